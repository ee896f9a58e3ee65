//! Snapshots and clones against a reference model: every volume (origins,
//! read-only snapshots, writable clones) is a byte array in the model; random
//! writes, trims, snapshots, clones, deletions, GC churn, checkpoints, clean
//! restarts and crashes (restarts without a checkpoint) run against both, and every
//! volume must read back its model. After each case `fsck` must find nothing: every
//! shared block counted once, every unit record naming a volume of the block's
//! family. A power-cut test checks that snapshots survive one whole while their
//! origin is written and collected.

mod common;
use common::*;
use lamina_core::{EngineError, Request};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use proptest::prelude::*;
use std::sync::Arc;

const VOL_BLOCKS: u64 = 256;
const SIZE: u64 = VOL_BLOCKS * BS as u64;

#[derive(Clone, Debug)]
enum Op {
    Write {
        vol: usize,
        block: u64,
        blocks: u64,
        seed: u8,
    },
    Zero {
        vol: usize,
        block: u64,
        blocks: u64,
    },
    Snapshot {
        vol: usize,
    },
    Clone {
        vol: usize,
    },
    Delete {
        vol: usize,
    },
    Rollback {
        vol: usize,
    },
    Churn {
        vol: usize,
        first: u64,
        rounds: u8,
    },
    Flush,
    Checkpoint,
    Restart,
    Crash,
}

fn op() -> impl Strategy<Value = Op> {
    let v = 0..8usize;
    prop_oneof![
        8 => (v.clone(), 0..VOL_BLOCKS, 1..64u64, any::<u8>()).prop_map(|(vol, b, n, seed)| Op::Write { vol, block: b, blocks: n.min(VOL_BLOCKS - b), seed }),
        2 => (v.clone(), 0..VOL_BLOCKS, 1..96u64).prop_map(|(vol, b, n)| Op::Zero { vol, block: b, blocks: n.min(VOL_BLOCKS - b) }),
        2 => v.clone().prop_map(|vol| Op::Snapshot { vol }),
        1 => v.clone().prop_map(|vol| Op::Clone { vol }),
        1 => v.clone().prop_map(|vol| Op::Delete { vol }),
        1 => v.clone().prop_map(|vol| Op::Rollback { vol }),
        2 => (v, 0..VOL_BLOCKS - 32, 1..24u8).prop_map(|(vol, first, rounds)| Op::Churn { vol, first, rounds }),
        1 => Just(Op::Flush),
        1 => Just(Op::Checkpoint),
        1 => Just(Op::Restart),
        1 => Just(Op::Crash),
    ]
}

/// Checkpoints only when asked (volume changes, restarts): recovery then replays
/// long stretches of the log, GC moves included, which is where a shared block's
/// other referrers must be found.
fn config() -> lamina_core::EngineConfig {
    lamina_core::EngineConfig {
        checkpoint_interval_blocks: 1 << 40,
        ..small_config()
    }
}

/// The array as a power cut leaves `dev` (half of what was not synced reached the
/// media), opened: the engine and its device.
fn after_power_cut(
    dev: &lamina_device::crash::CrashDevice,
    rng: &mut impl rand::Rng,
) -> (lamina_core::Engine, Arc<lamina_device::crash::CrashDevice>) {
    use lamina_device::crash::{CrashDevice, PowerCut};
    let image = dev.power_cut(
        rng,
        PowerCut {
            keep_probability: 0.5,
        },
    );
    let dev2 = Arc::new(CrashDevice::from_image("c", image));
    let d: Arc<dyn BlockDevice> = dev2.clone();
    (open_rw(&[d], config()), dev2)
}

/// A formatted crash-simulating device of 64 small segments, opened, with volume
/// "v" of 1/`part` of the usable space: the device, the engine, the volume, its blocks.
fn crash_array(
    part: u64,
) -> (
    Arc<lamina_device::crash::CrashDevice>,
    lamina_core::Engine,
    lamina_core::VolumeId,
    u64,
) {
    crash_array_with(part, config())
}

/// [`crash_array`] with configuration `cfg`.
fn crash_array_with(
    part: u64,
    cfg: lamina_core::EngineConfig,
) -> (
    Arc<lamina_device::crash::CrashDevice>,
    lamina_core::Engine,
    lamina_core::VolumeId,
    u64,
) {
    let dev = Arc::new(lamina_device::crash::CrashDevice::new(
        "c",
        device_bytes(64),
    ));
    let devs: Vec<Arc<dyn BlockDevice>> = vec![dev.clone()];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, cfg);
    let blocks = e.usable_bytes() / BS as u64 / part;
    let v = create_volume(&mut e, "v", blocks * BS as u64);
    (dev, e, v, blocks)
}

