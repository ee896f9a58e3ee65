//! A miniature of one volume's log, to choose its GC victim policy online.
//!
//! No victim policy is best everywhere. Cost-benefit (with sqrt(age), SepBIT's)
//! waits for young segments to die further and collects old ones that are fuller:
//! on hot/cold traffic in one stream it writes a third less than greedy
//! (`bench/placement.sh`, 90/10 at 7% spare: 4.93 against 7.65). Where age says
//! little of what is left to die (the P2P download and Windows boot traces), the
//! same waiting costs 0.5-2% over greedy, which takes the emptiest segment. Which
//! one a volume's traffic favours is not known in advance and may change.
//!
//! So the default policy (`auto`, in `gc.rs`) runs both on a miniature of the
//! volume, as miniature simulations of caches do (Waldspurger et al., ATC'17): the
//! blocks whose address hashes into a 2^-shift sample are written into two small
//! logs, one collected greedily and one by cost-benefit, each with segments and a
//! capacity scaled by the same rate, and the volume follows whichever of the two
//! moved fewer blocks lately. A uniformly sampled subset of addresses sees the same
//! overwrite pattern as the whole, so each miniature's write amplification tracks
//! what its policy would do on the full log.
//!
//! Cost: a user block that is not sampled costs one multiplication. Memory
//! follows the sampled blocks written: at most twice [`MAX_SAMPLES`] of them are
//! tracked (a volume grown after the miniature was sized samples more addresses;
//! past that bound new ones are left out), and each costs about 17 bytes in the map
//! plus up to 16 bytes of segment slots per log, about 2.5 MiB per volume at most.
//! Work per sampled block is bounded too: a log collects at most
//! [`VICTIMS_PER_WRITE`] segments per write, and only segments with at least
//! 1/[`MIN_GARBAGE`] of their blocks dead (a miniature whose capacity leaves no
//! such segment runs over its capacity instead of moving a whole segment per
//! write). Trims are replayed; the miniature starts empty at every start of the
//! engine.

use crate::gc::{Candidate, CostBenefitSqrt, Greedy, VictimPolicy};
use std::collections::HashMap;

/// Sampled blocks a volume's miniature holds at most: volumes larger than this
/// many blocks are sampled at 2^-shift, the smallest power that fits.
pub const MAX_SAMPLES: u64 = 1 << 15;
/// Miniature segments hold at least this many blocks.
const MIN_SEGMENT: u32 = 16;
/// Miniature segments kept free beside the open user and GC segments.
const RESERVE: usize = 2;
/// Segments a log collects at most per user write.
const VICTIMS_PER_WRITE: usize = 2;
/// A victim must have at least 1/MIN_GARBAGE of its blocks dead.
const MIN_GARBAGE: u32 = 16;
/// One log must move this fraction fewer blocks than the other to be followed.
const MARGIN: f64 = 0.005;
/// ... and by this many square roots of its count of moves.
const NOISE: f64 = 3.0;
/// No mapping.
const NONE: u32 = u32::MAX;

/// The miniatures' policies, in the order of [`Shadow::moved`].
pub const GREEDY: usize = 0;
pub const COST_BENEFIT: usize = 1;

struct Seg {
    /// Sampled addresses in the order they were written (`pos` in the miniature's
    /// block address `seg * seg_blocks + pos`).
    blocks: Vec<u64>,
    live: u32,
    closed_at: u64,
}

/// One miniature log, collected by one policy.
struct Log {
    segs: Vec<Seg>,
    free: Vec<u32>,
    open: u32,
    open_gc: u32,
    /// Closed segments (candidates).
    closed: Vec<u32>,
    /// Blocks written by users and moved by GC, halved every window.
    user: f64,
    moved: f64,
}

pub struct Shadow {
    shift: u32,
    seg_blocks: u32,
    /// Miniature segments each log may hold: the volume's share of the array as
    /// the engine last said, at most `limit`.
    capacity: usize,
    /// Segments for twice the blocks the volume can hold: the capacity until the
    /// engine says (its GC has not run), and at most what it says. A volume with
    /// more spare than that (a small volume on a large array) rarely needs GC, and
    /// a miniature as large as the array would make memory follow the array's
    /// size instead of the volume's.
    limit: usize,
    /// Per sampled address, its miniature block address in each log.
    map: HashMap<u64, [u32; 2], crate::placement::PageHash>,
    logs: [Log; 2],
    /// Sampled user writes so far (the miniatures' clock).
    clock: u64,
    /// Sampled user writes between two halvings of the counts.
    window: u64,
}

