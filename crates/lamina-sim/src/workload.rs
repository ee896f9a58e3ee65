//! Workloads: streams of block writes and trims, from traces or generators.
//!
//! Every workload is a sequence of [`Op`]s on numbered volumes, in 4 KiB blocks.
//! Requests of any byte range are rounded out to whole blocks, as SepBIT's simulator
//! counts them. Generators are seeded: the same seed gives the same sequence.

use rand::{Rng, SeedableRng};
use rand_distr::Distribution;

/// One operation of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    pub volume: u32,
    pub lba: u64,
    pub blocks: u32,
    pub trim: bool,
}

/// A source of operations.
pub trait Workload {
    /// Next operation; `None` at the end.
    fn next_op(&mut self) -> Option<Op>;
}

/// An affine permutation of `0..n`: a pseudo-random bijection computed in O(1) with
/// no memory, used to scatter hot ranks over the volume (and to move the hot set).
#[derive(Clone, Copy, Debug)]
pub struct Permutation {
    n: u64,
    a: u64,
    b: u64,
}

impl Permutation {
    pub fn new(n: u64, rng: &mut impl Rng) -> Self {
        let n = n.max(1);
        // a must be coprime with n for a bijection.
        let mut a = rng.gen_range(1..n.max(2)) | 1;
        while gcd(a, n) != 1 {
            a = (a + 2) % n.max(2);
            if a == 0 {
                a = 1;
            }
        }
        Permutation {
            n,
            a,
            b: rng.gen_range(0..n),
        }
    }
    pub fn apply(&self, x: u64) -> u64 {
        ((x as u128 * self.a as u128 + self.b as u128) % self.n as u128) as u64
    }
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// Which addresses a synthetic workload writes.
#[derive(Clone, Debug, PartialEq)]
pub enum Pattern {
    Uniform,
    /// Zipf with exponent theta over all blocks (theta 0 is uniform).
    Zipf(f64),
    /// `hot` percent of writes go to `hot_space` percent of the blocks.
    HotCold {
        hot: f64,
        hot_space: f64,
    },
    Sequential,
    /// Sequential runs of 64 blocks from random places, and single-block Zipf(0.9)
    /// writes, half of the blocks each.
    Mixed,
    /// SepBIT's synthetic workload: Zipf(theta) whose hot set moves to other blocks
    /// every `period` writes.
    ZipfShifting {
        theta: f64,
        period: u64,
    },
}

impl Pattern {
    /// Parses `uniform`, `zipf:0.9`, `hotcold:90/10`, `sequential`, `mixed`,
    /// `sepbit-zipf:0.9[:PERIOD]`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "unknown workload {s:?} (uniform, zipf:THETA, hotcold:HOT/COLD, sequential, mixed, sepbit-zipf:THETA[:PERIOD])"
            )
        };
        let mut parts = s.split(':');
        let kind = parts.next().unwrap_or("");
        let num = |p: Option<&str>| -> Result<f64, String> {
            p.ok_or_else(bad)?.parse::<f64>().map_err(|_| bad())
        };
        let p = match kind {
            "uniform" => Pattern::Uniform,
            "sequential" => Pattern::Sequential,
            "mixed" => Pattern::Mixed,
            "zipf" => {
                let t = num(parts.next())?;
                if !(0.0..=5.0).contains(&t) {
                    return Err(format!("zipf exponent {t} must be between 0 and 5"));
                }
                Pattern::Zipf(t)
            }
            "sepbit-zipf" => {
                let theta = num(parts.next())?;
                let period = match parts.next() {
                    Some(p) => p.parse::<u64>().map_err(|_| bad())?,
                    None => 0,
                };
                Pattern::ZipfShifting { theta, period }
            }
            "hotcold" => {
                let spec = parts.next().ok_or_else(bad)?;
                let (h, c) = spec.split_once('/').ok_or_else(bad)?;
                let hot: f64 = h.parse().map_err(|_| bad())?;
                let cold: f64 = c.parse().map_err(|_| bad())?;
                if !(0.0..100.0).contains(&hot)
                    || !(0.0..100.0).contains(&cold)
                    || hot + cold != 100.0
                {
                    return Err(format!(
                        "hotcold:{spec}: write fraction and space fraction must be percentages that add up to 100 (e.g. 90/10)"
                    ));
                }
                Pattern::HotCold {
                    hot,
                    hot_space: cold,
                }
            }
            _ => return Err(bad()),
        };
        if parts.next().is_some() {
            return Err(bad());
        }
        Ok(p)
    }
}

