mod common;
use common::*;
use lamina_core::Request;
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use rand::{Rng, SeedableRng};
use std::sync::Arc;

fn mem_array(segments: u64) -> Vec<Arc<dyn BlockDevice>> {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(segments)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    devs
}

#[test]
fn write_flush_read_restart() {
    let devs = mem_array(64);
    let mut e = open_rw(&devs, small_config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    for lba in 0..100u64 {
        let r = call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: lba * 4096,
                data: pattern(lba, 1),
                fua: false,
            },
        );
        r.result.unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    for lba in 0..100u64 {
        assert_eq!(decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(), 1);
    }
    assert_eq!(decode_pattern(500, &read_block(&e, vol, 500)).unwrap(), 0);
    drop(e);
    let mut e = open_rw(&devs, small_config());
    let vol = e.shared().volume("v").unwrap().id;
    for lba in 0..100u64 {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            1,
            "lba {lba} after restart"
        );
    }
    // Overwrite, zero a range, restart again.
    for lba in 0..50u64 {
        call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: lba * 4096,
                data: pattern(lba, 2),
                fua: false,
            },
        )
        .result
        .unwrap();
    }
    call(
        &mut e,
        Request::Zero {
            volume: vol,
            offset: 10 * 4096,
            length: 5 * 4096,
            fua: true,
            allocate: false,
        },
    )
    .result
    .unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    for lba in 0..100u64 {
        let want = if (10..15).contains(&lba) {
            0
        } else if lba < 50 {
            2
        } else {
            1
        };
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            want,
            "lba {lba}"
        );
    }
}

#[test]
fn gc_runs_and_data_survives() {
    let devs = mem_array(64);
    let mut e = open_rw(&devs, small_config());
    let usable = e.usable_bytes();
    let blocks = (usable * 8 / 10) / 4096;
    let vol = create_volume(&mut e, "v", blocks * 4096);
    let mut version = vec![0u64; blocks as usize];
    let mut x = 12345u64;
    for i in 0..blocks * 6 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let lba = if i < blocks { i } else { x % blocks };
        version[lba as usize] += 1;
        let r = call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: lba * 4096,
                data: pattern(lba, version[lba as usize]),
                fua: false,
            },
        );
        r.result
            .unwrap_or_else(|err| panic!("write {i} of lba {lba}: {err}"));
    }
    let st = e.status();
    eprintln!("{st:#?}");
    assert!(st.gc_bytes_relocated > 0, "GC must have run: {st:?}");
    assert!(st.write_amplification.unwrap() > 1.0);
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            version[lba as usize],
            "lba {lba}"
        );
    }
    call(&mut e, Request::Flush).result.unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            version[lba as usize],
            "lba {lba} after restart"
        );
    }
}

/// Device errors: a failed read is an I/O error for that read only; a failed write
/// stops the array from accepting writes (and says why) while reads go on.
#[test]
fn device_errors_are_reported_not_hidden() {
    use lamina_core::EngineError;
    use lamina_device::fault::{FaultDevice, FaultOp};
    let mem: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(64)));
    format_devices(std::slice::from_ref(&mem), &small_params());
    let fault = Arc::new(FaultDevice::new(mem));
    let devs: Vec<Arc<dyn BlockDevice>> = vec![fault.clone()];
    let mut e = open_rw(&devs, small_config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    for lba in 0..64u64 {
        call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: lba * 4096,
                data: pattern(lba, 1),
                fua: false,
            },
        )
        .result
        .unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    // Every read of the device fails: reads of data on it report an error, never
    // zeros or stale data.
    fault.fail(FaultOp::Read, 0, u64::MAX, u64::MAX);
    let v = e.shared().volume_by_id(vol).unwrap();
    let mut b = vec![0u8; 4096];
    assert!(e.shared().read(&v, 0, &mut b).is_err());
    fault.heal();
    assert_eq!(decode_pattern(0, &read_block(&e, vol, 0)).unwrap(), 1);
    // A failed write: the array goes read-only with a reason; reads still work.
    fault.fail(FaultOp::Write, 0, u64::MAX, u64::MAX);
    for lba in 0..300u64 {
        let r = call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: (lba % 64) * 4096,
                data: pattern(lba % 64, 2),
                fua: false,
            },
        );
        if r.result.is_err() {
            break;
        }
    }
    let r = call(&mut e, Request::Flush);
    let err = r.result.expect_err("flush must fail once a write failed");
    assert!(matches!(err, EngineError::Failed(_)), "{err:?}");
    assert_eq!(err.errno(), 5);
    assert!(e.status().failed.is_some());
    let r = call(
        &mut e,
        Request::Write {
            volume: vol,
            offset: 0,
            data: pattern(0, 3),
            fua: false,
        },
    );
    assert_eq!(r.result.unwrap_err().errno(), 5);
    fault.heal();
    let got = decode_pattern(5, &read_block(&e, vol, 5)).unwrap();
    assert!(got == 1 || got == 2, "reads keep working after the failure");
}

