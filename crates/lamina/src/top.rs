//! `lamina top`: a live view of a running server, from the metrics it exposes (the
//! admin socket's `metrics`, the same text Prometheus scrapes), sampled every
//! interval: per volume the requests and bytes per second and the latency, for the
//! array its space, write amplification and the writing behind it, and its members.

use crate::size::human;
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::{Duration, Instant};

pub const TOP_ABOUT: &str = "\
A live view of a running server, refreshed every --interval seconds: per volume the
read and write requests per second, bytes per second, mean and 99th-percentile
latency and errors; for the array its live and usable space, free segments, write
amplification, and the bytes per second written by users, to the media and moved by
garbage collection; each member's state. The figures are rates between two samples
of the server's metrics (lamina status --prometheus; names in docs/design.md).

On a terminal the screen is redrawn; otherwise each view is printed after the last,
which suits logs and scripts (with --count).";

/// A series' labels, `k="v"` pairs in their order, without the array's.
type Labels = Vec<(String, String)>;

/// One sample of the metrics: (name, labels) to value.
#[derive(Default)]
struct Sample {
    values: HashMap<(String, Labels), f64>,
    at: Option<Instant>,
}

/// Splits `name{k="v",...} value` (the text exposition format).
fn parse_line(line: &str) -> Option<(String, Labels, f64)> {
    if line.starts_with('#') || line.trim().is_empty() {
        return None;
    }
    let (series, value) = line.rsplit_once(' ')?;
    let value: f64 = value.parse().ok()?;
    let Some((name, rest)) = series.split_once('{') else {
        return Some((series.to_string(), Vec::new(), value));
    };
    let body = rest.strip_suffix('}')?;
    let mut labels = Vec::new();
    let mut chars = body.chars().peekable();
    while chars.peek().is_some() {
        let key: String = chars.by_ref().take_while(|&c| c != '=').collect();
        if chars.next() != Some('"') {
            return None;
        }
        let mut v = String::new();
        let mut closed = false;
        while let Some(c) = chars.next() {
            match c {
                '\\' => match chars.next()? {
                    'n' => v.push('\n'),
                    other => v.push(other),
                },
                '"' => {
                    closed = true;
                    break;
                }
                c => v.push(c),
            }
        }
        if !closed {
            return None;
        }
        if key != "array" {
            labels.push((key, v));
        }
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
    Some((name.to_string(), labels, value))
}

impl Sample {
    fn parse(text: &str) -> Sample {
        let mut s = Sample {
            at: Some(Instant::now()),
            ..Sample::default()
        };
        for (name, labels, v) in text.lines().filter_map(parse_line) {
            s.values.insert((name, labels), v);
        }
        s
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        let key = (
            name.to_string(),
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        );
        self.values.get(&key).copied().unwrap_or(0.0)
    }

    /// The values of the label `label` among the series of `name`, sorted.
    fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .values
            .keys()
            .filter(|(n, _)| n == name)
            .filter_map(|(_, l)| l.iter().find(|(k, _)| k == label).map(|(_, v)| v.clone()))
            .collect();
        v.sort();
        v.dedup();
        v
    }
}

/// What changed between two samples.
struct Delta<'a> {
    old: &'a Sample,
    new: &'a Sample,
    secs: f64,
}

impl Delta<'_> {
    fn diff(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        (self.new.get(name, labels) - self.old.get(name, labels)).max(0.0)
    }

    fn rate(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.diff(name, labels) / self.secs
    }

    /// The latency under which 99% of the requests of the interval finished (the
    /// upper bound of the histogram bucket it falls in), in seconds.
    fn p99(&self, volume: &str, op: &str) -> Option<f64> {
        let n = self.diff(
            "lamina_nbd_request_duration_seconds_count",
            &[("volume", volume), ("op", op)],
        );
        if n == 0.0 {
            return None;
        }
        let mut bounds: Vec<(f64, String)> = self
            .new
            .values
            .keys()
            .filter(|(name, l)| {
                name == "lamina_nbd_request_duration_seconds_bucket"
                    && l.iter().any(|(k, v)| k == "volume" && v == volume)
                    && l.iter().any(|(k, v)| k == "op" && v == op)
            })
            .filter_map(|(_, l)| {
                let le = &l.iter().find(|(k, _)| k == "le")?.1;
                let b = if le == "+Inf" {
                    f64::INFINITY
                } else {
                    le.parse().ok()?
                };
                Some((b, le.clone()))
            })
            .collect();
        bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (b, le) in bounds {
            let labels = [("volume", volume), ("op", op), ("le", le.as_str())];
            if self.diff("lamina_nbd_request_duration_seconds_bucket", &labels) >= 0.99 * n {
                return Some(b);
            }
        }
        None
    }
}

