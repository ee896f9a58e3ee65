//! Changing a JBOD array's members (issue 15): growing it by new devices (`lamina
//! array grow`) and moving a member to a new device (`lamina array replace`).
//! What the array held stays, the new segments are used, a crash afterwards loses
//! nothing acknowledged, and a change that stops anywhere leaves an array that
//! opens.

mod common;
use common::*;
use lamina_core::{evacuate, grow, replace, EngineError, GrowParams};
use lamina_device::fault::{FaultDevice, FaultOp};
use lamina_device::mem::MemDevice;
use lamina_format::superblock::{Layout, SUPERBLOCK_OFFSETS};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

fn mem(name: &str, segments: u64) -> Arc<FaultDevice> {
    Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
        name,
        device_bytes(segments),
    ))))
}

/// Random overwrites over `lbas` blocks, flushed every 50 and at the end.
fn churn(
    e: &mut lamina_core::Engine,
    vol: lamina_core::VolumeId,
    model: &mut HashMap<u64, u64>,
    lbas: u64,
    writes: u64,
    seed: u64,
) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    overwrite(e, vol, model, writes, 50, |_| rng.gen_range(0..lbas));
}

/// More overwrites on the open array `e` (see [`churn`]), then a crash (no clean
/// shutdown): `devs` opened again read back every block of the model.
#[allow(clippy::too_many_arguments)]
fn churn_and_crash(
    mut e: lamina_core::Engine,
    devs: &[Arc<dyn lamina_device::BlockDevice>],
    vol: lamina_core::VolumeId,
    model: &mut HashMap<u64, u64>,
    lbas: u64,
    writes: u64,
    seed: u64,
) {
    churn(&mut e, vol, model, lbas, writes, seed);
    drop(e);
    let e = open_rw(devs, small_config());
    verify_model(&e, vol, model);
}

fn one(d: &Arc<FaultDevice>) -> Vec<Arc<dyn lamina_device::BlockDevice>> {
    dyn_devs(std::slice::from_ref(d))
}

fn usable(e: &lamina_core::Engine) -> u64 {
    e.status().usable_bytes
}

#[test]
fn a_jbod_array_grows_and_keeps_what_it_held() {
    let a = mem("a", 24);
    format_devices(&one(&a), &layout_params(Layout::Jbod));
    let mut e = open_rw(&one(&a), small_config());
    // Larger than the one-device array can hold: thin.
    let vol = create_volume(&mut e, "v", 8 << 20);
    let before = usable(&e);
    let mut model = HashMap::new();
    churn(&mut e, vol, &mut model, 600, 1500, 1);
    // No clean shutdown: the grow starts from a crash.
    drop(e);

    let b = mem("b", 40);
    let mut committed = 0;
    let sb = grow(
        one(&a),
        &small_config(),
        &one(&b),
        &[[0x42; 16]],
        &GrowParams::default(),
        &mut || {
            committed += 1;
            Ok(())
        },
    )
    .expect("grow");
    assert_eq!(committed, 1);
    assert_eq!(sb.devices.len(), 2);
    assert_eq!(sb.devices[1].first_segment, sb.devices[0].segment_count);

    let all = dyn_devs(&[a.clone(), b.clone()]);
    let mut e = open_rw(&all, small_config());
    verify_model(&e, vol, &model);
    let after = usable(&e);
    assert!(after > 2 * before, "usable {before} -> {after}");
    // More distinct blocks than the one-device array could hold.
    let lbas = before / BS as u64 + 400;
    churn(&mut e, vol, &mut model, lbas, 3 * lbas, 2);
    let st = e.status();
    assert!(
        st.members.iter().all(|m| m.bytes_written > 0),
        "both members written: {:?}",
        st.members
            .iter()
            .map(|m| m.bytes_written)
            .collect::<Vec<_>>()
    );
    verify_model(&e, vol, &model);
    drop(e); // a crash after the grow
    let e = open_rw(&all, small_config());
    verify_model(&e, vol, &model);
    // Opened without the new member, the array says which one is missing.
    let err = lamina_core::open(one(&a), small_config(), lamina_core::OpenMode::ReadOnly)
        .err()
        .expect("refused without its new member");
    assert!(
        err.to_string().contains("members [1] were not given"),
        "{err}"
    );
}

