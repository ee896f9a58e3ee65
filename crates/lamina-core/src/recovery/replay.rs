//! Phases 5 and 6: replay and settling. Replay applies the block records of the
//! units the walk kept (by unit version) and their trims (by trim version) to the
//! maps loaded from the checkpoint, in version order. Settling then derives the
//! segment table from what was found and from the final maps: incarnations,
//! write pointers, ages, valid counts, and the free queue in the order allocation
//! will take it.

use super::checkpoint::Checkpoint;
use super::walk::{FoundUnit, Walk};
use super::RecoveryReport;
use crate::engine::{Counters, Seg, SegState};
use crate::geometry::Geometry;
use crate::map::{encode_device, BAD, UNMAPPED};
use crate::segments::{Origins, ORIGIN_SLOTS};
use crate::shared::{Shared, VolumeShared};
use crate::types::{Lba, SegmentId, Version};
use lamina_format::checkpoint::{SegmentState, VolumeRecord};
use lamina_format::unit::{kind, RawRecord, StreamKind};
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

/// What replay counted on top of the checkpoint's counters.
pub(super) struct Replayed {
    pub counters: Counters,
    /// Per volume: (user blocks, GC blocks, media blocks) of the replayed units.
    pub vol_media: HashMap<u16, (u64, u64, u64)>,
}

/// Applies every kept unit's block records and trims to the volumes' maps in
/// version order, leaving out the `torn` blocks (segment, unit offset, record).
/// Records of volumes that no longer exist, and blocks beyond a volume's end, are
/// skipped.
pub(super) fn replay(
    geo: &Geometry,
    walk: &Walk,
    torn: &HashSet<(u32, u32, usize)>,
    ckpt: &Checkpoint,
    report: &mut RecoveryReport,
) -> Replayed {
    enum Ev {
        Data { volume: u16, lba: u64, pba: u32 },
        Trim { volume: u16, start: u64, count: u64 },
    }
    let mut events: Vec<(Version, Ev)> = Vec::new();
    let mut counters = Counters::from_slice(&ckpt.meta.counters);
    let mut vol_media: HashMap<u16, (u64, u64, u64)> = HashMap::new();
    let created = Created::new(&ckpt.volumes);
    let is_of = |volume: u16, version: Version| created.owns(volume, version);
    for f in walk.kept() {
        for u in &f.units {
            report.units_replayed += 1;
            let blocks = (u.header_blocks + u.data_blocks) as u64;
            counters.media_blocks += blocks;
            let data = u.data_blocks as u64;
            let (user, gc) = match f.kind {
                StreamKind::Meta => (0, 0),
                StreamKind::User => (data, 0),
                StreamKind::Gc => (0, data),
            };
            counters.user_blocks += user;
            counters.gc_blocks += gc;
            if f.kind == StreamKind::Meta {
                counters.meta_blocks += blocks;
            } else if is_of(f.volume, u.version) {
                let e = vol_media.entry(f.volume).or_default();
                *e = (e.0 + user, e.1 + gc, e.2 + blocks);
            }
            // Data block `i` of the unit, for the volume and LBA of record `r`
            // (its DATA record, or an ALIAS naming it), if it is whole.
            let data_event = |r: &RawRecord, i: usize| {
                (u.records[i].kind == kind::DATA && !torn.contains(&(f.seg, u.offset, i))).then(
                    || {
                        let pba = geo.pba(SegmentId(f.seg), u.offset + u.header_blocks + i as u32);
                        (
                            u.version,
                            Ev::Data {
                                volume: r.volume(),
                                lba: r.lba(),
                                pba: pba.0,
                            },
                        )
                    },
                )
            };
            for i in 0..u.data_blocks as usize {
                if let Some(ev) = data_event(&u.records[i], i) {
                    events.push(ev);
                    report.blocks_replayed += 1;
                }
            }
            let extras = &u.records[u.data_blocks as usize..];
            for (i, r) in extras.iter().enumerate() {
                // Another volume's reference to a block of this unit (GC moved a
                // block that snapshots or clones share): a DATA record for it.
                if r.kind == kind::ALIAS && r.b < u.data_blocks {
                    events.extend(data_event(r, r.b as usize));
                }
                if r.kind == kind::TRIM {
                    if let Some(v) = extras.get(i + 1).filter(|v| v.kind == kind::VERSION) {
                        events.push((
                            Version(v.a),
                            Ev::Trim {
                                volume: r.volume(),
                                start: r.lba(),
                                count: r.b as u64,
                            },
                        ));
                        report.trims_replayed += 1;
                    }
                }
            }
        }
    }
    events.sort_by_key(|(v, _)| *v);
    let by_id: HashMap<u16, &VolumeShared> =
        ckpt.volumes.iter().map(|(v, _)| (v.id.0, &**v)).collect();
    // Records older than the volume are another's, as above.
    let vol_of = |id: u16, version: Version| by_id.get(&id).copied().filter(|_| is_of(id, version));
    for &(version, ref ev) in &events {
        match *ev {
            Ev::Data { volume, lba, pba } => {
                if let Some(v) = vol_of(volume, version) {
                    if lba < v.map.len() {
                        v.map.store(Lba(lba), encode_device(crate::types::Pba(pba)));
                    }
                }
            }
            Ev::Trim {
                volume,
                start,
                count,
            } => {
                if let Some(v) = vol_of(volume, version) {
                    // Run by run, as the engine trims: a trim of a thin volume's
                    // unwritten petabytes costs its pages, not its blocks.
                    let end = start.saturating_add(count).min(v.map.len());
                    for lba in v.map.mapped_runs(Lba(start), Lba(end)).flatten() {
                        v.map.store(lba, UNMAPPED);
                    }
                }
            }
        }
    }
    Replayed {
        counters,
        vol_media,
    }
}

