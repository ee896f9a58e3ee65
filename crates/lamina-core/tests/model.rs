//! Property tests: the engine against a reference model (a byte array per volume).
//!
//! Random sequences of unaligned writes, zeroes, flushes, checkpoints and clean
//! restarts run against an engine on a small array (so GC and checkpoints happen)
//! and against a plain `Vec<u8>`; every read must agree. proptest shrinks failures
//! to a minimal sequence.

mod common;
use common::*;
use lamina_core::Request;
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use proptest::prelude::*;
use std::sync::Arc;

const VOL_BLOCKS: u64 = 1024;

#[derive(Clone, Debug)]
enum Op {
    Write {
        offset: u64,
        len: u64,
        seed: u8,
    },
    Zero {
        offset: u64,
        len: u64,
    },
    Read {
        offset: u64,
        len: u64,
    },
    Flush,
    Checkpoint,
    Restart,
    /// Overwrite a hot range many times, to force GC.
    Churn {
        first: u64,
        rounds: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let size = VOL_BLOCKS * BS as u64;
    prop_oneof![
        6 => (0..size, 1..64 * 1024u64, any::<u8>()).prop_map(move |(o, l, s)| Op::Write { offset: o, len: l.min(size - o), seed: s }),
        2 => (0..size, 1..256 * 1024u64).prop_map(move |(o, l)| Op::Zero { offset: o, len: l.min(size - o) }),
        3 => (0..size, 1..128 * 1024u64).prop_map(move |(o, l)| Op::Read { offset: o, len: l.min(size - o) }),
        1 => Just(Op::Flush),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Restart),
        1 => (0..VOL_BLOCKS - 64, 1..40u8).prop_map(|(f, r)| Op::Churn { first: f, rounds: r }),
    ]
}

fn bytes(seed: u8, offset: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (offset + i).wrapping_mul(31).wrapping_add(seed as u64) as u8 | 1)
        .collect()
}

/// The small test configuration with a classifier and a victim policy.
fn placement_config(classifier: &str, policy: &str) -> lamina_core::EngineConfig {
    lamina_core::EngineConfig {
        classifier: classifier.into(),
        gc_policy: policy.into(),
        ..small_config()
    }
}

fn check_all(e: &lamina_core::Engine, model: &[u8]) -> Result<(), TestCaseError> {
    let v = e.shared().volume("m").unwrap();
    let mut got = vec![0u8; model.len()];
    e.shared().read(&v, 0, &mut got).unwrap();
    prop_assert!(got == model, "volume content differs from the model");
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// Every classifier with every victim policy, with and without a cache tier
    /// (issue 14) of one device or a mirror of two: GC and compaction never lose,
    /// duplicate or resurrect a block, whatever segments they pick and wherever
    /// they put blocks.
    #[test]
    fn engine_matches_reference_model(
        ops in proptest::collection::vec(op(), 1..60),
        classifier in proptest::sample::select(lamina_core::placement::CLASSIFIER_NAMES),
        policy in proptest::sample::select(lamina_core::gc::POLICY_NAMES),
        cache_copies in 0usize..3,
    ) {
        // Room for the open segments of every class (up to 8 + 8 per volume).
        let (devs, params) =
            with_cache(Arc::new(MemDevice::new("mem0", device_bytes(64))), cache_copies);
        run_model(&devs, &params, classifier, policy, ops)?;
    }

    /// A zoned capacity tier behind a cache of one device or a mirror of two
    /// (CSAL on ZNS, issue 14): the same model, every write within the zone rules.
    #[test]
    fn zoned_capacity_behind_a_cache_matches_reference_model(
        ops in proptest::collection::vec(op(), 1..60),
        classifier in proptest::sample::select(lamina_core::placement::CLASSIFIER_NAMES),
        policy in proptest::sample::select(lamina_core::gc::POLICY_NAMES),
        cache_copies in 1usize..3,
    ) {
        use lamina_device::zoned::{ZonedConfig, ZonedDevice};
        // Zones of one small segment; the superblocks' megabyte conventional; as
        // many zones open as every GC class, the read-hot stream and metadata take.
        const ZONE: u64 = 64 * BS as u64;
        let zoned = Arc::new(
            ZonedDevice::new(
                Arc::new(MemDevice::new("zns", device_bytes(64))),
                ZonedConfig {
                    zone_bytes: ZONE,
                    zone_capacity_bytes: ZONE,
                    conventional_zones: ((1u64 << 20) / ZONE) as u32,
                    max_open: 14,
                    max_active: 14,
                    ..Default::default()
                },
            )
            .unwrap(),
        );
        let (devs, params) = with_cache(zoned.clone(), cache_copies);
        run_model(&devs, &params, classifier, policy, ops)?;
        prop_assert_eq!(zoned.rejected_writes(), 0, "writes broke zone rules");
    }
}

