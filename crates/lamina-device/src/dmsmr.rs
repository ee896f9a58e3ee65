//! An emulated drive-managed SMR disk: the peer of Lamina on a host-managed one.
//!
//! The drive takes writes anywhere, as a conventional disk, and hides its shingled
//! zones behind its own translation, as drive-managed SMR disks do:
//!
//! * a write that continues a zone's sequential frontier (nothing of the zone is
//!   in the cache) goes straight to the zone;
//! * any other write is appended to a **media cache**, a region of conventional
//!   tracks at the outer edge (`cache_bytes`, about 1% of the disk);
//! * when the cache is full, the drive **cleans** the zone with the most cached
//!   bytes: it reads the zone and its cached pieces and rewrites the whole zone
//!   (the band read-modify-write that makes such disks slow on random writes),
//!   before it takes the write.
//!
//! Data is kept at its logical address in `inner` (reads return what was written);
//! the cache and cleaning only shape the timing, which uses the same head model
//! as the host-managed emulator ([`SmrTiming`]): the cache region sits before the
//! zones on the platter. Cleaning picks the fullest zone (greedy), which is kinder
//! to the drive than the FIFO order real caches use.

use crate::zoned::SmrTiming;
use crate::{check_range, BlockDevice, DeviceError};
use std::sync::{Arc, Mutex};

#[derive(Clone, Debug)]
pub struct DmSmrConfig {
    pub zone_bytes: u64,
    pub cache_bytes: u64,
    pub seek_us: u64,
    pub rpm: u64,
    pub outer_mb_s: u64,
    /// Clean the zone of the oldest cached write (as drives do) rather than the
    /// zone with the most cached bytes.
    pub fifo: bool,
}

impl Default for DmSmrConfig {
    fn default() -> Self {
        DmSmrConfig {
            zone_bytes: 256 << 20,
            cache_bytes: 0,
            seek_us: 8000,
            rpm: 7200,
            outer_mb_s: 250,
            fifo: false,
        }
    }
}

/// What the drive did (cumulative).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DmSmrStats {
    /// Virtual time the drive was busy (microseconds).
    pub clock_us: u64,
    pub host_bytes_written: u64,
    /// Bytes written to the media cache.
    pub cache_bytes_written: u64,
    /// Zones rewritten by cleaning, and the bytes that moved.
    pub cleanings: u64,
    pub cleaning_bytes: u64,
}

struct State {
    head: u64,
    /// Per zone: end of the sequentially written part, furthest byte written,
    /// bytes in the cache.
    frontier: Vec<u64>,
    extent: Vec<u64>,
    cached: Vec<u64>,
    cache_used: u64,
    cache_head: u64,
    /// Cached writes in arrival order: zone and the zone's cleaning count then.
    order: std::collections::VecDeque<(usize, u64)>,
    cleaned: Vec<u64>,
    stats: DmSmrStats,
}

pub struct DriveManagedSmr {
    inner: Arc<dyn BlockDevice>,
    cfg: DmSmrConfig,
    timing: SmrTiming,
    st: Mutex<State>,
}

impl DriveManagedSmr {
    pub fn new(inner: Arc<dyn BlockDevice>, cfg: DmSmrConfig) -> Result<Self, DeviceError> {
        let bad = |detail: String| DeviceError::Open {
            device: format!("dm-smr({})", inner.describe()),
            detail,
        };
        let size = inner.size_bytes();
        if cfg.zone_bytes == 0 || !cfg.zone_bytes.is_multiple_of(4096) || size < cfg.zone_bytes {
            return Err(bad(format!(
                "zone size {} must be a multiple of 4 KiB no larger than the disk",
                cfg.zone_bytes
            )));
        }
        if cfg.cache_bytes < 1 << 20 || cfg.cache_bytes >= size {
            return Err(bad(format!(
                "media cache of {} bytes must be at least 1 MiB and below the disk's size",
                cfg.cache_bytes
            )));
        }
        let zones = (size / cfg.zone_bytes) as usize;
        Ok(DriveManagedSmr {
            timing: SmrTiming {
                seek_us: cfg.seek_us,
                rpm: cfg.rpm,
                outer_mb_s: cfg.outer_mb_s,
                size: cfg.cache_bytes + zones as u64 * cfg.zone_bytes,
            },
            inner,
            cfg,
            st: Mutex::new(State {
                head: 0,
                frontier: vec![0; zones],
                extent: vec![0; zones],
                cached: vec![0; zones],
                cache_used: 0,
                cache_head: 0,
                order: Default::default(),
                cleaned: vec![0; zones],
                stats: DmSmrStats::default(),
            }),
        })
    }

    pub fn stats(&self) -> DmSmrStats {
        self.st.lock().unwrap().stats
    }

    /// Where logical byte `offset` lies on the platter (after the cache).
    fn platter(&self, offset: u64) -> u64 {
        self.cfg.cache_bytes + offset
    }

