//! The server's global caps: the write payload held over all connections together
//! stays under the in-flight limit however many clients push, the connections wait
//! rather than fail, and everything completes once the backend catches up.

mod common;

use lamina_nbd::client::Client;
use lamina_nbd::proto::CMD_WRITE;
use lamina_nbd::server::{inflight_bytes, set_inflight_limit, ReplySink};
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// A write the backend holds: handle, payload, where its completion goes.
type HeldWrite = (u64, Vec<u8>, Arc<ReplySink>);

/// A backend that holds every write until told to complete it, and records the
/// most payload it ever held at once.
#[derive(Default)]
struct Holding {
    held: Mutex<Vec<HeldWrite>>,
    bytes: AtomicU64,
    most: AtomicU64,
}

impl Backend for Holding {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        common::one_export("holding", 1 << 30)
    }
    fn open_export(&self, _: &str) -> Option<((), ExportInfo)> {
        Some(((), self.exports().remove(0)))
    }
    fn read(&self, _: &(), _: u64, buf: &mut [u8]) -> Result<(), u32> {
        buf.fill(0);
        Ok(())
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        let Command::Write { data, .. } = cmd else {
            reply.complete(&mut vec![Completion {
                handle,
                error: 0,
                buf: None,
            }]);
            return;
        };
        let now = self.bytes.fetch_add(data.len() as u64, Ordering::SeqCst) + data.len() as u64;
        self.most.fetch_max(now, Ordering::SeqCst);
        self.held
            .lock()
            .unwrap()
            .push((handle, data, reply.clone()));
    }
}

impl Holding {
    fn complete_all(&self) -> usize {
        let held = std::mem::take(&mut *self.held.lock().unwrap());
        let n = held.len();
        for (handle, data, sink) in held {
            self.bytes.fetch_sub(data.len() as u64, Ordering::SeqCst);
            sink.complete(&mut vec![Completion {
                handle,
                error: 0,
                buf: Some(data),
            }]);
        }
        n
    }
}

#[test]
fn payload_over_all_connections_stays_under_the_limit() {
    const LIMIT: u64 = 8 << 20;
    const MIB: usize = 1 << 20;
    set_inflight_limit(LIMIT);
    let backend = Arc::new(Holding::default());
    let (sock, stop) = common::serve_unix(backend.clone(), "caps");
    // Six clients, each pushing 6 MiB of writes: 36 MiB against an 8 MiB limit
    // (each connection alone stays under its own 64 MiB budget).
    let clients: Vec<_> = (0..6)
        .map(|c| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut cl = Client::connect_unix(&sock, "v").unwrap();
                let data = vec![c as u8; MIB];
                let mut handles = Vec::new();
                for i in 0..6u64 {
                    let off = (c * 6 + i) * MIB as u64;
                    handles.push(cl.send(CMD_WRITE, 0, off, MIB as u32, &data).unwrap());
                }
                cl.push().unwrap();
                for _ in &handles {
                    let r = cl.recv().unwrap();
                    assert_eq!(r.error, 0);
                    assert!(handles.contains(&r.handle));
                }
            })
        })
        .collect();
    // The backend fills up to the limit and no further while nothing completes.
    let t0 = Instant::now();
    while backend.bytes.load(Ordering::SeqCst) < LIMIT {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the backend never filled up"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(backend.bytes.load(Ordering::SeqCst), LIMIT);
    assert!(inflight_bytes() <= LIMIT);
    // Completing lets the waiting connections on, until every write is through.
    let mut done = 0;
    let t0 = Instant::now();
    while done < 36 {
        done += backend.complete_all();
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{done} of 36 writes completed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    for c in clients {
        c.join().unwrap();
    }
    assert!(backend.most.load(Ordering::SeqCst) <= LIMIT);
    assert_eq!(inflight_bytes(), 0);
    stop.store(true, Ordering::SeqCst);
}
