//! The server runtime: the engine thread, the device I/O threads, and the NBD
//! backend that connects client connections to them.
//!
//! ```text
//!  connection reader ──read──▶ Shared::read (map lookup, pread, verify) ──▶ reply
//!          │ write / trim / flush
//!          ▼
//!  engine inbox ──▶ engine thread ──IoOp──▶ I/O threads (pwrite, fdatasync)
//!          ▲            │                          │
//!          └────────────┼──── IoCompletion ◀───────┘
//!                       ▼
//!            connection replier (batched replies)
//! ```
//!
//! The engine thread is the only owner of the engine; everything reaches it as a
//! message on one inbox, and it drains the inbox in batches so that a burst of
//! writes costs one wake-up.

use anyhow::Result;
use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};
use lamina_core::io::{execute, IoCompletion, IoOp};
use lamina_core::{Engine, EngineError, Request, Shared, StatusReport, Token, VolumeShared};
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
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
    Req(Request, ReplyTo),
    Io(IoCompletion),
    /// Flush, checkpoint, then stop the engine thread.
    Shutdown(Sender<Result<(), EngineError>>),
}

/// A handle to a running engine.
#[derive(Clone)]
pub struct Runtime {
    pub inbox: Sender<Msg>,
    pub shared: Arc<Shared>,
    pub shutting_down: Arc<AtomicBool>,
    pub clients: Arc<Clients>,
}

type Disconnect = Box<dyn Fn() + Send + Sync>;
/// Per volume: (connection id, how to disconnect it once it has one).
type VolumeClients = HashMap<u16, Vec<(u64, Option<Disconnect>)>>;

/// The NBD connections open on each volume, so that a busy volume is not deleted
/// without `--force`, and a forced delete first disconnects them. Touched when a
/// connection opens or closes, never per request.
#[derive(Default)]
pub struct Clients {
    next: AtomicU64,
    by_volume: Mutex<VolumeClients>,
}

impl Clients {
    fn open(self: &Arc<Self>, vol: Arc<VolumeShared>) -> ExportHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.by_volume
            .lock()
            .unwrap()
            .entry(vol.id.0)
            .or_default()
            .push((id, None));
        ExportHandle {
            vol,
            id,
            clients: self.clone(),
        }
    }

    /// Connections open on volume `id`.
    pub fn count(&self, id: lamina_core::VolumeId) -> usize {
        self.by_volume
            .lock()
            .unwrap()
            .get(&id.0)
            .map_or(0, |v| v.len())
    }

    /// Closes every connection on volume `id` (their sockets are shut down: clients
    /// see the server hang up, as at a server shutdown); returns how many.
    pub fn disconnect(&self, id: lamina_core::VolumeId) -> usize {
        let by = self.by_volume.lock().unwrap();
        let conns = by.get(&id.0).map_or(&[][..], |v| &v[..]);
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
}

impl Drop for ExportHandle {
    fn drop(&mut self) {
        let mut by = self.clients.by_volume.lock().unwrap();
        if let Some(v) = by.get_mut(&self.vol.id.0) {
            v.retain(|(id, _)| *id != self.id);
            if v.is_empty() {
                by.remove(&self.vol.id.0);
            }
        }
    }
}

impl Runtime {
    /// Starts the engine thread and `io_threads` device threads.
    pub fn start(engine: Engine, io_threads: usize) -> Runtime {
        let shared = engine.shared().clone();
        let (inbox, rx) = unbounded::<Msg>();
        let (io_tx, io_rx) = unbounded::<IoOp>();
        for i in 0..io_threads.max(1) {
            let io_rx: Receiver<IoOp> = io_rx.clone();
            let inbox = inbox.clone();
            let shared = shared.clone();
            std::thread::Builder::new()
                .name(format!("lamina-io{i}"))
                .spawn(move || {
                    while let Ok(op) = io_rx.recv() {
                        let c = execute(&shared, op);
                        if inbox.send(Msg::Io(c)).is_err() {
                            return;
                        }
                    }
                })
                .expect("spawn I/O thread");
        }
        std::thread::Builder::new()
            .name("lamina-engine".into())
            .spawn(move || engine_thread(engine, rx, io_tx))
            .expect("spawn engine thread");
        Runtime {
            inbox,
            shared,
            shutting_down: Arc::new(AtomicBool::new(false)),
            clients: Arc::default(),
        }
    }

    /// Sends a request and waits for its reply (admin path).
    pub fn call(&self, req: Request) -> Result<Option<Box<StatusReport>>, EngineError> {
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.inbox
            .send(Msg::Req(req, ReplyTo::Admin(tx)))
            .map_err(|_| EngineError::ShuttingDown)?;
        rx.recv().map_err(|_| EngineError::ShuttingDown)?
    }

    /// Flushes, checkpoints and stops the engine.
    pub fn shutdown(&self) -> Result<(), EngineError> {
        self.shutting_down.store(true, Ordering::SeqCst);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.inbox
            .send(Msg::Shutdown(tx))
            .map_err(|_| EngineError::ShuttingDown)?;
        rx.recv().map_err(|_| EngineError::ShuttingDown)?
    }
}