    /// Rewrites a zone with cached bytes: the fullest, or the oldest cached
    /// write's (`fifo`).
    fn clean(&self, st: &mut State) {
        let pick = if self.cfg.fifo {
            std::iter::from_fn(|| st.order.pop_front())
                .find(|&(z, epoch)| st.cleaned[z] == epoch && st.cached[z] > 0)
                .map(|(z, _)| z)
        } else {
            (0..st.cached.len()).max_by_key(|&z| st.cached[z])
        };
        let Some(z) = pick else {
            return;
        };
        let zb = self.cfg.zone_bytes;
        let start = self.platter(z as u64 * zb);
        let written = st.extent[z];
        let cached = st.cached[z];
        let mut t = self.timing.cost(&mut st.head, start, written);
        // The cached pieces, scattered over the cache log: one seek for the lot.
        let at = st.cache_head;
        t += self.timing.cost(&mut st.head, at, cached);
        t += self.timing.cost(&mut st.head, start, written);
        st.stats.clock_us += t;
        st.stats.cleanings += 1;
        st.stats.cleaning_bytes += 2 * written + cached;
        st.cache_used -= cached;
        st.cached[z] = 0;
        st.cleaned[z] += 1;
        st.frontier[z] = written;
    }
}

impl BlockDevice for DriveManagedSmr {
    fn size_bytes(&self) -> u64 {
        self.st.lock().unwrap().frontier.len() as u64 * self.cfg.zone_bytes
    }
    fn describe(&self) -> String {
        format!("dm-smr({})", self.inner.describe())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        {
            let mut st = self.st.lock().unwrap();
            let t = self
                .timing
                .cost(&mut st.head, self.platter(offset), buf.len() as u64);
            st.stats.clock_us += t;
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        self.inner.write_at(buf, offset)?;
        let zb = self.cfg.zone_bytes;
        let mut st = self.st.lock().unwrap();
        st.stats.host_bytes_written += buf.len() as u64;
        let mut done = 0u64;
        let len = buf.len() as u64;
        while done < len {
            let off = offset + done;
            let z = (off / zb) as usize;
            let rel = off % zb;
            let n = (zb - rel).min(len - done);
            if rel == st.frontier[z] && st.cached[z] == 0 {
                let t = self.timing.cost(&mut st.head, self.platter(off), n);
                st.stats.clock_us += t;
                st.frontier[z] += n;
            } else {
                while st.cache_used + n > self.cfg.cache_bytes {
                    self.clean(&mut st);
                }
                if st.cache_head + n > self.cfg.cache_bytes {
                    st.cache_head = 0;
                }
                let at = st.cache_head;
                let t = self.timing.cost(&mut st.head, at, n);
                st.stats.clock_us += t;
                st.cache_head += n;
                st.cache_used += n;
                st.cached[z] += n;
                st.stats.cache_bytes_written += n;
                if self.cfg.fifo {
                    let epoch = st.cleaned[z];
                    st.order.push_back((z, epoch));
                }
            }
            st.extent[z] = st.extent[z].max(rel + n);
            done += n;
        }
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.inner.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sparse::SparseDevice;

    fn disk() -> DriveManagedSmr {
        DriveManagedSmr::new(
            Arc::new(SparseDevice::new("d", 64 << 20)),
            DmSmrConfig {
                zone_bytes: 4 << 20,
                cache_bytes: 1 << 20,
                ..Default::default()
            },
        )
        .unwrap()
    }

    #[test]
    fn sequential_writes_go_straight_random_ones_pay_cleaning() {
        let d = disk();
        let b = vec![3u8; 64 << 10];
        for i in 0..64u64 {
            d.write_at(&b, i * (64 << 10)).unwrap();
        }
        let s = d.stats();
        assert_eq!((s.cache_bytes_written, s.cleanings), (0, 0));
        let seq_us = s.clock_us;
        // The same amount at random places (rewrites of the written zone): cached,
        // and once the cache fills, zones are rewritten whole.
        let mut x = 7u64;
        for _ in 0..64 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            d.write_at(&b, (x >> 33) % 64 * (64 << 10)).unwrap();
        }
        let r = d.stats();
        assert!(r.cleanings > 0 && r.cache_bytes_written == 64 * (64 << 10));
        assert!(
            r.clock_us - seq_us > 5 * seq_us,
            "random {} us vs sequential {seq_us} us",
            r.clock_us - seq_us
        );
        let mut back = vec![0u8; 64 << 10];
        d.read_at(&mut back, 0).unwrap();
        assert_eq!(back, b, "data is where it was written");
    }

    #[test]
    fn bad_configs_are_refused() {
        let inner: Arc<dyn BlockDevice> = Arc::new(SparseDevice::new("d", 64 << 20));
        for (c, want) in [
            (
                DmSmrConfig {
                    zone_bytes: 5000,
                    cache_bytes: 1 << 20,
                    ..Default::default()
                },
                "zone size",
            ),
            (
                DmSmrConfig {
                    zone_bytes: 4 << 20,
                    cache_bytes: 0,
                    ..Default::default()
                },
                "media cache",
            ),
        ] {
            let e = DriveManagedSmr::new(inner.clone(), c).err().unwrap();
            assert!(e.to_string().contains(want), "{e}");
        }
    }
}
