//! `lamina bench csal`: CSAL's experiment (seed 002; issue 14) on the emulators.
//!
//! A QLC SSD with a large indirection unit takes 4 KiB writes spread over several
//! volumes, four ways, each from a fresh drive filled once over the same user
//! capacity (Lamina's usable space):
//!
//! * **raw QLC**: the writes go to the drive as they come;
//! * **LRU cache + QLC**: a write-back block cache of 4 KiB slots on an SLC SSD of
//!   the cache's size in front of the drive (what dm-cache and Open-CAS do): a write
//!   goes to its slot; a miss with the cache full evicts the least recently written
//!   block, which is read from the SLC and written to the QLC where it belongs
//!   (the fill goes through the cache too, as through Lamina's cache tier);
//! * **Lamina on the QLC**: an array on the drive, the volumes filling it;
//! * **Lamina + cache tier**: the same array with the SLC SSD as its cache tier;
//! * **Lamina + cache tier on ZNS**: the same cache in front of a ZNS drive of
//!   the QLC's capacity with zones of one erase block (CSAL's other setup). A ZNS
//!   drive has no garbage collection of its own: it programs what it is sent,
//!   and erases a zone when the host resets it. Lamina's segments are zones.
//!
//! What is measured is what the QLC programs: NAND bytes per user byte written
//! after the fill, its own write amplification (NAND bytes per byte it was sent),
//! and its erases; and what the SLC programs per user byte. Timing is not
//! measured here (the drives are driven inline, without a clock shared between
//! them).

use crate::bench::{writes, Inline};
use anyhow::Result;
use lamina_device::flash::{Cell, Flash, FlashConfig, FlashOp, FlashStats};
use lamina_device::mem::MemDevice;
use lamina_device::sparse::SparseDevice;
use lamina_device::zoned::{ZonedConfig, ZonedDevice};
use lamina_device::BlockDevice;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

const BS: u64 = 4096;

pub struct CsalArgs {
    pub capacity: u64,
    pub cache: u64,
    pub iu: u64,
    pub workload: String,
    pub passes: u32,
    pub volumes: u32,
    pub overprovision: f64,
    pub json: bool,
}

/// The QLC drive: CSAL's large indirection unit, pages at least as large, 1 MiB
/// erase blocks (so that a Lamina segment of 1 MiB is one erase block).
fn qlc_config(a: &CsalArgs) -> FlashConfig {
    let page = a.iu.max(16 << 10);
    let pages_per_block = ((1u64 << 20) / page).max(1);
    let block = page * pages_per_block;
    FlashConfig {
        capacity_bytes: a.capacity / block * block,
        iu_bytes: a.iu,
        page_bytes: page,
        pages_per_block,
        cell: Cell::Qlc,
        ..Default::default()
    }
}

/// The SLC cache drive: 4 KiB indirection unit, 16 KiB pages, 1 MiB blocks.
fn slc_config(a: &CsalArgs) -> FlashConfig {
    let block = 1u64 << 20;
    FlashConfig {
        capacity_bytes: a.cache / block * block,
        page_bytes: 16 << 10,
        pages_per_block: 64,
        cell: Cell::Slc,
        ..Default::default()
    }
}

/// What one setup cost the drives over the measured writes.
struct Row {
    name: &'static str,
    /// QLC: NAND bytes programmed, bytes it was sent, erases.
    qlc: Wear,
    /// SLC (setups with a cache): NAND bytes programmed.
    slc: Option<u64>,
    /// Lamina: bytes compaction moved to the capacity tier.
    compacted: Option<u64>,
    /// User bytes of the measured writes (the ZNS drive's volumes are a little
    /// smaller: its superblocks take a whole zone).
    user: u64,
}

impl Row {
    /// Bytes per user byte of this row's writes, and its user GiB.
    fn per_user(&self) -> (impl Fn(u64) -> f64, f64) {
        let user = self.user as f64;
        (move |b: u64| b as f64 / user, user / (1u64 << 30) as f64)
    }
}

/// What a drive has done: NAND bytes programmed, bytes it was sent, erases.
type Wear = (u64, u64, u64);

