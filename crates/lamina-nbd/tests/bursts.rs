//! Bursts: a connection holds back the commands of a burst it has already buffered
//! (`Backend::submit_deferred`) and starts them with the next `submit` or a `kick`
//! before it waits for anything. The backend here never completes a held command by
//! itself (no timer), so a server that waited for a credit or for payload budget
//! without kicking first would hang; and a burst must reach the backend as one.

mod common;

use lamina_nbd::client::Client;
use lamina_nbd::proto::{CMD_FLUSH, CMD_WRITE};
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SIZE: u64 = 1 << 30;

/// A held command: handle, payload, where the reply goes.
type Held = (u64, Option<Vec<u8>>, Arc<ReplySink>);

/// Completes held commands only when told to (`submit` or `kick`).
#[derive(Default)]
struct Holding {
    /// Held commands: handle, write payload (handed back in the completion, which
    /// releases its budget), where the reply goes.
    held: Mutex<Vec<Held>>,
    deferred: AtomicUsize,
    largest_batch: AtomicUsize,
}

impl Holding {
    fn release(&self, also: Option<(u64, Command, &Arc<ReplySink>)>) {
        let mut held = std::mem::take(&mut *self.held.lock().unwrap());
        if let Some((h, cmd, r)) = also {
            held.push((h, cmd.into_buffer(), r.clone()));
        }
        self.largest_batch.fetch_max(held.len(), Ordering::SeqCst);
        for (handle, buf, reply) in held {
            reply.complete(&mut vec![Completion {
                handle,
                error: 0,
                buf,
            }]);
        }
    }
}

impl Backend for Holding {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        common::one_export("holding", SIZE)
    }
    fn open_export(&self, _: &str) -> Option<((), ExportInfo)> {
        Some(((), self.exports().remove(0)))
    }
    fn read(&self, _: &(), _: u64, buf: &mut [u8]) -> Result<(), u32> {
        buf.fill(0);
        Ok(())
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        self.release(Some((handle, cmd, reply)));
    }
    fn submit_deferred(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        self.deferred.fetch_add(1, Ordering::SeqCst);
        self.held
            .lock()
            .unwrap()
            .push((handle, cmd.into_buffer(), reply.clone()));
    }
    fn kick(&self) {
        self.release(None);
    }
}

/// Sends `n` pipelined writes of `len` bytes (flushes when `len` is 0) and waits
/// for every reply.
fn burst(c: &mut Client, n: u64, len: u32) {
    let data = vec![7u8; len as usize];
    let mut want = std::collections::HashSet::new();
    for i in 0..n {
        let h = if len == 0 {
            c.send(CMD_FLUSH, 0, 0, 0, &[])
        } else {
            c.send(CMD_WRITE, 0, i * len as u64 % SIZE, len, &data)
        };
        want.insert(h.unwrap());
    }
    c.push().unwrap();
    for _ in 0..n {
        let r = c
            .recv()
            .expect("a reply for every write (the server hung?)");
        assert_eq!(r.error, 0);
        assert!(want.remove(&r.handle), "one reply per request");
    }
}

#[test]
fn held_commands_are_started_before_the_connection_waits() {
    let backend = Arc::new(Holding::default());
    let (sock, _stop) = common::serve_unix(backend.clone(), "bursts");
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut c = Client::connect_unix(&sock, "v").unwrap();
        // Requests small enough that more of them fit in the reader's buffer than
        // a connection has credits (256): the reader must start the held ones
        // before it waits for a credit.
        burst(&mut c, 3000, 0);
        // Bursts of writes, small and large (more payload than a connection may
        // hold at once, 64 MiB).
        burst(&mut c, 1000, 4096);
        burst(&mut c, 100, 1 << 20);
        done_tx.send(()).unwrap();
    });
    done_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the writes did not all complete: held commands were never started");
    let deferred = backend.deferred.load(Ordering::SeqCst);
    let batch = backend.largest_batch.load(Ordering::SeqCst);
    eprintln!("{deferred} commands held back, largest batch {batch}");
    assert!(deferred > 0, "no command of a burst was held back");
    assert!(
        batch >= 8,
        "bursts reached the backend one by one (largest {batch})"
    );
}
