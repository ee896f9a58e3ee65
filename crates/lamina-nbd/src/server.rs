//! The NBD server: handshake and transmission, over any [`Backend`].
//!
//! Each connection has two threads. The *reader* parses requests: reads go to the
//! listener's [`ReadPool`], whose threads run the backend's read path in parallel
//! (so one connection keeps as many device reads in flight as it sends, and they
//! complete out of order, as the protocol allows); writes, trims, zeroes and
//! flushes are handed to the backend with the connection's completion channel.
//! Whoever completes a request writes its reply straight to the socket when the
//! socket is free and takes it without blocking; otherwise the connection's
//! *replier* writes it, in batches. Up to [`MAX_INFLIGHT`] requests per connection
//! are outstanding at once; beyond that the reader waits, which is the backpressure
//! a client feels.
//!
//! Protocol violations end only their own connection. Errors a request can carry
//! (out of range, bad flags, too long) get an error reply and the connection goes on.

use crate::proto::*;
use crate::ring::ConnRing;
use crate::stats::{ConnStats, Op};
use crate::tls::TlsPolicy;
use crossbeam_channel::{bounded, Receiver, Sender};
use std::cell::RefCell;
use std::io::{self, BufReader, IoSlice, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Requests one connection may have outstanding.
pub const MAX_INFLIGHT: usize = 256;
/// Write payload bytes one connection may have outstanding (beyond one request).
pub const MAX_INFLIGHT_BYTES: u64 = 64 << 20;
/// Connections served at once, over all listeners; more are closed on accept.
pub const MAX_CONNECTIONS: usize = 256;
/// Default cap on request payload held in memory over all connections (write
/// payloads waiting for the backend, read buffers being filled); see
/// [`set_inflight_limit`].
pub const DEFAULT_INFLIGHT_LIMIT: u64 = 256 << 20;
/// How long a client may take over the handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(30);
/// Options one handshake may send before the server gives up on it.
const MAX_OPTIONS: usize = 1024;
/// Write buffers larger than this are not kept for reuse.
const POOL_KEEP_BYTES: usize = 1 << 20;
/// Most bytes of idle buffers one connection keeps for reuse (write and read pools
/// together): what a connection holds between bursts follows this, not the sizes
/// its client once asked for.
const POOL_BYTES_PER_CONNECTION: u64 = 4 << 20;

/// An export as listed and opened.
#[derive(Clone, Debug)]
pub struct ExportInfo {
    pub name: String,
    pub description: String,
    pub size: u64,
}

/// A request that completes asynchronously.
#[derive(Debug)]
pub enum Command {
    Write {
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    },
    /// Trim or write-zeroes: the range reads as zeros afterwards. `allocate`
    /// (write-zeroes with NBD_CMD_FLAG_NO_HOLE): the range must stay allocated, so
    /// that later writes there cannot fail for lack of space.
    Zero {
        offset: u64,
        length: u64,
        fua: bool,
        allocate: bool,
    },
    Flush,
}

impl Command {
    /// The write's payload, if this is a write: the buffer a completion hands back.
    pub fn into_buffer(self) -> Option<Vec<u8>> {
        match self {
            Command::Write { data, .. } => Some(data),
            _ => None,
        }
    }
}

/// One extent of a block status reply: `length` bytes with the same status flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub length: u32,
    pub flags: u32,
}

/// Extents one block status reply carries at most (the spec asks for no more than
/// 2^20; this keeps a reply at 512 KiB, and the client asks again for the rest).
pub const MAX_EXTENTS: usize = 1 << 16;

/// Block status buffers larger than this are not kept between requests.
const STATUS_KEEP_BYTES: usize = 64 << 10;

/// The metadata context id `base:allocation` is given (the only one served).
const ALLOCATION_CONTEXT: u32 = 1;

/// The completion of a [`Command`].
#[derive(Debug)]
pub struct Completion {
    pub handle: u64,
    pub error: u32,
    /// A write's buffer, returned for reuse.
    pub buf: Option<Vec<u8>>,
}

/// Where a read's data lies: `len` bytes (the request's) of descriptor `fd` at
/// `offset`, read by the connection with io_uring (see [`Backend::start_read`]).
/// `align`: the memory alignment the descriptor needs (O_DIRECT: 4096; 0 for
/// none); the connection reads into an aligned window of the buffer and moves the
/// data to its start before `finish_read`. `tag` is the backend's own: what it
/// needs to verify the data and release what the read holds.
#[derive(Debug)]
pub struct DeviceRead {
    pub fd: std::os::unix::io::RawFd,
    pub offset: u64,
    pub align: u32,
    pub tag: [u64; 2],
    /// A second read the backend needs to verify the data (a header), done on
    /// the same ring at the same time; its bytes go to [`Backend::finish_read`].
    pub header: Option<HeaderRead>,
}

/// `len` bytes of descriptor `fd` at `offset`, read beside a [`DeviceRead`] into a
/// buffer of the connection's (`align` as in [`DeviceRead`]).
#[derive(Debug, Clone, Copy)]
pub struct HeaderRead {
    pub fd: std::os::unix::io::RawFd,
    pub offset: u64,
    pub len: u32,
    pub align: u32,
}

/// How [`Backend::start_read`] started a read.
#[derive(Debug)]
pub enum ReadStart {
    /// Served: the buffer holds the data, or the read failed.
    Done(Result<(), u32>),
    /// To be read from a device by the connection.
    Device(DeviceRead),
    /// To be read on a read thread, where waiting is fine.
    Wait,
}

/// What [`Backend::finish_read`] made of a device read.
#[derive(Debug, PartialEq, Eq)]
pub enum Finished {
    /// Served: the buffer holds the data, or the read failed (with this error).
    Done(Result<(), u32>),
    /// Needs more than a check (it failed, or does not verify: to be read again,
    /// rebuilt, reported): the request goes to a read thread as a plain
    /// [`Backend::read`], so that the connection's other reads go on meanwhile.
    Again,
}

/// What serves the data.
pub trait Backend: Send + Sync + 'static {
    type Export: Send + Sync + 'static;
    fn exports(&self) -> Vec<ExportInfo>;
    /// Opens an export by name; `""` is the default export.
    fn open_export(&self, name: &str) -> Option<(Self::Export, ExportInfo)>;
    /// Reads synchronously (called on a read thread, or on the connection's reader
    /// thread when there is no read pool).
    fn read(&self, export: &Self::Export, offset: u64, buf: &mut [u8]) -> Result<(), u32>;
    /// Reads if that needs no wait for a device (data in memory, or in the page
    /// cache); `None` otherwise, and the read goes to a read thread. Called on the
    /// connection's reader thread, which serves cached reads without a hand-off.
    fn try_read(
        &self,
        export: &Self::Export,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Result<(), u32>> {
        let _ = (export, offset, buf);
        None
    }
    /// Whether this backend hands out [`DeviceRead`]s ([`Backend::start_read`]):
    /// then each connection gets an io_uring of its own for them. By default false.
    fn device_reads(&self) -> bool {
        false
    }
    /// Starts a read on the connection's reader thread: served at once if that
    /// needs no wait ([`ReadStart::Done`], as [`Backend::try_read`]); or where the
    /// data lies on a device, for the connection to read with io_uring and hand
    /// back to [`Backend::finish_read`] ([`ReadStart::Device`]); or
    /// [`ReadStart::Wait`], and the read goes to a read thread. Called only when
    /// [`Backend::device_reads`] is true. By default what `try_read` says.
    fn start_read(&self, export: &Self::Export, offset: u64, buf: &mut [u8]) -> ReadStart {
        match self.try_read(export, offset, buf) {
            Some(r) => ReadStart::Done(r),
            None => ReadStart::Wait,
        }
    }
    /// Finishes a read [`Backend::start_read`] started: `result` is what the
    /// device read of `read` into `buf` returned (bytes read), `header` the bytes
    /// of `read.header` and what reading them returned, when it asked for one.
    /// Called exactly once for every [`ReadStart::Device`], on the reader thread,
    /// which must not wait: whatever the read held (a pin) is released here, and a
    /// read that failed or does not verify is [`Finished::Again`] (read again on a
    /// read thread).
    fn finish_read(
        &self,
        export: &Self::Export,
        read: DeviceRead,
        buf: &mut [u8],
        result: io::Result<usize>,
        header: Option<(&[u8], io::Result<usize>)>,
    ) -> Finished {
        let _ = (export, read, buf, result, header);
        Finished::Done(Err(EIO))
    }
    /// The allocation status of the export from `offset` on (the `base:allocation`
    /// metadata context: [`STATE_HOLE`], [`STATE_ZERO`]), appended to `out` as at
    /// most `max` consecutive extents; `offset + length` lies within the export.
    /// The extents may cover less than `length` (the client asks again from where
    /// they end) or, the last one, a little more. Called on the connection's reader
    /// thread, so it must not wait for a device. By default the whole range is
    /// reported allocated with unknown contents (status 0), which the protocol
    /// always allows.
    fn block_status(
        &self,
        export: &Self::Export,
        offset: u64,
        length: u32,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), u32> {
        let _ = (export, offset, max);
        out.push(Extent { length, flags: 0 });
        Ok(())
    }
    /// True if the export takes no writes: it is advertised read-only
    /// (`NBD_FLAG_READ_ONLY`, without trim and zeroes) and writes, trims and zeroes
    /// get `EPERM`. By default false.
    fn read_only(&self, export: &Self::Export) -> bool {
        let _ = export;
        false
    }
    /// A hint that the client is about to use `length` bytes at `offset`
    /// (`NBD_CMD_CACHE`): the backend may start bringing them closer. It must not
    /// wait for a device (it runs on the connection's reader thread), and what it
    /// does must not change what reads return. By default nothing.
    fn cache(&self, export: &Self::Export, offset: u64, length: u32) -> Result<(), u32> {
        let _ = (export, offset, length);
        Ok(())
    }
    /// A data request of `bytes` payload (reads, writes, trims and zeroes, the last
    /// two with none) arrives: how long its connection waits before starting it,
    /// to hold the export to a rate (quality of service). By default no wait.
    fn pace(&self, export: &Self::Export, bytes: u64) -> Duration {
        let _ = (export, bytes);
        Duration::ZERO
    }
    /// Whether a wait [`Backend::pace`] asked for at `since` still holds (false:
    /// the limits changed or the export is going away; the request goes on).
    fn pace_holds(&self, export: &Self::Export, since: Instant) -> bool {
        let _ = (export, since);
        true
    }
    /// Starts a command; its completion must eventually reach `reply`
    /// ([`ReplySink::complete`]) with the `handle` given here. The handle is the
    /// server's own number for the request (below [`MAX_INFLIGHT`], not the client's
    /// handle, and never that of another request in flight); completing any other
    /// value is a bug and panics.
    fn submit(&self, export: &Self::Export, handle: u64, cmd: Command, reply: &Arc<ReplySink>);
    /// Starts a command while more of the connection's requests are already
    /// buffered: the backend may hold it until the next [`Backend::submit`] or
    /// [`Backend::kick`] of this connection, to work through the burst at once (and
    /// answer it with one write). The server calls one of those before it waits for
    /// anything. By default the same as `submit`.
    fn submit_deferred(
        &self,
        export: &Self::Export,
        handle: u64,
        cmd: Command,
        reply: &Arc<ReplySink>,
    ) {
        self.submit(export, handle, cmd, reply)
    }
    /// Starts what [`Backend::submit_deferred`] held (the connection is about to
    /// wait).
    fn kick(&self) {}
    /// True while the server is shutting down (new options are refused).
    fn shutting_down(&self) -> bool {
        false
    }
    /// A connection entered the transmission phase on `export`; calling `disconnect`
    /// closes it (for a backend that must take an export away from its clients).
    fn attach(&self, _export: &Self::Export, _disconnect: Box<dyn Fn() + Send + Sync>) {}
}

