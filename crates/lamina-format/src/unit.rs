//! Write units: the header that makes every write self-describing.
//!
//! A segment is filled front to back with write units. A unit is `header_blocks`
//! header blocks followed by `data_blocks` data blocks. The header holds a fixed part
//! (64 bytes) and then 16-byte [`RawRecord`]s:
//!
//! * the first `data_blocks` records describe the data blocks in order (volume, LBA and
//!   CRC-32C of the block; or a checkpoint block index; or a block that was already
//!   stale when the unit was sealed),
//! * the remaining records are events that ride along: trims (two slots: range, then
//!   the trim's version), segment releases, and aliases (a data block of the unit
//!   that other volumes of a snapshot family also map).
//!
//! Recovery reads only headers: a unit is accepted when its magic, checksum, array id,
//! segment, offset and incarnation all match what the reader expects at that place,
//! and its version is above the previous unit's. The first mismatch ends the segment.

use crate::codec::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::{
    check_crc, check_magic_version, crc32c_with_hole, FormatError, BLOCK_SIZE, FORMAT_VERSION,
};

/// "LMNUNIT\0" as a little-endian u64.
pub const UNIT_MAGIC: u64 = u64::from_le_bytes(*b"LMNUNIT\0");
/// Size of the fixed part of a unit header (104 bytes in use, the rest reserved zero).
pub const UNIT_FIXED_SIZE: usize = 128;
/// Size of one record.
pub const RECORD_SIZE: usize = 16;
/// Upper bound on header blocks (keeps a damaged count from driving huge reads).
pub const MAX_HEADER_BLOCKS: u16 = 64;
/// Sentinel for "no next segment".
pub const NO_SEGMENT: u32 = u32::MAX;
/// Largest LBA a record can carry (48 bits; 1 EiB of 4 KiB blocks).
pub const MAX_RECORD_LBA: u64 = (1 << 48) - 1;

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_HEADER_BLOCKS: usize = 10;
const OFF_RECORD_COUNT: usize = 12;
const OFF_ARRAY_ID: usize = 16;
const OFF_SEGMENT: usize = 24;
const OFF_OFFSET: usize = 28;
const OFF_INCARNATION: usize = 32;
const OFF_UNIT_VERSION: usize = 40;
const OFF_DATA_BLOCKS: usize = 48;
const OFF_STREAM_KIND: usize = 52;
const OFF_STREAM_CLASS: usize = 53;
const OFF_VOLUME: usize = 54;
const OFF_NEXT_SEGMENT: usize = 56;
pub(crate) const OFF_CRC: usize = 60;
const OFF_DURABLE_VERSION: usize = 64;
const OFF_RUN_START: usize = 72;
const OFF_OPENED_TIME: usize = 80;
const OFF_VOLUME_TIME: usize = 88;
const OFF_ORIGIN: usize = 96;
const OFF_RESERVED: usize = 104;

/// Record kinds (the `kind` field of a [`RawRecord`]).
pub mod kind {
    /// A live data block: `a` = volume << 48 | lba, `b` = CRC-32C of the block.
    pub const DATA: u16 = 1;
    /// A data block that was overwritten or trimmed before its unit was sealed. Its
    /// slot holds bytes but they belong to no one. Same fields as DATA.
    pub const DEAD: u16 = 2;
    /// A block of checkpoint payload: `a` = payload block index, `b` = CRC-32C.
    pub const CHECKPOINT: u16 = 3;
    /// A trim: `a` = volume << 48 | first lba, `b` = block count. Always followed by a
    /// VERSION record holding the trim's version.
    pub const TRIM: u16 = 4;
    /// Extension of the previous record: `a` = a version number.
    pub const VERSION: u16 = 5;
    /// A segment incarnation whose blocks are all superseded: `a` = incarnation,
    /// `b` = segment id. Once this unit is durable the segment may be reused.
    pub const RELEASE: u16 = 6;
    /// Summary only: a unit boundary. `a` = offset of the unit in the segment,
    /// `b` = data blocks, `c` = header blocks. Its data records follow it.
    pub const UNIT: u16 = 7;
    /// Another volume's reference to one of this unit's data blocks (snapshots and
    /// clones share blocks): `a` = volume << 48 | lba, `b` = the index of the data
    /// block in this unit. Ordered by the unit's version, as a DATA record is.
    pub const ALIAS: u16 = 8;

    /// Kinds that occupy a data block slot.
    pub fn is_data_bearing(k: u16) -> bool {
        matches!(k, DATA | DEAD | CHECKPOINT)
    }
}

/// One 16-byte record as stored: `a: u64, b: u32, kind: u16, c: u16`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct RawRecord {
    pub a: u64,
    pub b: u32,
    pub kind: u16,
    pub c: u16,
}

