//! Striped arrays (SAID0/5/6) through the engine: degraded service when members
//! fail, restart with failed or missing members, padding of partial rows, and the
//! errors for layouts that cannot be built.

mod common;

use common::*;
use lamina_core::{format, open, Lba, OpenMode, Request, VolumeId};
use lamina_device::fault::FaultDevice;
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

fn members(n: usize, segments: u64) -> Vec<Arc<FaultDevice>> {
    (0..n)
        .map(|i| {
            Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
                format!("m{i}"),
                device_bytes(segments),
            ))))
        })
        .collect()
}

/// Formats `devs` as `layout`, opens them and makes a volume of 70% of the usable
/// space; returns the engine, the volume and its size in blocks.
fn seventy_percent_volume(
    devs: &[Arc<dyn BlockDevice>],
    layout: Layout,
) -> (lamina_core::Engine, VolumeId, u64) {
    format_devices(devs, &layout_params(layout));
    let mut e = open_rw(devs, small_config());
    let blocks = (e.status().usable_bytes / BS as u64) * 7 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    (e, vol, blocks)
}

/// Random overwrites of `blocks` blocks with periodic flushes, checked against a
/// model; calls `at(i)` before write `i` so that tests can break members.
fn run(
    e: &mut lamina_core::Engine,
    vol: VolumeId,
    model: &mut HashMap<u64, u64>,
    blocks: u64,
    writes: u64,
    seed: u64,
    mut at: impl FnMut(u64),
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    overwrite(e, vol, model, writes, 97, |i| {
        at(i);
        rng.gen_range(0..blocks)
    });
}

fn verify(e: &lamina_core::Engine, vol: VolumeId, model: &HashMap<u64, u64>) {
    verify_model(e, vol, model)
}

/// Loses `lose` members (vanished) part way through a run that keeps GC busy,
/// verifies, restarts and verifies again.
fn survive(layout: Layout, n: usize, lose: &[usize]) {
    let f = members(n, 24);
    format_devices(&dyn_devs(&f), &layout_params(layout));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let blocks = (e.status().usable_bytes / BS as u64) * 8 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    let writes = blocks * 4;
    run(&mut e, vol, &mut model, blocks, writes, 1, |i| {
        for (j, &m) in lose.iter().enumerate() {
            if i == writes / 3 + j as u64 * 500 {
                f[m].vanish();
            }
        }
    });
    assert!(e.counters().gc_blocks > 0, "GC ran while degraded");
    verify(&e, vol, &model);
    let st = e.shared().striped.clone().unwrap();
    for &m in lose {
        assert!(st.is_failed(m), "member {m} marked failed");
    }
    assert_eq!(
        st.redundancy_left(),
        (n - layout_k(layout, n)) as isize - lose.len() as isize
    );
    assert!(st.rebuilt_blocks() > 0, "reads were rebuilt from parity");
    drop(e);
    // Restart: the failed members are recorded in the superblocks of the others
    // and left alone even though they are readable again.
    for &m in lose {
        f[m].heal();
    }
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let st = e.shared().striped.clone().unwrap();
    for &m in lose {
        assert!(st.is_failed(m), "member {m} still failed after restart");
    }
    verify(&e, vol, &model);
    run(&mut e, vol, &mut model, blocks, blocks, 2, |_| {});
    verify(&e, vol, &model);
}

fn layout_k(layout: Layout, n: usize) -> usize {
    match layout {
        Layout::Said5 => n - 1,
        Layout::Said6 => n - 2,
        _ => n,
    }
}

#[test]
fn said5_serves_through_a_lost_member_and_restarts_degraded() {
    survive(Layout::Said5, 4, &[2]);
}

#[test]
fn said6_serves_through_two_lost_members() {
    survive(Layout::Said6, 6, &[0, 4]);
}

#[test]
fn said0_and_said5_round_trip_without_failures() {
    for (layout, n) in [(Layout::Said0, 3), (Layout::Said5, 3), (Layout::Said6, 5)] {
        let f = members(n, 16);
        format_devices(&dyn_devs(&f), &layout_params(layout));
        let mut e = open_rw(&dyn_devs(&f), small_config());
        let blocks = (e.status().usable_bytes / BS as u64) * 8 / 10;
        let vol = create_volume(&mut e, "v", blocks * BS as u64);
        let mut model = HashMap::new();
        run(&mut e, vol, &mut model, blocks, blocks * 3, 3, |_| {});
        verify(&e, vol, &model);
        drop(e);
        let e = open_rw(&dyn_devs(&f), small_config());
        verify(&e, vol, &model);
    }
}

