//! Creating an array, and opening one: superblocks, checkpoint, replay.
//!
//! Opening reads the superblocks of every device, loads the checkpoint they name, and
//! then finds every unit written after the checkpoint's version `C`:
//!
//! 1. the stream heads recorded in the checkpoint, from their write pointers;
//! 2. the free queue recorded in the checkpoint, in order: segments are allocated in
//!    exactly that order, so the walk stops after a run of empty segments longer than
//!    the number of streams (only stream heads can be allocated and still empty);
//! 3. segments released after `C` (release records found in the walk), in the order
//!    of their release records, which is the order the engine appended them.
//!
//! Units above the highest durability mark found may be torn; their data checksums
//! are verified and failing blocks ignored. Replay then applies block records (by
//! unit version) and trims (by trim version) in version order. Everything recovery
//! needs comes from the devices; nothing is read from the configuration directory.

use crate::engine::{Counters, Engine, EngineConfig, Seg, SegState, Token, VERSION_LEASE};
use crate::error::EngineError;
use crate::geometry::Geometry;
use crate::io::execute;
use crate::map::{encode_device, BAD, UNMAPPED};
use crate::segments::{Origins, ORIGIN_SLOTS};
use crate::shared::{Shared, VolumeShared};
use crate::types::{SegmentId, VolumeId, BLOCK_SIZE, BLOCK_SIZE_U64};
use lamina_device::zoned::{ZoneCond, ZoneType};
use lamina_device::BlockDevice;
use lamina_format::checkpoint::{
    CheckpointHeader, CheckpointMeta, SegmentState, VolumeRecord, MAP_ENTRIES_PER_PAGE,
};
use lamina_format::summary::SummaryHeader;
use lamina_format::superblock::{
    CheckpointRef, DeviceEntry, Layout, Superblock, DEFAULT_DATA_OFFSET, MAX_DEVICES, MAX_NAME_LEN,
    SUPERBLOCK_OFFSETS,
};
use lamina_format::unit::{kind, record_at, RawRecord, StreamKind, UnitHeader, NO_SEGMENT};
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Fewest segments an array may have: stream heads, GC reserve and checkpoint space
/// need room to turn over.
pub const MIN_SEGMENTS: u32 = 16;

/// Parameters of a new array.
#[derive(Clone, Debug)]
pub struct FormatParams {
    pub name: String,
    pub layout: Layout,
    pub segment_blocks: u32,
    pub write_unit_blocks: u32,
    /// Spare space as a fraction of user space (0.10 = 10%).
    pub overprovision: f64,
    /// Overwrite devices that already hold a Lamina superblock.
    pub force: bool,
}

impl Default for FormatParams {
    fn default() -> Self {
        FormatParams {
            name: "lamina".into(),
            layout: Layout::Jbod,
            segment_blocks: 2048,
            write_unit_blocks: 128,
            overprovision: 0.10,
            force: false,
        }
    }
}

/// How to open an array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Recover, make the result durable, and accept writes.
    ReadWrite,
    /// Recover in memory only (inspecting a stopped array); nothing is written.
    ReadOnly,
}

/// What recovery found and did.
#[derive(Clone, Debug, Default)]
pub struct RecoveryReport {
    pub checkpoint_generation: u64,
    pub checkpoint_version: u64,
    pub checkpoint_blocks: u64,
    pub segments_scanned: u64,
    pub units_replayed: u64,
    pub blocks_replayed: u64,
    pub trims_replayed: u64,
    pub releases_seen: u64,
    pub torn_blocks_ignored: u64,
    /// Unit headers that failed as read and were rebuilt from parity.
    pub headers_rebuilt: u64,
    /// Data blocks of units written after the last durable point that failed their
    /// checksums as read and were rebuilt from parity (and, read-write, written
    /// back) rather than taken for torn writes.
    pub blocks_rebuilt: u64,
    /// Parity resync of the rows written after the last durable point (striped
    /// layouts with parity): rows checked, rows whose parity did not match, and rows
    /// left unprotected (sent to GC to be moved).
    pub resync_rows: u64,
    pub resync_mismatched: u64,
    pub resync_unprotected: u64,
    /// Segments moved at open because they held such unprotected rows.
    pub resync_relocated_segments: u64,
    pub bytes_read: u64,
    pub warnings: Vec<String>,
}

fn read_blocks(
    shared: &Shared,
    report: &mut RecoveryReport,
    seg: u32,
    offset: u32,
    blocks: u32,
) -> Result<Vec<u8>, EngineError> {
    let (dev, off) = shared.geo.locate(SegmentId(seg), offset);
    let mut buf = vec![0u8; blocks as usize * BLOCK_SIZE];
    shared.devices[dev].read_at(&mut buf, off)?;
    report.bytes_read += buf.len() as u64;
    Ok(buf)
}

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
    if devices.len() < min_devices {
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
    let zones = zoned_layout(devices)?;
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
            for off in SUPERBLOCK_OFFSETS {
                let mut b = vec![0u8; BLOCK_SIZE];
                if d.read_at(&mut b, off).is_ok() {
                    if let Ok(sb) = Superblock::decode(&b) {
                        return invalid(format!(
                            "device {} already belongs to Lamina array {:?}; refusing to overwrite it",
                            d.describe(),
                            sb.array_name
                        ));
                    }
                }
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
        entries.push(DeviceEntry {
            uuid: device_uuids[i],
            size_bytes: size,
            segment_count: segs,
            first_segment: if striped { 0 } else { first },
            state: 0,
            rebuild_cursor: 0,
        });
        first = first
            .checked_add(segs)
            .ok_or_else(|| EngineError::Invalid("array too large".into()))?;
    }
    if striped {
        first = stripes;
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
    };
    if zones.is_some() {
        // Start from empty zones: whatever an earlier user left would hold zones
        // open against the device's limits.
        for d in devices {
            empty_zones(&**d)?;
        }
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
fn zoned_layout(
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
    let mut ordered: Vec<Option<Arc<dyn BlockDevice>>> = vec![None; newest.devices.len()];
    // A striped array with parity may run without some members: a member whose
    // superblock cannot be read is treated as missing (its slot gets an absent
    // device) as long as the layout tolerates it.
    let tolerated = crate::geometry::layout_parity(newest.layout);
    if unreadable.len() > tolerated {
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
        // the newest table holds the replacement's identity.
        if tolerated > 0
            && i < newest.devices.len()
            && sb.devices.get(i).map(|e| e.uuid) != Some(newest.devices[i].uuid)
        {
            warnings.push(format!(
                "{} was member {i} of {:?} but has been replaced; ignored",
                d.describe(),
                newest.array_name
            ));
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
    let missing: Vec<usize> = (0..ordered.len())
        .filter(|&i| ordered[i].is_none())
        .collect();
    if !missing.is_empty() && missing.len() <= tolerated {
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
        return Err(EngineError::Invalid(format!(
            "array {:?} has {} devices; members {missing:?} were not given",
            newest.array_name,
            ordered.len()
        )));
    }
    Ok((newest, ordered.into_iter().map(|d| d.unwrap()).collect()))
}

/// Member state in the superblock: the member failed and holds nothing current.
pub const MEMBER_FAILED: u32 = 1;
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
    if sb.layout == Layout::Jbod {
        return Ok((
            members.into_iter().map(plug).collect::<Result<_, _>>()?,
            None,
        ));
    }
    let failed: Vec<bool> = sb
        .devices
        .iter()
        .zip(&members)
        .map(|(e, d)| e.state == MEMBER_FAILED || d.size_bytes() == 0)
        .collect();
    for (i, f) in failed.iter().enumerate() {
        if *f {
            warnings.push(format!(
                "member {i} ({}) is failed or missing: the array runs degraded",
                members[i].describe()
            ));
        }
    }
    let shape = StripeShape {
        data: geo.row_blocks as usize,
        parity: geo.parity,
        chunk_blocks: (geo.segment_blocks / geo.row_blocks) as u64,
        data_offset: geo.data_offset,
        stripes: geo.segment_count as u64,
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
            geo.parity
        ));
    }
    for (i, e) in sb.devices.iter().enumerate() {
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
                "member {i} ({}) is being rebuilt: {} of {} stripes done",
                members[i].describe(),
                e.rebuild_cursor,
                geo.segment_count
            ));
        }
    }
    // Superblocks and syncs reach members through their slots, so that they follow
    // a replacement.
    let mut devices: Vec<Arc<dyn BlockDevice>> = (0..members.len())
        .map(|index| {
            Arc::new(lamina_device::striped::MemberSlot {
                array: striped.clone(),
                index,
            }) as Arc<dyn BlockDevice>
        })
        .collect();
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

