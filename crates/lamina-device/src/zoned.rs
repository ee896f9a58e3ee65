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

use crate::{check_range, BlockDevice, DeviceError, ZoneLayout};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// The zone state file of a persistent device.
    file: Option<std::fs::File>,
}

pub struct ZonedDevice {
    inner: Arc<dyn BlockDevice>,
    cfg: ZonedConfig,
    st: Mutex<State>,
    name: String,
    /// Writes refused for breaking a zone rule (a host bug if ever non-zero).
    rejected: AtomicU64,
    /// Zones finished by the host, and bytes written to conventional zones.
    finishes: AtomicU64,
    conventional_written: AtomicU64,
    /// Bytes written to sequential zones, and resets of zones that held any:
    /// what a ZNS drive programs and erases (it has no garbage collection of
    /// its own).
    sequential_written: AtomicU64,
    resets: AtomicU64,
    /// Zones whose persisted state failed its checksum (taken offline at open).
    damaged: Vec<usize>,
}

/// The zone state file of a file-backed emulated zoned device: `DATA.zones`.
///
/// Layout (little-endian): a 64-byte header, magic `LMZONES1`, version u32,
/// zone size u64, zone capacity u64, conventional zones u32, max open u32, max
/// active u32, seek us u32, rpm u32, outer MB/s u32, zone count u64, CRC-32C of
/// bytes 0..60 at 60; then one 16-byte record per zone: write pointer u64,
/// condition u8, 3 zero bytes, CRC-32C of the zone index (u64) and bytes 0..12.
pub fn state_path(data: &Path) -> PathBuf {
    let mut p = data.as_os_str().to_owned();
    p.push(".zones");
    PathBuf::from(p)
}

const STATE_MAGIC: &[u8; 8] = b"LMZONES1";
const STATE_VERSION: u32 = 1;
const STATE_HEADER: u64 = 64;
const STATE_RECORD: u64 = 16;

fn cond_code(c: ZoneCond) -> u8 {
    match c {
        ZoneCond::NotWritePointer => 0,
        ZoneCond::Empty => 1,
        ZoneCond::ImplicitOpen => 2,
        ZoneCond::ExplicitOpen => 3,
        ZoneCond::Closed => 4,
        ZoneCond::Full => 5,
        ZoneCond::ReadOnly => 6,
        ZoneCond::Offline => 7,
    }
}

fn code_cond(c: u8) -> Option<ZoneCond> {
    Some(match c {
        0 => ZoneCond::NotWritePointer,
        1 => ZoneCond::Empty,
        2 => ZoneCond::ImplicitOpen,
        3 => ZoneCond::ExplicitOpen,
        4 => ZoneCond::Closed,
        5 => ZoneCond::Full,
        6 => ZoneCond::ReadOnly,
        7 => ZoneCond::Offline,
        _ => return None,
    })
}

fn record(i: usize, z: &Zone) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[..8].copy_from_slice(&z.wp.to_le_bytes());
    r[8] = cond_code(z.cond);
    let crc = crc32c::crc32c_append(crc32c::crc32c(&(i as u64).to_le_bytes()), &r[..12]);
    r[12..].copy_from_slice(&crc.to_le_bytes());
    r
}

fn header(cfg: &ZonedConfig, zones: u64) -> [u8; 64] {
    let mut h = [0u8; 64];
    h[..8].copy_from_slice(STATE_MAGIC);
    let mut at = 8;
    let mut put = |b: &[u8]| {
        h[at..at + b.len()].copy_from_slice(b);
        at += b.len();
    };
    put(&STATE_VERSION.to_le_bytes());
    put(&cfg.zone_bytes.to_le_bytes());
    put(&cfg.zone_capacity_bytes.to_le_bytes());
    put(&cfg.conventional_zones.to_le_bytes());
    put(&cfg.max_open.to_le_bytes());
    put(&cfg.max_active.to_le_bytes());
    put(&(cfg.seek_us as u32).to_le_bytes());
    put(&(cfg.rpm as u32).to_le_bytes());
    put(&(cfg.outer_mb_s as u32).to_le_bytes());
    put(&zones.to_le_bytes());
    let crc = crc32c::crc32c(&h[..60]);
    h[60..].copy_from_slice(&crc.to_le_bytes());
    h
}