/// Rolls volume `name` back to `snapshot`, after the checkpoint in progress if
/// one is (the engine refuses a rollback meanwhile).
fn rollback(e: &mut lamina_core::Engine, name: &str, snapshot: &str) -> Result<(), EngineError> {
    let req = || Request::Rollback {
        name: name.into(),
        snapshot: snapshot.into(),
    };
    match call(e, req()).result {
        Err(err) if err.to_string().contains(lamina_core::ROLLBACK_BUSY) => {
            call(e, Request::Checkpoint).result?;
            call(e, req()).result
        }
        r => r,
    }
}

struct ModelVol {
    name: String,
    data: Vec<u8>,
    read_only: bool,
    /// Index of the volume it was made from.
    origin: Option<usize>,
    alive: bool,
}

fn bytes(seed: u8, offset: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (offset + i).wrapping_mul(131).wrapping_add(seed as u64) as u8 | 1)
        .collect()
}

fn check(e: &lamina_core::Engine, vols: &[ModelVol], when: &str) -> Result<(), TestCaseError> {
    for m in vols.iter().filter(|m| m.alive) {
        let v = e.shared().volume(&m.name);
        prop_assert!(v.is_some(), "{when}: volume {} missing", m.name);
        let v = v.unwrap();
        let mut got = vec![0u8; SIZE as usize];
        e.shared().read(&v, 0, &mut got).unwrap();
        if got != m.data {
            let b = (0..VOL_BLOCKS as usize)
                .find(|&b| got[b * BS..(b + 1) * BS] != m.data[b * BS..(b + 1) * BS])
                .unwrap();
            prop_assert!(
                false,
                "{when}: volume {} differs from the model at block {b}",
                m.name
            );
        }
    }
    Ok(())
}

/// Offline check of the whole array: nothing found.
fn fsck_clean(devs: &[Arc<dyn BlockDevice>]) -> Result<(), TestCaseError> {
    let (e, _) =
        lamina_core::open(devs.to_vec(), config(), lamina_core::OpenMode::ReadOnly).unwrap();
    let mut r = lamina_core::fsck::FsckReport::default();
    lamina_core::fsck::check(&e, true, &mut r);
    prop_assert!(r.findings.is_empty(), "fsck: {:?}", r.findings);
    Ok(())
}