/// The re-open that ends a grow fails to commit its checkpoint (here: the new
/// device refuses superblock writes once labelled, after the checkpoint's own
/// blocks went to the new segments): the array still opens grown afterwards,
/// from the checkpoint before, extended again the same way, its walk passing the
/// uncommitted checkpoint's units, with nothing lost.
#[test]
fn a_grow_whose_last_open_fails_opens_grown() {
    let a = mem("a", 20);
    format_devices(&one(&a), &layout_params(Layout::Jbod));
    let mut e = open_rw(&one(&a), small_config());
    let vol = create_volume(&mut e, "v", 8 << 20);
    let mut model = HashMap::new();
    // Fill the array nearly up, so that its free queue is short and the re-open's
    // checkpoint reaches the new segments.
    let lbas = usable(&e) / BS as u64 - 8;
    churn(&mut e, vol, &mut model, lbas, 2 * lbas, 10);
    drop(e);
    let b = mem("b", 24);
    let err = grow(
        one(&a),
        &small_config(),
        &one(&b),
        &[[0x42; 16]],
        &GrowParams::default(),
        &mut || {
            // The re-open's first superblock update (both copies) goes through;
            // the one that would commit its checkpoint does not.
            b.fail_after(FaultOp::Write, 0, 1 << 20, 2, u64::MAX);
            Ok(())
        },
    )
    .unwrap_err();
    assert!(!err.to_string().is_empty());
    b.heal();
    // The uncommitted checkpoint did reach the new device.
    let mut area = vec![0u8; (device_bytes(24) - (1 << 20)) as usize];
    lamina_device::BlockDevice::read_at(&*b, &mut area, 1 << 20).unwrap();
    assert!(
        area.iter().any(|&x| x != 0),
        "nothing written to the new segments"
    );
    let all = dyn_devs(&[a.clone(), b.clone()]);
    let e = open_rw(&all, small_config());
    assert_eq!(e.superblock().devices.len(), 2);
    verify_model(&e, vol, &model);
    churn_and_crash(e, &all, vol, &mut model, lbas + 300, 2 * lbas, 11);
}

