//! Helpers shared by the engine's integration tests: small arrays on simulated
//! devices, a deterministic driver, and block contents that identify themselves.

#![allow(dead_code)]

use lamina_core::io::{execute, IoKind, IoOp};
use lamina_core::{
    format, open, Engine, EngineConfig, FormatParams, OpenMode, Reply, Request, Token, VolumeId,
};
use lamina_device::BlockDevice;
use std::sync::Arc;

pub use lamina_testkit::BS;

/// Geometry small enough that GC and checkpoints happen within a few thousand writes.
pub fn small_params() -> FormatParams {
    FormatParams {
        name: "test".into(),
        segment_blocks: 64,
        write_unit_blocks: 8,
        overprovision: 0.25,
        ..Default::default()
    }
}

/// The small geometry with `layout`.
pub fn layout_params(layout: lamina_format::superblock::Layout) -> FormatParams {
    FormatParams {
        layout,
        ..small_params()
    }
}

/// Concrete devices as the engine takes them.
pub fn dyn_devs<D: BlockDevice>(d: &[Arc<D>]) -> Vec<Arc<dyn BlockDevice>> {
    d.iter()
        .map(|d| d.clone() as Arc<dyn BlockDevice>)
        .collect()
}

pub fn small_config() -> EngineConfig {
    EngineConfig {
        buffer_units: 4,
        checkpoint_interval_blocks: 3000,
        ..Default::default()
    }
}

/// Bytes for a device of `segments` segments of the small geometry.
pub fn device_bytes(segments: u64) -> u64 {
    1024 * 1024 + segments * 64 * BS as u64
}

pub fn format_devices(devs: &[Arc<dyn BlockDevice>], params: &FormatParams) {
    let uuids: Vec<[u8; 16]> = (0..devs.len()).map(|i| [i as u8 + 1; 16]).collect();
    format(devs, params, [0xab; 16], &uuids, 0).expect("format");
}

pub fn open_rw(devs: &[Arc<dyn BlockDevice>], cfg: EngineConfig) -> Engine {
    open(devs.to_vec(), cfg, OpenMode::ReadWrite)
        .expect("open")
        .0
}

/// Submits a request and runs the engine until its reply arrives (all I/O inline).
pub fn call(e: &mut Engine, req: Request) -> Reply {
    lamina_core::call_inline(e, Token { conn: 7, handle: 1 }, req, 100_000).expect("no reply")
}

pub fn create_volume(e: &mut Engine, name: &str, size: u64) -> VolumeId {
    call(
        e,
        Request::CreateVolume {
            name: name.into(),
            size_bytes: size,
        },
    )
    .result
    .expect("create volume");
    e.shared().volume(name).unwrap().id
}

#[allow(unused_imports)]
pub use lamina_testkit::{decode_pattern, pattern};

/// Writes block `lba` holding `pattern(lba, gen)`.
pub fn write_block(
    e: &mut Engine,
    vol: VolumeId,
    lba: u64,
    gen: u64,
    fua: bool,
) -> Result<(), lamina_core::EngineError> {
    call(
        e,
        Request::Write {
            volume: vol,
            offset: lba * BS as u64,
            data: pattern(lba, gen),
            fua,
        },
    )
    .result
}

/// Writes `writes` blocks at the LBAs `next_lba(i)` gives, each one generation
/// newer than the model says, flushing every `flush_every` writes and at the end.
pub fn overwrite(
    e: &mut Engine,
    vol: VolumeId,
    model: &mut std::collections::HashMap<u64, u64>,
    writes: u64,
    flush_every: u64,
    mut next_lba: impl FnMut(u64) -> u64,
) {
    for i in 0..writes {
        let lba = next_lba(i);
        let gen = model.get(&lba).copied().unwrap_or(0) + 1;
        write_block(e, vol, lba, gen, false).unwrap_or_else(|err| panic!("write {i}: {err}"));
        model.insert(lba, gen);
        if i % flush_every == 0 {
            call(e, Request::Flush).result.expect("flush");
        }
    }
    call(e, Request::Flush).result.expect("flush");
}

/// Runs a rebuild of member `index` against an engine driven inline, at most
/// `max` stripes.
pub fn rebuild_member(
    e: &mut Engine,
    index: usize,
    max: Option<u64>,
) -> lamina_core::rebuild::RebuildReport {
    let opts = lamina_core::rebuild::RebuildOptions {
        record_every: std::time::Duration::ZERO,
        max_stripes: max,
        ..Default::default()
    };
    lamina_core::recovery::with_inline_calls(e, |shared, call| {
        lamina_core::rebuild::rebuild(shared, index, call, &opts, &mut |_, _| {})
    })
    .expect("rebuild")
}

/// Puts `device` in the slot of failed member `index` (its rebuild starts at
/// stripe 0).
pub fn replace_member(e: &mut Engine, index: usize, device: Arc<dyn BlockDevice>) {
    call(
        e,
        Request::ReplaceMember {
            index,
            device: lamina_core::NewDevice(device),
            uuid: [0x77; 16],
        },
    )
    .result
    .expect("replace");
}

