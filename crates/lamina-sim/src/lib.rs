//! `lamina sim`: replays a workload through the real engine, without data.
//!
//! The engine runs in metadata-only mode (`EngineConfig::metadata_only`): writes carry
//! LBAs but no bytes, GC moves records instead of blocks, and segments emptied by GC
//! are reused at once (nothing needs to be durable in a simulation). Everything that
//! decides write amplification is the code `lamina serve` runs: the write path, the
//! classifier and its streams, segment filling, unit and summary writing, victim
//! selection and relocation. The device is a sparse RAM device that keeps only what
//! the engine reads back (superblocks and segment summaries); unit writes are
//! acknowledged without storing anything.
//!
//! Sizing: each volume gets its working set (distinct blocks the workload writes)
//! times (1 + over-provisioning) of data space, plus the segments the engine keeps
//! out of circulation (the metadata stream's two, and GC's free reserve), so that
//! over-provisioning means what the models mean by it. The partly filled open
//! segment of each stream is not compensated: more heat classes hold more of them,
//! a real cost of the placement that small arrays feel.

pub mod plot;
pub mod trace;
pub mod workload;

use lamina_core::engine::{Engine, EngineConfig, Request, Token};
use lamina_core::io::{IoCompletion, IoKind, IoOp};
use lamina_core::{FormatParams, OpenMode, VolumeId};
use lamina_device::sparse::SparseDevice;
use lamina_device::BlockDevice;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;
use workload::{Op, Pattern, Synthetic, Workload};

/// Simulation parameters.
#[derive(Clone, Debug)]
pub struct SimConfig {
    pub segment_blocks: u32,
    pub write_unit_blocks: u32,
    /// Spare space as a fraction of the working set (0.28 = 28%).
    pub overprovision: f64,
    pub classifier: String,
    pub policy: String,
    /// User blocks written before the measured window starts (the fill and warm-up).
    pub warmup_blocks: u64,
    /// Points in the write-amplification time series.
    pub series_points: u64,
    pub wear_window: f64,
    /// Free segments below which GC runs.
    pub gc_start_segments: usize,
    /// SepBIT's trigger: GC also runs while dead blocks exceed this fraction of the
    /// stored ones.
    pub gc_garbage_ratio: Option<f64>,
    /// Size the array's reserve (the segments kept for GC and metadata) as if the
    /// placement had this many GC classes, so that placements with different
    /// numbers of classes are compared on arrays of the same physical size (1: the
    /// size greedy without separation gets). `None`: the placement's own number.
    pub footprint_classes: Option<usize>,
    /// Replay the array's device writes on an emulated SSD with this geometry (its
    /// capacity is set to hold the simulated array): device-level write
    /// amplification and erases.
    pub flash: Option<lamina_device::flash::FlashConfig>,
    /// A cache tier (issue 14) of this fraction of the array's segments (at
    /// least `MIN_CACHE_SEGMENTS`) in front of it: user writes land there and
    /// compaction moves them on. The emulated SSD, if any, is the capacity tier.
    pub cache: Option<f64>,
    /// Rolling snapshots of every volume (as `zfs-auto-snapshot` or sanoid take
    /// them): the blocks their volumes overwrite stay live, and GC moves them.
    pub snapshots: Option<SnapshotPolicy>,
}

/// A snapshot of every volume each `every_blocks` user blocks written to the
/// array, the newest `keep` of each kept (older ones deleted).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SnapshotPolicy {
    pub every_blocks: u64,
    pub keep: usize,
}

/// The most snapshots of one volume a policy may keep: a snapshot family holds at
/// most 64 volumes (docs/design.md, "Snapshots and clones").
pub const MAX_SNAPSHOTS_KEPT: usize = 62;

impl Default for SimConfig {
    fn default() -> Self {
        // The placement `lamina serve` uses without configuration.
        let engine = EngineConfig::default();
        SimConfig {
            segment_blocks: 2048,
            write_unit_blocks: 128,
            overprovision: 0.28,
            classifier: engine.classifier,
            policy: engine.gc_policy,
            warmup_blocks: 0,
            series_points: 100,
            wear_window: 0.0,
            gc_start_segments: 3,
            gc_garbage_ratio: None,
            footprint_classes: None,
            flash: None,
            cache: None,
            snapshots: None,
        }
    }
}

/// A volume of the simulated array.
#[derive(Clone, Debug)]
pub struct VolumeSpec {
    pub name: String,
    /// Address space in blocks (highest block written + 1).
    pub blocks: u64,
    /// Distinct blocks the workload writes: the live data the array must hold.
    pub working_set: u64,
}

/// Errors of a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("invalid simulation: {0}")]
    Invalid(String),
    /// (Transparent: the engine's message once, not again as its source.)
    #[error(transparent)]
    Engine(#[from] lamina_core::EngineError),
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
}

/// Counters at one point of the run.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sample {
    pub user_blocks: u64,
    pub gc_blocks: u64,
    pub media_blocks: u64,
    /// Blocks written to the capacity tier's device (every device write without
    /// a cache tier).
    pub capacity_blocks: u64,
    /// Live blocks in the cache tier (0 without one): what it has not moved on.
    pub dirty_blocks: u64,
}

