//! Checkpoint payload: the map and segment table, so recovery replays only the tail.
//!
//! A checkpoint is a sequence of blocks ("payload blocks") written as the data blocks
//! of metadata-stream write units, each protected by the CRC in its unit record:
//!
//! | payload blocks | content |
//! |---|---|
//! | 0 | [`CheckpointHeader`] |
//! | 1 ..= meta_blocks | [`CheckpointMeta`] serialised, `meta_bytes` long, CRC in the header |
//! | then | L2P map pages: for each volume in order, for each page listed in its `pages`, 1024 little-endian `u32` entries |
//!
//! The superblock's [`crate::superblock::CheckpointRef`] names the first segment and
//! the payload length; recovery follows the metadata stream's `next_segment` links.

use crate::codec::{get_u32, get_u64, put_u16, put_u32, put_u64, Reader, Writer};
use crate::{
    check_crc, check_magic_version, crc32c, crc32c_with_hole, FormatError, BLOCK_SIZE,
    FORMAT_VERSION,
};

/// "LMNCKPT\0" as a little-endian u64.
pub const CHECKPOINT_MAGIC: u64 = u64::from_le_bytes(*b"LMNCKPT\0");
/// L2P entries per map page (one 4 KiB block of `u32`).
pub const MAP_ENTRIES_PER_PAGE: usize = BLOCK_SIZE / 4;

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_ARRAY_ID: usize = 16;
const OFF_GENERATION: usize = 24;
const OFF_START_VERSION: usize = 32;
const OFF_PAYLOAD_BLOCKS: usize = 40;
const OFF_META_BYTES: usize = 48;
const OFF_MAP_PAGES: usize = 56;
const OFF_META_CRC: usize = 64;
pub(crate) const OFF_CRC: usize = 68;
pub(crate) const HEADER_SIZE: usize = 72;

/// Payload block 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointHeader {
    pub array_id: u64,
    pub generation: u64,
    /// Array version when the checkpoint started. Every unit with a higher version
    /// is replayed on recovery.
    pub start_version: u64,
    pub payload_blocks: u64,
    pub meta_bytes: u64,
    pub map_pages: u64,
    pub meta_crc: u32,
}

impl CheckpointHeader {
    /// Payload blocks taken by the metadata section.
    pub fn meta_blocks(&self) -> u64 {
        self.meta_bytes.div_ceil(BLOCK_SIZE as u64)
    }

    pub fn encode(&self) -> Box<[u8; BLOCK_SIZE]> {
        let mut b = Box::new([0u8; BLOCK_SIZE]);
        put_u64(&mut b[..], OFF_MAGIC, CHECKPOINT_MAGIC);
        put_u16(&mut b[..], OFF_VERSION, FORMAT_VERSION);
        put_u64(&mut b[..], OFF_ARRAY_ID, self.array_id);
        put_u64(&mut b[..], OFF_GENERATION, self.generation);
        put_u64(&mut b[..], OFF_START_VERSION, self.start_version);
        put_u64(&mut b[..], OFF_PAYLOAD_BLOCKS, self.payload_blocks);
        put_u64(&mut b[..], OFF_META_BYTES, self.meta_bytes);
        put_u64(&mut b[..], OFF_MAP_PAGES, self.map_pages);
        put_u32(&mut b[..], OFF_META_CRC, self.meta_crc);
        let crc = crc32c_with_hole(&b[..HEADER_SIZE], OFF_CRC);
        put_u32(&mut b[..], OFF_CRC, crc);
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        const WHAT: &str = "checkpoint header";
        check_magic_version(b, WHAT, CHECKPOINT_MAGIC, HEADER_SIZE)?;
        check_crc(&b[..HEADER_SIZE], WHAT, OFF_CRC)?;
        let h = CheckpointHeader {
            array_id: get_u64(b, OFF_ARRAY_ID),
            generation: get_u64(b, OFF_GENERATION),
            start_version: get_u64(b, OFF_START_VERSION),
            payload_blocks: get_u64(b, OFF_PAYLOAD_BLOCKS),
            meta_bytes: get_u64(b, OFF_META_BYTES),
            map_pages: get_u64(b, OFF_MAP_PAGES),
            meta_crc: get_u32(b, OFF_META_CRC),
        };
        if 1 + h.meta_blocks() + h.map_pages != h.payload_blocks {
            return Err(FormatError::Invalid {
                what: WHAT,
                detail: format!(
                    "payload of {} blocks does not hold {} meta bytes and {} map pages",
                    h.payload_blocks, h.meta_bytes, h.map_pages
                ),
            });
        }
        Ok(h)
    }
}

