//! The host side of zoned devices: what sits between the engine and a zoned
//! device (emulated, or a kernel zoned block device) so that the engine can treat
//! sequential zones as segments.
//!
//! * [`Compact`] hides the gap between a zone's capacity and its size (ZNS): the
//!   engine sees zones of exactly `capacity` bytes, back to back after the
//!   conventional zones, so that a segment is a whole zone.
//! * [`Plug`] keeps writes to one zone in the order the engine issued them, as the
//!   kernel's zone write plugging does: the engine computes every offset (it owns
//!   the write pointers), but its I/O threads may pick two writes of one zone at
//!   once; the later waits until the earlier has completed. A write that could
//!   never become sequential (below the write pointer, or waiting longer than
//!   [`PLUG_TIMEOUT`]) fails with the reason: it would be an engine bug, and it is
//!   never passed to the device.
//!
//! [`host`] wraps a device in a `Compact` when it needs one; the engine puts a
//! `Plug` in front of each device it writes segments to.

use crate::zoned::{Zone, ZoneType};
use crate::{BlockDevice, DeviceError, ZoneLayout};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// How long a write waits for the writes before it in its zone.
pub const PLUG_TIMEOUT: Duration = Duration::from_secs(30);

fn error(device: String, op: &'static str, offset: u64, len: usize, why: String) -> DeviceError {
    DeviceError::Io {
        device,
        op,
        offset,
        len,
        source: std::io::Error::other(why),
    }
}

/// `dev` as the engine should see it: behind a [`Compact`] when its zones have a
/// capacity below their size, unchanged otherwise.
pub fn host(dev: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
    match dev.zone_layout() {
        Some(l) if l.zone_capacity != l.zone_bytes => Arc::new(Compact { inner: dev, l }),
        _ => dev,
    }
}

/// A zoned device whose sequential zones are presented as `capacity` bytes each,
/// with no gap between them.
pub struct Compact {
    inner: Arc<dyn BlockDevice>,
    l: ZoneLayout,
}

impl Compact {
    /// The device offset of compacted offset `off`.
    fn map(&self, off: u64) -> u64 {
        let l = &self.l;
        if off < l.conventional_bytes {
            return off;
        }
        let rel = off - l.conventional_bytes;
        l.zone_start(rel / l.zone_capacity) + rel % l.zone_capacity
    }

    /// Runs `f` on each piece of `[off, off + len)` that lies in one zone.
    fn pieces(
        &self,
        off: u64,
        len: usize,
        mut f: impl FnMut(u64, std::ops::Range<usize>) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        crate::check_range(self, "access", off, len)?;
        let l = &self.l;
        let mut done = 0usize;
        while done < len {
            let o = off + done as u64;
            let room = if o < l.conventional_bytes {
                l.conventional_bytes - o
            } else {
                l.zone_capacity - (o - l.conventional_bytes) % l.zone_capacity
            };
            let n = (room.min((len - done) as u64)) as usize;
            f(self.map(o), done..done + n)?;
            done += n;
        }
        Ok(())
    }
}

impl BlockDevice for Compact {
    fn size_bytes(&self) -> u64 {
        self.l.conventional_bytes + self.l.zones * self.l.zone_capacity
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        let inner = &self.inner;
        self.pieces(offset, buf.len(), |o, r| inner.read_at(&mut buf[r], o))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        let inner = &self.inner;
        self.pieces(offset, buf.len(), |o, r| inner.write_at(&buf[r], o))
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let inner = &self.inner;
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        self.pieces(offset, len, |o, r| inner.discard(o, r.len() as u64))
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.inner.sync()
    }
    fn zone_layout(&self) -> Option<ZoneLayout> {
        Some(ZoneLayout {
            zone_bytes: self.l.zone_capacity,
            ..self.l
        })
    }
    fn report_zones(&self) -> Result<Vec<Zone>, DeviceError> {
        let l = &self.l;
        Ok(self
            .inner
            .report_zones()?
            .into_iter()
            .map(|z| {
                if z.ty == ZoneType::Conventional {
                    return z;
                }
                let i = (z.start - l.conventional_bytes) / l.zone_bytes;
                let start = l.conventional_bytes + i * l.zone_capacity;
                Zone {
                    start,
                    len: l.zone_capacity,
                    capacity: z.capacity,
                    wp: start + z.wp.saturating_sub(z.start).min(l.zone_capacity),
                    ..z
                }
            })
            .collect())
    }
    fn reset_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.inner.reset_zone(self.map(offset))
    }
    fn finish_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.inner.finish_zone(self.map(offset))
    }
}

