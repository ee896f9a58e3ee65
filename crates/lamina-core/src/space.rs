//! Space accounting: how many blocks volumes may map (the usable capacity), how many
//! they map now, and the free-segment watermarks that start and stop garbage
//! collection and hold user writes back.
//!
//! Free segments are counted by the segment table; this module turns the engine's
//! configuration into the three watermarks, decides when a write would exceed
//! the capacity (ENOSPC), and says when the array crosses the fullness thresholds
//! that thin provisioning warns at (as LVM thin pools do: 80% and 95% by default).

use crate::error::EngineError;
use crate::geometry::Geometry;
use lamina_format::superblock::Superblock;

/// Free segments user streams leave to GC and the metadata stream (at least).
pub(crate) const USER_FLOOR_SEGMENTS: usize = 4;

/// How full the array is against its usable capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fullness {
    Ok,
    /// At or above the warning threshold (`[engine] space_warn`).
    Warning,
    /// At or above the critical threshold (`[engine] space_critical`).
    Critical,
    /// Every usable block is mapped: writes to unmapped blocks get ENOSPC.
    Full,
}

impl Fullness {
    pub fn name(self) -> &'static str {
        match self {
            Fullness::Ok => "ok",
            Fullness::Warning => "warning",
            Fullness::Critical => "critical",
            Fullness::Full => "full",
        }
    }
}

/// Default fractions of the usable capacity at which the array is filling up and
/// nearly full (`[engine] space_warn`, `space_critical`).
pub const DEFAULT_SPACE_WARN: f64 = 0.80;
pub const DEFAULT_SPACE_CRITICAL: f64 = 0.95;

/// Checks fullness thresholds: `0 < warn <= critical <= 1`.
pub fn check_thresholds(warn: f64, critical: f64) -> Result<(), String> {
    if 0.0 < warn && warn <= critical && critical <= 1.0 {
        Ok(())
    } else {
        Err(format!(
            "space_warn = {warn} and space_critical = {critical}: give 0 < space_warn <= \
             space_critical <= 1"
        ))
    }
}

/// Checks an overcommit limit: a positive, finite multiple.
pub fn check_overcommit(r: f64) -> Result<(), String> {
    if r > 0.0 && r.is_finite() {
        Ok(())
    } else {
        Err(format!(
            "max_overcommit = {r}: give a positive multiple, e.g. 2.0"
        ))
    }
}

/// Writes refused for space are reported at most this often.
const REFUSED_REPORT_MS: u64 = 10_000;

/// What [`Space::report`] has to say.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct SpaceReport {
    /// The fullness level changed from the first to the second.
    pub crossed: Option<(Fullness, Fullness)>,
    /// Writes refused with ENOSPC since the last report.
    pub refused: Option<u64>,
}

pub(crate) struct Space {
    /// Blocks the volumes may map in all, and blocks mapped now.
    pub usable: u64,
    pub live: u64,
    /// Map pages one checkpoint has room for without `maps_extra`.
    ckpt_room: u64,
    /// The pages the last checkpoint wrote (and those requests admitted then
    /// would start), as changed since by new snapshots and deletions and the
    /// pages admitted writes start (see `admit`).
    pub map_pages: u64,
    /// Refuse writes beyond `usable` (off in simulations).
    enforce: bool,
    /// Configured user floor and GC start (free segments); `None`: the defaults.
    floor: Option<usize>,
    start: Option<usize>,
    /// Free segments GC makes while a rollback waits for them (0: none).
    reserve: usize,
    segment_count: usize,
    /// Mapped blocks at which the array is at the warning and critical levels.
    warn_at: u64,
    critical_at: u64,
    /// The level last reported.
    reported: Fullness,
    /// Writes refused with ENOSPC, in all and as of the last report (at
    /// `refused_ms`).
    pub refused: u64,
    refused_reported: u64,
    refused_ms: u64,
}

impl Space {
    pub fn new(
        usable: u64,
        enforce: bool,
        floor: Option<usize>,
        start: Option<usize>,
        segment_count: usize,
    ) -> Self {
        let mut s = Space {
            usable,
            live: 0,
            ckpt_room: u64::MAX,
            map_pages: 0,
            enforce,
            floor,
            start,
            reserve: 0,
            segment_count,
            warn_at: 0,
            critical_at: 0,
            reported: Fullness::Ok,
            refused: 0,
            refused_reported: 0,
            refused_ms: 0,
        };
        s.set_thresholds(DEFAULT_SPACE_WARN, DEFAULT_SPACE_CRITICAL);
        s
    }

