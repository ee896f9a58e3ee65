//! `lamina emulate`: an emulated SSD served as an NBD export, its virtual clock paced
//! to wall time, so that unmodified software (a file system, a database, fio, and
//! Lamina itself) runs on "a QLC drive" and feels its latencies.
//!
//! The drive is the flash emulator (`lamina_device::flash`: FTL with an indirection
//! unit, garbage collection, wear, dies and channels on a virtual clock); its data
//! lives in a backing file at the logical offset. Each request is accounted to the
//! FTL at the virtual time it arrives (wall time since the start, in microseconds),
//! the FTL says when the drive would complete it, and the request's reply waits for
//! that moment. Requests in flight at once overlap on different dies as they would
//! on the drive, up to `--threads` of them.

use crate::size::human;
use anyhow::{bail, Context, Result};
use crossbeam_channel::{unbounded, Receiver, Sender};
use lamina_device::file::{FileDevice, OpenMode as DevMode};
use lamina_device::flash::{Flash, FlashOp};
use lamina_device::BlockDevice;
use lamina_nbd::proto::EIO;
use lamina_nbd::server::{Listener, ReplySink};
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

pub const EMULATE_ABOUT: &str = "\
Serve an emulated SSD as an NBD export: the flash emulator (an FTL with an
indirection unit, garbage collection, wear, dies and channels, with published
latencies per cell type), paced to wall time, so that unmodified software - ext4,
PostgreSQL, fio, or Lamina itself (an array on the export through nbdfuse and a
loop device) - runs on the drive and waits as long as the drive would make it wait.

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
    nbdinfo 'nbd+unix:///ssd?socket=/tmp/qlc.sock'";

#[derive(clap::Args)]
pub struct EmulateArgs {
    /// The drive: cell type and settings, as `lamina sim --flash` takes them (slc,
    /// mlc, tlc, qlc; capacity, iu, page, pages-per-block, channels, dies).
    #[arg(long, value_name = "SPEC")]
    ssd: String,
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
    /// The export's name.
    #[arg(long, default_value = "ssd")]
    name: String,
    /// Answer as fast as the host can (the drive's counters are still kept).
    #[arg(long)]
    no_pace: bool,
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

struct Emulated {
    flash: Flash,
    data: Arc<dyn BlockDevice>,
    pacer: Pacer,
    info: ExportInfo,
    work: Sender<Job>,
}

impl Emulated {
    /// Runs one command at the drive's pace; the NBD error if it fails.
    fn execute(&self, cmd: Command) -> (u32, Option<Vec<u8>>) {
        let at = self.pacer.now_us();
        let (result, done, buf) = match cmd {
            Command::Write { offset, data, fua } => {
                let len = data.len() as u64;
                let r = self.data.write_at(&data, offset).and_then(|_| {
                    if fua {
                        self.data.sync()
                    } else {
                        Ok(())
                    }
                });
                let done = self.flash.submit(FlashOp::Write { offset, len }, at);
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
                let done = if allocate {
                    self.flash.submit(
                        FlashOp::Write {
                            offset,
                            len: length,
                        },
                        at,
                    )
                } else {
                    r = r.and_then(|_| self.flash.discard(offset, length));
                    at
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
        let len = buf.len() as u64;
        let done = self.flash.submit(FlashOp::Read { offset, len }, at);
        let r = self.data.read_at(buf, offset);
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

pub fn run(a: EmulateArgs) -> Result<()> {
    let cfg = crate::bench::parse_flash_spec(&a.ssd)?;
    if !(1..=256).contains(&a.threads) {
        bail!("--threads {}: give 1 to 256", a.threads);
    }
    if a.unix.is_none() && a.tcp.is_none() {
        bail!("nothing to listen on: give --unix PATH or --tcp HOST:PORT");
    }
    let capacity = cfg.capacity_bytes;
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
    let flash = Flash::new(data.clone(), cfg.clone())?;
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
        flash,
        data,
        pacer: Pacer {
            start: Instant::now(),
            pace: !a.no_pace,
            late_us: AtomicU64::new(0),
            paced: AtomicU64::new(0),
            latest_us: AtomicU64::new(0),
        },
        info: ExportInfo {
            name: a.name.clone(),
            description: format!("emulated {:?} SSD ({})", cfg.cell, a.ssd),
            size: capacity,
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
        .map(|p| format!("nbd+unix:///{}?socket={}", a.name, p.display()))
        .unwrap_or_else(|| format!("nbd://{}/{}", a.tcp.as_deref().unwrap_or(""), a.name));
    println!(
        "lamina: emulating a {} {:?} SSD ({}{}) on {endpoint}",
        human(capacity),
        cfg.cell,
        a.ssd,
        if a.no_pace { ", not paced" } else { "" }
    );
    let _ = std::io::Write::flush(&mut std::io::stdout());
    crate::notify::notify("READY=1");
    let _ = crate::serve::wait_for_signal(&signals);
    let _ = em.data.sync();
    let s = em.flash.stats();
    let wa = s.nand_bytes_programmed as f64 / s.host_bytes_written.max(1) as f64;
    let paced = em.pacer.paced.load(Ordering::Relaxed);
    println!(
        "{}",
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
            "wall_us": em.pacer.now_us(),
            "paced_replies": paced,
            "pacing_late_mean_us": em.pacer.late_us.load(Ordering::Relaxed) as f64 / paced.max(1) as f64,
            "pacing_late_max_us": em.pacer.latest_us.load(Ordering::Relaxed),
        })
    );
    if let Some(p) = &a.unix {
        let _ = std::fs::remove_file(p);
    }
    Ok(())
}
