//! The server runtime: the engine's host, the device I/O threads, and the NBD
//! backend that connects client connections to them.
//!
//! ```text
//!  connection reader ──read──▶ Shared::read (map lookup, pread, verify) ──▶ reply
//!          │ write / trim / flush
//!          ▼
//!  engine queue ──▶ whoever holds the engine ──IoOp──▶ I/O threads (pwrite, fdatasync)
//!          ▲            │                                    │
//!          └────────────┼──────── IoCompletion ◀─────────────┘
//!                       ▼
//!            replies written by the same thread, straight to the socket
//! ```
//!
//! The engine has one owner at a time, and everything reaches it as a message on
//! one queue. It has no thread of its own to wait on: the thread that posts a
//! message (a connection's reader, an I/O thread with a completion) runs the engine
//! itself when it is free, and writes the replies (see [`crate::combine`]); the
//! engine thread only ticks it every 10 ms and drains what posters leave. A
//! connection's reader also holds back the commands of a burst it has already
//! buffered and runs them together, so that one round answers them with one write.
//! Before this, an engine thread did all of it and every burst of requests paid for
//! waking it: on 2 cores, 4 KiB random writes went from 0.55x to 0.92x the IOPS
//! of `nbdkit file` (docs/benchmarks.md).

use crate::combine::{Combiner, Owner};
use anyhow::Result;
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use lamina_core::io::{execute, IoCompletion, IoKind, IoOp};
use lamina_core::{Engine, EngineError, Request, Shared, StatusReport, Token, VolumeShared};
use lamina_nbd::proto::{STATE_HOLE, STATE_ZERO};
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, Completion, DeviceRead, ExportInfo, Extent, ReadStart};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Where a reply goes.
pub enum ReplyTo {
    Nbd(Arc<ReplySink>, u64),
    Admin(Sender<Result<Option<Box<StatusReport>>, EngineError>>),
}

pub enum Msg {
    /// A request, with the creation version of the volume it names when its
    /// sender looked the volume up by name or holds it (see `Engine::submit_to`:
    /// ids of deleted volumes are given out again).
    Req(Request, ReplyTo, Option<lamina_core::Version>),
    Io(IoCompletion),
    /// Flush, checkpoint, then stop the engine.
    Shutdown(Sender<Result<(), EngineError>>),
}

/// A handle to a running engine.
#[derive(Clone)]
pub struct Runtime {
    host: Arc<Host>,
    pub shared: Arc<Shared>,
    pub shutting_down: Arc<AtomicBool>,
    pub clients: Arc<Clients>,
    /// The last scrub this server ran, as `status` shows it (JSON).
    pub last_scrub: Arc<std::sync::Mutex<Option<serde_json::Value>>>,
    /// Per-volume limits (`[engine.volumes.NAME] iops_limit`, `lamina volume qos`).
    pub qos: Arc<crate::qos::QosTable>,
}

/// Messages a thread handles per round before it looks at the clock and the
/// outputs again.
const ROUND: usize = 4096;
/// Rounds a thread runs for others before it leaves the rest to the engine thread.
const LENT_ROUNDS: usize = 4;
/// How often the engine is ticked (idle units sealed, periodic syncs, GC pacing).
const TICK: Duration = Duration::from_millis(10);
/// How long a stopping engine waits for device operations still under way after
/// its final checkpoint.
const CLOSE_WAIT: Duration = Duration::from_secs(10);

/// Where the answer to a shutdown request goes.
type Done = Sender<Result<(), EngineError>>;

/// The engine, run by whichever thread brings it work (see [`crate::combine`]).
type Host = Combiner<Core>;