/// A synthetic workload on one volume of `blocks` blocks: first a sequential fill of
/// every block (so overwrites start from a full volume), then `writes` single-block
/// writes drawn from the pattern.
pub struct Synthetic {
    pattern: Pattern,
    blocks: u64,
    fill_left: u64,
    fill_next: u64,
    writes_left: u64,
    rng: rand::rngs::SmallRng,
    zipf: Option<rand_distr::Zipf<f64>>,
    perm: Permutation,
    written: u64,
    seq: u64,
    run_left: u32,
    run_next: u64,
}

impl Synthetic {
    pub fn new(pattern: Pattern, blocks: u64, writes: u64, seed: u64, fill: bool) -> Self {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
        let theta = match pattern {
            Pattern::Zipf(t) | Pattern::ZipfShifting { theta: t, .. } => Some(t),
            Pattern::Mixed => Some(0.9),
            _ => None,
        };
        let zipf = theta
            .filter(|t| *t > 0.0)
            .map(|t| rand_distr::Zipf::new(blocks, t).expect("zipf parameters"));
        let perm = Permutation::new(blocks, &mut rng);
        Synthetic {
            pattern,
            blocks,
            fill_left: if fill { blocks } else { 0 },
            fill_next: 0,
            writes_left: writes,
            rng,
            zipf,
            perm,
            written: 0,
            seq: 0,
            run_left: 0,
            run_next: 0,
        }
    }

    fn zipf_block(&mut self) -> u64 {
        match &self.zipf {
            // Ranks 1..=n; rank 1 is the hottest. Scatter ranks over the volume.
            Some(z) => self.perm.apply(z.sample(&mut self.rng) as u64 - 1),
            None => self.rng.gen_range(0..self.blocks),
        }
    }
}

