//! Victim selection for garbage collection.
//!
//! A policy chooses, among a volume's closed segments that have something to reclaim,
//! the one whose live blocks GC relocates next. Policies see only what the engine
//! tracks per segment (live blocks, capacity, ages, class, wear), so they are cheap.
//! Ages are in the volume's time: user blocks written to it.

use crate::types::Lba;
use rand::{Rng, SeedableRng};

/// What a policy knows about a candidate segment.
#[derive(Clone, Copy, Debug)]
pub struct Candidate {
    pub segment: u32,
    /// Live blocks in it.
    pub valid: u32,
    /// Data blocks it holds.
    pub capacity: u32,
    /// Time since it was closed: the age of its youngest data.
    pub age: u64,
    /// Time since one of its blocks last died: small while it is still being
    /// invalidated.
    pub idle: u64,
    pub erase_count: u32,
    /// Heat class of the stream that wrote it.
    pub class: u8,
    /// Written by users (true) or by GC relocations (false).
    pub user: bool,
}

impl Candidate {
    /// Utilisation u: fraction of the segment still live.
    pub fn utilisation(&self) -> f64 {
        self.valid as f64 / self.capacity.max(1) as f64
    }
    /// Blocks GC gains by collecting it.
    pub fn garbage(&self) -> u32 {
        self.capacity.saturating_sub(self.valid)
    }
}

/// What a policy may know about each heat class of the volume (indexed by class).
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassInfo {
    /// Live blocks in the class's segments.
    pub live: u64,
    /// Data blocks of the segments the class holds (closed and open).
    pub space: u64,
    /// Blocks written into the class so far (user writes or relocations).
    pub written: u64,
}

/// Where a policy wants GC to look (see [`VictimPolicy::scope`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Every class of the volume.
    All,
    /// One class.
    Class(u8),
    /// Nothing to collect.
    Nothing,
}

