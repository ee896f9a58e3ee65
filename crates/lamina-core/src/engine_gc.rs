//! Garbage collection: relocating the live blocks of victim segments.
//!
//! When free segments fall below the start watermark the engine picks a victim with
//! the configured policy, reads its summary (or walks its unit headers when it has
//! none) to learn who owns each block, keeps the blocks the map still points at, and
//! reads them in batches. Each block's checksum is verified before it is appended to
//! its volume's GC stream, which is separate from the user stream so that relocated
//! (colder) data does not mix with fresh writes. When the victim holds nothing live it
//! enters the release protocol like any emptied segment.
//!
//! **Pacing** (SALSA 2.7, CSAL's user-write limiter; `gc_pacing`, off by default:
//! docs/design.md, "Pacing", has what it costs).
//! Between the start watermark and the floor, user blocks are let through against
//! credit GC earns as it moves a victim's live blocks, instead of running at full
//! speed until the floor stops them all at once. A victim with `live` of its
//! `blocks` live gains `blocks - live` free blocks for `live` moved, so each moved
//! block earns `(blocks - live) / live` blocks of credit (a victim with nothing
//! live earns its `blocks` at once), scaled by how far free space is above the
//! floor: with `d` free segments above the floor in a band of `w` (start - floor),
//! the scale is `2 d / w`, below 1 in the lower half of the band (GC gains on the
//! writes) and up to 2 just below the start (little held back); free space levels
//! off in the middle when GC can keep up at all. From the moment GC takes a victim
//! (reading its owners included) until it is done, user writes need credit: they
//! slow smoothly as GC falls behind rather than stopping at a watermark (the floor
//! can still be reached: segments GC empties become free only once released, after
//! the next sync). Credit is capped at one write unit, so that an idle spell does
//! not bank a burst; with GC idle nothing is held, and at the floor the floor rules
//! as before.

use crate::engine::{Engine, Purpose, SegState};
use crate::gc::{Candidate, Scope};
use crate::io::{IoCompletion, IoKind};
use crate::map::encode_device;
use crate::segments::Origins;
use crate::types::{Pba, RecordAddr, SegmentId, Version, VolumeId, BLOCK_SIZE};
use lamina_format::summary::SummaryHeader;
use lamina_format::unit::{kind, record_at, RawRecord, StreamKind, UnitHeader};

/// Live blocks read per GC batch.
const BATCH_BLOCKS: usize = 64;

#[derive(Default)]
pub(crate) struct GcState {
    phase: Phase,
    /// GC runs from the start watermark until the stop watermark (hysteresis).
    active: bool,
    pub victims: u64,
    spare: Vec<Vec<u8>>,
    /// Volumes by garbage, reused by `pick_victim`.
    vols: Vec<(u64, u16)>,
    /// Segments with a read error on a member, to move elsewhere.
    repair: Vec<u32>,
    /// Segments moved because of a read error.
    pub repaired: u64,
    /// Whether user writes wait at the user floor now, and how many times they
    /// did (each wait counted once, however long it lasts).
    held_at_floor: bool,
    pub floor_waits: u64,
    /// Pacing: user blocks that may be written now (see the module's comment).
    credit: f64,
    /// Whether user writes wait for credit now, and how many times they did.
    held_for_credit: bool,
    pub pace_waits: u64,
    /// The volumes that map the block being moved, reused for every block.
    refs: Vec<crate::types::VolumeId>,
    /// A victim's live blocks, its batch of runs and their reads, kept from the
    /// victim before (see [`Engine::gc_done_with_victim`]).
    spare_live: Vec<(Pba, RawRecord)>,
    spare_batch: Vec<Run>,
    spare_reads: Vec<(usize, Pba, usize)>,
    /// Compaction (arrays with a cache tier) runs from the cache's start
    /// watermark until its stop watermark.
    compacting: bool,
    /// Cache segments compacted, and blocks compaction moved to the capacity tier.
    pub compactions: u64,
    pub compacted_blocks: u64,
}

#[derive(Default)]
enum Phase {
    #[default]
    Idle,
    /// Reading the victim's summary, or its unit header at `offset` when walking.
    Owners {
        seg: u32,
        incarnation: Version,
        walking: bool,
        offset: u32,
        live: Vec<(Pba, RawRecord)>,
    },
    Relocate {
        seg: u32,
        incarnation: Version,
        live: Vec<(Pba, RawRecord)>,
        next: usize,
        batch: Vec<Run>,
        reads_pending: u32,
        run_pos: usize,
        block_pos: usize,
    },
}

struct Run {
    first: usize,
    count: usize,
    /// Blocks read: from the first live block to the last (dead ones between).
    span: usize,
    data: Option<Vec<u8>>,
    failed: bool,
}

impl GcState {
    pub(crate) fn is_idle(&self) -> bool {
        matches!(self.phase, Phase::Idle)
    }
}

impl Engine {
    /// The next victim: among volumes, the one with the most garbage in collectable
    /// segments; within it, the segment its victim policy chooses.
    /// A segment where a member failed a read: its blocks were served from parity;
    /// GC moves them to healthy space so nothing depends on the bad spot again.
    fn repair_victim(&mut self) -> Option<u32> {
        if let Some(st) = &self.shared.striped {
            for s in st.take_repairs() {
                let seg = self.geo.stripe_segment(s);
                if !self.gc.repair.contains(&seg) {
                    self.gc.repair.push(seg);
                }
            }
        }
        // Free ones need nothing, metadata and excluded ones are not GC's to move;
        // open ones are closed so that they can be moved.
        self.gc.repair.retain(|&s| {
            let sg = &self.segments.segs[s as usize];
            sg.state != SegState::Free && sg.kind != StreamKind::Meta && !sg.gc_exclude
        });
        for k in 0..self.gc.repair.len() {
            let seg = self.gc.repair[k];
            if let Some(s) = self.log.streams.iter().position(|st| st.seg == Some(seg)) {
                if self.log.streams[s].kind != StreamKind::Meta {
                    self.close_segment(s);
                }
            }
        }
        let i = self.gc.repair.iter().position(|&s| {
            let sg = &self.segments.segs[s as usize];
            sg.state == SegState::Closed && sg.kind != StreamKind::Meta && !sg.gc_exclude
        })?;
        Some(self.gc.repair.swap_remove(i))
    }

