//! The admin socket: how `lamina status` and `lamina volume create` talk to a running
//! server. One JSON object per line each way:
//!
//! ```text
//! {"op":"status"}                                  -> {"ok":true,"status":{...}}
//! {"op":"metrics"}                                 -> {"ok":true,"metrics":"..."}
//! {"op":"volume-create","name":"v","size":1073741824} -> {"ok":true}
//! {"op":"volume-delete","name":"v","force":false} -> {"ok":true} (refused while clients are connected unless force)
//! {"op":"volume-snapshot","origin":"v","name":"s","writable":false} -> {"ok":true} (a clone when writable)
//! {"op":"volume-rollback","name":"v","snapshot":"s","force":false} -> {"ok":true} (refused while clients are connected unless force)
//! {"op":"checkpoint"}                              -> {"ok":true}
//! {"op":"member-fail","index":2}                   -> {"ok":true}
//! {"op":"scrub"}                    -> {"progress":[d,t]}... {"ok":true,"scrub":{...}}
//! {"op":"member-replace","index":2,"path":"/x","size":N,"force":false,"rate":N}
//!                                                  -> {"ok":true} (rebuild runs on)
//! anything else                                    -> {"ok":false,"error":"..."}
//! ```

use crate::output::{running_metrics_text, status_json};
use crate::runtime::Runtime;
use anyhow::{anyhow, bail, Context, Result};
use lamina_core::{Request, StatusReport};
use lamina_device::file::IoOptions;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::time::Duration;

/// Longest request line accepted.
const MAX_LINE: u64 = 64 * 1024;