/// The segment table after replay: released incarnations and old metadata segments
/// are free, every kept incarnation is closed where its units end (recovery never
/// continues a segment), with its age from `clocks`, and stream heads that received
/// nothing are closed where they stood, or free if empty.
pub(super) fn settle_segments(
    segs: &mut [Seg],
    geo: &Geometry,
    walk: &Walk,
    ckpt: &Checkpoint,
    clocks: &VolumeClocks,
) {
    // A segment the walk found units in, or a release record for, was written
    // after C: whatever the checkpoint says, it holds data again and is discarded
    // once it has been free long enough. (Released incarnations are not in
    // `kept`, and a segment released after C may still carry C's incarnation.)
    let written = walk.found.iter().map(|f| f.seg);
    for seg in written.chain(walk.released.iter().map(|&(seg, _)| seg)) {
        if let Some(s) = segs.get_mut(seg as usize) {
            s.clean = false;
        }
    }
    for (seg, inc) in &walk.released {
        // A release record naming a segment the array does not have (it passed its
        // unit's checksum, so a bug wrote it) releases nothing.
        let Some(s) = segs.get_mut(*seg as usize) else {
            tracing::warn!(
                segment = seg,
                "release record for a segment beyond the array ignored"
            );
            continue;
        };
        if s.incarnation == *inc {
            let ec = s.erase_count;
            *s = Seg::free(ec);
        }
    }
    // Metadata segments recorded by the checkpoint belong to earlier generations,
    // except the stream head and its reserved successor, which the walk revisits.
    for (i, s) in segs.iter_mut().enumerate() {
        if s.state == SegState::Meta && !walk.scanned_heads.contains(&(i as u32)) {
            *s = Seg::free(s.erase_count);
        }
    }
    for f in walk.kept() {
        let s = &mut segs[f.seg as usize];
        let new_incarnation = f.start == 0 && s.incarnation != f.incarnation;
        if new_incarnation {
            s.erase_count += 1;
            s.data_blocks = 0;
        }
        if f.kind != StreamKind::Meta {
            if let (Some(first), Some(last)) = (f.units.first(), f.units.last()) {
                if new_incarnation {
                    s.born = clocks.before(f.volume, first);
                    s.origins = Origins::for_segment(f.kind, s.born);
                }
                s.closed = clocks.after(f.volume, f.kind, last);
                s.last_invalidated = s.closed;
                if f.kind == StreamKind::Gc {
                    // Each replayed unit dates the slots its blocks fall in (units
                    // written before origins were recorded: by the segment's birth).
                    let mut slots = [(0u128, 0u64); ORIGIN_SLOTS];
                    for u in &f.units {
                        let at = if u.origin != 0 { u.origin } else { s.born };
                        for i in 0..u.data_blocks {
                            let slot =
                                Origins::slot(u.offset + u.header_blocks + i, geo.segment_blocks);
                            slots[slot].0 += at as u128;
                            slots[slot].1 += 1;
                        }
                    }
                    let o = s
                        .origins
                        .get_or_insert_with(|| Box::new(Origins::at_time(s.born)));
                    for (k, &(sum, n)) in slots.iter().enumerate() {
                        if n > 0 {
                            o.mean[k] = (sum / n as u128) as u64;
                        }
                    }
                }
            }
        }
        s.incarnation = f.incarnation;
        s.kind = f.kind;
        s.class = f.class;
        s.volume = f.volume;
        s.write_ptr = f.end;
        s.data_blocks += f.units.iter().map(|u| u.data_blocks).sum::<u32>();
        s.close_version = f.units.last().map_or(s.close_version, |u| u.version);
        s.has_summary = f.has_summary;
        s.state = if f.kind == StreamKind::Meta {
            SegState::Meta
        } else {
            SegState::Closed
        };
        s.gen = ckpt.generation;
    }
    // Stream heads that received nothing: closed where they stood, or free if empty.
    for seg in &walk.scanned_heads {
        let s = &mut segs[*seg as usize];
        let empty_meta = s.state == SegState::Meta && !walk.found.iter().any(|f| f.seg == *seg);
        let empty_data = s.state == SegState::Closed && s.write_ptr == 0;
        if empty_meta || empty_data {
            *s = Seg::free(s.erase_count);
        } else if s.state == SegState::Closed
            && ckpt.meta.segments.get(*seg as usize).map(|r| r.state) == Some(SegmentState::Open)
            && !walk
                .found
                .iter()
                .any(|f| f.seg == *seg && !f.units.is_empty())
        {
            // Open at the checkpoint and not written since: its last write was
            // before the checkpoint.
            s.closed = ckpt
                .volumes
                .iter()
                .find(|(v, _)| v.id.0 == s.volume)
                .map_or(s.born, |(_, rec)| rec.user_blocks_written);
            s.last_invalidated = s.closed;
        }
    }
}

