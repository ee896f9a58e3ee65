//! An emulated flash SSD: NAND geometry, a page-mapped FTL with an indirection unit,
//! device over-provisioning, greedy garbage collection, wear, and a timing model on
//! a virtual clock.
//!
//! The data itself lives in an inner device at its logical offset (a file or RAM):
//! the FTL here is the drive's bookkeeping, which decides what the NAND would have
//! to do (program, read, erase, where and when), and counts it. That is what the
//! emulator is for: device-level write amplification, erase counts and latency,
//! deterministic, with the data kept exactly.
//!
//! * **Indirection unit (IU).** The FTL maps logical IUs (4 KiB, or 16/64 KiB as
//!   large QLC drives use) to physical IU slots. A write that covers an IU only in
//!   part costs a read-modify-write of the whole IU: the old IU is read and the
//!   whole IU programmed again.
//! * **Garbage collection.** Blocks are filled one IU slot after another; when free
//!   blocks run low the block with the fewest valid slots is collected (its valid
//!   slots moved to the GC block, then erased).
//! * **Timing.** Each block belongs to a die (round robin over channels × dies ×
//!   planes); a program or read occupies its die for the cell type's latency and its
//!   channel for the transfer; an erase occupies the die. [`Flash::submit`] takes the
//!   virtual time a request arrives and returns when it completes, so queue depths
//!   above 1 overlap on different dies. The [`BlockDevice`] methods run at queue
//!   depth 1 on the device's own clock.

use crate::{check_range, BlockDevice, DeviceError};
use std::sync::{Arc, Mutex};

/// NAND cell types and their published latencies (microseconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cell {
    Slc,
    Mlc,
    Tlc,
    Qlc,
}

impl Cell {
    /// (read, program, erase) in microseconds, middle-of-range values from
    /// published simulators (MQSim, FEMU, SSDsim defaults and datasheets).
    pub fn latency_us(self) -> (u64, u64, u64) {
        match self {
            Cell::Slc => (25, 200, 1500),
            Cell::Mlc => (50, 600, 3000),
            Cell::Tlc => (75, 1000, 3500),
            Cell::Qlc => (120, 2500, 5000),
        }
    }
    /// Program/erase cycles a block of this cell type is rated for (typical
    /// datasheet figures).
    pub fn rated_pe_cycles(self) -> u64 {
        match self {
            Cell::Slc => 100_000,
            Cell::Mlc => 10_000,
            Cell::Tlc => 3_000,
            Cell::Qlc => 1_000,
        }
    }
    pub fn parse(s: &str) -> Option<Cell> {
        Some(match s {
            "slc" => Cell::Slc,
            "mlc" => Cell::Mlc,
            "tlc" => Cell::Tlc,
            "qlc" => Cell::Qlc,
            _ => return None,
        })
    }
}

/// Geometry and behaviour of an emulated SSD.
#[derive(Clone, Debug)]
pub struct FlashConfig {
    /// Bytes the host sees.
    pub capacity_bytes: u64,
    pub page_bytes: u64,
    pub pages_per_block: u64,
    /// Indirection unit of the FTL's map.
    pub iu_bytes: u64,
    /// Spare NAND as a fraction of the capacity (0.07 = 7%).
    pub overprovision: f64,
    pub channels: u32,
    pub dies_per_channel: u32,
    pub planes_per_die: u32,
    pub cell: Cell,
    /// Channel bandwidth, bytes per microsecond (800 MB/s = 800).
    pub channel_bytes_per_us: u64,
    /// Data lives on the die its logical address picks (a block-mapped drive),
    /// rather than on the die of the block it was written to (page-mapped: by
    /// write order). Only the timing differs.
    pub lba_placement: bool,
}

impl Default for FlashConfig {
    fn default() -> Self {
        FlashConfig {
            capacity_bytes: 1 << 30,
            page_bytes: 16 << 10,
            pages_per_block: 256,
            iu_bytes: 4 << 10,
            overprovision: 0.07,
            channels: 4,
            dies_per_channel: 2,
            planes_per_die: 1,
            cell: Cell::Tlc,
            channel_bytes_per_us: 800,
            lba_placement: false,
        }
    }
}