#[test]
fn flushed_partial_rows_are_padded_not_rewritten() {
    let f = members(4, 16);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 1 << 20);
    let mut model = HashMap::new();
    for lba in 0..50u64 {
        write_block(&mut e, vol, lba, 1, true).unwrap();
        model.insert(lba, 1);
    }
    let c = e.counters();
    assert!(c.pad_blocks > 0, "single-block FUA writes were padded");
    // At most k - 1 = 2 pad blocks per unit.
    assert!(c.pad_blocks <= 2 * 60, "{} pad blocks", c.pad_blocks);
    // Lose any one member: everything flushed is still there.
    for m in &f {
        m.vanish();
        verify(&e, vol, &model);
        m.heal();
    }
    assert!(e.shared().striped.as_ref().unwrap().rebuilt_blocks() > 0);
}

#[test]
fn layouts_refuse_too_few_devices() {
    for (layout, n, need) in [(Layout::Said5, 2, 3), (Layout::Said6, 3, 4)] {
        let f = members(n, 16);
        let uuids: Vec<[u8; 16]> = (0..n).map(|i| [i as u8 + 1; 16]).collect();
        let err = format(&dyn_devs(&f), &layout_params(layout), [1; 16], &uuids, 0).unwrap_err();
        assert!(
            err.to_string()
                .contains(&format!("at least {need} devices")),
            "{err}"
        );
        // Nothing was written.
        let mut b = vec![0u8; BS];
        f[0].read_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }
}

#[test]
fn losing_more_than_the_parity_stops_writes_but_keeps_reads() {
    let f = members(4, 16);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 2 << 20);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, 256, 600, 4, |_| {});
    f[0].vanish();
    f[3].vanish();
    // Writes now fail with a reason.
    let mut failed = None;
    for lba in 0..200u64 {
        let r = write_block(&mut e, vol, lba, 99, true);
        if let Err(err) = r {
            failed = Some(err);
            break;
        }
    }
    let err = failed.expect("writes fail once two SAID5 members are gone");
    assert!(err.to_string().contains("members failed"), "{err}");
    // Blocks on the surviving members are still served.
    let v = e.shared().volume_by_id(vol).unwrap();
    let mut ok = 0;
    for (&lba, &gen) in &model {
        let mut b = vec![0u8; BS];
        if e.shared().read(&v, lba * BS as u64, &mut b).is_ok()
            && decode_pattern(lba, &b).ok() == Some(gen)
        {
            ok += 1;
        }
    }
    assert!(ok > 0, "some blocks still readable");
    drop(e);
    // Read-write open refuses; the message says why.
    let err = match open(dyn_devs(&f), small_config(), OpenMode::ReadWrite) {
        Ok(_) => panic!("opened with two SAID5 members gone"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("tolerates 1"), "{err}");
}

fn rebuild(
    e: &mut lamina_core::Engine,
    index: usize,
    max: Option<u64>,
) -> lamina_core::rebuild::RebuildReport {
    rebuild_member(e, index, max)
}

fn replace(e: &mut lamina_core::Engine, index: usize, size: u64) -> Arc<FaultDevice> {
    let dev = Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
        format!("new{index}"),
        size,
    ))));
    replace_member(e, index, dev.clone());
    dev
}

