//! Placement survives a restart: what the classifier learnt (SepBIT's lifespan
//! threshold and whether its classes separate) and the segment ages cost-benefit
//! GC reads are in the checkpoint, so a restarted volume goes on writing as if it
//! had not stopped, instead of learning again from nothing.

mod common;

use common::*;
use lamina_core::{EngineConfig, Request, VolumeId};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

const SEGMENTS: u64 = 400;

fn config() -> EngineConfig {
    EngineConfig {
        classifier: "sepbit".into(),
        gc_policy: "cost-benefit-sqrt".into(),
        // Only the checkpoints the test asks for, and recovery's own.
        checkpoint_interval_blocks: u64::MAX / 2,
        ..small_config()
    }
}

/// 90% of the writes to 10% of the blocks, from a fixed seed.
fn hot_cold(rng: &mut rand::rngs::StdRng, blocks: u64) -> u64 {
    if rng.gen_bool(0.9) {
        rng.gen_range(0..blocks / 10)
    } else {
        rng.gen_range(blocks / 10..blocks)
    }
}

/// A volume of 85% of an array's space, written once: the devices, the engine,
/// the volume, its blocks, what they hold, and the traffic's generator.
type Filled = (
    Vec<Arc<dyn BlockDevice>>,
    lamina_core::Engine,
    VolumeId,
    u64,
    HashMap<u64, u64>,
    rand::rngs::StdRng,
);

fn filled(seed: u64) -> Filled {
    filled_with(config(), seed)
}

/// [`filled`] with another engine configuration.
fn filled_with(cfg: EngineConfig, seed: u64) -> Filled {
    let devs: Vec<Arc<dyn BlockDevice>> =
        vec![Arc::new(MemDevice::new("d", device_bytes(SEGMENTS)))];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, cfg);
    let blocks = (e.status().usable_bytes / BS as u64) * 85 / 100;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    overwrite(&mut e, vol, &mut model, blocks, 4000, |i| i);
    let rng = rand::rngs::StdRng::seed_from_u64(seed);
    (devs, e, vol, blocks, model, rng)
}

struct Run {
    /// Write amplification of the volume over the second half of the writes.
    wa: f64,
    /// Classes open (user, GC) just before the second half, and at its end.
    classes_before: (u8, u8),
    classes_after: (u8, u8),
}

/// Fills a volume, overwrites it under hot/cold traffic, then (after a checkpoint
/// and, with `restart`, a restart from it) overwrites as much again.
fn run(restart: bool) -> Run {
    let (devs, mut e, vol, blocks, mut model, mut rng) = filled(11);
    overwrite(&mut e, vol, &mut model, 12 * blocks, 4000, |_| {
        hot_cold(&mut rng, blocks)
    });
    call(&mut e, Request::Checkpoint)
        .result
        .expect("checkpoint");
    let volume = |e: &lamina_core::Engine, vol: VolumeId| {
        e.status()
            .volumes
            .into_iter()
            .find(|v| v.id == vol.0)
            .unwrap()
    };
    let before = volume(&e, vol);
    let times = e.segment_times();
    if restart {
        drop(e);
        e = open_rw(&devs, config());
        // Segment ages carry over (cost-benefit GC reads them), except that the
        // segments open at the restart are closed at the restart's time.
        let now = before.user_bytes_written / BS as u64;
        let after = e.segment_times();
        let dated = |t: &[(u64, u64, u64)]| t.iter().filter(|t| **t != (0, 0, 0)).count();
        assert!(
            dated(&after) >= dated(&times) * 9 / 10,
            "{} of {} segments dated after the restart",
            dated(&after),
            dated(&times)
        );
        for (i, (was, &is)) in times.iter().zip(&after).enumerate() {
            if is != (0, 0, 0) && was.1 != 0 {
                assert_eq!(*was, is, "segment {i}");
            } else if is != (0, 0, 0) {
                assert_eq!((was.0, was.2), (is.0, is.2), "segment {i}");
                assert_eq!(is.1, now, "segment {i} closed at the restart");
            }
        }
    }
    let vol = e.shared().volume("v").unwrap().id;
    let start = volume(&e, vol);
    assert_eq!(
        (start.user_bytes_written, start.media_bytes_written),
        (before.user_bytes_written, before.media_bytes_written),
        "the volume's counters carry over"
    );
    overwrite(&mut e, vol, &mut model, 12 * blocks, 4000, |_| {
        hot_cold(&mut rng, blocks)
    });
    verify_model(&e, vol, &model);
    let end = volume(&e, vol);
    Run {
        wa: (end.media_bytes_written - start.media_bytes_written) as f64
            / (end.user_bytes_written - start.user_bytes_written) as f64,
        classes_before: start.classes_open,
        classes_after: end.classes_open,
    }
}

