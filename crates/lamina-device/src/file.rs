//! Regular files and raw block devices: `pread`, `pwrite` and `fdatasync` for single
//! operations, io_uring batches when an array drives several members at once (see
//! [`crate::uring`]), buffered or direct.
//!
//! `fdatasync` on a regular file writes the page cache back and flushes the disk's
//! volatile cache; on a block device it flushes the device cache. Either way a
//! completed [`BlockDevice::sync`] means the data survives a power cut.
//!
//! **Direct I/O** (`O_DIRECT`) moves data between the device and Lamina's buffers
//! without the page cache: no second copy of data Lamina already caches (its write
//! buffer, the header cache), no copy per transfer, and the device sees writes when
//! Lamina issues them rather than when writeback gets to them. It is the default on
//! block devices. On files it is a choice: the page cache of a file is often what
//! makes re-reads fast, and tmpfs has no device to go direct to. Memory that is not
//! page-aligned goes through a per-thread aligned buffer; offsets and lengths are
//! whole 4 KiB blocks everywhere in Lamina.
//!
//! Every open takes an exclusive `flock`, so a second Lamina process (or a
//! `lamina status` that would read a device the server is writing) fails clearly.

use crate::aligned::{is_aligned, AlignedBuf, ALIGN};
use crate::uring::{self, Op};
use crate::{check_range, BlockDevice, DeviceError, UringTarget};
use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

pub struct FileDevice {
    path: PathBuf,
    file: File,
    size: u64,
    is_block_device: bool,
    /// The file lives in memory (tmpfs, ramfs): reading it never waits for a
    /// device, and RWF_NOWAIT is not supported there.
    in_memory: bool,
    /// Arrays may put this device's operations into io_uring batches
    /// ([`BlockDevice::uring_target`]); single operations use plain system calls.
    uring: bool,
    /// Opened with `O_DIRECT`.
    direct: bool,
}

/// Which system calls drive a device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum IoEngine {
    /// io_uring where the kernel has it, else `pread`/`pwrite`.
    #[default]
    Auto,
    /// io_uring; opening fails where it is missing.
    Uring,
    /// `pread`/`pwrite`/`fdatasync`.
    Sync,
}

/// When to bypass the page cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DirectIo {
    /// On block devices, off on files.
    #[default]
    Auto,
    /// Everywhere it is possible (not on tmpfs, which has no device behind it).
    On,
    Off,
}

/// How to drive the devices of an array (`[engine] io_engine`, `direct_io`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoOptions {
    pub engine: IoEngine,
    pub direct: DirectIo,
}

impl IoOptions {
    /// One line for the start-up log: what drives the devices, and why not io_uring
    /// if it is not.
    pub fn describe(&self) -> String {
        let direct = match self.direct {
            DirectIo::Auto => "direct I/O on block devices",
            DirectIo::On => "direct I/O",
            DirectIo::Off => "buffered I/O",
        };
        match (self.engine, uring::available()) {
            (IoEngine::Sync, _) => {
                format!("pread/pwrite ([engine] io_engine = \"sync\"), {direct}")
            }
            (_, Ok(())) => format!("io_uring, {direct}"),
            (_, Err(why)) => format!("pread/pwrite (io_uring unavailable: {why}), {direct}"),
        }
    }
}

thread_local! {
    /// Bounce buffer for direct I/O from memory that is not page-aligned.
    static BOUNCE: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf::new()) };
}

/// How to open a device file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// Read and write, exclusive lock.
    ReadWrite,
    /// Read only, shared lock (tools inspecting a stopped array).
    ReadOnly,
}

