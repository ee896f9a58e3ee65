//! Backing devices: where segments finally land.
//!
//! The engine sees every device through [`BlockDevice`]: positioned reads and writes of
//! whole 4 KiB-aligned ranges and a durability barrier. Implementations:
//!
//! * [`file::FileDevice`]: a regular file (sparse files are the embedded default) or a
//!   raw block device, with `pread`/`pwrite` and `fdatasync`, locked with `flock`
//!   so two processes never drive one device.
//! * [`mem::MemDevice`]: RAM, for tests and the simulator.
//! * [`fault::FaultDevice`]: fails reads, writes or syncs on demand, tears writes,
//!   vanishes, or slows down, wrapped around another device.
//! * [`crash::CrashDevice`]: RAM that keeps durable and not-yet-synced writes apart,
//!   and can "lose power", keeping a random subset of unsynced writes (some torn).
//!
//! The engine calls these from its I/O threads (writes, syncs) and from client
//! threads (reads); every implementation is `Send + Sync`.

pub mod aligned;
pub mod blkzoned;
pub mod crash;
pub mod dmsmr;
pub mod fault;
pub mod file;
pub mod flash;
pub mod mem;
pub mod parity;
pub mod probe;
pub mod raid5;
pub mod sparse;
pub mod striped;
pub mod uring;
pub mod zoned;
pub mod zonehost;

use std::io;

/// Errors from a device. Each names the operation and place, so a user reading
/// the log knows which device failed where.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The operating system reported an I/O error.
    #[error("{device}: {op} of {len} bytes at offset {offset} failed: {source}")]
    Io {
        device: String,
        op: &'static str,
        offset: u64,
        len: usize,
        #[source]
        source: io::Error,
    },
    /// A request outside the device. Always a bug in the caller.
    #[error("{device}: {op} of {len} bytes at offset {offset} is past the end ({size} bytes)")]
    OutOfRange {
        device: String,
        op: &'static str,
        offset: u64,
        len: usize,
        size: u64,
    },
    /// The device could not be opened or is unusable.
    #[error("{device}: {detail}")]
    Open { device: String, detail: String },
    /// A fault injected by a test device.
    #[error("{device}: injected fault on {op} at offset {offset}")]
    Injected {
        device: String,
        op: &'static str,
        offset: u64,
    },
}

/// A descriptor that a batch of [`uring::Op`]s may drive directly (see
/// [`BlockDevice::uring_target`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UringTarget {
    pub fd: std::os::unix::io::RawFd,
    /// Opened with `O_DIRECT`: buffers must be page-aligned ([`aligned`]).
    pub direct: bool,
}

