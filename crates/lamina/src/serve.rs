//! `lamina serve`: recover the array, start the engine, listen for NBD clients.

use crate::config::Config;
use crate::runtime::{LaminaBackend, Runtime};
use crate::size::{human, parse_size};
use crate::{absolute, create_array, default_dir, open_array};
use anyhow::{bail, Context, Result};
use lamina_core::{FormatParams, OpenMode, Request};
use lamina_nbd::{Listener, TlsPolicy};
use std::io::{Read, Write};
use std::net::TcpListener;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Where the embedded default array listens on TCP.
const DEFAULT_TCP: &str = "127.0.0.1:10809";

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Array directory (default ./lamina-data, created with a default array if empty).
    dir: Option<PathBuf>,
    /// Listen on this Unix socket instead of the one in lamina.toml (DIR/nbd.sock
    /// unless changed there). Relative to the current directory.
    #[arg(long, value_name = "PATH", conflicts_with = "no_unix")]
    unix: Option<PathBuf>,
    /// Listen on this TCP address instead of the one in lamina.toml (the embedded
    /// default has 127.0.0.1:10809, `array create` none unless given --tcp).
    #[arg(long, value_name = "HOST:PORT", conflicts_with = "no_tcp")]
    tcp: Option<String>,
    /// Do not listen on a Unix socket (TCP only).
    #[arg(long)]
    no_unix: bool,
    /// Do not listen on TCP.
    #[arg(long)]
    no_tcp: bool,
    /// Serve Prometheus metrics on HOST:PORT at /metrics.
    #[arg(long, value_name = "HOST:PORT")]
    metrics: Option<String>,
    /// TLS certificate chain (PEM) of the server. With --tls-key, clients may start
    /// TLS (NBD_OPT_STARTTLS) and on TCP they must: plaintext is refused.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Certificate authorities (PEM) that client certificates must chain to; with
    /// it, clients without a valid certificate are refused.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// Size of the backing file when creating the embedded default array.
    #[arg(long, default_value = "8G", value_name = "SIZE")]
    default_size: String,
    /// Serve every volume read-only (NBD_FLAG_READ_ONLY): writes, trims and zeroes
    /// get EPERM. `[serve] read_only_volumes` names single volumes.
    #[arg(long)]
    read_only: bool,
}

/// Logs to standard error and to the array's log file.
#[derive(Clone)]
struct Tee(Arc<Mutex<Option<std::fs::File>>>);

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        if let Some(f) = self.0.lock().unwrap().as_mut() {
            let _ = f.write_all(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Starts logging to standard error and `log_file`; the handle reopens the file
/// (SIGHUP, after log rotation).
fn init_logging(log_file: &Path) -> Tee {
    let tee = Tee(Arc::new(Mutex::new(open_log(log_file))));
    let filter = tracing_subscriber::EnvFilter::try_from_env("LAMINA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let writer = tee.clone();
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .try_init();
    tee
}

fn open_log(log_file: &Path) -> Option<std::fs::File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_file)
        .ok()
}

/// Binds a Unix socket, replacing a stale socket file but never a live server's.
fn bind_unix(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        if UnixStream::connect(path).is_ok() {
            bail!(
                "{} is in use: is another `lamina serve` running?",
                path.display()
            );
        }
        std::fs::remove_file(path)
            .with_context(|| format!("cannot remove stale socket {}", path.display()))?;
    }
    UnixListener::bind(path).with_context(|| format!("cannot listen on {}", path.display()))
}

/// Creates the embedded default: one sparse file, one volume filling it.
fn create_default(dir: &Path, size: u64) -> Result<()> {
    let img = dir.join("default.img");
    eprintln!(
        "lamina: {} holds no array; creating the default: {} (sparse, {}) with volume \"default\"",
        dir.display(),
        img.display(),
        human(size)
    );
    create_array(
        dir,
        &[(img, Some(size))],
        FormatParams {
            name: "default".into(),
            ..Default::default()
        },
        None,
        // The embedded default also listens on loopback TCP (the README's quick
        // start); arrays made with `array create` only where told to.
        Some(DEFAULT_TCP.into()),
    )?;
    let (mut engine, _) = open_array(dir, OpenMode::ReadWrite)?;
    let usable = engine.usable_bytes() / (1 << 20) * (1 << 20);
    let token = lamina_core::Token { conn: 0, handle: 1 };
    engine.submit(
        token,
        Request::CreateVolume {
            name: "default".into(),
            size_bytes: usable,
        },
    );
    lamina_core::run_inline(&mut engine);
    let mut replies = Vec::new();
    engine.drain_replies(&mut replies);
    replies
        .into_iter()
        .find(|r| r.token == token)
        .context("volume creation did not complete")?
        .result?;
    Ok(())
}