#[test]
fn replaced_member_is_rebuilt_from_live_stripes_only_and_resumes() {
    let mut f = members(4, 48);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    // Half full: the rebuild should move about half of what a whole-device copy
    // would.
    let blocks = (e.status().usable_bytes / BS as u64) / 2;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, blocks, blocks, 5, |_| {});
    // Replacing a healthy member is refused.
    let err = call(
        &mut e,
        Request::ReplaceMember {
            index: 1,
            device: lamina_core::NewDevice(Arc::new(MemDevice::new("x", device_bytes(48)))),
            uuid: [1; 16],
        },
    )
    .result
    .unwrap_err();
    assert!(err.to_string().contains("fail it first"), "{err}");
    call(&mut e, Request::FailMember { index: 1 })
        .result
        .unwrap();
    run(&mut e, vol, &mut model, blocks, blocks / 2, 6, |_| {});
    // Too small a replacement is refused with the sizes.
    let err = call(
        &mut e,
        Request::ReplaceMember {
            index: 1,
            device: lamina_core::NewDevice(Arc::new(MemDevice::new("small", 1 << 20))),
            uuid: [2; 16],
        },
    )
    .result
    .unwrap_err();
    assert!(err.to_string().contains("too small"), "{err}");
    let new = replace(&mut e, 1, device_bytes(48));
    // Rebuild part of it, then "crash" (drop without shutdown) and reopen.
    let part = rebuild(&mut e, 1, Some(10));
    assert!(!part.finished);
    drop(e);
    f[1] = new;
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let st = e.shared().striped.clone().unwrap();
    eprintln!("{:?}", e.superblock().devices);
    assert_eq!(
        st.rebuild_cursor(1),
        Some(10),
        "resumes at the recorded stripe"
    );
    verify(&e, vol, &model);
    let rest = rebuild(&mut e, 1, None);
    assert!(rest.finished);
    assert_eq!(st.rebuild_cursor(1), None);
    assert_eq!(st.redundancy_left(), 1, "full redundancy again");
    let moved = part.bytes_written + rest.bytes_written;
    let whole = part.whole_device_bytes + rest.whole_device_bytes;
    eprintln!("rebuild moved {moved} bytes; a whole-device rebuild {whole}");
    assert!(
        moved < whole * 3 / 4,
        "only live stripes: {moved} of {whole}"
    );
    // The rebuilt member now carries its share: lose another one and read all.
    f[3].vanish();
    verify(&e, vol, &model);
    f[3].heal();
    // And after a restart the member is active.
    drop(e);
    let e = open_rw(&dyn_devs(&f), small_config());
    assert_eq!(e.status().members[1].state, "ok");
    f[0].vanish();
    verify(&e, vol, &model);
}

/// Members wear evenly: striped layouts by construction (every stripe writes each
/// member, parity rotates), JBOD by the allocator (the next segment comes from the
/// member with the least written per byte of capacity). The counts survive a
/// restart.
#[test]
fn members_wear_evenly_and_the_counts_persist() {
    for (layout, sizes) in [
        (Layout::Said5, vec![24u64, 24, 24, 24]),
        (Layout::Jbod, vec![16, 24, 40]),
    ] {
        let f: Vec<Arc<FaultDevice>> = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
                    format!("m{i}"),
                    device_bytes(s),
                ))))
            })
            .collect();
        let (mut e, vol, blocks) = seventy_percent_volume(&dyn_devs(&f), layout);
        let mut model = HashMap::new();
        run(&mut e, vol, &mut model, blocks, blocks * 6, 8, |_| {});
        let s = e.status();
        let written: Vec<u64> = s.members.iter().map(|m| m.bytes_written).collect();
        assert!(written.iter().all(|&w| w > 0), "{layout:?} {written:?}");
        eprintln!("{layout:?} spread {} {written:?}", s.wear_spread);
        assert!(
            s.wear_spread < 0.03,
            "{layout:?}: spread {} {written:?}",
            s.wear_spread
        );
        call(&mut e, Request::Checkpoint).result.unwrap();
        drop(e);
        let e = open_rw(&dyn_devs(&f), small_config());
        let again: Vec<u64> = e.status().members.iter().map(|m| m.bytes_written).collect();
        for (a, b) in written.iter().zip(&again) {
            assert!(
                *b >= *a,
                "{layout:?}: {again:?} after restart, {written:?} before"
            );
        }
    }
}

