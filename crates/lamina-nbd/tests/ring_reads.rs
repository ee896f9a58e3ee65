//! Device reads carried out by the connection itself (its io_uring): a backend
//! that hands out [`DeviceRead`]s gets them read, many at once, completed on the
//! reader and handed back to `finish_read` exactly once each, also when the client
//! goes away with reads in flight.
//!
//! The "device" is the read end of a pipe, which holds every read until the test
//! feeds it: so the test sees how many reads one connection keeps in flight
//! before any completes.

mod common;

use lamina_nbd::client::Client;
use lamina_nbd::proto::{CMD_READ, EIO};
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, Completion, DeviceRead, ExportInfo, Finished, ReadStart};
use std::fs::File;
use std::io::Write;
use std::os::unix::io::{AsRawFd, FromRawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const FILL: u8 = 0xab;
const HEADER: u8 = 0x5a;
const HEADER_LEN: usize = 512;

struct Piped {
    /// The pipe's read end: every read names it.
    rx: File,
    started: AtomicUsize,
    finished: AtomicUsize,
    /// When given, every other read (odd blocks) asks for a header beside its
    /// data: HEADER_LEN bytes of this pipe, into an aligned buffer of the ring's;
    /// `seen` counts those that came.
    headers: Option<File>,
    seen: AtomicUsize,
}

impl Piped {
    fn new(rx: File, headers: Option<File>) -> Self {
        Piped {
            rx,
            started: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            headers,
            seen: AtomicUsize::new(0),
        }
    }
}

impl Backend for Piped {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        common::one_export("piped", 1 << 30)
    }
    fn open_export(&self, _: &str) -> Option<((), ExportInfo)> {
        Some(((), self.exports().remove(0)))
    }
    fn read(&self, _: &(), _: u64, _: &mut [u8]) -> Result<(), u32> {
        panic!("every read is a device read here")
    }
    fn device_reads(&self) -> bool {
        true
    }
    fn start_read(&self, _: &(), offset: u64, _: &mut [u8]) -> ReadStart {
        self.started.fetch_add(1, Ordering::SeqCst);
        ReadStart::Device(DeviceRead {
            fd: self.rx.as_raw_fd(),
            offset: 0, // a pipe has no offsets
            // Every other read as for O_DIRECT: read into an aligned window of
            // its buffer and moved to the start (the reply shows it was).
            align: if (offset / 4096) % 2 == 1 { 4096 } else { 0 },
            tag: [offset, 7],
            header: self
                .headers
                .as_ref()
                .filter(|_| (offset / 4096) % 2 == 1)
                .map(|h| lamina_nbd::HeaderRead {
                    fd: h.as_raw_fd(),
                    offset: 0,
                    len: HEADER_LEN as u32,
                    align: 4096,
                }),
        })
    }
    fn finish_read(
        &self,
        _: &(),
        read: DeviceRead,
        buf: &mut [u8],
        result: std::io::Result<usize>,
        header: Option<(&[u8], std::io::Result<usize>)>,
    ) -> Finished {
        assert_eq!(read.tag[1], 7, "the tag comes back as it was given");
        match header {
            Some((bytes, res)) => {
                assert!(read.header.is_some(), "a header nobody asked for");
                assert_eq!(res.unwrap(), HEADER_LEN);
                assert!(bytes.len() == HEADER_LEN && bytes.iter().all(|&b| b == HEADER));
                self.seen.fetch_add(1, Ordering::SeqCst);
            }
            None => assert!(read.header.is_none(), "the header asked for did not come"),
        }
        self.finished.fetch_add(1, Ordering::SeqCst);
        Finished::Done(match result {
            Ok(n) if n == buf.len() => Ok(()),
            _ => Err(EIO),
        })
    }
    fn submit(&self, _: &(), handle: u64, _: Command, reply: &Arc<ReplySink>) {
        reply.complete(&mut vec![Completion {
            handle,
            error: 0,
            buf: None,
        }]);
    }
}

fn pipe() -> (File, File) {
    let mut fds = [0; 2];
    // SAFETY: pipe fills the two descriptors, which the Files then own.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    unsafe { (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1])) }
}