impl FlashConfig {
    pub fn block_bytes(&self) -> u64 {
        self.page_bytes * self.pages_per_block
    }
    /// Checks the geometry; says what is inconsistent.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |m: String| Err(m);
        if self.channels == 0 || self.dies_per_channel == 0 || self.planes_per_die == 0 {
            return bad(
                "channels, dies per channel and planes per die must all be at least 1".into(),
            );
        }
        if self.iu_bytes == 0 || !self.iu_bytes.is_multiple_of(4096) {
            return bad(format!(
                "indirection unit {} must be a multiple of 4 KiB",
                self.iu_bytes
            ));
        }
        if self.page_bytes == 0 || !self.page_bytes.is_multiple_of(self.iu_bytes) {
            return bad(format!(
                "page size {} must be a multiple of the indirection unit {}",
                self.page_bytes, self.iu_bytes
            ));
        }
        if self.pages_per_block == 0 {
            return bad("an erase block needs at least one page".into());
        }
        if self.capacity_bytes == 0 || !self.capacity_bytes.is_multiple_of(self.block_bytes()) {
            return bad(format!(
                "capacity {} is not a multiple of the erase block ({} bytes)",
                self.capacity_bytes,
                self.block_bytes()
            ));
        }
        if !(0.0..=4.0).contains(&self.overprovision) {
            return bad(format!(
                "over-provisioning {} must be between 0 and 4",
                self.overprovision
            ));
        }
        if self.channel_bytes_per_us == 0 {
            return bad("channel bandwidth must be positive".into());
        }
        Ok(())
    }
}

/// What the drive has done, as a SMART-like report.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FlashStats {
    pub host_bytes_written: u64,
    pub host_bytes_read: u64,
    pub nand_bytes_programmed: u64,
    pub nand_bytes_read: u64,
    pub erases: u64,
    /// IUs rewritten whole because a write covered them in part.
    pub rmw_ius: u64,
    pub gc_ius_moved: u64,
    /// Bytes unmapped by discards (TRIM).
    pub trimmed_bytes: u64,
    pub min_erase_count: u64,
    pub max_erase_count: u64,
    pub mean_erase_count: f64,
    /// Virtual time of the last completion, microseconds.
    pub clock_us: u64,
}

impl FlashStats {
    /// NAND bytes programmed per host byte written.
    pub fn write_amplification(&self) -> f64 {
        self.nand_bytes_programmed as f64 / self.host_bytes_written.max(1) as f64
    }

    /// The attributes a drive's SMART log would show (names after the common
    /// vendor attributes), `cell` giving the rated program/erase cycles.
    pub fn smart(&self, cell: Cell) -> Vec<(&'static str, String)> {
        let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
        let rated = cell.rated_pe_cycles();
        vec![
            ("Host_Writes", gib(self.host_bytes_written)),
            ("Host_Reads", gib(self.host_bytes_read)),
            ("NAND_Writes", gib(self.nand_bytes_programmed)),
            (
                "Write_Amplification",
                format!("{:.3}", self.write_amplification()),
            ),
            ("Block_Erases", self.erases.to_string()),
            (
                "Wear_Leveling_Count",
                format!(
                    "min {} / mean {:.1} / max {}",
                    self.min_erase_count, self.mean_erase_count, self.max_erase_count
                ),
            ),
            (
                "Percent_Lifetime_Used",
                format!(
                    "{:.3}% of {rated} rated cycles",
                    100.0 * self.mean_erase_count / rated as f64
                ),
            ),
            ("Partial_Unit_Rewrites", self.rmw_ius.to_string()),
            ("GC_Units_Moved", self.gc_ius_moved.to_string()),
            ("Trimmed", gib(self.trimmed_bytes)),
        ]
    }
}

const NONE: u32 = u32::MAX;

/// A host operation for [`Flash::submit`].
#[derive(Clone, Copy, Debug)]
pub enum FlashOp {
    Read { offset: u64, len: u64 },
    Write { offset: u64, len: u64 },
}

struct Ftl {
    cfg: FlashConfig,
    slots_per_block: u64,
    blocks: u64,
    /// Logical IU -> physical slot.
    map: Vec<u32>,
    /// Physical slot -> logical IU.
    rmap: Vec<u32>,
    valid: Vec<u32>,
    erase_count: Vec<u64>,
    free: std::collections::VecDeque<u32>,
    /// Open block and next slot, for host writes and for GC.
    host: Option<(u32, u64)>,
    gc: Option<(u32, u64)>,
    closed: Vec<bool>,
    stats: FlashStats,
    /// Virtual time each die and channel is busy until.
    die_busy: Vec<u64>,
    chan_busy: Vec<u64>,
    clock: u64,
}

