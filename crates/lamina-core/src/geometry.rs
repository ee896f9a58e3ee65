//! Geometry: how segments, units and blocks map onto devices.
//!
//! The log thinks in segments of `segment_blocks` blocks. Units fill a segment from
//! block 0 up to `data_end`; the last `summary_blocks` blocks hold the summary. This
//! module is the only place that turns (segment, block) into (device, byte offset).
//! JBOD places each segment whole on one device, devices concatenated in table order.
//! Striped layouts (SAID0/5/6) see one virtual device, the [`Striped`] device placed
//! after the members, whose segments are stripes of `k` data chunks (one per member);
//! units and summaries then cover whole rows of `k` blocks so that parity is written
//! with the data and never by read-modify-write.
//!
//! [`Striped`]: lamina_device::striped::Striped

use crate::types::{Pba, SegmentId, BLOCK_SIZE_U64};
use lamina_format::summary::summary_blocks;
use lamina_format::superblock::{Layout, Superblock, TIER_CACHE};
use lamina_format::unit::{header_blocks_for, records_capacity};

/// Record slots every unit keeps beyond one per data block, for trims and releases.
pub const UNIT_EXTRA_RECORDS: usize = 16;

#[derive(Clone, Debug)]
pub struct DeviceSpan {
    pub first_segment: u32,
    pub segment_count: u32,
    /// A JBOD member taken out by `array evacuate`: its segments keep their
    /// numbers (the members after it keep theirs) but are never used again, and
    /// its device is not needed.
    pub removed: bool,
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
    /// Units and summaries start and end on multiples of this many blocks (the data
    /// members of a stripe row; 1 for JBOD).
    pub row_blocks: u32,
    /// Physical members of the array (superblocks go to each).
    pub members: usize,
    /// Parity members per stripe (0 for JBOD and SAID0).
    pub parity: usize,
    /// The first segment of the cache tier (`segment_count` when the array has
    /// none): the cache members are the last of a JBOD, so their segments are the
    /// highest numbers (see [`Geometry::is_cache`]).
    pub cache_first: u32,
    /// Members in the cache tier: 0 without one, 1, or 2 or 3 that mirror each
    /// other (each holds every cache segment; see [`Geometry::mirrored`]).
    pub cache_copies: usize,
    /// Index of the first cache member (`members` without a cache tier).
    pub cache_member0: usize,
}

/// Which tier of the array a segment (or a stream's next segment) is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Tier {
    /// Where data lives; every segment of an array without a cache tier.
    #[default]
    Capacity = 0,
    /// The fast tier every user write lands in first; compaction moves it on.
    Cache = 1,
}

/// Parity members a layout keeps per stripe.
pub fn layout_parity(layout: Layout) -> usize {
    match layout {
        Layout::Jbod | Layout::Said0 => 0,
        Layout::Said5 => 1,
        Layout::Said6 => 2,
    }
}

