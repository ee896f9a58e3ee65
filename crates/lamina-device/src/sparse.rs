//! A device in RAM that stores only the 4 KiB blocks written to it: a huge array
//! costs memory only for what is written. The simulator keeps an array's metadata
//! (superblocks, summaries) on one while the data itself is never stored.

use crate::{check_range, BlockDevice, DeviceError};
use std::collections::HashMap;
use std::sync::Mutex;

const BS: usize = 4096;

pub struct SparseDevice {
    name: String,
    size: u64,
    blocks: Mutex<HashMap<u64, Box<[u8; BS]>>>,
}

impl SparseDevice {
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        SparseDevice {
            name: name.into(),
            size,
            blocks: Mutex::new(HashMap::new()),
        }
    }

    /// Blocks stored.
    pub fn stored_blocks(&self) -> usize {
        self.blocks.lock().unwrap().len()
    }
}

impl BlockDevice for SparseDevice {
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        let blocks = self.blocks.lock().unwrap();
        let mut pos = 0usize;
        while pos < buf.len() {
            let at = offset + pos as u64;
            let (b, within) = (at / BS as u64, (at % BS as u64) as usize);
            let n = (BS - within).min(buf.len() - pos);
            match blocks.get(&b) {
                Some(data) => buf[pos..pos + n].copy_from_slice(&data[within..within + n]),
                None => buf[pos..pos + n].fill(0),
            }
            pos += n;
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        let mut blocks = self.blocks.lock().unwrap();
        let mut pos = 0usize;
        while pos < buf.len() {
            let at = offset + pos as u64;
            let (b, within) = (at / BS as u64, (at % BS as u64) as usize);
            let n = (BS - within).min(buf.len() - pos);
            let block = blocks.entry(b).or_insert_with(|| Box::new([0u8; BS]));
            block[within..within + n].copy_from_slice(&buf[pos..pos + n]);
            pos += n;
        }
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_only_what_is_written() {
        let d = SparseDevice::new("s", 1 << 40);
        d.write_at(&[5u8; 6000], (1 << 39) + 100).unwrap();
        assert_eq!(d.stored_blocks(), 2);
        let mut b = vec![1u8; 8192];
        d.read_at(&mut b, 1 << 39).unwrap();
        assert!(b[..100].iter().all(|&x| x == 0));
        assert!(b[100..6100].iter().all(|&x| x == 5));
        assert!(b[6100..].iter().all(|&x| x == 0));
    }
}