/// A member that fails reads in one spot: those blocks are served from parity,
/// then GC moves the segment elsewhere, after which no read touches the spot.
#[test]
fn read_errors_are_served_from_parity_and_moved_away() {
    use lamina_device::fault::FaultOp;
    let f = members(4, 24);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 1 << 20);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, 256, 256, 9, |_| {});
    for lba in 0..256u64 {
        model.entry(lba).or_insert(0);
    }
    // Every read of the chunk holding LBA 0 fails from now on.
    let st = e.shared().striped.clone().unwrap();
    let sh = st.shape();
    let seg_blocks = e.shared().geo.segment_blocks as u64;
    let v = e.shared().volume_by_id(vol).unwrap();
    let lamina_core::map::Entry::Device(pba) = lamina_core::map::decode(v.map.load(Lba(0))) else {
        panic!("lba 0 not on a device");
    };
    let (seg, b) = (pba.0 as u64 / seg_blocks, pba.0 as u64 % seg_blocks);
    let m = sh.member(seg, (b % sh.data as u64) as usize);
    f[m].fail(
        FaultOp::Read,
        sh.member_offset(seg, 0),
        sh.member_offset(seg + 1, 0),
        u64::MAX,
    );
    verify(&e, vol, &model);
    assert!(st.member_states()[m].read_errors > 0, "the fault was hit");
    assert!(!st.is_failed(m), "read errors do not fail a member");
    // Let the engine act: the damaged segments are collected.
    for _ in 0..20 {
        call(&mut e, Request::Flush).result.unwrap();
    }
    assert!(e.status().segments_repaired > 0);
    verify(&e, vol, &model);
    let moved = lamina_core::map::decode(v.map.load(Lba(0)));
    assert!(
        !matches!(moved, lamina_core::map::Entry::Device(p) if p.0 as u64 / seg_blocks == seg),
        "LBA 0 moved off the damaged stripe"
    );
    let after = st.member_states()[m].read_errors;
    verify(&e, vol, &model);
    assert_eq!(
        st.member_states()[m].read_errors,
        after,
        "no read touches the bad spot once its data moved"
    );
}

/// Where LBA `lba` of `vol` lives: (stripe, member, byte offset on the member, row).
fn locate_block(e: &lamina_core::Engine, vol: VolumeId, lba: u64) -> (u64, usize, u64, u64) {
    let st = e.shared().striped.clone().unwrap();
    let sh = st.shape();
    let seg_blocks = e.shared().geo.segment_blocks as u64;
    let v = e.shared().volume_by_id(vol).unwrap();
    let lamina_core::map::Entry::Device(pba) = lamina_core::map::decode(v.map.load(Lba(lba)))
    else {
        panic!("lba {lba} not on a device");
    };
    let (seg, b) = (pba.0 as u64 / seg_blocks, pba.0 as u64 % seg_blocks);
    let row = b / sh.data as u64;
    (
        seg,
        sh.member(seg, (b % sh.data as u64) as usize),
        sh.member_offset(seg, row),
        row,
    )
}

/// Scrub finds a corrupted data block (by its checksum) and a corrupted parity
/// block (by the parity check), repairs both, and a second scrub finds nothing.
#[test]
fn scrub_repairs_corrupt_data_and_parity() {
    for (layout, n) in [(Layout::Said5, 4), (Layout::Said6, 5)] {
        let f = members(n, 16);
        format_devices(&dyn_devs(&f), &layout_params(layout));
        let mut e = open_rw(&dyn_devs(&f), small_config());
        let vol = create_volume(&mut e, "v", 1 << 20);
        let mut model = HashMap::new();
        for lba in 0..200u64 {
            write_block(&mut e, vol, lba, 1, false).unwrap();
            model.insert(lba, 1);
        }
        call(&mut e, Request::Flush).result.unwrap();
        let clean = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
        assert_eq!(clean.stats.parity_mismatches, 0, "{layout:?} {clean:?}");
        assert_eq!(clean.stats.checksum_errors, 0);
        assert!(clean.blocks_checked >= 200);
        // Silent corruption: a data block of LBA 10, and the parity of LBA 100's row.
        let (_, m, off, _) = locate_block(&e, vol, 10);
        f[m].write_at(&[0x5a; BS], off).unwrap();
        let (seg, _, off, _) = locate_block(&e, vol, 100);
        let sh = e.shared().striped.as_ref().unwrap().shape();
        f[sh.member(seg, sh.data)]
            .write_at(&[0xa5; BS], off)
            .unwrap();
        let r = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
        assert_eq!(r.stats.checksum_errors, 1, "{layout:?} {r:?}");
        assert_eq!(r.stats.blocks_repaired, 1, "{layout:?} {r:?}");
        assert!(r.stats.parity_repaired >= 1, "{layout:?} {r:?}");
        assert_eq!(r.stats.unrecoverable, 0, "{layout:?} {r:?}");
        let again = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
        assert_eq!(again.stats.parity_mismatches, 0, "{layout:?} {again:?}");
        assert_eq!(again.stats.checksum_errors, 0, "{layout:?} {again:?}");
        verify(&e, vol, &model);
        // The repaired parity really protects: lose the member holding LBA 100.
        let (_, m, _, _) = locate_block(&e, vol, 100);
        f[m].vanish();
        verify(&e, vol, &model);
    }
}