/// One volume as the checkpoint records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeRecord {
    pub id: u16,
    pub name: String,
    pub size_bytes: u64,
    pub created_version: u64,
    /// User blocks ever written to this volume.
    pub user_blocks_written: u64,
    /// Blocks relocated by GC for this volume.
    pub gc_blocks_relocated: u64,
    /// Blocks written to media on behalf of this volume (data, headers, summaries).
    pub media_blocks_written: u64,
    /// Map pages of this volume present in the checkpoint (others are all unmapped),
    /// ascending.
    pub pages: Vec<u32>,
}

/// State of a segment as recorded in a checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SegmentState {
    /// In the free queue (or waiting to be released).
    Free = 0,
    /// The head of a stream; units are appended at `write_ptr`.
    Open = 1,
    /// Sealed; holds data until garbage collection empties it.
    Closed = 2,
    /// Holds the checkpoint that is being superseded; freed when this one commits.
    Checkpoint = 3,
}

impl SegmentState {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => SegmentState::Free,
            1 => SegmentState::Open,
            2 => SegmentState::Closed,
            3 => SegmentState::Checkpoint,
            _ => return None,
        })
    }
}

/// One segment in the checkpoint's segment table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentRecord {
    pub state: SegmentState,
    pub stream_kind: u8,
    pub stream_class: u8,
    /// 1 if the segment ends with a summary.
    pub has_summary: u8,
    pub volume: u16,
    /// Blocks used by units.
    pub write_ptr: u32,
    /// Data blocks in those units.
    pub data_blocks: u32,
    pub incarnation: u64,
    pub close_version: u64,
    pub erase_count: u32,
}

impl SegmentRecord {
    /// A free segment that was never written.
    pub fn never_written() -> Self {
        SegmentRecord {
            state: SegmentState::Free,
            stream_kind: 0,
            stream_class: 0,
            has_summary: 0,
            volume: 0,
            write_ptr: 0,
            data_blocks: 0,
            incarnation: 0,
            close_version: 0,
            erase_count: 0,
        }
    }
}

/// One stream head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StreamRecord {
    pub kind: u8,
    pub class: u8,
    pub volume: u16,
    /// Open segment, or `u32::MAX` when the stream has none.
    pub segment: u32,
    /// Segment reserved to follow it (metadata stream), or `u32::MAX`.
    pub next_segment: u32,
}

/// When a segment was opened and closed, in its volume's time (user blocks written
/// to the volume): the ages cost-benefit GC and the classifiers read. All zero for
/// a segment not in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct SegmentTimes {
    pub born: u64,
    pub closed: u64,
    /// Segments written by GC: when the blocks in each of its [`ORIGIN_SLOTS`]
    /// equal parts were last written by users (mean).
    pub origins: Option<[u64; ORIGIN_SLOTS]>,
}

/// Parts a GC segment's blocks are dated by.
pub const ORIGIN_SLOTS: usize = 16;

/// A volume's placement state: what its classifier has learnt, opaque to the format
/// (the classifier encodes and checks it), at most [`MAX_PLACEMENT_STATE`] bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlacementRecord {
    pub volume: u16,
    /// The classifier's name, so that a changed configuration starts afresh.
    pub classifier: String,
    pub state: Vec<u8>,
}

/// A volume that shares blocks with others: a snapshot, a clone, or a volume
/// something was made from. Volumes that share nothing have no record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LineageRecord {
    pub volume: u16,
    /// The family: the id of the volume the first snapshot was taken of. Blocks are
    /// shared only within a family, always at the same LBA.
    pub family: u16,
    /// The volume this one was made from ([`NO_ORIGIN`] for the family's root).
    pub origin: u16,
    /// [`LINEAGE_READ_ONLY`], [`LINEAGE_DELETED`].
    pub flags: u16,
}

/// [`LineageRecord::origin`] of a family's root.
pub const NO_ORIGIN: u16 = u16::MAX;
/// A snapshot: read-only.
pub const LINEAGE_READ_ONLY: u16 = 1;
/// A deleted member, kept while its family lives: unit records may still name it.
pub const LINEAGE_DELETED: u16 = 2;

