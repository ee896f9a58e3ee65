//! PostgreSQL on ext4 on a Lamina volume, with power cuts (issue 16, item 4).
//!
//! The stack, bottom up: a backing file behind `nbdkit --filter=cache
//! cache=writeback`, exposed as a file by nbdfuse (the "disk": a power cut loses
//! whatever was not flushed to it); a Lamina array on that file and `lamina serve`;
//! nbdfuse + losetup over the volume; ext4 mounted with `discard`; PostgreSQL with
//! data checksums, `synchronous_commit = on` and small WAL limits (so checkpoints and
//! WAL recycling happen during the run); pgbench's TPC-B-like load from four clients.
//!
//! Each round cuts the power at a random moment of the load: the disk's cache dies
//! first, then everything above it with kill -9, and the kernel's ext4 state over the
//! dead loop device is dropped. Power back on: Lamina recovers; ext4 replays its
//! journal on mount and `e2fsck -fn` must then find nothing; PostgreSQL recovers from
//! its WAL; `pg_amcheck` (heap pages and B-trees, every heap tuple found in its
//! indexes) must find nothing; pgbench's invariant must hold (the balances of
//! accounts, tellers and branches each sum to the sum of the history's deltas); and
//! every transaction another session saw committed before the cut must still be
//! there. With `synchronous_commit = on` a commit becomes visible to other sessions
//! only once its WAL is flushed, so what a reader saw had been acknowledged as durable
//! through every layer, Lamina included. That reader samples (every 30 ms); beside
//! the load, a client also commits numbered rows one at a time and counts each
//! whose commit PostgreSQL acknowledged to it: after the cut every acknowledged row
//! must be there, with no gap below the highest. At the end the cluster is shut
//! down and `pg_checksums --check` reads every page.

mod common;
use common::*;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The newest PostgreSQL server installed the Debian way (/usr/lib/postgresql/N/bin).
fn pg_bin() -> Option<PathBuf> {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    found.sort();
    found.pop().map(|(_, b)| b)
}

/// The processes whose parent is `pid`.
fn children_of(pid: i32) -> Vec<i32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| {
        let child: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{child}/stat")).ok()?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = &stat[stat.rfind(')')? + 2..];
        let ppid: i32 = rest.split(' ').nth(1)?.parse().ok()?;
        (ppid == pid).then_some(child)
    })
    .collect()
}

/// How clients reach a cluster: as root, over the Unix socket in `sock`, with trust
/// authentication (cloned into the thread that watches commits).
#[derive(Clone)]
struct Clients {
    bin: PathBuf,
    sock: PathBuf,
}

impl Clients {
    fn client(&self, tool: &str) -> Command {
        let mut c = Command::new(self.bin.join(tool));
        self.connect(&mut c);
        c
    }

    /// A client that is killed after `secs` seconds: a server that hangs (the
    /// stack under test) fails the test instead of holding CI to its limit.
    fn client_within(&self, secs: u32, tool: &str) -> Command {
        let mut c = Command::new("timeout");
        c.args(["-k", "10", &secs.to_string()])
            .arg(self.bin.join(tool));
        self.connect(&mut c);
        c
    }

    fn connect(&self, c: &mut Command) {
        c.arg("-h")
            .arg(&self.sock)
            .args(["-p", "5432", "-U", "postgres"])
            .env("PGCONNECT_TIMEOUT", "10");
    }