/// For the fuzz target (`fuzz/`): makes the header's and every record's checksum
/// of a zone-state file image valid, so that what follows the checks is exercised.
#[doc(hidden)]
pub fn fuzzing_reseal_state(img: &mut [u8]) {
    if img.len() >= 64 {
        let crc = crc32c::crc32c(&img[..60]);
        img[60..64].copy_from_slice(&crc.to_le_bytes());
    }
    let recs = img.get_mut(STATE_HEADER as usize..).unwrap_or_default();
    for (i, r) in recs.chunks_exact_mut(STATE_RECORD as usize).enumerate() {
        let crc = crc32c::crc32c_append(crc32c::crc32c(&(i as u64).to_le_bytes()), &r[..12]);
        r[12..].copy_from_slice(&crc.to_le_bytes());
    }
}

fn parse_header(h: &[u8; 64]) -> Result<(ZonedConfig, u64), String> {
    if &h[..8] != STATE_MAGIC {
        return Err("not a zone state file (bad magic)".into());
    }
    let crc = u32::from_le_bytes(h[60..64].try_into().unwrap());
    if crc32c::crc32c(&h[..60]) != crc {
        return Err("zone state header checksum mismatch".into());
    }
    let u32_at = |o: usize| u32::from_le_bytes(h[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(h[o..o + 8].try_into().unwrap());
    if u32_at(8) != STATE_VERSION {
        return Err(format!("zone state version {} not supported", u32_at(8)));
    }
    let cfg = ZonedConfig {
        zone_bytes: u64_at(12),
        zone_capacity_bytes: u64_at(20),
        conventional_zones: u32_at(28),
        max_open: u32_at(32),
        max_active: u32_at(36),
        seek_us: u32_at(40) as u64,
        rpm: u32_at(44) as u64,
        outer_mb_s: u32_at(48) as u64,
    };
    Ok((cfg, u64_at(52)))
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
                file: None,
            }),
            name,
            rejected: AtomicU64::new(0),
            finishes: AtomicU64::new(0),
            conventional_written: AtomicU64::new(0),
            sequential_written: AtomicU64::new(0),
            resets: AtomicU64::new(0),
            damaged: Vec::new(),
        })
    }

    /// A new emulated zoned device over `inner` whose zone state persists in
    /// `state` (see [`state_path`]), so that it survives the process.
    pub fn create_persistent(
        inner: Arc<dyn BlockDevice>,
        cfg: ZonedConfig,
        state: &Path,
    ) -> Result<Self, DeviceError> {
        let mut d = Self::new(inner, cfg)?;
        let io = |source| DeviceError::Io {
            device: state.display().to_string(),
            op: "create zone state",
            offset: 0,
            len: 0,
            source,
        };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(state)
            .map_err(io)?;
        let zones = d.zones();
        let mut img = header(&d.cfg, zones.len() as u64).to_vec();
        for (i, z) in zones.iter().enumerate() {
            img.extend_from_slice(&record(i, z));
        }
        f.write_all_at(&img, 0).map_err(io)?;
        f.sync_all().map_err(io)?;
        d.st.get_mut().unwrap().file = Some(f);
        Ok(d)
    }

    /// The configuration recorded in zone state file `state` (to emulate another
    /// device like it).
    pub fn read_config(state: &Path) -> Result<ZonedConfig, DeviceError> {
        let bad = |detail: String| DeviceError::Open {
            device: state.display().to_string(),
            detail,
        };
        let f = std::fs::File::open(state).map_err(|e| bad(e.to_string()))?;
        let mut h = [0u8; 64];
        f.read_exact_at(&mut h, 0)
            .map_err(|e| bad(format!("cannot read the header: {e}")))?;
        Ok(parse_header(&h).map_err(bad)?.0)
    }

    /// Opens an emulated zoned device whose configuration and zone state are in
    /// `state`. A zone whose record fails its checksum is taken offline (its data
    /// is never served) and listed by [`ZonedDevice::damaged_zones`].
    pub fn open_persistent(inner: Arc<dyn BlockDevice>, state: &Path) -> Result<Self, DeviceError> {
        let bad = |detail: String| DeviceError::Open {
            device: state.display().to_string(),
            detail,
        };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(state)
            .map_err(|e| bad(e.to_string()))?;
        let mut h = [0u8; 64];
        f.read_exact_at(&mut h, 0)
            .map_err(|e| bad(format!("cannot read the header: {e}")))?;
        let (cfg, n) = parse_header(&h).map_err(bad)?;
        let mut d = Self::new(inner, cfg)?;
        let st = d.st.get_mut().unwrap();
        if st.zones.len() as u64 != n {
            return Err(bad(format!(
                "records {n} zones but the device holds {}",
                st.zones.len()
            )));
        }
        let mut recs = vec![0u8; (n * STATE_RECORD) as usize];
        f.read_exact_at(&mut recs, STATE_HEADER)
            .map_err(|e| bad(format!("cannot read the zone records: {e}")))?;
        for (i, r) in recs.chunks(16).enumerate() {
            let z = &mut st.zones[i];
            let crc = u32::from_le_bytes(r[12..16].try_into().unwrap());
            let want = crc32c::crc32c_append(crc32c::crc32c(&(i as u64).to_le_bytes()), &r[..12]);
            let wp = u64::from_le_bytes(r[..8].try_into().unwrap());
            match code_cond(r[8]) {
                Some(c) if crc == want && wp >= z.start && wp <= z.start + z.capacity => {
                    z.wp = wp;
                    z.cond = c;
                }
                _ => {
                    z.cond = ZoneCond::Offline;
                    d.damaged.push(i);
                }
            }
        }
        st.file = Some(f);
        Ok(d)
    }

    /// Zones taken offline at open because their persisted state was damaged.
    pub fn damaged_zones(&self) -> &[usize] {
        &self.damaged
    }

    /// Writes refused because they broke a zone rule.
    pub fn rejected_writes(&self) -> u64 {
        self.rejected.load(Ordering::Relaxed)
    }

    /// Zones the host finished.
    pub fn finished_zones(&self) -> u64 {
        self.finishes.load(Ordering::Relaxed)
    }

    /// Bytes the host wrote to conventional zones.
    pub fn conventional_bytes_written(&self) -> u64 {
        self.conventional_written.load(Ordering::Relaxed)
    }

    /// Bytes the host wrote to sequential zones.
    pub fn sequential_bytes_written(&self) -> u64 {
        self.sequential_written.load(Ordering::Relaxed)
    }

    /// Resets of zones that held something (an empty zone's reset erases nothing).
    pub fn zone_resets(&self) -> u64 {
        self.resets.load(Ordering::Relaxed)
    }

    fn reject(&self, e: DeviceError) -> DeviceError {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        e
    }

    /// Persists zone `i`'s state (persistent devices).
    fn persist(&self, st: &State, i: usize) -> Result<(), DeviceError> {
        if let Some(f) = &st.file {
            f.write_all_at(
                &record(i, &st.zones[i]),
                STATE_HEADER + i as u64 * STATE_RECORD,
            )
            .map_err(|source| DeviceError::Io {
                device: self.name.clone(),
                op: "zone state write",
                offset: i as u64,
                len: 16,
                source,
            })?;
        }
        Ok(())
    }

    /// The configuration the device was built with.
    pub fn config(&self) -> &ZonedConfig {
        &self.cfg
    }

    pub fn zones(&self) -> Vec<Zone> {
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
    pub fn reset(&self, i: usize) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        self.check_zone(&st, i, "reset")?;
        let z = &mut st.zones[i];
        if z.cond != ZoneCond::Empty {
            self.resets.fetch_add(1, Ordering::Relaxed);
        }
        z.wp = z.start;
        z.cond = ZoneCond::Empty;
        self.persist(&st, i)
    }

    /// Finishes zone `i`: full, whatever was written.
    pub fn finish(&self, i: usize) -> Result<(), DeviceError> {
        let mut st = self.st.lock().unwrap();
        self.check_zone(&st, i, "finish")?;
        if st.zones[i].cond == ZoneCond::Empty {
            // Finishing an empty zone makes it active for a moment.
            self.may_open(&st.zones, i, "finish")?;
        }
        let z = &mut st.zones[i];
        z.wp = z.start + z.capacity;
        z.cond = ZoneCond::Full;
        self.finishes.fetch_add(1, Ordering::Relaxed);
        self.persist(&st, i)
    }

    /// Opens zone `i` explicitly.
    pub fn open(&self, i: usize) -> Result<(), DeviceError> {
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
        self.persist(&st, i)
    }

    /// Closes zone `i` (it stays active if written, else returns to empty).
    pub fn close(&self, i: usize) -> Result<(), DeviceError> {
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
        self.persist(&st, i)
    }

    /// Puts zone `i` in a failed condition (tests of how the host copes).
    pub fn set_condition(&self, i: usize, cond: ZoneCond) {
        let mut st = self.st.lock().unwrap();
        st.zones[i].cond = cond;
        let _ = self.persist(&st, i);
    }

    /// The zone index holding byte `offset`, for the trait's offset-based calls.
    fn zone_at(&self, op: &'static str, offset: u64) -> Result<usize, DeviceError> {
        if offset >= self.size_bytes() {
            return Err(err(
                &self.name,
                op,
                offset,
                libc::EINVAL,
                format!("offset {offset} is past the last zone"),
            ));
        }
        Ok(self.zone_index(offset))
    }

    /// Checks a write of `len` bytes at `offset` against the zone rules; returns
    /// the zone.
    fn check_write(&self, st: &State, offset: u64, len: u64) -> Result<usize, DeviceError> {
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
        Ok(i)
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
        let t = SmrTiming::of(&self.cfg, st.zones.len() as u64).cost(&mut st.head, offset, len);
        st.clock += t;
    }
}

