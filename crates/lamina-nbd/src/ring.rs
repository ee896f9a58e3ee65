//! A connection's own io_uring: the device reads of its requests, submitted by the
//! connection's reader and completed by it too, without a hand-off to another
//! thread.
//!
//! **Why.** A read that misses the page cache used to go to a read-pool thread:
//! one queue hand-off and one thread wake-up per read, on top of the device's own
//! wait. On a VM with a fast disk that hand-off was the difference between
//! Lamina's 22-25 µs of CPU per cold read and `nbdkit file`'s 12-17 µs. Now the
//! backend says where the data lies ([`DeviceRead`]: a descriptor and an offset),
//! the reader queues the read on this ring (a burst of requests goes in with one
//! system call), and when it has nothing left to parse it sleeps in the ring
//! waiting for either a completion or the socket (a `POLL_ADD` on the socket in
//! the same ring). Completions are verified by the backend
//! ([`crate::Backend::finish_read`]) and answered from the reader, like reads
//! served from memory.
//!
//! **Buffers.** A read's buffer is moved into its slot here and handed back only
//! when the kernel has completed the read, so the kernel never writes into freed or
//! reused memory; dropping the ring waits for every read still in flight.
//!
//! **Headers.** A read may come with a second one the backend needs to verify it
//! ([`crate::server::HeaderRead`]: a unit header whose checksums it has not
//! cached). Both go in at once, into the request's buffer and one of the ring's
//! own header buffers (kept for reuse), and the request completes when both have.

use crate::server::DeviceRead;
use io_uring::{opcode, types, IoUring};
use std::io;
use std::os::unix::io::RawFd;

/// The `user_data` of the socket's poll; reads use their slot number, and the
/// header read beside one its slot number with this bit.
const POLL_TAG: u64 = u64::MAX;
const HEADER_TAG: u64 = 1 << 32;

/// A read in flight: what the completion hands back.
struct InFlight {
    read: DeviceRead,
    /// The export offset of the request (for the reply).
    offset: u64,
    buf: Vec<u8>,
    /// The request's length, and where in `buf` the kernel writes it (non-zero
    /// when the descriptor needs aligned memory and `buf` is not).
    len: usize,
    pad: usize,
    /// The data read's result, once it completed.
    res: Option<io::Result<usize>>,
    /// The header read beside it, if any.
    header: Option<HeaderInFlight>,
}

struct HeaderInFlight {
    buf: Vec<u8>,
    len: usize,
    pad: usize,
    res: Option<io::Result<usize>>,
}

/// A completed read: slot, export offset, the backend's read, the buffer, the
/// kernel's result (bytes read), and the header read beside it with its result.
pub(crate) type Done<'a> = &'a mut dyn FnMut(
    u16,
    u64,
    DeviceRead,
    Vec<u8>,
    io::Result<usize>,
    Option<(&[u8], io::Result<usize>)>,
);

/// Where in `buf` (grown to `len + align` without an allocation once it has the
/// capacity) a read of `len` bytes needing `align`-aligned memory goes.
fn aligned_window(buf: &mut Vec<u8>, len: usize, align: usize) -> usize {
    if align > 1 {
        buf.reserve_exact((len + align).saturating_sub(buf.len()));
        buf.resize(len + align, 0);
        (align - buf.as_ptr() as usize % align) % align
    } else {
        buf.resize(len, 0);
        0
    }
}

/// A read of `fd` at `offset` into `window`, completing with `tag`. The caller
/// keeps `window`'s memory where it is until the completion is reaped.
fn read_entry(fd: RawFd, window: &mut [u8], offset: u64, tag: u64) -> io_uring::squeue::Entry {
    opcode::Read::new(
        types::Fd(fd),
        window.as_mut_ptr(),
        window.len().min(u32::MAX as usize) as u32,
    )
    .offset(offset)
    .build()
    .user_data(tag)
}

