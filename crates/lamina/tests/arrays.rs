//! Striped arrays end to end: fio (nbd engine, crc32c verify) while members fail,
//! are replaced and rebuilt; kill -9 during a rebuild; the exports stay
//! byte-identical through it all (nbdcopy).

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A striped array of `n` sparse files of `size` with 1 MiB chunks and a volume
/// `v` of 80% of the usable space; returns DIR and the volume size.
fn striped(t: &TempDir, layout: &str, n: usize, size: &str) -> (PathBuf, u64) {
    let dir = t.join("arr");
    let devs: Vec<String> = (0..n)
        .map(|i| format!("{}:{size}", t.join(&format!("d{i}.img")).display()))
        .collect();
    let mut args = vec!["array", "create", dir.to_str().unwrap(), "--layout", layout];
    for d in &devs {
        args.push("--device");
        args.push(d);
    }
    args.extend(["--segment-size", "1M", "--write-unit", "256K"]);
    lamina(&args);
    let usable = status_json(&dir)["usable_bytes"].as_u64().unwrap();
    let vol = usable * 8 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());
    (dir, vol)
}

/// fio random writes verified with crc32c, in the background; JSON to `out`.
fn fio_start(uri: &str, vol: u64, loops: u32, out: &Path) -> Child {
    Command::new("fio")
        .args([
            "--name=said",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--bs=4k",
            "--iodepth=16",
            "--rw=randwrite",
            &format!("--size={vol}"),
            &format!("--loops={loops}"),
            "--verify=crc32c",
            "--verify_fatal=1",
            "--output-format=json",
            &format!("--output={}", out.display()),
        ])
        .stdout(Stdio::null())
        .spawn()
        .expect("start fio")
}

/// Waits for fio and checks that it wrote and verified everything without error.
fn fio_finish(mut c: Child, out: &Path, vol: u64) {
    let st = c.wait().unwrap();
    let text = std::fs::read_to_string(out).unwrap_or_default();
    assert!(st.success(), "fio failed ({st}):\n{text}");
    let j: serde_json::Value = serde_json::from_str(&text[text.find('{').unwrap()..]).unwrap();
    let job = &j["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error: {job}");
    let written = job["write"]["io_bytes"].as_u64().unwrap();
    let verified = job["read"]["io_bytes"].as_u64().unwrap();
    assert!(written >= vol, "wrote {written}");
    assert_eq!(verified, written, "every written block verified");
}