fn engine_thread(mut engine: Engine, rx: Receiver<Msg>, io_tx: Sender<IoOp>) {
    let start = Instant::now();
    let mut routes: Vec<Option<ReplyTo>> = Vec::new();
    let mut free_routes: Vec<u64> = Vec::new();
    let mut ops = Vec::new();
    let mut replies = Vec::new();
    let mut shutdown: Option<(Sender<Result<(), EngineError>>, u64)> = None;
    // Completions of this round, grouped by connection so each gets one write.
    let mut batches: Vec<(Arc<ReplySink>, Vec<Completion>)> = Vec::new();
    let tick = Duration::from_millis(10);
    let mut last_tick = Instant::now();
    loop {
        let first = match rx.recv_timeout(tick) {
            Ok(m) => Some(m),
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        let mut handle = |m: Msg, engine: &mut Engine| match m {
            Msg::Req(req, to) => {
                let slot = free_routes.pop().unwrap_or_else(|| {
                    routes.push(None);
                    routes.len() as u64 - 1
                });
                routes[slot as usize] = Some(to);
                engine.submit(
                    Token {
                        conn: 0,
                        handle: slot,
                    },
                    req,
                );
            }
            Msg::Io(c) => engine.io_completed(c),
            Msg::Shutdown(done) => {
                // A checkpoint flushes everything first, so after it the array is
                // clean and the next start replays nothing.
                let slot = free_routes.pop().unwrap_or_else(|| {
                    routes.push(None);
                    routes.len() as u64 - 1
                });
                routes[slot as usize] = None;
                engine.submit(
                    Token {
                        conn: 0,
                        handle: slot,
                    },
                    Request::Checkpoint,
                );
                shutdown = Some((done, slot));
            }
        };
        if let Some(m) = first {
            handle(m, &mut engine);
            for _ in 0..4096 {
                match rx.try_recv() {
                    Ok(m) => handle(m, &mut engine),
                    Err(_) => break,
                }
            }
        }
        if last_tick.elapsed() >= tick {
            engine.tick(start.elapsed().as_millis() as u64);
            last_tick = Instant::now();
        }
        engine.drain_io(&mut ops);
        for op in ops.drain(..) {
            let _ = io_tx.send(op);
        }
        engine.drain_replies(&mut replies);
        for r in replies.drain(..) {
            let slot = r.token.handle;
            if let Some((_, s)) = &shutdown {
                if *s == slot {
                    let (done, _) = shutdown.take().unwrap();
                    free_routes.push(slot);
                    let _ = done.send(r.result);
                    return;
                }
            }
            let Some(to) = routes[slot as usize].take() else {
                continue;
            };
            free_routes.push(slot);
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
                    match batches.iter_mut().find(|(s, _)| Arc::ptr_eq(s, &sink)) {
                        Some((_, v)) => v.push(c),
                        None => batches.push((sink, vec![c])),
                    }
                }
                ReplyTo::Admin(tx) => {
                    let _ = tx.send(r.result.map(|_| r.status));
                }
            }
        }
        for (sink, mut cs) in batches.drain(..) {
            sink.complete(&mut cs);
        }
    }
}

/// The NBD backend: volumes are exports.
pub struct LaminaBackend {
    pub rt: Runtime,
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
        export.name
    );
    lamina_nbd::proto::EIO
}

impl Backend for LaminaBackend {
    type Export = ExportHandle;

    fn exports(&self) -> Vec<ExportInfo> {
        self.rt
            .shared
            .list_volumes()
            .iter()
            .map(|v| ExportInfo {
                name: v.name.clone(),
                description: format!("Lamina volume {}", v.name),
                size: v.size_bytes,
            })
            .collect()
    }

    fn open_export(&self, name: &str) -> Option<(Self::Export, ExportInfo)> {
        let v = self.rt.shared.volume(name)?;
        let info = ExportInfo {
            name: v.name.clone(),
            description: format!("Lamina volume {}", v.name),
            size: v.size_bytes,
        };
        Some((self.rt.clients.open(v), info))
    }

    fn attach(&self, export: &Self::Export, disconnect: Disconnect) {
        let mut by = self.rt.clients.by_volume.lock().unwrap();
        if let Some(e) = by
            .get_mut(&export.vol.id.0)
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

    fn submit(&self, export: &Self::Export, handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
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
        if self
            .rt
            .inbox
            .send(Msg::Req(req, ReplyTo::Nbd(reply.clone(), handle)))
            .is_err()
        {
            reply.complete(&mut vec![Completion {
                handle,
                error: lamina_nbd::proto::ESHUTDOWN,
                buf: None,
            }]);
        }
    }

    fn shutting_down(&self) -> bool {
        self.rt.shutting_down.load(Ordering::SeqCst)
    }
}
