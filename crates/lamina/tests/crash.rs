//! Crash tests through NBD.
//!
//! `kill_9_at_random_moments`: a client writes, trims and flushes blocks of
//! self-identifying content while `lamina serve` is killed with SIGKILL at a random
//! moment; after a restart every block must hold a version allowed by the oracle:
//! the one acknowledged before the last completed flush (or FUA), or a later one,
//! and never a torn mix.
//!
//! `power_cut_through_nbdkit_writeback_cache`: kill -9 of the server alone is not a
//! power cut (the page cache survives it). Here the device is a file exposed by
//! nbdfuse from `nbdkit --filter=cache cache=writeback`; killing nbdkit loses exactly
//! the writes Lamina did not flush, as a power cut would.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_nbd::proto::{CMD_FLAG_FUA, CMD_FLUSH, CMD_TRIM, CMD_WRITE, CMD_WRITE_ZEROES};
use lamina_testkit::{fill_pattern, FlushMark, Oracle, WriteMark, BS};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

enum Outstanding {
    Write {
        first: u64,
        mark: WriteMark,
        fua: bool,
    },
    Flush(FlushMark),
}

/// Writes until the connection breaks (the server was killed) or `stop` is set.
/// With `device_may_die`, an error reply (EIO once the device is gone) also ends it.
fn workload(
    client: &mut Client,
    oracle: &mut Oracle,
    rng: &mut impl Rng,
    version: &mut u64,
    stop: &AtomicBool,
    device_may_die: bool,
) {
    let blocks = oracle.blocks();
    let mut out: HashMap<u64, Outstanding> = HashMap::new();
    let mut buf = vec![0u8; 8 * BS];
    while !stop.load(Ordering::SeqCst) {
        let batch = rng.gen_range(1..=32);
        let mut ok = true;
        for _ in 0..batch {
            let p: f64 = rng.gen();
            let sent = if p < 0.08 {
                let mark = oracle.flush_sent();
                client
                    .send(CMD_FLUSH, 0, 0, 0, &[])
                    .map(|h| (h, Outstanding::Flush(mark)))
            } else {
                let count = if rng.gen_bool(0.7) {
                    1
                } else {
                    rng.gen_range(1..=8)
                };
                let first = if rng.gen_bool(0.5) {
                    rng.gen_range(0..blocks / 16)
                } else {
                    rng.gen_range(0..blocks)
                }
                .min(blocks - count);
                let fua = rng.gen_bool(0.05);
                let flags = if fua { CMD_FLAG_FUA } else { 0 };
                let len = (count * BS as u64) as u32;
                if p < 0.14 {
                    let kind = if rng.gen_bool(0.5) {
                        CMD_TRIM
                    } else {
                        CMD_WRITE_ZEROES
                    };
                    let mark = oracle.issue(first, count, |_| 0);
                    client
                        .send(kind, flags, first * BS as u64, len, &[])
                        .map(|h| (h, Outstanding::Write { first, mark, fua }))
                } else {
                    let base = *version;
                    *version += count;
                    let v = |lba: u64| base + 1 + (lba - first);
                    for (k, lba) in (first..first + count).enumerate() {
                        fill_pattern(lba, v(lba), &mut buf[k * BS..(k + 1) * BS]);
                    }
                    let mark = oracle.issue(first, count, v);
                    client
                        .send(
                            CMD_WRITE,
                            flags,
                            first * BS as u64,
                            len,
                            &buf[..len as usize],
                        )
                        .map(|h| (h, Outstanding::Write { first, mark, fua }))
                }
            };
            match sent {
                Ok((h, o)) => {
                    out.insert(h, o);
                }
                Err(_) => {
                    ok = false;
                    break;
                }
            }
        }
        if !ok || client.push().is_err() {
            return;
        }
        while !out.is_empty() {
            let Ok(r) = client.recv() else { return };
            let o = out.remove(&r.handle).expect("reply for a handle we sent");
            if r.error != 0 && device_may_die {
                return;
            }
            assert_eq!(r.error, 0, "request failed with error {}", r.error);
            match o {
                Outstanding::Write {
                    first,
                    mark,
                    fua: true,
                } => oracle.ack_durable(first, &mark),
                Outstanding::Write {
                    first,
                    mark,
                    fua: false,
                } => oracle.ack(first, &mark),
                Outstanding::Flush(mark) => oracle.flush_done(&mark),
            }
        }
    }
}

