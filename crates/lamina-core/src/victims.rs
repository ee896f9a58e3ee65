//! GC's index of candidate victims: choosing a victim without looking at every
//! segment.
//!
//! A closed data segment is a candidate. Each volume's candidates are kept per heat
//! class in an ordered set keyed by (bucket of its live blocks, close time,
//! segment): [`BUCKETS`] buckets of equal width (a power of two) over a segment's
//! data blocks. A
//! segment moves to another bucket only when its live count crosses a bucket
//! boundary, so an overwrite costs a set update once every bucket width of
//! invalidations, and nothing otherwise.
//!
//! Policies score a candidate by its live blocks and its ages, and every score is
//! monotone: fewer live blocks or an older segment never scores lower (see
//! [`crate::gc::VictimPolicy::score`]). Within a bucket the set is in close order,
//! oldest first, so the first candidate of a bucket bounds what the rest of it can
//! score: the policy's score of a segment with the bucket's lowest live count and
//! that age. The search walks each class's buckets from the emptiest and leaves a
//! bucket as soon as that bound falls to the best score found, which makes the
//! pick exact (the best score among all candidates, as a scan would find) while
//! looking at one or a few segments per bucket: a pick costs about
//! `classes x BUCKETS` set lookups of O(log n), whatever the number of segments.
//!
//! The index also keeps, per volume and class, the live blocks and the number of
//! segments the class holds (open, closed, or on their way back to the free
//! queue), which the `lamina` policy weighs, and per volume the garbage of its
//! candidates, which decides the volume GC collects in.

use crate::gc::{Candidate, VictimPolicy};
use crate::segments::{Seg, SegState};
use lamina_format::unit::StreamKind;
use std::collections::BTreeSet;

/// Buckets of live counts per class.
pub const BUCKETS: u32 = 64;
/// Candidates looked at, at most, for the wear-aware tie-break (see
/// [`VictimIndex::best`]).
pub const WEAR_SCAN: usize = 256;

/// Per segment: not holding data for a volume.
const NOT_HELD: u8 = u8::MAX;
/// Per segment: holding data, not a candidate.
const HELD: u8 = u8::MAX - 1;
/// A candidate of the cache tier: in `cached`, oldest first, not in a bucket.
const CACHED: u8 = u8::MAX - 2;
const _: () = assert!(BUCKETS + 1 < CACHED as u32);

#[derive(Default)]
struct ClassIndex {
    /// Candidates by (bucket, close time, segment), packed into one key.
    set: BTreeSet<u128>,
    /// Live blocks in the segments the class holds.
    live: u64,
    /// Segments the class holds.
    held: u64,
}

#[derive(Default)]
struct VolIndex {
    classes: Vec<ClassIndex>,
    /// Garbage (data blocks of a segment less its live ones) of the candidates.
    garbage: u64,
}

pub(crate) struct VictimIndex {
    /// Data blocks of a segment.
    full: u32,
    /// log2 of the live counts per bucket, a power of two (a shift on every
    /// invalidation, not a division).
    shift: u32,
    /// Per segment: `NOT_HELD`, `HELD`, or the bucket it is indexed under.
    state: Vec<u8>,
    vols: Vec<VolIndex>,
    /// Segments from here up are the cache tier's: their candidates wait for
    /// compaction in `cached` instead of GC's buckets.
    cache_first: u32,
    /// The cache tier's candidates by (version at close, segment): compaction
    /// takes the oldest first, so a block rewritten while in the cache never
    /// reaches the capacity tier (CSAL's cache is a FIFO log).
    cached: BTreeSet<(u64, u32)>,
}

fn key(bucket: u8, closed: u64, seg: u32) -> u128 {
    (bucket as u128) << 96 | (closed as u128) << 32 | seg as u128
}

fn unkey(k: u128) -> (u8, u64, u32) {
    ((k >> 96) as u8, (k >> 32) as u64, k as u32)
}

/// What the search may take: candidates of `vol` (of one class, if given) with at
/// most `limit` live blocks.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Query {
    pub vol: u16,
    pub class: Option<u8>,
    pub limit: u32,
    /// Volume time, for ages.
    pub now: u64,
    /// Wear-aware tie-break: see [`crate::gc::select_by_score`].
    pub wear_window: f64,
}