/// Largest placement state a checkpoint carries per volume: classifier state must
/// stay bounded whatever the volume's size.
pub const MAX_PLACEMENT_STATE: usize = 64 << 10;

/// Sections after the fixed part of the metadata, each `tag: u32, length: u32,
/// bytes`. Checkpoints written before a section existed simply lack it, and a
/// reader skips tags it does not know, so adding one needs no format version.
const EXT_SEGMENT_TIMES: u32 = 1;
const EXT_PLACEMENT: u32 = 2;
const EXT_DISCARDED: u32 = 3;
const EXT_POLICY: u32 = 4;
/// Snapshot families. Unlike the others, recovery needs it: a checkpoint whose
/// lineage section cannot be read is refused (an array with shared blocks has a
/// version 3 superblock, so a build that predates the section refuses it too).
const EXT_LINEAGE: u32 = 5;

/// Encoded size of a [`SegmentRecord`].
pub const SEGMENT_RECORD_SIZE: usize = 34;
/// Encoded size of a [`StreamRecord`].
pub const STREAM_RECORD_SIZE: usize = 12;

/// The metadata section of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct CheckpointMeta {
    pub volumes: Vec<VolumeRecord>,
    pub segments: Vec<SegmentRecord>,
    /// Free segments in the order they will be allocated after this checkpoint.
    pub free_queue: Vec<u32>,
    pub streams: Vec<StreamRecord>,
    /// Array-wide counters: user blocks, media blocks, GC blocks, metadata blocks, ...
    pub counters: Vec<u64>,
    /// One per segment, or none (checkpoints written before they were recorded).
    pub segment_times: Vec<SegmentTimes>,
    /// Each volume's classifier and what it has learnt.
    pub placement: Vec<PlacementRecord>,
    /// Each volume's GC victim policy and what it has learnt, in the same record
    /// (`classifier` holds the policy's name), for the policies that keep state.
    pub policies: Vec<PlacementRecord>,
    /// Free segments whose extent was discarded since they were last written, as
    /// ascending, disjoint runs `(first, count)`: a restart need not discard them
    /// again. Losing the section only costs discards done twice.
    pub discarded: Vec<(u32, u32)>,
    /// Snapshot families (tag 5), one record per volume that shares blocks.
    pub lineage: Vec<LineageRecord>,
    /// Optional sections this build could not read and skipped (not encoded).
    pub skipped: Vec<String>,
}

