//! Lamina on zoned devices (emulated ZNS and host-managed SMR): segments are zones,
//! every write lands at its zone's write pointer, the open-zone limit holds, and
//! restarts take the write pointers from the devices, including zones a crash
//! left open with a torn write at their end.

mod common;

use common::*;
use lamina_core::{EngineConfig, FormatParams, Request, VolumeId};
use lamina_device::mem::MemDevice;
use lamina_device::zoned::{ZoneCond, ZoneType, ZonedConfig, ZonedDevice};
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

const ZONE: u64 = 256 << 10;

/// `n` zoned devices of `zones` zones of 256 KiB, the first 4 conventional (the
/// superblocks' megabyte), with `cap` writable bytes per zone and an open limit.
fn zoned(n: usize, zones: u64, cap: u64, limit: u32) -> Vec<Arc<ZonedDevice>> {
    zoned_conv(n, zones, cap, limit, 4)
}

fn zoned_conv(n: usize, zones: u64, cap: u64, limit: u32, conv: u32) -> Vec<Arc<ZonedDevice>> {
    (0..n)
        .map(|i| {
            Arc::new(
                ZonedDevice::new(
                    Arc::new(MemDevice::new(format!("z{i}"), zones * ZONE)),
                    ZonedConfig {
                        zone_bytes: ZONE,
                        zone_capacity_bytes: cap,
                        conventional_zones: conv,
                        max_open: limit,
                        max_active: limit,
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
        })
        .collect()
}

fn config() -> EngineConfig {
    EngineConfig {
        classifier: "lamina".into(),
        ..small_config()
    }
}

/// Random overwrites checked against a model, flushed now and then.
fn run(
    e: &mut lamina_core::Engine,
    vol: VolumeId,
    model: &mut HashMap<u64, u64>,
    blocks: u64,
    writes: u64,
    seed: u64,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed + seed_base());
    // Skewed: a hot tenth takes most writes, so heat classes matter.
    overwrite(e, vol, model, writes, 211, |_| {
        if rng.gen_bool(0.7) {
            rng.gen_range(0..blocks / 10)
        } else {
            rng.gen_range(0..blocks)
        }
    });
}

/// Added to every seed: `LAMINA_TEST_SEED=N cargo test --test zoned` runs the
/// same tests on other random runs (for soak testing).
fn seed_base() -> u64 {
    std::env::var("LAMINA_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// No device ever refused a write, and no more zones are open than allowed.
fn within_the_rules(z: &[Arc<ZonedDevice>], limit: u32) {
    for d in z {
        assert_eq!(
            d.rejected_writes(),
            0,
            "{}: writes broke zone rules",
            d.describe()
        );
        let open = d
            .zones()
            .iter()
            .filter(|z| {
                matches!(
                    z.cond,
                    ZoneCond::ImplicitOpen | ZoneCond::ExplicitOpen | ZoneCond::Closed
                )
            })
            .count() as u32;
        assert!(open <= limit, "{open} zones open, limit {limit}");
    }
}

/// A crash: the engine goes away without a flush, and each zone it had open gets
/// a torn block at its write pointer (a unit the device had half taken).
fn crash(e: lamina_core::Engine, z: &[Arc<ZonedDevice>], rng: &mut impl Rng) -> usize {
    drop(e);
    let mut torn = 0;
    for d in z {
        for zone in d.zones() {
            let open = matches!(zone.cond, ZoneCond::ImplicitOpen | ZoneCond::Closed);
            if zone.ty == ZoneType::SequentialRequired && open && rng.gen_bool(0.7) {
                let junk: Vec<u8> = (0..4096).map(|_| rng.gen()).collect();
                d.write_at(&junk, zone.wp).unwrap();
                torn += 1;
            }
        }
    }
    torn
}

fn lifecycle(
    layout: Layout,
    z: Vec<Arc<ZonedDevice>>,
    limit: u32,
    config: impl Fn() -> EngineConfig,
) {
    lifecycle_with_cache(layout, z, 0, limit, config)
}

/// [`lifecycle`], with a conventional cache device of `cache_zones` zone-sized
/// segments in front of the zoned ones when that is not 0.
fn lifecycle_with_cache(
    layout: Layout,
    z: Vec<Arc<ZonedDevice>>,
    cache_zones: u64,
    limit: u32,
    config: impl Fn() -> EngineConfig,
) {
    let mut devs = dyn_devs(&z);
    let conventional = z[0].config().conventional_zones as u64 * ZONE;
    if cache_zones > 0 {
        devs.push(Arc::new(MemDevice::new(
            "cache",
            conventional + cache_zones * ZONE,
        )));
    }
    let params = FormatParams {
        cache_devices: (cache_zones > 0) as usize,
        ..layout_params(layout)
    };
    format_devices(&devs, &params);
    let mut e = open_rw(&devs, config());
    let seg = e.status().segment_size_bytes;
    let per_member = match layout {
        Layout::Jbod => 1,
        _ => e.geometry().row_blocks as u64,
    };
    let cap = z[0].config().zone_capacity_bytes;
    assert_eq!(
        seg,
        cap * per_member,
        "a segment is one zone per data member"
    );
    let blocks = (e.status().usable_bytes / BS as u64) * 8 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    if cache_zones > 0 {
        // User writes land in the cache: less than it holds touches no zone
        // (after a flush has sealed what creating the volume left in the
        // metadata stream).
        // Its segments are as large as the zones' writable part.
        assert_eq!(
            e.status().cache.unwrap().segment_count,
            cache_zones * ZONE / seg
        );
        call(&mut e, Request::Flush).result.expect("flush");
        let zoned_bytes = |e: &lamina_core::Engine| e.status().members[0].bytes_written;
        let before = zoned_bytes(&e);
        overwrite(&mut e, vol, &mut model, 200, 50, |i| i * 7 % blocks);
        assert_eq!(zoned_bytes(&e), before, "a user write reached a zone");
    }
    run(&mut e, vol, &mut model, blocks, blocks * 4, 1);
    assert!(e.counters().gc_blocks > 0, "GC ran");
    if cache_zones > 0 {
        let c = e.status().cache.unwrap();
        assert!(c.compactions > 0 && c.compacted_bytes > 0, "{c:?}");
        // Released cache segments are discarded (the zoned device refuses a
        // discard of a sequential zone, and `within_the_rules` counts it).
        if config().discard_delay_ms == 0 {
            assert!(e.segments_discarded() > 0, "no cache segment discarded");
        }
    }
    verify_model(&e, vol, &model);
    within_the_rules(&z, limit);

    // Three crashes, each followed by more overwrites and a check.
    let mut rng = rand::rngs::StdRng::seed_from_u64(9 + seed_base());
    let mut torn = 0;
    for round in 0..3 {
        // Unflushed writes before the crash: acknowledged from RAM, may be lost.
        let mut unflushed = model.clone();
        for i in 0..200 {
            let lba = rng.gen_range(0..blocks);
            let gen = unflushed.get(&lba).copied().unwrap_or(0) + 1;
            write_block(&mut e, vol, lba, gen, false).unwrap();
            unflushed.insert(lba, gen);
            let _ = i;
        }
        torn += crash(e, &z, &mut rng);
        e = open_rw(&devs, config());
        within_the_rules(&z, limit);
        // Every block holds its flushed content or a later one it was given.
        for (lba, gen) in model.clone() {
            let b = read_block(&e, vol, lba);
            let got = decode_pattern(lba, &b).expect("a block of this lba");
            assert!(
                got >= gen && got <= unflushed[&lba],
                "round {round}: lba {lba} holds {got}, flushed {gen}"
            );
            model.insert(lba, got);
        }
        run(&mut e, vol, &mut model, blocks, blocks, 10 + round);
        verify_model(&e, vol, &model);
        within_the_rules(&z, limit);
    }
    assert!(torn > 0, "some crash left a torn write in an open zone");
}

#[test]
fn jbod_on_zns_with_capacity_below_zone_size() {
    // ZNS-like: 192 KiB writable of each 256 KiB zone, 10 zones open at most
    // (the volume's 4 heat classes keep 8 streams, plus metadata and a closing
    // one). One device, so that zones a crash left open would exceed the limit
    // if recovery did not finish them.
    lifecycle(Layout::Jbod, zoned(1, 120, 192 << 10, 10), 10, config);
}

/// CSAL on ZNS (issue 14): a conventional cache in front of a zoned device takes
/// every user write; compaction and GC fill the zones. Only their streams and
/// the metadata stream hold zones open: the 4 heat classes with their read-hot
/// stream and metadata fit a limit of 7 that the same volume without a cache
/// (8 user and GC streams, read-hot, metadata) does not.
#[test]
fn a_cache_in_front_of_zns_keeps_user_writes_out_of_the_zones() {
    // Segments discarded as they are released, in release order across tiers.
    let config = || EngineConfig {
        discard_delay_ms: 0,
        ..config()
    };
    lifecycle_with_cache(Layout::Jbod, zoned(1, 120, 192 << 10, 7), 24, 7, config);
    let devs = dyn_devs(&zoned(1, 120, 192 << 10, 7));
    format_devices(&devs, &layout_params(Layout::Jbod));
    let mut e = open_rw(&devs, config());
    let r = call(
        &mut e,
        Request::CreateVolume {
            name: "v".into(),
            size_bytes: 1 << 20,
        },
    );
    let err = r.result.expect_err("no room for its zones").to_string();
    assert!(err.contains("zones be open at once"), "{err}");
}

#[test]
fn said5_on_host_managed_smr() {
    // SMR-like: whole zones writable, a stripe is one zone on each of 4 members;
    // 3 heat classes (6 streams) and metadata under a limit of 8.
    // A disk: GC reads across gaps of up to 32 dead blocks rather than seek.
    lifecycle(Layout::Said5, zoned(4, 40, ZONE, 8), 8, || EngineConfig {
        gc_read_gap_blocks: 32,
        ..config()
    });
}

#[test]
fn zoned_arrays_refuse_what_cannot_work() {
    let err = |devs: Vec<Arc<dyn BlockDevice>>, p: FormatParams| {
        let uuids: Vec<[u8; 16]> = (0..devs.len()).map(|i| [i as u8 + 1; 16]).collect();
        lamina_core::format(&devs, &p, [1; 16], &uuids, 0)
            .unwrap_err()
            .to_string()
    };
    // No conventional room for the superblocks.
    let no_conv = Arc::new(
        ZonedDevice::new(
            Arc::new(MemDevice::new("z", 40 * ZONE)),
            ZonedConfig {
                zone_bytes: ZONE,
                zone_capacity_bytes: ZONE,
                conventional_zones: 1,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let e = err(vec![no_conv], layout_params(Layout::Jbod));
    assert!(e.contains("conventional"), "{e}");
    // Zoned and conventional devices mixed.
    let z = zoned(1, 40, ZONE, 0);
    let plain: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("plain", 40 * ZONE));
    let e = err(vec![z[0].clone(), plain], layout_params(Layout::Jbod));
    assert!(e.contains("not zoned"), "{e}");
    // A zoned cache device: a cache tier takes writes anywhere.
    let two = zoned(2, 40, ZONE, 0);
    let e = err(
        dyn_devs(&two),
        FormatParams {
            cache_devices: 1,
            ..layout_params(Layout::Jbod)
        },
    );
    assert!(e.contains("cache device") && e.contains("is zoned"), "{e}");
    // An open limit too small for the streams.
    let e = err(
        dyn_devs(&zoned(1, 40, ZONE, 3)),
        layout_params(Layout::Jbod),
    );
    assert!(e.contains("open at once"), "{e}");
    // Volumes beyond the open limit: a clear error naming the limit.
    let z = zoned(1, 60, ZONE, 6);
    let devs = dyn_devs(&z);
    format_devices(&devs, &layout_params(Layout::Jbod));
    let mut e = open_rw(&devs, config());
    let r = call(
        &mut e,
        Request::CreateVolume {
            name: "big".into(),
            size_bytes: 8 << 20,
        },
    );
    let msg = r.result.unwrap_err().to_string();
    assert!(msg.contains("6 zones be open at once"), "{msg}");
    // With one heat class (two streams) it fits: the default placement ("auto")
    // takes greedy's two streams where SepBIT's six do not fit the limit.
    drop(e);
    let mut e = open_rw(&devs, small_config());
    create_volume(&mut e, "small", 1 << 20);
    assert_eq!(e.status().volumes[0].classifier, "none");
    within_the_rules(&z, 6);
    // Where they fit, the default is SepBIT, and a second volume that would not
    // fit beside it gets greedy's two.
    let z = zoned(1, 60, ZONE, 11);
    let devs = dyn_devs(&z);
    format_devices(&devs, &layout_params(Layout::Jbod));
    let mut e = open_rw(&devs, small_config());
    create_volume(&mut e, "a", 1 << 20);
    create_volume(&mut e, "b", 1 << 20);
    assert_eq!(classifiers(&e), ["sepbit", "none"]);
    // Recovery keeps what "auto" resolved to at creation, even once the streams
    // that decided it are gone: "b" stays greedy after "a" is deleted.
    drop(e);
    let mut e = open_rw(&devs, small_config());
    assert_eq!(classifiers(&e), ["sepbit", "none"]);
    call(&mut e, Request::DeleteVolume { name: "a".into() })
        .result
        .unwrap();
    call(&mut e, Request::Checkpoint).result.unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    assert_eq!(classifiers(&e), ["none"]);
    within_the_rules(&z, 11);
}

/// Each volume's classifier, in volume order.
fn classifiers(e: &lamina_core::Engine) -> Vec<String> {
    e.status()
        .volumes
        .into_iter()
        .map(|v| v.classifier)
        .collect()
}

/// Zones that turn read-only keep serving their data; when their segments are
/// released, the failed reset sets them aside instead of failing the array.
#[test]
fn read_only_zones_are_set_aside() {
    let z = zoned(1, 120, 192 << 10, 10);
    let devs = dyn_devs(&z);
    format_devices(&devs, &layout_params(Layout::Jbod));
    let mut e = open_rw(&devs, config());
    let blocks = (e.status().usable_bytes / BS as u64) * 7 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, blocks, blocks * 2, 3);
    let full: Vec<usize> = z[0]
        .zones()
        .iter()
        .enumerate()
        .filter(|(_, z)| z.cond == ZoneCond::Full)
        .map(|(i, _)| i)
        .take(4)
        .collect();
    assert_eq!(full.len(), 4);
    for &i in &full {
        z[0].set_condition(i, ZoneCond::ReadOnly);
    }
    verify_model(&e, vol, &model);
    run(&mut e, vol, &mut model, blocks, blocks * 3, 4);
    verify_model(&e, vol, &model);
    assert_eq!(z[0].rejected_writes(), 0);
    assert!(
        e.segments_set_aside() > 0,
        "a read-only zone's segment was reused"
    );
    assert!(
        e.status().free_segments > 0,
        "still writing around the read-only zones"
    );
}

/// SALSA 3.2: conventional zones past the superblocks' megabyte hold segments, and
/// the metadata stream (checkpoints, trim and release records: small writes) lives
/// there, so it holds no sequential zone open and finishes none; everything else
/// (GC, crashes, restarts) works as on sequential zones.
#[test]
fn metadata_lives_in_conventional_zones() {
    let run_on = |conv: u32| {
        let z = zoned_conv(1, 120, ZONE, 12, conv);
        lifecycle(Layout::Jbod, z.clone(), 12, config);
        z[0].conventional_bytes_written()
    };
    // 4 conventional zones: the superblocks' megabyte only.
    let plain = run_on(4);
    // 12: 8 conventional segments for metadata.
    let conv = run_on(12);
    eprintln!("bytes written to conventional zones: {plain} -> {conv}");
    assert!(conv > 10 * plain, "metadata went to conventional zones");
}

/// SALSA 3.2, small writes: units a flush seals with a few blocks go to the
/// conventional zones instead of the data streams' sequential zones; everything
/// flushed survives a crash, and GC later moves those blocks on.
#[test]
fn small_flushed_writes_go_to_conventional_zones() {
    let z = zoned_conv(1, 140, ZONE, 12, 36);
    let devs = dyn_devs(&z);
    format_devices(&devs, &layout_params(Layout::Jbod));
    let mut e = open_rw(&devs, config());
    let blocks = (e.status().usable_bytes / BS as u64) * 6 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    // fsync after every one or two 4 KiB writes (a database's log).
    overwrite(&mut e, vol, &mut model, 3000, 2, |_| {
        rng.gen_range(0..blocks)
    });
    let moved = e.small_units_moved();
    eprintln!("{moved} short units moved");
    assert!(moved > 500, "{moved} short units moved");
    // Bulk writes make GC collect the small stream's segments too.
    run(&mut e, vol, &mut model, blocks, blocks * 3, 22);
    verify_model(&e, vol, &model);
    within_the_rules(&z, 12);
    let conv_before = z[0].conventional_bytes_written();
    overwrite(&mut e, vol, &mut model, 500, 1, |_| {
        rng.gen_range(0..blocks)
    });
    assert!(z[0].conventional_bytes_written() > conv_before);
    let mut rng2 = rand::rngs::StdRng::seed_from_u64(23);
    crash(e, &z, &mut rng2);
    let e = open_rw(&devs, config());
    verify_model(&e, vol, &model);
    within_the_rules(&z, 12);
}

/// A failed member of a SAID5 array on SMR is replaced by a new zoned device and
/// rebuilt while writes go on: each stripe's zone on the new member is written from
/// its start, up to the stripe's write pointer, then the stripe's later writes
/// continue there. The rebuilt member then carries its share alone.
#[test]
fn zoned_member_is_replaced_and_rebuilt_under_writes() {
    let z = zoned(4, 40, ZONE, 8);
    let devs = dyn_devs(&z);
    format_devices(&devs, &layout_params(Layout::Said5));
    let mut e = open_rw(&devs, config());
    let blocks = (e.status().usable_bytes / BS as u64) * 6 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, blocks, blocks * 2, 31);
    call(&mut e, Request::FailMember { index: 1 })
        .result
        .unwrap();
    run(&mut e, vol, &mut model, blocks, blocks / 2, 32);
    // A device zoned unlike the members is refused with the reason.
    let odd = Arc::new(
        ZonedDevice::new(
            Arc::new(MemDevice::new("odd", 40 * ZONE)),
            ZonedConfig {
                zone_bytes: ZONE / 2,
                zone_capacity_bytes: ZONE / 2,
                conventional_zones: 8,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let r = call(
        &mut e,
        Request::ReplaceMember {
            index: 1,
            device: lamina_core::NewDevice(odd),
            uuid: [9; 16],
        },
    );
    assert!(r.result.unwrap_err().to_string().contains("not zoned like"));
    let new = zoned(1, 40, ZONE, 8).remove(0);
    replace_member(&mut e, 1, new.clone());
    let st = e.shared().striped.clone().unwrap();
    // Half the stripes, then more writes (into stripes on both sides of the
    // cursor, and the open ones), then the rest.
    let part = rebuild_member(&mut e, 1, Some(18));
    assert!(!part.finished);
    run(&mut e, vol, &mut model, blocks, blocks, 33);
    let rest = rebuild_member(&mut e, 1, None);
    assert!(rest.finished && part.stripes_rebuilt + rest.stripes_rebuilt > 0);
    assert_eq!(st.rebuild_cursor(1), None);
    run(&mut e, vol, &mut model, blocks, blocks / 2, 34);
    for d in z.iter().chain([&new]) {
        assert_eq!(d.rejected_writes(), 0, "{}", d.describe());
    }
    // The new member carries its share: lose another one and read everything.
    call(&mut e, Request::FailMember { index: 3 })
        .result
        .unwrap();
    verify_model(&e, vol, &model);
    // And after a restart.
    drop(e);
    let devs2: Vec<Arc<dyn BlockDevice>> =
        vec![z[0].clone(), new.clone(), z[2].clone(), z[3].clone()];
    let e = open_rw(&devs2, config());
    verify_model(&e, vol, &model);
    assert_eq!(new.rejected_writes(), 0);
}

/// The write hole on zoned members. A power cut leaves each member's open zones
/// anywhere between what was synced and what was written (each member keeps or
/// loses its unsynced tail on its own); parity cannot be rewritten in place on a
/// zone, so recovery moves the live blocks of rows whose parity does not match
/// before it serves. Then each member is lost in turn: every block reads back as it
/// did after recovery.
#[test]
fn said5_zoned_power_cut_then_a_member_loss_keeps_every_block() {
    let mut relocated = 0;
    for seed in 0..16u64 {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed + 100 + seed_base());
        // The media under each zoned device, to leave junk where writes were lost.
        let media: Vec<Arc<MemDevice>> = (0..4)
            .map(|i| Arc::new(MemDevice::new(format!("z{i}"), 40 * ZONE)))
            .collect();
        let z: Vec<Arc<ZonedDevice>> = media
            .iter()
            .map(|m| {
                Arc::new(
                    ZonedDevice::new(
                        m.clone(),
                        ZonedConfig {
                            zone_bytes: ZONE,
                            zone_capacity_bytes: ZONE,
                            conventional_zones: 4,
                            max_open: 8,
                            max_active: 8,
                            ..Default::default()
                        },
                    )
                    .unwrap(),
                )
            })
            .collect();
        let devs = dyn_devs(&z);
        format_devices(&devs, &layout_params(Layout::Said5));
        let mut e = open_rw(&devs, config());
        let blocks = (e.status().usable_bytes / BS as u64) * 6 / 10;
        let vol = create_volume(&mut e, "v", blocks * BS as u64);
        let mut model = HashMap::new();
        run(&mut e, vol, &mut model, blocks, blocks * 2, seed);
        // What each zone holds durably: taken after the flush that ends `run`, and
        // again whenever the engine syncs by itself (free space running low).
        let wps = || -> Vec<HashMap<u64, u64>> {
            z.iter()
                .map(|d| d.zones().iter().map(|zn| (zn.start, zn.wp)).collect())
                .collect()
        };
        let mut synced = wps();
        let mut syncs = e.counters().syncs;
        for i in 0..400 {
            let lba = rng.gen_range(0..blocks);
            let gen = model.get(&lba).copied().unwrap_or(0) + 1;
            // Inline, without the clock moving: no background flush.
            let token = lamina_core::Token { conn: 3, handle: i };
            e.submit(
                token,
                Request::Write {
                    volume: vol,
                    offset: lba * BS as u64,
                    data: pattern(lba, gen),
                    fua: false,
                },
            );
            lamina_core::run_inline(&mut e);
            let mut replies = Vec::new();
            e.drain_replies(&mut replies);
            if e.counters().syncs != syncs {
                syncs = e.counters().syncs;
                synced = wps();
            }
        }
        drop(e);
        // The cut: each member's sequential zones fall back to a random point
        // between their synced and their current write pointer.
        for ((d, synced), m) in z.iter().zip(&synced).zip(&media) {
            for zn in d.zones() {
                let from = synced.get(&zn.start).copied().unwrap_or(zn.start);
                // (Zones the unsynced writes filled are left whole: rewriting part
                // of one would open a zone beyond the device's limit.)
                let open = matches!(zn.cond, ZoneCond::ImplicitOpen | ZoneCond::Closed);
                if zn.ty != ZoneType::SequentialRequired
                    || !open
                    || zn.wp <= from
                    || from < zn.start
                {
                    continue;
                }
                let keep_blocks = rng.gen_range(0..=(zn.wp - from) / BS as u64);
                let keep = from + keep_blocks * BS as u64;
                if keep == zn.wp {
                    continue;
                }
                let mut data = vec![0u8; (keep - zn.start) as usize];
                d.read_at(&mut data, zn.start).unwrap();
                d.reset_zone(zn.start).unwrap();
                if !data.is_empty() {
                    d.write_at(&data, zn.start).unwrap();
                }
                // What the lost writes would have replaced: junk, not their data.
                let junk: Vec<u8> = (0..zn.wp - keep).map(|_| rng.gen()).collect();
                m.write_at(&junk, keep).unwrap();
            }
        }
        if seed % 2 == 1 {
            // A crash while recovery is still at work: it has resynced what it
            // could, and would next write its checkpoint and move the blocks of the
            // rows it could not resync. The next recovery must find those rows
            // again, so no checkpoint may pass them before they are moved.
            let (mut half, _) = lamina_core::open_unfinished(
                devs.clone(),
                config(),
                lamina_core::OpenMode::ReadWrite,
            )
            .unwrap_or_else(|err| panic!("seed {seed}: recovery failed: {err}"));
            lamina_core::run_inline(&mut half);
            drop(half);
        }
        let (e, report) =
            lamina_core::open(devs.clone(), config(), lamina_core::OpenMode::ReadWrite)
                .unwrap_or_else(|err| panic!("seed {seed}: recovery failed: {err}"));
        relocated += report.resync_relocated_segments;
        within_the_rules(&z, 8);
        let contents: Vec<Vec<u8>> = (0..blocks).map(|lba| read_block(&e, vol, lba)).collect();
        for (&lba, &gen) in &model {
            let got = decode_pattern(lba, &contents[lba as usize]).expect("a block of this lba");
            assert!(
                got >= gen,
                "seed {seed}: lba {lba} holds {got}, flushed {gen}"
            );
        }
        drop(e);
        for lost in 0..z.len() {
            let mut members = devs.clone();
            members[lost] = Arc::new(lamina_device::striped::Absent::new("lost"));
            let (e, _) = lamina_core::open(members, config(), lamina_core::OpenMode::ReadOnly)
                .unwrap_or_else(|err| panic!("seed {seed}: open without {lost}: {err}"));
            let v = e.shared().volume_by_id(vol).unwrap();
            for lba in 0..blocks {
                let mut b = vec![0u8; BS];
                let r = e.shared().read(&v, lba * BS as u64, &mut b);
                assert!(
                    r.is_ok() && b == contents[lba as usize],
                    "seed {seed}: block {lba} changed when member {lost} was lost ({:?})",
                    r.err()
                );
            }
        }
    }
    assert!(
        relocated > 0,
        "some power cut left rows whose blocks had to move"
    );
}

/// Snapshots and clones on a zoned array with conventional zones: a family
/// written with frequent small flushes (units moved to the small stream), every
/// volume as its model says, before and after a restart; the zone rules hold, and
/// the snapshot's streams hold no zone (the origin's and clone's fit the limit).
#[test]
fn a_snapshot_family_on_zones_survives_small_flushes_and_restarts() {
    let z = zoned_conv(1, 140, ZONE, 12, 36);
    let devs = dyn_devs(&z);
    format_devices(&devs, &layout_params(Layout::Jbod));
    // The default classifier: the origin's and the clone's streams must share the
    // 12 open zones ("auto" fits them); the snapshot's hold none.
    let config = small_config;
    let mut e = open_rw(&devs, config());
    let models = snapshot_family_under_gc(&mut e, 3, 3);
    assert!(
        e.small_units_moved() > 0,
        "no unit went to the small stream"
    );
    check_family(&e, &models);
    within_the_rules(&z, 12);
    drop(e);
    let e = open_rw(&devs, config());
    check_family(&e, &models);
}

/// A mirrored cache in front of a zoned device: a failed copy is replaced by a
/// conventional device, never a zoned one; and an array whose cache device turns
/// up zoned at open (an emulated device's stale zone state beside its file) is
/// refused with the reason, not served into zone errors.
#[test]
fn a_cache_in_front_of_zones_stays_conventional() {
    let z = zoned(1, 120, 192 << 10, 7);
    let conv = 4 * ZONE;
    let copies: Vec<Arc<MemDevice>> = (0..2)
        .map(|i| Arc::new(MemDevice::new(format!("c{i}"), conv + 24 * ZONE)))
        .collect();
    let mut devs = dyn_devs(&z);
    devs.extend(dyn_devs(&copies));
    let params = FormatParams {
        cache_devices: 2,
        ..layout_params(Layout::Jbod)
    };
    format_devices(&devs, &params);
    let mut e = open_rw(&devs, config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, 1024, 3000, 3);
    call(&mut e, Request::FailMember { index: 2 })
        .result
        .expect("fail copy 1");
    let replace = |e: &mut lamina_core::Engine, d: Arc<dyn BlockDevice>| {
        call(
            e,
            Request::ReplaceMember {
                index: 2,
                device: lamina_core::NewDevice(d),
                uuid: [0x42; 16],
            },
        )
        .result
    };
    let zoned_copy = zoned(1, 28, ZONE, 7).remove(0);
    let err = replace(&mut e, zoned_copy).unwrap_err().to_string();
    assert!(err.contains("cache members are not"), "{err}");
    let c2 = Arc::new(MemDevice::new("c2", conv + 24 * ZONE));
    replace(&mut e, c2.clone()).expect("replace");
    verify_model(&e, vol, &model);
    drop(e);

    // The first copy seen through a zoned emulation at open.
    let as_zoned = Arc::new(
        ZonedDevice::new(
            copies[0].clone(),
            ZonedConfig {
                zone_bytes: ZONE,
                zone_capacity_bytes: ZONE,
                conventional_zones: 4,
                ..Default::default()
            },
        )
        .unwrap(),
    );
    let mut devs = dyn_devs(&z);
    devs.push(as_zoned);
    devs.push(c2);
    let err = lamina_core::open(devs, config(), lamina_core::OpenMode::ReadWrite)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("is zoned, but the array's cache tier is conventional"),
        "{err}"
    );
}
