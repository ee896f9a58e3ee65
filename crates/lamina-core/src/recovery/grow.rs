//! Adding members to a JBOD array (`lamina array grow`, as `zpool add` or
//! `vgextend`): the new devices' segments are numbered after the existing ones,
//! so nothing stored moves, and they join the free queue at its end.
//!
//! **Order, so that a crash at any point leaves an array that opens.**
//! 1. The array is opened read-write and closed: recovery replays what the last
//!    run left and writes a checkpoint, so the grown array starts from a
//!    checkpoint of everything (no replay ever spans the change of geometry).
//! 2. Each new device is discarded (optional) and labelled with the new superblock
//!    (the member table with the new entries, generation + 1), both copies, synced.
//! 3. The caller's `commit` runs: it records the new devices where the array's
//!    devices are listed (lamina.toml). Failing here, the old members still carry
//!    the old superblock, and the array opens as it was from its old list; the new
//!    devices' labels name members the array does not have and a new `grow`
//!    takes them again.
//! 4. The old members get the new superblock: copy 0 on every member, sync, copy 1,
//!    sync. A crash in between leaves old members one generation behind the new
//!    devices; opening takes the newest superblock, which lists every member,
//!    and a JBOD member's older label is still its own (the next superblock
//!    update rewrites it).
//! 5. The array is opened once more: the checkpoint lists fewer segments than the
//!    geometry, and [`super::checkpoint::load`] adds the new ones as free, at the
//!    end of the free queue, in index order; the open's own checkpoint then lists
//!    them all. Nothing is written to them before that checkpoint commits (every
//!    read-write open writes one before it serves), so no replay ever has to find
//!    units in segments its checkpoint does not list.
//!
//! Striped layouts would have to restripe every live segment over the new member
//! count; that is not built. Zoned arrays are refused too (a new device's zones
//! would have to match, and its conventional zones be placed).

use super::{assemble, format, open, OpenMode, Progress};
use crate::engine::EngineConfig;
use crate::error::EngineError;
use crate::geometry::Geometry;
use lamina_device::BlockDevice;
use lamina_format::superblock::{DeviceEntry, Layout, Superblock, MAX_DEVICES, SUPERBLOCK_OFFSETS};
use std::sync::Arc;

/// How to grow an array.
#[derive(Clone, Debug, Default)]
pub struct GrowParams {
    /// Take devices that carry another array's superblock.
    pub force: bool,
    /// Discard the new devices' data areas first (as at creation).
    pub discard: bool,
    pub progress: Option<Progress>,
}

/// Adds `new` (with identities `new_uuids`) to the JBOD array on `members`,
/// opened with `cfg` (the array's own settings); returns the superblock the array
/// now has. `commit` runs once the new devices
/// carry the array's label and before the old members do (see the module's
/// comment); an error from it stops the grow with the old members untouched.
pub fn grow(
    members: Vec<Arc<dyn BlockDevice>>,
    cfg: &EngineConfig,
    new: &[Arc<dyn BlockDevice>],
    new_uuids: &[[u8; 16]],
    params: &GrowParams,
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
) -> Result<Superblock, EngineError> {
    let invalid = |m: String| Err(EngineError::Invalid(m));
    assert_eq!(new.len(), new_uuids.len());
    if new.is_empty() {
        return invalid("no device to add".into());
    }
    // 1. A checkpoint of everything, under the geometry it was written with.
    let (engine, _) = open(members.clone(), cfg.clone(), OpenMode::ReadWrite)?;
    drop(engine);
    let mut warnings = Vec::new();
    let (sb, members) = assemble::read_superblocks(members, &mut warnings)?;
    if sb.layout != Layout::Jbod {
        return invalid(format!(
            "array {:?} is {}: growing a striped layout means restriping every live segment over more members, which is not built (only JBOD arrays grow)",
            sb.array_name,
            sb.layout.name()
        ));
    }
    if format::zoned_layout(&members)?.is_some() || format::zoned_layout(new)?.is_some() {
        return invalid("zoned arrays and zoned devices cannot be added to yet".into());
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
        if let Some(other) = format::label_of(&**d) {
            if other.array_uuid == sb.array_uuid {
                // A device this array lists now is in use; one it does not (a
                // grow that stopped before its commit, a member replaced long
                // ago) holds nothing the array needs.
                if sb.devices.iter().any(|e| {
                    other
                        .devices
                        .get(other.device_index as usize)
                        .is_some_and(|o| o.uuid == e.uuid)
                }) {
                    return invalid(format!(
                        "device {} is already a member of {:?}",
                        d.describe(),
                        sb.array_name
                    ));
                }
            } else if !params.force {
                return invalid(format!(
                    "device {} already belongs to Lamina array {:?}; refusing to overwrite it",
                    d.describe(),
                    other.array_name
                ));
            }
        }
    }
    let mut grown = sb.clone();
    let mut next = Geometry::from_superblock(&sb).segment_count;
    for (d, uuid) in new.iter().zip(new_uuids) {
        let segs = Geometry::segments_on_device(d.size_bytes(), sb.data_offset, sb.segment_blocks);
        if segs == 0 {
            return invalid(format!(
                "device {} ({} bytes) is too small for one segment of {} bytes",
                d.describe(),
                d.size_bytes(),
                sb.segment_blocks as u64 * crate::types::BLOCK_SIZE as u64
            ));
        }
        grown.devices.push(DeviceEntry {
            uuid: *uuid,
            size_bytes: d.size_bytes(),
            segment_count: segs,
            first_segment: next,
            state: 0,
            rebuild_cursor: 0,
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
    // 2. The new devices, labelled.
    if params.discard {
        format::discard_all(new, sb.data_offset, params.progress.as_ref());
    }
    let first_new = sb.devices.len();
    for (j, d) in new.iter().enumerate() {
        for off in SUPERBLOCK_OFFSETS {
            write_label(&**d, &grown, first_new + j, off)?;
        }
        d.sync()?;
    }
    // 3. Where the array's devices are listed.
    commit()?;
    // 4. The old members, one copy at a time.
    for off in SUPERBLOCK_OFFSETS {
        for (i, d) in members.iter().enumerate() {
            write_label(&**d, &grown, i, off)?;
        }
        for d in &members {
            d.sync()?;
        }
    }
    // 5. The first checkpoint that lists the new segments.
    let mut all = members;
    all.extend(new.iter().cloned());
    let (engine, _) = open(all, cfg.clone(), OpenMode::ReadWrite)?;
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