#[derive(Clone, Copy, Default)]
struct PlugZone {
    /// Where the next write of this zone goes.
    wp: u64,
    /// A write of this zone is at the device.
    busy: bool,
    /// A write failed: later writes of the zone fail too, until a reset.
    broken: bool,
    /// Resets so far.
    resets: u64,
}

/// Keeps each zone's writes in issue order (see the module documentation).
pub struct Plug {
    inner: Arc<dyn BlockDevice>,
    l: ZoneLayout,
    zones: Mutex<Vec<PlugZone>>,
    cv: Condvar,
}

impl Plug {
    /// Plugs `inner`, whose write pointers it reads from the device.
    pub fn new(inner: Arc<dyn BlockDevice>) -> Result<Self, DeviceError> {
        let l = inner.zone_layout().ok_or_else(|| DeviceError::Open {
            device: inner.describe(),
            detail: "not a zoned device".into(),
        })?;
        let mut zones = vec![PlugZone::default(); l.zones as usize];
        for z in inner.report_zones()? {
            if let Some(i) = (z.ty == ZoneType::SequentialRequired)
                .then(|| l.zone_of(z.start))
                .flatten()
            {
                zones[i as usize].wp = z.wp;
            }
        }
        Ok(Plug {
            inner,
            l,
            zones: Mutex::new(zones),
            cv: Condvar::new(),
        })
    }

    /// The sequential zone holding `offset`, for a zone operation `op`.
    fn seq_zone(&self, op: &'static str, offset: u64) -> Result<usize, DeviceError> {
        let z = self.l.zone_of(offset).ok_or_else(|| {
            error(
                self.describe(),
                op,
                offset,
                0,
                "not in a sequential zone".into(),
            )
        })?;
        Ok(z as usize)
    }

    /// Waits until zone `z` is idle and its write pointer is at `offset`.
    fn wait_turn<'a>(
        &'a self,
        mut g: std::sync::MutexGuard<'a, Vec<PlugZone>>,
        z: usize,
        op: &'static str,
        offset: u64,
        len: usize,
    ) -> Result<std::sync::MutexGuard<'a, Vec<PlugZone>>, DeviceError> {
        let deadline = Instant::now() + PLUG_TIMEOUT;
        loop {
            let pz = g[z];
            let why = if pz.broken {
                Some(format!(
                    "an earlier write to zone {z} failed; it takes no more writes until reset"
                ))
            } else if !pz.busy && pz.wp > offset {
                Some(format!(
                    "zone {z}'s write pointer is at {}, past {offset}: the write would not be sequential",
                    pz.wp
                ))
            } else if !pz.busy && pz.wp == offset {
                return Ok(g);
            } else if Instant::now() >= deadline {
                Some(format!(
                    "waited {PLUG_TIMEOUT:?} for zone {z}'s write pointer (at {}) to reach {offset}: writes out of order",
                    pz.wp
                ))
            } else {
                None
            };
            if let Some(why) = why {
                return Err(error(self.inner.describe(), op, offset, len, why));
            }
            g = self
                .cv
                .wait_timeout(g, Duration::from_millis(100))
                .unwrap()
                .0;
        }
    }
}

