//! Creating an array, and opening one: superblocks, checkpoint, replay.
//!
//! Opening reads the superblocks of every device, loads the checkpoint they name,
//! finds every unit written after the checkpoint's version `C` without scanning the
//! array, verifies what may be torn, and replays block records (by unit version) and
//! trims (by trim version) in version order. Everything recovery needs comes from
//! the devices; nothing is read from the configuration directory.
//!
//! Opening runs as phases, each a module with its own tests, each taking what the
//! phases before it produced and returning what it found (docs/design.md, "Recovery
//! as phases"):
//!
//! | phase | module | takes | gives |
//! |---|---|---|---|
//! | devices | `assemble` | devices, mode | superblock, `Shared` (data path, failed members) |
//! | checkpoint | `checkpoint` | superblock's reference | volumes and maps as of `C`, segment table as of `C` |
//! | walk | `walk` | checkpoint | every segment incarnation written after `C`, releases |
//! | verify | `verify` | walk | torn blocks, blocks rebuilt from parity; write hole closed |
//! | replay | `replay` | walk, torn blocks | maps as of the crash, counters |
//! | settle | `replay` | walk, maps | segment table, valid counts, free queue |
//!
//! then the engine is assembled from the result ([`open_unfinished`]).

use crate::engine::{Engine, EngineConfig, Token, VERSION_LEASE};
use crate::error::EngineError;
use crate::io::execute;
use crate::shared::Shared;
use crate::types::{SegmentId, VolumeId, BLOCK_SIZE};
use lamina_device::zoned::{ZoneCond, ZoneType};
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use std::sync::Arc;

mod assemble;
mod checkpoint;
mod format;
mod jbod;
mod replay;
mod verify;
mod walk;

#[cfg(test)]
mod testing;

pub use assemble::{read_superblocks, MEMBER_FAILED, MEMBER_REBUILDING, MEMBER_REMOVED};
pub(crate) use format::empty_zones;
pub use format::{format, label_of};
pub use jbod::{evacuate, grow, replace, EvacuateReport, GrowParams, ReplaceReport};

/// Fewest segments an array may have: stream heads, GC reserve and checkpoint space
/// need room to turn over.
pub const MIN_SEGMENTS: u32 = 16;
/// Fewest segments a cache tier may have: every user stream holds one open (a
/// segment is compacted once it is closed), so a cache of a few segments would
/// leave user writes waiting for segments that no stream closes.
pub const MIN_CACHE_SEGMENTS: u32 = 16;

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
    /// Discard each member's data area before the first superblock is written (as
    /// mkfs does): an SSD then knows every block is free, a file's old contents
    /// become holes. Zoned members are emptied (reset) instead, always.
    pub discard: bool,
    /// Told how the discard goes, as (bytes done, bytes in all) over every member:
    /// on a large SSD it takes a while.
    pub progress: Option<Progress>,
    /// The last this many of the devices given are the cache tier (issue 14):
    /// every user write lands there first and compaction moves it on to the
    /// others, the capacity tier. 0: no cache tier.
    pub cache_devices: usize,
}

/// A callback for long work, with (done, total).
#[derive(Clone)]
pub struct Progress(pub std::sync::Arc<dyn Fn(u64, u64) + Send + Sync>);

impl std::fmt::Debug for Progress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Progress")
    }
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
            discard: false,
            progress: None,
            cache_devices: 0,
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
    /// Unit headers that failed as read and were rebuilt from parity (in the
    /// checkpoint and the units replay uses).
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