/// Reads and decodes the unit header at `offset` of `seg` that `accept` takes (the
/// caller's identity checks: array, segment, offset, incarnation, version). On a
/// layout with parity, a header that does not decode as read, or decodes but is
/// not the one expected there (a stale header left by a write the member dropped or
/// stored elsewhere), is read again with each member rebuilt from the others in
/// turn: a header damaged on one member must not end the walk of a segment whose
/// later units were flushed. The flag says the header was rebuilt.
fn read_unit_header(
    shared: &Shared,
    report: &mut RecoveryReport,
    seg: u32,
    offset: u32,
    h: u32,
    accept: impl Fn(&UnitHeader) -> bool,
) -> Option<(Vec<u8>, UnitHeader, bool)> {
    if let Ok(buf) = read_blocks(shared, report, seg, offset, h) {
        if let Ok(u) = UnitHeader::decode(&buf) {
            if accept(&u) {
                return Some((buf, u, false));
            }
        }
    }
    let st = shared.striped.as_ref().filter(|st| st.shape().parity > 0)?;
    let (_, off) = shared.geo.locate(SegmentId(seg), offset);
    let mut buf = vec![0u8; h as usize * BLOCK_SIZE];
    for m in 0..st.shape().members() {
        if st.read_without(&mut buf, off, m).is_ok() {
            if let Ok(u) = UnitHeader::decode(&buf) {
                if accept(&u) {
                    report.headers_rebuilt += 1;
                    st.note_bad_block(m, off);
                    return Some((buf, u, true));
                }
            }
        }
    }
    None
}

/// One unit found by the walk.
struct FoundUnit {
    offset: u32,
    header_blocks: u32,
    data_blocks: u32,
    version: u64,
    durable_version: u64,
    run_start: u64,
    /// The volume's time at the unit's opening and seal and, for GC units, the
    /// mean origin of its blocks ([`UnitHeader::opened_time`],
    /// [`UnitHeader::volume_time`], [`UnitHeader::origin`]).
    opened_time: u64,
    volume_time: u64,
    origin: u64,
    records: Vec<RawRecord>,
    /// The header as rebuilt from parity, when it did not decode as read (or was
    /// not the one expected there).
    rebuilt: Option<Vec<u8>>,
}

/// Each volume's time (user blocks written to it) at the units recovery replays,
/// for the segment ages GC and placement read. Units record the volume's time at
/// their seal ([`UnitHeader::volume_time`]). Units written before they did (0
/// there) are dated by counting: the volume's count in the checkpoint plus the
/// user blocks of its replayed units with lower versions, which falls short when
/// segments written since the checkpoint were collected before the crash.
struct VolumeClocks {
    /// Per volume: (version, time before the unit) of each replayed user unit in
    /// version order, and the volume's time after everything replayed.
    clocks: HashMap<u16, (Vec<(u64, u64)>, u64)>,
}

impl VolumeClocks {
    fn new<'a>(
        volumes: &[(Arc<VolumeShared>, VolumeRecord)],
        units: impl Iterator<Item = (u16, StreamKind, &'a FoundUnit)>,
    ) -> Self {
        let mut clocks: HashMap<u16, (Vec<(u64, u64)>, u64)> = volumes
            .iter()
            .map(|(v, rec)| (v.id.0, (Vec::new(), rec.user_blocks_written)))
            .collect();
        let mut recorded: HashMap<u16, u64> = HashMap::new();
        for (volume, kind, u) in units {
            if let Some(c) = clocks.get_mut(&volume) {
                if kind == StreamKind::User {
                    c.0.push((u.version, u.data_blocks as u64));
                }
                let r = recorded.entry(volume).or_default();
                *r = (*r).max(u.volume_time);
            }
        }
        for (volume, (units, t)) in clocks.iter_mut() {
            units.sort_unstable_by_key(|u| u.0);
            for u in units.iter_mut() {
                let blocks = u.1;
                u.1 = *t;
                *t += blocks;
            }
            *t = (*t).max(recorded.get(volume).copied().unwrap_or(0));
        }
        VolumeClocks { clocks }
    }

    /// The volume's time when unit `u` was opened: as recorded, or else counted.
    fn before(&self, volume: u16, u: &FoundUnit) -> u64 {
        if u.volume_time != 0 {
            return u.opened_time;
        }
        self.clocks.get(&volume).map_or(0, |(units, end)| {
            units
                .get(units.partition_point(|c| c.0 < u.version))
                .map_or(*end, |c| c.1)
        })
    }

    /// The volume's time when unit `u` was sealed.
    fn after(&self, volume: u16, kind: StreamKind, u: &FoundUnit) -> u64 {
        if u.volume_time != 0 {
            return u.volume_time;
        }
        self.before(volume, u)
            + if kind == StreamKind::User {
                u.data_blocks as u64
            } else {
                0
            }
    }

    /// The volume's time after every replayed unit.
    fn end(&self, volume: u16) -> u64 {
        self.clocks.get(&volume).map_or(0, |c| c.1)
    }
}

