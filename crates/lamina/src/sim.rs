//! `lamina sim`: run the engine on a synthetic workload or a block trace, without
//! data, and report write amplification.

use anyhow::{bail, Context, Result};
use lamina_sim::plot::{line_chart, Line};
use lamina_sim::trace::{Format, TraceReader};
use lamina_sim::workload::Pattern;
use lamina_sim::{SimConfig, SimReport, VolumeSpec};
use serde_json::json;
use std::path::PathBuf;
use std::sync::Arc;

pub const SIM_ABOUT: &str = "\
Replay a synthetic workload or a block trace through the same engine `lamina serve`
runs (placement, classifiers, segments, GC), on a metadata-only device: no data bytes
are stored, so millions of block writes per second replay on one core.

Write amplification is reported as (user + GC-relocated blocks) / user blocks, the
figure the analytic models and SepBIT's simulator use; media write amplification
also counts unit headers, summaries and metadata. Synthetic workloads first fill the
volume sequentially, then issue --writes single-block writes; the measured window
starts after --warmup user blocks (default: the fill and the first half of the
writes). Traces are measured whole.

Over-provisioning is spare / user: the array gets (1 + OP) x the working set of data
space, plus the few segments the engine keeps out of circulation. A trace of several
volumes gets that per volume in whole segments (volumes never share one), and two
segments for the open streams of each volume past the first.

EXAMPLES
    lamina sim --workload uniform --overprovision 0.28
    lamina sim --workload hotcold:90/10 --classifier sepbit --policy cost-benefit
    lamina sim --trace msr-src1.csv.gz --trace-format msr --classifier sepbit --json
    lamina sim --workload uniform --sweep-overprovision 0.07,0.1,0.2,0.28,0.5 \\
               --sweep-policies greedy,cost-benefit --plot wa-vs-op.svg";

