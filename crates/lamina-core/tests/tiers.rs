//! The cache tier (issue 14): a fast member in front of the capacity tier takes
//! every user write; compaction moves the cache's oldest segments, what is still
//! live in them, to the capacity tier. (Power cuts with a cache tier are in
//! `crash.rs`, `cache_tier_power_cuts_never_lose_flushed_writes`.)

mod common;
use common::*;
use lamina_core::{FormatParams, Request, VolumeId};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use std::collections::HashMap;
use std::sync::Arc;

const CAPACITY_SEGMENTS: u64 = 48;
const CACHE_SEGMENTS: u64 = 20;

fn tiered_params() -> FormatParams {
    FormatParams {
        cache_devices: 1,
        ..small_params()
    }
}

/// A capacity member of 48 segments and a cache member of 20.
fn tiered_devices() -> Vec<Arc<dyn BlockDevice>> {
    let devs = vec![
        Arc::new(MemDevice::new("capacity", device_bytes(CAPACITY_SEGMENTS))),
        Arc::new(MemDevice::new("cache", device_bytes(CACHE_SEGMENTS))),
    ];
    dyn_devs(&devs)
}

/// A new array on [`tiered_devices`], opened.
fn tiered_engine() -> (Vec<Arc<dyn BlockDevice>>, lamina_core::Engine) {
    let devs = tiered_devices();
    format_devices(&devs, &tiered_params());
    let e = open_rw(&devs, small_config());
    (devs, e)
}

/// A capacity member and a cache of two copies (segments of each), formatted.
fn mirrored(capacity: u64, cache: u64) -> Vec<Arc<dyn BlockDevice>> {
    let mk = |n: &str, segs: u64| {
        Arc::new(MemDevice::new(n, device_bytes(segs))) as Arc<dyn BlockDevice>
    };
    let devs = vec![
        mk("capacity", capacity),
        mk("copy0", cache),
        mk("copy1", cache),
    ];
    let params = FormatParams {
        cache_devices: 2,
        ..tiered_params()
    };
    format_devices(&devs, &params);
    devs
}

/// Fails member `index` and puts a new device of `segments` in its place
/// (rebuilding from the cursor at 0); returns the new device.
fn replace_copy(e: &mut lamina_core::Engine, index: usize, segments: u64) -> Arc<dyn BlockDevice> {
    call(e, Request::FailMember { index })
        .result
        .expect("fail the copy");
    let new = Arc::new(MemDevice::new("copy-new", device_bytes(segments))) as Arc<dyn BlockDevice>;
    replace_member(e, index, new.clone());
    new
}

fn member_bytes(e: &lamina_core::Engine) -> (u64, u64) {
    let s = e.status();
    (s.members[0].bytes_written, s.members[1].bytes_written)
}

#[test]
fn user_writes_land_in_the_cache_and_compaction_moves_them_on() {
    let (devs, mut e) = tiered_engine();
    let s = e.status();
    let cache = s.cache.clone().expect("a cache tier");
    assert_eq!(cache.segment_count, CACHE_SEGMENTS);
    // Usable capacity is the capacity tier's: the cache only stages writes.
    assert_eq!(s.segment_count, CAPACITY_SEGMENTS);
    let usable = e.usable_bytes() / BS as u64;
    let blocks = usable * 7 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();

    // Less than the cache holds before compaction starts: only the cache member
    // is written (after a flush has sealed what creating the volume left in the
    // metadata stream).
    call(&mut e, Request::Flush).result.expect("flush");
    let before = member_bytes(&e);
    overwrite(&mut e, vol, &mut model, 300, 50, |i| i * 7 % blocks);
    let after = member_bytes(&e);
    assert_eq!(after.0, before.0, "the capacity member took no write");
    assert!(after.1 - before.1 >= 300 * BS as u64, "the cache took them");
    let c = e.status().cache.unwrap();
    assert_eq!(c.compactions, 0);
    assert!(c.dirty_bytes >= 280 * BS as u64, "{c:?}");

    // Many times the cache: compaction moves data on, and everything reads back.
    overwrite(&mut e, vol, &mut model, 6 * blocks, 200, |i| {
        (i * 2_654_435_761) % blocks
    });
    let c = e.status().cache.unwrap();
    assert!(c.compactions > 0 && c.compacted_bytes > 0, "{c:?}");
    assert!(
        c.free_segments > 0 && c.dirty_bytes <= CACHE_SEGMENTS * 64 * BS as u64,
        "{c:?}"
    );
    assert!(member_bytes(&e).0 > after.0 + c.compacted_bytes / 2);
    let r0 = e.status().cache.unwrap();
    verify_model(&e, vol, &model);
    e.check_gc_index();
    // Reads are counted where they were found: the whole volume, read once, comes
    // from both tiers (and from the buffer, what the last flush left there).
    let r = e.status().cache.unwrap();
    let (cache, capacity, buffer) = (
        r.read_bytes_cache - r0.read_bytes_cache,
        r.read_bytes_capacity - r0.read_bytes_capacity,
        r.read_bytes_buffer - r0.read_bytes_buffer,
    );
    assert!(cache > 0 && capacity > 0, "{r:?}");
    let mapped = model.len() as u64 * BS as u64;
    assert!(cache + capacity + buffer >= mapped, "{r:?}");
    assert!(
        r.hit_ratio.unwrap() > 0.0 && r.hit_ratio.unwrap() < 1.0,
        "{r:?}"
    );
    // The capacity tier took compaction's and the metadata's writes, a share of
    // what users wrote.
    let wa = r.capacity_write_amplification.unwrap();
    assert!(wa > 0.1 && wa < 2.0, "{r:?}");

    // After a restart, from both tiers.
    drop(e);
    let e = open_rw(&devs, small_config());
    verify_model(&e, vol, &model);
    e.check_gc_index();
}

