//! Phase 3: the walk. Finds every unit written after the checkpoint's version
//! `C`, without scanning the array:
//!
//! 1. the stream heads recorded in the checkpoint, from their write pointers (and
//!    the successor each had reserved);
//! 2. the free queue recorded in the checkpoint, in order: segments are allocated in
//!    that order (within a window), so the walk stops after a run of empty segments
//!    longer than the streams and the window could leave;
//! 3. segments released after `C` (release records found on the way), in the order
//!    of their release records, which is the order the engine appended them.

use super::checkpoint::Checkpoint;
use super::{read_blocks, RecoveryReport};
use crate::engine::Seg;
use crate::shared::Shared;
use crate::types::{SegmentId, Version, BLOCK_SIZE};
use lamina_format::summary::SummaryHeader;
use lamina_format::unit::{kind, record_at, RawRecord, StreamKind, UnitHeader, NO_SEGMENT};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};

/// Release records found, lowest first by (unit version, record index), with the
/// segment and incarnation each retires.
/// Release records found: (version of the unit that holds the record, record
/// index, segment, its incarnation), the oldest first.
type Releases = BinaryHeap<Reverse<(Version, usize, u32, Version)>>;

/// What the walk found.
pub(super) struct Walk {
    /// Every segment incarnation with units written after `C`, each once, in the
    /// order found.
    pub found: Vec<Found>,
    /// Stream heads (and reserved successors) named by the checkpoint.
    pub scanned_heads: HashSet<u32>,
    /// The part of the checkpoint's free queue the walk went through, in order.
    pub walked_queue: Vec<u32>,
    /// (segment, incarnation) of every release record found: those incarnations
    /// hold nothing live any more.
    pub released: HashSet<(u32, Version)>,
}

impl Walk {
    /// Whether a release record after `C` retired this incarnation.
    pub fn is_released(&self, f: &Found) -> bool {
        self.released.contains(&(f.seg, f.incarnation))
    }

    /// The incarnations found that no release record retired: what replay applies.
    pub fn kept(&self) -> impl Iterator<Item = &Found> {
        self.found.iter().filter(|f| !self.is_released(f))
    }

    /// The user and GC units of [`Walk::kept`], with their volume and stream kind.
    pub fn data_units(&self) -> impl Iterator<Item = (u16, StreamKind, &FoundUnit)> {
        self.kept()
            .filter(|f| f.kind != StreamKind::Meta)
            .flat_map(|f| f.units.iter().map(move |u| (f.volume, f.kind, u)))
    }
}