/// Every block of the model reads back with its generation.
pub fn verify_model(e: &Engine, vol: VolumeId, model: &std::collections::HashMap<u64, u64>) {
    for (&lba, &gen) in model {
        let b = read_block(e, vol, lba);
        assert_eq!(decode_pattern(lba, &b).ok(), Some(gen), "lba {lba}");
    }
}

pub fn read_block(e: &Engine, vol: VolumeId, lba: u64) -> Vec<u8> {
    let v = e.shared().volume_by_id(vol).unwrap();
    let mut b = vec![0u8; BS];
    e.shared().read(&v, lba * BS as u64, &mut b).expect("read");
    b
}

/// A driver that executes queued device operations in a seeded random order, a few
/// at a time, so that crashes land between any two of them.
pub struct Driver {
    pub queue: Vec<IoOp>,
    /// On a striped array, writes to the members themselves (superblocks) run only
    /// when nothing else is queued: the slowest order a device may choose for them,
    /// which is what a flush that must wait for a superblock has to survive.
    pub starve_superblocks: bool,
}

impl Driver {
    pub fn new() -> Self {
        Driver {
            queue: Vec::new(),
            starve_superblocks: false,
        }
    }
    /// Takes new operations from the engine and executes up to `n` of them.
    pub fn step(&mut self, e: &mut Engine, rng: &mut impl rand::Rng, n: usize) {
        let shared = e.shared().clone();
        let member_write = |op: &IoOp| {
            shared.striped.is_some()
                && op.device + 1 < shared.devices.len()
                && matches!(op.kind, IoKind::WriteOwned { .. })
        };
        for _ in 0..n {
            e.drain_io(&mut self.queue);
            if self.queue.is_empty() {
                return;
            }
            let mut i = rng.gen_range(0..self.queue.len());
            if self.starve_superblocks && member_write(&self.queue[i]) {
                if let Some(j) = self.queue.iter().position(|op| !member_write(op)) {
                    i = j;
                }
            }
            let op = self.queue.swap_remove(i);
            let c = execute(&shared, op);
            e.io_completed(c);
        }
    }
    /// Executes everything until the engine asks for nothing more.
    pub fn settle(&mut self, e: &mut Engine, rng: &mut impl rand::Rng) {
        loop {
            e.drain_io(&mut self.queue);
            if self.queue.is_empty() {
                return;
            }
            self.step(e, rng, usize::MAX);
        }
    }
}

/// A snapshot family under GC, on whatever devices and layout: volume "v" of
/// 1/`part` of the array, written, seven blocks of eight rewritten (so GC takes the
/// first segments while the snapshot shares what is left in them), snapshot "s",
/// clone "c" of it with writes of its own, then five rounds over v (flushed every
/// `flush_every` writes: small units on zoned arrays). Returns the model of each
/// volume: per block, the generation it holds.
pub fn snapshot_family_under_gc(
    e: &mut Engine,
    part: u64,
    flush_every: u64,
) -> Vec<(&'static str, Vec<u64>)> {
    let blocks = e.usable_bytes() / BS as u64 / part;
    let v = create_volume(e, "v", blocks * BS as u64);
    let mut mv = vec![1u64; blocks as usize];
    for lba in 0..blocks {
        write_block(e, v, lba, 1, false).unwrap();
    }
    // A new generation, so that a map left pointing at a dead copy reads wrong.
    for lba in (0..blocks).filter(|l| l % 8 != 0) {
        write_block(e, v, lba, 2, false).unwrap();
        mv[lba as usize] = 2;
    }
    for (name, origin, writable) in [("s", "v", false), ("c", "s", true)] {
        make_snapshot(e, origin, name, writable).unwrap();
    }
    let (ms, mut mc) = (mv.clone(), mv.clone());
    let c = e.shared().volume("c").unwrap().id;
    for lba in 0..8 {
        write_block(e, c, lba * 3, 50, false).unwrap();
        mc[(lba * 3) as usize] = 50;
    }
    let mut n = 0;
    for round in 3..=10u64 {
        for lba in (0..blocks).filter(|l| l % 8 != 0 && l % 5 != round % 5) {
            n += 1;
            write_block(e, v, lba, round, n % flush_every == 0).unwrap();
            mv[lba as usize] = round;
        }
    }
    call(e, Request::Flush).result.unwrap();
    vec![("v", mv), ("s", ms), ("c", mc)]
}

/// Every volume of `models` reads back as its model says.
pub fn check_family(e: &Engine, models: &[(&'static str, Vec<u64>)]) {
    for (name, gens) in models {
        let id = e.shared().volume(name).unwrap().id;
        for (lba, &g) in gens.iter().enumerate() {
            let got = decode_pattern(lba as u64, &read_block(e, id, lba as u64));
            assert_eq!(got, Ok(g), "{name} block {lba}");
        }
    }
}

/// Makes `name` from `origin`: a snapshot, or a clone when `writable`.
pub fn make_snapshot(
    e: &mut Engine,
    origin: &str,
    name: &str,
    writable: bool,
) -> Result<(), lamina_core::EngineError> {
    call(
        e,
        Request::CreateSnapshot {
            origin: origin.into(),
            name: name.into(),
            writable,
        },
    )
    .result
}