/// No complete copy of the cache tier is left (its one device missing, or every
/// device of its mirror missing, failed or still being rebuilt, which holds only
/// the stripes below its cursor): every block written since the last checkpoint
/// is only in the cache, and so are the blocks that checkpoint maps into cache
/// segments. The array cannot vouch for any volume and is not served; the error
/// says which volumes lost what, as the checkpoint (on the capacity tier) counts it.
fn cache_lost(
    shared: &Shared,
    sb: &lamina_format::superblock::Superblock,
    ckpt: &checkpoint::Checkpoint,
) -> Option<EngineError> {
    let geo = &shared.geo;
    // `read_superblocks` put an absent device (size 0) where a cache member was
    // missing; a member that is present is at least as large as it was. A mirror
    // also leaves out the copies it records as failed, and those not yet rebuilt.
    let cache: Vec<usize> = (0..sb.devices.len())
        .filter(|&i| sb.devices[i].tier == lamina_format::superblock::TIER_CACHE)
        .collect();
    let gone = |i: usize| {
        shared.devices[i].size_bytes() == 0
            || geo
                .striped_index(i)
                .zip(shared.striped.as_ref())
                .is_some_and(|(m, st)| !st.available(m))
    };
    if cache.is_empty() || !cache.iter().all(|&i| gone(i)) {
        return None;
    }
    let lost = cache;
    let mut volumes = Vec::new();
    for (v, _) in &ckpt.volumes {
        let mut n = 0u64;
        v.map.for_each_mapped(|_, e| {
            if e != crate::map::BAD && geo.is_cache(geo.split(crate::types::Pba(e - 1)).0 .0) {
                n += 1;
            }
        });
        if n > 0 {
            volumes.push(format!(
                "{:?} {n} blocks ({} MiB)",
                v.name(),
                (n * BLOCK_SIZE as u64) >> 20
            ));
        }
    }
    let at = sb.checkpoint.map_or_else(
        || "the array has no checkpoint yet".to_string(),
        |c| format!("checkpoint generation {}", c.generation),
    );
    Some(EngineError::Invalid(format!(
        "no complete copy of the cache tier is left (members {lost:?} missing, failed or being \
         rebuilt), and the array \
         cannot vouch for what was in its cache: it is not served. \
         Lost with it: every block written since the last checkpoint ({at}), and what that \
         checkpoint maps into the cache: {}. Give the device back to serve the array",
        if volumes.is_empty() {
            "nothing".to_string()
        } else {
            volumes.join(", ")
        }
    )))
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
    let writable = mode == OpenMode::ReadWrite;
    let (sb, shared) = assemble::open_devices(devices, &cfg, writable, &mut report)?;
    let geo = &shared.geo;
    let ckpt = checkpoint::load(&shared, sb.checkpoint, &mut report)?;
    if let Some(e) = cache_lost(&shared, &sb, &ckpt) {
        return Err(e);
    }
    let mut segs = checkpoint::segment_table(&ckpt.meta, geo.segment_count as usize);
    let walk = walk::walk(&shared, &ckpt, &segs, &mut report);
    let marks = verify::Marks::new(&walk);
    let verified = verify::unvouched_units(&shared, &walk, &marks, &mut report)?;
    if writable {
        verify::close_write_hole(&shared, &walk, &marks, &verified.put_back, &mut report)?;
    }
    let replayed = replay::replay(geo, &walk, &verified.torn, &ckpt, &mut report);
    let clocks = replay::VolumeClocks::new(&ckpt.volumes, walk.data_units());
    replay::settle_segments(&mut segs, geo, &walk, &ckpt, &clocks);
    // Snapshot families, before anything is published: readers need a volume's
    // family to accept the blocks it shares, and a snapshot is read-only.
    let lineage = crate::lineage::Lineage::from_records(&ckpt.meta.lineage, |id| {
        ckpt.volumes.iter().any(|(v, _)| v.id.0 == id)
    });
    for r in lineage.records() {
        shared.set_family(crate::types::VolumeId(r.volume), r.family);
    }
    for (v, _) in &ckpt.volumes {
        v.read_only.store(
            lineage.read_only(v.id),
            std::sync::atomic::Ordering::Release,
        );
    }
    let (live_per_volume, mapped) =
        replay::count_live(geo, &ckpt.volumes, &lineage, &mut segs, &mut report);
    let free = replay::free_queue(&segs, &walk.walked_queue, &ckpt.meta.free_queue);
    replay::publish(&shared, &segs, &walk);

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
        crate::types::Version(next_version),
        replayed.counters,
        ckpt.generation,
    )?;
    let placement = &ckpt.meta.placement;
    let policies = &ckpt.meta.policies;
    for ((vs, rec), live) in ckpt.volumes.into_iter().zip(live_per_volume) {
        let (u, g, m) = replayed.vol_media.get(&rec.id).copied().unwrap_or_default();
        let recorded = placement.iter().find(|p| p.volume == rec.id);
        let vol = engine.attach_volume(
            vs,
            crate::types::Version(rec.created_version),
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
        // And what its victim policy had learnt, likewise.
        let policy = policies.iter().find(|p| p.volume == rec.id);
        if let Some(p) = policy.filter(|p| p.classifier == vol.policy.name()) {
            if let Err(e) = vol.policy.restore(&p.state) {
                report.warnings.push(format!(
                    "volume {:?}: the GC policy state in the checkpoint is not usable ({e}); it starts afresh",
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
    }
    engine.space.mapped(mapped);
    engine.lineage = lineage;
    // Fit the open classes to the spare now that the mapped blocks are counted
    // (recovery leaves no data segment open, so nothing is closed here).
    engine.update_class_caps();
    if writable && engine.zones.zoned {
        // Small streams take conventional segments only: no zone, and nor do user
        // streams in front of a cache tier. Nor do a snapshot's streams take one:
        // a snapshot takes no writes, and GC moves its blocks within the
        // segments' owners' streams.
        let streams = (0..engine.log.streams.len())
            .filter(|&s| {
                engine.holds_zones(s)
                    && !engine
                        .lineage
                        .read_only(VolumeId(engine.log.streams[s].volume))
            })
            .count() as u32;
        if engine.zones.limit > 0 && streams > engine.zones.limit {
            return Err(EngineError::Invalid(format!(
                "the volumes' streams and the metadata stream need {streams} zones open at once, the devices allow {}: configure fewer heat classes (classifier) or geometry_aware = false",
                engine.zones.limit
            )));
        }
        reconcile_zones(&engine)?;
    }
    // What the maps take in the checkpoints (`Space::maps_extra`), as the next
    // checkpoint will count it: a read-only open writes none.
    engine.space.set_map_pages(engine.used_map_pages());
    if writable {
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
    // A cache tier's devices are conventional: their segments are skipped below.
    for d in geo.capacity_devices() {
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
        finish_inline(&mut engine, RECOVERY_TOKEN, "post-recovery checkpoint")?;
    }
    Ok((engine, report))
}

/// Runs the engine's device operations inline, then takes the reply to `token`, a
/// request submitted earlier (`what` names it): its result, or an error if it did
/// not come. The clock is left where it is.
fn finish_inline(engine: &mut Engine, token: Token, what: &str) -> Result<(), EngineError> {
    run_inline(engine);
    let mut replies = Vec::new();
    engine.drain_replies(&mut replies);
    match replies.into_iter().find(|r| r.token == token) {
        Some(r) => r.result,
        None => Err(EngineError::Io(format!("{what} did not complete"))),
    }
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
    finish_inline(engine, token, "flush after relocation")?;
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
/// operations run synchronously, and between rounds the clock moves an hour ahead so
/// that timers (idle seals, background flushes, discards of free segments) fire. `None` if no reply came within
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
            engine.tick(engine.now_ms.saturating_add(3_600_000));
        }
        run_inline(engine);
        engine.drain_replies(&mut replies);
        if let Some(i) = replies.iter().position(|r| r.token == token) {
            return Some(replies.swap_remove(i));
        }
    }
    None
}

/// Runs `f` with the engine's shared state and a `call` that serves each request
/// inline ([`call_inline`]): what a scrub or a rebuild sends to the engine when no
/// server runs it (offline commands, tests).
pub fn with_inline_calls<R>(
    engine: &mut Engine,
    f: impl FnOnce(&Shared, &dyn Fn(crate::engine::Request) -> Result<(), EngineError>) -> R,
) -> R {
    let shared = engine.shared().clone();
    let cell = std::cell::RefCell::new(engine);
    let call = |req| {
        // Not RECOVERY_TOKEN: a reply to it may still be on its way.
        let token = Token {
            conn: u32::MAX - 1,
            handle: 0,
        };
        call_inline(&mut cell.borrow_mut(), token, req, 100_000)
            .ok_or_else(|| EngineError::Io("the engine did not answer".into()))?
            .result
    };
    f(&shared, &call)
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
