//! `DIR/lamina.toml`: where an array's devices are and how to serve it.
//!
//! The array itself (layout, segment size, volumes, the map) is described by the
//! superblocks and checkpoints on its devices; this file only lists the device paths
//! and the server's sockets, logs and tunables. Paths are relative to DIR unless
//! absolute.

use crate::size::parse_size;
use anyhow::{bail, Context, Result};
use lamina_device::file::{DirectIo, IoEngine, IoOptions};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const CONFIG_FILE: &str = "lamina.toml";
/// What `lamina array export` leaves of CONFIG_FILE.
pub const EXPORTED_FILE: &str = "lamina.toml.exported";

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The array these devices hold (32 hex digits, as `lamina status` shows it):
    /// a configuration pointed at another array's devices is refused. Arrays made
    /// before it was written have none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub array_uuid: Option<String>,
    /// Backing files or block devices, in any order (superblocks give the order).
    pub devices: Vec<PathBuf>,
    /// Unix socket of the admin interface (`lamina status`, `lamina volume create`).
    #[serde(default = "default_admin")]
    pub admin_socket: PathBuf,
    /// Log file (besides standard error).
    #[serde(default = "default_log")]
    pub log_file: PathBuf,
    #[serde(default)]
    pub serve: ServeConfig,
    #[serde(default)]
    pub engine: EngineSection,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// Unix socket for NBD clients.
    #[serde(default = "default_unix")]
    pub unix: Option<PathBuf>,
    /// TCP address for NBD clients; none unless given (`array create --tcp`;
    /// the embedded default listens on loopback).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<String>,
    /// Address of the Prometheus metrics endpoint (`/metrics`); off when absent.
    #[serde(default)]
    pub metrics: Option<String>,
    /// Threads executing device writes and syncs.
    #[serde(default = "default_io_threads")]
    pub io_threads: usize,
    /// How many nice steps below the server the I/O threads run (0-19, default
    /// 0). Above 0 they give the CPU to the threads serving clients first; on a
    /// 2-core machine under GC that made writes wait for GC and reads during GC
    /// slower, so it is off by default (docs/design.md, "Read priority").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_nice: Option<i32>,
    /// Most bytes per second a rebuild writes to a new member ("200M"), so that
    /// clients keep their share of the devices; unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild_rate: Option<String>,
    /// Most request payload ("256M") held in memory over all client connections
    /// together; requests beyond it wait. Default 256 MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_inflight: Option<String>,
    /// Threads serving reads per listener: the most reads in flight to the devices
    /// at once over its connections (default 32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_threads: Option<usize>,
    /// Serve every volume read-only: clients see NBD_FLAG_READ_ONLY, and writes,
    /// trims and zeroes get EPERM.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_only: bool,
    /// Volumes served read-only (the others take writes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read_only_volumes: Vec<String>,
    /// TLS server certificate chain (PEM). With `tls_key`, clients may start TLS
    /// (NBD_OPT_STARTTLS) and TCP clients must.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// Private key of `tls_cert` (PEM).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Certificate authorities (PEM) that client certificates must chain to; when
    /// set, clients without such a certificate are refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_ca: Option<PathBuf>,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            unix: default_unix(),
            tcp: None,
            metrics: None,
            io_threads: default_io_threads(),
            io_nice: None,
            rebuild_rate: None,
            max_inflight: None,
            read_threads: None,
            read_only: false,
            read_only_volumes: Vec::new(),
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EngineSection {
    /// Victim policy: auto (the default: SepBIT's cost-benefit-sqrt while the
    /// volume's classes separate, else greedy or cost-benefit-sqrt as a miniature
    /// of the volume shows better), cost-benefit-sqrt, greedy, cost-benefit,
    /// d-choices, salsa, lamina.
    pub gc_policy: Option<String>,
    /// Heat classifier: auto (the default: SepBIT, or none where a zoned array's
    /// open-zone limit cannot hold its streams), none, frequency, sepbit, lamina
    /// (see docs/design.md for what each costs in memory per block).
    pub classifier: Option<String>,
    /// Wear-aware tie-breaking window for victims (0 disables; default 0.1).
    pub wear_window: Option<f64>,
    /// Per-volume choices, e.g. `[engine.volumes.db] classifier = "sepbit"`.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub volumes: std::collections::BTreeMap<String, VolumeEngine>,
    /// Write-unit buffers (the DRAM write buffer).
    pub buffer_units: Option<u32>,
    /// Data written between checkpoints, e.g. "1G".
    pub checkpoint_interval: Option<String>,
    /// Background flush interval in milliseconds.
    pub auto_sync_ms: Option<u64>,
    /// GC reads the dead blocks between live ones when the gap is at most this
    /// ("1M" suits disks, where a seek costs more than a megabyte of transfer;
    /// default 0, flash reads only what is live).
    pub gc_read_gap: Option<String>,
    /// Geometry-aware placement: GC moves blocks read since they were written to
    /// the outermost free segments (default: on for zoned arrays).
    pub geometry_aware: Option<bool>,
    /// Pace user writes to garbage collection once it runs (default false): they
    /// slow smoothly as GC falls behind instead of stopping at the floor, for
    /// some throughput and write amplification (docs/design.md, "Pacing").
    pub gc_pacing: Option<bool>,
    /// Discard free segments (TRIM, holes in files); default true.
    pub discard: Option<bool>,
    /// Milliseconds a segment stays free before it is discarded (default 30000);
    /// segments reused sooner are not discarded at all.
    pub discard_delay_ms: Option<u64>,
    /// Fraction of the usable capacity at which the array is logged and shown as
    /// filling up (default 0.8), and as nearly full (`space_critical`, 0.95).
    pub space_warn: Option<f64>,
    pub space_critical: Option<f64>,
    /// `volume create` is refused when the volumes' sizes together would exceed
    /// this multiple of the usable capacity (thin provisioning; default no limit).
    pub max_overcommit: Option<f64>,
    /// Memory for cached unit headers (checksums and owners the read path needs),
    /// e.g. "64M" (the default, about 20 GiB of data in 512 KiB units). A read whose
    /// unit is not cached reads its header from the device as well.
    pub header_cache: Option<String>,
    /// What drives the devices: "auto" (io_uring where the kernel has it, the
    /// default), "uring" (refuse to start without it) or "sync" (pread/pwrite).
    pub io_engine: Option<String>,
    /// Bypass the page cache (O_DIRECT): "auto" (on block devices, the default),
    /// "on" (files too, where the file system allows) or "off".
    pub direct_io: Option<String>,
}

