//! Arrays managed like mdadm and zpool: `lamina array list` (what devices hold),
//! `import` (an array found on devices, served from a directory), `export` (let
//! go of it, for another directory or host) and `destroy` (wipe its superblocks).

use crate::config::{Config, EXPORTED_FILE};
use crate::labels::{self, Found};
use crate::{absolute, admin, admin_socket, open_array};
use anyhow::{bail, Context, Result};
use lamina_core::OpenMode;
use serde_json::json;
use std::path::{Path, PathBuf};

/// `lamina array list [PATH...]`.
pub fn list(paths: &[PathBuf], as_json: bool) -> Result<()> {
    let found = labels::scan(&labels::candidates(paths)?);
    if as_json {
        let v: Vec<_> = found.iter().map(found_json).collect();
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    if found.is_empty() {
        println!("no Lamina array found");
        return Ok(());
    }
    println!(
        "{:<20} {:<32} {:<7} {:>7}  {:<10} {:>10}",
        "NAME", "UUID", "LAYOUT", "MEMBERS", "STATE", "GENERATION"
    );
    for f in &found {
        let sb = &f.reference;
        println!(
            "{:<20} {:<32} {:<7} {:>3} / {:<2} {:<10} {:>10}",
            sb.array_name,
            labels::uuid_hex(&f.uuid),
            sb.layout.name(),
            f.members.len() - f.missing(),
            f.members.len(),
            f.state(),
            sb.generation
        );
        for (i, m) in f.members.iter().enumerate() {
            match m {
                Some(p) => println!("  member {i:<3} {}", p.display()),
                None => println!("  member {i:<3} (not found)"),
            }
        }
    }
    Ok(())
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
        })).collect::<Vec<_>>(),
    })
}

/// The placeholder written for a member not found: opening it fails, and the
/// array runs degraded without it (as for any member that cannot be opened).
fn missing_member(i: usize) -> PathBuf {
    PathBuf::from(format!("/nonexistent/lamina-missing-member-{i}"))
}

/// `lamina array import DIR [PATH...] [--name N | --uuid U]`.
pub fn import(dir: &Path, paths: &[PathBuf], name: Option<&str>, uuid: Option<&str>) -> Result<()> {
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
    let want_uuid = uuid.or(previous.as_ref().and_then(|p| p.array_uuid.as_deref()));
    let mut found: Vec<Found> = labels::scan(&labels::candidates(&search)?)
        .into_iter()
        .filter(|f| name.is_none_or(|n| f.reference.array_name == n))
        .filter(|f| want_uuid.is_none_or(|u| labels::uuid_hex(&f.uuid).eq_ignore_ascii_case(u)))
        .collect();
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
            "no Lamina array{} found on {where_}",
            match (name, want_uuid) {
                (Some(n), _) => format!(" named {n:?}"),
                (None, Some(u)) => format!(" {u}"),
                _ => String::new(),
            }
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
    if f.state() == "incomplete" {
        let missing: Vec<String> = f
            .members
            .iter()
            .enumerate()
            .filter(|(_, m)| m.is_none())
            .map(|(i, _)| i.to_string())
            .collect();
        bail!(
            "array {:?} ({}) is incomplete: member(s) {} not found on {where_}, and its {} layout \
             can do without {} (give the paths that hold them)",
            sb.array_name,
            labels::uuid_hex(&f.uuid),
            missing.join(", "),
            sb.layout.name(),
            f.tolerates()
        );
    }
    let devices: Vec<PathBuf> = f
        .members
        .iter()
        .enumerate()
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
        f.members.len() - f.missing(),
        f.members.len(),
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

/// `lamina array destroy DIR --force`.
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
    let mut wiped = 0;
    for p in &paths {
        match labels::read_label(p) {
            Ok(Some(sb)) if labels::uuid_hex(&sb.array_uuid).eq_ignore_ascii_case(&uuid) => {
                labels::wipe_label(p)?;
                wiped += 1;
            }
            Ok(Some(sb)) => eprintln!(
                "lamina: {} holds another array ({:?}): left alone",
                p.display(),
                sb.array_name
            ),
            _ => eprintln!(
                "lamina: {} holds no superblock of the array: left alone",
                p.display()
            ),
        }
    }
    std::fs::remove_file(Config::path(&dir))
        .with_context(|| format!("cannot remove {}", Config::path(&dir).display()))?;
    tracing::info!("array {uuid} destroyed");
    println!(
        "destroyed array {uuid}: wiped the superblocks of {wiped} device(s); the files and devices themselves are left in place"
    );
    Ok(())
}
