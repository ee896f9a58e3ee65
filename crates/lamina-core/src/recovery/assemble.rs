//! Phase 1: the devices. Makes what a killed process left in the page cache
//! durable, reads and cross-checks the superblocks, and builds the data path the
//! engine drives (for striped layouts, the striped device over the members, with
//! failed and rebuilding members as the superblock records them).

use super::RecoveryReport;
use crate::engine::EngineConfig;
use crate::error::EngineError;
use crate::geometry::Geometry;
use crate::shared::Shared;
use crate::types::BLOCK_SIZE;
use lamina_device::zoned::ZoneCond;
use lamina_device::BlockDevice;
use lamina_format::superblock::{Layout, Superblock, SUPERBLOCK_OFFSETS};
use std::sync::Arc;

/// Opens the devices of an array: the newest superblock, and the shared state the
/// engine and its readers use, over the data path. A member that cannot sync is
/// failed (striped layouts run without it; JBOD cannot); a writable open with more
/// members failed than the parity covers is refused.
pub(super) fn open_devices(
    devices: Vec<Arc<dyn BlockDevice>>,
    cfg: &EngineConfig,
    writable: bool,
    report: &mut RecoveryReport,
) -> Result<(Superblock, Arc<Shared>), EngineError> {
    let devices: Vec<Arc<dyn BlockDevice>> = devices
        .into_iter()
        .map(lamina_device::zonehost::host)
        .collect();
    // What a killed process left in the page cache is not yet durable; make it so
    // before building on it.
    let mut sync_failed = Vec::new();
    if writable {
        for d in &devices {
            if let Err(e) = d.sync() {
                sync_failed.push((d.describe(), e));
            }
        }
    }
    let (sb, devices) = read_superblocks(devices, &mut report.warnings)?;
    let geo = Geometry::from_superblock(&sb);
    let (devices, striped) = data_path(&sb, &geo, devices, writable, &mut report.warnings)?;
    for (name, e) in sync_failed {
        let member = devices[..geo.members]
            .iter()
            .position(|d| d.describe() == name);
        match (&striped, member, member.and_then(|i| geo.striped_index(i))) {
            (Some(st), Some(i), Some(local)) => {
                report.warnings.push(format!("{e}: member {i} failed"));
                st.write_failed(local);
            }
            // A device that is not a member any more (unreadable, replaced, or a
            // removed JBOD member still named): it is already out of the array.
            (_, None, _) => report.warnings.push(format!("{e} (not in use)")),
            _ => return Err(e.into()),
        }
    }
    // A mirrored cache with no copy left is refused with what it cost
    // (`recovery::cache_lost`), which needs the checkpoint read first.
    if striped.as_ref().is_some_and(|st| st.redundancy_left() < 0) && writable && !geo.mirrored() {
        return Err(EngineError::Invalid(format!(
            "more members failed than the layout's {} parity tolerates; open read-only to read what can be rebuilt",
            geo.parity
        )));
    }
    let shared = Arc::new(Shared::new(
        geo,
        devices,
        striped,
        cfg.buffer_units,
        cfg.header_cache_bytes,
    ));
    Ok((sb, shared))
}