/// A torn checkpoint or superblock update never leaves the array unopenable: the
/// previous superblock copy and checkpoint remain.
#[test]
fn damaged_superblock_copy_is_survived_and_both_are_refused() {
    use lamina_format::superblock::SUPERBLOCK_OFFSETS;
    let devs = mem_array(64);
    {
        let mut e = open_rw(&devs, small_config());
        let vol = create_volume(&mut e, "v", 1 << 20);
        call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: 0,
                data: pattern(0, 9),
                fua: true,
            },
        )
        .result
        .unwrap();
    }
    devs[0]
        .write_at(&[0xee; 512], SUPERBLOCK_OFFSETS[0] + 512)
        .unwrap();
    let (e, report) = lamina_core::open(
        devs.clone(),
        small_config(),
        lamina_core::OpenMode::ReadWrite,
    )
    .expect("open with one copy");
    assert!(
        report.warnings.iter().any(|w| w.contains("superblock")),
        "{:?}",
        report.warnings
    );
    assert_eq!(
        decode_pattern(0, &read_block(&e, e.shared().volume("v").unwrap().id, 0)).unwrap(),
        9
    );
    drop(e);
    for off in SUPERBLOCK_OFFSETS {
        devs[0].write_at(&[0xee; 512], off + 512).unwrap();
    }
    let err = lamina_core::open(devs, small_config(), lamina_core::OpenMode::ReadOnly)
        .err()
        .expect("must refuse");
    assert!(
        err.to_string().contains("no valid Lamina superblock"),
        "{err}"
    );
}

/// A read error while recovery verifies the unsynced tail is not a torn write:
/// recovery refuses (naming the place) rather than roll flushed data back.
#[test]
fn recovery_read_error_refuses_instead_of_rolling_back() {
    use lamina_device::fault::{FaultDevice, FaultOp};
    let devs = mem_array(64);
    {
        let mut e = open_rw(&devs, small_config());
        let vol = create_volume(&mut e, "v", 1 << 20);
        call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: 0,
                data: pattern(0, 1),
                fua: false,
            },
        )
        .result
        .unwrap();
        // Flushed, and nothing sealed afterwards: no header vouches for this unit.
        call(&mut e, Request::Flush).result.unwrap();
    }
    let fault = Arc::new(FaultDevice::new(devs[0].clone()));
    // Fail every data read of the segment area that is not a header or summary: the
    // first read of each unit header succeeds (recovery must find the unit), then
    // the verification read fails.
    fault.fail(FaultOp::Read, 1 << 20, u64::MAX, u64::MAX);
    let dev: Arc<dyn BlockDevice> = fault.clone();
    let r = lamina_core::open(vec![dev], small_config(), lamina_core::OpenMode::ReadWrite);
    let err = r
        .err()
        .expect("recovery must not succeed without reading the data");
    assert!(!err.to_string().is_empty());
    // With the device healthy again, the flushed block is there.
    fault.heal();
    let dev: Arc<dyn BlockDevice> = fault.clone();
    let (e, _) =
        lamina_core::open(vec![dev], small_config(), lamina_core::OpenMode::ReadWrite).unwrap();
    let vol = e.shared().volume("v").unwrap().id;
    assert_eq!(decode_pattern(0, &read_block(&e, vol, 0)).unwrap(), 1);
}

/// GC never gives up a block it cannot read: the block stays mapped (reads of it
/// report the error) and its segment is not released; once the device answers
/// again the data is intact, also after a restart.
#[test]
fn gc_read_errors_keep_the_only_copy() {
    use lamina_device::fault::{FaultDevice, FaultOp};
    let mem: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(48)));
    format_devices(std::slice::from_ref(&mem), &small_params());
    let fault = Arc::new(FaultDevice::new(mem));
    let devs: Vec<Arc<dyn BlockDevice>> = vec![fault.clone()];
    let mut e = open_rw(&devs, small_config());
    let usable = e.usable_bytes() / 4096;
    let blocks = usable * 7 / 10;
    let vol = create_volume(&mut e, "v", blocks * 4096);
    // Even blocks are cold, odd blocks hot, interleaved in the same segments; the
    // hot ones are then overwritten until GC must move cold blocks out of segments
    // whose reads fail.
    for lba in 0..blocks {
        call(
            &mut e,
            Request::Write {
                volume: vol,
                offset: lba * 4096,
                data: pattern(lba, 1),
                fua: false,
            },
        )
        .result
        .unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    // Data reads of the first 16 segments fail; their summaries (the last block of
    // each 64-block segment here) stay readable, so GC gets as far as the blocks.
    for seg in 0..16u64 {
        let start = (1u64 << 20) + seg * 64 * 4096;
        fault.fail(FaultOp::Read, start, start + 63 * 4096, u64::MAX);
    }
    let mut version = 2;
    for _ in 0..8 {
        for lba in (1..blocks).step_by(2) {
            call(
                &mut e,
                Request::Write {
                    volume: vol,
                    offset: lba * 4096,
                    data: pattern(lba, version),
                    fua: false,
                },
            )
            .result
            .unwrap();
        }
        version += 1;
    }
    assert!(fault.injected() > 0, "GC must have tried the failing area");
    assert!(
        e.status().corrupt_blocks > 0,
        "GC must have met unreadable blocks"
    );
    fault.heal();
    let want = |lba: u64| {
        if lba.is_multiple_of(2) {
            1
        } else {
            version - 1
        }
    };
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            want(lba),
            "block {lba}"
        );
    }
    call(&mut e, Request::Flush).result.unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            want(lba),
            "block {lba} after restart"
        );
    }
}