/// A grow stopped before its commit (lamina.toml not updated) leaves the array
/// as it was, and the same device is taken again by the next grow; one stopped
/// between the old members' superblock writes opens with every member.
#[test]
fn a_grow_stopped_anywhere_leaves_an_array_that_opens() {
    let a = mem("a", 24);
    format_devices(&one(&a), &layout_params(Layout::Jbod));
    let mut e = open_rw(&one(&a), small_config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    let mut model = HashMap::new();
    churn(&mut e, vol, &mut model, 500, 800, 3);
    drop(e);
    let b = mem("b", 24);
    let err = grow(
        one(&a),
        &small_config(),
        &one(&b),
        &[[0x42; 16]],
        &GrowParams::default(),
        &mut || Err(EngineError::Io("lamina.toml: disk full".into())),
    )
    .unwrap_err();
    assert!(err.to_string().contains("disk full"), "{err}");
    let e = open_rw(&one(&a), small_config());
    assert_eq!(e.superblock().devices.len(), 1);
    verify_model(&e, vol, &model);
    drop(e);

    // Again with the same device; the old member's first superblock copy fails
    // to be written, as a crash between the members' writes would leave it.
    let sb_end = SUPERBLOCK_OFFSETS[0] + 4096;
    let err = grow(
        one(&a),
        &small_config(),
        &one(&b),
        &[[0x43; 16]],
        &GrowParams::default(),
        &mut || {
            a.fail(FaultOp::Write, SUPERBLOCK_OFFSETS[0], sb_end, 1);
            Ok(())
        },
    )
    .unwrap_err();
    assert!(!err.to_string().is_empty());
    a.heal();
    let all = dyn_devs(&[a.clone(), b.clone()]);
    let e = open_rw(&all, small_config());
    assert_eq!(e.superblock().devices.len(), 2);
    verify_model(&e, vol, &model);
    churn_and_crash(e, &all, vol, &mut model, 1000, 1500, 4);
}

#[test]
fn what_cannot_be_added_is_refused() {
    let a = mem("a", 24);
    format_devices(&one(&a), &layout_params(Layout::Jbod));
    let try_grow = |members: &[Arc<FaultDevice>], new: &[Arc<FaultDevice>], force: bool| {
        let uuids: Vec<[u8; 16]> = (0..new.len()).map(|i| [0x50 + i as u8; 16]).collect();
        grow(
            dyn_devs(members),
            &small_config(),
            &dyn_devs(new),
            &uuids,
            &GrowParams {
                force,
                ..Default::default()
            },
            &mut || Ok(()),
        )
        .map(|_| ())
        .unwrap_err()
        .to_string()
    };
    // A member of this array, a device of another one, one too small.
    assert!(
        try_grow(std::slice::from_ref(&a), std::slice::from_ref(&a), false)
            .contains("already a member")
    );
    let other = mem("other", 24);
    let mut p = layout_params(Layout::Jbod);
    p.name = "other".into();
    lamina_core::format(&one(&other), &p, [9; 16], &[[9; 16]], 0).unwrap();
    let e = try_grow(
        std::slice::from_ref(&a),
        std::slice::from_ref(&other),
        false,
    );
    assert!(e.contains("belongs to Lamina array \"other\""), "{e}");
    let tiny = Arc::new(FaultDevice::new(Arc::new(MemDevice::new("tiny", 1 << 20))));
    assert!(try_grow(std::slice::from_ref(&a), &[tiny], false).contains("too small"));
    // Striped layouts are not grown.
    let s: Vec<_> = (0..3).map(|i| mem(&format!("s{i}"), 16)).collect();
    format_devices(&dyn_devs(&s), &layout_params(Layout::Said5));
    let e = try_grow(&s, &[mem("n", 16)], false);
    assert!(e.contains("only JBOD arrays grow"), "{e}");
    // Nothing was changed by a refusal: the first array opens with one member.
    let e = open_rw(&one(&a), small_config());
    assert_eq!(e.superblock().devices.len(), 1);
}

fn replace_member(
    members: &[Arc<FaultDevice>],
    index: usize,
    new: &Arc<FaultDevice>,
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
) -> Result<lamina_core::ReplaceReport, EngineError> {
    replace_watched(members, index, new, &mut || {}, commit)
}

/// `copying` runs each time a piece has been copied.
fn replace_watched(
    members: &[Arc<FaultDevice>],
    index: usize,
    new: &Arc<FaultDevice>,
    copying: &mut dyn FnMut(),
    commit: &mut dyn FnMut() -> Result<(), EngineError>,
) -> Result<lamina_core::ReplaceReport, EngineError> {
    let mut progress = Vec::new();
    let r = replace(
        dyn_devs(members),
        &small_config(),
        index,
        new.clone(),
        [0x77; 16],
        &GrowParams::default(),
        &mut |d, t| {
            progress.push((d, t));
            copying();
        },
        commit,
    );
    if let Ok(r) = &r {
        assert_eq!(progress.last().map(|p| p.0), Some(r.bytes_copied));
        assert!(progress.iter().all(|p| p.1 == r.bytes_copied));
    }
    r
}

/// A JBOD array of two members with a volume overwritten `writes` times (seeded),
/// left as a crash would leave it.
fn two_members_written(
    writes: u64,
    seed: u64,
) -> (
    Arc<FaultDevice>,
    Arc<FaultDevice>,
    lamina_core::VolumeId,
    HashMap<u64, u64>,
) {
    let (a, b) = (mem("a", 24), mem("b", 24));
    let both = [a.clone(), b.clone()];
    format_devices(&dyn_devs(&both), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&both), small_config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    let mut model = HashMap::new();
    churn(&mut e, vol, &mut model, 700, writes, seed);
    drop(e);
    (a, b, vol, model)
}

/// A member moved to a new device: only its segments in use are copied, the old
/// device is not needed afterwards, and nothing acknowledged is lost across
/// crashes before and after.
#[test]
fn a_jbod_member_moves_to_a_new_device() {
    let (a, b, vol, mut model) = two_members_written(2000, 5);
    let both = [a.clone(), b.clone()];
    let mut e = open_rw(&dyn_devs(&both), small_config());
    churn(&mut e, vol, &mut model, 700, 1000, 4);
    call(&mut e, lamina_core::Request::Checkpoint)
        .result
        .unwrap();
    let old_written = e.status().members[0].bytes_written;
    assert!(old_written > 1 << 20, "{old_written}");
    drop(e);
    let n = mem("n", 24);
    let mut commits = 0;
    let r = replace_member(&both, 0, &n, &mut || {
        commits += 1;
        Ok(())
    })
    .expect("replace");
    assert_eq!(commits, 1);
    assert_eq!(r.segments, 24);
    assert!(
        r.segments_copied > 0 && r.segments_copied < r.segments,
        "{r:?}"
    );
    assert_eq!(r.superblock.devices[0].uuid, [0x77; 16]);
    // The old device, named again (a configuration restored, a disk renamed), is
    // never taken for the member: it holds the member as it was.
    let err = lamina_core::open(
        dyn_devs(&both),
        small_config(),
        lamina_core::OpenMode::ReadOnly,
    )
    .err()
    .expect("the old device refused");
    assert!(
        err.to_string().contains("has been replaced") && err.to_string().contains("[0]"),
        "{err}"
    );
    // Named beside the new one, it is passed over.
    let e = open_rw(
        &dyn_devs(&[a.clone(), n.clone(), b.clone()]),
        small_config(),
    );
    verify_model(&e, vol, &model);
    drop(e);
    // The old device is gone: the array opens without it.
    a.vanish();
    let now = [n.clone(), b.clone()];
    let e = open_rw(&dyn_devs(&now), small_config());
    verify_model(&e, vol, &model);
    // The new device's count of bytes written starts again.
    let new_written = e.status().members[0].bytes_written;
    assert!(
        new_written < old_written / 4,
        "{new_written} of {old_written}"
    );
    churn_and_crash(e, &dyn_devs(&now), vol, &mut model, 700, 2000, 6);
}

/// A replace that stops after its commit, between the other members' superblock
/// writes, leaves an array that opens with the new device.
#[test]
fn a_replace_stopped_after_its_commit_opens_with_the_new_device() {
    let (a, b, vol, mut model) = two_members_written(1500, 8);
    let both = [a.clone(), b.clone()];
    let n = mem("n", 24);
    let err = replace_member(&both, 0, &n, &mut || {
        b.fail(
            FaultOp::Write,
            SUPERBLOCK_OFFSETS[0],
            SUPERBLOCK_OFFSETS[0] + 4096,
            1,
        );
        Ok(())
    })
    .unwrap_err();
    assert!(!err.to_string().is_empty());
    b.heal();
    let now = [n.clone(), b.clone()];
    let e = open_rw(&dyn_devs(&now), small_config());
    assert_eq!(e.superblock().devices[0].uuid, [0x77; 16]);
    verify_model(&e, vol, &model);
    churn_and_crash(e, &dyn_devs(&now), vol, &mut model, 700, 800, 9);
}

/// A replace that stops before its commit, or on a segment the old device cannot
/// read, leaves the array as it was; refusals change nothing.
#[test]
fn a_replace_that_cannot_finish_changes_nothing() {
    let (a, b, vol, model) = two_members_written(1500, 7);
    let both = [a.clone(), b.clone()];
    let n = mem("n", 24);
    let err = replace_member(&both, 1, &n, &mut || {
        Err(EngineError::Io("lamina.toml: disk full".into()))
    })
    .unwrap_err();
    assert!(err.to_string().contains("disk full"), "{err}");
    // The old member turns unreadable once the copy has begun: no other copy,
    // so refused.
    let err = replace_watched(
        &both,
        1,
        &n,
        &mut || b.fail(FaultOp::Read, 1 << 20, device_bytes(24), u64::MAX),
        &mut || Ok(()),
    )
    .unwrap_err();
    assert!(err.to_string().contains("cannot be read"), "{err}");
    b.heal();
    let small = mem("small", 20);
    let err = replace_member(&both, 1, &small, &mut || Ok(())).unwrap_err();
    assert!(
        err.to_string().contains("is smaller than member 1"),
        "{err}"
    );
    let err = replace_member(&both, 2, &n, &mut || Ok(())).unwrap_err();
    assert!(err.to_string().contains("has no member 2"), "{err}");
    let err = replace_member(&both, 1, &a, &mut || Ok(())).unwrap_err();
    assert!(err.to_string().contains("already a member"), "{err}");
    let e = open_rw(&dyn_devs(&both), small_config());
    assert_eq!(
        e.superblock().devices[1].uuid,
        [2; 16],
        "member 1 unchanged"
    );
    verify_model(&e, vol, &model);
    drop(e);
    // The device of the replace that stopped is taken again.
    replace_member(&both, 1, &n, &mut || Ok(())).expect("replace");
    let e = open_rw(&dyn_devs(&[a.clone(), n.clone()]), small_config());
    verify_model(&e, vol, &model);
    // Striped members are rebuilt from parity instead.
    let s: Vec<_> = (0..3).map(|i| mem(&format!("s{i}"), 16)).collect();
    format_devices(&dyn_devs(&s), &layout_params(Layout::Said5));
    let err = replace_member(&s, 0, &mem("m", 16), &mut || Ok(())).unwrap_err();
    assert!(err.to_string().contains("rebuilding from parity"), "{err}");
}

// ---------------------------------------------------------------- evacuate

/// An evacuation is refused when the other members could hold the array's live
/// blocks but not the room its maps take in the checkpoints: a thin volume
/// written one block per map page, whose blocks alone fit easily.
#[test]
fn an_evacuation_counts_the_maps_room_in_the_checkpoints() {
    let m: Vec<_> = (0..3).map(|i| mem(&format!("p{i}"), 24)).collect();
    format_devices(&dyn_devs(&m), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&m), small_config());
    let vol = create_volume(&mut e, "v", 4 << 30);
    let mut written = 0;
    // One block per map page (1024 blocks) until the array is full.
    while write_block(&mut e, vol, written * 1024, 1, false).is_ok() {
        written += 1;
    }
    let st = e.status();
    // The blocks alone would fit on two members of three.
    assert!(written * (BS as u64) < usable(&e) / 2, "{written} blocks");
    assert!(st.maps_bytes > 0);
    call(&mut e, lamina_core::Request::Flush).result.unwrap();
    drop(e);
    let err = evacuate(
        dyn_devs(&m),
        &small_config(),
        0,
        &mut |_, _| {},
        &mut || Ok(()),
    )
    .expect_err("refused")
    .to_string();
    assert!(
        err.contains("cannot hold what the array stores") && err.contains("the maps' room"),
        "{err}"
    );
    // Nothing changed: every member is in service and every block is there.
    let e = open_rw(&dyn_devs(&m), small_config());
    assert!(e.status().members.iter().all(|m| m.state != "removed"));
    for k in 0..written {
        assert_eq!(
            decode_pattern(k * 1024, &read_block(&e, vol, k * 1024)),
            Ok(1)
        );
    }
}