impl Ftl {
    fn new(cfg: FlashConfig) -> Result<Self, String> {
        cfg.validate()?;
        let logical_ius = cfg.capacity_bytes / cfg.iu_bytes;
        let blocks_logical = cfg.capacity_bytes / cfg.block_bytes();
        // Spare blocks: the over-provisioning, and never fewer than GC needs.
        let spare = ((blocks_logical as f64 * cfg.overprovision).ceil() as u64).max(3);
        let blocks = blocks_logical + spare;
        let slots_per_block = cfg.block_bytes() / cfg.iu_bytes;
        if blocks * slots_per_block >= NONE as u64 {
            return Err("device too large for the emulator's 32-bit maps".into());
        }
        let dies = (cfg.channels * cfg.dies_per_channel * cfg.planes_per_die) as usize;
        Ok(Ftl {
            slots_per_block,
            blocks,
            map: vec![NONE; logical_ius as usize],
            rmap: vec![NONE; (blocks * slots_per_block) as usize],
            valid: vec![0; blocks as usize],
            erase_count: vec![0; blocks as usize],
            free: (0..blocks as u32).collect(),
            host: None,
            gc: None,
            closed: vec![false; blocks as usize],
            stats: FlashStats::default(),
            die_busy: vec![0; dies],
            chan_busy: vec![0; cfg.channels as usize],
            clock: 0,
            cfg,
        })
    }

    /// Forgets what the work so far cost (counters, busy dies and channels, the
    /// clock), keeping the FTL's state: for preconditioning a drive.
    fn forget_cost(&mut self) {
        self.stats = FlashStats::default();
        self.die_busy.fill(0);
        self.chan_busy.fill(0);
        self.clock = 0;
    }

    /// The die holding logical unit `iu` written into `block`.
    fn die_of(&self, block: u32, iu: Option<u32>) -> usize {
        match iu {
            Some(iu) if self.cfg.lba_placement => {
                (iu as u64 * self.cfg.iu_bytes / self.cfg.page_bytes) as usize % self.die_busy.len()
            }
            _ => block as usize % self.die_busy.len(),
        }
    }

    /// Occupies the die of `block` (or of logical unit `iu` in it) for `us` (plus
    /// its channel for a transfer of `bytes`) from `at`; returns when it is done.
    fn occupy(&mut self, (block, iu): (u32, Option<u32>), at: u64, us: u64, bytes: u64) -> u64 {
        let d = self.die_of(block, iu);
        let c = d % self.chan_busy.len();
        let xfer = bytes.div_ceil(self.cfg.channel_bytes_per_us);
        let start = at.max(self.die_busy[d]);
        let xfer_start = start.max(self.chan_busy[c]);
        let done = xfer_start + xfer + us;
        self.chan_busy[c] = xfer_start + xfer;
        self.die_busy[d] = done;
        done
    }

    fn take_free(&mut self) -> u32 {
        // Wear levelling at allocation: the least erased free block.
        let i = (0..self.free.len())
            .min_by_key(|&i| self.erase_count[self.free[i] as usize])
            .expect("free block");
        self.free.remove(i).unwrap()
    }

    /// Programs logical IU `iu` into the host or GC stream at time `at`.
    fn program(&mut self, iu: u32, gc: bool, at: u64) -> u64 {
        let cur = if gc { self.gc } else { self.host };
        let (block, slot) = match cur {
            Some((b, s)) if s < self.slots_per_block => (b, s),
            other => {
                if let Some((b, _)) = other {
                    self.closed[b as usize] = true;
                }
                (self.take_free(), 0)
            }
        };
        let phys = block as u64 * self.slots_per_block + slot;
        let old = self.map[iu as usize];
        if old != NONE {
            self.rmap[old as usize] = NONE;
            self.valid[(old as u64 / self.slots_per_block) as usize] -= 1;
        }
        self.map[iu as usize] = phys as u32;
        self.rmap[phys as usize] = iu;
        self.valid[block as usize] += 1;
        if gc {
            self.gc = Some((block, slot + 1));
        } else {
            self.host = Some((block, slot + 1));
        }
        self.stats.nand_bytes_programmed += self.cfg.iu_bytes;
        // A page is programmed when its last IU slot fills.
        let per_page = self.cfg.page_bytes / self.cfg.iu_bytes;
        if (slot + 1) % per_page == 0 {
            let (_, prog, _) = self.cfg.cell.latency_us();
            self.occupy((block, Some(iu)), at, prog, self.cfg.page_bytes)
        } else {
            at
        }
    }

