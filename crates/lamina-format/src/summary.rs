//! Segment summary: written into the last blocks of a segment when it is closed.
//!
//! It repeats, in one place, the block records of every unit of the segment, each
//! unit introduced by a `UNIT` record giving its offset and sizes. Garbage collection
//! reads the summary (one sequential read) to learn who owns each block of a victim
//! instead of reading every unit header. Segments closed early (after a crash) have
//! no summary; readers then fall back to walking the unit headers.

use crate::codec::{get_u16, get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::unit::{RECORD_SIZE, UNIT_FIXED_SIZE};
use crate::{
    check_crc, check_magic_version, crc32c_with_hole, FormatError, BLOCK_SIZE, FORMAT_VERSION,
};

/// "LMNSUMM\0" as a little-endian u64.
pub const SUMMARY_MAGIC: u64 = u64::from_le_bytes(*b"LMNSUMM\0");

const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_SUMMARY_BLOCKS: usize = 10;
const OFF_RECORD_COUNT: usize = 12;
const OFF_ARRAY_ID: usize = 16;
const OFF_SEGMENT: usize = 24;
const OFF_DATA_END: usize = 28;
const OFF_INCARNATION: usize = 32;
const OFF_CLOSE_VERSION: usize = 40;
pub(crate) const OFF_CRC: usize = 60;

/// Blocks reserved at the end of every segment of `segment_blocks` blocks for its
/// summary. Each block of the segment needs at most one record (a data record, or the
/// unit record standing for a unit's first header block), so this always suffices.
pub const fn summary_blocks(segment_blocks: u32) -> u32 {
    (UNIT_FIXED_SIZE + segment_blocks as usize * RECORD_SIZE).div_ceil(BLOCK_SIZE) as u32
}

/// Fixed part of a segment summary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SummaryHeader {
    pub summary_blocks: u16,
    pub record_count: u32,
    pub array_id: u64,
    pub segment: u32,
    /// Blocks of the segment used by units (the summary starts at or after this).
    pub data_end: u32,
    pub incarnation: u64,
    /// Array version when the segment was closed (its age for cost-benefit GC).
    pub close_version: u64,
}

impl SummaryHeader {
    /// Writes the fixed part into `buf` (records already in place) and seals it.
    pub fn seal_into(&self, buf: &mut [u8]) {
        let len = self.summary_blocks as usize * BLOCK_SIZE;
        let b = &mut buf[..len];
        put_u64(b, OFF_MAGIC, SUMMARY_MAGIC);
        put_u16(b, OFF_VERSION, FORMAT_VERSION);
        put_u16(b, OFF_SUMMARY_BLOCKS, self.summary_blocks);
        put_u32(b, OFF_RECORD_COUNT, self.record_count);
        put_u64(b, OFF_ARRAY_ID, self.array_id);
        put_u32(b, OFF_SEGMENT, self.segment);
        put_u32(b, OFF_DATA_END, self.data_end);
        put_u64(b, OFF_INCARNATION, self.incarnation);
        put_u64(b, OFF_CLOSE_VERSION, self.close_version);
        b[48..60].fill(0);
        b[64..UNIT_FIXED_SIZE].fill(0);
        let used = UNIT_FIXED_SIZE + self.record_count as usize * RECORD_SIZE;
        b[used..].fill(0);
        let crc = crc32c_with_hole(b, OFF_CRC);
        put_u32(b, OFF_CRC, crc);
    }

    /// Parses and verifies a summary read from the tail of a segment.
    pub fn decode(buf: &[u8]) -> Result<Self, FormatError> {
        const WHAT: &str = "segment summary";
        check_magic_version(buf, WHAT, SUMMARY_MAGIC, BLOCK_SIZE)?;
        let summary_blocks = get_u16(buf, OFF_SUMMARY_BLOCKS);
        let len = summary_blocks as usize * BLOCK_SIZE;
        if summary_blocks == 0 || buf.len() < len {
            return Err(FormatError::Truncated {
                what: WHAT,
                have: buf.len(),
                need: len.max(BLOCK_SIZE),
            });
        }
        let record_count = get_u32(buf, OFF_RECORD_COUNT);
        if UNIT_FIXED_SIZE + record_count as usize * RECORD_SIZE > len {
            return Err(FormatError::Invalid {
                what: WHAT,
                detail: format!("{record_count} records in {summary_blocks} blocks"),
            });
        }
        check_crc(&buf[..len], WHAT, OFF_CRC)?;
        Ok(SummaryHeader {
            summary_blocks,
            record_count,
            array_id: get_u64(buf, OFF_ARRAY_ID),
            segment: get_u32(buf, OFF_SEGMENT),
            data_end: get_u32(buf, OFF_DATA_END),
            incarnation: get_u64(buf, OFF_INCARNATION),
            close_version: get_u64(buf, OFF_CLOSE_VERSION),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unit::{put_record, record_at, RawRecord};

    #[test]
    fn sizes() {
        assert_eq!(summary_blocks(2048), 9);
        assert_eq!(summary_blocks(2048 * 16), 129);
        assert_eq!(summary_blocks(64), 1);
    }

    #[test]
    fn roundtrip_and_damage() {
        let h = SummaryHeader {
            summary_blocks: 1,
            record_count: 3,
            array_id: 5,
            segment: 6,
            data_end: 60,
            incarnation: 7,
            close_version: 8,
        };
        let mut buf = vec![0u8; BLOCK_SIZE];
        put_record(&mut buf, 0, &RawRecord::unit(0, 2, 1));
        put_record(&mut buf, 1, &RawRecord::data(1, 2, 3));
        put_record(&mut buf, 2, &RawRecord::data(1, 3, 4));
        h.seal_into(&mut buf);
        assert_eq!(SummaryHeader::decode(&buf).unwrap(), h);
        assert_eq!(record_at(&buf, 2).lba(), 3);
        buf[100] ^= 4;
        assert!(SummaryHeader::decode(&buf).is_err());
    }
}
