//! Kernel zoned block devices (host-managed ZBC/ZAC SMR disks, NVMe ZNS
//! namespaces) through the ioctls of `<linux/blkzoned.h>`: BLKREPORTZONE,
//! BLKRESETZONE, BLKOPENZONE, BLKCLOSEZONE, BLKFINISHZONE, and the limits in
//! sysfs (`queue/zoned`, `queue/max_open_zones`, `queue/max_active_zones`).
//!
//! [`open_if_zoned`] turns a [`FileDevice`] on a host-managed block device into a
//! [`KernelZoned`], the same [`BlockDevice`] zone interface the emulator offers;
//! host-aware and conventional devices stay as they are. The layout must be what
//! Lamina can use: conventional zones (if any) first, then sequential zones of one
//! size and one capacity.
//!
//! The build machine's kernel has no zoned device (no null_blk, no scsi_debug), so
//! the ioctl path runs in the kernel test rig (`tests/vm/rig.sh`: Debian's kernel
//! under QEMU, a zoned null_blk): `zone_conformance` holds the rules both backends
//! must follow; the emulator passes it in every test run, and
//! `LAMINA_ZONED_DEVICE=/dev/X cargo test -p lamina-device kernel_zoned` runs it
//! against a real device (destroying its contents), which is what the rig does. The
//! decoding of the kernel's structures is tested here on images of them.

use crate::file::FileDevice;
use crate::zoned::{Zone, ZoneCond, ZoneType};
use crate::{BlockDevice, DeviceError, ZoneLayout};
use std::os::fd::AsRawFd;

const SECTOR: u64 = 512;
/// `sizeof(struct blk_zone)`.
const ZONE_STRUCT: usize = 64;
/// `sizeof(struct blk_zone_report)` (its zones follow it).
const REPORT_HEADER: usize = 16;
const BLK_ZONE_REP_CAPACITY: u32 = 1;

const fn ioc(dir: u64, nr: u64, size: u64) -> u64 {
    (dir << 30) | (size << 16) | (0x12 << 8) | nr
}
const BLKREPORTZONE: u64 = ioc(3, 130, 16);
const BLKRESETZONE: u64 = ioc(1, 131, 16);
const BLKOPENZONE: u64 = ioc(1, 134, 16);
const BLKCLOSEZONE: u64 = ioc(1, 135, 16);
const BLKFINISHZONE: u64 = ioc(1, 136, 16);

/// Decodes one `struct blk_zone` (sectors to bytes). `has_capacity`: the report
/// carried BLK_ZONE_REP_CAPACITY (else the capacity is the length).
pub fn decode_zone(b: &[u8], has_capacity: bool) -> Result<Zone, String> {
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let (start, len, wp) = (u64_at(0), u64_at(8), u64_at(16));
    let ty = match b[24] {
        1 => ZoneType::Conventional,
        2 => ZoneType::SequentialRequired,
        3 => return Err("sequential-write-preferred (host-aware) zone".into()),
        t => return Err(format!("unknown zone type {t}")),
    };
    let cond = match b[25] {
        0 => ZoneCond::NotWritePointer,
        1 => ZoneCond::Empty,
        2 => ZoneCond::ImplicitOpen,
        3 => ZoneCond::ExplicitOpen,
        4 => ZoneCond::Closed,
        0xD => ZoneCond::ReadOnly,
        0xE => ZoneCond::Full,
        0xF => ZoneCond::Offline,
        c => return Err(format!("unknown zone condition {c:#x}")),
    };
    let capacity = if has_capacity { u64_at(32) } else { len };
    // The write pointer means something only for empty, open and closed zones
    // (offline and read-only ones may report all ones); full zones report the end.
    let wp = match cond {
        ZoneCond::Empty | ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen | ZoneCond::Closed => {
            wp.clamp(start, start.saturating_add(capacity))
        }
        ZoneCond::Full => start.saturating_add(capacity),
        _ => start,
    };
    let bytes = |sectors: u64| {
        sectors
            .checked_mul(SECTOR)
            .ok_or_else(|| format!("zone at sector {start} lies beyond 2^64 bytes"))
    };
    Ok(Zone {
        start: bytes(start)?,
        len: bytes(len)?,
        capacity: bytes(capacity)?,
        wp: bytes(wp)?,
        cond,
        ty,
    })
}

