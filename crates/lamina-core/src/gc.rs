//! Victim selection for garbage collection.
//!
//! A policy scores each closed segment that has something to reclaim; the engine
//! relocates the live blocks of the best-scoring one. Policies see only what the
//! engine tracks per segment (valid blocks, capacity, age, wear) so they are cheap.

/// What a policy knows about a candidate segment.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub segment: u32,
    /// Live blocks in it.
    pub valid: u32,
    /// Data blocks it holds when full.
    pub capacity: u32,
    /// Versions since it was closed: its age, in the engine's logical time.
    pub age: u64,
    pub erase_count: u32,
}

impl Candidate {
    /// Utilisation u: fraction of the segment still live.
    pub fn utilisation(&self) -> f64 {
        self.valid as f64 / self.capacity.max(1) as f64
    }
}

/// A victim selection policy. Higher scores are better victims.
pub trait VictimPolicy: Send {
    fn name(&self) -> &'static str;
    fn score(&self, c: &Candidate) -> f64;
}

/// Greedy: the segment with the fewest live blocks (the most to reclaim per block
/// moved). Optimal for uniform random overwrites.
pub struct Greedy;

impl VictimPolicy for Greedy {
    fn name(&self) -> &'static str {
        "greedy"
    }
    fn score(&self, c: &Candidate) -> f64 {
        (c.capacity.saturating_sub(c.valid)) as f64
    }
}

/// Cost-benefit (Rosenblum & Ousterhout, LFS): age x (1 - u) / (1 + u). Prefers old
/// segments, whose remaining data is likely cold, even when they are fuller.
pub struct CostBenefit;

impl VictimPolicy for CostBenefit {
    fn name(&self) -> &'static str {
        "cost-benefit"
    }
    fn score(&self, c: &Candidate) -> f64 {
        let u = c.utilisation();
        (c.age as f64 + 1.0) * (1.0 - u) / (1.0 + u)
    }
}

/// Builds a policy by name.
pub fn policy_by_name(name: &str) -> Option<Box<dyn VictimPolicy>> {
    match name {
        "greedy" => Some(Box::new(Greedy)),
        "cost-benefit" => Some(Box::new(CostBenefit)),
        _ => None,
    }
}

/// Names accepted by [`policy_by_name`].
pub const POLICY_NAMES: &[&str] = &["greedy", "cost-benefit"];

/// Picks the best-scoring candidate.
pub fn select(
    policy: &dyn VictimPolicy,
    candidates: impl Iterator<Item = Candidate>,
) -> Option<Candidate> {
    let mut best: Option<(f64, Candidate)> = None;
    for c in candidates {
        if c.valid >= c.capacity {
            continue;
        }
        let s = policy.score(&c);
        if best.as_ref().is_none_or(|(bs, _)| s > *bs) {
            best = Some((s, c));
        }
    }
    best.map(|(_, c)| c)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cand(segment: u32, valid: u32, age: u64) -> Candidate {
        Candidate {
            segment,
            valid,
            capacity: 100,
            age,
            erase_count: 0,
        }
    }

    #[test]
    fn greedy_takes_emptiest() {
        let cs = [cand(1, 90, 1000), cand(2, 10, 1), cand(3, 50, 50)];
        assert_eq!(select(&Greedy, cs.into_iter()).unwrap().segment, 2);
    }

    #[test]
    fn cost_benefit_prefers_old_cold_segments() {
        // 60% live but very old beats 40% live and young.
        let cs = [cand(1, 60, 100_000), cand(2, 40, 10)];
        assert_eq!(select(&CostBenefit, cs.into_iter()).unwrap().segment, 1);
        // At equal age it degenerates to greedy.
        let cs = [cand(1, 60, 100), cand(2, 40, 100)];
        assert_eq!(select(&CostBenefit, cs.into_iter()).unwrap().segment, 2);
    }

    #[test]
    fn full_segments_are_never_victims() {
        let cs = [cand(1, 100, 5)];
        assert!(select(&Greedy, cs.into_iter()).is_none());
    }
}
