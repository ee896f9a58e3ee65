//! Arrays managed like mdadm and zpool: `lamina array list` (what devices hold),
//! `import` (an array found on devices, served from a directory), `export` (let
//! go of it, for another directory or host) and `destroy` (wipe its superblocks).

use crate::config::{Config, EXPORTED_FILE};
use crate::labels::{self, Found};
use crate::{absolute, admin, admin_socket, open_array};
use anyhow::{bail, Context, Result};
use lamina_core::{GrowParams, OpenMode};
use lamina_device::BlockDevice;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `lamina array list [PATH...]`.
pub fn list(paths: &[PathBuf], as_json: bool) -> Result<()> {
    let scan = labels::scan(&labels::candidates(paths)?);
    let found = &scan.arrays;
    if as_json {
        let v = json!({
            "arrays": found.iter().map(found_json).collect::<Vec<_>>(),
            "unreadable": scan.unreadable.iter().map(|(p, e)| json!({
                "path": p.display().to_string(), "error": e,
            })).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    report_unreadable(&scan);
    if found.is_empty() {
        println!("no Lamina array found");
        return Ok(());
    }
    println!(
        "{:<20} {:<32} {:<7} {:>7}  {:<10} {:>10}",
        "NAME", "UUID", "LAYOUT", "MEMBERS", "STATE", "GENERATION"
    );
    for f in found {
        let sb = &f.reference;
        println!(
            "{:<20} {:<32} {:<7} {:>3} / {:<2} {:<10} {:>10}",
            sb.array_name,
            labels::uuid_hex(&f.uuid),
            sb.layout.name(),
            f.in_array() - f.missing(),
            f.in_array(),
            f.state(),
            sb.generation
        );
        for (i, m) in f.members.iter().enumerate() {
            let tier = if f.cache(i) { " (cache tier)" } else { "" };
            match (m, f.failed(i)) {
                _ if f.removed(i) => println!("  member {i:<3} (removed)"),
                (Some(p), false) => println!("  member {i:<3} {}{tier}", p.display()),
                (Some(p), true) => println!("  member {i:<3} {}{tier} (failed)", p.display()),
                (None, _) => println!("  member {i:<3} (not found){tier}"),
            }
        }
        for why in &f.passed_over {
            println!("  passed over: {why}");
        }
    }
    Ok(())
}

/// Says on standard error which devices could not be read (as a user without
/// the rights to read /dev would otherwise see "no array found").
fn report_unreadable(scan: &labels::Scan) {
    if let Some((p, e)) = scan.unreadable.first() {
        eprintln!(
            "lamina: {} device(s) could not be read, e.g. {}: {e}",
            scan.unreadable.len(),
            p.display()
        );
    }
}

/// A UUID as given (with or without dashes, any case) in the form labels use.
fn normal_uuid(u: &str) -> String {
    u.chars()
        .filter(|c| *c != '-')
        .collect::<String>()
        .to_ascii_lowercase()
}

fn found_json(f: &Found) -> serde_json::Value {
    json!({
        "name": f.reference.array_name,
        "uuid": labels::uuid_hex(&f.uuid),
        "layout": f.reference.layout.name(),
        "state": f.state(),
        "generation": f.reference.generation,
        "members": f.members.iter().enumerate().map(|(i, m)| json!({
            "index": i,
            "path": m.as_ref().map(|p| p.display().to_string()),
            "failed": f.failed(i),
            "removed": f.removed(i),
            "tier": if f.cache(i) { "cache" } else { "capacity" },
        })).collect::<Vec<_>>(),
        "passed_over": f.passed_over,
    })
}

/// The placeholder written for a member not found: opening it fails, and the
/// array runs degraded without it (as for any member that cannot be opened).
/// `array replace` swaps it for the new device.
pub fn missing_member(i: usize) -> PathBuf {
    PathBuf::from(format!("/nonexistent/lamina-missing-member-{i}"))
}

/// `lamina array import DIR [PATH...] [--name N | --uuid U] [--degraded]`.
pub fn import(
    dir: &Path,
    paths: &[PathBuf],
    name: Option<&str>,
    uuid: Option<&str>,
    degraded: bool,
) -> Result<()> {
    let dir = absolute(dir)?;
    if Config::exists(&dir) {
        bail!(
            "{} already holds an array ({} exists)",
            dir.display(),
            Config::path(&dir).display()
        );
    }
    // An exported directory remembers its settings and where its devices were.
    let exported = dir.join(EXPORTED_FILE);
    let previous: Option<Config> = match std::fs::read_to_string(&exported) {
        Ok(text) => Some(
            toml::from_str(&text)
                .with_context(|| format!("{} is not a valid configuration", exported.display()))?,
        ),
        Err(_) => None,
    };
    let search: Vec<PathBuf> = match (&previous, paths.is_empty()) {
        // Where the devices were: those gone since are members not found.
        (Some(p), true) => p
            .devices
            .iter()
            .map(|d| Config::resolve(&dir, d))
            .filter(|d| d.exists())
            .collect(),
        _ => paths.to_vec(),
    };
    let want_uuid = uuid
        .or(previous.as_ref().and_then(|p| p.array_uuid.as_deref()))
        .map(normal_uuid);
    let select = |scan: labels::Scan| -> (Vec<Found>, labels::Scan) {
        let (keep, other): (Vec<Found>, Vec<Found>) = scan.arrays.into_iter().partition(|f| {
            name.is_none_or(|n| f.reference.array_name == n)
                && want_uuid
                    .as_deref()
                    .is_none_or(|u| labels::uuid_hex(&f.uuid) == u)
        });
        let rest = labels::Scan {
            arrays: other,
            unreadable: scan.unreadable,
        };
        (keep, rest)
    };
    let (mut found, mut rest) = select(labels::scan(&labels::candidates(&search)?));
    // Devices renamed since the export (sdb is sdc now): what is not where it was
    // is looked for on every block device.
    if previous.is_some() && paths.is_empty() && found.iter().any(|f| f.missing() > 0) {
        let mut all = search.clone();
        all.extend(labels::candidates(&[])?);
        (found, rest) = select(labels::scan(&all));
    }
    report_unreadable(&rest);
    let where_ = if search.is_empty() {
        "the block devices".to_string()
    } else {
        search
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let f = match found.len() {
        0 => bail!(
            "no Lamina array{}{} found on {where_}",
            name.map(|n| format!(" named {n:?}")).unwrap_or_default(),
            want_uuid
                .map(|u| format!(" of UUID {u}"))
                .unwrap_or_default()
        ),
        1 => found.remove(0),
        _ => bail!(
            "{} arrays found on {where_}: {}; say which with --name or --uuid",
            found.len(),
            found
                .iter()
                .map(|f| format!(
                    "{:?} ({})",
                    f.reference.array_name,
                    labels::uuid_hex(&f.uuid)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let sb = &f.reference;
    let missing: Vec<String> = f
        .members
        .iter()
        .enumerate()
        .filter(|(i, m)| m.is_none() && !f.removed(*i))
        .map(|(i, _)| i.to_string())
        .collect();
    let passed = if f.passed_over.is_empty() {
        String::new()
    } else {
        format!("; passed over: {}", f.passed_over.join("; "))
    };
    match f.state() {
        "incomplete" => bail!(
            "array {:?} ({}) is incomplete: member(s) {} not found on {where_}, and its {} layout \
             can do without {} member(s) in all, failed ones included (give the paths that hold \
             them){passed}",
            sb.array_name,
            labels::uuid_hex(&f.uuid),
            missing.join(", "),
            sb.layout.name(),
            f.parity()
        ),
        "degraded" if !missing.is_empty() && !degraded => bail!(
            "array {:?} ({}) would be imported degraded: member(s) {} not found on {where_}; \
             give the paths that hold them, or --degraded to serve it without them (then \
             `lamina array replace` rebuilds onto a new device){passed}",
            sb.array_name,
            labels::uuid_hex(&f.uuid),
            missing.join(", ")
        ),
        _ => {}
    }
    // A removed member needs no device: its device, if found, is left out too.
    let devices: Vec<PathBuf> = f
        .members
        .iter()
        .enumerate()
        .filter(|(i, _)| !f.removed(*i))
        .map(|(i, m)| m.clone().unwrap_or_else(|| missing_member(i)))
        .collect();
    let mut cfg = previous.unwrap_or_else(|| Config::new(Vec::new()));
    cfg.devices = devices;
    cfg.array_uuid = Some(labels::uuid_hex(&f.uuid));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    cfg.save(&dir)?;
    // It must open from here, or the import is taken back.
    if let Err(e) = open_array(&dir, OpenMode::ReadOnly) {
        let _ = std::fs::remove_file(Config::path(&dir));
        return Err(e.context(format!("array {:?} does not open", sb.array_name)));
    }
    let _ = std::fs::remove_file(&exported);
    println!(
        "imported array {:?} ({}, {}) into {}: {} of {} members{}",
        sb.array_name,
        labels::uuid_hex(&f.uuid),
        sb.layout.name(),
        dir.display(),
        f.in_array() - f.missing(),
        f.in_array(),
        if f.missing() > 0 {
            " (degraded: `lamina array replace` puts a new device in place of a missing one)"
        } else {
            ""
        }
    );
    Ok(())
}

/// Refuses when a server answers on the array's admin socket.
fn refuse_if_served(dir: &Path, what: &str) -> Result<()> {
    if admin::request(&admin_socket(dir)?, &json!({"op": "status"}))?.is_some() {
        bail!(
            "the array in {} is being served: stop `lamina serve` first, then {what}",
            dir.display()
        );
    }
    Ok(())
}

/// `lamina array grow DIR --device PATH[:SIZE]...` (see `lamina_core::grow` for
/// the order of its steps).
pub fn grow(
    dir: &Path,
    specs: &[(PathBuf, Option<u64>)],
    force: bool,
    discard: bool,
) -> Result<()> {
    let dir = absolute(dir)?;
    let cfg = Config::load(&dir)?;
    refuse_if_served(&dir, "grow it")?;
    let (members, ec) = crate::open_config_devices(&dir, OpenMode::ReadWrite)?;
    let in_array = member_paths(&dir, &cfg);
    let mut seen = std::collections::HashSet::new();
    let mut created = crate::Created::default();
    let mut paths = Vec::new();
    let mut new: Vec<Arc<dyn BlockDevice>> = Vec::new();
    for (p, size) in specs {
        let (abs, dev) = crate::open_new_device(p, *size, &in_array, &mut seen, &mut created)?;
        new.push(Arc::from(lamina_device::blkzoned::open_if_zoned(dev)?));
        paths.push(abs);
    }
    let uuids: Vec<[u8; 16]> = new.iter().map(|_| crate::random_uuid()).collect();
    let (pb, progress) = crate::discard_bar("new devices");
    let params = GrowParams {
        force,
        discard,
        progress: Some(progress),
    };
    let before = cfg.devices.len();
    let committed = std::cell::Cell::new(false);
    let mut commit = || {
        let all: Vec<PathBuf> = cfg.devices.iter().chain(&paths).cloned().collect();
        write_devices(&dir, &all, &paths, &committed)
    };
    let grown = lamina_core::grow(members, &ec, &new, &uuids, &params, &mut commit);
    pb.finish_and_clear();
    let sb = settle(grown, committed.get(), created, &dir, "grow")?;
    drop(new); // its lock, before the array is opened again to report

    let (engine, _) = open_array(&dir, OpenMode::ReadOnly)?;
    let s = engine.status();
    println!(
        "array {:?} in {} grew from {before} to {} devices: capacity {}, usable {} ({} segments of {})",
        sb.array_name,
        dir.display(),
        sb.devices.len(),
        crate::size::human(s.capacity_bytes),
        crate::size::human(s.usable_bytes),
        s.segment_count,
        crate::size::human(s.segment_size_bytes)
    );
    Ok(())
}

/// `lamina array replace DIR --old N --new PATH[:SIZE]` on a JBOD array: member
/// `old` is copied to the new device (see `lamina_core::replace`).
#[allow(clippy::too_many_arguments)]
pub fn replace_jbod(
    dir: &Path,
    old: usize,
    old_name: &str,
    path: &Path,
    size: Option<u64>,
    force: bool,
    quiet: bool,
    as_json: bool,
) -> Result<()> {
    let cfg = Config::load(dir)?;
    refuse_if_served(dir, "replace a JBOD member (it is copied offline)")?;
    let (members, ec) = crate::open_config_devices(dir, OpenMode::ReadWrite)?;
    let resolved: Vec<PathBuf> = cfg
        .devices
        .iter()
        .map(|p| Config::resolve(dir, p))
        .collect();
    let mut created = crate::Created::default();
    let (abs, dev) = crate::open_new_device(
        path,
        size,
        &member_paths(dir, &cfg),
        &mut Default::default(),
        &mut created,
    )?;
    let new: Arc<dyn BlockDevice> = Arc::from(lamina_device::blkzoned::open_if_zoned(dev)?);
    // The member's path in lamina.toml (`old_name`: as status names member `old`).
    let old_path = crate::rebuild::member_path(old_name).to_string();
    let (pb, progress) = crate::discard_bar("the new device");
    let copy_bar = crate::progress_bar(
        quiet || as_json,
        1,
        &format!(
            "copying member {old} {{bar:40}} {{bytes}}/{{total_bytes}}  {{elapsed}} (eta {{eta}})"
        ),
    );
    let params = GrowParams {
        force,
        discard: true,
        progress: Some(progress),
    };
    let committed = std::cell::Cell::new(false);
    let mut commit = || {
        let devices: Vec<PathBuf> = cfg
            .devices
            .iter()
            .zip(&resolved)
            .map(|(p, r)| {
                if r.display().to_string() == old_path {
                    abs.clone()
                } else {
                    p.clone()
                }
            })
            .collect();
        if !devices.contains(&abs) {
            return Err(lamina_core::EngineError::Invalid(format!(
                "member {old} ({old_path}) is not among the devices {} lists",
                Config::path(dir).display()
            )));
        }
        write_devices(dir, &devices, std::slice::from_ref(&abs), &committed)
    };
    let uuid = crate::random_uuid();
    let r = lamina_core::replace(
        members,
        &ec,
        old,
        new.clone(),
        uuid,
        &params,
        &mut |done, total| {
            pb.finish_and_clear();
            copy_bar.set_length(total);
            copy_bar.set_position(done);
        },
        &mut commit,
    );
    pb.finish_and_clear();
    copy_bar.finish_and_clear();
    drop(new);
    let r = settle(r, committed.get(), created, dir, "replace")?;
    if as_json {
        println!(
            "{}",
            serde_json::json!({
                "member": old,
                "old": old_path,
                "new": abs.display().to_string(),
                "segments": r.segments,
                "segments_copied": r.segments_copied,
                "bytes_copied": r.bytes_copied,
            })
        );
    } else {
        println!(
            "member {old} moved from {old_path} to {}: {} of its {} segments held data ({} copied)",
            abs.display(),
            r.segments_copied,
            r.segments,
            crate::size::human(r.bytes_copied)
        );
    }
    Ok(())
}

/// The devices `cfg` names, as canonical paths (a device named another way is
/// still recognised).
fn member_paths(dir: &Path, cfg: &Config) -> std::collections::HashSet<PathBuf> {
    cfg.devices
        .iter()
        .map(|p| {
            let p = Config::resolve(dir, p);
            p.canonicalize().unwrap_or(p)
        })
        .collect()
}

/// The commit of a grow or replace: lamina.toml's device list becomes `devices`.
/// `committed` says whether the file names `new` afterwards, even when the write
/// reports an error (the rename went through, a sync after it failed): files
/// made for new devices must then stay.
fn write_devices(
    dir: &Path,
    devices: &[PathBuf],
    new: &[PathBuf],
    committed: &std::cell::Cell<bool>,
) -> Result<(), lamina_core::EngineError> {
    let r = crate::config::set_devices(&Config::path(dir), devices);
    let named = Config::load(dir).is_ok_and(|c| new.iter().all(|p| c.devices.contains(p)));
    committed.set(named);
    r.map_err(|e| lamina_core::EngineError::Io(format!("{e:#}")))
}

/// `lamina array evacuate DIR --device N` (see `lamina_core::evacuate`).
pub fn evacuate(
    dir: &Path,
    index: usize,
    name: &str,
    already: bool,
    as_json: bool,
    quiet: bool,
) -> Result<()> {
    let cfg = Config::load(dir)?;
    refuse_if_served(dir, "evacuate a member")?;
    let path = PathBuf::from(crate::rebuild::member_path(name));
    let resolved: Vec<PathBuf> = cfg
        .devices
        .iter()
        .map(|p| Config::resolve(dir, p))
        .collect();
    let kept: Vec<PathBuf> = cfg
        .devices
        .iter()
        .zip(&resolved)
        .filter(|(_, r)| **r != path)
        .map(|(p, _)| p.clone())
        .collect();
    if already {
        // Removed by an evacuation that stopped before lamina.toml changed.
        if kept.len() == cfg.devices.len() {
            bail!("member {index} was removed already");
        }
        crate::config::set_devices(&Config::path(dir), &kept)?;
        println!(
            "member {index} was removed already; {} no longer names {}",
            Config::path(dir).display(),
            path.display()
        );
        return Ok(());
    }
    if kept.len() + 1 != cfg.devices.len() {
        bail!(
            "{} does not name member {index}'s device {} once: edit it to list the array's devices",
            Config::path(dir).display(),
            path.display()
        );
    }
    let (members, ec) = crate::open_config_devices(dir, OpenMode::ReadWrite)?;
    let bar = crate::progress_bar(
        quiet || as_json,
        1,
        &format!("evacuating member {index} {{bar:40}} {{pos}}/{{len}} segments  {{elapsed}}"),
    );
    // (superblocks say removed, lamina.toml no longer names it)
    let done = std::cell::Cell::new((false, false));
    let r = lamina_core::evacuate(
        members,
        &ec,
        index,
        &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
        &mut || {
            // The superblocks say the member is removed: lamina.toml may stop
            // naming it (should this fail, the array opens with it named and
            // unused).
            done.set((true, false));
            crate::config::set_devices(&Config::path(dir), &kept)
                .map_err(|e| lamina_core::EngineError::Io(format!("{e:#}")))?;
            done.set((true, true));
            Ok(())
        },
    );
    bar.finish_and_clear();
    let r = r.map_err(|e| {
        let e = anyhow::Error::from(e);
        match done.get() {
            (true, false) => e.context(format!(
                "member {index} is removed; run the command again to drop it from {}",
                Config::path(dir).display()
            )),
            (true, true) => e.context(format!(
                "member {index} is removed and {} no longer names it, but the array did not open afterwards",
                Config::path(dir).display()
            )),
            _ => e,
        }
    })?;
    if as_json {
        println!(
            "{}",
            serde_json::json!({
                "member": index,
                "device": path.display().to_string(),
                "segments": r.segments,
                "blocks_moved": r.blocks_moved,
            })
        );
    } else {
        println!(
            "member {index} ({}) evacuated and removed: {} segments in use were emptied, {} blocks moved; the device is no longer needed",
            path.display(),
            r.segments,
            r.blocks_moved
        );
    }
    Ok(())
}

/// The end of a grow or replace: files made for new devices stay once lamina.toml
/// names them (`committed`), whatever happened next, and go otherwise; an error
/// after the commit says that the array opens with the change.
fn settle<T>(
    r: Result<T, lamina_core::EngineError>,
    committed: bool,
    created: crate::Created,
    dir: &Path,
    what: &str,
) -> Result<T> {
    if committed {
        created.keep();
    } else {
        drop(created);
    }
    r.map_err(|e| {
        let e = anyhow::Error::from(e);
        if committed {
            e.context(format!(
                "the {what} stopped after {} named the new devices: the array opens with them, and the next read-write open (`lamina serve`) rewrites every member's superblock",
                Config::path(dir).display()
            ))
        } else {
            e
        }
    })
}

/// `lamina array export DIR`.
pub fn export(dir: &Path) -> Result<()> {
    let dir = absolute(dir)?;
    let cfg = Config::load(&dir)?;
    refuse_if_served(&dir, "export it")?;
    // Opening read-only proves the array is whole and clean as it is left.
    drop(open_array(&dir, OpenMode::ReadOnly).context("the array does not open; not exported")?);
    std::fs::rename(Config::path(&dir), dir.join(EXPORTED_FILE))
        .with_context(|| format!("cannot rename {}", Config::path(&dir).display()))?;
    println!(
        "exported the array in {} ({} devices); `lamina array import DIR [PATH...]` serves it again, here or elsewhere",
        dir.display(),
        cfg.devices.len()
    );
    Ok(())
}

/// `lamina array destroy DIR --force`: every device is looked at before any is
/// wiped, and one that cannot be read stops it.
pub fn destroy(dir: &Path, force: bool) -> Result<()> {
    let dir = absolute(dir)?;
    let cfg = Config::load(&dir)?;
    if !force {
        bail!(
            "destroying the array in {} makes every volume on it unreachable: give --force",
            dir.display()
        );
    }
    refuse_if_served(&dir, "destroy it")?;
    let paths: Vec<PathBuf> = cfg
        .devices
        .iter()
        .map(|p| Config::resolve(&dir, p))
        .collect();
    // Which array: the configuration's, else the first labelled device's.
    let uuid = match &cfg.array_uuid {
        Some(u) => u.clone(),
        None => paths
            .iter()
            .find_map(|p| labels::read_label(p).ok().flatten())
            .map(|sb| labels::uuid_hex(&sb.array_uuid))
            .context("no device of the array holds a superblock: nothing to destroy")?,
    };
    let mut ours = Vec::new();
    for p in &paths {
        match labels::read_label(p) {
            Ok(Some(sb)) if labels::uuid_hex(&sb.array_uuid).eq_ignore_ascii_case(&uuid) => {
                ours.push(p)
            }
            Ok(Some(sb)) => eprintln!(
                "lamina: {} holds another array ({:?}): left alone",
                p.display(),
                sb.array_name
            ),
            Ok(None) => eprintln!(
                "lamina: {} holds no superblock of the array: left alone",
                p.display()
            ),
            // A member missing since an import (its placeholder) has nothing to wipe.
            Err(_) if !p.exists() => {
                eprintln!("lamina: {} is not there: nothing to wipe", p.display())
            }
            Err(e) => return Err(e.context("nothing was wiped")),
        }
    }
    // Every device locked before any is wiped: a busy one stops it all.
    let locked = ours
        .iter()
        .map(|p| labels::lock_for_wipe(p))
        .collect::<Result<Vec<_>>>()?;
    for (f, p) in locked.iter().zip(&ours) {
        labels::wipe_label(f, p)?;
    }
    let wiped = ours.len();
    std::fs::remove_file(Config::path(&dir))
        .with_context(|| format!("cannot remove {}", Config::path(&dir).display()))?;
    tracing::info!("array {uuid} destroyed");
    println!(
        "destroyed array {uuid}: wiped the superblocks of {wiped} device(s); the files and devices themselves are left in place"
    );
    Ok(())
}