pub(crate) struct ConnRing {
    ring: IoUring,
    /// By slot: the read in flight there.
    slots: Vec<Option<InFlight>>,
    /// Reads queued or in flight.
    inflight: usize,
    /// Entries pushed since the last submission.
    unsubmitted: usize,
    /// A poll on the socket is in the ring and has not completed.
    poll_armed: bool,
    sock: RawFd,
    /// Header buffers not in use.
    header_bufs: Vec<Vec<u8>>,
}

impl ConnRing {
    /// A ring for a connection on socket `sock` with up to `slots` requests in
    /// flight; `None` when the kernel will not make one (the reads then go to the
    /// read pool).
    pub(crate) fn new(sock: RawFd, slots: usize) -> Option<Self> {
        let entries = (slots as u32).next_power_of_two().max(8);
        // Up to two completions a request (its data and a header) and the poll.
        let ring = match IoUring::builder().setup_cqsize(4 * entries).build(entries) {
            Ok(r) => r,
            Err(e) => {
                tracing::debug!("no io_uring for the connection ({e}); reads use the read pool");
                return None;
            }
        };
        Some(ConnRing {
            ring,
            slots: (0..slots).map(|_| None).collect(),
            inflight: 0,
            unsubmitted: 0,
            poll_armed: false,
            sock,
            header_bufs: Vec::new(),
        })
    }

    /// Reads queued or in flight.
    pub(crate) fn inflight(&self) -> usize {
        self.inflight
    }

    /// Queues `read` into `buf` for the request in `slot`. It is submitted with the
    /// next [`ConnRing::submit`] (or when the queue is full).
    pub(crate) fn push(&mut self, slot: u16, offset: u64, read: DeviceRead, mut buf: Vec<u8>) {
        assert!(
            self.slots[slot as usize].is_none(),
            "slot {slot} already has a read in flight"
        );
        let len = buf.len();
        // Room for an aligned window (no allocation once the pooled buffer has
        // it): the kernel reads there, `reap` moves the data to the start.
        let pad = aligned_window(&mut buf, len, read.align as usize);
        let entry = read_entry(read.fd, &mut buf[pad..pad + len], read.offset, slot as u64);
        let mut header_entry = None;
        let header = read.header.map(|h| {
            let mut hbuf = self.header_bufs.pop().unwrap_or_default();
            let len = h.len as usize;
            let pad = aligned_window(&mut hbuf, len, h.align as usize);
            header_entry = Some(read_entry(
                h.fd,
                &mut hbuf[pad..pad + len],
                h.offset,
                slot as u64 | HEADER_TAG,
            ));
            HeaderInFlight {
                buf: hbuf,
                len,
                pad,
                res: None,
            }
        });
        // The buffers' heap memory stays where it is while they sit in the slot.
        self.slots[slot as usize] = Some(InFlight {
            read,
            offset,
            buf,
            len,
            pad,
            res: None,
            header,
        });
        self.inflight += 1;
        self.push_entry(&entry);
        if let Some(e) = header_entry {
            self.push_entry(&e);
        }
    }

    fn push_entry(&mut self, entry: &io_uring::squeue::Entry) {
        loop {
            // SAFETY: the entry's buffer (a read's) lives in `slots` until its
            // completion is reaped; the poll names only the socket.
            if unsafe { self.ring.submission().push(entry) }.is_ok() {
                self.unsubmitted += 1;
                return;
            }
            self.submit();
        }
    }

    /// Submits what was queued.
    pub(crate) fn submit(&mut self) {
        while self.unsubmitted > 0 {
            match self.ring.submit() {
                Ok(n) => self.unsubmitted -= n.min(self.unsubmitted),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // EBUSY/EAGAIN: the completion queue is full; reaping makes room,
                // which the caller's next wait does.
                Err(_) => return,
            }
        }
    }