    /// Puts up to `most` more segments of `range` that hold data on GC's repair
    /// list, to be moved whatever their garbage (`array evacuate`).
    pub(crate) fn move_segments(&mut self, range: std::ops::Range<u32>, most: usize) {
        let mut room = most.saturating_sub(self.gc.repair.len());
        for s in range {
            if room == 0 {
                return;
            }
            let sg = &self.segments.segs[s as usize];
            if sg.state != SegState::Free
                && sg.kind != StreamKind::Meta
                && !sg.gc_exclude
                && !self.gc.repair.contains(&s)
            {
                self.gc.repair.push(s);
                room -= 1;
            }
        }
    }

    /// Whether GC has repairs to make (stripes on the repair list, or a victim
    /// being moved): recovery drives the engine until none are left when a crash
    /// left rows whose parity could not be resynced.
    pub(crate) fn repairs_pending(&self) -> bool {
        // Only what GC will still move counts: a victim once emptied may be named
        // again by the reads that moved it.
        let movable = |s: u32| {
            let sg = &self.segments.segs[s as usize];
            let open = self.log.streams.iter().any(|st| st.seg == Some(s));
            (sg.state == SegState::Closed || open) && sg.kind != StreamKind::Meta && !sg.gc_exclude
        };
        self.gc.repair.iter().any(|&s| movable(s))
            || !matches!(self.gc.phase, Phase::Idle)
            || self
                .shared
                .striped
                .as_ref()
                .is_some_and(|st| st.repairs_waiting())
    }

    /// Segments GC has moved for repair so far.
    pub(crate) fn repaired_segments(&self) -> u64 {
        self.gc.repaired
    }

    /// The next victim: in the volume with the most garbage (or the next, if it
    /// has no candidate), the one its policy prefers, found through the
    /// segment table's index of candidates (see `victims.rs`) without looking at
    /// every segment.
    pub(crate) fn pick_victim(&mut self) -> Option<u32> {
        // A segment closed early (half dead while open, or at shutdown) frees its
        // unwritten tail too: its capacity is the full segment.
        let full = self.geo.data_blocks_per_segment() as u32;
        // Under the garbage-proportion trigger alone (free space is not short), a
        // victim must hold at least that proportion of garbage itself, as in
        // SepBIT: otherwise GC spends a segment's worth of writes to free little,
        // and on a working set of a few segments keeps rewriting what it wrote.
        let min_garbage = match self.cfg.gc_garbage_ratio {
            Some(r) if self.segments.free.len() >= self.gc_start_segments() => {
                ((full as f64 * r).ceil() as u32).max(1)
            }
            _ => 1,
        };
        let limit = full.saturating_sub(min_garbage);
        let mut vols = std::mem::take(&mut self.gc.vols);
        self.segments.victims.volumes_with_garbage(&mut vols);
        // The volume with the most garbage, then (rarely: when none of its
        // segments holds enough garbage alone) the others in turn.
        let first = vols.iter().copied().max();
        let mut pick = first.and_then(|(_, vol)| self.pick_victim_in(VolumeId(vol), limit));
        if pick.is_none() && vols.len() > 1 {
            vols.sort_unstable_by(|a, b| b.cmp(a));
            pick = vols[1..]
                .iter()
                .find_map(|&(_, vol)| self.pick_victim_in(VolumeId(vol), limit));
        }
        self.gc.vols = vols;
        pick
    }

    /// The victim of volume `vol` with at most `limit` live blocks, if any.
    fn pick_victim_in(&mut self, vol: VolumeId, limit: u32) -> Option<u32> {
        let full = self.geo.data_blocks_per_segment() as u32;
        let v = self.volumes.get(vol.0 as usize)?.as_ref()?;
        let now = v.user_blocks;
        let segs = &self.segments.segs;
        let candidate = |i: u32| crate::victims::candidate(&segs[i as usize], i, full, now);
        // What each class of the volume holds and has received, including classes
        // that segments written under another configuration carry (nothing is
        // written to those any more).
        let index = &self.segments.victims;
        let classes: Vec<crate::gc::ClassInfo> = (0..v.classes.len().max(index.classes(vol.0)))
            .map(|k| {
                let (live, held) = index.class_totals(vol.0, k as u8);
                crate::gc::ClassInfo {
                    live,
                    // Every segment counts for its full size: the class holds it.
                    space: held * full as u64,
                    written: v.classes.get(k).map_or(0, |c| c.blocks),
                }
            })
            .collect();
        // The space this volume may use: what it holds plus the free segments, or
        // under a garbage-proportion trigger the space at which GC holds it.
        let mut capacity = classes.iter().map(|c| c.space).sum::<u64>()
            + self.segments.free.len() as u64 * full as u64;
        if let Some(ratio) = self.cfg.gc_garbage_ratio {
            let live: u64 = classes.iter().map(|c| c.live).sum();
            capacity = capacity.min((live as f64 / (1.0 - ratio)) as u64);
        }
        let n = segs.len() as u32;
        // The volume keeps several classes open, or its segments still hold blocks
        // of several user or GC classes of its classifier (the read-hot and small
        // streams past them are not heat classes): blocks sit apart by heat.
        let uc = (v.user_classes as usize).min(classes.len());
        let gc_end = (uc + v.classifier.gc_classes() as usize).min(classes.len());
        let held = |cs: &[crate::gc::ClassInfo]| cs.iter().filter(|c| c.live > 0).count();
        let separating = v.caps.user > 1
            || v.caps.gc > 1
            || held(&classes[..uc]) > 1
            || held(&classes[uc..gc_end]) > 1;
        let policy = &mut self.volumes[vol.0 as usize].as_mut().unwrap().policy;
        policy.separating(separating);
        let scope = policy.scope(&classes, capacity, &|k| {
            index.any_candidate(vol.0, k, limit, |i| &segs[i as usize])
        });
        let class = match scope {
            Scope::All => None,
            Scope::Class(k) => Some(k),
            Scope::Nothing => return None,
        };
        let sampled = policy.sample(n, &mut |i| {
            let c = candidate(i);
            (index.is_candidate(i)
                && segs[i as usize].volume == vol.0
                && class.is_none_or(|k| k == c.class)
                && c.valid <= limit.min(full.saturating_sub(1)))
            .then_some(c)
        });
        if sampled.is_some() {
            return sampled;
        }
        let q = crate::victims::Query {
            vol: vol.0,
            class,
            limit,
            now,
            wear_window: self.cfg.wear_window,
        };
        index.best(&q, &**policy, &candidate)
    }

