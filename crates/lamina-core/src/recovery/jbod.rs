//! Changing a JBOD array's members, with the array closed: adding devices
//! (`lamina array grow`, as `zpool add` or `vgextend`) and moving a member to a
//! new device (`lamina array replace` on JBOD, as `pvmove` onto a new disk).
//!
//! **Grow.** The new devices' segments are numbered after the existing ones, so
//! nothing stored moves, and they join the free queue at its front (the
//! allocator, which prefers the least-written member, then fills them first).
//! **Replace.** Every segment of the member that is not in the free queue is
//! copied to the same offset of the new device, which takes the member's place
//! (same segments, its own identity); the old device keeps its data and its old
//! label, which names a member replaced since.
//!
//! **Order, so that a crash at any point leaves an array that opens.**
//! 1. The array is opened read-write and closed: recovery replays what the last
//!    run left and writes a checkpoint, so the array starts from a checkpoint of
//!    everything (no replay ever spans the change; for a replace, no unit is
//!    written after the segments are chosen for copying).
//! 2. Each new device is discarded (optional), filled (replace) and labelled with
//!    the new superblock (the new member table, generation + 1), both copies,
//!    synced.
//! 3. The caller's `commit` runs: it records the change where the array's
//!    devices are listed (lamina.toml). Failing here, the old members still carry
//!    the old superblock, and the array opens as it was from its old list; the new
//!    devices' labels name members the array does not have, and a new grow or
//!    replace takes them again.
//! 4. The other members get the new superblock: copy 0 on every member, sync,
//!    copy 1, sync. A crash in between leaves them one generation behind the new
//!    devices; opening takes the newest superblock, which lists every member,
//!    and a JBOD member's older label is still its own (the next superblock
//!    update rewrites it).
//! 5. The array is opened once more. After a grow, the checkpoint lists fewer
//!    segments than the geometry, and [`super::checkpoint::load`] adds the new ones
//!    as free, at the front of the free queue, in index order; the open's own
//!    checkpoint then lists them all. Nothing is written to them before that
//!    checkpoint commits (every read-write open writes one before it serves), so
//!    no replay ever has to find units in segments its checkpoint does not list.
//!
//! Striped layouts would have to restripe every live segment over the new member
//! count (grow), and replace their members by rebuilding from parity (the
//! `rebuild` module). Zoned arrays are refused too (a new device's zones would
//! have to match, and its conventional zones be placed).
//!
//! **Tiers.** An array with a cache tier moves a capacity member, or a cache
//! device that is not mirrored, as any JBOD member (a mirror's copies are
//! replaced online instead), and evacuates a capacity member onto the others;
//! it does not grow (the cache's segments are numbered after the capacity
//! tier's, where a new member's would go) and does not evacuate its cache.

use super::{assemble, format, open, OpenMode, Progress, MEMBER_FAILED, MEMBER_REMOVED};
use crate::engine::{Engine, EngineConfig};
use crate::error::EngineError;
use crate::geometry::Geometry;
use crate::types::{SegmentId, BLOCK_SIZE};
use lamina_device::BlockDevice;
use lamina_format::superblock::{
    DeviceEntry, Layout, Superblock, MAX_DEVICES, SUPERBLOCK_OFFSETS, TIER_CACHE,
};
use std::sync::Arc;

/// How to add devices to an array (grow, replace).
#[derive(Clone, Debug, Default)]
pub struct GrowParams {
    /// Take devices that carry another array's superblock.
    pub force: bool,
    /// Discard the new devices' data areas first (as at creation).
    /// Told how the discard goes (bytes done, in all).
    pub discard: bool,
    pub progress: Option<Progress>,
}