/// Walks the stream heads, the free queue and the released segments of `ckpt`;
/// `segs` is the segment table as of the checkpoint.
pub(super) fn walk(
    shared: &Shared,
    ckpt: &Checkpoint,
    segs: &[Seg],
    report: &mut RecoveryReport,
) -> Walk {
    let (meta, c_version) = (&ckpt.meta, ckpt.version);
    let nsegs = segs.len();
    let mut found: Vec<Found> = Vec::new();
    let mut scanned_heads: HashSet<u32> = HashSet::new();
    for st in &meta.streams {
        if st.segment != NO_SEGMENT && (st.segment as usize) < nsegs {
            let s = &segs[st.segment as usize];
            if let Some(f) = scan_segment(
                shared,
                report,
                st.segment,
                s.write_ptr,
                Some((s.incarnation, (s.kind, s.class, s.volume))),
                c_version,
            ) {
                found.push(f);
            }
            scanned_heads.insert(st.segment);
        }
        if st.next_segment != NO_SEGMENT && (st.next_segment as usize) < nsegs {
            if let Some(f) = scan_segment(shared, report, st.next_segment, 0, None, c_version) {
                found.push(f);
            }
            scanned_heads.insert(st.next_segment);
        }
    }
    // Only stream heads (and the metadata stream's reserved successor) can have been
    // allocated and still be empty; a margin covers streams of volumes created after C.
    // Allocation may take any of the first `ALLOC_WINDOW` free segments (JBOD wear
    // levelling), so that many may be skipped before one that was used.
    let k_stop = meta.streams.len() + 3 + 8 + crate::engine::ALLOC_WINDOW;
    // An array with a cache tier allocates from two queues (user streams from
    // the cache's, the others from the capacity tier's), each in its own order
    // and window: each tier's part of the queue is walked on its own, with its
    // own count of empties, and so are the segments released in each tier.
    let tier = |seg: u32| shared.geo.tier(seg) as usize;
    let mut empties = [0usize; 2];
    let mut releases: [Releases; 2] = Default::default();
    let mut released: HashSet<(u32, Version)> = HashSet::new();
    let harvest = |f: &Found, heaps: &mut [Releases; 2], set: &mut HashSet<(u32, Version)>| {
        for u in &f.units {
            for (i, r) in u.records.iter().enumerate().skip(u.data_blocks as usize) {
                if r.kind == kind::RELEASE {
                    heaps[tier(r.b)].push(Reverse((u.version, i, r.b, Version(r.a))));
                    set.insert((r.b, Version(r.a)));
                }
            }
        }
    };
    for f in &found {
        harvest(f, &mut releases, &mut released);
    }
    // Each incarnation found so far, to record it once (a set: the walk may meet
    // thousands of segments, and a scan of `found` each time was quadratic).
    let mut seen: HashSet<(u32, Version)> = found.iter().map(|f| (f.seg, f.incarnation)).collect();
    let mut walked_queue = Vec::new();
    let part = |t: usize| {
        meta.free_queue
            .iter()
            .copied()
            .filter(move |&s| tier(s) == t)
    };
    let mut queues = [part(0), part(1)];
    // The next segment to look at: the capacity tier's first, each tier's queue
    // before its releases, none of a tier whose run of empties ended its walk.
    // (A release found in one tier's walk may name a segment of the other: it
    // joins that tier's heap, which is looked at again on the next round.)
    while let Some((seg, min_version, t)) = (0..2).find_map(|t| {
        if empties[t] >= k_stop {
            return None;
        }
        if let Some(seg) = queues[t].next() {
            walked_queue.push(seg);
            Some((seg, c_version, t))
        } else {
            releases[t]
                .pop()
                .map(|Reverse((version, _, seg, _))| (seg, version, t))
        }
    }) {
        if seg as usize >= nsegs {
            continue;
        }
        match scan_segment(shared, report, seg, 0, None, min_version) {
            Some(f) => {
                empties[t] = 0;
                // A segment taken from the queue, released and reused after C is
                // met again among the releases: record each incarnation once.
                if seen.insert((f.seg, f.incarnation)) {
                    harvest(&f, &mut releases, &mut released);
                    found.push(f);
                }
            }
            None => empties[t] += 1,
        }
    }
    report.releases_seen = released.len() as u64;
    let walk = Walk {
        found,
        scanned_heads,
        walked_queue,
        released,
    };
    // Headers rebuilt from parity count against their member only in what replay
    // uses: past its first header, a released incarnation may have been discarded
    // (`Extent::Tail`), and members need not agree on what a discarded range
    // reads as (zeros on one, the old units on the others would rebuild an old
    // header and blame the member that zeroed it).
    for f in walk.kept() {
        for u in &f.units {
            if let Some((m, _)) = &u.rebuilt {
                blame_member(shared, report, f.seg, u.offset, *m);
            }
        }
    }
    walk
}

/// Reads and decodes the unit header at `offset` of `seg` that `accept` takes (the
/// caller's identity checks: array, segment, offset, incarnation, version). On a
/// layout with parity, a header that does not decode as read, or decodes but is
/// not the one expected there (a stale header left by a write the member dropped or
/// stored elsewhere), is read again with each member rebuilt from the others in
/// turn: a header damaged on one member must not end the walk of a segment whose
/// later units were flushed. The third value is the member the header was
/// rebuilt without; the caller blames it ([`blame_member`]) where the unit is
/// needed.
pub(super) fn read_unit_header(
    shared: &Shared,
    report: &mut RecoveryReport,
    seg: u32,
    offset: u32,
    h: u32,
    accept: impl Fn(&UnitHeader) -> bool,
) -> Option<(Vec<u8>, UnitHeader, Option<usize>)> {
    if let Ok(buf) = read_blocks(shared, report, seg, offset, h) {
        if let Ok(u) = UnitHeader::decode(&buf) {
            if accept(&u) {
                return Some((buf, u, None));
            }
        }
    }
    let (dev, off) = shared.geo.locate(SegmentId(seg), offset);
    // Only the striped device has rows to rebuild from (not a JBOD member beside
    // a mirrored cache).
    let st = shared.striped_at(dev).filter(|st| st.shape().parity > 0)?;
    let mut buf = vec![0u8; h as usize * BLOCK_SIZE];
    for m in 0..st.shape().members() {
        if st.read_without(&mut buf, off, m).is_ok() {
            if let Ok(u) = UnitHeader::decode(&buf) {
                if accept(&u) {
                    return Some((buf, u, Some(m)));
                }
            }
        }
    }
    None
}

