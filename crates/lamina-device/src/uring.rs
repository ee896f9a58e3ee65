//! The io_uring device engine: batches of reads, writes and data syncs submitted
//! with one system call and completed in any order.
//!
//! **One ring per thread.** Every thread that drives devices (the engine's I/O
//! threads, the read pool, whoever runs the engine) owns a small ring, made on its
//! first batch. Nothing is shared between threads, so there is no lock, and a batch
//! is never interleaved with another thread's completions. [`run`] returns only when
//! every operation of the batch has completed, which is what lets a batch borrow its
//! buffers: the kernel never touches them after `run` returns.
//!
//! **Why batches.** A striped array writes a row set to every member and syncs every
//! member at a flush. With `pread`/`pwrite`/`fdatasync` those go one after the other
//! (a flush of six members waits for six device cache flushes in a row); as one
//! batch they are all in flight at once and the flush takes as long as the slowest
//! member.
//!
//! **Single operations use plain system calls.** A caller that waits for one result
//! gains nothing from a ring, and io_uring hands an operation that a file system
//! cannot start without blocking (everything on tmpfs, buffered writes on some) to a
//! kernel worker thread: on tmpfs that made 4 KiB reads 7x slower than `pread`
//! (`bench/nbd-vs-nbdkit.sh --shm`, 9.3k against 68k IOPS). Batches pay that worker
//! once per member and get the members' operations in parallel for it.
//!
//! **Fallback.** Where io_uring is missing (old kernels, seccomp filters that refuse
//! `io_uring_setup`, `LAMINA_IO_URING=off`), or a thread cannot make its ring, the
//! same batch is carried out with `pread`/`pwrite`/`fdatasync`, one after the
//! other, with the same results. [`available`] tells which, once per process.

use io_uring::{opcode, types, IoUring};
use std::cell::RefCell;
use std::io;
use std::os::unix::io::RawFd;
use std::sync::OnceLock;

/// Submission queue entries per thread ring: the most operations in flight per
/// thread. Larger batches are fed in as earlier operations complete.
const RING_ENTRIES: u32 = 64;

/// The most bytes one submission moves; a longer transfer completes short and its
/// remainder is submitted again (the kernel takes a `u32` length).
const MAX_CHUNK: usize = 1 << 30;

/// Whether this process can use io_uring, and if not, why. Probed once: a ring is
/// made and asked for the operations Lamina uses.
pub fn available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE
        .get_or_init(|| {
            if std::env::var("LAMINA_IO_URING").is_ok_and(|v| v == "off" || v == "0") {
                return Err("turned off by LAMINA_IO_URING=off".into());
            }
            let ring = IoUring::new(8).map_err(|e| format!("io_uring_setup failed: {e}"))?;
            let mut probe = io_uring::Probe::new();
            ring.submitter()
                .register_probe(&mut probe)
                .map_err(|e| format!("cannot probe io_uring operations: {e}"))?;
            for (code, name) in [
                (opcode::Read::CODE, "READ"),
                (opcode::Write::CODE, "WRITE"),
                (opcode::Fsync::CODE, "FSYNC"),
            ] {
                if !probe.is_supported(code) {
                    return Err(format!("the kernel's io_uring lacks IORING_OP_{name}"));
                }
            }
            Ok(())
        })
        .clone()
}

/// What one operation does.
pub enum OpKind<'a> {
    /// Fill the buffer from the offset.
    Read(&'a mut [u8]),
    /// Write the buffer at the offset.
    Write(&'a [u8]),
    /// `fdatasync` the descriptor (the offset is ignored).
    Datasync,
}

/// One operation of a batch and, after [`run`], its result.
pub struct Op<'a> {
    fd: RawFd,
    offset: u64,
    kind: OpKind<'a>,
    /// Bytes transferred so far (a transfer may complete short and be continued).
    done: usize,
    pub result: io::Result<()>,
}

impl<'a> Op<'a> {
    pub fn read(fd: RawFd, buf: &'a mut [u8], offset: u64) -> Self {
        Self::new(fd, offset, OpKind::Read(buf))
    }
    pub fn write(fd: RawFd, buf: &'a [u8], offset: u64) -> Self {
        Self::new(fd, offset, OpKind::Write(buf))
    }
    pub fn datasync(fd: RawFd) -> Self {
        Self::new(fd, 0, OpKind::Datasync)
    }
    fn new(fd: RawFd, offset: u64, kind: OpKind<'a>) -> Self {
        Op {
            fd,
            offset,
            kind,
            done: 0,
            result: Ok(()),
        }
    }