/// Reads and cross-checks the superblocks of all devices; returns the newest and
/// the devices ordered by their index in the array.
pub fn read_superblocks(
    devices: Vec<Arc<dyn BlockDevice>>,
    warnings: &mut Vec<String>,
) -> Result<(Superblock, Vec<Arc<dyn BlockDevice>>), EngineError> {
    let mut per_device = Vec::new();
    let mut unreadable: Vec<(Arc<dyn BlockDevice>, String)> = Vec::new();
    let mut readable = Vec::new();
    for d in &devices {
        let mut best: Option<Superblock> = None;
        let mut errors = Vec::new();
        let mut opened = true;
        for (copy, off) in SUPERBLOCK_OFFSETS.iter().enumerate() {
            let mut b = vec![0u8; BLOCK_SIZE];
            let sb = match d.read_at(&mut b, *off) {
                // Not opened at all (missing, mistyped, held by another process):
                // say that, not that its metadata is damaged.
                Err(lamina_device::DeviceError::Open { detail, .. }) => {
                    errors = vec![detail];
                    opened = false;
                    break;
                }
                Err(e) => Err(EngineError::from(e)),
                Ok(()) => Superblock::decode(&b).map_err(EngineError::from),
            };
            match sb {
                Ok(sb) => {
                    if best.as_ref().is_none_or(|x| sb.generation > x.generation) {
                        best = Some(sb);
                    }
                }
                Err(e) => errors.push(format!("copy {copy}: {e}")),
            }
        }
        match best {
            Some(sb) => {
                if !errors.is_empty() {
                    warnings.push(format!(
                        "{}: superblock {} (using the other copy)",
                        d.describe(),
                        errors.join("; ")
                    ));
                }
                per_device.push(sb);
                readable.push(d.clone());
            }
            None if !opened => {
                unreadable.push((d.clone(), format!("cannot be opened: {}", errors[0])))
            }
            None => unreadable.push((
                d.clone(),
                format!("no valid Lamina superblock ({})", errors.join("; ")),
            )),
        }
    }
    let no_superblock = |(d, e): &(Arc<dyn BlockDevice>, String)| {
        if e.starts_with("cannot be opened") {
            EngineError::Io(format!("{}: {e}", d.describe()))
        } else {
            EngineError::Format(format!("{}: {e}", d.describe()))
        }
    };
    if per_device.is_empty() {
        return Err(no_superblock(&unreadable[0]));
    }
    let newest = per_device
        .iter()
        .max_by_key(|s| s.generation)
        .unwrap()
        .clone();
    // Why devices named were not taken (said when a member is missing).
    let mut replaced = Vec::new();
    let mut ordered: Vec<Option<Arc<dyn BlockDevice>>> = vec![None; newest.devices.len()];
    // A striped array with parity may run without some members: a member whose
    // superblock cannot be read is treated as missing (its slot gets an absent
    // device) as long as the layout tolerates it.
    let tolerated = crate::geometry::layout_parity(newest.layout);
    // A removed member's device is not needed: one still named that cannot be
    // read may be it (a member really missing is named below, with the reason).
    let removed = newest
        .devices
        .iter()
        .filter(|d| d.state == MEMBER_REMOVED)
        .count();
    // Nor is the cache tier's for the error that says what its loss costs (below
    // and `recovery::cache_lost`); a capacity member missing is still refused.
    let cache = newest
        .devices
        .iter()
        .filter(|d| d.tier == lamina_format::superblock::TIER_CACHE)
        .count();
    if unreadable.len() > tolerated + removed + cache {
        if tolerated == 0 {
            return Err(no_superblock(&unreadable[0]));
        }
        let names: Vec<String> = unreadable
            .iter()
            .map(|(d, e)| format!("{} ({e})", d.describe()))
            .collect();
        return Err(EngineError::Invalid(format!(
            "{} members have no readable superblock and layout {} tolerates {tolerated}: {}",
            unreadable.len(),
            newest.layout.name(),
            names.join("; ")
        )));
    }
    for (d, e) in &unreadable {
        warnings.push(format!(
            "{}: {e}; treated as a missing member",
            d.describe()
        ));
        replaced.push(format!("{}: {e}", d.describe()));
    }
    for (d, sb) in readable.iter().zip(&per_device) {
        if sb.array_uuid != newest.array_uuid {
            return Err(EngineError::Invalid(format!(
                "{} belongs to another array ({:?}), not to {:?}",
                d.describe(),
                sb.array_name,
                newest.array_name
            )));
        }
        let i = sb.device_index as usize;
        // A device that was replaced keeps an old superblock naming it member i;
        // the newest table holds the replacement's identity. On every layout: a
        // JBOD member moved to a new device (`array replace`) leaves the old one
        // with its data as it was, which must never be taken for the member again
        // (a configuration restored or a disk renamed would name it).
        if i < newest.devices.len()
            && sb.devices.get(i).map(|e| e.uuid) != Some(newest.devices[i].uuid)
        {
            let why = format!(
                "{} was member {i} of {:?} but has been replaced; ignored",
                d.describe(),
                newest.array_name
            );
            warnings.push(why.clone());
            replaced.push(why);
            continue;
        }
        if i >= ordered.len() {
            return Err(EngineError::Format(format!(
                "{}: member index {i} outside the array's {} devices",
                d.describe(),
                ordered.len()
            )));
        }
        if ordered[i].is_some() {
            return Err(EngineError::Invalid(format!(
                "{} and another device both claim to be member {i} of {:?}",
                d.describe(),
                newest.array_name
            )));
        }
        if d.size_bytes() < newest.devices[i].size_bytes {
            return Err(EngineError::Invalid(format!(
                "{} is smaller ({} bytes) than when it joined the array ({} bytes)",
                d.describe(),
                d.size_bytes(),
                newest.devices[i].size_bytes
            )));
        }
        ordered[i] = Some(d.clone());
    }
    // A removed member (`array evacuate`) holds nothing: its device is not needed.
    for (i, slot) in ordered.iter_mut().enumerate() {
        if slot.is_none() && newest.devices[i].state == MEMBER_REMOVED {
            *slot = Some(Arc::new(lamina_device::striped::Absent::new(format!(
                "member {i} (removed)"
            ))));
        }
    }
    let missing: Vec<usize> = (0..ordered.len())
        .filter(|&i| ordered[i].is_none())
        .collect();
    if !missing.is_empty()
        && missing
            .iter()
            .all(|&i| newest.devices[i].tier == lamina_format::superblock::TIER_CACHE)
    {
        // Cache members alone are missing. With a copy of the mirror left, the
        // array runs degraded; without, it will not be served (it cannot vouch
        // for what the cache held), but its checkpoint, on the capacity tier, says
        // which volumes lost what (`recovery::cache_lost`).
        let left = cache - missing.len();
        for &i in &missing {
            if left > 0 {
                warnings.push(format!(
                    "cache member {i} of {:?} is missing: the cache mirror runs degraded",
                    newest.array_name
                ));
            }
            ordered[i] = Some(Arc::new(lamina_device::striped::Absent::new(format!(
                "member {i} (cache tier, missing)"
            ))));
        }
    } else if !missing.is_empty() && missing.len() <= tolerated {
        for &i in &missing {
            warnings.push(format!(
                "member {i} of {:?} is missing: the array runs degraded",
                newest.array_name
            ));
            ordered[i] = Some(Arc::new(lamina_device::striped::Absent::new(format!(
                "member {i} (missing)"
            ))));
        }
    } else if !missing.is_empty() {
        let mut m = format!(
            "array {:?} has {} devices; members {missing:?} were not given",
            newest.array_name,
            ordered.len()
        );
        if !replaced.is_empty() {
            m += &format!(" ({})", replaced.join("; "));
        }
        return Err(EngineError::Invalid(m));
    }
    Ok((newest, ordered.into_iter().map(|d| d.unwrap()).collect()))
}