    /// The warning and critical thresholds, as fractions of the usable capacity
    /// (`0 < warn <= critical <= 1`).
    pub fn set_thresholds(&mut self, warn: f64, critical: f64) {
        debug_assert!(0.0 < warn && warn <= critical && critical <= 1.0);
        self.warn_at = (self.usable as f64 * warn).ceil() as u64;
        self.critical_at = (self.usable as f64 * critical).ceil() as u64;
    }

    /// The fullness level with `live` mapped blocks.
    fn level(&self, live: u64) -> Fullness {
        if live >= self.usable {
            Fullness::Full
        } else if live >= self.critical_at {
            Fullness::Critical
        } else if live >= self.warn_at {
            Fullness::Warning
        } else {
            Fullness::Ok
        }
    }

    /// Blocks counted as in use against `usable`: the mapped ones and the maps'
    /// extra room in the checkpoints.
    pub fn in_use_blocks(&self) -> u64 {
        self.live + self.maps_extra()
    }

    /// Blocks the checkpoints take beyond the room `usable` leaves them: every
    /// checkpoint writes every volume's map (snapshots and clones included), and
    /// the one before stays until it commits. Counted as in use, so that writes
    /// and new snapshots are refused before a checkpoint could find no room.
    pub fn maps_extra(&self) -> u64 {
        self.maps_extra_for(self.map_pages)
    }

    /// The fullness level now (the maps' room counts: writes of new blocks are
    /// refused when it is full).
    pub fn fullness(&self) -> Fullness {
        self.level(self.in_use_blocks())
    }

    /// What to log at engine time `now_ms`: the fullness level crossed since the
    /// last report (downwards only once 1% of the capacity below the threshold,
    /// so that a volume hovering at one does not fill the log), and the writes
    /// refused with ENOSPC since the last report (at most every 10 s).
    pub fn report(&mut self, now_ms: u64) -> SpaceReport {
        let mut r = SpaceReport::default();
        let now = self.fullness();
        let down = self.level(self.in_use_blocks() + self.usable / 100);
        if now > self.reported || down < self.reported {
            let to = now.max(down.min(self.reported));
            r.crossed = Some((self.reported, to));
            self.reported = to;
        }
        if self.refused > self.refused_reported
            && (now_ms.saturating_sub(self.refused_ms) >= REFUSED_REPORT_MS
                || self.refused_reported == 0)
        {
            r.refused = Some(self.refused - self.refused_reported);
            self.refused_reported = self.refused;
            self.refused_ms = now_ms;
        }
        r
    }

    /// Blocks volumes may map on an array of this geometry: the data blocks of the
    /// segments left after the reserve, over (1 + over-provisioning).
    pub fn usable_blocks(geo: &Geometry, sb: &Superblock) -> u64 {
        // Segments of removed members (`array evacuate`) hold nothing, ever.
        usable_blocks_of(
            geo.usable_segments() as u64,
            geo.data_blocks_per_segment(),
            sb.overprovision_ppm as f64 / 1e6,
        )
    }

    /// ENOSPC unless `new_blocks` more mapped blocks fit, with the `new_pages`
    /// map pages they start (counted as refused). Overwrites (`new_blocks == 0`)
    /// are always admitted: they take no room. Admitted pages count at once (in
    /// `map_pages`), not only from the next checkpoint: scattered writes to a
    /// thin volume make a page each, which every checkpoint writes, and the
    /// checkpoint after a run of them could otherwise find no room
    /// (`scattered_writes_to_a_thin_volume_leave_room_for_their_checkpoint`).
    pub fn admit(&mut self, new_blocks: u64, new_pages: u64) -> Result<(), EngineError> {
        let extra = self.maps_extra_for(self.map_pages + new_pages);
        if self.enforce && new_blocks > 0 && self.live + extra + new_blocks > self.usable {
            self.refused += 1;
            return Err(EngineError::NoSpace(self.in_use()));
        }
        if new_pages > 0 {
            self.set_map_pages(self.map_pages + new_pages);
        }
        Ok(())
    }

    fn in_use(&self) -> String {
        let maps = if self.maps_extra() > 0 {
            format!(
                " (of them {} by the volumes' maps in the checkpoints: snapshots and clones, or writes scattered over a thin volume)",
                self.maps_extra()
            )
        } else {
            String::new()
        };
        format!(
            "{} of {} usable blocks are in use{maps}",
            self.in_use_blocks(),
            self.usable
        )
    }

    /// The room a checkpoint has for map pages, from the geometry.
    pub fn set_checkpoint_room(&mut self, pages: u64) {
        self.ckpt_room = pages;
    }