fn latency(s: Option<f64>) -> String {
    match s {
        None => "-".into(),
        Some(s) if s.is_infinite() => ">8s".into(),
        Some(s) if s < 1e-3 => format!("{:.0}us", s * 1e6),
        Some(s) if s < 1.0 => format!("{:.1}ms", s * 1e3),
        Some(s) => format!("{s:.2}s"),
    }
}

/// Bytes per second, in one word (the view's columns split on spaces).
fn per_sec(bytes: f64) -> String {
    format!("{}/s", human(bytes as u64).replace(' ', ""))
}

/// One view of the interval between `old` and `new`.
fn render(old: &Sample, new: &Sample) -> String {
    let secs = match (old.at, new.at) {
        (Some(a), Some(b)) => b.duration_since(a).as_secs_f64().max(1e-3),
        _ => 1.0,
    };
    let d = Delta { old, new, secs };
    let g = |name: &str| new.get(name, &[]);
    let mut o = String::new();
    use std::fmt::Write as _;
    let _ = writeln!(
        o,
        "live {} of {} usable ({:.1}% in use, maps included)   free segments {}   write amplification {:.2}   connections {}",
        human(g("lamina_live_bytes") as u64),
        human(g("lamina_usable_bytes") as u64),
        100.0 * (g("lamina_live_bytes") + g("lamina_maps_bytes")) / g("lamina_usable_bytes").max(1.0),
        g("lamina_free_segments"),
        g("lamina_write_amplification"),
        g("lamina_nbd_connections"),
    );
    let _ = writeln!(
        o,
        "written: users {}   media {}   GC moved {}   metadata {}   writes waiting for GC {:.0}/s",
        per_sec(d.rate("lamina_user_bytes_written_total", &[])),
        per_sec(d.rate("lamina_media_bytes_written_total", &[])),
        per_sec(d.rate("lamina_gc_bytes_relocated_total", &[])),
        per_sec(d.rate("lamina_metadata_bytes_written_total", &[])),
        d.rate("lamina_gc_floor_waits_total", &[]),
    );
    let _ = writeln!(
        o,
        "\n{:<16} {:>9} {:>11} {:>8} {:>8} {:>9} {:>11} {:>8} {:>8} {:>9} {:>7}",
        "VOLUME",
        "READS/s",
        "READ",
        "MEAN",
        "P99",
        "WRITES/s",
        "WRITE",
        "MEAN",
        "P99",
        "OTHER/s",
        "ERR/s"
    );
    for v in new.label_values("lamina_volume_size_bytes", "volume") {
        let op = |op| op_labels(&v, op);
        let mean = |op: &'static str| {
            let n = d.diff(
                "lamina_nbd_request_duration_seconds_count",
                &op_labels(&v, op),
            );
            (n > 0.0).then(|| {
                d.diff(
                    "lamina_nbd_request_duration_seconds_sum",
                    &op_labels(&v, op),
                ) / n
            })
        };
        let others: f64 = ["flush", "trim", "write_zeroes", "cache", "block_status"]
            .iter()
            .map(|o| d.rate("lamina_nbd_requests_total", &op(o)))
            .sum();
        let errors: f64 = lamina_nbd::stats::OP_NAMES
            .iter()
            .map(|o| d.rate("lamina_nbd_request_errors_total", &op(o)))
            .sum();
        let _ = writeln!(
            o,
            "{:<16} {:>9.0} {:>11} {:>8} {:>8} {:>9.0} {:>11} {:>8} {:>8} {:>9.0} {:>7.0}",
            v,
            d.rate("lamina_nbd_requests_total", &op("read")),
            per_sec(d.rate("lamina_nbd_request_bytes_total", &op("read"))),
            latency(mean("read")),
            latency(d.p99(&v, "read")),
            d.rate("lamina_nbd_requests_total", &op("write")),
            per_sec(d.rate("lamina_nbd_request_bytes_total", &op("write"))),
            latency(mean("write")),
            latency(d.p99(&v, "write")),
            others,
            errors,
        );
    }
    let members = new.label_values("lamina_member_failed", "member");
    if members.len() > 1 {
        let _ = write!(o, "\nmembers:");
        for m in &members {
            let l = [("member", m.as_str())];
            let state = if new.get("lamina_member_failed", &l) > 0.0 {
                "failed".to_string()
            } else {
                let p = new.get("lamina_member_rebuild_progress_ratio", &l);
                if p < 1.0 {
                    format!("rebuilding {:.0}%", 100.0 * p)
                } else {
                    "ok".to_string()
                }
            };
            let _ = write!(o, "  {m}: {state}");
        }
        let _ = writeln!(o);
    }
    o
}