    /// Hands every completed read to `done`, without waiting. True when the socket
    /// poll completed among them (the socket has something to read).
    pub(crate) fn reap(&mut self, done: Done<'_>) -> bool {
        let mut socket = false;
        loop {
            let Some(cqe) = self.ring.completion().next() else {
                return socket;
            };
            if cqe.user_data() == POLL_TAG {
                self.poll_armed = false;
                socket = true;
                continue;
            }
            let slot = (cqe.user_data() & 0xffff) as u16;
            let res = if cqe.result() < 0 {
                Err(io::Error::from_raw_os_error(-cqe.result()))
            } else {
                Ok(cqe.result() as usize)
            };
            let f = self.slots[slot as usize]
                .as_mut()
                .expect("a completion for a slot without a read");
            if cqe.user_data() & HEADER_TAG != 0 {
                f.header
                    .as_mut()
                    .expect("a header completion for a read without one")
                    .res = Some(res);
            } else {
                f.res = Some(res);
            }
            // Done when the data and its header (if any) both are.
            if f.res.is_none() || f.header.as_ref().is_some_and(|h| h.res.is_none()) {
                continue;
            }
            let mut f = self.slots[slot as usize].take().unwrap();
            self.inflight -= 1;
            if f.buf.len() != f.len {
                f.buf.copy_within(f.pad..f.pad + f.len, 0);
                f.buf.truncate(f.len);
            }
            let res = f.res.take().unwrap();
            match f.header.take() {
                None => done(slot, f.offset, f.read, f.buf, res, None),
                Some(mut h) => {
                    let hres = h.res.take().unwrap();
                    let bytes = &h.buf[h.pad..h.pad + h.len];
                    done(slot, f.offset, f.read, f.buf, res, Some((bytes, hres)));
                    self.header_bufs.push(h.buf);
                }
            }
        }
    }

    /// Waits for a completion (with `socket`, or for the socket to be readable),
    /// then reaps as [`ConnRing::reap`] does. True when the socket is readable.
    pub(crate) fn wait(&mut self, socket: bool, done: Done<'_>) -> bool {
        if socket && !self.poll_armed {
            let entry = opcode::PollAdd::new(types::Fd(self.sock), libc::POLLIN as u32)
                .build()
                .user_data(POLL_TAG);
            self.poll_armed = true;
            self.push_entry(&entry);
        }
        loop {
            match self.ring.submit_and_wait(1) {
                Ok(n) => self.unsubmitted -= n.min(self.unsubmitted),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
                // EBUSY: completions are waiting to be reaped, which comes next.
                Err(_) => {}
            }
            if !self.ring.completion().is_empty() {
                // A poll that completed may be stale: armed before the loop that
                // read what woke it. Only bytes (or an end) waiting now count, or
                // the reader would block in `recv` with reads left unreaped.
                return self.reap(done) && self.socket_has_input();
            }
        }
    }

    /// Whether the socket has bytes to read, an end of stream or an error: anything
    /// a read would return at once.
    fn socket_has_input(&self) -> bool {
        let mut b = [0u8; 1];
        // SAFETY: peeks into a valid one-byte buffer on our socket.
        let n = unsafe {
            libc::recv(
                self.sock,
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        n >= 0 || io::Error::last_os_error().kind() != io::ErrorKind::WouldBlock
    }

    /// Completes every read in flight, handing each to `done`.
    pub(crate) fn drain(&mut self, done: Done<'_>) {
        self.submit();
        while self.inflight > 0 {
            self.wait(false, done);
        }
    }
}

impl Drop for ConnRing {
    /// The kernel may still be writing into buffers of reads in flight: wait for
    /// them (a connection that ends normally drained them already, through the
    /// backend; this is the path of a panic).
    fn drop(&mut self) {
        if self.inflight > 0 {
            self.submit();
            let mut lost = |_: u16,
                            _: u64,
                            _: DeviceRead,
                            _: Vec<u8>,
                            _: io::Result<usize>,
                            _: Option<(&[u8], io::Result<usize>)>| {};
            while self.inflight > 0 {
                self.wait(false, &mut lost);
            }
        }
    }
}