/// A stream a connection runs over.
pub trait Conn: Read + Write + Send + 'static {
    fn raw_fd(&self) -> std::os::unix::io::RawFd;
    fn try_clone_conn(&self) -> io::Result<Box<dyn Conn>>;
    fn set_read_timeout_conn(&self, d: Option<Duration>) -> io::Result<()>;
    fn shutdown_conn(&self);
    /// Reads what has already arrived without waiting: `Ok(None)` when nothing has
    /// (or the connection cannot tell, as TLS cannot).
    fn read_now(&mut self, _buf: &mut [u8]) -> io::Result<Option<usize>> {
        Ok(None)
    }
}

/// Both socket types implement [`Conn`] the same way.
macro_rules! impl_conn {
    ($t:ty) => {
        impl Conn for $t {
            fn raw_fd(&self) -> std::os::unix::io::RawFd {
                std::os::unix::io::AsRawFd::as_raw_fd(self)
            }
            fn try_clone_conn(&self) -> io::Result<Box<dyn Conn>> {
                Ok(Box::new(self.try_clone()?))
            }
            fn set_read_timeout_conn(&self, d: Option<Duration>) -> io::Result<()> {
                self.set_read_timeout(d)
            }
            fn shutdown_conn(&self) {
                let _ = self.shutdown(std::net::Shutdown::Both);
            }
            fn read_now(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
                // SAFETY: buf is valid for writes of buf.len() bytes.
                let n = unsafe {
                    libc::recv(
                        self.raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n >= 0 {
                    return Ok(Some(n as usize));
                }
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted => Ok(None),
                    _ => Err(e),
                }
            }
        }
    };
}
impl_conn!(UnixStream);
impl_conn!(TcpStream);

/// A wait for quality of service is slept in slices this long (see
/// [`Backend::pace_holds`]).
const PACE_SLICE: Duration = Duration::from_millis(50);

/// How long a connection's reader keeps looking for the next request before it
/// sleeps in the kernel (see [`Polled`]).
const POLL_SPIN: Duration = Duration::from_micros(50);

/// A connection whose reads look for data for a moment before they block.
///
/// Why: a client with many requests in flight sends its next ones as soon as it
/// has the replies, a few microseconds after the reader ran dry. Sleeping in
/// `recv` in between costs a wake-up per burst, and on a VM whose other core is
/// idle, a halted virtual CPU to be woken. Looking again for up to 50 µs
/// (yielding the core to anything runnable meanwhile) gave 4 KiB random writes at
/// iodepth 32 on RAM-backed files 1.07x the IOPS (1.12x when always spinning), at
/// the same CPU per request (`bench/ab.sh`, docs/benchmarks.md). A client that keeps the reader
/// waiting longer than that is not spun for: after a wait of more than four spins
/// the next read blocks at once, until a wait is short again, so idle and slow
/// connections cost nothing.
pub struct Polled {
    inner: Box<dyn Conn>,
    /// The last wait was short: look before blocking.
    spin: bool,
}

impl Polled {
    pub fn new(inner: Box<dyn Conn>) -> Self {
        Polled { inner, spin: true }
    }
}

impl Read for Polled {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if let Some(n) = self.inner.read_now(buf)? {
            return Ok(n);
        }
        let start = Instant::now();
        if self.spin {
            while start.elapsed() < POLL_SPIN {
                std::thread::yield_now();
                if let Some(n) = self.inner.read_now(buf)? {
                    return Ok(n);
                }
            }
        }
        let r = self.inner.read(buf);
        self.spin = start.elapsed() < 4 * POLL_SPIN;
        r
    }
}
impl Write for Polled {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}
impl Conn for Polled {
    fn raw_fd(&self) -> std::os::unix::io::RawFd {
        self.inner.raw_fd()
    }
    fn try_clone_conn(&self) -> io::Result<Box<dyn Conn>> {
        self.inner.try_clone_conn()
    }
    fn set_read_timeout_conn(&self, d: Option<Duration>) -> io::Result<()> {
        self.inner.set_read_timeout_conn(d)
    }
    fn shutdown_conn(&self) {
        self.inner.shutdown_conn()
    }
    fn read_now(&mut self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        self.inner.read_now(buf)
    }
}

/// The sending half of a connection. Every reply is appended whole to `pending` and
/// `pending` is written out before anything else, so replies written by different
/// threads never interleave.
pub struct ConnWriter {
    stream: Box<dyn Conn>,
    pending: Vec<u8>,
}

impl ConnWriter {
    /// Writes out `pending`, blocking.
    fn drain_blocking(&mut self) -> io::Result<()> {
        if !self.pending.is_empty() {
            self.stream.write_all(&self.pending)?;
            self.pending.clear();
        }
        Ok(())
    }

    /// Sends `parts` (at most `2 * REPLY_BATCH`) after `pending` (which must be
    /// empty) as far as the socket takes them without blocking; what it does not
    /// take is appended to `pending`.
    fn send_nonblocking(&mut self, parts: &[&[u8]]) -> io::Result<()> {
        debug_assert!(self.pending.is_empty());
        let fd = self.stream.raw_fd();
        let total: usize = parts.iter().map(|p| p.len()).sum();
        let mut iov: [libc::iovec; 2 * REPLY_BATCH] = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 2 * REPLY_BATCH];
        assert!(parts.len() <= iov.len());
        for (v, p) in iov.iter_mut().zip(parts) {
            v.iov_base = p.as_ptr() as *mut libc::c_void;
            v.iov_len = p.len();
        }
        // SAFETY: a zeroed msghdr is valid; it points at `iov`, which outlives the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = iov.as_mut_ptr();
        msg.msg_iovlen = parts.len() as _;
        let sent = loop {
            // SAFETY: sends from valid buffers on an open socket.
            let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
            if n >= 0 {
                break n as usize;
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::WouldBlock => break 0,
                io::ErrorKind::Interrupted => continue,
                _ => return Err(e),
            }
        };
        if sent < total {
            let mut skip = sent;
            for p in parts {
                let k = skip.min(p.len());
                self.pending.extend_from_slice(&p[k..]);
                skip -= k;
            }
        }
        Ok(())
    }

    /// Writes as much of `pending` as the socket takes without blocking.
    fn drain_nonblocking(&mut self) -> io::Result<()> {
        let fd = self.stream.raw_fd();
        let mut off = 0;
        while off < self.pending.len() {
            let rest = &self.pending[off..];
            // SAFETY: sends from a valid buffer on an open socket.
            let n = unsafe {
                libc::send(
                    fd,
                    rest.as_ptr() as *const libc::c_void,
                    rest.len(),
                    libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::WouldBlock => break,
                    io::ErrorKind::Interrupted => continue,
                    _ => return Err(e),
                }
            }
            off += n as usize;
        }
        self.pending.drain(..off);
        Ok(())
    }
}

type Writer = Arc<Mutex<ConnWriter>>;

/// Payload bytes held against a limit: by all connections of the process together
/// ([`GLOBAL`], `[serve] max_inflight`), and by each connection alone (at most
/// [`MAX_INFLIGHT_BYTES`], for fairness). A request that would pass the limit waits
/// until completions bring the total down, as a full queue would make it; one request
/// alone always passes (it is at most [`MAX_PAYLOAD`]). The fast path, acquire and
/// release alike, is one atomic read-modify-write: the lock is taken only by a
/// request that must wait and by a release that finds one waiting (a futex wake per
/// release would cost a system call per request).
struct Budget {
    used: AtomicU64,
    limit: AtomicU64,
    waiters: AtomicUsize,
    lock: Mutex<()>,
    freed: Condvar,
}

static GLOBAL: Budget = Budget::new(DEFAULT_INFLIGHT_LIMIT);

/// Connections open over all listeners.
static CONNECTIONS: AtomicUsize = AtomicUsize::new(0);

/// Read threads each listener starts; see [`set_read_threads`].
static READ_THREADS: AtomicUsize = AtomicUsize::new(DEFAULT_READ_THREADS);

/// Sets how many read threads each listener started after this call runs: the
/// most reads in flight to the devices at once over its connections.
pub fn set_read_threads(n: usize) {
    READ_THREADS.store(n.max(1), Ordering::SeqCst);
}

fn read_threads() -> usize {
    READ_THREADS.load(Ordering::SeqCst)
}

/// Sets the cap on payload bytes held over all connections (`[serve]
/// max_inflight`).
pub fn set_inflight_limit(bytes: u64) {
    GLOBAL.limit.store(bytes.max(1), Ordering::SeqCst);
    let _g = GLOBAL.lock.lock().unwrap();
    GLOBAL.freed.notify_all();
}

