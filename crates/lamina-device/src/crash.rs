//! A simulated disk that knows which writes are durable.
//!
//! Writes land in a volatile layer, as they would in a disk's cache or the page cache;
//! [`BlockDevice::sync`] moves them to the durable layer. [`CrashDevice::power_cut`]
//! returns the image a power cut would leave: the durable layer plus a random subset of
//! the volatile writes, some of them torn at 512-byte sector boundaries. Tests recover
//! an engine from that image and check that nothing acknowledged as durable was lost.

use crate::{check_range, BlockDevice, DeviceError};
use rand::Rng;
use std::collections::BTreeMap;
use std::sync::Mutex;

const SECTOR: usize = 512;

struct State {
    durable: Vec<u8>,
    /// Unsynced sectors, newest content per sector.
    volatile: BTreeMap<u64, [u8; SECTOR]>,
    syncs: u64,
}

pub struct CrashDevice {
    name: String,
    size: u64,
    state: Mutex<State>,
}

/// What survives a power cut.
#[derive(Clone, Copy, Debug)]
pub struct PowerCut {
    /// Probability that an unsynced sector reached the media.
    pub keep_probability: f64,
}

impl CrashDevice {
    pub fn new(name: impl Into<String>, size: u64) -> Self {
        Self::from_image(name, vec![0; size as usize])
    }

    pub fn from_image(name: impl Into<String>, image: Vec<u8>) -> Self {
        CrashDevice {
            name: name.into(),
            size: image.len() as u64,
            state: Mutex::new(State {
                durable: image,
                volatile: BTreeMap::new(),
                syncs: 0,
            }),
        }
    }

    /// The image left by a power cut now: durable data plus each unsynced sector with
    /// probability `keep_probability`. Sectors are kept independently, so a multi-sector
    /// write can be torn anywhere.
    pub fn power_cut(&self, rng: &mut impl Rng, cut: PowerCut) -> Vec<u8> {
        let st = self.state.lock().unwrap();
        let mut image = st.durable.clone();
        for (sector, data) in &st.volatile {
            if rng.gen_bool(cut.keep_probability) {
                let o = (*sector as usize) * SECTOR;
                image[o..o + SECTOR].copy_from_slice(data);
            }
        }
        image
    }

    /// Bytes written but not yet synced.
    pub fn unsynced_bytes(&self) -> usize {
        self.state.lock().unwrap().volatile.len() * SECTOR
    }

    /// Number of completed syncs.
    pub fn syncs(&self) -> u64 {
        self.state.lock().unwrap().syncs
    }
}

impl BlockDevice for CrashDevice {
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        let st = self.state.lock().unwrap();
        let o = offset as usize;
        buf.copy_from_slice(&st.durable[o..o + buf.len()]);
        let first = offset / SECTOR as u64;
        let last = (offset + buf.len() as u64).div_ceil(SECTOR as u64);
        for (sector, data) in st.volatile.range(first..last) {
            let s_start = *sector as usize * SECTOR;
            let lo = s_start.max(o);
            let hi = (s_start + SECTOR).min(o + buf.len());
            buf[lo - o..hi - o].copy_from_slice(&data[lo - s_start..hi - s_start]);
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        assert!(
            offset.is_multiple_of(SECTOR as u64) && buf.len().is_multiple_of(SECTOR),
            "crash device takes sector-aligned writes"
        );
        let mut st = self.state.lock().unwrap();
        for (i, chunk) in buf.chunks_exact(SECTOR).enumerate() {
            let sector = offset / SECTOR as u64 + i as u64;
            st.volatile.insert(sector, chunk.try_into().unwrap());
        }
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        let mut st = self.state.lock().unwrap();
        let volatile = std::mem::take(&mut st.volatile);
        for (sector, data) in volatile {
            let o = sector as usize * SECTOR;
            st.durable[o..o + SECTOR].copy_from_slice(&data);
        }
        st.syncs += 1;
        Ok(())
    }
    /// The harshest discard a drive may do: the range reads as zeros at once, and
    /// durably (so a test catches anything that still needed it).
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self, "discard", offset, len as usize)?;
        let mut st = self.state.lock().unwrap();
        let (o, n) = (offset as usize, len as usize);
        st.durable[o..o + n].fill(0);
        let (first, last) = (
            offset / SECTOR as u64,
            (offset + len).div_ceil(SECTOR as u64),
        );
        let gone: Vec<u64> = st.volatile.range(first..last).map(|(k, _)| *k).collect();
        for k in gone {
            st.volatile.remove(&k);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn synced_data_survives_unsynced_may_not() {
        let d = CrashDevice::new("t", 64 * 1024);
        d.write_at(&[1u8; 4096], 0).unwrap();
        d.sync().unwrap();
        d.write_at(&[2u8; 4096], 0).unwrap();
        d.write_at(&[3u8; 4096], 4096).unwrap();
        let mut b = [0u8; 4096];
        d.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [2u8; 4096], "reads see unsynced data");
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let lost = d.power_cut(
            &mut rng,
            PowerCut {
                keep_probability: 0.0,
            },
        );
        assert!(lost[..4096].iter().all(|&x| x == 1));
        assert!(lost[4096..8192].iter().all(|&x| x == 0));
        let kept = d.power_cut(
            &mut rng,
            PowerCut {
                keep_probability: 1.0,
            },
        );
        assert!(kept[..4096].iter().all(|&x| x == 2));
        let torn = d.power_cut(
            &mut rng,
            PowerCut {
                keep_probability: 0.5,
            },
        );
        let sectors_new = torn[..4096].chunks(512).filter(|s| s[0] == 2).count();
        assert!(sectors_new > 0 && sectors_new < 8, "a write can be torn");
    }
}