/// The time a disk head takes, in microseconds: a request that does not continue
/// where the previous one ended pays an average seek and half a rotation; the
/// transfer runs at a bandwidth falling linearly from `outer_mb_s` at offset 0
/// to half of it at the end (outer tracks hold twice the sectors of inner ones).
#[derive(Clone, Copy, Debug)]
pub struct SmrTiming {
    pub seek_us: u64,
    pub rpm: u64,
    pub outer_mb_s: u64,
    pub size: u64,
}

impl SmrTiming {
    fn of(cfg: &ZonedConfig, zones: u64) -> Self {
        SmrTiming {
            seek_us: cfg.seek_us,
            rpm: cfg.rpm,
            outer_mb_s: cfg.outer_mb_s,
            size: zones.max(1) * cfg.zone_bytes,
        }
    }

    /// Transfer bandwidth (MB/s, that is bytes per microsecond) at `offset`.
    pub fn bandwidth(&self, offset: u64) -> f64 {
        self.outer_mb_s as f64 * (1.0 - 0.5 * offset as f64 / self.size.max(1) as f64)
    }

    /// Time of a request of `len` bytes at `offset`, with the head at `*head`
    /// (moved past the request).
    pub fn cost(&self, head: &mut u64, offset: u64, len: u64) -> u64 {
        let mut t = (len as f64 / self.bandwidth(offset)) as u64;
        if offset != *head {
            t += self.seek(offset.abs_diff(*head)) + 30_000_000 / self.rpm.max(1);
        }
        *head = offset + len;
        t
    }