/// JBOD allocation may take any of the first free segments (wear levelling):
/// recovery must still find every acknowledged write after a crash.
#[test]
fn jbod_wear_levelled_allocation_recovers_after_a_crash() {
    let f = vec![
        Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
            "a",
            device_bytes(48),
        )))),
        Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
            "b",
            device_bytes(48),
        )))),
    ];
    format_devices(&dyn_devs(&f), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 2 << 20);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, 512, 600, 21, |_| {});
    call(&mut e, Request::Checkpoint).result.unwrap();
    // After the checkpoint: writes land on segments picked out of order.
    run(&mut e, vol, &mut model, 512, 1500, 22, |_| {});
    let members: Vec<u64> = e.status().members.iter().map(|m| m.bytes_written).collect();
    assert!(
        members.iter().all(|&b| b > 0),
        "both members used: {members:?}"
    );
    drop(e); // no clean shutdown: a crash after the last acknowledged flush
    let e = open_rw(&dyn_devs(&f), small_config());
    verify(&e, vol, &model);
}

/// A member being rebuilt does not count as redundancy; a rebuild of a device the
/// slot no longer holds cannot record progress; a transient read error on SAID0 is
/// retried, not a panic.
#[test]
fn rebuilding_members_and_stale_rebuilds_are_handled() {
    let f = members(4, 16);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 1 << 20);
    let mut model = HashMap::new();
    run(&mut e, vol, &mut model, 200, 400, 23, |_| {});
    call(&mut e, Request::FailMember { index: 1 })
        .result
        .unwrap();
    let _new = replace(&mut e, 1, device_bytes(16));
    let st = e.shared().striped.clone().unwrap();
    assert_eq!(
        st.redundancy_left(),
        0,
        "a rebuilding member adds no redundancy yet"
    );
    let err = call(&mut e, Request::FailMember { index: 2 })
        .result
        .unwrap_err();
    assert!(err.to_string().contains("unrecoverable"), "{err}");
    let stale = st.slot_generation(1);
    call(&mut e, Request::FailMember { index: 1 })
        .result
        .unwrap();
    let _newer = replace(&mut e, 1, device_bytes(16));
    let err = call(
        &mut e,
        Request::RebuildProgress {
            index: 1,
            cursor: None,
            generation: stale,
        },
    )
    .result
    .unwrap_err();
    assert!(err.to_string().contains("stale"), "{err}");
    assert!(
        st.rebuild_cursor(1).is_some(),
        "the new device is still being rebuilt"
    );
    let r = rebuild(&mut e, 1, None);
    assert!(r.finished);
    verify(&e, vol, &model);
}

/// A damaged unit header hides the units after it from scrub: it says so.
#[test]
fn scrub_reports_a_damaged_unit_header() {
    let f = members(1, 16);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 1 << 20);
    for lba in 0..200u64 {
        write_block(&mut e, vol, lba, 1, false).unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    let clean = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
    assert_eq!(clean.damaged_headers, 0, "{clean:?}");
    // The first unit header of the (closed) segment holding LBA 0.
    let v = e.shared().volume_by_id(vol).unwrap();
    let lamina_core::map::Entry::Device(pba) = lamina_core::map::decode(v.map.load(Lba(0))) else {
        panic!("lba 0 not on a device");
    };
    let geo = e.shared().geo.clone();
    let seg = pba.0 / geo.segment_blocks;
    let (_, off) = geo.locate(lamina_core::SegmentId(seg), 0);
    f[0].write_at(&[0x77; BS], off).unwrap();
    let r = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
    assert_eq!(r.damaged_headers, 1, "{r:?}");
}