fn handle(rt: &Runtime, io: IoOptions, req: &Value) -> Value {
    let op = req.get("op").and_then(|v| v.as_str()).unwrap_or("");
    let status = || {
        rt.call(Request::Status)
            .map(|s| s.expect("status reply carries a report"))
    };
    let result: Result<Value, String> = match op {
        "status" => status()
            .map(|mut s| {
                lamina_core::status::count_exclusive(&rt.shared, &mut s);
                let mut v = status_json(&s, true);
                v["last_scrub"] = rt.last_scrub.lock().unwrap().clone().unwrap_or(Value::Null);
                v["qos"] = rt
                    .qos
                    .all()
                    .into_iter()
                    .map(|(name, l)| (name, limits_json(l)))
                    .collect::<serde_json::Map<_, _>>()
                    .into();
                json!({"ok": true, "status": v})
            })
            .map_err(|e| e.to_string()),
        "metrics" => status()
            .map(|s| json!({"ok": true, "metrics": running_metrics_text(&s)}))
            .map_err(|e| e.to_string()),
        "volume-create" => {
            let name = req.get("name").and_then(|v| v.as_str());
            let size = req.get("size").and_then(|v| v.as_u64());
            match (name, size) {
                (Some(name), Some(size)) => rt
                    .call(Request::CreateVolume {
                        name: name.to_string(),
                        size_bytes: size,
                    })
                    .map(|_| json!({"ok": true}))
                    .map_err(|e| e.to_string()),
                _ => Err("volume-create needs \"name\" and \"size\"".into()),
            }
        }
        "volume-resize" => {
            let name = req.get("name").and_then(|v| v.as_str());
            let force = req.get("force").and_then(|v| v.as_bool()) == Some(true);
            let target = match (
                req.get("size").and_then(|v| v.as_u64()),
                req.get("grow").and_then(|v| v.as_u64()),
                req.get("shrink").and_then(|v| v.as_u64()),
            ) {
                (Some(n), None, None) => Some(NewSize::Absolute(n)),
                (None, Some(n), None) => Some(NewSize::Grow(n)),
                (None, None, Some(n)) => Some(NewSize::Shrink(n)),
                _ => None,
            };
            match (name, target) {
                (Some(name), Some(target)) => resize_volume(rt, name, target, force),
                _ => Err(
                    "volume-resize needs \"name\" and one of \"size\", \"grow\" or \"shrink\""
                        .into(),
                ),
            }
        }
        "volume-rename" => {
            let name = req.get("name").and_then(|v| v.as_str());
            let new_name = req.get("new_name").and_then(|v| v.as_str());
            match (name, new_name) {
                (Some(name), Some(new_name)) => rt
                    .call(Request::RenameVolume {
                        name: name.to_string(),
                        new_name: new_name.to_string(),
                    })
                    .map(|_| {
                        rt.qos.rename(name, new_name);
                        json!({"ok": true})
                    })
                    .map_err(|e| e.to_string()),
                _ => Err("volume-rename needs \"name\" and \"new_name\"".into()),
            }
        }
        "volume-snapshot" => {
            let origin = req.get("origin").and_then(|v| v.as_str());
            let name = req.get("name").and_then(|v| v.as_str());
            let writable = req.get("writable").and_then(|v| v.as_bool()) == Some(true);
            match (origin, name) {
                (Some(origin), Some(name)) => rt
                    .call(Request::CreateSnapshot {
                        origin: origin.to_string(),
                        name: name.to_string(),
                        writable,
                    })
                    .map(|_| json!({"ok": true}))
                    .map_err(|e| e.to_string()),
                _ => Err("volume-snapshot needs \"origin\" and \"name\"".into()),
            }
        }
        "volume-rollback" => {
            let name = req.get("name").and_then(|v| v.as_str());
            let snapshot = req.get("snapshot").and_then(|v| v.as_str());
            let force = req.get("force").and_then(|v| v.as_bool()) == Some(true);
            match (name, snapshot) {
                (Some(name), Some(snapshot)) => rollback_volume(rt, name, snapshot, force),
                _ => Err("volume-rollback needs \"name\" and \"snapshot\"".into()),
            }
        }
        "volume-delete" => match req.get("name").and_then(|v| v.as_str()) {
            Some(name) => {
                let force = req.get("force").and_then(|v| v.as_bool()) == Some(true);
                delete_volume(rt, name, force)
            }
            None => Err("volume-delete needs \"name\"".into()),
        },
        "member-fail" => match req.get("index").and_then(|v| v.as_u64()) {
            Some(index) => rt
                .call(Request::FailMember {
                    index: index as usize,
                })
                .map(|_| json!({"ok": true}))
                .map_err(|e| e.to_string()),
            None => Err("member-fail needs \"index\"".into()),
        },
        "member-replace" => {
            let index = req.get("index").and_then(|v| v.as_u64());
            let path = req.get("path").and_then(|v| v.as_str());
            let size = req.get("size").and_then(|v| v.as_u64());
            let force = req.get("force").and_then(|v| v.as_bool()).unwrap_or(false);
            let rate = req.get("rate").and_then(|v| v.as_u64());
            match (index, path) {
                (Some(index), Some(path)) => {
                    crate::rebuild::open_new_device(std::path::Path::new(path), size, force, io)
                        .and_then(|dev| crate::rebuild::replace(rt, index as usize, dev))
                        .map(|_| {
                            crate::rebuild::spawn(rt, index as usize, rate);
                            json!({"ok": true})
                        })
                        .map_err(|e| format!("{e:#}"))
                }
                _ => Err("member-replace needs \"index\" and \"path\"".into()),
            }
        }
        "volume-qos" => match req.get("name").and_then(|v| v.as_str()) {
            Some(name) if rt.shared.volume(name).is_some() => {
                let old = rt.qos.limits(name);
                // A key given sets that limit (null: none); one left out keeps it.
                let limit = |k: &str, old: Option<u64>| match req.get(k) {
                    None => Ok(old),
                    Some(Value::Null) => Ok(None),
                    Some(v) => match v.as_u64() {
                        Some(n) if n > 0 => Ok(Some(n)),
                        _ => Err(format!("{k} must be a positive number or null")),
                    },
                };
                limit("iops", old.iops)
                    .and_then(|iops| Ok((iops, limit("bandwidth", old.bytes_per_sec)?)))
                    .map(|(iops, bytes_per_sec)| {
                        let l = crate::qos::Limits {
                            iops,
                            bytes_per_sec,
                        };
                        if req.get("iops").is_some() || req.get("bandwidth").is_some() {
                            rt.qos.set(name, l);
                        }
                        json!({"ok": true, "limits": limits_json(l)})
                    })
            }
            Some(name) => Err(format!("no volume named {name:?}")),
            None => Err("volume-qos needs \"name\"".into()),
        },
        "checkpoint" => rt
            .call(Request::Checkpoint)
            .map(|_| json!({"ok": true}))
            .map_err(|e| e.to_string()),
        other => Err(format!("unknown op {other:?}")),
    };
    // What changes the array is logged, as zpool history keeps it; queries are not.
    let query = matches!(op, "status" | "metrics")
        || (op == "volume-qos" && req.get("iops").is_none() && req.get("bandwidth").is_none());
    if !query {
        let args: Vec<String> = req
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| *k != "op")
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        match &result {
            Ok(_) => tracing::info!("admin: {op} {}: done", args.join(" ")),
            Err(e) => tracing::warn!("admin: {op} {}: refused: {e}", args.join(" ")),
        }
    }
    result.unwrap_or_else(|e| json!({"ok": false, "error": e}))
}