/// The TLS setup from the command line, else from `[serve]` in the config; `None`
/// when neither names a certificate. A bad certificate or key stops the server
/// before it opens the array.
fn tls_config(
    a: &ServeArgs,
    cfg: &Config,
    dir: &Path,
) -> Result<Option<Arc<lamina_nbd::tls::ServerConfig>>> {
    let (cert, key, ca) = if a.tls_cert.is_some() {
        (a.tls_cert.clone(), a.tls_key.clone(), a.tls_ca.clone())
    } else {
        let s = &cfg.serve;
        let r = |p: &Option<PathBuf>| p.as_ref().map(|p| Config::resolve(dir, p));
        (r(&s.tls_cert), r(&s.tls_key), r(&s.tls_ca))
    };
    match (cert, key) {
        (None, None) if ca.is_none() => Ok(None),
        (Some(cert), Some(key)) => {
            let config = lamina_nbd::tls::load_config(&cert, &key, ca.as_deref())
                .map_err(anyhow::Error::msg)?;
            Ok(Some(Arc::new(config)))
        }
        _ => bail!("TLS needs both a certificate and a key (tls_cert and tls_key in [serve])"),
    }
}

/// Serves Prometheus scrapes one at a time on this one thread: a scrape is small
/// and rare, and a flood of them must not become a thread each. A client gets 2 s to
/// send its request and to take the answer. Requests are parsed by `httparse`.
fn serve_metrics(listener: TcpListener, rt: Runtime) {
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let timeout = Some(std::time::Duration::from_secs(2));
        let _ = conn.set_read_timeout(timeout);
        let _ = conn.set_write_timeout(timeout);
        let (code, body, head_only) = match read_request_head(&mut conn) {
            Some((_, path)) if path != "/metrics" => {
                ("404 Not Found", "try /metrics\n".to_string(), false)
            }
            Some((method, _)) if method != "GET" && method != "HEAD" => (
                "405 Method Not Allowed",
                "GET /metrics\n".to_string(),
                false,
            ),
            Some((method, _)) => match rt.call(Request::Status) {
                Ok(Some(s)) => (
                    "200 OK",
                    crate::output::running_metrics_text(&s),
                    method == "HEAD",
                ),
                _ => (
                    "503 Service Unavailable",
                    "engine unavailable\n".to_string(),
                    false,
                ),
            },
            None => (
                "400 Bad Request",
                "not an HTTP request\n".to_string(),
                false,
            ),
        };
        // HEAD gets the headers GET would, the length of its body included.
        let _ = write!(
            conn,
            "HTTP/1.1 {code}\r\nContent-Type: {METRICS_CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
            body.len(),
            if head_only { "" } else { &body }
        );
    }
}

/// What the exposition is (OpenMetrics text, which Prometheus asks for first).
const METRICS_CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Reads an HTTP request's head (at most 8 KiB, within the socket's timeout) and
/// returns its method and path, or `None` if the client sent something else or
/// too much, or stopped before the head was complete.
fn read_request_head(conn: &mut impl Read) -> Option<(String, String)> {
    let mut buf = [0u8; 8192];
    let mut n = 0;
    loop {
        let got = conn.read(&mut buf[n..]).ok()?;
        if got == 0 {
            return None;
        }
        n += got;
        let mut headers = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut headers);
        match req.parse(&buf[..n]) {
            Ok(httparse::Status::Complete(_)) => {
                return Some((req.method?.to_string(), req.path?.to_string()))
            }
            Ok(httparse::Status::Partial) if n < buf.len() => continue,
            _ => return None,
        }
    }
}

/// Blocks SIGINT, SIGTERM and SIGHUP in this thread (and threads spawned after), so
/// that `wait_for_signal` receives them instead of their killing the process
/// (closing the terminal sends SIGHUP).
pub(crate) fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal mask manipulation on a local set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

pub(crate) fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    let mut sig = 0;
    // SAFETY: waits for one of the blocked signals.
    unsafe { libc::sigwait(set, &mut sig) };
    sig
}