impl CheckpointMeta {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.volumes.len() as u32);
        for v in &self.volumes {
            w.u16(v.id);
            w.str(&v.name);
            w.u64(v.size_bytes);
            w.u64(v.created_version);
            w.u64(v.user_blocks_written);
            w.u64(v.gc_blocks_relocated);
            w.u64(v.media_blocks_written);
            w.u32(v.pages.len() as u32);
            for p in &v.pages {
                w.u32(*p);
            }
        }
        w.u32(self.segments.len() as u32);
        for s in &self.segments {
            w.u8(s.state as u8);
            w.u8(s.stream_kind);
            w.u8(s.stream_class);
            w.u8(s.has_summary);
            w.u16(s.volume);
            w.u32(s.write_ptr);
            w.u32(s.data_blocks);
            w.u64(s.incarnation);
            w.u64(s.close_version);
            w.u32(s.erase_count);
        }
        w.u32(self.free_queue.len() as u32);
        for f in &self.free_queue {
            w.u32(*f);
        }
        w.u32(self.streams.len() as u32);
        for s in &self.streams {
            w.u8(s.kind);
            w.u8(s.class);
            w.u16(s.volume);
            w.u32(s.segment);
            w.u32(s.next_segment);
        }
        w.u32(self.counters.len() as u32);
        for c in &self.counters {
            w.u64(*c);
        }
        if !self.segment_times.is_empty() {
            section(&mut w, EXT_SEGMENT_TIMES, |e| {
                e.u32(self.segment_times.len() as u32);
                for t in &self.segment_times {
                    e.u64(t.born);
                    e.u64(t.closed);
                    match &t.origins {
                        None => e.u8(0),
                        Some(o) => {
                            e.u8(ORIGIN_SLOTS as u8);
                            for &x in o {
                                e.u64(x);
                            }
                        }
                    }
                }
            });
        }
        for (tag, records) in [
            (EXT_PLACEMENT, &self.placement),
            (EXT_POLICY, &self.policies),
        ] {
            if records.is_empty() {
                continue;
            }
            section(&mut w, tag, |e| {
                e.u32(records.len() as u32);
                for p in records {
                    debug_assert!(p.state.len() <= MAX_PLACEMENT_STATE);
                    e.u16(p.volume);
                    e.str(&p.classifier);
                    e.u32(p.state.len() as u32);
                    e.buf.extend_from_slice(&p.state);
                }
            });
        }
        if !self.lineage.is_empty() {
            section(&mut w, EXT_LINEAGE, |e| {
                e.u32(self.lineage.len() as u32);
                for l in &self.lineage {
                    e.u16(l.volume);
                    e.u16(l.family);
                    e.u16(l.origin);
                    e.u16(l.flags);
                }
            });
        }
        if !self.discarded.is_empty() {
            section(&mut w, EXT_DISCARDED, |e| {
                e.u32(self.discarded.len() as u32);
                for &(first, count) in &self.discarded {
                    e.u32(first);
                    e.u32(count);
                }
            });
        }
        w.buf
    }

    pub fn decode(buf: &[u8]) -> Result<Self, FormatError> {
        const WHAT: &str = "checkpoint metadata";
        let mut r = Reader::new(buf, WHAT);
        let invalid = |detail: String| FormatError::Invalid { what: WHAT, detail };
        // Counts are bounded by what the remaining bytes could hold, so a damaged
        // count cannot drive a huge allocation.
        let bounded = |n: u32, each: usize, r: &Reader| -> Result<usize, FormatError> {
            let n = n as usize;
            if n.saturating_mul(each) > buf.len() - r.position() {
                Err(invalid(format!("count {n} exceeds section")))
            } else {
                Ok(n)
            }
        };
        let n = r.u32()?;
        let n = bounded(n, 2 + 2 + 8 * 5 + 4, &r)?;
        let mut volumes = Vec::with_capacity(n);
        for _ in 0..n {
            let id = r.u16()?;
            let name = r.str()?;
            let size_bytes = r.u64()?;
            let created_version = r.u64()?;
            let user_blocks_written = r.u64()?;
            let gc_blocks_relocated = r.u64()?;
            let media_blocks_written = r.u64()?;
            let np = r.u32()?;
            let np = bounded(np, 4, &r)?;
            let mut pages = Vec::with_capacity(np);
            for _ in 0..np {
                pages.push(r.u32()?);
            }
            volumes.push(VolumeRecord {
                id,
                name,
                size_bytes,
                created_version,
                user_blocks_written,
                gc_blocks_relocated,
                media_blocks_written,
                pages,
            });
        }
        let n = r.u32()?;
        let n = bounded(n, SEGMENT_RECORD_SIZE, &r)?;
        let mut segments = Vec::with_capacity(n);
        for i in 0..n {
            let st = r.u8()?;
            let state = SegmentState::from_u8(st)
                .ok_or_else(|| invalid(format!("segment {i} state {st}")))?;
            segments.push(SegmentRecord {
                state,
                stream_kind: r.u8()?,
                stream_class: r.u8()?,
                has_summary: r.u8()?,
                volume: r.u16()?,
                write_ptr: r.u32()?,
                data_blocks: r.u32()?,
                incarnation: r.u64()?,
                close_version: r.u64()?,
                erase_count: r.u32()?,
            });
        }
        let n = r.u32()?;
        let n = bounded(n, 4, &r)?;
        let mut free_queue = Vec::with_capacity(n);
        for _ in 0..n {
            free_queue.push(r.u32()?);
        }
        let n = r.u32()?;
        let n = bounded(n, STREAM_RECORD_SIZE, &r)?;
        let mut streams = Vec::with_capacity(n);
        for _ in 0..n {
            streams.push(StreamRecord {
                kind: r.u8()?,
                class: r.u8()?,
                volume: r.u16()?,
                segment: r.u32()?,
                next_segment: r.u32()?,
            });
        }
        let n = r.u32()?;
        let n = bounded(n, 8, &r)?;
        let mut counters = Vec::with_capacity(n);
        for _ in 0..n {
            counters.push(r.u64()?);
        }
        // The optional sections: nothing in them is needed to recover, so a section
        // this build cannot read (damaged, or from a later build that changed it)
        // is skipped with a note, never an error that would keep the array closed.
        let mut segment_times = Vec::new();
        let mut placement = Vec::new();
        let mut policies = Vec::new();
        let mut discarded = Vec::new();
        let mut lineage = Vec::new();
        let mut skipped = Vec::new();
        let rest = &buf[r.position()..];
        let mut x = Reader::new(rest, WHAT);
        while x.position() < rest.len() {
            let section = (|| -> Result<(u32, &[u8]), FormatError> {
                let tag = x.u32()?;
                let len = x.u32()? as usize;
                Ok((tag, x.bytes(len)?))
            })();
            let (tag, section) = match section {
                Ok(s) => s,
                Err(e) => {
                    skipped.push(format!("optional sections cut short: {e}"));
                    break;
                }
            };
            let read = match tag {
                EXT_SEGMENT_TIMES => {
                    decode_segment_times(section, segments.len()).map(|t| segment_times = t)
                }
                EXT_PLACEMENT => decode_placement(section).map(|p| placement = p),
                EXT_POLICY => decode_placement(section).map(|p| policies = p),
                EXT_DISCARDED => decode_discarded(section, segments.len()).map(|d| discarded = d),
                // Needed to recover: an error, not a note.
                EXT_LINEAGE => {
                    lineage = decode_lineage(section)?;
                    Ok(())
                }
                // A section a later build added.
                _ => Ok(()),
            };
            if let Err(e) = read {
                skipped.push(format!("section {tag} skipped: {e}"));
            }
        }
        Ok(CheckpointMeta {
            volumes,
            segments,
            free_queue,
            streams,
            counters,
            segment_times,
            placement,
            policies,
            discarded,
            lineage,
            skipped,
        })
    }
}