/// What a policy sees of segment `seg` (`s`) of `full` data blocks at volume time
/// `now`.
pub(crate) fn candidate(s: &Seg, seg: u32, full: u32, now: u64) -> Candidate {
    Candidate {
        segment: seg,
        valid: s.valid,
        capacity: full,
        age: now.saturating_sub(s.closed),
        idle: now.saturating_sub(s.last_invalidated),
        erase_count: s.erase_count,
        class: s.class,
        user: s.kind == StreamKind::User,
    }
}

impl VictimIndex {
    /// An empty index of `segments` segments of `full` data blocks.
    pub fn new(segments: usize, full: u32, cache_first: u32) -> Self {
        VictimIndex {
            full: full.max(1),
            shift: full
                .max(1)
                .div_ceil(BUCKETS)
                .next_power_of_two()
                .trailing_zeros(),
            state: vec![NOT_HELD; segments],
            vols: Vec::new(),
            cache_first,
            cached: BTreeSet::new(),
        }
    }

    /// A segment's bucket: [`BUCKETS`] (never walked) when it holds no garbage.
    fn bucket(&self, valid: u32) -> u8 {
        if valid >= self.full {
            return BUCKETS as u8;
        }
        (valid >> self.shift).min(BUCKETS - 1) as u8
    }

    /// The lowest live count of bucket `b`.
    fn bucket_low(&self, b: u32) -> u32 {
        b << self.shift
    }

    fn garbage(&self, s: &Seg) -> u64 {
        self.full.saturating_sub(s.valid) as u64
    }

    fn class_mut(&mut self, vol: u16, class: u8) -> &mut ClassIndex {
        let (vol, class) = (vol as usize, class as usize);
        if self.vols.len() <= vol {
            self.vols.resize_with(vol + 1, Default::default);
        }
        let v = &mut self.vols[vol];
        if v.classes.len() <= class {
            v.classes.resize_with(class + 1, Default::default);
        }
        &mut v.classes[class]
    }

    /// Whether `seg` is a candidate now.
    /// Whether `seg` is a candidate of GC now (cache segments are compaction's).
    pub fn is_candidate(&self, seg: u32) -> bool {
        self.state[seg as usize] < CACHED
    }

    /// The cache tier's oldest closed segment, if any: compaction's next victim.
    pub fn oldest_cached(&self) -> Option<u32> {
        self.cached.first().map(|&(_, seg)| seg)
    }

    /// Segment `seg` (`s`) now holds data of its volume and class: opened by a
    /// data stream, or found so at start.
    pub fn hold(&mut self, seg: u32, s: &Seg) {
        if s.kind == StreamKind::Meta || s.state == SegState::Meta {
            return;
        }
        assert_eq!(
            self.state[seg as usize], NOT_HELD,
            "segment {seg} held twice"
        );
        self.state[seg as usize] = HELD;
        // The class totals are what GC's policies weigh: the capacity tier's.
        if seg >= self.cache_first {
            return;
        }
        let c = self.class_mut(s.volume, s.class);
        c.held += 1;
        c.live += s.valid as u64;
    }

    /// Segment `seg` (`s`, as it was) returns to the free queue.
    pub fn release(&mut self, seg: u32, s: &Seg) {
        if self.state[seg as usize] == NOT_HELD {
            return;
        }
        self.remove(seg, s);
        self.state[seg as usize] = NOT_HELD;
        if seg >= self.cache_first {
            return;
        }
        let c = self.class_mut(s.volume, s.class);
        c.held -= 1;
        c.live -= s.valid as u64;
    }

    /// Held segment `seg` (`s`) became a candidate.
    pub fn insert(&mut self, seg: u32, s: &Seg) {
        let st = self.state[seg as usize];
        assert_ne!(st, NOT_HELD, "segment {seg} indexed while not held");
        if st != HELD {
            return;
        }
        if seg >= self.cache_first {
            self.state[seg as usize] = CACHED;
            self.cached.insert((s.close_version.0, seg));
            return;
        }
        let b = self.bucket(s.valid);
        self.state[seg as usize] = b;
        let g = self.garbage(s);
        self.class_mut(s.volume, s.class)
            .set
            .insert(key(b, s.closed, seg));
        self.vols[s.volume as usize].garbage += g;
    }

