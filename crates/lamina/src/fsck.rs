//! `lamina fsck DIR`: the offline check, with e2fsck's exit codes.

use crate::config::Config;
use crate::{absolute, admin, admin_socket, devices, open_array};
use anyhow::Result;
use lamina_core::fsck::{check, check_superblocks, Finding, FsckReport};
use lamina_core::OpenMode;
use lamina_device::BlockDevice;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;

pub const FSCK_ABOUT: &str = "\
Check a stopped array offline, as e2fsck checks a file system: both superblock
copies of every device, the checkpoint and the log (recovered in memory, nothing
written), every mapped block against the unit header that must name it, every
segment's live count against the map, no live block in a free segment, and every
segment summary against the unit headers it lists. --data also reads every live
block and verifies its CRC-32C (on layouts with parity, a block damaged on one
member and rebuilt from its row is a repairable finding).

--repair mends what is safe to mend: superblock copies that are damaged or stale
are rewritten (a read-write open writes both copies on every device with a fresh
checkpoint), and on layouts with parity a scrub rewrites damaged blocks and parity
from the rest of their rows. Then everything is checked again.

The array must not be served while fsck runs.

EXIT STATUS
    0  no damage found
    1  damage found and repaired
    4  damage left (run with --repair, or what remains cannot be repaired)
    8  fsck could not run (no such array, or the array is being served)";

/// Runs the check and exits with e2fsck's codes.
pub fn run(dir: &Path, repair: bool, data: bool, json_out: bool) -> ! {
    let code = match fsck(dir, repair, data, json_out) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("lamina: fsck: {e:#}");
            8
        }
    };
    std::process::exit(code)
}

fn fsck(dir: &Path, repair: bool, data: bool, json_out: bool) -> Result<i32> {
    let dir = absolute(dir)?;
    if admin::request(&admin_socket(&dir)?, &json!({"op": "status"}))?.is_some() {
        anyhow::bail!(
            "{} is being served: stop `lamina serve` first (fsck checks a stopped array)",
            dir.display()
        );
    }
    let first = check_array(&dir, data)?;
    if first.findings.is_empty() {
        print(&first, &[], json_out, "clean");
        return Ok(0);
    }
    if !repair {
        print(&first, &[], json_out, "damage found");
        return Ok(4);
    }
    // Repairs: a read-write open rewrites every superblock copy with its
    // checkpoint; a scrub mends blocks and parity from their rows.
    let repaired = (|| -> Result<()> {
        let (mut engine, _) = open_array(&dir, OpenMode::ReadWrite)?;
        if engine
            .shared()
            .striped
            .as_ref()
            .is_some_and(|st| st.shape().parity > 0)
        {
            lamina_core::scrub::scrub_inline(&mut engine, &mut |_, _| {})?;
        }
        Ok(())
    })();
    if let Err(e) = repaired {
        // The damage itself keeps the array from opening read-write.
        let mut r = first;
        r.findings.push(Finding {
            what: format!("repair could not run: {e:#}"),
            repairable: false,
        });
        print(&r, &[], json_out, "damage left (repair could not run)");
        return Ok(4);
    }
    let after = check_array(&dir, data)?;
    let (code, verdict) = if after.findings.is_empty() {
        (1, "repaired")
    } else {
        (4, "damage left after repair")
    };
    print(&after, &first.findings, json_out, verdict);
    Ok(code)
}

/// Opens the devices read-only and checks everything (see [`FSCK_ABOUT`]).
fn check_array(dir: &Path, data: bool) -> Result<FsckReport> {
    let cfg = Config::load(dir)?;
    let io = cfg.io_options()?;
    let mut devs: Vec<Arc<dyn BlockDevice>> = Vec::new();
    let mut report = FsckReport::default();
    for p in &cfg.devices {
        let p = Config::resolve(dir, p);
        match devices::open_device(&p, lamina_device::file::OpenMode::ReadOnly, io) {
            Ok(d) => devs.push(d),
            Err(e) => report.findings.push(Finding {
                what: format!("{}: cannot be opened: {e:#}", p.display()),
                repairable: false,
            }),
        }
    }
    check_superblocks(&devs, &mut report);
    drop(devs);
    match open_array(dir, OpenMode::ReadOnly) {
        Err(e) => report.findings.push(Finding {
            what: format!("recovery: {e:#}"),
            repairable: false,
        }),
        Ok((engine, rec)) => {
            // Superblock copies were checked above, one finding each.
            for w in rec
                .warnings
                .into_iter()
                .filter(|w| !w.contains("superblock"))
            {
                report.findings.push(Finding {
                    what: w,
                    repairable: false,
                });
            }
            check(&engine, data, &mut report);
        }
    }
    Ok(report)
}

fn print(r: &FsckReport, repaired: &[Finding], json_out: bool, verdict: &str) {
    if json_out {
        let f = |v: &[Finding]| {
            v.iter()
                .map(|f| json!({"what": f.what, "repairable": f.repairable}))
                .collect::<Vec<_>>()
        };
        let v = json!({
            "verdict": verdict,
            "superblock_copies": r.superblock_copies,
            "volumes": r.volumes,
            "blocks_checked": r.blocks_checked,
            "segments_checked": r.segments_checked,
            "summaries_checked": r.summaries_checked,
            "findings": f(&r.findings),
            "found_before_repair": f(repaired),
        });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
        return;
    }
    println!(
        "fsck: {} superblock copies, {} volumes, {} blocks, {} segments, {} summaries checked",
        r.superblock_copies, r.volumes, r.blocks_checked, r.segments_checked, r.summaries_checked
    );
    for f in repaired {
        println!("  repaired: {}", f.what);
    }
    for f in &r.findings {
        let tag = if f.repairable { "repairable" } else { "damage" };
        println!("  {tag}: {}", f.what);
    }
    println!("fsck: {verdict}");
}