    /// What the checkpoints of maps of `pages` pages in all take beyond their room.
    pub fn maps_extra_for(&self, pages: u64) -> u64 {
        maps_extra_of(pages, self.ckpt_room)
    }

    /// The volumes' maps are `pages` pages now (see `maps_extra`).
    pub fn set_map_pages(&mut self, pages: u64) {
        self.map_pages = pages;
    }

    /// ENOSPC unless `more` map pages fit beside the mapped blocks (a new
    /// snapshot or clone adds its map to every checkpoint). Not counted as a
    /// refused write.
    pub fn admit_maps(&mut self, more: u64) -> Result<(), EngineError> {
        let extra = self.maps_extra_for(self.map_pages + more);
        if self.enforce && self.live + extra > self.usable {
            return Err(EngineError::NoSpace(format!(
                "{}; the checkpoints would need {} more blocks for the new map",
                self.in_use(),
                extra.saturating_sub(self.maps_extra())
            )));
        }
        Ok(())
    }

    /// A block was mapped (`mapped(1)`) or unmapped.
    pub fn mapped(&mut self, blocks: u64) {
        self.live += blocks;
    }

    pub fn unmapped(&mut self, blocks: u64) {
        debug_assert!(self.live >= blocks, "unmapped more than was mapped");
        self.live = self.live.saturating_sub(blocks);
    }

    /// Segments beyond what the mapped blocks fill, the metadata stream's two and
    /// greedy's GC reserve: room for open segments and for GC to work in.
    pub fn spare_segments(&self, per_seg: u64) -> u64 {
        let held = self.live.div_ceil(per_seg.max(1)) + 2 + self.gc_start_base(1) as u64;
        (self.segment_count as u64).saturating_sub(held)
    }

    /// Free segments user streams leave to GC and the metadata stream. GC may need
    /// a fresh segment for each of its classes to finish one victim, so the floor
    /// grows with the largest number of GC classes of any volume (`gc_classes`).
    pub fn user_floor(&self, gc_classes: usize) -> usize {
        self.floor
            .unwrap_or(USER_FLOOR_SEGMENTS)
            .max(gc_classes + 2)
    }

    /// Free segments below which GC runs (always above the user floor): by default
    /// the floor plus 2% of the segments (at least 2); at least the reserve a
    /// waiting rollback asked for.
    pub fn gc_start(&self, gc_classes: usize) -> usize {
        self.gc_start_base(gc_classes).max(self.reserve)
    }

    /// The start watermark without a rollback's reserve.
    fn gc_start_base(&self, gc_classes: usize) -> usize {
        let floor = self.user_floor(gc_classes);
        self.start
            .unwrap_or(floor + 2.max(self.segment_count / 50))
            .max(floor + 1)
    }

    /// Makes GC run until `segments` are free (0: as usual again): what a
    /// rollback waits for.
    pub fn set_reserve(&mut self, segments: usize) {
        self.reserve = segments;
    }

    /// Moves GC's start watermark (`None`: the default); `array evacuate` raises
    /// it so that GC makes room on the other members as it goes.
    pub fn set_gc_start(&mut self, start: Option<usize>) {
        self.start = start;
    }

    /// Free segments at which GC stops (hysteresis: 1% of the segments above the
    /// start, or exactly one more when the start was configured).
    pub fn gc_stop(&self, gc_classes: usize) -> usize {
        let start = self.gc_start_base(gc_classes);
        let stop = match self.start {
            Some(_) => start + 1,
            None => start + 1.max(self.segment_count / 100),
        };
        // A rollback's reserve: one more, for hysteresis.
        stop.max(self.reserve + 1)
    }
}

/// The map pages [`checkpoint_blocks_of`] has room for: one map over the whole
/// array, a page per 1024 blocks (see `Space::maps_extra` for more maps).
pub fn map_room_of(count: u64, per_seg: u64) -> u64 {
    count * per_seg / 1024
}

/// The blocks [`usable_blocks_of`] keeps for each of two checkpoints on `count`
/// segments of `per_seg` data blocks: [`map_room_of`], the table and a little
/// more.
pub fn checkpoint_blocks_of(count: u64, per_seg: u64) -> u64 {
    map_room_of(count, per_seg) + count / 100 + 4
}

/// What the checkpoints of maps of `pages` pages take beyond a checkpoint room of
/// `room` pages: every checkpoint writes every map, and the previous one stays
/// until the next commits.
pub fn maps_extra_of(pages: u64, room: u64) -> u64 {
    2 * pages.saturating_sub(room)
}