    fn read_iu(&mut self, iu: u32, at: u64) -> u64 {
        let p = self.map[iu as usize];
        if p == NONE {
            return at;
        }
        self.stats.nand_bytes_read += self.cfg.iu_bytes;
        let (read, _, _) = self.cfg.cell.latency_us();
        self.occupy(
            ((p as u64 / self.slots_per_block) as u32, Some(iu)),
            at,
            read,
            self.cfg.iu_bytes,
        )
    }

    /// Collects blocks while fewer than 2 are free.
    fn gc(&mut self, mut at: u64) -> u64 {
        while self.free.len() < 2 {
            let open: Vec<u32> = [self.host, self.gc]
                .iter()
                .flatten()
                .map(|(b, _)| *b)
                .collect();
            let victim = (0..self.blocks as u32)
                .filter(|&b| self.closed[b as usize] && !open.contains(&b))
                .min_by_key(|&b| (self.valid[b as usize], self.erase_count[b as usize]));
            let Some(v) = victim else { break };
            for s in 0..self.slots_per_block {
                let phys = v as u64 * self.slots_per_block + s;
                let iu = self.rmap[phys as usize];
                if iu != NONE {
                    at = self.read_iu(iu, at);
                    at = self.program(iu, true, at);
                    self.stats.gc_ius_moved += 1;
                }
            }
            let (_, _, erase) = self.cfg.cell.latency_us();
            at = self.occupy((v, None), at, erase, 0);
            self.erase_count[v as usize] += 1;
            self.stats.erases += 1;
            self.closed[v as usize] = false;
            self.free.push_back(v);
        }
        at
    }

    fn submit(&mut self, op: FlashOp, at: u64) -> u64 {
        let iu = self.cfg.iu_bytes;
        let mut done = at;
        match op {
            FlashOp::Read { offset, len } => {
                self.stats.host_bytes_read += len;
                for i in offset / iu..(offset + len).div_ceil(iu) {
                    done = done.max(self.read_iu(i as u32, at));
                }
            }
            FlashOp::Write { offset, len } => {
                self.stats.host_bytes_written += len;
                let mut t = at;
                for i in offset / iu..(offset + len).div_ceil(iu) {
                    let covered = offset <= i * iu && offset + len >= (i + 1) * iu;
                    if !covered && self.map[i as usize] != NONE {
                        // Read-modify-write of the whole unit.
                        self.stats.rmw_ius += 1;
                        t = self.read_iu(i as u32, t);
                    }
                    t = self.gc(t);
                    t = self.program(i as u32, false, t);
                }
                done = t;
            }
        }
        self.clock = self.clock.max(done);
        done
    }

    /// Unmaps the units wholly inside `[offset, offset + len)` (TRIM): their
    /// slots become garbage GC need not copy.
    fn trim(&mut self, offset: u64, len: u64) {
        let iu = self.cfg.iu_bytes;
        for i in offset.div_ceil(iu)..(offset + len) / iu {
            let p = self.map[i as usize];
            if p != NONE {
                self.rmap[p as usize] = NONE;
                self.valid[(p as u64 / self.slots_per_block) as usize] -= 1;
                self.map[i as usize] = NONE;
                self.stats.trimmed_bytes += iu;
            }
        }
    }

    fn stats(&self) -> FlashStats {
        let mut s = self.stats.clone();
        s.min_erase_count = self.erase_count.iter().copied().min().unwrap_or(0);
        s.max_erase_count = self.erase_count.iter().copied().max().unwrap_or(0);
        s.mean_erase_count =
            self.erase_count.iter().sum::<u64>() as f64 / self.erase_count.len().max(1) as f64;
        s.clock_us = self.clock;
        s
    }
}

/// The emulated SSD, over an inner device that holds the data.
pub struct Flash {
    inner: Arc<dyn BlockDevice>,
    ftl: Mutex<Ftl>,
    name: String,
}