    fn sql(&self, query: &str) -> Result<String, String> {
        let out = self
            .client_within(300, "psql")
            .args([
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-c",
                query,
                "postgres",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| e.to_string())?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }
}

/// One PostgreSQL cluster: the server runs as the `postgres` user.
struct Postgres {
    clients: Clients,
    data: PathBuf,
    log: PathBuf,
    server: Option<Child>,
}

impl Postgres {
    fn as_postgres(&self, tool: &str) -> Command {
        let mut c = Command::new("setpriv");
        c.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--",
        ])
        .arg(self.clients.bin.join(tool));
        c
    }

    fn initdb(&self) {
        let out = self
            .as_postgres("initdb")
            .arg("-D")
            .arg(&self.data)
            .args(["--data-checksums", "-A", "trust", "-U", "postgres"])
            .output()
            .expect("initdb");
        assert!(
            out.status.success(),
            "initdb failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// The server's settings, on its command line: nothing the server needs to start
    /// depends on a file the test wrote.
    fn settings(&self) -> Vec<String> {
        [
            "listen_addresses=".to_string(),
            format!("unix_socket_directories={}", self.clients.sock.display()),
            "port=5432".into(),
            "shared_buffers=16MB".into(),
            "max_wal_size=48MB".into(),
            "min_wal_size=32MB".into(),
            "checkpoint_timeout=30s".into(),
            "fsync=on".into(),
            "synchronous_commit=on".into(),
            "full_page_writes=on".into(),
        ]
        .into_iter()
        .flat_map(|kv| ["-c".to_string(), kv])
        .collect()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Starts the server (crash recovery included) and waits until it answers.
    fn start(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        let child = self
            .as_postgres("postgres")
            .arg("-D")
            .arg(&self.data)
            .args(self.settings())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .expect("postgres");
        self.server = Some(child);
        let t0 = Instant::now();
        loop {
            if self.clients.sql("SELECT 1").is_ok() {
                return;
            }
            if let Some(st) = self.server.as_mut().unwrap().try_wait().unwrap() {
                // Reaped: its pid may be reused, so Drop must not signal it.
                self.server = None;
                panic!("postgres exited ({st}) at start:\n{}", self.log_tail());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(180),
                "postgres did not come up:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// kill -9 of the server and every process it started. Its children each call
    /// setsid(), so no process group holds them all: the server is stopped first (it
    /// forks no more), then it and its children are killed.
    fn kill9(&mut self) {
        if let Some(mut c) = self.server.take() {
            let pid = c.id() as i32;
            // SAFETY: kill has no memory preconditions; `pid` is our child, not reaped.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            for child in children_of(pid) {
                // SAFETY: as above.
                unsafe { libc::kill(child, libc::SIGKILL) };
            }
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            let _ = c.wait();
        }
    }

    /// A fast shutdown (SIGINT): a final checkpoint, then exit.
    fn stop(&mut self) {
        if let Some(mut c) = self.server.take() {
            // SAFETY: as in kill9.
            unsafe { libc::kill(c.id() as i32, libc::SIGINT) };
            let st = c.wait().unwrap();
            assert!(st.success(), "postgres shutdown: {st}\n{}", self.log_tail());
        }
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// The checks after a power cut; returns the number of committed transactions.
fn check_database(pg: &Postgres, seen_committed: u64, round: usize) -> u64 {
    let row = pg
        .clients
        .sql(
            "SELECT (SELECT sum(abalance) FROM pgbench_accounts), \
                    (SELECT sum(tbalance) FROM pgbench_tellers), \
                    (SELECT sum(bbalance) FROM pgbench_branches), \
                    (SELECT coalesce(sum(delta), 0) FROM pgbench_history), \
                    (SELECT count(*) FROM pgbench_history)",
        )
        .unwrap_or_else(|e| panic!("round {round}: query failed: {e}\n{}", pg.log_tail()));
    let v: Vec<i64> = row
        .split('|')
        .map(|x| x.parse().unwrap_or_else(|_| panic!("bad row {row:?}")))
        .collect();
    assert_eq!(v.len(), 5, "row {row:?}");
    assert!(
        v[0] == v[3] && v[1] == v[3] && v[2] == v[3],
        "round {round}: pgbench's balances disagree (accounts, tellers, branches, \
         history): {row}"
    );
    let committed = v[4] as u64;
    assert!(
        committed >= seen_committed,
        "round {round}: {seen_committed} transactions were seen committed before the \
         power cut, {committed} survived it"
    );
    let out = pg
        .clients
        .client_within(600, "pg_amcheck")
        .args(["--install-missing", "--heapallindexed", "--parent-check"])
        .arg("postgres")
        .output()
        .expect("pg_amcheck");
    assert!(
        out.status.success() && out.stdout.is_empty(),
        "round {round}: pg_amcheck found damage:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    committed
}

#[test]
fn postgres_survives_power_cuts_on_ext4_on_lamina() {
    let bin = pg_bin();
    let initdb = bin
        .as_ref()
        .map(|b| b.join("initdb").display().to_string())
        .unwrap_or_else(|| "initdb (apt-get install postgresql)".into());
    if !need(
        "postgres::postgres_survives_power_cuts_on_ext4_on_lamina",
        &[
            "nbdkit",
            "nbdfuse",
            "fusermount3",
            "losetup",
            "mkfs.ext4",
            "e2fsck",
            "setpriv",
            &initdb,
        ],
        true,
    ) {
        return;
    }
    let bin = bin.unwrap();
    let rounds: usize = env_parse("LAMINA_PG_ROUNDS").unwrap_or(4);
    let seed: u64 = env_parse("LAMINA_PG_SEED").unwrap_or_else(rand::random);
    eprintln!("postgres power cuts: seed {seed}, {rounds} rounds");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let t = TempDir::new("postgres");
    let mut guard = Guard::new();
    guard.mounts.push(t.join("fuse"));
    guard.mounts.push(t.join("fuse2"));
    let backing = t.join("backing.img");
    std::fs::File::create(&backing)
        .unwrap()
        .set_len(544 << 20)
        .unwrap();
    let sock = t.join("run");
    std::fs::create_dir_all(&sock).unwrap();
    run("chmod", &["1777", sock.to_str().unwrap()]);
    let mnt = t.join("mnt");

    let mut disk = Some(cached_device(&t, &backing));
    let dir = t.join("arr");
    lamina(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--device",
        t.join("fuse").join("dev").to_str().unwrap(),
        "--segment-size",
        "2M",
        "--write-unit",
        "256K",
    ]);
    create_volume(&dir, "pg", "448M");
    let mut server = Some(Server::start(&dir));
    let mut fs = Some(Stack::attach(
        &server.as_ref().unwrap().uri("pg"),
        &t.join("fuse2"),
    ));
    let fs_ref = fs.as_mut().unwrap();
    run("mkfs.ext4", &["-q", "-F", fs_ref.dev()]);
    fs_ref.mount_with(&mnt, "discard");
    // Ballast that stays: the database's churn then runs in the rest of the array,
    // so Lamina's garbage collection works during the rounds.
    run(
        "dd",
        &[
            "if=/dev/urandom",
            &format!("of={}", mnt.join("ballast").display()),
            "bs=1M",
            "count=256",
            "conv=fsync",
            "status=none",
        ],
    );
    let data = mnt.join("pgdata");
    std::fs::create_dir_all(&data).unwrap();
    run("chown", &["postgres:postgres", data.to_str().unwrap()]);
    let mut pg = Postgres {
        clients: Clients { bin, sock },
        data,
        log: t.join("pg.log"),
        server: None,
    };
    pg.initdb();
    pg.start();
    let out = pg
        .clients
        .client_within(600, "pgbench")
        .args(["-i", "-q", "-s", "2", "postgres"])
        .output()
        .expect("pgbench -i");
    assert!(
        out.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    pg.clients
        .sql("CREATE TABLE acks (n bigint PRIMARY KEY)")
        .unwrap_or_else(|e| panic!("CREATE TABLE acks: {e}"));

    let mut committed = 0u64;
    let mut acked_total = 0u64;
    for round in 0..rounds {
        // The load, and a reader that records how many transactions it saw committed.
        let mut bench = pg
            .clients
            .client("pgbench")
            .args(["-n", "-c", "4", "-j", "2", "-T", "600", "postgres"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pgbench");
        let seen = Arc::new(AtomicU64::new(committed));
        let stop = Arc::new(AtomicBool::new(false));
        let reader = {
            let (seen, stop) = (seen.clone(), stop.clone());
            let clients = pg.clients.clone();
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let count = clients.sql("SELECT count(*) FROM pgbench_history");
                    if let Some(n) = count.ok().and_then(|n| n.parse().ok()) {
                        seen.fetch_max(n, Ordering::SeqCst);
                    }
                    std::thread::sleep(Duration::from_millis(30));
                }
            })
        };
        // One row at a time, each its own transaction: `psql -c` exits 0 only
        // after the server acknowledged the commit.
        let acked = Arc::new(AtomicU64::new(acked_total));
        let acker = {
            let (acked, stop) = (acked.clone(), stop.clone());
            let clients = pg.clients.clone();
            std::thread::spawn(move || {
                let mut n = acked.load(Ordering::SeqCst);
                while !stop.load(Ordering::SeqCst) {
                    n += 1;
                    if clients
                        .sql(&format!("INSERT INTO acks VALUES ({n})"))
                        .is_err()
                    {
                        // The cut came while this row was in flight: it may or
                        // may not be there, and nothing after it is sent.
                        break;
                    }
                    acked.store(n, Ordering::SeqCst);
                }
            })
        };
        std::thread::sleep(Duration::from_millis(rng.gen_range(1500..6000)));

        // The power cut: the disk's cache first, then every process above it.
        let (kit, lower_fuse) = disk.take().unwrap();
        drop(kit);
        server.take().unwrap().kill9();
        pg.kill9();
        let _ = bench.kill();
        let _ = bench.wait();
        stop.store(true, Ordering::SeqCst);
        reader.join().unwrap();
        acker.join().unwrap();
        let acked_before = acked.load(Ordering::SeqCst);
        fs.take().unwrap().cut();
        unmount_fuse(&t);
        drop(lower_fuse);
        let seen_committed = seen.load(Ordering::SeqCst);

        // Power back on.
        disk = Some(cached_device(&t, &backing));
        server = Some(Server::start(&dir));
        let mut stack = Stack::attach(&server.as_ref().unwrap().uri("pg"), &t.join("fuse2"));
        // Mounting replays ext4's journal; after it the file system must be clean.
        stack.mount_with(&mnt, "discard");
        stack.unmount();
        run("e2fsck", &["-fn", stack.dev()]);
        stack.mount_with(&mnt, "discard");
        fs = Some(stack);
        pg.start();
        let now = check_database(&pg, seen_committed, round);
        let rows = pg
            .clients
            .sql("SELECT count(*), coalesce(max(n), 0) FROM acks")
            .unwrap_or_else(|e| panic!("round {round}: acks: {e}"));
        let (count, max) = rows
            .split_once('|')
            .and_then(|(c, m)| Some((c.parse::<u64>().ok()?, m.parse::<u64>().ok()?)))
            .unwrap_or_else(|| panic!("round {round}: acks gave {rows:?}"));
        assert!(
            max >= acked_before && count == max,
            "round {round}: {acked_before} rows were acknowledged committed before the \
             power cut; after it the table holds {count} rows, the highest {max}"
        );
        assert!(
            acked_before > acked_total,
            "round {round}: no row was acknowledged during the load"
        );
        eprintln!("round {round}: {acked_before} rows acknowledged, {max} survived");
        acked_total = max;
        eprintln!(
            "round {round}: {} transactions seen committed before the cut, {} after \
             recovery ({} in the round)",
            seen_committed,
            now,
            now - committed
        );
        assert!(
            now > committed,
            "round {round}: no transaction committed during the load"
        );
        committed = now;
    }

    // A clean shutdown, then every page's checksum.
    pg.stop();
    let out = pg
        .as_postgres("pg_checksums")
        .args(["--check", "-D"])
        .arg(&pg.data)
        .output()
        .expect("pg_checksums");
    assert!(
        out.status.success(),
        "pg_checksums:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    fs.take().unwrap().detach();
    server.take().unwrap().stop();
    let st = status_json(&dir);
    eprintln!(
        "lamina after {rounds} power cuts: user {} MiB written, gc {} MiB relocated",
        st["user_bytes_written"].as_u64().unwrap_or(0) >> 20,
        st["gc_bytes_relocated"].as_u64().unwrap_or(0) >> 20
    );
    drop(disk);
    unmount_fuse(&t);
    drop(guard);
}