/// Member state in the superblock: the member failed and holds nothing current.
pub const MEMBER_FAILED: u32 = 1;
/// Member state (JBOD): taken out by `array evacuate`; holds nothing, and its
/// segments are never used again.
pub const MEMBER_REMOVED: u32 = lamina_format::superblock::DEVICE_REMOVED;
/// Member state: a replacement being rebuilt; stripes below `rebuild_cursor` are
/// current on it.
pub const MEMBER_REBUILDING: u32 = 2;

/// The devices the engine drives: the members, then for striped layouts the
/// striped device over them (members marked failed in the superblock, or missing,
/// are left out of its I/O).
#[allow(clippy::type_complexity)]
fn data_path(
    sb: &Superblock,
    geo: &Geometry,
    members: Vec<Arc<dyn BlockDevice>>,
    writable: bool,
    warnings: &mut Vec<String>,
) -> Result<
    (
        Vec<Arc<dyn BlockDevice>>,
        Option<Arc<lamina_device::striped::Striped>>,
    ),
    EngineError,
> {
    use lamina_device::striped::{StripeShape, Striped};
    if sb.layout == Layout::Jbod && !geo.mirrored() {
        return Ok((
            members.into_iter().map(plug).collect::<Result<_, _>>()?,
            None,
        ));
    }
    // The striped device's members: every member of a striped layout; the cache
    // members of a JBOD whose cache tier is mirrored (one data column, the other
    // copies as its parity: P and Q of a single column are copies of it).
    let base = geo.striped_member0();
    let (capacity, members) = {
        let mut m = members;
        let mirror = m.split_off(base);
        (m, mirror)
    };
    let failed: Vec<bool> = sb.devices[base..]
        .iter()
        .zip(&members)
        .map(|(e, d)| e.state == MEMBER_FAILED || d.size_bytes() == 0)
        .collect();
    for (i, f) in failed.iter().enumerate() {
        if *f {
            warnings.push(format!(
                "member {} ({}) is failed or missing: the {} runs degraded",
                base + i,
                members[i].describe(),
                if geo.mirrored() {
                    "cache mirror"
                } else {
                    "array"
                }
            ));
        }
    }
    let shape = if geo.mirrored() {
        StripeShape {
            data: 1,
            parity: geo.cache_copies - 1,
            chunk_blocks: geo.segment_blocks as u64,
            data_offset: geo.data_offset,
            stripes: geo.cache_segments() as u64,
        }
    } else {
        StripeShape {
            data: geo.row_blocks as usize,
            parity: geo.parity,
            chunk_blocks: (geo.segment_blocks / geo.row_blocks) as u64,
            data_offset: geo.data_offset,
            stripes: geo.segment_count as u64,
        }
    };
    let striped = Arc::new(
        Striped::new(members.clone(), shape, &failed)
            .map_err(|e| EngineError::Invalid(e.to_string()))?,
    );
    if striped.redundancy_left() < 0 {
        warnings.push(format!(
            "{} of {} members failed, more than the layout's {} parity: data is lost",
            striped.failed_count(),
            members.len(),
            shape.parity
        ));
    }
    for (i, e) in sb.devices[base..].iter().enumerate() {
        if e.state == MEMBER_REBUILDING && !failed[i] {
            striped.set_rebuild_cursor(i, Some(e.rebuild_cursor as u64));
            // Zoned: what a killed rebuild wrote past its recorded cursor would
            // hold zones of the new member open; the resumed rebuild rewrites
            // those stripes from their start anyway.
            if writable && members[i].zone_layout().is_some() {
                let from = shape.member_offset(e.rebuild_cursor as u64, 0);
                for z in members[i].report_zones()? {
                    if z.ty == lamina_device::zoned::ZoneType::SequentialRequired
                        && z.start >= from
                        && matches!(
                            z.cond,
                            ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen | ZoneCond::Closed
                        )
                    {
                        members[i].reset_zone(z.start)?;
                    }
                }
            }
            warnings.push(format!(
                "member {} ({}) is being rebuilt: {} of {} stripes done",
                base + i,
                members[i].describe(),
                e.rebuild_cursor,
                shape.stripes
            ));
        }
    }
    // Superblocks and syncs reach members through their slots, so that they follow
    // a replacement.
    let mut devices: Vec<Arc<dyn BlockDevice>> =
        capacity.into_iter().map(plug).collect::<Result<_, _>>()?;
    devices.extend((0..members.len()).map(|index| {
        Arc::new(lamina_device::striped::MemberSlot {
            array: striped.clone(),
            index,
        }) as Arc<dyn BlockDevice>
    }));
    devices.push(plug(striped.clone())?);
    Ok((devices, Some(striped)))
}

