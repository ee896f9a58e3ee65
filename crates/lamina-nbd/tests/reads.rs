//! Parallel reads: one connection keeps as many reads in flight as it sends, on a
//! backend whose every read takes a while (a slow device), and the replies come
//! back out of order with the right data; an error reply carries no payload and
//! the connection goes on. Large replies that the socket takes only in part never
//! stall the connection.

mod common;

use lamina_nbd::client::Client;
use lamina_nbd::proto::{CMD_READ, EIO};
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, Completion, ExportInfo};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SIZE: u64 = 1 << 30;
const DELAY: Duration = Duration::from_millis(40);
/// Reads of this offset fail.
const BAD: u64 = 4096 * 7;

/// Every read sleeps `DELAY`, later offsets a little less (so that replies finish
/// out of order), and counts how many run at once; with `fast` set, reads do not
/// sleep. Content: each 8-byte word holds its own offset.
#[derive(Default)]
struct Slow {
    now: AtomicUsize,
    most: AtomicUsize,
    fast: bool,
}

impl Backend for Slow {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        common::one_export("slow", SIZE)
    }
    fn open_export(&self, _: &str) -> Option<((), ExportInfo)> {
        Some(((), self.exports().remove(0)))
    }
    fn read(&self, _: &(), offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        let n = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(n, Ordering::SeqCst);
        if !self.fast {
            std::thread::sleep(DELAY - Duration::from_micros((offset / 4096) % 20 * 1000));
        }
        self.now.fetch_sub(1, Ordering::SeqCst);
        if offset == BAD {
            return Err(EIO);
        }
        for (i, w) in buf.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&(offset + 8 * i as u64).to_le_bytes());
        }
        Ok(())
    }
    fn submit(&self, _: &(), handle: u64, _: Command, reply: &Arc<ReplySink>) {
        reply.complete(&mut vec![Completion {
            handle,
            error: 0,
            buf: None,
        }]);
    }
}

#[test]
fn one_connection_keeps_its_reads_in_flight() {
    let backend = Arc::new(Slow::default());
    let (sock, _stop) = common::serve_unix(backend.clone(), "reads");
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    const N: u64 = 64;
    let t0 = Instant::now();
    let mut want = std::collections::HashMap::new();
    for i in 0..N {
        let offset = i * 4096;
        let h = c.send(CMD_READ, 0, offset, 4096, &[]).unwrap();
        want.insert(h, offset);
    }
    c.push().unwrap();
    let mut order = Vec::new();
    for _ in 0..N {
        let r = c.recv().unwrap();
        let offset = want.remove(&r.handle).expect("a reply per request");
        order.push(offset);
        if offset == BAD {
            assert_eq!((r.error, r.data.len()), (EIO, 0));
            continue;
        }
        assert_eq!(r.error, 0);
        for (i, w) in r.data.chunks_exact(8).enumerate() {
            assert_eq!(
                u64::from_le_bytes(w.try_into().unwrap()),
                offset + 8 * i as u64
            );
        }
    }
    let took = t0.elapsed();
    let most = backend.most.load(Ordering::SeqCst);
    eprintln!("{N} reads of {DELAY:?} each: {took:?}, at most {most} at once");
    assert!(most >= 16, "only {most} reads in flight at once");
    assert!(
        took < DELAY * (N as u32) / 8,
        "{N} reads took {took:?}: not in parallel"
    );
    assert!(
        order.windows(2).any(|w| w[0] > w[1]),
        "replies came back strictly in order"
    );
    // The connection goes on after all that.
    assert_eq!(c.read(8192, 16).unwrap().len(), 16);
}

/// Replies larger than the socket's buffer are sent in part by the thread that
/// completes the read and finished by the replier thread. Every round ends with
/// the client waiting for its last reply and sending nothing more, so a reply left
/// behind in the connection's queue without the replier knowing shows as a wait
/// that never ends (it did: the replier's "kicked" flag could stay set after the
/// kick itself had been consumed).
#[test]
fn large_replies_sent_in_part_are_always_finished() {
    let (sock, _stop) = common::serve_unix(
        Arc::new(Slow {
            fast: true,
            ..Slow::default()
        }),
        "large-replies",
    );
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    const LEN: u32 = 1 << 20;
    for round in 0..3000u64 {
        let n = 1 + round % 8;
        let mut want = std::collections::HashMap::new();
        for i in 0..n {
            let offset = ((round * 8 + i) % 512) * LEN as u64;
            want.insert(c.send(CMD_READ, 0, offset, LEN, &[]).unwrap(), offset);
        }
        c.push().unwrap();
        for _ in 0..n {
            let r = c
                .recv()
                .unwrap_or_else(|e| panic!("round {round}: a reply never came ({e})"));
            let offset = want.remove(&r.handle).expect("a reply per request");
            assert_eq!((r.error, r.data.len()), (0, LEN as usize));
            let last = r.data.len() - 8;
            assert_eq!(
                u64::from_le_bytes(r.data[last..].try_into().unwrap()),
                offset + last as u64
            );
        }
    }
}