    /// Seek time over `distance` bytes: a settle time plus a part growing with the
    /// square root of the distance (the arm accelerates, then coasts), scaled so
    /// that seeks between uniformly random places average `seek_us`
    /// (E[sqrt(d)] = 8/15 of the full stroke for such places).
    pub fn seek(&self, distance: u64) -> u64 {
        const SETTLE_US: f64 = 1000.0;
        let avg = (self.seek_us as f64).max(SETTLE_US);
        let full = SETTLE_US + (avg - SETTLE_US) * 15.0 / 8.0;
        let frac = (distance as f64 / self.size.max(1) as f64).min(1.0);
        (SETTLE_US + (full - SETTLE_US) * frac.sqrt()) as u64
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
        let i = self
            .check_write(&st, offset, len)
            .map_err(|e| self.reject(e))?;
        self.inner.write_at(buf, offset)?;
        self.time(&mut st, offset, len);
        let z = &mut st.zones[i];
        if z.ty == ZoneType::Conventional {
            self.conventional_written.fetch_add(len, Ordering::Relaxed);
        }
        if z.ty == ZoneType::SequentialRequired {
            self.sequential_written.fetch_add(len, Ordering::Relaxed);
            z.wp += len;
            z.cond = if z.wp == z.start + z.capacity {
                ZoneCond::Full
            } else if z.cond == ZoneCond::ExplicitOpen {
                ZoneCond::ExplicitOpen
            } else {
                ZoneCond::ImplicitOpen
            };
            self.persist(&st, i)?;
        }
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.inner.sync()?;
        if let Some(f) = &self.st.lock().unwrap().file {
            f.sync_data().map_err(|source| DeviceError::Io {
                device: self.name.clone(),
                op: "zone state sync",
                offset: 0,
                len: 0,
                source,
            })?;
        }
        Ok(())
    }
    fn zone_layout(&self) -> Option<ZoneLayout> {
        let conv = self.cfg.conventional_zones as u64;
        Some(ZoneLayout {
            conventional_bytes: conv * self.cfg.zone_bytes,
            zone_bytes: self.cfg.zone_bytes,
            zone_capacity: self.cfg.zone_capacity_bytes,
            zones: self.size_bytes() / self.cfg.zone_bytes - conv,
            max_open: self.cfg.max_open,
            max_active: self.cfg.max_active,
        })
    }
    fn report_zones(&self) -> Result<Vec<Zone>, DeviceError> {
        Ok(self.zones())
    }
    /// Conventional zones take discards; a sequential zone is emptied by a reset
    /// only (host-managed drives refuse a discard there), so one is refused and
    /// counted with the writes that broke a rule.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self, "discard", offset, len as usize)?;
        if len == 0 {
            return Ok(());
        }
        let st = self.st.lock().unwrap();
        let (first, last) = (self.zone_index(offset), self.zone_index(offset + len - 1));
        if let Some(i) = (first..=last).find(|&i| st.zones[i].ty == ZoneType::SequentialRequired) {
            return Err(self.reject(err(
                &self.name,
                "discard",
                offset,
                libc::EINVAL,
                format!("zone {i} is sequential: it is reset, not discarded"),
            )));
        }
        drop(st);
        self.inner.discard(offset, len)
    }
    fn reset_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.reset(self.zone_at("reset zone", offset)?)
    }
    fn finish_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.finish(self.zone_at("finish zone", offset)?)
    }
}