/// Reads the whole volume and checks it against the oracle; the result becomes the
/// new durable state.
fn verify(sock: &Path, oracle: &mut Oracle, round: usize) {
    let mut c = Client::connect_unix(sock, "v").expect("connect after restart");
    let blocks = oracle.blocks();
    let mut found = Vec::with_capacity(blocks as usize);
    let chunk = 256u64;
    let mut lba = 0;
    while lba < blocks {
        let n = chunk.min(blocks - lba);
        let data = c
            .read(lba * BS as u64, (n * BS as u64) as u32)
            .expect("read back");
        for k in 0..n {
            let b = &data[(k as usize) * BS..(k as usize + 1) * BS];
            match oracle.check(lba + k, b) {
                Ok(v) => found.push(v),
                Err(e) => panic!("round {round}: {e}"),
            }
        }
        lba += n;
    }
    oracle.reset_to(&found);
}

fn kill_after(pid: i32, delay: Duration, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(delay);
        // SAFETY: signalling a child process of this test.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        stop.store(true, Ordering::SeqCst);
    })
}

#[test]
fn kill_9_at_random_moments() {
    let rounds: usize = std::env::var("LAMINA_KILL_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("LAMINA_KILL_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("kill_9_at_random_moments: seed {seed} (LAMINA_KILL_SEED to replay the workload)");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let t = TempDir::new("kill9");
    let dir = t.join("arr");
    create_array(
        &dir,
        "128M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", "48M");
    let mut oracle = Oracle::new((48 << 20) / BS as u64);
    let mut version = 0u64;
    let mut server = Server::start(&dir);
    for round in 0..rounds {
        let stop = Arc::new(AtomicBool::new(false));
        let killer = kill_after(
            server.pid(),
            Duration::from_millis(rng.gen_range(50..900)),
            stop.clone(),
        );
        if let Ok(mut c) = Client::connect_unix(&server.sock, "v") {
            workload(&mut c, &mut oracle, &mut rng, &mut version, &stop, false);
        }
        killer.join().unwrap();
        server.kill9();
        server = Server::start(&dir);
        verify(&server.sock, &mut oracle, round);
    }
    let st = status_json(&dir);
    eprintln!(
        "after {rounds} kills: user {} gc {} checkpoints gen {}",
        st["user_bytes_written"], st["gc_bytes_relocated"], st["checkpoint_generation"]
    );
    server.stop();
}

/// A child process killed on drop.
struct Proc(Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nbdkit with a write-back cache over `backing`, exposed as `fuse/dev`.
fn cached_device(t: &TempDir, backing: &Path) -> (Proc, Proc) {
    let (kit, fuse, _) = nbdkit_as_file(
        t,
        &[
            "--filter=cache",
            "file",
            backing.to_str().unwrap(),
            "cache=writeback",
        ],
    );
    (Proc(kit), Proc(fuse))
}

fn unmount(t: &TempDir) {
    let _ = Command::new("fusermount3")
        .arg("-u")
        .arg(t.join("fuse"))
        .status();
}

#[test]
fn power_cut_through_nbdkit_writeback_cache() {
    if !need(
        "crash::power_cut_through_nbdkit_writeback_cache",
        &["nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    let rounds: usize = std::env::var("LAMINA_POWER_CUT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(6);
    let seed: u64 = rand::random();
    eprintln!("power_cut_through_nbdkit_writeback_cache: seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let t = TempDir::new("powercut");
    let mut guard = Guard::new();
    guard.mounts.push(t.join("fuse"));
    let backing = t.join("backing.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(96 << 20)
        .unwrap();
    let dir = t.join("arr");
    let (kit, fuse) = cached_device(&t, &backing);
    let dev = t.join("fuse").join("dev");
    lamina(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--device",
        dev.to_str().unwrap(),
        "--segment-size",
        "1M",
        "--write-unit",
        "128K",
    ]);
    create_volume(&dir, "v", "24M");
    let mut oracle = Oracle::new((24 << 20) / BS as u64);
    let mut version = 0u64;
    let mut stack = Some((kit, fuse));
    let mut lost_something = false;
    for round in 0..rounds {
        let server = Server::start(&dir);
        let stop = Arc::new(AtomicBool::new(false));
        // The power cut: nbdkit (the "disk") dies first, taking its unflushed cache.
        let (kit, fuse) = stack.take().unwrap();
        let kit_pid = kit.0.id() as i32;
        let killer = kill_after(
            kit_pid,
            Duration::from_millis(rng.gen_range(100..1200)),
            stop.clone(),
        );
        if let Ok(mut c) = Client::connect_unix(&server.sock, "v") {
            workload(&mut c, &mut oracle, &mut rng, &mut version, &stop, true);
        }
        killer.join().unwrap();
        server.kill9();
        drop(kit);
        unmount(&t);
        drop(fuse);
        // Power back on: a fresh cache over what reached the backing file.
        let before = std::fs::read(&backing).unwrap();
        stack = Some(cached_device(&t, &backing));
        let server = Server::start(&dir);
        verify(&server.sock, &mut oracle, round);
        server.stop();
        lost_something |= before != std::fs::read(&backing).unwrap();
    }
    let _ = lost_something;
    drop(stack);
    unmount(&t);
}

/// With multi-conn, a flush on one connection covers writes completed on all of
/// them: write on A, flush on B, kill -9, and A's writes are there.
#[test]
fn flush_on_one_connection_covers_writes_of_others() {
    let t = TempDir::new("multiconn");
    let dir = small_array(&t, "16M");
    for round in 0..5u64 {
        let server = Server::start(&dir);
        let mut a = Client::connect_unix(&server.sock, "v").unwrap();
        let mut b = Client::connect_unix(&server.sock, "v").unwrap();
        for lba in 0..200u64 {
            a.write(
                lba * BS as u64,
                &lamina_testkit::pattern(lba, round + 1),
                false,
            )
            .unwrap();
        }
        b.flush().unwrap();
        server.kill9();
        let server = Server::start(&dir);
        let mut c = Client::connect_unix(&server.sock, "v").unwrap();
        for lba in 0..200u64 {
            let got =
                lamina_testkit::decode_pattern(lba, &c.read(lba * BS as u64, BS as u32).unwrap())
                    .unwrap();
            assert_eq!(
                got,
                round + 1,
                "round {round}: block {lba} written on A, flushed on B, lost"
            );
        }
        server.stop();
    }
}

/// The RAID write hole, end to end, as the issue that found it did it: SAID5 over
/// four members, each a file that nbdfuse exposes from its own `nbdkit
/// --filter=cache cache=writeback`. A power cut kills the server and the four
/// nbdkits at once: each member keeps or loses its unflushed writes on its own.
/// After recovery every block is checked against the oracle; then each member in
/// turn is lost (the array is opened from copies of the other three) and every
/// block must read back the same. Before recovery resynced parity, losing a member
/// after such a cut returned EIO (checksum mismatches) for blocks that had been
/// readable.
#[test]
fn said5_power_cut_then_a_member_loss_through_nbdkit_caches() {
    if !need(
        "crash::said5_power_cut_then_a_member_loss_through_nbdkit_caches",
        &["nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    let rounds: usize = std::env::var("LAMINA_POWER_CUT_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let seed: u64 = std::env::var("LAMINA_POWER_CUT_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("said5_power_cut_then_a_member_loss_through_nbdkit_caches: seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let t = TempDir::new("said5cut");
    let members: Vec<TempDir> = (0..4)
        .map(|i| TempDir::new(&format!("said5cut-m{i}")))
        .collect();
    let mut guard = Guard::new();
    let backing: Vec<_> = members.iter().map(|m| m.join("backing.img")).collect();
    for (m, b) in members.iter().zip(&backing) {
        guard.mounts.push(m.join("fuse"));
        std::fs::File::create(b).unwrap().set_len(24 << 20).unwrap();
    }
    let mut stacks: Vec<(Proc, Proc)> = members
        .iter()
        .zip(&backing)
        .map(|(m, b)| cached_device(m, b))
        .collect();
    let dir = t.join("arr");
    let mut args = vec![
        "array".to_string(),
        "create".into(),
        dir.display().to_string(),
        "--layout".into(),
        "said5".into(),
        "--segment-size".into(),
        "256K".into(),
        "--write-unit".into(),
        "96K".into(),
    ];
    for m in &members {
        args.push("--device".into());
        args.push(m.join("fuse").join("dev").display().to_string());
    }
    lamina(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    create_volume(&dir, "v", "32M");
    let mut oracle = Oracle::new((32 << 20) / BS as u64);
    let mut version = 0u64;
    for round in 0..rounds {
        let server = Server::start(&dir);
        let stop = Arc::new(AtomicBool::new(false));
        // The power cut: the server and every member's cache die together.
        let pids: Vec<i32> = std::iter::once(server.pid())
            .chain(stacks.iter().map(|(kit, _)| kit.0.id() as i32))
            .collect();
        let delay = Duration::from_millis(rng.gen_range(200..1500));
        let killer = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                std::thread::sleep(delay);
                for pid in pids {
                    // SAFETY: signalling child processes of this test.
                    unsafe { libc::kill(pid, libc::SIGKILL) };
                }
                stop.store(true, Ordering::SeqCst);
            })
        };
        if let Ok(mut c) = Client::connect_unix(&server.sock, "v") {
            workload(&mut c, &mut oracle, &mut rng, &mut version, &stop, true);
        }
        killer.join().unwrap();
        server.kill9();
        for ((kit, fuse), m) in stacks.drain(..).zip(&members) {
            drop(kit);
            unmount(m);
            drop(fuse);
        }
        // Power back on: fresh caches over what reached each backing file.
        stacks = members
            .iter()
            .zip(&backing)
            .map(|(m, b)| cached_device(m, b))
            .collect();
        let server = Server::start(&dir);
        verify(&server.sock, &mut oracle, round);
        let st = status_json(&dir);
        assert_eq!(
            st["array"]["redundancy_left"], 1,
            "round {round}: all four members are in service after the cut"
        );
        server.stop();
        // Each member lost in turn, on copies of the other three.
        for lost in 0..members.len() {
            let copy = TempDir::new(&format!("said5cut-lose{lost}"));
            let cfg = std::fs::read_to_string(dir.join("lamina.toml")).unwrap();
            let mut cfg = cfg.clone();
            for (i, (m, b)) in members.iter().zip(&backing).enumerate() {
                let to = copy.join(&format!("m{i}.img"));
                if i != lost {
                    std::fs::copy(b, &to).unwrap();
                }
                cfg = cfg.replace(
                    &m.join("fuse").join("dev").display().to_string(),
                    to.to_str().unwrap(),
                );
            }
            let cdir = copy.join("arr");
            std::fs::create_dir_all(&cdir).unwrap();
            std::fs::write(cdir.join("lamina.toml"), cfg).unwrap();
            let srv = Server::start(&cdir);
            let mut check = oracle.clone();
            verify(&srv.sock, &mut check, round);
            srv.stop();
        }
    }
    drop(stacks);
    for m in &members {
        unmount(m);
    }
}