/// Volumes appear to clients only once their creation is durable; a deleted volume
/// disappears at once but its data is only destroyed once the deletion is durable;
/// ids are never reused.
#[test]
fn volume_lifecycle_is_crash_safe() {
    use lamina_core::Token;
    use lamina_device::crash::{CrashDevice, PowerCut};
    use rand::SeedableRng;
    let dev = Arc::new(CrashDevice::new("c", device_bytes(64)));
    let devs: Vec<Arc<dyn BlockDevice>> = vec![dev.clone()];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, small_config());
    let a = create_volume(&mut e, "a", 1 << 20);
    for lba in 0..64 {
        call(
            &mut e,
            Request::Write {
                volume: a,
                offset: lba * 4096,
                data: pattern(lba, 1),
                fua: false,
            },
        )
        .result
        .unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    // Creation in progress: not visible yet.
    e.submit(
        Token {
            conn: 1,
            handle: 99,
        },
        Request::CreateVolume {
            name: "b".into(),
            size_bytes: 1 << 20,
        },
    );
    assert!(
        e.shared().volume("b").is_none(),
        "b must not be exported before its creation is durable"
    );
    // Deletion requested: hidden at once, but a power cut before it commits brings
    // the volume back whole.
    e.submit(
        Token {
            conn: 1,
            handle: 100,
        },
        Request::DeleteVolume { name: "a".into() },
    );
    assert!(
        e.shared().volume("a").is_none(),
        "a deleted volume is hidden at once"
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let image = dev.power_cut(
        &mut rng,
        PowerCut {
            keep_probability: 0.5,
        },
    );
    drop(e);
    let dev2 = Arc::new(CrashDevice::from_image("c", image));
    let devs2: Vec<Arc<dyn BlockDevice>> = vec![dev2.clone()];
    let mut e = open_rw(&devs2, small_config());
    let a2 = e
        .shared()
        .volume("a")
        .expect("an uncommitted deletion is undone by a crash")
        .id;
    assert_eq!(a2, a);
    for lba in 0..64 {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, a, lba)).unwrap(),
            1,
            "block {lba} of a"
        );
    }
    // A completed deletion destroys it; the next volume gets a new id.
    call(&mut e, Request::DeleteVolume { name: "a".into() })
        .result
        .unwrap();
    let c = create_volume(&mut e, "c", 1 << 20);
    assert!(
        c.0 > a.0,
        "volume ids are never reused ({} after {})",
        c.0,
        a.0
    );
    assert!(e.shared().volume("a").is_none());
    drop(e);
    let e = open_rw(&devs2, small_config());
    assert!(
        e.shared().volume("a").is_none(),
        "a committed deletion survives restarts"
    );
    assert!(e.shared().volume("c").is_some());
    assert_eq!(
        e.status().live_bytes,
        0,
        "the deleted volume's space is released"
    );
}