impl FileDevice {
    /// Creates a sparse file of `size` bytes. Fails if `path` exists.
    pub fn create_sparse(path: &Path, size: u64) -> Result<Self, DeviceError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|e| DeviceError::Open {
                device: path.display().to_string(),
                detail: format!("cannot create backing file: {e}"),
            })?;
        file.set_len(size).map_err(|e| DeviceError::Open {
            device: path.display().to_string(),
            detail: format!("cannot size backing file to {size} bytes: {e}"),
        })?;
        drop(file);
        Self::open(path, OpenMode::ReadWrite)
    }

    /// Opens an existing regular file or block device with the default
    /// [`IoOptions`].
    pub fn open(path: &Path, mode: OpenMode) -> Result<Self, DeviceError> {
        Self::open_with(path, mode, IoOptions::default())
    }

    /// Opens an existing regular file or block device.
    pub fn open_with(path: &Path, mode: OpenMode, io: IoOptions) -> Result<Self, DeviceError> {
        let device = path.display().to_string();
        let open_err = |detail: String| DeviceError::Open {
            device: device.clone(),
            detail,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(mode == OpenMode::ReadWrite)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| open_err(format!("cannot open: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| open_err(format!("cannot stat: {e}")))?;
        let is_block_device = meta.file_type().is_block_device();
        let size = if is_block_device {
            block_device_size(&file).map_err(|e| open_err(format!("cannot get size: {e}")))?
        } else if meta.is_file() {
            meta.len()
        } else {
            return Err(open_err("not a regular file or block device".to_string()));
        };
        let op = match mode {
            OpenMode::ReadWrite => libc::LOCK_EX,
            OpenMode::ReadOnly => libc::LOCK_SH,
        };
        // A process that was killed releases its locks when the last reference to
        // its open files goes; io_uring tears a dead process's rings down in the
        // background and holds its files until then (milliseconds, or as long as
        // its last requests take). A lock whose holder has exited is waited for.
        let started = std::time::Instant::now();
        loop {
            // SAFETY: flock on a file descriptor we own.
            let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
            if rc == 0 {
                break;
            }
            let holder = lock_holder(&meta);
            let exited = holder.as_ref().is_none_or(|(pid, _)| !process_alive(*pid));
            if exited && started.elapsed() < LOCK_RELEASE_WAIT {
                std::thread::sleep(std::time::Duration::from_millis(10));
                continue;
            }
            return Err(open_err(match holder {
                Some((pid, cmd)) if !exited => format!("is in use by process {pid} ({cmd})"),
                Some((pid, _)) => format!(
                    "is still locked by process {pid}, which has exited (its I/O did not finish within {}s)",
                    LOCK_RELEASE_WAIT.as_secs()
                ),
                None => {
                    "is in use by another Lamina process (or another program holds a lock on it)"
                        .to_string()
                }
            }));
        }
        let in_memory = !is_block_device && in_memory_fs(&file);
        // tmpfs cannot read or write without possibly blocking in io_uring's sense,
        // so io_uring hands every operation on it to a kernel worker thread: slower
        // than the system call. Files in memory are driven with system calls.
        let uring = match io.engine {
            IoEngine::Sync => false,
            IoEngine::Auto => uring::available().is_ok() && !in_memory,
            IoEngine::Uring => {
                uring::available().map_err(|why| {
                    open_err(format!("[engine] io_engine = \"uring\", but {why}"))
                })?;
                !in_memory
            }
        };
        let want_direct = match io.direct {
            DirectIo::Auto => is_block_device,
            DirectIo::On => !in_memory,
            DirectIo::Off => false,
        };
        if want_direct {
            set_direct(&file).map_err(|e| {
                open_err(format!(
                    "cannot use direct I/O ({e}); set [engine] direct_io = \"off\""
                ))
            })?;
        }
        Ok(FileDevice {
            path: path.to_path_buf(),
            file,
            size,
            is_block_device,
            in_memory,
            uring,
            direct: want_direct,
        })
    }

    /// Whether reads and writes bypass the page cache.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Whether the device is driven through io_uring.
    pub fn uses_uring(&self) -> bool {
        self.uring
    }

    /// One read or write through the chosen engine; direct transfers from memory
    /// that is not page-aligned go through the bounce buffer.
    fn transfer(&self, op: &'static str, offset: u64, buf: Buf<'_>) -> Result<(), DeviceError> {
        let len = buf.len();
        if self.direct && !(offset as usize | len).is_multiple_of(ALIGN) {
            return Err(self.io_err(
                op,
                offset,
                len,
                std::io::Error::other("direct I/O needs whole 4 KiB blocks"),
            ));
        }
        let fd = self.file.as_raw_fd();
        // One operation waited for on the spot: a plain system call (see `uring`).
        let run = |o: Op<'_>| {
            let mut ops = [o];
            uring::run(&mut ops, false);
            let [o] = ops;
            o.result
        };
        let r = match buf {
            Buf::Read(b) if self.direct && !is_aligned(b.as_ptr()) => BOUNCE.with(|t| {
                let mut t = t.borrow_mut();
                let a = t.get(len);
                run(Op::read(fd, a, offset))?;
                b.copy_from_slice(a);
                Ok(())
            }),
            Buf::Write(b) if self.direct && !is_aligned(b.as_ptr()) => BOUNCE.with(|t| {
                let mut t = t.borrow_mut();
                let a = t.get(len);
                a.copy_from_slice(b);
                run(Op::write(fd, a, offset))
            }),
            Buf::Read(b) => run(Op::read(fd, b, offset)),
            Buf::Write(b) => run(Op::write(fd, b, offset)),
        };
        r.map_err(|e| self.io_err(op, offset, len, e))
    }
    /// The open file (block-device ioctls need its descriptor).
    pub fn file(&self) -> &File {
        &self.file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn is_block_device(&self) -> bool {
        self.is_block_device
    }

    fn io_err(&self, op: &'static str, offset: u64, len: usize, e: std::io::Error) -> DeviceError {
        DeviceError::Io {
            device: self.describe(),
            op,
            offset,
            len,
            source: e,
        }
    }
}

enum Buf<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
}

impl Buf<'_> {
    fn len(&self) -> usize {
        match self {
            Buf::Read(b) => b.len(),
            Buf::Write(b) => b.len(),
        }
    }
}

