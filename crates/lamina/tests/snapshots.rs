//! `lamina volume snapshot` and `volume clone` (issue 15) on a running server: a
//! snapshot taken while a client writes is one point in time, it is served
//! read-only (EPERM for writes), a clone of it is writable and leaves it alone,
//! `volume list` tells snapshots, clones and their space apart, the origin cannot
//! be deleted under them, and all of it holds after kill -9 and GC.

mod common;
use common::*;
use lamina_nbd::client::{Client, ClientError};
use lamina_nbd::proto::EPERM;
use lamina_testkit::{decode_pattern, pattern, BS};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

const BLOCKS: u64 = 1024;

fn gens(sock: &Path, export: &str) -> Vec<u64> {
    let mut c = Client::connect_unix(sock, export).unwrap();
    (0..BLOCKS)
        .map(|lba| {
            let b = c.read(lba * BS as u64, BS as u32).unwrap();
            decode_pattern(lba, &b).unwrap_or_else(|e| panic!("{export} block {lba}: {e:?}"))
        })
        .collect()
}

/// A single writer wrote blocks in order, round after round, each acknowledged
/// before the next: a point in time is a prefix of round r+1 over round r.
fn assert_point_in_time(g: &[u64]) {
    let first = g[0];
    let k = g.iter().position(|&x| x != first).unwrap_or(g.len());
    assert!(
        g[k..].iter().all(|&x| x + 1 == first),
        "not one point in time: round {first} up to block {k}, then {:?}",
        &g[k..(k + 8).min(g.len())]
    );
}

fn list(dir: &Path) -> serde_json::Value {
    let out = lamina(&["volume", "list", dir.to_str().unwrap(), "--json"]);
    serde_json::from_str(&out).unwrap()
}

fn entry<'a>(l: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    l.as_array()
        .unwrap()
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("{name} not listed: {l}"))
}