    /// Segment `seg` (`s`) is no longer a candidate (emptied, excluded, withheld).
    pub fn remove(&mut self, seg: u32, s: &Seg) {
        let b = self.state[seg as usize];
        if b >= HELD {
            return;
        }
        self.state[seg as usize] = HELD;
        if b == CACHED {
            let removed = self.cached.remove(&(s.close_version.0, seg));
            assert!(
                removed,
                "cache segment {seg} missing from the compaction queue"
            );
            return;
        }
        let g = self.garbage(s);
        let removed = self
            .class_mut(s.volume, s.class)
            .set
            .remove(&key(b, s.closed, seg));
        assert!(removed, "segment {seg} missing from its bucket");
        self.vols[s.volume as usize].garbage -= g;
    }

    /// Held segment `seg` now has `s.valid` live blocks, `before` before.
    #[inline]
    pub fn valid_changed(&mut self, seg: u32, s: &Seg, before: u32) {
        let st = self.state[seg as usize];
        if st == NOT_HELD || seg >= self.cache_first {
            return;
        }
        let b = self.bucket(s.valid);
        // A held segment's volume and class have their entries (see `hold`).
        let c = &mut self.vols[s.volume as usize].classes[s.class as usize];
        c.live = c.live + s.valid as u64 - before as u64;
        if st >= CACHED {
            return;
        }
        if b != st {
            c.set.remove(&key(st, s.closed, seg));
            c.set.insert(key(b, s.closed, seg));
            self.state[seg as usize] = b;
        }
        let v = &mut self.vols[s.volume as usize];
        v.garbage = v.garbage + self.full.saturating_sub(s.valid) as u64
            - self.full.saturating_sub(before) as u64;
    }

    /// Volumes whose candidates hold garbage, with it.
    pub fn volumes_with_garbage(&self, out: &mut Vec<(u64, u16)>) {
        out.clear();
        out.extend(
            self.vols
                .iter()
                .enumerate()
                .filter(|(_, v)| v.garbage > 0)
                .map(|(i, v)| (v.garbage, i as u16)),
        );
    }

    /// Classes `vol` has held segments in (some perhaps written under another
    /// configuration, with more classes than the volume has now).
    pub fn classes(&self, vol: u16) -> usize {
        self.vols.get(vol as usize).map_or(0, |v| v.classes.len())
    }

    /// Live blocks and segments held by class `class` of `vol`.
    pub fn class_totals(&self, vol: u16, class: u8) -> (u64, u64) {
        self.vols
            .get(vol as usize)
            .and_then(|v| v.classes.get(class as usize))
            .map_or((0, 0), |c| (c.live, c.held))
    }

    fn classes_of(&self, vol: u16, class: Option<u8>) -> impl Iterator<Item = &ClassIndex> {
        let all = self.vols.get(vol as usize).map_or(&[][..], |v| &v.classes);
        all.iter()
            .enumerate()
            .filter(move |(k, _)| class.is_none_or(|c| c as usize == *k))
            .map(|(_, c)| c)
    }