/// Choices for one volume: placement (overrides the `[engine]` ones) and limits.
#[derive(Clone, Debug, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct VolumeEngine {
    pub classifier: Option<String>,
    pub gc_policy: Option<String>,
    /// Requests per second the volume's clients get together (reads, writes,
    /// trims, zeroes); unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops_limit: Option<u64>,
    /// Payload bytes per second ("100M"); unlimited when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_limit: Option<String>,
}

impl VolumeEngine {
    /// The volume's limits, checked.
    pub fn limits(&self, name: &str) -> Result<crate::qos::Limits> {
        if self.iops_limit == Some(0) {
            bail!(
                "[engine.volumes.{name}] iops_limit = 0: give a positive number, or leave it out"
            );
        }
        let bytes_per_sec = match &self.bandwidth_limit {
            None => None,
            Some(b) => match parse_size(b) {
                Ok(n) if n > 0 => Some(n),
                Ok(_) => bail!("[engine.volumes.{name}] bandwidth_limit = {b:?}: give more than 0"),
                Err(e) => bail!("[engine.volumes.{name}] bandwidth_limit = {b:?}: {e}"),
            },
        };
        Ok(crate::qos::Limits {
            iops: self.iops_limit,
            bytes_per_sec,
        })
    }
}

/// Volume `name`'s table in the configuration document (`[engine.volumes.NAME]`,
/// or however the file writes it: dotted keys, an inline table), made (with
/// `engine` and `engine.volumes` as implicit tables when missing) if `create`.
fn volume_table<'a>(
    doc: &'a mut toml_edit::DocumentMut,
    name: &str,
    create: bool,
) -> Result<Option<&'a mut dyn toml_edit::TableLike>> {
    use toml_edit::{Item, Table};
    let implicit = || {
        let mut t = Table::new();
        t.set_implicit(true);
        Item::Table(t)
    };
    let exists = doc
        .get("engine")
        .and_then(|e| e.get("volumes"))
        .and_then(|v| v.get(name))
        .is_some();
    if !exists && !create {
        return Ok(None);
    }
    let not_table = |what: &str| anyhow::anyhow!("{what} in lamina.toml is not a table");
    let engine = doc
        .entry("engine")
        .or_insert_with(implicit)
        .as_table_like_mut()
        .ok_or_else(|| not_table("engine"))?;
    let volumes = engine
        .entry("volumes")
        .or_insert_with(implicit)
        .as_table_like_mut()
        .ok_or_else(|| not_table("engine.volumes"))?;
    let vol = volumes
        .entry(name)
        .or_insert_with(|| Item::Table(Table::new()))
        .as_table_like_mut()
        .ok_or_else(|| not_table(&format!("engine.volumes.{name}")))?;
    Ok(Some(vol))
}

