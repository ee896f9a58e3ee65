//! `lamina`: create log-structured arrays, carve volumes, serve them over NBD.

// serde_json's json! macro nests deeply for the status document.
#![recursion_limit = "256"]

mod admin;
mod config;
mod output;
mod runtime;
mod serve;
mod sim;
mod size;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use config::Config;
use lamina_core::{EngineConfig, FormatParams, OpenMode, Request};
use lamina_device::file::{FileDevice, OpenMode as DevMode};
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use serde_json::json;
use size::{human, parse_size};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const ABOUT: &str = "Log-structured block storage: arrays of cheap devices, served as NBD volumes";

const LONG_ABOUT: &str = "\
Lamina turns backing files or block devices into a log-structured ARRAY and serves
VOLUMES carved from it over the NBD protocol. Every write goes out of place into
large sequential segments, so low-endurance SSDs, SMR disks and parity arrays see
only the access pattern they handle well; garbage collection reclaims space.

An array lives in a directory DIR that holds only lamina.toml (the device paths,
sockets and tunables), the admin socket and the log. Everything else - layout,
volumes, the block map - is on the devices themselves, so they can be moved.

QUICK START
    lamina serve                 # creates ./lamina-data with one sparse file
    nbdinfo 'nbd+unix:///default?socket=lamina-data/nbd.sock'

EXIT STATUS
    0 success, 1 failure (the message says what and where), 2 bad usage.";

#[derive(Parser)]
#[command(name = "lamina", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create arrays.
    #[command(subcommand)]
    Array(ArrayCmd),
    /// Create, list and delete volumes.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Serve the volumes of an array over NBD (creates a default array if needed).
    #[command(long_about = SERVE_ABOUT)]
    Serve(serve::ServeArgs),
    /// Show capacity, space use and write amplification.
    #[command(long_about = STATUS_ABOUT)]
    Status(StatusArgs),
    /// Replay a workload or block trace through the engine, without data.
    #[command(long_about = sim::SIM_ABOUT)]
    Sim(sim::SimArgs),
}

const SERVE_ABOUT: &str = "\
Serve every volume of the array in DIR as an NBD export named after the volume
(the empty export name selects the first volume).

Without DIR, ./lamina-data is used; if it holds no array, an embedded default is
created there: one sparse backing file (--default-size) and one volume `default`
filling it. The server prints how to connect (nbdinfo, nbdfuse + losetup,
nbd-client, qemu).

Writes are acknowledged from RAM; NBD_CMD_FLUSH and FUA make them durable.
SIGINT or SIGTERM flushes, writes a checkpoint and exits.";

const STATUS_ABOUT: &str = "\
Report an array's capacity, segment use, bytes written by users and to media, bytes
relocated by garbage collection, and write amplification (media / user), overall
and per volume. Asks the running server through its admin socket; for a stopped
array it recovers the state read-only from the devices.

With --json the keys are a stable interface: capacity_bytes, usable_bytes,
live_bytes, segment_count, used_segments, free_segments, user_bytes_written,
media_bytes_written, gc_bytes_relocated, metadata_bytes_written,
write_amplification, and volumes[] with the same per-volume keys.";

#[derive(Subcommand)]
enum ArrayCmd {
    /// Create an array in DIR from one or more devices.
    #[command(long_about = ARRAY_CREATE_ABOUT)]
    Create(ArrayCreateArgs),
}

const ARRAY_CREATE_ABOUT: &str = "\
Create an array in DIR from one or more devices. A device is a block device or a
regular file; PATH:SIZE creates a sparse file of SIZE when PATH does not exist.
SIZE accepts K, M, G, T suffixes (powers of 1024).

Devices that already belong to a Lamina array are refused unless --force is given.

EXAMPLE
    lamina array create /srv/tank --device /var/lib/tank/a.img:100G --overprovision 0.2
    lamina volume create /srv/tank vm1 --size 40G
    lamina serve /srv/tank";

#[derive(clap::Args)]
struct ArrayCreateArgs {
    /// Directory for the array's configuration (created if missing).
    dir: PathBuf,
    /// A device: PATH or PATH:SIZE (repeat for more devices).
    #[arg(
        long = "device",
        short = 'd',
        required = true,
        value_name = "PATH[:SIZE]"
    )]
    devices: Vec<String>,
    /// Segment size: the unit of allocation and garbage collection.
    #[arg(long, default_value = "8M", value_name = "SIZE")]
    segment_size: String,
    /// Write unit: the size of each sequential device write.
    #[arg(long, default_value = "512K", value_name = "SIZE")]
    write_unit: String,
    /// Spare space as a fraction of user space (0.10 keeps 10% spare for GC).
    #[arg(long, default_value_t = 0.10, value_name = "FRACTION")]
    overprovision: f64,
    /// How segments are spread over devices (only jbod is available yet).
    #[arg(long, default_value = "jbod", value_parser = ["jbod", "said0", "said5", "said6"])]
    layout: String,
    /// Name of the array (default: the directory's name).
    #[arg(long)]
    name: Option<String>,
    /// Overwrite devices that belong to another Lamina array.
    #[arg(long)]
    force: bool,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a thin-provisioned volume.
    Create {
        dir: PathBuf,
        name: String,
        /// Size of the volume (K, M, G, T suffixes); a multiple of 4 KiB.
        #[arg(long, value_name = "SIZE")]
        size: String,
    },
    /// List volumes.
    List {
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Delete a volume and release its space.
    Delete { dir: PathBuf, name: String },
}