impl BlockDevice for Plug {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        let Some(z) = self.l.zone_of(offset) else {
            return self.inner.write_at(buf, offset);
        };
        let z = z as usize;
        let g = self.zones.lock().unwrap();
        let mut g = self.wait_turn(g, z, "write", offset, buf.len())?;
        g[z].busy = true;
        drop(g);
        let r = self.inner.write_at(buf, offset);
        let mut g = self.zones.lock().unwrap();
        g[z].busy = false;
        match r {
            Ok(()) => g[z].wp += buf.len() as u64,
            Err(_) => g[z].broken = true,
        }
        drop(g);
        self.cv.notify_all();
        r
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.inner.discard(offset, len)
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.inner.sync()
    }
    fn zone_layout(&self) -> Option<ZoneLayout> {
        Some(self.l)
    }
    fn report_zones(&self) -> Result<Vec<Zone>, DeviceError> {
        self.inner.report_zones()
    }
    fn reset_zone(&self, offset: u64) -> Result<(), DeviceError> {
        let z = self.seq_zone("reset zone", offset)?;
        let mut g = self.zones.lock().unwrap();
        while g[z].busy {
            g = self.cv.wait(g).unwrap();
        }
        self.inner.reset_zone(offset)?;
        g[z] = PlugZone {
            wp: self.l.zone_start(z as u64),
            resets: g[z].resets + 1,
            ..Default::default()
        };
        Ok(())
    }
    fn zone_progress(&self, offset: u64) -> Option<(u64, u64)> {
        let z = self.l.zone_of(offset)? as usize;
        let g = self.zones.lock().unwrap();
        Some((g[z].wp, g[z].resets))
    }
    fn with_zone_held(
        &self,
        offset: u64,
        f: &mut dyn FnMut(Option<(u64, u64)>) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let Some(z) = self.l.zone_of(offset) else {
            return f(None);
        };
        let z = z as usize;
        let mut g = self.zones.lock().unwrap();
        while g[z].busy {
            g = self.cv.wait(g).unwrap();
        }
        g[z].busy = true;
        let progress = (g[z].wp, g[z].resets);
        drop(g);
        let r = f(Some(progress));
        self.zones.lock().unwrap()[z].busy = false;
        self.cv.notify_all();
        r
    }
    /// Finishes the zone once every write below `offset` in it has completed.
    fn finish_zone(&self, offset: u64) -> Result<(), DeviceError> {
        let z = self.seq_zone("finish zone", offset)?;
        let g = self.zones.lock().unwrap();
        let mut g = self.wait_turn(g, z, "finish zone", offset, 0)?;
        self.inner.finish_zone(offset)?;
        g[z].wp = self.l.zone_start(z as u64) + self.l.zone_capacity;
        drop(g);
        self.cv.notify_all();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemDevice;
    use crate::zoned::{ZoneCond, ZonedConfig, ZonedDevice};

    const Z: u64 = 64 << 10;
    const CAP: u64 = Z - 16384;

    fn zns() -> Arc<ZonedDevice> {
        Arc::new(
            ZonedDevice::new(
                Arc::new(MemDevice::new("m", 16 * Z)),
                ZonedConfig {
                    zone_bytes: Z,
                    zone_capacity_bytes: CAP,
                    conventional_zones: 1,
                    max_open: 4,
                    max_active: 4,
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    }

    #[test]
    fn compact_hides_the_capacity_gap() {
        let z = zns();
        let c = host(z.clone());
        let l = c.zone_layout().unwrap();
        assert_eq!((l.zone_bytes, l.zone_capacity, l.zones), (CAP, CAP, 15));
        assert_eq!(c.size_bytes(), Z + 15 * CAP);
        // A write filling compacted zone 0 and its neighbour's start lands in two
        // device zones, each at its write pointer.
        let buf: Vec<u8> = (0..CAP + 8192).map(|i| (i / 4096) as u8).collect();
        c.write_at(&buf, Z).unwrap();
        let zs = z.zones();
        assert_eq!(zs[1].cond, ZoneCond::Full);
        assert_eq!(zs[2].wp, 2 * Z + 8192);
        let mut back = vec![0u8; buf.len()];
        c.read_at(&mut back, Z).unwrap();
        assert_eq!(back, buf);
        let r = c.report_zones().unwrap();
        assert_eq!(r[2].start, Z + CAP);
        assert_eq!(r[2].wp, Z + CAP + 8192);
        c.reset_zone(Z + CAP).unwrap();
        assert_eq!(z.zones()[2].cond, ZoneCond::Empty);
        assert_eq!(z.rejected_writes(), 0);
    }

    #[test]
    fn plug_orders_writes_of_a_zone() {
        let z = zns();
        let p = Arc::new(Plug::new(host(z.clone())).unwrap());
        let base = Z + CAP; // compacted zone 1
                            // Eight threads each write one block of zone 1, started in reverse order:
                            // the plug lets each through only when the one before it has landed.
        let hs: Vec<_> = (0..8u64)
            .rev()
            .map(|i| {
                let p = p.clone();
                std::thread::spawn(move || {
                    std::thread::sleep(Duration::from_millis(10 * (8 - i)));
                    p.write_at(&[i as u8 + 1; 4096], base + i * 4096)
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap().unwrap();
        }
        assert_eq!(z.rejected_writes(), 0);
        let mut b = vec![0u8; 8 * 4096];
        p.read_at(&mut b, base).unwrap();
        for i in 0..8 {
            assert_eq!(b[i * 4096], i as u8 + 1);
        }
        // A write below the write pointer fails at once, without reaching the device.
        let e = p.write_at(&[0; 4096], base).unwrap_err();
        assert!(e.to_string().contains("not be sequential"), "{e}");
        assert_eq!(z.rejected_writes(), 0);
        // Finish waits for the write pointer, then fills the zone.
        p.finish_zone(base + 8 * 4096).unwrap();
        assert_eq!(z.zones()[2].cond, ZoneCond::Full);
        p.reset_zone(base).unwrap();
        p.write_at(&[9; 4096], base).unwrap();
    }
}