#[derive(clap::Args)]
pub struct SimArgs {
    /// Block trace to replay (gzip is detected).
    #[arg(long, value_name = "FILE", requires = "trace_format")]
    trace: Option<PathBuf>,
    /// Format of --trace: msr, alibaba, tencent, spc, blkparse, disksim (DiskSim
    /// ASCII), diskmon (Sysinternals DiskMon), wpa (Windows Performance Analyzer
    /// disk I/O export).
    #[arg(long, value_name = "FORMAT")]
    trace_format: Option<String>,
    /// Add this many 512-byte sectors to every offset of --trace (1 puts the
    /// clusters of a partition that starts at sector 63 on 4 KiB boundaries; a
    /// negative value subtracts).
    #[arg(
        long,
        value_name = "SECTORS",
        default_value_t = 0,
        allow_hyphen_values = true
    )]
    trace_shift: i64,
    /// Synthetic workload: uniform, zipf:THETA, hotcold:HOT/COLD (e.g. 90/10),
    /// sequential, mixed, sepbit-zipf:THETA[:PERIOD].
    #[arg(long, default_value = "uniform", conflicts_with = "trace")]
    workload: String,
    /// Volume size of a synthetic workload.
    #[arg(long, default_value = "4G", value_name = "SIZE")]
    capacity: String,
    /// Spare space as a fraction of the working set.
    #[arg(long, default_value_t = 0.28, value_name = "FRACTION")]
    overprovision: f64,
    /// Segment size.
    #[arg(long, default_value = "8M", value_name = "SIZE")]
    segment_size: String,
    /// Write unit size.
    #[arg(long, default_value = "512K", value_name = "SIZE")]
    write_unit: String,
    /// Single-block writes after the fill (default: 4 x the volume's blocks).
    #[arg(long, value_name = "N")]
    writes: Option<u64>,
    /// User blocks written before measuring.
    #[arg(long, value_name = "N")]
    warmup: Option<u64>,
    /// Victim policy: auto (as `lamina serve`: SepBIT's cost-benefit-sqrt while the
    /// classes separate, else whichever of greedy and cost-benefit-sqrt moves less in
    /// a miniature of the volume), cost-benefit-sqrt, greedy, cost-benefit,
    /// d-choices, salsa, lamina.
    #[arg(long, default_value_t = SimConfig::default().policy)]
    policy: String,
    /// Heat classifier: auto (SepBIT; as `lamina serve`), none, frequency, sepbit,
    /// lamina, oracle.
    #[arg(long, default_value_t = SimConfig::default().classifier)]
    classifier: String,
    /// Free segments below which GC runs.
    #[arg(long, default_value_t = 3, value_name = "SEGMENTS")]
    gc_start: usize,
    /// Also run GC while dead blocks exceed this fraction of the stored ones
    /// (SepBIT's trigger, which it runs at 0.15); give the array room with a larger
    /// --overprovision so that this, not free space, decides.
    #[arg(long, value_name = "FRACTION")]
    gc_garbage: Option<f64>,
    /// Size the array's reserve (segments kept for GC and metadata) as if the
    /// placement had N GC classes, so that placements are compared on arrays of the
    /// same physical size: with 1 every placement gets the array greedy without
    /// separation gets, and pays for its extra open segments out of the spare.
    #[arg(long, value_name = "N")]
    footprint_classes: Option<usize>,
    /// Wear-aware tie-breaking window (0 off, 0.1 = within 10% of the best).
    #[arg(long, default_value_t = 0.0)]
    wear_window: f64,
    /// Seed of synthetic workloads.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Run once per over-provisioning value (comma separated).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    sweep_overprovision: Vec<f64>,
    /// With --sweep-overprovision: policies (or policy/classifier pairs) to compare.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    sweep_policies: Vec<String>,
    /// Write an SVG plot: WA over time, or WA against over-provisioning for a sweep.
    #[arg(long, value_name = "FILE.svg")]
    plot: Option<PathBuf>,
    /// Replay the array's writes on an emulated SSD (as `lamina probe --emulate`:
    /// `qlc,iu=64K,page=64K`; its capacity follows the array) and report NAND
    /// bytes per user byte, device write amplification and erases.
    #[arg(long, value_name = "SPEC")]
    flash: Option<String>,
    /// Put a cache tier of this fraction of the array's segments (at least 16)
    /// in front of it (`array create --cache-device`): user writes land there and
    /// compaction moves them on. Reports the capacity tier's write amplification
    /// (blocks written to it per user block); `--flash` then emulates the
    /// capacity tier.
    #[arg(long, value_name = "FRACTION")]
    cache: Option<f64>,
    /// Take a read-only snapshot of every volume each SIZE of user writes to the
    /// array (a rolling schedule, as zfs-auto-snapshot or sanoid keep one): the
    /// blocks the volumes overwrite stay live in the snapshots, GC moves them, and
    /// each snapshot's checkpoint writes its map. The array's usable space is
    /// sized for the live data plus the most the kept snapshots can hold (N times
    /// SIZE, at most N copies of the working set), and --overprovision is the
    /// spare over that.
    #[arg(long, value_name = "SIZE", requires = "snapshot_keep")]
    snapshot_every: Option<String>,
    /// With --snapshot-every: the newest N snapshots of each volume are kept, the
    /// older ones deleted (1 to 62: a family holds 64 volumes at most).
    #[arg(long, value_name = "N", requires = "snapshot_every")]
    snapshot_keep: Option<usize>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(long)]
    quiet: bool,
}

struct Prepared {
    volumes: Vec<VolumeSpec>,
    label: String,
    oracle: Option<Vec<Arc<Vec<u64>>>>,
}

fn blocks_of(what: &str, s: &str) -> Result<u64> {
    let b = crate::size_arg(what, s)?;
    if b == 0 || b % 4096 != 0 {
        return Err(
            crate::Usage(format!("{what} {s} must be a positive multiple of 4 KiB")).into(),
        );
    }
    Ok(b / 4096)
}