/// A device the array stores segments on.
pub trait BlockDevice: Send + Sync + 'static {
    /// Usable size in bytes.
    fn size_bytes(&self) -> u64;
    /// Human-readable identity (a path) for messages.
    fn describe(&self) -> String;
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError>;
    /// Reads exactly `buf.len()` bytes at `offset` if that needs no wait for the
    /// device (the data is in memory, the page cache for a file): true when read,
    /// false when a read would have to wait (then `buf` holds nothing of use and
    /// nothing is counted against the device). The caller then reads with
    /// [`BlockDevice::read_at`] where waiting is fine. The default never reads.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> Result<bool, DeviceError> {
        let _ = (buf, offset);
        Ok(false)
    }
    /// Starts bringing `[offset, offset + len)` into memory for reads soon to come
    /// (NBD_CMD_CACHE): a hint that never waits and never fails. The default does
    /// nothing.
    fn prefetch(&self, offset: u64, len: u64) {
        let _ = (offset, len);
    }
    /// Writes all of `buf` at `offset`. Not durable until [`BlockDevice::sync`] returns.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError>;
    /// Makes every completed write durable.
    fn sync(&self) -> Result<(), DeviceError>;
    /// For a plain file or block device driven through io_uring: its descriptor, so
    /// that an array can put the operations of several members into one batch
    /// ([`uring::run`]). `None` (the default) for every device that does more than
    /// pass reads and writes through.
    fn uring_target(&self) -> Option<UringTarget> {
        None
    }
    /// Tells the device that `[offset, offset + len)` holds nothing of value any
    /// more (TRIM / UNMAP / hole punching), so that an SSD's garbage collection
    /// need not copy it. Advisory: reads of the range may return old data or
    /// zeros. The default does nothing.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let _ = (offset, len);
        Ok(())
    }
    /// Runs `f` with the zone holding `offset` quiet: no write of it in flight and
    /// none let through until `f` returns; `f` gets the zone's progress (see
    /// [`BlockDevice::zone_progress`]), `None` for devices without a host-side
    /// write plug.
    fn with_zone_held(
        &self,
        offset: u64,
        f: &mut dyn FnMut(Option<(u64, u64)>) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let _ = offset;
        f(None)
    }
    /// The write pointer of the zone holding `offset` as the host-side write plug
    /// tracks it, and how many times the zone was reset (so that a caller can tell
    /// that what it saw below the write pointer was replaced).
    fn zone_progress(&self, offset: u64) -> Option<(u64, u64)> {
        let _ = offset;
        None
    }
    /// How the device is zoned; `None` for a device that takes writes anywhere.
    fn zone_layout(&self) -> Option<ZoneLayout> {
        None
    }
    /// Every zone (conventional ones included) with its condition and write
    /// pointer, as the device reports them.
    fn report_zones(&self) -> Result<Vec<zoned::Zone>, DeviceError> {
        Err(not_zoned(self, "report zones", 0))
    }
    /// Resets the sequential zone holding `offset`: empty, write pointer at its start.
    fn reset_zone(&self, offset: u64) -> Result<(), DeviceError> {
        Err(not_zoned(self, "reset zone", offset))
    }
    /// Finishes the sequential zone holding `offset`: full, whatever was written.
    /// A host-side write plug ([`zonehost::Plug`]) first waits until the writes
    /// below `offset` in that zone have completed.
    fn finish_zone(&self, offset: u64) -> Result<(), DeviceError> {
        Err(not_zoned(self, "finish zone", offset))
    }
}

/// The zones of a zoned device as its user sees them: conventional zones first
/// (writable anywhere), then `zones` sequential-write-required zones of
/// `zone_bytes` each, of which the first `zone_capacity` bytes are writable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ZoneLayout {
    pub conventional_bytes: u64,
    pub zone_bytes: u64,
    pub zone_capacity: u64,
    pub zones: u64,
    /// Open and active zone limits (0: none).
    pub max_open: u32,
    pub max_active: u32,
}

impl ZoneLayout {
    /// Most zones that may be written at once: the tighter of the two limits
    /// (0: no limit). Lamina never closes a zone explicitly, so every zone it has
    /// written and not filled is both open and active.
    pub fn open_limit(&self) -> u32 {
        match (self.max_open, self.max_active) {
            (0, a) => a,
            (o, 0) => o,
            (o, a) => o.min(a),
        }
    }
    /// The sequential zone holding `offset`, if any.
    pub fn zone_of(&self, offset: u64) -> Option<u64> {
        let z = offset.checked_sub(self.conventional_bytes)? / self.zone_bytes;
        (z < self.zones).then_some(z)
    }
    /// Byte offset where sequential zone `z` starts.
    pub fn zone_start(&self, z: u64) -> u64 {
        self.conventional_bytes + z * self.zone_bytes
    }
}

fn not_zoned(device: &(impl BlockDevice + ?Sized), op: &'static str, offset: u64) -> DeviceError {
    DeviceError::Io {
        device: device.describe(),
        op,
        offset,
        len: 0,
        source: io::Error::new(io::ErrorKind::Unsupported, "not a zoned device"),
    }
}

/// Checks that `[offset, offset+len)` lies within a device of `size` bytes.
pub fn check_range(
    device: &dyn BlockDevice,
    op: &'static str,
    offset: u64,
    len: usize,
) -> Result<(), DeviceError> {
    let size = device.size_bytes();
    if offset.checked_add(len as u64).is_none_or(|end| end > size) {
        return Err(DeviceError::OutOfRange {
            device: device.describe(),
            op,
            offset,
            len,
            size,
        });
    }
    Ok(())
}