/// A member evacuated: everything it held moves to the others, it is marked
/// removed, its device is not needed any more and never written again, the
/// array's capacity shrinks by it, and nothing acknowledged is lost across crashes
/// after; a second evacuation of the same member, of the last one, or of one
/// whose data the others cannot hold is refused.
#[test]
fn a_jbod_member_is_evacuated_and_removed() {
    // First an array nearly as full as the other members can hold, with garbage
    // everywhere: GC must collect on the others as it moves the member's data.
    let m: Vec<_> = (0..3).map(|i| mem(&format!("f{i}"), 24)).collect();
    format_devices(&dyn_devs(&m), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&m), small_config());
    let vol = create_volume(&mut e, "v", 8 << 20);
    let lbas = usable(&e) / BS as u64 * 61 / 100;
    let mut model = HashMap::new();
    churn(&mut e, vol, &mut model, lbas, 4 * lbas, 32);
    drop(e);
    let r = evacuate(
        dyn_devs(&m),
        &small_config(),
        0,
        &mut |_, _| {},
        &mut || Ok(()),
    )
    .expect("evacuate a nearly full array");
    assert!(r.blocks_moved > 0);
    m[0].vanish();
    let e = open_rw(&dyn_devs(&m[1..]), small_config());
    verify_model(&e, vol, &model);
    drop(e);

    let m: Vec<_> = (0..3).map(|i| mem(&format!("m{i}"), 24)).collect();
    format_devices(&dyn_devs(&m), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&m), small_config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    let before = usable(&e);
    let mut model = HashMap::new();
    churn(&mut e, vol, &mut model, 900, 2500, 30);
    let written: Vec<u64> = e.status().members.iter().map(|m| m.bytes_written).collect();
    assert!(written.iter().all(|&b| b > 0), "{written:?}");
    drop(e); // a crash
    let mut seen = Vec::new();
    let mut commits = 0;
    let r = evacuate(
        dyn_devs(&m),
        &small_config(),
        1,
        &mut |d, t| seen.push((d, t)),
        &mut || {
            commits += 1;
            Ok(())
        },
    )
    .expect("evacuate");
    assert_eq!(commits, 1);
    assert!(r.segments > 0 && r.blocks_moved > 0, "{r:?}");
    assert_eq!(seen.last(), Some(&(r.segments, r.segments)), "{seen:?}");
    assert_eq!(
        r.superblock.devices[1].state,
        lamina_core::recovery::MEMBER_REMOVED
    );
    m[1].vanish();
    let rest = dyn_devs(&[m[0].clone(), m[2].clone()]);
    let e = open_rw(&rest, small_config());
    verify_model(&e, vol, &model);
    let st = e.status();
    assert_eq!(st.members[1].state, "removed");
    assert!(
        usable(&e) < before * 3 / 4,
        "usable {before} -> {}",
        usable(&e)
    );
    churn_and_crash(e, &rest, vol, &mut model, 900, 2500, 31);
    // Its device still named but gone: the array opens all the same.
    let named = dyn_devs(&m);
    let e = open_rw(&named, small_config());
    verify_model(&e, vol, &model);
    drop(e);
    // Grow and replace go on around the removed member.
    let n = mem("n", 24);
    grow(
        rest.clone(),
        &small_config(),
        &one(&n),
        &[[0x61; 16]],
        &GrowParams::default(),
        &mut || Ok(()),
    )
    .expect("grow after an evacuation");
    let r2 = mem("r2", 24);
    let grown = dyn_devs(&[m[0].clone(), m[2].clone(), n.clone()]);
    replace(
        grown,
        &small_config(),
        2,
        r2.clone(),
        [0x62; 16],
        &GrowParams::default(),
        &mut |_, _| {},
        &mut || Ok(()),
    )
    .expect("replace after an evacuation");
    m[2].vanish();
    let rest = dyn_devs(&[m[0].clone(), r2.clone(), n.clone()]);
    let e = open_rw(&rest, small_config());
    assert_eq!(e.superblock().devices.len(), 4);
    verify_model(&e, vol, &model);
    churn_and_crash(e, &rest, vol, &mut model, 900, 1500, 33);
    // Refusals: the removed member again; the last member in use; more data than
    // the others hold.
    let again = evacuate(
        rest.clone(),
        &small_config(),
        1,
        &mut |_, _| {},
        &mut || Ok(()),
    );
    assert!(again.unwrap_err().to_string().contains("removed already"));
    let single = mem("single", 24);
    format_devices(&one(&single), &layout_params(Layout::Jbod));
    let err = evacuate(
        one(&single),
        &small_config(),
        0,
        &mut |_, _| {},
        &mut || Ok(()),
    );
    assert!(err.unwrap_err().to_string().contains("last one"));
    // A second member evacuated, with one removed before it.
    evacuate(rest, &small_config(), 0, &mut |_, _| {}, &mut || Ok(()))
        .expect("a second evacuation");
    m[0].vanish();
    let rest = dyn_devs(&[r2.clone(), n.clone()]);
    let e = open_rw(&rest, small_config());
    verify_model(&e, vol, &model);
    drop(e);
    let err = evacuate(rest, &small_config(), 2, &mut |_, _| {}, &mut || Ok(()))
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot hold"), "{err}");
}

