//! Device probing in the manner of Hystor's SSD sketcher: black-box I/O patterns
//! whose timing reveals the indirection unit, the number of parallel units, how the
//! drive maps writes, and where its garbage collection starts to hurt.
//!
//! The probe talks to a [`Timed`] target: a batch of operations issued together
//! (queue depth = batch size) and the latency of each. The emulated SSD is one
//! ([`Flash::submit`] on its virtual clock), so the probe's verdicts can be checked
//! against known geometry.

use crate::flash::{Flash, FlashOp};

/// Something whose operations can be timed.
pub trait Timed {
    fn capacity(&self) -> u64;
    /// Issues `ops` together; returns each one's latency in microseconds.
    fn run(&mut self, ops: &[FlashOp]) -> Vec<u64>;
    /// Lets `us` microseconds pass without I/O (background work drains).
    fn idle(&mut self, us: u64);
}

/// The emulated SSD on its virtual clock.
pub struct EmulatedTarget<'a> {
    pub flash: &'a Flash,
    pub now: u64,
}

impl Timed for EmulatedTarget<'_> {
    fn capacity(&self) -> u64 {
        use crate::BlockDevice;
        self.flash.size_bytes()
    }
    fn run(&mut self, ops: &[FlashOp]) -> Vec<u64> {
        let at = self.now;
        let done: Vec<u64> = ops.iter().map(|op| self.flash.submit(*op, at)).collect();
        self.now = done.iter().copied().max().unwrap_or(at);
        done.iter().map(|d| d - at).collect()
    }
    fn idle(&mut self, us: u64) {
        self.now += us;
    }
}

/// A real device or file, timed by the wall clock with direct I/O (the page cache
/// bypassed): each batch is issued by one thread per operation, together, and
/// each operation's latency measured. Only the first `capacity` bytes are used.
pub struct DirectTarget {
    file: std::fs::File,
    capacity: u64,
    /// The file could not be opened for direct I/O (tmpfs, some overlays): timing
    /// then shows the page cache, not the device.
    pub buffered: bool,
}

impl DirectTarget {
    pub fn open(path: &std::path::Path, capacity: u64) -> std::io::Result<Self> {
        use std::os::unix::fs::OpenOptionsExt;
        let open = |flags| {
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(flags)
                .open(path)
        };
        let (file, buffered) = match open(libc::O_DIRECT) {
            Ok(f) => (f, false),
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => (open(0)?, true),
            Err(e) => return Err(e),
        };
        // Direct I/O on some file systems is refused only at the first access.
        let mut t = DirectTarget {
            file,
            capacity: capacity / 4096 * 4096,
            buffered,
        };
        if !t.buffered
            && t.io(FlashOp::Read {
                offset: 0,
                len: 4096,
            })
            .is_err()
        {
            t.file = open(0)?;
            t.buffered = true;
        }
        Ok(t)
    }

    fn io(&self, op: FlashOp) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt;
        let len = match op {
            FlashOp::Read { len, .. } | FlashOp::Write { len, .. } => len as usize,
        };
        // Direct I/O wants a buffer aligned to the logical block size.
        let mut raw = vec![0u8; len + 4096];
        let at = raw.as_ptr().align_offset(4096);
        let buf = &mut raw[at..at + len];
        match op {
            FlashOp::Read { offset, .. } => self.file.read_exact_at(buf, offset),
            FlashOp::Write { offset, .. } => {
                buf.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
                self.file.write_all_at(buf, offset)
            }
        }
    }
}

impl Timed for DirectTarget {
    fn capacity(&self) -> u64 {
        self.capacity
    }
    fn run(&mut self, ops: &[FlashOp]) -> Vec<u64> {
        let this = &*self;
        std::thread::scope(|s| {
            let hs: Vec<_> = ops
                .iter()
                .map(|&op| {
                    s.spawn(move || {
                        let t = std::time::Instant::now();
                        // A failed operation counts as very slow; the verdicts
                        // then say so through their evidence.
                        let ok = this.io(op).is_ok();
                        let us = t.elapsed().as_micros() as u64;
                        if ok {
                            us.max(1)
                        } else {
                            u64::MAX / 1024
                        }
                    })
                })
                .collect();
            hs.into_iter()
                .map(|h| h.join().unwrap_or(u64::MAX / 1024))
                .collect()
        })
    }
    fn idle(&mut self, us: u64) {
        std::thread::sleep(std::time::Duration::from_micros(us));
    }
}

