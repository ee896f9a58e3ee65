//! A device in RAM. Reads and writes take a lock; this is for tests and tools, not
//! for the hot path of a server.

use crate::{check_range, BlockDevice, DeviceError};
use std::sync::RwLock;

pub struct MemDevice {
    name: String,
    data: RwLock<Vec<u8>>,
}

impl MemDevice {
    /// A zero-filled device of `size` bytes.
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        Self::from_image(name, vec![0; size as usize])
    }
    /// A device holding `image`.
    pub fn from_image(name: impl Into<String>, image: Vec<u8>) -> Self {
        MemDevice {
            name: name.into(),
            data: RwLock::new(image),
        }
    }
    /// A copy of the whole content.
    pub fn image(&self) -> Vec<u8> {
        self.data.read().unwrap().clone()
    }
}

impl BlockDevice for MemDevice {
    fn size_bytes(&self) -> u64 {
        self.data.read().unwrap().len() as u64
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        let d = self.data.read().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    /// Memory never makes a reader wait.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> Result<bool, DeviceError> {
        self.read_at(buf, offset).map(|()| true)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        let mut d = self.data.write().unwrap();
        d[offset as usize..offset as usize + buf.len()].copy_from_slice(buf);
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    /// Discarded ranges read as zeros (what a drive with deterministic zeroes
    /// after TRIM returns; tests then catch anything that still needed them).
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self, "discard", offset, len as usize)?;
        let o = offset as usize;
        self.data.write().unwrap()[o..o + len as usize].fill(0);
        Ok(())
    }
}

/// A device that keeps nothing: writes vanish, reads return zeros. For emulators
/// whose timing alone is measured (the drive-managed SMR peer of the SMR bench).
pub struct NullDevice {
    name: String,
    size: u64,
}

impl NullDevice {
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        NullDevice {
            name: name.into(),
            size,
        }
    }
}

impl BlockDevice for NullDevice {
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        buf.fill(0);
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        Ok(())
    }
}