// ---------------------------------------------------------------- power cuts

use lamina_device::crash::{CrashDevice, PowerCut};
use lamina_device::{BlockDevice, DeviceError};
use std::sync::atomic::{AtomicU64, Ordering};

/// A device of a machine that loses power after a number of writes and syncs,
/// counted over all its devices: from then on every operation fails (nothing more
/// reaches any disk), and the [`CrashDevice`]s below say what survived.
struct Dying {
    inner: Arc<CrashDevice>,
    left: Arc<AtomicU64>,
}

impl Dying {
    fn dead(&self, op: &'static str) -> DeviceError {
        DeviceError::Injected {
            device: self.inner.describe(),
            op,
            offset: 0,
        }
    }
    fn step(&self, op: &'static str) -> Result<(), DeviceError> {
        self.left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .map(|_| ())
            .map_err(|_| self.dead(op))
    }
}

impl BlockDevice for Dying {
    fn size_bytes(&self) -> u64 {
        self.inner.size_bytes()
    }
    fn describe(&self) -> String {
        self.inner.describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        if self.left.load(Ordering::SeqCst) == 0 {
            return Err(self.dead("read"));
        }
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.step("write")?;
        self.inner.write_at(buf, offset)
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.step("sync")?;
        self.inner.sync()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        self.step("discard")?;
        self.inner.discard(offset, len)
    }
}