fn limits_json(l: crate::qos::Limits) -> Value {
    json!({"iops": l.iops, "bandwidth": l.bytes_per_sec})
}

/// Logs a scrub's findings and keeps them for `status` (`last_scrub`).
fn record_scrub(rt: &Runtime, r: &lamina_core::scrub::ScrubReport, seconds: f64) -> Value {
    let mut v = scrub_json(r);
    let s = &r.stats;
    let msg = format!(
        "scrub finished in {seconds:.1}s: {} segments, {} blocks checked; {} checksum errors, \
         {} parity mismatches; repaired {} blocks and {} parity blocks; {} unrecoverable, \
         {} unresolved, {} damaged unit headers",
        r.segments,
        r.blocks_checked,
        s.checksum_errors,
        s.parity_mismatches,
        s.blocks_repaired,
        s.parity_repaired,
        s.unrecoverable,
        s.unresolved,
        r.damaged_headers
    );
    if v["damage_left"].as_u64() > Some(0) {
        tracing::error!("{msg}");
    } else if s.checksum_errors + s.parity_mismatches > 0 {
        tracing::warn!("{msg}");
    } else {
        tracing::info!("{msg}");
    }
    let finished = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    v["finished_unix"] = json!(finished);
    v["seconds"] = json!(seconds);
    *rt.last_scrub.lock().unwrap() = Some(v.clone());
    v
}

/// Serves the admin socket (runs until the process exits). `io` says how devices
/// added later (a replacement member) are driven.
pub fn serve(listener: UnixListener, rt: Runtime, io: IoOptions) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let rt = rt.clone();
        std::thread::spawn(move || {
            let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
            let mut line = String::new();
            let mut r = BufReader::new(Read::take(&conn, MAX_LINE));
            if r.read_line(&mut line).is_err() {
                return;
            }
            let reply = match serde_json::from_str::<Value>(&line) {
                Ok(req) if req.get("op").and_then(|v| v.as_str()) == Some("scrub") => {
                    // Streams {"progress":[done,total]} lines, then the report.
                    let mut w = &conn;
                    tracing::info!("admin: scrub started");
                    let t0 = std::time::Instant::now();
                    let call = |req| rt.call(req).map(|_| ());
                    let r = lamina_core::scrub::scrub(&rt.shared, &call, &mut |d, t| {
                        let _ = writeln!(w, "{}", json!({"progress": [d, t]}));
                    });
                    match r {
                        Ok(r) => {
                            let v = record_scrub(&rt, &r, t0.elapsed().as_secs_f64());
                            json!({"ok": true, "scrub": v})
                        }
                        Err(e) => {
                            tracing::error!("scrub failed: {e}");
                            json!({"ok": false, "error": e.to_string()})
                        }
                    }
                }
                Ok(req) => handle(&rt, io, &req),
                Err(e) => json!({"ok": false, "error": format!("request is not JSON: {e}")}),
            };
            let mut w = &conn;
            let _ = writeln!(w, "{reply}");
        });
    }
}