/// Valid counts and live blocks from the final maps: a block mapped into a segment
/// that holds nothing is marked bad (reads of it fail) with a warning, and closed
/// segments with nothing valid are free. Returns each volume's live blocks.
/// Counts the live blocks of every segment from the final maps: what each volume
/// maps (per volume), and the blocks mapped at all (the total; a block that
/// several volumes of a snapshot family map counts once).
pub(super) fn count_live(
    geo: &Geometry,
    volumes: &[(Arc<VolumeShared>, VolumeRecord)],
    lineage: &crate::lineage::Lineage,
    segs: &mut [Seg],
    report: &mut RecoveryReport,
) -> (Vec<u64>, u64) {
    let limit_blocks = geo.segment_count as u64 * geo.segment_blocks as u64;
    let mut live_per_volume = Vec::new();
    let mut distinct = 0u64;
    for (k, (v, _)) in volumes.iter().enumerate() {
        let mut live = 0u64;
        // Members of the family counted before this one.
        let before: Vec<&VolumeShared> = lineage.family(v.id).map_or(Vec::new(), |f| {
            volumes[..k]
                .iter()
                .filter(|(o, _)| lineage.family(o.id) == Some(f))
                .map(|(o, _)| &**o)
                .collect()
        });
        v.map.for_each_mapped(|lba, e| {
            live += 1;
            if e == BAD || before.iter().any(|o| o.map.load(lba) == e) {
                if e == BAD {
                    distinct += 1;
                }
                return;
            }
            distinct += 1;
            let pba = (e - 1) as u64;
            let ok = pba < limit_blocks && {
                let s = &segs[(pba / geo.segment_blocks as u64) as usize];
                s.state == SegState::Closed
            };
            if ok {
                segs[(pba / geo.segment_blocks as u64) as usize].valid += 1;
            } else {
                report.warnings.push(format!(
                    "volume {:?} block {lba} pointed into an unused segment; marked bad",
                    v.name()
                ));
                v.map.store(lba, BAD);
            }
        });
        live_per_volume.push(live);
    }
    for s in segs.iter_mut() {
        if s.state == SegState::Closed && s.valid == 0 {
            *s = Seg::free(s.erase_count);
        }
    }
    (live_per_volume, distinct)
}

/// The free queue: the part of the checkpoint's queue the walk went through, in its
/// order, then the rest of that queue, then every other free segment; each free
/// segment once.
pub(super) fn free_queue(segs: &[Seg], walked_queue: &[u32], recorded: &[u32]) -> VecDeque<u32> {
    let nsegs = segs.len();
    let mut in_queue = vec![false; nsegs];
    let mut free = VecDeque::new();
    for seg in walked_queue.iter().copied().chain(recorded.iter().copied()) {
        if (seg as usize) < nsegs
            && segs[seg as usize].state == SegState::Free
            && !in_queue[seg as usize]
        {
            in_queue[seg as usize] = true;
            free.push_back(seg);
        }
    }
    for (i, s) in segs.iter().enumerate() {
        if s.state == SegState::Free && !in_queue[i] {
            free.push_back(i as u32);
        }
    }
    free
}

