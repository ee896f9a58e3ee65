//! The segment table and the release pipeline: what each segment holds and where it
//! is in its life, and the queues that move emptied segments back to the free queue.
//!
//! A segment that GC (or overwrites) emptied cannot be reused at once: recovery
//! must never find a segment reused while something durable still points into it.
//! So an emptied segment goes through the *release protocol*:
//!
//! ```text
//! Closed ──emptied──▶ Draining ──its flush synced──▶ ReleaseReady
//!        ──release record sealed──▶ Releasing ──that flush synced (with
//!        `discard_delay_ms = 0`, and the discard done)──▶ Free (back of the free
//!        queue) ──free for `discard_delay_ms`──▶ discarded while free
//! ```
//!
//! Segments leave `Releasing` in the order their release records were sealed, the
//! order recovery walks them. The engine decides when flushes happen and writes the
//! release records; this module owns the states and the queues, and checks every
//! transition against the state it expects.

use crate::geometry::Tier;
use crate::types::Version;
use crate::victims::VictimIndex;
use lamina_format::unit::StreamKind;
use std::collections::{HashMap, VecDeque};

/// What a discard of a segment covers (see [`SegmentTable::discardable`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Extent {
    Whole,
    /// All but the first unit's header blocks.
    Tail,
    /// The first unit's header blocks, which a tail discard kept, once the
    /// segment's contents precede the durable checkpoint.
    Head,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SegState {
    Free,
    /// Head of a stream.
    Open,
    /// All units sealed; some writes (or the summary) still in flight.
    Closing,
    /// Holds data; a garbage collection candidate.
    Closed,
    /// Empty; waiting for a flush generation that makes its emptiness durable.
    Draining,
    /// Emptiness durable; waiting for its release record to be written.
    ReleaseReady,
    /// Release record sealed; waiting for a flush generation to make it durable.
    Releasing,
    /// Written by the metadata stream (checkpoints, release records).
    Meta,
}

#[derive(Clone, Debug)]
pub(crate) struct Seg {
    pub state: SegState,
    pub kind: StreamKind,
    pub class: u8,
    pub volume: u16,
    pub valid: u32,
    pub write_ptr: u32,
    pub data_blocks: u32,
    pub incarnation: Version,
    pub close_version: Version,
    pub erase_count: u32,
    pub has_summary: bool,
    pub writes_inflight: u32,
    /// Draining / Releasing: flush generation to wait for. Meta: checkpoint generation.
    pub gen: u64,
    /// GC found a block here it could not read or verify: the segment keeps it (reads
    /// of it return an error) and is not collected again until it is reused.
    pub gc_exclude: bool,
    /// Volume time (user blocks written to its volume) when the segment was opened.
    pub born: u64,
    /// Volume time when a block of it last went dead.
    pub last_invalidated: u64,
    /// Volume time when it was closed.
    pub closed: u64,
    /// Written by GC: when its blocks were last written by users (boxed: user
    /// segments, most of them, do not pay for it).
    pub origins: Option<Box<Origins>>,
    /// Free: the version at which its last contents were opened (an upper bound
    /// for segments found free at start); see [`SegmentTable::discardable`].
    pub retired: Version,
    /// Free: its last contents are known to have been a data segment's (user or
    /// GC), whose units carry no record the walk needs (release records are the
    /// metadata stream's); not known for segments found free at start.
    pub retired_data: bool,
    /// Free: engine time (ms) when it joined the free queue.
    pub freed_ms: u64,
    /// Free: a discard of its extent is under way; allocation must not take it.
    pub discarding: bool,
    /// Free: its extent was discarded since it was last written.
    pub clean: bool,
    /// Free and clean: the discard kept the first unit header ([`Extent::Tail`]);
    /// it is discarded too once a later checkpoint is durable.
    pub head_kept: bool,
}

/// Slots a GC segment is divided into for dating its blocks.
pub const ORIGIN_SLOTS: usize = lamina_format::checkpoint::ORIGIN_SLOTS;

/// When the blocks GC moved into a segment were last written by users: the mean of
/// each sixteenth of the segment. GC writes a victim's live blocks in order, so
/// neighbours in a GC segment come from the same part of the same victim and were
/// written at about the same time. One mean for the whole segment would date each
/// block by blocks of every age moved with it; and since the blocks that die soon
/// after a move are the young ones, the overwrites it dates would all look old
/// (SepBIT's lifespan check then saw no difference between its classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Origins {
    pub mean: [u64; ORIGIN_SLOTS],
    n: [u32; ORIGIN_SLOTS],
}