impl Geometry {
    pub fn from_superblock(sb: &Superblock) -> Self {
        let w = sb.write_unit_blocks;
        let header_blocks = header_blocks_for(w as usize + UNIT_EXTRA_RECORDS);
        let members = sb.devices.len();
        let parity = layout_parity(sb.layout);
        let row_blocks = if sb.layout == Layout::Jbod {
            1
        } else {
            (members - parity) as u32
        };
        let summary = summary_blocks(sb.segment_blocks).next_multiple_of(row_blocks);
        let devices: Vec<DeviceSpan> = if sb.layout == Layout::Jbod {
            sb.devices
                .iter()
                .map(|d| DeviceSpan {
                    first_segment: d.first_segment,
                    segment_count: d.segment_count,
                    removed: d.state == crate::recovery::MEMBER_REMOVED,
                })
                .collect()
        } else {
            // Every member holds one chunk of every stripe: the stripes are the
            // segments of one virtual device.
            let stripes = sb
                .devices
                .iter()
                .map(|d| d.segment_count)
                .min()
                .unwrap_or(0);
            vec![DeviceSpan {
                first_segment: 0,
                segment_count: stripes,
                removed: false,
            }]
        };
        // Mirrored cache members hold the same segments, so they are counted once.
        let segment_count = devices
            .iter()
            .map(|d| d.first_segment + d.segment_count)
            .max()
            .unwrap_or(0);
        // `Superblock::decode` checked that cache members follow the capacity
        // members of a JBOD, and that mirrored ones span the same segments.
        let cache_member0 = sb
            .devices
            .iter()
            .position(|d| d.tier == TIER_CACHE)
            .unwrap_or(members);
        let cache_first = sb
            .devices
            .get(cache_member0)
            .map_or(segment_count, |d| d.first_segment);
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
            segment_count,
            data_offset: sb.data_offset,
            devices,
            row_blocks,
            members,
            parity,
            cache_first,
            cache_copies: members - cache_member0,
            cache_member0,
        }
    }

    /// Whether the cache tier is mirrored: its members each hold every cache
    /// segment, and the striped device (`Shared::striped`, one data column and
    /// the other copies as its parity) writes them and reads them.
    #[inline]
    pub fn mirrored(&self) -> bool {
        self.cache_copies > 1
    }

    /// The first array member of the striped device: its member `i` is array
    /// member `striped_member0() + i` (all members of a striped layout, the cache
    /// members of a mirrored cache tier).
    pub fn striped_member0(&self) -> usize {
        if self.mirrored() {
            self.cache_member0
        } else {
            0
        }
    }

    /// The segment of the striped device's stripe `s` (stripes are segments; a
    /// mirrored cache's stripes are the cache tier's segments).
    pub fn stripe_segment(&self, s: u64) -> u32 {
        let base = if self.mirrored() { self.cache_first } else { 0 };
        base + s as u32
    }

    /// The array member of the striped device's member `i`.
    pub fn striped_member(&self, i: usize) -> usize {
        self.striped_member0() + i
    }

    /// The striped device's member for array member `dev`, if it is one of its.
    pub fn striped_index(&self, dev: usize) -> Option<usize> {
        match self.layout {
            Layout::Jbod if self.mirrored() => {
                (dev >= self.cache_member0 && dev < self.members).then(|| dev - self.cache_member0)
            }
            Layout::Jbod => None,
            _ => (dev < self.members).then_some(dev),
        }
    }

    /// Whether the array has a cache tier.
    #[inline]
    pub fn tiered(&self) -> bool {
        self.cache_first < self.segment_count
    }

    /// Whether `seg` is in the cache tier.
    #[inline]
    pub fn is_cache(&self, seg: u32) -> bool {
        seg >= self.cache_first
    }

    /// The tier of segment `seg`.
    #[inline]
    pub fn tier(&self, seg: u32) -> Tier {
        if self.is_cache(seg) {
            Tier::Cache
        } else {
            Tier::Capacity
        }
    }

    /// Whether device `dev` is a member of the cache tier.
    pub fn is_cache_member(&self, dev: usize) -> bool {
        self.layout == Layout::Jbod
            && self
                .devices
                .get(dev)
                .is_some_and(|d| d.first_segment >= self.cache_first)
    }

    /// Whether device index `dev` holds cache segments: a cache member, or the
    /// striped device that drives a mirrored cache's copies.
    pub fn holds_cache(&self, dev: usize) -> bool {
        self.is_cache_member(dev) || (self.mirrored() && dev == self.members)
    }

    /// The devices whose segments are the capacity tier's (every data device of
    /// an array without a cache tier).
    pub fn capacity_devices(&self) -> impl Iterator<Item = usize> + '_ {
        self.data_devices().filter(|&d| !self.holds_cache(d))
    }

    /// Segments of the cache tier.
    pub fn cache_segments(&self) -> u32 {
        self.segment_count - self.cache_first
    }

    /// Segments that hold data for good, or may: those of the capacity tier's
    /// members not removed (the cache tier only stages what compaction moves on).
    pub fn usable_segments(&self) -> u32 {
        self.devices
            .iter()
            .filter(|d| !d.removed && d.first_segment < self.cache_first)
            .map(|d| d.segment_count)
            .sum()
    }

    /// The segments of removed members, which are never used.
    pub fn removed_spans(&self) -> impl Iterator<Item = std::ops::Range<u32>> + '_ {
        self.devices
            .iter()
            .filter(|d| d.removed)
            .map(|d| d.first_segment..d.first_segment + d.segment_count)
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
        if self.layout != Layout::Jbod || (self.mirrored() && segment.0 >= self.cache_first) {
            // The striped device's space: its stripes from 0 (a mirrored cache's
            // first stripe is the cache tier's first segment).
            let stripe = segment.0 - self.stripe_segment(0);
            let block = stripe as u64 * self.segment_blocks as u64 + offset as u64;
            return (self.members, self.data_offset + block * BLOCK_SIZE_U64);
        }
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

    /// `blocks` rounded up to whole rows.
    #[inline]
    pub fn round_to_row(&self, blocks: u32) -> u32 {
        blocks.next_multiple_of(self.row_blocks)
    }

    /// Indices in `Shared::devices` that hold segments (and need syncs for data):
    /// the members of a JBOD, the striped device of the other layouts, and the
    /// capacity members and the striped device of a JBOD with a mirrored cache.
    pub fn data_devices(&self) -> std::iter::Chain<std::ops::Range<usize>, std::ops::Range<usize>> {
        let virt = self.members..self.members + 1;
        match self.layout {
            Layout::Jbod if self.mirrored() => (0..self.cache_member0).chain(virt),
            Layout::Jbod => (0..self.members).chain(0..0),
            _ => (0..0).chain(virt),
        }
    }

    /// Whether device `dev` is a removed JBOD member: it is given no I/O at all,
    /// and may be absent.
    pub fn is_removed(&self, dev: usize) -> bool {
        self.layout == Layout::Jbod && self.devices.get(dev).is_some_and(|d| d.removed)
    }

    /// Segments one device of `size_bytes` bytes holds.
    pub fn segments_on_device(size_bytes: u64, data_offset: u64, segment_blocks: u32) -> u32 {
        let seg_bytes = segment_blocks as u64 * BLOCK_SIZE_U64;
        (size_bytes.saturating_sub(data_offset) / seg_bytes).min(u32::MAX as u64) as u32
    }
}