fn live_bytes(e: &lamina_core::Engine) -> u64 {
    e.status().live_bytes
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn snapshots_and_clones_match_the_model(ops in proptest::collection::vec(op(), 1..50)) {
        // Small enough that GC runs in most cases: at most four volumes live at
        // once (the 2300 usable blocks hold them wholly diverged).
        let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(48)));
        let devs = vec![d];
        format_devices(&devs, &small_params());
        let mut e = open_rw(&devs, config());
        create_volume(&mut e, "v0", SIZE);
        let mut vols = vec![ModelVol { name: "v0".into(), data: vec![0; SIZE as usize], read_only: false, origin: None, alive: true }];
        let pick = |vols: &[ModelVol], i: usize| {
            let alive: Vec<usize> = (0..vols.len()).filter(|&k| vols[k].alive).collect();
            alive[i % alive.len()]
        };
        for op in ops {
            match op {
                Op::Write { vol, block, blocks, seed } => {
                    let k = pick(&vols, vol);
                    let id = e.shared().volume(&vols[k].name).unwrap().id;
                    let (off, len) = (block * BS as u64, blocks * BS as u64);
                    let data = bytes(seed, off, len);
                    let r = call(&mut e, Request::Write { volume: id, offset: off, data: data.clone(), fua: seed % 5 == 0 }).result;
                    if vols[k].read_only {
                        prop_assert!(matches!(r, Err(EngineError::ReadOnly(_))), "a write to snapshot {}: {r:?}", vols[k].name);
                    } else {
                        r.unwrap();
                        vols[k].data[off as usize..(off + len) as usize].copy_from_slice(&data);
                    }
                }
                Op::Zero { vol, block, blocks } => {
                    let k = pick(&vols, vol);
                    let id = e.shared().volume(&vols[k].name).unwrap().id;
                    let (off, len) = (block * BS as u64, blocks * BS as u64);
                    let r = call(&mut e, Request::Zero { volume: id, offset: off, length: len, fua: false, allocate: blocks % 3 == 0 }).result;
                    if vols[k].read_only {
                        prop_assert!(r.is_err());
                    } else {
                        r.unwrap();
                        vols[k].data[off as usize..(off + len) as usize].fill(0);
                    }
                }
                Op::Snapshot { vol } | Op::Clone { vol } => {
                    if vols.iter().filter(|m| m.alive).count() >= 4 {
                        continue;
                    }
                    let writable = matches!(op, Op::Clone { .. });
                    let k = pick(&vols, vol);
                    let name = format!("{}{}", if writable { "c" } else { "s" }, vols.len());
                    make_snapshot(&mut e, &vols[k].name, &name, writable).unwrap();
                    let data = vols[k].data.clone();
                    vols.push(ModelVol { name, data, read_only: !writable, origin: Some(k), alive: true });
                }
                Op::Delete { vol } => {
                    let k = pick(&vols, vol);
                    let has_children = vols.iter().any(|m| m.alive && m.origin == Some(k));
                    let before = live_bytes(&e);
                    let r = call(&mut e, Request::DeleteVolume { name: vols[k].name.clone() }).result;
                    if has_children {
                        prop_assert!(r.is_err(), "deleting {} with volumes made from it", vols[k].name);
                    } else {
                        r.unwrap();
                        vols[k].alive = false;
                        prop_assert!(live_bytes(&e) <= before);
                    }
                    if vols.iter().all(|m| !m.alive) {
                        create_volume(&mut e, "v0b", SIZE);
                        vols.push(ModelVol { name: "v0b".into(), data: vec![0; SIZE as usize], read_only: false, origin: None, alive: true });
                    }
                }
                Op::Rollback { vol } => {
                    // A live snapshot (if any) taken of a live volume.
                    let snaps: Vec<usize> = (0..vols.len())
                        .filter(|&k| {
                            vols[k].alive
                                && vols[k].read_only
                                && vols[k].origin.is_some_and(|o| vols[o].alive && !vols[o].read_only)
                        })
                        .collect();
                    if snaps.is_empty() {
                        continue;
                    }
                    let k = snaps[vol % snaps.len()];
                    let o = vols[k].origin.unwrap();
                    // GC frees what its checkpoint needs first (a small busy
                    // array keeps fewer free segments: the saved case). Refused
                    // only when GC cannot free that much (or not in time: the
                    // clock jumps an hour between `call`'s rounds), with the
                    // reason, and then nothing changed, which `check` verifies.
                    match rollback(&mut e, &vols[o].name, &vols[k].name) {
                        Ok(()) => vols[o].data = vols[k].data.clone(),
                        Err(EngineError::NoSpace(why)) => {
                            prop_assert!(why.contains("free space first"), "{why}")
                        }
                        Err(err) => panic!("rollback: {err}"),
                    }
                }
                Op::Churn { vol, first, rounds } => {
                    let k = pick(&vols, vol);
                    if vols[k].read_only {
                        continue;
                    }
                    let id = e.shared().volume(&vols[k].name).unwrap().id;
                    for r in 0..rounds as u64 {
                        for lba in first..first + 32 {
                            let (off, len) = (lba * BS as u64, BS as u64);
                            let data = bytes(r as u8 ^ 0x5a, off, len);
                            call(&mut e, Request::Write { volume: id, offset: off, data: data.clone(), fua: false }).result.unwrap();
                            vols[k].data[off as usize..(off + len) as usize].copy_from_slice(&data);
                        }
                    }
                }
                Op::Flush => call(&mut e, Request::Flush).result.unwrap(),
                Op::Checkpoint => call(&mut e, Request::Checkpoint).result.unwrap(),
                Op::Restart | Op::Crash => {
                    // What the engine counted must be what recovery counts from
                    // the maps: each shared block once.
                    let before = live_bytes(&e);
                    if matches!(op, Op::Restart) {
                        call(&mut e, Request::Checkpoint).result.unwrap();
                    } else {
                        call(&mut e, Request::Flush).result.unwrap();
                    }
                    drop(e);
                    e = open_rw(&devs, config());
                    check(&e, &vols, &format!("after {op:?}"))?;
                    prop_assert_eq!(live_bytes(&e), before, "live bytes across {:?}", op);
                }
            }
        }
        check(&e, &vols, "at the end")?;
        let before = live_bytes(&e);
        call(&mut e, Request::Flush).result.unwrap();
        drop(e);
        let e = open_rw(&devs, config());
        check(&e, &vols, "after the last restart")?;
        prop_assert_eq!(live_bytes(&e), before);
        drop(e);
        fsck_clean(&devs)?;
    }
}