impl RawRecord {
    pub fn data(volume: u16, lba: u64, crc: u32) -> Self {
        debug_assert!(lba <= MAX_RECORD_LBA);
        RawRecord {
            a: pack_volume_lba(volume, lba),
            b: crc,
            kind: kind::DATA,
            c: 0,
        }
    }
    pub fn checkpoint(index: u64, crc: u32) -> Self {
        RawRecord {
            a: index,
            b: crc,
            kind: kind::CHECKPOINT,
            c: 0,
        }
    }
    pub fn trim(volume: u16, start: u64, count: u32) -> Self {
        RawRecord {
            a: pack_volume_lba(volume, start),
            b: count,
            kind: kind::TRIM,
            c: 0,
        }
    }
    pub fn version(version: u64) -> Self {
        RawRecord {
            a: version,
            b: 0,
            kind: kind::VERSION,
            c: 0,
        }
    }
    pub fn release(segment: u32, incarnation: u64) -> Self {
        RawRecord {
            a: incarnation,
            b: segment,
            kind: kind::RELEASE,
            c: 0,
        }
    }
    pub fn alias(volume: u16, lba: u64, index: u32) -> Self {
        debug_assert!(lba <= MAX_RECORD_LBA);
        RawRecord {
            a: pack_volume_lba(volume, lba),
            b: index,
            kind: kind::ALIAS,
            c: 0,
        }
    }
    pub fn unit(offset: u32, data_blocks: u32, header_blocks: u16) -> Self {
        RawRecord {
            a: offset as u64,
            b: data_blocks,
            kind: kind::UNIT,
            c: header_blocks,
        }
    }
    /// Volume of a DATA / DEAD / TRIM / ALIAS record.
    pub fn volume(&self) -> u16 {
        (self.a >> 48) as u16
    }
    /// LBA of a DATA / DEAD / TRIM / ALIAS record.
    pub fn lba(&self) -> u64 {
        self.a & MAX_RECORD_LBA
    }
    pub fn encode(&self, out: &mut [u8]) {
        put_u64(out, 0, self.a);
        put_u32(out, 8, self.b);
        put_u16(out, 12, self.kind);
        put_u16(out, 14, self.c);
    }
    pub fn decode(inp: &[u8]) -> Self {
        RawRecord {
            a: get_u64(inp, 0),
            b: get_u32(inp, 8),
            kind: get_u16(inp, 12),
            c: get_u16(inp, 14),
        }
    }
}

/// Packs a volume id and an LBA into a record's `a` field.
#[inline]
pub fn pack_volume_lba(volume: u16, lba: u64) -> u64 {
    ((volume as u64) << 48) | (lba & MAX_RECORD_LBA)
}

/// How many records fit in `header_blocks` header blocks.
pub const fn records_capacity(header_blocks: u16) -> usize {
    (header_blocks as usize * BLOCK_SIZE - UNIT_FIXED_SIZE) / RECORD_SIZE
}

/// Fewest header blocks that hold `records` records.
pub const fn header_blocks_for(records: usize) -> u16 {
    (UNIT_FIXED_SIZE + records * RECORD_SIZE).div_ceil(BLOCK_SIZE) as u16
}

/// Which stream a unit was written by. Streams never share segments.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamKind {
    /// Blocks written by users of a volume.
    User = 0,
    /// Blocks relocated by garbage collection.
    Gc = 1,
    /// Checkpoints and other array metadata.
    Meta = 2,
}

impl StreamKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0 => StreamKind::User,
            1 => StreamKind::Gc,
            2 => StreamKind::Meta,
            _ => return None,
        })
    }
}

/// The fixed part of a unit header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UnitHeader {
    pub header_blocks: u16,
    pub record_count: u32,
    pub array_id: u64,
    pub segment: u32,
    /// Offset of the unit's first header block within the segment, in blocks.
    pub offset: u32,
    /// The version at which the segment was opened; distinguishes reuses of a segment.
    pub incarnation: u64,
    /// The unit's own version, assigned when it is sealed; strictly increasing within
    /// a segment and across the array.
    pub version: u64,
    pub data_blocks: u32,
    pub stream_kind: StreamKind,
    pub stream_class: u8,
    pub volume: u16,
    /// For metadata-stream units: the segment this stream continues in when the
    /// current one is full; [`NO_SEGMENT`] otherwise.
    pub next_segment: u32,
    /// Every unit of this run (versions `run_start ..= durable_version`) was durable
    /// (a sync had completed) when this unit was sealed. Recovery verifies the data
    /// checksums only of units above their run's highest mark: only those can be torn.
    pub durable_version: u64,
    /// First version of the run (server start) that wrote this unit. A durability
    /// mark says nothing about versions of earlier runs, which crashed.
    pub run_start: u64,
    /// The volume's time (user blocks written to it) when the unit was opened, and
    /// when it was sealed (its own blocks included): recovery dates the segments
    /// written after the checkpoint from them (placement ages). 0 in units written
    /// before they were recorded (the bytes were reserved and zero).
    pub opened_time: u64,
    pub volume_time: u64,
    /// GC units: the mean volume time at which users last wrote the blocks GC
    /// moved into this unit. 0 otherwise.
    pub origin: u64,
}