/// The lineage section: one record per sharing volume, each volume once.
fn decode_lineage(b: &[u8]) -> Result<Vec<LineageRecord>, FormatError> {
    let mut r = Reader::new(b, "checkpoint lineage");
    let invalid = |detail: String| FormatError::Invalid {
        what: "checkpoint lineage",
        detail,
    };
    let n = r.u32()? as usize;
    if n.saturating_mul(8) > b.len() - r.position() {
        return Err(invalid(format!("{n} records do not fit in the section")));
    }
    let mut out: Vec<LineageRecord> = Vec::with_capacity(n);
    for _ in 0..n {
        let l = LineageRecord {
            volume: r.u16()?,
            family: r.u16()?,
            origin: r.u16()?,
            flags: r.u16()?,
        };
        if l.volume == NO_ORIGIN || l.flags & !(LINEAGE_READ_ONLY | LINEAGE_DELETED) != 0 {
            return Err(invalid(format!("bad record {l:?}")));
        }
        if out.iter().any(|o| o.volume == l.volume) {
            return Err(invalid(format!("volume {} listed twice", l.volume)));
        }
        out.push(l);
    }
    Ok(out)
}

/// Appends an optional section: `tag`, the length of what `body` writes, then that.
fn section(w: &mut Writer, tag: u32, body: impl FnOnce(&mut Writer)) {
    let mut e = Writer::default();
    body(&mut e);
    w.u32(tag);
    w.u32(e.buf.len() as u32);
    w.buf.extend_from_slice(&e.buf);
}

/// The discarded-segments section: ascending, disjoint runs within the table.
fn decode_discarded(b: &[u8], segments: usize) -> Result<Vec<(u32, u32)>, FormatError> {
    const WHAT: &str = "checkpoint discarded segments";
    let invalid = |detail: String| FormatError::Invalid { what: WHAT, detail };
    let mut e = Reader::new(b, WHAT);
    let n = e.u32()? as usize;
    let left = b.len() - e.position();
    if n.saturating_mul(8) != left {
        return Err(invalid(format!("{n} runs in {left} bytes")));
    }
    let mut runs = Vec::with_capacity(n);
    let mut end = 0u64;
    for _ in 0..n {
        let (first, count) = (e.u32()?, e.u32()?);
        let last = first as u64 + count as u64;
        if count == 0 || (first as u64) < end || last > segments as u64 {
            return Err(invalid(format!(
                "run of {count} from segment {first} (after {end}, of {segments})"
            )));
        }
        end = last;
        runs.push((first, count));
    }
    Ok(runs)
}