/// A snapshot survives a power cut whole, however much its origin is overwritten
/// and collected after it: the snapshot's creation is durable when it returns,
/// and GC moving a shared block records every volume that maps it.
#[test]
fn a_snapshot_survives_a_power_cut_and_gc_of_its_origin() {
    use rand::SeedableRng;
    // Written and partly rewritten, the origin fits without GC; once the
    // snapshot holds its blocks and the origin diverges, GC must run.
    let (dev, mut e, v, blocks) = crash_array(4);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    // Seven blocks of eight again (a new generation): the first segments
    // are mostly garbage, so GC picks them early, while origin and snapshot both
    // map the blocks left in them, and must record both.
    for lba in (0..blocks).filter(|l| l % 8 != 0) {
        write_block(&mut e, v, lba, 2, false).unwrap();
    }
    make_snapshot(&mut e, "v", "s", false).unwrap();
    let s = e.shared().volume("s").unwrap().id;
    let gc_before = e.status().gc_bytes_relocated;
    assert_eq!(gc_before, 0, "GC ran before the snapshot");
    for round in 2..=9u64 {
        // The blocks left in the first segments stay shared until the last
        // round, so that GC finds them mapped by both volumes.
        for lba in (0..blocks).filter(|l| l % 4 != round % 4 && (l % 8 != 0 || round == 9)) {
            write_block(&mut e, v, lba, round, false).unwrap();
        }
    }
    assert!(
        e.status().gc_bytes_relocated > gc_before,
        "GC did not run: the test must move shared blocks"
    );
    // No flush: only what was flushed (the snapshot, through its checkpoint) is
    // promised for the origin; each of its blocks holds some round's write.
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    drop(e);
    let (e, dev2) = after_power_cut(&dev, &mut rng);
    for lba in 0..blocks {
        // The blocks left in the first segments were written once, the others
        // twice (a new generation: a map left on the dead copy would read 1).
        let want = if lba % 8 == 0 { 1 } else { 2 };
        assert_eq!(
            decode_pattern(lba, &read_block(&e, s, lba)).unwrap(),
            want,
            "snapshot block {lba}"
        );
        let got = decode_pattern(lba, &read_block(&e, v, lba)).unwrap();
        assert!((1..=9).contains(&got), "origin block {lba}: round {got}");
    }
    drop(e);
    let (e, _) = lamina_core::open(vec![dev2], config(), lamina_core::OpenMode::ReadOnly).unwrap();
    let mut r = lamina_core::fsck::FsckReport::default();
    lamina_core::fsck::check(&e, true, &mut r);
    assert!(r.findings.is_empty(), "fsck: {:?}", r.findings);
}

/// Deleting a snapshot frees what only it held; deleting its origin first is
/// refused; space comes back to what the origin alone holds.
#[test]
fn deleting_a_snapshot_frees_only_what_it_alone_held() {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(64)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, config());
    let v = create_volume(&mut e, "v", 256 * BS as u64);
    for lba in 0..256 {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    let alone = e.status().live_bytes;
    make_snapshot(&mut e, "v", "s", false).unwrap();
    assert_eq!(e.status().live_bytes, alone, "a snapshot costs no space");
    for lba in 0..64 {
        write_block(&mut e, v, lba, 2, false).unwrap();
    }
    let mut st = e.status();
    lamina_core::status::count_exclusive(e.shared(), &mut st);
    assert_eq!(st.live_bytes, alone + 64 * BS as u64);
    let vv = st.volumes.iter().find(|x| x.name == "v").unwrap();
    assert_eq!(vv.exclusive_bytes, 64 * BS as u64, "its overwrites");
    let sv = st.volumes.iter().find(|x| x.name == "s").unwrap();
    assert_eq!(sv.exclusive_bytes, 64 * BS as u64);
    assert!(sv.snapshot && sv.origin.as_deref() == Some("v"));
    let err = call(&mut e, Request::DeleteVolume { name: "v".into() })
        .result
        .unwrap_err();
    assert!(err.to_string().contains("\"s\""), "{err}");
    let s = e.shared().volume("s").unwrap().id;
    let err = call(
        &mut e,
        Request::Write {
            volume: s,
            offset: 0,
            data: vec![1; BS],
            fua: false,
        },
    )
    .result
    .unwrap_err();
    assert_eq!(err.errno(), 1, "EPERM: {err}");
    call(&mut e, Request::DeleteVolume { name: "s".into() })
        .result
        .unwrap();
    assert_eq!(e.status().live_bytes, alone);
    for lba in 0..256 {
        let want = if lba < 64 { 2 } else { 1 };
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), want);
    }
    drop(e);
    let e = open_rw(&devs, config());
    assert_eq!(e.status().live_bytes, alone);
}

/// Overwriting what a snapshot holds takes new space: a full array answers
/// ENOSPC (never a write that waits for GC to free what it cannot), the snapshot
/// stays whole, and deleting it gives the space back.
#[test]
fn overwrites_under_a_snapshot_are_refused_when_the_array_is_full() {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(48)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, config());
    let blocks = e.usable_bytes() / BS as u64 * 3 / 5;
    let v = create_volume(&mut e, "v", blocks * BS as u64);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    make_snapshot(&mut e, "v", "s", false).unwrap();
    let s = e.shared().volume("s").unwrap().id;
    let mut refused = None;
    for lba in 0..blocks {
        if let Err(err) = write_block(&mut e, v, lba, 2, false) {
            assert!(matches!(err, EngineError::NoSpace(_)), "{err}");
            refused = Some(lba);
            break;
        }
    }
    let at = refused.expect("the origin and its snapshot cannot both fit");
    assert!(at > 0);
    // Refused when admitted, as thin provisioning promises, not after GC ran
    // out of victims mid-write.
    let st = e.status();
    assert_eq!(st.writes_refused_nospace, 1);
    assert!(st.live_bytes <= st.usable_bytes);
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, s, lba)).unwrap(), 1);
    }
    call(&mut e, Request::DeleteVolume { name: "s".into() })
        .result
        .unwrap();
    for lba in at..blocks {
        write_block(&mut e, v, lba, 2, false).unwrap();
    }
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), 2);
    }
}