impl Origins {
    /// Every slot dated `t` (what a slot nothing was moved into yet says).
    pub fn at_time(t: u64) -> Self {
        Origins {
            mean: [t; ORIGIN_SLOTS],
            n: [0; ORIGIN_SLOTS],
        }
    }

    /// Slot of block `offset` of a segment of `segment_blocks` blocks.
    #[inline]
    pub fn slot(offset: u32, segment_blocks: u32) -> usize {
        (offset as u64 * ORIGIN_SLOTS as u64 / segment_blocks.max(1) as u64)
            .min(ORIGIN_SLOTS as u64 - 1) as usize
    }

    /// For a segment of `kind` opened at `born`: GC segments only.
    pub fn for_segment(kind: lamina_format::unit::StreamKind, born: u64) -> Option<Box<Self>> {
        (kind == lamina_format::unit::StreamKind::Gc).then(|| Box::new(Self::at_time(born)))
    }

    /// A block last written by a user at `at` was moved into `slot`.
    pub fn add(&mut self, slot: usize, at: u64) {
        let n = &mut self.n[slot];
        *n = n.saturating_add(1);
        let m = &mut self.mean[slot];
        *m = (*m as i128 + (at as i128 - *m as i128) / *n as i128) as u64;
    }
}

impl Seg {
    /// What the segment holds: the version its contents were opened at, and
    /// whether they are a data segment's. A free segment, or one reserved for
    /// the metadata stream and not opened yet, holds what it held before.
    fn contents(&self) -> (Version, bool) {
        if self.state == SegState::Free || self.incarnation == Version::ZERO {
            (self.retired, self.retired_data)
        } else {
            (self.incarnation, self.kind != StreamKind::Meta)
        }
    }

    /// A discard of `extent` of the free segment ended (done or failed: either
    /// way it is not tried again until the segment is written).
    fn discarded(&mut self, extent: Extent) {
        self.clean = true;
        self.head_kept = extent == Extent::Tail;
    }

    pub(crate) fn free(erase_count: u32) -> Self {
        Seg {
            state: SegState::Free,
            kind: StreamKind::User,
            class: 0,
            volume: 0,
            valid: 0,
            write_ptr: 0,
            data_blocks: 0,
            incarnation: Version::ZERO,
            close_version: Version::ZERO,
            erase_count,
            has_summary: false,
            writes_inflight: 0,
            gen: 0,
            gc_exclude: false,
            born: 0,
            last_invalidated: 0,
            closed: 0,
            origins: None,
            retired: Version(u64::MAX),
            retired_data: false,
            freed_ms: 0,
            discarding: false,
            clean: false,
            head_kept: false,
        }
    }
}

/// Every segment's state, the free queue and the release pipeline.
pub(crate) struct SegmentTable {
    pub segs: Vec<Seg>,
    /// Segments allocation may take, in the order recovery expects them taken
    /// (within a window; see `Engine::take_free`): the capacity tier's (every
    /// segment of an array without a cache tier).
    pub free: VecDeque<u32>,
    /// The cache tier's free segments, in the same kind of order (recovery walks
    /// each tier's queue on its own): segments `cache_first..`.
    pub cache_free: VecDeque<u32>,
    /// The first segment of the cache tier (the segment count without one).
    cache_first: u32,
    /// Emptied, waiting for the flush generation in their `gen` to be synced.
    pub draining: Vec<u32>,
    /// Emptiness durable, waiting for the next flush to carry their release record.
    pub release_ready: Vec<u32>,
    /// Release record sealed, in sealing order, waiting for its flush to be synced.
    pub releasing: Vec<u32>,
    /// With `discard_delay_ms = 0`: released segments whose discard is under way
    /// (`None`) or done (what it covered); they join the free queue in release
    /// order once done.
    pub discards: HashMap<u32, Option<Extent>>,
    /// Discards of free segments under way.
    pub discarding: usize,
    /// Where the next look for free segments to discard starts (an index of `free`).
    /// Per tier (capacity, cache).
    discard_cursor: [usize; 2],
    pub discarded: u64,
    /// Discards done that kept the first unit header ([`Extent::Tail`]), and
    /// of such headers later ([`Extent::Head`]).
    pub tail_discards: u64,
    pub head_discards: u64,
    /// Free segments set aside because their zone could not be reset.
    pub quarantined: u64,
    /// Segments that never join the free queue again: those of a member being
    /// evacuated or removed (`array evacuate`). They become free as GC and
    /// checkpoints empty them, and stay out of use.
    withheld: Vec<std::ops::Range<u32>>,
    /// GC's candidates, kept as the table changes (see `victims.rs`).
    pub victims: VictimIndex,
    /// What the garbage proportion weighs (see [`SegmentTable::garbage_proportion`]).
    proportion: Proportion,
}