impl Flash {
    pub fn new(inner: Arc<dyn BlockDevice>, cfg: FlashConfig) -> Result<Self, DeviceError> {
        let name = format!("flash({})", inner.describe());
        let bad = |detail: String| DeviceError::Open {
            device: name.clone(),
            detail,
        };
        if inner.size_bytes() < cfg.capacity_bytes {
            return Err(bad(format!(
                "backing device has {} bytes, the drive needs {}",
                inner.size_bytes(),
                cfg.capacity_bytes
            )));
        }
        let ftl = Ftl::new(cfg).map_err(bad)?;
        Ok(Flash {
            inner,
            ftl: Mutex::new(ftl),
            name,
        })
    }

    /// Puts the FTL in the state one sequential write of the whole drive leaves:
    /// every logical unit mapped, in order, the spare blocks free. A drive in use
    /// is in this state (every block written at least once); a fresh one has all
    /// its blocks free and its GC has nothing to do until they are used. What it
    /// took (programs, time) is not counted. Only on a drive nothing was written to.
    pub fn prefill(&self) {
        let mut f = self.ftl.lock().unwrap();
        assert_eq!(f.stats.host_bytes_written, 0, "prefill of a drive in use");
        let logical = f.map.len() as u32;
        for iu in 0..logical {
            f.program(iu, false, 0);
        }
        debug_assert!(f.free.len() >= 2, "the spare blocks are free");
        f.forget_cost();
    }

    /// Puts the FTL in the steady state of a drive used for random writes: the
    /// prefill, then `passes` x the capacity in uniform random IU writes (seeded,
    /// so repeatable), its GC running as it would; nothing counted. Valid data is
    /// then spread over every block, and the next host writes pay the drive's GC at
    /// once, where a prefilled drive pays nothing until its spare is used.
    pub fn age(&self, passes: u32, seed: u64) {
        self.prefill();
        let mut f = self.ftl.lock().unwrap();
        let logical = f.map.len() as u64;
        let mut x = seed | 1;
        for _ in 0..logical * passes as u64 {
            // xorshift64: enough for a uniform choice of unit.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let t = f.gc(0);
            f.program((x % logical) as u32, false, t);
        }
        f.forget_cost();
    }

    /// Accounts a host operation arriving at virtual time `at_us`; returns when it
    /// completes. Does not move data (see the [`BlockDevice`] methods).
    pub fn submit(&self, op: FlashOp, at_us: u64) -> u64 {
        self.ftl.lock().unwrap().submit(op, at_us)
    }

    pub fn stats(&self) -> FlashStats {
        self.ftl.lock().unwrap().stats()
    }

    /// Where logical IU `iu` lives (block, slot), for tests.
    pub fn locate(&self, iu: u64) -> Option<(u64, u64)> {
        let f = self.ftl.lock().unwrap();
        let p = f.map[iu as usize];
        (p != NONE).then(|| (p as u64 / f.slots_per_block, p as u64 % f.slots_per_block))
    }

    /// Checks the FTL's invariants: map and reverse map agree, valid counts match.
    pub fn check(&self) -> Result<(), String> {
        let f = self.ftl.lock().unwrap();
        let mut valid = vec![0u32; f.blocks as usize];
        for (iu, &p) in f.map.iter().enumerate() {
            if p != NONE {
                if f.rmap[p as usize] != iu as u32 {
                    return Err(format!("IU {iu} maps to slot {p}, which maps elsewhere"));
                }
                valid[(p as u64 / f.slots_per_block) as usize] += 1;
            }
        }
        if valid != f.valid {
            return Err("valid counts disagree with the map".into());
        }
        Ok(())
    }
}

