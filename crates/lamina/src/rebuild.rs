//! `lamina array replace`: putting a new device in the place of a failed member and
//! rebuilding it, online (through the running server) or offline.

use crate::config::Config;
use crate::runtime::Runtime;
use anyhow::{bail, Context, Result};
use lamina_core::rebuild::{rebuild, RebuildOptions, RebuildReport};
use lamina_core::{NewDevice, Request};
use lamina_device::file::{FileDevice, IoOptions, OpenMode as DevMode};
use lamina_device::BlockDevice;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Opens (or creates, with a size) the replacement device; refuses one that holds
/// a Lamina superblock unless `force`.
pub fn open_new_device(
    path: &Path,
    size: Option<u64>,
    force: bool,
    io: IoOptions,
) -> Result<Arc<dyn BlockDevice>> {
    let dev: Arc<dyn BlockDevice> = if path.exists() {
        crate::devices::open_device(path, DevMode::ReadWrite, io)?
    } else {
        let Some(size) = size else {
            bail!(
                "{} does not exist; give PATH:SIZE to create a sparse file",
                path.display()
            );
        };
        drop(FileDevice::create_sparse(path, size)?);
        crate::devices::open_device(path, DevMode::ReadWrite, io)?
    };
    if !force {
        if let Some(sb) = lamina_core::recovery::label_of(&*dev) {
            bail!(
                "{} belongs to Lamina array {:?}; refusing to overwrite it (--force to reuse it)",
                path.display(),
                sb.array_name
            );
        }
    }
    Ok(dev)
}

/// The path in a member's name (emulated zoned members are named `zoned(PATH)`).
pub fn member_path(name: &str) -> &str {
    name.strip_prefix("zoned(")
        .and_then(|s| s.strip_suffix(')'))
        .unwrap_or(name)
}

/// Before replacing a member of an array of emulated zoned devices: a new file
/// is created as a zoned device emulated like the old member (`old_name`).
/// Returns whether it did (the file then exists, so no size is needed).
pub fn prepare_zoned(old_name: &str, path: &Path, size: Option<u64>) -> Result<bool> {
    use lamina_device::zoned::{state_path, ZonedDevice};
    let template = state_path(Path::new(member_path(old_name)));
    if path.exists() || !template.exists() {
        return Ok(false);
    }
    let Some(size) = size else {
        bail!(
            "{} does not exist; give PATH:SIZE to create it (emulated zoned like the member it replaces)",
            path.display()
        );
    };
    let cfg = ZonedDevice::read_config(&template)?;
    let f = FileDevice::create_sparse(path, size)?;
    ZonedDevice::create_persistent(Arc::new(f), cfg, &state_path(path))
        .with_context(|| format!("{}: cannot emulate a zoned device", path.display()))?;
    Ok(true)
}

/// Puts `dev` in member slot `index` (recorded durably when this returns).
pub fn replace(rt: &Runtime, index: usize, dev: Arc<dyn BlockDevice>) -> Result<()> {
    rt.call(Request::ReplaceMember {
        index,
        device: NewDevice(dev),
        uuid: crate::random_uuid(),
    })?;
    Ok(())
}

/// Rebuilds member `index` on this thread.
pub fn run(
    rt: &Runtime,
    index: usize,
    rate: Option<u64>,
    all_stripes: bool,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RebuildReport> {
    let call = |r: Request| rt.call(r).map(|_| ());
    let opts = RebuildOptions {
        rate_bytes_per_s: rate,
        all_stripes,
        ..Default::default()
    };
    Ok(rebuild(&rt.shared, index, &call, &opts, progress)?)
}

/// Rebuilds member `index` on a thread of its own (in the server), logging the
/// outcome; waits for a rebuild of the slot that is still running to end first.
pub fn spawn(rt: &Runtime, index: usize, rate: Option<u64>) {
    let Some(st) = rt.shared.striped.clone() else {
        return;
    };
    let Some(m) = rt.shared.geo.striped_index(index) else {
        return;
    };
    let rt = rt.clone();
    std::thread::Builder::new()
        .name(format!("lamina-rebuild{index}"))
        .spawn(move || {
            // A rebuild of a device this slot held before may still be winding
            // down (it stops at its next stripe): wait for it.
            let t0 = std::time::Instant::now();
            while !st.claim_rebuild(m) {
                if t0.elapsed() > std::time::Duration::from_secs(600) {
                    tracing::error!("member {index}: another rebuild holds the slot; giving up");
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            tracing::info!("rebuilding member {index}");
            match run(&rt, index, rate, false, &mut |_, _| {}) {
                Ok(r) => tracing::info!(
                    "member {index} rebuilt in {:.1}s: {} of {} stripes held data, {} bytes written (a whole-device rebuild writes {})",
                    r.elapsed.as_secs_f64(),
                    r.stripes_rebuilt,
                    r.stripes_visited,
                    r.bytes_written,
                    r.whole_device_bytes
                ),
                Err(e) => tracing::error!("rebuild of member {index} stopped: {e}"),
            }
            st.release_rebuild(m);
        })
        .expect("spawn rebuild thread");
}

/// Starts the rebuilds a previous run left unfinished.
pub fn resume_all(rt: &Runtime, rate: Option<u64>) {
    if let Some(st) = rt.shared.striped.clone() {
        for i in 0..st.shape().members() {
            if st.rebuild_cursor(i).is_some() && !st.is_failed(i) {
                spawn(rt, rt.shared.geo.striped_member(i), rate);
            }
        }
    }
}

/// Swaps the failed member's path for the new one in `lamina.toml` (the list is in
/// any order; superblocks give each device its place).
pub fn update_config(dir: &Path, old_name: &str, new: &Path) -> Result<()> {
    let mut cfg = Config::load(dir)?;
    let old_name = member_path(old_name);
    let new = std::path::absolute(new).with_context(|| format!("bad path {}", new.display()))?;
    // A member missing since an import is named "member N (missing)" and stands
    // in the configuration as its placeholder path.
    let placeholder = old_name
        .strip_prefix("member ")
        .and_then(|r| r.strip_suffix(" (missing)"))
        .and_then(|n| n.parse::<usize>().ok())
        .map(crate::arrays::missing_member);
    cfg.devices.retain(|p| {
        let r = Config::resolve(dir, p);
        let s = r.display().to_string();
        !(old_name == s
            || old_name.starts_with(&format!("{s} ("))
            || r == new
            || placeholder.as_ref() == Some(&r))
    });
    cfg.devices.push(PathBuf::from(&new));
    crate::config::set_devices(&Config::path(dir), &cfg.devices)
}
