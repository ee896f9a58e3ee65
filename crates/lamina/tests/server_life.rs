//! The server's life as a user meets it: where it starts (the implicit default, a
//! mistyped DIR), who holds its devices, and the signals and closed outputs a
//! terminal session brings (SIGHUP, SIGTERM, `lamina serve | head -1`).

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_testkit::{decode_pattern, pattern, BS};
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn signal(pid: i32, sig: i32) {
    // SAFETY: signalling a child of this test.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0);
}

/// Waits until the array's log file has a line containing `needle`.
fn wait_log(dir: &Path, needle: &str) {
    let t0 = Instant::now();
    loop {
        let log = std::fs::read_to_string(dir.join("lamina.log")).unwrap_or_default();
        if log.contains(needle) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no {needle:?} in the log:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `lamina serve DIR` with a DIR that holds no array is a typo until proven
/// otherwise: an error that says how to create one, and nothing created (it used to
/// create and serve a new, empty 8 GiB array).
#[test]
fn a_mistyped_dir_is_an_error_and_creates_nothing() {
    let t = TempDir::new("typo");
    let typo = t.join("tnak");
    let out = lamina_output(&["serve", typo.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("holds no Lamina array") && err.contains("lamina array create"),
        "{err}"
    );
    assert!(!typo.exists(), "nothing is created for a mistyped DIR");
}

/// Without DIR, ./lamina-data is created with the embedded default on first run and
/// reused after (the README's first command).
#[test]
fn the_implicit_default_is_created_once_and_served() {
    let t = TempDir::new("default");
    let start = || {
        Command::new(lamina_bin())
            // (The default listens on loopback TCP too, as its config says; not
            // here, where other tests' servers may hold the port.)
            .args(["serve", "--default-size", "256M", "--no-tcp"])
            .current_dir(t.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let sock = t.join("lamina-data/nbd.sock");
    let mut child = start();
    wait_for(&sock);
    let cfg = std::fs::read_to_string(t.join("lamina-data/lamina.toml")).unwrap();
    assert!(cfg.contains("tcp = \"127.0.0.1:10809\""), "{cfg}");
    let mut c = Client::connect_unix(&sock, "default").unwrap();
    assert!(c.size > 100 << 20, "default volume of {} bytes", c.size);
    c.write(0, &pattern(0, 3), true).unwrap();
    drop(c);
    signal(child.id() as i32, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
    let mut child = start();
    wait_for(&sock);
    let mut c = Client::connect_unix(&sock, "default").unwrap();
    assert_eq!(decode_pattern(0, &c.read(0, BS as u32).unwrap()), Ok(3));
    drop(c);
    signal(child.id() as i32, libc::SIGTERM);
    assert!(child.wait().unwrap().success());
}

/// A device held by a running server is refused with the holder's PID; a mistyped
/// device path says there is no such file. Neither is called damaged metadata, which
/// would invite `--force`.
#[test]
fn held_or_missing_devices_are_named_for_what_they_are() {
    let t = TempDir::new("held");
    let dir = small_array(&t, "16M");
    let srv = Server::start(&dir);
    let out = lamina_output(&[
        "serve",
        dir.to_str().unwrap(),
        "--unix",
        t.join("other.sock").to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("in use by process {}", srv.pid())) && err.contains("lamina"),
        "{err}"
    );
    assert!(
        !err.contains("superblock") && !err.contains("damaged"),
        "{err}"
    );
    srv.stop();
    let cfg_path = dir.join("lamina.toml");
    let good = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(&cfg_path, good.replace("dev.img", "dve.img")).unwrap();
    let out = lamina_output(&["status", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("dve.img") && err.contains("No such file"),
        "{err}"
    );
    assert!(
        !err.contains("superblock") && !err.contains("damaged"),
        "{err}"
    );
}

/// SIGHUP (a closed terminal, or log rotation) flushes, checkpoints and reopens the
/// log, and the server goes on; SIGTERM flushes, checkpoints and exits cleanly; a
/// closed standard output does not stop the server. (SIGHUP used to kill the server
/// without a flush, and a closed stdout aborted it.)
#[test]
fn sighup_sigterm_and_a_closed_stdout() {
    let t = TempDir::new("signals");
    let dir = small_array(&t, "16M");
    let sock = dir.join("nbd.sock");
    // Standard output is a pipe whose reader is gone before the banner is written.
    let mut child = Command::new(lamina_bin())
        .args([
            "serve",
            dir.to_str().unwrap(),
            "--unix",
            sock.to_str().unwrap(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let mut err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
    });
    wait_for(&sock);
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    assert!(
        child.try_wait().unwrap().is_none(),
        "the server survives a closed stdout"
    );
    // Unflushed writes, then SIGHUP: they must be durable afterwards.
    for lba in 0..64u64 {
        c.write(lba * BS as u64, &pattern(lba, 5), false).unwrap();
    }
    // Log rotation: the old file is moved away; SIGHUP reopens the configured path.
    std::fs::rename(dir.join("lamina.log"), dir.join("lamina.log.1")).unwrap();
    signal(child.id() as i32, libc::SIGHUP);
    wait_log(&dir, "SIGHUP: checkpoint written");
    assert!(
        child.try_wait().unwrap().is_none(),
        "SIGHUP does not stop the server"
    );
    // Still serving on the same connection.
    c.write(64 * BS as u64, &pattern(64, 6), false).unwrap();
    assert_eq!(
        decode_pattern(3, &c.read(3 * BS as u64, BS as u32).unwrap()),
        Ok(5)
    );
    drop(c);
    // kill -9 now: what SIGHUP flushed survives.
    child.kill().unwrap();
    child.wait().unwrap();
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in 0..64u64 {
        assert_eq!(
            decode_pattern(lba, &c.read(lba * BS as u64, BS as u32).unwrap()),
            Ok(5),
            "block {lba} was flushed by SIGHUP"
        );
    }
    c.write(0, &pattern(0, 9), false).unwrap();
    drop(c);
    // SIGTERM: flush, checkpoint, exit 0.
    srv.stop_with(libc::SIGTERM);
    let log = std::fs::read_to_string(dir.join("lamina.log")).unwrap();
    assert!(
        log.contains("signal 15") && log.contains("clean shutdown"),
        "{log}"
    );
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    assert_eq!(decode_pattern(0, &c.read(0, BS as u32).unwrap()), Ok(9));
    drop(c);
    srv.stop();
}

/// A volume with clients connected is not deleted without `--force` (as `lvremove`
/// and `zfs destroy` refuse a busy volume); with it, the clients are disconnected
/// first. (Deleting used to succeed silently, leaving the client with EIO on reads
/// and EINVAL on writes while its flushes still succeeded.)
#[test]
fn busy_volumes_are_deleted_only_with_force() {
    let t = TempDir::new("busy");
    let dir = small_array(&t, "16M");
    create_volume(&dir, "w", "16M");
    let d = dir.to_str().unwrap();
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    c.write(0, &pattern(0, 1), true).unwrap();
    let out = lamina_output(&["volume", "delete", d, "v"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("in use by 1 client") && err.contains("--force"),
        "{err}"
    );
    // Refused: the client goes on as before.
    assert_eq!(decode_pattern(0, &c.read(0, BS as u32).unwrap()), Ok(1));
    // A client that disconnected no longer counts.
    let c2 = Client::connect_unix(&srv.sock, "w").unwrap();
    drop(c2);
    let t0 = Instant::now();
    loop {
        let out = lamina_output(&["volume", "delete", d, "w"]);
        if out.status.success() {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{out:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    // --force disconnects the client, then deletes.
    let out = lamina_output(&["volume", "delete", d, "v", "--force"]);
    assert!(out.status.success(), "{out:?}");
    assert!(c.read(0, BS as u32).is_err(), "the client was disconnected");
    let list = lamina(&["volume", "list", d, "--json"]);
    assert!(!list.contains("\"v\""), "{list}");
    assert!(Client::connect_unix(&srv.sock, "v").is_err());
    srv.stop();
}

/// Nice value and name of each thread of process `pid`.
fn thread_nices(pid: i32) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(task.join("comm")),
            std::fs::read_to_string(task.join("stat")),
        ) else {
            continue; // the thread ended meanwhile
        };
        // Fields after the parenthesised name: state is field 3, nice field 19.
        let rest = &stat[stat.rfind(')').unwrap() + 2..];
        let nice = rest.split(' ').nth(16).unwrap().parse().unwrap();
        out.push((comm.trim().to_string(), nice));
    }
    out
}

/// The I/O threads (unit writes and garbage collection) run `[serve] io_nice` steps
/// below the rest of the server (none by default), and the engine thread never
/// does; a bad value is refused before anything starts.
#[test]
fn io_threads_run_below_the_threads_serving_clients() {
    let t = TempDir::new("io-nice");
    let dir = small_array(&t, "64M");
    let cfg_path = dir.join("lamina.toml");
    let good = std::fs::read_to_string(&cfg_path).unwrap();
    // SAFETY: getpriority on this process.
    let base = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) } as i64;
    for (setting, steps) in [(None, 0), (Some(10), 10), (Some(3), 3), (Some(0), 0)] {
        let cfg = match setting {
            None => good.clone(),
            Some(n) => good.replace("[serve]", &format!("[serve]\nio_nice = {n}")),
        };
        std::fs::write(&cfg_path, cfg).unwrap();
        let s = Server::start(&dir);
        let threads = thread_nices(s.pid());
        let io: Vec<i64> = threads
            .iter()
            .filter(|(n, _)| n.starts_with("lamina-io"))
            .map(|t| t.1)
            .collect();
        assert!(!io.is_empty(), "no I/O threads among {threads:?}");
        assert!(
            io.iter().all(|&n| n == (base + steps).min(19)),
            "io_nice {setting:?}: {threads:?}"
        );
        let engine = threads.iter().find(|(n, _)| n == "lamina-engine");
        assert_eq!(engine.map(|t| t.1), Some(base), "{threads:?}");
        s.stop();
    }
    std::fs::write(&cfg_path, good.replace("[serve]", "[serve]\nio_nice = 40")).unwrap();
    let out = lamina_output(&["serve", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("[serve] io_nice = 40: give 0 to 19"), "{err}");
}