/// CSAL's point: a block rewritten while it is in the cache never costs the
/// capacity tier a write. A hot set well inside the cache, rewritten over and
/// over, leaves compaction almost nothing to move.
#[test]
fn blocks_rewritten_in_the_cache_never_reach_the_capacity_tier() {
    let (_devs, mut e) = tiered_engine();
    let vol = create_volume(&mut e, "v", 2000 * BS as u64);
    let mut model = HashMap::new();
    let hot = 200;
    let writes = 20 * hot;
    let before = member_bytes(&e);
    overwrite(&mut e, vol, &mut model, writes, 100, |i| i % hot);
    let after = member_bytes(&e);
    // The cache turned over several times: its segments were emptied by the
    // rewrites and freed without compaction.
    assert!(after.1 - before.1 > 3 * CACHE_SEGMENTS * 64 * BS as u64);
    assert!(
        after.0 - before.0 < writes * BS as u64 / 20,
        "the capacity member took {} bytes",
        after.0 - before.0
    );
    let c = e.status().cache.unwrap();
    assert!(
        c.compacted_bytes < writes * BS as u64 / 20,
        "compaction moved {} of {} bytes written",
        c.compacted_bytes,
        writes * BS as u64
    );
    verify_model(&e, vol, &model);
}

/// Several volumes, each with its own open user segments in the cache, and
/// trims: every block reads back after compaction and after a restart.
#[test]
fn several_volumes_share_the_cache() {
    let (devs, mut e) = tiered_engine();
    let usable = e.usable_bytes() / BS as u64;
    let per = usable / 5;
    let vols: Vec<VolumeId> = (0..3)
        .map(|i| create_volume(&mut e, &format!("v{i}"), per * BS as u64))
        .collect();
    let mut models = vec![HashMap::new(); 3];
    for round in 0..6u64 {
        for (k, &v) in vols.iter().enumerate() {
            overwrite(&mut e, v, &mut models[k], per / 2, 64, |i| {
                (i * 31 + round * 7 + k as u64) % per
            });
        }
        // Trim a range of the first volume.
        let (from, n) = (round * 10 % per, 8u64);
        call(
            &mut e,
            Request::Zero {
                volume: vols[0],
                offset: from * BS as u64,
                length: n * BS as u64,
                fua: false,
                allocate: false,
            },
        )
        .result
        .expect("trim");
        for lba in from..from + n {
            models[0].remove(&lba);
        }
    }
    call(&mut e, Request::Flush).result.expect("flush");
    assert!(e.status().cache.unwrap().compactions > 0);
    let check = |e: &lamina_core::Engine| {
        for (k, &v) in vols.iter().enumerate() {
            verify_model(e, v, &models[k]);
        }
        // The last trim reads as zeroes.
        for lba in 50..58 {
            assert_eq!(read_block(e, vols[0], lba), vec![0u8; BS]);
        }
        e.check_gc_index();
    };
    check(&e);
    drop(e);
    let e = open_rw(&devs, small_config());
    check(&e);
}

