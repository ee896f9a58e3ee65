//! Phase 2: the checkpoint. Loads the volumes, their maps and the segment table as
//! of the checkpoint's version `C`, following the metadata stream from the segment
//! the superblock names; every block is checked against its record's checksum (and
//! rebuilt from parity where the layout has it).

use super::walk::{blame_member, read_unit_header};
use super::{read_blocks, RecoveryReport};
use crate::engine::{Seg, SegState};
use crate::error::EngineError;
use crate::map::{BAD, UNMAPPED};
use crate::segments::Origins;
use crate::shared::{Shared, VolumeShared};
use crate::types::{Lba, SegmentId, Version, VolumeId, BLOCK_SIZE, BLOCK_SIZE_U64};
use lamina_format::checkpoint::{
    CheckpointHeader, CheckpointMeta, SegmentRecord, SegmentState, VolumeRecord,
    MAP_ENTRIES_PER_PAGE,
};
use lamina_format::superblock::CheckpointRef;
use lamina_format::unit::{kind, record_at, StreamKind, NO_SEGMENT};
use std::collections::{HashSet, VecDeque};
use std::sync::Arc;

/// The state recorded by the checkpoint.
pub(super) struct Checkpoint {
    /// `C`: the walk looks for what was written after it.
    pub version: Version,
    pub generation: u64,
    pub meta: CheckpointMeta,
    /// Each volume with its map as of `C`, and its record.
    pub volumes: Vec<(Arc<VolumeShared>, VolumeRecord)>,
}

impl Checkpoint {
    /// What an array that never wrote a checkpoint starts from: no volumes, every
    /// segment free, in index order.
    fn none(segment_count: u32) -> Self {
        Checkpoint {
            version: Version::ZERO,
            generation: 0,
            meta: CheckpointMeta {
                free_queue: (0..segment_count).collect(),
                segments: Vec::new(),
                ..Default::default()
            },
            volumes: Vec::new(),
        }
    }
}

/// Loads the checkpoint `cref` names (none: an array that never wrote one). A
/// checkpoint that does not match its superblock reference or its checksums, or
/// that maps a block outside the array, is an error: recovery never guesses.
pub(super) fn load(
    shared: &Shared,
    cref: Option<CheckpointRef>,
    report: &mut RecoveryReport,
) -> Result<Checkpoint, EngineError> {
    let geo = &shared.geo;
    let nsegs = geo.segment_count as usize;
    let Some(cref) = cref else {
        return Ok(Checkpoint::none(geo.segment_count));
    };
    let mut rd = CheckpointReader::new(shared, cref);
    let block0 = rd.next_block(report)?;
    if lamina_format::crc32c(&block0) != cref.root_crc {
        return Err(EngineError::Format(format!(
            "checkpoint generation {}: header does not match the superblock",
            cref.generation
        )));
    }
    let hdr = CheckpointHeader::decode(&block0)?;
    if hdr.generation != cref.generation
        || hdr.start_version != cref.version
        || hdr.payload_blocks != cref.payload_blocks
    {
        return Err(EngineError::Format(
            "checkpoint header disagrees with the superblock".into(),
        ));
    }
    let mut meta_bytes = Vec::with_capacity(hdr.meta_bytes as usize);
    for _ in 0..hdr.meta_blocks() {
        meta_bytes.extend_from_slice(&rd.next_block(report)?);
    }
    meta_bytes.truncate(hdr.meta_bytes as usize);
    if lamina_format::crc32c(&meta_bytes) != hdr.meta_crc {
        return Err(EngineError::Format(
            "checkpoint metadata fails its checksum".into(),
        ));
    }
    let mut meta = CheckpointMeta::decode(&meta_bytes)?;
    for s in &meta.skipped {
        report.warnings.push(format!("checkpoint: {s}"));
    }
    // Only a JBOD array grows (`array grow`); on any other a shorter list is as
    // wrong as a longer one.
    if meta.segments.len() > nsegs
        || (meta.segments.len() < nsegs && geo.layout != lamina_format::superblock::Layout::Jbod)
    {
        return Err(EngineError::Format(format!(
            "checkpoint lists {} segments, the array has {nsegs}",
            meta.segments.len()
        )));
    }
    // Nothing the checkpoint maps may lie in segments it does not list.
    let limit = meta.segments.len() as u32 * geo.segment_blocks;
    if meta.segments.len() < nsegs {
        add_grown_segments(&mut meta, nsegs, report);
    }
    let mut volumes = Vec::new();
    for v in &meta.volumes {
        if v.size_bytes / BLOCK_SIZE_U64 > crate::map::MAX_BLOCKS {
            return Err(EngineError::Format(format!(
                "checkpoint names volume {:?} of {} bytes, beyond the 16 PiB limit",
                v.name, v.size_bytes
            )));
        }
        let vs = Arc::new(VolumeShared::new(
            VolumeId(v.id),
            v.name.clone(),
            v.size_bytes,
            shared.new_map(v.size_bytes / BLOCK_SIZE_U64),
        ));
        for &page in &v.pages {
            let block = rd.next_block(report)?;
            for i in 0..MAP_ENTRIES_PER_PAGE {
                let lba = page as u64 * MAP_ENTRIES_PER_PAGE as u64 + i as u64;
                let e = u32::from_le_bytes(block[i * 4..i * 4 + 4].try_into().unwrap());
                if e == UNMAPPED || lba >= vs.map.len() {
                    continue;
                }
                let ok = e == BAD || (e - 1) < limit;
                if !ok {
                    return Err(EngineError::Format(format!(
                        "checkpoint maps volume {} block {lba} to an invalid place ({e:#x})",
                        v.name
                    )));
                }
                vs.map.store(Lba(lba), e);
            }
        }
        volumes.push((vs, v.clone()));
    }
    report.checkpoint_generation = cref.generation;
    report.checkpoint_version = cref.version;
    report.checkpoint_blocks = cref.payload_blocks;
    Ok(Checkpoint {
        version: Version(cref.version),
        generation: cref.generation,
        meta,
        volumes,
    })
}

