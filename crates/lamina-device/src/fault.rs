//! A device that fails on demand, wrapped around another device.
//!
//! Tests arm faults at run time: fail reads or writes that touch a byte range, tear
//! writes (only a prefix reaches the inner device), make the device vanish (every
//! operation fails), slow it down, or make it lie: writes silently dropped, or
//! silently stored somewhere else (misdirected).

use crate::{BlockDevice, DeviceError};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Which operations a fault applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FaultOp {
    Read,
    Write,
    Sync,
}

#[derive(Clone, Debug)]
struct Fault {
    op: FaultOp,
    start: u64,
    end: u64,
    /// Remaining times it fires; `u64::MAX` for ever.
    remaining: u64,
    /// Matching accesses let through before it starts firing.
    skip: u64,
}

pub struct FaultDevice {
    inner: Arc<dyn BlockDevice>,
    faults: Mutex<Vec<Fault>>,
    gone: AtomicBool,
    /// Writes touching this range store only their first half (a torn write),
    /// then report success.
    tear: Mutex<Option<(u64, u64)>>,
    delay_us: AtomicU64,
    injected: AtomicU64,
    /// Writes report success but are not stored.
    drop_writes: AtomicBool,
    /// Writes report success but land this many bytes further (0: where asked;
    /// past the end they are lost).
    misdirect: AtomicU64,
    /// The ranges `prefetch` was asked for (passed on too).
    pub prefetched: Mutex<Vec<(u64, u64)>>,
}

impl FaultDevice {
    pub fn new(inner: Arc<dyn BlockDevice>) -> Self {
        FaultDevice {
            inner,
            faults: Mutex::new(Vec::new()),
            gone: AtomicBool::new(false),
            tear: Mutex::new(None),
            delay_us: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            drop_writes: AtomicBool::new(false),
            misdirect: AtomicU64::new(0),
            prefetched: Mutex::new(Vec::new()),
        }
    }

    /// Fails `op` on any access overlapping `[start, end)`, `times` times.
    pub fn fail(&self, op: FaultOp, start: u64, end: u64, times: u64) {
        self.fail_after(op, start, end, 0, times);
    }

    /// Like [`FaultDevice::fail`], but the first `skip` matching accesses succeed.
    pub fn fail_after(&self, op: FaultOp, start: u64, end: u64, skip: u64, times: u64) {
        self.faults.lock().unwrap().push(Fault {
            op,
            start,
            end,
            remaining: times,
            skip,
        });
    }

    /// Removes all armed faults and brings the device back.
    pub fn heal(&self) {
        self.faults.lock().unwrap().clear();
        *self.tear.lock().unwrap() = None;
        self.gone.store(false, Ordering::SeqCst);
        self.drop_writes.store(false, Ordering::SeqCst);
        self.misdirect.store(0, Ordering::SeqCst);
    }

    /// Writes report success and are silently not stored (a drive that lies).
    pub fn drop_writes(&self) {
        self.drop_writes.store(true, Ordering::SeqCst);
    }

    /// Writes report success and are silently stored `delta` bytes further on.
    pub fn misdirect_writes(&self, delta: u64) {
        self.misdirect.store(delta, Ordering::SeqCst);
    }

    /// Every operation fails from now on, as when a disk is pulled.
    pub fn vanish(&self) {
        self.gone.store(true, Ordering::SeqCst);
    }

    /// Writes overlapping `[start, end)` are torn: half is written, success reported.
    pub fn tear_writes(&self, start: u64, end: u64) {
        *self.tear.lock().unwrap() = Some((start, end));
    }

    /// Adds latency to every operation.
    pub fn slow_down(&self, delay: Duration) {
        self.delay_us
            .store(delay.as_micros() as u64, Ordering::SeqCst);
    }

    /// Faults that fired so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    fn check(
        &self,
        op: FaultOp,
        offset: u64,
        len: usize,
        name: &'static str,
    ) -> Result<(), DeviceError> {
        let d = self.delay_us.load(Ordering::Relaxed);
        if d > 0 {
            std::thread::sleep(Duration::from_micros(d));
        }
        let err = || DeviceError::Injected {
            device: self.describe(),
            op: name,
            offset,
        };
        if self.gone.load(Ordering::SeqCst) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(err());
        }
        let end = offset + len as u64;
        let mut faults = self.faults.lock().unwrap();
        for f in faults.iter_mut() {
            let hit = f.op == op
                && f.remaining > 0
                && (op == FaultOp::Sync || (offset < f.end && end > f.start));
            if hit && f.skip > 0 {
                f.skip -= 1;
                continue;
            }
            if hit {
                if f.remaining != u64::MAX {
                    f.remaining -= 1;
                }
                self.injected.fetch_add(1, Ordering::SeqCst);
                return Err(err());
            }
        }
        Ok(())
    }
}

impl BlockDevice for FaultDevice {
    fn prefetch(&self, offset: u64, len: u64) {
        self.prefetched.lock().unwrap().push((offset, len));
        self.inner.prefetch(offset, len);
    }
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn describe(&self) -> String {
        format!("fault({})", self.inner.describe())
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.check(FaultOp::Read, offset, buf.len(), "read")?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.check(FaultOp::Write, offset, buf.len(), "write")?;
        let torn = self
            .tear
            .lock()
            .unwrap()
            .is_some_and(|(s, e)| offset < e && offset + buf.len() as u64 > s);
        if torn {
            let half = (buf.len() / 2) & !511;
            self.injected.fetch_add(1, Ordering::SeqCst);
            return self.inner.write_at(&buf[..half], offset);
        }
        if self.drop_writes.load(Ordering::SeqCst) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Ok(());
        }
        let delta = self.misdirect.load(Ordering::SeqCst);
        if delta > 0 {
            self.injected.fetch_add(1, Ordering::SeqCst);
            let to = offset + delta;
            if to + buf.len() as u64 <= self.size_bytes() {
                return self.inner.write_at(buf, to);
            }
            return Ok(());
        }
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.check(FaultOp::Sync, 0, 0, "sync")?;
        self.inner.sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemDevice;

    #[test]
    fn faults_fire_where_armed() {
        let d = FaultDevice::new(Arc::new(MemDevice::new("m", 1 << 20)));
        d.fail(FaultOp::Read, 8192, 12288, 1);
        let mut b = [0u8; 4096];
        assert!(d.read_at(&mut b, 0).is_ok());
        assert!(d.read_at(&mut b, 8192).is_err());
        assert!(d.read_at(&mut b, 8192).is_ok(), "fired once only");
        d.vanish();
        assert!(d.write_at(&b, 0).is_err());
        d.heal();
        d.tear_writes(0, 4096);
        d.write_at(&[9u8; 4096], 0).unwrap();
        d.heal();
        d.read_at(&mut b, 0).unwrap();
        assert!(b[..2048].iter().all(|&x| x == 9) && b[2048..].iter().all(|&x| x == 0));
        assert_eq!(d.injected(), 3);
    }
}