/// Publishes what readers need before the engine serves: each segment's
/// incarnation, and the unit starts of the segments the walk scanned from their
/// start (the others load lazily on their first read).
pub(super) fn publish(shared: &Shared, segs: &[Seg], walk: &Walk) {
    let geo = &shared.geo;
    for (i, s) in segs.iter().enumerate() {
        shared.set_incarnation(SegmentId(i as u32), s.incarnation);
    }
    // Readers locate unit headers through the unit-start bitmap. Segments the walk
    // scanned get theirs now; the others load lazily on their first read.
    for f in walk.kept() {
        if segs[f.seg as usize].incarnation != f.incarnation {
            continue;
        }
        if f.start == 0 {
            for u in &f.units {
                shared.mark_unit_start(geo.pba(SegmentId(f.seg), u.offset));
            }
            shared.set_starts_known(SegmentId(f.seg));
        }
    }
}

/// Each volume's time (user blocks written to it) at the units recovery replays,
/// for the segment ages GC and placement read. Units record the volume's time at
/// their seal ([`UnitHeader::volume_time`]). Units written before they did (0
/// there) are dated by counting: the volume's count in the checkpoint plus the
/// user blocks of its replayed units with lower versions, which falls short when
/// segments written since the checkpoint were collected before the crash.
pub(super) struct VolumeClocks {
    /// Per volume: (version, time before the unit) of each replayed user unit in
    /// version order, and the volume's time after everything replayed.
    clocks: HashMap<u16, (Vec<(Version, u64)>, u64)>,
}

/// The creation version of each volume a checkpoint names. A unit or trim at or
/// below it is not the volume's but another's that had its id: ids of deleted
/// volumes are given out again (`Engine::next_volume_id`). (None reaches
/// replay: the old volume's units all precede the checkpoint that names the
/// new one.)
struct Created(HashMap<u16, u64>);

impl Created {
    fn new(volumes: &[(Arc<VolumeShared>, VolumeRecord)]) -> Self {
        Created(
            volumes
                .iter()
                .map(|(v, r)| (v.id.0, r.created_version))
                .collect(),
        )
    }

    /// Whether something written at `version` under id `volume` is that
    /// volume's (false for a volume the checkpoint does not name).
    fn owns(&self, volume: u16, version: Version) -> bool {
        self.0.get(&volume).is_some_and(|&c| version.0 > c)
    }
}

impl VolumeClocks {
    pub fn new<'a>(
        volumes: &[(Arc<VolumeShared>, VolumeRecord)],
        units: impl Iterator<Item = (u16, StreamKind, &'a FoundUnit)>,
    ) -> Self {
        let mut clocks: HashMap<u16, (Vec<(Version, u64)>, u64)> = volumes
            .iter()
            .map(|(v, rec)| (v.id.0, (Vec::new(), rec.user_blocks_written)))
            .collect();
        let created = Created::new(volumes);
        let mut recorded: HashMap<u16, u64> = HashMap::new();
        for (volume, kind, u) in units {
            if !created.owns(volume, u.version) {
                continue;
            }
            if let Some(c) = clocks.get_mut(&volume) {
                if kind == StreamKind::User {
                    c.0.push((u.version, u.data_blocks as u64));
                }
                let r = recorded.entry(volume).or_default();
                *r = (*r).max(u.volume_time);
            }
        }
        for (volume, (units, t)) in clocks.iter_mut() {
            units.sort_unstable_by_key(|u| u.0);
            for u in units.iter_mut() {
                let blocks = u.1;
                u.1 = *t;
                *t += blocks;
            }
            *t = (*t).max(recorded.get(volume).copied().unwrap_or(0));
        }
        VolumeClocks { clocks }
    }

    /// The volume's time when unit `u` was opened: as recorded, or else counted.
    pub fn before(&self, volume: u16, u: &FoundUnit) -> u64 {
        if u.volume_time != 0 {
            return u.opened_time;
        }
        self.clocks.get(&volume).map_or(0, |(units, end)| {
            units
                .get(units.partition_point(|c| c.0 < u.version))
                .map_or(*end, |c| c.1)
        })
    }