pub fn scrub_json(r: &lamina_core::scrub::ScrubReport) -> Value {
    let s = &r.stats;
    json!({
        // What no scrub can mend: blocks without a good copy, mismatches without
        // a culprit, headers that hide the units after them.
        "damage_left": s.unrecoverable + s.unresolved + r.damaged_headers,
        "segments": r.segments,
        "units": r.units,
        "blocks_checked": r.blocks_checked,
        "rows_checked": r.stats.rows,
        "checksum_errors": r.stats.checksum_errors,
        "parity_mismatches": r.stats.parity_mismatches,
        "blocks_repaired": r.stats.blocks_repaired,
        "parity_repaired": r.stats.parity_repaired,
        "unresolved": r.stats.unresolved,
        "unrecoverable": r.stats.unrecoverable,
        "damaged_unit_headers": r.damaged_headers,
        "unit_headers_rebuilt": r.headers_found_by_parity,
        "segments_changed_while_read": r.changed_while_read,
        "checkpoint_error": r.checkpoint_error,
    })
}

/// Sends a request whose answer is preceded by progress lines
/// (`{"progress":[done,total]}`), calling `progress` for each. `Ok(None)` when no
/// server answers.
pub fn request_with_progress(
    socket: &Path,
    req: &Value,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Option<Value>> {
    let Ok(conn) = UnixStream::connect(socket) else {
        return Ok(None);
    };
    conn.set_read_timeout(Some(Duration::from_secs(600)))?;
    let mut w = &conn;
    writeln!(w, "{req}")?;
    for line in BufReader::new(&conn).lines() {
        let line = line.with_context(|| format!("no answer on {}", socket.display()))?;
        let v: Value = serde_json::from_str(&line)
            .with_context(|| format!("bad answer on {}", socket.display()))?;
        if let Some(p) = v.get("progress").and_then(|p| p.as_array()) {
            progress(p[0].as_u64().unwrap_or(0), p[1].as_u64().unwrap_or(1));
            continue;
        }
        if v.get("ok").and_then(|b| b.as_bool()) != Some(true) {
            bail!(
                "{}",
                v.get("error")
                    .and_then(|e| e.as_str())
                    .unwrap_or("request failed")
            );
        }
        return Ok(Some(v));
    }
    bail!("the server closed {} without an answer", socket.display())
}

/// Sends one request to a running server. `Ok(None)` when no server answers.
pub fn request(socket: &Path, req: &Value) -> Result<Option<Value>> {
    request_with_progress(socket, req, &mut |_, _| {})
}

/// Turns the JSON status back into a report, for the human renderer.
pub fn status_from_json(v: &Value) -> Result<StatusReport> {
    let s = v
        .get("status")
        .ok_or_else(|| anyhow!("answer without status"))?;
    let u = |k: &str| s.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    let a = s.get("array").cloned().unwrap_or_default();
    let mut r = StatusReport {
        array_name: a["name"].as_str().unwrap_or("").into(),
        array_uuid: a["uuid"].as_str().unwrap_or("").into(),
        layout: a["layout"].as_str().unwrap_or("").into(),
        devices: a["devices"]
            .as_array()
            .map(|d| {
                d.iter()
                    .filter_map(|x| x.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default(),
        segment_size_bytes: a["segment_size_bytes"].as_u64().unwrap_or(0),
        write_unit_bytes: a["write_unit_bytes"].as_u64().unwrap_or(0),
        overprovision: a["overprovision"].as_f64().unwrap_or(0.0),
        capacity_bytes: u("capacity_bytes"),
        usable_bytes: u("usable_bytes"),
        live_bytes: u("live_bytes"),
        maps_bytes: u("maps_bytes"),
        promised_bytes: u("promised_bytes"),
        volume_ids_left: u("volume_ids_left"),
        space_state: s["space_state"].as_str().unwrap_or("").into(),
        space_warn: s["space_warn"].as_f64().unwrap_or(0.0),
        space_critical: s["space_critical"].as_f64().unwrap_or(0.0),
        writes_refused_nospace: u("writes_refused_nospace"),
        segment_count: u("segment_count"),
        free_segments: u("free_segments"),
        used_segments: u("used_segments"),
        user_bytes_written: u("user_bytes_written"),
        media_bytes_written: u("media_bytes_written"),
        gc_bytes_relocated: u("gc_bytes_relocated"),
        metadata_bytes_written: u("metadata_bytes_written"),
        write_amplification: s["write_amplification"].as_f64(),
        gc_policy: s["gc_policy"].as_str().unwrap_or("").into(),
        gc_victims: u("gc_victims"),
        cache: s.get("cache").filter(|c| c.is_object()).map(|c| {
            let u = |k: &str| c[k].as_u64().unwrap_or(0);
            lamina_core::CacheStatus {
                segment_count: u("segment_count"),
                free_segments: u("free_segments"),
                dirty_bytes: u("dirty_bytes"),
                compactions: u("compactions"),
                compacted_bytes: u("compacted_bytes"),
                compaction_start: u("compaction_start"),
                compaction_stop: u("compaction_stop"),
                copies: u("copies"),
                copies_ok: u("copies_ok"),
                read_bytes_cache: u("read_bytes_cache"),
                read_bytes_capacity: u("read_bytes_capacity"),
                read_bytes_buffer: u("read_bytes_buffer"),
                hit_ratio: c["hit_ratio"].as_f64(),
                capacity_write_amplification: c["capacity_write_amplification"].as_f64(),
            }
        }),
        gc_floor_waits: u("gc_floor_waits"),
        gc_pace_waits: u("gc_pace_waits"),
        segments_discarded: u("segments_discarded"),
        segments_tail_discarded: u("segments_tail_discarded"),
        flushes: u("flushes"),
        syncs: u("syncs"),
        checkpoints: u("checkpoints"),
        checkpoint_generation: u("checkpoint_generation"),
        corrupt_blocks: u("corrupt_blocks"),
        read_checksum_errors: u("read_checksum_errors"),
        reads_by_connection: u("reads_by_connection"),
        header_cache_misses: u("header_cache_misses"),
        failed: s["failed"].as_str().map(String::from),
        members: a["members"]
            .as_array()
            .map(|ms| {
                ms.iter()
                    .map(|m| lamina_core::MemberStatus {
                        index: m["index"].as_u64().unwrap_or(0) as usize,
                        name: m["name"].as_str().unwrap_or("").into(),
                        state: m["state"].as_str().unwrap_or("").into(),
                        bytes_written: m["bytes_written"].as_u64().unwrap_or(0),
                        bytes_read: m["bytes_read"].as_u64().unwrap_or(0),
                        read_errors: m["read_errors"].as_u64().unwrap_or(0),
                        checksum_errors: m["checksum_errors"].as_u64().unwrap_or(0),
                        write_errors: m["write_errors"].as_u64().unwrap_or(0),
                        rebuild_progress: m["rebuild_progress"].as_f64(),
                        // Missing (a server older than this command): taken as running.
                        rebuild_running: m["rebuild_running"].as_bool().unwrap_or(true),
                        tier: m["tier"].as_str().unwrap_or("capacity").into(),
                    })
                    .collect()
            })
            .unwrap_or_default(),
        redundancy_left: a["redundancy_left"].as_i64().unwrap_or(0),
        wear_spread: a["wear_spread"].as_f64().unwrap_or(0.0),
        zones_open: a["zones_open"].as_u64(),
        zone_open_limit: a["zone_open_limit"].as_u64().unwrap_or(0),
        pad_bytes_written: u("pad_bytes_written"),
        blocks_rebuilt_from_parity: u("blocks_rebuilt_from_parity"),
        segments_repaired: u("segments_repaired"),
        ..Default::default()
    };
    if let Some(vols) = s["volumes"].as_array() {
        for v in vols {
            r.volumes.push(lamina_core::VolumeStatus {
                id: v["id"].as_u64().unwrap_or(0) as u16,
                name: v["name"].as_str().unwrap_or("").into(),
                size_bytes: v["size_bytes"].as_u64().unwrap_or(0),
                live_bytes: v["live_bytes"].as_u64().unwrap_or(0),
                segments: v["segments"].as_u64().unwrap_or(0),
                user_bytes_written: v["user_bytes_written"].as_u64().unwrap_or(0),
                media_bytes_written: v["media_bytes_written"].as_u64().unwrap_or(0),
                gc_bytes_relocated: v["gc_bytes_relocated"].as_u64().unwrap_or(0),
                write_amplification: v["write_amplification"].as_f64(),
                classifier: v["classifier"].as_str().unwrap_or("").into(),
                gc_policy: v["gc_policy"].as_str().unwrap_or("").into(),
                exclusive_bytes: v["exclusive_bytes"].as_u64().unwrap_or(0),
                snapshot: v["snapshot"].as_bool().unwrap_or(false),
                origin: v["origin"].as_str().map(Into::into),
                family: v["family"].as_u64().map(|f| f as u16),
                created_version: v["created_version"].as_u64().unwrap_or(0),
                classes_open: (
                    v["classes_open"]["user"].as_u64().unwrap_or(0) as u8,
                    v["classes_open"]["gc"].as_u64().unwrap_or(0) as u8,
                ),
                classes: v["classes"]
                    .as_array()
                    .map(|cs| {
                        cs.iter()
                            .map(|c| lamina_core::ClassStatus {
                                class: c["class"].as_u64().unwrap_or(0) as u8,
                                kind: c["kind"].as_str().unwrap_or("").into(),
                                segments: c["segments"].as_u64().unwrap_or(0),
                                live_bytes: c["live_bytes"].as_u64().unwrap_or(0),
                                bytes_written: c["bytes_written"].as_u64().unwrap_or(0),
                                bytes_relocated_out: c["bytes_relocated_out"].as_u64().unwrap_or(0),
                                victims: c["victims"].as_u64().unwrap_or(0),
                                gc_cost: c["gc_cost"].as_f64(),
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
            });
        }
    }
    Ok(r)
}

/// Resizes a volume of the running server; with `force`, a shrink first trims
/// what lies beyond the new end (the engine refuses to drop mapped blocks). The
/// size is checked before anything is trimmed.
/// A volume's new size: as given, or relative to its size when the server applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NewSize {
    Absolute(u64),
    Grow(u64),
    Shrink(u64),
}

impl NewSize {
    /// The size this asks for, from the volume's size `old`; `None` if it cannot be.
    pub fn from(self, old: u64) -> Option<u64> {
        match self {
            NewSize::Absolute(n) => Some(n),
            NewSize::Grow(d) => old.checked_add(d),
            NewSize::Shrink(d) => old.checked_sub(d),
        }
        .filter(|&n| n > 0)
    }
}

/// Resizes a volume. One resize at a time, from reading the size to the new size
/// being durable: a relative size is applied to the size the volume has then, so
/// two `+1G` at once grow it by 2 GiB (computed by each client from the size it
/// had read, one increment was lost), and a forced shrink trims exactly the tail
/// it then cuts off.
fn resize_volume(rt: &Runtime, name: &str, target: NewSize, force: bool) -> Result<Value, String> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let v = rt
        .shared
        .volume(name)
        .ok_or_else(|| format!("no volume named {name:?}"))?;
    let old = v.size_bytes();
    let size = target.from(old).ok_or_else(|| {
        format!(
            "the volume of {} cannot take that size",
            crate::size::human(old)
        )
    })?;
    lamina_core::check_volume_size(size).map_err(|e| e.to_string())?;
    if force && size < old {
        rt.call_to(lamina_core::trim_tail(v.id, size, old), &v)
            .map_err(|e| format!("trimming beyond {size} bytes: {e}"))?;
    }
    rt.call(Request::ResizeVolume {
        name: name.to_string(),
        size_bytes: size,
    })
    .map(|_| json!({"ok": true, "old_size": old, "size": size}))
    .map_err(|e| e.to_string())
}

/// Deletes a volume; one with clients connected only with `force`, which first
/// disconnects them (as `lvremove` and `zfs destroy` refuse a busy volume).
/// A rollback changes what clients read under them: refused while the volume has
/// any, unless `force` (which disconnects them).
fn rollback_volume(rt: &Runtime, name: &str, snapshot: &str, force: bool) -> Result<Value, String> {
    /// Keeps new clients off the volume while the request lasts (it may wait for
    /// GC to free the space its checkpoint needs).
    struct Closed(Option<std::sync::Arc<lamina_core::VolumeShared>>);
    impl Drop for Closed {
        fn drop(&mut self) {
            if let Some(v) = &self.0 {
                v.closed_to_clients
                    .store(false, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
    let closed = Closed(rt.shared.volume(name));
    if let Some(v) = &closed.0 {
        v.closed_to_clients
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let n = rt.clients.count(v);
        if n > 0 && !force {
            return Err(format!(
                "volume {name:?} is in use by {n} client connection(s); disconnect them \
                 first, or roll back with --force (which disconnects them)"
            ));
        }
        if n > 0 {
            let gone = rt.clients.disconnect(v);
            tracing::warn!("volume {name:?}: disconnected {gone} client(s) to roll it back");
        }
    }
    rt.call(Request::Rollback {
        name: name.to_string(),
        snapshot: snapshot.to_string(),
    })
    .map(|_| json!({"ok": true}))
    .map_err(|e| e.to_string())
}

fn delete_volume(rt: &Runtime, name: &str, force: bool) -> Result<Value, String> {
    let vol = rt.shared.volume(name);
    let n = vol.as_ref().map_or(0, |v| rt.clients.count(v));
    if n > 0 && !force {
        return Err(format!(
            "volume {name:?} is in use by {n} client connection(s); disconnect them \
             first, or delete with --force (which disconnects them)"
        ));
    }
    if n > 0 {
        // Not for a deletion the engine will refuse anyway: clients would be cut
        // off for nothing. (Their requests in flight must be gone before the
        // engine takes it, so they are disconnected first.)
        let status = rt
            .call(Request::Status)
            .map_err(|e| e.to_string())?
            .expect("status reply carries a report");
        let children: Vec<String> = status
            .volumes
            .iter()
            .filter(|v| v.origin.as_deref() == Some(name))
            .map(|v| format!("{:?}", v.name))
            .collect();
        if !children.is_empty() {
            return Err(format!(
                "volume {name:?} has snapshots or clones made from it ({}): delete them first",
                children.join(", ")
            ));
        }
        if let Some(v) = &vol {
            let closed = rt.clients.disconnect(v);
            tracing::warn!("volume {name:?}: disconnected {closed} client(s) to delete it");
        }
    }
    rt.call(Request::DeleteVolume {
        name: name.to_string(),
    })
    .map(|_| {
        rt.qos.remove(name);
        json!({"ok": true})
    })
    .map_err(|e| e.to_string())
}