/// Data blocks of the data segments that hold data (open, closing or closed), and
/// of the closed ones with their live blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Proportion {
    stored: u64,
    closed: u64,
    closed_live: u64,
}

impl Proportion {
    fn of(segs: &[Seg]) -> Self {
        let mut p = Proportion::default();
        for s in segs.iter().filter(|s| holds(s)) {
            p.stored += s.data_blocks as u64;
            if s.state == SegState::Closed {
                p.closed += s.data_blocks as u64;
                p.closed_live += s.valid as u64;
            }
        }
        p
    }

    /// `s` stops holding data (emptied or freed).
    fn leave(&mut self, s: &Seg) {
        if holds(s) {
            self.stored -= s.data_blocks as u64;
            if s.state == SegState::Closed {
                self.closed -= s.data_blocks as u64;
                self.closed_live -= s.valid as u64;
            }
        }
    }
}

/// Whether `s` is a data segment that holds data (one on its way back to the free
/// queue holds nothing any more).
fn holds(s: &Seg) -> bool {
    s.kind != StreamKind::Meta
        && matches!(
            s.state,
            SegState::Open | SegState::Closing | SegState::Closed
        )
}

impl SegmentTable {
    /// `opened_at`: the first version of this run. What the segments found free
    /// held was opened by an earlier run, at a version below it, so they count as
    /// retired just before it (discarded once a checkpoint of this run, which
    /// starts at `opened_at` or later, is durable).
    /// `full`: data blocks of a segment.
    /// `free` is the free queue of both tiers (segments from `cache_first` up
    /// are the cache tier's): each tier's queue keeps its order.
    pub fn new(
        mut segs: Vec<Seg>,
        free: VecDeque<u32>,
        opened_at: Version,
        full: u32,
        cache_first: u32,
    ) -> Self {
        debug_assert!(free
            .iter()
            .all(|&s| segs[s as usize].state == SegState::Free));
        for &s in &free {
            segs[s as usize].retired = opened_at.prev();
        }
        let (cache_free, free): (VecDeque<u32>, VecDeque<u32>) =
            free.into_iter().partition(|&s| s >= cache_first);
        let mut t = SegmentTable {
            proportion: Proportion::of(&segs),
            victims: VictimIndex::new(segs.len(), full, cache_first),
            segs,
            free,
            cache_free,
            cache_first,
            draining: Vec::new(),
            release_ready: Vec::new(),
            releasing: Vec::new(),
            discards: HashMap::new(),
            discarding: 0,
            discard_cursor: [0; 2],
            discarded: 0,
            tail_discards: 0,
            head_discards: 0,
            quarantined: 0,
            withheld: Vec::new(),
        };
        for i in 0..t.segs.len() as u32 {
            let s = &t.segs[i as usize];
            if s.state != SegState::Free {
                t.victims.hold(i, s);
            }
            if t.collectable(i) {
                t.victims.insert(i, &t.segs[i as usize]);
            }
        }
        t
    }

    /// Whether `seg` is one GC may collect: a closed data segment, not excluded
    /// (see `Seg::gc_exclude`), not withheld. The index of candidates holds these.
    pub fn collectable(&self, seg: u32) -> bool {
        let s = &self.segs[seg as usize];
        s.state == SegState::Closed
            && s.kind != StreamKind::Meta
            && !s.gc_exclude
            && !self.is_withheld(seg)
    }

    /// The free queue of `tier`.
    pub fn free_in(&self, tier: Tier) -> &VecDeque<u32> {
        match tier {
            Tier::Capacity => &self.free,
            Tier::Cache => &self.cache_free,
        }
    }

    fn free_in_mut(&mut self, tier: Tier) -> &mut VecDeque<u32> {
        match tier {
            Tier::Capacity => &mut self.free,
            Tier::Cache => &mut self.cache_free,
        }
    }

    /// The free queue `seg` belongs in.
    fn free_of_mut(&mut self, seg: u32) -> &mut VecDeque<u32> {
        let tier = if seg >= self.cache_first {
            Tier::Cache
        } else {
            Tier::Capacity
        };
        self.free_in_mut(tier)
    }

    /// Takes entry `i` of `tier`'s free queue.
    pub fn take_free_at(&mut self, tier: Tier, i: usize) -> Option<u32> {
        self.free_in_mut(tier).remove(i)
    }