/// [`Space::usable_blocks`] of `count` segments of `per_seg` data blocks with
/// over-provisioning `op` (the simulator sizes arrays with it).
pub fn usable_blocks_of(count: u64, per_seg: u64, op: f64) -> u64 {
    // A checkpoint holds up to one map page per 1024 live blocks plus its table;
    // two may coexist. Keep room for both, plus stream heads and the GC floor.
    let ckpt_blocks = checkpoint_blocks_of(count, per_seg);
    let reserve = 2 * ckpt_blocks.div_ceil(per_seg) + USER_FLOOR_SEGMENTS as u64 + 4;
    let segs = count.saturating_sub(reserve);
    ((segs * per_seg) as f64 / (1.0 + op)) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_watermarks_sit_above_the_floor_and_grow_with_the_array() {
        let small = Space::new(0, true, None, None, 64);
        assert_eq!(small.user_floor(1), 4);
        assert_eq!(small.gc_start(1), 6, "floor + 2");
        assert_eq!(small.gc_stop(1), 7);
        let big = Space::new(0, true, None, None, 10_000);
        assert_eq!(big.gc_start(1), 4 + 200, "floor + 2% of the segments");
        assert_eq!(big.gc_stop(1), 204 + 100, "start + 1%");
        // Many GC classes raise the floor, and the start with it.
        assert_eq!(small.user_floor(5), 7);
        assert_eq!(small.gc_start(5), 9);
    }

    #[test]
    fn configured_watermarks_are_kept_above_the_floor() {
        let s = Space::new(0, true, Some(6), Some(3), 1000);
        assert_eq!(s.user_floor(1), 6);
        assert_eq!(
            s.gc_start(1),
            7,
            "a start at or below the floor moves above it"
        );
        assert_eq!(s.gc_stop(1), 8);
        let s = Space::new(0, true, None, Some(50), 1000);
        assert_eq!((s.gc_start(1), s.gc_stop(1)), (50, 51));
    }

    #[test]
    fn writes_beyond_the_usable_capacity_are_refused_unless_not_enforced() {
        let mut s = Space::new(100, true, None, None, 64);
        s.mapped(90);
        assert!(s.admit(10, 0).is_ok());
        let e = s.admit(11, 0).unwrap_err();
        assert!(matches!(e, EngineError::NoSpace(_)), "{e}");
        assert!(e.to_string().contains("90 of 100"), "{e}");
        s.unmapped(50);
        assert!(s.admit(60, 0).is_ok());
        assert!(Space::new(100, false, None, None, 64)
            .admit(1000, 0)
            .is_ok());
    }

    /// Crossing a threshold is reported once each way, downwards only 1% below
    /// it; refused writes are summed over 10 s.
    #[test]
    fn fullness_is_reported_once_per_crossing() {
        let mut s = Space::new(1000, true, None, None, 64);
        let crossed = |s: &mut Space, at| s.report(at).crossed;
        assert_eq!(crossed(&mut s, 0), None);
        s.mapped(800);
        assert_eq!(s.fullness(), Fullness::Warning);
        assert_eq!(crossed(&mut s, 0), Some((Fullness::Ok, Fullness::Warning)));
        assert_eq!(crossed(&mut s, 0), None, "once");
        s.unmapped(5);
        assert_eq!(crossed(&mut s, 0), None, "795 is within 1% of 800");
        s.unmapped(6);
        assert_eq!(crossed(&mut s, 0), Some((Fullness::Warning, Fullness::Ok)));
        s.mapped(211);
        assert_eq!(s.fullness(), Fullness::Full);
        assert_eq!(crossed(&mut s, 0), Some((Fullness::Ok, Fullness::Full)));
        s.unmapped(20);
        assert_eq!(s.fullness(), Fullness::Critical);
        assert_eq!(
            crossed(&mut s, 0),
            Some((Fullness::Full, Fullness::Critical))
        );
        s.unmapped(500);
        assert_eq!(crossed(&mut s, 0), Some((Fullness::Critical, Fullness::Ok)));
        // Refused writes: the first at once, then at most every 10 s.
        s.mapped(520);
        assert!(s.admit(1, 0).is_err() && s.admit(2, 0).is_err());
        assert_eq!(s.report(1_000).refused, Some(2));
        assert!(s.admit(1, 0).is_err());
        assert_eq!(s.report(5_000).refused, None);
        assert!(s.admit(1, 0).is_err());
        assert_eq!(s.report(11_000).refused, Some(2));
        assert_eq!(s.report(30_000).refused, None);
        s.set_thresholds(0.5, 0.6);
        assert_eq!(s.fullness(), Fullness::Full);
    }
}
