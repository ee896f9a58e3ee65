//! Lamina on emulated zoned devices end to end: a SAID5 array of four emulated
//! ZNS drives (zone capacity below zone size, 14 open zones at most) served over
//! NBD, fio writing 4 KiB blocks at random with crc32c verification while GC
//! runs, kill -9 in the middle of writing, and restarts that take the write
//! pointers from the devices' persisted zone state.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Every member is OK, the engine holds no more zones than allowed, and the
/// devices' persisted zone state agrees: no zone is open beyond the limit.
fn zones_within_limits(dir: &Path, devs: &[PathBuf]) -> serde_json::Value {
    let st = status_json(dir);
    for m in st["array"]["members"].as_array().unwrap() {
        assert_eq!(m["state"], "ok", "member failed: {st}");
    }
    let open = st["array"]["zones_open"].as_u64().expect("zoned status");
    let limit = st["array"]["zone_open_limit"].as_u64().unwrap();
    assert_eq!(limit, 14, "the emulator's default");
    assert!(open <= limit, "{open} zones open, limit {limit}");
    for d in devs {
        // The state file: 64-byte header, 16-byte records (condition at byte 8;
        // 2, 3 and 4 are open or closed, that is active).
        let img = std::fs::read(lamina_device::zoned::state_path(d)).unwrap();
        let active = img[64..]
            .chunks(16)
            .filter(|r| (2..=4).contains(&r[8]))
            .count() as u64;
        assert!(active <= limit, "{}: {active} zones active", d.display());
    }
    st
}