/// Payload bytes held over all connections now.
pub fn inflight_bytes() -> u64 {
    GLOBAL.used.load(Ordering::SeqCst)
}

impl Budget {
    const fn new(limit: u64) -> Self {
        Budget {
            used: AtomicU64::new(0),
            limit: AtomicU64::new(limit),
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(()),
            freed: Condvar::new(),
        }
    }
    fn fits(&self, used: u64, n: u64) -> bool {
        used == 0 || used + n <= self.limit.load(Ordering::SeqCst)
    }
    fn acquire(&self, n: u64) {
        loop {
            let u = self.used.load(Ordering::SeqCst);
            if self.fits(u, n) {
                if self
                    .used
                    .compare_exchange(u, u + n, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    return;
                }
                continue;
            }
            let g = self.lock.lock().unwrap();
            self.waiters.fetch_add(1, Ordering::SeqCst);
            // Checked again under the lock: a release that came in between either
            // shows here or finds the waiter counted and notifies.
            if !self.fits(self.used.load(Ordering::SeqCst), n) {
                drop(self.freed.wait(g).unwrap());
            }
            self.waiters.fetch_sub(1, Ordering::SeqCst);
        }
    }
    /// Acquires `n` if that needs no wait.
    fn try_acquire(&self, n: u64) -> bool {
        let mut u = self.used.load(Ordering::SeqCst);
        while self.fits(u, n) {
            match self
                .used
                .compare_exchange(u, u + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(now) => u = now,
            }
        }
        false
    }
    fn release(&self, n: u64) {
        let before = self.used.fetch_sub(n, Ordering::SeqCst);
        debug_assert!(before >= n, "budget released more than was acquired");
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock().unwrap();
            self.freed.notify_all();
        }
    }
}

/// Where the completions of one connection's commands go. Any thread may complete
/// commands: the replies are written right away when the socket is free and takes
/// them without blocking, otherwise the connection's replier thread finishes them.
pub struct ReplySink {
    writer: Writer,
    /// Free request slots (see [`Slot`]): taking one is the credit a request needs.
    credits: Sender<u16>,
    /// What each request in flight needs at its completion, by slot.
    slots: Box<[Slot]>,
    /// The connection's counters.
    stats: Arc<ConnStats>,
    /// What `Slot::started` counts from.
    epoch: Instant,
    pool: Sender<Vec<u8>>,
    /// Read buffers, returned for reuse.
    read_bufs: Sender<Vec<u8>>,
    /// Bytes of the buffers in both pools (see [`POOL_BYTES_PER_CONNECTION`]).
    pooled: AtomicU64,
    replier: Sender<ReplierMsg>,
    /// A kick is queued, or the replier holds the writer and drains `pending` before
    /// it lets go: no need for another. Set by a completer holding the writer's lock
    /// (which sends the kick before unlocking), cleared by the replier under it.
    kicked: AtomicBool,
    /// This connection's share of payload bytes (at most [`MAX_INFLIGHT_BYTES`]).
    budget: Budget,
    /// Structured replies were negotiated: reads are answered with chunks.
    structured: bool,
}

/// A request in flight, in the slot its credit named. The backend is handed the
/// slot's index as the request's handle and completes with it; the completion finds
/// here the client's handle for the reply and what to count. The reader fills a
/// slot before it hands the request on, and the slot is returned to the credits
/// only after the completion read it, so the backend's hand-off orders the two.
#[derive(Default)]
struct Slot {
    handle: AtomicU64,
    /// Nanoseconds from the connection's epoch to when the request was read.
    started: AtomicU64,
    /// The [`Op`] in the top byte, the bytes it covers below.
    op_bytes: AtomicU64,
}

const OP_SHIFT: u32 = 56;

impl ReplySink {
    /// Records a request in `slot` before it is handed on.
    fn fill(&self, slot: u16, handle: u64, op: Op, bytes: u64, started: Instant) {
        let s = &self.slots[slot as usize];
        s.handle.store(handle, Ordering::Relaxed);
        let ns = started.saturating_duration_since(self.epoch).as_nanos() as u64;
        s.started.store(ns, Ordering::Relaxed);
        debug_assert!(bytes < 1 << OP_SHIFT);
        s.op_bytes
            .store(((op as u64) << OP_SHIFT) | bytes, Ordering::Relaxed);
    }

    /// The client's handle of the request in `slot`, counting it as done.
    fn finish(&self, slot: u64, error: bool) -> u64 {
        let s = self
            .slots
            .get(slot as usize)
            .expect("a backend completed a handle the server did not give it");
        let ob = s.op_bytes.load(Ordering::Relaxed);
        let op = Op::ALL[(ob >> OP_SHIFT) as usize];
        let started = self.epoch + Duration::from_nanos(s.started.load(Ordering::Relaxed));
        self.stats
            .record(op, ob & ((1 << OP_SHIFT) - 1), error, started);
        s.handle.load(Ordering::Relaxed)
    }
}

enum ReplierMsg {
    /// Reply bytes to write.
    Bytes(Vec<u8>),
    /// A read's reply: the header, then the data when it succeeded; `slot` goes back
    /// to the credits once it is written.
    Read {
        slot: u16,
        handle: u64,
        offset: u64,
        error: u32,
        buf: Vec<u8>,
    },
    /// `pending` holds bytes that still need writing.
    Kick,
    /// The connection is done: write what is left and exit.
    Stop,
}

impl ReplySink {
    /// Completes one command at once with `error` (0: success), handing its buffer
    /// back.
    pub fn complete_now(&self, handle: u64, error: u32, cmd: Command) {
        let buf = cmd.into_buffer();
        self.complete(&mut vec![Completion { handle, error, buf }]);
    }

    /// Completes a batch of commands of this connection.
    pub fn complete(&self, completions: &mut Vec<Completion>) {
        if completions.is_empty() {
            return;
        }
        let n = completions.len();
        let mut payload = 0u64;
        // The backend completed slots: their clients' handles go in the replies (and
        // the slots stay taken until the credits below).
        let headers = |out: &mut Vec<u8>, cs: &[Completion]| {
            for c in cs {
                let handle = self.finish(c.handle, c.error != 0);
                out.extend_from_slice(&simple_reply(handle, c.error));
            }
        };
        // Replies go straight into the writer's queue when it is free (no buffer of
        // their own), else to the replier as one message.
        match self.writer.try_lock() {
            Ok(mut w) => {
                headers(&mut w.pending, completions);
                let broken = w.drain_nonblocking().is_err();
                if !broken && !w.pending.is_empty() && !self.kicked.swap(true, Ordering::SeqCst) {
                    let _ = self.replier.send(ReplierMsg::Kick);
                }
            }
            Err(_) => {
                let mut bytes = Vec::with_capacity(16 * n);
                headers(&mut bytes, completions);
                let _ = self.replier.send(ReplierMsg::Bytes(bytes));
            }
        }
        for c in completions.iter_mut() {
            if let Some(b) = c.buf.take() {
                payload += b.len() as u64;
                if self.keep(&b) {
                    if let Err(e) = self.pool.try_send(b) {
                        self.taken(e.into_inner());
                    }
                }
            }
        }
        if payload > 0 {
            self.budget.release(payload);
            GLOBAL.release(payload);
        }
        for c in completions.drain(..) {
            let _ = self.credits.send(c.handle as u16);
        }
    }
}

impl ReplySink {
    /// Completes a read: its reply goes out now if the socket is free and takes it
    /// without blocking, otherwise through the replier. Either way the buffer goes
    /// back to the connection's pool, the payload budget is released and the
    /// request's credit (`slot`) returned.
    fn complete_read(&self, slot: u16, offset: u64, result: Result<(), u32>, buf: Vec<u8>) {
        let error = result.err().unwrap_or(0);
        let handle = self.finish(slot as u64, error != 0);
        if let Ok(mut w) = self.writer.try_lock() {
            if w.pending.is_empty() {
                let h = ReplyHead::read(self.structured, handle, offset, buf.len(), error);
                let data: &[u8] = if error == 0 { &buf } else { &[] };
                let broken = w.send_nonblocking(&[h.as_bytes(), data]).is_err();
                if !broken && !w.pending.is_empty() && !self.kicked.swap(true, Ordering::SeqCst) {
                    let _ = self.replier.send(ReplierMsg::Kick);
                }
                drop(w);
                self.read_done(slot, buf);
                return;
            }
        }
        let _ = self.replier.send(ReplierMsg::Read {
            slot,
            handle,
            offset,
            error,
            buf,
        });
    }

    /// Completes reads the connection's reader finished (its ring's), as
    /// [`ReplySink::complete_read`] does, but with one system call for up to
    /// [`REPLY_BATCH`] replies when the socket is free: a burst of completions
    /// costs the client one wake-up, not one per read.
    pub(crate) fn complete_reads(&self, done: &mut Vec<ReadDone>) {
        if done.is_empty() {
            return;
        }
        let Some(mut w) = self.writer.try_lock().ok().filter(|w| w.pending.is_empty()) else {
            for d in done.drain(..) {
                self.complete_read(d.slot, d.offset, d.result, d.buf);
            }
            return;
        };
        let mut broken = false;
        let mut sent = 0;
        while sent < done.len() && w.pending.is_empty() && !broken {
            // A batch: up to REPLY_BATCH replies and REPLY_BATCH_BYTES of data (at
            // least one reply), so that what a short send leaves in `pending` (a
            // copy whose read has already given its credit back) stays small.
            let mut end = sent + 1;
            let mut bytes = done[sent].buf.len();
            while end < done.len()
                && end - sent < REPLY_BATCH
                && bytes + done[end].buf.len() <= REPLY_BATCH_BYTES
            {
                bytes += done[end].buf.len();
                end += 1;
            }
            let batch = &done[sent..end];
            sent = end;
            let mut heads = [ReplyHead::EMPTY; REPLY_BATCH];
            for (h, d) in heads.iter_mut().zip(batch) {
                let error = d.result.err().unwrap_or(0);
                let handle = self.finish(d.slot as u64, error != 0);
                *h = ReplyHead::read(self.structured, handle, d.offset, d.buf.len(), error);
            }
            let mut parts: [&[u8]; 2 * REPLY_BATCH] = [&[]; 2 * REPLY_BATCH];
            let mut n = 0;
            for (h, d) in heads.iter().zip(batch) {
                parts[n] = h.as_bytes();
                n += 1;
                if d.result.is_ok() {
                    parts[n] = &d.buf;
                    n += 1;
                }
            }
            broken = w.send_nonblocking(&parts[..n]).is_err();
        }
        // The socket is full (or gone): the rest go to the replier, which holds
        // their buffers and credits until they are written.
        for d in done.drain(sent..) {
            let error = d.result.err().unwrap_or(0);
            let handle = self.finish(d.slot as u64, error != 0);
            let _ = self.replier.send(ReplierMsg::Read {
                slot: d.slot,
                handle,
                offset: d.offset,
                error,
                buf: d.buf,
            });
        }
        if !broken && !w.pending.is_empty() && !self.kicked.swap(true, Ordering::SeqCst) {
            let _ = self.replier.send(ReplierMsg::Kick);
        }
        drop(w);
        for d in done.drain(..) {
            self.read_done(d.slot, d.buf);
        }
    }