/// A victim selection policy.
///
/// The engine finds the best scoring candidate through an index (see
/// `victims.rs`) that relies on every score being **monotone**: a candidate with
/// fewer live blocks, or an older one (larger `age`, larger `idle`), or written
/// by users rather than by GC, never scores lower, other things equal.
pub trait VictimPolicy: Send {
    fn name(&self) -> &'static str;
    /// The name with what the policy does now, for `status` (its name by default).
    fn describe(&self) -> String {
        self.name().into()
    }
    /// Score of a candidate; higher is a better victim. Must be monotone (see the
    /// trait's documentation).
    fn score(&self, c: &Candidate) -> f64;
    /// The classes to collect in, knowing what each class of the volume holds and
    /// has received and the space available to it (`capacity`, data blocks);
    /// `collectable` says whether a class has a candidate. By default every class.
    fn scope(
        &mut self,
        _classes: &[ClassInfo],
        _capacity: u64,
        _collectable: &dyn Fn(u8) -> bool,
    ) -> Scope {
        Scope::All
    }
    /// Sampling policies choose here instead of by score, among `segments`
    /// segments: `candidate` gives a segment's candidate if it is one. `None`:
    /// choose by score.
    fn sample(
        &mut self,
        _segments: u32,
        _candidate: &mut dyn FnMut(u32) -> Option<Candidate>,
    ) -> Option<u32> {
        None
    }
    /// Told before each pick whether the volume's blocks sit apart by heat: it
    /// keeps more than one class open, or its segments hold blocks of several.
    fn separating(&mut self, _separating: bool) {}
    /// Told once, when the volume is attached, the blocks it can hold (its size,
    /// or the array's if smaller) and the data blocks of a segment.
    fn configure(&mut self, _volume_blocks: u64, _segment_blocks: u64) {}
    /// Told of every block a user writes to the volume (before it is placed).
    fn user_write(&mut self, _lba: Lba) {}
    /// Told of every mapped block a trim unmaps.
    fn trimmed(&mut self, _lba: Lba) {}
    /// What the policy has learnt, for the checkpoint (empty: nothing to keep).
    fn save(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Takes back what [`VictimPolicy::save`] gave, after a restart.
    fn restore(&mut self, _state: &[u8]) -> Result<(), String> {
        Ok(())
    }
}

/// Best scoring candidate, with wear-aware tie-breaking.
pub fn select_by_score(
    cands: &[Candidate],
    score: impl Fn(&Candidate) -> f64,
    wear_window: f64,
) -> Option<usize> {
    let mut best: Option<(f64, usize)> = None;
    for (i, c) in cands.iter().enumerate() {
        if c.garbage() == 0 {
            continue;
        }
        let s = score(c);
        if best.is_none_or(|(bs, _)| s > bs) {
            best = Some((s, i));
        }
    }
    let (bs, bi) = best?;
    if wear_window <= 0.0 {
        return Some(bi);
    }
    // Scores are made comparable as a fraction of the best one; greedy's score is
    // the garbage, so this is "within 10% of the most garbage" there.
    let floor = bs - bs.abs() * wear_window;
    let mut pick = bi;
    for (i, c) in cands.iter().enumerate() {
        if c.garbage() > 0 && score(c) >= floor && c.erase_count < cands[pick].erase_count {
            pick = i;
        }
    }
    Some(pick)
}

/// Greedy: the segment with the most garbage (fewest live blocks). Optimal for
/// uniform random overwrites; no policy can beat it there.
pub struct Greedy;

impl VictimPolicy for Greedy {
    fn name(&self) -> &'static str {
        "greedy"
    }
    fn score(&self, c: &Candidate) -> f64 {
        c.garbage() as f64
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

/// Cost-benefit as SepBIT's simulator scores it: GP / (1 - GP) x sqrt(age), with GP
/// the garbage proportion.
pub struct CostBenefitSqrt;

impl VictimPolicy for CostBenefitSqrt {
    fn name(&self) -> &'static str {
        "cost-benefit-sqrt"
    }
    fn score(&self, c: &Candidate) -> f64 {
        let gp = 1.0 - c.utilisation();
        let denom = (1.0 - gp).max(1e-9);
        gp / denom * (c.age as f64 + 1.0).sqrt()
    }
}

/// The default: cost-benefit with sqrt(age) while the volume's classes separate
/// blocks by heat (SepBIT's pairing); otherwise, with everything in one stream,
/// greedy or cost-benefit, whichever moved fewer blocks lately in a miniature of
/// the volume (`shadow.rs`), greedy until the miniature knows.
#[derive(Default)]
pub struct Auto {
    /// GC has picked in the volume (and told `separating`).
    picked: bool,
    separating: bool,
    /// The policy the miniature found better in one stream (`shadow::GREEDY` or
    /// `shadow::COST_BENEFIT`).
    follow: usize,
    shadow: Option<crate::shadow::Shadow>,
}

impl Auto {
    fn cost_benefit(&self) -> bool {
        self.separating || self.follow == crate::shadow::COST_BENEFIT
    }
}

impl VictimPolicy for Auto {
    fn name(&self) -> &'static str {
        "auto"
    }
    /// "auto (cost-benefit-sqrt: classes apart)", "auto (greedy: one stream)", ...;
    /// "auto" until GC has picked a victim in the volume.
    fn describe(&self) -> String {
        if !self.picked {
            return "auto".into();
        }
        let now = if self.cost_benefit() {
            "cost-benefit-sqrt"
        } else {
            "greedy"
        };
        let why = if self.separating {
            "classes apart"
        } else {
            "one stream"
        };
        format!("auto ({now}: {why})")
    }
    fn score(&self, c: &Candidate) -> f64 {
        // Both scores are monotone, so the victim index's bounds hold for either.
        if self.cost_benefit() {
            CostBenefitSqrt.score(c)
        } else {
            Greedy.score(c)
        }
    }
    fn configure(&mut self, volume_blocks: u64, segment_blocks: u64) {
        self.shadow = Some(crate::shadow::Shadow::new(volume_blocks, segment_blocks));
    }
    fn user_write(&mut self, lba: Lba) {
        if let Some(s) = &mut self.shadow {
            s.write(lba.0);
        }
    }
    fn trimmed(&mut self, lba: Lba) {
        if let Some(s) = &mut self.shadow {
            s.trim(lba.0);
        }
    }
    fn scope(
        &mut self,
        _classes: &[ClassInfo],
        capacity: u64,
        _collectable: &dyn Fn(u8) -> bool,
    ) -> Scope {
        if let Some(s) = &mut self.shadow {
            s.set_capacity(capacity);
            if let Some(k) = s.better() {
                self.follow = k;
            }
        }
        Scope::All
    }
    fn separating(&mut self, separating: bool) {
        self.picked = true;
        self.separating = separating;
    }
    /// The policy followed in one stream: the miniature starts empty after a
    /// restart, and without this the volume would collect greedily until it has
    /// learnt again.
    fn save(&self) -> Vec<u8> {
        vec![AUTO_STATE_VERSION, self.follow as u8]
    }
    fn restore(&mut self, state: &[u8]) -> Result<(), String> {
        match *state {
            [AUTO_STATE_VERSION, f] if f as usize <= crate::shadow::COST_BENEFIT => {
                self.follow = f as usize;
                Ok(())
            }
            [v, ..] if v != AUTO_STATE_VERSION => Err(format!("auto policy state version {v}")),
            _ => Err(format!("auto policy state damaged ({} bytes)", state.len())),
        }
    }
}

