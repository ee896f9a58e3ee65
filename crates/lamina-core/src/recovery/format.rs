//! Making a new array: superblocks on every device, zones emptied.

use super::{FormatParams, MIN_CACHE_SEGMENTS, MIN_SEGMENTS};
use crate::error::EngineError;
use crate::geometry::Geometry;
use crate::types::{BLOCK_SIZE, BLOCK_SIZE_U64};
use lamina_device::zoned::{ZoneCond, ZoneType};
use lamina_device::BlockDevice;
use lamina_format::superblock::{
    DeviceEntry, Layout, Superblock, DEFAULT_DATA_OFFSET, MAX_DEVICES, MAX_NAME_LEN,
    SUPERBLOCK_OFFSETS, TIER_CACHE, TIER_CAPACITY,
};
use std::sync::Arc;

/// Writes fresh superblocks to `devices`, making them one new, empty array.
pub fn format(
    devices: &[Arc<dyn BlockDevice>],
    params: &FormatParams,
    array_uuid: [u8; 16],
    device_uuids: &[[u8; 16]],
    created_unix: u64,
) -> Result<Superblock, EngineError> {
    let invalid = |m: String| Err(EngineError::Invalid(m));
    if devices.is_empty() {
        return invalid("an array needs at least one device".into());
    }
    if devices.len() > MAX_DEVICES {
        return invalid(format!("an array holds at most {MAX_DEVICES} devices"));
    }
    let parity = crate::geometry::layout_parity(params.layout);
    let min_devices = match params.layout {
        Layout::Jbod | Layout::Said0 => 1,
        Layout::Said5 => 3,
        Layout::Said6 => 4,
    };
    if params.cache_devices > 0 {
        if params.layout != Layout::Jbod {
            return invalid(format!(
                "a cache tier is built in front of a jbod capacity tier only (not {}) in this version",
                params.layout.name()
            ));
        }
        if params.cache_devices > 3 {
            return invalid(format!(
                "a cache tier is one device or a mirror of 2 or 3, not {}",
                params.cache_devices
            ));
        }
        if devices.len() <= params.cache_devices {
            return invalid("a cache tier needs at least one capacity device behind it".into());
        }
    }
    let capacity_devices = devices.len() - params.cache_devices;
    if capacity_devices < min_devices {
        return invalid(format!(
            "layout {} needs at least {min_devices} devices, {} given",
            params.layout.name(),
            devices.len()
        ));
    }
    let devices: Vec<Arc<dyn BlockDevice>> = devices
        .iter()
        .map(|d| lamina_device::zonehost::host(d.clone()))
        .collect();
    let devices = &devices[..];
    let mut params = params.clone();
    // Zoned devices: a segment (a striped layout's chunk) is one zone, and the
    // superblocks live in the conventional zones before the first sequential one.
    // A cache tier in front of them is conventional (it takes writes anywhere)
    // and is cut into segments of the same size, after the same offset.
    let (capacity, cache) = devices.split_at(capacity_devices);
    let zones = zoned_layout(capacity)?;
    if let Some(d) = cache.iter().find(|d| d.zone_layout().is_some()) {
        return invalid(format!(
            "cache device {} is zoned: a cache tier takes writes anywhere (a conventional SSD, Optane or a file)",
            d.describe()
        ));
    }
    let data_offset = match zones {
        Some(l) => {
            params.segment_blocks = (l.zone_bytes / BLOCK_SIZE_U64) as u32;
            // Conventional zones past the superblocks' megabyte hold segments of
            // their own (SALSA 3.2: the metadata stream's small writes go there)
            // when they are as large as the sequential ones (JBOD).
            let first = DEFAULT_DATA_OFFSET.next_multiple_of(l.zone_bytes);
            if params.layout == Layout::Jbod
                && first < l.conventional_bytes
                && (l.conventional_bytes - first).is_multiple_of(l.zone_bytes)
            {
                first
            } else {
                l.conventional_bytes
            }
        }
        None => DEFAULT_DATA_OFFSET,
    };
    // Striped layouts: the segment size given is each member's chunk; a segment
    // (stripe) holds k chunks of data, and write units are whole rows of k blocks.
    let striped = params.layout != Layout::Jbod;
    let k = (devices.len() - parity) as u32;
    let chunk_blocks = params.segment_blocks;
    if striped {
        params.segment_blocks = chunk_blocks
            .checked_mul(k)
            .filter(|&b| b <= 1 << 24)
            .ok_or_else(|| EngineError::Invalid("stripe too large (at most 64 GiB)".into()))?;
        params.write_unit_blocks = (params.write_unit_blocks / k * k).max(2 * k);
    }
    let params = &params;
    if params.name.is_empty() || params.name.len() > MAX_NAME_LEN {
        return invalid(format!("array name must be 1 to {MAX_NAME_LEN} bytes"));
    }
    if !(0.0..=10.0).contains(&params.overprovision) || params.overprovision.is_nan() {
        return invalid(format!(
            "over-provisioning {} must be between 0 and 10 (spare / user)",
            params.overprovision
        ));
    }
    if params.write_unit_blocks < 2 || params.write_unit_blocks > 4096 {
        return invalid(format!(
            "write unit of {} blocks must be 8 KiB to 16 MiB",
            params.write_unit_blocks
        ));
    }
    let summary = lamina_format::summary::summary_blocks(params.segment_blocks);
    if params.segment_blocks < 4 * params.write_unit_blocks.max(8)
        || params.segment_blocks < summary + params.write_unit_blocks
    {
        return invalid(format!(
            "segment of {} blocks is too small for write units of {} blocks (need at least 4 units per segment)",
            params.segment_blocks, params.write_unit_blocks
        ));
    }
    if !params.force {
        for d in devices {
            if let Some(sb) = label_of(&**d) {
                return invalid(format!(
                    "device {} already belongs to Lamina array {:?}; refusing to overwrite it",
                    d.describe(),
                    sb.array_name
                ));
            }
        }
    }
    let mut entries = Vec::new();
    let mut first = 0u32;
    // Striped: every member holds one chunk of each stripe, so the smallest member
    // decides how many stripes there are.
    let stripes = devices
        .iter()
        .map(|d| Geometry::segments_on_device(d.size_bytes(), data_offset, chunk_blocks))
        .min()
        .unwrap_or(0);
    // A mirrored cache tier: every cache member holds every cache segment, as many
    // as the smallest of them holds, numbered after the capacity tier's.
    let cache_segments = devices[capacity_devices..]
        .iter()
        .map(|d| Geometry::segments_on_device(d.size_bytes(), data_offset, params.segment_blocks))
        .min()
        .unwrap_or(0);
    for (i, d) in devices.iter().enumerate() {
        let size = d.size_bytes();
        let segs = if striped {
            stripes
        } else {
            Geometry::segments_on_device(size, data_offset, params.segment_blocks)
        };
        if segs == 0 {
            return invalid(format!(
                "device {} ({} bytes) is too small for one segment of {} bytes",
                d.describe(),
                size,
                chunk_blocks as u64 * BLOCK_SIZE_U64
            ));
        }
        let segs = if i >= capacity_devices {
            cache_segments
        } else {
            segs
        };
        entries.push(DeviceEntry {
            uuid: device_uuids[i],
            size_bytes: size,
            segment_count: segs,
            first_segment: if striped { 0 } else { first },
            state: 0,
            rebuild_cursor: 0,
            tier: if i >= capacity_devices {
                TIER_CACHE
            } else {
                TIER_CAPACITY
            },
        });
        // The cache members after the first mirror it: same segments.
        if i < capacity_devices {
            first = first
                .checked_add(segs)
                .ok_or_else(|| EngineError::Invalid("array too large".into()))?;
        }
    }
    if striped {
        first = stripes;
    }
    if params.cache_devices > 0 {
        let cache = cache_segments;
        first = first
            .checked_add(cache)
            .ok_or_else(|| EngineError::Invalid("array too large".into()))?;
        if cache < MIN_CACHE_SEGMENTS || first - cache < MIN_SEGMENTS {
            return invalid(format!(
                "a cache tier of {cache} segments in front of {} is too small: need at least \
                 {MIN_CACHE_SEGMENTS} segments of {} bytes in the cache and {MIN_SEGMENTS} behind it",
                first - cache,
                params.segment_blocks as u64 * BLOCK_SIZE_U64
            ));
        }
    }
    if first < MIN_SEGMENTS {
        return invalid(format!(
            "array of {first} segments is too small: need at least {MIN_SEGMENTS} segments of {} bytes",
            params.segment_blocks as u64 * BLOCK_SIZE_U64
        ));
    }
    if first as u64 * params.segment_blocks as u64 >= crate::map::PBA_LIMIT as u64 {
        return invalid("array exceeds 16 TiB, the limit of 32-bit block addresses".into());
    }
    let sb = Superblock {
        array_uuid,
        array_name: params.name.clone(),
        generation: 1,
        device_index: 0,
        layout: params.layout,
        block_size: BLOCK_SIZE as u32,
        segment_blocks: params.segment_blocks,
        write_unit_blocks: params.write_unit_blocks,
        overprovision_ppm: (params.overprovision * 1e6).round() as u32,
        data_offset,
        created_unix,
        version_reserved: 1,
        checkpoint: None,
        devices: entries,
        shared_blocks: false,
    };
    if zones.is_some() {
        // Start from empty zones: whatever an earlier user left would hold zones
        // open against the device's limits.
        for d in capacity {
            empty_zones(&**d)?;
        }
    }
    if params.discard {
        // Only now: the devices were checked for another array's superblock above,
        // and everything about the new one is known to be right. Zoned devices
        // were emptied instead.
        let conventional = if zones.is_some() { cache } else { devices };
        discard_all(conventional, data_offset, params.progress.as_ref());
    }
    for off in SUPERBLOCK_OFFSETS {
        for (i, d) in devices.iter().enumerate() {
            let mut s = sb.clone();
            s.device_index = i as u32;
            d.write_at(&s.encode()[..], off)?;
        }
        for d in devices {
            d.sync()?;
        }
    }
    Ok(sb)
}

