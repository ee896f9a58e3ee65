//! An emulated zoned device: host-managed SMR or ZNS.
//!
//! The device is divided into zones of `zone_bytes`. Conventional zones (SMR keeps
//! about 1% of them at the start) accept writes anywhere. Sequential-write-required
//! zones accept a write only at their write pointer, below their capacity, and in a
//! writable condition; the zone state machine follows the ZBC/ZNS rules:
//!
//! ```text
//!   EMPTY --write/open--> IMPLICIT/EXPLICIT OPEN --close--> CLOSED --write--> OPEN
//!     ^                        |  (write pointer reaches capacity, or finish)
//!     +------- reset ------- FULL <---------------------------------------+
//! ```
//!
//! Open zones are limited by `max_open`, open and closed ones together by
//! `max_active` (0 = no limit). Writes that break a rule fail with the error the
//! kernel reports for them (EIO for an unaligned write, ETOOMANYREFS-like limits as
//! EBUSY, ENOSPC past the capacity), and never change the device. Zones can be made
//! read-only or offline to test how the host copes. Reads above the write pointer
//! return zeros.
//!
//! Timing (SMR): a request that does not continue where the previous one ended pays
//! a seek and half a rotation; transfer runs at a bandwidth that falls linearly from
//! the outer zones (`outer_mb_s`) to the inner ones (half of it).