/// Everything the engine's holder owns while it holds it.
struct Core {
    engine: Engine,
    /// Reply routes by token slot.
    routes: Vec<Option<ReplyTo>>,
    free_routes: Vec<u64>,
    ops: Vec<IoOp>,
    replies: Vec<lamina_core::Reply>,
    /// The shutdown request, and the token slot of its checkpoint.
    shutdown: Option<(Done, u64)>,
    /// The final checkpoint answered: the shutdown request, that answer, and how
    /// long to wait at most for what is still in flight (see [`Core::close`]).
    closing: Option<(Done, Result<(), EngineError>, Instant)>,
    /// Completions of this round, grouped by connection so each gets one write;
    /// emptied vectors are kept in `spare` for the next round.
    batches: Vec<(Arc<ReplySink>, Vec<Completion>)>,
    spare: Vec<Vec<Completion>>,
    io_tx: Option<Sender<IoOp>>,
    start: Instant,
    last_tick: Instant,
}

impl Owner for Core {
    type Msg = Msg;

    fn round(&mut self, inbox: &Receiver<Msg>) -> bool {
        self.run_round(inbox);
        self.stopped()
    }

    fn refuse(m: Msg) {
        refuse(m)
    }
}

/// Answers a message that arrives after the engine stopped.
fn refuse(m: Msg) {
    match m {
        Msg::Req(_, ReplyTo::Nbd(sink, handle), _) => sink.complete(&mut vec![Completion {
            handle,
            error: lamina_nbd::proto::ESHUTDOWN,
            buf: None,
        }]),
        Msg::Req(_, ReplyTo::Admin(tx), _) => {
            let _ = tx.send(Err(EngineError::ShuttingDown));
        }
        Msg::Shutdown(done) => {
            let _ = done.send(Ok(()));
        }
        Msg::Io(_) => {}
    }
}

impl Core {
    fn stopped(&self) -> bool {
        self.io_tx.is_none()
    }

    fn route(&mut self, to: Option<ReplyTo>) -> u64 {
        let slot = self.free_routes.pop().unwrap_or_else(|| {
            self.routes.push(None);
            self.routes.len() as u64 - 1
        });
        self.routes[slot as usize] = to;
        slot
    }

    fn handle(&mut self, m: Msg) {
        if self.stopped() {
            return refuse(m);
        }
        match m {
            Msg::Req(req, to, created) => {
                let token = Token {
                    conn: 0,
                    handle: self.route(Some(to)),
                };
                match created {
                    Some(c) => self.engine.submit_to(token, req, c),
                    None => self.engine.submit(token, req),
                }
            }
            Msg::Io(c) => self.engine.io_completed(c),
            Msg::Shutdown(done) => {
                // A checkpoint flushes everything first; nothing a client asks for
                // starts after it (`Engine::finish_shutdown`), so the next start
                // replays only what GC finished moving meanwhile.
                self.engine.begin_shutdown();
                let handle = self.route(None);
                self.engine
                    .submit(Token { conn: 0, handle }, Request::Checkpoint);
                self.shutdown = Some((done, handle));
            }
        }
    }