impl SimArgs {
    fn open_trace(&self) -> Result<TraceReader> {
        let path = self.trace.as_ref().unwrap();
        let format = Format::parse(self.trace_format.as_deref().unwrap_or(""))
            .map_err(anyhow::Error::msg)?;
        let shift = self
            .trace_shift
            .checked_mul(512)
            .ok_or_else(|| anyhow::anyhow!("--trace-shift {} is too large", self.trace_shift))?;
        Ok(TraceReader::open(path, format)?.with_shift(shift))
    }

    /// A trace's volumes and, for the oracle, its next-write tables (pre-passes).
    fn prepare_trace(&self, classifier: &str) -> Result<Prepared> {
        let mut r = self.open_trace()?;
        let sizes = lamina_sim::measure(&mut r);
        if let Some(e) = r.error.take() {
            return Err(e.into());
        }
        if r.garbage > 0 {
            eprintln!(
                "lamina sim: {} records of {} skipped: their offset or length does not fit 64 bits in bytes",
                r.garbage,
                self.trace.as_ref().unwrap().display()
            );
        }
        let names = r.volume_names().to_vec();
        let volumes: Vec<VolumeSpec> = sizes
            .iter()
            .zip(&names)
            .map(|(&(blocks, ws), name)| VolumeSpec {
                name: sanitize(name),
                blocks,
                working_set: ws,
            })
            .collect();
        let oracle = (classifier == "oracle").then(|| -> Result<_> {
            let mut r = self.open_trace()?;
            Ok(lamina_sim::next_writes(&mut r, volumes.len())
                .into_iter()
                .map(Arc::new)
                .collect())
        });
        Ok(Prepared {
            volumes,
            label: self.trace.as_ref().unwrap().display().to_string(),
            oracle: oracle.transpose()?,
        })
    }

    fn config(&self, op: f64, policy: &str, classifier: &str, warmup: u64) -> Result<SimConfig> {
        let segment_blocks = blocks_of("segment size", &self.segment_size)?;
        let write_unit_blocks = blocks_of("write unit", &self.write_unit)?;
        if segment_blocks > u32::MAX as u64 || write_unit_blocks > 4096 {
            bail!("segment or write unit too large");
        }
        if let Some(g) = self.gc_garbage {
            if !(g > 0.0 && g < 1.0) {
                bail!("--gc-garbage {g} must be a fraction between 0 and 1 (SepBIT uses 0.15)");
            }
        }
        Ok(SimConfig {
            segment_blocks: segment_blocks as u32,
            write_unit_blocks: write_unit_blocks as u32,
            overprovision: op,
            classifier: classifier.into(),
            policy: policy.into(),
            warmup_blocks: warmup,
            wear_window: self.wear_window,
            gc_start_segments: self.gc_start,
            gc_garbage_ratio: self.gc_garbage,
            footprint_classes: self.footprint_classes,
            flash: self
                .flash
                .as_deref()
                .map(crate::bench::parse_flash_spec)
                .transpose()?,
            cache: self.cache,
            snapshots: match (&self.snapshot_every, self.snapshot_keep) {
                (Some(every), Some(keep)) => Some(lamina_sim::SnapshotPolicy {
                    every_blocks: blocks_of("--snapshot-every", every)?,
                    keep,
                }),
                _ => None,
            },
            ..Default::default()
        })
    }