    /// Checks GC's index of candidates against the segment table (for tests), and
    /// that each volume's best victim by its policy's score (without the wear
    /// tie-break) scores what a scan of every candidate finds.
    #[doc(hidden)]
    pub fn check_gc_index(&self) {
        self.segments.check_victims();
        let full = self.geo.data_blocks_per_segment() as u32;
        let segs = &self.segments.segs;
        // With a cache tier: user data is written into cache segments only,
        // GC's and the metadata stream's into capacity segments only, and each
        // free queue holds its own tier's segments.
        if self.geo.tiered() {
            for (i, s) in segs.iter().enumerate() {
                if matches!(
                    s.state,
                    SegState::Open | SegState::Closing | SegState::Closed
                ) {
                    assert_eq!(
                        self.geo.is_cache(i as u32),
                        s.kind == StreamKind::User,
                        "segment {i} ({:?}, {:?}, {} live of {}) is in the wrong tier",
                        s.state,
                        s.kind,
                        s.valid,
                        s.data_blocks
                    );
                }
            }
            assert!(self.segments.free.iter().all(|&s| !self.geo.is_cache(s)));
            assert!(self
                .segments
                .cache_free
                .iter()
                .all(|&s| self.geo.is_cache(s)));
        }
        for (vi, v) in self.volumes.iter().enumerate() {
            let Some(v) = v else { continue };
            let now = v.user_blocks;
            let candidate = |i: u32| crate::victims::candidate(&segs[i as usize], i, full, now);
            let all: Vec<Candidate> = (0..segs.len() as u32)
                .filter(|&i| {
                    segs[i as usize].volume as usize == vi
                        && self.segments.collectable(i)
                        && !self.geo.is_cache(i)
                })
                .map(candidate)
                .collect();
            let q = crate::victims::Query {
                vol: vi as u16,
                class: None,
                limit: full,
                now,
                wear_window: 0.0,
            };
            let p = &*v.policy;
            let got = self.segments.victims.best(&q, p, &candidate);
            let want = crate::gc::select_by_score(&all, |c| p.score(c), 0.0);
            assert_eq!(
                got.map(|g| p.score(&candidate(g))),
                want.map(|w| p.score(&all[w])),
                "volume {vi}: {}'s pick",
                p.name()
            );
        }
    }

    /// Prefetches the map entries the data records `range` of `buf` name, before
    /// [`Engine::is_live`] looks them up one by one (a victim's blocks are
    /// scattered over the map: each lookup would otherwise wait on memory alone).
    fn prefetch_owners(&self, buf: &[u8], range: std::ops::Range<usize>) {
        for i in range {
            let r = record_at(buf, i);
            if r.kind != kind::DATA {
                continue;
            }
            if let Some(Some(v)) = self.volumes.get(r.vol().0 as usize) {
                v.shared.map.prefetch(r.block());
            }
        }
    }

    fn is_live(&self, pba: Pba, r: &RawRecord) -> bool {
        if r.kind != kind::DATA {
            return false;
        }
        let (lba, e) = (r.block(), encode_device(pba));
        let live_in = |v: VolumeId| {
            self.volumes
                .get(v.0 as usize)
                .and_then(|v| v.as_ref())
                // A volume being deleted keeps its blocks where they are until the
                // deletion commits (see `Vol::deleting`).
                .is_some_and(|v| v.deleting.is_none() && v.shared.map.load(lba) == e)
        };
        match self.lineage.family(r.vol()) {
            None => live_in(r.vol()),
            // Snapshots and clones: live while any member of the family maps it.
            Some(f) => self.lineage.members(f).iter().any(|&m| live_in(m)),
        }
    }