use crate::{check_range, BlockDevice, DeviceError};
use std::sync::{Arc, Mutex};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZoneType {
    Conventional,
    SequentialRequired,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ZoneCond {
    /// Conventional zones have no condition.
    NotWritePointer,
    Empty,
    ImplicitOpen,
    ExplicitOpen,
    Closed,
    Full,
    ReadOnly,
    Offline,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Zone {
    pub start: u64,
    pub len: u64,
    pub capacity: u64,
    /// Absolute byte offset of the write pointer.
    pub wp: u64,
    pub cond: ZoneCond,
    pub ty: ZoneType,
}

#[derive(Clone, Debug)]
pub struct ZonedConfig {
    pub zone_bytes: u64,
    /// Writable bytes per zone (ZNS: may be below the zone size).
    pub zone_capacity_bytes: u64,
    pub conventional_zones: u32,
    pub max_open: u32,
    pub max_active: u32,
    /// SMR timing: average seek and rotation, outer-track bandwidth.
    pub seek_us: u64,
    pub rpm: u64,
    pub outer_mb_s: u64,
}

impl Default for ZonedConfig {
    fn default() -> Self {
        ZonedConfig {
            zone_bytes: 256 << 20,
            zone_capacity_bytes: 256 << 20,
            conventional_zones: 0,
            max_open: 0,
            max_active: 0,
            seek_us: 8000,
            rpm: 7200,
            outer_mb_s: 250,
        }
    }
}

impl ZonedConfig {
    pub fn validate(&self, size: u64) -> Result<(), String> {
        if self.zone_bytes == 0 || !self.zone_bytes.is_multiple_of(4096) {
            return Err(format!(
                "zone size {} must be a positive multiple of 4 KiB",
                self.zone_bytes
            ));
        }
        if self.zone_capacity_bytes == 0
            || self.zone_capacity_bytes > self.zone_bytes
            || !self.zone_capacity_bytes.is_multiple_of(4096)
        {
            return Err(format!(
                "zone capacity {} must be a multiple of 4 KiB between 4 KiB and the zone size {}",
                self.zone_capacity_bytes, self.zone_bytes
            ));
        }
        if size < self.zone_bytes {
            return Err(format!("{size} bytes hold no zone of {}", self.zone_bytes));
        }
        if self.conventional_zones as u64 >= size / self.zone_bytes {
            return Err("every zone would be conventional".into());
        }
        if self.max_active != 0 && self.max_open > self.max_active {
            return Err(format!(
                "max open zones {} above max active zones {}",
                self.max_open, self.max_active
            ));
        }
        Ok(())
    }
}

/// Why a zone operation failed (the errno the kernel would give).
fn err(device: &str, op: &'static str, offset: u64, errno: i32, why: String) -> DeviceError {
    DeviceError::Io {
        device: device.to_string(),
        op,
        offset,
        len: 0,
        source: std::io::Error::new(std::io::Error::from_raw_os_error(errno).kind(), why),
    }
}

struct State {
    zones: Vec<Zone>,
    clock: u64,
    head: u64,
}

pub struct ZonedDevice {
    inner: Arc<dyn BlockDevice>,
    cfg: ZonedConfig,
    st: Mutex<State>,
    name: String,
}

impl ZonedDevice {
    pub fn new(inner: Arc<dyn BlockDevice>, cfg: ZonedConfig) -> Result<Self, DeviceError> {
        let name = format!("zoned({})", inner.describe());
        let size = inner.size_bytes();
        cfg.validate(size).map_err(|detail| DeviceError::Open {
            device: name.clone(),
            detail,
        })?;
        let n = size / cfg.zone_bytes;
        let zones = (0..n)
            .map(|i| {
                let conv = i < cfg.conventional_zones as u64;
                Zone {
                    start: i * cfg.zone_bytes,
                    len: cfg.zone_bytes,
                    capacity: if conv {
                        cfg.zone_bytes
                    } else {
                        cfg.zone_capacity_bytes
                    },
                    wp: i * cfg.zone_bytes,
                    cond: if conv {
                        ZoneCond::NotWritePointer
                    } else {
                        ZoneCond::Empty
                    },
                    ty: if conv {
                        ZoneType::Conventional
                    } else {
                        ZoneType::SequentialRequired
                    },
                }
            })
            .collect();
        Ok(ZonedDevice {
            inner,
            cfg,
            st: Mutex::new(State {
                zones,
                clock: 0,
                head: 0,
            }),
            name,
        })
    }

    pub fn report_zones(&self) -> Vec<Zone> {
        self.st.lock().unwrap().zones.clone()
    }

    pub fn zone_bytes(&self) -> u64 {
        self.cfg.zone_bytes
    }

    /// Virtual time (microseconds) the device has been busy so far.
    pub fn clock_us(&self) -> u64 {
        self.st.lock().unwrap().clock
    }

    fn counts(zones: &[Zone]) -> (u32, u32) {
        let open = zones
            .iter()
            .filter(|z| matches!(z.cond, ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen))
            .count() as u32;
        let closed = zones.iter().filter(|z| z.cond == ZoneCond::Closed).count() as u32;
        (open, open + closed)
    }

    /// Whether zone `i` may become open (from its current condition).
    fn may_open(&self, zones: &[Zone], i: usize, op: &'static str) -> Result<(), DeviceError> {
        let (open, active) = Self::counts(zones);
        let z = &zones[i];
        let becomes_active = z.cond == ZoneCond::Empty;
        if self.cfg.max_active != 0 && becomes_active && active >= self.cfg.max_active {
            return Err(err(
                &self.name,
                op,
                z.start,
                libc::EBUSY,
                format!(
                    "zone {i}: {active} zones active, the device allows {}",
                    self.cfg.max_active
                ),
            ));
        }
        if self.cfg.max_open != 0 && open >= self.cfg.max_open {
            return Err(err(
                &self.name,
                op,
                z.start,
                libc::EBUSY,
                format!(
                    "zone {i}: {open} zones open, the device allows {}",
                    self.cfg.max_open
                ),
            ));
        }
        Ok(())
    }

    fn zone_index(&self, offset: u64) -> usize {
        (offset / self.cfg.zone_bytes) as usize
    }

    fn check_zone(&self, st: &State, i: usize, op: &'static str) -> Result<(), DeviceError> {
        if i >= st.zones.len() {
            return Err(err(&self.name, op, 0, libc::EINVAL, format!("no zone {i}")));
        }
        if st.zones[i].ty == ZoneType::Conventional {
            return Err(err(
                &self.name,
                op,
                st.zones[i].start,
                libc::EINVAL,
                format!("zone {i} is conventional"),
            ));
        }
        match st.zones[i].cond {
            ZoneCond::Offline | ZoneCond::ReadOnly => Err(err(
                &self.name,
                op,
                st.zones[i].start,
                libc::EIO,
                format!("zone {i} is {:?}", st.zones[i].cond),
            )),
            _ => Ok(()),
        }
    }

    /// Resets zone `i`: empty, write pointer at its start.
    pub fn reset_zone(&self, i: usize) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        self.check_zone(&st, i, "reset")?;
        let z = &mut st.zones[i];
        z.wp = z.start;
        z.cond = ZoneCond::Empty;
        Ok(())
    }

    /// Finishes zone `i`: full, whatever was written.
    pub fn finish_zone(&self, i: usize) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        self.check_zone(&st, i, "finish")?;
        if st.zones[i].cond == ZoneCond::Empty {
            // Finishing an empty zone makes it active for a moment.
            self.may_open(&st.zones, i, "finish")?;
        }
        let z = &mut st.zones[i];
        z.wp = z.start + z.capacity;
        z.cond = ZoneCond::Full;
        Ok(())
    }

    /// Opens zone `i` explicitly.
    pub fn open_zone(&self, i: usize) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        self.check_zone(&st, i, "open")?;
        match st.zones[i].cond {
            ZoneCond::ExplicitOpen => return Ok(()),
            ZoneCond::Full => {
                return Err(err(
                    &self.name,
                    "open",
                    st.zones[i].start,
                    libc::EIO,
                    format!("zone {i} is full"),
                ))
            }
            ZoneCond::ImplicitOpen => {}
            _ => self.may_open(&st.zones, i, "open")?,
        }
        st.zones[i].cond = ZoneCond::ExplicitOpen;
        Ok(())
    }

    /// Closes zone `i` (it stays active if written, else returns to empty).
    pub fn close_zone(&self, i: usize) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        self.check_zone(&st, i, "close")?;
        let z = &mut st.zones[i];
        if matches!(z.cond, ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen) {
            z.cond = if z.wp == z.start {
                ZoneCond::Empty
            } else {
                ZoneCond::Closed
            };
        }
        Ok(())
    }

    /// Puts zone `i` in a failed condition (tests of how the host copes).
    pub fn set_condition(&self, i: usize, cond: ZoneCond) {
        self.st.lock().unwrap().zones[i].cond = cond;
    }

    /// ZNS zone append: writes `buf` at zone `i`'s write pointer; returns where.
    pub fn zone_append(&self, i: usize, buf: &[u8]) -> Result<u64, DeviceError> {
        let wp = {
            let st = self.st.lock().unwrap();
            self.check_zone(&st, i, "append")?;
            st.zones[i].wp
        };
        self.write_at(buf, wp)?;
        Ok(wp)
    }

    fn time(&self, st: &mut State, offset: u64, len: u64) {
        let zones = st.zones.len().max(1) as u64;
        let zi = offset / self.cfg.zone_bytes;
        // Outer zones (low offsets) twice as fast as the inner ones.
        let bw = self.cfg.outer_mb_s as f64 * (1.0 - 0.5 * zi as f64 / zones as f64);
        let mut t = (len as f64 / bw) as u64; // bytes / (MB/s) = microseconds
        if offset != st.head {
            t += self.cfg.seek_us + 30_000_000 / self.cfg.rpm.max(1);
        }
        st.head = offset + len;
        st.clock += t;
    }
}