    /// Whether class `class` of `vol` has a candidate with at most `limit` live
    /// blocks and some garbage (`seg` gives a segment's table entry).
    pub fn any_candidate<'s>(
        &self,
        vol: u16,
        class: u8,
        limit: u32,
        seg: impl Fn(u32) -> &'s Seg,
    ) -> bool {
        let limit = limit.min(self.full - 1);
        self.classes_of(vol, Some(class)).any(|c| {
            c.set
                .iter()
                .map(|&k| unkey(k))
                .take_while(|&(b, _, _)| self.bucket_low(b as u32) <= limit)
                .any(|(_, _, s)| seg(s).valid <= limit)
        })
    }

    /// Walks the candidates of `q` that may score above what `floor` says (or at
    /// least that, when `inclusive`), calling `visit` on each with its score;
    /// `visit` returns false to stop the walk. A bucket is left at the first
    /// candidate whose bound (the score of a segment with the bucket's lowest live
    /// count, this candidate's age and any idle time) does not reach the floor:
    /// the rest of the bucket is younger. Segments without garbage are in a bucket
    /// of their own that is never walked.
    #[allow(clippy::too_many_arguments)]
    fn walk(
        &self,
        q: &Query,
        policy: &dyn VictimPolicy,
        cand: &dyn Fn(u32) -> Candidate,
        floor: &dyn Fn() -> Option<f64>,
        inclusive: bool,
        visit: &mut dyn FnMut(&Candidate, f64) -> bool,
    ) {
        let limit = q.limit.min(self.full - 1);
        // The next bucket of a class at or after `from` that may hold candidates.
        let next_bucket = |c: &ClassIndex, from: u32| {
            (from < BUCKETS)
                .then(|| c.set.range(key(from as u8, 0, 0)..).next())
                .flatten()
                .map(|&k| unkey(k).0 as u32)
                .filter(|&b| b < BUCKETS && self.bucket_low(b) <= limit)
        };
        // Buckets in order across the classes, the emptiest first (so that the
        // wear tie-break's bounded look takes the best of every class first).
        let classes: Vec<&ClassIndex> = self.classes_of(q.vol, q.class).collect();
        let mut cursor: Vec<Option<u32>> = classes.iter().map(|c| next_bucket(c, 0)).collect();
        while let Some((i, b)) = cursor
            .iter()
            .enumerate()
            .filter_map(|(i, b)| b.map(|b| (i, b)))
            .min_by_key(|&(_, b)| b)
        {
            let lo = self.bucket_low(b);
            for &k in classes[i]
                .set
                .range(key(b as u8, 0, 0)..key(b as u8 + 1, 0, 0))
            {
                let (_, closed, seg) = unkey(k);
                let age = q.now.saturating_sub(closed);
                if let Some(f) = floor() {
                    let bound = policy.score(&Candidate {
                        segment: seg,
                        valid: lo,
                        capacity: self.full,
                        age,
                        idle: u64::MAX,
                        erase_count: 0,
                        class: 0,
                        user: true,
                    });
                    if bound < f || (!inclusive && bound == f) {
                        break;
                    }
                }
                let cd = cand(seg);
                if cd.valid > limit {
                    continue;
                }
                if !visit(&cd, policy.score(&cd)) {
                    return;
                }
            }
            cursor[i] = next_bucket(classes[i], b + 1);
        }
    }

    /// The best victim of `q` by `policy`'s score: the same score a scan of every
    /// candidate would find ([`crate::gc::select_by_score`]). With a wear window,
    /// the least erased of the candidates scoring within the window of the best
    /// wins, looked for among at most [`WEAR_SCAN`] of them (the emptiest buckets
    /// of every class first).
    pub fn best(
        &self,
        q: &Query,
        policy: &dyn VictimPolicy,
        cand: &dyn Fn(u32) -> Candidate,
    ) -> Option<u32> {
        let best = std::cell::Cell::new(None::<(f64, Candidate)>);
        self.walk(
            q,
            policy,
            cand,
            // A candidate must beat the best so far.
            &|| best.get().map(|(s, _)| s),
            false,
            &mut |c, s| {
                if best.get().is_none_or(|(bs, _)| s > bs) {
                    best.set(Some((s, *c)));
                }
                true
            },
        );
        let (bs, bc) = best.get()?;
        if q.wear_window <= 0.0 {
            return Some(bc.segment);
        }
        let floor = bs - bs.abs() * q.wear_window;
        let mut pick = bc;
        let mut seen = 0;
        self.walk(q, policy, cand, &|| Some(floor), true, &mut |c, s| {
            if s >= floor {
                seen += 1;
                if c.erase_count < pick.erase_count {
                    pick = *c;
                }
            }
            seen < WEAR_SCAN
        });
        Some(pick.segment)
    }

    /// Checks the index against the segment table (for tests): every candidate
    /// and every count as a scan of `segs` finds them. `should_be` says which
    /// segments should be candidates.
    pub fn check(&self, segs: &[Seg], should_be: impl Fn(u32, &Seg) -> bool) {
        let mut want: Vec<VolIndex> = Vec::new();
        let mut cands = 0usize;
        for (i, s) in segs.iter().enumerate() {
            let held =
                !matches!(s.state, SegState::Free | SegState::Meta) && s.kind != StreamKind::Meta;
            let st = self.state[i];
            assert_eq!(st != NOT_HELD, held, "segment {i} ({:?}) held", s.state);
            if !held {
                continue;
            }
            if i as u32 >= self.cache_first {
                let is = should_be(i as u32, s);
                assert_eq!(st == CACHED, is, "cache segment {i} ({:?}) queued", s.state);
                if is {
                    assert!(self.cached.contains(&(s.close_version.0, i as u32)));
                    cands += 1;
                }
                continue;
            }
            let (v, k) = (s.volume as usize, s.class as usize);
            if want.len() <= v {
                want.resize_with(v + 1, Default::default);
            }
            if want[v].classes.len() <= k {
                want[v].classes.resize_with(k + 1, Default::default);
            }
            want[v].classes[k].held += 1;
            want[v].classes[k].live += s.valid as u64;
            let is = should_be(i as u32, s);
            assert_eq!(st != HELD, is, "segment {i} ({:?}) indexed", s.state);
            if is {
                cands += 1;
                assert_eq!(st, self.bucket(s.valid), "segment {i}'s bucket");
                assert!(
                    self.vols[v].classes[k]
                        .set
                        .contains(&key(st, s.closed, i as u32)),
                    "segment {i} in its set"
                );
                want[v].garbage += self.garbage(s);
            }
        }
        let indexed: usize = self
            .vols
            .iter()
            .flat_map(|v| &v.classes)
            .map(|c| c.set.len())
            .sum();
        assert_eq!(indexed + self.cached.len(), cands, "indexed candidates");
        for (v, got) in self.vols.iter().enumerate() {
            let w = want.get(v);
            assert_eq!(
                got.garbage,
                w.map_or(0, |w| w.garbage),
                "volume {v} garbage"
            );
            for (k, c) in got.classes.iter().enumerate() {
                let wc = w.and_then(|w| w.classes.get(k));
                assert_eq!(
                    (c.live, c.held),
                    wc.map_or((0, 0), |c| (c.live, c.held)),
                    "volume {v} class {k} live and held"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gc::{policy_by_name, select_by_score};
    use rand::{Rng, SeedableRng};

    fn closed(volume: u16, class: u8, valid: u32, closed: u64, erase: u32) -> Seg {
        let mut s = Seg::free(erase);
        s.state = SegState::Closed;
        s.volume = volume;
        s.class = class;
        s.valid = valid;
        s.closed = closed;
        s.last_invalidated = closed;
        s
    }

    /// Against a scan of every candidate, on random tables: the pick has the best
    /// score, and with a wear window it scores within the window and is no more
    /// worn than the least worn a scan finds there, whenever the window holds
    /// fewer than `WEAR_SCAN` candidates.
    #[test]
    fn picks_what_a_scan_picks() {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        for round in 0..300 {
            let full = [16u32, 100, 2048, 131072][round % 4];
            let n = rng.gen_range(1..400usize);
            let now = rng.gen_range(0..1_000_000u64);
            let segs: Vec<Seg> = (0..n)
                .map(|_| {
                    let mut s = closed(
                        rng.gen_range(0..2),
                        rng.gen_range(0..3),
                        // Clustered live counts, as GC leaves them, and some full.
                        match rng.gen_range(0..4) {
                            0 => full,
                            1 => rng.gen_range(0..=full / 8),
                            _ => rng.gen_range(0..=full),
                        },
                        rng.gen_range(0..=now),
                        rng.gen_range(0..20),
                    );
                    // Idle time beyond the age too: a segment not invalidated since
                    // it was opened.
                    s.last_invalidated = rng.gen_range(s.closed.saturating_sub(1000)..=now);
                    if rng.gen_bool(0.3) {
                        s.kind = StreamKind::Gc;
                    }
                    s
                })
                .collect();
            let mut ix = VictimIndex::new(n, full, n as u32);
            for (i, s) in segs.iter().enumerate() {
                ix.hold(i as u32, s);
                ix.insert(i as u32, s);
            }
            ix.check(&segs, |_, _| true);
            let limit = if rng.gen_bool(0.5) {
                full
            } else {
                rng.gen_range(0..=full)
            };
            for name in ["greedy", "cost-benefit", "cost-benefit-sqrt", "salsa"] {
                let p = policy_by_name(name).unwrap();
                for window in [0.0, 0.1] {
                    for vol in 0..2u16 {
                        for class in [None, Some(1u8)] {
                            let q = Query {
                                vol,
                                class,
                                limit,
                                now,
                                wear_window: window,
                            };
                            let cands: Vec<Candidate> = segs
                                .iter()
                                .enumerate()
                                .filter(|(_, s)| {
                                    s.volume == vol
                                        && class.is_none_or(|c| c == s.class)
                                        && s.valid <= limit
                                })
                                .map(|(i, s)| candidate(s, i as u32, full, now))
                                .collect();
                            let got =
                                ix.best(&q, &*p, &|i| candidate(&segs[i as usize], i, full, now));
                            let want = select_by_score(&cands, |c| p.score(c), 0.0);
                            let Some(w) = want else {
                                assert_eq!(got, None, "{name}: nothing to collect");
                                continue;
                            };
                            let g = got.unwrap_or_else(|| panic!("{name}: found nothing"));
                            let gc = candidate(&segs[g as usize], g, full, now);
                            let best = p.score(&cands[w]);
                            let got_score = p.score(&gc);
                            if window == 0.0 {
                                assert_eq!(got_score, best, "{name} round {round}");
                                continue;
                            }
                            let floor = best - best.abs() * window;
                            assert!(got_score >= floor, "{name}: outside the window");
                            let in_window: Vec<&Candidate> = cands
                                .iter()
                                .filter(|c| c.garbage() > 0 && p.score(c) >= floor)
                                .collect();
                            let least = in_window.iter().map(|c| c.erase_count).min().unwrap();
                            assert!(gc.erase_count <= cands[w].erase_count);
                            if in_window.len() < WEAR_SCAN {
                                assert_eq!(gc.erase_count, least, "{name}: least worn");
                            }
                        }
                    }
                }
            }
            // Any candidate, per class.
            for class in 0..3u8 {
                let want = segs
                    .iter()
                    .any(|s| s.volume == 0 && s.class == class && s.valid <= limit.min(full - 1));
                assert_eq!(
                    ix.any_candidate(0, class, limit, |i| &segs[i as usize]),
                    want
                );
            }
        }
    }

    /// Live counts moving across buckets, segments leaving and returning: the
    /// index follows the table.
    #[test]
    fn follows_invalidations_and_releases() {
        let full = 100;
        let mut segs: Vec<Seg> = (0..50)
            .map(|i| closed((i % 3) as u16, (i % 2) as u8, full, i as u64, 0))
            .collect();
        let mut ix = VictimIndex::new(segs.len(), full, segs.len() as u32);
        for (i, s) in segs.iter().enumerate() {
            ix.hold(i as u32, s);
            ix.insert(i as u32, s);
        }
        let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
        for _ in 0..20_000 {
            let i = rng.gen_range(0..segs.len());
            let s = &mut segs[i];
            match s.state {
                SegState::Closed if s.valid > 0 => {
                    let before = s.valid;
                    s.valid -= 1;
                    ix.valid_changed(i as u32, s, before);
                }
                SegState::Closed => {
                    ix.remove(i as u32, s);
                    s.state = SegState::Draining;
                }
                SegState::Draining => {
                    ix.release(i as u32, s);
                    *s = Seg::free(0);
                }
                _ => {
                    // Reopened for another volume and class, filled, closed.
                    *s = closed(rng.gen_range(0..3), rng.gen_range(0..3), 0, 0, 1);
                    s.state = SegState::Open;
                    ix.hold(i as u32, s);
                    let before = s.valid;
                    s.valid = rng.gen_range(1..=full);
                    ix.valid_changed(i as u32, s, before);
                    s.state = SegState::Closed;
                    s.closed = rng.gen();
                    ix.insert(i as u32, s);
                }
            }
        }
        ix.check(&segs, |_, s| s.state == SegState::Closed);
    }
}
