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

pub mod crash;
pub mod fault;
pub mod file;
pub mod flash;
pub mod mem;
pub mod parity;
pub mod probe;
pub mod raid5;
pub mod sparse;
pub mod striped;
pub mod zoned;

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

/// A device the array stores segments on.
pub trait BlockDevice: Send + Sync + 'static {
    /// Usable size in bytes.
    fn size_bytes(&self) -> u64;
    /// Human-readable identity (a path) for messages.
    fn describe(&self) -> String;
    /// Reads exactly `buf.len()` bytes at `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError>;
    /// Writes all of `buf` at `offset`. Not durable until [`BlockDevice::sync`] returns.
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError>;
    /// Makes every completed write durable.
    fn sync(&self) -> Result<(), DeviceError>;
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
