//! Zone accounting for zoned arrays (host-managed SMR, ZNS, their emulations):
//! which segments lie in conventional zones, and how many zones the engine holds
//! open against the devices' open-zone limit.
//!
//! A segment on a sequential-write-required zone holds the zone open from the
//! moment it is opened until its last write lands (or the zone is finished early);
//! the devices refuse more open zones than their limit, so the engine opens a new
//! segment only while [`Zones::may_open`] says so. Segments below a device's
//! conventional boundary (SALSA 3.2) obey no zone rules: the metadata stream
//! prefers them, and flushes move short units there instead of wasting a zone's
//! write pointer on padding.

use crate::geometry::Geometry;
use crate::types::SegmentId;

pub(crate) struct Zones {
    /// The array is zoned: segments are zones, reset before reuse and filled (or
    /// finished) when closed.
    pub zoned: bool,
    /// Most zones the devices let be open at once (0: no limit), and how many
    /// segments hold one now (open or closing).
    pub limit: u32,
    pub active: u32,
    /// Per segment (a bit each): it lies in a conventional zone (every segment of
    /// a cache tier in front of zoned devices does: the cache is conventional).
    conventional: Vec<u64>,
    /// Some segment of the capacity tier does: there the metadata stream and
    /// short flushed units have a place outside the zones.
    pub any_conventional: bool,
    /// Short units a flush moved to conventional zones.
    pub small_units_moved: u64,
}

impl Zones {
    /// `limit`: the devices' open-zone limit (0: none); `conventional_end`: per
    /// device, where its sequential zones start (0 when it has none, or is not
    /// zoned; past its end for a cache tier's devices).
    pub fn new(geo: &Geometry, zoned: bool, limit: u32, conventional_end: &[u64]) -> Self {
        let n = geo.segment_count as usize;
        let mut conventional = vec![0u64; n.div_ceil(64)];
        if zoned {
            for seg in 0..n {
                let (d, off) = geo.locate(SegmentId(seg as u32), 0);
                if off < conventional_end[d] {
                    conventional[seg / 64] |= 1 << (seg % 64);
                }
            }
        }
        let mut z = Zones {
            zoned,
            limit,
            active: 0,
            any_conventional: false,
            conventional,
            small_units_moved: 0,
        };
        z.any_conventional = (0..geo.cache_first.min(n as u32)).any(|s| z.conventional(s));
        z
    }

    /// Segment `seg` lies in a conventional zone of a zoned device.
    #[inline]
    pub fn conventional(&self, seg: u32) -> bool {
        self.conventional[seg as usize / 64] & (1 << (seg % 64)) != 0
    }

    /// Segment `seg`, when opened, holds a zone open (zoned, not conventional).
    #[inline]
    pub fn holds_zone(&self, seg: u32) -> bool {
        self.zoned && !self.conventional(seg)
    }

    /// Another zone may be opened now.
    pub fn may_open(&self) -> bool {
        self.limit == 0 || self.active < self.limit
    }

    /// Segment `seg` was opened.
    pub fn opened(&mut self, seg: u32) {
        if self.holds_zone(seg) {
            self.active += 1;
            debug_assert!(self.limit == 0 || self.active <= self.limit);
        }
    }

    /// Segment `seg`'s zone became full (or was never written): it no longer
    /// counts against the limit.
    pub fn done(&mut self, seg: u32) {
        if self.holds_zone(seg) {
            debug_assert!(self.active > 0, "zone of segment {seg} closed twice");
            self.active = self.active.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::DeviceSpan;
    use lamina_format::superblock::Layout;

    #[test]
    fn conventional_segments_hold_no_zone_and_the_limit_counts_the_others() {
        let geo = Geometry {
            array_id: 1,
            layout: Layout::Jbod,
            segment_blocks: 256,
            write_unit_blocks: 32,
            header_blocks: 1,
            unit_data_max: 31,
            unit_records: 31,
            summary_blocks: 1,
            data_end: 255,
            segment_count: 16,
            data_offset: 1 << 20,
            devices: vec![DeviceSpan {
                removed: false,
                first_segment: 0,
                segment_count: 16,
            }],
            row_blocks: 1,
            members: 1,
            parity: 0,
            cache_first: 16,
            cache_copies: 0,
            cache_member0: 1,
        };
        let seg_bytes = geo.segment_blocks as u64 * 4096;
        // Zones start after the superblock area; the first three segments lie in
        // conventional zones.
        let mut z = Zones::new(&geo, true, 2, &[geo.data_offset + 3 * seg_bytes]);
        assert!(z.any_conventional);
        assert!((0..3).all(|s| z.conventional(s)) && !(3..16).any(|s| z.conventional(s)));
        z.opened(0);
        assert_eq!(z.active, 0, "a conventional segment holds no zone");
        z.opened(5);
        z.opened(6);
        assert!(!z.may_open());
        z.done(5);
        assert!(z.may_open());
        assert_eq!(z.active, 1);
        // Not zoned: nothing is conventional and there is no limit.
        let z = Zones::new(&geo, false, 0, &[geo.data_offset + 3 * seg_bytes]);
        assert!(!z.any_conventional && !z.holds_zone(0) && z.may_open());

        // A cache member in front of a zoned one (segments 12..16): its segments
        // hold no zone, but they are not the capacity tier's conventional space.
        let mut geo = geo;
        geo.devices = vec![
            DeviceSpan {
                removed: false,
                first_segment: 0,
                segment_count: 12,
            },
            DeviceSpan {
                removed: false,
                first_segment: 12,
                segment_count: 4,
            },
        ];
        geo.members = 2;
        geo.cache_first = 12;
        geo.cache_copies = 1;
        let mut z = Zones::new(&geo, true, 2, &[geo.data_offset, u64::MAX]);
        assert!(!z.any_conventional);
        assert!((12..16).all(|s| z.conventional(s) && !z.holds_zone(s)));
        assert!((0..12).all(|s| z.holds_zone(s)));
        z.opened(12);
        assert_eq!(z.active, 0, "a cache segment holds no zone");
    }
}