    fn run_one(&self, op: f64, policy: &str, classifier: &str) -> Result<SimReport> {
        let cfg = self.config(op, policy, classifier, self.warmup.unwrap_or(0))?;
        let bar = (!self.quiet && !self.json).then(|| {
            let total: u64 = if self.trace.is_none() {
                let blocks = blocks_of("capacity", &self.capacity).unwrap_or(0);
                blocks + self.writes.unwrap_or(4 * blocks)
            } else {
                0
            };
            let b = if total > 0 {
                indicatif::ProgressBar::new(total)
            } else {
                indicatif::ProgressBar::new_spinner()
            };
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} {msg} [{elapsed_precise}] {wide_bar} {human_pos}/{human_len} blocks ({per_sec}, eta {eta})",
                )
                .unwrap(),
            );
            b.set_message(format!("{policy}/{classifier} op {op}"));
            b
        });
        let mut progress = |n: u64| {
            if let Some(b) = &bar {
                b.set_position(n);
            }
        };
        let r = if self.trace.is_some() {
            let p = self.prepare_trace(classifier)?;
            lamina_sim::simulate(
                &mut self.open_trace()?,
                &p.volumes,
                &cfg,
                p.oracle,
                &p.label,
                &mut progress,
            )
        } else {
            let pattern = Pattern::parse(&self.workload).map_err(anyhow::Error::msg)?;
            let blocks = blocks_of("capacity", &self.capacity)?;
            let writes = self.writes.unwrap_or(4 * blocks);
            lamina_sim::run_synthetic(
                &self.workload,
                &pattern,
                blocks,
                writes,
                self.seed,
                &cfg,
                &mut progress,
            )
        }
        .context("simulation failed")?;
        if let Some(b) = bar {
            b.finish_and_clear();
        }
        Ok(r)
    }
}

fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if c == '/' || c == '\0' { '_' } else { c })
        .take(64)
        .collect();
    if s.is_empty() {
        "volume".into()
    } else {
        s
    }
}

fn print_report(r: &SimReport) {
    println!(
        "{}: policy {}, classifier {}, over-provisioning {:.0}%, {} segments of {} blocks",
        r.workload,
        r.config.policy,
        r.config.classifier,
        r.config.overprovision * 100.0,
        r.segments,
        r.config.segment_blocks
    );
    println!(
        "  write amplification {:.3} (measured after {} warm-up blocks; whole run {:.3}; media {:.3})",
        r.write_amplification(),
        r.config.warmup_blocks,
        r.write_amplification_total(),
        r.media_write_amplification()
    );
    println!(
        "  user blocks {}, GC blocks {}, media blocks {}, {} victims; {:.2} M blocks/s",
        r.end.user_blocks - r.start.user_blocks,
        r.end.gc_blocks - r.start.gc_blocks,
        r.end.media_blocks - r.start.media_blocks,
        r.status.gc_victims,
        r.blocks_per_second() / 1e6
    );
    if let Some(c) = &r.status.cache {
        println!(
            "  cache tier: {} segments; capacity tier write amplification {:.3} (measured window); compaction moved {} blocks from {} segments",
            c.segment_count,
            r.capacity_write_amplification(),
            c.compacted_bytes / 4096,
            c.compactions
        );
    }
    if let Some(p) = r.config.snapshots {
        println!(
            "  snapshots: one of each volume every {} user blocks, {} kept; {} taken, {} deleted; at the end they alone hold {} blocks",
            p.every_blocks,
            p.keep,
            r.snapshots_taken,
            r.snapshots_deleted,
            r.snapshot_held_blocks()
        );
    }
    if let Some(f) = r.flash_json() {
        println!(
            "  emulated SSD: {:.3} NAND bytes per user byte (device write amplification {:.3}), {} erases, erase count max {} mean {:.1}",
            f["nand_bytes_per_user_byte"].as_f64().unwrap_or(0.0),
            f["device_write_amplification"].as_f64().unwrap_or(0.0),
            f["erases"],
            f["max_erase_count"],
            f["mean_erase_count"].as_f64().unwrap_or(0.0)
        );
    }
    if r.workload == "uniform" {
        // Under the garbage trigger GC holds the array at 1/(1 - ratio) of the live
        // data when that is less than what over-provisioning gives.
        let op = r
            .config
            .gc_garbage_ratio
            .map_or(r.config.overprovision, |g| {
                r.config.overprovision.min(1.0 / (1.0 - g) - 1.0)
            });
        println!(
            "  model (uniform, greedy, large segments): {:.3}",
            lamina_sim::model_wa(op)
        );
    }
    let j = r.to_json();
    for v in j["volumes"].as_array().unwrap() {
        println!(
            "  volume {}: {} blocks, WA {}",
            v["name"].as_str().unwrap_or(""),
            v["blocks"],
            v["write_amplification"]
                .as_f64()
                .map_or("-".into(), |w| format!("{w:.3}"))
        );
        for c in v["classes"].as_array().unwrap() {
            println!(
                "    class {:>2} {:<4} written {:>12} relocated out {:>12} victims {:>8} live {:>10}",
                c["class"], c["kind"].as_str().unwrap_or(""), c["blocks_written"], c["blocks_relocated_out"], c["victims"], c["live_blocks"]
            );
        }
    }
}