#[test]
fn a_cache_tier_is_refused_where_it_is_not_built() {
    let err = |params: FormatParams, devs: Vec<Arc<dyn BlockDevice>>| {
        let uuids: Vec<[u8; 16]> = (0..devs.len()).map(|i| [i as u8 + 1; 16]).collect();
        lamina_core::format(&devs, &params, [0xab; 16], &uuids, 0)
            .expect_err("refused")
            .to_string()
    };
    let mem = |n: &str, segs: u64| {
        Arc::new(MemDevice::new(n, device_bytes(segs))) as Arc<dyn BlockDevice>
    };
    let said5 = FormatParams {
        layout: Layout::Said5,
        ..tiered_params()
    };
    let e = err(
        said5,
        vec![mem("a", 24), mem("b", 24), mem("c", 24), mem("d", 24)],
    );
    assert!(e.contains("jbod"), "{e}");
    let four = FormatParams {
        cache_devices: 4,
        ..tiered_params()
    };
    let e = err(
        four,
        vec![
            mem("a", 48),
            mem("b", 20),
            mem("c", 20),
            mem("d", 20),
            mem("e", 20),
        ],
    );
    assert!(e.contains("a mirror of 2 or 3"), "{e}");
    // A mirror is as large as its smallest copy.
    let two = FormatParams {
        cache_devices: 2,
        ..tiered_params()
    };
    let e = err(two, vec![mem("a", 48), mem("b", 20), mem("c", 8)]);
    assert!(e.contains("too small"), "{e}");
    let e = err(tiered_params(), vec![mem("a", 48), mem("b", 8)]);
    assert!(e.contains("too small"), "{e}");
    let e = err(tiered_params(), vec![mem("a", 20)]);
    assert!(e.contains("capacity device"), "{e}");
}

/// Recovery walks each tier's free queue on its own: behind a capacity tier with
/// many more free segments than the walk's run of empties, what user writes put
/// in the cache after the last checkpoint is found (a walk of one queue stops
/// among the capacity tier's untouched segments and never reaches the cache's).
#[test]
fn recovery_finds_the_cache_behind_a_large_capacity_tier() {
    let devs = dyn_devs(&[
        Arc::new(MemDevice::new("capacity", device_bytes(400))),
        Arc::new(MemDevice::new("cache", device_bytes(CACHE_SEGMENTS))),
    ]);
    format_devices(&devs, &tiered_params());
    let mut e = open_rw(&devs, small_config());
    let vol = create_volume(&mut e, "v", 4000 * BS as u64);
    let mut model = HashMap::new();
    // Fewer blocks than a checkpoint interval: recovery must replay them all.
    overwrite(&mut e, vol, &mut model, 500, 100, |i| i * 3);
    assert_eq!(e.status().cache.unwrap().compactions, 0);
    // Stopped without a shutdown checkpoint, as a crash after the last flush.
    drop(e);
    let e = open_rw(&devs, small_config());
    verify_model(&e, vol, &model);
}

/// More volumes than the cache has segments, each writing a little and
/// flushing: every cache segment becomes a user stream's open head, with none
/// closed for compaction to take. The engine closes the fullest head, so writes
/// go on instead of waiting for ever (or failing with ENOSPC on an empty array).
#[test]
fn more_volumes_than_cache_segments_keep_writing() {
    let (devs, mut e) = tiered_engine();
    let n = CACHE_SEGMENTS as usize + 8;
    let vols: Vec<VolumeId> = (0..n)
        .map(|i| create_volume(&mut e, &format!("v{i}"), 64 * BS as u64))
        .collect();
    let mut models = vec![HashMap::new(); n];
    for round in 0..3u64 {
        for (k, &v) in vols.iter().enumerate() {
            overwrite(&mut e, v, &mut models[k], 4, 4, |i| (i + round * 4) % 64);
        }
    }
    assert!(e.status().cache.unwrap().compactions > 0);
    for (k, &v) in vols.iter().enumerate() {
        verify_model(&e, v, &models[k]);
    }
    e.check_gc_index();
    drop(e);
    let e = open_rw(&devs, small_config());
    for (k, &v) in vols.iter().enumerate() {
        verify_model(&e, v, &models[k]);
    }
}