/// One segment incarnation found by the walk.
struct Found {
    seg: u32,
    incarnation: u64,
    kind: StreamKind,
    class: u8,
    volume: u16,
    /// Where the walk started (non-zero for stream heads continuing a segment).
    start: u32,
    units: Vec<FoundUnit>,
    end: u32,
    has_summary: bool,
}

/// Scans units of `seg` from `start`. `expect` is the incarnation when known;
/// otherwise the first unit sets it and it must exceed `min_version`.
fn scan_segment(
    shared: &Shared,
    report: &mut RecoveryReport,
    seg: u32,
    start: u32,
    expect: Option<u64>,
    min_version: u64,
) -> Option<Found> {
    let geo = &shared.geo;
    let h = geo.header_blocks as u32;
    let mut offset = start;
    let mut prev = min_version;
    let mut incarnation = expect;
    let mut units = Vec::new();
    let mut meta = (StreamKind::User, 0u8, 0u16);
    report.segments_scanned += 1;
    while offset + h <= geo.data_end {
        let expected = |u: &UnitHeader| {
            let inc_ok = match incarnation {
                Some(i) => u.incarnation == i,
                None => u.incarnation > min_version,
            };
            u.array_id == geo.array_id
                && u.segment == seg
                && u.offset == offset
                && inc_ok
                && u.version > prev
                && u.header_blocks as u32 == h
                && offset + u.total_blocks() <= geo.data_end
        };
        let Some((buf, u, rebuilt)) = read_unit_header(shared, report, seg, offset, h, expected)
        else {
            break;
        };
        incarnation = Some(u.incarnation);
        meta = (u.stream_kind, u.stream_class, u.volume);
        let records = (0..u.record_count as usize)
            .map(|i| record_at(&buf, i))
            .collect();
        units.push(FoundUnit {
            offset,
            header_blocks: h,
            data_blocks: u.data_blocks,
            version: u.version,
            durable_version: u.durable_version,
            run_start: u.run_start,
            opened_time: u.opened_time,
            volume_time: u.volume_time,
            origin: u.origin,
            rebuilt: rebuilt.then(|| buf.clone()),
            records,
        });
        prev = u.version;
        offset += u.total_blocks();
    }
    if units.is_empty() && start == 0 {
        return None;
    }
    let incarnation = incarnation?;
    let mut has_summary = false;
    if offset + geo.round_to_row(h + 1) > geo.data_end && meta.0 != StreamKind::Meta {
        if let Ok(buf) = read_blocks(shared, report, seg, geo.data_end, geo.summary_blocks) {
            has_summary = SummaryHeader::decode(&buf).is_ok_and(|s| {
                s.segment == seg && s.incarnation == incarnation && s.array_id == geo.array_id
            });
        }
    }
    Some(Found {
        seg,
        incarnation,
        kind: meta.0,
        class: meta.1,
        volume: meta.2,
        start,
        units,
        end: offset,
        has_summary,
    })
}

/// Reads the checkpoint payload blocks in order, following the metadata stream.
struct CheckpointReader<'a> {
    shared: &'a Shared,
    cref: CheckpointRef,
    seg: u32,
    offset: u32,
    incarnation: Option<u64>,
    next_index: u64,
    queue: VecDeque<Vec<u8>>,
    visited: HashSet<u32>,
    last_next_segment: u32,
}

impl<'a> CheckpointReader<'a> {
    fn new(shared: &'a Shared, cref: CheckpointRef) -> Self {
        CheckpointReader {
            shared,
            cref,
            seg: cref.first_segment,
            offset: 0,
            incarnation: Some(cref.first_incarnation),
            next_index: 0,
            queue: VecDeque::new(),
            visited: HashSet::from([cref.first_segment]),
            last_next_segment: NO_SEGMENT,
        }
    }

    fn next_block(&mut self, report: &mut RecoveryReport) -> Result<Vec<u8>, EngineError> {
        let damaged = |m: String| {
            EngineError::Format(format!(
                "checkpoint generation {}: {m}",
                self.cref.generation
            ))
        };
        while self.queue.is_empty() {
            let geo = &self.shared.geo;
            let h = geo.header_blocks as u32;
            let (seg, offset, incarnation) = (self.seg, self.offset, self.incarnation);
            let min = self.cref.version;
            let usable = if offset + h <= geo.data_end {
                read_unit_header(self.shared, report, seg, offset, h, |u| {
                    u.array_id == geo.array_id
                        && u.segment == seg
                        && u.offset == offset
                        && u.stream_kind == StreamKind::Meta
                        && incarnation.is_none_or(|i| u.incarnation == i)
                        && u.incarnation > min
                })
                .map(|(b, u, _)| (u, b))
            } else {
                None
            };
            let Some((u, hbuf)) = usable else {
                // End of this segment: continue where its units said the stream goes.
                let next = self.last_next_segment;
                if next == NO_SEGMENT || !self.visited.insert(next) {
                    return Err(damaged(format!(
                        "payload ends after {} of {} blocks",
                        self.next_index, self.cref.payload_blocks
                    )));
                }
                self.seg = next;
                self.offset = 0;
                self.incarnation = None;
                continue;
            };
            self.incarnation = Some(u.incarnation);
            self.last_next_segment = u.next_segment;
            let data = if u.data_blocks > 0 {
                read_blocks(
                    self.shared,
                    report,
                    self.seg,
                    self.offset + h,
                    u.data_blocks,
                )?
            } else {
                Vec::new()
            };
            for i in 0..u.data_blocks as usize {
                let r = record_at(&hbuf, i);
                if r.kind != kind::CHECKPOINT
                    || r.c != self.cref.generation as u16
                    || u.version <= self.cref.version
                {
                    continue;
                }
                let mut block = data[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].to_vec();
                if r.a != self.next_index + self.queue.len() as u64 {
                    return Err(damaged(format!(
                        "block {} found where {} was expected",
                        r.a, self.next_index
                    )));
                }
                if lamina_format::crc32c(&block) != r.b {
                    let at = self.offset + h + i as u32;
                    block = self
                        .shared
                        .rebuild_block(SegmentId(self.seg), at, r.b)
                        .ok_or_else(|| {
                            damaged(format!("payload block {} fails its checksum", r.a))
                        })?;
                }
                self.queue.push_back(block);
            }
            self.offset += u.total_blocks();
        }
        self.next_index += 1;
        Ok(self.queue.pop_front().unwrap())
    }
}