impl UnitHeader {
    /// Total length of the unit in blocks.
    pub fn total_blocks(&self) -> u32 {
        self.header_blocks as u32 + self.data_blocks
    }

    /// Writes the fixed part into `buf` (the whole header area, `header_blocks`
    /// blocks long, with records already in place) and seals it with the checksum.
    pub fn seal_into(&self, buf: &mut [u8]) {
        let len = self.header_blocks as usize * BLOCK_SIZE;
        assert!(buf.len() >= len);
        assert!(self.record_count as usize <= records_capacity(self.header_blocks));
        let b = &mut buf[..len];
        put_u64(b, OFF_MAGIC, UNIT_MAGIC);
        put_u16(b, OFF_VERSION, FORMAT_VERSION);
        put_u16(b, OFF_HEADER_BLOCKS, self.header_blocks);
        put_u32(b, OFF_RECORD_COUNT, self.record_count);
        put_u64(b, OFF_ARRAY_ID, self.array_id);
        put_u32(b, OFF_SEGMENT, self.segment);
        put_u32(b, OFF_OFFSET, self.offset);
        put_u64(b, OFF_INCARNATION, self.incarnation);
        put_u64(b, OFF_UNIT_VERSION, self.version);
        put_u32(b, OFF_DATA_BLOCKS, self.data_blocks);
        b[OFF_STREAM_KIND] = self.stream_kind as u8;
        b[OFF_STREAM_CLASS] = self.stream_class;
        put_u16(b, OFF_VOLUME, self.volume);
        put_u32(b, OFF_NEXT_SEGMENT, self.next_segment);
        put_u64(b, OFF_DURABLE_VERSION, self.durable_version);
        put_u64(b, OFF_RUN_START, self.run_start);
        put_u64(b, OFF_OPENED_TIME, self.opened_time);
        put_u64(b, OFF_VOLUME_TIME, self.volume_time);
        put_u64(b, OFF_ORIGIN, self.origin);
        b[OFF_RESERVED..UNIT_FIXED_SIZE].fill(0);
        // Unused record slots are zeroed so the checksum covers defined bytes.
        let used = UNIT_FIXED_SIZE + self.record_count as usize * RECORD_SIZE;
        b[used..].fill(0);
        let crc = crc32c_with_hole(b, OFF_CRC);
        put_u32(b, OFF_CRC, crc);
    }

    /// Parses the fixed part from the first header block, without verifying the
    /// checksum (which covers all header blocks: see [`UnitHeader::verify`]). Returns
    /// an error only when the block is not a unit header at all.
    pub fn peek(first_block: &[u8]) -> Result<Self, FormatError> {
        const WHAT: &str = "unit header";
        check_magic_version(first_block, WHAT, UNIT_MAGIC, UNIT_FIXED_SIZE)?;
        let b = first_block;
        let invalid = |detail: String| FormatError::Invalid { what: WHAT, detail };
        let header_blocks = get_u16(b, OFF_HEADER_BLOCKS);
        if header_blocks == 0 || header_blocks > MAX_HEADER_BLOCKS {
            return Err(invalid(format!("header blocks {header_blocks}")));
        }
        let record_count = get_u32(b, OFF_RECORD_COUNT);
        if record_count as usize > records_capacity(header_blocks) {
            return Err(invalid(format!(
                "{record_count} records in {header_blocks} header blocks"
            )));
        }
        let data_blocks = get_u32(b, OFF_DATA_BLOCKS);
        if data_blocks > record_count {
            return Err(invalid(format!(
                "{data_blocks} data blocks but {record_count} records"
            )));
        }
        let stream_kind = StreamKind::from_u8(b[OFF_STREAM_KIND])
            .ok_or_else(|| invalid(format!("stream kind {}", b[OFF_STREAM_KIND])))?;
        Ok(UnitHeader {
            header_blocks,
            record_count,
            array_id: get_u64(b, OFF_ARRAY_ID),
            segment: get_u32(b, OFF_SEGMENT),
            offset: get_u32(b, OFF_OFFSET),
            incarnation: get_u64(b, OFF_INCARNATION),
            version: get_u64(b, OFF_UNIT_VERSION),
            data_blocks,
            stream_kind,
            stream_class: b[OFF_STREAM_CLASS],
            volume: get_u16(b, OFF_VOLUME),
            next_segment: get_u32(b, OFF_NEXT_SEGMENT),
            durable_version: get_u64(b, OFF_DURABLE_VERSION),
            run_start: get_u64(b, OFF_RUN_START),
            opened_time: get_u64(b, OFF_OPENED_TIME),
            volume_time: get_u64(b, OFF_VOLUME_TIME),
            origin: get_u64(b, OFF_ORIGIN),
        })
    }