    /// One round: up to [`ROUND`] messages, the tick when due, then the device
    /// operations and the replies the engine produced.
    fn run_round(&mut self, inbox: &Receiver<Msg>) {
        for _ in 0..ROUND {
            match inbox.try_recv() {
                Ok(m) => self.handle(m),
                Err(_) => break,
            }
        }
        if self.stopped() {
            return;
        }
        if self.last_tick.elapsed() >= TICK {
            self.engine.tick(self.start.elapsed().as_millis() as u64);
            self.last_tick = Instant::now();
        }
        self.engine.drain_io(&mut self.ops);
        if let Some(io) = &self.io_tx {
            for op in self.ops.drain(..) {
                let _ = io.send(op);
            }
        }
        self.engine.drain_replies(&mut self.replies);
        let mut replies = std::mem::take(&mut self.replies);
        for r in replies.drain(..) {
            let slot = r.token.handle;
            if self.shutdown.as_ref().is_some_and(|(_, s)| *s == slot) {
                let (done, _) = self.shutdown.take().unwrap();
                self.free_routes.push(slot);
                self.engine.finish_shutdown();
                self.closing = Some((done, r.result, Instant::now() + CLOSE_WAIT));
                continue;
            }
            let Some(to) = self.routes[slot as usize].take() else {
                continue;
            };
            self.free_routes.push(slot);
            match to {
                ReplyTo::Nbd(sink, handle) => {
                    let error = r.result.as_ref().err().map_or(0, |e| e.errno());
                    if let Err(e) = &r.result {
                        tracing::debug!("request failed: {e}");
                    }
                    let c = Completion {
                        handle,
                        error,
                        buf: r.buf,
                    };
                    match self.batches.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &sink)) {
                        Some((_, v)) => v.push(c),
                        None => {
                            let mut v = self.spare.pop().unwrap_or_default();
                            v.push(c);
                            self.batches.push((sink, v));
                        }
                    }
                }
                ReplyTo::Admin(tx) => {
                    let _ = tx.send(r.result.map(|_| r.status));
                }
            }
        }
        self.replies = replies;
        for (sink, mut cs) in self.batches.drain(..) {
            sink.complete(&mut cs);
            self.spare.push(cs);
        }
        self.close();
    }

    /// Stops the engine once the final checkpoint has committed and nothing it
    /// started is still under way: a flush whose sync was sent after the
    /// checkpoint's (a connection flushed while the checkpoint committed) is
    /// answered when that sync completes, not dropped with it. After
    /// [`CLOSE_WAIT`] it stops regardless (a device that never answers).
    fn close(&mut self) {
        let Some((_, _, deadline)) = &self.closing else {
            return;
        };
        if !self.engine.quiesced() {
            if Instant::now() < *deadline {
                return;
            }
            tracing::warn!(
                "stopping with device operations or flushes still under way after {CLOSE_WAIT:?}"
            );
        }
        let (done, result, _) = self.closing.take().unwrap();
        // Dropping the I/O queue ends the I/O threads once they are idle.
        self.io_tx = None;
        let _ = done.send(result);
    }
}

type Disconnect = Box<dyn Fn() + Send + Sync>;
/// Per volume, by id and creation version (the id of a deleted volume is given
/// again, and its clients are not the new volume's): (connection id, how to
/// disconnect it once it has one).
type VolumeClients = HashMap<(u16, lamina_core::Version), Vec<(u64, Option<Disconnect>)>>;

/// The key of volume `v` among [`Clients`].
fn key(v: &VolumeShared) -> (u16, lamina_core::Version) {
    (v.id.0, v.created_version())
}

/// The NBD connections open on each volume, so that a busy volume is not deleted
/// without `--force`, and a forced delete first disconnects them. Touched when a
/// connection opens or closes, never per request.
#[derive(Default)]
pub struct Clients {
    next: AtomicU64,
    by_volume: Mutex<VolumeClients>,
}

impl Clients {
    fn open(
        self: &Arc<Self>,
        vol: Arc<VolumeShared>,
        qos: Arc<crate::qos::Limiter>,
    ) -> ExportHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.by_volume
            .lock()
            .unwrap()
            .entry(key(&vol))
            .or_default()
            .push((id, None));
        ExportHandle {
            vol,
            id,
            clients: self.clone(),
            qos,
        }
    }

    /// Connections open on volume `vol`.
    pub fn count(&self, vol: &VolumeShared) -> usize {
        self.by_volume
            .lock()
            .unwrap()
            .get(&key(vol))
            .map_or(0, |v| v.len())
    }

    /// Closes every connection on volume `vol` (their sockets are shut down:
    /// clients see the server hang up, as at a server shutdown); returns how many.
    pub fn disconnect(&self, vol: &VolumeShared) -> usize {
        let by = self.by_volume.lock().unwrap();
        let conns = by.get(&key(vol)).map_or(&[][..], |v| &v[..]);
        for d in conns.iter().filter_map(|(_, d)| d.as_ref()) {
            d();
        }
        conns.len()
    }
}

/// An export as one connection holds it: the volume, registered in [`Clients`]
/// until the connection ends.
pub struct ExportHandle {
    vol: Arc<VolumeShared>,
    id: u64,
    clients: Arc<Clients>,
    /// The volume's limits (`crate::qos`).
    qos: Arc<crate::qos::Limiter>,
}