/// The layout Lamina uses from a device's zones, or why it cannot.
pub fn layout_of(zones: &[Zone], max_open: u32, max_active: u32) -> Result<ZoneLayout, String> {
    let conv = zones
        .iter()
        .take_while(|z| z.ty == ZoneType::Conventional)
        .count();
    let seq = &zones[conv..];
    let first = seq.first().ok_or("no sequential zones")?;
    if let Some(z) = seq.iter().find(|z| z.ty == ZoneType::Conventional) {
        return Err(format!(
            "a conventional zone at {} follows sequential ones",
            z.start
        ));
    }
    if let Some(z) = seq
        .iter()
        .find(|z| z.len != first.len || z.capacity != first.capacity)
    {
        return Err(format!(
            "zone at {} has size {} and capacity {}, unlike the first ({} and {})",
            z.start, z.len, z.capacity, first.len, first.capacity
        ));
    }
    Ok(ZoneLayout {
        conventional_bytes: first.start,
        zone_bytes: first.len,
        zone_capacity: first.capacity,
        zones: seq.len() as u64,
        max_open,
        max_active,
    })
}

/// A host-managed kernel zoned block device. Data moves with direct I/O: through
/// the page cache, writes would reach the device when the kernel writes them back,
/// in any order and after a zone finish that [`crate::zonehost::Plug`] believed
/// came after them.
pub struct KernelZoned {
    file: FileDevice,
    direct: std::fs::File,
    layout: ZoneLayout,
}

/// `queue/NAME` of the block device behind `file`, from sysfs.
fn queue_attr(file: &FileDevice, name: &str) -> Option<String> {
    // SAFETY: fstat on an open descriptor into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(file.file().as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    let (major, minor) = (libc::major(st.st_rdev), libc::minor(st.st_rdev));
    std::fs::read_to_string(format!("/sys/dev/block/{major}:{minor}/queue/{name}"))
        .ok()
        .map(|s| s.trim().to_string())
}

/// `file` as a zoned device if it is a host-managed zoned block device.
pub fn open_if_zoned(file: FileDevice) -> Result<Box<dyn BlockDevice>, DeviceError> {
    if !file.is_block_device() || queue_attr(&file, "zoned").as_deref() != Some("host-managed") {
        return Ok(Box::new(file));
    }
    let limit = |n| {
        queue_attr(&file, n)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    };
    let (max_open, max_active) = (limit("max_open_zones"), limit("max_active_zones"));
    let zones = report(&file)?;
    let layout = layout_of(&zones, max_open, max_active).map_err(|detail| DeviceError::Open {
        device: file.describe(),
        detail: format!("zoned layout Lamina cannot use: {detail}"),
    })?;
    use std::os::unix::fs::OpenOptionsExt;
    let direct = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
        .open(file.path())
        .map_err(|e| DeviceError::Open {
            device: file.describe(),
            detail: format!("cannot open for direct I/O: {e}"),
        })?;
    Ok(Box::new(KernelZoned {
        file,
        direct,
        layout,
    }))
}

/// Runs `f` on a 4 KiB-aligned scratch buffer of `len` bytes (direct I/O wants
/// aligned buffers).
fn aligned<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    let mut raw = vec![0u8; len + 4096];
    let at = raw.as_ptr().align_offset(4096);
    f(&mut raw[at..at + len])
}

fn os_err(file: &FileDevice, op: &'static str, offset: u64) -> DeviceError {
    DeviceError::Io {
        device: file.describe(),
        op,
        offset,
        len: 0,
        source: std::io::Error::last_os_error(),
    }
}