    fn len(&self) -> usize {
        match &self.kind {
            OpKind::Read(b) => b.len(),
            OpKind::Write(b) => b.len(),
            OpKind::Datasync => 0,
        }
    }

    /// The submission entry for what is left of this operation.
    fn entry(&mut self, tag: u64) -> io_uring::squeue::Entry {
        let fd = types::Fd(self.fd);
        let off = self.offset + self.done as u64;
        let left = (self.len() - self.done).min(MAX_CHUNK) as u32;
        let e = match &mut self.kind {
            OpKind::Read(b) => opcode::Read::new(fd, b[self.done..].as_mut_ptr(), left)
                .offset(off)
                .build(),
            OpKind::Write(b) => opcode::Write::new(fd, b[self.done..].as_ptr(), left)
                .offset(off)
                .build(),
            OpKind::Datasync => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
        };
        e.user_data(tag)
    }

    /// Takes a completion's result; true when the operation must be submitted again
    /// (interrupted, or a transfer that completed short).
    fn complete(&mut self, res: i32) -> bool {
        if res == 0 && self.done == self.len() {
            // Nothing (left) to move: an empty transfer, or a sync.
            return false;
        }
        if res < 0 {
            if res == -libc::EINTR || res == -libc::EAGAIN {
                return true;
            }
            self.result = Err(io::Error::from_raw_os_error(-res));
            return false;
        }
        if matches!(self.kind, OpKind::Datasync) {
            return false;
        }
        if res == 0 {
            self.result = Err(match self.kind {
                OpKind::Read(_) => {
                    io::Error::new(io::ErrorKind::UnexpectedEof, "read past the end")
                }
                _ => io::Error::new(io::ErrorKind::WriteZero, "device took no bytes"),
            });
            return false;
        }
        self.done += res as usize;
        self.done < self.len()
    }

    /// Carries the operation out with a plain system call (the fallback).
    fn run_sync(&mut self) {
        loop {
            // SAFETY: plain system calls on the caller's descriptor and buffer; the
            // lengths never exceed the buffers'.
            let res = unsafe {
                match &mut self.kind {
                    OpKind::Read(b) => libc::pread(
                        self.fd,
                        b[self.done..].as_mut_ptr() as *mut libc::c_void,
                        b.len() - self.done,
                        (self.offset + self.done as u64) as libc::off_t,
                    ),
                    OpKind::Write(b) => libc::pwrite(
                        self.fd,
                        b[self.done..].as_ptr() as *const libc::c_void,
                        b.len() - self.done,
                        (self.offset + self.done as u64) as libc::off_t,
                    ),
                    OpKind::Datasync => libc::fdatasync(self.fd) as isize,
                }
            };
            let res = if res < 0 {
                -io::Error::last_os_error()
                    .raw_os_error()
                    .unwrap_or(libc::EIO)
            } else {
                res.min(i32::MAX as isize) as i32
            };
            if !self.complete(res) {
                return;
            }
        }
    }
}

struct ThreadRing {
    ring: IoUring,
    /// Operations to submit again, by index (reused, so a batch allocates nothing).
    again: Vec<usize>,
}

thread_local! {
    /// This thread's ring: `None` until the first batch, `Some(None)` when it could
    /// not be made (the thread then uses the fallback).
    static RING: RefCell<Option<Option<ThreadRing>>> = const { RefCell::new(None) };
}

