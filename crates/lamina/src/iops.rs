//! `lamina bench iops`: SALSA 5.1.1 on emulated SSDs. 4 KiB random reads and writes
//! (80/20 by default) at queue depths 1 to 32 on an array of emulated TLC SSDs:
//! RAID-0 and RAID-5 (read-modify-write) straight on the drives against Lamina
//! SAID5 on the same drives. Throughput and latency come from the drives' timing
//! model (`Flash::submit` on a virtual clock: dies and channels, program and read
//! latencies, and the drives' own garbage collection).
//!
//! The raw arrays translate each request into drive operations directly. Lamina
//! runs for real, in this process: its device operations (unit writes, GC reads
//! and writes, summaries, checkpoints, reads of data not in the write buffer) are
//! recorded per client request, then replayed on fresh drives for each queue
//! depth. A write Lamina acknowledges from its buffer completes at once; a write
//! that made Lamina write a unit, a summary or GC waits for those (back-pressure);
//! a read waits for its drive read.
//!
//! Every array is first filled and then overwritten at random twice, so that the
//! drives (and Lamina) are in their steady state when requests are timed.

use anyhow::Result;
use lamina_device::flash::{Cell, Flash, FlashConfig, FlashOp};
use lamina_device::mem::{MemDevice, NullDevice};
use lamina_device::{BlockDevice, DeviceError};
use rand::{Rng, SeedableRng};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};

const BS: u64 = 4096;
/// Time a request served from RAM takes (Lamina's write buffer).
const RAM_US: u64 = 5;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Discard,
}

#[derive(Clone, Copy, Debug)]
struct DevOp {
    member: usize,
    kind: OpKind,
    offset: u64,
    len: u64,
}

impl DevOp {
    /// Replays the operation on drive `d` at `at`; returns its completion (a
    /// discard only updates the drive's map and takes no time).
    fn replay(&self, d: &Flash, at: u64) -> u64 {
        let (offset, len) = (self.offset, self.len);
        match self.kind {
            OpKind::Read => d.submit(FlashOp::Read { offset, len }, at),
            OpKind::Write => d.submit(FlashOp::Write { offset, len }, at),
            OpKind::Discard => {
                let _ = d.discard(offset, len);
                at
            }
        }
    }
}

/// A member device that logs every read and write it serves.
struct Recorder {
    inner: MemDevice,
    member: usize,
    log: Arc<Mutex<Vec<DevOp>>>,
}

impl BlockDevice for Recorder {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(DevOp {
            member: self.member,
            kind: OpKind::Read,
            offset,
            len: buf.len() as u64,
        });
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(DevOp {
            member: self.member,
            kind: OpKind::Write,
            offset,
            len: buf.len() as u64,
        });
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.log.lock().unwrap().push(DevOp {
            member: self.member,
            kind: OpKind::Discard,
            offset,
            len,
        });
        self.inner.discard(offset, len)
    }
}

/// A client request: read or write of one 4 KiB block.
#[derive(Clone, Copy)]
struct Req {
    write: bool,
    block: u64,
}

fn requests(n: usize, blocks: u64, read_percent: u32, seed: u64) -> Vec<Req> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .map(|_| Req {
            write: rng.gen_range(0..100) >= read_percent,
            block: rng.gen_range(0..blocks),
        })
        .collect()
}

/// Runs `n` requests with `qd` outstanding; `issue(i, t)` submits request `i` at
/// time `t` and returns its completion. Returns (requests per second, mean latency
/// in microseconds).
fn closed_loop(n: usize, qd: usize, mut issue: impl FnMut(usize, u64) -> u64) -> (f64, f64) {
    let mut heap = BinaryHeap::new();
    let mut next = 0;
    let mut lat = 0u64;
    let mut end = 0u64;
    while next < n.min(qd) {
        let c = issue(next, 0);
        heap.push(Reverse((c, 0u64)));
        next += 1;
    }
    while let Some(Reverse((c, started))) = heap.pop() {
        lat += c - started;
        end = end.max(c);
        if next < n {
            let d = issue(next, c);
            heap.push(Reverse((d.max(c), c)));
            next += 1;
        }
    }
    (n as f64 * 1e6 / end.max(1) as f64, lat as f64 / n as f64)
}

fn drives(n: usize, cfg: &FlashConfig) -> Result<Vec<Flash>> {
    (0..n)
        .map(|i| {
            Ok(Flash::new(
                Arc::new(NullDevice::new(format!("ssd{i}"), cfg.capacity_bytes)),
                cfg.clone(),
            )?)
        })
        .collect()
}