/// A snapshot family on a tiered array: compaction moves blocks that the
/// volume, its snapshot and a clone share (once, with an ALIAS record for each
/// other holder, as GC does); every volume reads back, before and after a
/// restart, and the GC index agrees.
#[test]
fn a_snapshot_family_survives_compaction() {
    let (devs, mut e) = tiered_engine();
    let models = snapshot_family_under_gc(&mut e, 3, 50);
    let c = e.status().cache.unwrap();
    assert!(c.compactions > 0 && c.compacted_bytes > 0, "{c:?}");
    check_family(&e, &models);
    e.check_gc_index();
    drop(e);
    let e = open_rw(&devs, small_config());
    check_family(&e, &models);
    e.check_gc_index();
}

/// Without its cache device (one copy, not mirrored) the array is not served:
/// it cannot vouch for what the cache held. The error says which volumes lost
/// what, as the last checkpoint counts it, read-only or not.
#[test]
fn a_lost_cache_device_is_named_with_what_each_volume_lost() {
    let (devs, mut e) = tiered_engine();
    let a = create_volume(&mut e, "a", 400 * BS as u64);
    let _b = create_volume(&mut e, "b", 400 * BS as u64);
    let mut model = HashMap::new();
    overwrite(&mut e, a, &mut model, 100, 50, |i| i);
    call(&mut e, Request::Checkpoint)
        .result
        .expect("checkpoint");
    drop(e);
    for mode in [
        lamina_core::OpenMode::ReadOnly,
        lamina_core::OpenMode::ReadWrite,
    ] {
        let err = lamina_core::open(vec![devs[0].clone()], small_config(), mode)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("no complete copy of the cache tier is left (members [1] missing")
                && err.contains("\"a\" 100 blocks")
                && !err.contains("\"b\""),
            "{err}"
        );
    }
    // With the device back, everything is there.
    let e = open_rw(&devs, small_config());
    verify_model(&e, a, &model);
}

/// A mirrored cache serves while one complete copy is left, and refuses (saying
/// what is lost) when the only copy left is one still being rebuilt: it holds the
/// stripes below its cursor only, and trusting it would drop what the others held.
#[test]
fn a_mirror_needs_one_complete_copy() {
    let devs = mirrored(CAPACITY_SEGMENTS, CACHE_SEGMENTS);
    let mut e = open_rw(&devs, small_config());
    assert_eq!(e.status().cache.unwrap().copies, 2);
    let a = create_volume(&mut e, "a", 400 * BS as u64);
    let mut model = HashMap::new();
    call(&mut e, Request::Checkpoint)
        .result
        .expect("checkpoint");
    overwrite(&mut e, a, &mut model, 100, 50, |i| i);
    call(&mut e, Request::Flush).result.expect("flush");
    // Copy 1 out and replaced; its rebuild not run.
    let new = replace_copy(&mut e, 2, CACHE_SEGMENTS);
    assert_eq!(e.status().members[2].state, "rebuilding");
    // The complete copy cannot be failed now.
    let err = call(&mut e, Request::FailMember { index: 1 })
        .result
        .unwrap_err();
    assert!(err.to_string().contains("unrecoverable"), "{err}");
    drop(e);
    // Copy 0 alone serves everything.
    let e = open_rw(
        &[devs[0].clone(), devs[1].clone(), new.clone()],
        small_config(),
    );
    verify_model(&e, a, &model);
    drop(e);
    // Copy 0 lost: only the copy being rebuilt is left, and that is refused.
    for mode in [
        lamina_core::OpenMode::ReadOnly,
        lamina_core::OpenMode::ReadWrite,
    ] {
        let err = lamina_core::open(vec![devs[0].clone(), new.clone()], small_config(), mode)
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("no complete copy of the cache tier is left (members [1, 2]")
                && err.contains("\"a\""),
            "{err}"
        );
    }
}

/// Each block's generation, as the workload wrote it.
type Model = HashMap<u64, u64>;

/// The engine configuration of [`released_since_the_checkpoint`]: no checkpoint
/// starts by itself.
fn no_auto_checkpoints() -> lamina_core::EngineConfig {
    lamina_core::EngineConfig {
        checkpoint_interval_blocks: u64::MAX / 2,
        ..small_config()
    }
}

