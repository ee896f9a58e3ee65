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
        BenchCmd::Endurance {
            capacity,
            passes,
            overprovision,
            cell,
            iu,
            json,
        } => return endurance(&capacity, passes, overprovision, &cell, &iu, json),
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

/// xorshift64: the random LBAs of the endurance runs (seeded, reproducible).
fn next(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

fn endurance(
    capacity: &str,
    passes: u32,
    op: f64,
    cell: &str,
    iu: &str,
    json_out: bool,
) -> Result<()> {
    use lamina_device::flash::{Cell, Flash, FlashConfig, FlashOp};
    use lamina_device::mem::MemDevice;
    let capacity = parse_size(capacity).map_err(anyhow::Error::msg)?;
    let cfg = FlashConfig {
        capacity_bytes: capacity,
        iu_bytes: parse_size(iu).map_err(anyhow::Error::msg)?,
        cell: Cell::parse(cell).ok_or_else(|| anyhow::anyhow!("unknown cell type {cell:?}"))?,
        ..Default::default()
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    let bs = 4096u64;
    // Raw: the host writes 4 KiB blocks at random over the whole device.
    let raw = Flash::new(
        Arc::new(lamina_device::sparse::SparseDevice::new("raw", capacity)),
        cfg.clone(),
    )?;
    let blocks = capacity / bs;
    let mut x = 0x9e3779b97f4a7c15u64;
    for b in 0..blocks {
        raw.submit(
            FlashOp::Write {
                offset: b * bs,
                len: bs,
            },
            0,
        );
    }
    for _ in 0..passes as u64 * blocks {
        raw.submit(
            FlashOp::Write {
                offset: (next(&mut x) % blocks) * bs,
                len: bs,
            },
            0,
        );
    }
    let r = raw.stats();
    // Lamina: an array on the same kind of SSD, a volume filling its usable space,
    // the same writes through the engine.
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
    lamina_core::format(&devs, &params, [1; 16], &[[2; 16]], 0)?;
    let (mut e, _) = lamina_core::open(devs, Default::default(), lamina_core::OpenMode::ReadWrite)?;
    let vol_blocks = e.status().usable_bytes / bs;
    let call = |e: &mut lamina_core::Engine, req: lamina_core::Request| -> Result<()> {
        let t = lamina_core::Token { conn: 1, handle: 1 };
        e.submit(t, req);
        let mut out = Vec::new();
        loop {
            lamina_core::run_inline(e);
            e.drain_replies(&mut out);
            if let Some(rep) = out.iter().position(|r| r.token == t) {
                return Ok(out.swap_remove(rep).result?);
            }
            e.tick(u64::MAX / 2);
        }
    };
    call(
        &mut e,
        lamina_core::Request::CreateVolume {
            name: "v".into(),
            size_bytes: vol_blocks * bs,
        },
    )?;
    let vol = e.shared().volume("v").unwrap().id;
    let mut replies = Vec::new();
    let mut write = |e: &mut lamina_core::Engine, lba: u64, i: u64| {
        e.submit(
            lamina_core::Token { conn: 2, handle: i },
            lamina_core::Request::Write {
                volume: vol,
                offset: lba * bs,
                data: vec![(i % 251) as u8; bs as usize],
                fua: false,
            },
        );
        if i % 64 == 63 {
            lamina_core::run_inline(e);
            e.drain_replies(&mut replies);
            replies.clear();
        }
    };
    let mut i = 0;
    for b in 0..vol_blocks {
        write(&mut e, b, i);
        i += 1;
    }
    let filled = ssd.stats();
    for _ in 0..passes as u64 * vol_blocks {
        write(&mut e, next(&mut x) % vol_blocks, i);
        i += 1;
    }
    call(&mut e, lamina_core::Request::Flush)?;
    let l = ssd.stats();
    let host = e.status();
    // Raw again, but written only over Lamina's user capacity: the same spare space
    // left to the drive's own FTL (a fair peer for the spare Lamina keeps).
    let raw2 = Flash::new(
        Arc::new(lamina_device::sparse::SparseDevice::new("raw2", capacity)),
        cfg.clone(),
    )?;
    for b in 0..vol_blocks {
        raw2.submit(
            FlashOp::Write {
                offset: b * bs,
                len: bs,
            },
            0,
        );
    }
    let r2a = raw2.stats();
    for _ in 0..passes as u64 * vol_blocks {
        raw2.submit(
            FlashOp::Write {
                offset: (next(&mut x) % vol_blocks) * bs,
                len: bs,
            },
            0,
        );
    }
    let r2 = raw2.stats();
    let wa_raw2 = (r2.nand_bytes_programmed - r2a.nand_bytes_programmed) as f64
        / (r2.host_bytes_written - r2a.host_bytes_written) as f64;
    let erases_raw2 = r2.erases - r2a.erases;
    let nand_raw = r.nand_bytes_programmed as f64;
    let user_raw = r.host_bytes_written as f64;
    let nand_l = (l.nand_bytes_programmed - filled.nand_bytes_programmed) as f64;
    let user_l = (passes as u64 * vol_blocks * bs) as f64;
    let erases_raw = r.erases;
    let erases_l = l.erases - filled.erases;
    let rows = serde_json::json!({
        "capacity_bytes": capacity,
        "passes": passes,
        "cell": cell,
        "iu_bytes": cfg.iu_bytes,
        "raw": {"user_bytes_written": user_raw, "nand_bytes_programmed": nand_raw,
                 "erases": erases_raw, "write_amplification": nand_raw / user_raw},
        "lamina": {"user_capacity_bytes": vol_blocks * bs, "user_bytes_written": user_l,
                   "nand_bytes_programmed": nand_l, "erases": erases_l,
                   "host_write_amplification": host.write_amplification,
                   "device_write_amplification": (l.nand_bytes_programmed - filled.nand_bytes_programmed) as f64
                        / (l.host_bytes_written - filled.host_bytes_written).max(1) as f64,
                   "write_amplification": nand_l / user_l},
        "raw_same_capacity": {"write_amplification": wa_raw2, "erases": erases_raw2},
        "wear_ratio_raw_over_lamina": (nand_raw / user_raw) / (nand_l / user_l),
    });
    if json_out {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("| | user capacity | NAND bytes per user byte | erases per GiB written |");
        println!("|---|---:|---:|---:|");
        println!(
            "| raw SSD, 4 KiB random | {} | {:.2} | {:.0} |",
            crate::size::human(capacity),
            nand_raw / user_raw,
            erases_raw as f64 / (user_raw / (1u64 << 30) as f64)
        );
        println!(
            "| raw SSD, 4 KiB random over the same capacity as Lamina | {} | {:.2} | {:.0} |",
            crate::size::human(vol_blocks * bs),
            wa_raw2,
            erases_raw2 as f64 / (user_l / (1u64 << 30) as f64)
        );
        println!(
            "| Lamina on the SSD | {} | {:.2} | {:.0} |",
            crate::size::human(vol_blocks * bs),
            nand_l / user_l,
            erases_l as f64 / (user_l / (1u64 << 30) as f64)
        );
        println!(
            "\nLamina: {:.1}x less NAND wear per user byte (host WA {:.2} x device WA {:.2})",
            rows["wear_ratio_raw_over_lamina"].as_f64().unwrap(),
            host.write_amplification.unwrap_or(0.0),
            rows["lamina"]["device_write_amplification"]
                .as_f64()
                .unwrap()
        );
    }
    Ok(())
}