/// Resets every sequential zone of `d` that holds anything. Offline and read-only
/// zones are left as they are: the engine sets their segments aside when it fails
/// to reset them.
pub(crate) fn empty_zones(d: &dyn BlockDevice) -> Result<(), EngineError> {
    for z in d.report_zones()? {
        if z.ty == ZoneType::SequentialRequired
            && !matches!(
                z.cond,
                ZoneCond::Empty | ZoneCond::Offline | ZoneCond::ReadOnly
            )
        {
            d.reset_zone(z.start)?;
        }
    }
    Ok(())
}

/// The zone layout shared by the devices of a new array, if they are zoned; an
/// error says why a set of devices cannot make one.
pub(super) fn zoned_layout(
    devices: &[Arc<dyn BlockDevice>],
) -> Result<Option<lamina_device::ZoneLayout>, EngineError> {
    let invalid = |m: String| Err(EngineError::Invalid(m));
    let layouts: Vec<_> = devices.iter().map(|d| d.zone_layout()).collect();
    let Some(first) = layouts.iter().flatten().next().copied() else {
        return Ok(None);
    };
    for (d, l) in devices.iter().zip(&layouts) {
        let Some(l) = l else {
            return invalid(format!(
                "{} is not zoned but other devices are: an array is all zoned or not at all",
                d.describe()
            ));
        };
        if l.zone_bytes != first.zone_bytes || l.conventional_bytes != first.conventional_bytes {
            return invalid(format!(
                "{} has zones of {} bytes after {} conventional bytes, unlike {} ({} after {}): zoned members must match",
                d.describe(),
                l.zone_bytes,
                l.conventional_bytes,
                devices[0].describe(),
                first.zone_bytes,
                first.conventional_bytes
            ));
        }
        if !l.zone_bytes.is_multiple_of(BLOCK_SIZE_U64)
            || !l.conventional_bytes.is_multiple_of(BLOCK_SIZE_U64)
        {
            return invalid(format!(
                "{} has zones of {} bytes after {} conventional bytes: Lamina needs multiples of 4 KiB",
                d.describe(),
                l.zone_bytes,
                l.conventional_bytes
            ));
        }
        if l.conventional_bytes < DEFAULT_DATA_OFFSET {
            return invalid(format!(
                "{} has {} bytes of conventional zones; Lamina rewrites its superblocks in place in the first {} bytes, which must be conventional",
                d.describe(),
                l.conventional_bytes,
                DEFAULT_DATA_OFFSET
            ));
        }
        if l.open_limit() != 0 && l.open_limit() < 4 {
            return invalid(format!(
                "{} lets only {} zones be open at once; Lamina needs at least 4 (metadata, one user and one GC stream, and one closing)",
                d.describe(),
                l.open_limit()
            ));
        }
    }
    Ok(Some(first))
}