/// On SAID5 a damaged unit header is read correctly by leaving its member out, and
/// scrub rewrites it.
#[test]
fn scrub_repairs_a_damaged_unit_header_from_parity() {
    let f = members(4, 16);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    let vol = create_volume(&mut e, "v", 1 << 20);
    let mut model = HashMap::new();
    for lba in 0..250u64 {
        write_block(&mut e, vol, lba, 1, false).unwrap();
        model.insert(lba, 1);
    }
    call(&mut e, Request::Flush).result.unwrap();
    let (seg, _, _, _) = locate_block(&e, vol, 0);
    let sh = e.shared().striped.as_ref().unwrap().shape();
    // Block 0 of the stripe: the first unit's header, row 0, column 0.
    f[sh.member(seg, 0)]
        .write_at(&[0x66; BS], sh.member_offset(seg, 0))
        .unwrap();
    let r = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
    assert_eq!(r.headers_found_by_parity, 1, "{r:?}");
    assert_eq!(r.damaged_headers, 0, "{r:?}");
    assert!(r.stats.blocks_repaired >= 1, "{r:?}");
    let again = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
    assert_eq!(again.headers_found_by_parity, 0, "{again:?}");
    assert_eq!(again.stats.parity_mismatches, 0, "{again:?}");
    verify(&e, vol, &model);
}

/// A member that lies or decays, silently: bits flipped at rest, writes stored at
/// the wrong place, writes dropped while reporting success, sectors that fail to
/// read. On SAID5 and SAID6 every block still reads back right (rebuilt from the
/// rest of its row when its checksum fails on the bad member), GC goes on, and so
/// does a restart.
#[test]
fn silent_faults_on_one_member_are_served_from_parity() {
    use lamina_device::fault::FaultOp;
    let kinds = [
        "bit flips",
        "misdirected writes",
        "dropped writes",
        "latent sector errors",
    ];
    for (layout, n) in [(Layout::Said5, 4usize), (Layout::Said6, 5)] {
        for (ki, kind) in kinds.iter().enumerate() {
            let seed = ki as u64 * 7 + n as u64;
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let size = device_bytes(24);
            let media: Vec<Arc<MemDevice>> = (0..n)
                .map(|i| Arc::new(MemDevice::new(format!("m{i}"), size)))
                .collect();
            let f: Vec<Arc<FaultDevice>> = media
                .iter()
                .map(|m| Arc::new(FaultDevice::new(m.clone())))
                .collect();
            format_devices(&dyn_devs(&f), &layout_params(layout));
            let mut e = open_rw(&dyn_devs(&f), small_config());
            let blocks = (e.status().usable_bytes / BS as u64) * 7 / 10;
            let vol = create_volume(&mut e, "v", blocks * BS as u64);
            let mut model = HashMap::new();
            run(&mut e, vol, &mut model, blocks, blocks * 2, seed, |_| {});
            let bad = rng.gen_range(0..n);
            let data_start = 1 << 20;
            let what = format!("{layout:?} {kind} on member {bad}");
            match *kind {
                "bit flips" => {
                    for _ in 0..400 {
                        let off = rng.gen_range(data_start..size);
                        let mut b = [0u8; 1];
                        media[bad].read_at(&mut b, off).unwrap();
                        b[0] ^= 1 << rng.gen_range(0..8);
                        media[bad].write_at(&b, off).unwrap();
                    }
                }
                "misdirected writes" => {
                    f[bad].misdirect_writes(3 * 64 * BS as u64);
                    run(
                        &mut e,
                        vol,
                        &mut model,
                        blocks,
                        blocks / 2,
                        seed + 100,
                        |_| {},
                    );
                    f[bad].heal();
                }
                "dropped writes" => {
                    f[bad].drop_writes();
                    run(
                        &mut e,
                        vol,
                        &mut model,
                        blocks,
                        blocks / 2,
                        seed + 100,
                        |_| {},
                    );
                    f[bad].heal();
                }
                _ => {
                    for _ in 0..4 {
                        let off = rng.gen_range(data_start..size - (64 << 10)) & !4095;
                        f[bad].fail(FaultOp::Read, off, off + (64 << 10), u64::MAX);
                    }
                }
            }
            for (&lba, &gen) in &model {
                let v = e.shared().volume_by_id(vol).unwrap();
                let mut b = vec![0u8; BS];
                let r = e.shared().read(&v, lba * BS as u64, &mut b);
                assert!(
                    r.is_ok() && decode_pattern(lba, &b).ok() == Some(gen),
                    "{what}: lba {lba} ({:?})",
                    r.err()
                );
            }
            let st = e.shared().striped.clone().unwrap();
            let served = e
                .shared()
                .read_stats
                .rebuilt_from_parity
                .load(std::sync::atomic::Ordering::Relaxed)
                + st.rebuilt_blocks();
            assert!(served > 0, "{what}: some reads were served from parity");
            // The damage is counted against the member that has it, as zpool
            // status's READ and CKSUM columns do, and no other member is blamed.
            let ms = st.member_states();
            if *kind == "latent sector errors" {
                assert!(ms[bad].read_errors > 0, "{what}: {ms:?}");
            } else {
                assert!(ms[bad].checksum_errors > 0, "{what}: {ms:?}");
            }
            for (i, m) in ms.iter().enumerate().filter(|&(i, _)| i != bad) {
                assert_eq!(m.checksum_errors, 0, "{what}: member {i} blamed: {ms:?}");
            }
            // GC moves on over the damage, and a restart finds everything.
            run(&mut e, vol, &mut model, blocks, blocks, seed + 200, |_| {});
            verify(&e, vol, &model);
            drop(e);
            let e = open_rw(&dyn_devs(&f), small_config());
            verify(&e, vol, &model);
            assert_eq!(
                e.counters().corrupt_blocks,
                0,
                "{what}: nothing left damaged"
            );
        }
    }
}

