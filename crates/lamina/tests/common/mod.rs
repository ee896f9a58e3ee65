//! End-to-end test support: temporary arrays, `lamina serve` processes, real tools.
//!
//! Tests that need a tool (fio, nbdinfo, nbdfuse, ...) or root call [`need`] first.
//! When something is missing they say so loudly and skip, except under `CI=true`,
//! where a missing requirement fails the test: CI installs everything.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

pub fn lamina_bin() -> &'static str {
    env!("CARGO_BIN_EXE_lamina")
}

/// True when the requirements are there. Under CI=true a missing one panics.
pub fn need(test: &str, tools: &[&str], root: bool) -> bool {
    let mut missing: Vec<String> = tools
        .iter()
        .filter(|t| {
            !Command::new("sh")
                .arg("-c")
                .arg(format!("command -v {t}"))
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .map(|t| t.to_string())
        .collect();
    // SAFETY: geteuid has no preconditions.
    if root && unsafe { libc::geteuid() } != 0 {
        missing.push("root".into());
    }
    if missing.is_empty() {
        return true;
    }
    unavailable(&format!("{test}: needs {} (install: apt-get install fio libnbd-bin nbdkit qemu-utils fuse3 e2fsprogs openssl man-db postgresql)", missing.join(", ")));
    false
}

/// A test cannot run here (`msg` says why): it says so loudly and returns, so the
/// caller skips, except under `CI=true`, where it fails.
pub fn unavailable(msg: &str) {
    if std::env::var("CI").is_ok_and(|v| v == "true") {
        panic!("{msg}");
    }
    eprintln!("\n*** SKIPPED {msg} ***\n");
}

/// The environment variable `name` parsed as a `T` (a test's rounds or seed);
/// `None` when it is unset or does not parse.
pub fn env_parse<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|s| s.parse().ok())
}