/// Released segments are discarded (here on a device whose discarded ranges read
/// as zeros), and nothing that was still needed was among them: with no delay as
/// they are released, with a delay once they have stayed free that long (and not
/// while the writes keep reusing them sooner).
#[test]
fn released_segments_are_discarded() {
    for delay in [0, 60_000] {
        let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(lamina_device::mem::MemDevice::new(
            "d",
            device_bytes(120),
        ))];
        format_devices(&devs, &small_params());
        let cfg = || lamina_core::EngineConfig {
            discard_delay_ms: delay,
            ..small_config()
        };
        let mut e = open_rw(&devs, cfg());
        let blocks = (e.status().usable_bytes / BS as u64) * 8 / 10;
        let vol = create_volume(&mut e, "v", blocks * BS as u64);
        let mut model = std::collections::HashMap::new();
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // The engine's clock: 10 ms per write. (The writes are not made with
        // `call`, whose rounds move the clock an hour each.)
        let mut now = e.now_ms();
        // A minute idle first: the fresh array's free segments are discarded.
        for _ in 0..200 {
            now += 1000;
            e.tick(now);
            lamina_core::run_inline(&mut e);
        }
        let idle = e.segments_discarded();
        assert_eq!(idle > 0, delay > 0, "{idle} discarded while idle");
        let mut replies = Vec::new();
        let mut steady = 0;
        for i in 0..blocks * 4 {
            if i == blocks * 2 {
                steady = e.segments_discarded();
            }
            let lba = rng.gen_range(0..blocks);
            let gen = model.get(&lba).copied().unwrap_or(0) + 1;
            let token = lamina_core::Token { conn: 9, handle: i };
            let data = lamina_testkit::pattern(lba, gen);
            let offset = lba * BS as u64;
            e.submit(
                token,
                Request::Write {
                    volume: vol,
                    offset,
                    data,
                    fua: false,
                },
            );
            loop {
                now += 10;
                e.tick(now);
                lamina_core::run_inline(&mut e);
                e.drain_replies(&mut replies);
                if let Some(r) = replies.iter().position(|r| r.token == token) {
                    replies.swap_remove(r).result.unwrap();
                    break;
                }
            }
            model.insert(lba, gen);
        }
        let churned = e.segments_discarded() - idle;
        let steady = e.segments_discarded() - steady;
        call(&mut e, Request::Flush).result.unwrap();
        if delay == 0 {
            assert!(churned > 10, "{churned} discarded as released");
        } else {
            // In the steady state, released segments are reused within seconds:
            // none stays free for a minute.
            assert_eq!(steady, 0, "discarded while the writes reused them");
            // Idle for 100 s: what is free now is discarded, a few at a time.
            for _ in 0..100 {
                let t = e.now_ms() + 1000;
                e.tick(t);
                lamina_core::run_inline(&mut e);
            }
            let free = e.status().free_segments as usize;
            let clean = e.free_segments_discarded();
            assert!(
                clean + 1 >= free && clean > 3,
                "{clean} of {free} free segments discarded after 100 s idle (all but the head)"
            );
        }
        verify_model(&e, vol, &model);
        drop(e);
        let e = open_rw(&devs, cfg());
        verify_model(&e, vol, &model);
    }
}

/// What was discarded stays known across a restart (the checkpoint records it), so
/// the next run does not discard every free segment again: on a large SSD that was
/// a TRIM of all free space 30 s after every start, and on a thin backing file the
/// pages of a file written in full given back at once.
#[test]
fn discarded_segments_are_not_discarded_again_after_a_restart() {
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(lamina_device::mem::MemDevice::new(
        "d",
        device_bytes(120),
    ))];
    format_devices(&devs, &small_params());
    let cfg = || lamina_core::EngineConfig {
        discard_delay_ms: 60_000,
        ..small_config()
    };
    let idle = |e: &mut lamina_core::Engine, secs: u64| {
        for _ in 0..secs {
            let t = e.now_ms() + 1000;
            e.tick(t);
            lamina_core::run_inline(e);
        }
    };
    let mut e = open_rw(&devs, cfg());
    idle(&mut e, 100);
    let first = e.segments_discarded();
    assert!(first > 3, "{first} discarded after 100 s idle");
    call(&mut e, Request::Checkpoint).result.unwrap();
    let clean = e.free_segments_discarded();
    drop(e);
    let mut e = open_rw(&devs, cfg());
    let kept = e.free_segments_discarded();
    // The recovery checkpoint takes a segment or two of them.
    assert!(
        kept + 4 >= clean && kept > 3,
        "{kept} of {clean} known as discarded after the restart"
    );
    idle(&mut e, 100);
    let again = e.segments_discarded();
    assert!(
        again <= 4,
        "{again} segments discarded again after the restart ({clean} were)"
    );
    assert!(e.free_segments_discarded() + 4 >= clean);
}