/// Replaces failed member `old` of the array `s` serves by `new` (PATH:SIZE), its
/// rebuild running online while fio writes `loops` passes of the volume (job
/// `name`) in the background; fio must write through it.
fn replace_while_writing(s: &Server, name: &str, vol: u64, loops: u32, old: &str, new: &str) {
    let loops = format!("--loops={loops}");
    let mut bg = Command::new("fio")
        .args(fio_job(name, &s.uri("v"), vol, &[&loops, "--do_verify=0"]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let dir = s.dir.to_str().unwrap();
    lamina(&[
        "array", "replace", dir, "--old", old, "--new", new, "--quiet",
    ]);
    assert!(
        bg.wait().unwrap().success(),
        "fio wrote through the rebuild"
    );
}

#[test]
fn said5_on_emulated_zns_fio_verify_gc_kill9() {
    if !need(
        "zoned::said5_on_emulated_zns_fio_verify_gc_kill9",
        &["fio"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("zoned-said5");
    let dir = t.join("arr");
    let devs: Vec<PathBuf> = (0..4).map(|i| t.join(&format!("z{i}.img"))).collect();
    let mut args: Vec<String> = ["array", "create", dir.to_str().unwrap()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.extend(["--layout", "said5", "--write-unit", "256K"].map(String::from));
    args.extend(["--zoned", "zns,zone=4M,cap=3M"].map(String::from));
    for d in &devs {
        args.push("--device".into());
        args.push(format!("{}:128M", d.display()));
    }
    let out = lamina(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(
        out.contains("segments of 9.0 MiB"),
        "a segment is a zone on each of 3 data members: {out}"
    );
    let usable = status_json(&dir)["usable_bytes"].as_u64().unwrap();
    let vol = usable * 8 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());

    // Three passes of random writes, verified: GC has to run.
    let s = Server::start(&dir);
    let (w, r) = fio_ok(&fio(&fio_job("zoned", &s.uri("v"), vol, &["--loops=3"])));
    assert!(w >= 3 * vol && r == w, "wrote {w}, verified {r}");
    let st = zones_within_limits(&dir, &devs);
    assert!(
        st["gc_bytes_relocated"].as_u64().unwrap() > 0,
        "GC relocated nothing: {st}"
    );

    // A last pass written and flushed, then kill -9: everything must come back.
    let s = kill9_after_flush(s, "zoned", vol);
    zones_within_limits(&dir, &devs);

    // kill -9 in the middle of random writes: zones are left open with partial
    // units; after the restart the array takes writes again and verifies.
    let s = kill9_while_writing(s, "zoned", vol);
    zones_within_limits(&dir, &devs);
    let (w, r) = fio_ok(&fio(&fio_job("zoned", &s.uri("v"), vol, &["--loops=2"])));
    assert!(
        w >= 2 * vol && r == w,
        "wrote {w}, verified {r} after the crash"
    );
    zones_within_limits(&dir, &devs);

    // A member fails and is replaced by a new emulated ZNS file (zoned like the
    // others), rebuilt online while fio writes; then another member fails and
    // everything still verifies: the new member carries its share.
    lamina(&["array", "fail", dir.to_str().unwrap(), "--device", "2"]);
    let new = t.join("z4.img");
    replace_while_writing(&s, "zoned", vol, 3, "2", &format!("{}:128M", new.display()));
    assert!(lamina_device::zoned::state_path(&new).exists());
    let mut devs = devs.clone();
    devs[2] = new;
    zones_within_limits(&dir, &devs);
    let (_, r) = fio_ok(&fio(&fio_job(
        "zoned",
        &s.uri("v"),
        vol,
        &["--verify_only"],
    )));
    assert!(r >= vol);
    lamina(&["array", "fail", dir.to_str().unwrap(), "--device", "0"]);
    let (_, r) = fio_ok(&fio(&fio_job(
        "zoned",
        &s.uri("v"),
        vol,
        &["--verify_only"],
    )));
    assert!(r >= vol, "verified through the rebuilt member");
    s.stop();
}

/// CSAL on ZNS (issue 14), end to end: an emulated ZNS drive behind a mirrored
/// conventional cache. fio's random 4 KiB writes land in the cache; compaction
/// fills the zones; kill -9 after a flush and while writing loses nothing; a
/// cache copy fails and a new plain file (not zoned) takes its place online.
#[test]
fn a_mirrored_cache_in_front_of_emulated_zns_fio_verify_kill9() {
    if !need(
        "zoned::a_mirrored_cache_in_front_of_emulated_zns_fio_verify_kill9",
        &["fio"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("zoned-cache");
    let dir = t.join("arr");
    let d = dir.to_str().unwrap();
    let zns = t.join("zns.img");
    let mut args: Vec<String> = ["array", "create", d].map(String::from).to_vec();
    args.extend(["--zoned", "zns,zone=4M,cap=3M", "--write-unit", "256K"].map(String::from));
    args.push("--device".into());
    args.push(format!("{}:192M", zns.display()));
    for c in ["cache0.img", "cache1.img"] {
        args.push("--cache-device".into());
        args.push(format!("{}:80M", t.join(c).display()));
    }
    let out = lamina(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(
        out.contains("segments of 3.0 MiB"),
        "a segment is a zone: {out}"
    );
    // Only the capacity drive is zoned.
    assert!(lamina_device::zoned::state_path(&zns).exists());
    assert!(!lamina_device::zoned::state_path(&t.join("cache0.img")).exists());
    let st = zones_within_limits(&dir, std::slice::from_ref(&zns));
    assert_eq!(st["cache"]["copies"], 2, "{st}");
    let usable = st["usable_bytes"].as_u64().unwrap();
    let vol = usable * 7 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());

    let s = Server::start(&dir);
    let (w, r) = fio_ok(&fio(&fio_job("zcache", &s.uri("v"), vol, &["--loops=3"])));
    assert!(w >= 3 * vol && r == w, "wrote {w}, verified {r}");
    let st = zones_within_limits(&dir, std::slice::from_ref(&zns));
    let c = &st["cache"];
    assert!(
        c["compactions"].as_u64().unwrap() > 0 && c["compacted_bytes"].as_u64().unwrap() > 0,
        "compaction ran: {st}"
    );
    let s = kill9_after_flush(s, "zcache", vol);
    zones_within_limits(&dir, std::slice::from_ref(&zns));
    let s = kill9_while_writing(s, "zcache", vol);
    zones_within_limits(&dir, std::slice::from_ref(&zns));

    // A cache copy fails; a plain file replaces it and is rebuilt from the other
    // while fio writes (a zoned file would be refused: the cache takes writes
    // anywhere).
    lamina(&["array", "fail", d, "--device", "1"]);
    let new = t.join("cache2.img");
    replace_while_writing(&s, "zcache", vol, 2, "1", &format!("{}:80M", new.display()));
    assert!(!lamina_device::zoned::state_path(&new).exists());
    let st = zones_within_limits(&dir, std::slice::from_ref(&zns));
    assert_eq!(st["cache"]["copies_ok"], 2, "{st}");
    // The other copy fails: the rebuilt one carries the cache alone.
    lamina(&["array", "fail", d, "--device", "2"]);
    let (_, r) = fio_ok(&fio(&fio_job(
        "zcache",
        &s.uri("v"),
        vol,
        &["--verify_only"],
    )));
    assert!(r >= vol, "verified from the rebuilt copy");
    s.stop();
    // fsck checks every summary and names what is missing: one copy.
    let out = lamina_output(&["fsck", d]);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && text.contains("the cache mirror runs degraded"),
        "fsck: {text}"
    );
    assert_eq!(text.matches("damage:").count(), 1, "fsck: {text}");
}

/// A file once used as an emulated zoned device keeps its zone state beside it;
/// made a conventional device (here a cache), it would be opened as zoned again
/// later. `array create` says so instead, and leaves nothing behind.
#[test]
fn a_stale_zone_state_file_is_named_at_create() {
    let t = TempDir::new("zoned-stale");
    let dir = t.join("arr");
    let cap = t.join("cap.img");
    let cache = t.join("cache.img");
    std::fs::File::create(&cache)
        .unwrap()
        .set_len(80 << 20)
        .unwrap();
    let state = lamina_device::zoned::state_path(&cache);
    std::fs::write(&state, b"stale").unwrap();
    let out = lamina_output(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--zoned",
        "zns,zone=4M,cap=3M",
        "--device",
        &format!("{}:128M", cap.display()),
        "--cache-device",
        cache.to_str().unwrap(),
        "--force",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("holds the zone state of an emulated zoned device"),
        "{err}"
    );
    assert!(
        !dir.exists() && !cap.exists(),
        "a failed create leaves nothing"
    );
    assert!(state.exists(), "the user's file is not removed");
}