type Devs = Vec<Arc<dyn BlockDevice>>;

/// An array's devices as a power cut leaves them, for a new run.
fn after_cut(devs: &[Arc<CrashDevice>], keep: f64, rng: &mut impl Rng) -> Devs {
    devs.iter()
        .map(|d| {
            let image = d.power_cut(
                rng,
                PowerCut {
                    keep_probability: keep,
                },
            );
            Arc::new(CrashDevice::from_image(d.describe(), image)) as Arc<dyn BlockDevice>
        })
        .collect()
}

/// A JBOD array of `members` crash devices with a volume written and flushed;
/// returns the members' durable images and the model. `full`: the share of the
/// array's usable space written (garbage everywhere), else a few hundred blocks
/// per member.
fn written_images(
    members: usize,
    seed: u64,
    full: Option<u64>,
) -> (Vec<Vec<u8>>, lamina_core::VolumeId, HashMap<u64, u64>) {
    let devs: Vec<Arc<CrashDevice>> = (0..members)
        .map(|i| Arc::new(CrashDevice::new(format!("m{i}"), device_bytes(24))))
        .collect();
    format_devices(&dyn_devs(&devs), &layout_params(Layout::Jbod));
    let mut e = open_rw(&dyn_devs(&devs), small_config());
    let vol = create_volume(&mut e, "v", 8 << 20);
    let mut model = HashMap::new();
    let lbas = match full {
        Some(percent) => usable(&e) / BS as u64 * percent / 100,
        None => 300 * members as u64,
    };
    churn(&mut e, vol, &mut model, lbas, 4 * lbas, seed);
    drop(e);
    // Everything written was flushed: the durable layers hold it.
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let images = devs
        .iter()
        .map(|d| {
            d.power_cut(
                &mut rng,
                PowerCut {
                    keep_probability: 0.0,
                },
            )
        })
        .collect();
    (images, vol, model)
}