/// Turns on `O_DIRECT` for an open file (EINVAL where the file system has no
/// direct I/O).
fn set_direct(file: &File) -> std::io::Result<()> {
    let fd = file.as_raw_fd();
    // SAFETY: fcntl on a descriptor we own.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_DIRECT) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

fn block_device_size(file: &File) -> std::io::Result<u64> {
    // BLKGETSIZE64 = _IOR(0x12, 114, size_t)
    const BLKGETSIZE64: libc::c_ulong = 0x8008_1272;
    let mut size: u64 = 0;
    // SAFETY: the ioctl writes one u64 into `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), BLKGETSIZE64, &mut size as *mut u64) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(size)
}

/// Whether `file` is on a file system kept in memory (tmpfs, ramfs).
fn in_memory_fs(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    // SAFETY: fstatfs fills the zeroed struct for our open descriptor.
    unsafe {
        let mut st: libc::statfs = std::mem::zeroed();
        libc::fstatfs(file.as_raw_fd(), &mut st) == 0
            && matches!(st.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC)
    }
}

impl BlockDevice for FileDevice {
    fn size_bytes(&self) -> u64 {
        self.size
    }
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "read", offset, buf.len())?;
        self.transfer("read", offset, Buf::Read(buf))
    }
    /// `preadv2(RWF_NOWAIT)`: served from the page cache or not at all (a short read,
    /// part of the range cached, counts as not at all). Block devices opened
    /// buffered work the same way. A direct read always waits for the device.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> Result<bool, DeviceError> {
        if self.direct {
            return Ok(false);
        }
        if self.in_memory {
            return self.read_at(buf, offset).map(|()| true);
        }
        check_range(self, "read", offset, buf.len())?;
        let iov = libc::iovec {
            iov_base: buf.as_mut_ptr() as *mut libc::c_void,
            iov_len: buf.len(),
        };
        loop {
            // SAFETY: reads into `buf`, which `iov` describes, from our descriptor.
            let n = unsafe {
                libc::preadv2(
                    self.file.as_raw_fd(),
                    &iov,
                    1,
                    offset as libc::off_t,
                    libc::RWF_NOWAIT,
                )
            };
            if n >= 0 {
                return Ok(n as usize == buf.len());
            }
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR) => continue,
                // Anything else (not cached, no RWF_NOWAIT on this file system, an
                // I/O error): the normal read will wait, or report the error.
                _ => return Ok(false),
            }
        }
    }
    /// `posix_fadvise(WILLNEED)`: the kernel starts reading the range into the
    /// page cache. Nothing for direct I/O (no page cache to fill) or a file kept in
    /// memory (it is there already).
    fn prefetch(&self, offset: u64, len: u64) {
        if self.direct || self.in_memory || check_range(self, "read", offset, len as usize).is_err()
        {
            return;
        }
        // SAFETY: an advisory call on our own descriptor.
        unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                offset as libc::off_t,
                len as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            );
        }
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        self.transfer("write", offset, Buf::Write(buf))
    }
    fn sync(&self) -> Result<(), DeviceError> {
        let mut ops = [Op::datasync(self.file.as_raw_fd())];
        uring::run(&mut ops, false);
        let [o] = ops;
        o.result.map_err(|e| self.io_err("sync", 0, 0, e))
    }
    fn uring_target(&self) -> Option<UringTarget> {
        self.uring.then(|| UringTarget {
            fd: self.file.as_raw_fd(),
            direct: self.direct,
        })
    }
    /// A hole punched in a file (it shrinks on disk), BLKDISCARD on a block device.
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        check_range(self, "discard", offset, len as usize)?;
        let fd = self.file.as_raw_fd();
        // SAFETY: plain system calls on a descriptor we own.
        let rc = if self.is_block_device {
            // BLKDISCARD = _IO(0x12, 119), a u64[2] range.
            const BLKDISCARD: libc::c_ulong = 0x1277;
            let range = [offset, len];
            unsafe { libc::ioctl(fd, BLKDISCARD, range.as_ptr()) }
        } else {
            unsafe {
                libc::fallocate(
                    fd,
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    offset as libc::off_t,
                    len as libc::off_t,
                )
            }
        };
        if rc != 0 {
            return Err(self.io_err(
                "discard",
                offset,
                len as usize,
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// How long a lock left by a process that has exited is waited for.
const LOCK_RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether process `pid` runs (exists and is not a zombie, whose files are closed).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name in parentheses: "1234 (name) S ...".
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        // Gone. Anything else (hidepid, no permission) counts as running.
        Err(e) => e.kind() != std::io::ErrorKind::NotFound,
    }
}

/// The process holding a `flock` on the file `meta` describes, and its command line,
/// from `/proc/locks` (lines such as `1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF`).
fn lock_holder(meta: &std::fs::Metadata) -> Option<(u32, String)> {
    use std::os::unix::fs::MetadataExt;
    let dev = meta.dev();
    let id = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        meta.ino()
    );
    let locks = std::fs::read_to_string("/proc/locks").ok()?;
    let pid: u32 = locks.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // Blocked waiters are listed with "->" and one more field.
        let f = if f.get(1) == Some(&"->") {
            &f[1..]
        } else {
            &f[..]
        };
        (f.get(1) == Some(&"FLOCK") && f.get(5) == Some(&id.as_str()))
            .then(|| f.get(4)?.parse().ok())
            .flatten()
    })?;
    let cmd = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| {
            c.split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default();
    Some((pid, if cmd.is_empty() { "?".into() } else { cmd }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn discard_punches_a_hole() {
        use std::os::unix::fs::MetadataExt;
        let dir = std::env::temp_dir().join(format!("lamina-discard-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.img");
        let _ = std::fs::remove_file(&path);
        let d = FileDevice::create_sparse(&path, 8 << 20).unwrap();
        d.write_at(&vec![9u8; 4 << 20], 0).unwrap();
        d.sync().unwrap();
        let before = std::fs::metadata(&path).unwrap().blocks();
        d.discard(1 << 20, 2 << 20).unwrap();
        d.sync().unwrap();
        let after = std::fs::metadata(&path).unwrap().blocks();
        assert!(
            after + 2048 <= before,
            "{before} -> {after} 512-byte blocks"
        );
        let mut b = vec![1u8; 4096];
        d.read_at(&mut b, 2 << 20).unwrap();
        assert!(b.iter().all(|&x| x == 0), "a hole reads as zeros");
        d.read_at(&mut b, 0).unwrap();
        assert!(b.iter().all(|&x| x == 9), "outside the hole the data stays");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn sparse_create_rw_and_lock() {
        let dir = std::env::temp_dir().join(format!("lamina-dev-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.img");
        let _ = std::fs::remove_file(&path);
        let d = FileDevice::create_sparse(&path, 1 << 20).unwrap();
        assert_eq!(d.size_bytes(), 1 << 20);
        d.write_at(&[7u8; 4096], 8192).unwrap();
        d.sync().unwrap();
        let mut b = [0u8; 4096];
        d.read_at(&mut b, 8192).unwrap();
        assert_eq!(b, [7u8; 4096]);
        assert!(matches!(
            d.write_at(&[0u8; 4096], (1 << 20) - 100),
            Err(DeviceError::OutOfRange { .. })
        ));
        let second = FileDevice::open(&path, OpenMode::ReadWrite);
        assert!(matches!(second, Err(DeviceError::Open { .. })));
        drop(d);
        assert!(FileDevice::open(&path, OpenMode::ReadWrite).is_ok());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every engine and caching choice reads back what it wrote, from aligned and
    /// unaligned memory, and refuses what direct I/O cannot do with a clear error.
    #[test]
    fn every_engine_and_direct_choice_round_trips() {
        let dir = std::env::temp_dir().join(format!("lamina-dev-io-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for engine in [IoEngine::Uring, IoEngine::Sync] {
            for direct in [DirectIo::On, DirectIo::Off] {
                let path = dir.join(format!("{engine:?}-{direct:?}.img"));
                let _ = std::fs::remove_file(&path);
                drop(FileDevice::create_sparse(&path, 4 << 20).unwrap());
                let io = IoOptions { engine, direct };
                let d = FileDevice::open_with(&path, OpenMode::ReadWrite, io).unwrap();
                assert_eq!(d.uses_uring(), engine == IoEngine::Uring && !d.in_memory);
                // /tmp is a disk file system here (ext4 on CI); tmpfs would refuse.
                assert_eq!(d.is_direct(), direct == DirectIo::On && !d.in_memory);
                let mut aligned = AlignedBuf::new();
                let a = aligned.get(64 << 10);
                a.iter_mut()
                    .enumerate()
                    .for_each(|(i, x)| *x = (i / 4096) as u8);
                d.write_at(a, 1 << 20).unwrap();
                // A Vec one byte into its allocation is never page-aligned.
                let mut v = vec![0u8; (8 << 10) + 1];
                v[1..].fill(0xab);
                d.write_at(&v[1..], 2 << 20).unwrap();
                d.sync().unwrap();
                let mut back = vec![0u8; (64 << 10) + 1];
                d.read_at(&mut back[1..], 1 << 20).unwrap();
                assert_eq!(&back[1..], &a[..]);
                let b = aligned.get(8 << 10);
                d.read_at(b, 2 << 20).unwrap();
                assert!(b.iter().all(|&x| x == 0xab));
                if d.is_direct() {
                    let e = d.read_at(&mut back[..512], 0).unwrap_err().to_string();
                    assert!(e.contains("whole 4 KiB blocks"), "{e}");
                    assert!(!d.try_read_at(b, 2 << 20).unwrap(), "direct reads wait");
                }
                assert!(matches!(
                    d.read_at(&mut back[..4096], 4 << 20),
                    Err(DeviceError::OutOfRange { .. })
                ));
                drop(d);
                // What one engine wrote, the other reads.
                let other = IoOptions {
                    engine: IoEngine::Sync,
                    direct: DirectIo::Off,
                };
                let d = FileDevice::open_with(&path, OpenMode::ReadOnly, other).unwrap();
                d.read_at(&mut back[1..], 1 << 20).unwrap();
                assert_eq!(back[1 + 4096 * 3], 3);
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