/// A device whose writes land in two steps: the first block, a pause, then the
/// rest (what a reader beside a long write may see of a unit: its header before
/// its data).
struct SplitWrites(MemDevice);

impl BlockDevice for SplitWrites {
    fn size_bytes(&self) -> u64 {
        self.0.size_bytes()
    }
    fn describe(&self) -> String {
        self.0.describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), lamina_device::DeviceError> {
        self.0.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), lamina_device::DeviceError> {
        let first = buf.len().min(BS);
        self.0.write_at(&buf[..first], offset)?;
        if buf.len() > first {
            std::thread::sleep(std::time::Duration::from_micros(200));
            self.0.write_at(&buf[first..], offset + first as u64)?;
        }
        Ok(())
    }
    fn sync(&self) -> Result<(), lamina_device::DeviceError> {
        self.0.sync()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), lamina_device::DeviceError> {
        self.0.discard(offset, len)
    }
}

/// Scrub runs beside the engine (the admin socket starts it on a serving array):
/// units still being written, and segments emptied or reused while scrub reads
/// them, are not damage. Random overwrites keep GC reusing segments while scrubs
/// run back to back on another thread; none of them may report an error. (Scrub
/// that walked every unit header it found failed here on nearly every pass: a
/// unit's header lands before its data.)
#[test]
fn scrub_beside_writes_and_segment_reuse_reports_no_false_errors() {
    for (layout, n) in [(Layout::Jbod, 1), (Layout::Said5, 4)] {
        let f: Vec<Arc<SplitWrites>> = (0..n)
            .map(|i| {
                Arc::new(SplitWrites(MemDevice::new(
                    format!("m{i}"),
                    device_bytes(16),
                )))
            })
            .collect();
        let (mut e, vol, blocks) = seventy_percent_volume(&dyn_devs(&f), layout);
        let mut model = HashMap::new();
        let shared = e.shared().clone();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let scrubber = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let mut passes = 0u64;
                let mut changed = 0u64;
                let mut bad = Vec::new();
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    // The engine is driven by the test's thread: the closing
                    // checkpoint is not what this test is about.
                    let r =
                        lamina_core::scrub::scrub(&shared, &|_| Ok(()), &mut |_, _| {}).unwrap();
                    changed += r.changed_while_read;
                    if r.stats.checksum_errors + r.stats.unrecoverable + r.stats.parity_mismatches
                        > 0
                        || r.damaged_headers > 0
                    {
                        bad.push(r);
                    }
                    passes += 1;
                }
                (passes, bad, changed)
            })
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        overwrite(&mut e, vol, &mut model, blocks * 5, 61, |_| {
            rng.gen_range(0..blocks)
        });
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let (passes, bad, changed) = scrubber.join().unwrap();
        eprintln!("{layout:?}: {passes} scrubs, {changed} segments dropped as changed while read");
        assert!(e.counters().gc_blocks > 0, "{layout:?}: GC reused segments");
        assert!(passes >= 3, "{layout:?}: only {passes} scrub passes ran");
        assert!(
            bad.is_empty(),
            "{layout:?}: {} of {passes} scrubs reported damage: {:?}",
            bad.len(),
            bad.first()
        );
        verify(&e, vol, &model);
        let clean = lamina_core::scrub::scrub_inline(&mut e, &mut |_, _| {}).unwrap();
        assert!(clean.blocks_checked > 0);
        assert_eq!(clean.stats.checksum_errors, 0, "{layout:?} {clean:?}");
    }
}

