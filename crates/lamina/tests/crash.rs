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
    let rounds: usize = env_parse("LAMINA_KILL_ROUNDS").unwrap_or(20);
    let seed: u64 = env_parse("LAMINA_KILL_SEED").unwrap_or_else(rand::random);
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

#[test]
fn power_cut_through_nbdkit_writeback_cache() {
    if !need(
        "crash::power_cut_through_nbdkit_writeback_cache",
        &["nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    let rounds: usize = env_parse("LAMINA_POWER_CUT_ROUNDS").unwrap_or(6);
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
        unmount_fuse(&t);
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
    unmount_fuse(&t);
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

/// One member of a parity array whose files sit behind nbdkit write-back caches:
/// the data file and, on a zoned array, the zone-state file (`DATA.zones`), each
/// with its own cache, so a power cut can keep one and lose the other.
struct CutMember {
    /// Per cached file: its directory (nbdkit socket, `fuse/dev`) and backing file.
    files: Vec<(TempDir, std::path::PathBuf)>,
    stacks: Vec<(Proc, Proc)>,
}

impl CutMember {
    fn start(&mut self) {
        self.stacks = self
            .files
            .iter()
            .map(|(d, b)| cached_device(d, b))
            .collect();
    }
    /// Power off: kill the caches (whatever they did not write back is lost).
    fn stop(&mut self) {
        for ((kit, fuse), (d, _)) in self.stacks.drain(..).zip(&self.files) {
            drop(kit);
            unmount_fuse(d);
            drop(fuse);
        }
    }
    fn kit_pids(&self) -> Vec<i32> {
        self.stacks
            .iter()
            .map(|(kit, _)| kit.0.id() as i32)
            .collect()
    }
}

/// The RAID write hole, end to end, as the issue that found it did it: a parity
/// array over members that are files nbdfuse exposes from their own `nbdkit
/// --filter=cache cache=writeback` (on a zoned array the zone-state file of each
/// member has its own cache too). A power cut kills the server and every nbdkit at
/// once: each file keeps or loses its unflushed writes on its own. After recovery
/// every block is checked against the oracle; then each member in turn is lost (the
/// array is opened from copies of the others) and every block must read back the
/// same.
fn parity_power_cut_then_member_loss(
    name: &str,
    layout: &str,
    members: usize,
    zoned: Option<&str>,
) {
    let rounds: usize = env_parse("LAMINA_POWER_CUT_ROUNDS").unwrap_or(4);
    let seed: u64 = env_parse("LAMINA_POWER_CUT_SEED").unwrap_or_else(rand::random);
    eprintln!("{name}: seed {seed}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let t = TempDir::new(name);
    // The array is made on plain files, then each file is copied into the backing
    // file of its cache and the configuration pointed at the cached copies, through
    // links named as the array expects (`mN` and `mN.zones`).
    let init = t.join("init");
    let links = t.join("links");
    std::fs::create_dir_all(&init).unwrap();
    std::fs::create_dir_all(&links).unwrap();
    let dir = t.join("arr");
    let mut args = vec![
        "array".to_string(),
        "create".into(),
        dir.display().to_string(),
        "--layout".into(),
        layout.into(),
        "--segment-size".into(),
        "256K".into(),
        "--write-unit".into(),
        "96K".into(),
    ];
    if let Some(z) = zoned {
        args.extend(["--zoned".to_string(), z.to_string()]);
    }
    for i in 0..members {
        args.push("--device".into());
        args.push(format!("{}:24M", init.join(format!("m{i}")).display()));
    }
    lamina(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    let mut guard = Guard::new();
    let mut cut: Vec<CutMember> = Vec::new();
    let mut cfg = std::fs::read_to_string(dir.join("lamina.toml")).unwrap();
    for i in 0..members {
        let data = init.join(format!("m{i}"));
        let mut names = vec![(data.clone(), links.join(format!("m{i}")))];
        if zoned.is_some() {
            let zones = lamina_device::zoned::state_path(&data);
            assert!(zones.exists(), "{} was not made", zones.display());
            names.push((
                zones,
                lamina_device::zoned::state_path(&links.join(format!("m{i}"))),
            ));
        }
        let mut files = Vec::new();
        for (j, (from, link)) in names.iter().enumerate() {
            let d = TempDir::new(&format!("{name}-m{i}-{j}"));
            guard.mounts.push(d.join("fuse"));
            let backing = d.join("backing.img");
            std::fs::copy(from, &backing).unwrap();
            std::os::unix::fs::symlink(d.join("fuse").join("dev"), link).unwrap();
            files.push((d, backing));
        }
        cfg = cfg.replace(
            data.to_str().unwrap(),
            links.join(format!("m{i}")).to_str().unwrap(),
        );
        let mut m = CutMember {
            files,
            stacks: Vec::new(),
        };
        m.start();
        cut.push(m);
    }
    std::fs::write(dir.join("lamina.toml"), &cfg).unwrap();
    create_volume(&dir, "v", "16M");
    let mut oracle = Oracle::new((16 << 20) / BS as u64);
    let mut version = 0u64;
    for round in 0..rounds {
        let server = Server::start(&dir);
        let stop = Arc::new(AtomicBool::new(false));
        // The power cut: the server and every cache die together.
        let pids: Vec<i32> = std::iter::once(server.pid())
            .chain(cut.iter().flat_map(|m| m.kit_pids()))
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
        // Power back on: fresh caches over what reached each backing file.
        for m in &mut cut {
            m.stop();
            m.start();
        }
        let server = Server::start(&dir);
        verify(&server.sock, &mut oracle, round);
        let st = status_json(&dir);
        let parity = if layout == "said6" { 2 } else { 1 };
        assert_eq!(
            st["array"]["redundancy_left"], parity,
            "round {round}: every member is in service after the cut"
        );
        server.stop();
        // Each member lost in turn, on copies of the others.
        for lost in 0..members {
            let copy = TempDir::new(&format!("{name}-lose{lost}"));
            let mut ccfg = cfg.clone();
            for (i, m) in cut.iter().enumerate() {
                let to = copy.join(&format!("m{i}"));
                let data_link = links.join(format!("m{i}"));
                if i != lost {
                    std::fs::copy(&m.files[0].1, &to).unwrap();
                    if let Some((_, zb)) = m.files.get(1) {
                        std::fs::copy(zb, lamina_device::zoned::state_path(&to)).unwrap();
                    }
                }
                ccfg = ccfg.replace(data_link.to_str().unwrap(), to.to_str().unwrap());
            }
            let cdir = copy.join("arr");
            std::fs::create_dir_all(&cdir).unwrap();
            std::fs::write(cdir.join("lamina.toml"), &ccfg).unwrap();
            let srv = Server::start(&cdir);
            let mut check = oracle.clone();
            verify(&srv.sock, &mut check, round);
            srv.stop();
        }
    }
    for m in &mut cut {
        m.stop();
    }
}

/// SAID5 over four cached members. Before recovery resynced parity, losing a
/// member after such a cut returned EIO (checksum mismatches) for blocks that had
/// been readable.
#[test]
fn said5_power_cut_then_a_member_loss_through_nbdkit_caches() {
    if !need(
        "crash::said5_power_cut_then_a_member_loss_through_nbdkit_caches",
        &["nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    parity_power_cut_then_member_loss("said5cut", "said5", 4, None);
}

/// The same on a zoned SAID5 array (emulated ZNS members): zones accept writes
/// only at their write pointers, so parity of a cut row cannot be rewritten in
/// place; recovery moves the live blocks of such rows instead. The zone-state
/// files sit behind caches of their own, so a cut can keep a write pointer's
/// advance and lose the data, or the reverse.
#[test]
fn zoned_said5_power_cut_then_a_member_loss_through_nbdkit_caches() {
    if !need(
        "crash::zoned_said5_power_cut_then_a_member_loss_through_nbdkit_caches",
        &["nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    parity_power_cut_then_member_loss(
        "zonedcut",
        "said5",
        3,
        Some("zns,zone=256K,cap=192K,conv=4,open=8"),
    );
}