/// A Lamina superblock on `d` (either copy), if it has one.
pub fn label_of(d: &dyn BlockDevice) -> Option<Superblock> {
    SUPERBLOCK_OFFSETS.iter().find_map(|&off| {
        let mut b = vec![0u8; BLOCK_SIZE];
        d.read_at(&mut b, off).ok()?;
        Superblock::decode(&b).ok()
    })
}

/// Discards the data areas of `devices`, telling `progress` the bytes done over
/// all of them.
pub(super) fn discard_all(
    devices: &[Arc<dyn BlockDevice>],
    data_offset: u64,
    progress: Option<&super::Progress>,
) {
    let total: u64 = devices
        .iter()
        .map(|d| d.size_bytes().saturating_sub(data_offset))
        .sum();
    let mut done = 0;
    for d in devices {
        discard_data_area(&**d, data_offset, &mut |n| {
            done += n;
            if let Some(p) = progress {
                (p.0)(done, total);
            }
        });
    }
}

/// Discards `[data_offset, end)` of `d` in pieces of 1 GiB (a device-wide discard
/// of a large SSD can take long in one call). Advisory, as on mkfs: a device that
/// does not take it is left as it is, with a warning.
/// `advanced` is told the bytes of each piece as it goes (and the rest at once
/// when the device refuses, so that progress still reaches the total).
fn discard_data_area(d: &dyn BlockDevice, data_offset: u64, advanced: &mut dyn FnMut(u64)) {
    const PIECE: u64 = 1 << 30;
    let end = d.size_bytes();
    let mut at = data_offset;
    while at < end {
        let len = PIECE.min(end - at);
        if let Err(e) = d.discard(at, len) {
            tracing::warn!(
                "{}: discard at array creation failed ({e}); its old contents stay",
                d.describe()
            );
            advanced(end - at);
            return;
        }
        at += len;
        advanced(len);
    }
}