    /// Whether `b` goes back to a pool: small enough, and the connection's pools
    /// under their byte cap (counted until the buffer is taken out again).
    fn keep(&self, b: &Vec<u8>) -> bool {
        let cap = b.capacity() as u64;
        // (A read's buffer may be a page longer than its request: the aligned
        // window of a direct read, see ring.rs.)
        if cap == 0 || cap > POOL_KEEP_BYTES as u64 + 4096 {
            return false;
        }
        if self.pooled.fetch_add(cap, Ordering::Relaxed) + cap > POOL_BYTES_PER_CONNECTION {
            self.pooled.fetch_sub(cap, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// A buffer taken out of a pool.
    fn taken(&self, b: Vec<u8>) -> Vec<u8> {
        self.pooled
            .fetch_sub(b.capacity() as u64, Ordering::Relaxed);
        b
    }

    /// A read's reply is written (or queued in `pending`): release what it held.
    fn read_done(&self, slot: u16, buf: Vec<u8>) {
        GLOBAL.release(buf.len() as u64);
        if self.keep(&buf) {
            if let Err(e) = self.read_bufs.try_send(buf) {
                self.taken(e.into_inner());
            }
        }
        let _ = self.credits.send(slot);
    }
}

/// A read finished on the connection's reader (from its ring), its reply not yet
/// written.
pub(crate) struct ReadDone {
    slot: u16,
    offset: u64,
    result: Result<(), u32>,
    buf: Vec<u8>,
}

/// Replies [`ReplySink::complete_reads`] writes with one system call at most.
const REPLY_BATCH: usize = 32;
/// Data bytes of one such batch at most (one reply may be longer).
const REPLY_BATCH_BYTES: usize = 1 << 20;

/// Threads that run the backend's reads for the connections of one listener, so
/// that a connection's reads are in flight together (the device sees the client's
/// queue depth) and complete in any order. A read job carries its buffer, taken from
/// its connection's pool; nothing is allocated per read.
pub struct ReadPool<B: Backend> {
    jobs: Sender<ReadJob<B>>,
}

struct ReadJob<B: Backend> {
    export: Arc<B::Export>,
    offset: u64,
    slot: u16,
    buf: Vec<u8>,
    sink: Arc<ReplySink>,
}

/// Default number of read threads per listener.
pub const DEFAULT_READ_THREADS: usize = 32;

impl<B: Backend> ReadPool<B> {
    /// Starts `threads` read threads over `backend`.
    pub fn start(backend: Arc<B>, threads: usize) -> io::Result<Arc<Self>> {
        let (tx, rx) = bounded::<ReadJob<B>>(MAX_INFLIGHT);
        for _ in 0..threads.max(1) {
            let (backend, rx) = (backend.clone(), rx.clone());
            std::thread::Builder::new()
                .name("nbd-read".into())
                .spawn(move || {
                    while let Ok(mut job) = rx.recv() {
                        let r = backend.read(&job.export, job.offset, &mut job.buf);
                        job.sink.complete_read(job.slot, job.offset, r, job.buf);
                    }
                })?;
        }
        Ok(Arc::new(ReadPool { jobs: tx }))
    }

    /// Runs a read of `buf.len()` bytes at `offset` on a read thread, which
    /// answers it. False when the read threads are gone: the read is answered
    /// with EIO here, giving its slot back (or the connection's end would wait
    /// for it for ever).
    fn hand_over(
        &self,
        export: &Arc<B::Export>,
        offset: u64,
        slot: u16,
        buf: Vec<u8>,
        sink: &Arc<ReplySink>,
    ) -> bool {
        let job = ReadJob {
            export: export.clone(),
            offset,
            slot,
            buf,
            sink: sink.clone(),
        };
        match self.jobs.send(job) {
            Ok(()) => true,
            Err(e) => {
                let job = e.into_inner();
                sink.complete_read(job.slot, job.offset, Err(EIO), job.buf);
                false
            }
        }
    }
}

/// Returns a read's share of the global budget when the read is done (or fails).
struct Held(u64);

impl Drop for Held {
    fn drop(&mut self) {
        GLOBAL.release(self.0);
    }
}

fn protocol(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// Reads and throws away `n` bytes, in bounded chunks.
fn discard(r: &mut impl Read, mut n: u64) -> io::Result<()> {
    let mut scratch = [0u8; 64 * 1024];
    while n > 0 {
        let k = n.min(scratch.len() as u64) as usize;
        r.read_exact(&mut scratch[..k])?;
        n -= k as u64;
    }
    Ok(())
}

fn send(w: &Writer, bytes: &[u8]) -> io::Result<()> {
    let mut g = w.lock().unwrap();
    g.drain_blocking()?;
    g.stream.write_all(bytes)?;
    g.stream.flush()
}

fn write_all_vectored(w: &mut dyn Conn, mut bufs: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What the connection advertises for its export. "Don't fragment" is offered
/// only with structured replies, the one case where reads could be fragmented
/// (they never are: a read is always answered with one chunk). A read-only export
/// offers neither trim nor zeroes.
fn transmission_flags(options: &Options, read_only: bool) -> u16 {
    let df = if options.structured { TF_SEND_DF } else { 0 };
    let writes = if read_only {
        TF_READ_ONLY
    } else {
        TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO
    };
    TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA | TF_CAN_MULTI_CONN | TF_SEND_CACHE | df | writes
}

/// What a client negotiated beyond the export; STARTTLS forgets it all (the spec).
#[derive(Default)]
struct Options {
    /// NBD_OPT_STRUCTURED_REPLY was acknowledged.
    structured: bool,
    /// The export name the last NBD_OPT_SET_META_CONTEXT selected `base:allocation`
    /// for; block status is served only if the client then opens that export.
    allocation_for: Option<String>,
}

/// What transmission serves, as negotiated.
#[derive(Clone, Copy)]
struct Session {
    structured: bool,
    /// `base:allocation` is selected: NBD_CMD_BLOCK_STATUS is answered.
    allocation: bool,
    /// The export takes no writes.
    read_only: bool,
    flags: u16,
}

impl Options {
    fn session(&self, name: &str, read_only: bool) -> Session {
        Session {
            structured: self.structured,
            allocation: self.structured && self.allocation_for.as_deref() == Some(name),
            read_only,
            flags: transmission_flags(self, read_only),
        }
    }
}

/// The data of NBD_OPT_LIST_META_CONTEXT and NBD_OPT_SET_META_CONTEXT: an export
/// name and queries, each a string; `None` when the lengths do not add up or a
/// string is not UTF-8.
fn parse_meta_request(data: &[u8]) -> Option<(String, Vec<String>)> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Option<&[u8]> {
        let b = data.get(at..at.checked_add(n)?)?;
        at += n;
        Some(b)
    };
    let u32_at = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap()) as usize;
    let nl = u32_at(take(4)?);
    if nl > MAX_STRING {
        return None;
    }
    let name = String::from_utf8(take(nl)?.to_vec()).ok()?;
    let n = u32_at(take(4)?);
    let mut queries = Vec::new();
    for _ in 0..n {
        let ql = u32_at(take(4)?);
        if ql > MAX_STRING {
            return None;
        }
        queries.push(String::from_utf8(take(ql)?.to_vec()).ok()?);
    }
    (at == data.len()).then_some((name, queries))
}

/// An NBD_REP_META_CONTEXT payload: the context id, then its name.
fn meta_context(id: u32, name: &str) -> Vec<u8> {
    let mut d = id.to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d
}

/// Where a connection stands on TLS during the handshake.
struct TlsState<'a> {
    policy: Option<&'a TlsPolicy>,
    /// TLS is up on this connection.
    active: bool,
}

impl TlsState<'_> {
    /// Options other than STARTTLS and ABORT are refused (FORCEDTLS, before TLS).
    fn refusing(&self) -> bool {
        !self.active && self.policy.is_some_and(|p| p.required)
    }
}

/// How the option haggling ended.
enum Negotiated<E> {
    /// Serve this export, as negotiated.
    Go(E, ExportInfo, Session),
    /// The client ended the negotiation cleanly.
    Abort,
    /// STARTTLS was acknowledged: run the TLS handshake, then haggle on inside it.
    StartTls,
}

/// Sends the server's greeting and reads the client's flags: (fixed newstyle, no
/// zeroes).
fn greet(r: &mut impl Read, w: &Writer) -> io::Result<(bool, bool)> {
    let mut hello = Vec::with_capacity(18);
    hello.extend_from_slice(&NBDMAGIC.to_be_bytes());
    hello.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hello.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    send(w, &hello)?;
    let client_flags = read_u32(r)?;
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(protocol(format!("unknown client flags {client_flags:#x}")));
    }
    Ok((
        client_flags & FLAG_C_FIXED_NEWSTYLE != 0,
        client_flags & FLAG_C_NO_ZEROES != 0,
    ))
}