pub fn run(a: SimArgs) -> Result<()> {
    if a.trace.is_some() != a.trace_format.is_some() {
        bail!("--trace and --trace-format go together");
    }
    if a.sweep_overprovision.is_empty() {
        let r = a.run_one(a.overprovision, &a.policy, &a.classifier)?;
        if let Some(path) = &a.plot {
            let pts: Vec<(f64, f64)> = r.to_json()["series"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    (
                        p["user_blocks"].as_f64().unwrap(),
                        p["write_amplification"].as_f64().unwrap(),
                    )
                })
                .collect();
            let svg = line_chart(
                &format!("{}: write amplification over time", r.workload),
                "user blocks written",
                "write amplification (window)",
                &[Line {
                    label: format!("{}/{}", r.config.policy, r.config.classifier),
                    points: pts,
                    dashed: false,
                }],
            );
            std::fs::write(path, svg)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
        if a.json {
            println!("{}", serde_json::to_string_pretty(&r.to_json())?);
        } else {
            print_report(&r);
        }
        return Ok(());
    }
    // A sweep: every policy (or policy/classifier) at every over-provisioning.
    let combos: Vec<(String, String)> = if a.sweep_policies.is_empty() {
        vec![(a.policy.clone(), a.classifier.clone())]
    } else {
        a.sweep_policies
            .iter()
            .map(|s| match s.split_once('/') {
                Some((p, c)) => (p.to_string(), c.to_string()),
                None => (s.clone(), a.classifier.clone()),
            })
            .collect()
    };
    let mut rows = Vec::new();
    let mut lines = Vec::new();
    for (policy, classifier) in &combos {
        let mut pts = Vec::new();
        for &op in &a.sweep_overprovision {
            let r = a.run_one(op, policy, classifier)?;
            pts.push((op, r.write_amplification()));
            rows.push(json!({
                "policy": policy, "classifier": classifier, "overprovision": op,
                "write_amplification": r.write_amplification(),
                "media_write_amplification": r.media_write_amplification(),
                "model": lamina_sim::model_wa(op),
                "blocks_per_second": r.blocks_per_second(),
            }));
            if !a.json {
                println!(
                    "{policy:<18} {classifier:<10} op {:>5.2}  WA {:.3}  (model, uniform greedy: {:.3})  {:.2} M blocks/s",
                    op,
                    r.write_amplification(),
                    lamina_sim::model_wa(op),
                    r.blocks_per_second() / 1e6
                );
            }
        }
        lines.push(Line {
            label: format!("{policy}/{classifier}"),
            points: pts,
            dashed: false,
        });
    }
    if a.workload == "uniform" && a.trace.is_none() {
        lines.push(Line {
            label: "model: greedy, uniform".into(),
            points: a
                .sweep_overprovision
                .iter()
                .map(|&op| (op, lamina_sim::model_wa(op)))
                .collect(),
            dashed: true,
        });
    }
    if let Some(path) = &a.plot {
        let svg = line_chart(
            &format!(
                "{}: write amplification against over-provisioning",
                a.trace
                    .as_ref()
                    .map_or(a.workload.clone(), |t| t.display().to_string())
            ),
            "over-provisioning (spare / user)",
            "write amplification",
            &lines,
        );
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({ "sweep": rows }))?
        );
    }
    Ok(())
}