fn wear(s: &FlashStats) -> Wear {
    (s.nand_bytes_programmed, s.host_bytes_written, s.erases)
}

/// What a drive did between two readings.
fn delta(a: Wear, b: Wear) -> Wear {
    (b.0 - a.0, b.1 - a.1, b.2 - a.2)
}

fn write(f: &Flash, block: u64) {
    f.submit(
        FlashOp::Write {
            offset: block * BS,
            len: BS,
        },
        0,
    );
}

fn flash(cfg: &FlashConfig, inner: Arc<dyn BlockDevice>) -> Result<Arc<Flash>> {
    cfg.validate().map_err(anyhow::Error::msg)?;
    Ok(Arc::new(Flash::new(inner, cfg.clone())?))
}

fn sparse(name: &str, cfg: &FlashConfig) -> Arc<dyn BlockDevice> {
    Arc::new(SparseDevice::new(name, cfg.capacity_bytes))
}

/// The raw QLC, filled over `blocks`, then the workload's writes (the endurance
/// bench's raw run).
fn raw(a: &CsalArgs, blocks: u64) -> Result<Row> {
    let (wa, erases, _) = crate::bench::raw_run(&qlc_config(a), blocks, &a.workload, a.passes)?;
    let host = a.passes as u64 * blocks * BS;
    Ok(Row {
        name: "raw QLC",
        qlc: ((wa * host as f64).round() as u64, host, erases),
        slc: None,
        compacted: None,
        user: host,
    })
}

/// A write-back LRU block cache of 4 KiB slots on the SLC drive in front of the
/// QLC: least recently written first out (stamps, with stale queue entries
/// skipped). The fill goes through the cache too, as it does through Lamina's
/// cache tier, so both caches start the measured writes full of dirty blocks.
fn lru(a: &CsalArgs, blocks: u64) -> Result<Row> {
    let (qcfg, scfg) = (qlc_config(a), slc_config(a));
    let qlc = flash(&qcfg, sparse("qlc", &qcfg))?;
    let slc = flash(&scfg, sparse("slc", &scfg))?;
    let mut cache = Lru::new(scfg.capacity_bytes / BS);
    for b in 0..blocks {
        cache.write(b, &qlc, &slc);
    }
    let (q0, s0) = (wear(&qlc.stats()), wear(&slc.stats()));
    for b in writes(&a.workload, blocks, a.passes)? {
        cache.write(b, &qlc, &slc);
    }
    Ok(Row {
        name: "LRU cache on SLC + QLC",
        qlc: delta(q0, wear(&qlc.stats())),
        slc: Some(delta(s0, wear(&slc.stats())).0),
        compacted: None,
        user: a.passes as u64 * blocks * BS,
    })
}

/// The LRU write-back cache's state.
struct Lru {
    slots: u64,
    /// Block -> (slot, stamp of its last write); `order` holds (block, stamp).
    cached: HashMap<u64, (u64, u64)>,
    order: VecDeque<(u64, u64)>,
    free: Vec<u64>,
    stamp: u64,
}

impl Lru {
    fn new(slots: u64) -> Self {
        Lru {
            slots,
            cached: HashMap::new(),
            order: VecDeque::new(),
            free: (0..slots).rev().collect(),
            stamp: 0,
        }
    }

    /// Block `b` is written: into its slot, or a free one, or the slot of the
    /// least recently written block, which goes to the QLC first.
    fn write(&mut self, b: u64, qlc: &Flash, slc: &Flash) {
        self.stamp += 1;
        let slot = match self.cached.get(&b) {
            Some(&(slot, _)) => slot,
            None => match self.free.pop() {
                Some(slot) => slot,
                None => loop {
                    let (victim, at) = self.order.pop_front().expect("a full cache has entries");
                    if self.cached.get(&victim).is_some_and(|&(_, s)| s == at) {
                        let (slot, _) = self.cached.remove(&victim).unwrap();
                        slc.submit(
                            FlashOp::Read {
                                offset: slot * BS,
                                len: BS,
                            },
                            0,
                        );
                        write(qlc, victim);
                        break slot;
                    }
                },
            },
        };
        self.cached.insert(b, (slot, self.stamp));
        self.order.push_back((b, self.stamp));
        write(slc, slot);
        // Stale entries (blocks written again since) would pile up under a skewed
        // workload: drop them now and then.
        if self.order.len() > 4 * self.slots as usize {
            let cached = &self.cached;
            self.order
                .retain(|(blk, at)| cached.get(blk).is_some_and(|&(_, s)| s == *at));
        }
    }
}