/// Keeps freed request payloads from staying in the heap.
///
/// glibc serves allocations of 128 KiB and more with mmap and returns them on free,
/// but after the first such free it raises that threshold to the freed size, so
/// from then on a client's 1 MiB write payloads come from the heap and stay there
/// once freed: 12-14 MiB more resident set after a 64 GiB fill (84.3 MiB against
/// 69.7 MiB, `bench/memory.sh 64G`), which is what put the server over its memory
/// budget. Setting the threshold fixes it at 128 KiB. The cost is an mmap and its
/// page faults per large payload; a bounded pool of payload buffers in the NBD
/// layer would avoid both and is the better fix.
fn keep_large_allocations_out_of_the_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter, under glibc's own lock.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 << 10);
    }
}

pub fn run(a: ServeArgs) -> Result<()> {
    keep_large_allocations_out_of_the_heap();
    let explicit = a.dir.is_some();
    let dir = absolute(&a.dir.clone().unwrap_or_else(default_dir))?;
    if !Config::exists(&dir) {
        // Only the implicit ./lamina-data is created on first use: a DIR given on
        // the command line that holds no array is more likely a typo than a wish
        // for a new, empty array.
        if explicit {
            bail!(
                "{} holds no Lamina array (no {}); create one with `lamina array create {} \
                 --device PATH:SIZE`, or run `lamina serve` without DIR to use ./lamina-data",
                dir.display(),
                crate::config::CONFIG_FILE,
                dir.display()
            );
        }
        let empty = !dir.exists() || std::fs::read_dir(&dir)?.next().is_none();
        if !empty {
            bail!(
                "{} holds no Lamina array and is not empty; create one with `lamina array create`",
                dir.display()
            );
        }
        let size = crate::size_arg("--default-size", &a.default_size)?;
        create_default(&dir, size)?;
    }
    let cfg = Config::load(&dir)?;
    // Each endpoint on the command line replaces its own kind from the config
    // only; paths on the command line are relative to the current directory,
    // paths in the config to DIR.
    let unix = match &a.unix {
        _ if a.no_unix => None,
        Some(p) => Some(absolute(p)?),
        None => cfg.serve.unix.as_ref().map(|p| Config::resolve(&dir, p)),
    };
    let tcp = match &a.tcp {
        _ if a.no_tcp => None,
        Some(t) => Some(t.clone()),
        None => cfg.serve.tcp.clone(),
    };
    if unix.is_none() && tcp.is_none() {
        return Err(crate::Usage(
            "nothing to listen on: give --unix or --tcp (lamina.toml names neither)".into(),
        )
        .into());
    }
    let tls = tls_config(&a, &cfg, &dir)?;
    let limits = cfg
        .engine
        .volumes
        .iter()
        .map(|(name, v)| Ok((name.clone(), v.limits(name)?)))
        .collect::<Result<Vec<_>>>()?;
    if let Some(n) = cfg.serve.read_threads {
        if !(1..=1024).contains(&n) {
            bail!("[serve] read_threads = {n}: give 1 to 1024");
        }
        lamina_nbd::server::set_read_threads(n);
    }
    let io_nice = cfg.serve.io_nice()?;
    let log_file = Config::resolve(&dir, &cfg.log_file);
    let log = init_logging(&log_file);
    let signals = block_signals();

    let started = Instant::now();
    crate::notify::notify("STATUS=opening the array (recovery after a crash may take a while)");
    let (engine, report) = open_array(&dir, OpenMode::ReadWrite)?;
    let io = cfg.io_options()?;
    tracing::info!("devices driven by {}", io.describe());
    tracing::info!(
        "recovered array {:?} in {:.2}s: checkpoint generation {} ({} blocks), {} units / {} blocks / {} trims replayed from {} segments, {} torn blocks ignored, parity of {} rows resynced ({} mismatched, {} segments moved), {} read",
        engine.superblock().array_name,
        started.elapsed().as_secs_f64(),
        report.checkpoint_generation,
        report.checkpoint_blocks,
        report.units_replayed,
        report.blocks_replayed,
        report.trims_replayed,
        report.segments_scanned,
        report.torn_blocks_ignored,
        report.resync_rows,
        report.resync_mismatched,
        report.resync_relocated_segments,
        human(report.bytes_read)
    );
    let status = engine.status();
    let rt = Runtime::start(engine, cfg.serve.io_threads, io_nice);
    for (name, l) in limits.into_iter().filter(|(_, l)| !l.is_none()) {
        rt.qos.set(&name, l);
    }
    let rebuild_rate = cfg
        .serve
        .rebuild_rate
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(anyhow::Error::msg)
        .context("[serve] rebuild_rate")?;
    crate::rebuild::resume_all(&rt, rebuild_rate);
    if let Some(cap) = &cfg.serve.max_inflight {
        let cap = parse_size(cap)
            .map_err(anyhow::Error::msg)
            .context("[serve] max_inflight")?;
        lamina_nbd::server::set_inflight_limit(cap);
    }
    let backend = Arc::new(LaminaBackend {
        rt: rt.clone(),
        read_only: crate::runtime::ReadOnly {
            all: a.read_only || cfg.serve.read_only,
            volumes: cfg.serve.read_only_volumes.iter().cloned().collect(),
        },
    });
    let stop = Arc::new(AtomicBool::new(false));

    let mut sockets = Vec::new();
    let mut endpoints = Vec::new();
    if let Some(path) = &unix {
        let l = bind_unix(path)?;
        sockets.push(path.clone());
        endpoints.push(format!("unix:{}", path.display()));
        let (b, s) = (backend.clone(), stop.clone());
        // A Unix socket is guarded by file permissions: TLS is offered there, not
        // required.
        let policy = tls.clone().map(|config| TlsPolicy {
            config,
            required: false,
        });
        std::thread::spawn(move || lamina_nbd::serve(b, Listener::Unix(l), policy, s));
    }
    let mut tcp_bound = None;
    if let Some(addr) = &tcp {
        match TcpListener::bind(addr) {
            Ok(l) => {
                tcp_bound = Some(addr.clone());
                let policy = tls.clone().map(|config| TlsPolicy {
                    config,
                    required: true,
                });
                endpoints.push(if policy.is_some() {
                    format!("tcp:{addr} (TLS required)")
                } else {
                    format!("tcp:{addr}")
                });
                let (b, s) = (backend.clone(), stop.clone());
                std::thread::spawn(move || lamina_nbd::serve(b, Listener::Tcp(l), policy, s));
            }
            // Configs written before `array create --tcp` existed all name the
            // old default address: there, and for the embedded default, a second
            // array on the host goes on without TCP (said loudly), as it did.
            Err(e) if a.tcp.is_none() && addr == DEFAULT_TCP => {
                tracing::warn!(
                    "not listening on TCP {addr}: {e} (another array's server has it; \
                     serving on the Unix socket only; give [serve] tcp in {} another \
                     address, or remove it)",
                    Config::path(&dir).display()
                );
            }
            // Asked for (here or in lamina.toml), so not served without it: a
            // client would find another server, or none, at that address.
            Err(e) => bail!(
                "cannot listen on TCP {addr}: {e} (another server there? give --tcp \
                 HOST:PORT or --no-tcp, or change [serve] tcp in {})",
                Config::path(&dir).display()
            ),
        }
    }
    let admin_path = Config::resolve(&dir, &cfg.admin_socket);
    let admin = bind_unix(&admin_path)?;
    sockets.push(admin_path.clone());
    {
        let rt = rt.clone();
        std::thread::spawn(move || crate::admin::serve(admin, rt, io));
    }
    if let Some(addr) = a.metrics.or(cfg.serve.metrics.clone()) {
        let l = TcpListener::bind(&addr)
            .with_context(|| format!("cannot listen for metrics on {addr}"))?;
        let rt = rt.clone();
        std::thread::spawn(move || serve_metrics(l, rt));
        tracing::info!("metrics at http://{addr}/metrics");
    }

    // The banner goes to standard output, which may be closed (`lamina serve |
    // head -1`, a closed terminal): a failed write there must not stop the server.
    let mut out = String::new();
    macro_rules! outln {
        ($o:expr, $($t:tt)*) => {{
            use std::fmt::Write as _;
            let _ = writeln!($o, $($t)*);
        }};
    }
    let first = status.volumes.first().map(|v| v.name.clone());
    outln!(
        out,
        "lamina: serving array {:?} ({}, usable {}) on {}",
        status.array_name,
        status.layout,
        human(status.usable_bytes),
        endpoints.join(", ")
    );
    for v in &status.volumes {
        outln!(out, "  volume {:?}: {}", v.name, human(v.size_bytes));
    }
    if let Some(vol) = first {
        outln!(out, "\nConnect with:");
        if let Some(p) = &unix {
            let uri = format!("nbd+unix:///{vol}?socket={}", p.display());
            outln!(out, "  nbdinfo '{uri}'");
            outln!(out, "  mkdir -p /tmp/lamina && nbdfuse /tmp/lamina/{vol} '{uri}' &   # then: losetup -f --show /tmp/lamina/{vol}");
            outln!(out, "  nbd-client -unix {} -N {vol} /dev/nbd0", p.display());
            outln!(
                out,
                "  qemu-system-x86_64 -drive file=nbd:unix:{}:exportname={vol},format=raw,cache=none ...",
                p.display()
            );
        }
        if let Some(addr) = &tcp_bound {
            outln!(out, "  nbdinfo nbd://{addr}/{vol}");
        }
        outln!(
            out,
            "Status: lamina status {}   Stop: Ctrl-C (flushes and checkpoints)",
            dir.display()
        );
    } else {
        outln!(
            out,
            "The array has no volume yet: lamina volume create {} NAME --size SIZE",
            dir.display()
        );
    }

    let mut stdout = std::io::stdout();
    let _ = stdout
        .write_all(out.as_bytes())
        .and_then(|_| stdout.flush());
    // Every listener is bound and the array open: clients can connect.
    let serving = format!(
        "STATUS=serving array {:?} on {}",
        status.array_name,
        endpoints.join(", ")
    );
    crate::notify::notify(&format!(
        "READY=1\n{serving}\nMAINPID={}",
        std::process::id()
    ));

    let sig = loop {
        match wait_for_signal(&signals) {
            libc::SIGHUP => {
                // As daemons do: reopen the log (after rotation) and make everything
                // durable, then go on serving.
                *log.0.lock().unwrap() = open_log(&log_file);
                tracing::info!("SIGHUP: log reopened; flushing and writing a checkpoint");
                crate::notify::notify("STATUS=SIGHUP: flushing and writing a checkpoint");
                let r = rt
                    .call(Request::Flush)
                    .and_then(|_| rt.call(Request::Checkpoint));
                match r {
                    Ok(_) => tracing::info!("SIGHUP: checkpoint written"),
                    Err(e) => tracing::error!("SIGHUP: flush or checkpoint failed: {e}"),
                }
                crate::notify::notify(&serving);
            }
            sig => break sig,
        }
    };
    tracing::info!("signal {sig}: flushing and writing a checkpoint");
    crate::notify::notify("STOPPING=1\nSTATUS=flushing and writing a checkpoint");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    let result = rt.shutdown();
    for s in &sockets {
        let _ = std::fs::remove_file(s);
    }
    match result {
        Ok(()) => {
            tracing::info!("clean shutdown");
            Ok(())
        }
        Err(e) => bail!("shutdown checkpoint failed: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::read_request_head;

    /// A client that sends its bytes in the pieces given.
    struct Pieces(Vec<&'static [u8]>);

    impl std::io::Read for Pieces {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0.is_empty() {
                return Ok(0);
            }
            let p = self.0[0];
            let n = p.len().min(buf.len());
            buf[..n].copy_from_slice(&p[..n]);
            if n == p.len() {
                self.0.remove(0);
            } else {
                self.0[0] = &p[n..];
            }
            Ok(n)
        }
    }

    #[test]
    fn a_request_head_in_pieces_is_read_whole() {
        let mut c = Pieces(vec![b"GET /met", b"rics HTTP/1.1\r\nHost: x\r\n", b"\r\n"]);
        assert_eq!(
            read_request_head(&mut c),
            Some(("GET".into(), "/metrics".into()))
        );
    }

    #[test]
    fn garbage_a_cut_head_and_a_flood_are_refused() {
        assert_eq!(
            read_request_head(&mut Pieces(vec![b"\x16\x03\x01 tls"])),
            None
        );
        assert_eq!(
            read_request_head(&mut Pieces(vec![b"GET /metrics HTTP/1.1\r\n"])),
            None
        );
        let long: &'static [u8] = Box::leak(
            format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(9000))
                .into_bytes()
                .into_boxed_slice(),
        );
        let pieces = long.chunks(1000).collect();
        assert_eq!(read_request_head(&mut Pieces(pieces)), None);
    }
}