#[test]
fn placement_state_survives_a_restart() {
    let straight = run(false);
    let restarted = run(true);
    println!(
        "WA over the second half: without a restart {:.4}, with one {:.4}; classes open {:?} / {:?}",
        straight.wa, restarted.wa, straight.classes_before, restarted.classes_before
    );
    // SepBIT separates hot/cold traffic, and the restarted volume knows it at
    // once (a classifier starting afresh keeps one class of each until its
    // lifespan check has seen enough overwrites).
    assert_eq!(straight.classes_before, (2, 4), "hot/cold separates");
    assert_eq!(restarted.classes_before, straight.classes_before);
    assert_eq!(restarted.classes_after, straight.classes_after);
    let gap = (restarted.wa / straight.wa - 1.0).abs();
    assert!(
        gap < 0.02,
        "WA after a restart {:.4} against {:.4} without one",
        restarted.wa,
        straight.wa
    );
}

/// The `auto` victim policy's choice in one stream (no classifier) survives a
/// restart: its miniature starts empty and knows nothing for a while, so without
/// the saved choice the volume would collect greedily again on hot/cold traffic,
/// where cost-benefit wins.
#[test]
fn the_auto_policys_choice_survives_a_restart() {
    let cfg = || EngineConfig {
        classifier: "none".into(),
        gc_policy: "auto".into(),
        ..config()
    };
    let (devs, mut e, vol, blocks, mut model, mut rng) = filled_with(cfg(), 13);
    overwrite(&mut e, vol, &mut model, 12 * blocks, 4000, |_| {
        hot_cold(&mut rng, blocks)
    });
    let policy = |e: &lamina_core::Engine| e.status().volumes[0].gc_policy.clone();
    assert_eq!(
        policy(&e),
        "auto (cost-benefit-sqrt: one stream)",
        "the miniature found cost-benefit better on hot/cold traffic"
    );
    call(&mut e, Request::Checkpoint)
        .result
        .expect("checkpoint");
    drop(e);
    let mut e = open_rw(&devs, cfg());
    let vol = e.shared().volume("v").unwrap().id;
    // Up to GC's first pick after the restart: the new miniature has had no GC of
    // its own yet (it learns its capacity at that pick), so only the saved choice
    // can say cost-benefit there.
    let mut written = 0;
    while policy(&e) == "auto" {
        assert!(
            written < 2 * blocks,
            "GC picked nothing in {written} writes"
        );
        overwrite(&mut e, vol, &mut model, 64, 4000, |_| {
            hot_cold(&mut rng, blocks)
        });
        written += 64;
    }
    verify_model(&e, vol, &model);
    assert_eq!(policy(&e), "auto (cost-benefit-sqrt: one stream)");
}

/// After a crash, recovery dates the segments written since the checkpoint from
/// the volume times their unit headers record: the ages it rebuilds are those the
/// engine kept.
#[test]
fn crash_recovery_rebuilds_segment_ages() {
    let (devs, mut e, vol, blocks, mut model, mut rng) = filled(12);
    call(&mut e, Request::Checkpoint)
        .result
        .expect("checkpoint");
    // Everything below is known to recovery only from the log.
    overwrite(&mut e, vol, &mut model, 4 * blocks, 4000, |_| {
        hot_cold(&mut rng, blocks)
    });
    let times = e.segment_times();
    drop(e);
    let e = open_rw(&devs, config());
    verify_model(&e, vol, &model);
    let after = e.segment_times();
    let mut compared = 0;
    let (mut origin_error, mut age) = (0u64, 0u64);
    let now = e.status().volumes[0].user_bytes_written / BS as u64;
    for (i, (was, is)) in times.iter().zip(&after).enumerate() {
        if *was == (0, 0, 0) || *is == (0, 0, 0) || was.1 == 0 {
            // Free, freed by recovery (empty), or open at the crash.
            continue;
        }
        compared += 1;
        assert_eq!((was.0, was.1), (is.0, is.1), "segment {i}: (born, closed)");
        origin_error += was.2.abs_diff(is.2);
        age += now - was.2;
    }
    // Origins are means: rebuilt from each unit's mean, they differ where units
    // straddle two slots of a segment (here 4 blocks each).
    assert!(
        origin_error * 50 < age,
        "origins rebuilt {origin_error} blocks off in all, for ages of {age}"
    );
    assert!(compared > SEGMENTS / 2, "only {compared} segments compared");
}
