//! The segment table and the release pipeline: what each segment holds and where it
//! is in its life, and the queues that move emptied segments back to the free queue.
//!
//! A segment that GC (or overwrites) emptied cannot be reused at once: recovery
//! must never find a segment reused while something durable still points into it.
//! So an emptied segment goes through the *release protocol*:
//!
//! ```text
//! Closed ──emptied──▶ Draining ──its flush synced──▶ ReleaseReady
//!        ──release record sealed──▶ Releasing ──that flush synced (and, where
//!        discards are used, the discard done)──▶ Free (back of the free queue)
//! ```
//!
//! Segments leave `Releasing` in the order their release records were sealed, the
//! order recovery walks them. The engine decides when flushes happen and writes the
//! release records; this module owns the states and the queues, and checks every
//! transition against the state it expects.

use lamina_format::unit::StreamKind;
use std::collections::{HashMap, VecDeque};

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
    pub incarnation: u64,
    pub close_version: u64,
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
    pub(crate) fn free(erase_count: u32) -> Self {
        Seg {
            state: SegState::Free,
            kind: StreamKind::User,
            class: 0,
            volume: 0,
            valid: 0,
            write_ptr: 0,
            data_blocks: 0,
            incarnation: 0,
            close_version: 0,
            erase_count,
            has_summary: false,
            writes_inflight: 0,
            gen: 0,
            gc_exclude: false,
            born: 0,
            last_invalidated: 0,
            closed: 0,
            origins: None,
        }
    }
}

/// Every segment's state, the free queue and the release pipeline.
pub(crate) struct SegmentTable {
    pub segs: Vec<Seg>,
    /// Segments allocation may take, in the order recovery expects them taken
    /// (within a window; see `Engine::take_free`).
    pub free: VecDeque<u32>,
    /// Emptied, waiting for the flush generation in their `gen` to be synced.
    pub draining: Vec<u32>,
    /// Emptiness durable, waiting for the next flush to carry their release record.
    pub release_ready: Vec<u32>,
    /// Release record sealed, in sealing order, waiting for its flush to be synced.
    pub releasing: Vec<u32>,
    /// Released segments whose discard is under way (false) or done (true); they
    /// join the free queue in release order once done.
    pub discards: HashMap<u32, bool>,
    pub discarded: u64,
    /// Free segments set aside because their zone could not be reset.
    pub quarantined: u64,
}

impl SegmentTable {
    pub fn new(segs: Vec<Seg>, free: VecDeque<u32>) -> Self {
        debug_assert!(free
            .iter()
            .all(|&s| segs[s as usize].state == SegState::Free));
        SegmentTable {
            segs,
            free,
            draining: Vec::new(),
            release_ready: Vec::new(),
            releasing: Vec::new(),
            discards: HashMap::new(),
            discarded: 0,
            quarantined: 0,
        }
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

    /// Whether released segment `seg` is to be discarded before reuse: discards
    /// are on (`before` is `Some`) and it was opened before the durable
    /// checkpoint's start version `before`. Recovery from that checkpoint walks
    /// the segments opened after it in free-queue order and takes a run of empty
    /// ones for the end of what was allocated, so those must keep their units
    /// until reused (a segment opened before the checkpoint reads as stale to the
    /// walk either way).
    pub fn discardable(&self, seg: u32, before: Option<u64>) -> bool {
        before.is_some_and(|v| self.segs[seg as usize].incarnation < v)
    }

    /// Frees the first releasing segment if its release is durable and, where it
    /// is to be discarded (see [`SegmentTable::discardable`]), its discard is
    /// done: returns it.
    pub fn free_next_released(&mut self, synced: u64, discard_before: Option<u64>) -> Option<u32> {
        let &s = self.releasing.first()?;
        if self.segs[s as usize].gen > synced {
            return None;
        }
        if self.discardable(s, discard_before) && self.discards.get(&s) != Some(&true) {
            return None;
        }
        self.discards.remove(&s);
        self.releasing.remove(0);
        self.make_free(s);
        Some(s)
    }

    /// Returns `seg` to the back of the free queue as a new, empty segment (its
    /// wear is kept).
    pub fn make_free(&mut self, seg: u32) {
        let erase_count = self.segs[seg as usize].erase_count;
        self.segs[seg as usize] = Seg::free(erase_count);
        self.free.push_back(seg);
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
        SegmentTable::new(segs, VecDeque::new())
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
            t.free_next_released(6, None).is_none(),
            "record not durable"
        );
        // Both records durable: freed in the order they were sealed.
        assert_eq!(t.released(8), 2);
        assert_eq!(t.free_next_released(8, None), Some(2));
        assert_eq!(t.free_next_released(8, None), Some(0));
        assert_eq!(t.free, VecDeque::from(vec![2, 0]));
        assert_eq!(t.segs[2].state, SegState::Free);
        assert_eq!(t.segs[2].erase_count, 3, "wear is kept");
        assert_eq!(t.in_release(), 0);
        assert!(!t.wants_flush(8));
    }

    #[test]
    fn a_segment_to_discard_waits_for_its_discard_and_holds_back_later_ones() {
        let mut t = table(3);
        t.emptied(1, 1);
        t.emptied(2, 1);
        t.synced(1);
        t.release_recorded(2);
        t.release_recorded(2);
        // Segment 1 was opened before the durable checkpoint (version 10), 2 after.
        t.segs[1].incarnation = 5;
        t.segs[2].incarnation = 12;
        let discard = Some(10);
        assert!(t.discardable(1, discard) && !t.discardable(2, discard));
        assert!(!t.discardable(1, None), "discards off");
        t.discards.insert(1, false);
        assert!(t.free_next_released(2, discard).is_none());
        assert!(t.free.is_empty(), "segment 2 must not overtake 1");
        *t.discards.get_mut(&1).unwrap() = true;
        assert_eq!(t.free_next_released(2, discard), Some(1));
        assert!(t.discards.is_empty());
        assert_eq!(t.free_next_released(2, discard), Some(2));
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