/// Adds `new` (with identities `new_uuids`) to the JBOD array on `members`,
/// opened with `cfg` (the array's own settings); returns the superblock the array
/// now has. `commit` runs once the new devices carry the array's label and before
/// the old members do (see the module's comment); an error from it stops the grow
/// with the old members untouched.
pub fn grow(
    members: Vec<Arc<dyn BlockDevice>>,
    cfg: &EngineConfig,
    new: &[Arc<dyn BlockDevice>],
    new_uuids: &[[u8; 16]],
    params: &GrowParams,
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
) -> Result<Superblock, EngineError> {
    assert_eq!(new.len(), new_uuids.len());
    if new.is_empty() {
        return invalid("no device to add".into());
    }
    let (sb, members, ()) = checkpointed(members, cfg, "grow", |_| ())?;
    if format::zoned_layout(new)?.is_some() {
        return invalid("zoned devices cannot be added to an array yet".into());
    }
    if sb.devices.len() + new.len() > MAX_DEVICES {
        return invalid(format!(
            "an array holds at most {MAX_DEVICES} devices; {:?} has {} and {} were given",
            sb.array_name,
            sb.devices.len(),
            new.len()
        ));
    }
    for d in new {
        check_new_device(&**d, &sb, params.force)?;
    }
    let mut grown = sb.clone();
    let mut next = Geometry::from_superblock(&sb).segment_count;
    for (d, uuid) in new.iter().zip(new_uuids) {
        let segs = Geometry::segments_on_device(d.size_bytes(), sb.data_offset, sb.segment_blocks);
        if segs == 0 {
            return invalid(format!(
                "device {} ({} bytes) is too small: it needs {} bytes at least, for the superblocks and one segment",
                d.describe(),
                d.size_bytes(),
                sb.data_offset + sb.segment_blocks as u64 * BLOCK_SIZE as u64
            ));
        }
        grown.devices.push(DeviceEntry {
            uuid: *uuid,
            size_bytes: d.size_bytes(),
            segment_count: segs,
            first_segment: next,
            state: 0,
            rebuild_cursor: 0,
            tier: 0,
        });
        next = next
            .checked_add(segs)
            .ok_or_else(|| EngineError::Invalid("array too large".into()))?;
    }
    if next as u64 * sb.segment_blocks as u64 >= crate::map::PBA_LIMIT as u64 {
        return invalid(
            "the array would exceed 16 TiB, the limit of 32-bit block addresses".into(),
        );
    }
    grown.generation = sb.generation + 1;
    if params.discard {
        format::discard_all(new, sb.data_offset, params.progress.as_ref());
    }
    let first_new = sb.devices.len();
    let labelled: Vec<(usize, Arc<dyn BlockDevice>)> = new
        .iter()
        .enumerate()
        .map(|(j, d)| (first_new + j, d.clone()))
        .collect();
    let others = in_service(&sb, members, None);
    switch(&grown, &labelled, &others, cfg, commit, None)
}

/// What [`replace`] copied.
#[derive(Clone, Debug)]
pub struct ReplaceReport {
    pub superblock: Superblock,
    /// Segments copied (those not in the free queue) and the member's segments.
    pub segments_copied: u64,
    pub segments: u64,
    pub bytes_copied: u64,
}