impl Workload for Synthetic {
    fn next_op(&mut self) -> Option<Op> {
        let op = |lba| Op {
            volume: 0,
            lba,
            blocks: 1,
            trim: false,
        };
        if self.fill_left > 0 {
            let n = self.fill_left.min(256);
            let o = Op {
                volume: 0,
                lba: self.fill_next,
                blocks: n as u32,
                trim: false,
            };
            self.fill_left -= n;
            self.fill_next += n;
            return Some(o);
        }
        if self.writes_left == 0 {
            return None;
        }
        self.writes_left -= 1;
        self.written += 1;
        let lba = match self.pattern.clone() {
            Pattern::Uniform => self.rng.gen_range(0..self.blocks),
            Pattern::Zipf(_) => self.zipf_block(),
            Pattern::ZipfShifting { period, .. } => {
                let period = if period == 0 { self.blocks } else { period };
                if self.written.is_multiple_of(period) {
                    self.perm = Permutation::new(self.blocks, &mut self.rng);
                }
                self.zipf_block()
            }
            Pattern::HotCold { hot, hot_space } => {
                let hot_blocks =
                    ((self.blocks as f64 * hot_space / 100.0) as u64).clamp(1, self.blocks - 1);
                let i = if self.rng.gen_bool(hot / 100.0) {
                    self.rng.gen_range(0..hot_blocks)
                } else {
                    self.rng.gen_range(hot_blocks..self.blocks)
                };
                self.perm.apply(i)
            }
            Pattern::Sequential => {
                let l = self.seq % self.blocks;
                self.seq += 1;
                l
            }
            Pattern::Mixed => {
                if self.run_left > 0 {
                    self.run_left -= 1;
                    self.run_next = (self.run_next + 1) % self.blocks;
                    self.run_next
                } else if self.rng.gen_bool(1.0 / 64.0) {
                    self.run_left = 63;
                    self.run_next = self.rng.gen_range(0..self.blocks);
                    self.run_next
                } else {
                    self.zipf_block()
                }
            }
        };
        Some(op(lba))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lbas(p: Pattern, n: u64, w: u64, seed: u64) -> Vec<u64> {
        let mut s = Synthetic::new(p, n, w, seed, false);
        std::iter::from_fn(|| s.next_op()).map(|o| o.lba).collect()
    }

    #[test]
    fn seeded_and_reproducible() {
        assert_eq!(
            lbas(Pattern::Zipf(0.9), 1000, 500, 3),
            lbas(Pattern::Zipf(0.9), 1000, 500, 3)
        );
        assert_ne!(
            lbas(Pattern::Zipf(0.9), 1000, 500, 3),
            lbas(Pattern::Zipf(0.9), 1000, 500, 4)
        );
    }

    #[test]
    fn fill_writes_every_block_once_first() {
        let mut s = Synthetic::new(Pattern::Uniform, 1000, 10, 1, true);
        let mut seen = vec![0u32; 1000];
        let mut fill_ops = 0;
        while let Some(o) = s.next_op() {
            if o.blocks > 1 || fill_ops < 4 {
                for l in o.lba..o.lba + o.blocks as u64 {
                    seen[l as usize] += 1;
                }
                fill_ops += 1;
            }
        }
        assert!(seen.iter().all(|&c| c >= 1));
    }

    #[test]
    fn hotcold_sends_the_right_share_to_the_hot_set() {
        let n = 10_000;
        let hot = Pattern::parse("hotcold:90/10").unwrap();
        let mut s = Synthetic::new(hot, n, 100_000, 9, false);
        let perm = s.perm;
        // The hot set is the image of ranks 0..1000 under the permutation.
        let hot_set: std::collections::HashSet<u64> = (0..1000).map(|i| perm.apply(i)).collect();
        let mut hits = 0;
        while let Some(o) = s.next_op() {
            hits += hot_set.contains(&o.lba) as u64;
        }
        let share = hits as f64 / 100_000.0;
        assert!((share - 0.9).abs() < 0.01, "hot share {share}");
    }

    #[test]
    fn zipf_is_skewed_and_uniform_is_not() {
        let count_top = |p: Pattern| {
            let v = lbas(p, 10_000, 50_000, 2);
            let mut c = std::collections::HashMap::new();
            for l in v {
                *c.entry(l).or_insert(0u64) += 1;
            }
            let mut counts: Vec<u64> = c.into_values().collect();
            counts.sort_unstable_by(|a, b| b.cmp(a));
            counts.iter().take(100).sum::<u64>() as f64 / 50_000.0
        };
        assert!(count_top(Pattern::Zipf(1.2)) > 0.5);
        assert!(count_top(Pattern::Uniform) < 0.05);
    }

    #[test]
    fn permutation_is_a_bijection() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        for n in [1u64, 2, 7, 1000, 4096] {
            let p = Permutation::new(n, &mut rng);
            let mut seen = vec![false; n as usize];
            for x in 0..n {
                let y = p.apply(x) as usize;
                assert!(!seen[y]);
                seen[y] = true;
            }
        }
    }

    #[test]
    fn parse_errors_are_clear() {
        assert!(Pattern::parse("zipf").is_err());
        assert!(Pattern::parse("hotcold:90/20")
            .unwrap_err()
            .contains("add up to 100"));
        assert!(Pattern::parse("bogus")
            .unwrap_err()
            .contains("unknown workload"));
        assert_eq!(
            Pattern::parse("sepbit-zipf:0.8:1000").unwrap(),
            Pattern::ZipfShifting {
                theta: 0.8,
                period: 1000
            }
        );
    }
}