/// A grow or a replace of the first member by the last device, with a commit.
type Change =
    dyn Fn(Devs, Arc<dyn BlockDevice>, &mut dyn FnMut() -> Result<(), EngineError>) -> bool;

/// Runs `change` on devices made from `images` (and a new empty one) until the
/// power goes after `steps` writes and syncs. Returns the crash devices (members
/// first, then the new one), whether the commit ran, and the steps left over.
fn cut_during(
    images: &[Vec<u8>],
    steps: u64,
    change: &Change,
) -> (Vec<Arc<CrashDevice>>, bool, u64) {
    let left = Arc::new(AtomicU64::new(steps));
    let crash: Vec<Arc<CrashDevice>> = images
        .iter()
        .enumerate()
        .map(|(i, img)| Arc::new(CrashDevice::from_image(format!("m{i}"), img.clone())))
        .chain(std::iter::once(Arc::new(CrashDevice::new(
            "new",
            device_bytes(24),
        ))))
        .collect();
    let dying: Devs = crash
        .iter()
        .map(|d| {
            Arc::new(Dying {
                inner: d.clone(),
                left: left.clone(),
            }) as Arc<dyn BlockDevice>
        })
        .collect();
    let mut committed = false;
    let n = dying.len();
    change(dying[..n - 1].to_vec(), dying[n - 1].clone(), &mut || {
        committed = true;
        Ok(())
    });
    (crash, committed, left.load(Ordering::SeqCst))
}