/// Segments added to a JBOD array since the checkpoint (`grow`): free and never
/// written, they join the free queue at its front in index order. The walk then
/// meets them where the engine took them, because the engine that wrote after
/// this checkpoint started from the same queue.
fn add_grown_segments(meta: &mut CheckpointMeta, nsegs: usize, report: &mut RecoveryReport) {
    let old = meta.segments.len();
    meta.segments.resize(nsegs, SegmentRecord::never_written());
    // At the front: the new capacity is used at once (and, the new members having
    // nothing written, wear levelling takes them first anyway).
    let mut queue: Vec<u32> = (old as u32..nsegs as u32).collect();
    queue.append(&mut meta.free_queue);
    meta.free_queue = queue;
    report.warnings.push(format!(
        "the array has grown by {} segments since its checkpoint; they are free",
        nsegs - old
    ));
}

/// The segment table as the checkpoint recorded it: segments open at `C` count as
/// closed (recovery never continues a segment), metadata segments as metadata.
pub(super) fn segment_table(meta: &CheckpointMeta, nsegs: usize) -> Vec<Seg> {
    let mut segs: Vec<Seg> = (0..nsegs).map(|_| Seg::free(0)).collect();
    for (i, r) in meta.segments.iter().enumerate() {
        let s = &mut segs[i];
        s.erase_count = r.erase_count;
        s.incarnation = Version(r.incarnation);
        s.write_ptr = r.write_ptr;
        s.data_blocks = r.data_blocks;
        s.close_version = Version(r.close_version);
        s.has_summary = r.has_summary != 0;
        s.volume = r.volume;
        s.class = r.stream_class;
        s.kind = StreamKind::from_u8(r.stream_kind).unwrap_or(StreamKind::User);
        s.state = match r.state {
            SegmentState::Free => SegState::Free,
            SegmentState::Open | SegmentState::Closed => SegState::Closed,
            SegmentState::Checkpoint => SegState::Meta,
        };
        // Checkpoints written before segment times were recorded have none: the
        // segments then look equally old until they are reused.
        if let Some(t) = meta.segment_times.get(i) {
            s.born = t.born;
            s.closed = t.closed;
            if r.state != SegmentState::Free {
                s.origins = Origins::for_segment(s.kind, t.born);
            }
            if let (Some(o), Some(mean)) = (&mut s.origins, t.origins) {
                o.mean = mean;
            }
            s.last_invalidated = t.closed;
        }
    }
    // Free segments discarded since last written stay so until the walk finds
    // them written again (`replay::settle_segments`).
    for &(first, count) in &meta.discarded {
        for s in &mut segs[first as usize..][..count as usize] {
            s.clean = s.state == SegState::Free;
        }
    }
    segs
}

/// Reads the checkpoint payload blocks in order, following the metadata stream.
struct CheckpointReader<'a> {
    shared: &'a Shared,
    cref: CheckpointRef,
    seg: u32,
    offset: u32,
    incarnation: Option<u64>,
    next_index: u64,
    queue: VecDeque<Vec<u8>>,
    visited: HashSet<u32>,
    last_next_segment: u32,
}

impl<'a> CheckpointReader<'a> {
    fn new(shared: &'a Shared, cref: CheckpointRef) -> Self {
        CheckpointReader {
            shared,
            cref,
            seg: cref.first_segment,
            offset: 0,
            incarnation: Some(cref.first_incarnation),
            next_index: 0,
            queue: VecDeque::new(),
            visited: HashSet::from([cref.first_segment]),
            last_next_segment: NO_SEGMENT,
        }
    }