    /// Parses and verifies a complete header (`header_blocks` blocks).
    pub fn decode(buf: &[u8]) -> Result<Self, FormatError> {
        let h = Self::peek(buf)?;
        let len = h.header_blocks as usize * BLOCK_SIZE;
        if buf.len() < len {
            return Err(FormatError::Truncated {
                what: "unit header",
                have: buf.len(),
                need: len,
            });
        }
        check_crc(&buf[..len], "unit header", OFF_CRC)?;
        // Data-bearing records must come first, exactly data_blocks of them.
        for i in 0..h.record_count as usize {
            let r = record_at(buf, i);
            let expect_data = i < h.data_blocks as usize;
            if kind::is_data_bearing(r.kind) != expect_data {
                return Err(FormatError::Invalid {
                    what: "unit header",
                    detail: format!("record {i} has kind {} out of place", r.kind),
                });
            }
        }
        Ok(h)
    }
}

/// Byte offset of record `i` within a header or summary buffer.
#[inline]
pub const fn record_offset(i: usize) -> usize {
    UNIT_FIXED_SIZE + i * RECORD_SIZE
}

/// Reads record `i` from a header or summary buffer.
#[inline]
pub fn record_at(buf: &[u8], i: usize) -> RawRecord {
    RawRecord::decode(&buf[record_offset(i)..record_offset(i) + RECORD_SIZE])
}

/// Writes record `i` into a header or summary buffer.
#[inline]
pub fn put_record(buf: &mut [u8], i: usize, r: &RawRecord) {
    r.encode(&mut buf[record_offset(i)..record_offset(i) + RECORD_SIZE]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(records: u32, data: u32) -> UnitHeader {
        UnitHeader {
            header_blocks: header_blocks_for(records as usize),
            record_count: records,
            array_id: 0x1234,
            segment: 9,
            offset: 256,
            incarnation: 77,
            version: 80,
            data_blocks: data,
            stream_kind: StreamKind::User,
            stream_class: 0,
            volume: 3,
            next_segment: NO_SEGMENT,
            durable_version: 70,
            run_start: 60,
            opened_time: 1200,
            volume_time: 1234,
            origin: 567,
        }
    }

    #[test]
    fn capacities() {
        assert_eq!(records_capacity(1), 248);
        assert_eq!(records_capacity(2), 504);
        assert_eq!(header_blocks_for(248), 1);
        assert_eq!(header_blocks_for(249), 2);
        assert_eq!(header_blocks_for(0), 1);
    }

    #[test]
    fn roundtrip_with_records() {
        let h = header(5, 3);
        let mut buf = vec![0u8; h.header_blocks as usize * BLOCK_SIZE];
        put_record(&mut buf, 0, &RawRecord::data(3, 10, 0xaa));
        put_record(&mut buf, 1, &RawRecord::data(3, 11, 0xbb));
        put_record(&mut buf, 2, &RawRecord::data(3, 12, 0xcc));
        put_record(&mut buf, 3, &RawRecord::trim(3, 100, 8));
        put_record(&mut buf, 4, &RawRecord::version(79));
        h.seal_into(&mut buf);
        assert_eq!(UnitHeader::decode(&buf).unwrap(), h);
        assert_eq!(record_at(&buf, 1).lba(), 11);
        assert_eq!(record_at(&buf, 1).volume(), 3);
        assert_eq!(record_at(&buf, 3).b, 8);
    }

    #[test]
    fn bit_flips_detected() {
        let h = header(2, 2);
        let mut buf = vec![0u8; BLOCK_SIZE];
        put_record(&mut buf, 0, &RawRecord::data(1, 1, 1));
        put_record(&mut buf, 1, &RawRecord::data(1, 2, 2));
        h.seal_into(&mut buf);
        for i in (0..BLOCK_SIZE).step_by(7) {
            let mut d = buf.clone();
            d[i] ^= 1;
            assert!(UnitHeader::decode(&d).is_err(), "flip at {i}");
        }
    }

    #[test]
    fn misplaced_data_record_rejected() {
        let h = header(2, 1);
        let mut buf = vec![0u8; BLOCK_SIZE];
        put_record(&mut buf, 0, &RawRecord::release(4, 5));
        put_record(&mut buf, 1, &RawRecord::data(1, 2, 2));
        h.seal_into(&mut buf);
        assert!(matches!(
            UnitHeader::decode(&buf),
            Err(FormatError::Invalid { .. })
        ));
    }
}