fn wait_for(what: &str, f: impl Fn() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < Duration::from_secs(10), "timed out: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Feeds `n` reads' worth (4 KiB each, at most PIPE_BUF so each write is whole).
fn feed(tx: &mut File, n: usize) {
    for _ in 0..n {
        tx.write_all(&[FILL; 4096]).unwrap();
    }
}

#[test]
fn one_connection_keeps_its_device_reads_in_flight() {
    let (rx, mut tx) = pipe();
    let backend = Arc::new(Piped::new(rx, None));
    let (sock, _stop) = common::serve_unix(backend.clone(), "ring-reads");
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    const N: usize = 32;
    for i in 0..N {
        c.send(CMD_READ, 0, i as u64 * 4096, 4096, &[]).unwrap();
    }
    c.push().unwrap();
    wait_for("every read started", || {
        backend.started.load(Ordering::SeqCst) == N
    });
    // All of them are in flight on the device at once: none can have completed.
    assert_eq!(backend.finished.load(Ordering::SeqCst), 0);
    let feeder = std::thread::spawn(move || {
        feed(&mut tx, N);
        tx
    });
    for _ in 0..N {
        let r = c.recv().unwrap();
        assert_eq!(r.error, 0);
        assert!(r.data.len() == 4096 && r.data.iter().all(|&b| b == FILL));
    }
    let mut tx = feeder.join().unwrap();
    assert_eq!(backend.finished.load(Ordering::SeqCst), N);

    // The client goes away with reads in flight: the connection still finishes
    // each (a backend releases what they hold there) before it ends.
    for i in 0..8u64 {
        c.send(CMD_READ, 0, i * 4096, 4096, &[]).unwrap();
    }
    c.push().unwrap();
    wait_for("the second reads started", || {
        backend.started.load(Ordering::SeqCst) == N + 8
    });
    drop(c);
    std::thread::sleep(Duration::from_millis(50));
    feed(&mut tx, 8);
    wait_for("every read finished", || {
        backend.finished.load(Ordering::SeqCst) == N + 8
    });
}

/// Like [`Piped`], but the read at offset 0 does not verify (`Finished::Again`):
/// it is read again by `read`, which waits until every other read has finished.
struct Retried {
    piped: Piped,
    /// The thread `read` ran on.
    read_on: std::sync::Mutex<Option<String>>,
}

const RETRIED: u8 = 0xcd;

impl Backend for Retried {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        self.piped.exports()
    }
    fn open_export(&self, name: &str) -> Option<((), ExportInfo)> {
        self.piped.open_export(name)
    }
    fn read(&self, _: &(), offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        assert_eq!(offset, 0, "only the retried read is read again");
        *self.read_on.lock().unwrap() = std::thread::current().name().map(String::from);
        // Were this the reader's thread, the other reads could not finish.
        let t0 = Instant::now();
        while self.piped.finished.load(Ordering::SeqCst) < 9 {
            if t0.elapsed() > Duration::from_secs(5) {
                return Err(EIO);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        buf.fill(RETRIED);
        Ok(())
    }
    fn device_reads(&self) -> bool {
        true
    }
    fn start_read(&self, e: &(), offset: u64, buf: &mut [u8]) -> ReadStart {
        self.piped.start_read(e, offset, buf)
    }
    fn finish_read(
        &self,
        e: &(),
        read: DeviceRead,
        buf: &mut [u8],
        result: std::io::Result<usize>,
        header: Option<(&[u8], std::io::Result<usize>)>,
    ) -> Finished {
        let offset = read.tag[0];
        let f = self.piped.finish_read(e, read, buf, result, header);
        if offset == 0 {
            Finished::Again
        } else {
            f
        }
    }
    fn submit(&self, e: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        self.piped.submit(e, handle, cmd, reply)
    }
}

/// A read that fails or does not verify is read again on a read thread: the
/// connection's other reads are finished and answered meanwhile (the read again
/// waits for them, which it could not do on the connection's reader).
#[test]
fn a_read_that_does_not_verify_is_read_again_off_the_reader() {
    let (rx, mut tx) = pipe();
    let backend = Arc::new(Retried {
        piped: Piped::new(rx, None),
        read_on: Default::default(),
    });
    let (sock, _stop) = common::serve_unix(backend.clone(), "ring-retried");
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let n = 9;
    let handles: Vec<u64> = (0..n)
        .map(|i| c.send(CMD_READ, 0, i as u64 * 4096, 4096, &[]).unwrap())
        .collect();
    c.push().unwrap();
    feed(&mut tx, n);
    for _ in 0..n {
        let r = c.recv().unwrap();
        assert_eq!(r.error, 0, "handle {}", r.handle);
        let want = if r.handle == handles[0] {
            RETRIED
        } else {
            FILL
        };
        assert!(r.data.len() == 4096 && r.data.iter().all(|&b| b == want));
    }
    let on = backend.read_on.lock().unwrap().clone().unwrap_or_default();
    assert!(on.starts_with("nbd-read"), "read again on thread {on:?}");
}

/// A read that asks for a header beside its data completes when both have: not
/// before its header is read, and with the header's bytes, once each.
#[test]
fn a_read_with_a_header_completes_when_both_are_read() {
    let (rx, mut tx) = pipe();
    let (hrx, mut htx) = pipe();
    let backend = Arc::new(Piped::new(rx, Some(hrx)));
    let (sock, _stop) = common::serve_unix(backend.clone(), "ring-headers");
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    c.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    const N: usize = 16;
    for i in 0..N {
        c.send(CMD_READ, 0, i as u64 * 4096, 4096, &[]).unwrap();
    }
    c.push().unwrap();
    wait_for("every read started", || {
        backend.started.load(Ordering::SeqCst) == N
    });
    // The data of all of them: those without a header complete.
    feed(&mut tx, N);
    for _ in 0..N / 2 {
        let r = c.recv().unwrap();
        assert_eq!(r.error, 0);
        assert!(r.data.iter().all(|&b| b == FILL));
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(backend.finished.load(Ordering::SeqCst), N / 2);
    assert_eq!(backend.seen.load(Ordering::SeqCst), 0);
    // Their headers: the rest complete.
    for _ in 0..N / 2 {
        htx.write_all(&[HEADER; HEADER_LEN]).unwrap();
    }
    for _ in 0..N / 2 {
        let r = c.recv().unwrap();
        assert_eq!(r.error, 0);
        assert!(r.data.len() == 4096 && r.data.iter().all(|&b| b == FILL));
    }
    assert_eq!(backend.seen.load(Ordering::SeqCst), N / 2);
    assert_eq!(backend.finished.load(Ordering::SeqCst), N);
}