/// What the probe concluded, with the measurements behind each verdict.
#[derive(Clone, Debug, Default)]
pub struct ProbeReport {
    pub iu_bytes: u64,
    /// (write size, median microseconds per KiB) of QD1 random writes.
    pub iu_evidence: Vec<(u64, f64)>,
    pub parallel_units: u32,
    /// (queue depth, 4 KiB reads per millisecond).
    pub parallel_evidence: Vec<(u32, f64)>,
    /// Reading back in write order is this much slower (>1) or faster (<1) than in
    /// LBA order after writing in a random order.
    pub write_order_ratio: f64,
    pub mapping: String,
    /// Bytes of sustained random writes before latency jumps (the GC cliff).
    pub gc_cliff_bytes: Option<u64>,
    pub recommended_write_unit: u64,
    pub recommended_segment: u64,
    pub recommended_queue_depth: u32,
}

fn rng(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Runs every pattern against `t`. Writes over the whole target: data is lost.
pub fn probe(t: &mut dyn Timed) -> ProbeReport {
    let cap = t.capacity();
    let mut x = 0x5eed_u64;
    let mut r = ProbeReport::default();
    // Precondition: one sequential pass, so every unit is mapped.
    let mut off = 0;
    while off < cap {
        let len = (1 << 20).min(cap - off);
        t.run(&[FlashOp::Write { offset: off, len }]);
        off += len;
    }
    // 1. Indirection unit (few writes, within the drive's free space, so that its
    // GC does not blur the picture): random aligned writes of growing size at queue depth 1.
    // Below the unit each write costs a read of the old unit, which shows as a
    // higher cost per byte; the unit is the smallest size without that premium.
    let sizes: Vec<u64> = (12..=17).map(|s| 1u64 << s).collect();
    for &s in &sizes {
        // Mean, not median: a write pays a program only when it completes a page.
        let n = 32;
        let total: u64 = (0..n)
            .map(|_| {
                let o = rng(&mut x) % (cap / s) * s;
                t.run(&[FlashOp::Write { offset: o, len: s }])[0]
            })
            .sum();
        r.iu_evidence
            .push((s, total as f64 / (n * s / 1024) as f64));
    }
    let best = r.iu_evidence.iter().map(|e| e.1).fold(f64::MAX, f64::min);
    r.iu_bytes = r
        .iu_evidence
        .iter()
        .find(|e| e.1 <= best * 1.08)
        .map_or(4096, |e| e.0);
    // 2. GC cliff (from the nearly fresh, just-filled state): sustained random
    // writes of whole units; the point where the mean latency of a window jumps to
    // 3x that of the first window.
    let iu = r.iu_bytes;
    let window = 256u64;
    let mut first = None;
    for w in 0..(cap / iu / window).max(1) {
        let total: u64 = (0..window)
            .map(|_| {
                let o = rng(&mut x) % (cap / iu) * iu;
                t.run(&[FlashOp::Write { offset: o, len: iu }])[0]
            })
            .sum();
        let mean = total as f64 / window as f64;
        match first {
            None => first = Some(mean),
            Some(f) if mean > 3.0 * f => {
                r.gc_cliff_bytes = Some((w + 1) * window * iu);
                break;
            }
            _ => {}
        }
    }
    // 3. Parallel units: batches of k random 4 KiB reads issued together. A batch
    // takes as long as its busiest unit, so with D units the speed-up over k = 1 is
    // k / E[most requests on one unit]; the D whose expected speed-ups (balls into
    // bins, computed here) fit the measured ones best is the answer.
    let depths: Vec<u32> = (0..=6).map(|i| 1 << i).collect();
    for &k in &depths {
        let mut per_ms = Vec::new();
        for _ in 0..48 {
            // Idle first, so that no unit is still busy with earlier work.
            t.idle(20_000);
            let ops: Vec<FlashOp> = (0..k)
                .map(|_| FlashOp::Read {
                    offset: rng(&mut x) % (cap / 4096) * 4096,
                    len: 4096,
                })
                .collect();
            let span = t.run(&ops).into_iter().max().unwrap_or(1).max(1);
            per_ms.push(k as f64 * 1000.0 / span as f64);
        }
        r.parallel_evidence
            .push((k, per_ms.iter().sum::<f64>() / per_ms.len() as f64));
    }
    let single = r.parallel_evidence[0].1;
    let expected = |d: u32, k: u32| -> f64 {
        let mut y = 0x9e37_79b9u64;
        let trials = 200;
        let mut sum = 0.0;
        for _ in 0..trials {
            let mut load = vec![0u32; d as usize];
            for _ in 0..k {
                load[(rng(&mut y) % d as u64) as usize] += 1;
            }
            sum += k as f64 / *load.iter().max().unwrap() as f64;
        }
        sum / trials as f64
    };
    r.parallel_units = (1..=64u32)
        .min_by(|&a, &b| {
            let err = |d: u32| {
                r.parallel_evidence
                    .iter()
                    .map(|&(k, tp)| (tp / single / expected(d, k) - 1.0).powi(2))
                    .sum::<f64>()
            };
            err(a).total_cmp(&err(b))
        })
        .unwrap_or(1);
    // 4. Mapping: write a region unit by unit in a random order, then read it back
    // in that order and in LBA order, 32 at a time. A drive that places data by write
    // order shows a difference; one that places by LBA does not.
    let n = (cap / iu / 8).min(8192);
    let mut order: Vec<u64> = (0..n).collect();
    for i in (1..order.len()).rev() {
        let j = (rng(&mut x) % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    for &b in &order {
        t.run(&[FlashOp::Write {
            offset: b * iu,
            len: iu,
        }]);
    }
    let read_all = |t: &mut dyn Timed, seq: &[u64]| -> u64 {
        seq.chunks(32)
            .map(|c| {
                let ops: Vec<FlashOp> = c
                    .iter()
                    .map(|&b| FlashOp::Read {
                        offset: b * iu,
                        len: 4096,
                    })
                    .collect();
                t.run(&ops).into_iter().max().unwrap_or(0)
            })
            .sum()
    };
    let by_write = read_all(t, &order);
    let lba: Vec<u64> = (0..n).collect();
    let by_lba = read_all(t, &lba);
    r.write_order_ratio = by_write as f64 / by_lba.max(1) as f64;
    r.mapping = if (r.write_order_ratio - 1.0).abs() > 0.2 {
        "write-order (page-mapped, log-structured FTL)".into()
    } else {
        "LBA-based".into()
    };
    // Recommendations: a write unit that keeps every parallel unit busy with whole
    // indirection units, segments of many write units, queue depth twice the units.
    r.recommended_write_unit = (r.iu_bytes * r.parallel_units as u64).max(64 << 10);
    r.recommended_segment = (r.recommended_write_unit * 64).max(8 << 20);
    r.recommended_queue_depth = (2 * r.parallel_units).max(4);
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flash::FlashConfig;
    use crate::sparse::SparseDevice;
    use std::sync::Arc;

    /// The probe finds the known geometry of three emulated drives.
    #[test]
    fn probe_finds_the_emulated_geometry() {
        for (iu, channels, dies, cap) in [
            (4096u64, 2u32, 2u32, 256u64 << 20),
            (16384, 4, 2, 256 << 20),
            (65536, 2, 1, 512 << 20),
        ] {
            let cfg = FlashConfig {
                capacity_bytes: cap,
                iu_bytes: iu,
                page_bytes: iu.max(16384),
                pages_per_block: 64,
                channels,
                dies_per_channel: dies,
                ..Default::default()
            };
            let f = Flash::new(Arc::new(SparseDevice::new("p", cap)), cfg).unwrap();
            let r = probe(&mut EmulatedTarget { flash: &f, now: 0 });
            let units = channels * dies;
            assert_eq!(r.iu_bytes, iu, "IU: {r:?}");
            assert!(
                r.parallel_units.abs_diff(units) <= units / 4,
                "parallel units {} for {units}: {r:?}",
                r.parallel_units
            );
            assert!(r.mapping.starts_with("write-order"), "{r:?}");
            assert!(r.gc_cliff_bytes.is_some(), "{r:?}");
        }
    }

    /// A drive that places data by logical address: the mapping verdict says so.
    #[test]
    fn probe_tells_lba_placement_from_write_order() {
        let cap = 256u64 << 20;
        let cfg = FlashConfig {
            capacity_bytes: cap,
            pages_per_block: 64,
            lba_placement: true,
            ..Default::default()
        };
        let f = Flash::new(Arc::new(SparseDevice::new("p", cap)), cfg).unwrap();
        let r = probe(&mut EmulatedTarget { flash: &f, now: 0 });
        assert_eq!(r.mapping, "LBA-based", "{r:?}");
        assert_eq!(r.iu_bytes, 4096, "{r:?}");
    }
}