/// A mirrored cache of 160 segments (capacity 200) where, since the durable
/// checkpoint, a volume of 20 segments was written five times over: the first four
/// passes' cache segments died whole and were released, one after another in the
/// free queue's order, and recovery from that checkpoint walks them all (their
/// first headers tell it where the allocations went on). Returns the devices, the
/// engine, the volume and its model.
fn released_since_the_checkpoint() -> (
    Vec<Arc<dyn BlockDevice>>,
    lamina_core::Engine,
    VolumeId,
    Model,
) {
    let devs = mirrored(200, 160);
    let mut e = open_rw(&devs, no_auto_checkpoints());
    let blocks = 20 * 64;
    let a = create_volume(&mut e, "a", blocks * BS as u64);
    call(&mut e, Request::Checkpoint)
        .result
        .expect("checkpoint");
    let ckpt = e.status().checkpoint_generation;
    let mut model = HashMap::new();
    overwrite(&mut e, a, &mut model, 5 * blocks, 64, |i| i % blocks);
    call(&mut e, Request::Flush).result.expect("flush");
    assert_eq!(e.status().checkpoint_generation, ckpt, "no checkpoint yet");
    (devs, e, a, model)
}

/// A rebuilt cache copy is a complete copy: once its rebuild is done, the other
/// copy may be lost, and a crash after that loses nothing flushed. The rebuild
/// copies only segments that hold data, so the released segments recovery would
/// walk are blank on the new copy. The rebuild therefore ends with a checkpoint,
/// after which recovery walks only segments the rebuild copied or that were
/// written after it passed them.
#[test]
fn a_crash_after_a_rebuild_and_the_loss_of_the_other_copy_loses_nothing() {
    let (devs, mut e, a, model) = released_since_the_checkpoint();
    let new = replace_copy(&mut e, 2, 160);
    let r = rebuild_member(&mut e, 2, None);
    assert!(r.finished);
    assert_eq!(e.status().members[2].state, "ok");
    // Copy 0 lost, then a crash: the new copy alone holds the cache.
    drop(e);
    let e = open_rw(&[devs[0].clone(), new], no_auto_checkpoints());
    verify_model(&e, a, &model);
}

/// The same for a scrub: a copy that rotted whole is mended by a scrub in the
/// segments that hold data, and the released ones recovery would walk keep their
/// junk; the scrub ends with a checkpoint, so the mended copy alone is enough.
#[test]
fn a_crash_after_a_scrub_and_the_loss_of_the_good_copy_loses_nothing() {
    let (devs, mut e, a, model) = released_since_the_checkpoint();
    let data_offset = lamina_format::superblock::DEFAULT_DATA_OFFSET;
    let junk = vec![0x5au8; devs[2].size_bytes() as usize - data_offset as usize];
    devs[2].write_at(&junk, data_offset).unwrap();
    let r = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
    assert!(
        r.stats.blocks_repaired > 0 && r.stats.unrecoverable == 0,
        "{r:?}"
    );
    drop(e);
    let e = open_rw(&[devs[0].clone(), devs[2].clone()], no_auto_checkpoints());
    verify_model(&e, a, &model);
}

/// One copy of a mirrored cache rots whole (junk over every segment, unit
/// headers and summaries included): a scrub still finds its units through the
/// other copy, rewrites every live block and header from it, and after the scrub
/// the array reads everything without the good copy.
#[test]
fn a_scrub_rebuilds_a_rotten_cache_copy_from_the_other() {
    let f: Vec<Arc<lamina_device::fault::FaultDevice>> = [
        ("capacity", CAPACITY_SEGMENTS),
        ("copy0", CACHE_SEGMENTS),
        ("copy1", CACHE_SEGMENTS),
    ]
    .iter()
    .map(|&(n, segs)| {
        Arc::new(lamina_device::fault::FaultDevice::new(Arc::new(
            MemDevice::new(n, device_bytes(segs)),
        )))
    })
    .collect();
    let devs = dyn_devs(&f);
    let params = FormatParams {
        cache_devices: 2,
        ..tiered_params()
    };
    format_devices(&devs, &params);
    let mut e = open_rw(&devs, small_config());
    let a = create_volume(&mut e, "a", 400 * BS as u64);
    let mut model = HashMap::new();
    // Enough to close several cache segments (on both copies' turns as the data
    // column), too little for compaction to move them all.
    overwrite(&mut e, a, &mut model, 300, 50, |i| i);
    call(&mut e, Request::Flush).result.expect("flush");
    let data_offset = lamina_format::superblock::DEFAULT_DATA_OFFSET;
    let junk = vec![0x5au8; devs[2].size_bytes() as usize - data_offset as usize];
    devs[2].write_at(&junk, data_offset).unwrap();
    let r = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
    assert!(
        r.stats.blocks_repaired > 0
            && r.stats.parity_repaired > 0
            && r.headers_found_by_parity > 0
            && r.stats.unrecoverable == 0,
        "{r:?}"
    );
    drop(e);
    f[1].vanish();
    let e = open_rw(&devs, small_config());
    verify_model(&e, a, &model);
}