/// A directory removed when dropped.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        static N: AtomicU32 = AtomicU32::new(0);
        let p = std::env::temp_dir().join(format!(
            "lamina-e2e-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
    pub fn join(&self, p: &str) -> PathBuf {
        self.0.join(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `lamina ARGS`; panics with its output unless it succeeds.
pub fn lamina(args: &[&str]) -> String {
    let out = lamina_output(args);
    assert!(
        out.status.success(),
        "lamina {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn lamina_output(args: &[&str]) -> Output {
    Command::new(lamina_bin())
        .args(args)
        .output()
        .expect("run lamina")
}

/// Runs a command; panics with its output unless it succeeds.
pub fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Creates an array in `dir` with one sparse device and returns the usable bytes.
pub fn create_array(dir: &Path, device_size: &str, extra: &[&str]) -> u64 {
    let dev = format!("{}:{device_size}", dir.join("dev.img").display());
    let mut args = vec!["array", "create", dir.to_str().unwrap(), "--device", &dev];
    args.extend_from_slice(extra);
    lamina(&args);
    status_json(dir)["usable_bytes"].as_u64().unwrap()
}

/// A 128 MiB array with 1 MiB segments in `t/arr`, and a volume `v` of `vol`.
pub fn small_array(t: &TempDir, vol: &str) -> PathBuf {
    let dir = t.join("arr");
    create_array(
        &dir,
        "128M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", vol);
    dir
}

/// `lamina volume create DIR NAME --size SIZE`.
pub fn create_volume(dir: &Path, name: &str, size: &str) {
    lamina(&[
        "volume",
        "create",
        dir.to_str().unwrap(),
        name,
        "--size",
        size,
    ]);
}

/// Appends `text` to the array's lamina.toml.
pub fn append_config(dir: &Path, text: &str) {
    let cfg = dir.join("lamina.toml");
    let old = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, format!("{old}\n{text}")).unwrap();
}

pub fn status_json(dir: &Path) -> serde_json::Value {
    let out = lamina(&["status", dir.to_str().unwrap(), "--json"]);
    serde_json::from_str(&out).expect("status --json is JSON")
}

/// A running `lamina serve`.
pub struct Server {
    pub child: Child,
    pub dir: PathBuf,
    pub sock: PathBuf,
}

impl Server {
    pub fn start(dir: &Path) -> Server {
        Self::start_env(dir, &[])
    }

    /// Starts `lamina serve DIR` with extra environment variables.
    pub fn start_env(dir: &Path, env: &[(&str, &str)]) -> Server {
        Self::start_with(dir, env, &[])
    }

    /// Starts `lamina serve DIR` with extra environment variables and options.
    pub fn start_with(dir: &Path, env: &[(&str, &str)], args: &[&str]) -> Server {
        let sock = dir.join("nbd.sock");
        let _ = std::fs::remove_file(&sock);
        let child = Command::new(lamina_bin())
            .envs(env.iter().copied())
            .args([
                "serve",
                dir.to_str().unwrap(),
                "--unix",
                sock.to_str().unwrap(),
            ])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start lamina serve");
        let mut s = Server {
            child,
            dir: dir.to_path_buf(),
            sock,
        };
        let t0 = Instant::now();
        while !s.sock.exists() || std::os::unix::net::UnixStream::connect(&s.sock).is_err() {
            if let Ok(Some(status)) = s.child.try_wait() {
                let mut err = String::new();
                use std::io::Read;
                s.child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut err)
                    .unwrap();
                panic!("lamina serve exited with {status}:\n{err}");
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "lamina serve did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        // Keep draining stderr so the server never blocks on a full pipe.
        let mut err = s.child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut err, &mut std::io::sink());
        });
        s
    }

    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.sock.display())
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL: the process dies with whatever it had in memory.
    pub fn kill9(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGINT: flush, checkpoint, exit. Panics unless it exits cleanly.
    pub fn stop(self) {
        self.stop_with(libc::SIGINT)
    }

    /// Stops the server with `signal` (SIGINT or SIGTERM); panics unless it exits
    /// cleanly.
    pub fn stop_with(mut self, signal: i32) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.pid(), signal) };
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                assert!(st.success(), "lamina serve exited with {st}");
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "lamina serve did not stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Background processes and a FUSE mount point, cleaned up on drop even when a test
/// fails: unmount first (lazily, in case the server is already gone), then kill.
pub struct Guard {
    pub mounts: Vec<PathBuf>,
    pub children: Vec<Child>,
}

impl Guard {
    pub fn new() -> Guard {
        Guard {
            mounts: Vec::new(),
            children: Vec::new(),
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        for m in &self.mounts {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg("-z")
                .arg(m)
                .stderr(Stdio::null())
                .status();
        }
        for c in self.children.iter_mut().rev() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits for a path to appear.
pub fn wait_for(p: &Path) {
    use std::os::unix::fs::FileTypeExt;
    let t0 = Instant::now();
    // A socket's file appears when it is bound, a moment before it listens:
    // wait until a connection is taken.
    let ready = || match std::fs::metadata(p) {
        Ok(m) if m.file_type().is_socket() => std::os::unix::net::UnixStream::connect(p).is_ok(),
        Ok(_) => true,
        Err(_) => false,
    };
    while !ready() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{} did not appear",
            p.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Starts nbdkit with `args` on a Unix socket in `t` and exposes its export as a
/// regular file with nbdfuse. Returns (nbdkit, nbdfuse, the file). The mount point is
/// `t.join("fuse")`; callers unmount it (see [`Guard`]).
pub fn nbdkit_as_file(t: &TempDir, args: &[&str]) -> (Child, Child, PathBuf) {
    let sock = t.join("kit.sock");
    let _ = std::fs::remove_file(&sock);
    let kit = Command::new("nbdkit")
        .args(["--foreground", "-U", sock.to_str().unwrap()])
        .args(args)
        .stdout(Stdio::null())
        .spawn()
        .expect("nbdkit");
    wait_for(&sock);
    let fuse_dir = t.join("fuse");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let file = fuse_dir.join("dev");
    let fuse = Command::new("nbdfuse")
        .arg(&file)
        .args(["--unix", sock.to_str().unwrap()])
        .stdout(Stdio::null())
        .spawn()
        .expect("nbdfuse");
    wait_for(&file);
    (kit, fuse, file)
}

/// `len` bytes of xorshift noise from `seed` (nonzero), none of them zero: data no
/// client or server mistakes for a hole.
pub fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8 | 1
        })
        .collect()
}

/// A child process killed on drop.
pub struct Proc(pub Child);
impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nbdkit with a write-back cache over `backing`, exposed as `fuse/dev`.
pub fn cached_device(t: &TempDir, backing: &Path) -> (Proc, Proc) {
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

/// Unmounts `t/fuse`. A killed server's io_uring requests on the file are torn
/// down in the background (they end when nbdfuse answers them), and the mount is
/// busy until then: retry for a while.
pub fn unmount_fuse(t: &TempDir) {
    let t0 = std::time::Instant::now();
    while !Command::new("fusermount3")
        .arg("-u")
        .arg(t.join("fuse"))
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
        && t0.elapsed() < Duration::from_secs(10)
        && std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .contains(&format!(" {} ", t.join("fuse").display()))
    {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// What a test of ext4 on a volume through [`Stack`] runs.
pub const EXT4_TOOLS: &[&str] = &[
    "nbdfuse",
    "fusermount3",
    "losetup",
    "mkfs.ext4",
    "e2fsck",
    "mount",
    "sha256sum",
];

/// nbdfuse + loop device + mount point, torn down in reverse order on drop.
pub struct Stack {
    fuse_dir: PathBuf,
    nbdfuse: Option<Child>,
    loopdev: Option<String>,
    mounted: Option<PathBuf>,
}

impl Stack {
    pub fn attach(uri: &str, fuse_dir: &Path) -> Stack {
        std::fs::create_dir_all(fuse_dir).unwrap();
        let child = Command::new("nbdfuse")
            .arg(fuse_dir.join("disk"))
            .arg(uri)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("nbdfuse");
        let mut s = Stack {
            fuse_dir: fuse_dir.to_path_buf(),
            nbdfuse: Some(child),
            loopdev: None,
            mounted: None,
        };
        let t0 = Instant::now();
        while !fuse_dir.join("disk").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "nbdfuse did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let dev = run(
            "losetup",
            &["-f", "--show", fuse_dir.join("disk").to_str().unwrap()],
        );
        s.loopdev = Some(dev.trim().to_string());
        s
    }
    pub fn dev(&self) -> &str {
        self.loopdev.as_deref().unwrap()
    }
    pub fn mount(&mut self, at: &Path) {
        self.mount_with(at, "defaults");
    }
    pub fn mount_with(&mut self, at: &Path, options: &str) {
        std::fs::create_dir_all(at).unwrap();
        run("mount", &["-o", options, self.dev(), at.to_str().unwrap()]);
        self.mounted = Some(at.to_path_buf());
    }
    pub fn unmount(&mut self) {
        if let Some(m) = self.mounted.take() {
            run("umount", &[m.to_str().unwrap()]);
        }
    }
    pub fn detach(&mut self) {
        self.unmount();
        if let Some(d) = self.loopdev.take() {
            run("losetup", &["-d", &d]);
        }
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.fuse_dir)
                .status();
            let t0 = Instant::now();
            while c.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Stack {
    /// A power cut seen from above: the NBD client dies first (kill -9), then the
    /// file system is detached lazily and the loop device let go. Whatever the
    /// kernel still held for them is lost, as it would be with the machine's power.
    pub fn cut(&mut self) {
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        if let Some(m) = self.mounted.take() {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        if let Some(d) = self.loopdev.take() {
            let _ = Command::new("losetup").args(["-d", &d]).status();
        }
        let _ = Command::new("fusermount3")
            .args(["-u", "-z"])
            .arg(&self.fuse_dir)
            .stderr(Stdio::null())
            .status();
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(m) = self.mounted.take() {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        if let Some(d) = self.loopdev.take() {
            let _ = Command::new("losetup").args(["-d", &d]).status();
        }
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.fuse_dir)
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs fio with `args` and returns its JSON report.
pub fn fio(args: &[String]) -> serde_json::Value {
    let out = run("fio", &args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    serde_json::from_str(&out[out.find('{').expect("fio printed JSON")..]).expect("fio JSON")
}

/// fio arguments for 4 KiB random writes at iodepth 32 over NBD, verified with
/// crc32c (fatal on the first mismatch), JSON output.
pub fn fio_job(name: &str, uri: &str, vol: u64, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
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
    a.push(format!("--name={name}"));
    a.push(format!("--uri={uri}"));
    a.push(format!("--size={vol}"));
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// Bytes written and read (verified) by fio's first job; fails on its error.
pub fn fio_ok(j: &serde_json::Value) -> (u64, u64) {
    let job = &j["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error: {job}");
    (
        job["write"]["io_bytes"].as_u64().unwrap(),
        job["read"]["io_bytes"].as_u64().unwrap(),
    )
}

/// kill -9 in the middle of random writes: starts fio (job `name`, five passes
/// over volume `v` of `vol` bytes, no verification) against `s`, kills the server
/// once half the volume more has been written, and restarts it.
pub fn kill9_while_writing(s: Server, name: &str, vol: u64) -> Server {
    let dir = s.dir.clone();
    let mut bg = Command::new("fio")
        .args(fio_job(
            name,
            &s.uri("v"),
            vol,
            &["--loops=5", "--do_verify=0"],
        ))
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
    Server::start(&dir)
}

/// A pass over volume `v` (`vol` bytes) written by fio job `name` and flushed,
/// then kill -9 and a restart: every block verifies. Returns the new server.
pub fn kill9_after_flush(s: Server, name: &str, vol: u64) -> Server {
    let (w, _) = fio_ok(&fio(&fio_job(
        name,
        &s.uri("v"),
        vol,
        &["--do_verify=0", "--end_fsync=1"],
    )));
    assert!(w >= vol);
    let dir = s.dir.clone();
    s.kill9();
    let s = Server::start(&dir);
    let (_, r) = fio_ok(&fio(&fio_job(name, &s.uri("v"), vol, &["--verify_only"])));
    assert!(r >= vol, "verified {r} of {vol} after kill -9");
    s
}

/// The array's name (`status --json`), which labels its metrics.
#[allow(dead_code)]
pub fn array_name(dir: &Path) -> String {
    status_json(dir)["array"]["name"]
        .as_str()
        .unwrap()
        .to_string()
}

/// A free TCP port on 127.0.0.1, for a server's `--metrics`.
#[allow(dead_code)]
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The metrics page of a server started with `--metrics 127.0.0.1:PORT` (tried
/// for up to 5 s while the server starts).
#[allow(dead_code)]
pub fn scrape(port: u16) -> String {
    use std::io::{Read, Write};
    let mut body = String::new();
    for _ in 0..100 {
        if let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            s.read_to_string(&mut body).unwrap();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

/// The value of sample `lamina_NAME{array="ARRAY"LABELS}` on a metrics page
/// (`labels`: those after the array's, each with its leading comma).
#[allow(dead_code)]
pub fn sample(body: &str, array: &str, name: &str, labels: &str) -> f64 {
    let key = format!("lamina_{name}{{array=\"{array}\"{labels}}} ");
    let line = body
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("no {key} in\n{body}"));
    line[key.len()..].parse().unwrap()
}