fn read_document(path: &std::path::Path) -> Result<toml_edit::DocumentMut> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    text.parse()
        .with_context(|| format!("{} does not parse as TOML", path.display()))
}

/// Writes an edited configuration back, if it still parses as one.
fn write_document(path: &std::path::Path, doc: &toml_edit::DocumentMut) -> Result<()> {
    let out = doc.to_string();
    toml::from_str::<Config>(&out).with_context(|| {
        format!(
            "the edited {} would not parse; left as it was",
            path.display()
        )
    })?;
    replace_file(path, &out)
}

/// Replaces the file at `path` with `text`: written beside it, synced, renamed.
fn replace_file(path: &std::path::Path, text: &str) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("toml.tmp");
    let mut f =
        std::fs::File::create(&tmp).with_context(|| format!("cannot write {}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .and_then(|()| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))?;
    // The rename itself durable too: `array grow` writes the members' superblocks
    // only after the file names the new devices.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .with_context(|| format!("cannot sync {}", dir.display()))?;
    }
    Ok(())
}

/// Sets the `devices` list of the configuration file at `path` to `devices`, in
/// place (through `toml_edit`, so comments and the rest stay), and makes it
/// durable: `array grow` and `array replace` write members' superblocks only
/// after it.
pub fn set_devices(path: &std::path::Path, devices: &[PathBuf]) -> Result<()> {
    let mut doc = read_document(path)?;
    let list = doc
        .get_mut("devices")
        .and_then(|d| d.as_array_mut())
        .with_context(|| format!("{} has no devices list", path.display()))?;
    list.clear();
    for p in devices {
        list.push(p.display().to_string());
    }
    write_document(path, &doc)
}

/// Sets keys of volume `name`'s section (`[engine.volumes.NAME]`) in the
/// configuration file at `path`: each `(key, Some(value))` replaces the key's value
/// or adds the key (value as TOML, e.g. `5000` or `"100M"`), each `(key, None)`
/// removes it. The section is added at the end when missing. The edit goes through
/// `toml_edit`, so everything else stays as it is, comments included (a comment
/// after a replaced value too); the result must parse as a configuration before it
/// replaces the file.
pub fn set_volume_keys(
    path: &std::path::Path,
    name: &str,
    keys: &[(&str, Option<String>)],
) -> Result<()> {
    let mut doc = read_document(path)?;
    let create = keys.iter().any(|(_, v)| v.is_some());
    let Some(section) = volume_table(&mut doc, name, create)? else {
        return Ok(());
    };
    for (key, value) in keys {
        match value {
            Some(v) => {
                let mut new: toml_edit::Value = v.parse().with_context(|| {
                    format!(
                        "{key} = {v} is not a TOML value; {} left as it was",
                        path.display()
                    )
                })?;
                match section.get_mut(key) {
                    // In place: the key as it was written, and what surrounds the
                    // value (a comment after it).
                    Some(item) => {
                        if let Some(old) = item.as_value() {
                            *new.decor_mut() = old.decor().clone();
                        }
                        *item = toml_edit::Item::Value(new);
                    }
                    None => {
                        section.insert(key, toml_edit::Item::Value(new));
                    }
                }
            }
            None => {
                section.remove(key);
            }
        }
    }
    write_document(path, &doc)
}