/// Encoded state of the `auto` policy: a version byte, then the policy followed.
const AUTO_STATE_VERSION: u8 = 1;

/// d-choices: greedy among `d` candidates drawn at random (cheap on huge arrays;
/// close to greedy for large d).
pub struct DChoices {
    d: usize,
    rng: rand::rngs::SmallRng,
}

impl DChoices {
    pub fn new(d: usize, seed: u64) -> Self {
        DChoices {
            d: d.max(1),
            rng: rand::rngs::SmallRng::seed_from_u64(seed),
        }
    }
}

impl VictimPolicy for DChoices {
    fn name(&self) -> &'static str {
        "d-choices"
    }
    fn score(&self, c: &Candidate) -> f64 {
        c.garbage() as f64
    }
    /// Greedy among `d` candidates drawn at random from the segments (`d x 64`
    /// draws at most: a volume holding few of them falls back to greedy).
    fn sample(
        &mut self,
        segments: u32,
        candidate: &mut dyn FnMut(u32) -> Option<Candidate>,
    ) -> Option<u32> {
        let mut best: Option<Candidate> = None;
        let mut found = 0;
        for _ in 0..self.d * 64 {
            if found == self.d || segments == 0 {
                break;
            }
            let Some(c) = candidate(self.rng.gen_range(0..segments)) else {
                continue;
            };
            found += 1;
            if c.garbage() > 0 && best.is_none_or(|b| c.garbage() > b.garbage()) {
                best = Some(c);
            }
        }
        best.map(|c| c.segment)
    }
}

/// SALSA's ideas (2.4): take the logical origin, the age and the update pattern of
/// the data into account, and do not break up data that tends to be overwritten
/// together. A segment whose blocks are still dying (recently invalidated) is left
/// alone: the pattern that is emptying it will likely finish the job for free. The
/// benefit is cost-benefit's (1 - u) / (1 + u), weighted by how long the segment
/// has been quiet (its "idle" time) rather than by its age, and segments written by
/// GC (origin: old, cold data) must be quiet longer to be worth moving again.
pub struct Salsa;

impl VictimPolicy for Salsa {
    fn name(&self) -> &'static str {
        "salsa"
    }
    fn score(&self, c: &Candidate) -> f64 {
        let u = c.utilisation();
        let quiet = c.idle.min(c.age) as f64 + 1.0;
        let origin = if c.user { 1.0 } else { 0.5 };
        origin * quiet * (1.0 - u) / (1.0 + u)
    }
}