    /// Both free queues, capacity first, each in its order: what a checkpoint
    /// records (recovery splits it again by tier).
    pub fn all_free(&self) -> impl Iterator<Item = u32> + '_ {
        self.free.iter().chain(&self.cache_free).copied()
    }

    /// Free segments of both tiers.
    pub fn free_count(&self) -> usize {
        self.free.len() + self.cache_free.len()
    }

    /// Segments somewhere in the release pipeline (free once flushes complete).
    pub fn in_release(&self) -> usize {
        self.draining.len() + self.release_ready.len() + self.releasing.len()
    }

    /// Whether a flush would move the pipeline along: something waits for its
    /// emptiness or its release record to be made durable (`synced`: the newest
    /// synced flush generation).
    pub fn wants_flush(&self, synced: u64) -> bool {
        !self.draining.is_empty()
            || !self.release_ready.is_empty()
            || self
                .releasing
                .iter()
                .any(|&s| self.segs[s as usize].gen > synced)
    }

    /// A closed segment holds nothing live any more: its emptiness becomes durable
    /// with flush generation `gen`.
    pub fn emptied(&mut self, seg: u32, gen: u64) {
        let s = &mut self.segs[seg as usize];
        assert_eq!(s.state, SegState::Closed, "segment {seg} emptied");
        self.victims.remove(seg, s);
        self.proportion.leave(s);
        s.state = SegState::Draining;
        s.gen = gen;
        self.draining.push(seg);
    }

    /// A metadata segment superseded by a committed checkpoint: its emptiness is
    /// already durable (the checkpoint that supersedes it is).
    pub fn superseded(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        assert_eq!(s.state, SegState::Meta, "segment {seg} superseded");
        s.state = SegState::ReleaseReady;
        self.release_ready.push(seg);
    }

    /// Flush generation `synced` is durable: segments drained by it are ready for
    /// their release records.
    pub fn synced(&mut self, synced: u64) {
        let segs = &mut self.segs;
        let ready = &mut self.release_ready;
        self.draining.retain(|&s| {
            let sg = &mut segs[s as usize];
            if sg.gen > synced {
                return true;
            }
            sg.state = SegState::ReleaseReady;
            ready.push(s);
            false
        });
    }

    /// The release record of the first ready segment was sealed into flush
    /// generation `gen`.
    pub fn release_recorded(&mut self, gen: u64) -> u32 {
        let seg = self.release_ready.remove(0);
        let s = &mut self.segs[seg as usize];
        debug_assert_eq!(s.state, SegState::ReleaseReady);
        s.state = SegState::Releasing;
        s.gen = gen;
        self.releasing.push(seg);
        seg
    }

    /// How many of the releasing segments, from the first, are released (their
    /// release record is durable).
    pub fn released(&self, synced: u64) -> usize {
        self.releasing
            .iter()
            .take_while(|&&s| self.segs[s as usize].gen <= synced)
            .count()
    }

    /// How much of released or free segment `seg` may be discarded, when
    /// discards are on (`before` is `Some`, the durable checkpoint's start
    /// version):
    /// - contents opened before `before`: all of it (a segment opened before the
    ///   checkpoint reads as stale to the walk either way);
    /// - a data segment's contents opened after it: all but the first unit's
    ///   header ([`Extent::Tail`]). Recovery from that checkpoint walks the
    ///   segments opened after it in free-queue order and takes a run of empty
    ///   ones for the end of what was allocated; a segment that read as empty in
    ///   the middle of that order could end the walk early. With its first header
    ///   kept, every visit of the walk finds (or, for a visit that needs a later
    ///   incarnation, misses) it exactly as it would the whole segment, and the
    ///   release record that retired it keeps its units out of replay. The
    ///   metadata stream's segments hold the release records the walk follows,
    ///   so they keep everything.
    pub fn discardable(&self, seg: u32, before: Option<Version>) -> Option<Extent> {
        let (opened, data) = self.segs[seg as usize].contents();
        let before = before?;
        if opened < before {
            Some(Extent::Whole)
        } else if data {
            Some(Extent::Tail)
        } else {
            None
        }
    }

    /// Frees the first releasing segment if its release is durable and, where it
    /// is to be discarded on release (`release_discards`, see
    /// [`SegmentTable::discardable`]), its discard is done: returns it.
    pub fn free_next_released(
        &mut self,
        synced: u64,
        release_discards: Option<Version>,
        now_ms: u64,
    ) -> Option<u32> {
        let &s = self.releasing.first()?;
        if self.segs[s as usize].gen > synced {
            return None;
        }
        let done = self.discards.get(&s).copied().flatten();
        if self.discardable(s, release_discards).is_some() && done.is_none() {
            return None;
        }
        self.discards.remove(&s);
        self.releasing.remove(0);
        self.make_free(s, now_ms);
        if let Some(extent) = done {
            self.segs[s as usize].discarded(extent);
        }
        Some(s)
    }

    /// Returns `seg` to the back of the free queue as a new, empty segment (its
    /// wear is kept) at engine time `now_ms`.
    pub fn make_free(&mut self, seg: u32, now_ms: u64) {
        let old = &self.segs[seg as usize];
        debug_assert!(!old.discarding, "segment {seg} freed while discarded");
        self.victims.release(seg, old);
        // A simulation frees emptied segments at once, without draining them.
        self.proportion.leave(old);
        let (retired, retired_data) = old.contents();
        self.segs[seg as usize] = Seg {
            retired,
            retired_data,
            freed_ms: now_ms,
            ..Seg::free(old.erase_count)
        };
        if !self.is_withheld(seg) {
            self.free_of_mut(seg).push_back(seg);
        }
    }

    /// Keeps the segments of `range` out of use from now on: out of the free
    /// queue, and out of it again when they are released.
    pub fn withhold(&mut self, range: std::ops::Range<u32>) {
        self.free.retain(|s| !range.contains(s));
        self.cache_free.retain(|s| !range.contains(s));
        for seg in range.clone() {
            self.victims.remove(seg, &self.segs[seg as usize]);
        }
        self.withheld.push(range);
    }

    /// Segment `seg` was (re)opened by a stream: it holds data of its volume and
    /// class from now on.
    pub fn opened(&mut self, seg: u32) {
        let s = &self.segs[seg as usize];
        self.victims.hold(seg, s);
        if holds(s) {
            self.proportion.stored += s.data_blocks as u64;
        }
    }

    /// A unit of `data` data blocks was sealed into `seg`.
    pub fn sealed(&mut self, seg: u32, data: u32) {
        let s = &mut self.segs[seg as usize];
        s.data_blocks += data;
        if holds(s) {
            self.proportion.stored += data as u64;
            if s.state == SegState::Closed {
                self.proportion.closed += data as u64;
            }
        }
    }

    /// Dead blocks GC could reclaim (those of closed data segments) over the
    /// blocks stored in data segments: the garbage proportion of SepBIT's trigger.
    /// Dead blocks of open segments do not count: GC cannot reach them, and on a
    /// working set of a few segments they alone can hold the proportion above the
    /// trigger, so that GC would run without end on segments with little garbage.
    pub fn garbage_proportion(&self) -> f64 {
        let p = &self.proportion;
        if p.stored == 0 {
            0.0
        } else {
            self.reclaimable_blocks() as f64 / p.stored as f64
        }
    }

    /// Dead blocks of closed data segments: what GC could reclaim at most.
    pub fn reclaimable_blocks(&self) -> u64 {
        self.proportion
            .closed
            .saturating_sub(self.proportion.closed_live)
    }

    /// Segment `seg`'s writes are all done: it is closed, a GC candidate unless
    /// excluded or withheld.
    pub fn close(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        debug_assert_ne!(s.state, SegState::Closed, "segment {seg} closed twice");
        s.state = SegState::Closed;
        if s.kind != StreamKind::Meta {
            self.proportion.closed += s.data_blocks as u64;
            self.proportion.closed_live += s.valid as u64;
        }
        if self.collectable(seg) {
            self.victims.insert(seg, &self.segs[seg as usize]);
        }
    }

    /// GC left a block it could not read or verify in `seg`: it is not collected
    /// again until reused.
    pub fn exclude(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        s.gc_exclude = true;
        self.victims.remove(seg, s);
    }

    /// One more live block in `seg`.
    #[inline]
    pub fn add_valid(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        s.valid += 1;
        self.victims.valid_changed(seg, s, s.valid - 1);
        if s.state == SegState::Closed && s.kind != StreamKind::Meta {
            self.proportion.closed_live += 1;
        }
    }

    /// One live block fewer in `seg`.
    #[inline]
    pub fn drop_valid(&mut self, seg: u32) {
        let s = &mut self.segs[seg as usize];
        s.valid -= 1;
        self.victims.valid_changed(seg, s, s.valid + 1);
        if s.state == SegState::Closed && s.kind != StreamKind::Meta {
            self.proportion.closed_live -= 1;
        }
    }

    /// Checks GC's index against the table (for tests).
    pub fn check_victims(&self) {
        assert_eq!(
            self.proportion,
            Proportion::of(&self.segs),
            "garbage proportion"
        );
        self.victims.check(&self.segs, |i, _| self.collectable(i));
    }

    /// Free segments discarded since they were last written, as ascending runs
    /// `(first, count)` (what a checkpoint records, so that a restart does not
    /// discard them again).
    pub fn discarded_runs(&self) -> Vec<(u32, u32)> {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        for (i, s) in self.segs.iter().enumerate() {
            if s.state != SegState::Free || !s.clean || s.discarding {
                continue;
            }
            match runs.last_mut() {
                Some((first, count)) if *first + *count == i as u32 => *count += 1,
                _ => runs.push((i as u32, 1)),
            }
        }
        runs
    }

    pub fn is_withheld(&self, seg: u32) -> bool {
        self.withheld.iter().any(|r| r.contains(&seg))
    }

    /// The next free segment to discard, if any, marked as being discarded:
    /// one that has been free for `delay_ms` at `now_ms`, was not discarded since
    /// it was last written, is [`discardable`](Self::discardable) with `before`,
    /// lies beyond the first `window` of the queue (what allocation takes next),
    /// and is not `pinned` by a reader; or the first header a tail discard kept,
    /// once `before` is past what the segment held ([`Extent::Head`]), and only
    /// those with `heads_only`. Looks at no more than `scan` entries, going on
    /// from where the last call stopped. Each tier's queue is looked at on its
    /// own (`tier`).
    #[allow(clippy::too_many_arguments)]
    pub fn next_to_discard(
        &mut self,
        tier: Tier,
        now_ms: u64,
        delay_ms: u64,
        before: Option<Version>,
        window: usize,
        mut scan: usize,
        heads_only: bool,
        pinned: impl Fn(u32) -> bool,
    ) -> Option<(u32, Extent)> {
        let q = tier as usize;
        let len = self.free_in(tier).len();
        if before.is_none() || len <= window {
            return None;
        }
        let mut wrapped = false;
        while scan > 0 {
            if self.discard_cursor[q] < window || self.discard_cursor[q] >= len {
                if wrapped {
                    return None;
                }
                wrapped = true;
                self.discard_cursor[q] = window;
            }
            let seg = self.free_in(tier)[self.discard_cursor[q]];
            self.discard_cursor[q] += 1;
            scan -= 1;
            let s = &mut self.segs[seg as usize];
            // A clock that went back (an engine first driven inline, then by the
            // runtime's clock from 0) restarts the wait instead of never ending it.
            s.freed_ms = s.freed_ms.min(now_ms);
            if s.discarding || now_ms - s.freed_ms < delay_ms || (s.clean && !s.head_kept) {
                continue;
            }
            let head = s.clean;
            if heads_only && !head {
                continue;
            }
            let extent = match self.discardable(seg, before) {
                Some(Extent::Whole) if head => Some(Extent::Head),
                _ if head => None,
                e => e,
            };
            if let Some(extent) = extent.filter(|_| !pinned(seg)) {
                self.segs[seg as usize].discarding = true;
                self.discarding += 1;
                return Some((seg, extent));
            }
        }
        None
    }

    /// The discard of `extent` of free segment `seg` ended (`ok`: it succeeded).
    pub fn discard_done(&mut self, seg: u32, ok: bool, extent: Extent) {
        let s = &mut self.segs[seg as usize];
        assert!(
            s.discarding && s.state == SegState::Free,
            "discard of segment {seg} ended"
        );
        s.discarding = false;
        // A failed discard is not retried: the segment is rewritten anyway when reused.
        s.discarded(extent);
        self.discarding -= 1;
        // (A kept header discarded later is not another segment discarded.)
        if ok && extent != Extent::Head {
            self.discarded += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(n: usize) -> SegmentTable {
        let mut segs: Vec<Seg> = (0..n).map(|_| Seg::free(0)).collect();
        for s in segs.iter_mut() {
            s.state = SegState::Closed;
            s.erase_count = 3;
        }
        SegmentTable::new(segs, VecDeque::new(), Version(1), 100, n as u32)
    }

    #[test]
    fn an_emptied_segment_is_free_two_synced_flushes_later_in_release_order() {
        let mut t = table(4);
        t.emptied(2, 5);
        t.emptied(0, 6);
        assert_eq!(t.in_release(), 2);
        assert!(t.wants_flush(4));
        t.synced(5);
        assert_eq!(t.release_ready, vec![2]);
        assert_eq!(t.segs[0].state, SegState::Draining);
        // Segment 2's record goes into flush 7, then 0's (drained by 6) into 8.
        assert_eq!(t.release_recorded(7), 2);
        t.synced(6);
        assert_eq!(t.release_recorded(8), 0);
        assert_eq!(t.released(6), 0);
        assert!(
            t.free_next_released(6, None, 0).is_none(),
            "record not durable"
        );
        // Both records durable: freed in the order they were sealed.
        assert_eq!(t.released(8), 2);
        assert_eq!(t.free_next_released(8, None, 0), Some(2));
        assert_eq!(t.free_next_released(8, None, 0), Some(0));
        assert_eq!(t.free, VecDeque::from(vec![2, 0]));
        assert_eq!(t.segs[2].state, SegState::Free);
        assert_eq!(t.segs[2].erase_count, 3, "wear is kept");
        assert_eq!(t.in_release(), 0);
        assert!(!t.wants_flush(8));
    }

    /// Free segments are discarded once they have stayed free for the delay, one
    /// at a time, never those allocation takes next, metadata segments opened
    /// after the durable checkpoint, those a reader holds, or those already
    /// discarded; data segments opened after the checkpoint all but their first
    /// header.
    #[test]
    fn free_segments_are_discarded_once_they_stay_free() {
        let mut t = table(8);
        // Segments 0..8 released in order at times 0, 10, .., 70; 5 (metadata)
        // and 6 (data) were opened after the durable checkpoint (version 10).
        for seg in 0..8 {
            t.segs[seg as usize].incarnation = if seg == 5 || seg == 6 {
                Version(12)
            } else {
                Version(5)
            };
            t.emptied(seg, 1);
        }
        t.segs[5].kind = StreamKind::Meta;
        t.synced(1);
        for _ in 0..8 {
            t.release_recorded(2);
        }
        for (i, now) in (0..8).zip((0..).step_by(10)) {
            assert_eq!(t.free_next_released(2, None, now), Some(i));
        }
        let pinned = |s: u32| s == 3;
        let next = |t: &mut SegmentTable, now| {
            t.next_to_discard(
                Tier::Capacity,
                now,
                35,
                Some(Version(10)),
                2,
                100,
                false,
                pinned,
            )
        };
        assert_eq!(
            next(&mut t, 70),
            Some((2, Extent::Whole)),
            "0 and 1 are allocation's next two"
        );
        assert!(t.segs[2].discarding);
        assert_eq!(next(&mut t, 70), None, "3 is pinned, 4 is too young");
        assert_eq!(
            next(&mut t, 200),
            Some((4, Extent::Whole)),
            "5 is metadata newer than the checkpoint"
        );
        assert_eq!(next(&mut t, 200), Some((6, Extent::Tail)));
        assert_eq!(next(&mut t, 200), Some((7, Extent::Whole)));
        assert_eq!(next(&mut t, 200), None);
        assert_eq!(t.discardable(1, None), None, "discards off");
        assert_eq!(
            t.next_to_discard(Tier::Capacity, 200, 35, None, 2, 100, false, pinned),
            None
        );
        // A clock that went back restarts the wait.
        t.segs[3].freed_ms = 500;
        assert_eq!(
            t.next_to_discard(
                Tier::Capacity,
                210,
                35,
                Some(Version(10)),
                2,
                100,
                false,
                |_| false
            ),
            None
        );
        assert_eq!(t.segs[3].freed_ms, 210);
        assert_eq!(
            t.next_to_discard(
                Tier::Capacity,
                245,
                35,
                Some(Version(10)),
                2,
                100,
                false,
                |_| false
            ),
            Some((3, Extent::Whole))
        );
        t.discard_done(3, true, Extent::Whole);
        t.discard_done(2, true, Extent::Whole);
        t.discard_done(4, false, Extent::Whole);
        assert!(t.segs[2].clean && !t.segs[2].discarding && t.segs[4].clean);
        assert_eq!((t.discarding, t.discarded), (2, 2));
        assert_eq!(next(&mut t, 200), None, "discarded ones are not again");
        // 6's tail is discarded; its first header goes once a checkpoint after
        // what it held (version 12) is durable, then never again.
        t.discard_done(6, true, Extent::Tail);
        t.discard_done(7, true, Extent::Whole);
        assert!(t.segs[6].clean && t.segs[6].head_kept);
        assert_eq!(next(&mut t, 200), None, "the checkpoint is older than 6");
        let later = |t: &mut SegmentTable, heads_only| {
            t.next_to_discard(
                Tier::Capacity,
                300,
                35,
                Some(Version(13)),
                2,
                100,
                heads_only,
                pinned,
            )
        };
        assert_eq!(later(&mut t, true), Some((6, Extent::Head)));
        t.discard_done(6, true, Extent::Head);
        assert!(t.segs[6].clean && !t.segs[6].head_kept);
        assert_eq!(t.discarded, 4, "a header is not another segment");
        assert_eq!(
            later(&mut t, false),
            Some((5, Extent::Whole)),
            "the metadata segment, once the checkpoint is past it"
        );
        assert_eq!(later(&mut t, false), None, "nothing left to discard");
        // A segment reused and freed again is discarded again.
        let pos = t.free.iter().position(|&s| s == 2).unwrap();
        t.free.remove(pos);
        t.segs[2].state = SegState::Closed;
        t.segs[2].incarnation = Version(7);
        t.emptied(2, 3);
        t.synced(3);
        t.release_recorded(4);
        assert_eq!(t.free_next_released(4, None, 300), Some(2));
        assert!(!t.segs[2].clean && t.segs[2].retired == Version(7));
        assert_eq!(next(&mut t, 400), Some((2, Extent::Whole)));
    }

    /// With no discard delay, a released segment is discarded before it joins the
    /// free queue, and later ones wait for it.
    #[test]
    fn a_segment_discarded_on_release_holds_back_later_ones() {
        let mut t = table(3);
        t.emptied(1, 1);
        t.emptied(2, 1);
        t.synced(1);
        t.release_recorded(2);
        t.release_recorded(2);
        // Segment 1 was opened before the durable checkpoint (version 10), 2 after.
        t.segs[1].incarnation = Version(5);
        t.segs[2].incarnation = Version(12);
        let discard = Some(Version(10));
        assert_eq!(t.discardable(1, discard), Some(Extent::Whole));
        assert_eq!(t.discardable(2, discard), Some(Extent::Tail));
        assert_eq!(t.discardable(1, None), None, "discards off");
        // Segment 2 is the metadata stream's: kept whole until a later checkpoint.
        t.segs[2].kind = StreamKind::Meta;
        assert_eq!(t.discardable(2, discard), None);
        t.discards.insert(1, None);
        assert!(t.free_next_released(2, discard, 0).is_none());
        assert!(t.free.is_empty(), "segment 2 must not overtake 1");
        *t.discards.get_mut(&1).unwrap() = Some(Extent::Whole);
        assert_eq!(t.free_next_released(2, discard, 0), Some(1));
        assert!(t.discards.is_empty());
        assert!(t.segs[1].clean, "not discarded again while free");
        assert_eq!(t.free_next_released(2, discard, 0), Some(2));
        assert!(!t.segs[2].clean);
        assert!(!t.segs[2].retired_data, "freed as a metadata segment");
        assert_eq!(t.discardable(2, discard), None);
        assert_eq!(t.discardable(1, discard), Some(Extent::Whole));
    }

    /// A segment reserved for the metadata stream and superseded before it was
    /// opened is judged by what it held while it was free.
    #[test]
    fn a_reserved_metadata_segment_keeps_what_it_held() {
        let mut t = table(2);
        t.segs[1].incarnation = Version(12);
        t.emptied(1, 1);
        t.synced(1);
        t.release_recorded(2);
        assert_eq!(t.free_next_released(2, None, 0), Some(1));
        assert!(t.segs[1].retired_data);
        t.free.retain(|&s| s != 1);
        t.segs[1].state = SegState::Meta;
        t.superseded(1);
        assert_eq!(t.discardable(1, Some(Version(10))), Some(Extent::Tail));
        t.release_recorded(3);
        assert_eq!(t.free_next_released(3, None, 0), Some(1));
        assert_eq!(
            (t.segs[1].retired, t.segs[1].retired_data),
            (Version(12), true)
        );
        assert_eq!(t.discardable(1, Some(Version(10))), Some(Extent::Tail));
    }

    #[test]
    fn superseded_metadata_segments_skip_draining() {
        let mut t = table(2);
        t.segs[1].state = SegState::Meta;
        t.superseded(1);
        assert_eq!(t.release_ready, vec![1]);
        assert!(t.wants_flush(0));
    }

    #[test]
    #[should_panic(expected = "segment 0 emptied")]
    fn emptying_a_segment_that_is_not_closed_is_a_bug() {
        let mut t = table(1);
        t.segs[0].state = SegState::Open;
        t.emptied(0, 1);
    }
}
