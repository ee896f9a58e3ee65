//! Geometry: how segments, units and blocks map onto devices.
//!
//! The log thinks in segments of `segment_blocks` blocks. Units fill a segment from
//! block 0 up to `data_end`; the last `summary_blocks` blocks hold the summary. This
//! module is the only place that turns (segment, block) into (device, byte offset).
//! JBOD places each segment whole on one device, devices concatenated in table order.

use crate::types::{Pba, SegmentId, BLOCK_SIZE_U64};
use lamina_format::summary::summary_blocks;
use lamina_format::superblock::{Layout, Superblock};
use lamina_format::unit::{header_blocks_for, records_capacity};

/// Record slots every unit keeps beyond one per data block, for trims and releases.
pub const UNIT_EXTRA_RECORDS: usize = 16;

#[derive(Clone, Debug)]
pub struct DeviceSpan {
    pub first_segment: u32,
    pub segment_count: u32,
}

#[derive(Clone, Debug)]
pub struct Geometry {
    pub array_id: u64,
    pub layout: Layout,
    pub segment_blocks: u32,
    /// Largest unit, header included.
    pub write_unit_blocks: u32,
    /// Header blocks of every unit.
    pub header_blocks: u16,
    /// Most data blocks in one unit.
    pub unit_data_max: u32,
    /// Record slots in a unit header.
    pub unit_records: u32,
    pub summary_blocks: u32,
    /// Units end at or before this block of a segment; the summary follows.
    pub data_end: u32,
    pub segment_count: u32,
    pub data_offset: u64,
    pub devices: Vec<DeviceSpan>,
}

impl Geometry {
    pub fn from_superblock(sb: &Superblock) -> Self {
        let w = sb.write_unit_blocks;
        let header_blocks = header_blocks_for(w as usize + UNIT_EXTRA_RECORDS);
        let summary = summary_blocks(sb.segment_blocks);
        let devices: Vec<DeviceSpan> = sb
            .devices
            .iter()
            .map(|d| DeviceSpan {
                first_segment: d.first_segment,
                segment_count: d.segment_count,
            })
            .collect();
        Geometry {
            array_id: sb.array_id(),
            layout: sb.layout,
            segment_blocks: sb.segment_blocks,
            write_unit_blocks: w,
            header_blocks,
            unit_data_max: w - header_blocks as u32,
            unit_records: records_capacity(header_blocks) as u32,
            summary_blocks: summary,
            data_end: sb.segment_blocks - summary,
            segment_count: devices.iter().map(|d| d.segment_count).sum(),
            data_offset: sb.data_offset,
            devices,
        }
    }

    /// Physical block address of block `offset` of `segment`.
    #[inline]
    pub fn pba(&self, segment: SegmentId, offset: u32) -> Pba {
        Pba(segment.0 * self.segment_blocks + offset)
    }

    /// The segment and offset of a physical block.
    #[inline]
    pub fn split(&self, pba: Pba) -> (SegmentId, u32) {
        (
            SegmentId(pba.0 / self.segment_blocks),
            pba.0 % self.segment_blocks,
        )
    }

    /// Device index and byte offset of block `offset` of `segment`.
    #[inline]
    pub fn locate(&self, segment: SegmentId, offset: u32) -> (usize, u64) {
        let dev = self
            .devices
            .iter()
            .position(|d| segment.0 < d.first_segment + d.segment_count)
            .expect("segment beyond the array");
        let local = (segment.0 - self.devices[dev].first_segment) as u64;
        (
            dev,
            self.data_offset
                + (local * self.segment_blocks as u64 + offset as u64) * BLOCK_SIZE_U64,
        )
    }

    /// Data blocks a segment holds when every unit is full (the usual case).
    pub fn data_blocks_per_segment(&self) -> u64 {
        let full_units = self.data_end / self.write_unit_blocks;
        let rest = self.data_end % self.write_unit_blocks;
        let rest_data = rest.saturating_sub(self.header_blocks as u32);
        full_units as u64 * self.unit_data_max as u64 + rest_data as u64
    }

    /// Segments one device of `size_bytes` bytes holds.
    pub fn segments_on_device(size_bytes: u64, data_offset: u64, segment_blocks: u32) -> u32 {
        let seg_bytes = segment_blocks as u64 * BLOCK_SIZE_U64;
        (size_bytes.saturating_sub(data_offset) / seg_bytes).min(u32::MAX as u64) as u32
    }
}