/// A header at `offset` of `seg` was rebuilt from parity without `member`: that
/// member's block there is counted as damaged and its stripe queued for repair.
pub(super) fn blame_member(
    shared: &Shared,
    report: &mut RecoveryReport,
    seg: u32,
    offset: u32,
    member: usize,
) {
    let (dev, off) = shared.geo.locate(SegmentId(seg), offset);
    if let Some(st) = shared.striped_at(dev) {
        report.headers_rebuilt += 1;
        st.note_bad_block(member, off);
    }
}

/// One unit found by the walk.
pub(super) struct FoundUnit {
    pub offset: u32,
    pub header_blocks: u32,
    pub data_blocks: u32,
    pub version: Version,
    pub durable_version: Version,
    pub run_start: Version,
    /// The volume's time at the unit's opening and seal and, for GC units, the
    /// mean origin of its blocks ([`UnitHeader::opened_time`],
    /// [`UnitHeader::volume_time`], [`UnitHeader::origin`]).
    pub opened_time: u64,
    pub volume_time: u64,
    pub origin: u64,
    pub records: Vec<RawRecord>,
    /// The member left out and the header as rebuilt from parity, when it did
    /// not decode as read (or was
    /// not the one expected there).
    pub rebuilt: Option<(usize, Vec<u8>)>,
}

/// One segment incarnation found by the walk.
pub(super) struct Found {
    pub seg: u32,
    pub incarnation: Version,
    pub kind: StreamKind,
    pub class: u8,
    pub volume: u16,
    /// Where the walk started (non-zero for stream heads continuing a segment).
    pub start: u32,
    pub units: Vec<FoundUnit>,
    pub end: u32,
    pub has_summary: bool,
}

/// Scans units of `seg` from `start`. `expect` is the incarnation when known,
/// with the stream kind, class and volume the checkpoint recorded for the
/// segment (what a stream head that took no unit since keeps); otherwise the
/// first unit sets them and its incarnation must exceed `min_version`.
fn scan_segment(
    shared: &Shared,
    report: &mut RecoveryReport,
    seg: u32,
    start: u32,
    expect: Option<(Version, (StreamKind, u8, u16))>,
    min_version: Version,
) -> Option<Found> {
    let geo = &shared.geo;
    let h = geo.header_blocks as u32;
    let mut offset = start;
    let mut prev = min_version;
    let mut incarnation = expect.map(|(i, _)| i);
    let mut units = Vec::new();
    // A head found without a new unit used to come back as volume 0's user
    // segment of class 0, whoever wrote it.
    let mut meta = expect.map_or((StreamKind::User, 0u8, 0u16), |(_, m)| m);
    report.segments_scanned += 1;
    while offset + h <= geo.data_end {
        let expected = |u: &UnitHeader| {
            let inc_ok = match incarnation {
                Some(i) => u.incarnation == i.0,
                None => u.incarnation > min_version.0,
            };
            u.array_id == geo.array_id
                && u.segment == seg
                && u.offset == offset
                && inc_ok
                && u.version > prev.0
                && u.header_blocks as u32 == h
                && offset + u.total_blocks() <= geo.data_end
        };
        let Some((buf, u, rebuilt)) = read_unit_header(shared, report, seg, offset, h, expected)
        else {
            break;
        };
        incarnation = Some(Version(u.incarnation));
        meta = (u.stream_kind, u.stream_class, u.volume);
        let records = (0..u.record_count as usize)
            .map(|i| record_at(&buf, i))
            .collect();
        units.push(FoundUnit {
            offset,
            header_blocks: h,
            data_blocks: u.data_blocks,
            version: Version(u.version),
            durable_version: Version(u.durable_version),
            run_start: Version(u.run_start),
            opened_time: u.opened_time,
            volume_time: u.volume_time,
            origin: u.origin,
            rebuilt: rebuilt.map(|m| (m, buf.clone())),
            records,
        });
        prev = Version(u.version);
        offset += u.total_blocks();
    }
    if units.is_empty() && start == 0 {
        return None;
    }
    let incarnation = incarnation?;
    let mut has_summary = false;
    if offset + geo.round_to_row(h + 1) > geo.data_end && meta.0 != StreamKind::Meta {
        if let Ok(buf) = read_blocks(shared, report, seg, geo.data_end, geo.summary_blocks) {
            has_summary = SummaryHeader::decode(&buf).is_ok_and(|s| {
                s.segment == seg && s.incarnation == incarnation.0 && s.array_id == geo.array_id
            });
        }
    }
    Some(Found {
        seg,
        incarnation,
        kind: meta.0,
        class: meta.1,
        volume: meta.2,
        start,
        units,
        end: offset,
        has_summary,
    })
}