/// Segments opened after the durable checkpoint keep their first unit header when
/// they are discarded (released, or while free): recovery walks them in
/// free-queue order and would take a long run of zeroed ones for the end of the
/// allocations, missing everything after it. Here a small region is rewritten
/// (and flushed) over and over with no checkpoint in between, so many such
/// segments are opened, released and discarded, on a device whose discarded
/// ranges read as zeros, with discards as released and with free segments
/// discarded at every step of the clock; every flushed write must come back after
/// a crash. (Discarding them whole fails it.)
#[test]
fn segments_opened_after_the_checkpoint_survive_release_until_reused() {
    for delay in [0, 1] {
        let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(lamina_device::mem::MemDevice::new(
            "d",
            device_bytes(400),
        ))];
        format_devices(&devs, &small_params());
        let cfg = || lamina_core::EngineConfig {
            checkpoint_interval_blocks: u64::MAX / 4,
            discard_delay_ms: delay,
            ..small_config()
        };
        let mut e = open_rw(&devs, cfg());
        let vol = create_volume(&mut e, "v", 4096 * BS as u64);
        let mut model = std::collections::HashMap::new();
        // Fill the volume once (its blocks live in early segments), then churn a
        // small region through more than 100 segments.
        overwrite(&mut e, vol, &mut model, 4096, 500, |i| i);
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        for i in 0..200 {
            overwrite(&mut e, vol, &mut model, 40, 40, |_| rng.gen_range(0..256));
            let t = e.now_ms() + 1000 + i;
            e.tick(t);
            lamina_core::run_inline(&mut e);
        }
        let checkpoints = e.counters().checkpoints;
        let discarded = e.segments_discarded();
        let tails = e.segments_tail_discarded();
        let st = e.status();
        assert_eq!(
            (st.segments_discarded, st.segments_tail_discarded),
            (discarded, tails)
        );
        assert_eq!(e.segments_head_discarded(), 0, "no checkpoint is past them");
        let after_churn = e.segments_discarded();
        // Once a checkpoint is past them, the kept headers go too (and count as
        // no new segment discarded), then a crash.
        call(&mut e, Request::Checkpoint).result.unwrap();
        for i in 0..20 {
            let t = e.now_ms() + 1000 + i;
            e.tick(t);
            lamina_core::run_inline(&mut e);
        }
        let heads = e.segments_head_discarded();
        assert!(
            heads > 20,
            "{heads} kept headers discarded after a checkpoint"
        );
        assert!(e.segments_discarded() - after_churn < heads);
        overwrite(&mut e, vol, &mut model, 40, 40, |i| i);
        drop(e);
        let e = open_rw(&devs, cfg());
        assert!(
            checkpoints <= 2,
            "no checkpoint during the churn ({checkpoints})"
        );
        // The churned segments were discarded, all but their first header
        // (with a delay of 1 ms, once free; with none, as released).
        assert!(
            tails > 100 && discarded >= tails,
            "{tails} of {discarded} discards kept the first header"
        );
        verify_model(&e, vol, &model);
    }
}

/// Reads without waiting: served when every block is unmapped, buffered or on a
/// device that has it at hand, with the same bytes the waiting read returns; on a
/// device that cannot promise that (a fault-injecting wrapper, which never reads
/// without waiting), or for a damaged block, nothing is served, nothing is counted
/// against the device, and the waiting read then reports the damage.
#[test]
fn reads_without_waiting_match_waiting_reads_or_step_aside() {
    use lamina_device::fault::FaultDevice;
    for at_hand in [true, false] {
        let mem = Arc::new(MemDevice::new("mem0", device_bytes(24)));
        let dev: Arc<dyn BlockDevice> = if at_hand {
            mem.clone()
        } else {
            Arc::new(FaultDevice::new(mem.clone()))
        };
        let devs = vec![dev];
        format_devices(&devs, &small_params());
        let mut e = open_rw(&devs, small_config());
        let vol = create_volume(&mut e, "v", 4 << 20);
        for lba in 0..64 {
            write_block(&mut e, vol, lba, 1, false).unwrap();
        }
        call(&mut e, Request::Flush).result.unwrap();
        // Some blocks buffered (written after the flush), most on the device.
        for lba in 60..64 {
            write_block(&mut e, vol, lba, 2, false).unwrap();
        }
        let v = e.shared().volume_by_id(vol).unwrap();
        let mut got = vec![0u8; 72 * BS];
        let mut want = vec![0u8; 72 * BS];
        e.shared().read(&v, 0, &mut want).unwrap();
        let r = e.shared().read_nowait(&v, 0, &mut got);
        if at_hand {
            assert!(matches!(r, Some(Ok(()))), "{r:?}");
            assert!(got == want);
        } else {
            assert!(
                r.is_none(),
                "served without waiting by a device that cannot"
            );
        }
        // Unaligned requests always step aside.
        assert!(e.shared().read_nowait(&v, 512, &mut got[..BS]).is_none());
        // A block damaged on the device: not served, not counted; the waiting read
        // reports it.
        if at_hand {
            let errors = e
                .shared()
                .read_stats
                .checksum_errors
                .load(std::sync::atomic::Ordering::SeqCst);
            let mut off = 0;
            let mut probe = vec![0u8; BS];
            // Find where block 5 lives: flip every copy of its pattern's first byte.
            let want5 = pattern(5, 1);
            let mut image = vec![0u8; mem.size_bytes() as usize];
            mem.read_at(&mut image, 0).unwrap();
            while off + BS <= image.len() {
                if image[off..off + BS] == want5[..] {
                    probe.copy_from_slice(&want5);
                    probe[0] ^= 1;
                    mem.write_at(&probe, off as u64).unwrap();
                }
                off += BS;
            }
            let mut b = vec![0u8; BS];
            assert!(e.shared().read_nowait(&v, 5 * BS as u64, &mut b).is_none());
            assert_eq!(
                e.shared()
                    .read_stats
                    .checksum_errors
                    .load(std::sync::atomic::Ordering::SeqCst),
                errors
            );
            assert!(e.shared().read(&v, 5 * BS as u64, &mut b).is_err());
        }
    }
}