/// Runs the option haggling.
fn negotiate<B: Backend>(
    backend: &B,
    r: &mut impl Read,
    w: &Writer,
    (fixed, no_zeroes): (bool, bool),
    tls: &TlsState,
    options: &mut Options,
) -> io::Result<Negotiated<B::Export>> {
    for _ in 0..MAX_OPTIONS {
        let magic = read_u64(r)?;
        if magic != IHAVEOPT {
            return Err(protocol(format!("bad option magic {magic:#x}")));
        }
        let option = read_u32(r)?;
        let len = read_u32(r)?;
        if len > MAX_OPTION_DATA {
            return Err(protocol(format!(
                "option {option} with {len} bytes of data"
            )));
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data)?;
        let reply = |reply: u32, d: &[u8]| send(w, &option_reply(option, reply, d));
        let err_msg = |reply: u32, msg: &str| send(w, &option_reply(option, reply, msg.as_bytes()));
        if backend.shutting_down() && option != OPT_ABORT {
            err_msg(REP_ERR_SHUTDOWN, "server is shutting down")?;
            continue;
        }
        if tls.refusing() && option != OPT_STARTTLS && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                // No error reply exists for this option: hang up (the spec).
                return Err(protocol(
                    "NBD_OPT_EXPORT_NAME without TLS on a TLS-only server",
                ));
            }
            err_msg(
                REP_ERR_TLS_REQD,
                "this server requires TLS: negotiate NBD_OPT_STARTTLS first",
            )?;
            continue;
        }
        match option {
            OPT_EXPORT_NAME => {
                let name =
                    String::from_utf8(data).map_err(|_| protocol("export name is not UTF-8"))?;
                let Some((export, info)) = backend.open_export(&name) else {
                    // This option cannot carry an error: the spec says hang up.
                    return Err(protocol(format!("unknown export {name:?}")));
                };
                let session = options.session(&name, backend.read_only(&export));
                let mut b = Vec::with_capacity(10 + 124);
                b.extend_from_slice(&info.size.to_be_bytes());
                b.extend_from_slice(&session.flags.to_be_bytes());
                if !no_zeroes {
                    b.extend_from_slice(&[0u8; 124]);
                }
                send(w, &b)?;
                return Ok(Negotiated::Go(export, info, session));
            }
            _ if !fixed => {
                return Err(protocol(format!(
                    "option {option} from a non-fixed-newstyle client"
                )));
            }
            OPT_ABORT => {
                let _ = reply(REP_ACK, &[]);
                return Ok(Negotiated::Abort);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    err_msg(REP_ERR_INVALID, "NBD_OPT_LIST takes no data")?;
                    continue;
                }
                for e in backend.exports() {
                    let mut d = Vec::new();
                    d.extend_from_slice(&(e.name.len() as u32).to_be_bytes());
                    d.extend_from_slice(e.name.as_bytes());
                    d.extend_from_slice(e.description.as_bytes());
                    reply(REP_SERVER, &d)?;
                }
                reply(REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                // u32 name length, name, u16 request count, requests.
                let parsed = (|| {
                    if data.len() < 6 {
                        return None;
                    }
                    let nl = u32::from_be_bytes(data[0..4].try_into().unwrap()) as usize;
                    if nl > MAX_STRING || data.len() < 4 + nl + 2 {
                        return None;
                    }
                    let name = String::from_utf8(data[4..4 + nl].to_vec()).ok()?;
                    let n = u16::from_be_bytes(data[4 + nl..6 + nl].try_into().unwrap()) as usize;
                    if data.len() != 6 + nl + 2 * n {
                        return None;
                    }
                    let reqs: Vec<u16> = (0..n)
                        .map(|i| {
                            u16::from_be_bytes(
                                data[6 + nl + 2 * i..8 + nl + 2 * i].try_into().unwrap(),
                            )
                        })
                        .collect();
                    Some((name, reqs))
                })();
                let Some((name, reqs)) = parsed else {
                    err_msg(REP_ERR_INVALID, "malformed NBD_OPT_INFO/GO request")?;
                    continue;
                };
                let Some((export, info)) = backend.open_export(&name) else {
                    err_msg(REP_ERR_UNKNOWN, &format!("no export named {name:?}"))?;
                    continue;
                };
                let mut d = Vec::new();
                d.extend_from_slice(&INFO_EXPORT.to_be_bytes());
                d.extend_from_slice(&info.size.to_be_bytes());
                let flags = transmission_flags(options, backend.read_only(&export));
                d.extend_from_slice(&flags.to_be_bytes());
                reply(REP_INFO, &d)?;
                let mut d = Vec::new();
                d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
                d.extend_from_slice(&1u32.to_be_bytes());
                d.extend_from_slice(&PREFERRED_BLOCK.to_be_bytes());
                d.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                reply(REP_INFO, &d)?;
                if reqs.contains(&INFO_NAME) {
                    let mut d = INFO_NAME.to_be_bytes().to_vec();
                    d.extend_from_slice(info.name.as_bytes());
                    reply(REP_INFO, &d)?;
                }
                if reqs.contains(&INFO_DESCRIPTION) {
                    let mut d = INFO_DESCRIPTION.to_be_bytes().to_vec();
                    d.extend_from_slice(info.description.as_bytes());
                    reply(REP_INFO, &d)?;
                }
                reply(REP_ACK, &[])?;
                if option == OPT_GO {
                    let session = options.session(&name, backend.read_only(&export));
                    return Ok(Negotiated::Go(export, info, session));
                }
            }
            OPT_STARTTLS => {
                if !data.is_empty() {
                    err_msg(REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data")?;
                } else if tls.active {
                    err_msg(REP_ERR_INVALID, "TLS is already active")?;
                } else if tls.policy.is_none() {
                    err_msg(REP_ERR_POLICY, "TLS is not configured on this server")?;
                } else {
                    reply(REP_ACK, &[])?;
                    return Ok(Negotiated::StartTls);
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    err_msg(REP_ERR_INVALID, "NBD_OPT_STRUCTURED_REPLY takes no data")?;
                } else {
                    options.structured = true;
                    reply(REP_ACK, &[])?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                let set = option == OPT_SET_META_CONTEXT;
                if set {
                    // A SET replaces what was selected, even when it fails (the spec).
                    options.allocation_for = None;
                }
                if !options.structured {
                    err_msg(
                        REP_ERR_INVALID,
                        "negotiate NBD_OPT_STRUCTURED_REPLY before metadata contexts",
                    )?;
                    continue;
                }
                let Some((name, queries)) = parse_meta_request(&data) else {
                    err_msg(REP_ERR_INVALID, "malformed metadata context request")?;
                    continue;
                };
                if backend.open_export(&name).is_none() {
                    err_msg(REP_ERR_UNKNOWN, &format!("no export named {name:?}"))?;
                    continue;
                }
                // `base:allocation` is the one context; `base:` lists it (a
                // wildcard, for LIST only), and any other query is ignored.
                let wanted = queries
                    .iter()
                    .any(|q| q == META_BASE_ALLOCATION || (!set && q == "base:"))
                    || (!set && queries.is_empty());
                if wanted {
                    let id = if set { ALLOCATION_CONTEXT } else { 0 };
                    reply(REP_META_CONTEXT, &meta_context(id, META_BASE_ALLOCATION))?;
                    if set {
                        options.allocation_for = Some(name);
                    }
                }
                reply(REP_ACK, &[])?;
            }
            _ => err_msg(REP_ERR_UNSUP, &format!("option {option} is not supported"))?,
        }
    }
    Err(protocol("too many options"))
}

/// Serves one connection until the client disconnects or breaks the protocol. An
/// error ends the handshake; how the transmission phase ended is logged here.
/// `tls`: the listener's TLS policy, if it offers TLS.
/// `reads`: the pool that runs this connection's reads; without one they run on the
/// connection's reader thread, one at a time.
pub fn serve_connection<B: Backend>(
    backend: Arc<B>,
    stream: Box<dyn Conn>,
    tls: Option<&TlsPolicy>,
    reads: Option<&Arc<ReadPool<B>>>,
) -> io::Result<()> {
    stream.set_read_timeout_conn(Some(HANDSHAKE_TIMEOUT))?;
    // Before TLS, which moves the connection onto a socket pair of our own.
    let peer = peer_name(stream.raw_fd());
    let writer_for = |s: &dyn Conn| -> io::Result<Writer> {
        Ok(Arc::new(Mutex::new(ConnWriter {
            stream: s.try_clone_conn()?,
            pending: Vec::new(),
        })))
    };
    let mut writer = writer_for(&*stream)?;
    let stream: Box<dyn Conn> = Box::new(Polled::new(stream));
    let mut r = BufReader::with_capacity(64 * 1024, stream);
    let flags = greet(&mut r, &writer)?;
    let mut state = TlsState {
        policy: tls,
        active: false,
    };
    let mut options = Options::default();
    let (export, info, session) = loop {
        match negotiate(&*backend, &mut r, &writer, flags, &state, &mut options)? {
            Negotiated::Go(export, info, session) => break (export, info, session),
            Negotiated::Abort => {
                r.get_ref().shutdown_conn();
                return Ok(());
            }
            Negotiated::StartTls => {
                // Bytes that came after STARTTLS but before the TLS handshake were
                // not protected: refuse them rather than act on them.
                if !r.buffer().is_empty() {
                    return Err(protocol("plaintext sent after NBD_OPT_STARTTLS"));
                }
                let policy = tls.expect("STARTTLS is acknowledged only with a policy");
                let plain = crate::tls::start(r.into_inner(), &policy.config)?;
                plain.set_read_timeout_conn(Some(HANDSHAKE_TIMEOUT))?;
                writer = writer_for(&*plain)?;
                r = BufReader::with_capacity(64 * 1024, plain);
                state.active = true;
                options = Options::default();
            }
        }
    };
    r.get_ref().set_read_timeout_conn(None)?;
    let closer = Mutex::new(r.get_ref().try_clone_conn()?);
    backend.attach(
        &export,
        Box::new(move || closer.lock().unwrap().shutdown_conn()),
    );
    let export = Arc::new(export);
    tracing::info!(
        "client {peer} connected to export {:?}{}",
        info.name,
        if state.active { " (TLS)" } else { "" }
    );
    let result = transmission(&*backend, &export, &info, session, &mut r, &writer, reads);
    r.get_ref().shutdown_conn();
    // Logged here with the export's name; what the caller logs is the handshake's.
    match &result {
        Ok(()) => tracing::info!("client {peer} disconnected from export {:?}", info.name),
        Err(e) => tracing::info!(
            "client {peer} disconnected from export {:?}: {e}",
            info.name
        ),
    }
    Ok(())
}