/// Lamina's policy: every heat class gets the share of the spare space that
/// minimises total cleaning work, and GC collects (greedily) in the class that holds
/// the most space beyond its share.
///
/// Why: for greedy cleaning of a class with live data L and spare space S, the victims
/// hold about 1 - 2S/L live data when S is small, so freeing a block costs about
/// L / 2S relocations. A class written at rate w therefore costs w L / 2S; minimising
/// the sum over classes with the total spare fixed gives S_i proportional to
/// sqrt(w_i L_i) (the square-root rule). Hot classes (high w, small L) and cold ones
/// (low w, large L) thus get the spare that makes their cleaning cheap overall,
/// instead of one global greedy pool that cleans every class at the same victim
/// utilisation. Write rates are measured as moving averages of what each class
/// received since the previous choice. On uniform traffic every class has the same
/// w per block, the shares are proportional to L, and it is greedy.
#[derive(Default)]
pub struct Lamina {
    last_written: Vec<u64>,
    rate: Vec<f64>,
}

impl Lamina {
    /// Target space of each class for the current rates.
    pub fn targets(&self, classes: &[ClassInfo], capacity: u64) -> Vec<f64> {
        let live: u64 = classes.iter().map(|c| c.live).sum();
        let spare = capacity.saturating_sub(live) as f64;
        let weights: Vec<f64> = classes
            .iter()
            .zip(&self.rate)
            .map(|(c, &w)| (w * c.live as f64).sqrt())
            .collect();
        let total: f64 = weights.iter().sum();
        classes
            .iter()
            .zip(&weights)
            .map(|(c, &wt)| {
                let share = if total > 0.0 {
                    wt / total
                } else {
                    1.0 / classes.len() as f64
                };
                c.live as f64 + spare * share
            })
            .collect()
    }
}

impl VictimPolicy for Lamina {
    fn name(&self) -> &'static str {
        "lamina"
    }
    fn score(&self, c: &Candidate) -> f64 {
        c.garbage() as f64
    }
    fn scope(
        &mut self,
        classes: &[ClassInfo],
        capacity: u64,
        collectable: &dyn Fn(u8) -> bool,
    ) -> Scope {
        if self.rate.len() != classes.len() {
            self.rate = vec![0.0; classes.len()];
            self.last_written = classes.iter().map(|c| c.written).collect();
        }
        // Moving average of the blocks each class received since the last choice.
        for (i, c) in classes.iter().enumerate() {
            let delta = c.written.saturating_sub(self.last_written[i]) as f64;
            self.last_written[i] = c.written;
            self.rate[i] = 0.98 * self.rate[i] + 0.02 * delta;
        }
        let targets = self.targets(classes, capacity);
        // The class furthest above its share, among those with something to collect.
        let mut best: Option<(f64, u8)> = None;
        for (k, c) in classes.iter().enumerate() {
            let excess = c.space as f64 - targets[k];
            if best.is_none_or(|(e, _)| excess > e) && collectable(k as u8) {
                best = Some((excess, k as u8));
            }
        }
        best.map_or(Scope::Nothing, |(_, k)| Scope::Class(k))
    }
}

/// Names accepted by [`policy_by_name`].
pub const POLICY_NAMES: &[&str] = &[
    "auto",
    "greedy",
    "cost-benefit",
    "cost-benefit-sqrt",
    "d-choices",
    "salsa",
    "lamina",
];