impl BlockDevice for Flash {
    fn size_bytes(&self) -> u64 {
        self.ftl.lock().unwrap().cfg.capacity_bytes
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        {
            let mut f = self.ftl.lock().unwrap();
            let at = f.clock;
            f.submit(
                FlashOp::Read {
                    offset,
                    len: buf.len() as u64,
                },
                at,
            );
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        self.inner.write_at(buf, offset)?;
        let mut f = self.ftl.lock().unwrap();
        let at = f.clock;
        f.submit(
            FlashOp::Write {
                offset,
                len: buf.len() as u64,
            },
            at,
        );
        Ok(())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.inner.sync()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self, "discard", offset, len as usize)?;
        self.ftl.lock().unwrap().trim(offset, len);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mem::MemDevice;

    fn small(iu: u64, op: f64) -> FlashConfig {
        FlashConfig {
            capacity_bytes: 64 << 20,
            page_bytes: 16 << 10,
            pages_per_block: 16,
            iu_bytes: iu,
            overprovision: op,
            ..Default::default()
        }
    }

    fn flash(cfg: FlashConfig) -> Flash {
        Flash::new(Arc::new(MemDevice::new("m", cfg.capacity_bytes)), cfg).unwrap()
    }

    fn rng(x: &mut u64) -> u64 {
        *x ^= *x << 13;
        *x ^= *x >> 7;
        *x ^= *x << 17;
        *x
    }

    /// Greedy model for uniform random writes: 1/(1-u), u = exp(-alpha(1-u)).
    fn model(op: f64) -> f64 {
        let mut u = 0.5;
        for _ in 0..200 {
            u = (-(1.0 + op) * (1.0 - u)).exp();
        }
        1.0 / (1.0 - u)
    }

    #[test]
    fn inconsistent_configs_are_refused_with_reasons() {
        let cases: Vec<(FlashConfig, &str)> = vec![
            (
                FlashConfig {
                    capacity_bytes: (64 << 20) + 4096,
                    ..small(4096, 0.07)
                },
                "multiple of the erase block",
            ),
            (
                FlashConfig {
                    channels: 0,
                    ..small(4096, 0.07)
                },
                "at least 1",
            ),
            (
                FlashConfig {
                    iu_bytes: 6000,
                    ..small(4096, 0.07)
                },
                "multiple of 4 KiB",
            ),
            (
                FlashConfig {
                    page_bytes: 8192,
                    iu_bytes: 16384,
                    ..small(4096, 0.07)
                },
                "multiple of the indirection unit",
            ),
        ];
        for (cfg, want) in cases {
            let e = cfg.validate().unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn data_reads_back_and_the_map_stays_consistent() {
        let f = flash(small(4096, 0.07));
        let mut x = 7u64;
        let mut model_data = std::collections::HashMap::new();
        for i in 0..40_000u64 {
            let b = rng(&mut x) % (16 << 8);
            f.write_at(&[(i % 251) as u8; 4096], b * 4096).unwrap();
            model_data.insert(b, (i % 251) as u8);
        }
        f.check().unwrap();
        for (b, v) in model_data {
            let mut buf = [0u8; 4096];
            f.read_at(&mut buf, b * 4096).unwrap();
            assert!(buf.iter().all(|&x| x == v));
            assert!(f.locate(b).is_some());
        }
        assert!(f.stats().erases > 0, "GC ran");
    }

    /// A prefilled drive is where a sequential fill through the host leaves it
    /// (every unit in the same slot), with nothing counted, and its GC starts once
    /// the spare blocks are used instead of after a whole drive of writes.
    #[test]
    fn prefill_is_a_sequential_fill_not_counted() {
        let cfg = small(4096, 0.07);
        let ius = cfg.capacity_bytes / 4096;
        let (pre, filled) = (flash(cfg.clone()), flash(cfg));
        pre.prefill();
        for i in 0..ius {
            let op = FlashOp::Write {
                offset: i * 4096,
                len: 4096,
            };
            filled.submit(op, 0);
        }
        pre.check().unwrap();
        for i in 0..ius {
            assert_eq!(pre.locate(i), filled.locate(i), "unit {i}");
        }
        let s = pre.stats();
        assert_eq!((s.nand_bytes_programmed, s.clock_us, s.erases), (0, 0, 0));
        let spare_ius = ius * 8 / 100;
        let mut x = 5u64;
        for _ in 0..spare_ius {
            let b = rng(&mut x) % ius;
            let op = FlashOp::Write {
                offset: b * 4096,
                len: 4096,
            };
            pre.submit(op, 0);
        }
        assert!(
            pre.stats().erases > 0,
            "GC ran within the spare's worth of writes"
        );
        pre.check().unwrap();
    }

    /// An aged drive is at the GC steady state at once: its first random writes pay
    /// the model's write amplification (7% spare: 7.8, within 15% over this short
    /// window) where a prefilled drive's pay nothing until its spare is used.
    #[test]
    fn an_aged_drive_pays_its_gc_at_once() {
        let cfg = small(4096, 0.07);
        let ius = cfg.capacity_bytes / 4096;
        let wa_of_next_writes = |f: &Flash| {
            let mut x = 9u64;
            // Fewer writes than the spare holds: a prefilled drive needs no GC.
            for _ in 0..ius / 20 {
                let b = rng(&mut x) % ius;
                let op = FlashOp::Write {
                    offset: b * 4096,
                    len: 4096,
                };
                f.submit(op, 0);
            }
            f.check().unwrap();
            f.stats().write_amplification()
        };
        let (aged, pre) = (flash(cfg.clone()), flash(cfg));
        aged.age(2, 3);
        pre.prefill();
        let s = aged.stats();
        assert_eq!((s.nand_bytes_programmed, s.erases), (0, 0));
        let (a, p) = (wa_of_next_writes(&aged), wa_of_next_writes(&pre));
        assert!((a - model(0.07)).abs() / model(0.07) < 0.15, "aged WA {a}");
        assert!(p < 1.01, "prefilled WA {p}");
    }

    /// Greedy FTL GC under uniform random 4 KiB writes after a full fill: device WA
    /// within 5% of the model for its over-provisioning (7%: 7.87 against 7.82;
    /// 28%: 2.42 against 2.48).
    #[test]
    fn greedy_gc_matches_the_model_for_its_overprovisioning() {
        for op in [0.07, 0.28] {
            let f = flash(small(4096, op));
            let ius = (64u64 << 20) / 4096;
            for i in 0..ius {
                f.submit(
                    FlashOp::Write {
                        offset: i * 4096,
                        len: 4096,
                    },
                    0,
                );
            }
            let before = f.stats();
            let mut x = 11u64;
            for _ in 0..ius * 8 {
                let b = rng(&mut x) % ius;
                f.submit(
                    FlashOp::Write {
                        offset: b * 4096,
                        len: 4096,
                    },
                    0,
                );
            }
            let s = f.stats();
            let wa = (s.nand_bytes_programmed - before.nand_bytes_programmed) as f64
                / (s.host_bytes_written - before.host_bytes_written) as f64;
            let m = model(op);
            eprintln!("op {op}: WA {wa:.3}, model {m:.3}, {s:?}");
            assert!(
                (wa / m - 1.0).abs() < 0.05,
                "op {op}: WA {wa:.3}, model {m:.3}"
            );
            // Wear levelling keeps erase counts close.
            assert!(
                s.max_erase_count - s.min_erase_count <= s.mean_erase_count as u64 + 3,
                "{s:?}"
            );
        }
    }

    /// With a 16 KiB indirection unit a 4 KiB write programs 16 KiB: four times the
    /// write amplification of 4 KiB units, before GC.
    #[test]
    fn small_writes_on_large_units_cost_read_modify_write() {
        let f = flash(small(16384, 0.5));
        for i in 0..1024u64 {
            f.submit(
                FlashOp::Write {
                    offset: i * 16384,
                    len: 16384,
                },
                0,
            );
        }
        let a = f.stats();
        for i in 0..1024u64 {
            f.submit(
                FlashOp::Write {
                    offset: i * 16384 + 4096,
                    len: 4096,
                },
                0,
            );
        }
        let b = f.stats();
        let wa = (b.nand_bytes_programmed - a.nand_bytes_programmed) as f64
            / (b.host_bytes_written - a.host_bytes_written) as f64;
        assert!(wa >= 4.0, "WA {wa}");
        assert_eq!(b.rmw_ius - a.rmw_ius, 1024);
    }

    /// Requests on different dies overlap; on one die they queue.
    #[test]
    fn timing_overlaps_dies_and_queues_on_one() {
        let cfg = small(4096, 0.07);
        let (read, prog, _) = cfg.cell.latency_us();
        let f = flash(cfg);
        // Fill a page (4 IUs) so that it is programmed.
        let mut t = 0;
        for i in 0..4u64 {
            t = f.submit(
                FlashOp::Write {
                    offset: i * 4096,
                    len: 4096,
                },
                0,
            );
        }
        assert!(t >= prog, "a full page takes a program time ({t} us)");
        // Two reads of the same page at once: the second waits for the first.
        let a = f.submit(
            FlashOp::Read {
                offset: 0,
                len: 4096,
            },
            t,
        );
        let b = f.submit(
            FlashOp::Read {
                offset: 4096,
                len: 4096,
            },
            t,
        );
        assert!(a >= t + read && b >= a + read, "{t} {a} {b}");
    }
}