/// A family as large as it may be: GC moves blocks that every member maps, one
/// record per member in the unit that takes each block, and recovery points
/// every member at the copies; one more member is refused with a clear error.
#[test]
fn the_largest_family_survives_gc_and_one_more_is_refused() {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(64)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    let mut e = open_rw(&devs, config());
    let blocks = e.usable_bytes() / BS as u64 / 4;
    let v = create_volume(&mut e, "v", blocks * BS as u64);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    // Garbage in the first segments, so GC takes them while all map the rest.
    for lba in (0..blocks).filter(|l| l % 8 != 0) {
        write_block(&mut e, v, lba, 2, false).unwrap();
    }
    let mut n = 1;
    let err = loop {
        match make_snapshot(&mut e, "v", &format!("s{n}"), false) {
            Ok(()) => n += 1,
            Err(err) => break err,
        }
        assert!(n <= 64, "no limit on a family's size");
    };
    assert!(err.to_string().contains("the most one family"), "{err}");
    assert!(n >= 8, "{n} volumes");
    let gc0 = e.status().gc_bytes_relocated;
    for round in 2..=12u64 {
        for lba in (0..blocks).filter(|l| l % 8 != 0) {
            write_block(&mut e, v, lba, round, false).unwrap();
        }
    }
    assert!(e.status().gc_bytes_relocated > gc0, "GC ran");
    call(&mut e, Request::Flush).result.unwrap();
    drop(e);
    let e = open_rw(&devs, config());
    for k in [1, n / 2, n - 1] {
        let s = e.shared().volume(&format!("s{k}")).unwrap().id;
        for lba in 0..blocks {
            let want = if lba % 8 == 0 { 1 } else { 2 };
            assert_eq!(
                decode_pattern(lba, &read_block(&e, s, lba)).unwrap(),
                want,
                "s{k} block {lba}"
            );
        }
    }
    drop(e);
    fsck_clean(&devs).unwrap();
}

/// Every checkpoint writes every map, snapshots' included, and the one before
/// stays until it commits: on an array nearly full of data, snapshots of a large
/// volume are refused with ENOSPC (saying the maps take the room) before their
/// maps could leave a checkpoint waiting for segments nothing would free. (The
/// 27th snapshot here used to hang the engine at around the 60th.) Checkpoints
/// go on, and deleting the snapshots gives the room back.
#[test]
fn snapshots_of_a_full_array_are_refused_before_their_maps_fill_it() {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(400)));
    let devs = vec![d];
    format_devices(
        &devs,
        &lamina_core::FormatParams {
            overprovision: 0.07,
            ..small_params()
        },
    );
    let mut e = open_rw(&devs, config());
    let blocks = e.usable_bytes() / BS as u64 * 95 / 100;
    let v = create_volume(&mut e, "v", blocks * BS as u64);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    let mut n = 0;
    let err = loop {
        match make_snapshot(&mut e, "v", &format!("s{n}"), false) {
            Ok(()) => n += 1,
            Err(err) => break err.to_string(),
        }
    };
    assert!(
        err.contains("no space") && err.contains("volumes' maps"),
        "{err}"
    );
    assert!((5..63).contains(&n), "{n} snapshots before the refusal");
    // Status counts the maps as in use: the volume alone is below the critical
    // level (95%), with the snapshots' maps the array is above it.
    let s = e.status();
    let critical = (s.usable_bytes as f64 * 0.95).ceil() as u64;
    assert!(
        s.live_bytes < critical,
        "{} {}",
        s.live_bytes,
        s.usable_bytes
    );
    assert!(s.maps_bytes > 0 && s.live_bytes + s.maps_bytes >= critical);
    assert_eq!(s.space_state, "critical");
    // So does the status of the stopped array (a read-only open writes no
    // checkpoint, which is where the maps are counted while it runs).
    call(&mut e, Request::Flush).result.unwrap();
    let offline = lamina_core::recovery::open(
        devs.clone(),
        config(),
        lamina_core::recovery::OpenMode::ReadOnly,
    )
    .expect("read-only open")
    .0
    .status();
    assert_eq!(offline.maps_bytes, s.maps_bytes);
    assert_eq!(offline.space_state, "critical");
    for _ in 0..3 {
        call(&mut e, Request::Checkpoint)
            .result
            .expect("checkpoint");
    }
    for k in 0..n {
        call(
            &mut e,
            Request::DeleteVolume {
                name: format!("s{k}"),
            },
        )
        .result
        .unwrap();
    }
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 3, false).unwrap();
    }
    make_snapshot(&mut e, "v", "after", false).expect("room again");
    call(&mut e, Request::Flush).result.unwrap();
    drop(e);
    let e = open_rw(&devs, config());
    for lba in (0..blocks).step_by(97) {
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), 3);
    }
    drop(e);
    fsck_clean(&devs).unwrap();
}

