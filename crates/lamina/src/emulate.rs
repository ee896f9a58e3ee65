//! `lamina emulate`: an emulated drive served as an NBD export, its virtual clock
//! paced to wall time, so that unmodified software (a file system, a database, fio,
//! and Lamina itself) runs on "a QLC drive" or "an SMR disk" and feels its latencies.
//!
//! An SSD is the flash emulator (`lamina_device::flash`: FTL with an indirection
//! unit, garbage collection, wear, dies and channels on a virtual clock); each
//! request is accounted to the FTL at the virtual time it arrives (wall time since
//! the start, in microseconds), the FTL says when the drive would complete it, and
//! the reply waits for that moment: requests in flight together overlap on
//! different dies, up to `--threads` of them. An SMR disk is the drive-managed SMR
//! emulator (`lamina_device::dmsmr`: media cache, zone cleaning, one head): it
//! serves one request at a time, so a request starts when the disk is free and the
//! time its model charged is added. Either way the data lives in a backing file at
//! its logical offset.

use crate::size::human;
use anyhow::{bail, Context, Result};
use crossbeam_channel::{unbounded, Receiver, Sender};
use lamina_device::dmsmr::{DmSmrConfig, DriveManagedSmr};
use lamina_device::file::{FileDevice, OpenMode as DevMode};
use lamina_device::flash::{Flash, FlashOp};
use lamina_device::BlockDevice;
use lamina_device::DeviceError;
use lamina_nbd::proto::EIO;
use lamina_nbd::server::{Listener, ReplySink};
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const EMULATE_ABOUT: &str = "\
Serve an emulated drive as an NBD export, paced to wall time, so that unmodified
software - ext4, PostgreSQL, fio, or Lamina itself (an array on the export through
nbdfuse and a loop device) - runs on the drive and waits as long as the drive would
make it wait. --ssd: the flash emulator (an FTL with an indirection unit, garbage
collection, wear, dies and channels, with published latencies per cell type).
--smr: a drive-managed SMR disk (a media cache at the outer edge, zones rewritten
whole when it fills, seeks and rotation; one request at a time).

The drive's data is kept in FILE (created sparse at the drive's capacity); its FTL
state (mapping, wear, garbage collection) lives in memory and starts fresh at each
start. On SIGINT or SIGTERM the drive's counters are printed as JSON (host and NAND
bytes, write amplification, erases) and the server exits.

Pacing: a request is accounted to the drive at the virtual time it arrives (wall
time since the start), and answered when the drive's clock says it completes;
requests in flight together overlap on different dies. The error is the host's: the
time to serve a request over NBD and to wake a thread (tens of microseconds, stated
in docs/benchmarks.md with the command that measures it). --no-pace answers as fast
as the host can while still counting what the drive would do.

    lamina emulate --ssd qlc,iu=64K,capacity=8G --backing /srv/qlc.img --unix /tmp/qlc.sock
    lamina emulate --smr capacity=8G,zone=256M,cache=1% --backing /srv/smr.img --unix /tmp/smr.sock
    nbdinfo 'nbd+unix:///ssd?socket=/tmp/qlc.sock'";

#[derive(clap::Args)]
pub struct EmulateArgs {
    /// An SSD: cell type and settings, as `lamina sim --flash` takes them (slc,
    /// mlc, tlc, qlc; capacity, iu, page, pages-per-block, channels, dies).
    #[arg(
        long,
        value_name = "SPEC",
        required_unless_present = "smr",
        conflicts_with = "smr"
    )]
    ssd: Option<String>,
    /// A drive-managed SMR disk: capacity (default 8G), zone (256M), cache (bytes or
    /// a percentage of the capacity, default 1%), fifo (clean the oldest cached
    /// write's zone rather than the fullest).
    #[arg(long, value_name = "SPEC")]
    smr: Option<String>,
    /// File that holds the drive's data (created sparse at the drive's capacity if
    /// missing; an existing one must be at least that large).
    #[arg(long, value_name = "FILE")]
    backing: PathBuf,
    /// Listen on this Unix socket.
    #[arg(long, value_name = "PATH")]
    unix: Option<PathBuf>,
    /// Listen on this TCP address.
    #[arg(long, value_name = "HOST:PORT")]
    tcp: Option<String>,
    /// The export's name (default "ssd" or "smr").
    #[arg(long)]
    name: Option<String>,
    /// Answer as fast as the host can (the drive's counters are still kept).
    #[arg(long)]
    no_pace: bool,
    /// SSDs: start as a drive in use, every logical block written once (as after a
    /// sequential fill), so that its garbage collection runs as soon as its spare
    /// blocks are used; without it the drive starts new, every block erased. The
    /// data file is left as it is.
    #[arg(long, conflicts_with = "smr")]
    prefilled: bool,
    /// SSDs: start as a drive used for random writes, at its garbage collection's
    /// steady state (the prefill, then twice the capacity in uniform random writes,
    /// not counted): valid data spread over every block, so that random writes pay
    /// the drive's GC from the first one (SALSA's "at steady state").
    #[arg(long, conflicts_with_all = ["smr", "prefilled"])]
    aged: bool,
    /// Requests served at once: the queue depth the drive can see (1 to 256).
    #[arg(long, default_value_t = 32)]
    threads: usize,
}