#[derive(clap::Args)]
struct StatusArgs {
    /// Array directory (default ./lamina-data).
    dir: Option<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Prometheus text format.
    #[arg(long, conflicts_with = "json")]
    prometheus: bool,
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.cmd {
        Cmd::Array(ArrayCmd::Create(a)) => array_create(a),
        Cmd::Volume(v) => volume(v),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Status(a) => status(a),
        Cmd::Sim(a) => sim::run(a),
    };
    if let Err(e) = result {
        eprintln!("lamina: error: {e:#}");
        std::process::exit(1);
    }
}

pub fn default_dir() -> PathBuf {
    PathBuf::from("lamina-data")
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).with_context(|| format!("bad path {}", p.display()))
}

/// Splits `PATH[:SIZE]`.
fn parse_device(spec: &str) -> Result<(PathBuf, Option<u64>)> {
    if let Some((p, s)) = spec.rsplit_once(':') {
        if let Ok(size) = parse_size(s) {
            return Ok((PathBuf::from(p), Some(size)));
        }
    }
    Ok((PathBuf::from(spec), None))
}

fn random_uuid() -> [u8; 16] {
    let mut u: [u8; 16] = rand::random();
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

fn size_in_blocks(what: &str, s: &str) -> Result<u32> {
    let bytes = parse_size(s).map_err(anyhow::Error::msg)?;
    if bytes == 0 || bytes % 4096 != 0 || bytes / 4096 > u32::MAX as u64 {
        bail!("{what} {s} must be a positive multiple of 4 KiB");
    }
    Ok((bytes / 4096) as u32)
}

/// Creates an array in `dir` (shared by `array create` and the embedded default).
pub fn create_array(
    dir: &Path,
    device_specs: &[(PathBuf, Option<u64>)],
    params: FormatParams,
) -> Result<()> {
    if Config::exists(dir) {
        bail!(
            "{} already holds an array ({} exists)",
            dir.display(),
            Config::path(dir).display()
        );
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut seen = std::collections::HashSet::new();
    let mut devices: Vec<Arc<dyn BlockDevice>> = Vec::new();
    let mut paths = Vec::new();
    let mut created = Vec::new();
    let cleanup = |created: &[PathBuf]| {
        for p in created {
            let _ = std::fs::remove_file(p);
        }
    };
    for (p, size) in device_specs {
        let abs = absolute(p)?;
        let canon = abs.canonicalize().unwrap_or(abs.clone());
        if !seen.insert(canon) {
            cleanup(&created);
            bail!("device {} is listed twice", p.display());
        }
        let dev = if abs.exists() {
            let d = FileDevice::open(&abs, DevMode::ReadWrite)?;
            if let Some(s) = size {
                if !d.is_block_device() && d.size_bytes() != *s {
                    cleanup(&created);
                    bail!(
                        "{} exists with {} bytes, not the {} given; omit :SIZE to use it as it is",
                        abs.display(),
                        d.size_bytes(),
                        s
                    );
                }
            }
            d
        } else {
            let Some(s) = size else {
                cleanup(&created);
                bail!(
                    "{} does not exist; give PATH:SIZE to create a sparse file",
                    abs.display()
                );
            };
            let d = FileDevice::create_sparse(&abs, *s)?;
            created.push(abs.clone());
            d
        };
        devices.push(Arc::new(dev));
        paths.push(abs);
    }
    let uuids: Vec<[u8; 16]> = devices.iter().map(|_| random_uuid()).collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    if let Err(e) = lamina_core::format(&devices, &params, random_uuid(), &uuids, now) {
        cleanup(&created);
        return Err(e.into());
    }
    // Opening writes the first checkpoint.
    let (engine, _) = lamina_core::open(devices, EngineConfig::default(), OpenMode::ReadWrite)?;
    drop(engine);
    Config::new(paths).save(dir)?;
    Ok(())
}

fn array_create(a: ArrayCreateArgs) -> Result<()> {
    let dir = absolute(&a.dir)?;
    let specs = a
        .devices
        .iter()
        .map(|d| parse_device(d))
        .collect::<Result<Vec<_>>>()?;
    let layout = match a.layout.as_str() {
        "jbod" => Layout::Jbod,
        "said0" => Layout::Said0,
        "said5" => Layout::Said5,
        _ => Layout::Said6,
    };
    let name = a.name.unwrap_or_else(|| {
        dir.file_name()
            .map(|n| n.to_string_lossy().chars().take(63).collect())
            .unwrap_or_else(|| "lamina".into())
    });
    let params = FormatParams {
        name,
        layout,
        segment_blocks: size_in_blocks("segment size", &a.segment_size)?,
        write_unit_blocks: size_in_blocks("write unit", &a.write_unit)?,
        overprovision: a.overprovision,
        force: a.force,
    };
    create_array(&dir, &specs, params)?;
    let (engine, _) = open_array(&dir, OpenMode::ReadOnly)?;
    let s = engine.status();
    println!(
        "created array {:?} in {}: {} device(s), capacity {}, usable {} ({} segments of {})",
        s.array_name,
        dir.display(),
        s.devices.len(),
        human(s.capacity_bytes),
        human(s.usable_bytes),
        s.segment_count,
        human(s.segment_size_bytes)
    );
    Ok(())
}

/// Opens the devices listed in `dir`'s config and recovers the array.
pub fn open_array(
    dir: &Path,
    mode: OpenMode,
) -> Result<(lamina_core::Engine, lamina_core::RecoveryReport)> {
    let cfg = Config::load(dir)?;
    let dm = match mode {
        OpenMode::ReadWrite => DevMode::ReadWrite,
        OpenMode::ReadOnly => DevMode::ReadOnly,
    };
    let mut devices: Vec<Arc<dyn BlockDevice>> = Vec::new();
    for p in &cfg.devices {
        let p = Config::resolve(dir, p);
        devices.push(Arc::new(FileDevice::open(&p, dm)?));
    }
    let ec = cfg.engine_config()?;
    Ok(lamina_core::open(devices, ec, mode)?)
}

fn admin_socket(dir: &Path) -> Result<PathBuf> {
    let cfg = Config::load(dir)?;
    Ok(Config::resolve(dir, &cfg.admin_socket))
}

/// Runs a request against a stopped array (opened read-write, then closed cleanly).
fn offline(dir: &Path, req: Request) -> Result<()> {
    let (mut engine, _) = open_array(dir, OpenMode::ReadWrite).context(
        "cannot open the array (if `lamina serve` is running, its admin socket did not answer)",
    )?;
    let token = lamina_core::Token { conn: 0, handle: 1 };
    engine.submit(token, req);
    lamina_core::run_inline(&mut engine);
    let mut replies = Vec::new();
    engine.drain_replies(&mut replies);
    match replies.into_iter().find(|r| r.token == token) {
        Some(r) => r.result.map_err(Into::into),
        None => bail!("request did not complete"),
    }
}

fn volume(cmd: VolumeCmd) -> Result<()> {
    match cmd {
        VolumeCmd::Create { dir, name, size } => {
            let dir = absolute(&dir)?;
            let size = parse_size(&size).map_err(anyhow::Error::msg)?;
            let req = json!({"op": "volume-create", "name": name, "size": size});
            if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                offline(
                    &dir,
                    Request::CreateVolume {
                        name: name.clone(),
                        size_bytes: size,
                    },
                )?;
            }
            println!("created volume {name:?} ({})", human(size));
        }
        VolumeCmd::Delete { dir, name } => {
            let dir = absolute(&dir)?;
            let req = json!({"op": "volume-delete", "name": name});
            if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                offline(&dir, Request::DeleteVolume { name: name.clone() })?;
            }
            println!("deleted volume {name:?}");
        }
        VolumeCmd::List { dir, json } => {
            let dir = absolute(&dir)?;
            let (report, running) = get_status(&dir)?;
            if json {
                let v = output::status_json(&report, running);
                println!("{}", serde_json::to_string_pretty(&v["volumes"])?);
            } else {
                println!("{:<20} {:>12} {:>12}", "NAME", "SIZE", "LIVE");
                for v in &report.volumes {
                    println!(
                        "{:<20} {:>12} {:>12}",
                        v.name,
                        human(v.size_bytes),
                        human(v.live_bytes)
                    );
                }
            }
        }
    }
    Ok(())
}

fn get_status(dir: &Path) -> Result<(lamina_core::StatusReport, bool)> {
    if let Some(v) = admin::request(&admin_socket(dir)?, &json!({"op": "status"}))? {
        return Ok((admin::status_from_json(&v)?, true));
    }
    let (engine, _) = open_array(dir, OpenMode::ReadOnly).context(
        "cannot read the array (if `lamina serve` is running, its admin socket did not answer)",
    )?;
    Ok((engine.status(), false))
}

fn status(a: StatusArgs) -> Result<()> {
    let dir = absolute(&a.dir.unwrap_or_else(default_dir))?;
    let (report, running) = get_status(&dir)?;
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&output::status_json(&report, running))?
        );
    } else if a.prometheus {
        print!("{}", output::metrics_text(&report));
    } else {
        print!("{}", output::status_text(&report, running));
    }
    Ok(())
}