/// Fills every drive and overwrites it at random `passes` times with 4 KiB writes;
/// returns when the drives are idle again (timed requests start there).
fn precondition_raw(d: &[Flash], cap: u64, passes: u32) -> u64 {
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    for f in d {
        for b in 0..cap / BS {
            f.submit(
                FlashOp::Write {
                    offset: b * BS,
                    len: BS,
                },
                0,
            );
        }
        for _ in 0..passes as u64 * cap / BS {
            let b = rng.gen_range(0..cap / BS);
            f.submit(
                FlashOp::Write {
                    offset: b * BS,
                    len: BS,
                },
                0,
            );
        }
    }
    idle(d)
}

/// When every drive is done with what it was given.
fn idle(d: &[Flash]) -> u64 {
    d.iter().map(|f| f.stats().clock_us).max().unwrap_or(0)
}

/// RAID-0 with `chunk`-byte chunks over the drives: member and offset of a block.
fn raid0_place(n: usize, chunk: u64, block: u64) -> (usize, u64) {
    let per = chunk / BS;
    let c = block / per;
    (
        (c % n as u64) as usize,
        (c / n as u64) * chunk + (block % per) * BS,
    )
}

/// RAID-5 (left-symmetric rotation): data member, parity member, member offset.
fn raid5_place(n: usize, chunk: u64, block: u64) -> (usize, usize, u64) {
    let per = chunk / BS;
    let c = block / per;
    let k = (n - 1) as u64;
    let stripe = c / k;
    let parity = (n as u64 - 1 - stripe % n as u64) as usize;
    let mut data = (c % k) as usize;
    if data >= parity {
        data += 1;
    }
    (data, parity, stripe * chunk + (block % per) * BS)
}

pub struct Row {
    pub qd: usize,
    pub raid0: (f64, f64),
    pub raid5: (f64, f64),
    pub lamina: (f64, f64),
}