/// Pipelined random overwrites of a volume at 80% of the usable space, 32 writes in
/// flight, on a device of limited bandwidth whose reads are slow (a disk's seeks,
/// QLC's reads), so GC and the release of what it emptied compete with the writes
/// they make room for, as under a real client: every write completes, every block
/// reads back its last version, and the waits at the user floor are counted (once
/// each, however long), where an array with room to spare counts none. Returns the
/// status and each write's latency in rounds of the model, sorted.
fn pipelined_overwrites_under_gc(
    gc_pacing: bool,
    cache_segments: u64,
) -> (lamina_core::StatusReport, Vec<u64>) {
    let devs = if cache_segments == 0 {
        mem_array(256)
    } else {
        // A cache tier (issue 14): the writes wait for compaction instead of GC.
        let devs: Vec<Arc<dyn BlockDevice>> = vec![
            Arc::new(MemDevice::new("mem0", device_bytes(256))),
            Arc::new(MemDevice::new("cache", device_bytes(cache_segments))),
        ];
        let params = lamina_core::FormatParams {
            cache_devices: 1,
            ..small_params()
        };
        format_devices(&devs, &params);
        devs
    };
    let mut e = open_rw(
        &devs,
        lamina_core::EngineConfig {
            gc_pacing,
            ..small_config()
        },
    );
    let blocks = (e.usable_bytes() * 8 / 10) / 4096;
    let vol = create_volume(&mut e, "v", blocks * 4096);
    let mut version = vec![0u64; blocks as usize];
    for lba in 0..blocks {
        version[lba as usize] = 1;
        write_block(&mut e, vol, lba, 1, false).unwrap();
    }
    assert_eq!(e.status().gc_floor_waits, 0, "the fill waited at the floor");
    let shared = e.shared().clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (total, depth) = (blocks * 3, 32usize);
    let mut in_flight = std::collections::HashMap::new();
    let mut latencies = Vec::with_capacity(total as usize);
    let (mut submitted, mut completed, mut round) = (0u64, 0u64, 0u64);
    let (mut queue, mut ops, mut replies) =
        (std::collections::VecDeque::new(), Vec::new(), Vec::new());
    while completed < total {
        while submitted < total && in_flight.len() < depth {
            let lba = rng.gen_range(0..blocks);
            version[lba as usize] += 1;
            let token = lamina_core::Token {
                conn: 1,
                handle: submitted,
            };
            e.submit(
                token,
                Request::Write {
                    volume: vol,
                    offset: lba * 4096,
                    data: pattern(lba, version[lba as usize]),
                    fua: false,
                },
            );
            in_flight.insert(submitted, round);
            submitted += 1;
        }
        e.drain_io(&mut ops);
        queue.extend(ops.drain(..));
        // 256 KiB per round; a read costs 16 times what a write of its size does.
        let mut budget = 256i64 << 10;
        while budget > 0 {
            let Some(op) = queue.pop_front() else { break };
            budget -= match &op.kind {
                lamina_core::io::IoKind::Read { buf } => 16 * buf.len() as i64,
                lamina_core::io::IoKind::WriteUnit { blocks, .. } => *blocks as i64 * 4096,
                _ => 4096,
            };
            e.io_completed(lamina_core::io::execute(&shared, op));
        }
        e.tick(round * 10);
        e.drain_replies(&mut replies);
        for r in replies.drain(..) {
            r.result
                .unwrap_or_else(|err| panic!("write {}: {err}", r.token.handle));
            let sent = in_flight
                .remove(&r.token.handle)
                .unwrap_or_else(|| panic!("reply to {}", r.token.handle));
            latencies.push(round - sent);
            completed += 1;
        }
        round += 1;
        assert!(round < 100 * total, "writes stopped completing");
    }
    for op in queue {
        e.io_completed(lamina_core::io::execute(&shared, op));
    }
    call(&mut e, Request::Flush).result.unwrap();
    let st = e.status();
    latencies.sort_unstable();
    eprintln!(
        "pacing {gc_pacing}: {round} rounds, {} floor waits, {} pace waits, WA {:?}, \
         write latency in rounds p50 {} p99 {} p99.9 {} max {}",
        st.gc_floor_waits,
        st.gc_pace_waits,
        st.write_amplification,
        quantile(&latencies, 0.5),
        quantile(&latencies, 0.99),
        quantile(&latencies, 0.999),
        latencies.last().unwrap()
    );
    assert!(st.gc_bytes_relocated > 0, "GC must have run");
    assert!(
        st.gc_floor_waits + st.gc_pace_waits < total,
        "waits counted per block, not per wait"
    );
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            version[lba as usize],
            "lba {lba}"
        );
    }
    (st, latencies)
}

fn quantile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q) as usize]
}

/// Without pacing (the default) the writes run into the floor and stop there;
/// with it they are slowed before: fewer waits at the floor, and the slowest
/// writes wait less.
#[test]
fn pipelined_overwrites_under_gc_are_paced() {
    // Measured: 8 against 2551 waits, p99.9 25 against 82 rounds.
    paced(0, 2.0);
}