/// Virtual microseconds are wall microseconds since `start`.
struct Pacer {
    start: Instant,
    pace: bool,
    /// How late replies were let go, against the drive's completion time: the
    /// pacing's own error (µs summed, replies, the latest).
    late_us: AtomicU64,
    paced: AtomicU64,
    latest_us: AtomicU64,
}

impl Pacer {
    fn now_us(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }

    /// Waits until the virtual time `done_us` (at once without pacing).
    fn wait_until(&self, done_us: u64) {
        if !self.pace {
            return;
        }
        fine_timer_slack();
        let target = self.start + Duration::from_micros(done_us);
        let now = Instant::now();
        if target > now {
            std::thread::sleep(target - now);
        }
        let late = Instant::now().saturating_duration_since(target).as_micros() as u64;
        self.late_us.fetch_add(late, Ordering::Relaxed);
        self.paced.fetch_add(1, Ordering::Relaxed);
        self.latest_us.fetch_max(late, Ordering::Relaxed);
    }
}

/// Makes this thread's sleeps end within a microsecond of when they should rather
/// than the default 50 µs later (timer slack, prctl(2)); once per thread.
fn fine_timer_slack() {
    thread_local!(static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) });
    DONE.with(|d| {
        if !d.get() {
            // SAFETY: sets this thread's timer slack; no pointers involved.
            unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1) };
            d.set(true);
        }
    });
}

type Job = (Command, u64, Arc<ReplySink>);

/// The drive behind the export.
enum Drive {
    /// The FTL accounts requests at the time they arrive; the data goes to the
    /// backing file directly.
    Ssd(Flash),
    /// The disk moves the data itself and charges its time to its clock; `free` is
    /// when it finishes what it was given (virtual µs); its lock serialises the disk.
    Smr {
        disk: DriveManagedSmr,
        free: Mutex<u64>,
    },
}

/// A request's data, as the drive sees it.
enum Io<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

struct Emulated {
    drive: Drive,
    data: Arc<dyn BlockDevice>,
    pacer: Pacer,
    info: ExportInfo,
    work: Sender<Job>,
}

impl Emulated {
    /// Moves the data of one request arriving at virtual time `at`; when the drive
    /// completes it.
    fn io(&self, io: Io, offset: u64, at: u64) -> (Result<(), DeviceError>, u64) {
        match &self.drive {
            Drive::Ssd(flash) => {
                let (r, op) = match io {
                    Io::Read(buf) => {
                        let len = buf.len() as u64;
                        (
                            self.data.read_at(buf, offset),
                            FlashOp::Read { offset, len },
                        )
                    }
                    Io::Write(buf) => {
                        let len = buf.len() as u64;
                        (
                            self.data.write_at(buf, offset),
                            FlashOp::Write { offset, len },
                        )
                    }
                };
                (r, flash.submit(op, at))
            }
            Drive::Smr { disk, free } => {
                let mut free = free.lock().unwrap();
                let before = disk.stats().clock_us;
                let r = match io {
                    Io::Read(buf) => disk.read_at(buf, offset),
                    Io::Write(buf) => disk.write_at(buf, offset),
                };
                let service = disk.stats().clock_us - before;
                *free = (*free).max(at) + service;
                (r, *free)
            }
        }
    }