/// Every zone of the device, by BLKREPORTZONE in batches.
fn report(file: &FileDevice) -> Result<Vec<Zone>, DeviceError> {
    const BATCH: usize = 4096;
    let size = file.size_bytes();
    let mut zones = Vec::new();
    let mut buf = vec![0u8; REPORT_HEADER + BATCH * ZONE_STRUCT];
    let mut sector = 0u64;
    while sector * SECTOR < size {
        buf.fill(0);
        buf[..8].copy_from_slice(&sector.to_le_bytes());
        buf[8..12].copy_from_slice(&(BATCH as u32).to_le_bytes());
        // SAFETY: the buffer holds a blk_zone_report followed by BATCH zones.
        let rc = unsafe {
            libc::ioctl(
                file.file().as_raw_fd(),
                BLKREPORTZONE as _,
                buf.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(os_err(file, "report zones", sector * SECTOR));
        }
        let n = u32::from_le_bytes(buf[8..12].try_into().unwrap()) as usize;
        let flags = u32::from_le_bytes(buf[12..16].try_into().unwrap());
        if n == 0 {
            break;
        }
        for i in 0..n.min(BATCH) {
            let at = REPORT_HEADER + i * ZONE_STRUCT;
            let z = decode_zone(
                &buf[at..at + ZONE_STRUCT],
                flags & BLK_ZONE_REP_CAPACITY != 0,
            )
            .map_err(|detail| DeviceError::Open {
                device: file.describe(),
                detail,
            })?;
            sector = (z.start + z.len) / SECTOR;
            zones.push(z);
        }
    }
    Ok(zones)
}

impl KernelZoned {
    fn range_op(&self, req: u64, op: &'static str, offset: u64) -> Result<(), DeviceError> {
        let l = &self.layout;
        let z = l.zone_of(offset).ok_or_else(|| DeviceError::Io {
            device: self.file.describe(),
            op,
            offset,
            len: 0,
            source: std::io::Error::other("not in a sequential zone"),
        })?;
        let range: [u64; 2] = [l.zone_start(z) / SECTOR, l.zone_bytes / SECTOR];
        // SAFETY: a blk_zone_range on the stack.
        let rc = unsafe { libc::ioctl(self.file.file().as_raw_fd(), req as _, range.as_ptr()) };
        if rc != 0 {
            return Err(os_err(&self.file, op, offset));
        }
        Ok(())
    }

    /// Opens the zone holding `offset` explicitly.
    pub fn open_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.range_op(BLKOPENZONE, "open zone", offset)
    }

    /// Closes the zone holding `offset`.
    pub fn close_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.range_op(BLKCLOSEZONE, "close zone", offset)
    }
}