#[allow(clippy::too_many_arguments)]
pub fn run(
    ssds: usize,
    capacity: u64,
    read_percent: u32,
    depths: &[usize],
    ops: usize,
    op: f64,
    chunk: u64,
) -> Result<(Vec<Row>, serde_json::Value)> {
    if ssds < 3 {
        anyhow::bail!("RAID-5 and SAID5 need at least 3 drives");
    }
    if read_percent > 100 {
        anyhow::bail!("read percentage {read_percent} is above 100");
    }
    let cfg = FlashConfig {
        capacity_bytes: capacity,
        cell: Cell::Tlc,
        ..Default::default()
    };
    cfg.validate().map_err(anyhow::Error::msg)?;
    if chunk == 0 || !chunk.is_multiple_of(BS) || !capacity.is_multiple_of(chunk) {
        anyhow::bail!("the RAID chunk must be a multiple of 4 KiB dividing the drive capacity");
    }
    let passes = 2;

    // Lamina SAID5: the real engine, its device operations recorded.
    let log = Arc::new(Mutex::new(Vec::new()));
    let members: Vec<Arc<dyn BlockDevice>> = (0..ssds)
        .map(|i| {
            Arc::new(Recorder {
                inner: MemDevice::new(format!("ssd{i}"), capacity),
                member: i,
                log: log.clone(),
            }) as Arc<dyn BlockDevice>
        })
        .collect();
    let params = lamina_core::FormatParams {
        name: "iops".into(),
        layout: lamina_format::superblock::Layout::Said5,
        // A member's chunk of a stripe is one erase block of the drive.
        segment_blocks: (cfg.block_bytes() / BS) as u32,
        overprovision: op,
        ..Default::default()
    };
    let mut l = crate::bench::Inline::new(members, &params, Default::default())?;
    let vol_blocks = l.volume_bytes / BS;
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    for b in 0..vol_blocks {
        l.write(b * BS, BS as usize);
    }
    for _ in 0..passes as u64 * vol_blocks {
        l.write(rng.gen_range(0..vol_blocks) * BS, BS as usize);
    }
    l.flush()?;
    let warm: Vec<DevOp> = std::mem::take(&mut *log.lock().unwrap());
    let reqs = requests(ops, vol_blocks, read_percent, 13);
    let vol = l.e.shared().volume("v").unwrap();
    let mut per_req: Vec<Vec<DevOp>> = Vec::with_capacity(ops);
    let mut buf = vec![0u8; BS as usize];
    for r in &reqs {
        if r.write {
            l.write_now(r.block * BS, BS as usize);
        } else {
            l.e.shared()
                .read(&vol, r.block * BS, &mut buf)
                .map_err(|e| anyhow::anyhow!("read of block {}: {e:?}", r.block))?;
        }
        per_req.push(std::mem::take(&mut *log.lock().unwrap()));
    }
    // What the requests left in the write buffer is paid for too: the last
    // request waits for the final flush.
    l.flush()?;
    if let Some(last) = per_req.last_mut() {
        last.extend(std::mem::take(&mut *log.lock().unwrap()));
    }
    let lamina_status = l.e.status();
    drop(l);

    let raw_reqs = requests(ops, ssds as u64 * capacity / BS, read_percent, 13);
    let raid5_blocks = (ssds as u64 - 1) * capacity / BS;
    let raid5_reqs = requests(ops, raid5_blocks, read_percent, 13);
    let mut rows = Vec::new();
    for &qd in depths {
        // RAID-0.
        let d = drives(ssds, &cfg)?;
        let t0 = precondition_raw(&d, capacity, passes);
        let raid0 = closed_loop(ops, qd, |i, t| {
            let t = t0 + t;
            let r = raw_reqs[i];
            let (m, off) = raid0_place(ssds, chunk, r.block);
            let op = if r.write {
                FlashOp::Write {
                    offset: off,
                    len: BS,
                }
            } else {
                FlashOp::Read {
                    offset: off,
                    len: BS,
                }
            };
            d[m].submit(op, t) - t0
        });
        // RAID-5: a small write reads old data and parity, then writes both.
        let d = drives(ssds, &cfg)?;
        let t0 = precondition_raw(&d, capacity, passes);
        let raid5 = closed_loop(ops, qd, |i, t| {
            let t = t0 + t;
            let r = raid5_reqs[i];
            let (m, p, off) = raid5_place(ssds, chunk, r.block);
            let read = FlashOp::Read {
                offset: off,
                len: BS,
            };
            if !r.write {
                return d[m].submit(read, t) - t0;
            }
            let got = d[m].submit(read, t).max(d[p].submit(read, t));
            let write = FlashOp::Write {
                offset: off,
                len: BS,
            };
            d[m].submit(write, got).max(d[p].submit(write, got)) - t0
        });
        // Lamina: fresh drives that took the same warm-up writes, then the
        // recorded operations of each request.
        let d = drives(ssds, &cfg)?;
        for o in &warm {
            o.replay(&d[o.member], 0);
        }
        // The warm-up left the drives' clocks far ahead; requests start after it.
        let t0 = idle(&d);
        let lamina = closed_loop(ops, qd, |i, t| {
            let at = t0 + t;
            let done = per_req[i]
                .iter()
                .map(|o| o.replay(&d[o.member], at))
                .max()
                .unwrap_or(at + RAM_US);
            done - t0
        });
        rows.push(Row {
            qd,
            raid0,
            raid5,
            lamina,
        });
    }
    let json = serde_json::json!({
        "ssds": ssds, "capacity_bytes": capacity, "read_percent": read_percent,
        "requests": ops, "raid_chunk_bytes": chunk,
        "lamina_volume_bytes": vol_blocks * BS,
        "lamina_write_amplification": lamina_status.write_amplification,
        "rows": rows.iter().map(|r| serde_json::json!({
            "queue_depth": r.qd,
            "raid0_iops": r.raid0.0, "raid0_latency_us": r.raid0.1,
            "raid5_iops": r.raid5.0, "raid5_latency_us": r.raid5.1,
            "lamina_iops": r.lamina.0, "lamina_latency_us": r.lamina.1,
        })).collect::<Vec<_>>(),
    });
    Ok((rows, json))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raid_placement() {
        // RAID-0, 64 KiB chunks over 5: block 16 starts chunk 1 on member 1.
        assert_eq!(raid0_place(5, 64 << 10, 16), (1, 0));
        assert_eq!(
            raid0_place(5, 64 << 10, 5 * 16 + 3),
            (0, (64 << 10) + 3 * BS)
        );
        // RAID-5 over 5: stripe 0 has parity on member 4, stripe 1 on member 3.
        assert_eq!(raid5_place(5, 64 << 10, 0), (0, 4, 0));
        assert_eq!(raid5_place(5, 64 << 10, 4 * 16), (0, 3, 64 << 10));
        let (d, p, _) = raid5_place(5, 64 << 10, 4 * 16 + 3 * 16);
        assert_eq!((d, p), (4, 3), "data skips the parity member");
    }

    #[test]
    fn closed_loop_keeps_the_depth() {
        // Each request takes 100 us on its own: QD 4 runs four at a time.
        let (iops, lat) = closed_loop(100, 4, |_, t| t + 100);
        assert!((iops - 40_000.0).abs() < 1.0, "{iops}");
        assert!((lat - 100.0).abs() < 1e-9);
    }
}