/// `capacity` with a cache tier of `copies` devices (none when 0) of the fewest
/// segments a cache may have, and the parameters to format them with.
fn with_cache(
    capacity: Arc<dyn BlockDevice>,
    copies: usize,
) -> (Vec<Arc<dyn BlockDevice>>, lamina_core::FormatParams) {
    let mut devs = vec![capacity];
    for i in 0..copies {
        devs.push(Arc::new(MemDevice::new(
            format!("cache{i}"),
            device_bytes(16),
        )));
    }
    let params = lamina_core::FormatParams {
        cache_devices: copies,
        ..small_params()
    };
    (devs, params)
}

/// Runs `ops` on a new array of `devs` against the model, then checks the whole
/// volume, after a clean restart and after one that only flushed.
fn run_model(
    devs: &[Arc<dyn BlockDevice>],
    params: &lamina_core::FormatParams,
    classifier: &str,
    policy: &str,
    ops: Vec<Op>,
) -> Result<(), TestCaseError> {
    format_devices(devs, params);
    let config = || placement_config(classifier, policy);
    let mut e = open_rw(devs, config());
    let vol = create_volume(&mut e, "m", VOL_BLOCKS * BS as u64);
    let mut model = vec![0u8; (VOL_BLOCKS * BS as u64) as usize];
    for op in ops {
        match op {
            Op::Write { offset, len, seed } => {
                let data = bytes(seed, offset, len);
                call(
                    &mut e,
                    Request::Write {
                        volume: vol,
                        offset,
                        data: data.clone(),
                        fua: seed % 7 == 0,
                    },
                )
                .result
                .unwrap();
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
            }
            Op::Zero { offset, len } => {
                call(
                    &mut e,
                    Request::Zero {
                        volume: vol,
                        offset,
                        length: len,
                        fua: false,
                        allocate: len % 3 == 0,
                    },
                )
                .result
                .unwrap();
                model[offset as usize..(offset + len) as usize].fill(0);
            }
            Op::Read { offset, len } => {
                let v = e.shared().volume_by_id(vol).unwrap();
                let mut got = vec![0u8; len as usize];
                e.shared().read(&v, offset, &mut got).unwrap();
                prop_assert!(
                    got[..] == model[offset as usize..(offset + len) as usize],
                    "read at {offset}+{len} differs"
                );
            }
            Op::Flush => call(&mut e, Request::Flush).result.unwrap(),
            Op::Checkpoint => call(&mut e, Request::Checkpoint).result.unwrap(),
            Op::Restart => {
                call(&mut e, Request::Checkpoint).result.unwrap();
                drop(e);
                e = open_rw(devs, config());
                check_all(&e, &model)?;
            }
            Op::Churn { first, rounds } => {
                for r in 0..rounds as u64 {
                    for lba in first..first + 64 {
                        let data = bytes(r as u8 ^ 0x5a, lba * BS as u64, BS as u64);
                        call(
                            &mut e,
                            Request::Write {
                                volume: vol,
                                offset: lba * BS as u64,
                                data: data.clone(),
                                fua: false,
                            },
                        )
                        .result
                        .unwrap();
                        model[(lba * BS as u64) as usize..((lba + 1) * BS as u64) as usize]
                            .copy_from_slice(&data);
                    }
                }
            }
        }
    }
    check_all(&e, &model)?;
    e.check_gc_index();
    // And once more after a restart without a clean checkpoint (only what was
    // flushed is promised, but nothing was lost: the in-memory devices keep all).
    call(&mut e, Request::Flush).result.unwrap();
    drop(e);
    let e = open_rw(devs, config());
    check_all(&e, &model)?;
    e.check_gc_index();
    Ok(())
}