impl Drop for ExportHandle {
    fn drop(&mut self) {
        let mut by = self.clients.by_volume.lock().unwrap();
        let k = key(&self.vol);
        if let Some(v) = by.get_mut(&k) {
            v.retain(|(id, _)| *id != self.id);
            if v.is_empty() {
                by.remove(&k);
            }
        }
    }
}

impl Runtime {
    /// Starts the engine's host, its engine thread and `io_threads` device threads,
    /// which run `io_nice` nice steps below the calling thread.
    pub fn start(engine: Engine, io_threads: usize, io_nice: i32) -> Runtime {
        let shared = engine.shared().clone();
        let (io_tx, io_rx) = unbounded::<IoOp>();
        let now = Instant::now();
        let core = Core {
            engine,
            routes: Vec::new(),
            free_routes: Vec::new(),
            ops: Vec::new(),
            replies: Vec::new(),
            shutdown: None,
            closing: None,
            batches: Vec::new(),
            spare: Vec::new(),
            io_tx: Some(io_tx),
            start: now,
            last_tick: now,
        };
        let host = Arc::new(Combiner::new(core, LENT_ROUNDS));
        for i in 0..io_threads.max(1) {
            let io_rx: Receiver<IoOp> = io_rx.clone();
            let host = host.clone();
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("lamina-io{i}"))
                .spawn(move || {
                    lower_priority(io_nice);
                    while let Ok(op) = io_rx.recv() {
                        // A sync's completion is what flushes wait for, and its round
                        // is short (replies to them): run it here rather than pay
                        // for waking the engine thread. Everything else (a unit
                        // written, a GC read, which leads to GC's copying) is handed
                        // off at low priority.
                        let sync = matches!(op.kind, IoKind::Sync);
                        let c = execute(&shared, op);
                        if io_nice > 0 && !sync {
                            host.hand_off(Msg::Io(c));
                        } else {
                            host.post(Msg::Io(c));
                        }
                    }
                })
                .expect("spawn I/O thread");
        }
        let h = host.clone();
        std::thread::Builder::new()
            .name("lamina-engine".into())
            .spawn(move || h.backstop(TICK))
            .expect("spawn engine thread");
        Runtime {
            host,
            shared,
            shutting_down: Arc::new(AtomicBool::new(false)),
            clients: Arc::default(),
            last_scrub: Arc::default(),
            qos: Arc::default(),
        }
    }

    /// Sends a request and waits for its reply (admin path).
    pub fn call(&self, req: Request) -> Result<Option<Box<StatusReport>>, EngineError> {
        self.call_with(req, None)
    }

    /// [`Runtime::call`] for a write or trim of `vol`, as looked up: refused if
    /// the volume was deleted meanwhile (its id may belong to another by then).
    pub fn call_to(
        &self,
        req: Request,
        vol: &VolumeShared,
    ) -> Result<Option<Box<StatusReport>>, EngineError> {
        self.call_with(req, Some(vol.created_version()))
    }

    fn call_with(
        &self,
        req: Request,
        created: Option<lamina_core::Version>,
    ) -> Result<Option<Box<StatusReport>>, EngineError> {
        let (tx, rx) = bounded(1);
        self.host.post(Msg::Req(req, ReplyTo::Admin(tx), created));
        rx.recv().map_err(|_| EngineError::ShuttingDown)?
    }

    /// Flushes, checkpoints and stops the engine.
    pub fn shutdown(&self) -> Result<(), EngineError> {
        self.shutting_down.store(true, Ordering::SeqCst);
        let (tx, rx) = bounded(1);
        self.host.post(Msg::Shutdown(tx));
        rx.recv().map_err(|_| EngineError::ShuttingDown)?
    }
}

