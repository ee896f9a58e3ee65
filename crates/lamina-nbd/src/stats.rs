//! Request counters and latency histograms, per connection, summed per export when
//! asked ([`snapshot`]).
//!
//! Each connection owns one [`ConnStats`]: relaxed atomic adds by whichever thread
//! completes a request of that connection (its reader, a read thread, the engine),
//! so no two connections share a cache line and nothing is locked per request. The
//! registry's lock is taken when a connection starts or ends and when a scrape sums
//! them; an ended connection's counts are folded into its export's retired totals,
//! so counters never go down.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The kinds of request counted, in the order of [`OP_NAMES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Read = 0,
    Write = 1,
    Flush = 2,
    Trim = 3,
    WriteZeroes = 4,
    Cache = 5,
    BlockStatus = 6,
}

/// How many kinds of request are counted.
pub const OPS: usize = 7;

impl Op {
    /// Every kind, by its number.
    pub const ALL: [Op; OPS] = [
        Op::Read,
        Op::Write,
        Op::Flush,
        Op::Trim,
        Op::WriteZeroes,
        Op::Cache,
        Op::BlockStatus,
    ];
}
/// The `op` label of each [`Op`].
pub const OP_NAMES: [&str; OPS] = [
    "read",
    "write",
    "flush",
    "trim",
    "write_zeroes",
    "cache",
    "block_status",
];

/// Latency buckets: bucket `i` counts requests that took at most 2^i microseconds
/// (1 µs to 2^23 µs, 8.4 s); the last one, everything slower.
pub const BUCKETS: usize = 25;

/// The upper bound of bucket `i` in seconds (`None`: +Inf).
pub fn bucket_bound(i: usize) -> Option<f64> {
    (i + 1 < BUCKETS).then(|| (1u64 << i) as f64 * 1e-6)
}

fn bucket_of(micros: u64) -> usize {
    // The smallest i with micros <= 2^i.
    let i = if micros <= 1 {
        0
    } else {
        64 - (micros - 1).leading_zeros() as usize
    };
    i.min(BUCKETS - 1)
}

#[derive(Default)]
struct OpCounters {
    count: AtomicU64,
    errors: AtomicU64,
    bytes: AtomicU64,
    nanos: AtomicU64,
    buckets: [AtomicU64; BUCKETS],
}

/// One connection's counters.
pub struct ConnStats {
    export: String,
    ops: [OpCounters; OPS],
}