/// The same with a cache tier in front: the writes are paced against
/// compaction, between no free cache segment and compaction's start.
#[test]
fn pipelined_overwrites_on_a_cache_tier_are_paced() {
    // Measured: 0 against 2983 waits, p99.9 37 against 64 rounds.
    paced(32, 1.5);
}

/// Pacing holds writes before the floor (four times fewer waits there at
/// least) and cuts the p99.9 write latency by `tail_gain` at least.
fn paced(cache_segments: u64, tail_gain: f64) {
    let (off, off_lat) = pipelined_overwrites_under_gc(false, cache_segments);
    assert!(off.gc_floor_waits > 0, "the model never reached the floor");
    assert_eq!(off.gc_pace_waits, 0, "paced with pacing off");
    let (on, on_lat) = pipelined_overwrites_under_gc(true, cache_segments);
    assert!(on.gc_pace_waits > 0, "pacing never held a write");
    assert!(
        on.gc_floor_waits * 4 < off.gc_floor_waits,
        "paced writes reached the floor {} times, unpaced {}",
        on.gc_floor_waits,
        off.gc_floor_waits
    );
    let (on_tail, off_tail) = (quantile(&on_lat, 0.999), quantile(&off_lat, 0.999));
    assert!(
        on_tail as f64 * tail_gain < off_tail as f64,
        "p99.9 write latency paced {on_tail} rounds, unpaced {off_tail}"
    );
}

/// Scattered writes to a thin volume make a map page each, and every checkpoint
/// writes every page: one block per 4 MiB of a 1 TiB volume, on an array of 400
/// small segments, until ENOSPC. The pages count against the usable space as the
/// writes are admitted, so the writes are refused before the checkpoint after
/// them has no room: it commits, and everything acknowledged is there after a
/// restart. Before, the pages counted only from the next checkpoint, and that
/// checkpoint (17160 pages on an array with 8000 blocks free) waited for ever
/// for segments nothing would free.
#[test]
fn scattered_writes_to_a_thin_volume_leave_room_for_their_checkpoint() {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(400)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    // The default checkpoint interval (1 GiB of writes): none in between.
    let cfg = lamina_core::EngineConfig {
        buffer_units: 4,
        ..Default::default()
    };
    let mut e = open_rw(&devs, cfg.clone());
    let usable = e.usable_bytes() / BS as u64;
    let v = create_volume(&mut e, "v", 1 << 40);
    let page = 1024u64;
    let mut written = 0;
    let err = loop {
        assert!(
            written <= usable,
            "{written} blocks written, {usable} usable"
        );
        let r = lamina_core::call_inline(
            &mut e,
            lamina_core::Token { conn: 7, handle: 1 },
            Request::Write {
                volume: v,
                offset: written * page * BS as u64,
                data: pattern(written * page, 1),
                fua: false,
            },
            1000,
        )
        .expect("a reply");
        match r.result {
            Ok(()) => written += 1,
            Err(err) => break err,
        }
    };
    assert!(matches!(err, lamina_core::EngineError::NoSpace(_)), "{err}");
    // Each block took a page in two checkpoints besides itself.
    eprintln!("{written} scattered blocks written of {usable} usable");
    assert!(written < usable / 2, "{written} of {usable}");
    let ckpt = lamina_core::call_inline(
        &mut e,
        lamina_core::Token { conn: 7, handle: 2 },
        Request::Checkpoint,
        1000,
    )
    .expect("the checkpoint commits");
    ckpt.result.unwrap();
    drop(e);
    let e = open_rw(&devs, cfg);
    for k in (0..written).step_by(97) {
        assert_eq!(
            decode_pattern(k * page, &read_block(&e, v, k * page)),
            Ok(1)
        );
    }
    let mut r = lamina_core::fsck::FsckReport::default();
    lamina_core::fsck::check(&e, true, &mut r);
    assert!(r.findings.is_empty(), "fsck: {:?}", r.findings);
}

/// Once the server begins to shut down, what would need a checkpoint after the
/// final one is refused with ESHUTDOWN (writes, new volumes, snapshots); flushes
/// and the final checkpoint are served, and what was written before is kept.
#[test]
fn after_shutdown_begins_only_flushes_and_checkpoints_are_served() {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(64)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, small_config());
    let v = create_volume(&mut e, "v", 1 << 20);
    write_block(&mut e, v, 3, 1, false).unwrap();
    e.begin_shutdown();
    let refused = |r: Result<(), lamina_core::EngineError>| {
        assert!(
            matches!(r, Err(lamina_core::EngineError::ShuttingDown)),
            "{r:?}"
        )
    };
    refused(write_block(&mut e, v, 4, 1, false));
    refused(
        call(
            &mut e,
            Request::CreateVolume {
                name: "w".into(),
                size_bytes: 1 << 20,
            },
        )
        .result,
    );
    refused(
        call(
            &mut e,
            Request::CreateSnapshot {
                origin: "v".into(),
                name: "s".into(),
                writable: false,
            },
        )
        .result,
    );
    call(&mut e, Request::Flush).result.unwrap();
    call(&mut e, Request::Checkpoint).result.unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    assert_eq!(decode_pattern(3, &read_block(&e, v, 3)), Ok(1));
    assert!(e.shared().volume("w").is_none() && e.shared().volume("s").is_none());
}