/// The result of a run.
#[derive(Debug)]
pub struct SimReport {
    pub config: SimConfig,
    pub segments: u32,
    pub start: Sample,
    pub warm: Sample,
    pub end: Sample,
    pub per_volume_warm: Vec<(u64, u64)>,
    pub status: lamina_core::StatusReport,
    pub series: Vec<Sample>,
    pub elapsed_s: f64,
    pub workload: String,
    /// Snapshots taken and deleted by the run's [`SnapshotPolicy`].
    pub snapshots_taken: u64,
    pub snapshots_deleted: u64,
    /// With an emulated SSD: its counters when the measured window started and at
    /// the end.
    pub flash: Option<(
        lamina_device::flash::FlashStats,
        lamina_device::flash::FlashStats,
    )>,
}

impl SimReport {
    /// (user + relocated) / user blocks in the measured window: the write
    /// amplification the analytic models and SepBIT's simulator report.
    pub fn write_amplification(&self) -> f64 {
        wa(self.warm, self.end)
    }
    /// Blocks written to the capacity tier (the whole array without a cache
    /// tier; with one: compaction, the capacity tier's GC, metadata), headers
    /// and summaries included, per user block in the measured window.
    pub fn capacity_write_amplification(&self) -> f64 {
        let u = self.end.user_blocks - self.warm.user_blocks;
        (self.end.capacity_blocks - self.warm.capacity_blocks) as f64 / u.max(1) as f64
    }
    /// Same over the whole run.
    pub fn write_amplification_total(&self) -> f64 {
        wa(self.start, self.end)
    }
    /// Everything written to media (data, unit headers, summaries, metadata) per
    /// user block, over the whole run.
    pub fn media_write_amplification(&self) -> f64 {
        let u = self.end.user_blocks - self.start.user_blocks;
        (self.end.media_blocks - self.start.media_blocks) as f64 / u.max(1) as f64
    }
    /// Live blocks at the end that only snapshots map: the array's live blocks
    /// less what the volumes themselves map (volumes share blocks only with their
    /// own snapshots).
    pub fn snapshot_held_blocks(&self) -> u64 {
        let own: u64 = self
            .status
            .volumes
            .iter()
            .filter(|v| !v.snapshot)
            .map(|v| v.live_bytes / 4096)
            .sum();
        (self.status.live_bytes / 4096).saturating_sub(own)
    }
    pub fn blocks_per_second(&self) -> f64 {
        (self.end.user_blocks - self.start.user_blocks + self.end.gc_blocks - self.start.gc_blocks)
            as f64
            / self.elapsed_s.max(1e-9)
    }