/// Moves member `index` of the JBOD array on `members` to `new` (identity
/// `new_uuid`), which must hold the member's segments: every segment not in the
/// free queue is copied, at the same offset (`copied` is told bytes done and in
/// all). The old device is left as it is. `commit` as for [`grow`].
#[allow(clippy::too_many_arguments)]
pub fn replace(
    members: Vec<Arc<dyn BlockDevice>>,
    cfg: &EngineConfig,
    index: usize,
    new: Arc<dyn BlockDevice>,
    new_uuid: [u8; 16],
    params: &GrowParams,
    copied: &mut dyn FnMut(u64, u64),
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
) -> Result<ReplaceReport, EngineError> {
    let (sb, members, in_use) = checkpointed(members, cfg, "replace", |engine| {
        let geo = &engine.shared().geo;
        let mut free = vec![false; geo.segment_count as usize];
        // Both tiers' free queues: the member may be the cache's.
        for s in engine.segments.all_free() {
            free[s as usize] = true;
        }
        match geo.devices.get(index) {
            Some(span) => (span.first_segment..span.first_segment + span.segment_count)
                .filter(|&s| !free[s as usize])
                .collect(),
            None => Vec::new(),
        }
    })?;
    let Some(entry) = sb.devices.get(index) else {
        return invalid(format!(
            "array {:?} has no member {index} (it has {})",
            sb.array_name,
            sb.devices.len()
        ));
    };
    if entry.state == MEMBER_REMOVED {
        return invalid(format!(
            "member {index} of {:?} was removed: it holds nothing to move (`array grow` adds a device)",
            sb.array_name
        ));
    }
    let geo = Geometry::from_superblock(&sb);
    if geo.mirrored() && geo.is_cache_member(index) {
        return invalid(format!(
            "member {index} of {:?} is a copy of a mirrored cache: it is replaced online and \
             rebuilt from another copy (`lamina array fail`, then `lamina array replace` with \
             the array served)",
            sb.array_name
        ));
    }
    if format::zoned_layout(std::slice::from_ref(&new))?.is_some() {
        return invalid("a zoned device cannot replace a member yet".into());
    }
    check_new_device(&*new, &sb, params.force)?;
    let seg_bytes = sb.segment_blocks as u64 * BLOCK_SIZE as u64;
    let needed = sb.data_offset + entry.segment_count as u64 * seg_bytes;
    if new.size_bytes() < needed {
        return invalid(format!(
            "device {} ({} bytes) is smaller than member {index}'s {} segments need ({needed} bytes)",
            new.describe(),
            new.size_bytes(),
            entry.segment_count
        ));
    }
    if params.discard {
        format::discard_all(
            std::slice::from_ref(&new),
            sb.data_offset,
            params.progress.as_ref(),
        );
    }
    let old = &members[index];
    let total = in_use.len() as u64 * seg_bytes;
    // A segment at a time, in pieces of 1 MiB (segments may be 64 GiB stripes
    // elsewhere; JBOD ones are whole on the device, but need not be small).
    const PIECE: u64 = 1 << 20;
    let mut buf = vec![0u8; PIECE.min(seg_bytes) as usize];
    let mut done = 0;
    for &seg in &in_use {
        let (dev, start) = geo.locate(SegmentId(seg), 0);
        debug_assert_eq!(dev, index);
        let mut at = 0;
        while at < seg_bytes {
            let len = PIECE.min(seg_bytes - at) as usize;
            old.read_at(&mut buf[..len], start + at).map_err(|e| {
                EngineError::Io(format!(
                    "member {index} ({}): segment {seg} cannot be read ({e}); JBOD has no other copy, nothing was changed",
                    old.describe()
                ))
            })?;
            new.write_at(&buf[..len], start + at)?;
            at += len as u64;
            done += len as u64;
            copied(done, total);
        }
    }
    new.sync()?;
    let mut next = sb.clone();
    next.generation = sb.generation + 1;
    next.devices[index] = DeviceEntry {
        uuid: new_uuid,
        size_bytes: new.size_bytes(),
        ..*entry
    };
    let others = in_service(&sb, members, Some(index));
    // The new device starts with nothing written (wear levelling and `status`
    // count per member slot).
    let superblock = switch(&next, &[(index, new)], &others, cfg, commit, Some(index))?;
    Ok(ReplaceReport {
        superblock,
        segments_copied: in_use.len() as u64,
        segments: entry.segment_count as u64,
        bytes_copied: done,
    })
}

/// The members (in their order) that take superblocks: all but `except`, the
/// removed ones, whose devices are not needed (a placeholder stands for them),
/// and a mirrored cache's failed copies (missing, or never to be trusted again),
/// as the engine's own superblock writes leave them out.
fn in_service(
    sb: &Superblock,
    members: Devices,
    except: Option<usize>,
) -> Vec<(usize, Arc<dyn BlockDevice>)> {
    members
        .into_iter()
        .enumerate()
        .filter(|(i, _)| {
            Some(*i) != except && !matches!(sb.devices[*i].state, MEMBER_REMOVED | MEMBER_FAILED)
        })
        .collect()
}

fn invalid<T>(m: String) -> Result<T, EngineError> {
    Err(EngineError::Invalid(m))
}

type Devices = Vec<Arc<dyn BlockDevice>>;