impl Shadow {
    /// A miniature of a volume of `volume_blocks` blocks on segments of
    /// `segment_blocks` data blocks.
    pub fn new(volume_blocks: u64, segment_blocks: u64) -> Shadow {
        let mut shift = 0;
        while volume_blocks >> shift > MAX_SAMPLES {
            shift += 1;
        }
        let seg_blocks = ((segment_blocks >> shift) as u32).max(MIN_SEGMENT);
        let limit =
            (2 * (volume_blocks >> shift)).div_ceil(seg_blocks as u64) as usize + RESERVE + 2;
        let log = || Log {
            segs: Vec::new(),
            free: Vec::new(),
            open: NONE,
            open_gc: NONE,
            closed: Vec::new(),
            user: 0.0,
            moved: 0.0,
        };
        Shadow {
            shift,
            seg_blocks,
            capacity: limit,
            limit,
            map: HashMap::default(),
            logs: [log(), log()],
            clock: 0,
            window: 4 * MAX_SAMPLES.min(volume_blocks.max(1)),
        }
    }

    /// Whether the miniature samples address `lba`: the top `shift` bits of a mix
    /// of it are zero (another mix than the map's hash, which would otherwise see
    /// only keys with equal top bits).
    #[inline]
    fn sampled(&self, lba: u64) -> bool {
        let h = (lba ^ (lba >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        self.shift == 0 || h >> (64 - self.shift) == 0
    }

    /// Tells the miniature the data blocks the volume may use (its segments plus
    /// the free ones): its logs get the same share of their own segments, never
    /// fewer than its live blocks need.
    pub fn set_capacity(&mut self, blocks: u64) {
        let segs = (blocks >> self.shift) / self.seg_blocks as u64;
        let needed = (self.map.len() as u64).div_ceil(self.seg_blocks as u64) + RESERVE as u64 + 2;
        self.capacity = segs.min(self.limit as u64).max(needed) as usize;
    }

    /// A user write of block `lba`.
    pub fn write(&mut self, lba: u64) {
        if !self.sampled(lba) {
            return;
        }
        self.clock += 1;
        if self.clock.is_multiple_of(self.window) {
            for l in &mut self.logs {
                l.user /= 2.0;
                l.moved /= 2.0;
            }
        }
        let full = self.map.len() as u64 >= 2 * MAX_SAMPLES;
        let addrs = match self.map.entry(lba) {
            std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
            // A volume grown since the miniature was sized: past twice its samples,
            // new addresses are left out.
            std::collections::hash_map::Entry::Vacant(_) if full => return,
            std::collections::hash_map::Entry::Vacant(v) => v.insert([NONE; 2]),
        };
        for (k, log) in self.logs.iter_mut().enumerate() {
            log.user += 1.0;
            addrs[k] = log.append(lba, addrs[k], false, self.seg_blocks, self.clock);
        }
        for k in 0..2 {
            self.collect(k);
        }
    }

    /// A trim unmapped block `lba`: it is dead in both logs.
    pub fn trim(&mut self, lba: u64) {
        if !self.sampled(lba) {
            return;
        }
        if let Some(old) = self.map.remove(&lba) {
            for (k, log) in self.logs.iter_mut().enumerate() {
                log.kill(old[k], self.seg_blocks);
            }
        }
    }

    /// Blocks moved per block written by users in miniature `k`, lately.
    #[cfg(test)]
    pub fn moved(&self, k: usize) -> f64 {
        self.logs[k].moved / self.logs[k].user.max(1.0)
    }

    /// The miniature whose policy moved fewer blocks by more than the margin, if
    /// either did.
    pub fn better(&self) -> Option<usize> {
        let (g, c) = (self.logs[GREEDY].moved, self.logs[COST_BENEFIT].moved);
        // Moves are counts: a difference within a few standard deviations of a
        // count (its square root) is chance, as when GC has only begun.
        let clear = (g - c).abs() > NOISE * g.max(c).sqrt();
        if c < g * (1.0 - MARGIN) && clear {
            Some(COST_BENEFIT)
        } else if g < c * (1.0 - MARGIN) && clear {
            Some(GREEDY)
        } else {
            None
        }
    }

    /// Collects in miniature `k` while it holds more segments than its capacity
    /// leaves room for.
    fn collect(&mut self, k: usize) {
        let (seg_blocks, clock) = (self.seg_blocks, self.clock);
        for _ in 0..VICTIMS_PER_WRITE {
            let log = &mut self.logs[k];
            if log.segs.len() - log.free.len() + RESERVE <= self.capacity {
                return;
            }
            let Some(i) = log.victim(k, seg_blocks, clock) else {
                return;
            };
            let victim = log.closed.swap_remove(i);
            let mut blocks = std::mem::take(&mut log.segs[victim as usize].blocks);
            for (pos, &lba) in blocks.iter().enumerate() {
                let addr = victim * seg_blocks + pos as u32;
                // Trimmed blocks are no longer mapped.
                let Some(entry) = self.map.get_mut(&lba) else {
                    continue;
                };
                if entry[k] == addr {
                    let log = &mut self.logs[k];
                    log.moved += 1.0;
                    entry[k] = log.append(lba, addr, true, seg_blocks, clock);
                }
            }
            let log = &mut self.logs[k];
            blocks.clear();
            let s = &mut log.segs[victim as usize];
            debug_assert_eq!(s.live, 0, "every live block was moved");
            s.blocks = blocks;
            log.free.push(victim);
        }
    }
}

impl Log {
    /// The copy at miniature address `addr` died.
    fn kill(&mut self, addr: u32, seg_blocks: u32) {
        let s = &mut self.segs[(addr / seg_blocks) as usize];
        debug_assert!(s.live > 0);
        s.live -= 1;
    }

    /// Writes `lba` (mapped at `old`, or `NONE`) into the open user or GC segment
    /// and returns its new miniature address.
    fn append(&mut self, lba: u64, old: u32, gc: bool, seg_blocks: u32, clock: u64) -> u32 {
        if old != NONE {
            self.kill(old, seg_blocks);
        }
        let open = if gc { self.open_gc } else { self.open };
        let open = if open == NONE || self.segs[open as usize].blocks.len() as u32 == seg_blocks {
            if open != NONE {
                self.segs[open as usize].closed_at = clock;
                self.closed.push(open);
            }
            let fresh = self.free.pop().unwrap_or_else(|| {
                self.segs.push(Seg {
                    blocks: Vec::with_capacity(seg_blocks as usize),
                    live: 0,
                    closed_at: 0,
                });
                self.segs.len() as u32 - 1
            });
            if gc {
                self.open_gc = fresh;
            } else {
                self.open = fresh;
            }
            fresh
        } else {
            open
        };
        let s = &mut self.segs[open as usize];
        s.blocks.push(lba);
        s.live += 1;
        open * seg_blocks + s.blocks.len() as u32 - 1
    }

    /// Index in `closed` of the candidate miniature `k`'s policy picks: the best
    /// score, the oldest among equals (as the victim index breaks ties).
    fn victim(&self, k: usize, seg_blocks: u32, clock: u64) -> Option<usize> {
        let policy: &dyn VictimPolicy = if k == GREEDY {
            &Greedy
        } else {
            &CostBenefitSqrt
        };
        let mut best: Option<(f64, u64, usize)> = None;
        for (i, &seg) in self.closed.iter().enumerate() {
            let s = &self.segs[seg as usize];
            if seg_blocks - s.live < (seg_blocks / MIN_GARBAGE).max(1) {
                continue;
            }
            let age = clock - s.closed_at;
            let score = policy.score(&Candidate {
                segment: seg,
                valid: s.live,
                capacity: seg_blocks,
                age,
                idle: age,
                erase_count: 0,
                class: 0,
                user: true,
            });
            if best.is_none_or(|(b, a, _)| score > b || (score == b && age > a)) {
                best = Some((score, age, i));
            }
        }
        best.map(|(_, _, i)| i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Overwrites of a 128k-block volume (8 MiB segments, 25% spare: 80 miniature
    /// segments of 512 blocks), 90% of them to a tenth of the blocks when `hot`,
    /// else uniform.
    fn run(hot: bool) -> Shadow {
        let blocks = 1u64 << 17;
        let mut s = Shadow::new(blocks, 2048);
        s.set_capacity(blocks * 5 / 4);
        let addrs: Vec<u64> = (0..blocks).collect();
        overwrite(&mut s, &addrs, 6, hot);
        s
    }

    /// Every sampled address of a volume of `blocks` blocks, in address order.
    fn sampled_addresses(s: &Shadow, blocks: u64) -> Vec<u64> {
        (0..blocks).filter(|&l| s.sampled(l)).collect()
    }

    /// Writes the addresses once, then `rounds` times their number of overwrites:
    /// 90% of them to the first tenth when `hot`, else uniform.
    fn overwrite(s: &mut Shadow, addrs: &[u64], rounds: usize, hot: bool) {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(11);
        for &a in addrs {
            s.write(a);
        }
        for _ in 0..rounds * addrs.len() {
            let i = if hot && rng.gen_bool(0.9) {
                rng.gen_range(0..addrs.len() / 10)
            } else {
                rng.gen_range(0..addrs.len())
            };
            s.write(addrs[i]);
        }
    }

    #[test]
    fn a_volume_of_a_few_segments_does_not_move_a_segment_per_write() {
        // 16 MiB on 8 MiB segments: two segments of data, every block sampled.
        let mut s = Shadow::new(4096, 2048);
        s.set_capacity(4096 * 5 / 4);
        let addrs: Vec<u64> = (0..4096).collect();
        overwrite(&mut s, &addrs, 20, false);
        for k in [GREEDY, COST_BENEFIT] {
            let per_write = s.logs[k].moved / s.logs[k].user;
            assert!(
                per_write < MIN_GARBAGE as f64,
                "log {k}: {per_write} moves per write"
            );
        }
    }

    #[test]
    fn miniature_segments_at_their_floor_still_tell_the_policies_apart() {
        // 1 TiB on 8 MiB segments: 2^-13 of the addresses, in segments of 16
        // blocks (not 2048 >> 13), 25% spare.
        let blocks = 1u64 << 28;
        for hot in [true, false] {
            let mut s = Shadow::new(blocks, 2048);
            assert_eq!(s.seg_blocks, MIN_SEGMENT);
            s.set_capacity(blocks * 5 / 4);
            let addrs = sampled_addresses(&s, blocks);
            overwrite(&mut s, &addrs, 6, hot);
            let (g, c) = (s.moved(GREEDY), s.moved(COST_BENEFIT));
            println!("hot {hot}: greedy {g:.3}, cost-benefit {c:.3}");
            if hot {
                assert_eq!(s.better(), Some(COST_BENEFIT));
            } else {
                assert_ne!(s.better(), Some(COST_BENEFIT));
            }
        }
    }

    #[test]
    fn trimmed_blocks_are_dead_in_both_logs() {
        let mut s = Shadow::new(1 << 12, 256);
        for lba in 0..1 << 12 {
            s.write(lba);
        }
        for lba in 0..1 << 11 {
            s.trim(lba);
        }
        assert_eq!(s.map.len(), 1 << 11);
        for log in &s.logs {
            assert_eq!(log.segs.iter().map(|g| g.live).sum::<u32>(), 1 << 11);
        }
        // Collecting the half-dead segments moves only the blocks still mapped.
        s.set_capacity(1 << 11);
        for lba in 1 << 11..1 << 12 {
            s.write(lba);
        }
        for log in &s.logs {
            assert_eq!(log.segs.iter().map(|g| g.live).sum::<u32>(), 1 << 11);
        }
    }

    #[test]
    fn samples_follow_the_volume_size_not_the_writes() {
        let s = Shadow::new(1 << 28, 2048);
        assert_eq!(s.shift, 13);
        assert_eq!(s.seg_blocks, MIN_SEGMENT);
        let sampled = (0..1u64 << 20).filter(|&l| s.sampled(l)).count();
        // 2^20 addresses at 2^-13: 128 expected.
        assert!((64..256).contains(&sampled), "{sampled}");
        assert_eq!(Shadow::new(1000, 2048).shift, 0);
    }

    #[test]
    fn memory_follows_the_volume_not_the_array() {
        // A 64 MiB volume overwritten 20 times on an array of 1 TiB: the miniature
        // collects within twice the volume, whatever the array's free space.
        let blocks = 1u64 << 14;
        let mut s = Shadow::new(blocks, 2048);
        s.set_capacity(1 << 28);
        for i in 0..20 * blocks {
            s.write(i % blocks);
        }
        for log in &s.logs {
            let held: usize = log.segs.iter().map(|g| g.blocks.capacity()).sum();
            assert!(held as u64 <= 2 * blocks + 4 * 2048, "{held} blocks held");
        }
    }

    #[test]
    fn hot_cold_traffic_favours_cost_benefit() {
        let s = run(true);
        println!(
            "greedy {:.3}, cost-benefit {:.3}",
            s.moved(GREEDY),
            s.moved(COST_BENEFIT)
        );
        assert_eq!(s.better(), Some(COST_BENEFIT));
    }

    #[test]
    fn uniform_traffic_does_not_favour_cost_benefit() {
        let s = run(false);
        let (g, c) = (s.moved(GREEDY), s.moved(COST_BENEFIT));
        println!("greedy {g:.3}, cost-benefit {c:.3}");
        assert!(g > 1.0, "GC ran: {g}");
        assert_ne!(s.better(), Some(COST_BENEFIT));
    }

    #[test]
    fn every_segment_is_accounted_for() {
        let s = run(true);
        for log in &s.logs {
            let live: u32 = log.segs.iter().map(|s| s.live).sum();
            assert_eq!(live as usize, s.map.len(), "one live copy per block");
            assert!(
                log.segs.len() - log.free.len() <= s.capacity,
                "within capacity"
            );
        }
    }
}