#[cfg(test)]
mod tests {
    use super::super::testing::{call, devices, engine_with_volume, entries, up_to_walk, write};
    use super::super::{replay, verify};
    use super::*;
    use crate::engine::Request;

    /// The walk finds every unit written after the checkpoint that is still on the
    /// media, and nothing before it: replaying what it found onto the checkpoint's
    /// maps gives back the map the engine had, also when GC released and reused
    /// segments after the checkpoint (found through their release records).
    #[test]
    fn the_walk_finds_everything_that_followed_the_checkpoint() {
        let (_dev, devs) = devices();
        let (mut e, v) = engine_with_volume(&devs);
        write(&mut e, v, 0, 400, 1);
        call(&mut e, Request::Checkpoint);
        // Overwrites of a quarter of the volume, many times over: GC collects
        // segments written before and after the checkpoint.
        for round in 0..12u8 {
            for lba in (0..128).step_by(7) {
                write(&mut e, v, lba, 7, round);
            }
        }
        call(&mut e, Request::Flush);
        let expected = entries(&e.shared().volume("v").unwrap().map);
        drop(e);

        let (shared, ckpt, walk) = up_to_walk(&devs);
        assert!(
            !walk.released.is_empty(),
            "GC released nothing: the test needs more writes"
        );
        for f in &walk.found {
            assert!(f.units.iter().all(|u| u.version > ckpt.version));
            assert!(f.units.windows(2).all(|w| w[0].version < w[1].version));
        }
        let marks = verify::Marks::new(&walk);
        let mut report = RecoveryReport::default();
        let v = verify::unvouched_units(&shared, &walk, &marks, &mut report).unwrap();
        assert!(v.torn.is_empty());
        replay::replay(&shared.geo, &walk, &v.torn, &ckpt, &mut report);
        assert_eq!(entries(&ckpt.volumes[0].0.map), expected);
    }

    /// A stream head that took no unit after the checkpoint keeps the volume,
    /// class and kind the checkpoint recorded for it (it came back as volume
    /// 0's user segment of class 0, whoever owned it).
    #[test]
    fn a_head_without_new_units_keeps_its_owner() {
        let (_dev, devs) = devices();
        let (mut e, _) = engine_with_volume(&devs);
        call(
            &mut e,
            Request::CreateVolume {
                name: "w".into(),
                size_bytes: 1 << 20,
            },
        );
        let w = e.shared().volume("w").unwrap().id;
        assert_ne!(w.0, 0);
        write(&mut e, w, 0, 3, 1);
        call(&mut e, Request::Flush);
        call(&mut e, Request::Checkpoint);
        drop(e);
        let (_, _, walk) = up_to_walk(&devs);
        let heads: Vec<&Found> = walk
            .found
            .iter()
            .filter(|f| f.start > 0 && f.units.is_empty())
            .collect();
        assert!(
            !heads.is_empty(),
            "w's head was scanned: {:?}",
            walk.found
                .iter()
                .map(|f| (f.seg, f.start, f.units.len(), f.volume))
                .collect::<Vec<_>>()
        );
        for f in heads {
            assert_eq!(
                (f.volume, f.kind),
                (w.0, StreamKind::User),
                "segment {}",
                f.seg
            );
        }
    }
}