/// Like [`open`], but in read-write mode the checkpoint of the recovered state is
/// only submitted (with [`RECOVERY_TOKEN`]): the caller must drive the engine's I/O
/// until that reply arrives before serving. Tests use this to crash in the middle of
/// it.
pub fn open_unfinished(
    devices: Vec<Arc<dyn BlockDevice>>,
    cfg: EngineConfig,
    mode: OpenMode,
) -> Result<(Engine, RecoveryReport), EngineError> {
    let mut report = RecoveryReport::default();
    let devices: Vec<Arc<dyn BlockDevice>> = devices
        .into_iter()
        .map(lamina_device::zonehost::host)
        .collect();
    // What a killed process left in the page cache is not yet durable; make it so
    // before building on it. A member that cannot sync is failed (striped layouts
    // run without it; JBOD cannot).
    let mut sync_failed = Vec::new();
    if mode == OpenMode::ReadWrite {
        for d in &devices {
            if let Err(e) = d.sync() {
                sync_failed.push((d.describe(), e));
            }
        }
    }
    let (sb, devices) = read_superblocks(devices, &mut report.warnings)?;
    let geo = Geometry::from_superblock(&sb);
    let (devices, striped) = data_path(
        &sb,
        &geo,
        devices,
        mode == OpenMode::ReadWrite,
        &mut report.warnings,
    )?;
    for (name, e) in sync_failed {
        let member = devices[..geo.members]
            .iter()
            .position(|d| d.describe() == name);
        match (&striped, member) {
            (Some(st), Some(i)) => {
                report.warnings.push(format!("{e}: member {i} failed"));
                st.fail_member(i);
            }
            // A device that is not a member any more (unreadable, replaced): it is
            // already out of the array.
            (Some(_), None) => report.warnings.push(format!("{e} (not in use)")),
            _ => return Err(e.into()),
        }
    }
    if striped.as_ref().is_some_and(|st| st.redundancy_left() < 0) && mode == OpenMode::ReadWrite {
        return Err(EngineError::Invalid(format!(
            "more members failed than the layout's {} parity tolerates; open read-only to read what can be rebuilt",
            geo.parity
        )));
    }
    let shared = Arc::new(Shared::new(
        geo.clone(),
        devices,
        striped,
        cfg.buffer_units,
        cfg.header_cache_bytes,
    ));
    let nsegs = geo.segment_count as usize;

    // ---- checkpoint
    let (c_version, meta, ckpt_gen, volumes) = match sb.checkpoint {
        None => (
            0u64,
            CheckpointMeta {
                free_queue: (0..geo.segment_count).collect(),
                segments: Vec::new(),
                ..Default::default()
            },
            0u64,
            Vec::new(),
        ),
        Some(cref) => {
            let mut rd = CheckpointReader::new(&shared, cref);
            let block0 = rd.next_block(&mut report)?;
            if lamina_format::crc32c(&block0) != cref.root_crc {
                return Err(EngineError::Format(format!(
                    "checkpoint generation {}: header does not match the superblock",
                    cref.generation
                )));
            }
            let hdr = CheckpointHeader::decode(&block0)?;
            if hdr.generation != cref.generation
                || hdr.start_version != cref.version
                || hdr.payload_blocks != cref.payload_blocks
            {
                return Err(EngineError::Format(
                    "checkpoint header disagrees with the superblock".into(),
                ));
            }
            let mut meta_bytes = Vec::with_capacity(hdr.meta_bytes as usize);
            for _ in 0..hdr.meta_blocks() {
                meta_bytes.extend_from_slice(&rd.next_block(&mut report)?);
            }
            meta_bytes.truncate(hdr.meta_bytes as usize);
            if lamina_format::crc32c(&meta_bytes) != hdr.meta_crc {
                return Err(EngineError::Format(
                    "checkpoint metadata fails its checksum".into(),
                ));
            }
            let meta = CheckpointMeta::decode(&meta_bytes)?;
            for s in &meta.skipped {
                report.warnings.push(format!("checkpoint: {s}"));
            }
            if meta.segments.len() != nsegs {
                return Err(EngineError::Format(format!(
                    "checkpoint lists {} segments, the array has {nsegs}",
                    meta.segments.len()
                )));
            }
            let limit = geo.segment_count * geo.segment_blocks;
            let mut volumes = Vec::new();
            for v in &meta.volumes {
                if v.size_bytes / BLOCK_SIZE_U64 > crate::map::MAX_BLOCKS {
                    return Err(EngineError::Format(format!(
                        "checkpoint names volume {:?} of {} bytes, beyond the 16 PiB limit",
                        v.name, v.size_bytes
                    )));
                }
                let vs = Arc::new(VolumeShared {
                    id: VolumeId(v.id),
                    name: v.name.clone(),
                    size_bytes: v.size_bytes,
                    map: shared.new_map(v.size_bytes / BLOCK_SIZE_U64),
                    deleted: AtomicBool::new(false),
                });
                for &page in &v.pages {
                    let block = rd.next_block(&mut report)?;
                    for i in 0..MAP_ENTRIES_PER_PAGE {
                        let lba = page as u64 * MAP_ENTRIES_PER_PAGE as u64 + i as u64;
                        let e = u32::from_le_bytes(block[i * 4..i * 4 + 4].try_into().unwrap());
                        if e == UNMAPPED || lba >= vs.map.len() {
                            continue;
                        }
                        let ok = e == BAD || (e - 1) < limit;
                        if !ok {
                            return Err(EngineError::Format(format!(
                                "checkpoint maps volume {} block {lba} to an invalid place ({e:#x})",
                                v.name
                            )));
                        }
                        vs.map.store(lba, e);
                    }
                }
                volumes.push((vs, v.clone()));
            }
            report.checkpoint_generation = cref.generation;
            report.checkpoint_version = cref.version;
            report.checkpoint_blocks = cref.payload_blocks;
            (cref.version, meta, cref.generation, volumes)
        }
    };

    // ---- segment table as of the checkpoint
    let mut segs: Vec<Seg> = (0..nsegs).map(|_| Seg::free(0)).collect();
    for (i, r) in meta.segments.iter().enumerate() {
        let s = &mut segs[i];
        s.erase_count = r.erase_count;
        s.incarnation = r.incarnation;
        s.write_ptr = r.write_ptr;
        s.data_blocks = r.data_blocks;
        s.close_version = r.close_version;
        s.has_summary = r.has_summary != 0;
        s.volume = r.volume;
        s.class = r.stream_class;
        s.kind = StreamKind::from_u8(r.stream_kind).unwrap_or(StreamKind::User);
        s.state = match r.state {
            SegmentState::Free => SegState::Free,
            SegmentState::Open | SegmentState::Closed => SegState::Closed,
            SegmentState::Checkpoint => SegState::Meta,
        };
        // Checkpoints written before segment times were recorded have none: the
        // segments then look equally old until they are reused.
        if let Some(t) = meta.segment_times.get(i) {
            s.born = t.born;
            s.closed = t.closed;
            if r.state != SegmentState::Free {
                s.origins = Origins::for_segment(s.kind, t.born);
            }
            if let (Some(o), Some(mean)) = (&mut s.origins, t.origins) {
                o.mean = mean;
            }
            s.last_invalidated = t.closed;
        }
    }

    // ---- walk
    let mut found: Vec<Found> = Vec::new();
    let mut scanned_heads: HashSet<u32> = HashSet::new();
    for st in &meta.streams {
        if st.segment != NO_SEGMENT && (st.segment as usize) < nsegs {
            let s = &segs[st.segment as usize];
            if let Some(f) = scan_segment(
                &shared,
                &mut report,
                st.segment,
                s.write_ptr,
                Some(s.incarnation),
                c_version,
            ) {
                found.push(f);
            }
            scanned_heads.insert(st.segment);
        }
        if st.next_segment != NO_SEGMENT && (st.next_segment as usize) < nsegs {
            if let Some(f) = scan_segment(&shared, &mut report, st.next_segment, 0, None, c_version)
            {
                found.push(f);
            }
            scanned_heads.insert(st.next_segment);
        }
    }
    // Only stream heads (and the metadata stream's reserved successor) can have been
    // allocated and still be empty; a margin covers streams of volumes created after C.
    // Allocation may take any of the first `ALLOC_WINDOW` free segments (JBOD wear
    // levelling), so that many may be skipped before one that was used.
    let k_stop = meta.streams.len() + 3 + 8 + crate::engine::ALLOC_WINDOW;
    let mut empties = 0usize;
    let mut releases: BinaryHeap<Reverse<(u64, usize, u32, u64)>> = BinaryHeap::new();
    let mut released: HashSet<(u32, u64)> = HashSet::new();
    let harvest = |f: &Found,
                   heap: &mut BinaryHeap<Reverse<(u64, usize, u32, u64)>>,
                   set: &mut HashSet<(u32, u64)>| {
        for u in &f.units {
            for (i, r) in u.records.iter().enumerate().skip(u.data_blocks as usize) {
                if r.kind == kind::RELEASE {
                    heap.push(Reverse((u.version, i, r.b, r.a)));
                    set.insert((r.b, r.a));
                }
            }
        }
    };
    for f in &found {
        harvest(f, &mut releases, &mut released);
    }
    let mut walked_queue = Vec::new();
    let mut queue_iter = meta.free_queue.iter().copied();
    loop {
        if empties >= k_stop {
            break;
        }
        let (seg, min_version) = if let Some(seg) = queue_iter.next() {
            walked_queue.push(seg);
            (seg, c_version)
        } else if let Some(Reverse((version, _, seg, _))) = releases.pop() {
            (seg, version)
        } else {
            break;
        };
        if seg as usize >= nsegs {
            continue;
        }
        match scan_segment(&shared, &mut report, seg, 0, None, min_version) {
            Some(f) => {
                empties = 0;
                // A segment taken from the queue, released and reused after C is
                // met again among the releases: record each incarnation once.
                if !found
                    .iter()
                    .any(|g| g.seg == f.seg && g.incarnation == f.incarnation)
                {
                    harvest(&f, &mut releases, &mut released);
                    found.push(f);
                }
            }
            None => empties += 1,
        }
    }
    report.releases_seen = released.len() as u64;

    // ---- torn units: verify the data of units no durability mark vouches for.
    // A mark covers versions of its own run only (run_start ..= durable_version):
    // a later run never synced what an earlier, crashed run left behind.
    let mut marks: std::collections::HashMap<u64, u64> = Default::default();
    for u in found.iter().flat_map(|f| f.units.iter()) {
        let m = marks.entry(u.run_start).or_insert(0);
        *m = (*m).max(u.durable_version);
    }
    let vouched = |u: &FoundUnit| marks.get(&u.run_start).is_some_and(|&d| u.version <= d);
    // What recovery rebuilt from parity in units no durability mark vouches for
    // (headers here, data blocks below) goes back to its member before the parity
    // resync, so that the rows match their parity again; otherwise the resync would
    // make the parity match the damage and lose the only good copy. This covers a
    // flushed unit that no later unit vouches for yet, whose block a member dropped
    // or flipped, and a torn write whose header never reached its member while the
    // row's parity did (seed 21 of the SAID5 crash simulation). Zoned rows are never
    // rewritten: there the resync rewrites no parity either, and the rows go to the
    // repair list, whose relocation reads through parity. Read-only opens write
    // nothing.
    let writable = mode == OpenMode::ReadWrite;
    let write_back = shared
        .striped
        .as_ref()
        .filter(|st| writable && st.shape().parity > 0 && !st.is_zoned());
    let mut put_back: Vec<(u64, Vec<u8>)> = Vec::new();
    for f in found
        .iter()
        .filter(|f| !released.contains(&(f.seg, f.incarnation)))
    {
        for u in f.units.iter().filter(|u| !vouched(u)) {
            if let Some(h) = &u.rebuilt {
                put_back.push((geo.locate(SegmentId(f.seg), u.offset).1, h.clone()));
            }
        }
    }
    let mut torn: HashSet<(u32, u32, usize)> = HashSet::new();
    for f in &found {
        if released.contains(&(f.seg, f.incarnation)) {
            continue;
        }
        for u in f.units.iter().filter(|u| !vouched(u) && u.data_blocks > 0) {
            let first = u.offset + u.header_blocks;
            let whole = read_blocks(&shared, &mut report, f.seg, first, u.data_blocks).ok();
            for i in 0..u.data_blocks as usize {
                let r = &u.records[i];
                if r.kind != kind::DATA {
                    continue;
                }
                let block = match &whole {
                    Some(d) => d[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].to_vec(),
                    // A read error is not a tear: never fall back to an older copy
                    // because a device failed to answer. Retry the block, then refuse.
                    None => {
                        let at = first + i as u32;
                        read_blocks(&shared, &mut report, f.seg, at, 1)
                            .or_else(|_| read_blocks(&shared, &mut report, f.seg, at, 1))
                            .map_err(|e| {
                                EngineError::Io(format!(
                                    "recovery cannot read segment {} block {at} to verify it: {e}",
                                    f.seg
                                ))
                            })?
                    }
                };
                if lamina_format::crc32c(&block) != r.b {
                    let at = first + i as u32;
                    if let Some(b) = shared.rebuild_block(SegmentId(f.seg), at, r.b) {
                        put_back.push((geo.locate(SegmentId(f.seg), at).1, b));
                        report.blocks_rebuilt += 1;
                        continue;
                    }
                    torn.insert((f.seg, u.offset, i));
                    report.torn_blocks_ignored += 1;
                }
            }
        }
    }

    // ---- the write hole: rows written after the last durable point may hold new
    // data on some members and old content on others, so their parity is made to
    // match what the members hold before anything is trusted to it (docs/design.md,
    // "The write hole"). Units vouched for were synced whole, and rows are never
    // rewritten in place, so only the units checked above, and summaries (written
    // after their segment's last unit, with no mark of their own), need it.
    // Read-only opens (status, fsck, inspection) write nothing: the next read-write
    // open resyncs.
    if let Some(st) = write_back {
        for (off, data) in &put_back {
            st.write_back(*off, data)
                .map_err(|e| EngineError::Io(format!("writing back a rebuilt block: {e}")))?;
        }
    }
    if let Some(st) = shared
        .striped
        .as_ref()
        .filter(|st| writable && st.shape().parity > 0)
    {
        let mut total = lamina_device::striped::ResyncStats::default();
        for f in found
            .iter()
            .filter(|f| !released.contains(&(f.seg, f.incarnation)))
        {
            // (first block, blocks) of each range to resync
            let mut ranges: Vec<(u32, u32)> = Vec::new();
            if let Some(u) = f.units.iter().find(|u| !vouched(u)) {
                ranges.push((u.offset, f.end - u.offset));
            }
            if f.has_summary {
                ranges.push((geo.data_end, geo.summary_blocks));
            }
            for (from, len) in ranges {
                let (_, off) = geo.locate(SegmentId(f.seg), from);
                let r = st.resync(off, len as usize * BLOCK_SIZE).map_err(|e| {
                    EngineError::Io(format!("parity resync of segment {}: {e}", f.seg))
                })?;
                total.add(&r);
            }
        }
        report.resync_rows = total.rows;
        report.resync_mismatched = total.rows_mismatched;
        report.resync_unprotected = total.unprotected;
        if total.parity_rewritten > 0 {
            shared.devices[geo.members]
                .sync()
                .map_err(|e| EngineError::Io(format!("sync after parity resync: {e}")))?;
        }
        if total.unprotected > 0 {
            report.warnings.push(format!(
                "{} rows written before the crash could not get matching parity (a member \
                 unavailable, or zoned members); their live blocks are moved",
                total.unprotected
            ));
        }
    }

    // ---- replay in version order
    enum Ev {
        Data { volume: u16, lba: u64, pba: u32 },
        Trim { volume: u16, start: u64, count: u64 },
    }
    let mut events: Vec<(u64, Ev)> = Vec::new();
    let mut counters = Counters::from_slice(&meta.counters);
    let mut vol_media: std::collections::HashMap<u16, (u64, u64, u64)> = Default::default();
    for f in &found {
        if released.contains(&(f.seg, f.incarnation)) {
            continue;
        }
        for u in &f.units {
            report.units_replayed += 1;
            let blocks = (u.header_blocks + u.data_blocks) as u64;
            counters.media_blocks += blocks;
            match f.kind {
                StreamKind::Meta => counters.meta_blocks += blocks,
                StreamKind::User => {
                    counters.user_blocks += u.data_blocks as u64;
                    let e = vol_media.entry(f.volume).or_default();
                    e.0 += u.data_blocks as u64;
                    e.2 += blocks;
                }
                StreamKind::Gc => {
                    counters.gc_blocks += u.data_blocks as u64;
                    let e = vol_media.entry(f.volume).or_default();
                    e.1 += u.data_blocks as u64;
                    e.2 += blocks;
                }
            }
            for i in 0..u.data_blocks as usize {
                let r = &u.records[i];
                if r.kind == kind::DATA && !torn.contains(&(f.seg, u.offset, i)) {
                    events.push((
                        u.version,
                        Ev::Data {
                            volume: r.volume(),
                            lba: r.lba(),
                            pba: geo
                                .pba(SegmentId(f.seg), u.offset + u.header_blocks + i as u32)
                                .0,
                        },
                    ));
                    report.blocks_replayed += 1;
                }
            }
            let extras = &u.records[u.data_blocks as usize..];
            for (i, r) in extras.iter().enumerate() {
                if r.kind == kind::TRIM {
                    if let Some(v) = extras.get(i + 1).filter(|v| v.kind == kind::VERSION) {
                        events.push((
                            v.a,
                            Ev::Trim {
                                volume: r.volume(),
                                start: r.lba(),
                                count: r.b as u64,
                            },
                        ));
                        report.trims_replayed += 1;
                    }
                }
            }
        }
    }
    events.sort_by_key(|(v, _)| *v);
    let vol_of = |id: u16| {
        volumes
            .iter()
            .find(|(v, _)| v.id.0 == id)
            .map(|(v, _)| v.clone())
    };
    for (_, ev) in &events {
        match *ev {
            Ev::Data { volume, lba, pba } => {
                if let Some(v) = vol_of(volume) {
                    if lba < v.map.len() {
                        v.map.store(lba, encode_device(crate::types::Pba(pba)));
                    }
                }
            }
            Ev::Trim {
                volume,
                start,
                count,
            } => {
                if let Some(v) = vol_of(volume) {
                    let end = (start + count).min(v.map.len());
                    for lba in start..end {
                        v.map.store(lba, UNMAPPED);
                    }
                }
            }
        }
    }

    // ---- segment states after replay
    for (seg, inc) in &released {
        let s = &mut segs[*seg as usize];
        if s.incarnation == *inc {
            let ec = s.erase_count;
            *s = Seg::free(ec);
        }
    }
    // Metadata segments recorded by the checkpoint belong to earlier generations,
    // except the stream head and its reserved successor, which the walk revisits.
    for (i, s) in segs.iter_mut().enumerate() {
        if s.state == SegState::Meta && !scanned_heads.contains(&(i as u32)) {
            *s = Seg::free(s.erase_count);
        }
    }
    let clocks = VolumeClocks::new(
        &volumes,
        found
            .iter()
            .filter(|f| f.kind != StreamKind::Meta && !released.contains(&(f.seg, f.incarnation)))
            .flat_map(|f| f.units.iter().map(move |u| (f.volume, f.kind, u))),
    );
    for f in &found {
        if released.contains(&(f.seg, f.incarnation)) {
            continue;
        }
        let s = &mut segs[f.seg as usize];
        let new_incarnation = f.start == 0 && s.incarnation != f.incarnation;
        if new_incarnation {
            s.erase_count += 1;
            s.data_blocks = 0;
        }
        if f.kind != StreamKind::Meta {
            if let (Some(first), Some(last)) = (f.units.first(), f.units.last()) {
                if new_incarnation {
                    s.born = clocks.before(f.volume, first);
                    s.origins = Origins::for_segment(f.kind, s.born);
                }
                s.closed = clocks.after(f.volume, f.kind, last);
                s.last_invalidated = s.closed;
                if f.kind == StreamKind::Gc {
                    // Each replayed unit dates the slots its blocks fall in (units
                    // written before origins were recorded: by the segment's birth).
                    let mut slots = [(0u128, 0u64); ORIGIN_SLOTS];
                    for u in &f.units {
                        let at = if u.origin != 0 { u.origin } else { s.born };
                        for i in 0..u.data_blocks {
                            let slot =
                                Origins::slot(u.offset + u.header_blocks + i, geo.segment_blocks);
                            slots[slot].0 += at as u128;
                            slots[slot].1 += 1;
                        }
                    }
                    let o = s
                        .origins
                        .get_or_insert_with(|| Box::new(Origins::at_time(s.born)));
                    for (k, &(sum, n)) in slots.iter().enumerate() {
                        if n > 0 {
                            o.mean[k] = (sum / n as u128) as u64;
                        }
                    }
                }
            }
        }
        s.incarnation = f.incarnation;
        s.kind = f.kind;
        s.class = f.class;
        s.volume = f.volume;
        s.write_ptr = f.end;
        s.data_blocks += f.units.iter().map(|u| u.data_blocks).sum::<u32>();
        s.close_version = f.units.last().map_or(s.close_version, |u| u.version);
        s.has_summary = f.has_summary;
        s.state = if f.kind == StreamKind::Meta {
            SegState::Meta
        } else {
            SegState::Closed
        };
        s.gen = ckpt_gen;
    }
    // Stream heads that received nothing: closed where they stood, or free if empty.
    for seg in &scanned_heads {
        let s = &mut segs[*seg as usize];
        let empty_meta = s.state == SegState::Meta && !found.iter().any(|f| f.seg == *seg);
        let empty_data = s.state == SegState::Closed && s.write_ptr == 0;
        if empty_meta || empty_data {
            *s = Seg::free(s.erase_count);
        } else if s.state == SegState::Closed
            && meta.segments.get(*seg as usize).map(|r| r.state) == Some(SegmentState::Open)
            && !found.iter().any(|f| f.seg == *seg && !f.units.is_empty())
        {
            // Open at the checkpoint and not written since: its last write was
            // before the checkpoint.
            s.closed = volumes
                .iter()
                .find(|(v, _)| v.id.0 == s.volume)
                .map_or(s.born, |(_, rec)| rec.user_blocks_written);
            s.last_invalidated = s.closed;
        }
    }

    // ---- valid counts and live blocks from the final map
    let limit_blocks = geo.segment_count as u64 * geo.segment_blocks as u64;
    let mut live_per_volume = Vec::new();
    for (v, _) in &volumes {
        let mut live = 0u64;
        v.map.for_each_mapped(|lba, e| {
            live += 1;
            if e == BAD {
                return;
            }
            let pba = (e - 1) as u64;
            let ok = pba < limit_blocks && {
                let s = &segs[(pba / geo.segment_blocks as u64) as usize];
                s.state == SegState::Closed
            };
            if ok {
                segs[(pba / geo.segment_blocks as u64) as usize].valid += 1;
            } else {
                report.warnings.push(format!(
                    "volume {:?} block {lba} pointed into an unused segment; marked bad",
                    v.name
                ));
                v.map.store(lba, BAD);
            }
        });
        live_per_volume.push(live);
    }
    for s in segs.iter_mut() {
        if s.state == SegState::Closed && s.valid == 0 {
            *s = Seg::free(s.erase_count);
        }
    }

    // ---- the free queue: the walked order first, then the rest
    let mut in_queue = vec![false; nsegs];
    let mut free = VecDeque::new();
    for seg in walked_queue
        .iter()
        .copied()
        .chain(meta.free_queue.iter().copied())
    {
        if (seg as usize) < nsegs
            && segs[seg as usize].state == SegState::Free
            && !in_queue[seg as usize]
        {
            in_queue[seg as usize] = true;
            free.push_back(seg);
        }
    }
    for (i, s) in segs.iter().enumerate() {
        if s.state == SegState::Free && !in_queue[i] {
            free.push_back(i as u32);
        }
    }
    for (i, s) in segs.iter().enumerate() {
        shared.set_incarnation(SegmentId(i as u32), s.incarnation);
    }
    // Readers locate unit headers through the unit-start bitmap. Segments the walk
    // scanned get theirs now; the others load lazily on their first read.
    for f in &found {
        if released.contains(&(f.seg, f.incarnation))
            || segs[f.seg as usize].incarnation != f.incarnation
        {
            continue;
        }
        if f.start == 0 {
            for u in &f.units {
                shared.mark_unit_start(geo.pba(SegmentId(f.seg), u.offset));
            }
            shared.set_starts_known(SegmentId(f.seg));
        }
    }

    // ---- the engine
    let next_version = sb.version_reserved.max(1);
    let mut sb = sb;
    sb.version_reserved = next_version + VERSION_LEASE;
    let mut engine = Engine::assemble(
        shared.clone(),
        cfg,
        sb,
        segs,
        free,
        next_version,
        counters,
        ckpt_gen,
    )?;
    for ((vs, rec), live) in volumes.into_iter().zip(live_per_volume) {
        let (u, g, m) = vol_media.get(&rec.id).copied().unwrap_or_default();
        let recorded = meta.placement.iter().find(|p| p.volume == rec.id);
        let vol = engine.attach_volume(
            vs,
            rec.created_version,
            true,
            recorded.map(|p| p.classifier.as_str()),
        );
        // What the volume's classifier had learnt, unless it is another one now.
        if let Some(p) = recorded.filter(|p| p.classifier == vol.classifier.name()) {
            if let Err(e) = vol.classifier.restore(&p.state) {
                report.warnings.push(format!(
                    "volume {:?}: the placement state in the checkpoint is not usable ({e}); placement starts afresh",
                    rec.name
                ));
            }
        }
        // Units record the volume's count; counting replayed units falls short when
        // segments written since the checkpoint were collected before the crash.
        vol.user_blocks = (rec.user_blocks_written + u).max(clocks.end(rec.id));
        vol.gc_blocks = rec.gc_blocks_relocated + g;
        vol.media_blocks = rec.media_blocks_written + m;
        vol.live_blocks = live;
        engine.space.mapped(live);
    }
    // Fit the open classes to the spare now that the mapped blocks are counted
    // (recovery leaves no data segment open, so nothing is closed here).
    engine.update_class_caps();
    if mode == OpenMode::ReadWrite && engine.zones.zoned {
        // Small streams take conventional segments only: no zone.
        let streams = engine.streams.iter().filter(|s| !s.small).count() as u32;
        if engine.zones.limit > 0 && streams > engine.zones.limit {
            return Err(EngineError::Invalid(format!(
                "the volumes' streams and the metadata stream need {streams} zones open at once, the devices allow {}: configure fewer heat classes (classifier) or geometry_aware = false",
                engine.zones.limit
            )));
        }
        reconcile_zones(&engine)?;
    }
    if mode == OpenMode::ReadWrite {
        // Persist the new version lease before any version from it is used.
        engine.write_superblock_sync()?;
        if report.resync_unprotected > 0 {
            // Rows without matching parity are known only from this walk: if a
            // checkpoint moved the start of the next recovery past them before
            // their blocks are moved, a crash in between would leave them trusted.
            // So the recovery checkpoint waits for the relocation ([`open`]).
            engine.hold_checkpoints = true;
        } else {
            // Record the recovered state so that later recoveries start from here.
            engine.submit(RECOVERY_TOKEN, crate::engine::Request::Checkpoint);
        }
    }
    for w in &report.warnings {
        tracing::warn!("{w}");
    }
    Ok((engine, report))
}