/// The capacity drive of a Lamina row: the QLC SSD, or a ZNS drive of its
/// capacity with zones of its erase block.
enum Capacity {
    Qlc(Arc<Flash>),
    Zns(Arc<ZonedDevice>),
}

impl Capacity {
    /// Zones a ZNS drive lets be open at once here: enough for the metadata
    /// stream and each of 8 volumes' SepBIT GC streams (user writes go to the
    /// cache), as on the QLC rows. Drives differ: 14 to several hundred.
    const ZNS_OPEN: u32 = 64;

    fn new(a: &CsalArgs, zns: bool) -> Result<Self> {
        let qcfg = qlc_config(a);
        let mem = Arc::new(MemDevice::new("qlc", qcfg.capacity_bytes));
        if !zns {
            return Ok(Capacity::Qlc(flash(&qcfg, mem)?));
        }
        let zone = qcfg.block_bytes();
        let cfg = ZonedConfig {
            zone_bytes: zone,
            zone_capacity_bytes: zone,
            // The superblocks' megabyte (real ZNS drives keep it on a small
            // conventional namespace).
            conventional_zones: (lamina_format::superblock::DEFAULT_DATA_OFFSET.div_ceil(zone))
                as u32,
            max_open: Self::ZNS_OPEN,
            max_active: Self::ZNS_OPEN,
            ..Default::default()
        };
        Ok(Capacity::Zns(Arc::new(ZonedDevice::new(mem, cfg)?)))
    }

    fn device(&self) -> Arc<dyn BlockDevice> {
        match self {
            Capacity::Qlc(f) => f.clone(),
            Capacity::Zns(z) => z.clone(),
        }
    }

    /// Its [`Wear`]. A ZNS drive programs what it is sent (its conventional
    /// zones too) and erases a zone on reset.
    fn stats(&self) -> Wear {
        match self {
            Capacity::Qlc(f) => wear(&f.stats()),
            Capacity::Zns(z) => {
                let sent = z.sequential_bytes_written() + z.conventional_bytes_written();
                (sent, sent, z.zone_resets())
            }
        }
    }
}

/// Lamina on the QLC (or a ZNS drive when `zns`), with the SLC drive as its
/// cache tier when `tiered`. Returns the row and the blocks of each volume.
fn lamina(a: &CsalArgs, tiered: bool, zns: bool) -> Result<(Row, u64)> {
    let (qcfg, scfg) = (qlc_config(a), slc_config(a));
    let capacity = Capacity::new(a, zns)?;
    let mut devs: Vec<Arc<dyn BlockDevice>> = vec![capacity.device()];
    let slc = if tiered {
        let slc = flash(&scfg, Arc::new(MemDevice::new("slc", scfg.capacity_bytes)))?;
        devs.push(slc.clone());
        Some(slc)
    } else {
        None
    };
    let params = lamina_core::FormatParams {
        name: "csal".into(),
        segment_blocks: (qcfg.block_bytes() / BS) as u32,
        write_unit_blocks: 64,
        overprovision: a.overprovision,
        cache_devices: tiered as usize,
        ..Default::default()
    };
    // No read-hot stream: an SSD has no outer tracks (the default on zoned
    // devices, for SMR disks).
    let cfg = lamina_core::EngineConfig {
        geometry_aware: Some(false),
        ..Default::default()
    };
    let mut l = Inline::with_volumes(devs, &params, cfg, a.volumes)?;
    let per_vol = l.volume_bytes / BS;
    let total = per_vol * a.volumes as u64;
    for b in 0..total {
        l.write_to((b / per_vol) as usize, b % per_vol * BS, BS as usize);
    }
    l.flush()?;
    let (q0, s0) = (capacity.stats(), slc.as_ref().map(|s| wear(&s.stats())));
    let c0 = l.e.status().cache.map_or(0, |c| c.compacted_bytes);
    for b in writes(&a.workload, total, a.passes)? {
        l.write_to((b / per_vol) as usize, b % per_vol * BS, BS as usize);
    }
    l.flush()?;
    let st = l.e.status();
    Ok((
        Row {
            name: match (tiered, zns) {
                (true, true) => "Lamina + cache tier on SLC, ZNS drive",
                (true, false) => "Lamina + cache tier on SLC",
                _ => "Lamina on the QLC",
            },
            qlc: delta(q0, capacity.stats()),
            slc: slc.map(|s| delta(s0.unwrap(), wear(&s.stats())).0),
            compacted: st.cache.map(|c| c.compacted_bytes - c0),
            user: a.passes as u64 * total * BS,
        },
        per_vol,
    ))
}