#[cfg(test)]
mod tests {

    /// The zone-state seed of the fuzz corpus (`fuzz/corpus/zone_state/seed-0`) is
    /// a file `create_persistent` writes for the fuzz target's 8 MiB device, with
    /// some zones written (`LAMINA_WRITE_FUZZ_SEEDS=1` rewrites it).
    #[test]
    fn zone_state_fuzz_seed_is_current() {
        let dir = std::env::temp_dir().join(format!("lamina-zseed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("d.zones");
        let cfg = ZonedConfig {
            zone_bytes: 256 << 10,
            zone_capacity_bytes: 192 << 10,
            conventional_zones: 4,
            max_open: 4,
            max_active: 6,
            ..Default::default()
        };
        let inner = Arc::new(crate::mem::MemDevice::new("fuzz", 8 << 20));
        let d = ZonedDevice::create_persistent(inner, cfg, &state).unwrap();
        d.write_at(&[1u8; 8192], 4 * (256 << 10)).unwrap();
        d.write_at(&[2u8; 4096], 6 * (256 << 10)).unwrap();
        d.finish_zone(6 * (256 << 10)).unwrap();
        drop(d);
        let mut input = vec![0u8];
        input.extend_from_slice(&std::fs::read(&state).unwrap());
        std::fs::remove_dir_all(&dir).unwrap();
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fuzz/corpus/zone_state/seed-0");
        if std::env::var("LAMINA_WRITE_FUZZ_SEEDS").is_ok() {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &input).unwrap();
        }
        assert_eq!(
            std::fs::read(&path).unwrap(),
            input,
            "{} is stale",
            path.display()
        );
        // Resealing a valid image changes nothing.
        let mut resealed = input[1..].to_vec();
        fuzzing_reseal_state(&mut resealed);
        assert_eq!(resealed, input[1..]);
    }
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
        assert_eq!(d.zones()[1].cond, ZoneCond::ImplicitOpen);
        assert_eq!(d.zone_append(1, &b).unwrap(), Z + 4096);
        // Reads above the write pointer are zeros.
        let mut r = [1u8; 4096];
        d.read_at(&mut r, Z + 8192).unwrap();
        assert!(r.iter().all(|&x| x == 0));
        // Past the capacity: ENOSPC, nothing changes.
        d.finish(2).unwrap();
        assert_eq!(d.zones()[2].cond, ZoneCond::Full);
        assert!(d.write_at(&b, 2 * Z).is_err());
        d.reset(2).unwrap();
        let big = vec![0u8; (Z - 16384) as usize];
        d.write_at(&big, 2 * Z).unwrap();
        assert_eq!(d.zones()[2].cond, ZoneCond::Full, "full at capacity");
        // Open limit: zones 1 is open; open 3 and 4; a fifth write to a new zone fails.
        d.open(3).unwrap();
        d.open(4).unwrap();
        let e = d.write_at(&b, 5 * Z).unwrap_err();
        assert!(e.to_string().contains("zones open"), "{e}");
        // Closing one makes room (active stays, it was written).
        d.close(1).unwrap();
        assert_eq!(d.zones()[1].cond, ZoneCond::Closed);
        d.write_at(&b, 5 * Z).unwrap();
        // Active limit: 1 closed + 3, 4, 5 open = 4 active; zone 6 cannot start.
        d.close(3).unwrap(); // empty, so back to Empty, not active
        let e = d.open(6);
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

    #[test]
    fn seeks_grow_with_distance_and_average_the_configured_time() {
        let t = SmrTiming {
            seek_us: 8000,
            rpm: 7200,
            outer_mb_s: 250,
            size: 1 << 40,
        };
        assert!(t.seek(1 << 20) < 1500, "a short seek is mostly settling");
        assert!(t.seek(1 << 40) > 14000, "a full stroke");
        let mut x = 88172645463325252u64;
        let mut next = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % (1 << 40)
        };
        let n = 100_000;
        let avg = (0..n).map(|_| t.seek(next().abs_diff(next()))).sum::<u64>() as f64 / n as f64;
        assert!((avg - 8000.0).abs() < 200.0, "average seek {avg}");
    }