impl ConnStats {
    /// Counts a request of `op` over `bytes` that started at `since` and ended now;
    /// the bytes of a request that failed are not counted.
    pub fn record(&self, op: Op, bytes: u64, error: bool, since: Instant) {
        let nanos = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        let c = &self.ops[op as usize];
        c.count.fetch_add(1, Ordering::Relaxed);
        if error {
            c.errors.fetch_add(1, Ordering::Relaxed);
        } else {
            c.bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        c.nanos.fetch_add(nanos, Ordering::Relaxed);
        // Rounded up: a bucket holds nothing slower than its bound.
        c.buckets[bucket_of(nanos.div_ceil(1000))].fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts of one kind of request, summed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OpTotals {
    pub count: u64,
    pub errors: u64,
    pub bytes: u64,
    /// Time spent, from the request read to its reply queued.
    pub seconds: f64,
    /// Requests per latency bucket (not cumulative; see [`bucket_bound`]).
    pub buckets: [u64; BUCKETS],
}

/// One export's counts, per kind of request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExportTotals {
    pub ops: [OpTotals; OPS],
}

impl ExportTotals {
    fn add(&mut self, s: &ConnStats) {
        for (t, c) in self.ops.iter_mut().zip(&s.ops) {
            t.count += c.count.load(Ordering::Relaxed);
            t.errors += c.errors.load(Ordering::Relaxed);
            t.bytes += c.bytes.load(Ordering::Relaxed);
            t.seconds += c.nanos.load(Ordering::Relaxed) as f64 * 1e-9;
            for (b, a) in t.buckets.iter_mut().zip(&c.buckets) {
                *b += a.load(Ordering::Relaxed);
            }
        }
    }
}

/// What [`snapshot`] returns.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Connections in the transmission phase now.
    pub connections: usize,
    /// Per export name, in name order.
    pub exports: Vec<(String, ExportTotals)>,
}

#[derive(Default)]
struct Registry {
    live: Vec<Arc<ConnStats>>,
    retired: HashMap<String, ExportTotals>,
}

static REGISTRY: Mutex<Option<Registry>> = Mutex::new(None);

/// A connection's counters, registered while this lives: dropping it (however the
/// connection ends) moves its counts to its export's retired totals.
pub struct Registration(Arc<ConnStats>);

impl Registration {
    pub fn stats(&self) -> &Arc<ConnStats> {
        &self.0
    }
}

impl Drop for Registration {
    fn drop(&mut self) {
        retire(&self.0);
    }
}

/// Counters for a connection that starts serving `export`.
pub fn register(export: &str) -> Registration {
    let s = Arc::new(ConnStats {
        export: export.to_string(),
        ops: Default::default(),
    });
    let mut r = REGISTRY.lock().unwrap();
    r.get_or_insert_with(Registry::default).live.push(s.clone());
    Registration(s)
}

/// The connection is done: its counts move to its export's retired totals.
fn retire(s: &Arc<ConnStats>) {
    let mut r = REGISTRY.lock().unwrap();
    let r = r.get_or_insert_with(Registry::default);
    if let Some(i) = r.live.iter().position(|l| Arc::ptr_eq(l, s)) {
        r.live.swap_remove(i);
        r.retired.entry(s.export.clone()).or_default().add(s);
    }
}

/// Every export's totals so far, live connections and ended ones together.
pub fn snapshot() -> Snapshot {
    let r = REGISTRY.lock().unwrap();
    let Some(r) = r.as_ref() else {
        return Snapshot::default();
    };
    let mut by: HashMap<String, ExportTotals> = r.retired.clone();
    for s in &r.live {
        by.entry(s.export.clone()).or_default().add(s);
    }
    let mut exports: Vec<_> = by.into_iter().collect();
    exports.sort_by(|a, b| a.0.cmp(&b.0));
    Snapshot {
        connections: r.live.len(),
        exports,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_hold_what_their_bounds_say() {
        assert_eq!(bucket_of(0), 0);
        assert_eq!(bucket_of(1), 0);
        assert_eq!(bucket_of(2), 1);
        assert_eq!(bucket_of(3), 2);
        assert_eq!(bucket_of(1024), 10);
        assert_eq!(bucket_of(1025), 11);
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
        for us in [0u64, 1, 2, 3, 7, 100, 4096, 5000, 1 << 23] {
            let i = bucket_of(us);
            let hi = bucket_bound(i).unwrap();
            assert!(us as f64 * 1e-6 <= hi + 1e-12, "{us} over bucket {i}");
            if i > 0 {
                assert!(us as f64 * 1e-6 > bucket_bound(i - 1).unwrap(), "{us}");
            }
        }
        assert_eq!(bucket_bound(BUCKETS - 1), None);
    }

    /// Counts survive the connection that made them; live and ended connections of
    /// an export add up.
    #[test]
    fn totals_outlive_their_connections() {
        let export = format!("stats-test-{}", std::process::id());
        let t0 = Instant::now();
        let a = register(&export);
        let b = register(&export);
        a.stats().record(Op::Write, 4096, false, t0);
        a.stats().record(Op::Write, 8192, true, t0);
        b.stats().record(Op::Read, 512, false, t0);
        let before = snapshot();
        assert!(before.connections >= 2);
        drop(a);
        let after = snapshot();
        let get = |s: &Snapshot| s.exports.iter().find(|e| e.0 == export).unwrap().1.clone();
        assert_eq!(get(&before), get(&after));
        let t = get(&after);
        let w = &t.ops[Op::Write as usize];
        assert_eq!(
            (w.count, w.errors, w.bytes),
            (2, 1, 4096),
            "failed bytes not counted"
        );
        assert_eq!(w.buckets.iter().sum::<u64>(), 2);
        assert_eq!(t.ops[Op::Read as usize].bytes, 512);
        drop(b);
    }
}