/// A flush that a connection sends while the final checkpoint commits is answered
/// once its sync completes, even when that is after the checkpoint's answer: the
/// engine says it is quiesced only when no flush waits and nothing is in flight,
/// and the server stops only then (it used to stop at the checkpoint's answer and
/// drop the sync's completion, so such a flush was never answered). Once closed,
/// every request is refused.
#[test]
fn a_flush_sent_during_the_final_checkpoint_is_answered_before_the_engine_stops() {
    use lamina_core::Token;
    use std::collections::HashSet;
    let mut late = 0;
    for seed in 0..16 {
        let devs = mem_array(64);
        let mut e = open_rw(&devs, small_config());
        let v = create_volume(&mut e, "v", 1 << 20);
        for k in 0..40 {
            write_block(&mut e, v, k, 1, false).unwrap();
        }
        e.begin_shutdown();
        let ckpt = Token { conn: 9, handle: 0 };
        e.submit(ckpt, Request::Checkpoint);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut driver = Driver::new();
        let mut open = HashSet::new();
        let mut replies = Vec::new();
        // A flush sent once the engine has closed: refused.
        let after_close = Token {
            conn: 11,
            handle: 0,
        };
        let mut refused = false;
        let mut answer = |e: &mut lamina_core::Engine, open: &mut HashSet<u64>| {
            let mut checkpointed = false;
            e.drain_replies(&mut replies);
            for r in replies.drain(..) {
                if r.token == after_close {
                    assert!(
                        matches!(r.result, Err(lamina_core::EngineError::ShuttingDown)),
                        "{:?}",
                        r.result
                    );
                    refused = true;
                    continue;
                }
                r.result.unwrap();
                if r.token == ckpt {
                    checkpointed = true;
                } else {
                    assert!(open.remove(&r.token.handle), "{:?} answered twice", r.token);
                }
            }
            checkpointed
        };
        // Another connection flushes before every device operation completes.
        for step in 1u64.. {
            assert!(step < 100_000, "the final checkpoint never committed");
            e.submit(
                Token {
                    conn: 10,
                    handle: step,
                },
                Request::Flush,
            );
            open.insert(step);
            driver.step(&mut e, &mut rng, 1);
            if answer(&mut e, &mut open) {
                break;
            }
        }
        late += open.len();
        e.finish_shutdown();
        e.submit(after_close, Request::Flush);
        let mut steps = 0;
        while !e.quiesced() {
            steps += 1;
            assert!(steps < 100_000, "the engine never quiesced");
            driver.step(&mut e, &mut rng, 1);
            answer(&mut e, &mut open);
        }
        answer(&mut e, &mut open);
        assert!(
            open.is_empty(),
            "seed {seed}: flushes {open:?} never answered"
        );
        assert!(refused, "the flush sent after closing was not answered");
    }
    // The case this is about happened: flushes were still waiting when the
    // checkpoint answered.
    assert!(late > 0);
}

/// After a write run many times longer than the header cache, the cache still
/// holds the units with live blocks: a full shard drops the entries of segments'
/// earlier incarnations before anything else. Evicting at random among them lost
/// most live units' entries, and every cold read then read its unit's header
/// again (on a server: off the connection's ring, 0.89x `nbdkit file` where a
/// fresh cache gave 1.5x).
#[test]
fn after_a_long_write_run_the_header_cache_holds_the_live_units() {
    let devs = mem_array(64);
    // 1024 units' checksums (8-block units), twice the units the array holds.
    let cfg = lamina_core::EngineConfig {
        header_cache_bytes: 1024 * (16 * 8 + 128),
        ..small_config()
    };
    let mut e = open_rw(&devs, cfg);
    let blocks = 1500;
    let v = create_volume(&mut e, "v", blocks * BS as u64);
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    let mut model = vec![1u64; blocks as usize];
    // About 40 times the cache's units written, GC moving blocks throughout.
    for i in 0..40 * 1024 * 8 {
        let lba = rng.gen_range(0..blocks);
        model[lba as usize] = 2 + i;
        write_block(&mut e, v, lba, 2 + i, false).unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    let before = e.status().header_cache_misses;
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, v, lba)),
            Ok(model[lba as usize])
        );
    }
    let misses = e.status().header_cache_misses - before;
    // Every unit holding a live block was cached when it was written, and stays.
    assert!(
        misses <= blocks / 50,
        "{misses} header reads for {blocks} blocks"
    );
}