impl BlockDevice for KernelZoned {
    fn size_bytes(&self) -> u64 {
        self.file.size_bytes()
    }
    fn describe(&self) -> String {
        self.file.describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        use std::os::unix::fs::FileExt;
        crate::check_range(self, "read", offset, buf.len())?;
        let r = if buf.as_ptr().align_offset(4096) == 0 {
            self.direct.read_exact_at(buf, offset)
        } else {
            aligned(buf.len(), |a| {
                self.direct.read_exact_at(a, offset)?;
                buf.copy_from_slice(a);
                Ok(())
            })
        };
        r.map_err(|source| DeviceError::Io {
            device: self.describe(),
            op: "read",
            offset,
            len: buf.len(),
            source,
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        use std::os::unix::fs::FileExt;
        crate::check_range(self, "write", offset, buf.len())?;
        let r = if buf.as_ptr().align_offset(4096) == 0 {
            self.direct.write_all_at(buf, offset)
        } else {
            aligned(buf.len(), |a| {
                a.copy_from_slice(buf);
                self.direct.write_all_at(a, offset)
            })
        };
        r.map_err(|source| DeviceError::Io {
            device: self.describe(),
            op: "write",
            offset,
            len: buf.len(),
            source,
        })
    }
    fn sync(&self) -> Result<(), DeviceError> {
        // Direct writes bypass the page cache, not the device's volatile cache.
        self.direct.sync_data().map_err(|source| DeviceError::Io {
            device: self.describe(),
            op: "sync",
            offset: 0,
            len: 0,
            source,
        })
    }
    fn zone_layout(&self) -> Option<ZoneLayout> {
        Some(self.layout)
    }
    fn report_zones(&self) -> Result<Vec<Zone>, DeviceError> {
        report(&self.file)
    }
    fn reset_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.range_op(BLKRESETZONE, "reset zone", offset)
    }
    fn finish_zone(&self, offset: u64) -> Result<(), DeviceError> {
        self.range_op(BLKFINISHZONE, "finish zone", offset)
    }
}

/// The zone rules Lamina relies on, checked on any zoned device (its contents
/// are destroyed): writes only at the write pointer, reset and finish move it,
/// the report agrees, and a write below the write pointer is refused.
pub fn zone_conformance(dev: &dyn BlockDevice) -> Result<(), String> {
    let l = dev.zone_layout().ok_or("not a zoned device")?;
    let zones = dev.report_zones().map_err(|e| e.to_string())?;
    let seq: Vec<&Zone> = zones
        .iter()
        .filter(|z| z.ty == ZoneType::SequentialRequired)
        .collect();
    if seq.len() as u64 != l.zones || seq[0].start != l.conventional_bytes {
        return Err(format!(
            "report ({} sequential zones from {}) disagrees with the layout {l:?}",
            seq.len(),
            seq[0].start
        ));
    }
    let z0 = l.zone_start(0);
    let find = |dev: &dyn BlockDevice| -> Result<Zone, String> {
        dev.report_zones()
            .map_err(|e| e.to_string())?
            .into_iter()
            .find(|z| z.start == z0)
            .ok_or_else(|| "zone 0 missing from the report".to_string())
    };
    dev.reset_zone(z0).map_err(|e| format!("reset: {e}"))?;
    let z = find(dev)?;
    if (z.cond, z.wp) != (ZoneCond::Empty, z0) {
        return Err(format!("after reset: {z:?}"));
    }
    let block = vec![0x5au8; 4096];
    dev.write_at(&block, z0 + 4096)
        .err()
        .ok_or("a write past the write pointer was accepted")?;
    dev.write_at(&block, z0)
        .map_err(|e| format!("write at the write pointer: {e}"))?;
    dev.write_at(&block, z0 + 4096)
        .map_err(|e| format!("second write: {e}"))?;
    let z = find(dev)?;
    if z.wp != z0 + 8192 || !matches!(z.cond, ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen) {
        return Err(format!("after two writes: {z:?}"));
    }
    dev.write_at(&block, z0)
        .err()
        .ok_or("a write below the write pointer was accepted")?;
    let mut back = vec![0u8; 4096];
    dev.read_at(&mut back, z0 + 4096)
        .map_err(|e| e.to_string())?;
    if back != block {
        return Err("read back differs".into());
    }
    dev.finish_zone(z0).map_err(|e| format!("finish: {e}"))?;
    let z = find(dev)?;
    if z.cond != ZoneCond::Full {
        return Err(format!("after finish: {z:?}"));
    }
    dev.write_at(&block, z.wp.min(z0 + l.zone_capacity - 4096))
        .err()
        .ok_or("a write to a full zone was accepted")?;
    dev.reset_zone(z0).map_err(|e| format!("reset: {e}"))?;
    if find(dev)?.cond != ZoneCond::Empty {
        return Err("reset did not empty the zone".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemDevice;
    use crate::zoned::{ZonedConfig, ZonedDevice};
    use std::sync::Arc;

    fn blk_zone(start: u64, len: u64, wp: u64, ty: u8, cond: u8, cap: u64) -> Vec<u8> {
        let mut b = vec![0u8; ZONE_STRUCT];
        b[0..8].copy_from_slice(&start.to_le_bytes());
        b[8..16].copy_from_slice(&len.to_le_bytes());
        b[16..24].copy_from_slice(&wp.to_le_bytes());
        b[24] = ty;
        b[25] = cond;
        b[32..40].copy_from_slice(&cap.to_le_bytes());
        b
    }

    #[test]
    fn ioctl_numbers_match_the_kernel_headers() {
        // From <linux/blkzoned.h> on x86_64 and aarch64.
        assert_eq!(BLKREPORTZONE, 0xC0101282);
        assert_eq!(BLKRESETZONE, 0x40101283);
        assert_eq!(BLKOPENZONE, 0x40101286);
        assert_eq!(BLKCLOSEZONE, 0x40101287);
        assert_eq!(BLKFINISHZONE, 0x40101288);
    }

    #[test]
    fn kernel_zone_reports_decode() {
        let z = decode_zone(&blk_zone(2048, 2048, 2056, 2, 2, 1536), true).unwrap();
        assert_eq!(
            (z.start, z.len, z.wp, z.capacity),
            (1 << 20, 1 << 20, (1 << 20) + 4096, 768 << 10)
        );
        assert_eq!(
            (z.ty, z.cond),
            (ZoneType::SequentialRequired, ZoneCond::ImplicitOpen)
        );
        let z = decode_zone(&blk_zone(0, 2048, 0, 1, 0, 0), false).unwrap();
        assert_eq!((z.ty, z.capacity), (ZoneType::Conventional, 1 << 20));
        assert_eq!(
            decode_zone(&blk_zone(0, 8, 0, 2, 0xE, 8), true)
                .unwrap()
                .cond,
            ZoneCond::Full
        );
        assert!(decode_zone(&blk_zone(0, 8, 0, 3, 1, 8), true)
            .unwrap_err()
            .contains("host-aware"));
        assert!(decode_zone(&blk_zone(0, 8, 0, 2, 9, 8), true).is_err());
        // An offline zone's write pointer may be all ones: ignored.
        let z = decode_zone(&blk_zone(2048, 2048, u64::MAX, 2, 0xF, 2048), true).unwrap();
        assert_eq!((z.cond, z.wp), (ZoneCond::Offline, 1 << 20));
        // Layouts: conventional prefix, one size and capacity.
        let zs: Vec<Zone> = [
            blk_zone(0, 2048, 0, 1, 0, 2048),
            blk_zone(2048, 2048, 2048, 2, 1, 1536),
            blk_zone(4096, 2048, 4096, 2, 1, 1536),
        ]
        .iter()
        .map(|b| decode_zone(b, true).unwrap())
        .collect();
        let l = layout_of(&zs, 14, 14).unwrap();
        assert_eq!(
            (l.conventional_bytes, l.zone_bytes, l.zone_capacity, l.zones),
            (1 << 20, 1 << 20, 768 << 10, 2)
        );
        let mut odd = zs.clone();
        odd[2].capacity = 4096;
        assert!(layout_of(&odd, 0, 0).unwrap_err().contains("capacity"));
        odd[2] = zs[0];
        assert!(layout_of(&odd, 0, 0).unwrap_err().contains("follows"));
    }

    #[test]
    fn emulator_passes_the_conformance_rules() {
        let z = ZonedDevice::new(
            Arc::new(MemDevice::new("m", 16 << 20)),
            ZonedConfig {
                zone_bytes: 1 << 20,
                zone_capacity_bytes: 768 << 10,
                conventional_zones: 2,
                ..Default::default()
            },
        )
        .unwrap();
        zone_conformance(&z).unwrap();
        // And through the host side Lamina puts in front of it.
        let h = crate::zonehost::host(Arc::new(z));
        zone_conformance(&*h).unwrap();
    }

    /// The same rules on a kernel zoned device named by LAMINA_ZONED_DEVICE
    /// (its contents are destroyed). None exists on the build machine.
    #[test]
    fn kernel_zoned_device_passes_the_conformance_rules() {
        let Ok(path) = std::env::var("LAMINA_ZONED_DEVICE") else {
            eprintln!(
                "SKIPPED kernel_zoned_device_passes_the_conformance_rules: set LAMINA_ZONED_DEVICE=/dev/X \
                 (a host-managed SMR disk, a ZNS namespace or a zoned null_blk) to run it; tests/vm/rig.sh does"
            );
            return;
        };
        let f = FileDevice::open(
            std::path::Path::new(&path),
            crate::file::OpenMode::ReadWrite,
        )
        .unwrap();
        let d = open_if_zoned(f).unwrap();
        assert!(d.zone_layout().is_some(), "{path} is not host-managed");
        zone_conformance(&*d).unwrap();
    }
}