/// A member whose superblock write fails (the engine writes superblocks itself,
/// not through the striped device's data path) is failed with the error counted
/// against it, as a failed data write would be: a failed member with no write
/// error is one failed by decision.
#[test]
fn a_failed_superblock_write_counts_against_its_member() {
    use lamina_device::fault::FaultOp;
    let f = members(4, 16);
    format_devices(&dyn_devs(&f), &layout_params(Layout::Said5));
    let mut e = open_rw(&dyn_devs(&f), small_config());
    create_volume(&mut e, "v", 2 << 20);
    // Only the superblocks' megabyte: data writes to the member still succeed.
    f[2].fail(FaultOp::Write, 0, 1 << 20, u64::MAX);
    assert!(call(&mut e, Request::Checkpoint).result.is_ok());
    let st = e.status();
    assert_eq!(st.members[2].state, "failed");
    assert_eq!(st.members[2].write_errors, 1);
    assert!(st
        .members
        .iter()
        .enumerate()
        .all(|(i, m)| i == 2 || m.write_errors == 0));
}

/// Segments opened after the durable checkpoint are discarded all but their first
/// unit header, and members need not agree on what a discarded range reads as:
/// here two members of three keep their old data and the third reads zeros. A
/// restart after many such discards must find every flushed write and blame no
/// member: a later header of a released segment, rebuilt from the old data on
/// the other members, is not damage (it used to count a checksum error against
/// the member that did discard).
#[test]
fn members_that_disagree_on_discarded_ranges_are_not_blamed() {
    // The fault-injecting wrapper does not pass discards on: what it holds stays.
    let keep: Vec<Arc<dyn BlockDevice>> = (0..2)
        .map(|i| {
            let mem = Arc::new(MemDevice::new(format!("k{i}"), device_bytes(200)));
            Arc::new(FaultDevice::new(mem)) as Arc<dyn BlockDevice>
        })
        .collect();
    keep[0].write_at(&[7u8; BS], 0).unwrap();
    keep[0].discard(0, BS as u64).unwrap();
    let mut b = vec![0u8; BS];
    keep[0].read_at(&mut b, 0).unwrap();
    assert_eq!(b, vec![7u8; BS], "the member kept its data");
    let zero: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("z", device_bytes(200)));
    let devs: Vec<Arc<dyn BlockDevice>> = keep.into_iter().chain([zero]).collect();
    format_devices(&devs, &layout_params(Layout::Said5));
    let cfg = || lamina_core::EngineConfig {
        checkpoint_interval_blocks: u64::MAX / 4,
        discard_delay_ms: 0,
        ..small_config()
    };
    let mut e = open_rw(&devs, cfg());
    let vol = create_volume(&mut e, "v", 4096 * BS as u64);
    let mut model = HashMap::new();
    overwrite(&mut e, vol, &mut model, 2048, 500, |i| i);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    overwrite(&mut e, vol, &mut model, 8000, 40, |_| rng.gen_range(0..256));
    let tails = e.segments_tail_discarded();
    assert!(
        tails > 50,
        "{tails} segments discarded all but their first header"
    );
    drop(e);
    let (e, report) = open(devs.clone(), cfg(), OpenMode::ReadWrite).expect("open");
    verify_model(&e, vol, &model);
    let st = e.shared().striped.clone().unwrap();
    let blamed: Vec<u64> = st
        .member_states()
        .iter()
        .map(|m| m.checksum_errors)
        .collect();
    assert_eq!(
        (report.headers_rebuilt, blamed),
        (0, vec![0, 0, 0]),
        "after {tails} partial discards"
    );
}