/// Power cuts while snapshots are taken and deleted during writes (several seeds,
/// a random history each): every snapshot whose creation returned comes back
/// whole, every deletion that returned stays done, the origin's blocks each hold
/// a write that was made (and, up to the last completed flush, the newest), and
/// fsck finds nothing.
#[test]
fn power_cuts_while_snapshots_are_taken_and_deleted() {
    use rand::{Rng, SeedableRng};
    for seed in 0..6u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let (dev, mut e, v, blocks) = crash_array(5);
        // Per block: the newest round written, and the newest flushed.
        let mut last = vec![0u64; blocks as usize];
        let mut flushed = vec![0u64; blocks as usize];
        // Live snapshots: name and the rounds they hold.
        let mut snaps: Vec<(String, Vec<u64>)> = Vec::new();
        let mut deleted: Vec<String> = Vec::new();
        let steps = rng.gen_range(200..600);
        for step in 1..=steps {
            match rng.gen_range(0..100) {
                0..=2 if snaps.len() < 4 => {
                    let name = format!("s{step}");
                    make_snapshot(&mut e, "v", &name, false).unwrap();
                    snaps.push((name, last.clone()));
                }
                3..=4 if !snaps.is_empty() => {
                    let (name, _) = snaps.remove(rng.gen_range(0..snaps.len()));
                    call(&mut e, Request::DeleteVolume { name: name.clone() })
                        .result
                        .unwrap();
                    deleted.push(name);
                }
                5..=7 => {
                    call(&mut e, Request::Flush).result.unwrap();
                    flushed.clone_from(&last);
                }
                _ => {
                    // A run of writes, skewed to the front so GC finds garbage.
                    let n = rng.gen_range(1..32);
                    for _ in 0..n {
                        let lba = if rng.gen_bool(0.7) {
                            rng.gen_range(0..blocks / 4)
                        } else {
                            rng.gen_range(0..blocks)
                        };
                        write_block(&mut e, v, lba, step, false).unwrap();
                        last[lba as usize] = step;
                    }
                }
            }
        }
        drop(e);
        let (e, dev2) = after_power_cut(&dev, &mut rng);
        for (name, rounds) in &snaps {
            let s = e
                .shared()
                .volume(name)
                .unwrap_or_else(|| panic!("seed {seed}: snapshot {name} lost"))
                .id;
            for lba in 0..blocks {
                let got = decode_pattern(lba, &read_block(&e, s, lba));
                let want = rounds[lba as usize];
                let ok = if want == 0 {
                    read_block(&e, s, lba).iter().all(|&b| b == 0)
                } else {
                    got == Ok(want)
                };
                assert!(ok, "seed {seed}: {name} block {lba}: {got:?}, want {want}");
            }
        }
        for name in &deleted {
            assert!(
                e.shared().volume(name).is_none(),
                "seed {seed}: {name} is back"
            );
        }
        for lba in 0..blocks {
            let b = read_block(&e, v, lba);
            let got = if b.iter().all(|&x| x == 0) {
                0
            } else {
                decode_pattern(lba, &b).unwrap()
            };
            assert!(
                got >= flushed[lba as usize] && got <= last[lba as usize],
                "seed {seed}: origin block {lba}: round {got}, flushed {}, last {}",
                flushed[lba as usize],
                last[lba as usize]
            );
        }
        drop(e);
        fsck_clean(&[dev2]).unwrap();
    }
}

/// On a small busy array GC keeps fewer segments free than a rollback's
/// checkpoint needs (the user floor, the checkpoint, 2 more): the rollback waits
/// for GC to free them, refusing writes to the volume meanwhile, then runs. It
/// used to be refused with ENOSPC.
/// A small busy array on which a rollback of volume "v" to snapshot "s" must wait
/// for GC (see below): the device, the engine, v, its blocks, the generation
/// written last, and a second volume "w".
fn busy_array_for_rollback(
    rng: &mut impl rand::Rng,
) -> (
    Arc<lamina_device::crash::CrashDevice>,
    lamina_core::Engine,
    lamina_core::VolumeId,
    u64,
    u64,
    lamina_core::VolumeId,
) {
    // GC stops one segment short of what the rollback needs (the floor, its
    // checkpoint's one segment, 2 more): the rollback's reserve makes it go on.
    let cfg = lamina_core::EngineConfig {
        user_floor_segments: Some(4),
        gc_start_segments: Some(5),
        ..config()
    };
    let (dev, mut e, v, blocks) = crash_array_with(2, cfg);
    let w = create_volume(&mut e, "w", 16 * BS as u64);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    make_snapshot(&mut e, "v", "s", false).unwrap();
    let mut last = 1;
    for i in 0..blocks * 4 {
        let lba = rng.gen_range(0..blocks / 2);
        last = 2 + i;
        write_block(&mut e, v, lba, last, false).unwrap();
    }
    (dev, e, v, blocks, last, w)
}