    pub fn to_json(&self) -> Value {
        let c = &self.config;
        let volumes: Vec<Value> = self
            .status
            .volumes
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let (wu, wg) = self.per_volume_warm.get(i).copied().unwrap_or((0, 0));
                let u = v.user_bytes_written / 4096 - wu;
                let g = v.gc_bytes_relocated / 4096 - wg;
                json!({
                    "name": v.name,
                    "snapshot": v.snapshot,
                    "blocks": v.size_bytes / 4096,
                    "live_blocks": v.live_bytes / 4096,
                    "user_blocks_written": v.user_bytes_written / 4096,
                    "gc_blocks_written": v.gc_bytes_relocated / 4096,
                    "media_blocks_written": v.media_bytes_written / 4096,
                    "write_amplification": if u > 0 { Some((u + g) as f64 / u as f64) } else { None },
                    "media_write_amplification": v.write_amplification,
                    "classes": v.classes.iter().map(|k| json!({
                        "class": k.class,
                        "kind": k.kind,
                        "segments": k.segments,
                        "live_blocks": k.live_bytes / 4096,
                        "blocks_written": k.bytes_written / 4096,
                        "blocks_relocated_out": k.bytes_relocated_out / 4096,
                        "victims": k.victims,
                        "gc_cost": k.gc_cost,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect();
        json!({
            "workload": self.workload,
            "config": {
                "segment_blocks": c.segment_blocks,
                "write_unit_blocks": c.write_unit_blocks,
                "overprovision": c.overprovision,
                "classifier": c.classifier,
                "policy": c.policy,
                "warmup_blocks": c.warmup_blocks,
                "segments": self.segments,
            },
            "write_amplification": self.write_amplification(),
            "write_amplification_total": self.write_amplification_total(),
            "media_write_amplification": self.media_write_amplification(),
            "user_blocks_written": self.end.user_blocks - self.start.user_blocks,
            "gc_blocks_written": self.end.gc_blocks - self.start.gc_blocks,
            "media_blocks_written": self.end.media_blocks - self.start.media_blocks,
            "gc_victims": self.status.gc_victims,
            "measured_user_blocks": self.end.user_blocks - self.warm.user_blocks,
            "volumes": volumes,
            "series": self.series.windows(2).map(|w| json!({
                "user_blocks": w[1].user_blocks - self.start.user_blocks,
                "write_amplification": wa(w[0], w[1]),
                "cumulative_write_amplification": wa(self.start, w[1]),
            })).collect::<Vec<_>>(),
            "elapsed_s": self.elapsed_s,
            "blocks_per_second": self.blocks_per_second(),
            "flash": self.flash_json(),
            "snapshots": c.snapshots.map(|p| json!({
                "every_blocks": p.every_blocks,
                "keep": p.keep,
                "taken": self.snapshots_taken,
                "deleted": self.snapshots_deleted,
                "held_blocks": self.snapshot_held_blocks(),
            })),
            "capacity_write_amplification": self.capacity_write_amplification(),
            "cache": self.status.cache.as_ref().map(|c| json!({
                "segments": c.segment_count,
                // What the capacity tier would take if the cache were emptied
                // now: what it took plus what the cache still holds live.
                "capacity_write_amplification_emptied": (
                    (self.end.capacity_blocks - self.warm.capacity_blocks) as f64
                        + self.end.dirty_blocks as f64
                        - self.warm.dirty_blocks as f64
                ) / (self.end.user_blocks - self.warm.user_blocks).max(1) as f64,
                "dirty_blocks": c.dirty_bytes / 4096,
                "compacted_blocks": c.compacted_bytes / 4096,
                "compactions": c.compactions,
            })),
        })
    }

    /// The emulated SSD's view of the measured window: NAND bytes programmed per
    /// user byte, per host byte (device-level WA), and erases.
    pub fn flash_json(&self) -> Option<Value> {
        let (a, b) = self.flash.as_ref()?;
        let user = (self.end.user_blocks - self.warm.user_blocks).max(1) * 4096;
        let nand = b.nand_bytes_programmed - a.nand_bytes_programmed;
        let host = (b.host_bytes_written - a.host_bytes_written).max(1);
        Some(json!({
            "nand_bytes_per_user_byte": nand as f64 / user as f64,
            "device_write_amplification": nand as f64 / host as f64,
            "erases": b.erases - a.erases,
            "max_erase_count": b.max_erase_count,
            "mean_erase_count": b.mean_erase_count,
        }))
    }
}

fn wa(a: Sample, b: Sample) -> f64 {
    let u = b.user_blocks - a.user_blocks;
    if u == 0 {
        return 1.0;
    }
    (u + b.gc_blocks - a.gc_blocks) as f64 / u as f64
}

/// For each volume, `next[t]`: the time (in that volume's user blocks written) of
/// the next write or trim of the block written at time `t`, `u64::MAX` if none.
/// A pre-pass over the workload; what the oracle classifier needs.
pub fn next_writes(ops: &mut dyn Workload, volumes: usize) -> Vec<Vec<u64>> {
    // Forward pass: for each write, remember (volume, lba, time); then resolve
    // backwards. To bound memory, we store per volume the LBA of each write.
    let mut lbas: Vec<Vec<u64>> = vec![Vec::new(); volumes];
    let mut trims: Vec<Vec<(u64, u64, u64)>> = vec![Vec::new(); volumes]; // (time, lba, count)
    while let Some(op) = ops.next_op() {
        let v = op.volume as usize;
        if v >= volumes {
            continue;
        }
        if op.trim {
            trims[v].push((lbas[v].len() as u64, op.lba, op.blocks as u64));
        } else {
            for b in 0..op.blocks as u64 {
                lbas[v].push(op.lba + b);
            }
        }
    }
    lbas.into_iter()
        .zip(trims)
        .map(|(l, tr)| {
            let mut next = vec![u64::MAX; l.len()];
            let mut seen: std::collections::HashMap<u64, u64> = std::collections::HashMap::new();
            let mut tr = tr;
            for t in (0..l.len()).rev() {
                // Trims issued after write t (at or after time t+1) end lives too.
                while let Some(&(tt, lba, count)) = tr.last() {
                    if tt <= t as u64 {
                        break;
                    }
                    for b in lba..lba + count {
                        seen.insert(b, tt);
                    }
                    tr.pop();
                }
                if let Some(&n) = seen.get(&l[t]) {
                    next[t] = n;
                }
                seen.insert(l[t], t as u64);
            }
            next
        })
        .collect()
}

/// Write amplification of greedy cleaning under uniform random overwrites with
/// large segments (Desnoyers; Stoica and Ailamaki): 1 / (1 - u) where the victims'
/// utilisation u solves u = exp(-alpha (1 - u)), alpha = physical / logical
/// = 1 + over-provisioning.
pub fn model_wa(overprovision: f64) -> f64 {
    let alpha = 1.0 + overprovision;
    let mut u = 0.5;
    for _ in 0..200 {
        u = (-alpha * (1.0 - u)).exp();
    }
    1.0 / (1.0 - u)
}

/// Runs a synthetic workload on one volume of `blocks` blocks: a sequential fill,
/// then `writes` single-block writes of `pattern`; measured from the middle of the
/// writes unless `cfg.warmup_blocks` says otherwise. Builds the oracle's table when
/// `cfg.classifier` is `oracle`.
pub fn run_synthetic(
    label: &str,
    pattern: &Pattern,
    blocks: u64,
    writes: u64,
    seed: u64,
    cfg: &SimConfig,
    progress: &mut dyn FnMut(u64),
) -> Result<SimReport, SimError> {
    let make = || Synthetic::new(pattern.clone(), blocks, writes, seed, true);
    let oracle = (cfg.classifier == "oracle").then(|| {
        next_writes(&mut make(), 1)
            .into_iter()
            .map(Arc::new)
            .collect()
    });
    let mut cfg = cfg.clone();
    if cfg.warmup_blocks == 0 {
        cfg.warmup_blocks = blocks + writes / 2;
    }
    let volumes = [VolumeSpec {
        name: "v0".into(),
        blocks,
        working_set: blocks,
    }];
    simulate(&mut make(), &volumes, &cfg, oracle, label, progress)
}

/// Executes the engine's device operations against the metadata store.
struct Driver {
    /// The capacity device, then the cache device if any.
    devs: Vec<Arc<SparseDevice>>,
    /// Emulates the capacity device.
    flash: Option<Arc<lamina_device::flash::Flash>>,
    ops: Vec<IoOp>,
    /// Blocks written to the capacity device.
    capacity_blocks: u64,
}

impl Driver {
    fn run(&mut self, e: &mut Engine) {
        loop {
            e.drain_io(&mut self.ops);
            if self.ops.is_empty() {
                return;
            }
            for op in self.ops.drain(..) {
                let capacity = op.device == 0;
                if capacity {
                    self.capacity_blocks += match &op.kind {
                        IoKind::WriteUnit { blocks, .. } => *blocks as u64,
                        IoKind::WriteOwned { data } => data.len() as u64 / 4096,
                        _ => 0,
                    };
                }
                let flash = self.flash.as_ref().filter(|_| capacity);
                if let (Some(f), IoKind::WriteUnit { blocks, .. }) = (flash, &op.kind) {
                    f.submit(
                        lamina_device::flash::FlashOp::Write {
                            offset: op.offset,
                            len: *blocks as u64 * 4096,
                        },
                        0,
                    );
                }
                if let (Some(f), IoKind::WriteOwned { data }) = (flash, &op.kind) {
                    f.submit(
                        lamina_device::flash::FlashOp::Write {
                            offset: op.offset,
                            len: data.len() as u64,
                        },
                        0,
                    );
                }
                if let (Some(f), IoKind::Discard { len }) = (flash, &op.kind) {
                    let _ = f.discard(op.offset, *len);
                }
                let (result, buf) = match op.kind {
                    // Data is not simulated; unit headers are not read back either
                    // (GC reads summaries).
                    IoKind::WriteUnit { .. }
                    | IoKind::Sync
                    | IoKind::FinishZone
                    | IoKind::Discard { .. } => (Ok(()), None),
                    IoKind::WriteOwned { data } => {
                        (self.devs[op.device].write_at(&data, op.offset), None)
                    }
                    IoKind::Read { mut buf } => {
                        (self.devs[op.device].read_at(&mut buf, op.offset), Some(buf))
                    }
                };
                e.io_completed(IoCompletion {
                    tag: op.tag,
                    result,
                    buf,
                });
            }
        }
    }
}

fn counters(e: &Engine, d: &Driver) -> Sample {
    let c = e.counters();
    Sample {
        user_blocks: c.user_blocks,
        gc_blocks: c.gc_blocks,
        media_blocks: c.media_blocks,
        capacity_blocks: d.capacity_blocks,
        dirty_blocks: e.cache_live_blocks(),
    }
}

/// Runs a workload on a fresh simulated array holding `volumes`.
/// `oracle`: per volume, the next-write table from [`next_writes`] (needed only by
/// the `oracle` classifier). `progress` is called with user blocks written so far.
pub fn simulate(
    workload: &mut dyn Workload,
    volumes: &[VolumeSpec],
    cfg: &SimConfig,
    oracle: Option<Vec<Arc<Vec<u64>>>>,
    label: &str,
    progress: &mut dyn FnMut(u64),
) -> Result<SimReport, SimError> {
    if volumes.is_empty() {
        return Err(SimError::Invalid("the workload writes nothing".into()));
    }
    if !(0.0..=10.0).contains(&cfg.overprovision) || cfg.overprovision.is_nan() {
        return Err(SimError::Invalid(format!(
            "over-provisioning {} must be between 0 and 10",
            cfg.overprovision
        )));
    }
    if lamina_core::gc::policy_by_name(&cfg.policy).is_none() {
        return Err(SimError::Invalid(format!(
            "unknown policy {:?} (known: {})",
            cfg.policy,
            lamina_core::gc::POLICY_NAMES.join(", ")
        )));
    }
    let known = lamina_core::placement::classifier_by_name(&cfg.classifier, 1).is_some()
        || (cfg.classifier == "oracle" && oracle.is_some());
    if !known {
        return Err(SimError::Invalid(format!(
            "unknown classifier {:?} (known: {}, oracle)",
            cfg.classifier,
            lamina_core::placement::CLASSIFIER_NAMES.join(", ")
        )));
    }
    // Size the array: the working sets with their spare space, plus what the engine
    // keeps out of circulation.
    let h = lamina_format::unit::header_blocks_for(cfg.write_unit_blocks as usize + 16) as u64;
    let per_unit = cfg.write_unit_blocks as u64 - h;
    let data_end = cfg.segment_blocks as u64
        - lamina_format::summary::summary_blocks(cfg.segment_blocks) as u64;
    let per_seg = (data_end / cfg.write_unit_blocks as u64) * per_unit
        + (data_end % cfg.write_unit_blocks as u64).saturating_sub(h);
    let gc_classes = match lamina_core::placement::classifier_by_name(&cfg.classifier, 1) {
        Some(c) => c.gc_classes() as usize,
        None => 16, // the oracle
    };
    // GC may need a fresh segment per GC class to finish a victim: user writes stop
    // while fewer than that remain, and GC starts a little above. These are greedy's
    // (one GC class); the engine raises both with the GC classes it keeps open,
    // which follow the spare space (see `EngineConfig::user_floor_segments`).
    let user_floor = 3;
    let gc_start = cfg.gc_start_segments.max(user_floor + 1);
    // A placement with more classes than the footprint was sized for keeps its
    // own, higher watermarks inside the same array: its open segments and reserve
    // come out of the spare, as they would on a real array.
    let reserve_classes = cfg.footprint_classes.unwrap_or(gc_classes);
    let reserve_start = cfg.gc_start_segments.max(reserve_classes + 3);
    if let Some(p) = cfg.snapshots {
        if p.every_blocks == 0 || p.keep == 0 || p.keep > MAX_SNAPSHOTS_KEPT {
            return Err(SimError::Invalid(format!(
                "snapshots every {} blocks, {} kept: give a positive interval and keep 1 to {MAX_SNAPSHOTS_KEPT}",
                p.every_blocks, p.keep
            )));
        }
    }
    // What the kept snapshots may hold besides the volumes' own data, at most: the
    // old versions of the blocks overwritten in the last `keep` intervals (no more
    // than `keep` copies of the working set), shared among the volumes by working
    // set. The array's usable space holds it, as a real one must (admission
    // control refuses writes beyond it), and the spare is over that.
    let total_ws = volumes.iter().map(|v| v.working_set.max(1)).sum::<u64>();
    let snapshot_room = |v: &VolumeSpec| {
        cfg.snapshots.map_or(0, |p| {
            let ws = v.working_set.max(1);
            let share = (p.keep as u128 * p.every_blocks as u128 * ws as u128) / total_ws as u128;
            (share.min(u64::MAX as u128) as u64).min(p.keep as u64 * ws)
        })
    };
    let with_spare = |v: &VolumeSpec| {
        ((v.working_set.max(1) + snapshot_room(v)) as f64 * (1.0 + cfg.overprovision)).ceil() as u64
    };
    // The metadata stream holds two segments and GC keeps about `reserve_start`
    // free; the open segments of the streams are part of the placement's own cost
    // and are not compensated.
    let overhead = 2 + reserve_start as u64;
    let segments = if volumes.len() == 1 {
        with_spare(&volumes[0]).div_ceil(per_seg) + overhead
    } else {
        // Volumes never share a segment: each one's data takes whole segments,
        // and each one past the first keeps its own open user and GC segments
        // (the first one's come out of the spare, as on a one-volume array).
        // Without this, volumes smaller than a segment could not fit an array
        // sized to their working sets under any placement.
        volumes
            .iter()
            .map(|v| with_spare(v).div_ceil(per_seg))
            .sum::<u64>()
            + 2 * (volumes.len() as u64 - 1)
            + overhead
    };
    let mut segments = segments.max(lamina_core::recovery::MIN_SEGMENTS as u64);
    if let Some(p) = cfg.snapshots {
        // Writes are admitted against the usable space (below), which keeps the
        // engine's own reserve out: grow the array until the live data and what
        // the snapshots may hold fit it, their checkpoints' maps included (each
        // checkpoint writes every kept snapshot's map; two may coexist).
        let need: u64 = volumes
            .iter()
            .map(|v| v.working_set.max(1) + snapshot_room(v))
            .sum();
        let maps = 2 * p.keep as u64 * total_ws.div_ceil(1024);
        let extra = maps.div_ceil(per_seg);
        while lamina_core::usable_blocks_of(segments, per_seg, cfg.overprovision) < need {
            segments += 1;
        }
        segments += extra;
    }
    if segments * cfg.segment_blocks as u64 >= lamina_core::map::PBA_LIMIT as u64 {
        return Err(SimError::Invalid(
            "the simulated array would exceed 16 TiB".into(),
        ));
    }
    let dev_bytes = 1024 * 1024 + segments * cfg.segment_blocks as u64 * 4096;
    let mut sims = vec![Arc::new(SparseDevice::new("sim", dev_bytes))];
    if let Some(f) = cfg.cache {
        if !(f > 0.0 && f <= 10.0) {
            return Err(SimError::Invalid(format!(
                "a cache of {f} of the array: give a fraction above 0, at most 10"
            )));
        }
        let n = ((segments as f64 * f).ceil() as u64)
            .max(lamina_core::recovery::MIN_CACHE_SEGMENTS as u64);
        sims.push(Arc::new(SparseDevice::new(
            "sim-cache",
            1024 * 1024 + n * cfg.segment_blocks as u64 * 4096,
        )));
    }
    let devs: Vec<Arc<dyn BlockDevice>> = sims
        .iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect();
    let params = FormatParams {
        name: "sim".into(),
        segment_blocks: cfg.segment_blocks,
        write_unit_blocks: cfg.write_unit_blocks,
        overprovision: cfg.overprovision,
        cache_devices: sims.len() - 1,
        ..Default::default()
    };
    lamina_core::format(
        &devs,
        &params,
        [0x51; 16],
        &[[0x52; 16], [0x53; 16]][..devs.len()],
        0,
    )?;
    let ecfg = EngineConfig {
        buffer_units: 16,
        header_cache_bytes: 64 << 10,
        gc_policy: cfg.policy.clone(),
        classifier: cfg.classifier.clone(),
        checkpoint_interval_blocks: u64::MAX / 4,
        idle_seal_ms: u64::MAX,
        auto_sync_ms: u64::MAX,
        wear_window: cfg.wear_window,
        metadata_only: true,
        // Live data beyond the usable space is refused (ENOSPC) rather than left
        // to a GC that frees a block per victim: only snapshots can get there.
        enforce_capacity: cfg.snapshots.is_some(),
        gc_start_segments: Some(gc_start),
        user_floor_segments: Some(user_floor),
        gc_garbage_ratio: cfg.gc_garbage_ratio,
        ..Default::default()
    };
    let (mut engine, _) = lamina_core::open(devs, ecfg, OpenMode::ReadWrite)?;
    if let Some(tables) = oracle {
        let names: Vec<String> = volumes.iter().map(|v| v.name.clone()).collect();
        engine.set_classifier_factory(Box::new(move |cname, vname, blocks| {
            if cname != "oracle" {
                return None;
            }
            let i = names.iter().position(|n| n == vname)?;
            Some(Box::new(lamina_core::placement::Oracle::new(
                tables[i].clone(),
                16,
                (blocks / 8).max(64),
            ))
                as Box<dyn lamina_core::placement::Classifier>)
        }));
    }
    let flash = match &cfg.flash {
        Some(fc) => {
            let mut fc = fc.clone();
            fc.capacity_bytes = dev_bytes.next_multiple_of(fc.block_bytes());
            fc.validate().map_err(SimError::Invalid)?;
            let inner = Arc::new(lamina_device::mem::NullDevice::new(
                "ssd",
                fc.capacity_bytes,
            ));
            Some(Arc::new(
                lamina_device::flash::Flash::new(inner, fc)
                    .map_err(|e| SimError::Invalid(e.to_string()))?,
            ))
        }
        None => None,
    };
    let mut driver = Driver {
        devs: sims,
        flash: flash.clone(),
        ops: Vec::new(),
        capacity_blocks: 0,
    };
    let mut replies = Vec::new();
    let token = Token { conn: 0, handle: 0 };
    let mut ids = Vec::new();
    // All at once: creations waiting together share the checkpoint that records
    // them (one each would cost a checkpoint per volume, each as long as the
    // number of volumes).
    for v in volumes {
        engine.submit(
            token,
            Request::CreateVolume {
                name: v.name.clone(),
                size_bytes: v.blocks.max(1) * 4096,
            },
        );
    }
    settle(&mut engine, &mut driver, &mut replies)?;
    for v in volumes {
        let created = engine
            .shared()
            .volume(&v.name)
            .ok_or_else(|| SimError::Invalid(format!("volume {} was not created", v.name)))?;
        ids.push(created.id);
    }
    let start = counters(&engine, &driver);
    let total_hint = volumes.iter().map(|v| v.working_set).sum::<u64>().max(1);
    let series_step = (total_hint / cfg.series_points.max(1)).max(1);
    let mut series = vec![start];
    let mut warm = if cfg.warmup_blocks == 0 {
        Some(start)
    } else {
        None
    };
    let mut per_volume_warm: Vec<(u64, u64)> = vec![(0, 0); volumes.len()];
    let mut flash_warm = flash.as_ref().map(|f| f.stats());
    let mut next_sample = start.user_blocks + series_step;
    let mut next_progress = start.user_blocks + (1 << 20);
    let t0 = Instant::now();
    let mut prefix = String::from("snap");
    while volumes.iter().any(|v| v.name.starts_with(&prefix)) {
        prefix.push('x');
    }
    let mut snaps = Snapshots {
        prefix,
        next_at: start.user_blocks + cfg.snapshots.map_or(0, |p| p.every_blocks),
        kept: vec![std::collections::VecDeque::new(); volumes.len()],
        taken: 0,
        deleted: 0,
    };
    // Operations are read a few ahead, and each one's map entry is prefetched as
    // it is read: by the time the engine takes it, the memory wait is over
    // (lookups of scattered entries would otherwise wait one after another).
    const LOOKAHEAD: usize = 8;
    let mut ahead: std::collections::VecDeque<Op> = std::collections::VecDeque::new();
    loop {
        while ahead.len() < LOOKAHEAD {
            let Some(n) = workload.next_op() else {
                break;
            };
            if let Some(&v) = ids.get(n.volume as usize) {
                engine.prefetch(v, lamina_core::Lba(n.lba));
            }
            ahead.push_back(n);
        }
        let Some(op) = ahead.pop_front() else {
            break;
        };
        let Some(&volume) = ids.get(op.volume as usize) else {
            continue;
        };
        submit(&mut engine, volume, op);
        settle(&mut engine, &mut driver, &mut replies).map_err(|e| engine_error(e, cfg))?;
        let now = engine.counters().user_blocks;
        if let Some(p) = cfg.snapshots.filter(|_| now >= snaps.next_at) {
            snaps.next_at = now + p.every_blocks;
            snaps.take(&mut engine, volumes, p.keep);
            settle(&mut engine, &mut driver, &mut replies).map_err(|e| engine_error(e, cfg))?;
        }
        if warm.is_none() && now - start.user_blocks >= cfg.warmup_blocks {
            warm = Some(counters(&engine, &driver));
            flash_warm = flash.as_ref().map(|f| f.stats());
            let st = engine.status();
            for (i, v) in st.volumes.iter().enumerate().take(per_volume_warm.len()) {
                per_volume_warm[i] = (v.user_bytes_written / 4096, v.gc_bytes_relocated / 4096);
            }
        }
        if now >= next_sample {
            series.push(counters(&engine, &driver));
            next_sample = now + series_step;
        }
        if now >= next_progress {
            progress(now - start.user_blocks);
            next_progress = now + (1 << 20);
        }
    }
    let elapsed_s = t0.elapsed().as_secs_f64();
    let end = counters(&engine, &driver);
    series.push(end);
    if engine.pending_requests() > 0 {
        return Err(SimError::Invalid(
            "writes were left waiting for space: the array is too small".into(),
        ));
    }
    Ok(SimReport {
        config: cfg.clone(),
        segments: segments as u32,
        start,
        warm: warm.unwrap_or(end),
        end,
        per_volume_warm,
        status: engine.status(),
        series,
        elapsed_s,
        workload: label.to_string(),
        snapshots_taken: snaps.taken,
        snapshots_deleted: snaps.deleted,
        flash: flash.map(|f| (flash_warm.unwrap_or_default(), f.stats())),
    })
}

/// An engine error of the run; running out of space with snapshots on says what
/// to change.
fn engine_error(e: lamina_core::EngineError, cfg: &SimConfig) -> SimError {
    match e {
        lamina_core::EngineError::NoSpace(why) if cfg.snapshots.is_some() => SimError::Invalid(
            format!("the snapshots keep more than the array holds ({why}): raise --overprovision, or keep fewer"),
        ),
        e => SimError::Engine(e),
    }
}

/// The snapshots a [`SnapshotPolicy`] keeps, per volume, oldest first.
struct Snapshots {
    /// Snapshot names start with it: no volume of the workload's does.
    prefix: String,
    next_at: u64,
    kept: Vec<std::collections::VecDeque<String>>,
    taken: u64,
    deleted: u64,
}

impl Snapshots {
    /// Submits a snapshot of every volume (one checkpoint records them all), then
    /// the deletion of those beyond `keep`.
    fn take(&mut self, engine: &mut Engine, volumes: &[VolumeSpec], keep: usize) {
        let token = Token { conn: 0, handle: 0 };
        let n = self.taken / volumes.len().max(1) as u64;
        for (i, (v, kept)) in volumes.iter().zip(&mut self.kept).enumerate() {
            let name = format!("{}{i}.{n}", self.prefix);
            engine.submit(
                token,
                Request::CreateSnapshot {
                    origin: v.name.clone(),
                    name: name.clone(),
                    writable: false,
                },
            );
            kept.push_back(name);
            self.taken += 1;
            while kept.len() > keep {
                let old = kept.pop_front().unwrap();
                engine.submit(token, Request::DeleteVolume { name: old });
                self.deleted += 1;
            }
        }
    }
}

/// Runs the engine's device operations until it asks for none, and takes its
/// replies: the first error among them, if any.
fn settle(
    engine: &mut Engine,
    driver: &mut Driver,
    replies: &mut Vec<lamina_core::Reply>,
) -> Result<(), lamina_core::EngineError> {
    driver.run(engine);
    engine.drain_replies(replies);
    replies.drain(..).try_for_each(|r| r.result)
}

fn submit(engine: &mut Engine, volume: VolumeId, op: Op) {
    let token = Token { conn: 0, handle: 0 };
    if op.trim {
        engine.submit(
            token,
            Request::Zero {
                volume,
                offset: op.lba * 4096,
                length: op.blocks as u64 * 4096,
                fua: false,
                allocate: false,
            },
        );
    } else {
        engine.submit(
            token,
            Request::WriteBlocks {
                volume,
                lba: lamina_core::Lba(op.lba),
                count: op.blocks,
            },
        );
    }
}

/// Address space and working set of each volume of a workload (a pre-pass).
/// Memory follows the blocks written, not the address space: a cloud volume's few
/// blocks at the far end of a large disk cost one chunk of 4096 blocks' bits.
pub fn measure(ops: &mut dyn Workload) -> Vec<(u64, u64)> {
    const CHUNK_BITS: u32 = 12;
    type Chunk = Box<[u64; 1 << (CHUNK_BITS - 6)]>;
    let mut seen: Vec<std::collections::HashMap<u64, Chunk>> = Vec::new();
    let mut max: Vec<u64> = Vec::new();
    while let Some(op) = ops.next_op() {
        let v = op.volume as usize;
        if v >= seen.len() {
            seen.resize_with(v + 1, Default::default);
            max.resize(v + 1, 0);
        }
        let end = op.lba.saturating_add(op.blocks as u64);
        max[v] = max[v].max(end);
        if op.trim {
            continue;
        }
        for b in op.lba..end {
            let chunk = seen[v]
                .entry(b >> CHUNK_BITS)
                .or_insert_with(|| Box::new([0; 1 << (CHUNK_BITS - 6)]));
            let i = (b & ((1 << CHUNK_BITS) - 1)) as usize;
            chunk[i / 64] |= 1 << (i % 64);
        }
    }
    seen.iter()
        .zip(max)
        .map(|(s, m)| {
            let blocks = s
                .values()
                .flat_map(|c| c.iter())
                .map(|w| w.count_ones() as u64);
            (m, blocks.sum())
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Ops(std::vec::IntoIter<Op>);
    impl Workload for Ops {
        fn next_op(&mut self) -> Option<Op> {
            self.0.next()
        }
    }

    /// Rolling snapshots: one of the volume each interval, the newest `keep` kept
    /// and served from the same engine, what only they map counted, and policies
    /// that cannot be kept refused with the reason.
    #[test]
    fn rolling_snapshots_are_taken_kept_and_deleted() {
        let cfg = SimConfig {
            segment_blocks: 256,
            write_unit_blocks: 32,
            snapshots: Some(SnapshotPolicy {
                every_blocks: 2048,
                keep: 4,
            }),
            ..Default::default()
        };
        let blocks = 8192;
        let r = run_synthetic(
            "uniform",
            &Pattern::Uniform,
            blocks,
            4 * blocks,
            1,
            &cfg,
            &mut |_| {},
        )
        .unwrap();
        // The fill and the writes: 5 x 8192 user blocks, a snapshot every 2048.
        assert_eq!(r.snapshots_taken, 5 * blocks / 2048);
        assert_eq!(r.snapshots_deleted, r.snapshots_taken - 4);
        let snaps: Vec<&str> = r
            .status
            .volumes
            .iter()
            .filter(|v| v.snapshot)
            .map(|v| v.name.as_str())
            .collect();
        assert_eq!(snaps, ["snap0.16", "snap0.17", "snap0.18", "snap0.19"]);
        let held = r.snapshot_held_blocks();
        assert!(held > 0 && held <= 4 * 2048, "{held}");
        assert!(r.end.gc_blocks > r.start.gc_blocks, "GC ran");
        for keep in [0, MAX_SNAPSHOTS_KEPT + 1] {
            let cfg = SimConfig {
                snapshots: Some(SnapshotPolicy {
                    every_blocks: 2048,
                    keep,
                }),
                ..cfg.clone()
            };
            let err = run_synthetic(
                "uniform",
                &Pattern::Uniform,
                blocks,
                blocks,
                1,
                &cfg,
                &mut |_| {},
            )
            .unwrap_err()
            .to_string();
            assert!(err.contains("keep 1 to 62"), "{err}");
        }
    }

    /// The pre-pass counts distinct blocks per volume, and a block at the far end
    /// of a huge address space costs a chunk, not a bitmap of the whole space
    /// (which, at 2^40 blocks, could not be allocated).
    #[test]
    fn measure_counts_distinct_blocks_sparsely() {
        let op = |volume, lba, blocks, trim| Op {
            volume,
            lba,
            blocks,
            trim,
        };
        let mut ops = Ops(vec![
            op(0, 10, 4, false),
            op(0, 12, 4, false),
            op(1, 1 << 40, 2, false),
            op(1, 5, 1, false),
            op(0, 100, 50, true),
        ]
        .into_iter());
        assert_eq!(measure(&mut ops), vec![(150, 6), ((1 << 40) + 2, 3)]);
    }
}