    /// Runs one command at the drive's pace; the NBD error if it fails.
    fn execute(&self, cmd: Command) -> (u32, Option<Vec<u8>>) {
        let at = self.pacer.now_us();
        let (result, done, buf) = match cmd {
            Command::Write { offset, data, fua } => {
                let (mut r, done) = self.io(Io::Write(&data), offset, at);
                if fua {
                    r = r.and_then(|_| self.data.sync());
                }
                (r, done, Some(data))
            }
            Command::Zero {
                offset,
                length,
                fua,
                allocate,
            } => {
                // The range reads as zeros either way; the drive programs it only if
                // it must stay allocated, and otherwise forgets it (TRIM).
                let mut r = self.data.discard(offset, length);
                let done = match &self.drive {
                    Drive::Ssd(flash) if allocate => flash.submit(
                        FlashOp::Write {
                            offset,
                            len: length,
                        },
                        at,
                    ),
                    Drive::Ssd(flash) => {
                        r = r.and_then(|_| flash.discard(offset, length));
                        at
                    }
                    // The disk has no TRIM; the hole in the file is enough.
                    Drive::Smr { .. } => at,
                };
                if fua {
                    r = r.and_then(|_| self.data.sync());
                }
                (r, done, None)
            }
            Command::Flush => (self.data.sync(), at, None),
        };
        self.pacer.wait_until(done);
        match result {
            Ok(()) => (0, buf),
            Err(e) => {
                tracing::error!("emulated drive: {e}");
                (EIO, buf)
            }
        }
    }
}

impl Backend for Emulated {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        vec![self.info.clone()]
    }
    fn open_export(&self, name: &str) -> Option<((), ExportInfo)> {
        (name.is_empty() || name == self.info.name).then(|| ((), self.info.clone()))
    }
    fn read(&self, _: &(), offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        let at = self.pacer.now_us();
        let (r, done) = self.io(Io::Read(buf), offset, at);
        self.pacer.wait_until(done);
        r.map_err(|e| {
            tracing::error!("emulated drive: {e}");
            EIO
        })
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        let _ = self.work.send((cmd, handle, reply.clone()));
    }
}

fn worker(em: Arc<Emulated>, jobs: Receiver<Job>) {
    while let Ok((cmd, handle, reply)) = jobs.recv() {
        let (error, buf) = em.execute(cmd);
        reply.complete(&mut vec![Completion { handle, error, buf }]);
    }
}

/// A drive-managed SMR disk from `key=value,...` (capacity, zone, cache, fifo).
fn parse_smr_spec(spec: &str) -> Result<(u64, DmSmrConfig)> {
    let mut capacity = 8u64 << 30;
    let mut cfg = DmSmrConfig::default();
    let mut cache: Option<String> = None;
    for kv in spec.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let size = || crate::size_arg(k, v);
        match k {
            "capacity" => capacity = size()?,
            "zone" => cfg.zone_bytes = size()?,
            "cache" => cache = Some(v.to_string()),
            "fifo" => cfg.fifo = true,
            _ => bail!("unknown SMR setting {k:?} (capacity, zone, cache, fifo)"),
        }
    }
    cfg.cache_bytes = match cache.as_deref() {
        None => capacity / 100,
        Some(c) => match c.strip_suffix('%') {
            Some(p) => {
                let p: f64 = p
                    .parse()
                    .with_context(|| format!("cache={c}: not a percentage"))?;
                if !(0.0..100.0).contains(&p) {
                    bail!("cache={c}: give a percentage below 100");
                }
                (capacity as f64 * p / 100.0) as u64 / 4096 * 4096
            }
            None => crate::size_arg("cache", c)?,
        },
    };
    Ok((capacity, cfg))
}

/// The drive asked for, parsed once.
enum Spec {
    Ssd(lamina_device::flash::FlashConfig),
    Smr { capacity: u64, cfg: DmSmrConfig },
}