    pub(crate) fn progress_gc(&mut self) {
        // A rollback in progress: nothing moves until its checkpoint commits.
        if self.failed.is_some() || self.rollback_until.is_some() {
            return;
        }
        // Shut down: a victim under way is finished, no new one is picked.
        if self.closed && matches!(self.gc.phase, Phase::Idle) {
            return;
        }
        match &self.gc.phase {
            Phase::Idle => {
                let free = self.segments.free.len();
                if free < self.gc_start_segments() {
                    self.gc.active = true;
                }
                if free >= self.gc_stop_segments() {
                    self.gc.active = false;
                }
                if let Some(ratio) = self.cfg.gc_garbage_ratio {
                    if self.segments.garbage_proportion() > ratio {
                        self.gc.active = true;
                    }
                }
                let compact = self.compaction_due();
                let seg = match self.repair_victim() {
                    Some(seg) => {
                        self.gc.repaired += 1;
                        seg
                    }
                    None => {
                        // Compaction moves the cache's oldest segment to the
                        // capacity tier, as a user write would fill it: not into
                        // the capacity tier's floor, which GC keeps for itself.
                        let cached = if compact && free > self.user_floor() {
                            let oldest = self.segments.victims.oldest_cached();
                            if oldest.is_none()
                                && self.segments.cache_free.is_empty()
                                && !self.cache_segment_on_its_way()
                            {
                                // Every cache segment is a user stream's open
                                // head (many volumes or classes on a small
                                // cache): close the fullest, so that compaction
                                // has a victim once its summary is written.
                                if let Some(s) = self.cache_head_to_close() {
                                    self.close_segment(s);
                                }
                            }
                            oldest
                        } else {
                            None
                        };
                        let Some(seg) = cached.or_else(|| {
                            if self.gc.active {
                                self.pick_victim()
                            } else {
                                None
                            }
                        }) else {
                            return;
                        };
                        if self.geo.is_cache(seg) {
                            self.gc.compactions += 1;
                        }
                        seg
                    }
                };
                self.gc.victims += 1;
                let (class, born, volume) = {
                    let s = &self.segments.segs[seg as usize];
                    (s.class, s.born, s.volume)
                };
                if let Some(v) = self
                    .volumes
                    .get_mut(volume as usize)
                    .and_then(|v| v.as_mut())
                {
                    let now = v.user_blocks;
                    // What the classifier learns from a victim's age is GC's
                    // turnover; a cache segment's is the cache's, not the same.
                    if !self.geo.is_cache(seg) {
                        v.classifier.segment_collected(class, born, now);
                    }
                    if let Some(c) = v.classes.get_mut(class as usize) {
                        c.victims += 1;
                    }
                }
                let has_summary = self.segments.segs[seg as usize].has_summary;
                self.gc.phase = Phase::Owners {
                    seg,
                    incarnation: self.segments.segs[seg as usize].incarnation,
                    walking: !has_summary,
                    offset: 0,
                    live: std::mem::take(&mut self.gc.spare_live),
                };
                self.gc_read_owners();
            }
            Phase::Owners { .. } => {}
            Phase::Relocate { .. } => self.gc_relocate(),
        }
    }

    /// Issues the read for the current owners step (summary or one unit header).
    fn gc_read_owners(&mut self) {
        let Phase::Owners {
            seg,
            walking,
            offset,
            ..
        } = &self.gc.phase
        else {
            return;
        };
        let (seg, walking, offset) = (*seg, *walking, *offset);
        let (start, blocks) = if walking {
            (offset, self.geo.header_blocks as u32)
        } else {
            (self.geo.data_end, self.geo.summary_blocks)
        };
        let (dev, off) = self.geo.locate(SegmentId(seg), start);
        let mut buf = self.gc.spare.pop().unwrap_or_default();
        buf.clear();
        buf.resize(blocks as usize * BLOCK_SIZE, 0);
        self.submit_io(Purpose::GcMeta, dev, off, IoKind::Read { buf });
    }

    /// The summary or a unit header of the victim arrived. Its buffer goes back
    /// to the spares once read, as every buffer of GC's does (GC allocates
    /// nothing per victim once it has run for a while).
    pub(crate) fn gc_meta_done(&mut self, mut c: IoCompletion) {
        let mut buf = c.buf.take().unwrap_or_default();
        self.gc_owners_arrived(c.result.is_ok(), &mut buf);
        self.gc.spare.push(buf);
    }