/// Who is at the other end of a socket, for the log: `HOST:PORT` on TCP, the
/// process on a Unix socket (`pid N`, from SO_PEERCRED), else "?".
fn peer_name(fd: std::os::unix::io::RawFd) -> String {
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: addr and len describe a buffer of len bytes.
    let r = unsafe {
        libc::getpeername(
            fd,
            (&mut addr as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if r == 0 {
        match addr.ss_family as i32 {
            libc::AF_INET => {
                // SAFETY: the kernel wrote a sockaddr_in for AF_INET.
                let a: &libc::sockaddr_in =
                    unsafe { &*(&addr as *const _ as *const libc::sockaddr_in) };
                let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
                return format!("{ip}:{}", u16::from_be(a.sin_port));
            }
            libc::AF_INET6 => {
                // SAFETY: the kernel wrote a sockaddr_in6 for AF_INET6.
                let a: &libc::sockaddr_in6 =
                    unsafe { &*(&addr as *const _ as *const libc::sockaddr_in6) };
                let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
                return format!("[{ip}]:{}", u16::from_be(a.sin6_port));
            }
            _ => {}
        }
    }
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len describe a ucred.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r == 0 && cred.pid > 0 {
        format!("pid {} (uid {})", cred.pid, cred.uid)
    } else {
        "?".into()
    }
}

fn transmission<B: Backend>(
    backend: &B,
    export: &Arc<B::Export>,
    info: &ExportInfo,
    session: Session,
    r: &mut BufReader<Box<dyn Conn>>,
    writer: &Writer,
    reads: Option<&Arc<ReadPool<B>>>,
) -> io::Result<()> {
    // Unbounded, yet bounded in practice: byte messages are at most one per
    // outstanding command (credits), and kicks are deduplicated.
    let (replier_tx, replier_rx) = crossbeam_channel::unbounded::<ReplierMsg>();
    let (credit_tx, credit_rx) = bounded::<u16>(MAX_INFLIGHT);
    for slot in 0..MAX_INFLIGHT {
        credit_tx.send(slot as u16).unwrap();
    }
    let (pool_tx, pool_rx) = bounded::<Vec<u8>>(MAX_INFLIGHT);
    let (read_bufs_tx, read_bufs_rx) = bounded::<Vec<u8>>(MAX_INFLIGHT);
    // Retires the connection's counters however this function ends.
    let registration = crate::stats::register(&info.name);
    let sink = Arc::new(ReplySink {
        writer: writer.clone(),
        credits: credit_tx,
        slots: (0..MAX_INFLIGHT).map(|_| Slot::default()).collect(),
        stats: registration.stats().clone(),
        epoch: Instant::now(),
        pool: pool_tx,
        read_bufs: read_bufs_tx,
        pooled: AtomicU64::new(0),
        replier: replier_tx,
        kicked: AtomicBool::new(false),
        budget: Budget::new(MAX_INFLIGHT_BYTES),
        structured: session.structured,
    });
    let replier = {
        let writer = writer.clone();
        let sink = sink.clone();
        std::thread::Builder::new()
            .name("nbd-replier".into())
            .spawn(move || replier(replier_rx, writer, sink))?
    };
    let mut read_buf: Vec<u8> = Vec::new();
    // Block status: the backend's extents, and the reply built from them.
    let mut extents: Vec<Extent> = Vec::new();
    let mut status_reply: Vec<u8> = Vec::new();
    // The connection's device reads (see ring.rs), completed on this thread: the
    // reader never waits for anything without reaping them, or it could wait for a
    // credit or budget that only their completions give back.
    let ring: RefCell<Option<ConnRing>> = RefCell::new(match reads {
        Some(_) if backend.device_reads() => ConnRing::new(r.get_ref().raw_fd(), MAX_INFLIGHT),
        _ => None,
    });
    // Finished reads wait here to be answered together (`reply`).
    let done = RefCell::new(Vec::<ReadDone>::with_capacity(MAX_INFLIGHT));
    let finished = |slot: u16,
                    offset: u64,
                    read: DeviceRead,
                    mut buf: Vec<u8>,
                    res: io::Result<usize>,
                    header: Option<(&[u8], io::Result<usize>)>| {
        let result = match backend.finish_read(export, read, &mut buf, res, header) {
            Finished::Done(result) => result,
            Finished::Again => {
                // Read again where waiting is fine (a connection with a ring
                // has a read pool), which answers it.
                let pool = reads.expect("a device read without a read pool");
                pool.hand_over(export, offset, slot, buf, &sink);
                return;
            }
        };
        done.borrow_mut().push(ReadDone {
            slot,
            offset,
            result,
            buf,
        });
    };
    let reply = || sink.complete_reads(&mut done.borrow_mut());
    // Puts what the ring has queued in flight: before anything that may wait.
    let submit_ring = || {
        if let Some(g) = ring.borrow_mut().as_mut() {
            g.submit();
        }
    };
    // Completes and answers every read in flight.
    let drain_ring = || {
        if let Some(g) = ring.borrow_mut().as_mut() {
            g.drain(&mut &finished);
            reply();
        }
    };
    // Waits for one of the ring's reads if any is in flight (true), after starting
    // held commands.
    let wait_ring = || match ring.borrow_mut().as_mut().filter(|g| g.inflight() > 0) {
        Some(g) => {
            backend.kick();
            g.wait(false, &mut &finished);
            reply();
            true
        }
        None => false,
    };
    // Waits that a held (deferred) command may be what ends: start the held ones
    // first, or the wait could last until the backend's own timer.
    let take_credit = || loop {
        if let Ok(slot) = credit_rx.try_recv() {
            return slot;
        }
        if !wait_ring() {
            backend.kick();
            return credit_rx.recv().unwrap();
        }
    };
    let acquire = |budget: &Budget, n: u64| {
        while !budget.try_acquire(n) {
            if !wait_ring() {
                backend.kick();
                budget.acquire(n);
                return;
            }
        }
    };
    let result = (|| -> io::Result<()> {
        let mut hdr = [0u8; RequestHeader::SIZE];
        loop {
            if let Some(g) = ring.borrow_mut().as_mut() {
                g.reap(&mut &finished);
                reply();
                if r.buffer().len() < RequestHeader::SIZE && g.inflight() > 0 {
                    // Nothing left to parse: sleep until the socket has more or a
                    // read completes. (With no read in flight the socket read below
                    // waits, as it does without a ring.)
                    g.submit();
                    while g.inflight() > 0 {
                        let socket = g.wait(true, &mut &finished);
                        reply();
                        if socket {
                            break;
                        }
                    }
                }
            }
            r.read_exact(&mut hdr)?;
            let started = Instant::now();
            let req = RequestHeader::decode(&hdr)
                .map_err(|m| protocol(format!("bad request magic {m:#x}")))?;
            if req.kind != CMD_READ {
                // Queued reads go in before anything that may wait (a payload, a
                // blocking reply, the engine): they are in flight meanwhile.
                submit_ring();
            }
            let (offset, len) = (req.offset, req.length as u64);
            // What the request counts as (`None`: disconnect, unknown commands).
            let op = match req.kind {
                CMD_READ => Some(Op::Read),
                CMD_WRITE => Some(Op::Write),
                CMD_FLUSH => Some(Op::Flush),
                CMD_TRIM => Some(Op::Trim),
                CMD_WRITE_ZEROES => Some(Op::WriteZeroes),
                CMD_CACHE => Some(Op::Cache),
                CMD_BLOCK_STATUS => Some(Op::BlockStatus),
                _ => None,
            };
            let count = |bytes: u64, error: bool| {
                if let Some(op) = op {
                    sink.stats.record(op, bytes, error, started);
                }
            };
            let in_range = offset.checked_add(len).is_some_and(|end| end <= info.size);
            // Quality of service: requests that will be served wait their turn;
            // what is refused costs nothing. (A read or write is at most
            // MAX_PAYLOAD, a trim or zeroes moves no payload.)
            let paced = match op {
                Some(Op::Read | Op::Write) if in_range && len <= MAX_PAYLOAD as u64 => Some(len),
                Some(Op::Trim | Op::WriteZeroes) if in_range => Some(0),
                _ => None,
            };
            if let Some(wait) = paced.map(|bytes| backend.pace(export, bytes)) {
                if !wait.is_zero() {
                    // Held commands go first: the wait may be long. It is slept in
                    // slices, and ends early when the backend says it no longer
                    // holds (the limits changed, the export went away). Reads in
                    // flight are answered before it.
                    drain_ring();
                    backend.kick();
                    let from = Instant::now();
                    while let Some(left) = wait.checked_sub(from.elapsed()).filter(|l| !l.is_zero())
                    {
                        std::thread::sleep(left.min(PACE_SLICE));
                        if !backend.pace_holds(export, from) {
                            break;
                        }
                    }
                }
            }
            // FUA is accepted on every command (the spec), ignored where nothing is
            // written.
            let allowed_flags = match req.kind {
                CMD_WRITE_ZEROES => CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                CMD_READ if session.structured => CMD_FLAG_FUA | CMD_FLAG_DF,
                CMD_BLOCK_STATUS => CMD_FLAG_FUA | CMD_FLAG_REQ_ONE,
                _ => CMD_FLAG_FUA,
            };
            let bad_flags = req.flags & !allowed_flags != 0;
            let fua = req.flags & CMD_FLAG_FUA != 0;
            // With structured replies an error carries its reason (and a read must
            // not be answered with a simple reply at all).
            let error_reply = |e: u32, why: &str| {
                count(0, true);
                submit_ring();
                if session.structured {
                    send(writer, &error_chunk(req.handle, e, why))
                } else {
                    send(writer, &simple_reply(req.handle, e))
                }
            };
            // Why a request that names a range cannot be served, if it cannot.
            let range_error = |max_len: u64| -> Option<&'static str> {
                if bad_flags {
                    Some("flags not valid for this command")
                } else if !in_range {
                    Some("range beyond the end of the export")
                } else if len > max_len {
                    Some("length over the maximum payload")
                } else {
                    None
                }
            };
            // Takes a slot (waiting for one), records the request in it, and hands
            // the command to the backend under the slot's number. With another
            // request already buffered the command may be held and worked through
            // with the rest of the burst.
            let submit = |cmd: Command, bytes: u64, buffered: usize| {
                let slot = take_credit();
                sink.fill(slot, req.handle, op.expect("a command"), bytes, started);
                if buffered >= RequestHeader::SIZE {
                    backend.submit_deferred(export, slot as u64, cmd, &sink);
                } else {
                    backend.submit(export, slot as u64, cmd, &sink);
                }
            };
            match req.kind {
                CMD_READ => {
                    if req.flags & CMD_FLAG_DF != 0 && len > MAX_PAYLOAD as u64 && !bad_flags {
                        // What the spec asks of a read too long to send in one chunk.
                        error_reply(EOVERFLOW, "read too long for one chunk")?;
                        continue;
                    }
                    if let Some(why) = range_error(MAX_PAYLOAD as u64) {
                        error_reply(EINVAL, why)?;
                        continue;
                    }
                    if let Some(pool) = reads {
                        // Released by the reply (`ReplySink::read_done`).
                        acquire(&GLOBAL, len);
                        let slot = take_credit();
                        sink.fill(slot, req.handle, Op::Read, len, started);
                        let mut buf = read_bufs_rx
                            .try_recv()
                            .map(|b| sink.taken(b))
                            .unwrap_or_default();
                        buf.clear();
                        buf.resize(req.length as usize, 0);
                        // What needs no wait is served here, without a hand-off;
                        // with a ring, reads from a device are too.
                        let mut g = ring.borrow_mut();
                        let how = match g.as_mut() {
                            Some(_) => backend.start_read(export, offset, &mut buf),
                            None => match backend.try_read(export, offset, &mut buf) {
                                Some(res) => ReadStart::Done(res),
                                None => ReadStart::Wait,
                            },
                        };
                        match (how, g.as_mut()) {
                            (ReadStart::Done(res), _) => {
                                drop(g);
                                sink.complete_read(slot, offset, res, buf);
                                continue;
                            }
                            (ReadStart::Device(read), Some(g)) => {
                                g.push(slot, offset, read, buf);
                                if r.buffer().len() < RequestHeader::SIZE {
                                    g.submit();
                                }
                                continue;
                            }
                            (ReadStart::Device(read), None) => {
                                unreachable!("device read {read:?} without a ring")
                            }
                            (ReadStart::Wait, _) => {}
                        }
                        drop(g);
                        if !pool.hand_over(export, offset, slot, buf, &sink) {
                            return Err(io::Error::other("the read threads are gone"));
                        }
                        continue;
                    }
                    acquire(&GLOBAL, len);
                    let _held = Held(len);
                    read_buf.resize(req.length as usize, 0);
                    match backend.read(export, offset, &mut read_buf) {
                        Ok(()) => {
                            let h = ReplyHead::read(
                                session.structured,
                                req.handle,
                                offset,
                                read_buf.len(),
                                0,
                            );
                            let mut g = writer.lock().unwrap();
                            g.drain_blocking()?;
                            write_all_vectored(
                                &mut *g.stream,
                                &mut [IoSlice::new(h.as_bytes()), IoSlice::new(&read_buf)],
                            )?;
                            count(len, false);
                        }
                        Err(e) => error_reply(e, "read failed")?,
                    }
                    if read_buf.capacity() > POOL_KEEP_BYTES {
                        read_buf = Vec::new();
                    }
                }
                CMD_WRITE => {
                    if let Some(why) = range_error(MAX_PAYLOAD as u64) {
                        discard(r, len)?;
                        error_reply(EINVAL, why)?;
                        continue;
                    }
                    if session.read_only {
                        discard(r, len)?;
                        error_reply(EPERM, "the export is read-only")?;
                        continue;
                    }
                    acquire(&sink.budget, len);
                    acquire(&GLOBAL, len);
                    let mut data = pool_rx
                        .try_recv()
                        .map(|b| sink.taken(b))
                        .unwrap_or_default();
                    data.resize(req.length as usize, 0);
                    if r.buffer().len() < data.len() {
                        // The payload may take a while to arrive.
                        backend.kick();
                        submit_ring();
                    }
                    if let Err(e) = r.read_exact(&mut data) {
                        sink.budget.release(len);
                        GLOBAL.release(len);
                        return Err(e);
                    }
                    submit(Command::Write { offset, data, fua }, len, r.buffer().len());
                }
                CMD_FLUSH => {
                    if bad_flags || offset != 0 || len != 0 {
                        error_reply(EINVAL, "a flush takes no flags, offset or length")?;
                        continue;
                    }
                    submit(Command::Flush, 0, r.buffer().len());
                }
                CMD_TRIM | CMD_WRITE_ZEROES => {
                    if let Some(why) = range_error(u64::MAX) {
                        error_reply(EINVAL, why)?;
                        continue;
                    }
                    if session.read_only {
                        error_reply(EPERM, "the export is read-only")?;
                        continue;
                    }
                    let allocate =
                        req.kind == CMD_WRITE_ZEROES && req.flags & CMD_FLAG_NO_HOLE != 0;
                    if allocate && req.flags & CMD_FLAG_FAST_ZERO != 0 {
                        // Allocated zeroes are written like data: not faster than a
                        // write, which is what FAST_ZERO asks to be told (the spec).
                        error_reply(ENOTSUP, "allocated zeroes are no faster than a write")?;
                        continue;
                    }
                    submit(
                        Command::Zero {
                            offset,
                            length: len,
                            fua,
                            allocate,
                        },
                        len,
                        r.buffer().len(),
                    );
                }
                CMD_CACHE => {
                    if let Some(why) = range_error(u64::MAX) {
                        error_reply(EINVAL, why)?;
                        continue;
                    }
                    match backend.cache(export, offset, req.length) {
                        Ok(()) => {
                            count(len, false);
                            send(writer, &simple_reply(req.handle, 0))?
                        }
                        Err(e) => error_reply(e, "cache hint failed")?,
                    }
                }
                CMD_BLOCK_STATUS => {
                    if !session.allocation {
                        error_reply(
                            EINVAL,
                            "no metadata context selected (NBD_OPT_SET_META_CONTEXT)",
                        )?;
                        continue;
                    }
                    if let Some(why) = range_error(u64::MAX) {
                        error_reply(EINVAL, why)?;
                        continue;
                    }
                    if len == 0 {
                        error_reply(EINVAL, "block status of zero bytes")?;
                        continue;
                    }
                    let one = req.flags & CMD_FLAG_REQ_ONE != 0;
                    extents.clear();
                    let max = if one { 1 } else { MAX_EXTENTS };
                    match backend.block_status(export, offset, req.length, max, &mut extents) {
                        Ok(()) => {
                            let limits = StatusLimits {
                                length: req.length,
                                to_end: info.size - offset,
                                one,
                            };
                            status_chunk(req.handle, limits, &extents, &mut status_reply);
                            count(len, false);
                            send(writer, &status_reply)?;
                        }
                        Err(e) => error_reply(e, "block status failed")?,
                    }
                    // A long reply's buffers are not kept: what a connection holds
                    // between requests does not follow the largest one.
                    if status_reply.capacity() > STATUS_KEEP_BYTES {
                        status_reply = Vec::new();
                        extents = Vec::new();
                    }
                }
                CMD_DISC => return Ok(()),
                _ => error_reply(EINVAL, "unknown command")?,
            }
        }
    })();
    // Wait for every outstanding command so its reply is sent (or at least its
    // completion consumed) before the connection goes away; commands held back in a
    // burst start now rather than at the backend's next tick.
    drain_ring();
    backend.kick();
    for _ in 0..MAX_INFLIGHT {
        let _ = credit_rx.recv();
    }
    let _ = sink.replier.send(ReplierMsg::Kick);
    let _ = sink.replier.send(ReplierMsg::Stop);
    let _ = replier.join();
    drop(registration);
    match result {
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(()),
        other => other,
    }
}

/// What a block status reply may describe.
#[derive(Clone, Copy)]
struct StatusLimits {
    /// The length the client asked about.
    length: u32,
    /// Bytes from the request's offset to the end of the export (at least `length`).
    to_end: u64,
    /// REQ_ONE: a single extent, no longer than `length`.
    one: bool,
}

/// The one NBD_REPLY_TYPE_BLOCK_STATUS chunk answering a request, from the backend's
/// `extents`, made valid whatever the backend gave: no empty extent, at least one
/// (status 0 for the whole range if none), nothing after the extent that reaches
/// the requested length, nothing past the end of the export, and with REQ_ONE a
/// single extent no longer than asked.
fn status_chunk(handle: u64, limits: StatusLimits, extents: &[Extent], out: &mut Vec<u8>) {
    let StatusLimits {
        length,
        to_end,
        one,
    } = limits;
    debug_assert!(to_end >= length as u64);
    out.clear();
    out.extend_from_slice(&[0u8; CHUNK_HEADER]);
    out.extend_from_slice(&ALLOCATION_CONTEXT.to_be_bytes());
    let mut covered = 0u64;
    for e in extents.iter().filter(|e| e.length > 0) {
        let cap = if one { length as u64 } else { to_end - covered };
        let len = (e.length as u64).min(cap) as u32;
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&e.flags.to_be_bytes());
        covered += len as u64;
        if one || covered >= length as u64 || out.len() >= CHUNK_HEADER + 4 + 8 * MAX_EXTENTS {
            break;
        }
    }
    if covered == 0 {
        out.extend_from_slice(&length.to_be_bytes());
        out.extend_from_slice(&0u32.to_be_bytes());
    }
    let payload = (out.len() - CHUNK_HEADER) as u32;
    let h = chunk_header(handle, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, payload);
    out[..CHUNK_HEADER].copy_from_slice(&h);
}

fn replier(rx: Receiver<ReplierMsg>, writer: Writer, sink: Arc<ReplySink>) {
    // Holding the sink keeps the channel open; the loop ends on `Stop`, which the
    // reader sends after its final kick, once every command has given back its
    // credit (so nothing writes to `pending` any more) and that kick's round drained.
    let mut broken = false;
    // Read replies of one batch (kept for its capacity).
    let mut reads: Vec<(u16, u64, u64, u32, Vec<u8>)> = Vec::new();
    while let Ok(first) = rx.recv() {
        if matches!(first, ReplierMsg::Stop) {
            break;
        }
        let mut g = writer.lock().unwrap();
        // Cleared under the lock, and `pending` is drained before the lock is let go:
        // a completer sets the flag and sends its kick while it holds the lock, so
        // the flag set means a kick is queued or the bytes are drained in this round.
        // Clearing it before taking the lock lost wake-ups: a kick consumed by the
        // `try_recv` below left the flag set with no kick queued, and the next
        // partial reply waited in `pending` until the client sent something else.
        sink.kicked.store(false, Ordering::SeqCst);
        let mut take = |m: ReplierMsg, g: &mut ConnWriter| match m {
            ReplierMsg::Bytes(b) => g.pending.extend_from_slice(&b),
            ReplierMsg::Read {
                slot,
                handle,
                offset,
                error,
                buf,
            } => reads.push((slot, handle, offset, error, buf)),
            ReplierMsg::Kick | ReplierMsg::Stop => {}
        };
        take(first, &mut g);
        let mut stop = false;
        while let Ok(m) = rx.try_recv() {
            stop |= matches!(m, ReplierMsg::Stop);
            take(m, &mut g);
        }
        if !broken && g.drain_blocking().is_err() {
            broken = true;
        }
        for (slot, handle, offset, error, buf) in reads.drain(..) {
            if !broken {
                let h = ReplyHead::read(sink.structured, handle, offset, buf.len(), error);
                let data: &[u8] = if error == 0 { &buf } else { &[] };
                let parts = &mut [IoSlice::new(h.as_bytes()), IoSlice::new(data)];
                broken = write_all_vectored(&mut *g.stream, parts).is_err();
            }
            sink.read_done(slot, buf);
        }
        if !broken && g.stream.flush().is_err() {
            broken = true;
        }
        if broken {
            g.pending.clear();
        }
        if stop {
            break;
        }
    }
}

/// Where to listen.
pub enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

/// Accepts connections until `stop` is set, serving each on its own threads, with
/// TLS offered (or required) as `tls` says.
pub fn serve<B: Backend>(
    backend: Arc<B>,
    listener: Listener,
    tls: Option<TlsPolicy>,
    stop: Arc<AtomicBool>,
) {
    let tls = tls.map(Arc::new);
    let reads = match ReadPool::start(backend.clone(), read_threads()) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::error!("cannot start read threads ({e}): reads run one at a time");
            None
        }
    };
    loop {
        let conn: io::Result<Box<dyn Conn>> = match &listener {
            Listener::Unix(l) => l.accept().map(|(s, _)| Box::new(s) as Box<dyn Conn>),
            Listener::Tcp(l) => l.accept().map(|(s, _)| {
                let _ = s.set_nodelay(true);
                Box::new(s) as Box<dyn Conn>
            }),
        };
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let conn = match conn {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if CONNECTIONS.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
            tracing::warn!("refusing connection: {MAX_CONNECTIONS} already open");
            conn.shutdown_conn();
            continue;
        }
        let backend = backend.clone();
        let tls = tls.clone();
        let reads = reads.clone();
        let spawned = std::thread::Builder::new()
            .name("nbd-conn".into())
            .spawn(move || {
                if let Err(e) = serve_connection(backend, conn, tls.as_deref(), reads.as_ref()) {
                    tracing::info!("connection closed during the handshake: {e}");
                }
                CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            CONNECTIONS.fetch_sub(1, Ordering::SeqCst);
            tracing::error!("cannot start a connection thread: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `read_now` reads what has arrived and never waits; a polled reader spins
    /// only while the client keeps it waiting briefly, and sees the end of the
    /// stream.
    #[test]
    fn polled_reads_look_without_waiting_and_stop_spinning_for_slow_clients() {
        let (a, mut peer) = UnixStream::pair().unwrap();
        let mut raw: Box<dyn Conn> = Box::new(a.try_clone().unwrap());
        let mut buf = [0u8; 8];
        let t = Instant::now();
        assert_eq!(raw.read_now(&mut buf).unwrap(), None, "nothing sent yet");
        assert!(t.elapsed() < Duration::from_millis(50), "read_now waited");
        peer.write_all(b"abc").unwrap();
        assert_eq!(raw.read_now(&mut buf).unwrap(), Some(3));
        assert_eq!(&buf[..3], b"abc");

        let mut p = Polled::new(Box::new(a));
        let writer = std::thread::spawn(move || {
            // Sent while the reader spins: found without blocking.
            peer.write_all(b"x").unwrap();
            // A slow client: the reader blocks, and stops spinning after it.
            std::thread::sleep(Duration::from_millis(20));
            peer.write_all(b"y").unwrap();
            std::thread::sleep(Duration::from_millis(20));
            peer.write_all(b"z").unwrap();
        });
        let mut one = [0u8; 1];
        assert_eq!(p.read(&mut one).unwrap(), 1);
        assert_eq!(&one, b"x");
        assert_eq!(p.read(&mut one).unwrap(), 1);
        assert_eq!(&one, b"y");
        assert!(!p.spin, "a 20 ms wait turns spinning off");
        assert_eq!(p.read(&mut one).unwrap(), 1);
        assert_eq!(&one, b"z");
        writer.join().unwrap();
        assert_eq!(p.read(&mut one).unwrap(), 0, "end of stream");
    }

    /// A connection's sink over one end of a socket pair, the pair's other end, and
    /// the far ends of its channels.
    struct TestSink {
        sink: Arc<ReplySink>,
        peer: UnixStream,
        replies: Receiver<ReplierMsg>,
        pool: Receiver<Vec<u8>>,
        read_bufs: Receiver<Vec<u8>>,
        credits: Receiver<u16>,
    }

    fn test_sink(structured: bool) -> TestSink {
        let (a, peer) = UnixStream::pair().unwrap();
        let (credits, credits_rx) = bounded(MAX_INFLIGHT);
        let (pool, pool_rx) = bounded(MAX_INFLIGHT);
        let (read_bufs, read_rx) = bounded(MAX_INFLIGHT);
        let (replier, replies) = crossbeam_channel::unbounded();
        let sink = ReplySink {
            writer: Arc::new(Mutex::new(ConnWriter {
                stream: Box::new(a),
                pending: Vec::new(),
            })),
            credits,
            slots: (0..MAX_INFLIGHT).map(|_| Slot::default()).collect(),
            stats: crate::stats::register("test").stats().clone(),
            epoch: Instant::now(),
            pool,
            read_bufs,
            pooled: AtomicU64::new(0),
            replier,
            kicked: AtomicBool::new(false),
            budget: Budget::new(MAX_INFLIGHT_BYTES),
            structured,
        };
        TestSink {
            sink: Arc::new(sink),
            peer,
            replies,
            pool: pool_rx,
            read_bufs: read_rx,
            credits: credits_rx,
        }
    }

    /// Reads the replier thread writes are structured like the ones written
    /// straight from a completion: one OFFSET_DATA chunk with the data, one ERROR
    /// chunk, one NONE chunk for an empty read.
    #[test]
    fn the_replier_writes_structured_read_replies() {
        let TestSink {
            sink,
            mut peer,
            replies: rx,
            credits,
            ..
        } = test_sink(true);
        let writer = sink.writer.clone();
        let thread = {
            let sink = sink.clone();
            std::thread::spawn(move || replier(rx, writer, sink))
        };
        let data: Vec<u8> = (0..5000u32).map(|i| i as u8).collect();
        for (slot, (handle, offset, error, buf)) in [
            (1u64, 8192u64, 0u32, data.clone()),
            (2, 4096, EIO, vec![0; 512]),
            (3, 0, 0, Vec::new()),
        ]
        .into_iter()
        .enumerate()
        {
            GLOBAL.acquire(buf.len() as u64);
            let msg = ReplierMsg::Read {
                slot: slot as u16 + 7,
                handle,
                offset,
                error,
                buf,
            };
            sink.replier.send(msg).unwrap();
        }
        sink.replier.send(ReplierMsg::Stop).unwrap();
        thread.join().unwrap();
        drop(sink);
        let mut got = Vec::new();
        peer.read_to_end(&mut got).unwrap();
        let mut want = chunk_header(1, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 8 + 5000).to_vec();
        want.extend_from_slice(&8192u64.to_be_bytes());
        want.extend_from_slice(&data);
        want.extend_from_slice(&chunk_header(2, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6));
        want.extend_from_slice(&EIO.to_be_bytes());
        want.extend_from_slice(&0u16.to_be_bytes());
        want.extend_from_slice(&chunk_header(3, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0));
        assert!(
            got == want,
            "replier wrote {} bytes, expected {}",
            got.len(),
            want.len()
        );
        // Each read's slot went back to the credits once its reply was written.
        assert_eq!(credits.try_iter().collect::<Vec<_>>(), vec![7, 8, 9]);
    }

    /// Idle buffers a connection keeps are capped in bytes, whatever sizes its
    /// client asked for, and a buffer taken out frees its share.
    #[test]
    fn pooled_buffers_are_capped_per_connection() {
        let TestSink {
            sink,
            pool: pool_rx,
            read_bufs: read_rx,
            ..
        } = test_sink(false);
        let mib = || Vec::<u8>::with_capacity(1 << 20);
        let kept = (0..10).filter(|_| sink.keep(&mib())).count();
        assert_eq!(kept as u64, POOL_BYTES_PER_CONNECTION >> 20);
        assert!(
            !sink.keep(&Vec::with_capacity(2 << 20)),
            "over POOL_KEEP_BYTES"
        );
        let _ = sink.taken(mib());
        assert!(sink.keep(&mib()));
        // Through the real paths: read buffers beyond the cap are dropped.
        sink.pooled.store(0, Ordering::Relaxed);
        for slot in 0..10 {
            sink.read_done(slot, mib());
        }
        assert_eq!(read_rx.len() as u64, POOL_BYTES_PER_CONNECTION >> 20);
        assert_eq!(pool_rx.len(), 0);
    }
}