/// Moves the calling thread `steps` nice steps down (the kernel stops at 19), so
/// that it takes the CPU only when the threads serving clients leave it: I/O
/// threads write units and read GC's victims, which no client waits for, while a
/// read waits for its thread to get a core. Raising a priority needs privileges;
/// lowering one does not, so this works for any user. A failure costs only the
/// priority.
fn lower_priority(steps: i32) {
    if steps <= 0 {
        return;
    }
    // SAFETY: nice(2) acts on the calling thread on Linux; errno is thread-local.
    // It returns the new nice value, and -1 is a valid one: errno tells an error.
    unsafe {
        *libc::__errno_location() = 0;
        if libc::nice(steps) == -1 && *libc::__errno_location() != 0 {
            tracing::warn!(
                "I/O thread keeps its priority: nice: {}",
                std::io::Error::last_os_error()
            );
        }
    }
}

/// The NBD backend: volumes are exports.
pub struct LaminaBackend {
    pub rt: Runtime,
    pub read_only: ReadOnly,
}

/// Which volumes are served read-only.
#[derive(Default)]
pub struct ReadOnly {
    /// Every volume (`--read-only`, `[serve] read_only`).
    pub all: bool,
    /// These by name (`[serve] read_only_volumes`).
    pub volumes: std::collections::HashSet<String>,
}

/// Logs a failed read; the client gets EIO.
fn read_failed(
    export: &lamina_core::VolumeShared,
    offset: u64,
    len: usize,
    e: lamina_core::ReadError,
) -> u32 {
    tracing::error!(
        "read of {len} bytes at {offset} on {:?} failed: {e}",
        export.name()
    );
    lamina_nbd::proto::EIO
}

impl LaminaBackend {
    fn message(export: &ExportHandle, handle: u64, cmd: Command, reply: &Arc<ReplySink>) -> Msg {
        let volume = export.vol.id;
        let req = match cmd {
            Command::Write { offset, data, fua } => Request::Write {
                volume,
                offset,
                data,
                fua,
            },
            Command::Zero {
                offset,
                length,
                fua,
                allocate,
            } => Request::Zero {
                volume,
                offset,
                length,
                fua,
                allocate,
            },
            Command::Flush => Request::Flush,
        };
        let created = export.vol.created_version();
        Msg::Req(req, ReplyTo::Nbd(reply.clone(), handle), Some(created))
    }
}

impl Backend for LaminaBackend {
    type Export = ExportHandle;

    fn exports(&self) -> Vec<ExportInfo> {
        self.rt
            .shared
            .list_volumes()
            .iter()
            .map(|v| ExportInfo {
                name: v.name().to_string(),
                description: format!("Lamina volume {}", v.name()),
                size: v.size_bytes(),
            })
            .collect()
    }

    fn open_export(&self, name: &str) -> Option<(Self::Export, ExportInfo)> {
        let v = self.rt.shared.volume(name)?;
        if v.closed_to_clients.load(Ordering::SeqCst) {
            tracing::warn!(
                "volume {name:?} is being rolled back: a new connection to it is refused"
            );
            return None;
        }
        let info = ExportInfo {
            name: v.name().to_string(),
            description: format!("Lamina volume {}", v.name()),
            size: v.size_bytes(),
        };
        let qos = self.rt.qos.get(&v.name());
        Some((self.rt.clients.open(v, qos), info))
    }

    fn attach(&self, export: &Self::Export, disconnect: Disconnect) {
        let mut by = self.rt.clients.by_volume.lock().unwrap();
        if let Some(e) = by
            .get_mut(&key(&export.vol))
            .and_then(|v| v.iter_mut().find(|(id, _)| *id == export.id))
        {
            e.1 = Some(disconnect);
        }
    }

    fn read(&self, export: &Self::Export, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        let export = &export.vol;
        if export.deleted.load(Ordering::Relaxed) {
            return Err(lamina_nbd::proto::EIO);
        }
        self.rt
            .shared
            .read(export, offset, buf)
            .map_err(|e| read_failed(export, offset, buf.len(), e))
    }