impl BlockDevice for ZonedDevice {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes() / self.cfg.zone_bytes * self.cfg.zone_bytes
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        let mut st = self.st.lock().unwrap();
        let i = self.zone_index(offset);
        if st.zones[i].cond == ZoneCond::Offline {
            return Err(err(
                &self.name,
                "read",
                offset,
                libc::EIO,
                format!("zone {i} is offline"),
            ));
        }
        self.time(&mut st, offset, buf.len() as u64);
        drop(st);
        self.inner.read_at(buf, offset)?;
        // Above the write pointer a sequential zone reads as zeros.
        let st = self.st.lock().unwrap();
        let mut pos = offset;
        for chunk in buf.chunks_mut(4096) {
            let z = &st.zones[self.zone_index(pos)];
            if z.ty == ZoneType::SequentialRequired && pos >= z.wp {
                chunk.fill(0);
            }
            pos += chunk.len() as u64;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        let len = buf.len() as u64;
        let mut st = self.st.lock().unwrap();
        let i = self.zone_index(offset);
        let z = st.zones[i];
        if offset + len > z.start + z.len {
            return Err(err(
                &self.name,
                "write",
                offset,
                libc::EIO,
                format!("write of {len} bytes at {offset} crosses the end of zone {i}"),
            ));
        }
        if z.ty == ZoneType::SequentialRequired {
            match z.cond {
                ZoneCond::Full => {
                    return Err(err(
                        &self.name,
                        "write",
                        offset,
                        libc::EIO,
                        format!("zone {i} is full"),
                    ))
                }
                ZoneCond::ReadOnly | ZoneCond::Offline => {
                    return Err(err(
                        &self.name,
                        "write",
                        offset,
                        libc::EIO,
                        format!("zone {i} is {:?}", z.cond),
                    ))
                }
                _ => {}
            }
            if offset != z.wp {
                return Err(err(
                    &self.name,
                    "write",
                    offset,
                    libc::EIO,
                    format!(
                        "unaligned write: zone {i} write pointer is at {}, not {offset}",
                        z.wp
                    ),
                ));
            }
            if offset + len > z.start + z.capacity {
                return Err(err(
                    &self.name,
                    "write",
                    offset,
                    libc::ENOSPC,
                    format!(
                        "write of {len} bytes passes zone {i}'s capacity of {}",
                        z.capacity
                    ),
                ));
            }
            if matches!(z.cond, ZoneCond::Empty | ZoneCond::Closed) {
                self.may_open(&st.zones, i, "write")?;
            }
        }
        self.inner.write_at(buf, offset)?;
        self.time(&mut st, offset, len);
        let z = &mut st.zones[i];
        if z.ty == ZoneType::SequentialRequired {
            z.wp += len;
            z.cond = if z.wp == z.start + z.capacity {
                ZoneCond::Full
            } else if z.cond == ZoneCond::ExplicitOpen {
                ZoneCond::ExplicitOpen
            } else {
                ZoneCond::ImplicitOpen
            };
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
    use crate::mem::MemDevice;
    use proptest::prelude::*;

    const Z: u64 = 64 << 10;

    fn dev(cfg: ZonedConfig) -> ZonedDevice {
        ZonedDevice::new(Arc::new(MemDevice::new("m", 16 * Z)), cfg).unwrap()
    }

    fn cfg() -> ZonedConfig {
        ZonedConfig {
            zone_bytes: Z,
            zone_capacity_bytes: Z - 16384,
            conventional_zones: 1,
            max_open: 3,
            max_active: 4,
            ..Default::default()
        }
    }

    #[test]
    fn inconsistent_configs_are_refused() {
        let size = 16 * Z;
        let bad = [
            (
                ZonedConfig {
                    zone_capacity_bytes: 2 * Z,
                    ..cfg()
                },
                "capacity",
            ),
            (
                ZonedConfig {
                    zone_bytes: 5000,
                    ..cfg()
                },
                "multiple of 4 KiB",
            ),
            (
                ZonedConfig {
                    conventional_zones: 16,
                    ..cfg()
                },
                "conventional",
            ),
            (
                ZonedConfig {
                    max_open: 5,
                    max_active: 4,
                    ..cfg()
                },
                "max open",
            ),
        ];
        for (c, want) in bad {
            let e = c.validate(size).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn sequential_zones_follow_the_rules() {
        let d = dev(cfg());
        let b = [7u8; 4096];
        // Conventional zone: anywhere.
        d.write_at(&b, 8192).unwrap();
        // Zone 1: only at the write pointer.
        assert!(d
            .write_at(&b, Z + 4096)
            .unwrap_err()
            .to_string()
            .contains("unaligned write"));
        d.write_at(&b, Z).unwrap();
        assert_eq!(d.report_zones()[1].cond, ZoneCond::ImplicitOpen);
        assert_eq!(d.zone_append(1, &b).unwrap(), Z + 4096);
        // Reads above the write pointer are zeros.
        let mut r = [1u8; 4096];
        d.read_at(&mut r, Z + 8192).unwrap();
        assert!(r.iter().all(|&x| x == 0));
        // Past the capacity: ENOSPC, nothing changes.
        d.finish_zone(2).unwrap();
        assert_eq!(d.report_zones()[2].cond, ZoneCond::Full);
        assert!(d.write_at(&b, 2 * Z).is_err());
        d.reset_zone(2).unwrap();
        let big = vec![0u8; (Z - 16384) as usize];
        d.write_at(&big, 2 * Z).unwrap();
        assert_eq!(d.report_zones()[2].cond, ZoneCond::Full, "full at capacity");
        // Open limit: zones 1 is open; open 3 and 4; a fifth write to a new zone fails.
        d.open_zone(3).unwrap();
        d.open_zone(4).unwrap();
        let e = d.write_at(&b, 5 * Z).unwrap_err();
        assert!(e.to_string().contains("zones open"), "{e}");
        // Closing one makes room (active stays, it was written).
        d.close_zone(1).unwrap();
        assert_eq!(d.report_zones()[1].cond, ZoneCond::Closed);
        d.write_at(&b, 5 * Z).unwrap();
        // Active limit: 1 closed + 3, 4, 5 open = 4 active; zone 6 cannot start.
        d.close_zone(3).unwrap(); // empty, so back to Empty, not active
        let e = d.open_zone(6);
        assert!(e.is_ok(), "zone 3 went back to empty: {e:?}");
        let e = d.write_at(&b, 7 * Z).unwrap_err();
        assert!(
            e.to_string().contains("active") || e.to_string().contains("open"),
            "{e}"
        );
        // Offline and read-only zones refuse writes.
        d.set_condition(9, ZoneCond::ReadOnly);
        assert!(d.write_at(&b, 9 * Z).is_err());
        d.set_condition(10, ZoneCond::Offline);
        assert!(d.read_at(&mut r, 10 * Z).is_err());
    }

    #[test]
    fn outer_zones_are_faster_and_seeks_cost() {
        let d = dev(ZonedConfig {
            max_open: 0,
            max_active: 0,
            ..cfg()
        });
        let b = vec![0u8; 16384];
        let timed = |off: u64| {
            let t = d.clock_us();
            d.write_at(&b, off).unwrap();
            d.clock_us() - t
        };
        timed(Z);
        let outer = timed(Z + 16384);
        let inner_with_seek = timed(15 * Z);
        let inner = timed(15 * Z + 16384);
        assert!(inner_with_seek > inner + 8000, "a seek costs");
        assert!(
            inner > outer + outer / 2,
            "inner tracks are slower: {inner} vs {outer}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Random zone operations against a reference of the rules: the device
        /// accepts exactly the writes the rules allow, and write pointers match.
        #[test]
        fn random_operations_match_the_rules(ops in proptest::collection::vec((0u8..6, 1usize..16, 1u64..4), 1..200)) {
            let c = cfg();
            let d = dev(c.clone());
            let mut wp: Vec<u64> = (0..16).map(|i| i * Z).collect();
            for (op, z, n) in ops {
                let start = z as u64 * Z;
                let cap = start + c.zone_capacity_bytes;
                match op {
                    0 | 1 => {
                        // Write n blocks at the write pointer (op 0) or elsewhere (1).
                        let off = if op == 0 { wp[z] } else { wp[z] + 4096 };
                        let len = n * 4096;
                        let r = d.write_at(&vec![1u8; len as usize], off);
                        let allowed_by_place = op == 0 && off + len <= cap;
                        if r.is_ok() {
                            prop_assert!(allowed_by_place, "accepted a write breaking the rules");
                            wp[z] += len;
                        }
                    }
                    2 => { d.reset_zone(z).unwrap(); wp[z] = start; }
                    3 => { d.finish_zone(z).ok(); }
                    4 => { d.close_zone(z).unwrap(); }
                    _ => { d.open_zone(z).ok(); }
                }
                let zs = d.report_zones();
                let (open, active) = ZonedDevice::counts(&zs);
                prop_assert!(open <= c.max_open && active <= c.max_active);
                if zs[z].cond == ZoneCond::Full { wp[z] = zs[z].wp; }
                prop_assert_eq!(zs[z].wp, wp[z]);
            }
        }
    }
}
