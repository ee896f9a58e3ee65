//! Lamina on emulated zoned devices end to end: a SAID5 array of four emulated
//! ZNS drives (zone capacity below zone size, 14 open zones at most) served over
//! NBD, fio writing 4 KiB blocks at random with crc32c verification while GC
//! runs, kill -9 in the middle of writing, and restarts that take the write
//! pointers from the devices' persisted zone state.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn fio(args: &[String]) -> serde_json::Value {
    let out = run("fio", &args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    serde_json::from_str(&out[out.find('{').expect("fio printed JSON")..]).expect("fio JSON")
}

fn job_args(uri: &str, vol: u64, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "--name=zoned",
        "--ioengine=nbd",
        "--bs=4k",
        "--iodepth=32",
        "--rw=randwrite",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--randseed=7",
        "--output-format=json",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.push(format!("--uri={uri}"));
    a.push(format!("--size={vol}"));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn ok(j: &serde_json::Value) -> (u64, u64) {
    let job = &j["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error: {job}");
    (
        job["write"]["io_bytes"].as_u64().unwrap(),
        job["read"]["io_bytes"].as_u64().unwrap(),
    )
}

/// Every member is OK, the engine holds no more zones than allowed, and the
/// devices' persisted zone state agrees: no zone is open beyond the limit.
fn zones_within_limits(dir: &Path, devs: &[PathBuf]) -> serde_json::Value {
    let st = status_json(dir);
    for m in st["array"]["members"].as_array().unwrap() {
        assert_eq!(m["state"], "ok", "member failed: {st}");
    }
    let open = st["array"]["zones_open"].as_u64().expect("zoned status");
    let limit = st["array"]["zone_open_limit"].as_u64().unwrap();
    assert_eq!(limit, 14);
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
    let (w, r) = ok(&fio(&job_args(&s.uri("v"), vol, &["--loops=3"])));
    assert!(w >= 3 * vol && r == w, "wrote {w}, verified {r}");
    let st = zones_within_limits(&dir, &devs);
    assert!(
        st["gc_bytes_relocated"].as_u64().unwrap() > 0,
        "GC relocated nothing: {st}"
    );

    // A last pass written and flushed, then kill -9: everything must come back.
    let (w, _) = ok(&fio(&job_args(
        &s.uri("v"),
        vol,
        &["--do_verify=0", "--end_fsync=1"],
    )));
    assert!(w >= vol);
    s.kill9();
    let s = Server::start(&dir);
    let (_, r) = ok(&fio(&job_args(&s.uri("v"), vol, &["--verify_only"])));
    assert!(r >= vol, "verified {r} of {vol} after kill -9");
    zones_within_limits(&dir, &devs);

    // kill -9 in the middle of random writes: zones are left open with partial
    // units; after the restart the array takes writes again and verifies.
    let mut bg = Command::new("fio")
        .args(job_args(&s.uri("v"), vol, &["--loops=5", "--do_verify=0"]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let before = status_json(&dir)["user_bytes_written"].as_u64().unwrap();
    let t0 = Instant::now();
    while status_json(&dir)["user_bytes_written"].as_u64().unwrap() < before + vol / 2 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    s.kill9();
    let _ = bg.wait();
    let s = Server::start(&dir);
    zones_within_limits(&dir, &devs);
    let (w, r) = ok(&fio(&job_args(&s.uri("v"), vol, &["--loops=2"])));
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
    let mut bg = Command::new("fio")
        .args(job_args(&s.uri("v"), vol, &["--loops=3", "--do_verify=0"]))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    lamina(&[
        "array",
        "replace",
        dir.to_str().unwrap(),
        "--old",
        "2",
        "--new",
        &format!("{}:128M", new.display()),
        "--quiet",
    ]);
    assert!(
        bg.wait().unwrap().success(),
        "fio wrote through the rebuild"
    );
    assert!(lamina_device::zoned::state_path(&new).exists());
    let mut devs = devs.clone();
    devs[2] = new;
    zones_within_limits(&dir, &devs);
    let (_, r) = ok(&fio(&job_args(&s.uri("v"), vol, &["--verify_only"])));
    assert!(r >= vol);
    lamina(&["array", "fail", dir.to_str().unwrap(), "--device", "0"]);
    let (_, r) = ok(&fio(&job_args(&s.uri("v"), vol, &["--verify_only"])));
    assert!(r >= vol, "verified through the rebuilt member");
    s.stop();
}
