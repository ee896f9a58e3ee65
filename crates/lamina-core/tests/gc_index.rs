//! GC's index of candidate victims follows the segment table through real
//! traffic: every policy and classifier, two volumes, overwrites, zeroes, a volume
//! deleted, GC under both triggers, and a restart (which builds the index from the
//! recovered table). The index is checked against a scan of the table as the
//! traffic goes, and the data read back at the end.

mod common;

use common::*;
use lamina_core::{EngineConfig, Request};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

const SEGMENTS: u64 = 300;

/// `classifiers`: the one of the first run, and the one after the restart.
fn run(policy: &str, classifiers: [&str; 2], garbage_ratio: Option<f64>, seed: u64) {
    let cfg = |round: usize| EngineConfig {
        gc_policy: policy.into(),
        classifier: classifiers[round.min(1)].into(),
        gc_garbage_ratio: garbage_ratio,
        ..small_config()
    };
    let devs: Vec<Arc<dyn BlockDevice>> =
        vec![Arc::new(MemDevice::new("d", device_bytes(SEGMENTS)))];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, cfg(0));
    let usable = e.status().usable_bytes / BS as u64;
    let (a_blocks, b_blocks) = (usable * 50 / 100, usable * 25 / 100);
    let a = create_volume(&mut e, "a", a_blocks * BS as u64);
    let b = create_volume(&mut e, "b", b_blocks * BS as u64);
    let gone = create_volume(&mut e, "gone", 64 * BS as u64);
    let (mut ma, mut mb) = (HashMap::new(), HashMap::new());
    overwrite(&mut e, gone, &mut HashMap::new(), 64, 16, |i| i);
    overwrite(&mut e, a, &mut ma, a_blocks, 500, |i| i);
    overwrite(&mut e, b, &mut mb, b_blocks, 500, |i| i);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut victims = 0;
    for round in 0..2 {
        // After a change of classifier, long enough for the old classes to be
        // overwritten well past what GC would leave in them.
        let writes = if round == 1 && classifiers[0] != classifiers[1] {
            40_000
        } else {
            12_000
        };
        for i in 0..writes {
            // Volume a hot and cold, b uniform, some zeroes.
            let (vol, model, blocks) = if rng.gen_bool(0.7) {
                (a, &mut ma, a_blocks)
            } else {
                (b, &mut mb, b_blocks)
            };
            let lba = if vol == a && rng.gen_bool(0.8) {
                rng.gen_range(0..blocks / 10)
            } else {
                rng.gen_range(0..blocks)
            };
            if rng.gen_bool(0.03) {
                call(
                    &mut e,
                    Request::Zero {
                        volume: vol,
                        offset: lba * BS as u64,
                        length: BS as u64,
                        fua: false,
                        allocate: false,
                    },
                )
                .result
                .expect("zero");
                model.remove(&lba);
            } else {
                let gen = model.get(&lba).copied().unwrap_or(0) + 1;
                write_block(&mut e, vol, lba, gen, false).expect("write");
                model.insert(lba, gen);
            }
            if i % 700 == 0 {
                call(&mut e, Request::Flush).result.expect("flush");
                e.check_gc_index();
            }
            if round == 0 && i == 3000 {
                call(
                    &mut e,
                    Request::DeleteVolume {
                        name: "gone".into(),
                    },
                )
                .result
                .expect("delete");
            }
        }
        call(&mut e, Request::Flush).result.expect("flush");
        e.check_gc_index();
        victims += e.status().gc_victims;
        // Restart without a clean shutdown: recovery rebuilds the table.
        drop(e);
        e = open_rw(&devs, cfg(round + 1));
        e.check_gc_index();
    }
    assert!(victims > 200, "{policy}: GC ran {victims} times");
    verify_model(&e, a, &ma);
    verify_model(&e, b, &mb);
}

#[test]
fn the_index_follows_the_table_under_every_policy() {
    for (i, policy) in lamina_core::gc::POLICY_NAMES.iter().enumerate() {
        run(policy, ["none", "none"], None, i as u64);
    }
}

#[test]
fn the_index_follows_the_table_with_classifiers_and_the_garbage_trigger() {
    run("cost-benefit-sqrt", ["auto", "auto"], None, 11);
    run("lamina", ["lamina", "lamina"], None, 12);
    run("greedy", ["sepbit", "sepbit"], Some(0.15), 13);
}

/// Segments written under a classifier with more classes than the next one has
/// are still collected: the `lamina` policy weighs their classes too. (When it
/// weighed only the configured classes, the garbage of the others was never
/// collected and writes stalled for space in the second round.)
#[test]
fn classes_left_by_another_configuration_are_collected() {
    run("lamina", ["lamina", "none"], None, 21);
    run("cost-benefit-sqrt", ["sepbit", "none"], None, 22);
}

/// The simulator's engine (`metadata_only`) frees emptied segments at once instead
/// of draining them: the index and the garbage proportion follow that path too.
#[test]
fn the_index_follows_the_table_in_a_simulation() {
    for ratio in [None, Some(0.15)] {
        let devs: Vec<Arc<dyn BlockDevice>> =
            vec![Arc::new(MemDevice::new("d", device_bytes(SEGMENTS)))];
        format_devices(&devs, &small_params());
        let mut e = open_rw(
            &devs,
            EngineConfig {
                metadata_only: true,
                gc_garbage_ratio: ratio,
                ..small_config()
            },
        );
        let blocks = (e.status().usable_bytes / BS as u64) * 70 / 100;
        let vol = create_volume(&mut e, "v", blocks * BS as u64);
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let write = |e: &mut lamina_core::Engine, lba: u64, count: u32| {
            call(
                e,
                Request::WriteBlocks {
                    volume: vol,
                    lba: lamina_core::Lba(lba),
                    count,
                },
            )
            .result
            .expect("write");
        };
        for lba in (0..blocks).step_by(16) {
            write(&mut e, lba, (blocks - lba).min(16) as u32);
        }
        for i in 0..30_000u64 {
            let lba = if rng.gen_bool(0.8) {
                rng.gen_range(0..blocks / 10)
            } else {
                rng.gen_range(0..blocks)
            };
            write(&mut e, lba, 1);
            if i % 500 == 0 {
                e.check_gc_index();
            }
        }
        e.check_gc_index();
        assert!(e.status().gc_victims > 200, "GC ran");
    }
}