/// Builds a policy by name.
pub fn policy_by_name(name: &str) -> Option<Box<dyn VictimPolicy>> {
    Some(match name {
        "auto" => Box::new(Auto::default()),
        "greedy" => Box::new(Greedy),
        "cost-benefit" => Box::new(CostBenefit),
        "cost-benefit-sqrt" => Box::new(CostBenefitSqrt),
        "d-choices" => Box::new(DChoices::new(10, 0x5eed)),
        "salsa" => Box::new(Salsa),
        "lamina" => Box::new(Lamina::default()),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_says_what_it_does_and_keeps_its_choice() {
        let mut a = Auto::default();
        assert_eq!(a.describe(), "auto", "nothing picked yet");
        a.separating(true);
        assert_eq!(a.describe(), "auto (cost-benefit-sqrt: classes apart)");
        a.separating(false);
        assert_eq!(a.describe(), "auto (greedy: one stream)");
        a.follow = crate::shadow::COST_BENEFIT;
        let state = a.save();
        let mut b = Auto::default();
        b.restore(&state).unwrap();
        b.separating(false);
        assert_eq!(b.describe(), "auto (cost-benefit-sqrt: one stream)");
        for bad in [&[][..], &[1], &[1, 2], &[2, 0], &[1, 0, 0]] {
            assert!(b.restore(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            b.follow,
            crate::shadow::COST_BENEFIT,
            "a bad state changes nothing"
        );
    }

    fn cand(segment: u32, valid: u32, age: u64) -> Candidate {
        Candidate {
            segment,
            valid,
            capacity: 100,
            age,
            idle: age,
            erase_count: 0,
            class: 0,
            user: true,
        }
    }

    fn pick(p: &mut dyn VictimPolicy, cs: &[Candidate]) -> u32 {
        cs[select_by_score(cs, |c| p.score(c), 0.0).unwrap()].segment
    }

    /// Every policy's score is monotone (what the victim index relies on): fewer
    /// live blocks, more age or idle time, or user origin never score lower.
    #[test]
    fn scores_are_monotone() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::SmallRng::seed_from_u64(5);
        for name in POLICY_NAMES {
            let p = policy_by_name(name).unwrap();
            for _ in 0..20_000 {
                let cap = rng.gen_range(1..5000);
                let mut c = cand(0, rng.gen_range(0..=cap), rng.gen_range(0..1 << 40));
                c.capacity = cap;
                c.idle = rng.gen_range(0..=c.age + 1000);
                c.user = rng.gen();
                let s = p.score(&c);
                let mut d = c;
                d.valid = rng.gen_range(0..=c.valid);
                d.age += rng.gen_range(0..1 << 20);
                d.idle += rng.gen_range(0..1 << 20);
                d.user |= rng.gen::<bool>();
                assert!(p.score(&d) >= s, "{name}: {d:?} scores below {c:?}");
            }
        }
    }

    /// The square-root rule: spare space in proportion to sqrt(rate x live).
    #[test]
    fn lamina_splits_spare_by_the_square_root_rule() {
        let mut p = Lamina::default();
        let info = |live, space, written| ClassInfo {
            live,
            space,
            written,
        };
        // Class 0 receives 4 times class 1's writes; equal live data.
        let mut classes = [info(1000, 1200, 0), info(1000, 1200, 0)];
        for round in 1..=400u64 {
            classes[0].written = 400 * round;
            classes[1].written = 100 * round;
            p.scope(&classes, 3000, &|_| true);
        }
        let t = p.targets(&classes, 3000);
        let (s0, s1) = (t[0] - 1000.0, t[1] - 1000.0);
        assert!((s0 / s1 - 2.0).abs() < 0.05, "spares {s0} {s1}: want 2:1");
        assert!((s0 + s1 - 1000.0).abs() < 1e-6);
        // Targets are about 1667 (class 0) and 1333 (class 1): GC collects in the
        // class holding the most beyond its target.
        classes[1].space = 1500;
        let s = p.scope(&classes, 3000, &|_| true);
        assert_eq!(s, Scope::Class(1), "collect in the class above its share");
        // Unless it has nothing to collect.
        assert_eq!(p.scope(&classes, 3000, &|k| k == 0), Scope::Class(0));
        assert_eq!(p.scope(&classes, 3000, &|_| false), Scope::Nothing);
        classes[1].space = 1200;
        classes[0].space = 1900;
        assert_eq!(p.scope(&classes, 3000, &|_| true), Scope::Class(0));
    }

    #[test]
    fn greedy_takes_emptiest() {
        let cs = [cand(1, 90, 1000), cand(2, 10, 1), cand(3, 50, 50)];
        assert_eq!(pick(&mut Greedy, &cs), 2);
    }

    #[test]
    fn cost_benefit_prefers_old_cold_segments() {
        // 60% live but very old beats 40% live and young.
        let cs = [cand(1, 60, 100_000), cand(2, 40, 10)];
        assert_eq!(pick(&mut CostBenefit, &cs), 1);
        // At equal age it degenerates to greedy.
        let cs = [cand(1, 60, 100), cand(2, 40, 100)];
        assert_eq!(pick(&mut CostBenefit, &cs), 2);
        assert_eq!(pick(&mut CostBenefitSqrt, &cs), 2);
        // sqrt(age) weighs age less than age does.
        let cs = [cand(1, 60, 1000), cand(2, 30, 100)];
        assert_eq!(pick(&mut CostBenefit, &cs), 1);
        assert_eq!(pick(&mut CostBenefitSqrt, &cs), 2);
    }

    #[test]
    fn full_segments_are_never_victims() {
        let cs = [cand(1, 100, 5)];
        assert!(select_by_score(&cs, |c| Greedy.score(c), 0.1).is_none());
        assert!(DChoices::new(4, 1)
            .sample(1, &mut |_| Some(cs[0]))
            .is_none());
    }

    #[test]
    fn d_choices_samples_and_prefers_garbage() {
        let mut cs: Vec<_> = (0..100).map(|i| cand(i, 90, 0)).collect();
        cs[42].valid = 0;
        // Odd segments are not candidates.
        let sample = |d: &mut DChoices| {
            d.sample(100, &mut |i| (i % 2 == 0).then(|| cs[i as usize]))
                .unwrap()
        };
        let mut d = DChoices::new(1000, 7);
        assert_eq!(sample(&mut d), 42, "with d much larger than n it is greedy");
        let mut d1 = DChoices::new(1, 7);
        let picks: std::collections::HashSet<u32> = (0..50).map(|_| sample(&mut d1)).collect();
        assert!(picks.len() > 5, "with d = 1 it samples");
        assert!(picks.iter().all(|p| p % 2 == 0), "only candidates");
    }

    #[test]
    fn salsa_leaves_dying_segments_alone() {
        // Same utilisation; one was invalidated a moment ago, the other long ago.
        let mut dying = cand(1, 50, 1000);
        dying.idle = 1;
        let quiet = cand(2, 50, 1000);
        assert_eq!(pick(&mut Salsa, &[dying, quiet]), 2);
        // Relocated (GC-origin) data must be quieter to be worth moving again.
        let mut gc_seg = cand(3, 50, 1000);
        gc_seg.user = false;
        assert_eq!(pick(&mut Salsa, &[gc_seg, cand(4, 50, 1000)]), 4);
    }

    #[test]
    fn wear_aware_tie_breaking() {
        let mut a = cand(1, 10, 5);
        a.erase_count = 50;
        let mut b = cand(2, 14, 5);
        b.erase_count = 3;
        let c = cand(3, 40, 5);
        // Garbage 90 vs 86: within 10% of the best, the less erased wins.
        let greedy = |cs: &[Candidate], w| {
            select_by_score(cs, |c| Greedy.score(c), w).map(|i| cs[i].segment)
        };
        assert_eq!(greedy(&[a, b, c], 0.10), Some(2));
        assert_eq!(greedy(&[a, b, c], 0.0), Some(1));
        // Outside the window the better score still wins.
        let mut far = cand(4, 60, 5);
        far.erase_count = 0;
        assert_eq!(greedy(&[a, far], 0.10), Some(1));
    }
}
