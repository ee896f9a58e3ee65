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
                "checksum_errors": m.checksum_errors,
                "write_errors": m.write_errors,
                "rebuild_progress": m.rebuild_progress,
                "rebuild_running": m.rebuild_running,
                "tier": m.tier,
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
        "maps_bytes": s.maps_bytes,
        "promised_bytes": s.promised_bytes,
        "volume_ids_left": s.volume_ids_left,
        "space_state": s.space_state,
        "space_warn": s.space_warn,
        "space_critical": s.space_critical,
        "writes_refused_nospace": s.writes_refused_nospace,
        "segment_count": s.segment_count,
        "used_segments": s.used_segments,
        "free_segments": s.free_segments,
        "cache": s.cache.as_ref().map(|c| json!({
            "segment_count": c.segment_count,
            "free_segments": c.free_segments,
            "dirty_bytes": c.dirty_bytes,
            "compactions": c.compactions,
            "compacted_bytes": c.compacted_bytes,
            "compaction_start": c.compaction_start,
            "compaction_stop": c.compaction_stop,
            "copies": c.copies,
            "copies_ok": c.copies_ok,
            "read_bytes_cache": c.read_bytes_cache,
            "read_bytes_capacity": c.read_bytes_capacity,
            "read_bytes_buffer": c.read_bytes_buffer,
            "hit_ratio": c.hit_ratio,
            "capacity_write_amplification": c.capacity_write_amplification,
        })),
        "user_bytes_written": s.user_bytes_written,
        "media_bytes_written": s.media_bytes_written,
        "gc_bytes_relocated": s.gc_bytes_relocated,
        "metadata_bytes_written": s.metadata_bytes_written,
        "write_amplification": s.write_amplification,
        "gc_policy": s.gc_policy,
        "gc_victims": s.gc_victims,
        "gc_floor_waits": s.gc_floor_waits,
        "gc_pace_waits": s.gc_pace_waits,
        "segments_discarded": s.segments_discarded,
        "segments_tail_discarded": s.segments_tail_discarded,
        "flushes": s.flushes,
        "syncs": s.syncs,
        "checkpoints": s.checkpoints,
        "checkpoint_generation": s.checkpoint_generation,
        "corrupt_blocks": s.corrupt_blocks,
        "read_checksum_errors": s.read_checksum_errors,
        "reads_by_connection": s.reads_by_connection,
        "header_cache_misses": s.header_cache_misses,
        "failed": s.failed,
        "volumes": s.volumes.iter().map(|v| json!({
            "id": v.id,
            "name": v.name,
            "size_bytes": v.size_bytes,
            "live_bytes": v.live_bytes,
            "exclusive_bytes": v.exclusive_bytes,
            "snapshot": v.snapshot,
            "origin": v.origin,
            "family": v.family,
            "created_version": v.created_version,
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
            if m.tier == "cache" {
                format!("{} (cache tier)", m.name)
            } else {
                m.name.clone()
            },
            human(m.bytes_written),
            match (m.read_errors, m.checksum_errors) {
                (0, 0) => String::new(),
                (r, c) => format!(", errors repaired from parity: {r} read, {c} checksum"),
            } + &match m.write_errors {
                0 => String::new(),
                w => format!(", {w} write error{}", if w == 1 { "" } else { "s" }),
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
            "  zoned: a segment per zone{}; {open} zones open of {}\n",
            if s.cache.is_some() {
                " of the capacity tier (the cache is conventional)"
            } else {
                ""
            },
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
    // The volumes' maps beyond the checkpoints' room count as in use (see
    // `maps_bytes`): shown only when there is some.
    let maps = if s.maps_bytes > 0 {
        format!(" + maps {}", human(s.maps_bytes))
    } else {
        String::new()
    };
    o += &format!(
        "  capacity {}   usable {}   live {}{maps} ({:.1}%)\n",
        human(s.capacity_bytes),
        human(s.usable_bytes),
        human(s.live_bytes),
        100.0 * (s.live_bytes + s.maps_bytes) as f64 / s.usable_bytes.max(1) as f64
    );
    o += &space_line(s);
    o += &format!(
        "  segments {} of {}: {} used, {} free; over-provisioning {:.0}%\n",
        s.segment_count,
        human(s.segment_size_bytes),
        s.used_segments,
        s.free_segments,
        s.overprovision * 100.0
    );
    if let Some(c) = &s.cache {
        o += &format!(
            "  cache tier: {} segments, {} free (compaction below {}, until {}); {} not yet compacted; compacted {} from {} segments\n",
            c.segment_count,
            c.free_segments,
            c.compaction_start,
            c.compaction_stop,
            human(c.dirty_bytes),
            human(c.compacted_bytes),
            c.compactions
        );
        o += &format!(
            "  cache reads: {} from the cache, {} from the write buffer, {} from the capacity tier{}; capacity tier written {} per user byte\n",
            human(c.read_bytes_cache),
            human(c.read_bytes_buffer),
            human(c.read_bytes_capacity),
            c.hit_ratio
                .map_or(String::new(), |h| format!(" (hit ratio {:.1}%)", h * 100.0)),
            c.capacity_write_amplification
                .map_or("-".to_string(), |w| format!("{w:.2}"))
        );
        if c.copies > 1 {
            o += &format!(
                "  cache mirror: {} copies, {}\n",
                c.copies,
                match c.copies - c.copies_ok.min(c.copies) {
                    0 => "all in service".to_string(),
                    n if n == c.copies => "NONE in service".to_string(),
                    n => format!("{n} out of service (degraded)"),
                }
            );
        }
    }
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
        "  user writes waited for GC: paced {} times, at the floor for a free segment {} times\n",
        s.gc_pace_waits, s.gc_floor_waits
    );
    o += &format!(
        "  segments discarded {} ({} keeping their first header)\n",
        s.segments_discarded, s.segments_tail_discarded
    );
    o += &format!(
        "  checkpoints {} (generation {}), flushes {}, syncs {}, corrupt blocks {}, read checksum errors {}\n",
        s.checkpoints, s.checkpoint_generation, s.flushes, s.syncs, s.corrupt_blocks, s.read_checksum_errors
    );
    o += &format!(
        "  device reads by connections {}, unit headers read for the header cache {}\n",
        s.reads_by_connection, s.header_cache_misses
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

/// Prometheus exposition (OpenMetrics text, written by the `prometheus-client`
/// crate), every sample labelled with the array's name. The metric names are a
/// stable interface, listed in docs/design.md ("Metrics"). Families are collected
/// here from a status report and a snapshot of the NBD server's counters, then
/// encoded at once: a scrape sees one consistent report.
struct Exposition {
    array: String,
    families: Vec<MetricFamily>,
}

/// A sample's labels besides `array`.
type Labels = Vec<(&'static str, String)>;
/// A sample's labels besides `array`, and its value.
type Sample = (Labels, f64);
/// A histogram series: labels, sum, and (upper bound, count in that bucket) with
/// `f64::MAX` for +Inf.
type Series = (Labels, f64, Vec<(f64, u64)>);

#[derive(Debug)]
enum Values {
    Counter(Vec<Sample>),
    Gauge(Vec<Sample>),
    /// The count of a series is its buckets' total.
    Histogram(Vec<Series>),
}

#[derive(Debug)]
struct MetricFamily {
    /// Without the `lamina_` prefix, and for counters without `_total` (the
    /// encoder appends it to the samples, as OpenMetrics names them).
    name: String,
    help: String,
    values: Values,
}

/// A label value with `\`, `"` and newlines escaped, as the format asks (the
/// encoder writes label values as they are given).
fn label_value(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escaped(labels: &[(&'static str, String)]) -> Labels {
    labels.iter().map(|(k, v)| (*k, label_value(v))).collect()
}

impl prometheus_client::collector::Collector for MetricFamilies {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::metrics::exemplar::Exemplar;
        use prometheus_client::metrics::MetricType;
        for f in &self.0 {
            let kind = match f.values {
                Values::Counter(_) => MetricType::Counter,
                Values::Gauge(_) => MetricType::Gauge,
                Values::Histogram(_) => MetricType::Histogram,
            };
            let mut m = encoder.encode_descriptor(&f.name, &f.help, None, kind)?;
            match &f.values {
                // Whole numbers are written as such ("2", not "2.0"), as they were
                // before the crate wrote them and as scripts that read them expect.
                Values::Counter(samples) => {
                    for (labels, v) in samples {
                        let labels = escaped(labels);
                        let mut f = m.encode_family(&labels)?;
                        match whole(*v) {
                            Some(n) if n >= 0 => f
                                .encode_counter::<Vec<(String, String)>, u64, f64>(
                                    &(n as u64),
                                    None,
                                )?,
                            _ => f.encode_counter::<Vec<(String, String)>, f64, f64>(v, None)?,
                        }
                    }
                }
                Values::Gauge(samples) => {
                    for (labels, v) in samples {
                        let labels = escaped(labels);
                        let mut f = m.encode_family(&labels)?;
                        match whole(*v) {
                            Some(n) => f.encode_gauge(&n)?,
                            None => f.encode_gauge(v)?,
                        }
                    }
                }
                Values::Histogram(series) => {
                    for (labels, sum, buckets) in series {
                        let count = buckets.iter().map(|b| b.1).sum();
                        let labels = escaped(labels);
                        m.encode_family(&labels)?
                            .encode_histogram::<Vec<(String, String)>>(
                                *sum,
                                count,
                                buckets,
                                None::<
                                    &std::collections::HashMap<
                                        usize,
                                        Exemplar<Vec<(String, String)>, f64>,
                                    >,
                                >,
                            )?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// `v` as an integer when it is one (and exactly representable).
fn whole(v: f64) -> Option<i64> {
    (v.fract() == 0.0 && v.abs() < (1u64 << 53) as f64).then_some(v as i64)
}

/// The families of one scrape, as the registry's collector.
#[derive(Debug)]
struct MetricFamilies(Vec<MetricFamily>);

impl Exposition {
    fn new(array: &str) -> Self {
        Exposition {
            array: array.to_string(),
            families: Vec::new(),
        }
    }

    fn metric(&mut self, name: &str, kind: &str, help: &str, samples: Vec<Sample>) {
        let (name, values) = match kind {
            "counter" => (
                name.strip_suffix("_total")
                    .expect("a counter's name ends in _total"),
                Values::Counter(samples),
            ),
            "gauge" => (name, Values::Gauge(samples)),
            _ => panic!("metric kind {kind}"),
        };
        self.families.push(MetricFamily {
            name: name.to_string(),
            help: help.to_string(),
            values,
        });
    }

    /// One sample without labels of its own.
    fn one(&mut self, name: &str, kind: &str, help: &str, v: f64) {
        self.metric(name, kind, help, vec![(vec![], v)]);
    }

    /// The exposition as text: every family, each sample with `array` too.
    fn finish(self) -> String {
        let mut registry = prometheus_client::registry::Registry::with_prefix_and_labels(
            "lamina",
            [(
                std::borrow::Cow::Borrowed("array"),
                std::borrow::Cow::Owned(label_value(&self.array)),
            )]
            .into_iter(),
        );
        registry.register_collector(Box::new(MetricFamilies(self.families)));
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String does not fail");
        out
    }
}

/// Everything a running server exposes: the array's metrics and the NBD server's.
pub fn running_metrics_text(s: &StatusReport) -> String {
    let mut e = Exposition::new(&s.array_name);
    array_metrics(&mut e, s);
    server_metrics(&mut e, &lamina_nbd::stats::snapshot());
    e.finish()
}

/// The array's metrics, from a status report of a stopped array.
pub fn metrics_text(s: &StatusReport) -> String {
    let mut e = Exposition::new(&s.array_name);
    array_metrics(&mut e, s);
    e.finish()
}

/// The array's metrics, from a status report (a running server's or a stopped
/// array's).
fn array_metrics(e: &mut Exposition, s: &StatusReport) {
    let vol = |f: &dyn Fn(&lamina_core::VolumeStatus) -> f64| -> Vec<Sample> {
        s.volumes
            .iter()
            .map(|v| (vec![("volume", v.name.clone())], f(v)))
            .collect()
    };
    let member = |f: &dyn Fn(&lamina_core::MemberStatus) -> f64| -> Vec<Sample> {
        s.members
            .iter()
            .map(|m| (vec![("member", m.index.to_string())], f(m)))
            .collect()
    };
    if let Some(open) = s.zones_open {
        e.one(
            "zones_open",
            "gauge",
            "Zones held open by open or closing segments (zoned devices).",
            open as f64,
        );
    }
    let failed = member(&|m| (m.state == "failed") as u8 as f64);
    e.metric(
        "member_failed",
        "gauge",
        "1 if the member device has failed.",
        failed,
    );
    type MemberCounter = fn(&lamina_core::MemberStatus) -> u64;
    let member_counters: [(&str, &str, MemberCounter); 5] = [
        (
            "member_bytes_written_total",
            "Bytes written to each member device.",
            |m| m.bytes_written,
        ),
        (
            "member_bytes_read_total",
            "Bytes read from each member device (striped layouts; since the array was opened).",
            |m| m.bytes_read,
        ),
        (
            "member_read_errors_total",
            "Reads of each member that failed (and were rebuilt from parity).",
            |m| m.read_errors,
        ),
        (
            "member_checksum_errors_total",
            "Blocks of each member that failed their checksum (and were rebuilt from parity).",
            |m| m.checksum_errors,
        ),
        (
            "member_write_errors_total",
            "Writes, syncs and zone operations of each member that failed (the first fails a member of a striped layout).",
            |m| m.write_errors,
        ),
    ];
    for (name, help, f) in member_counters {
        e.metric(name, "counter", help, member(&|m| f(m) as f64));
    }
    let progress = member(&|m| match m.state.as_str() {
        "failed" => 0.0,
        "rebuilding" => m.rebuild_progress.unwrap_or(0.0),
        _ => 1.0,
    });
    let help = "Fraction of the member's stripes that hold its data: 1 when in service, \
                the rebuild's progress while rebuilding, 0 when failed.";
    e.metric("member_rebuild_progress_ratio", "gauge", help, progress);
    let help = "Member failures the layout can still absorb.";
    e.one("redundancy_left", "gauge", help, s.redundancy_left as f64);
    let help = "Segment space on all devices.";
    e.one("capacity_bytes", "gauge", help, s.capacity_bytes as f64);
    e.one(
        "usable_bytes",
        "gauge",
        "Live data the array accepts.",
        s.usable_bytes as f64,
    );
    e.one("live_bytes", "gauge", "Live data.", s.live_bytes as f64);
    let help = "What the volumes' maps (snapshots and clones, writes scattered over \
                thin volumes) take in the checkpoints beyond the room usable_bytes \
                leaves them (in use, as live data is).";
    e.one("maps_bytes", "gauge", help, s.maps_bytes as f64);
    let help = "The volumes' sizes together (above usable_bytes: overcommitted).";
    e.one("promised_bytes", "gauge", help, s.promised_bytes as f64);
    let help = "Volume ids the array can still give out (each volume, snapshot, clone \
                and rollback holds one until it is deleted and unreferenced).";
    e.one("volume_ids_left", "gauge", help, s.volume_ids_left as f64);
    let help = "Fullness against the usable capacity: 0 ok, 1 above the warning \
                threshold, 2 above the critical one, 3 full.";
    let state = match s.space_state.as_str() {
        "warning" => 1.0,
        "critical" => 2.0,
        "full" => 3.0,
        _ => 0.0,
    };
    e.one("space_state", "gauge", help, state);
    let help = "Writes refused with ENOSPC since the array was opened.";
    e.one(
        "writes_refused_nospace_total",
        "counter",
        help,
        s.writes_refused_nospace as f64,
    );
    let help = "Segments in the free queue.";
    e.one("free_segments", "gauge", help, s.free_segments as f64);
    if let Some(c) = &s.cache {
        let by_tier = [
            ("cache", c.read_bytes_cache),
            ("buffer", c.read_bytes_buffer),
            ("capacity", c.read_bytes_capacity),
        ]
        .iter()
        .map(|&(tier, bytes)| (vec![("tier", tier.to_string())], bytes as f64))
        .collect();
        e.metric(
            "tier_read_bytes_total",
            "counter",
            "Bytes read, by where they were found: the cache tier, the DRAM write buffer or the capacity tier.",
            by_tier,
        );
        if let Some(w) = c.capacity_write_amplification {
            let help = "Bytes written to the capacity tier per user byte written.";
            e.one("capacity_write_amplification", "gauge", help, w);
        }
        let help = "Devices of the cache tier in service (a mirror has 2 or 3).";
        e.one("cache_copies_ok", "gauge", help, c.copies_ok as f64);
        let help = "Free segments of the cache tier.";
        e.one("cache_free_segments", "gauge", help, c.free_segments as f64);
        let help = "Live bytes in the cache tier that compaction has not moved yet.";
        e.one("cache_dirty_bytes", "gauge", help, c.dirty_bytes as f64);
        let help = "Bytes compaction moved from the cache tier to the capacity tier.";
        e.one(
            "cache_compacted_bytes_total",
            "counter",
            help,
            c.compacted_bytes as f64,
        );
        let help = "Cache segments compacted.";
        e.one(
            "cache_compactions_total",
            "counter",
            help,
            c.compactions as f64,
        );
    }
    let counters: [(&str, &str, u64); 16] = [
        (
            "user_bytes_written_total",
            "Bytes written by clients.",
            s.user_bytes_written,
        ),
        (
            "media_bytes_written_total",
            "Bytes written to devices.",
            s.media_bytes_written,
        ),
        (
            "gc_bytes_relocated_total",
            "Bytes moved by garbage collection.",
            s.gc_bytes_relocated,
        ),
        (
            "metadata_bytes_written_total",
            "Bytes of checkpoints, release records and superblocks.",
            s.metadata_bytes_written,
        ),
        ("flushes_total", "Client flushes.", s.flushes),
        ("syncs_total", "Device sync rounds.", s.syncs),
        ("checkpoints_total", "Checkpoints committed.", s.checkpoints),
        (
            "gc_floor_waits_total",
            "Times user writes waited at the user floor for a free segment.",
            s.gc_floor_waits,
        ),
        (
            "gc_pace_waits_total",
            "Times user writes waited for GC to earn them room (pacing).",
            s.gc_pace_waits,
        ),
        (
            "segments_discarded_total",
            "Segments discarded (TRIM, holes in files) since the array was opened.",
            s.segments_discarded,
        ),
        (
            "segments_tail_discarded_total",
            "Discards that kept the segment's first unit header (opened after the durable checkpoint).",
            s.segments_tail_discarded,
        ),
        (
            "corrupt_blocks_total",
            "Blocks found damaged by GC.",
            s.corrupt_blocks,
        ),
        (
            "read_checksum_errors_total",
            "Reads that failed verification.",
            s.read_checksum_errors,
        ),
        (
            "reads_by_connection_total",
            "Device reads carried out by the client's connection through io_uring.",
            s.reads_by_connection,
        ),
        (
            "header_cache_misses_total",
            "Unit headers read from a device because the header cache did not hold their checksums.",
            s.header_cache_misses,
        ),
        (
            "pad_bytes_written_total",
            "Dead blocks written to pad flushed units to whole stripe rows.",
            s.pad_bytes_written,
        ),
    ];
    for (name, help, v) in counters {
        e.one(name, "counter", help, v as f64);
    }
    let help = "Media bytes per user byte.";
    e.one(
        "write_amplification",
        "gauge",
        help,
        s.write_amplification.unwrap_or(0.0),
    );
    type VolumeField = fn(&lamina_core::VolumeStatus) -> f64;
    let per_volume: [(&str, &str, &str, VolumeField); 6] = [
        (
            "volume_size_bytes",
            "gauge",
            "Size of each volume (what its clients see).",
            |v| v.size_bytes as f64,
        ),
        ("volume_live_bytes", "gauge", "Live data per volume.", |v| {
            v.live_bytes as f64
        }),
        (
            "volume_user_bytes_written_total",
            "counter",
            "Bytes written by clients per volume.",
            |v| v.user_bytes_written as f64,
        ),
        (
            "volume_media_bytes_written_total",
            "counter",
            "Bytes written to devices per volume.",
            |v| v.media_bytes_written as f64,
        ),
        (
            "volume_gc_bytes_relocated_total",
            "counter",
            "Bytes moved by GC per volume.",
            |v| v.gc_bytes_relocated as f64,
        ),
        (
            "volume_write_amplification",
            "gauge",
            "Media bytes per user byte per volume.",
            |v| v.write_amplification.unwrap_or(0.0),
        ),
    ];
    for (name, kind, help, f) in per_volume {
        e.metric(name, kind, help, vol(&f));
    }
}

/// The NBD server's metrics: connections, and per volume and kind of request the
/// requests, errors, bytes and a latency histogram (from the request read to its
/// completion). Only a running server has them.
fn server_metrics(e: &mut Exposition, snap: &lamina_nbd::stats::Snapshot) {
    use lamina_nbd::stats::{bucket_bound, OP_NAMES};
    let help = "NBD connections in the transmission phase.";
    e.one("nbd_connections", "gauge", help, snap.connections as f64);
    let help =
        "Heap allocations of the server process (the data path makes next to none per request).";
    e.one(
        "heap_allocations_total",
        "counter",
        help,
        crate::heap::allocations() as f64,
    );
    let per_op = |f: &dyn Fn(&lamina_nbd::stats::OpTotals) -> f64| -> Vec<Sample> {
        let mut v = Vec::new();
        for (volume, t) in &snap.exports {
            for (op, o) in OP_NAMES.iter().zip(&t.ops) {
                v.push((
                    vec![("volume", volume.clone()), ("op", op.to_string())],
                    f(o),
                ));
            }
        }
        v
    };
    type OpField = fn(&lamina_nbd::stats::OpTotals) -> f64;
    let counters: [(&str, &str, OpField); 3] = [
        ("nbd_requests_total", "NBD requests completed, per volume and kind.", |o| {
            o.count as f64
        }),
        (
            "nbd_request_errors_total",
            "NBD requests answered with an error, per volume and kind.",
            |o| o.errors as f64,
        ),
        (
            "nbd_request_bytes_total",
            "Bytes the NBD requests covered (read, written, trimmed, zeroed...), per volume and kind.",
            |o| o.bytes as f64,
        ),
    ];
    for (name, help, f) in counters {
        e.metric(name, "counter", help, per_op(&f));
    }
    // Per series: the buckets, the sum, and the count, which is the buckets' total
    // (read in the same pass, so +Inf equals it even while requests complete
    // during the scrape).
    let mut series = Vec::new();
    for (volume, t) in &snap.exports {
        for (op, o) in OP_NAMES.iter().zip(&t.ops) {
            let buckets = o
                .buckets
                .iter()
                .enumerate()
                .map(|(i, &n)| (bucket_bound(i).unwrap_or(f64::MAX), n))
                .collect();
            series.push((
                vec![("volume", volume.clone()), ("op", op.to_string())],
                o.seconds,
                buckets,
            ));
        }
    }
    e.families.push(MetricFamily {
        name: "nbd_request_duration_seconds".into(),
        help: "NBD request latency, from the request read to its completion.".into(),
        values: Values::Histogram(series),
    });
}

/// The fullness line of `status`: the state against the thresholds, and how far
/// thin volumes overcommit the usable capacity.
fn space_line(s: &StatusReport) -> String {
    let state = match s.space_state.as_str() {
        "warning" => format!("WARNING: above {:.0}% of usable", s.space_warn * 100.0),
        "critical" => format!(
            "CRITICAL: above {:.0}% of usable; writes to unwritten blocks fail when full",
            s.space_critical * 100.0
        ),
        "full" => "FULL: writes to unwritten blocks get ENOSPC".to_string(),
        _ => format!(
            "ok (warns at {:.0}%, critical at {:.0}%)",
            s.space_warn * 100.0,
            s.space_critical * 100.0
        ),
    };
    let thin = if s.promised_bytes > s.usable_bytes {
        format!(
            "; volumes promise {} = {:.2}x usable (thin)",
            human(s.promised_bytes),
            s.promised_bytes as f64 / s.usable_bytes.max(1) as f64
        )
    } else {
        format!("; volumes promise {}", human(s.promised_bytes))
    };
    let refused = if s.writes_refused_nospace > 0 {
        format!("; {} writes refused (ENOSPC)", s.writes_refused_nospace)
    } else {
        String::new()
    };
    let ids = if s.volume_ids_left < 1000 {
        format!(
            "\n  volume ids: {} left (volumes, snapshots, clones and rollbacks each hold one until deleted)",
            s.volume_ids_left
        )
    } else {
        String::new()
    };
    format!("  space {state}{thin}{refused}{ids}\n")
}

/// The last scrub of a running server, as `zpool status` shows its scan line.
pub fn scrub_line(v: &Value) -> String {
    if v.is_null() {
        return "  scrub: none since the server started (lamina array scrub)\n".into();
    }
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let ago = now.saturating_sub(n("finished_unix"));
    let left = n("damage_left");
    format!(
        "  scrub: {} blocks checked in {:.1}s, {} ago: {} checksum errors, {} parity \
         mismatches, {} repaired, {}\n",
        n("blocks_checked"),
        v["seconds"].as_f64().unwrap_or(0.0),
        if ago < 120 {
            format!("{ago}s")
        } else {
            format!("{} min", ago / 60)
        },
        n("checksum_errors"),
        n("parity_mismatches"),
        n("blocks_repaired") + n("parity_repaired"),
        if left > 0 {
            format!("DAMAGE LEFT: {left} blocks or headers")
        } else {
            "no damage left".to_string()
        }
    )
}