    #[test]
    fn zone_state_persists_and_damage_is_detected() {
        let dir = std::env::temp_dir().join(format!("lamina-zones-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let state = dir.join("dev.zones");
        let inner: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("m", 16 * Z));
        let d = ZonedDevice::create_persistent(inner.clone(), cfg(), &state).unwrap();
        d.write_at(&[5u8; 8192], Z).unwrap();
        d.finish(3).unwrap();
        d.sync().unwrap();
        drop(d);
        let d = ZonedDevice::open_persistent(inner.clone(), &state).unwrap();
        let zs = d.zones();
        assert_eq!((zs[1].wp, zs[1].cond), (Z + 8192, ZoneCond::ImplicitOpen));
        assert_eq!(zs[3].cond, ZoneCond::Full);
        assert_eq!(d.config().zone_capacity_bytes, Z - 16384);
        assert!(d.damaged_zones().is_empty());
        drop(d);
        // A flipped byte in zone 1's record: zone 1 goes offline, the rest opens.
        let mut img = std::fs::read(&state).unwrap();
        img[64 + 16 + 2] ^= 0x40;
        std::fs::write(&state, &img).unwrap();
        let d = ZonedDevice::open_persistent(inner.clone(), &state).unwrap();
        assert_eq!(d.damaged_zones(), &[1]);
        let mut b = [0u8; 4096];
        assert!(
            d.read_at(&mut b, Z).is_err(),
            "a damaged zone is never served"
        );
        assert_eq!(d.zones()[3].cond, ZoneCond::Full);
        drop(d);
        // A damaged header: refused with the reason.
        img[20] ^= 1;
        std::fs::write(&state, &img).unwrap();
        let e = ZonedDevice::open_persistent(inner, &state).err().unwrap();
        assert!(e.to_string().contains("checksum"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
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
                    2 => { d.reset(z).unwrap(); wp[z] = start; }
                    3 => { d.finish(z).ok(); }
                    4 => { d.close(z).unwrap(); }
                    _ => { d.open(z).ok(); }
                }
                let zs = d.zones();
                let (open, active) = ZonedDevice::counts(&zs);
                prop_assert!(open <= c.max_open && active <= c.max_active);
                if zs[z].cond == ZoneCond::Full { wp[z] = zs[z].wp; }
                prop_assert_eq!(zs[z].wp, wp[z]);
            }
        }
    }
}