pub fn run(a: &CsalArgs) -> Result<()> {
    if a.volumes == 0 || a.passes == 0 {
        anyhow::bail!("--volumes and --passes must be at least 1");
    }
    let (plain, per_vol) = lamina(a, false, false)?;
    let (tiered, per_vol_t) = lamina(a, true, false)?;
    // The usable space is the capacity tier's in both: the same volumes.
    anyhow::ensure!(per_vol == per_vol_t, "the cache changed the usable space");
    // On the ZNS drive the superblocks take a whole zone: a little less space.
    let (zns, per_vol_z) = lamina(a, true, true)?;
    anyhow::ensure!(
        per_vol_z <= per_vol && per_vol_z * 100 >= per_vol * 99,
        "the ZNS drive's volumes ({per_vol_z} blocks) are not those of the QLC ({per_vol})"
    );
    let blocks = per_vol * a.volumes as u64;
    let rows = [raw(a, blocks)?, lru(a, blocks)?, plain, tiered, zns];
    let json_rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let (per_user, gib) = r.per_user();
            serde_json::json!({
                "setup": r.name,
                "qlc_nand_bytes_per_user_byte": per_user(r.qlc.0),
                "qlc_write_amplification": r.qlc.0 as f64 / r.qlc.1.max(1) as f64,
                "qlc_bytes_written_per_user_byte": per_user(r.qlc.1),
                "qlc_erases_per_user_gib": r.qlc.2 as f64 / gib,
                "slc_nand_bytes_per_user_byte": r.slc.map(&per_user),
                "compacted_bytes_per_user_byte": r.compacted.map(&per_user),
            })
        })
        .collect();
    if a.json {
        let out = serde_json::json!({
            "qlc_bytes": qlc_config(a).capacity_bytes,
            "iu_bytes": a.iu,
            "cache_bytes": slc_config(a).capacity_bytes,
            "user_bytes": blocks * BS,
            "volumes": a.volumes,
            "workload": a.workload,
            "passes": a.passes,
            "rows": json_rows,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    let human = crate::size::human;
    println!(
        "QLC {} (IU {}), SLC cache {}, {} volumes of {} each, {}: {} passes of 4 KiB writes after one fill\n",
        human(qlc_config(a).capacity_bytes),
        human(a.iu),
        human(slc_config(a).capacity_bytes),
        a.volumes,
        human(per_vol * BS),
        a.workload,
        a.passes
    );
    println!("| setup | QLC NAND bytes per user byte | QLC WA | QLC erases per user GiB | SLC NAND bytes per user byte |");
    println!("|---|---:|---:|---:|---:|");
    for r in &rows {
        let (per_user, gib) = r.per_user();
        println!(
            "| {} | {:.2} | {:.2} | {:.0} | {} |",
            r.name,
            per_user(r.qlc.0),
            r.qlc.0 as f64 / r.qlc.1.max(1) as f64,
            r.qlc.2 as f64 / gib,
            r.slc
                .map_or("-".to_string(), |b| format!("{:.2}", per_user(b)))
        );
    }
    for r in &rows {
        if let Some(c) = r.compacted {
            println!(
                "{}: compaction moved {:.2} bytes to the capacity drive per user byte",
                r.name,
                r.per_user().0(c)
            );
        }
    }
    Ok(())
}