fn op_labels<'a>(volume: &'a str, op: &'a str) -> [(&'a str, &'a str); 2] {
    [("volume", volume), ("op", op)]
}

fn fetch(socket: &Path) -> Result<Sample> {
    let Some(v) = crate::admin::request(socket, &json!({"op": "metrics"}))? else {
        bail!(
            "no server answers on {} (lamina top watches a running `lamina serve`)",
            socket.display()
        );
    };
    let text = v["metrics"]
        .as_str()
        .context("the server's answer has no metrics")?;
    Ok(Sample::parse(text))
}

/// Runs the view: `count` views (forever if `None`), `interval` apart.
pub fn run(dir: &Path, interval: Duration, count: Option<u64>) -> Result<()> {
    let socket = crate::admin_socket(dir)?;
    let tty = std::io::stdout().is_terminal();
    let mut old = fetch(&socket)?;
    let mut shown = 0u64;
    while count.is_none_or(|c| shown < c) {
        std::thread::sleep(interval);
        let new = fetch(&socket)?;
        let mut frame = String::new();
        if tty {
            frame += "\x1b[H\x1b[2J";
        } else if shown > 0 {
            frame += "\n";
        }
        frame += &format!(
            "lamina top {}   every {:.1}s\n",
            dir.display(),
            interval.as_secs_f64()
        );
        frame += &render(&old, &new);
        let mut out = std::io::stdout().lock();
        match out.write_all(frame.as_bytes()).and_then(|_| out.flush()) {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
            r => r.context("cannot write to standard output")?,
        }
        old = new;
        shown += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_lines_parse() {
        let (n, l, v) =
            parse_line(r#"lamina_x{array="a",volume="v \"q\"",op="read"} 12.5"#).unwrap();
        assert_eq!(n, "lamina_x");
        assert_eq!(
            l,
            vec![
                ("volume".to_string(), "v \"q\"".to_string()),
                ("op".to_string(), "read".to_string())
            ]
        );
        assert_eq!(v, 12.5);
        assert_eq!(parse_line("lamina_y 3").unwrap().2, 3.0);
        assert!(parse_line("# TYPE lamina_y gauge").is_none());
        assert!(parse_line("garbage").is_none());
        assert!(parse_line(r#"x{a="b} 1"#).is_none());
    }

    #[test]
    fn rates_and_percentiles_come_from_the_difference() {
        let t0 = Instant::now();
        let mk = |count: f64, fast: f64, at: Instant| {
            let text = format!(
                "lamina_volume_size_bytes{{array=\"a\",volume=\"v\"}} 1000\n\
                 lamina_nbd_requests_total{{array=\"a\",volume=\"v\",op=\"write\"}} {count}\n\
                 lamina_nbd_request_duration_seconds_bucket{{array=\"a\",volume=\"v\",op=\"write\",le=\"0.001\"}} {fast}\n\
                 lamina_nbd_request_duration_seconds_bucket{{array=\"a\",volume=\"v\",op=\"write\",le=\"+Inf\"}} {count}\n\
                 lamina_nbd_request_duration_seconds_count{{array=\"a\",volume=\"v\",op=\"write\"}} {count}\n"
            );
            let mut s = Sample::parse(&text);
            s.at = Some(at);
            s
        };
        let old = mk(100.0, 100.0, t0);
        // 1000 more writes in 2 s, 995 of them under 1 ms.
        let new = mk(1100.0, 1095.0, t0 + Duration::from_secs(2));
        let d = Delta {
            old: &old,
            new: &new,
            secs: 2.0,
        };
        assert_eq!(
            d.rate("lamina_nbd_requests_total", &op_labels("v", "write")),
            500.0
        );
        assert_eq!(d.p99("v", "write"), Some(0.001));
        // 20 slow ones: the 99th percentile is past the last bound.
        let new = mk(1100.0, 1080.0, t0 + Duration::from_secs(2));
        let d = Delta {
            old: &old,
            new: &new,
            secs: 2.0,
        };
        assert_eq!(d.p99("v", "write"), Some(f64::INFINITY));
        let view = render(&old, &new);
        assert!(view.contains("v ") && view.contains("500"), "{view}");
    }
}