    /// [`Engine::gc_meta_done`]: what `buf` holds (`ok`: read without error).
    fn gc_owners_arrived(&mut self, ok: bool, buf: &mut Vec<u8>) {
        let Phase::Owners {
            seg,
            incarnation,
            walking,
            offset,
            mut live,
        } = std::mem::take(&mut self.gc.phase)
        else {
            panic!("GC metadata completion outside the owners phase");
        };
        if !self.victim_unchanged(seg, incarnation) {
            // Emptied and released meanwhile: nothing left to do.
            live.clear();
            self.gc.spare_live = live;
            return;
        }
        let (sg_incarnation, sg_write_ptr) = {
            let s = &self.segments.segs[seg as usize];
            (s.incarnation, s.write_ptr)
        };
        if !walking {
            let parsed = if ok {
                SummaryHeader::decode(buf).ok()
            } else {
                None
            };
            match parsed {
                Some(h)
                    if h.segment == seg
                        && h.incarnation == sg_incarnation.0
                        && h.array_id == self.geo.array_id =>
                {
                    let mut i = 0usize;
                    while i < h.record_count as usize {
                        let u = record_at(buf, i);
                        i += 1;
                        if u.kind != kind::UNIT {
                            continue;
                        }
                        let (uoff, d, hb) = (u.a as u32, u.b, u.c as u32);
                        let end = (i + d as usize).min(h.record_count as usize);
                        self.prefetch_owners(buf, i..end);
                        for k in 0..d as usize {
                            if i + k >= h.record_count as usize {
                                break;
                            }
                            let r = record_at(buf, i + k);
                            let pba = self.geo.pba(SegmentId(seg), uoff + hb + k as u32);
                            if self.is_live(pba, &r) {
                                live.push((pba, r));
                            }
                        }
                        i += d as usize;
                    }
                    self.gc_start_relocation(seg, incarnation, live);
                }
                _ => {
                    tracing::warn!(
                        segment = seg,
                        "summary unreadable; walking unit headers instead"
                    );
                    self.gc.phase = Phase::Owners {
                        seg,
                        incarnation,
                        walking: true,
                        offset: 0,
                        live,
                    };
                    self.gc_read_owners();
                }
            }
            return;
        }
        // Walking unit headers.
        let fits = |h: &UnitHeader| {
            h.segment == seg
                && h.offset == offset
                && h.incarnation == sg_incarnation.0
                && h.array_id == self.geo.array_id
        };
        let mut header = if ok {
            UnitHeader::decode(buf).ok().filter(fits)
        } else {
            None
        };
        if header.is_none() && offset < sg_write_ptr {
            // Damaged on one member? Rebuilt from parity (a rare path, on this
            // thread): blocks described by a header GC cannot read stay behind.
            let (dev, off) = self.geo.locate(SegmentId(seg), offset);
            buf.resize(self.geo.header_blocks as usize * BLOCK_SIZE, 0);
            header = self
                .shared
                .read_decoded(dev, off, buf, |b| UnitHeader::decode(b).ok().filter(fits))
                .ok()
                .flatten();
        }
        let next = match header {
            Some(h) => {
                for k in 0..h.data_blocks as usize {
                    let r = record_at(buf, k);
                    let pba = self
                        .geo
                        .pba(SegmentId(seg), offset + h.header_blocks as u32 + k as u32);
                    if self.is_live(pba, &r) {
                        live.push((pba, r));
                    }
                }
                Some(offset + h.total_blocks())
            }
            _ => None,
        };
        match next {
            Some(n) if n < sg_write_ptr => {
                self.gc.phase = Phase::Owners {
                    seg,
                    incarnation,
                    walking: true,
                    offset: n,
                    live,
                };
                self.gc_read_owners();
            }
            Some(_) => self.gc_start_relocation(seg, incarnation, live),
            None => {
                // A header we cannot read: the blocks it describes stay where they
                // are (reads of them report the damage) and the segment is not
                // collected again.
                tracing::error!(
                    segment = seg,
                    offset,
                    "unit header damaged during garbage collection"
                );
                self.segments.exclude(seg);
                self.gc_start_relocation(seg, incarnation, live);
            }
        }
    }

    /// Compaction's watermarks: free cache segments below which it starts, and
    /// at which it stops. A quarter of the cache is kept free for bursts; what
    /// stays in the rest is what later writes may still overwrite there, and a
    /// block overwritten in the cache never costs the capacity tier a write.
    pub(crate) fn cache_watermarks(&self) -> (usize, usize) {
        let n = self.geo.cache_segments() as usize;
        let start = (n / 4).max(4);
        (start, start + (n / 8).max(2))
    }

    /// A cache segment is closing (a victim for compaction once its summary is
    /// written) or on its way back to the free queue: one more head need not be
    /// closed for now.
    fn cache_segment_on_its_way(&self) -> bool {
        self.segments.segs[self.geo.cache_first as usize..]
            .iter()
            .any(|s| {
                matches!(
                    s.state,
                    SegState::Closing
                        | SegState::Draining
                        | SegState::ReleaseReady
                        | SegState::Releasing
                )
            })
    }

    /// The user stream whose open cache segment holds the most, if any holds
    /// anything: the one to close when no closed cache segment is left to compact.
    pub(crate) fn cache_head_to_close(&self) -> Option<usize> {
        (0..self.log.streams.len())
            .filter_map(|s| {
                let st = &self.log.streams[s];
                let seg = st
                    .seg
                    .filter(|&seg| st.kind == StreamKind::User && self.geo.is_cache(seg))?;
                let used = self.segments.segs[seg as usize].write_ptr;
                (used > 0).then_some((used, s))
            })
            .max()
            .map(|(_, s)| s)
    }

    /// Whether compaction should run now (arrays with a cache tier), with
    /// hysteresis between the watermarks.
    fn compaction_due(&mut self) -> bool {
        if !self.geo.tiered() {
            return false;
        }
        let (start, stop) = self.cache_watermarks();
        let free = self.segments.cache_free.len();
        if free < start {
            self.gc.compacting = true;
        }
        if free >= stop {
            self.gc.compacting = false;
        }
        self.gc.compacting
    }

    /// Whether user stream `stream` can take one more block now: pacing allows it
    /// and its unit has room. Pacing is asked first: a held block must not take a
    /// buffer or open a segment (GC may need the buffer to earn the credit).
    pub(crate) fn room_for_user_block(&mut self, stream: usize) -> bool {
        // A rollback holds GC until its checkpoint commits: user writes wait too,
        // so that the free segments that checkpoint needs stay free.
        if self.rollback_until.is_some()
            || self.held_for_credit()
            || self.ensure_unit(stream, 1, 0).is_err()
        {
            self.user_block_held();
            return false;
        }
        true
    }

    /// Where user writes take their segments, as `(free, floor, start)`: the free
    /// segments there, the floor user streams leave, and the watermark at which
    /// what frees segments there starts (GC's; with a cache tier, the cache's,
    /// where the floor is 0 and compaction frees segments).
    pub(crate) fn user_room(&self) -> (usize, usize, usize) {
        if self.geo.tiered() {
            (self.segments.cache_free.len(), 0, self.cache_watermarks().0)
        } else {
            (
                self.segments.free.len(),
                self.user_floor(),
                self.gc_start_segments(),
            )
        }
    }