/// Renames the section of volume `name` (`[engine.volumes.NAME]`) in the
/// configuration file at `path` to `new_name`, in place, with its comments (through
/// `toml_edit`; a name with a '.' is quoted). True when there was such a section.
pub fn rename_volume_section(path: &std::path::Path, name: &str, new_name: &str) -> Result<bool> {
    let mut doc = read_document(path)?;
    let Some(volumes) = doc
        .get_mut("engine")
        .and_then(|e| e.get_mut("volumes"))
        .and_then(|v| v.as_table_like_mut())
    else {
        return Ok(false);
    };
    if volumes.contains_key(new_name) {
        bail!(
            "{} already has a section for {new_name:?}; {name:?}'s stays as it is",
            path.display()
        );
    }
    let Some(section) = volumes.remove(name) else {
        return Ok(false);
    };
    volumes.insert(new_name, section);
    replace_file(path, &doc.to_string())?;
    Ok(true)
}

fn default_admin() -> PathBuf {
    "admin.sock".into()
}
fn default_log() -> PathBuf {
    "lamina.log".into()
}
fn default_unix() -> Option<PathBuf> {
    Some("nbd.sock".into())
}
fn default_io_threads() -> usize {
    4
}

/// See [`ServeConfig::io_nice`].
/// Off: measured worse than 0 on every figure of the reads-during-GC run at 10
/// (docs/design.md, "Read priority").
const DEFAULT_IO_NICE: i32 = 0;

impl ServeConfig {
    /// `io_nice`, checked.
    pub fn io_nice(&self) -> Result<i32> {
        match self.io_nice.unwrap_or(DEFAULT_IO_NICE) {
            n @ 0..=19 => Ok(n),
            n => bail!("[serve] io_nice = {n}: give 0 to 19"),
        }
    }
}

impl Config {
    pub fn new(devices: Vec<PathBuf>) -> Self {
        Config {
            array_uuid: None,
            devices,
            admin_socket: default_admin(),
            log_file: default_log(),
            serve: ServeConfig::default(),
            engine: EngineSection::default(),
        }
    }

    pub fn path(dir: &Path) -> PathBuf {
        dir.join(CONFIG_FILE)
    }