/// Reads are counted by where they were found, once: a request that a no-wait
/// attempt gives up on (a block in the write buffer, then one on a device that
/// has nothing at hand) and that is then read the waiting way counts each block
/// one time.
#[test]
fn a_read_is_counted_once_where_it_was_found() {
    // Behind fault-injecting devices, which have nothing at hand for a no-wait
    // read (they pass no page cache through).
    let devs: Vec<Arc<dyn BlockDevice>> = tiered_devices()
        .into_iter()
        .map(|d| Arc::new(lamina_device::fault::FaultDevice::new(d)) as Arc<dyn BlockDevice>)
        .collect();
    format_devices(&devs, &tiered_params());
    let mut e = open_rw(&devs, small_config());
    let v = create_volume(&mut e, "v", 400 * BS as u64);
    write_block(&mut e, v, 1, 1, false).unwrap();
    call(&mut e, Request::Flush).result.expect("flush");
    // Block 0 stays in the write buffer: no flush after it.
    write_block(&mut e, v, 0, 1, false).unwrap();
    let vol = e.shared().volume_by_id(v).unwrap();
    let before = e.status().cache.unwrap();
    let mut buf = vec![0u8; 2 * BS];
    assert!(
        e.shared().read_nowait(&vol, 0, &mut buf).is_none(),
        "the device has nothing at hand"
    );
    e.shared().read(&vol, 0, &mut buf).unwrap();
    let after = e.status().cache.unwrap();
    assert_eq!(
        after.read_bytes_buffer - before.read_bytes_buffer,
        BS as u64
    );
    assert_eq!(after.read_bytes_cache - before.read_bytes_cache, BS as u64);
    assert_eq!(after.read_bytes_capacity, before.read_bytes_capacity);
}