    /// A user block could not be written now: counts a wait at the floor.
    fn user_block_held(&mut self) {
        let (free, floor, _) = self.user_room();
        if free <= floor && !self.gc.held_at_floor {
            self.gc.held_at_floor = true;
            self.gc.floor_waits += 1;
        }
    }

    /// A user block was written: a wait at the floor or for credit, if any, is over.
    pub(crate) fn user_block_written(&mut self) {
        self.gc.held_at_floor = false;
        self.gc.held_for_credit = false;
    }

    /// What pacing's holds depend on besides free space: whether GC is idle, and
    /// its credit (as bits, to compare exactly).
    pub(crate) fn gc_progress_mark(&self) -> (bool, u64) {
        (self.gc.is_idle(), self.gc.credit.to_bits())
    }

    /// Pacing's band: `(d, w)`, free segments above the floor and start - floor,
    /// when free space lies strictly between the floor and the start watermark.
    /// With a cache tier, of the cache: user writes wait for compaction there
    /// (between no free cache segment and compaction's start watermark).
    fn pacing_band(&self) -> Option<(f64, f64)> {
        let (free, floor, start) = self.user_room();
        (floor < free && free < start).then(|| ((free - floor) as f64, (start - floor) as f64))
    }

    /// Whether freeing segment `seg` makes room for user writes: any segment
    /// without a cache tier, a cache segment with one (the capacity tier's GC
    /// earns user writes nothing).
    fn frees_user_room(&self, seg: u32) -> bool {
        !self.geo.tiered() || self.geo.is_cache(seg)
    }

    /// Pacing: whether user blocks need credit now.
    fn pacing(&self) -> bool {
        // With a cache tier, also while the capacity tier's GC runs: it earns user
        // writes nothing, but compaction waits for it, so the cache would only
        // fill meanwhile (measured: letting writes run then gave 2420 waits at an
        // empty cache instead of none; `basic::pipelined_overwrites_on_a_cache_tier_are_paced`).
        self.cfg.gc_pacing && !self.gc.is_idle() && self.pacing_band().is_some()
    }

    /// Pacing: whether the next user block must wait for credit (counted once per
    /// wait). Asked before the block takes a buffer or a segment.
    pub(crate) fn held_for_credit(&mut self) -> bool {
        if !self.pacing() || self.gc.credit >= 1.0 {
            return false;
        }
        if !self.gc.held_for_credit {
            self.gc.held_for_credit = true;
            self.gc.pace_waits += 1;
        }
        true
    }

    /// Pacing: a user block is being written; it takes its credit. Opening its
    /// segment may have brought the free count into the band since the check, so
    /// the credit may go below zero: the blocks after it repay it.
    pub(crate) fn spend_credit(&mut self) {
        if self.pacing() {
            self.gc.credit -= 1.0;
        }
    }

    /// Pacing: credit for `freed` blocks GC has just gained (net of what it moved).
    fn earn_credit(&mut self, freed: f64) {
        let Some((d, w)) = self.pacing_band() else {
            return;
        };
        // Below 1 in the lower half of the band (GC gains on the writes), up to 2
        // just below the start (little held back).
        let scale = 2.0 * d / w;
        let cap = self.geo.unit_data_max as f64;
        self.gc.credit = (self.gc.credit + freed * scale).min(cap);
    }

    /// GC is done with its victim (moved, or gone meanwhile): idle again, its
    /// vectors kept for the next one, and the data buffers of runs not yet
    /// relocated back with the spares.
    fn gc_done_with_victim(&mut self) {
        match std::mem::take(&mut self.gc.phase) {
            Phase::Idle => {}
            Phase::Owners { mut live, .. } => {
                live.clear();
                self.gc.spare_live = live;
            }
            Phase::Relocate {
                mut live,
                mut batch,
                ..
            } => {
                live.clear();
                self.gc.spare_live = live;
                for run in batch.drain(..) {
                    if let Some(d) = run.data {
                        self.gc.spare.push(d);
                    }
                }
                self.gc.spare_batch = batch;
            }
        }
    }

    /// The victim is still the closed segment incarnation GC started on.
    fn victim_unchanged(&self, seg: u32, incarnation: Version) -> bool {
        let s = &self.segments.segs[seg as usize];
        s.state == SegState::Closed && s.incarnation == incarnation
    }

    fn gc_start_relocation(&mut self, seg: u32, incarnation: Version, live: Vec<(Pba, RawRecord)>) {
        if live.is_empty() && self.frees_user_room(seg) {
            self.earn_credit(self.geo.segment_blocks as f64);
        }
        self.gc.phase = Phase::Relocate {
            seg,
            incarnation,
            live,
            next: 0,
            batch: std::mem::take(&mut self.gc.spare_batch),
            reads_pending: 0,
            run_pos: 0,
            block_pos: 0,
        };
        self.gc_relocate();
    }