fn rollback_v_to_s() -> Request {
    Request::Rollback {
        name: "v".into(),
        snapshot: "s".into(),
    }
}

#[test]
fn a_rollback_on_a_busy_array_waits_for_gc_to_free_its_segments() {
    use lamina_core::Token;
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (dev, mut e, v, blocks, last, w) = busy_array_for_rollback(&mut rng);
    // The block written last, found by its generation.
    let newest = (0..blocks / 2)
        .find(|&lba| decode_pattern(lba, &read_block(&e, v, lba)) == Ok(last))
        .unwrap();
    let t = |handle| Token { conn: 1, handle };
    let victims = e.status().gc_victims;
    e.submit(t(1), rollback_v_to_s());
    // It waits: the map is not the snapshot's yet (a rollback that runs takes
    // it at once), and writes to the volume are refused; another volume's are
    // taken.
    assert_eq!(decode_pattern(newest, &read_block(&e, v, newest)), Ok(last));
    let write = |volume| Request::Write {
        volume,
        offset: 0,
        data: pattern(0, 7),
        fua: false,
    };
    e.submit(t(2), write(v));
    e.submit(t(3), write(w));
    let mut replies = Vec::new();
    e.drain_replies(&mut replies);
    let refused = replies.iter().find(|r| r.token == t(2)).expect("at once");
    let err = refused.result.as_ref().unwrap_err().to_string();
    assert!(err.contains("being rolled back"), "{err}");
    assert!(replies.iter().all(|r| r.token != t(1)));
    // GC runs, without the clock moving (as an offline rollback runs it); the
    // rollback follows.
    lamina_core::recovery::run_inline(&mut e);
    e.drain_replies(&mut replies);
    let answer = |t| {
        replies
            .iter()
            .find(|r| r.token == t)
            .map(|r| r.result.clone())
    };
    answer(t(1))
        .expect("the rollback is answered")
        .expect("GC frees what the rollback needs");
    answer(t(3))
        .expect("answered")
        .expect("the other volume's write");
    assert!(e.status().gc_victims > victims, "GC ran for the rollback");
    assert_eq!(decode_pattern(0, &read_block(&e, w, 0)), Ok(7));
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), 1);
    }
    drop(e);
    let (e, dev2) = after_power_cut(&dev, &mut rng);
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), 1);
    }
    drop(e);
    fsck_clean(&[dev2]).unwrap();
}

/// A waiting rollback is refused for time only when writes took what GC freed: an
/// offline rollback (no writes; its clock jumps an hour per round) waits however
/// long GC takes, while one that waited 60 s as writes to another volume went on
/// is refused with ENOSPC.
#[test]
fn a_waiting_rollback_times_out_only_while_writes_take_the_space() {
    use lamina_core::Token;
    use rand::SeedableRng;
    let t = |handle| Token { conn: 1, handle };
    let answer = |e: &mut lamina_core::Engine, t| {
        let mut replies = Vec::new();
        e.drain_replies(&mut replies);
        replies.into_iter().find(|r| r.token == t).map(|r| r.result)
    };
    // No writes: an hour passes before GC runs, and the rollback still runs.
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (_, mut e, v, blocks, _, _) = busy_array_for_rollback(&mut rng);
    e.submit(t(1), rollback_v_to_s());
    let now = e.now_ms();
    e.tick(now + 3_600_000);
    assert!(answer(&mut e, t(1)).is_none(), "it waits");
    lamina_core::recovery::run_inline(&mut e);
    answer(&mut e, t(1))
        .expect("answered")
        .expect("GC freed what it needs");
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), 1);
    }
    // Writes to another volume meanwhile, and 60 s: refused.
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (_, mut e, _, _, _, w) = busy_array_for_rollback(&mut rng);
    e.submit(t(1), rollback_v_to_s());
    e.submit(
        t(2),
        Request::Write {
            volume: w,
            offset: 0,
            data: pattern(0, 7),
            fua: false,
        },
    );
    assert!(answer(&mut e, t(1)).is_none(), "it waits");
    let now = e.now_ms();
    e.tick(now + 60_000);
    let err = answer(&mut e, t(1))
        .expect("answered")
        .expect_err("refused")
        .to_string();
    assert!(err.contains("while writes took the rest"), "{err}");
}