/// Zoned devices: closes what a crash left open, from the write pointers the
/// devices report (never from memory). Every zone still open or closed (a
/// segment without its summary yet, or a stream head a crashed run had just
/// started) is finished where its write pointer stands: recovery never continues
/// a segment, so nothing more is written there, and the zone stops counting
/// against the device's open limit. Contents are kept: a free segment's zone is
/// reset only when the segment is reused, as a conventional device's segment is
/// only overwritten then (a crash before the post-recovery checkpoint may need
/// the previous checkpoint's segments).
fn reconcile_zones(engine: &Engine) -> Result<(), EngineError> {
    let geo = &engine.geo;
    let shared = &engine.shared;
    let mut reports = std::collections::HashMap::new();
    for d in geo.data_devices() {
        let zones: std::collections::HashMap<u64, lamina_device::zoned::Zone> = shared.devices[d]
            .report_zones()?
            .into_iter()
            .filter(|z| z.ty == ZoneType::SequentialRequired)
            .map(|z| (z.start, z))
            .collect();
        reports.insert(d, zones);
    }
    for i in 0..engine.segments.segs.len() {
        let (d, off) = geo.locate(SegmentId(i as u32), 0);
        if engine.seg_conventional(i as u32) {
            continue;
        }
        let Some(z) = reports.get(&d).and_then(|r| r.get(&off)) else {
            return Err(EngineError::Invalid(format!(
                "segment {i} does not start a zone of {} (offset {off})",
                shared.devices[d].describe()
            )));
        };
        if matches!(
            z.cond,
            ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen | ZoneCond::Closed
        ) {
            shared.devices[d].finish_zone(z.wp)?;
        }
    }
    Ok(())
}