    /// Reads the next batch, or relocates the blocks of the batch that arrived.
    fn gc_relocate(&mut self) {
        loop {
            let (s, inc, pending) = match &self.gc.phase {
                Phase::Relocate {
                    seg,
                    incarnation,
                    reads_pending,
                    ..
                } => (*seg, *incarnation, *reads_pending),
                _ => return,
            };
            if pending > 0 {
                return;
            }
            if !self.victim_unchanged(s, inc) {
                // Emptied (and perhaps reused) while GC waited: what it read is stale.
                self.gc_done_with_victim();
                return;
            }
            let Phase::Relocate {
                seg,
                live,
                next,
                batch,
                reads_pending,
                ..
            } = &mut self.gc.phase
            else {
                return;
            };
            if batch.is_empty() {
                if *next >= live.len() {
                    let seg = *seg;
                    self.gc_done_with_victim();
                    let s = &self.segments.segs[seg as usize];
                    if s.state == SegState::Closed && s.valid > 0 {
                        // Blocks we could not move (damaged header) stay where they are.
                        tracing::warn!(
                            segment = seg,
                            valid = s.valid,
                            "victim keeps blocks that could not be relocated"
                        );
                    }
                    return;
                }
                // Group the next live blocks into runs of consecutive physical blocks.
                // A batch fills about one write unit of the GC stream.
                let batch_blocks = BATCH_BLOCKS.max(self.geo.unit_data_max as usize);
                let end = (*next + batch_blocks).min(live.len());
                let mut i = *next;
                let gap = self.cfg.gc_read_gap_blocks;
                while i < end {
                    let mut n = 1;
                    // A run spans at most this many blocks, so that a sparse batch
                    // does not become one huge read.
                    let max_span = (4 * self.geo.write_unit_blocks).max(1024);
                    while i + n < end
                        && live[i + n].0 .0 > live[i + n - 1].0 .0
                        && live[i + n].0 .0
                            <= live[i + n - 1].0 .0.saturating_add(gap.saturating_add(1))
                        && live[i + n].0 .0 - live[i].0 .0 < max_span
                    {
                        n += 1;
                    }
                    batch.push(Run {
                        first: i,
                        count: n,
                        span: (live[i + n - 1].0 .0 - live[i].0 .0) as usize + 1,
                        data: None,
                        failed: false,
                    });
                    i += n;
                }
                *next = end;
                if self.cfg.metadata_only {
                    // Simulation: there are no data bytes to read.
                    continue;
                }
                let seg = *seg;
                let mut runs = std::mem::take(&mut self.gc.spare_reads);
                runs.extend(
                    batch
                        .iter()
                        .enumerate()
                        .map(|(k, r)| (k, live[r.first].0, r.span)),
                );
                *reads_pending = runs.len() as u32;
                for &(k, pba, count) in &runs {
                    let (_, off_in_seg) = self.geo.split(pba);
                    let (dev, off) = self.geo.locate(SegmentId(seg), off_in_seg);
                    let mut buf = self.gc.spare.pop().unwrap_or_default();
                    buf.resize(count * BLOCK_SIZE, 0);
                    self.submit_io(
                        Purpose::GcRead {
                            batch_index: k as u32,
                        },
                        dev,
                        off,
                        IoKind::Read { buf },
                    );
                }
                runs.clear();
                self.gc.spare_reads = runs;
                return;
            }
            if !self.gc_relocate_batch() {
                return; // blocked on a buffer or segment
            }
        }
    }

    /// Reads one block of a victim on the engine thread (the rare retry of a run
    /// read across dead blocks that failed).
    fn gc_read_block(&self, seg: u32, pba: Pba) -> Option<Vec<u8>> {
        let (_, off_in_seg) = self.geo.split(pba);
        let (dev, off) = self.geo.locate(SegmentId(seg), off_in_seg);
        let mut b = vec![0u8; BLOCK_SIZE];
        self.shared.devices[dev]
            .read_at(&mut b, off)
            .ok()
            .map(|_| b)
    }