/// Step 1: the array opened (recovery, a checkpoint) and closed; `look` sees the
/// engine before it closes. Returns the superblock, the members in their order
/// and what `look` found. Only JBOD arrays that are not zoned go on.
fn checkpointed<T>(
    members: Vec<Arc<dyn BlockDevice>>,
    cfg: &EngineConfig,
    what: &str,
    look: impl FnOnce(&Engine) -> T,
) -> Result<(Superblock, Devices, T), EngineError> {
    let (engine, _) = open(members.clone(), cfg.clone(), OpenMode::ReadWrite)?;
    let seen = look(&engine);
    drop(engine);
    let mut warnings = Vec::new();
    let (sb, members) = assemble::read_superblocks(members, &mut warnings)?;
    // Any zoned member (a cache tier in front of zoned ones is not zoned).
    let zoned = members.iter().any(|d| d.zone_layout().is_some());
    jbod_only(&sb, zoned, what)?;
    Ok((sb, members, seen))
}

/// Changes of members (`what`: "grow", "replace", "evacuate") are for JBOD arrays
/// that are not zoned; the refusal says what a striped array does instead.
fn jbod_only(sb: &Superblock, zoned: bool, what: &str) -> Result<(), EngineError> {
    if sb.layout != Layout::Jbod {
        let how = match what {
            "grow" => "growing a striped layout means restriping every live segment over more members, which is not built (only JBOD arrays grow)",
            "evacuate" => "only a JBOD array's member is evacuated (a striped layout's member is replaced by failing it and rebuilding from parity)",
            _ => "a striped layout's member is replaced by failing it and rebuilding from parity (`array fail`, then `array replace`)",
        };
        return invalid(format!(
            "array {:?} is {}: {how}",
            sb.array_name,
            sb.layout.name()
        ));
    }
    if zoned {
        return invalid(format!("zoned arrays cannot {what} their members yet"));
    }
    // The cache tier's segments are numbered after the capacity tier's: a new
    // capacity member would have to be numbered between them.
    if what == "grow" && sb.devices.iter().any(|d| d.tier == TIER_CACHE) {
        return invalid(format!(
            "array {:?} has a cache tier: it cannot grow yet (issue 14)",
            sb.array_name
        ));
    }
    Ok(())
}

/// A device may join the array unless it is a member now, or (without `force`)
/// carries another array's label. One that carries this array's label but is not a
/// member (a grow or replace that stopped before its commit, a member replaced
/// long ago) holds nothing the array needs.
fn check_new_device(d: &dyn BlockDevice, sb: &Superblock, force: bool) -> Result<(), EngineError> {
    let Some(other) = format::label_of(d) else {
        return Ok(());
    };
    if other.array_uuid == sb.array_uuid {
        // A removed member's device holds nothing the array needs either.
        let own = other.devices.get(other.device_index as usize);
        if sb
            .devices
            .iter()
            .any(|e| e.state != MEMBER_REMOVED && own.is_some_and(|o| o.uuid == e.uuid))
        {
            return invalid(format!(
                "device {} is already a member of {:?}",
                d.describe(),
                sb.array_name
            ));
        }
    } else if !force {
        return invalid(format!(
            "device {} already belongs to Lamina array {:?}; refusing to overwrite it",
            d.describe(),
            other.array_name
        ));
    }
    Ok(())
}

/// Steps 2 (labels), 3, 4 and 5 of the module's comment: `labelled` get `next`
/// first, then `commit` runs, then `others`, one copy at a time; then the array
/// is opened on all of them for a checkpoint under the new table.
fn switch(
    next: &Superblock,
    labelled: &[(usize, Arc<dyn BlockDevice>)],
    others: &[(usize, Arc<dyn BlockDevice>)],
    cfg: &EngineConfig,
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
    fresh: Option<usize>,
) -> Result<Superblock, EngineError> {
    for (i, d) in labelled {
        for off in SUPERBLOCK_OFFSETS {
            write_label(&**d, next, *i, off)?;
        }
        d.sync()?;
    }
    commit()?;
    for off in SUPERBLOCK_OFFSETS {
        for (i, d) in others {
            write_label(&**d, next, *i, off)?;
        }
        for (_, d) in others {
            d.sync()?;
        }
    }
    let all: Vec<Arc<dyn BlockDevice>> = others
        .iter()
        .chain(labelled)
        .map(|(_, d)| d.clone())
        .collect();
    let (mut engine, _) = open(all, cfg.clone(), OpenMode::ReadWrite)?;
    if let Some(i) = fresh {
        if let Some(b) = engine.device_blocks.get_mut(i) {
            *b = 0;
            checkpoint(&mut engine)?;
        }
    }
    let sb = engine.superblock().clone();
    drop(engine);
    Ok(sb)
}