/// Token of the post-recovery checkpoint submitted by [`open_unfinished`].
pub const RECOVERY_TOKEN: Token = Token {
    conn: u32::MAX,
    handle: 0,
};

/// Opens an array: reads superblocks, loads the checkpoint, replays what followed,
/// and (read-write) writes the checkpoint of the recovered state before returning.
pub fn open(
    devices: Vec<Arc<dyn BlockDevice>>,
    cfg: EngineConfig,
    mode: OpenMode,
) -> Result<(Engine, RecoveryReport), EngineError> {
    let (mut engine, mut report) = open_unfinished(devices, cfg, mode)?;
    if mode == OpenMode::ReadWrite {
        if engine.hold_checkpoints {
            relocate_unprotected(&mut engine, &mut report)?;
            engine.hold_checkpoints = false;
            engine.submit(RECOVERY_TOKEN, crate::engine::Request::Checkpoint);
        }
        run_inline(&mut engine);
        let mut replies = Vec::new();
        engine.drain_replies(&mut replies);
        match replies.into_iter().find(|r| r.token == RECOVERY_TOKEN) {
            Some(r) => r.result?,
            None => {
                return Err(EngineError::Io(
                    "post-recovery checkpoint did not complete".into(),
                ))
            }
        }
    }
    Ok((engine, report))
}