    /// The volume's time when unit `u` was sealed.
    pub fn after(&self, volume: u16, kind: StreamKind, u: &FoundUnit) -> u64 {
        if u.volume_time != 0 {
            return u.volume_time;
        }
        self.before(volume, u)
            + if kind == StreamKind::User {
                u.data_blocks as u64
            } else {
                0
            }
    }

    /// The volume's time after every replayed unit.
    pub fn end(&self, volume: u16) -> u64 {
        self.clocks.get(&volume).map_or(0, |c| c.1)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{
        checkpoint_with_volume, devices, found, unit, up_to_walk, walk_of,
    };
    use super::*;
    use lamina_format::unit::RawRecord;

    fn at(geo: &Geometry, seg: u32, offset: u32) -> u32 {
        encode_device(geo.pba(SegmentId(seg), offset))
    }

    /// Replay applies blocks and trims in version order whatever order the walk met
    /// them in, leaves out torn blocks, released incarnations, blocks beyond the
    /// volume's end and volumes that do not exist, and counts what it replayed.
    #[test]
    fn replay_applies_in_version_order_and_leaves_out_what_it_must() {
        let (_dev, devs) = devices();
        let (shared, _, _) = up_to_walk(&devs);
        let geo = &shared.geo;
        let ckpt = checkpoint_with_volume(&shared, 10, 64);
        let map = &ckpt.volumes[0].0.map;
        map.store(Lba(9), at(geo, 2, 1)); // as of the checkpoint
        map.store(Lba(30), at(geo, 2, 2));
        // Segment 5 (met first by the walk) holds the newer copy of block 3, and a
        // trim (version 16) of blocks 4..6, written after block 4's copy in segment 6.
        let newer = unit(
            0,
            15,
            11,
            0,
            vec![
                RawRecord::data(1, 3, 0),
                RawRecord::trim(1, 4, 2),
                RawRecord::version(16),
            ],
        );
        // Segment 6: block 3 at version 12, block 4 at 12, block 9 torn, block 70
        // beyond the volume, a block of volume 2, which does not exist.
        let older = unit(
            0,
            12,
            11,
            0,
            vec![
                RawRecord::data(1, 3, 0),
                RawRecord::data(1, 4, 0),
                RawRecord::data(1, 9, 0),
                RawRecord::data(1, 70, 0),
                RawRecord::data(2, 5, 0),
            ],
        );
        // Segment 7 was released after the checkpoint: nothing of it counts.
        let gone = unit(0, 13, 11, 0, vec![RawRecord::data(1, 30, 0)]);
        let walk = walk_of(
            vec![
                found(5, 14, 1, vec![newer]),
                found(6, 12, 1, vec![older]),
                found(7, 13, 1, vec![gone]),
            ],
            &[(7, 13)],
        );
        let torn: HashSet<(u32, u32, usize)> = [(6, 0, 2)].into_iter().collect();
        let mut report = RecoveryReport::default();
        let r = replay(geo, &walk, &torn, &ckpt, &mut report);
        assert_eq!(map.load(Lba(3)), at(geo, 5, 1), "the newer copy wins");
        assert_eq!(
            map.load(Lba(4)),
            UNMAPPED,
            "the later trim wins over the older copy"
        );
        assert_eq!(map.load(Lba(5)), UNMAPPED);
        assert_eq!(
            map.load(Lba(9)),
            at(geo, 2, 1),
            "a torn block keeps the checkpoint's copy"
        );
        assert_eq!(
            map.load(Lba(30)),
            at(geo, 2, 2),
            "a released incarnation replays nothing"
        );
        assert_eq!(report.units_replayed, 2);
        assert_eq!(
            report.blocks_replayed, 5,
            "every untorn data record, kept or not"
        );
        assert_eq!(report.trims_replayed, 1);
        assert_eq!(r.counters.user_blocks, 6);
        assert_eq!(r.counters.media_blocks, 8);
        assert_eq!(r.vol_media.get(&1), Some(&(6, 0, 8)));
    }

    fn seg(state: SegState, incarnation: u64, write_ptr: u32) -> Seg {
        let mut s = Seg::free(3);
        s.state = state;
        s.incarnation = Version(incarnation);
        s.write_ptr = write_ptr;
        s
    }

    /// The segment table after replay: released and stale metadata segments are
    /// free, a new incarnation counts an erase and ends where its units end, and an
    /// empty stream head is free again.
    #[test]
    fn settling_follows_what_the_walk_found() {
        let (_dev, devs) = devices();
        let (shared, _, _) = up_to_walk(&devs);
        let geo = &shared.geo;
        let ckpt = checkpoint_with_volume(&shared, 10, 64);
        let mut segs: Vec<Seg> = (0..8).map(|_| Seg::free(3)).collect();
        segs[1] = seg(SegState::Closed, 4, 64); // released after C
        segs[2] = seg(SegState::Meta, 5, 9); // an older checkpoint's
        segs[3] = seg(SegState::Free, 0, 0); // taken after C, now written
        segs[3].clean = true; // discarded before C
        segs[4] = seg(SegState::Closed, 0, 0); // a stream head that got nothing
        segs[5].clean = true; // discarded before C, still free
        segs[6].clean = true; // discarded before C, then written and released after
        let units = vec![
            unit(0, 11, 11, 0, vec![RawRecord::data(1, 0, 0); 7]),
            unit(8, 12, 11, 0, vec![RawRecord::data(1, 1, 0); 3]),
        ];
        // (1, 4): a release; (8, 1) and (u32::MAX, 1) name segments the array does
        // not have, and release nothing.
        let mut walk = walk_of(
            vec![found(3, 11, 1, units)],
            &[(1, 4), (6, 13), (8, 1), (u32::MAX, 1)],
        );
        walk.scanned_heads.insert(4);
        let clocks = VolumeClocks::new(&ckpt.volumes, walk.data_units());
        settle_segments(&mut segs, geo, &walk, &ckpt, &clocks);
        assert_eq!(segs[1].state, SegState::Free);
        assert_eq!(segs[1].erase_count, 3, "a release keeps the erase count");
        assert_eq!(segs[2].state, SegState::Free);
        let s = &segs[3];
        assert_eq!(
            (
                s.state,
                s.incarnation,
                s.erase_count,
                s.write_ptr,
                s.data_blocks,
                s.close_version
            ),
            (SegState::Closed, Version(11), 4, 12, 10, Version(12))
        );
        assert_eq!(
            (s.born, s.closed),
            (0, 10),
            "dated by counting the volume's blocks"
        );
        assert!(!s.clean, "written after its discard");
        assert_eq!(segs[4].state, SegState::Free);
        assert!(
            segs[5].clean,
            "a discarded segment nothing wrote to stays so"
        );
        assert!(
            segs[6].state == SegState::Free && !segs[6].clean,
            "written and released after C: not discarded since"
        );
    }

    /// Valid counts come from the final maps; a block mapped into a segment that
    /// holds nothing is marked bad and reported, and closed segments left with
    /// nothing valid are free.
    #[test]
    fn live_blocks_come_from_the_maps() {
        let (_dev, devs) = devices();
        let (shared, _, _) = up_to_walk(&devs);
        let geo = &shared.geo;
        let ckpt = checkpoint_with_volume(&shared, 10, 64);
        let map = &ckpt.volumes[0].0.map;
        let mut segs: Vec<Seg> = (0..8).map(|_| Seg::free(0)).collect();
        segs[2] = seg(SegState::Closed, 1, 64);
        segs[3] = seg(SegState::Closed, 2, 64);
        map.store(Lba(0), at(geo, 2, 1));
        map.store(Lba(1), at(geo, 2, 2));
        map.store(Lba(2), at(geo, 6, 1)); // segment 6 is free
        map.store(Lba(3), BAD);
        let mut report = RecoveryReport::default();
        let (live, _) = count_live(
            geo,
            &ckpt.volumes,
            &crate::lineage::Lineage::default(),
            &mut segs,
            &mut report,
        );
        assert_eq!(live, vec![4], "bad blocks are still the volume's");
        assert_eq!(segs[2].valid, 2);
        assert_eq!(segs[3].state, SegState::Free, "closed with nothing valid");
        assert_eq!(map.load(Lba(2)), BAD);
        assert_eq!(report.warnings.len(), 1, "{:?}", report.warnings);
    }

    /// The free queue starts with what the walk went through, in its order, then
    /// the rest of the recorded queue, then every other free segment, each once.
    #[test]
    fn the_free_queue_keeps_the_walked_order() {
        let mut segs: Vec<Seg> = (0..8).map(|_| seg(SegState::Closed, 1, 64)).collect();
        for i in [1, 2, 3, 5, 7] {
            segs[i] = Seg::free(0);
        }
        let q = free_queue(&segs, &[3, 4, 1], &[1, 3, 4, 5, 2, 99]);
        assert_eq!(Vec::from(q), vec![3, 1, 5, 2, 7]);
    }
}