#[cfg(test)]
mod tests {
    use super::super::{testing, Progress};
    use super::*;
    use crate::types::BLOCK_SIZE;
    use lamina_device::mem::MemDevice;
    use std::sync::{Arc, Mutex};

    /// The discard at creation tells its progress over every member, rising to
    /// the members' data areas in all.
    #[test]
    fn the_discard_at_creation_reports_progress_to_the_total() {
        let size = (1 << 20) + 40 * 64 * BLOCK_SIZE as u64;
        let devices: Vec<Arc<dyn BlockDevice>> = (0..2)
            .map(|i| Arc::new(MemDevice::new(format!("mem{i}"), size)) as Arc<dyn BlockDevice>)
            .collect();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = seen.clone();
        let params = FormatParams {
            discard: true,
            progress: Some(Progress(Arc::new(move |d, t| {
                s.lock().unwrap().push((d, t))
            }))),
            ..testing::params()
        };
        format(&devices, &params, [7; 16], &[[1; 16], [2; 16]], 0).unwrap();
        let seen = seen.lock().unwrap();
        let total = seen.last().unwrap().1;
        assert_eq!(seen.last().unwrap().0, total, "{seen:?}");
        assert!(total > size && total < 2 * size, "{total}");
        assert!(seen.windows(2).all(|w| w[0].0 <= w[1].0), "{seen:?}");
    }
}