/// The segment-times section: one entry per segment of the table.
fn decode_segment_times(b: &[u8], segments: usize) -> Result<Vec<SegmentTimes>, FormatError> {
    const WHAT: &str = "checkpoint segment times";
    let invalid = |detail: String| FormatError::Invalid { what: WHAT, detail };
    let mut e = Reader::new(b, WHAT);
    let n = e.u32()? as usize;
    // Each entry takes at least 17 bytes: a damaged count cannot size the vector.
    if n != segments || n.saturating_mul(17) > b.len() {
        return Err(invalid(format!(
            "{n} entries for {segments} segments in {} bytes",
            b.len()
        )));
    }
    let mut times = Vec::with_capacity(n);
    for i in 0..n {
        let (born, closed) = (e.u64()?, e.u64()?);
        let origins = match e.u8()? {
            0 => None,
            k if k as usize == ORIGIN_SLOTS => {
                let mut o = [0u64; ORIGIN_SLOTS];
                for x in &mut o {
                    *x = e.u64()?;
                }
                Some(o)
            }
            k => return Err(invalid(format!("segment {i}: {k} origin slots"))),
        };
        times.push(SegmentTimes {
            born,
            closed,
            origins,
        });
    }
    if e.position() != b.len() {
        return Err(invalid(format!(
            "{} bytes left over",
            b.len() - e.position()
        )));
    }
    Ok(times)
}

/// The placement section: each volume's classifier and its state.
fn decode_placement(b: &[u8]) -> Result<Vec<PlacementRecord>, FormatError> {
    const WHAT: &str = "checkpoint placement state";
    let mut e = Reader::new(b, WHAT);
    let n = e.u32()? as usize;
    let mut out = Vec::new();
    // Each record takes at least 8 bytes: a damaged count cannot run long.
    for _ in 0..n.min(b.len() / 8) {
        let volume = e.u16()?;
        let classifier = e.str()?;
        let size = e.u32()? as usize;
        if size > MAX_PLACEMENT_STATE {
            return Err(FormatError::Invalid {
                what: WHAT,
                detail: format!("state of volume {volume} is {size} bytes"),
            });
        }
        out.push(PlacementRecord {
            volume,
            classifier,
            state: e.bytes(size)?.to_vec(),
        });
    }
    Ok(out)
}