/// A rollback is all or nothing across a power cut: cut before its checkpoint
/// commits, the volume is as it was (GC moved nothing meanwhile, the blocks only
/// it held are all there); once the command has returned, the volume is its
/// snapshot again, the snapshot stays, and what only the volume held is freed.
#[test]
fn a_rollback_survives_a_power_cut_whole_or_not_at_all() {
    use lamina_core::Token;
    use rand::SeedableRng;
    let mut rng = rand::rngs::StdRng::seed_from_u64(3);
    let (dev, mut e, v, blocks) = crash_array(4);
    for lba in 0..blocks {
        write_block(&mut e, v, lba, 1, false).unwrap();
    }
    make_snapshot(&mut e, "v", "s", false).unwrap();
    for round in 2..=6u64 {
        for lba in (0..blocks).filter(|l| l % 3 != round % 3) {
            write_block(&mut e, v, lba, round, false).unwrap();
        }
    }
    call(&mut e, Request::Flush).result.unwrap();
    let before: Vec<Vec<u8>> = (0..blocks).map(|lba| read_block(&e, v, lba)).collect();
    let live_before = e.status().live_bytes;
    // Not while a checkpoint is being written: it would save the map half old.
    e.submit(Token { conn: 1, handle: 5 }, Request::Checkpoint);
    let busy = Token { conn: 1, handle: 6 };
    e.submit(
        busy,
        Request::Rollback {
            name: "v".into(),
            snapshot: "s".into(),
        },
    );
    let mut replies = Vec::new();
    e.drain_replies(&mut replies);
    let r = replies
        .iter()
        .find(|r| r.token == busy)
        .expect("refused at once");
    let err = r.result.as_ref().unwrap_err();
    assert!(
        err.to_string().contains(lamina_core::ROLLBACK_BUSY),
        "{err}"
    );
    call(&mut e, Request::Checkpoint).result.unwrap();
    // Cut before the rollback's checkpoint commits: nothing of it happened.
    e.submit(
        Token { conn: 1, handle: 7 },
        Request::Rollback {
            name: "v".into(),
            snapshot: "s".into(),
        },
    );
    // (Submitted, not run: `call` would carry out the rollback's I/O too.)
    let write = Token { conn: 1, handle: 8 };
    e.submit(
        write,
        Request::Write {
            volume: v,
            offset: 0,
            data: pattern(0, 99),
            fua: false,
        },
    );
    let mut replies = Vec::new();
    e.drain_replies(&mut replies);
    let r = replies
        .iter()
        .find(|r| r.token == write)
        .expect("refused at once");
    let err = r.result.as_ref().unwrap_err();
    assert!(err.to_string().contains("rolled back"), "{err}");
    drop(e);
    let (mut e, dev2) = after_power_cut(&dev, &mut rng);
    let v = e.shared().volume("v").unwrap().id;
    let s = e.shared().volume("s").unwrap().id;
    for lba in 0..blocks {
        assert_eq!(read_block(&e, v, lba), before[lba as usize], "block {lba}");
        assert_eq!(decode_pattern(lba, &read_block(&e, s, lba)).unwrap(), 1);
    }
    assert_eq!(e.status().live_bytes, live_before);
    // Done, then cut: the volume is its snapshot, which stays; only what they
    // share is left.
    rollback(&mut e, "v", "s").unwrap();
    assert_eq!(e.status().live_bytes, blocks * BS as u64);
    write_block(&mut e, v, 0, 100, false).unwrap();
    drop(e);
    let (e, dev3) = after_power_cut(&dev2, &mut rng);
    for lba in 1..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, v, lba)).unwrap(), 1);
        assert_eq!(decode_pattern(lba, &read_block(&e, s, lba)).unwrap(), 1);
    }
    let first = decode_pattern(0, &read_block(&e, v, 0)).unwrap();
    assert!(first == 1 || first == 100, "block 0: round {first}");
    drop(e);
    fsck_clean(&[dev3]).unwrap();
}

/// On a parity array: a family under GC, then a member fails; every volume reads
/// back through parity, before and after a restart.
#[test]
fn a_family_on_said5_survives_gc_and_a_member_loss() {
    let d: Vec<Arc<dyn BlockDevice>> = (0..4)
        .map(|i| {
            Arc::new(MemDevice::new(format!("m{i}"), device_bytes(32))) as Arc<dyn BlockDevice>
        })
        .collect();
    format_devices(&d, &layout_params(lamina_format::superblock::Layout::Said5));
    let mut e = open_rw(&d, config());
    let gc0 = e.status().gc_bytes_relocated;
    let models = snapshot_family_under_gc(&mut e, 5, u64::MAX);
    assert!(e.status().gc_bytes_relocated > gc0, "GC ran");
    check_family(&e, &models);
    call(&mut e, Request::FailMember { index: 1 })
        .result
        .unwrap();
    check_family(&e, &models);
    drop(e);
    let e = open_rw(&d, config());
    check_family(&e, &models);
}