/// Power cuts at every step of a grow and of a replace, and at about 150 points of
/// an evacuation (two: a lightly used array, and one nearly as full as the other
/// members can hold, where GC collects on them as the data moves), each keeping
/// none, half or all of the unsynced sectors: the array opens from the devices
/// lamina.toml would name (the old ones before the commit, the new set after),
/// with every block that was flushed before.
#[test]
fn power_cuts_during_grow_and_replace_lose_nothing() {
    let grow_change: &Change = &|members, new, commit| {
        grow(
            members,
            &small_config(),
            &[new],
            &[[0x42; 16]],
            &GrowParams::default(),
            commit,
        )
        .is_ok()
    };
    let replace_change: &Change = &|members, new, commit| {
        replace(
            members,
            &small_config(),
            0,
            new,
            [0x77; 16],
            &GrowParams::default(),
            &mut |_, _| {},
            commit,
        )
        .is_ok()
    };
    let evacuate_change: &Change = &|members, _new, commit| {
        evacuate(members, &small_config(), 1, &mut |_, _| {}, commit).is_ok()
    };
    for (name, members, full, change) in [
        ("grow", 1, None, grow_change),
        ("replace", 2, None, replace_change),
        ("evacuate", 3, None, evacuate_change),
        // Nearly as full as the other two members hold: GC collects on them while
        // the member's data moves.
        ("evacuate", 3, Some(58), evacuate_change),
    ] {
        let (images, vol, model) = written_images(members, 20 + members as u64, full);
        // How many writes and syncs the whole change makes.
        const PLENTY: u64 = 1 << 40;
        let (_, committed, left) = cut_during(&images, PLENTY, change);
        assert!(committed, "{name} without a cut");
        let total = PLENTY - left;
        assert!(total > 10, "{name}: {total} steps");
        let mut rng = rand::rngs::StdRng::seed_from_u64(99);
        let mut outcomes = [0u32; 2];
        // Every step of a grow or replace; about a hundred and fifty of an
        // evacuation, whose GC makes hundreds or thousands. Each cut keeps none,
        // half or all of the unsynced sectors in turn.
        let stride = (total / 150).max(1) as usize;
        for (k, steps) in (0..=total).step_by(stride).enumerate() {
            let (crash, committed, _) = cut_during(&images, steps, change);
            outcomes[committed as usize] += 1;
            let keep = [0.0, 0.5, 1.0][k % 3];
            let devs = after_cut(&crash, keep, &mut rng);
            // What lamina.toml names: the old devices until the commit, then the
            // new set (a replace's old member 0 out, the new device in).
            let named: Devs = match (name, committed) {
                (_, false) => devs[..members].to_vec(),
                ("grow", true) => devs.clone(),
                ("replace", true) => devs[1..].to_vec(),
                _ => vec![devs[0].clone(), devs[2].clone()],
            };
            let e = lamina_core::open(named, small_config(), lamina_core::OpenMode::ReadWrite)
                .unwrap_or_else(|err| panic!("{name}, cut after {steps} of {total}: {err}"))
                .0;
            let want = members + (committed && name == "grow") as usize;
            assert_eq!(e.superblock().devices.len(), want, "{name} at {steps}");
            if name == "evacuate" && committed {
                assert_eq!(e.status().members[1].state, "removed");
            }
            verify_model(&e, vol, &model);
        }
        eprintln!("{name} {full:?}: {total} steps, outcomes {outcomes:?}");
        assert!(outcomes[0] > 0 && outcomes[1] > 0, "{name}: {outcomes:?}");
    }
}