/// The members of a tiered array move as JBOD members do (issue 14): a capacity
/// member and the cache device are copied to new devices with the array closed,
/// and a capacity member is evacuated onto the other; every block reads back
/// after each step. The cache is not evacuated, a mirror's copy is replaced
/// online only, and a tiered array does not grow: each refusal says why.
#[test]
fn the_members_of_a_tiered_array_move() {
    let mem = |n: &str, segs: u64| Arc::new(MemDevice::new(n, device_bytes(segs)));
    let (a, b, c) = (
        mem("cap-a", CAPACITY_SEGMENTS),
        mem("cap-b", CAPACITY_SEGMENTS),
        mem("cache", CACHE_SEGMENTS),
    );
    let devs = dyn_devs(&[a.clone(), b.clone(), c.clone()]);
    format_devices(&devs, &tiered_params());
    let mut e = open_rw(&devs, small_config());
    let blocks = e.usable_bytes() / BS as u64 * 4 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    overwrite(&mut e, vol, &mut model, 5 * blocks, 100, |i| {
        (i * 2_654_435_761) % blocks
    });
    let s = e.status();
    assert!(s.cache.as_ref().unwrap().compactions > 0, "{s:?}");
    assert!(
        s.members.iter().all(|m| m.bytes_written > 0),
        "every member holds data: {:?}",
        s.members
    );
    call(&mut e, Request::Flush).result.expect("flush");
    drop(e);

    let replace = |devs: &[Arc<dyn BlockDevice>], i: usize, new: Arc<dyn BlockDevice>| {
        lamina_core::replace(
            devs.to_vec(),
            &small_config(),
            i,
            new,
            [0x50 + i as u8; 16],
            &lamina_core::GrowParams::default(),
            &mut |_, _| {},
            &mut || Ok(()),
        )
    };
    // A capacity member, then the cache device.
    let a2 = mem("cap-a2", CAPACITY_SEGMENTS);
    let r = replace(&devs, 0, a2.clone()).expect("replace a capacity member");
    assert!(r.segments_copied > 0);
    let devs = dyn_devs(&[a2.clone(), b.clone(), c.clone()]);
    let e = open_rw(&devs, small_config());
    verify_model(&e, vol, &model);
    drop(e);
    let c2 = mem("cache2", CACHE_SEGMENTS);
    let r = replace(&devs, 2, c2.clone()).expect("replace the cache device");
    // Compaction keeps part of the cache free: those segments are not copied.
    assert!(
        r.segments_copied > 0 && r.segments_copied < r.segments,
        "{} of {}",
        r.segments_copied,
        r.segments
    );
    let devs = dyn_devs(&[a2.clone(), b.clone(), c2.clone()]);
    let mut e = open_rw(&devs, small_config());
    verify_model(&e, vol, &model);
    assert_eq!(e.superblock().devices[2].uuid, [0x52; 16]);
    // Writes go on (into the new cache) and read back.
    overwrite(&mut e, vol, &mut model, blocks, 100, |i| (i * 7) % blocks);
    call(&mut e, Request::Flush).result.expect("flush");
    drop(e);

    // The cache is not evacuated; a capacity member is.
    let evacuate = |devs: &[Arc<dyn BlockDevice>], i: usize| {
        lamina_core::evacuate(
            devs.to_vec(),
            &small_config(),
            i,
            &mut |_, _| {},
            &mut || Ok(()),
        )
    };
    let err = evacuate(&devs, 2).unwrap_err().to_string();
    assert!(err.contains("is its cache tier"), "{err}");
    let r = evacuate(&devs, 0).expect("evacuate a capacity member");
    // (Blocks moved count compaction's too; the reads below are the proof.)
    assert!(r.segments > 0, "member 0 held data");
    let devs = dyn_devs(&[b.clone(), c2.clone()]);
    let mut e = open_rw(&devs, small_config());
    verify_model(&e, vol, &model);
    assert!(e.status().cache.is_some());
    overwrite(&mut e, vol, &mut model, blocks, 100, |i| (i * 13) % blocks);
    verify_model(&e, vol, &model);
    drop(e);

    // No grow; a mirror's copy is not copied offline.
    let err = lamina_core::grow(
        devs.clone(),
        &small_config(),
        &[mem("more", 24) as Arc<dyn BlockDevice>],
        &[[9; 16]],
        &lamina_core::GrowParams::default(),
        &mut || Ok(()),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("cannot grow yet"), "{err}");
    let m = dyn_devs(&[
        mem("m-cap", CAPACITY_SEGMENTS),
        mem("m-cap1", CAPACITY_SEGMENTS),
        mem("m-c0", CACHE_SEGMENTS),
        mem("m-c1", CACHE_SEGMENTS),
    ]);
    format_devices(
        &m,
        &FormatParams {
            cache_devices: 2,
            ..small_params()
        },
    );
    let err = replace(&m, 2, mem("m-c2", CACHE_SEGMENTS))
        .unwrap_err()
        .to_string();
    assert!(err.contains("is replaced online"), "{err}");

    // Beside a mirror running on one copy (the other failed, its device gone),
    // a capacity member is still copied and another evacuated: the failed copy
    // takes no superblock.
    let mut e = open_rw(&m, small_config());
    let vol = create_volume(&mut e, "w", blocks * BS as u64);
    let mut model = HashMap::new();
    overwrite(&mut e, vol, &mut model, 4 * blocks, 100, |i| {
        (i * 2_654_435_761) % blocks
    });
    call(&mut e, Request::FailMember { index: 3 })
        .result
        .expect("fail a copy");
    call(&mut e, Request::Flush).result.expect("flush");
    drop(e);
    let gone: Arc<dyn BlockDevice> = Arc::new(lamina_device::striped::Absent::new("m-c1"));
    let m = vec![m[0].clone(), m[1].clone(), m[2].clone(), gone];
    let cap2 = mem("m-cap2", CAPACITY_SEGMENTS);
    replace(&m, 0, cap2.clone()).expect("replace beside a degraded mirror");
    let m = vec![
        cap2 as Arc<dyn BlockDevice>,
        m[1].clone(),
        m[2].clone(),
        m[3].clone(),
    ];
    let e = open_rw(&m, small_config());
    verify_model(&e, vol, &model);
    assert_eq!(e.status().cache.unwrap().copies_ok, 1);
    drop(e);
    evacuate(&m, 1).expect("evacuate beside a degraded mirror");
    let m = vec![m[0].clone(), m[2].clone(), m[3].clone()];
    let e = open_rw(&m, small_config());
    verify_model(&e, vol, &model);
}
