//! Rendering a status report: JSON for scripts (stable key names), a table for
//! people, and Prometheus text for monitoring.

use crate::size::human;
use lamina_core::StatusReport;
use serde_json::{json, Value};

pub fn status_json(s: &StatusReport, running: bool) -> Value {
    json!({
        "running": running,
        "array": {
            "name": s.array_name,
            "uuid": s.array_uuid,
            "layout": s.layout,
            "devices": s.devices,
            "segment_size_bytes": s.segment_size_bytes,
            "write_unit_bytes": s.write_unit_bytes,
            "overprovision": s.overprovision,
            "members": s.members.iter().map(|m| json!({
                "index": m.index,
                "name": m.name,
                "state": m.state,
                "bytes_written": m.bytes_written,
                "bytes_read": m.bytes_read,
                "read_errors": m.read_errors,
                "rebuild_progress": m.rebuild_progress,
            })).collect::<Vec<_>>(),
            "redundancy_left": s.redundancy_left,
            "wear_spread": s.wear_spread,
            "zones_open": s.zones_open,
            "zone_open_limit": s.zone_open_limit,
        },
        "pad_bytes_written": s.pad_bytes_written,
        "blocks_rebuilt_from_parity": s.blocks_rebuilt_from_parity,
        "segments_repaired": s.segments_repaired,
        "capacity_bytes": s.capacity_bytes,
        "usable_bytes": s.usable_bytes,
        "live_bytes": s.live_bytes,
        "segment_count": s.segment_count,
        "used_segments": s.used_segments,
        "free_segments": s.free_segments,
        "user_bytes_written": s.user_bytes_written,
        "media_bytes_written": s.media_bytes_written,
        "gc_bytes_relocated": s.gc_bytes_relocated,
        "metadata_bytes_written": s.metadata_bytes_written,
        "write_amplification": s.write_amplification,
        "gc_policy": s.gc_policy,
        "gc_victims": s.gc_victims,
        "gc_floor_waits": s.gc_floor_waits,
        "flushes": s.flushes,
        "syncs": s.syncs,
        "checkpoints": s.checkpoints,
        "checkpoint_generation": s.checkpoint_generation,
        "corrupt_blocks": s.corrupt_blocks,
        "read_checksum_errors": s.read_checksum_errors,
        "failed": s.failed,
        "volumes": s.volumes.iter().map(|v| json!({
            "id": v.id,
            "name": v.name,
            "size_bytes": v.size_bytes,
            "live_bytes": v.live_bytes,
            "segments": v.segments,
            "user_bytes_written": v.user_bytes_written,
            "media_bytes_written": v.media_bytes_written,
            "gc_bytes_relocated": v.gc_bytes_relocated,
            "write_amplification": v.write_amplification,
            "classifier": v.classifier,
            "gc_policy": v.gc_policy,
            "classes_open": {"user": v.classes_open.0, "gc": v.classes_open.1},
            "classes": v.classes.iter().map(|c| json!({
                "class": c.class,
                "kind": c.kind,
                "segments": c.segments,
                "live_bytes": c.live_bytes,
                "bytes_written": c.bytes_written,
                "bytes_relocated_out": c.bytes_relocated_out,
                "victims": c.victims,
                "gc_cost": c.gc_cost,
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
    })
}

fn wa(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.3}"))
}

pub fn status_text(s: &StatusReport, running: bool) -> String {
    let mut o = String::new();
    o += &format!(
        "array {:?}  ({}, {} device{}, {})\n",
        s.array_name,
        s.layout,
        s.devices.len(),
        if s.devices.len() == 1 { "" } else { "s" },
        if running { "serving" } else { "stopped" }
    );
    if let Some(f) = &s.failed {
        o += &format!("  FAILED: {f}\n");
    }
    if s.members.is_empty() {
        for d in &s.devices {
            o += &format!("  device {d}\n");
        }
    }
    for m in &s.members {
        o += &format!(
            "  member {} {:<10} {}  written {}{}\n",
            m.index,
            match m.rebuild_progress {
                Some(p) => format!("REBUILDING {:.0}%", p * 100.0),
                None => m.state.to_uppercase(),
            },
            m.name,
            human(m.bytes_written),
            if m.read_errors > 0 {
                format!(", {} read errors repaired from parity", m.read_errors)
            } else {
                String::new()
            }
        );
    }
    if s.layout != "jbod" {
        o += &format!(
            "  redundancy: {}\n",
            match s.redundancy_left {
                r if r < 0 => "NONE, data lost on failed members".to_string(),
                0 => "none left (degraded)".to_string(),
                r => format!(
                    "{r} more member failure{} tolerated",
                    if r == 1 { "" } else { "s" }
                ),
            }
        );
    }
    if let Some(open) = s.zones_open {
        o += &format!(
            "  zoned: a segment per zone; {open} zones open of {}\n",
            match s.zone_open_limit {
                0 => "no limit".to_string(),
                l => format!("at most {l}"),
            }
        );
    }
    if s.members.len() > 1 {
        o += &format!(
            "  wear spread {:.1}% (most - least written per byte of capacity, over the mean)\n",
            s.wear_spread * 100.0
        );
    }
    o += &format!(
        "  capacity {}   usable {}   live {} ({:.1}%)\n",
        human(s.capacity_bytes),
        human(s.usable_bytes),
        human(s.live_bytes),
        100.0 * s.live_bytes as f64 / s.usable_bytes.max(1) as f64
    );
    o += &format!(
        "  segments {} of {}: {} used, {} free; over-provisioning {:.0}%\n",
        s.segment_count,
        human(s.segment_size_bytes),
        s.used_segments,
        s.free_segments,
        s.overprovision * 100.0
    );
    o += &format!(
        "  written: user {}, media {}, gc relocated {}, metadata {}\n",
        human(s.user_bytes_written),
        human(s.media_bytes_written),
        human(s.gc_bytes_relocated),
        human(s.metadata_bytes_written)
    );
    o += &format!(
        "  write amplification {}   gc policy {} ({} victims)\n",
        wa(s.write_amplification),
        s.gc_policy,
        s.gc_victims
    );
    o += &format!(
        "  user writes waited at the floor for a free segment {} times\n",
        s.gc_floor_waits
    );
    o += &format!(
        "  checkpoints {} (generation {}), flushes {}, syncs {}, corrupt blocks {}, read checksum errors {}\n",
        s.checkpoints, s.checkpoint_generation, s.flushes, s.syncs, s.corrupt_blocks, s.read_checksum_errors
    );
    o += &format!(
        "\n{:<20} {:>10} {:>10} {:>14} {:>14} {:>8}\n",
        "VOLUME", "SIZE", "LIVE", "USER WRITTEN", "GC RELOCATED", "WA"
    );
    for v in &s.volumes {
        o += &format!(
            "{:<20} {:>10} {:>10} {:>14} {:>14} {:>8}\n",
            v.name,
            human(v.size_bytes),
            human(v.live_bytes),
            human(v.user_bytes_written),
            human(v.gc_bytes_relocated),
            wa(v.write_amplification)
        );
    }
    for v in &s.volumes {
        o += &format!(
            "\n{}: classifier {}, gc policy {}, {} user + {} GC classes open\n  {:<6} {:<5} {:>9} {:>10} {:>12} {:>14} {:>8} {:>8}\n",
            v.name, v.classifier, v.gc_policy, v.classes_open.0, v.classes_open.1, "CLASS", "KIND", "SEGMENTS", "LIVE", "WRITTEN", "MOVED OUT", "VICTIMS", "GC COST"
        );
        for c in &v.classes {
            o += &format!(
                "  {:<6} {:<5} {:>9} {:>10} {:>12} {:>14} {:>8} {:>8}\n",
                c.class,
                c.kind,
                c.segments,
                human(c.live_bytes),
                human(c.bytes_written),
                human(c.bytes_relocated_out),
                c.victims,
                wa(c.gc_cost)
            );
        }
    }
    o
}

/// Prometheus text exposition format.
pub fn metrics_text(s: &StatusReport) -> String {
    let mut o = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: Vec<(String, f64)>| {
        o += &format!("# HELP lamina_{name} {help}\n# TYPE lamina_{name} {kind}\n");
        for (labels, v) in samples {
            o += &format!("lamina_{name}{labels} {v}\n");
        }
    };
    let vol = |f: &dyn Fn(&lamina_core::VolumeStatus) -> f64| -> Vec<(String, f64)> {
        s.volumes
            .iter()
            .map(|v| (format!("{{volume=\"{}\"}}", v.name), f(v)))
            .collect()
    };
    if let Some(open) = s.zones_open {
        metric(
            "zones_open",
            "gauge",
            "Zones held open by open or closing segments (zoned devices).",
            vec![(String::new(), open as f64)],
        );
    }
    metric(
        "member_failed",
        "gauge",
        "1 if the member device has failed.",
        s.members
            .iter()
            .map(|m| {
                (
                    format!("{{member=\"{}\"}}", m.index),
                    (m.state == "failed") as u8 as f64,
                )
            })
            .collect(),
    );
    metric(
        "member_bytes_written_total",
        "counter",
        "Bytes written to each member device.",
        s.members
            .iter()
            .map(|m| {
                (
                    format!("{{member=\"{}\"}}", m.index),
                    m.bytes_written as f64,
                )
            })
            .collect(),
    );
    metric(
        "redundancy_left",
        "gauge",
        "Member failures the layout can still absorb.",
        vec![(String::new(), s.redundancy_left as f64)],
    );
    metric(
        "capacity_bytes",
        "gauge",
        "Segment space on all devices.",
        vec![(String::new(), s.capacity_bytes as f64)],
    );
    metric(
        "usable_bytes",
        "gauge",
        "Live data the array accepts.",
        vec![(String::new(), s.usable_bytes as f64)],
    );
    metric(
        "live_bytes",
        "gauge",
        "Live data.",
        vec![(String::new(), s.live_bytes as f64)],
    );
    metric(
        "free_segments",
        "gauge",
        "Segments in the free queue.",
        vec![(String::new(), s.free_segments as f64)],
    );
    metric(
        "user_bytes_written_total",
        "counter",
        "Bytes written by clients.",
        vec![(String::new(), s.user_bytes_written as f64)],
    );
    metric(
        "media_bytes_written_total",
        "counter",
        "Bytes written to devices.",
        vec![(String::new(), s.media_bytes_written as f64)],
    );
    metric(
        "gc_bytes_relocated_total",
        "counter",
        "Bytes moved by garbage collection.",
        vec![(String::new(), s.gc_bytes_relocated as f64)],
    );
    metric(
        "metadata_bytes_written_total",
        "counter",
        "Bytes of checkpoints, release records and superblocks.",
        vec![(String::new(), s.metadata_bytes_written as f64)],
    );
    metric(
        "write_amplification",
        "gauge",
        "Media bytes per user byte.",
        vec![(String::new(), s.write_amplification.unwrap_or(0.0))],
    );
    metric(
        "flushes_total",
        "counter",
        "Client flushes.",
        vec![(String::new(), s.flushes as f64)],
    );
    metric(
        "syncs_total",
        "counter",
        "Device sync rounds.",
        vec![(String::new(), s.syncs as f64)],
    );
    metric(
        "checkpoints_total",
        "counter",
        "Checkpoints committed.",
        vec![(String::new(), s.checkpoints as f64)],
    );
    metric(
        "gc_floor_waits_total",
        "counter",
        "Times user writes waited at the user floor for a free segment.",
        vec![(String::new(), s.gc_floor_waits as f64)],
    );
    metric(
        "corrupt_blocks_total",
        "counter",
        "Blocks found damaged by GC.",
        vec![(String::new(), s.corrupt_blocks as f64)],
    );
    metric(
        "read_checksum_errors_total",
        "counter",
        "Reads that failed verification.",
        vec![(String::new(), s.read_checksum_errors as f64)],
    );
    metric(
        "volume_live_bytes",
        "gauge",
        "Live data per volume.",
        vol(&|v| v.live_bytes as f64),
    );
    metric(
        "volume_user_bytes_written_total",
        "counter",
        "Bytes written by clients per volume.",
        vol(&|v| v.user_bytes_written as f64),
    );
    metric(
        "volume_media_bytes_written_total",
        "counter",
        "Bytes written to devices per volume.",
        vol(&|v| v.media_bytes_written as f64),
    );
    metric(
        "volume_gc_bytes_relocated_total",
        "counter",
        "Bytes moved by GC per volume.",
        vol(&|v| v.gc_bytes_relocated as f64),
    );
    metric(
        "volume_write_amplification",
        "gauge",
        "Media bytes per user byte per volume.",
        vol(&|v| v.write_amplification.unwrap_or(0.0)),
    );
    o
}
