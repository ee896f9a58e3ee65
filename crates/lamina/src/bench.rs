//! `lamina bench`: yardsticks the benchmarks in bench/ measure Lamina against.
//!
//! `lamina bench raid5-rmw` serves a classic RAID-5 (read-modify-write for small
//! writes, as Linux md does) over the same kind of devices through the same NBD
//! server, so that fio can run the same job against it and against a SAID5 array.
//! On SIGINT it prints what it read and wrote as JSON.

use anyhow::{Context, Result};
use crossbeam_channel::{unbounded, Sender};
use lamina_device::file::{FileDevice, OpenMode as DevMode};
use lamina_device::raid5::Raid5Rmw;
use lamina_device::BlockDevice;
use lamina_nbd::server::{Listener, ReplySink};
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

#[derive(clap::Subcommand)]
pub enum BenchCmd {
    /// Serve a RAID-5 with read-modify-write over NBD (export "raid5") until
    /// SIGINT, then print device bytes read and written as JSON.
    Raid5Rmw {
        /// Member files (created sparse with PATH:SIZE).
        #[arg(long = "device", required = true, value_name = "PATH[:SIZE]")]
        devices: Vec<String>,
        /// Unix socket to listen on.
        #[arg(long)]
        unix: PathBuf,
        /// Chunk per member per stripe.
        #[arg(long, default_value = "64K")]
        chunk: String,
        /// Threads executing writes (the RAID's queue depth).
        #[arg(long, default_value_t = 8)]
        threads: usize,
    },
    /// SALSA 5.1.2: full-device passes of 4 KiB random writes on an emulated SSD,
    /// raw and through Lamina (the real engine, in this process): NAND writes and
    /// erases of each.
    Endurance {
        /// Capacity of the emulated SSD.
        #[arg(long, default_value = "256M")]
        capacity: String,
        /// Full passes of 4 KiB random writes over the user capacity.
        #[arg(long, default_value_t = 10)]
        passes: u32,
        /// Lamina's own spare space (spare / user).
        #[arg(long, default_value_t = 0.2)]
        overprovision: f64,
        /// NAND cell type: slc, mlc, tlc, qlc.
        #[arg(long, default_value = "tlc")]
        cell: String,
        /// FTL indirection unit.
        #[arg(long, default_value = "4K")]
        iu: String,
        /// Where the 4 KiB writes go: uniform, zipf:THETA, hotcold:H/C (as `lamina sim`).
        #[arg(long, default_value = "uniform")]
        workload: String,
        /// Also draw NAND bytes per user byte in each pass (SVG).
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// CSAL (issue 14): 4 KiB writes over several volumes on an emulated QLC SSD
    /// with a large indirection unit, and what a small fast cache in front of it
    /// does: NAND bytes the QLC programs per user byte and its erases, for the raw
    /// QLC, an LRU write-back block cache on an SLC SSD in front of it (what
    /// dm-cache and Open-CAS do), Lamina on the QLC, and Lamina with a cache
    /// tier on the same SLC SSD.
    Csal {
        /// Capacity of the QLC SSD.
        #[arg(long, default_value = "1G")]
        capacity: String,
        /// Capacity of the SLC SSD in front of it (the cache).
        #[arg(long, default_value = "80M")]
        cache: String,
        /// The QLC SSD's indirection unit (CSAL: 64 KiB).
        #[arg(long, default_value = "64K")]
        iu: String,
        /// Where the 4 KiB writes go over the volumes' space: uniform, zipf:THETA,
        /// hotcold:H/C (as `lamina sim`).
        #[arg(long, default_value = "zipf:1.2")]
        workload: String,
        /// Passes of writes over the user capacity, after it is filled once.
        #[arg(long, default_value_t = 4)]
        passes: u32,
        /// Volumes the capacity is divided into (CSAL: one per VM).
        #[arg(long, default_value_t = 8)]
        volumes: u32,
        /// Lamina's own spare space (spare / user).
        #[arg(long, default_value_t = 0.2)]
        overprovision: f64,
        #[arg(long)]
        json: bool,
    },
    /// SALSA 5.1.1: 4 KiB random reads and writes at queue depths 1 to 32 on
    /// emulated TLC SSDs: RAID-0 and RAID-5 (read-modify-write) on the drives
    /// against Lamina SAID5 on the same drives; IOPS and latency from the drives'
    /// timing model.
    Iops {
        /// Drives in the array.
        #[arg(long, default_value_t = 5)]
        ssds: usize,
        /// Capacity of each drive.
        #[arg(long, default_value = "512M")]
        capacity: String,
        /// Reads in percent of the requests.
        #[arg(long, default_value_t = 80)]
        read_percent: u32,
        /// Queue depths (comma-separated).
        #[arg(long, default_value = "1,2,4,8,16,32", value_delimiter = ',')]
        depths: Vec<usize>,
        /// Requests timed at each depth.
        #[arg(long, default_value_t = 100000)]
        requests: usize,
        /// Lamina's spare space (spare / user).
        #[arg(long, default_value_t = 0.25)]
        overprovision: f64,
        /// RAID chunk of the raw arrays.
        #[arg(long, default_value = "64K")]
        chunk: String,
        /// Also draw IOPS against queue depth (SVG).
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
    /// SALSA 3.1, geometry-aware placement: on an emulated host-managed SMR disk,
    /// a tenth of the volume is read over and over while the rest is rewritten;
    /// then the read-hot tenth is read back, with geometry-aware placement on and
    /// off: read bandwidth from the disk's timing model.
    Geometry {
        /// Capacity of the disk.
        #[arg(long, default_value = "4G")]
        capacity: String,
        /// Zone size (a Lamina segment is one zone).
        #[arg(long, default_value = "64M")]
        zone: String,
        /// Size of each read and write.
        #[arg(long, default_value = "64K")]
        io: String,
        /// Rounds of (read the hot tenth, rewrite an eighth of the rest).
        #[arg(long, default_value_t = 24)]
        rounds: u32,
        #[arg(long)]
        json: bool,
    },
    /// Parity throughput of one stripe row: P alone (SAID5), P and Q (SAID6) with
    /// Q by words and by the table-driven reference, and the rebuild of lost
    /// members; in GB/s of data members' bytes, on this CPU.
    Parity {
        /// Data members in a row.
        #[arg(long, default_value_t = 6)]
        members: usize,
        /// Bytes of each member in a row (a segment's chunk).
        #[arg(long, default_value = "64K")]
        chunk: String,
        /// Seconds each measurement runs.
        #[arg(long, default_value_t = 1.0)]
        seconds: f64,
        #[arg(long)]
        json: bool,
    },
    /// SALSA 5.3: sequential then random writes through Lamina on an emulated
    /// host-managed SMR disk, against the same writes on an emulated drive-managed
    /// SMR disk with a media cache: steady-state bandwidth from the disks' timing
    /// models (virtual time), and the ideal sequential bandwidth of the zones.
    Smr {
        /// Capacity of each disk.
        #[arg(long, default_value = "4G")]
        capacity: String,
        /// Zone size (a Lamina segment is one zone).
        #[arg(long, default_value = "64M")]
        zone: String,
        /// The drive-managed disk's media cache, in percent of its capacity
        /// (a comma-separated list compares several).
        #[arg(long, default_value = "1", value_delimiter = ',')]
        cache_percent: Vec<f64>,
        /// Size of each write.
        #[arg(long, default_value = "64K")]
        io: String,
        /// Random passes over the volume after the sequential one.
        #[arg(long, default_value_t = 2)]
        passes: u32,
        /// Lamina's spare space (spare / user).
        #[arg(long, default_value_t = 0.25)]
        overprovision: f64,
        /// Lamina's write unit.
        #[arg(long, default_value = "4M")]
        write_unit: String,
        /// GC reads across gaps of dead blocks up to this size (`[engine]
        /// gc_read_gap`).
        #[arg(long, default_value = "4M")]
        gc_read_gap: String,
        /// Also draw random-write bandwidth against the media cache size (SVG).
        #[arg(long, value_name = "FILE")]
        plot: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

struct DeviceBackend {
    dev: Arc<dyn BlockDevice>,
    work: Sender<(Command, u64, Arc<ReplySink>)>,
}

impl Backend for DeviceBackend {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        vec![self.info()]
    }
    fn open_export(&self, _: &str) -> Option<((), ExportInfo)> {
        Some(((), self.info()))
    }
    fn read(&self, _: &(), offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        self.dev
            .read_at(buf, offset)
            .map_err(|_| lamina_nbd::proto::EIO)
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        let _ = self.work.send((cmd, handle, reply.clone()));
    }
}

impl DeviceBackend {
    fn info(&self) -> ExportInfo {
        ExportInfo {
            name: "raid5".into(),
            description: self.dev.describe(),
            size: self.dev.size_bytes(),
        }
    }
}

pub fn run(cmd: BenchCmd) -> Result<()> {
    let (devices, unix, chunk, threads) = match cmd {
        BenchCmd::Raid5Rmw {
            devices,
            unix,
            chunk,
            threads,
        } => (devices, unix, chunk, threads),
        BenchCmd::Iops {
            ssds,
            capacity,
            read_percent,
            depths,
            requests,
            overprovision,
            chunk,
            plot,
            json,
        } => {
            let size = |s: &str| crate::size_arg("size", s);
            return iops(
                ssds,
                size(&capacity)?,
                read_percent,
                &depths,
                requests,
                overprovision,
                size(&chunk)?,
                plot.as_deref(),
                json,
            );
        }
        BenchCmd::Geometry {
            capacity,
            zone,
            io,
            rounds,
            json,
        } => {
            let size = |s: &str| crate::size_arg("size", s);
            return geometry(size(&capacity)?, size(&zone)?, size(&io)?, rounds, json);
        }
        BenchCmd::Parity {
            members,
            chunk,
            seconds,
            json,
        } => {
            let chunk = crate::size_arg("--chunk", &chunk)?;
            return parity(members, chunk, seconds, json);
        }
        BenchCmd::Smr {
            capacity,
            zone,
            cache_percent,
            io,
            passes,
            overprovision,
            write_unit,
            gc_read_gap,
            plot,
            json,
        } => {
            return smr(
                &capacity,
                &zone,
                &cache_percent,
                &io,
                passes,
                overprovision,
                (&write_unit, &gc_read_gap),
                plot.as_deref(),
                json,
            )
        }
        BenchCmd::Csal {
            capacity,
            cache,
            iu,
            workload,
            passes,
            volumes,
            overprovision,
            json,
        } => {
            let size = |what: &str, s: &str| crate::size_arg(what, s);
            return crate::csal::run(&crate::csal::CsalArgs {
                capacity: size("--capacity", &capacity)?,
                cache: size("--cache", &cache)?,
                iu: size("--iu", &iu)?,
                workload,
                passes,
                volumes,
                overprovision,
                json,
            });
        }
        BenchCmd::Endurance {
            capacity,
            passes,
            overprovision,
            cell,
            iu,
            workload,
            plot,
            json,
        } => {
            return endurance(
                &capacity,
                passes,
                overprovision,
                &cell,
                &iu,
                &workload,
                plot.as_deref(),
                json,
            )
        }
    };
    let mut members: Vec<Arc<dyn BlockDevice>> = Vec::new();
    for d in &devices {
        let (p, size) = crate::parse_device(d)?;
        let dev = match size {
            Some(s) if !p.exists() => FileDevice::create_sparse(&p, s)?,
            _ => FileDevice::open(&p, DevMode::ReadWrite)?,
        };
        members.push(Arc::new(dev));
    }
    let chunk = crate::size_arg("--chunk", &chunk)?;
    let raid = Arc::new(Raid5Rmw::new(members, chunk)?);
    let (tx, rx) = unbounded::<(Command, u64, Arc<ReplySink>)>();
    for _ in 0..threads.max(1) {
        let rx = rx.clone();
        let raid = raid.clone();
        std::thread::spawn(move || {
            while let Ok((cmd, handle, reply)) = rx.recv() {
                let (r, buf) = match cmd {
                    Command::Write { offset, data, .. } => {
                        (raid.write_at(&data, offset), Some(data))
                    }
                    Command::Zero { offset, length, .. } => {
                        (raid.write_at(&vec![0u8; length as usize], offset), None)
                    }
                    Command::Flush => (raid.sync(), None),
                };
                reply.complete(&mut vec![Completion {
                    handle,
                    error: if r.is_ok() { 0 } else { lamina_nbd::proto::EIO },
                    buf,
                }]);
            }
        });
    }
    let set = crate::serve::block_signals();
    let _ = std::fs::remove_file(&unix);
    let l = std::os::unix::net::UnixListener::bind(&unix)
        .with_context(|| format!("cannot listen on {}", unix.display()))?;
    let backend = Arc::new(DeviceBackend {
        dev: raid.clone(),
        work: tx,
    });
    let stop = Arc::new(AtomicBool::new(false));
    {
        let stop = stop.clone();
        std::thread::spawn(move || lamina_nbd::serve(backend, Listener::Unix(l), None, stop));
    }
    crate::serve::wait_for_signal(&set);
    stop.store(true, Ordering::SeqCst);
    println!(
        "{}",
        serde_json::json!({
            "user_bytes_written": raid.user_bytes_written.load(Ordering::Relaxed),
            "device_bytes_written": raid.bytes_written.load(Ordering::Relaxed),
            "device_bytes_read": raid.bytes_read.load(Ordering::Relaxed),
        })
    );
    let _ = std::fs::remove_file(&unix);
    Ok(())
}

/// The 4 KiB writes of an endurance run over `blocks` blocks after a sequential
/// fill: `passes x blocks` of them, placed by `pattern` (seeded, reproducible).
pub(crate) fn writes(pattern: &str, blocks: u64, passes: u32) -> Result<impl Iterator<Item = u64>> {
    use lamina_sim::workload::{Pattern, Synthetic, Workload};
    let p = Pattern::parse(pattern).map_err(anyhow::Error::msg)?;
    let mut w = Synthetic::new(p, blocks, passes as u64 * blocks, 42, false);
    Ok(std::iter::from_fn(move || w.next_op().map(|o| o.lba)))
}

/// A raw run: the SSD filled over `blocks`, then the workload's writes over them;
/// returns (NAND bytes per host byte, erases) of the writes after the fill.
pub(crate) fn raw_run(
    cfg: &lamina_device::flash::FlashConfig,
    blocks: u64,
    workload: &str,
    passes: u32,
) -> Result<(f64, u64, Vec<f64>)> {
    use lamina_device::flash::{Flash, FlashOp};
    let bs = 4096;
    let raw = Flash::new(
        Arc::new(lamina_device::sparse::SparseDevice::new(
            "raw",
            cfg.capacity_bytes,
        )),
        cfg.clone(),
    )?;
    let put = |b: u64| {
        raw.submit(
            FlashOp::Write {
                offset: b * bs,
                len: bs,
            },
            0,
        )
    };
    (0..blocks).for_each(|b| {
        put(b);
    });
    let a = raw.stats();
    let mut per_pass = PerPass::new(blocks, a.nand_bytes_programmed);
    for b in writes(workload, blocks, passes)? {
        put(b);
        per_pass.tick(|| raw.stats().nand_bytes_programmed);
    }
    let z = raw.stats();
    let wa = (z.nand_bytes_programmed - a.nand_bytes_programmed) as f64
        / (z.host_bytes_written - a.host_bytes_written) as f64;
    Ok((wa, z.erases - a.erases, per_pass.wa))
}

/// NAND bytes programmed per user byte in each pass of `blocks` 4 KiB writes.
struct PerPass {
    blocks: u64,
    n: u64,
    last: u64,
    wa: Vec<f64>,
}

impl PerPass {
    fn new(blocks: u64, nand: u64) -> Self {
        PerPass {
            blocks,
            n: 0,
            last: nand,
            wa: Vec::new(),
        }
    }
    fn tick(&mut self, nand: impl FnOnce() -> u64) {
        self.n += 1;
        if self.n.is_multiple_of(self.blocks) {
            let now = nand();
            self.wa
                .push((now - self.last) as f64 / (self.blocks * 4096) as f64);
            self.last = now;
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn endurance(
    capacity: &str,
    passes: u32,
    op: f64,
    cell: &str,
    iu: &str,
    workload: &str,
    plot: Option<&std::path::Path>,
    json_out: bool,
) -> Result<()> {
    use lamina_device::flash::{Cell, Flash, FlashConfig};
    use lamina_device::mem::MemDevice;
    let capacity = crate::size_arg("--capacity", capacity)?;
    let iu = crate::size_arg("--iu", iu)?;
    let cfg = FlashConfig {
        capacity_bytes: capacity,
        iu_bytes: iu,
        // Large-unit drives have pages at least as large as their unit.
        page_bytes: iu.max(16 << 10),
        cell: Cell::parse(cell).ok_or_else(|| anyhow::anyhow!("unknown cell type {cell:?}"))?,
        ..Default::default()
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    let bs = 4096u64;
    // Raw: the host writes 4 KiB blocks over the whole device.
    let (wa_raw, erases_raw, pass_raw) = raw_run(&cfg, capacity / bs, workload, passes)?;
    // Lamina: an array on the same kind of SSD, a volume filling its usable space,
    // the same kind of writes through the engine.
    let ssd = Arc::new(Flash::new(
        Arc::new(MemDevice::new("ssd", capacity)),
        cfg.clone(),
    )?);
    let devs: Vec<Arc<dyn BlockDevice>> = vec![ssd.clone()];
    let params = lamina_core::FormatParams {
        name: "endurance".into(),
        segment_blocks: (cfg.block_bytes() / bs) as u32,
        write_unit_blocks: 64,
        overprovision: op,
        ..Default::default()
    };
    let mut l = Inline::new(devs, &params, Default::default())?;
    let vol_blocks = l.volume_bytes / bs;
    for b in 0..vol_blocks {
        l.write(b * bs, bs as usize);
    }
    let filled = ssd.stats();
    let mut pass_l = PerPass::new(vol_blocks, filled.nand_bytes_programmed);
    for b in writes(workload, vol_blocks, passes)? {
        l.write(b * bs, bs as usize);
        pass_l.tick(|| ssd.stats().nand_bytes_programmed);
    }
    l.flush()?;
    let host = l.e.status();
    let l = ssd.stats();
    // Raw again, written only over Lamina's user capacity: the same spare space left
    // to the drive's own FTL (a fair peer for the spare Lamina keeps).
    let (wa_raw2, erases_raw2, pass_raw2) = raw_run(&cfg, vol_blocks, workload, passes)?;
    if let Some(path) = plot {
        use lamina_sim::plot::{line_chart, Line};
        let line = |label: &str, v: &[f64]| Line {
            label: label.into(),
            points: v
                .iter()
                .enumerate()
                .map(|(i, &w)| (i as f64 + 1.0, w))
                .collect(),
            dashed: false,
        };
        let svg = line_chart(
            &format!(
                "{} {} SSD, IU {}, 4 KiB writes ({workload})",
                crate::size::human(capacity),
                cell.to_uppercase(),
                crate::size::human(iu)
            ),
            "pass over the user capacity",
            "NAND bytes programmed per user byte",
            &[
                line("raw SSD", &pass_raw),
                line("raw SSD, Lamina's capacity", &pass_raw2),
                line("Lamina on the SSD", &pass_l.wa),
            ],
        );
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let user_l = (passes as u64 * vol_blocks * bs) as f64;
    let nand_l = (l.nand_bytes_programmed - filled.nand_bytes_programmed) as f64;
    let wa_l = nand_l / user_l;
    let dev_wa = nand_l / (l.host_bytes_written - filled.host_bytes_written).max(1) as f64;
    let erases_l = l.erases - filled.erases;
    let per_gib = |erases: u64, user: f64| erases as f64 / (user / (1u64 << 30) as f64);
    let user_raw = (passes as u64 * capacity) as f64;
    let rows = serde_json::json!({
        "capacity_bytes": capacity,
        "passes": passes,
        "cell": cell,
        "workload": workload,
        "iu_bytes": iu,
        "raw": {"write_amplification": wa_raw, "erases": erases_raw},
        "raw_same_capacity": {"write_amplification": wa_raw2, "erases": erases_raw2},
        "lamina": {"user_capacity_bytes": vol_blocks * bs,
                   "write_amplification": wa_l, "erases": erases_l,
                   "host_write_amplification": host.write_amplification,
                   "device_write_amplification": dev_wa},
        "wear_ratio_raw_over_lamina": wa_raw / wa_l,
        "per_pass_write_amplification": {"raw": pass_raw, "raw_same_capacity": pass_raw2,
                                         "lamina": pass_l.wa},
        "lamina_drive_smart": l.smart(cfg.cell).into_iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::String(v)))
            .collect::<serde_json::Map<_, _>>(),
    });
    if json_out {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let human = crate::size::human;
    println!("| | user capacity | NAND bytes per user byte | erases per GiB written |");
    println!("|---|---:|---:|---:|");
    println!(
        "| raw SSD | {} | {wa_raw:.2} | {:.0} |",
        human(capacity),
        per_gib(erases_raw, user_raw)
    );
    println!(
        "| raw SSD, written over the same capacity as Lamina | {} | {wa_raw2:.2} | {:.0} |",
        human(vol_blocks * bs),
        per_gib(erases_raw2, user_l)
    );
    println!(
        "| Lamina on the SSD | {} | {wa_l:.2} | {:.0} |",
        human(vol_blocks * bs),
        per_gib(erases_l, user_l)
    );
    println!(
        "\nLamina: {:.1}x less NAND wear per user byte than the raw SSD (host WA {:.2} x device WA {dev_wa:.2})",
        wa_raw / wa_l,
        host.write_amplification.unwrap_or(0.0)
    );
    println!("\nSMART-like report of the SSD under Lamina (whole run, fill included):");
    for (k, v) in l.smart(cfg.cell) {
        println!("    {k:<24} {v}");
    }
    Ok(())
}

/// An engine in this process on `devs` (formatted with `params`) with one volume
/// `v` filling its usable space, driven by writes run inline every 64 requests.
pub(crate) struct Inline {
    pub(crate) e: lamina_core::Engine,
    vols: Vec<lamina_core::VolumeId>,
    /// Bytes of each volume.
    pub(crate) volume_bytes: u64,
    n: u64,
    replies: Vec<lamina_core::Reply>,
}

impl Inline {
    pub(crate) fn new(
        devs: Vec<Arc<dyn BlockDevice>>,
        params: &lamina_core::FormatParams,
        cfg: lamina_core::EngineConfig,
    ) -> Result<Self> {
        Self::with_volumes(devs, params, cfg, 1)
    }

    /// As [`Inline::new`], with the usable space divided among `n` volumes
    /// (whole MiB each).
    pub(crate) fn with_volumes(
        devs: Vec<Arc<dyn BlockDevice>>,
        params: &lamina_core::FormatParams,
        cfg: lamina_core::EngineConfig,
        n: u32,
    ) -> Result<Self> {
        let uuids: Vec<[u8; 16]> = (0..devs.len()).map(|i| [i as u8 + 2; 16]).collect();
        lamina_core::format(&devs, params, [1; 16], &uuids, 0)?;
        // No clock runs here: released segments are discarded as they are released,
        // so that the emulated drive hears of every one (SALSA's setup).
        let cfg = lamina_core::EngineConfig {
            discard_delay_ms: 0,
            ..cfg
        };
        let (e, _) = lamina_core::open(devs, cfg, lamina_core::OpenMode::ReadWrite)?;
        let volume_bytes = e.status().usable_bytes / n.max(1) as u64 / (1 << 20) * (1 << 20);
        let mut l = Inline {
            e,
            vols: Vec::new(),
            volume_bytes,
            n: 0,
            replies: Vec::new(),
        };
        for i in 0..n.max(1) {
            let name = if i == 0 { "v".into() } else { format!("v{i}") };
            l.call(lamina_core::Request::CreateVolume {
                name: name.clone(),
                size_bytes: volume_bytes,
            })?;
            let id = l.e.shared().volume(&name).unwrap().id;
            l.vols.push(id);
        }
        Ok(l)
    }

    fn call(&mut self, req: lamina_core::Request) -> Result<()> {
        let t = lamina_core::Token { conn: 1, handle: 1 };
        let r = lamina_core::call_inline(&mut self.e, t, req, 100_000)
            .ok_or_else(|| anyhow::anyhow!("the engine did not answer"))?;
        Ok(r.result?)
    }

    /// Writes `len` bytes at `offset` and runs the engine until it is idle, so
    /// that what the engine does is done now.
    pub(crate) fn write_now(&mut self, offset: u64, len: usize) {
        self.write(offset, len);
        lamina_core::run_inline(&mut self.e);
        self.e.drain_replies(&mut self.replies);
        self.replies.clear();
    }

    /// Writes `len` bytes at `offset` of the first volume (contents vary per
    /// write).
    pub(crate) fn write(&mut self, offset: u64, len: usize) {
        self.write_to(0, offset, len)
    }

    /// Writes `len` bytes at `offset` of volume `i`.
    pub(crate) fn write_to(&mut self, i: usize, offset: u64, len: usize) {
        let req = lamina_core::Request::Write {
            volume: self.vols[i],
            offset,
            data: vec![(self.n % 251) as u8; len],
            fua: false,
        };
        let token = lamina_core::Token {
            conn: 2,
            handle: self.n,
        };
        self.e.submit(token, req);
        self.n += 1;
        if self.n.is_multiple_of(64) {
            lamina_core::run_inline(&mut self.e);
            self.e.drain_replies(&mut self.replies);
            self.replies.clear();
        }
    }

    pub(crate) fn flush(&mut self) -> Result<()> {
        self.call(lamina_core::Request::Flush)
    }
}

/// The offsets of `passes` uniform random passes of `io`-byte writes over
/// `bytes` (seeded).
fn random_offsets(bytes: u64, io: u64, passes: u32) -> impl Iterator<Item = u64> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::seed_from_u64(53);
    let slots = bytes / io;
    (0..passes as u64 * slots).map(move |_| rng.gen_range(0..slots) * io)
}

/// The host-managed SMR emulator `lamina bench smr` and `geometry` use: the one
/// `array create --zoned smr` makes (about 1% conventional zones, at least Lamina's
/// first megabyte, 128 open zones), with `zone`-byte zones.
fn hm_smr_config(capacity: u64, zone: u64) -> Result<lamina_device::zoned::ZonedConfig> {
    crate::devices::parse_zoned(&format!("smr,zone={zone}"), capacity)
}

/// Lamina, in this process, on an emulated host-managed SMR disk: `op` spare,
/// disk-sized write units of `unit` bytes (a seek costs as much as a few megabytes
/// of transfer), GC reading across gaps of dead blocks up to `gap` bytes rather
/// than seek around them.
fn lamina_on_hm_smr(
    zoned: lamina_device::zoned::ZonedConfig,
    capacity: u64,
    op: f64,
    unit: u64,
    gap: u64,
    cfg: lamina_core::EngineConfig,
) -> Result<(Arc<lamina_device::zoned::ZonedDevice>, Inline)> {
    let hm = Arc::new(lamina_device::zoned::ZonedDevice::new(
        Arc::new(lamina_device::mem::MemDevice::new("hm-smr", capacity)),
        zoned,
    )?);
    let params = lamina_core::FormatParams {
        name: "smr".into(),
        overprovision: op,
        write_unit_blocks: (unit / 4096) as u32,
        ..Default::default()
    };
    let cfg = lamina_core::EngineConfig {
        gc_read_gap_blocks: (gap / 4096) as u32,
        ..cfg
    };
    let l = Inline::new(vec![hm.clone() as Arc<dyn BlockDevice>], &params, cfg)?;
    Ok((hm, l))
}

/// One run of the geometry bench: (hot read MB/s, mean offset of the hot data
/// over the disk's size).
fn geometry_run(capacity: u64, zone: u64, io: u64, rounds: u32, on: bool) -> Result<(f64, f64)> {
    use rand::seq::SliceRandom;
    use rand::{Rng, SeedableRng};
    let cfg = lamina_core::EngineConfig {
        geometry_aware: Some(on),
        ..Default::default()
    };
    let (hm, mut l) = lamina_on_hm_smr(
        hm_smr_config(capacity, zone)?,
        capacity,
        0.25,
        4 << 20,
        4 << 20,
        cfg,
    )?;
    let extents = l.volume_bytes / io;
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    let mut all: Vec<u64> = (0..extents).collect();
    all.shuffle(&mut rng);
    let hot: Vec<u64> = all[..(extents / 10) as usize].to_vec();
    let mut is_hot = vec![false; extents as usize];
    for &h in &hot {
        is_hot[h as usize] = true;
    }
    for x in 0..extents {
        l.write(x * io, io as usize);
    }
    l.flush()?;
    let vol = l.e.shared().volume("v").unwrap();
    let mut buf = vec![0u8; io as usize];
    let mut read_hot = |l: &mut Inline, order: &[u64]| -> Result<()> {
        for &x in order {
            l.e.shared()
                .read(&vol, x * io, &mut buf)
                .map_err(|e| anyhow::anyhow!("read: {e:?}"))?;
        }
        Ok(())
    };
    for _ in 0..rounds {
        read_hot(&mut l, &hot)?;
        for _ in 0..extents / 8 {
            let x = loop {
                let x = rng.gen_range(0..extents);
                if !is_hot[x as usize] {
                    break x;
                }
            };
            l.write(x * io, io as usize);
        }
        l.flush()?;
    }
    let mut order = hot.clone();
    order.shuffle(&mut rng);
    let t0 = hm.clock_us();
    read_hot(&mut l, &order)?;
    let us = hm.clock_us() - t0;
    let bs = 4096u64;
    let mean = order
        .iter()
        .map(
            |&x| match lamina_core::map::decode(vol.map.load(lamina_core::Lba(x * io / bs))) {
                lamina_core::map::Entry::Device(p) => p.0 as f64 * bs as f64 / capacity as f64,
                _ => 0.0,
            },
        )
        .sum::<f64>()
        / order.len().max(1) as f64;
    Ok(((order.len() as u64 * io) as f64 / us.max(1) as f64, mean))
}

fn geometry(capacity: u64, zone: u64, io: u64, rounds: u32, json_out: bool) -> Result<()> {
    if io == 0 || !io.is_multiple_of(4096) {
        anyhow::bail!("the I/O size must be a multiple of 4 KiB");
    }
    let (on_mb, on_pos) = geometry_run(capacity, zone, io, rounds, true)?;
    let (off_mb, off_pos) = geometry_run(capacity, zone, io, rounds, false)?;
    let j = serde_json::json!({
        "capacity_bytes": capacity, "zone_bytes": zone, "io_bytes": io, "rounds": rounds,
        "geometry_aware": {"hot_read_mb_s": on_mb, "hot_mean_position": on_pos},
        "plain": {"hot_read_mb_s": off_mb, "hot_mean_position": off_pos},
        "speedup": on_mb / off_mb,
    });
    if json_out {
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(());
    }
    println!("| placement | read-hot data, mean position on the disk (0 = outer edge) | random {} reads of it, MB/s |", crate::size::human(io));
    println!("|---|---:|---:|");
    println!("| geometry-aware | {on_pos:.2} | {on_mb:.1} |");
    println!("| plain | {off_pos:.2} | {off_mb:.1} |");
    println!(
        "\ngeometry-aware placement: {:.2}x the read bandwidth of the read-hot data",
        on_mb / off_mb
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn smr(
    capacity: &str,
    zone: &str,
    cache_percents: &[f64],
    io: &str,
    passes: u32,
    op: f64,
    (unit, gap): (&str, &str),
    plot: Option<&std::path::Path>,
    json_out: bool,
) -> Result<()> {
    use lamina_device::dmsmr::{DmSmrConfig, DriveManagedSmr};
    use lamina_device::mem::NullDevice;
    use lamina_device::zoned::SmrTiming;
    let size = |s: &str| crate::size_arg("size", s);
    let (capacity, zone, io, unit, gap) = (
        size(capacity)?,
        size(zone)?,
        size(io)?,
        size(unit)?,
        size(gap)?,
    );
    if io == 0 || !io.is_multiple_of(4096) || zone % io != 0 {
        anyhow::bail!("the write size must be a multiple of 4 KiB dividing the zone size");
    }
    let hm_cfg = hm_smr_config(capacity, zone)?;
    let mbps = |bytes: u64, us: u64| bytes as f64 / us.max(1) as f64;
    // The ideal: every zone written front to back in `io` pieces, nothing else.
    let timing = SmrTiming {
        seek_us: hm_cfg.seek_us,
        rpm: hm_cfg.rpm,
        outer_mb_s: hm_cfg.outer_mb_s,
        size: capacity / zone * zone,
    };
    let conv = hm_cfg.conventional_zones as u64 * zone;
    let ideal = |bytes: u64| {
        let mut head = conv;
        let us: u64 = (0..bytes / io)
            .map(|i| timing.cost(&mut head, conv + i * io, io))
            .sum();
        mbps(bytes, us)
    };

    // Lamina on host-managed SMR: the real engine, in this process.
    let (hm, mut l) =
        lamina_on_hm_smr(hm_cfg.clone(), capacity, op, unit, gap, Default::default())?;
    let vol = l.volume_bytes;
    let t0 = hm.clock_us();
    for off in (0..vol).step_by(io as usize) {
        l.write(off, io as usize);
    }
    l.flush()?;
    let t1 = hm.clock_us();
    for off in random_offsets(vol, io, passes) {
        l.write(off, io as usize);
    }
    l.flush()?;
    let t2 = hm.clock_us();
    let st = l.e.status();
    let (l_seq, l_rand) = (mbps(vol, t1 - t0), mbps(passes as u64 * vol, t2 - t1));
    // Ideal: the volume's bytes written zone after zone from the first sequential
    // zone, where Lamina's first segments are.
    let ideal = ideal(vol);
    drop(l);
    drop(hm);

    // Drive-managed SMR, same disk, same writes over the same user capacity, with
    // each cache size and both cleaning orders: the fullest zone first (kind to
    // the drive) and the oldest cached write first (as drives clean).
    let dm_run = |cache: u64, fifo: bool| -> Result<(f64, f64, u64)> {
        let dm = DriveManagedSmr::new(
            Arc::new(NullDevice::new("dm-smr", capacity)),
            DmSmrConfig {
                zone_bytes: zone,
                cache_bytes: cache,
                seek_us: hm_cfg.seek_us,
                rpm: hm_cfg.rpm,
                outer_mb_s: hm_cfg.outer_mb_s,
                fifo,
            },
        )?;
        let buf = vec![0u8; io as usize];
        for off in (0..vol).step_by(io as usize) {
            dm.write_at(&buf, off)?;
        }
        let d1 = dm.stats();
        for off in random_offsets(vol, io, passes) {
            dm.write_at(&buf, off)?;
        }
        let d2 = dm.stats();
        Ok((
            mbps(vol, d1.clock_us),
            mbps(passes as u64 * vol, d2.clock_us - d1.clock_us),
            d2.cleanings,
        ))
    };
    let mut dms = Vec::new();
    for &pct in cache_percents {
        if !(pct > 0.0 && pct < 100.0) {
            anyhow::bail!("media cache of {pct}% must be between 0 and 100%");
        }
        let cache = ((capacity as f64 * pct / 100.0) as u64).max(1 << 20) / 4096 * 4096;
        let (seq, greedy, cleanings) = dm_run(cache, false)?;
        let (_, fifo, fifo_cleanings) = dm_run(cache, true)?;
        dms.push(serde_json::json!({
            "cache_percent": pct, "media_cache_bytes": cache,
            "sequential_mb_s": seq, "random_mb_s": greedy, "cleanings": cleanings,
            "fifo_random_mb_s": fifo, "fifo_cleanings": fifo_cleanings,
            "random_lamina_over_drive_managed": l_rand / greedy,
            "random_lamina_over_drive_managed_fifo": l_rand / fifo,
        }));
    }
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(0.0);
    if let Some(path) = plot {
        use lamina_sim::plot::{line_chart, Line};
        let pts = |k: &str| {
            dms.iter()
                .map(|d| (f(d, "cache_percent"), f(d, k)))
                .collect()
        };
        let xs: Vec<f64> = cache_percents.to_vec();
        let (lo, hi) = (
            xs.iter().cloned().fold(f64::MAX, f64::min),
            xs.iter().cloned().fold(f64::MIN, f64::max),
        );
        let svg = line_chart(
            &format!(
                "SALSA 5.3: {} random writes, {} SMR disk, {} zones",
                crate::size::human(io),
                crate::size::human(capacity),
                crate::size::human(zone)
            ),
            "drive-managed media cache (% of capacity)",
            "random-write bandwidth (MB/s, virtual time)",
            &[
                Line {
                    label: "Lamina on host-managed".into(),
                    points: vec![(lo, l_rand), (hi, l_rand)],
                    dashed: false,
                },
                Line {
                    label: "drive-managed (fullest zone cleaned)".into(),
                    points: pts("random_mb_s"),
                    dashed: false,
                },
                Line {
                    label: "drive-managed (FIFO cleaning)".into(),
                    points: pts("fifo_random_mb_s"),
                    dashed: true,
                },
            ],
        );
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    let rows = serde_json::json!({
        "capacity_bytes": capacity, "zone_bytes": zone, "io_bytes": io,
        "volume_bytes": vol, "random_passes": passes,
        "ideal_sequential_mb_s": ideal,
        "lamina_hm": {"sequential_mb_s": l_seq, "random_mb_s": l_rand,
                      "write_amplification": st.write_amplification},
        "lamina_sequential_of_ideal": l_seq / ideal,
        "drive_managed": dms,
    });
    if json_out {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    let human = crate::size::human;
    println!(
        "| {} disk, {} zones, {} writes over {} | sequential MB/s | random MB/s (steady, {passes} passes) |",
        human(capacity),
        human(zone),
        human(io),
        human(vol)
    );
    println!("|---|---:|---:|");
    println!("| ideal: the zones written in order | {ideal:.1} | |");
    println!(
        "| Lamina on host-managed SMR | {l_seq:.1} ({:.0}% of ideal) | {l_rand:.1} (Lamina WA {:.2}) |",
        100.0 * l_seq / ideal,
        st.write_amplification.unwrap_or(0.0)
    );
    for d in &dms {
        println!(
            "| drive-managed SMR, {} media cache ({}%) | {:.1} | {:.2} fullest zone cleaned first ({:.0}x less than Lamina), {:.2} FIFO ({:.0}x) |",
            human(d["media_cache_bytes"].as_u64().unwrap_or(0)),
            f(d, "cache_percent"),
            f(d, "sequential_mb_s"),
            f(d, "random_mb_s"),
            f(d, "random_lamina_over_drive_managed"),
            f(d, "fifo_random_mb_s"),
            f(d, "random_lamina_over_drive_managed_fifo"),
        );
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn iops(
    ssds: usize,
    capacity: u64,
    read_percent: u32,
    depths: &[usize],
    requests: usize,
    op: f64,
    chunk: u64,
    plot: Option<&std::path::Path>,
    json_out: bool,
) -> Result<()> {
    let (rows, json) = crate::iops::run(ssds, capacity, read_percent, depths, requests, op, chunk)?;
    if let Some(path) = plot {
        use lamina_sim::plot::{line_chart, Line};
        let line = |label: &str, f: &dyn Fn(&crate::iops::Row) -> f64| Line {
            label: label.into(),
            points: rows.iter().map(|r| (r.qd as f64, f(r))).collect(),
            dashed: false,
        };
        let svg = line_chart(
            &format!(
                "SALSA 5.1.1: 4 KiB random {read_percent}/{} read/write, {ssds} emulated TLC SSDs",
                100 - read_percent
            ),
            "queue depth",
            "IOPS (virtual time)",
            &[
                line("Lamina SAID5", &|r| r.lamina.0),
                line("RAID-0", &|r| r.raid0.0),
                line("RAID-5 (read-modify-write)", &|r| r.raid5.0),
            ],
        );
        std::fs::write(path, svg).with_context(|| format!("cannot write {}", path.display()))?;
    }
    if json_out {
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    println!(
        "| QD | RAID-0 IOPS (latency) | RAID-5 IOPS (latency) | Lamina SAID5 IOPS (latency) | Lamina / RAID-0 | Lamina / RAID-5 |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {:.0} ({:.0} us) | {:.0} ({:.0} us) | {:.0} ({:.0} us) | {:.1}x | {:.1}x |",
            r.qd,
            r.raid0.0,
            r.raid0.1,
            r.raid5.0,
            r.raid5.1,
            r.lamina.0,
            r.lamina.1,
            r.lamina.0 / r.raid0.0,
            r.lamina.0 / r.raid5.0
        );
    }
    Ok(())
}

/// `lamina probe --emulate SPEC`: the sketcher against an emulated SSD whose
/// geometry is known, printing its verdicts with the evidence.
/// An emulated SSD from `cell,key=value,...` (capacity, iu, page,
/// pages-per-block, channels, dies; `lba` for placement by logical address).
pub fn parse_flash_spec(spec: &str) -> Result<lamina_device::flash::FlashConfig> {
    use lamina_device::flash::{Cell, FlashConfig};
    let mut cfg = FlashConfig {
        capacity_bytes: 256 << 20,
        pages_per_block: 64,
        ..Default::default()
    };
    for kv in spec.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let size = || crate::size_arg(k, v);
        let num = || {
            v.parse::<u32>()
                .with_context(|| format!("{k}={v}: not a number"))
        };
        match k {
            "slc" | "mlc" | "tlc" | "qlc" => cfg.cell = Cell::parse(k).unwrap(),
            "lba" => cfg.lba_placement = true,
            "capacity" => cfg.capacity_bytes = size()?,
            "iu" => {
                cfg.iu_bytes = size()?;
                cfg.page_bytes = cfg.page_bytes.max(cfg.iu_bytes);
            }
            "page" => cfg.page_bytes = size()?,
            "pages-per-block" => cfg.pages_per_block = num()? as u64,
            "channels" => cfg.channels = num()?,
            "dies" => cfg.dies_per_channel = num()?,
            _ => anyhow::bail!("unknown emulator setting {k:?} (cell type, capacity, iu, page, pages-per-block, channels, dies, lba)"),
        }
    }
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(cfg)
}

pub fn probe_emulated(spec: &str, json_out: bool) -> Result<()> {
    use lamina_device::flash::Flash;
    use lamina_device::probe::{probe, EmulatedTarget};
    let cfg = parse_flash_spec(spec)?;
    let f = Flash::new(
        Arc::new(lamina_device::sparse::SparseDevice::new(
            "probe",
            cfg.capacity_bytes,
        )),
        cfg.clone(),
    )?;
    let r = probe(&mut EmulatedTarget { flash: &f, now: 0 });
    let truth_units = cfg.channels * cfg.dies_per_channel * cfg.planes_per_die;
    print_probe(&r, Some((cfg.iu_bytes, truth_units)), json_out)
}

/// `lamina probe DEVICE`: the sketcher against a real device or file, timed with
/// direct I/O over its first `size` bytes (overwritten).
pub fn probe_device(
    path: &std::path::Path,
    size: u64,
    destroy: bool,
    json_out: bool,
) -> Result<()> {
    use lamina_device::probe::{probe, DirectTarget};
    if !destroy {
        anyhow::bail!(
            "probing writes over the first {} of {}: add --destroy if its data may be lost",
            crate::size::human(size),
            path.display()
        );
    }
    let dev = FileDevice::open(path, DevMode::ReadWrite)?;
    let cap = dev.size_bytes();
    drop(dev);
    if size < 64 << 20 || size > cap {
        anyhow::bail!(
            "--size {} must be at least 64 MiB and at most the device's {}",
            crate::size::human(size),
            crate::size::human(cap)
        );
    }
    let mut t = DirectTarget::open(path, size)
        .with_context(|| format!("cannot open {} for probing", path.display()))?;
    if t.buffered {
        eprintln!(
            "lamina: {} does not take direct I/O; the timings below are the page cache's, not the device's",
            path.display()
        );
    }
    let r = probe(&mut t);
    print_probe(&r, None, json_out)
}

/// Prints a probe's verdicts with their evidence (and the truth, for emulators).
fn print_probe(
    r: &lamina_device::probe::ProbeReport,
    truth: Option<(u64, u32)>,
    json_out: bool,
) -> Result<()> {
    if json_out {
        println!(
            "{}",
            serde_json::json!({
                "indirection_unit_bytes": r.iu_bytes,
                "indirection_unit_evidence": r.iu_evidence.iter()
                    .map(|(s, us)| serde_json::json!({"write_bytes": s, "us_per_kib": us}))
                    .collect::<Vec<_>>(),
                "parallel_units": r.parallel_units,
                "parallel_evidence": r.parallel_evidence.iter()
                    .map(|(qd, tp)| serde_json::json!({"queue_depth": qd, "reads_per_ms": tp}))
                    .collect::<Vec<_>>(),
                "mapping": r.mapping,
                "write_order_ratio": r.write_order_ratio,
                "gc_cliff_bytes": r.gc_cliff_bytes,
                "recommended_write_unit_bytes": r.recommended_write_unit,
                "recommended_segment_bytes": r.recommended_segment,
                "recommended_queue_depth": r.recommended_queue_depth,
                "truth": truth.map(|(iu, units)| serde_json::json!(
                    {"indirection_unit_bytes": iu, "parallel_units": units})),
            })
        );
        return Ok(());
    }
    let human = crate::size::human;
    let emulated = |v: String| truth.map_or(String::new(), |_| format!("  (emulated: {v})"));
    println!(
        "indirection unit: {}{}",
        human(r.iu_bytes),
        emulated(truth.map_or(String::new(), |t| human(t.0)))
    );
    for (s, us) in &r.iu_evidence {
        println!("    random writes of {:>9}: {us:8.1} us per KiB", human(*s));
    }
    println!(
        "parallel units: {}{}",
        r.parallel_units,
        emulated(truth.map_or(String::new(), |t| t.1.to_string()))
    );
    for (k, tp) in &r.parallel_evidence {
        println!("    4 KiB random reads at queue depth {k:>2}: {tp:7.1} per ms");
    }
    println!(
        "mapping: {}  (reading back in write order takes {:.2}x the time of LBA order)",
        r.mapping, r.write_order_ratio
    );
    match r.gc_cliff_bytes {
        Some(b) => println!(
            "GC cliff: after {} of random writes the latency triples",
            human(b)
        ),
        None => println!("GC cliff: none seen"),
    }
    println!(
        "recommended: write unit {}, segment {}, queue depth {}",
        human(r.recommended_write_unit),
        human(r.recommended_segment),
        r.recommended_queue_depth
    );
    Ok(())
}

/// `lamina bench parity`: GB/s of data through each parity routine, each run for
/// `seconds` on one row of `members` data members of `chunk` bytes.
fn parity(members: usize, chunk: u64, seconds: f64, json: bool) -> Result<()> {
    use lamina_device::parity::{encode, encode_with_tables, reconstruct};
    if !(2..=64).contains(&members) {
        anyhow::bail!("--members {members}: give 2 to 64");
    }
    if !(4096..=(64 << 20)).contains(&chunk) {
        anyhow::bail!("--chunk {chunk}: give 4K to 64M");
    }
    if !(0.01..=60.0).contains(&seconds) {
        anyhow::bail!("--seconds {seconds}: give 0.01 to 60");
    }
    use rand::{RngCore, SeedableRng};
    let len = chunk as usize;
    let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
    let mut row: Vec<Vec<u8>> = (0..members + 2)
        .map(|_| {
            let mut m = vec![0u8; len];
            rng.fill_bytes(&mut m);
            m
        })
        .collect();
    // GB/s of data members' bytes while `f` runs over and over for `seconds`.
    let rate = |f: &mut dyn FnMut()| -> f64 {
        f(); // warm the caches and the branch predictors
        let t0 = std::time::Instant::now();
        let mut n = 0u64;
        while t0.elapsed().as_secs_f64() < seconds {
            f();
            n += 1;
        }
        (n * members as u64 * chunk) as f64 / t0.elapsed().as_secs_f64() / 1e9
    };
    let (data, parity_members) = row.split_at_mut(members);
    let (p, q) = parity_members.split_at_mut(1);
    let refs: Vec<&[u8]> = data.iter().map(|d| &d[..]).collect();
    let p_only = rate(&mut || encode(&refs, &mut p[0], None));
    let pq_words = rate(&mut || encode(&refs, &mut p[0], Some(&mut q[0])));
    let pq_tables = rate(&mut || encode_with_tables(&refs, &mut p[0], Some(&mut q[0])));
    encode(&refs, &mut p[0], Some(&mut q[0]));
    let rebuild = |lost: &[usize]| {
        let mut mask = vec![false; members + 2];
        for &i in lost {
            mask[i] = true;
        }
        let mut work = row.clone();
        rate(&mut || {
            let mut refs: Vec<&mut [u8]> = work.iter_mut().map(|m| &mut m[..]).collect();
            reconstruct(&mut refs, 2, &mask).expect("two losses are tolerated");
        })
    };
    let one_data = rebuild(&[0]);
    let data_and_p = rebuild(&[0, members]);
    let two_data = rebuild(&[0, 1]);
    let rows = [
        ("p", "P (SAID5)", p_only),
        ("pq_words", "P+Q, Q by words", pq_words),
        ("pq_tables", "P+Q, Q by tables (reference)", pq_tables),
        (
            "rebuild_one_data",
            "rebuild one data member from P",
            one_data,
        ),
        (
            "rebuild_data_and_p",
            "rebuild a data member and P (from Q)",
            data_and_p,
        ),
        ("rebuild_two_data", "rebuild two data members", two_data),
    ];
    if json {
        let v: serde_json::Value = rows
            .iter()
            .map(|(k, _, r)| (k.to_string(), serde_json::json!(r)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        println!(
            "{}",
            serde_json::json!({"members": members, "chunk": chunk, "gb_per_s": v})
        );
    } else {
        println!("{members} data members of {chunk} bytes, GB/s of data:");
        for (_, label, r) in rows {
            println!("  {label:<40} {r:>7.2}");
        }
    }
    Ok(())
}
