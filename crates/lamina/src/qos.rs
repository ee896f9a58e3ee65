//! Per-volume limits on requests per second and bytes per second
//! (`[engine.volumes.NAME] iops_limit, bandwidth_limit`, `lamina volume qos`).
//!
//! Each limit is a GCRA (generic cell rate algorithm) clock: one atomic word, the
//! time at which the volume's next request would conform. A request reserves its
//! slot with one compare-and-swap and, when it runs ahead of the rate by more than
//! the burst allowance, its connection sleeps until the slot comes. No lock, no
//! allocation per request; a volume without limits costs two relaxed loads. The connection's
//! reader sleeps, not the engine: the client's requests wait in its own queue
//! (and in the socket), other volumes are not held up.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// A volume's limits: requests and payload bytes per second (`None`: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Limits {
    pub iops: Option<u64>,
    pub bytes_per_sec: Option<u64>,
}

impl Limits {
    pub fn is_none(&self) -> bool {
        self.iops.is_none() && self.bytes_per_sec.is_none()
    }
}

/// How far ahead of its rate a volume may run: this long's worth of requests or
/// bytes go out at once (a client's queue of requests after an idle spell).
const BURST: Duration = Duration::from_millis(20);

/// One GCRA clock: units per second (0: unlimited) and the theoretical arrival
/// time of the next unit, in nanoseconds since [`epoch`].
#[derive(Default)]
struct Rate {
    per_sec: AtomicU64,
    tat: AtomicU64,
}

impl Rate {
    /// A new rate; the backlog reserved at the old one is forgotten.
    fn set(&self, per_sec: Option<u64>, now: u64) {
        self.per_sec.store(per_sec.unwrap_or(0), Ordering::Relaxed);
        self.tat.store(now, Ordering::Relaxed);
    }

    /// Reserves `units` at `now` (ns); returns how long to wait before going on.
    fn reserve(&self, units: u64, now: u64) -> u64 {
        let rate = self.per_sec.load(Ordering::Relaxed);
        if rate == 0 {
            return 0;
        }
        // Nanoseconds the units take at the rate, rounded up (exact for any rate:
        // whole nanoseconds per byte would be 6% off at 100 MB/s).
        let cost = (units as u128 * 1_000_000_000).div_ceil(rate as u128);
        let cost = cost.min(u64::MAX as u128 / 4) as u64;
        let burst = BURST.as_nanos() as u64;
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let next = tat.max(now).saturating_add(cost);
            match self
                .tat
                .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                // Conforming while the clock is at most `burst` ahead of now.
                Ok(_) => return next.saturating_sub(now).saturating_sub(burst + cost),
                Err(t) => tat = t,
            }
        }
    }
}

/// The limits of one volume, shared by its connections.
#[derive(Default)]
pub struct Limiter {
    iops: Rate,
    bytes: Rate,
    limits: Mutex<Limits>,
    /// When the limits were last set (ns since [`epoch`]).
    changed: AtomicU64,
}

impl Limiter {
    pub fn set(&self, l: Limits) {
        let now = now_ns();
        self.iops.set(l.iops, now);
        self.bytes.set(l.bytes_per_sec, now);
        self.changed.store(now, Ordering::Relaxed);
        *self.limits.lock().unwrap() = l;
    }

    /// Whether the limits were changed after `t` (a wait computed before then is
    /// void: the connection stops waiting).
    pub fn changed_since(&self, t: Instant) -> bool {
        self.changed.load(Ordering::Relaxed) > t.duration_since(epoch()).as_nanos() as u64
    }

    pub fn limits(&self) -> Limits {
        *self.limits.lock().unwrap()
    }

    /// A request of `bytes` payload arrives: how long it waits to keep the volume
    /// within its limits.
    pub fn pace(&self, bytes: u64) -> Duration {
        let now = now_ns();
        let a = self.iops.reserve(1, now);
        let b = if bytes > 0 {
            self.bytes.reserve(bytes, now)
        } else {
            0
        };
        Duration::from_nanos(a.max(b))
    }
}

/// "2000 requests/s, 50.0 MiB/s" (or "no limit").
pub fn describe(l: Limits) -> String {
    let mut parts = Vec::new();
    if let Some(n) = l.iops {
        parts.push(format!("{n} requests/s"));
    }
    if let Some(b) = l.bytes_per_sec {
        parts.push(format!("{}/s", crate::size::human(b)));
    }
    if parts.is_empty() {
        "no limit".into()
    } else {
        parts.join(", ")
    }
}

fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

fn now_ns() -> u64 {
    epoch().elapsed().as_nanos() as u64
}

/// The limiters of an array's volumes, by name: made when limits are first set
/// (from the configuration at start, or `lamina volume qos` later) and handed to
/// each connection that opens the volume.
#[derive(Default)]
pub struct QosTable(Mutex<HashMap<String, Arc<Limiter>>>);

impl QosTable {
    /// Sets `name`'s limits (live: its open connections follow at once), and
    /// logs them.
    pub fn set(&self, name: &str, l: Limits) {
        self.0
            .lock()
            .unwrap()
            .entry(name.to_string())
            .or_default()
            .set(l);
        if l.is_none() {
            tracing::info!("volume {name:?}: limits lifted");
        } else {
            tracing::info!("volume {name:?} limited to {}", describe(l));
        }
    }

    /// The limiter a new connection to `name` uses: made if the volume has none
    /// yet, so that limits set later apply to the connection too (an unlimited
    /// limiter costs a connection two relaxed loads per request).
    pub fn get(&self, name: &str) -> Arc<Limiter> {
        self.0
            .lock()
            .unwrap()
            .entry(name.to_string())
            .or_default()
            .clone()
    }

    /// `name`'s limits (none if never set).
    pub fn limits(&self, name: &str) -> Limits {
        self.0
            .lock()
            .unwrap()
            .get(name)
            .map_or(Limits::default(), |l| l.limits())
    }

    /// A renamed volume keeps its limiter (its open connections share it).
    pub fn rename(&self, name: &str, new_name: &str) {
        let mut t = self.0.lock().unwrap();
        if let Some(l) = t.remove(name) {
            t.insert(new_name.to_string(), l);
        }
    }

    /// A deleted volume's limits go with it (a new volume of the name starts free).
    pub fn remove(&self, name: &str) {
        if let Some(l) = self.0.lock().unwrap().remove(name) {
            l.set(Limits::default());
        }
    }

    /// Every volume's limits that are set.
    pub fn all(&self) -> Vec<(String, Limits)> {
        let mut v: Vec<_> = self
            .0
            .lock()
            .unwrap()
            .iter()
            .map(|(n, l)| (n.clone(), l.limits()))
            .filter(|(_, l)| !l.is_none())
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// After the burst, requests are spaced at the rate; bytes and requests each
    /// hold; an unlimited rate never waits; a change applies at once.
    #[test]
    fn gcra_spaces_requests_at_the_rate_after_a_burst() {
        let r = Rate::default();
        assert_eq!(r.reserve(1, 0), 0, "unlimited");
        r.set(Some(1000), 0); // 1 ms a request, 20 ms of burst
        let waits: Vec<u64> = (0..30).map(|_| r.reserve(1, 0)).collect();
        assert!(waits[..=20].iter().all(|&w| w == 0), "{waits:?}");
        assert_eq!(waits[21], 1_000_000);
        assert_eq!(waits[29], 9_000_000);
        // Time passes: the clock catches up.
        assert_eq!(r.reserve(1, 200_000_000), 0);
        // A raised limit forgets the backlog of the old one.
        r.set(Some(1000), 200_000_000);
        assert_eq!(r.reserve(1, 200_000_000), 0);
        // Byte rates are exact at any size: 250 MB/s, 10 GB/s.
        for rate in [250_000_000u64, 10_000_000_000] {
            let x = Rate::default();
            x.set(Some(rate), 0);
            x.reserve(rate, 0);
            let w = x.reserve(1, 0) + BURST.as_nanos() as u64;
            assert!((999_000_000..=1_001_000_000).contains(&w), "{rate}: {w}");
        }
        let b = Rate::default();
        b.set(Some(1 << 20), 0); // 1 MiB/s
        assert_eq!(b.reserve(16 << 10, 0), 0, "within the burst");
        assert_eq!(b.reserve(1 << 20, 0), 0, "charged after it goes");
        let w = b.reserve(1, 0);
        assert!(w > 900_000_000 && w < 1_100_000_000, "{w}");
        let l = Limiter::default();
        l.set(Limits {
            iops: Some(100),
            bytes_per_sec: None,
        });
        let total: Duration = (0..12).map(|_| l.pace(4096)).max().unwrap();
        assert!(total >= Duration::from_millis(80), "{total:?}");
        l.set(Limits::default());
        assert_eq!(l.pace(4096), Duration::ZERO);
    }
}
