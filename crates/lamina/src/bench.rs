//! `lamina bench`: yardsticks the benchmarks in bench/ measure Lamina against.
//!
//! `lamina bench raid5-rmw` serves a classic RAID-5 (read-modify-write for small
//! writes, as Linux md does) over the same kind of devices through the same NBD
//! server, so that fio can run the same job against it and against a SAID5 array.
//! On SIGINT it prints what it read and wrote as JSON.

use crate::size::parse_size;
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
    let BenchCmd::Raid5Rmw {
        devices,
        unix,
        chunk,
        threads,
    } = cmd;
    let mut members: Vec<Arc<dyn BlockDevice>> = Vec::new();
    for d in &devices {
        let (p, size) = crate::parse_device(d)?;
        let dev = match size {
            Some(s) if !p.exists() => FileDevice::create_sparse(&p, s)?,
            _ => FileDevice::open(&p, DevMode::ReadWrite)?,
        };
        members.push(Arc::new(dev));
    }
    let chunk = parse_size(&chunk).map_err(anyhow::Error::msg)?;
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
        std::thread::spawn(move || lamina_nbd::serve(backend, Listener::Unix(l), stop));
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
