//! What the phase tests build on: a small array on memory devices, driven inline,
//! and found units, segments and volumes made by hand.

use super::checkpoint::Checkpoint;
use super::walk::{Found, FoundUnit, Walk};
use super::{assemble, format, open, FormatParams, OpenMode, RecoveryReport};
use crate::engine::{Engine, EngineConfig, Request, Token};
use crate::shared::{Shared, VolumeShared};
use crate::types::{Lba, Version, VolumeId, BLOCK_SIZE};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use lamina_format::checkpoint::{CheckpointMeta, VolumeRecord};
use lamina_format::unit::{RawRecord, StreamKind};
use std::sync::Arc;

/// Segments of 64 blocks, units of 8 (1 header + 7 data blocks at most).
pub fn params() -> FormatParams {
    FormatParams {
        name: "phases".into(),
        segment_blocks: 64,
        write_unit_blocks: 8,
        overprovision: 0.25,
        ..Default::default()
    }
}

pub fn config() -> EngineConfig {
    EngineConfig {
        buffer_units: 4,
        // No checkpoint but the ones a test asks for.
        checkpoint_interval_blocks: u64::MAX / 4,
        ..Default::default()
    }
}

/// One memory device of 40 segments, formatted.
pub fn devices() -> (Arc<MemDevice>, Vec<Arc<dyn BlockDevice>>) {
    let dev = Arc::new(MemDevice::new(
        "mem0",
        1024 * 1024 + 40 * 64 * BLOCK_SIZE as u64,
    ));
    let devs = vec![dev.clone() as Arc<dyn BlockDevice>];
    format(&devs, &params(), [7; 16], &[[1; 16]], 0).expect("format");
    (dev, devs)
}

/// Opens `devs` read-write, as a server would.
pub fn engine(devs: &[Arc<dyn BlockDevice>]) -> Engine {
    open(devs.to_vec(), config(), OpenMode::ReadWrite)
        .expect("open")
        .0
}

/// Opens `devs` read-write with a volume "v" of 512 blocks in it.
pub fn engine_with_volume(devs: &[Arc<dyn BlockDevice>]) -> (Engine, VolumeId) {
    let mut e = engine(devs);
    let size_bytes = 512 * BLOCK_SIZE as u64;
    let name = "v".to_string();
    call(&mut e, Request::CreateVolume { name, size_bytes });
    let v = e.shared().volume("v").unwrap().id;
    (e, v)
}

/// Sends `req` and runs the engine inline until it is answered.
pub fn call(e: &mut Engine, req: Request) {
    let token = Token { conn: 9, handle: 1 };
    super::call_inline(e, token, req, 100_000)
        .expect("no reply")
        .result
        .expect("request failed");
}

/// Writes `blocks` blocks at `lba` of `volume`, each filled with `fill`.
pub fn write(e: &mut Engine, volume: VolumeId, lba: u64, blocks: usize, fill: u8) {
    call(
        e,
        Request::Write {
            volume,
            offset: lba * BLOCK_SIZE as u64,
            data: vec![fill; blocks * BLOCK_SIZE],
            fua: false,
        },
    );
}

/// Every entry of `map`, in LBA order.
pub fn entries(map: &crate::map::Map) -> Vec<u32> {
    (0..map.len()).map(|lba| map.load(Lba(lba))).collect()
}

/// The first phases of recovery on `devs`, read-only: what the later ones take.
pub fn up_to_walk(devs: &[Arc<dyn BlockDevice>]) -> (Arc<Shared>, Checkpoint, Walk) {
    let mut report = RecoveryReport::default();
    let (sb, shared) =
        assemble::open_devices(devs.to_vec(), &config(), false, &mut report).expect("devices");
    let ckpt = super::checkpoint::load(&shared, sb.checkpoint, &mut report).expect("checkpoint");
    let segs = super::checkpoint::segment_table(&ckpt.meta, shared.geo.segment_count as usize);
    let walk = super::walk::walk(&shared, &ckpt, &segs, &mut report);
    (shared, ckpt, walk)
}

/// A unit at `offset` of `version`, of the run that started at `run_start` and knew
/// everything up to `durable` durable, holding `records` (data records first).
pub fn unit(
    offset: u32,
    version: u64,
    run_start: u64,
    durable: u64,
    records: Vec<RawRecord>,
) -> FoundUnit {
    let data_blocks = records
        .iter()
        .take_while(|r| r.kind == lamina_format::unit::kind::DATA)
        .count() as u32;
    FoundUnit {
        offset,
        header_blocks: 1,
        data_blocks,
        version: Version(version),
        durable_version: Version(durable),
        run_start: Version(run_start),
        opened_time: 0,
        volume_time: 0,
        origin: 0,
        records,
        rebuilt: None,
    }
}

/// An incarnation of `seg` written by `volume`'s user stream from its start.
pub fn found(seg: u32, incarnation: u64, volume: u16, units: Vec<FoundUnit>) -> Found {
    let end = units
        .last()
        .map_or(0, |u| u.offset + u.header_blocks + u.data_blocks);
    Found {
        seg,
        incarnation: Version(incarnation),
        kind: StreamKind::User,
        class: 0,
        volume,
        start: 0,
        units,
        end,
        has_summary: false,
    }
}

/// A walk that found `found` and saw `released` retired.
pub fn walk_of(found: Vec<Found>, released: &[(u32, u64)]) -> Walk {
    Walk {
        found,
        scanned_heads: Default::default(),
        walked_queue: Vec::new(),
        released: released.iter().map(|&(s, i)| (s, Version(i))).collect(),
    }
}

/// A checkpoint at version `c` holding volume 1 of `blocks` blocks (empty map) on
/// the array `shared` describes.
pub fn checkpoint_with_volume(shared: &Shared, c: u64, blocks: u64) -> Checkpoint {
    let vs = Arc::new(VolumeShared::new(
        VolumeId(1),
        "v".into(),
        blocks * BLOCK_SIZE as u64,
        shared.new_map(blocks),
    ));
    let rec = VolumeRecord {
        id: 1,
        name: "v".into(),
        size_bytes: blocks * BLOCK_SIZE as u64,
        created_version: 1,
        user_blocks_written: 0,
        gc_blocks_relocated: 0,
        media_blocks_written: 0,
        pages: Vec::new(),
    };
    Checkpoint {
        version: Version(c),
        generation: 1,
        meta: CheckpointMeta::default(),
        volumes: vec![(vs, rec)],
    }
}