pub fn run(a: EmulateArgs) -> Result<()> {
    let (spec, text) = match (&a.ssd, &a.smr) {
        (Some(s), None) => (Spec::Ssd(crate::bench::parse_flash_spec(s)?), s),
        (None, Some(s)) => {
            let (capacity, cfg) = parse_smr_spec(s)?;
            (Spec::Smr { capacity, cfg }, s)
        }
        _ => bail!("give one of --ssd SPEC and --smr SPEC"),
    };
    let (capacity, kind) = match &spec {
        Spec::Ssd(cfg) => (cfg.capacity_bytes, "ssd"),
        Spec::Smr { capacity, .. } => (*capacity, "smr"),
    };
    let name = a.name.clone().unwrap_or_else(|| kind.to_string());
    if !(1..=256).contains(&a.threads) {
        bail!("--threads {}: give 1 to 256", a.threads);
    }
    if a.unix.is_none() && a.tcp.is_none() {
        bail!("nothing to listen on: give --unix PATH or --tcp HOST:PORT");
    }
    let data: Arc<dyn BlockDevice> = if a.backing.exists() {
        let d = FileDevice::open(&a.backing, DevMode::ReadWrite)?;
        if d.size_bytes() < capacity {
            bail!(
                "{} holds {}, the drive needs {}",
                a.backing.display(),
                human(d.size_bytes()),
                human(capacity)
            );
        }
        Arc::new(d)
    } else {
        Arc::new(FileDevice::create_sparse(&a.backing, capacity)?)
    };
    let (drive, description) = match spec {
        Spec::Ssd(cfg) => {
            let d = format!("emulated {:?} SSD ({text})", cfg.cell);
            let flash = Flash::new(data.clone(), cfg)?;
            if a.aged {
                flash.age(2, 1);
            } else if a.prefilled {
                flash.prefill();
            }
            (Drive::Ssd(flash), d)
        }
        Spec::Smr { cfg, .. } => {
            let disk = DriveManagedSmr::new(data.clone(), cfg)?;
            let d = format!("emulated drive-managed SMR disk ({text})");
            let free = Mutex::new(0);
            (Drive::Smr { disk, free }, d)
        }
    };
    // The disk rounds down to whole zones.
    let size = match &drive {
        Drive::Ssd(_) => capacity,
        Drive::Smr { disk, .. } => disk.size_bytes(),
    };
    let listener = match (&a.unix, &a.tcp) {
        (Some(p), _) => {
            let _ = std::fs::remove_file(p);
            Listener::Unix(
                std::os::unix::net::UnixListener::bind(p)
                    .with_context(|| format!("cannot listen on {}", p.display()))?,
            )
        }
        (None, Some(addr)) => Listener::Tcp(
            std::net::TcpListener::bind(addr)
                .with_context(|| format!("cannot listen on TCP {addr}"))?,
        ),
        (None, None) => unreachable!("checked above"),
    };
    let (tx, rx) = unbounded();
    let em = Arc::new(Emulated {
        drive,
        data,
        pacer: Pacer {
            start: Instant::now(),
            pace: !a.no_pace,
            late_us: AtomicU64::new(0),
            paced: AtomicU64::new(0),
            latest_us: AtomicU64::new(0),
        },
        info: ExportInfo {
            name: name.clone(),
            description: description.clone(),
            size,
        },
        work: tx,
    });
    for _ in 0..a.threads {
        let (em, rx) = (em.clone(), rx.clone());
        std::thread::Builder::new()
            .name("emulate".into())
            .spawn(move || worker(em, rx))?;
    }
    lamina_nbd::server::set_read_threads(a.threads);
    let signals = crate::serve::block_signals();
    let stop = Arc::new(AtomicBool::new(false));
    {
        let (em, stop) = (em.clone(), stop.clone());
        std::thread::spawn(move || lamina_nbd::serve(em, listener, None, stop));
    }
    let endpoint = a
        .unix
        .as_ref()
        .map(|p| format!("nbd+unix:///{name}?socket={}", p.display()))
        .unwrap_or_else(|| format!("nbd://{}/{name}", a.tcp.as_deref().unwrap_or("")));
    println!(
        "lamina: {description}, {}{}, on {endpoint}",
        human(size),
        if a.no_pace { ", not paced" } else { "" }
    );
    let _ = std::io::Write::flush(&mut std::io::stdout());
    crate::notify::notify("READY=1");
    let _ = crate::serve::wait_for_signal(&signals);
    let _ = em.data.sync();
    let paced = em.pacer.paced.load(Ordering::Relaxed);
    let late = em.pacer.late_us.load(Ordering::Relaxed) as f64 / paced.max(1) as f64;
    let mut out = match &em.drive {
        Drive::Ssd(flash) => {
            let s = flash.stats();
            let wa = s.nand_bytes_programmed as f64 / s.host_bytes_written.max(1) as f64;
            serde_json::json!({
                "host_bytes_written": s.host_bytes_written,
                "host_bytes_read": s.host_bytes_read,
                "nand_bytes_programmed": s.nand_bytes_programmed,
                "nand_bytes_read": s.nand_bytes_read,
                "write_amplification": wa,
                "erases": s.erases,
                "rmw_ius": s.rmw_ius,
                "gc_ius_moved": s.gc_ius_moved,
                "trimmed_bytes": s.trimmed_bytes,
                "max_erase_count": s.max_erase_count,
                "virtual_us": s.clock_us,
            })
        }
        Drive::Smr { disk, .. } => {
            let s = disk.stats();
            serde_json::json!({
                "host_bytes_written": s.host_bytes_written,
                "cache_bytes_written": s.cache_bytes_written,
                "cleanings": s.cleanings,
                "cleaning_bytes": s.cleaning_bytes,
                "virtual_us": s.clock_us,
            })
        }
    };
    out["wall_us"] = em.pacer.now_us().into();
    out["paced_replies"] = paced.into();
    out["pacing_late_mean_us"] = late.into();
    out["pacing_late_max_us"] = em.pacer.latest_us.load(Ordering::Relaxed).into();
    println!("{out}");
    if let Some(p) = &a.unix {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}