#[test]
fn snapshots_and_clones_online() {
    let t = TempDir::new("snapshots");
    let dir = small_array(&t, "4M");
    let d = dir.to_str().unwrap();
    let s = Server::start(&dir);
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    for lba in 0..BLOCKS {
        c.write(lba * BS as u64, &pattern(lba, 1), false).unwrap();
    }
    // A writer goes on, round after round, while the snapshot is taken.
    let stop = Arc::new(AtomicBool::new(false));
    let writer = {
        let (sock, stop) = (s.sock.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = Client::connect_unix(&sock, "v").unwrap();
            let mut round = 2;
            while !stop.load(Ordering::Relaxed) || round < 4 {
                for lba in 0..BLOCKS {
                    c.write(lba * BS as u64, &pattern(lba, round), false)
                        .unwrap();
                }
                round += 1;
            }
            c.flush().unwrap();
            round - 1
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(50));
    let t0 = Instant::now();
    let out = lamina_output(&["volume", "snapshot", d, "v", "s"]);
    eprintln!("snapshot under load took {:?}", t0.elapsed());
    assert!(out.status.success(), "{out:?}");
    stop.store(true, Ordering::Relaxed);
    let last = writer.join().unwrap();
    let snap = gens(&s.sock, "s");
    assert_point_in_time(&snap);
    assert!(
        snap[0] >= 2,
        "the snapshot holds writes acknowledged before it"
    );
    assert!(gens(&s.sock, "v").iter().all(|&g| g == last));

    // Read-only: advertised so, and a write that comes anyway gets EPERM.
    let mut ro = Client::connect_unix(&s.sock, "s").unwrap();
    assert_ne!(ro.flags & lamina_nbd::proto::TF_READ_ONLY, 0);
    match ro.write(0, &pattern(0, 99), false) {
        Err(ClientError::Nbd(e)) => assert_eq!(e, EPERM),
        other => panic!("a write to a snapshot: {other:?}"),
    }

    // A clone: writable, sharing what it does not overwrite.
    lamina(&["volume", "clone", d, "s", "c"]);
    let mut cl = Client::connect_unix(&s.sock, "c").unwrap();
    for lba in 0..16 {
        cl.write(lba * BS as u64, &pattern(lba, 77), false).unwrap();
    }
    cl.flush().unwrap();
    let cg = gens(&s.sock, "c");
    assert!(cg[..16].iter().all(|&g| g == 77));
    assert_eq!(&cg[16..], &snap[16..]);
    assert_eq!(
        gens(&s.sock, "s"),
        snap,
        "a clone's writes leave its snapshot alone"
    );

    let l = list(&dir);
    assert_eq!(entry(&l, "s")["snapshot"], true);
    assert_eq!(entry(&l, "s")["origin"], "v");
    assert_eq!(entry(&l, "c")["origin"], "s");
    assert_eq!(entry(&l, "c")["snapshot"], false);
    assert_eq!(entry(&l, "c")["exclusive_bytes"], 16 * BS as u64);
    let text = lamina(&["volume", "list", d]);
    assert!(
        text.contains("snapshot") && text.contains("clone"),
        "{text}"
    );
    let only = lamina(&["volume", "list", d, "--snapshots", "--json"]);
    let only: serde_json::Value = serde_json::from_str(&only).unwrap();
    assert_eq!(only.as_array().unwrap().len(), 1, "{only}");
    assert_eq!(only[0]["name"], "s");

    // The origin and the snapshot cannot go while volumes made from them exist.
    let out = lamina_output(&["volume", "delete", d, "v", "--force"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("\"s\""),
        "{out:?}"
    );
    let out = lamina_output(&["volume", "snapshot", d, "v", "bad name"]);
    assert!(!out.status.success());

    // Refused before the clients were cut off.
    c.write(0, &pattern(0, last), false).unwrap();
    // kill -9, then GC churning the origin: the snapshot and the clone stay.
    drop((c, ro, cl));
    s.kill9();
    let s = Server::start(&dir);
    assert_eq!(gens(&s.sock, "s"), snap);
    assert_eq!(gens(&s.sock, "c"), cg);
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    let gc0 = status_json(&dir)["gc_bytes_relocated"].as_u64().unwrap();
    // The 128M array holds v, s and c a few times over: 40 rounds of v makes GC run.
    for round in 100..140 {
        for lba in 0..BLOCKS {
            c.write(lba * BS as u64, &pattern(lba, round), false)
                .unwrap();
        }
    }
    c.flush().unwrap();
    assert!(
        status_json(&dir)["gc_bytes_relocated"].as_u64().unwrap() > gc0,
        "GC ran"
    );
    drop(c);
    s.kill9();
    let s = Server::start(&dir);
    assert_eq!(gens(&s.sock, "s"), snap);
    assert_eq!(gens(&s.sock, "c"), cg);
    assert!(gens(&s.sock, "v").iter().all(|&g| g == 139));

    // Rollback: refused while the volume has a client, then the volume is its
    // snapshot again, for good.
    let busy = Client::connect_unix(&s.sock, "v").unwrap();
    let out = lamina_output(&["volume", "rollback", d, "v", "s"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    drop(busy);
    let out = lamina_output(&["volume", "rollback", d, "v", "c"]);
    assert!(
        !out.status.success(),
        "a clone is no snapshot of v: {out:?}"
    );
    lamina(&["volume", "rollback", d, "v", "s"]);
    assert_eq!(gens(&s.sock, "v"), snap);
    s.kill9();
    let s = Server::start(&dir);
    assert_eq!(gens(&s.sock, "v"), snap);
    assert_eq!(gens(&s.sock, "s"), snap);

    // Deleting the clone and the snapshot frees what only they held; then the
    // origin can go.
    let live = |dir: &Path| status_json(dir)["live_bytes"].as_u64().unwrap();
    let before = live(&dir);
    lamina(&["volume", "delete", d, "c"]);
    assert_eq!(live(&dir), before - 16 * BS as u64);
    lamina(&["volume", "delete", d, "s"]);
    assert_eq!(live(&dir), BLOCKS * BS as u64);
    lamina(&["volume", "delete", d, "v"]);
    s.stop();
    let out = lamina(&["fsck", d]);
    assert!(out.contains("clean"), "{out}");
}

/// ext4 on a clone while its origin is written: a snapshot of a mounted file
/// system under writes is crash-consistent, so its clone's journal replays and
/// e2fsck finds it clean; the files synced before the snapshot are there with
/// their contents; the clone takes writes of its own while the origin goes on;
/// neither sees the other's, and both file systems check clean at the end.
#[test]
fn ext4_on_a_clone_while_its_origin_is_written() {
    if !need(
        "snapshots::ext4_on_a_clone_while_its_origin_is_written",
        EXT4_TOOLS,
        true,
    ) {
        return;
    }
    let t = TempDir::new("snapshots-ext4");
    let dir = t.join("arr");
    create_array(
        &dir,
        "1G",
        &["--segment-size", "2M", "--write-unit", "256K"],
    );
    create_volume(&dir, "v", "256M");
    let d = dir.to_str().unwrap();
    let s = Server::start(&dir);
    let mut origin = Stack::attach(&s.uri("v"), &t.join("fuse-v"));
    run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", origin.dev()]);
    let mv = t.join("mnt-v");
    origin.mount(&mv);
    run(
        "cp",
        &["-a", "/usr/share/doc", mv.join("doc").to_str().unwrap()],
    );
    run("sync", &[]);
    let sums = |at: &Path| {
        run(
            "sh",
            &[
                "-c",
                &format!(
                    "cd {} && find doc -type f -print0 | sort -z | xargs -0 sha256sum",
                    at.display()
                ),
            ],
        )
    };
    let doc = sums(&mv);
    assert!(doc.lines().count() > 100, "copied too few files");
    // The origin keeps writing while the snapshot is taken and the clone used.
    let writer = {
        let mv = mv.clone();
        std::thread::spawn(move || {
            for i in 0..6 {
                run(
                    "dd",
                    &[
                        "if=/dev/urandom",
                        &format!("of={}", mv.join(format!("busy{i}")).display()),
                        "bs=1M",
                        "count=8",
                        "conv=fsync",
                        "status=none",
                    ],
                );
            }
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    lamina(&["volume", "snapshot", d, "v", "s"]);
    lamina(&["volume", "clone", d, "s", "c"]);
    let mut clone = Stack::attach(&s.uri("c"), &t.join("fuse-c"));
    // Crash-consistent: the journal replays (exit 0 or 1: fixed), then clean.
    let fix = std::process::Command::new("e2fsck")
        .args(["-fy", clone.dev()])
        .output()
        .unwrap();
    assert!(matches!(fix.status.code(), Some(0 | 1)), "{fix:?}");
    run("e2fsck", &["-fn", clone.dev()]);
    let mc = t.join("mnt-c");
    clone.mount(&mc);
    assert_eq!(sums(&mc), doc, "files synced before the snapshot");
    run(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", mc.join("clone-only").display()),
            "bs=1M",
            "count=16",
            "conv=fsync",
            "status=none",
        ],
    );
    std::fs::remove_dir_all(mc.join("doc/man-db")).ok();
    writer.join().unwrap();
    assert!(!mv.join("clone-only").exists());
    assert!(!mc.join("busy5").exists());
    assert_eq!(sums(&mv), doc, "the clone's changes stay in the clone");
    clone.detach();
    origin.detach();
    let mut clone = Stack::attach(&s.uri("c"), &t.join("fuse-c"));
    run("e2fsck", &["-fn", clone.dev()]);
    clone.detach();
    let mut origin = Stack::attach(&s.uri("v"), &t.join("fuse-v"));
    run("e2fsck", &["-fn", origin.dev()]);
    origin.detach();
    s.stop();
}