/// Splits encoded metadata into payload blocks (zero padded) and returns its CRC.
pub fn meta_crc(meta_bytes: &[u8]) -> u32 {
    crc32c(meta_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> CheckpointMeta {
        CheckpointMeta {
            volumes: vec![VolumeRecord {
                id: 0,
                name: "default".into(),
                size_bytes: 1 << 30,
                created_version: 5,
                user_blocks_written: 1000,
                gc_blocks_relocated: 10,
                media_blocks_written: 1020,
                pages: vec![0, 3, 9],
            }],
            segments: vec![
                SegmentRecord {
                    state: SegmentState::Closed,
                    stream_kind: 0,
                    stream_class: 0,
                    has_summary: 1,
                    volume: 0,
                    write_ptr: 2039,
                    data_blocks: 2020,
                    incarnation: 9,
                    close_version: 20,
                    erase_count: 2,
                },
                SegmentRecord::never_written(),
            ],
            free_queue: vec![1],
            streams: vec![StreamRecord {
                kind: 0,
                class: 0,
                volume: 0,
                segment: 0,
                next_segment: 5,
            }],
            counters: vec![1, 2, 3],
            segment_times: vec![],
            placement: vec![],
            policies: vec![],
            discarded: vec![],
            lineage: vec![],
            skipped: vec![],
        }
    }

    /// The victim policies' section travels like the classifiers' one, beside it.
    #[test]
    fn policy_state_roundtrips_beside_the_placement_state() {
        let mut m = sample();
        m.placement = vec![PlacementRecord {
            volume: 0,
            classifier: "sepbit".into(),
            state: vec![1, 2, 3],
        }];
        m.policies = vec![PlacementRecord {
            volume: 0,
            classifier: "auto".into(),
            state: vec![1, 1],
        }];
        assert_eq!(CheckpointMeta::decode(&m.encode()).unwrap(), m);
        // The policies travel in a section of their own (tag 4), which a reader that
        // predates it skips as an unknown tag.
        let only_placement = CheckpointMeta {
            policies: vec![],
            ..m.clone()
        };
        assert_ne!(m.encode(), only_placement.encode());
    }

    /// The discarded segments travel as runs; runs that overlap, go backwards, are
    /// empty or leave the table make the section skipped, never the checkpoint.
    #[test]
    fn lineage_roundtrips_and_a_damaged_one_is_refused() {
        let mut m = sample();
        m.lineage = vec![
            LineageRecord {
                volume: 0,
                family: 0,
                origin: NO_ORIGIN,
                flags: 0,
            },
            LineageRecord {
                volume: 3,
                family: 0,
                origin: 0,
                flags: LINEAGE_READ_ONLY,
            },
            LineageRecord {
                volume: 4,
                family: 0,
                origin: 3,
                flags: LINEAGE_DELETED,
            },
        ];
        let enc = m.encode();
        assert_eq!(CheckpointMeta::decode(&enc).unwrap(), m);
        // Recovery needs the families: a damaged section is an error, where the
        // other optional sections are skipped.
        let mut dup = m.clone();
        dup.lineage[2].volume = 3;
        assert!(CheckpointMeta::decode(&dup.encode()).is_err());
        let mut flags = m.clone();
        flags.lineage[1].flags = 0x80;
        assert!(CheckpointMeta::decode(&flags.encode()).is_err());
        let mut cut = m.encode();
        let at = cut.len() - 8 * 3 - 4;
        cut[at..at + 4].copy_from_slice(&1000u32.to_le_bytes());
        assert!(CheckpointMeta::decode(&cut).is_err());
    }

    #[test]
    fn discarded_runs_roundtrip_and_bad_ones_are_skipped() {
        let mut m = sample();
        m.discarded = vec![(1, 1)];
        assert_eq!(CheckpointMeta::decode(&m.encode()).unwrap(), m);
        for bad in [
            vec![(0, 2), (1, 1)],
            vec![(1, 1), (0, 1)],
            vec![(0, 0)],
            vec![(1, 2)],
            vec![(u32::MAX, 2)],
        ] {
            let mut b = sample();
            b.discarded = bad.clone();
            let d = CheckpointMeta::decode(&b.encode()).expect("decodes");
            assert!(
                d.discarded.is_empty() && d.skipped.len() == 1,
                "{bad:?}: {:?}",
                d.skipped
            );
        }
        // A count that does not match the section's length.
        let mut enc = sample().encode();
        enc.extend_from_slice(&EXT_DISCARDED.to_le_bytes());
        enc.extend_from_slice(&8u32.to_le_bytes());
        enc.extend_from_slice(&1000u32.to_le_bytes());
        enc.extend_from_slice(&1u32.to_le_bytes());
        let d = CheckpointMeta::decode(&enc).expect("decodes");
        assert!(d.discarded.is_empty() && d.skipped.len() == 1);
    }

    #[test]
    fn extension_sections_roundtrip_and_are_optional() {
        let plain = sample();
        let mut m = sample();
        m.segment_times = vec![
            SegmentTimes {
                born: 7,
                closed: 900,
                origins: Some([3; ORIGIN_SLOTS]),
            },
            SegmentTimes::default(),
        ];
        m.placement = vec![PlacementRecord {
            volume: 0,
            classifier: "sepbit".into(),
            state: vec![1, 2, 3, 4],
        }];
        let enc = m.encode();
        assert_eq!(CheckpointMeta::decode(&enc).unwrap(), m);
        // A checkpoint without the sections (an older writer) reads with none.
        assert_eq!(CheckpointMeta::decode(&plain.encode()).unwrap(), plain);
        // A section this build does not know is skipped.
        let mut unknown = plain.encode();
        unknown.extend_from_slice(&99u32.to_le_bytes());
        unknown.extend_from_slice(&3u32.to_le_bytes());
        unknown.extend_from_slice(&[9, 9, 9]);
        assert_eq!(CheckpointMeta::decode(&unknown).unwrap(), plain);
        // A cut anywhere in the sections reads, never panics: the sections before
        // it are kept, the one it falls in is skipped with a note (the header's
        // length and checksum are what catch a cut checkpoint).
        for cut in plain.encode().len() + 1..enc.len() {
            let d = CheckpointMeta::decode(&enc[..cut]).expect("decodes");
            assert!(d.placement.is_empty(), "cut at {cut}");
            assert!(
                d.segment_times.is_empty() || d.segment_times == m.segment_times,
                "cut at {cut}"
            );
            // Only a cut between the two sections reads without a note.
            assert!(
                !d.skipped.is_empty() || d.segment_times == m.segment_times,
                "cut at {cut}"
            );
        }
    }

    /// A section this build cannot read is skipped with a note, and the
    /// checkpoint still reads: nothing in the sections is needed to recover.
    #[test]
    fn damaged_extension_sections_are_skipped() {
        let with = |tag: u32, body: &[u8]| {
            let mut enc = sample().encode();
            enc.extend_from_slice(&tag.to_le_bytes());
            enc.extend_from_slice(&(body.len() as u32).to_le_bytes());
            enc.extend_from_slice(body);
            CheckpointMeta::decode(&enc).expect("decodes")
        };
        let times_skipped = |d: &CheckpointMeta| {
            assert!(
                d.segment_times.is_empty() && d.skipped.len() == 1,
                "{:?}",
                d.skipped
            )
        };
        // Times for the wrong number of segments.
        let mut m = sample();
        m.segment_times = vec![SegmentTimes::default()];
        let d = CheckpointMeta::decode(&m.encode()).unwrap();
        times_skipped(&d);
        // An origin slot count this build does not know.
        let mut w = Writer::default();
        w.u32(2);
        for k in [0u8, 7] {
            w.u64(1);
            w.u64(2);
            w.u8(k);
        }
        let d = with(EXT_SEGMENT_TIMES, &w.buf);
        times_skipped(&d);
        // A placement state beyond the bound.
        let mut w = Writer::default();
        w.u32(1);
        w.u16(0);
        w.str("x");
        w.u32(MAX_PLACEMENT_STATE as u32 + 1);
        w.buf.extend_from_slice(&vec![0; MAX_PLACEMENT_STATE + 1]);
        let d = with(EXT_PLACEMENT, &w.buf);
        assert!(
            d.placement.is_empty() && d.skipped.len() == 1,
            "{:?}",
            d.skipped
        );
        // A section length beyond the buffer.
        let mut enc = sample().encode();
        enc.extend_from_slice(&EXT_SEGMENT_TIMES.to_le_bytes());
        enc.extend_from_slice(&u32::MAX.to_le_bytes());
        let d = CheckpointMeta::decode(&enc).expect("decodes");
        times_skipped(&d);
        // The fixed part damaged is still an error.
        let enc = sample().encode();
        assert!(CheckpointMeta::decode(&enc[..enc.len() - 3]).is_err());
    }

    #[test]
    fn meta_roundtrip() {
        let m = sample();
        assert_eq!(CheckpointMeta::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn record_sizes_are_exact() {
        // Many segments and nothing after them: the bound checks must accept exactly
        // what fits, so they must use the true record sizes.
        let mut m = sample();
        m.segments = vec![m.segments[0]; 1000];
        m.free_queue.clear();
        m.streams.clear();
        m.counters.clear();
        let enc = m.encode();
        assert_eq!(CheckpointMeta::decode(&enc).unwrap(), m);
        let empty = CheckpointMeta {
            segments: vec![m.segments[0]],
            ..Default::default()
        }
        .encode();
        assert_eq!(empty.len(), 4 + 4 + SEGMENT_RECORD_SIZE + 4 + 4 + 4);
        let streams = CheckpointMeta {
            streams: vec![sample().streams[0]],
            ..Default::default()
        }
        .encode();
        assert_eq!(streams.len(), 4 + 4 + 4 + 4 + STREAM_RECORD_SIZE + 4);
    }

    #[test]
    fn truncated_meta_is_an_error_not_a_panic() {
        let enc = sample().encode();
        for cut in 0..enc.len() {
            assert!(CheckpointMeta::decode(&enc[..cut]).is_err());
        }
    }

    #[test]
    fn header_roundtrip_and_consistency() {
        let h = CheckpointHeader {
            array_id: 1,
            generation: 2,
            start_version: 3,
            payload_blocks: 1 + 1 + 7,
            meta_bytes: 100,
            map_pages: 7,
            meta_crc: 9,
        };
        assert_eq!(CheckpointHeader::decode(&h.encode()[..]).unwrap(), h);
        let bad = CheckpointHeader {
            payload_blocks: 5,
            ..h
        };
        assert!(CheckpointHeader::decode(&bad.encode()[..]).is_err());
    }
}