    fn try_read(
        &self,
        export: &Self::Export,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Result<(), u32>> {
        let export = &export.vol;
        if export.deleted.load(Ordering::Relaxed) {
            return Some(Err(lamina_nbd::proto::EIO));
        }
        let r = self.rt.shared.read_nowait(export, offset, buf)?;
        Some(r.map_err(|e| read_failed(export, offset, buf.len(), e)))
    }

    /// When a device is driven through io_uring: the connections then read from it
    /// themselves (`start_read`), without the read pool's hand-off.
    fn device_reads(&self) -> bool {
        self.rt.shared.device_reads()
    }

    fn start_read(&self, export: &Self::Export, offset: u64, buf: &mut [u8]) -> ReadStart {
        let vol = &export.vol;
        if vol.deleted.load(Ordering::Relaxed) {
            return ReadStart::Done(Err(lamina_nbd::proto::EIO));
        }
        match self.rt.shared.read_start(vol, offset, buf) {
            lamina_core::ReadStart::Done(r) => {
                ReadStart::Done(r.map_err(|e| read_failed(vol, offset, buf.len(), e)))
            }
            lamina_core::ReadStart::Device(d) => {
                let align = |direct| {
                    if direct {
                        lamina_core::BLOCK_SIZE as u32
                    } else {
                        0
                    }
                };
                ReadStart::Device(DeviceRead {
                    fd: d.fd,
                    offset: d.offset,
                    align: align(d.direct),
                    tag: [(d.seg.0 as u64) << 32 | d.seg_off as u64, d.first_lba.0],
                    header: d.header.map(|h| lamina_nbd::HeaderRead {
                        fd: h.fd,
                        offset: h.offset,
                        len: h.len,
                        align: align(h.direct),
                    }),
                })
            }
            lamina_core::ReadStart::Wait => ReadStart::Wait,
        }
    }

    fn finish_read(
        &self,
        export: &Self::Export,
        read: DeviceRead,
        buf: &mut [u8],
        result: std::io::Result<usize>,
        header: Option<(&[u8], std::io::Result<usize>)>,
    ) -> lamina_nbd::Finished {
        let vol = &export.vol;
        let d = lamina_core::DeviceRead {
            fd: read.fd,
            offset: read.offset,
            direct: read.align > 0,
            seg: lamina_core::SegmentId((read.tag[0] >> 32) as u32),
            seg_off: read.tag[0] as u32,
            first_lba: lamina_core::Lba(read.tag[1]),
            header: read.header.map(|h| lamina_core::HeaderRead {
                fd: h.fd,
                offset: h.offset,
                len: h.len,
                direct: h.align > 0,
            }),
        };
        // Failed or damaged: read again on a read thread (`read`, which
        // rebuilds and reports), so that the connection's other reads go on.
        if self.rt.shared.read_finish(vol, d, buf, result, header) {
            lamina_nbd::Finished::Done(Ok(()))
        } else {
            lamina_nbd::Finished::Again
        }
    }

    /// NBD_CMD_CACHE: the device blocks of the range are read ahead into the page
    /// cache (files and buffered block devices), so that the reads that follow
    /// find them there.
    fn cache(&self, export: &Self::Export, offset: u64, length: u32) -> Result<(), u32> {
        if export.vol.deleted.load(Ordering::Relaxed) {
            return Err(lamina_nbd::proto::EIO);
        }
        self.rt.shared.prefetch(&export.vol, offset, length as u64);
        Ok(())
    }

    fn read_only(&self, export: &Self::Export) -> bool {
        self.read_only.all
            || self.read_only.volumes.contains(&*export.vol.name())
            // Snapshots.
            || export.vol.read_only.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn pace(&self, export: &Self::Export, bytes: u64) -> Duration {
        export.qos.pace(bytes)
    }

    fn pace_holds(&self, export: &Self::Export, since: Instant) -> bool {
        !export.vol.deleted.load(Ordering::Relaxed)
            && !self.rt.shutting_down.load(Ordering::Relaxed)
            && !export.qos.changed_since(since)
    }

    fn block_status(
        &self,
        export: &Self::Export,
        offset: u64,
        length: u32,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), u32> {
        let vol = &export.vol;
        if vol.deleted.load(Ordering::Relaxed) {
            return Err(lamina_nbd::proto::EIO);
        }
        // The longest extent a descriptor holds in whole blocks.
        let bs = lamina_core::BLOCK_SIZE as u64;
        let max_extent = u32::MAX as u64 / bs * bs;
        vol.allocation(offset, length as u64, max, max_extent, |len, mapped| {
            out.push(Extent {
                length: len as u32,
                // Unmapped blocks take no space and read as zeros.
                flags: if mapped { 0 } else { STATE_HOLE | STATE_ZERO },
            })
        });
        Ok(())
    }

    fn submit(&self, export: &Self::Export, handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        self.rt.host.post(Self::message(export, handle, cmd, reply));
    }

    fn submit_deferred(
        &self,
        export: &Self::Export,
        handle: u64,
        cmd: Command,
        reply: &Arc<ReplySink>,
    ) {
        self.rt
            .host
            .queue(Self::message(export, handle, cmd, reply));
    }

    fn kick(&self) {
        self.rt.host.kick();
    }

    fn shutting_down(&self) -> bool {
        self.rt.shutting_down.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lamina_core::recovery::FormatParams;
    use lamina_device::fault::FaultDevice;
    use lamina_device::mem::MemDevice;
    use lamina_device::BlockDevice;

    /// Flushes that clients send while the final checkpoint commits are all
    /// answered (done, or refused once the engine has closed), never left
    /// waiting: the engine stops only when nothing it started is in flight. It
    /// used to stop at the checkpoint's answer, and a flush whose sync was sent
    /// after the checkpoint's was never answered.
    #[test]
    fn flushes_sent_during_shutdown_are_all_answered() {
        let mem = Arc::new(MemDevice::new("m", (1 << 20) + 64 * 64 * 4096));
        let dev = Arc::new(FaultDevice::new(mem));
        let devs: Vec<Arc<dyn BlockDevice>> = vec![dev.clone()];
        let params = FormatParams {
            name: "t".into(),
            segment_blocks: 64,
            write_unit_blocks: 8,
            overprovision: 0.25,
            ..Default::default()
        };
        lamina_core::format(&devs, &params, [1; 16], &[[2; 16]], 0).unwrap();
        let (engine, _) = lamina_core::open(
            devs,
            lamina_core::EngineConfig::default(),
            lamina_core::OpenMode::ReadWrite,
        )
        .unwrap();
        let rt = Runtime::start(engine, 2, 0);
        rt.call(Request::CreateVolume {
            name: "v".into(),
            size_bytes: 1 << 20,
        })
        .unwrap();
        let v = rt.shared.volume("v").unwrap();
        rt.call(Request::Write {
            volume: v.id,
            offset: 0,
            data: vec![7; 4096],
            fua: false,
        })
        .unwrap();
        // Every device operation takes 20 ms: the checkpoint's steps and the
        // flushes' syncs overlap.
        dev.slow_down(Duration::from_millis(20));
        let stopper = {
            let rt = rt.clone();
            std::thread::spawn(move || rt.shutdown())
        };
        let mut answers = Vec::new();
        while !stopper.is_finished() {
            let (tx, rx) = bounded(1);
            rt.host
                .post(Msg::Req(Request::Flush, ReplyTo::Admin(tx), None));
            answers.push(rx);
            std::thread::sleep(Duration::from_millis(5));
        }
        stopper.join().unwrap().unwrap();
        assert!(answers.len() > 10, "{} flushes", answers.len());
        let mut done = 0;
        for (i, rx) in answers.iter().enumerate() {
            match rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(_)) => done += 1,
                Ok(Err(EngineError::ShuttingDown)) => {}
                Ok(Err(e)) => panic!("flush {i}: {e}"),
                Err(_) => panic!("flush {i} of {} was never answered", answers.len()),
            }
        }
        assert!(done > 0, "no flush was served during the shutdown");
    }
}