    pub fn exists(dir: &Path) -> bool {
        Self::path(dir).exists()
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let p = Self::path(dir);
        let text = std::fs::read_to_string(&p).with_context(|| {
            if dir.join(EXPORTED_FILE).exists() {
                format!(
                    "the array in {} was exported (`lamina array import {}` brings it back)",
                    dir.display(),
                    dir.display()
                )
            } else {
                format!(
                    "{} holds no Lamina array (cannot read {})",
                    dir.display(),
                    p.display()
                )
            }
        })?;
        let cfg: Config = toml::from_str(&text)
            .with_context(|| format!("{} is not a valid configuration", p.display()))?;
        if cfg.devices.is_empty() {
            bail!("{}: `devices` lists no device", p.display());
        }
        let path = Self::path(dir);
        let e = &cfg.engine;
        let policies = std::iter::once(("[engine]", &e.gc_policy))
            .chain(e.volumes.iter().map(|(n, v)| (n.as_str(), &v.gc_policy)));
        for (whose, p) in policies {
            if let Some(p) = p.as_deref() {
                if lamina_core::gc::policy_by_name(p).is_none() {
                    bail!(
                        "{}: {whose}: unknown gc_policy {p:?} (known: {})",
                        path.display(),
                        lamina_core::gc::POLICY_NAMES.join(", ")
                    );
                }
            }
        }
        let classifiers = std::iter::once(("[engine]", &e.classifier))
            .chain(e.volumes.iter().map(|(n, v)| (n.as_str(), &v.classifier)));
        for (whose, c) in classifiers {
            if let Some(c) = c.as_deref() {
                if lamina_core::placement::classifier_by_name(c, 1).is_none() {
                    bail!(
                        "{}: {whose}: unknown classifier {c:?} (known: {})",
                        path.display(),
                        lamina_core::placement::CLASSIFIER_NAMES.join(", ")
                    );
                }
            }
        }
        if let Some(w) = e.wear_window {
            if !(0.0..=1.0).contains(&w) {
                bail!(
                    "{}: wear_window {w} must be between 0 and 1",
                    path.display()
                );
            }
        }
        if let Some(s) = &cfg.engine.checkpoint_interval {
            parse_size(s)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("{}: checkpoint_interval", Self::path(dir).display()))?;
        }
        if cfg.engine.buffer_units == Some(0) {
            bail!(
                "{}: buffer_units must be at least 1",
                Self::path(dir).display()
            );
        }
        Ok(cfg)
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        let text = format!(
            "# Lamina array configuration. The array itself (layout, volumes, data) is\n\
             # described by the superblocks on its devices; this file says where they are.\n{}",
            toml::to_string_pretty(self)?
        );
        let p = Self::path(dir);
        let tmp = dir.join(".lamina.toml.tmp");
        std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, &p).with_context(|| format!("cannot write {}", p.display()))?;
        Ok(())
    }

    /// A path from the config, made absolute against DIR.
    pub fn resolve(dir: &Path, p: &Path) -> PathBuf {
        if p.is_absolute() {
            p.to_path_buf()
        } else {
            dir.join(p)
        }
    }

    /// How the devices are driven (`[engine] io_engine`, `direct_io`).
    pub fn io_options(&self) -> Result<IoOptions> {
        let engine = match self.engine.io_engine.as_deref() {
            None | Some("auto") => IoEngine::Auto,
            Some("uring") | Some("io_uring") => IoEngine::Uring,
            Some("sync") => IoEngine::Sync,
            Some(o) => bail!("[engine] io_engine = {o:?}: give auto, uring or sync"),
        };
        let direct = match self.engine.direct_io.as_deref() {
            None | Some("auto") => DirectIo::Auto,
            Some("on") => DirectIo::On,
            Some("off") => DirectIo::Off,
            Some(o) => bail!("[engine] direct_io = {o:?}: give auto, on or off"),
        };
        Ok(IoOptions { engine, direct })
    }

    pub fn engine_config(&self) -> Result<lamina_core::EngineConfig> {
        let mut c = lamina_core::EngineConfig::default();
        if let Some(p) = &self.engine.gc_policy {
            c.gc_policy = p.clone();
        }
        if let Some(k) = &self.engine.classifier {
            c.classifier = k.clone();
        }
        if let Some(w) = self.engine.wear_window {
            c.wear_window = w;
        }
        c.volume_overrides = self
            .engine
            .volumes
            .iter()
            .map(|(name, v)| (name.clone(), v.classifier.clone(), v.gc_policy.clone()))
            .collect();
        if let Some(b) = self.engine.buffer_units {
            c.buffer_units = b;
        }
        if let Some(s) = &self.engine.checkpoint_interval {
            c.checkpoint_interval_blocks = parse_size(s).map_err(anyhow::Error::msg)? / 4096;
        }
        if let Some(ms) = self.engine.auto_sync_ms {
            c.auto_sync_ms = ms;
        }
        if let Some(g) = &self.engine.gc_read_gap {
            let bytes = parse_size(g).map_err(anyhow::Error::msg)?;
            if bytes % 4096 != 0 || bytes / 4096 > u32::MAX as u64 {
                anyhow::bail!("[engine] gc_read_gap {g:?} must be a multiple of 4 KiB");
            }
            c.gc_read_gap_blocks = (bytes / 4096) as u32;
        }
        if let Some(h) = &self.engine.header_cache {
            c.header_cache_bytes = parse_size(h)
                .map_err(anyhow::Error::msg)
                .with_context(|| format!("[engine] header_cache {h:?}"))?;
        }
        c.geometry_aware = self.engine.geometry_aware;
        if let Some(d) = self.engine.discard {
            c.discard = d;
        }
        if let Some(p) = self.engine.gc_pacing {
            c.gc_pacing = p;
        }
        if let Some(ms) = self.engine.discard_delay_ms {
            c.discard_delay_ms = ms;
        }
        c.space_warn = self.engine.space_warn.unwrap_or(c.space_warn);
        c.space_critical = self.engine.space_critical.unwrap_or(c.space_critical);
        c.max_overcommit = self.engine.max_overcommit;
        // The engine checks these too; here the message names the section.
        lamina_core::check_thresholds(c.space_warn, c.space_critical)
            .and_then(|()| {
                c.max_overcommit
                    .map_or(Ok(()), lamina_core::check_overcommit)
            })
            .map_err(|e| anyhow::anyhow!("[engine] {e}"))?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> (PathBuf, String) {
        let dir = std::env::temp_dir().join(format!(
            "lamina-config-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("lamina.toml");
        let head = "devices = [\"d.img\"]\n\n[engine]\n";
        std::fs::write(&p, format!("{head}{text}")).unwrap();
        (p, head.to_string())
    }

    /// Keys are replaced, added and removed in the section however its header is
    /// written; comments (after a replaced value too) and other sections stay; a
    /// missing section is added; the result parses.
    #[test]
    fn volume_keys_are_edited_in_place() {
        let (p, head) = file(
            "# web tier\n[ engine.volumes.\"web.1\" ]  # the frontends\n\"iops_limit\" = 10  # cap\nclassifier = \"sepbit\"\n\n[engine.volumes.db]\niops_limit = 7\n",
        );
        set_volume_keys(
            &p,
            "web.1",
            &[
                ("iops_limit", Some("500".into())),
                ("bandwidth_limit", Some("\"10M\"".into())),
            ],
        )
        .unwrap();
        let t = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            t,
            format!("{head}# web tier\n[ engine.volumes.\"web.1\" ]  # the frontends\n\"iops_limit\" = 500  # cap\nclassifier = \"sepbit\"\nbandwidth_limit = \"10M\"\n\n[engine.volumes.db]\niops_limit = 7\n")
        );
        set_volume_keys(&p, "db", &[("iops_limit", None)]).unwrap();
        set_volume_keys(&p, "new", &[("iops_limit", Some("3".into()))]).unwrap();
        set_volume_keys(&p, "gone", &[("iops_limit", None)]).unwrap();
        let t = std::fs::read_to_string(&p).unwrap();
        assert!(
            t.contains("[engine.volumes.db]\n\n[engine.volumes.new]\niops_limit = 3\n"),
            "{t}"
        );
        assert!(!t.contains("gone"), "{t}");
        let c: Config = toml::from_str(&t).unwrap();
        assert_eq!(c.engine.volumes["new"].iops_limit, Some(3));
        assert_eq!(c.engine.volumes["web.1"].iops_limit, Some(500));
        // A value that would not parse leaves the file as it was.
        assert!(set_volume_keys(&p, "db", &[("iops_limit", Some("\"x".into()))]).is_err());
        assert!(set_volume_keys(&p, "db", &[("iops_limit", Some("\"x\"".into()))]).is_err());
        assert_eq!(std::fs::read_to_string(&p).unwrap(), t);
        // Renaming finds the header written any way, keeps its comment, and quotes
        // a dotted name; a name already taken is refused.
        assert!(rename_volume_section(&p, "web.1", "web2").unwrap());
        assert!(rename_volume_section(&p, "new", "new.x").unwrap());
        assert!(!rename_volume_section(&p, "none", "other").unwrap());
        assert!(rename_volume_section(&p, "db", "web2").is_err());
        let t = std::fs::read_to_string(&p).unwrap();
        assert!(
            t.contains(
                "# web tier\n[engine.volumes.web2]  # the frontends\n\"iops_limit\" = 500  # cap\n"
            ),
            "{t}"
        );
        assert!(t.contains("[engine.volumes.\"new.x\"]\n"), "{t}");
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }

    /// Sections written as dotted keys or inline tables are edited where they are
    /// (the line-based editor added a second [engine.volumes.NAME], which then
    /// failed to parse), and no [engine] or [engine.volumes] is needed beforehand.
    #[test]
    fn volume_keys_in_any_toml_form() {
        let (p, head) =
            file("volumes.db.iops_limit = 7\nvolumes.web = { classifier = \"none\" }\n");
        set_volume_keys(&p, "db", &[("iops_limit", Some("8".into()))]).unwrap();
        set_volume_keys(&p, "web", &[("iops_limit", Some("9".into()))]).unwrap();
        let t = std::fs::read_to_string(&p).unwrap();
        assert_eq!(
            t,
            format!("{head}volumes.db.iops_limit = 8\nvolumes.web = {{ classifier = \"none\" , iops_limit = 9 }}\n")
        );
        let c: Config = toml::from_str(&t).unwrap();
        assert_eq!(c.engine.volumes["web"].iops_limit, Some(9));
        std::fs::write(&p, "devices = [\"d.img\"]\n").unwrap();
        set_volume_keys(&p, "v", &[("iops_limit", Some("1".into()))]).unwrap();
        assert_eq!(
            std::fs::read_to_string(&p).unwrap(),
            "devices = [\"d.img\"]\n\n[engine.volumes.v]\niops_limit = 1\n"
        );
        let _ = std::fs::remove_dir_all(p.parent().unwrap());
    }
}