    /// Relocates the blocks of the current batch. False when blocked.
    fn gc_relocate_batch(&mut self) -> bool {
        if self.rollback_until.is_some() {
            return false; // resumed once the rollback's checkpoint commits
        }
        let Phase::Relocate {
            seg,
            live,
            batch,
            run_pos,
            block_pos,
            ..
        } = &mut self.gc.phase
        else {
            return true;
        };
        let seg = *seg;
        let mut live_local = std::mem::take(live);
        let mut batch_local = std::mem::take(batch);
        let (mut rp, mut bp) = (*run_pos, *block_pos);
        let mut blocked = false;
        let mut moved = 0usize;
        let mut refs = std::mem::take(&mut self.gc.refs);
        'runs: while rp < batch_local.len() {
            let run = &batch_local[rp];
            while bp < run.count {
                let (pba, r) = live_local[run.first + bp];
                // Every volume that maps the block moves with it (snapshots and
                // clones share blocks; otherwise this is the record's volume).
                self.referrers(r.vol(), r.block(), encode_device(pba), &mut refs);
                if !refs.is_empty() {
                    // The block goes to a GC stream of the volume whose segment it
                    // leaves: a volume's segments then hold only blocks that it or
                    // volumes made from it map, so deleting a volume (refused while
                    // volumes made from it exist) never strands another's blocks.
                    let owner = VolumeId(self.segments.segs[seg as usize].volume);
                    let volume = if self
                        .volumes
                        .get(owner.0 as usize)
                        .is_some_and(|v| v.is_some())
                    {
                        owner
                    } else {
                        refs[0]
                    };
                    let metadata_only = self.cfg.metadata_only;
                    // A run read across dead blocks fails as a whole if any of them
                    // is unreadable: read each live block of it on its own then.
                    let exact = (!metadata_only && run.failed && run.span > run.count)
                        .then(|| self.gc_read_block(seg, pba))
                        .flatten();
                    let data_ok =
                        metadata_only || exact.is_some() || (!run.failed && run.data.is_some());
                    // Where this block lies in the run's read.
                    let at = (pba.0 - live_local[run.first].0 .0) as usize;
                    let block = run_block(run, &exact, at);
                    let crc_ok = metadata_only
                        || (data_ok && block.is_some_and(|b| lamina_format::crc32c(b) == r.b));
                    // Damaged as read: on a layout with parity, rebuilt from the row.
                    let rebuilt = (!crc_ok)
                        .then(|| {
                            let (_, off) = self.geo.split(pba);
                            self.shared.rebuild_block(SegmentId(seg), off, r.b)
                        })
                        .flatten();
                    if crc_ok || rebuilt.is_some() {
                        let now = self.vol(volume).user_blocks;
                        let mut from = self.written_at(pba, now);
                        // A segment written under another configuration may carry a
                        // class this one does not have.
                        let seg_class = self.segments.segs[seg as usize].class as usize;
                        let v = self.vol_mut(volume);
                        from.class = from
                            .class
                            .min(v.user_classes + v.classifier.gc_classes() - 1);
                        let class = v.caps.class(
                            v.user_classes,
                            v.classifier.classify_gc(r.block(), v.user_blocks, from),
                        );
                        let mut gc_stream = v.streams[class as usize];
                        let mut class = class as usize;
                        let read_hot = v
                            .read_hot_stream
                            .is_some_and(|_| v.shared.map.was_read(r.block()));
                        if read_hot {
                            gc_stream = v.read_hot_stream.unwrap();
                            class = self.log.streams[gc_stream].class as usize;
                        }
                        if self.ensure_unit(gc_stream, 1, refs.len() - 1).is_err() {
                            blocked = true;
                            break 'runs;
                        }
                        if read_hot {
                            // Cleared only once the block is on its way.
                            self.vol(volume).shared.map.take_read(r.block());
                        }
                        let block = match &rebuilt {
                            Some(b) => Some(&b[..]),
                            None => run_block(&batch_local[rp], &exact, at),
                        };
                        self.relocate_data(
                            gc_stream,
                            &refs,
                            r.block(),
                            block,
                            Some(r.b),
                            encode_device(pba),
                        );
                        // Date the moved block by when a user last wrote it.
                        let st = &mut self.log.streams[gc_stream];
                        let to = st.seg.expect("ensure_unit opened it");
                        let unit = st.unit.as_mut().expect("ensure_unit opened it");
                        let offset = unit.offset + self.geo.header_blocks as u32 + unit.data - 1;
                        unit.origin_sum += from.at as u128;
                        unit.origin_n += 1;
                        if let Some(o) = &mut self.segments.segs[to as usize].origins {
                            o.add(Origins::slot(offset, self.geo.segment_blocks), from.at);
                        }
                        self.counters.gc_blocks += 1;
                        if self.geo.is_cache(seg) {
                            self.gc.compacted_blocks += 1;
                        }
                        moved += 1;
                        self.blocks_since_checkpoint =
                            self.blocks_since_checkpoint.saturating_sub(1);
                        if let Some(v) = self.volumes[volume.0 as usize].as_mut() {
                            v.gc_blocks += 1;
                            v.classes[class].blocks += 1;
                            if let Some(c) = v.classes.get_mut(seg_class) {
                                c.relocated_out += 1;
                            }
                        }
                    } else {
                        // The only copy is unreadable or damaged. It stays mapped where it
                        // is, so reads of it report the error instead of returning other
                        // data, and the segment, which holds it, is never released.
                        tracing::error!(
                            segment = seg,
                            volume = volume.0,
                            lba = r.lba(),
                            read_failed = run.failed,
                            "block failed verification during garbage collection; left in place"
                        );
                        self.segments.exclude(seg);
                        self.counters.corrupt_blocks += 1;
                    }
                }
                bp += 1;
            }
            rp += 1;
            bp = 0;
        }
        self.gc.refs = refs;
        // What each moved block is worth: the victim's net yield per live block.
        let blocks = self.geo.segment_blocks as f64;
        let live = live_local.len() as f64;
        if self.frees_user_room(seg) {
            // GC gains the segment less what it moves back into the same space;
            // compaction gives the whole segment back to the cache (the blocks
            // it moves take room in the capacity tier, not in the cache).
            let freed = if self.geo.tiered() {
                blocks
            } else {
                (blocks - live).max(0.0)
            };
            self.earn_credit(moved as f64 * freed / live.max(1.0));
        }
        if blocked {
            if let Phase::Relocate {
                live,
                batch,
                run_pos,
                block_pos,
                ..
            } = &mut self.gc.phase
            {
                *live = live_local;
                *batch = batch_local;
                *run_pos = rp;
                *block_pos = bp;
            }
            return false;
        }
        for run in batch_local.drain(..) {
            if let Some(d) = run.data {
                self.gc.spare.push(d);
            }
        }
        live_local.truncate(live_local.len()); // keep
        if let Phase::Relocate {
            live,
            batch,
            run_pos,
            block_pos,
            ..
        } = &mut self.gc.phase
        {
            *live = live_local;
            *batch = batch_local;
            *run_pos = 0;
            *block_pos = 0;
        }
        true
    }

    /// A GC data read completed.
    pub(crate) fn gc_read_done(&mut self, batch_index: u32, c: IoCompletion) {
        let Phase::Relocate {
            batch,
            reads_pending,
            seg,
            ..
        } = &mut self.gc.phase
        else {
            panic!("GC read completion outside relocation");
        };
        let run = &mut batch[batch_index as usize];
        if let Err(e) = &c.result {
            tracing::error!(segment = *seg, "GC read failed: {e}");
            run.failed = true;
        }
        run.data = c.buf;
        *reads_pending -= 1;
    }
}

/// Block `at` of a GC read run, or its separately read copy.
fn run_block<'a>(run: &'a Run, exact: &'a Option<Vec<u8>>, at: usize) -> Option<&'a [u8]> {
    match exact {
        Some(b) => Some(&b[..]),
        None => run
            .data
            .as_deref()
            .map(|d| &d[at * BLOCK_SIZE..(at + 1) * BLOCK_SIZE]),
    }
}