/// JBOD over several devices, opened with the devices in another order: the
/// superblocks, not the caller, say which is which.
#[test]
fn several_devices_in_any_order() {
    let devs: Vec<Arc<dyn BlockDevice>> = (0..3)
        .map(|i| {
            Arc::new(MemDevice::new(
                format!("mem{i}"),
                device_bytes(20 + 4 * i as u64),
            )) as Arc<dyn BlockDevice>
        })
        .collect();
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, small_config());
    let usable = e.usable_bytes() / BS as u64;
    let blocks = usable * 7 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    for round in 1..=3u64 {
        for lba in 0..blocks {
            call(
                &mut e,
                Request::Write {
                    volume: vol,
                    offset: lba * BS as u64,
                    data: pattern(lba, round),
                    fua: false,
                },
            )
            .result
            .unwrap();
        }
    }
    call(&mut e, Request::Flush).result.unwrap();
    assert!(e.status().gc_bytes_relocated > 0);
    drop(e);
    let shuffled = vec![devs[2].clone(), devs[0].clone(), devs[1].clone()];
    let e = open_rw(&shuffled, small_config());
    for lba in 0..blocks {
        assert_eq!(
            decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(),
            3,
            "lba {lba}"
        );
    }
    drop(e);
    // A missing member and a foreign device are refused with a clear message.
    let err = lamina_core::open(
        vec![devs[0].clone(), devs[1].clone()],
        small_config(),
        lamina_core::OpenMode::ReadOnly,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("were not given"), "{err}");
    let foreign: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("other", device_bytes(20)));
    lamina_core::format(
        std::slice::from_ref(&foreign),
        &small_params(),
        [0xcd; 16],
        &[[9; 16]],
        0,
    )
    .unwrap();
    let err = lamina_core::open(
        vec![devs[0].clone(), devs[1].clone(), foreign],
        small_config(),
        lamina_core::OpenMode::ReadOnly,
    )
    .err()
    .unwrap();
    assert!(err.to_string().contains("another array"), "{err}");
}

/// Every classifier with every policy under a skewed overwrite load: GC runs (the
/// array holds the volume about 1.4 times), every block reads back its last write,
/// before and after a restart.
#[test]
fn every_classifier_and_policy_keeps_every_block() {
    for classifier in lamina_core::placement::CLASSIFIER_NAMES {
        for policy in lamina_core::gc::POLICY_NAMES {
            let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(64)));
            let devs = vec![d];
            format_devices(&devs, &small_params());
            let config = || placement_config(classifier, policy);
            let mut e = open_rw(&devs, config());
            let blocks = e.usable_bytes() / BS as u64 * 7 / 10;
            let vol = create_volume(&mut e, "v", blocks * BS as u64);
            let mut last = vec![0u64; blocks as usize];
            let mut x = 0x9e3779b97f4a7c15u64;
            for round in 1..=6 * blocks {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // 80% of writes to the first 20% of blocks.
                let lba = if x % 10 < 8 {
                    (x >> 8) % (blocks / 5)
                } else {
                    (x >> 8) % blocks
                };
                let data = pattern(lba, round);
                let req = Request::Write {
                    volume: vol,
                    offset: lba * BS as u64,
                    data,
                    fua: false,
                };
                call(&mut e, req).result.unwrap();
                last[lba as usize] = round;
            }
            call(&mut e, Request::Flush).result.unwrap();
            let st = e.status();
            let what = format!("{classifier}/{policy}");
            assert!(st.gc_bytes_relocated > 0, "{what}: GC never ran");
            let check = |e: &lamina_core::Engine| {
                for lba in 0..blocks {
                    let got = decode_pattern(lba, &read_block(e, vol, lba));
                    assert_eq!(got, Ok(last[lba as usize]), "{what}: lba {lba}");
                }
            };
            check(&e);
            drop(e);
            let e = open_rw(&devs, config());
            check(&e);
        }
    }
}