fn wait_written(dir: &Path, bytes: u64) {
    let t0 = Instant::now();
    while status_json(dir)["user_bytes_written"].as_u64().unwrap() < bytes {
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn member_states(dir: &Path) -> Vec<String> {
    status_json(dir)["array"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["state"].as_str().unwrap().to_string())
        .collect()
}

/// SHA-256 of the whole export, copied out with nbdcopy.
fn export_digest(t: &TempDir, uri: &str, name: &str) -> String {
    let img = t.join(name);
    run("nbdcopy", &[uri, img.to_str().unwrap()]);
    let out = run("sha256sum", &[img.to_str().unwrap()]);
    std::fs::remove_file(&img).unwrap();
    out.split_whitespace().next().unwrap().to_string()
}

fn fail(dir: &Path, m: usize) {
    lamina(&[
        "array",
        "fail",
        dir.to_str().unwrap(),
        "--device",
        &m.to_string(),
    ]);
}

fn replace(t: &TempDir, dir: &Path, m: usize, size: &str, extra: &[&str]) {
    let new = format!("{}:{size}", t.join(&format!("new{m}.img")).display());
    let mut args = vec![
        "array",
        "replace",
        dir.to_str().unwrap(),
        "--old",
        &m.to_string(),
        "--new",
        &new,
        "--quiet",
    ]
    .into_iter()
    .map(String::from)
    .collect::<Vec<_>>();
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    lamina(&refs);
}

/// Members fail while fio writes and verifies; the array keeps serving. Then each is
/// replaced and rebuilt while fio runs again; finally another member may fail
/// without changing one byte of the export (the rebuilt members hold their share).
fn lose_replace_rebuild(layout: &str, n: usize, lose: &[usize]) {
    let name = format!("arrays::{layout}");
    if !need(&name, &["fio", "nbdcopy", "sha256sum"], false) {
        return;
    }
    let t = TempDir::new(&format!("arr-{layout}"));
    let (dir, vol) = striped(&t, layout, n, "48M");
    let s = Server::start(&dir);
    let uri = s.uri("v");
    let out = t.join("fio1.json");
    let fio = fio_start(&uri, vol, 2, &out);
    wait_written(&dir, vol / 2);
    for &m in lose {
        fail(&dir, m);
    }
    fio_finish(fio, &out, vol);
    let st = status_json(&dir);
    let parity = if layout == "said6" { 2 } else { 1 };
    assert_eq!(
        st["array"]["redundancy_left"].as_i64().unwrap(),
        parity - lose.len() as i64,
        "{st}"
    );
    for &m in lose {
        assert_eq!(member_states(&dir)[m], "failed");
    }
    assert!(st["blocks_rebuilt_from_parity"].as_u64().unwrap() > 0);
    let text = lamina(&["status", dir.to_str().unwrap()]);
    assert!(text.contains("FAILED"), "{text}");
    // Replace and rebuild while fio writes and verifies again.
    let out2 = t.join("fio2.json");
    let fio = fio_start(&uri, vol, 1, &out2);
    wait_written(&dir, st["user_bytes_written"].as_u64().unwrap() + vol / 4);
    for &m in lose {
        replace(&t, &dir, m, "48M", &["--rate", "64M"]);
    }
    fio_finish(fio, &out2, vol);
    assert!(
        member_states(&dir).iter().all(|s| s == "ok"),
        "{:?}",
        member_states(&dir)
    );
    assert_eq!(
        status_json(&dir)["array"]["redundancy_left"]
            .as_i64()
            .unwrap(),
        parity
    );
    let before = export_digest(&t, &uri, "before.img");
    // Lose members that were never replaced: the rebuilt ones must carry the data.
    let others: Vec<usize> = (0..n)
        .filter(|m| !lose.contains(m))
        .take(lose.len())
        .collect();
    for &m in &others {
        fail(&dir, m);
    }
    assert_eq!(export_digest(&t, &uri, "after.img"), before);
    s.stop();
    // The config now names the new devices; a restart serves the same bytes.
    let s = Server::start(&dir);
    assert_eq!(export_digest(&t, &s.uri("v"), "restart.img"), before);
    s.stop();
}

#[test]
fn said5_four_devices_lose_one_replace_rebuild_under_fio() {
    lose_replace_rebuild("said5", 4, &[1]);
}

#[test]
fn said6_six_devices_lose_two_replace_rebuild_under_fio() {
    lose_replace_rebuild("said6", 6, &[0, 4]);
}

/// Each way of driving the devices (io_uring with direct I/O, pread/pwrite
/// buffered, and the fallback when io_uring is unavailable) says so at start, opens
/// the members as asked (O_DIRECT seen in /proc/PID/fdinfo), passes fio verify on
/// SAID5, and what it wrote survives a restart and reads back with a member lost.
#[test]
fn every_io_engine_serves_a_said5_array() {
    if !need(
        "arrays::every_io_engine_serves_a_said5_array",
        &["fio", "nbdcopy", "sha256sum"],
        false,
    ) {
        return;
    }
    /// io_engine, direct_io, environment, what the log says, members opened O_DIRECT.
    type Case<'a> = (&'a str, &'a str, &'a [(&'a str, &'a str)], &'a str, bool);
    let cases: [Case; 3] = [
        ("uring", "on", &[], "devices driven by io_uring, direct I/O", true),
        (
            "sync",
            "off",
            &[],
            "devices driven by pread/pwrite ([engine] io_engine = \"sync\"), buffered I/O",
            false,
        ),
        (
            "auto",
            "on",
            &[("LAMINA_IO_URING", "off")],
            "devices driven by pread/pwrite (io_uring unavailable: turned off by LAMINA_IO_URING=off), direct I/O",
            true,
        ),
    ];
    for (engine, direct, env, said, o_direct) in cases {
        let t = TempDir::new(&format!("arr-io-{engine}-{direct}"));
        let (dir, vol) = striped(&t, "said5", 4, "32M");
        let cfg_path = dir.join("lamina.toml");
        let cfg = std::fs::read_to_string(&cfg_path).unwrap();
        assert!(cfg.contains("\n[engine]\n"));
        let cfg = cfg.replace(
            "\n[engine]\n",
            &format!("\n[engine]\nio_engine = \"{engine}\"\ndirect_io = \"{direct}\"\n"),
        );
        std::fs::write(&cfg_path, cfg).unwrap();
        let s = Server::start_env(&dir, env);
        let log = std::fs::read_to_string(dir.join("lamina.log")).unwrap();
        assert!(log.contains(said), "{engine}/{direct}: log says\n{log}");
        // The members' descriptors, as the kernel sees them.
        let mut direct_fds = 0;
        let mut member_fds = 0;
        for fd in std::fs::read_dir(format!("/proc/{}/fd", s.pid())).unwrap() {
            let fd = fd.unwrap();
            let target = std::fs::read_link(fd.path()).unwrap_or_default();
            let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !(name.starts_with('d') && name.ends_with(".img")) {
                continue;
            }
            member_fds += 1;
            let info = std::fs::read_to_string(format!(
                "/proc/{}/fdinfo/{}",
                s.pid(),
                fd.file_name().to_str().unwrap()
            ))
            .unwrap();
            let flags = info
                .lines()
                .find_map(|l| l.strip_prefix("flags:"))
                .map(|f| u32::from_str_radix(f.trim(), 8).unwrap())
                .unwrap();
            if flags & libc_o_direct() != 0 {
                direct_fds += 1;
            }
        }
        assert_eq!(member_fds, 4, "{engine}/{direct}");
        assert_eq!(
            direct_fds,
            if o_direct { 4 } else { 0 },
            "{engine}/{direct}"
        );
        let out = t.join("fio.json");
        fio_finish(fio_start(&s.uri("v"), vol, 1, &out), &out, vol);
        let before = export_digest(&t, &s.uri("v"), "before.img");
        s.stop();
        let s = Server::start_env(&dir, env);
        fail(&dir, 1);
        assert_eq!(
            export_digest(&t, &s.uri("v"), "after.img"),
            before,
            "{engine}/{direct}: the export after a restart and a lost member"
        );
        s.stop();
    }
}

/// O_DIRECT on x86-64 and aarch64 Linux (040000 and 0200000 octal).
fn libc_o_direct() -> u32 {
    if cfg!(target_arch = "aarch64") {
        0o200000
    } else {
        0o40000
    }
}

/// kill -9 during a rate-limited rebuild: the restarted server resumes it from the
/// progress recorded in the superblocks and completes it; no byte changes.
#[test]
fn rebuild_resumes_after_kill9() {
    if !need(
        "arrays::rebuild_resumes_after_kill9",
        &["fio", "nbdcopy", "sha256sum"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("arr-kill");
    let (dir, vol) = striped(&t, "said5", 4, "48M");
    let s = Server::start(&dir);
    let uri = s.uri("v");
    let out = t.join("fio.json");
    fio_finish(fio_start(&uri, vol, 1, &out), &out, vol);
    fail(&dir, 2);
    let before = export_digest(&t, &uri, "before.img");
    replace(&t, &dir, 2, "48M", &["--rate", "4M", "--no-wait"]);
    // Past the first recorded progress (every 2 s), then kill.
    let t0 = Instant::now();
    loop {
        let st = status_json(&dir);
        let p = st["array"]["members"][2]["rebuild_progress"].as_f64();
        if t0.elapsed() > Duration::from_millis(4500) && p.unwrap_or(0.0) > 0.2 {
            break;
        }
        assert!(p.is_some(), "rebuild finished too soon to interrupt: {st}");
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(100));
    }
    s.kill9();
    let s = Server::start(&dir);
    let st = status_json(&dir);
    let resumed = st["array"]["members"][2]["rebuild_progress"].as_f64();
    assert!(
        resumed.is_some_and(|p| p > 0.0),
        "restarted rebuild resumes from its record, not from 0: {st}"
    );
    let t0 = Instant::now();
    while member_states(&dir)[2] != "ok" {
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "rebuild did not finish"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    fail(&dir, 0);
    assert_eq!(export_digest(&t, &s.uri("v"), "after.img"), before);
    s.stop();
}

/// Silent corruption on a member (bytes changed behind the array's back) is found
/// by `lamina array scrub` and repaired; the export is unchanged; a second scrub is
/// clean, also online while the server runs.
#[test]
fn scrub_finds_and_repairs_silent_corruption() {
    if !need("arrays::scrub", &["nbdcopy", "sha256sum"], false) {
        return;
    }
    let t = TempDir::new("arr-scrub");
    let (dir, vol) = striped(&t, "said5", 4, "32M");
    let img = t.join("src.img");
    let data: Vec<u8> = (0..vol)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(&img, &data).unwrap();
    let want = run("sha256sum", &[img.to_str().unwrap()]);
    let want = want.split_whitespace().next().unwrap().to_string();
    let s = Server::start(&dir);
    run("nbdcopy", &[img.to_str().unwrap(), &s.uri("v")]);
    s.stop();
    // Corrupt one block in each 1 MiB chunk of member 1 (wherever data lives).
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(t.join("d1.img"))
        .unwrap();
    for chunk in 0..31u64 {
        f.write_all_at(&[0xee; 4096], (1 << 20) + (chunk << 20) + (300 << 10))
            .unwrap();
    }
    drop(f);
    let out = lamina_output(&["array", "scrub", dir.to_str().unwrap(), "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    let found = r["checksum_errors"].as_u64().unwrap() + r["parity_mismatches"].as_u64().unwrap();
    let fixed = r["blocks_repaired"].as_u64().unwrap() + r["parity_repaired"].as_u64().unwrap();
    assert!(found > 0, "{r}");
    assert_eq!(fixed, found, "every damaged block repaired: {r}");
    assert_eq!(r["unrecoverable"], 0, "{r}");
    let s = Server::start(&dir);
    let again = lamina(&["array", "scrub", dir.to_str().unwrap(), "--json"]);
    let a: serde_json::Value = serde_json::from_str(&again).unwrap();
    assert_eq!(a["checksum_errors"], 0, "{a}");
    assert_eq!(a["parity_mismatches"], 0, "{a}");
    assert!(a["blocks_checked"].as_u64().unwrap() >= vol / 4096, "{a}");
    assert_eq!(export_digest(&t, &s.uri("v"), "out.img"), want);
    s.stop();
    // The same blocks of two members damaged: one parity cannot mend both, the
    // scrub says so and exits 4 (as fsck does for damage left; 2 is bad usage).
    for m in ["d1.img", "d2.img"] {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(t.join(m))
            .unwrap();
        for chunk in 0..31u64 {
            f.write_all_at(&[0x5a; 4096], (1 << 20) + (chunk << 20) + (300 << 10))
                .unwrap();
        }
    }
    let out = lamina_output(&["array", "scrub", dir.to_str().unwrap(), "--json"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(4), "{text}");
    let r: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert!(r["unrecoverable"].as_u64().unwrap() > 0, "{r}");
}

/// The RAID-5 yardstick of bench/said5.sh serves correct data and counts 2 reads and
/// 2 writes per 4 KiB write.
#[test]
fn raid5_rmw_yardstick_is_correct_and_counts_its_io() {
    if !need("arrays::raid5_rmw", &["fio"], false) {
        return;
    }
    let t = TempDir::new("arr-rmw");
    let sock = t.join("r.sock");
    let mut args: Vec<String> = vec!["bench".into(), "raid5-rmw".into()];
    for i in 0..4 {
        args.push("--device".into());
        args.push(format!("{}:16M", t.join(&format!("r{i}.img")).display()));
    }
    args.extend(["--unix".into(), sock.to_str().unwrap().into()]);
    let child = Command::new(lamina_bin())
        .args(&args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !sock.exists() {
        assert!(t0.elapsed() < Duration::from_secs(20));
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = t.join("fio.json");
    let uri = format!("nbd+unix:///raid5?socket={}", sock.display());
    fio_finish(fio_start(&uri, 8 << 20, 1, &out), &out, 8 << 20);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let user = j["user_bytes_written"].as_u64().unwrap();
    assert!(user >= 8 << 20, "{j}");
    assert_eq!(j["device_bytes_written"].as_u64().unwrap(), 2 * user, "{j}");
}

/// A member that starts failing every I/O mid-run (nbdkit's error filter behind
/// nbdfuse): the array fails it by itself and fio, writing and verifying, sees no
/// error at all.
#[test]
fn said5_member_returning_eio_is_failed_automatically_under_fio() {
    if !need(
        "arrays::said5_member_returning_eio",
        &["fio", "nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    let t = TempDir::new("arr-eio");
    let mut guard = Guard::new();
    let trigger = t.join("fail-now");
    let error_file = format!("error-file={}", trigger.display());
    let (kit, fuse, flaky) = nbdkit_as_file(
        &t,
        &[
            "--filter=error",
            "memory",
            "48M",
            "error=EIO",
            "error-rate=100%",
            &error_file,
        ],
    );
    guard.children.push(kit);
    guard.children.push(fuse);
    guard.mounts.push(t.join("fuse"));
    let dir = t.join("arr");
    let files: Vec<String> = (0..3)
        .map(|i| format!("{}:48M", t.join(&format!("d{i}.img")).display()))
        .collect();
    lamina(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--layout",
        "said5",
        "--device",
        &files[0],
        "--device",
        &files[1],
        "--device",
        flaky.to_str().unwrap(),
        "--device",
        &files[2],
        "--segment-size",
        "1M",
        "--write-unit",
        "256K",
    ]);
    let usable = status_json(&dir)["usable_bytes"].as_u64().unwrap();
    let vol = usable * 8 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());
    let s = Server::start(&dir);
    let out = t.join("fio.json");
    let fio = fio_start(&s.uri("v"), vol, 2, &out);
    wait_written(&dir, vol / 2);
    std::fs::write(&trigger, b"").unwrap();
    fio_finish(fio, &out, vol);
    let st = status_json(&dir);
    let failed: Vec<&serde_json::Value> = st["array"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["state"] == "failed")
        .collect();
    assert_eq!(failed.len(), 1, "exactly the flaky member failed: {st}");
    assert!(failed[0]["name"].as_str().unwrap().contains("fuse"), "{st}");
    assert_eq!(st["array"]["redundancy_left"], 0, "{st}");
    assert!(
        st["failed"].is_null(),
        "the array itself still serves: {st}"
    );
    s.stop();
}

/// Without --write-unit, a segment smaller than four default units (512 KiB)
/// takes a quarter of it, where `array create --segment-size 1M` used to fail
/// ("need at least 4 units per segment"); a unit given is kept.
#[test]
fn small_segments_take_a_write_unit_that_fits() {
    let t = TempDir::new("small-seg");
    let (a, b) = (t.join("a"), t.join("b"));
    create_array(&a, "64M", &["--segment-size", "1M"]);
    assert_eq!(status_json(&a)["array"]["write_unit_bytes"], 256 << 10);
    create_array(&b, "64M", &["--segment-size", "1M", "--write-unit", "128K"]);
    assert_eq!(status_json(&b)["array"]["write_unit_bytes"], 128 << 10);
}
