//! Classic RAID-5 with read-modify-write, as a yardstick for the benchmarks.
//!
//! Members are striped in chunks (left-symmetric parity rotation, as Linux md's
//! default). A write that covers less than a whole stripe updates parity the way
//! md does for small writes: read the old data and the old parity, write the new
//! data and the new parity `P' = P ^ D ^ D'`: 2 reads and 2 writes per block. This
//! is what SAID5 avoids by writing whole stripes out of place. Not used to store
//! anything; counts what it reads and writes.

use crate::parity::xor_into;
use crate::{BlockDevice, DeviceError};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

const BLOCK: usize = 4096;

pub struct Raid5Rmw {
    members: Vec<Arc<dyn BlockDevice>>,
    chunk: u64,
    rows: u64,
    locks: Vec<Mutex<()>>,
    pub bytes_read: AtomicU64,
    pub bytes_written: AtomicU64,
    pub user_bytes_written: AtomicU64,
}

impl Raid5Rmw {
    /// `chunk_bytes` per member per stripe (a multiple of 4 KiB).
    pub fn new(members: Vec<Arc<dyn BlockDevice>>, chunk_bytes: u64) -> Result<Self, DeviceError> {
        let smallest = members.iter().map(|m| m.size_bytes()).min().unwrap_or(0);
        if members.len() < 3 || chunk_bytes == 0 || !chunk_bytes.is_multiple_of(BLOCK as u64) {
            return Err(DeviceError::Open {
                device: "raid5".into(),
                detail: "RAID-5 needs 3+ members and a chunk that is a multiple of 4 KiB".into(),
            });
        }
        Ok(Raid5Rmw {
            rows: smallest / chunk_bytes,
            chunk: chunk_bytes,
            locks: (0..256).map(|_| Mutex::new(())).collect(),
            members,
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            user_bytes_written: AtomicU64::new(0),
        })
    }

    /// Member and byte offset of data block `b`, and of its parity.
    fn place(&self, b: u64) -> (usize, u64, usize) {
        let n = self.members.len() as u64;
        let per_chunk = self.chunk / BLOCK as u64;
        let stripe = b / (per_chunk * (n - 1));
        let within = b % (per_chunk * (n - 1));
        let (col, off) = (within / per_chunk, within % per_chunk);
        let parity = (n - 1 - stripe % n) as usize;
        // Left-symmetric: data columns start after the parity member.
        let member = ((parity as u64 + 1 + col) % n) as usize;
        (member, stripe * self.chunk + off * BLOCK as u64, parity)
    }
}

impl BlockDevice for Raid5Rmw {
    fn size_bytes(&self) -> u64 {
        self.rows * self.chunk * (self.members.len() as u64 - 1)
    }
    fn describe(&self) -> String {
        format!("raid5-rmw({} members)", self.members.len())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        crate::check_range(self, "read", offset, buf.len())?;
        for (i, blk) in buf.chunks_mut(BLOCK).enumerate() {
            let (m, off, _) = self.place(offset / BLOCK as u64 + i as u64);
            self.members[m].read_at(blk, off)?;
            self.bytes_read.fetch_add(BLOCK as u64, Ordering::Relaxed);
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        crate::check_range(self, "write", offset, buf.len())?;
        let mut old = [0u8; BLOCK];
        let mut par = [0u8; BLOCK];
        for (i, blk) in buf.chunks(BLOCK).enumerate() {
            let (m, off, p) = self.place(offset / BLOCK as u64 + i as u64);
            let _g = self.locks[(off / self.chunk) as usize % self.locks.len()]
                .lock()
                .unwrap();
            self.members[m].read_at(&mut old, off)?;
            self.members[p].read_at(&mut par, off)?;
            xor_into(&mut par, &old);
            xor_into(&mut par, blk);
            self.members[m].write_at(blk, off)?;
            self.members[p].write_at(&par, off)?;
            self.bytes_read
                .fetch_add(2 * BLOCK as u64, Ordering::Relaxed);
            self.bytes_written
                .fetch_add(2 * BLOCK as u64, Ordering::Relaxed);
        }
        self.user_bytes_written
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        for m in &self.members {
            m.sync()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemDevice;

    #[test]
    fn small_writes_cost_two_reads_two_writes_and_keep_parity() {
        let ms: Vec<Arc<dyn BlockDevice>> = (0..4)
            .map(|i| Arc::new(MemDevice::new(format!("m{i}"), 1 << 20)) as _)
            .collect();
        let r = Raid5Rmw::new(ms.clone(), 64 << 10).unwrap();
        for b in [0u64, 5, 17, 40, 100] {
            r.write_at(&[b as u8 + 1; BLOCK], b * BLOCK as u64).unwrap();
        }
        assert_eq!(
            r.bytes_written.load(Ordering::Relaxed),
            5 * 2 * BLOCK as u64
        );
        assert_eq!(r.bytes_read.load(Ordering::Relaxed), 5 * 2 * BLOCK as u64);
        let mut got = [0u8; BLOCK];
        r.read_at(&mut got, 17 * BLOCK as u64).unwrap();
        assert_eq!(got, [18u8; BLOCK]);
        // Every row's parity is the XOR of its data.
        for off in (0..(1u64 << 20)).step_by(BLOCK) {
            let mut x = [0u8; BLOCK];
            for m in &ms {
                let mut b = [0u8; BLOCK];
                m.read_at(&mut b, off).unwrap();
                xor_into(&mut x, &b);
            }
            assert!(x.iter().all(|&v| v == 0), "row at {off}");
        }
    }
}