fn write_label(
    d: &dyn BlockDevice,
    sb: &Superblock,
    index: usize,
    off: u64,
) -> Result<(), EngineError> {
    let mut s = sb.clone();
    s.device_index = index as u32;
    d.write_at(&s.encode()[..], off)?;
    Ok(())
}

/// What [`evacuate`] did.
#[derive(Clone, Debug)]
pub struct EvacuateReport {
    pub superblock: Superblock,
    /// Segments of the member in use when it started (data, metadata).
    pub segments: u64,
    /// Blocks GC moved meanwhile (the member's live blocks, and what else GC
    /// collected on the way).
    pub blocks_moved: u64,
}

/// Moves everything off member `index` of the JBOD array on `members` onto the
/// others, then marks it removed ([`MEMBER_REMOVED`]): its segments keep their
/// numbers and are never used again, and its device is no longer needed.
/// `progress` is told segments emptied and in all; `commit` runs once the
/// superblocks say the member is removed (the caller then drops it from where the
/// devices are listed).
///
/// The member's segments leave the free queue for good, and a checkpoint commits
/// before GC moves anything: a crash before it replays by the previous
/// checkpoint's free queue, which still holds them, and the engine took none of
/// them. GC then moves the segments that hold data (its repair list, whatever
/// their garbage), and checkpoints move the metadata stream off the member and
/// release what was emptied. A crash in the middle leaves an array whose member
/// holds less; the command can be run again.
pub fn evacuate(
    members: Vec<Arc<dyn BlockDevice>>,
    cfg: &EngineConfig,
    index: usize,
    progress: &mut dyn FnMut(u64, u64),
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
) -> Result<EvacuateReport, EngineError> {
    let (mut engine, _) = open(members.clone(), cfg.clone(), OpenMode::ReadWrite)?;
    let sb = engine.superblock().clone();
    jbod_only(&sb, engine.zones.zoned, "evacuate")?;
    let geo = engine.geometry().clone();
    let Some(span) = geo.devices.get(index) else {
        return invalid(format!(
            "array {:?} has no member {index} (it has {})",
            sb.array_name,
            geo.devices.len()
        ));
    };
    if geo.is_cache_member(index) {
        return invalid(format!(
            "member {index} of {:?} is its cache tier: evacuating it would remove the cache, \
             which is not built (`lamina array replace` moves it to another device)",
            sb.array_name
        ));
    }
    if span.removed {
        return invalid(format!(
            "member {index} of {:?} was removed already",
            sb.array_name
        ));
    }
    let range = span.first_segment..span.first_segment + span.segment_count;
    let mut after = geo.clone();
    after.devices[index].removed = true;
    if after.usable_segments() == 0 {
        return invalid(format!(
            "member {index} is the last one of {:?} in use: there is nowhere to move its data",
            sb.array_name
        ));
    }
    let usable_after = crate::space::Space::usable_blocks(&after, &sb);
    // What the array holds counts its maps' room in the checkpoints too, against
    // the checkpoint room of the smaller array, as the engine will count it
    // after: the live blocks alone could fit while the next checkpoint did not.
    let room_after = crate::space::map_room_of(
        after.usable_segments() as u64,
        after.data_blocks_per_segment(),
    );
    let maps = crate::space::maps_extra_of(engine.space.map_pages, room_after);
    let in_use = engine.space.live + maps;
    if in_use > usable_after {
        let of_maps = if maps > 0 {
            format!(" ({maps} of them the maps' room in the checkpoints)")
        } else {
            String::new()
        };
        return invalid(format!(
            "the other members cannot hold what the array stores: {in_use} blocks are in use{of_maps} \
             and they would offer {usable_after}; free space first (trim, delete a volume or snapshot) \
             or add a member",
        ));
    }
    let in_use = |e: &Engine| {
        range
            .clone()
            .filter(|&s| e.segments.segs[s as usize].state != crate::engine::SegState::Free)
            .count() as u64
    };
    let total = in_use(&engine);
    let moved_before = engine.counters.gc_blocks;
    engine.segments.withhold(range.clone());
    checkpoint(&mut engine)?;
    // From here GC collects the other members' garbage until this many segments
    // are free, so that the repair list always has room to move into (offline:
    // no client writes wait at these watermarks).
    let floor = engine.gc_start_segments();
    engine.space.set_gc_start(Some(floor + 8));
    let mut best = u64::MAX;
    let mut stalled = 0;
    loop {
        let left = in_use(&engine);
        progress(total - left.min(total), total);
        if left == 0 {
            break;
        }
        if left < best {
            best = left;
            stalled = 0;
        } else {
            stalled += 1;
        }
        if stalled > 16 {
            let segs: Vec<String> = range
                .clone()
                .filter(|&s| {
                    engine.segments.segs[s as usize].state != crate::engine::SegState::Free
                })
                .map(|s| {
                    let sg = &engine.segments.segs[s as usize];
                    format!(
                        "{s} ({:?}{})",
                        sg.state,
                        if sg.gc_exclude {
                            ", holds blocks that failed verification"
                        } else {
                            ""
                        }
                    )
                })
                .collect();
            return Err(EngineError::Io(format!(
                "member {index}: {left} segments could not be emptied: {}; nothing was removed",
                segs.join(", ")
            )));
        }
        // GC's repair list goes before its own victims, and the member's emptied
        // segments do not come back: hand it only as many segments as the free
        // space above GC's usual start can take (each may need a fresh segment for
        // its live blocks); GC's own start, raised above, has it collect the other
        // members' garbage meanwhile.
        let headroom = engine.segments.free.len().saturating_sub(floor + 1);
        engine.move_segments(range.clone(), headroom);
        let mut rounds = 0u64;
        let mut last = (usize::MAX, u64::MAX);
        let mut same = 0;
        loop {
            if let Some(why) = &engine.failed {
                return Err(EngineError::Io(format!("evacuating member {index}: {why}")));
            }
            let now = (engine.segments.free.len(), engine.counters.gc_blocks);
            let collecting = engine.segments.free.len() < engine.gc_start_segments();
            if !engine.repairs_pending() && !collecting {
                break;
            }
            // GC that no longer moves anything nor frees anything is done for this
            // round; the checkpoint below may release what it emptied.
            same = if now == last { same + 1 } else { 0 };
            last = now;
            rounds += 1;
            if same > 64 || rounds > 1_000_000 {
                break;
            }
            engine.tick(engine.now_ms);
            super::run_inline(&mut engine);
        }
        // Releases what was emptied, and moves the metadata stream along.
        checkpoint(&mut engine)?;
    }
    engine.sb.devices[index].state = MEMBER_REMOVED;
    checkpoint(&mut engine)?;
    let blocks_moved = engine.counters.gc_blocks - moved_before;
    drop(engine);
    commit()?;
    // The members still in service (placeholders of removed ones are not passed
    // on: opening makes its own).
    let rest: Vec<Arc<dyn BlockDevice>> = {
        let mut w = Vec::new();
        let (sb, ordered) = assemble::read_superblocks(members, &mut w)?;
        in_service(&sb, ordered, Some(index))
            .into_iter()
            .map(|(_, d)| d)
            .collect()
    };
    let (engine, _) = open(rest, cfg.clone(), OpenMode::ReadWrite)?;
    let superblock = engine.superblock().clone();
    Ok(EvacuateReport {
        superblock,
        segments: total,
        blocks_moved,
    })
}

/// Runs a checkpoint to its commit, inline.
fn checkpoint(engine: &mut Engine) -> Result<(), EngineError> {
    let token = crate::engine::Token {
        conn: u32::MAX,
        handle: 2,
    };
    match super::call_inline(engine, token, crate::engine::Request::Checkpoint, 1000) {
        Some(r) => r.result,
        None => Err(EngineError::Io("a checkpoint did not complete".into())),
    }
}