/// Rows a crash left without matching parity that could not be resynced in place
/// (zoned members, a data member missing) are on GC's repair list: their live
/// blocks are moved to new rows, written whole with their parity, and made durable
/// before the array serves, so that no member loss from then on can cost them. It
/// runs before the recovery checkpoint: a crash in the middle finds the same rows
/// again. Bounded: one GC pass over the segments the crash left open. Should GC
/// need a checkpoint to free segments for the moves (a nearly full array),
/// checkpoints are let through after a while, with a warning: the array opens,
/// and only a crash before the moves finish would forget the rows.
fn relocate_unprotected(
    engine: &mut Engine,
    report: &mut RecoveryReport,
) -> Result<(), EngineError> {
    let before = engine.repaired_segments();
    let mut rounds = 0u64;
    while engine.repairs_pending() {
        rounds += 1;
        if let Some(why) = &engine.failed {
            return Err(EngineError::Io(format!(
                "moving blocks out of rows without parity: the array failed: {why}"
            )));
        }
        if rounds == 10_000 && engine.hold_checkpoints {
            engine.hold_checkpoints = false;
            let w = "moving blocks out of rows without parity needs checkpoints to free \
                     segments; a crash before it finishes would leave those rows trusted";
            tracing::warn!("{w}");
            report.warnings.push(w.into());
        }
        if rounds > 1_000_000 {
            return Err(EngineError::Io(
                "moving blocks out of rows without parity did not finish".into(),
            ));
        }
        // The clock stays where it is: the runtime's own starts from it.
        engine.tick(engine.now_ms);
        run_inline(engine);
    }
    let token = Token {
        conn: u32::MAX,
        handle: 1,
    };
    engine.submit(token, crate::engine::Request::Flush);
    run_inline(engine);
    let mut replies = Vec::new();
    engine.drain_replies(&mut replies);
    match replies.into_iter().find(|r| r.token == token) {
        Some(r) => r.result?,
        None => {
            return Err(EngineError::Io(
                "flush after relocation did not complete".into(),
            ))
        }
    }
    report.resync_relocated_segments = engine.repaired_segments() - before;
    let w = format!(
        "moved the live blocks of {} segments whose rows had no matching parity",
        report.resync_relocated_segments
    );
    tracing::warn!("{w}");
    report.warnings.push(w);
    Ok(())
}

/// Submits `req` and drives the engine inline until its reply arrives: device
/// operations run synchronously, and between rounds the clock is moved far ahead so
/// that timers (idle seals, background flushes) fire. `None` if no reply came within
/// `rounds` rounds.
pub fn call_inline(
    engine: &mut Engine,
    token: Token,
    req: crate::engine::Request,
    rounds: usize,
) -> Option<crate::engine::Reply> {
    engine.submit(token, req);
    let mut replies = Vec::new();
    for round in 0..rounds {
        if round > 0 {
            engine.tick(u64::MAX / 2);
        }
        run_inline(engine);
        engine.drain_replies(&mut replies);
        if let Some(i) = replies.iter().position(|r| r.token == token) {
            return Some(replies.swap_remove(i));
        }
    }
    None
}

/// Executes the engine's device operations synchronously until none are left.
pub fn run_inline(engine: &mut Engine) {
    let shared = engine.shared().clone();
    let mut ops = Vec::new();
    loop {
        engine.drain_io(&mut ops);
        if ops.is_empty() {
            break;
        }
        for op in ops.drain(..) {
            let c = execute(&shared, op);
            engine.io_completed(c);
        }
    }
}
