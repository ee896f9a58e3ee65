//! Opening an array's devices: files and block devices, and emulated zoned
//! devices (a file with a `.zones` state file beside it, see
//! [`lamina_device::zoned::state_path`]).

use anyhow::{bail, Context, Result};
use lamina_device::file::{FileDevice, IoOptions, OpenMode as DevMode};
use lamina_device::zoned::{state_path, ZonedConfig, ZonedDevice};
use lamina_device::BlockDevice;
use std::path::Path;
use std::sync::Arc;

/// Opens `path`; a file with a zone state file beside it is an emulated zoned
/// device, a host-managed zoned block device is driven through the kernel's zone
/// ioctls. `io` says how to drive it (the array's `[engine] io_engine` and
/// `direct_io`).
pub fn open_device(path: &Path, mode: DevMode, io: IoOptions) -> Result<Arc<dyn BlockDevice>> {
    let file = FileDevice::open_with(path, mode, io)?;
    if file.is_block_device() {
        return Ok(Arc::from(lamina_device::blkzoned::open_if_zoned(file)?));
    }
    let state = state_path(path);
    if !state.exists() {
        return Ok(Arc::new(file));
    }
    let z = ZonedDevice::open_persistent(Arc::new(file), &state)?;
    if !z.damaged_zones().is_empty() {
        tracing::error!(
            "{}: zone state of zones {:?} damaged; they are offline",
            state.display(),
            z.damaged_zones()
        );
    }
    Ok(Arc::new(z))
}

/// Makes `file` (just created or opened for a new array) an emulated zoned device
/// described by `spec`, writing its zone state file.
pub fn make_zoned(path: &Path, file: FileDevice, spec: &str) -> Result<Arc<dyn BlockDevice>> {
    let cfg = parse_zoned(spec, file.size_bytes())?;
    let z = ZonedDevice::create_persistent(Arc::new(file), cfg, &state_path(path))
        .with_context(|| format!("{}: cannot emulate a zoned device", path.display()))?;
    Ok(Arc::new(z))
}

/// `smr` or `zns`, then comma-separated settings: `zone=SIZE`, `cap=SIZE` (zone
/// capacity), `conv=N` (conventional zones at the start), `open=N`, `active=N`.
///
/// * `smr`: host-managed SMR, 256 MiB zones, 1% conventional zones (at least
///   enough for Lamina's first megabyte), 128 open zones.
/// * `zns`: 64 MiB zones of 48 MiB capacity, 14 open and active zones, one
///   conventional zone (a ZNS namespace has none; Lamina keeps its superblocks in
///   the first megabyte, so give a ZNS drive a small conventional partner).
pub fn parse_zoned(spec: &str, size: u64) -> Result<ZonedConfig> {
    let mut parts = spec.split(',');
    let kind = parts.next().unwrap_or("");
    let mut c = match kind {
        "smr" => ZonedConfig {
            zone_bytes: 256 << 20,
            zone_capacity_bytes: 256 << 20,
            conventional_zones: 0,
            max_open: 128,
            max_active: 0,
            ..Default::default()
        },
        "zns" => ZonedConfig {
            zone_bytes: 64 << 20,
            zone_capacity_bytes: 48 << 20,
            conventional_zones: 1,
            max_open: 14,
            max_active: 14,
            ..Default::default()
        },
        _ => bail!("zoned device {spec:?}: start with smr or zns"),
    };
    let mut cap_given = false;
    let mut conv_given = false;
    for p in parts {
        let (k, v) = p
            .split_once('=')
            .with_context(|| format!("zoned setting {p:?} is not KEY=VALUE"))?;
        let size_of = |v: &str| crate::size::parse_size(v).map_err(anyhow::Error::msg);
        let num = |v: &str| {
            v.parse::<u32>()
                .with_context(|| format!("zoned setting {k}={v:?} is not a count"))
        };
        match k {
            "zone" => c.zone_bytes = size_of(v)?,
            "cap" => {
                c.zone_capacity_bytes = size_of(v)?;
                cap_given = true;
            }
            "conv" => {
                c.conventional_zones = num(v)?;
                conv_given = true;
            }
            "open" => c.max_open = num(v)?,
            "active" => c.max_active = num(v)?,
            _ => bail!("unknown zoned setting {k:?} (zone, cap, conv, open, active)"),
        }
    }
    if !cap_given {
        c.zone_capacity_bytes = if kind == "smr" {
            c.zone_bytes
        } else {
            c.zone_bytes / 4 * 3 / 4096 * 4096
        };
    }
    if !conv_given && kind == "smr" && c.zone_bytes > 0 {
        let zones = size / c.zone_bytes;
        let megabyte = (1u64 << 20).div_ceil(c.zone_bytes);
        c.conventional_zones = zones.div_ceil(100).max(megabyte) as u32;
    }
    if kind == "zns" && c.max_active != 0 && c.max_open > c.max_active {
        c.max_open = c.max_active;
    }
    c.validate(size)
        .map_err(|e| anyhow::anyhow!("zoned device {spec:?}: {e}"))?;
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        let c = parse_zoned("smr", 10 << 30).unwrap();
        assert_eq!(
            (c.zone_bytes, c.conventional_zones, c.max_open),
            (256 << 20, 1, 128)
        );
        let c = parse_zoned("zns,zone=4M,open=8,active=10", 256 << 20).unwrap();
        assert_eq!(
            (c.zone_capacity_bytes, c.max_open, c.max_active),
            (3 << 20, 8, 10)
        );
        for (bad, want) in [
            ("hdd", "smr or zns"),
            ("zns,zone=4M,cap=8M", "capacity"),
            ("smr,speed=3", "unknown zoned setting"),
            ("zns,open=x", "not a count"),
            ("zns,conv", "KEY=VALUE"),
        ] {
            let e = parse_zoned(bad, 256 << 20).unwrap_err().to_string();
            assert!(e.contains(want), "{bad}: {e}");
        }
    }
}