    fn next_block(&mut self, report: &mut RecoveryReport) -> Result<Vec<u8>, EngineError> {
        let damaged = |m: String| {
            EngineError::Format(format!(
                "checkpoint generation {}: {m}",
                self.cref.generation
            ))
        };
        while self.queue.is_empty() {
            let geo = &self.shared.geo;
            let h = geo.header_blocks as u32;
            let (seg, offset, incarnation) = (self.seg, self.offset, self.incarnation);
            let min = self.cref.version;
            let usable = if offset + h <= geo.data_end {
                read_unit_header(self.shared, report, seg, offset, h, |u| {
                    u.array_id == geo.array_id
                        && u.segment == seg
                        && u.offset == offset
                        && u.stream_kind == StreamKind::Meta
                        && incarnation.is_none_or(|i| u.incarnation == i)
                        && u.incarnation > min
                })
                .map(|(b, u, rebuilt)| {
                    if let Some(m) = rebuilt {
                        blame_member(self.shared, report, seg, offset, m);
                    }
                    (u, b)
                })
            } else {
                None
            };
            let Some((u, hbuf)) = usable else {
                // End of this segment: continue where its units said the stream goes.
                let next = self.last_next_segment;
                if next == NO_SEGMENT || !self.visited.insert(next) {
                    return Err(damaged(format!(
                        "payload ends after {} of {} blocks",
                        self.next_index, self.cref.payload_blocks
                    )));
                }
                self.seg = next;
                self.offset = 0;
                self.incarnation = None;
                continue;
            };
            self.incarnation = Some(u.incarnation);
            self.last_next_segment = u.next_segment;
            let data = if u.data_blocks > 0 {
                read_blocks(
                    self.shared,
                    report,
                    self.seg,
                    self.offset + h,
                    u.data_blocks,
                )?
            } else {
                Vec::new()
            };
            for i in 0..u.data_blocks as usize {
                let r = record_at(&hbuf, i);
                if r.kind != kind::CHECKPOINT
                    || r.c != self.cref.generation as u16
                    || u.version <= self.cref.version
                {
                    continue;
                }
                let mut block = data[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].to_vec();
                if r.a != self.next_index + self.queue.len() as u64 {
                    return Err(damaged(format!(
                        "block {} found where {} was expected",
                        r.a, self.next_index
                    )));
                }
                if lamina_format::crc32c(&block) != r.b {
                    let at = self.offset + h + i as u32;
                    block = self
                        .shared
                        .rebuild_block(SegmentId(self.seg), at, r.b)
                        .ok_or_else(|| {
                            damaged(format!("payload block {} fails its checksum", r.a))
                        })?;
                }
                self.queue.push_back(block);
            }
            self.offset += u.total_blocks();
        }
        self.next_index += 1;
        Ok(self.queue.pop_front().unwrap())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testing::{call, config, devices, engine_with_volume, entries, write};
    use super::super::{assemble, RecoveryReport};
    use super::*;
    use crate::engine::Request;
    use lamina_device::BlockDevice;

    /// The checkpoint gives back each volume with its map as the engine had it when
    /// the checkpoint was taken (not what was written after), and segments open then
    /// count as closed; a checkpoint whose first unit is damaged is refused with the
    /// generation named, never taken for an empty array.
    #[test]
    fn the_checkpoint_loads_as_taken_and_damage_is_refused() {
        let (dev, devs) = devices();
        let (mut e, v) = engine_with_volume(&devs);
        write(&mut e, v, 0, 100, 1);
        call(&mut e, Request::Checkpoint);
        let at_checkpoint = entries(&e.shared().volume("v").unwrap().map);
        write(&mut e, v, 0, 50, 2);
        call(&mut e, Request::Flush);
        drop(e);

        let mut report = RecoveryReport::default();
        let (sb, shared) =
            assemble::open_devices(devs.clone(), &config(), false, &mut report).unwrap();
        let cref = sb.checkpoint.expect("a checkpoint");
        let ckpt = load(&shared, Some(cref), &mut report).unwrap();
        assert_eq!(ckpt.version, Version(cref.version));
        assert_eq!(ckpt.volumes.len(), 1);
        let (vs, rec) = &ckpt.volumes[0];
        assert_eq!(
            (rec.name.as_str(), vs.size_bytes()),
            ("v", 512 * BLOCK_SIZE as u64)
        );
        assert_eq!(entries(&vs.map), at_checkpoint);
        let segs = segment_table(&ckpt.meta, shared.geo.segment_count as usize);
        assert!(segs.iter().any(|s| s.state == SegState::Closed));
        assert!(segs.iter().any(|s| s.state == SegState::Meta));

        let (_, off) = shared.geo.locate(SegmentId(cref.first_segment), 0);
        dev.write_at(&[0x5a; 64], off).unwrap();
        let err = load(&shared, Some(cref), &mut report)
            .err()
            .expect("damage refused");
        assert!(
            err.to_string()
                .contains(&format!("checkpoint generation {}", cref.generation)),
            "{err}"
        );
    }
}