/// Carries out every operation of `ops`, on this thread's ring where io_uring is
/// [`available`] and with plain system calls otherwise. Each operation's
/// [`Op::result`] says how it went. Returns when all have completed.
///
/// The operations of a batch are not ordered among themselves: a data sync in the
/// same batch as writes may run before them. Sync in a batch after the writes'.
pub fn run(ops: &mut [Op<'_>], use_uring: bool) {
    if ops.is_empty() {
        return;
    }
    let done = use_uring
        && RING.with(|cell| {
            let Ok(mut slot) = cell.try_borrow_mut() else {
                return false;
            };
            let ring = slot.get_or_insert_with(|| {
                available().ok()?;
                Some(ThreadRing {
                    ring: IoUring::new(RING_ENTRIES).ok()?,
                    again: Vec::new(),
                })
            });
            match ring {
                Some(r) => {
                    r.drive(ops);
                    true
                }
                None => false,
            }
        });
    if !done {
        for op in ops.iter_mut() {
            op.run_sync();
        }
    }
}

impl ThreadRing {
    fn drive(&mut self, ops: &mut [Op<'_>]) {
        let mut next = 0usize;
        let mut in_flight = 0usize;
        self.again.clear();
        let mut enter_errors = 0u32;
        while next < ops.len() || in_flight > 0 || !self.again.is_empty() {
            {
                let mut sq = self.ring.submission();
                while in_flight < RING_ENTRIES as usize {
                    let i = match self.again.pop() {
                        Some(i) => i,
                        None if next < ops.len() => {
                            next += 1;
                            next - 1
                        }
                        None => break,
                    };
                    let e = ops[i].entry(i as u64);
                    // SAFETY: the buffer the entry names is borrowed by `ops`, which
                    // outlives this call, and this call returns only when every
                    // submitted entry has completed.
                    if unsafe { sq.push(&e) }.is_err() {
                        // Cannot happen (at most RING_ENTRIES in flight, and the queue
                        // is empty after each submit); submit what is queued first.
                        self.again.push(i);
                        break;
                    }
                    in_flight += 1;
                }
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                match e.raw_os_error() {
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => {}
                    _ => {
                        // Only a broken ring fails otherwise; and with entries the
                        // kernel may or may not have taken, returning would let it
                        // write into buffers the caller reuses. Retry, then stop the
                        // process rather than risk that.
                        enter_errors += 1;
                        if enter_errors > 100 {
                            eprintln!("lamina: io_uring_enter keeps failing ({e}); stopping");
                            std::process::abort();
                        }
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
            }
            for cqe in self.ring.completion() {
                let i = cqe.user_data() as usize;
                in_flight -= 1;
                if ops[i].complete(cqe.result()) {
                    self.again.push(i);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::io::AsRawFd;

    fn temp_file(name: &str, size: u64) -> (std::path::PathBuf, std::fs::File) {
        let dir = std::env::temp_dir().join(format!("lamina-uring-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        f.set_len(size).unwrap();
        (path, f)
    }

    /// A batch larger than the ring, of writes then reads, with both engines.
    #[test]
    fn batches_larger_than_the_ring_complete() {
        for use_uring in [true, false] {
            let (path, f) = temp_file(&format!("batch-{use_uring}"), 1 << 20);
            let fd = f.as_raw_fd();
            let data: Vec<Vec<u8>> = (0..200u8).map(|i| vec![i; 4096]).collect();
            let mut ops: Vec<Op> = data
                .iter()
                .enumerate()
                .map(|(i, d)| Op::write(fd, d, (i as u64 % 256) * 4096))
                .collect();
            let mut empty = [0u8; 0];
            ops.push(Op::read(fd, &mut empty, 0));
            run(&mut ops, use_uring);
            assert!(
                ops.iter().all(|o| o.result.is_ok()),
                "an empty read is done"
            );
            let mut sync = [Op::datasync(fd)];
            run(&mut sync, use_uring);
            assert!(sync[0].result.is_ok());
            let mut back = vec![vec![0u8; 4096]; 200];
            let mut ops: Vec<Op> = back
                .iter_mut()
                .enumerate()
                .map(|(i, b)| Op::read(fd, b, i as u64 * 4096))
                .collect();
            run(&mut ops, use_uring);
            assert!(ops.iter().all(|o| o.result.is_ok()));
            drop(ops);
            assert_eq!(back, data);
            std::fs::remove_file(path).unwrap();
        }
    }

    /// Reads past the end fail (short at EOF, then nothing), errors are per operation.
    #[test]
    fn errors_are_per_operation() {
        for use_uring in [true, false] {
            let (path, f) = temp_file(&format!("err-{use_uring}"), 8192);
            let fd = f.as_raw_fd();
            let mut a = vec![0u8; 4096];
            let mut b = vec![0u8; 8192];
            let mut ops = [Op::read(fd, &mut a, 0), Op::read(fd, &mut b, 4096)];
            run(&mut ops, use_uring);
            assert!(ops[0].result.is_ok());
            let e = ops[1].result.as_ref().unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{e}");
            let mut ops = [Op::datasync(-1)];
            run(&mut ops, use_uring);
            assert_eq!(
                ops[0].result.as_ref().unwrap_err().raw_os_error(),
                Some(libc::EBADF)
            );
            std::fs::remove_file(path).unwrap();
        }
    }

    #[test]
    fn io_uring_is_available_here() {
        // This machine and CI have io_uring; if this fails, the fallback is what
        // every other test measured.
        if std::env::var("LAMINA_IO_URING").is_err() {
            available().unwrap();
        }
    }
}