/// A device the engine writes segments to, behind a zone write plug if it is
/// zoned (see [`lamina_device::zonehost::Plug`]).
fn plug(dev: Arc<dyn BlockDevice>) -> Result<Arc<dyn BlockDevice>, EngineError> {
    if dev.zone_layout().is_none() {
        return Ok(dev);
    }
    Ok(Arc::new(lamina_device::zonehost::Plug::new(dev)?))
}

#[cfg(test)]
mod tests {
    use super::super::testing::{config, devices};
    use super::*;
    use lamina_device::mem::MemDevice;

    /// The devices phase takes the array's shape from the superblocks alone, and a
    /// device that holds no array is refused, not formatted or guessed at.
    #[test]
    fn devices_give_the_recorded_shape_and_strangers_are_refused() {
        let (_dev, devs) = devices();
        let mut report = RecoveryReport::default();
        let (sb, shared) = open_devices(devs, &config(), true, &mut report).unwrap();
        assert_eq!(sb.array_name, "phases");
        assert_eq!(shared.geo.segment_blocks, 64);
        assert_eq!(shared.geo.write_unit_blocks, 8);
        assert!(report.warnings.is_empty(), "{:?}", report.warnings);

        let blank: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("blank", 8 << 20));
        let err = open_devices(vec![blank], &config(), true, &mut report).err();
        assert!(err.is_some(), "a blank device opened as an array");
    }
}
