//! Regular files and raw block devices, with `pread`, `pwrite` and `fdatasync`.
//!
//! `fdatasync` on a regular file writes the page cache back and flushes the disk's
//! volatile cache; on a block device it flushes the device cache. Either way a
//! completed [`BlockDevice::sync`] means the data survives a power cut.
//!
//! Every open takes an exclusive `flock`, so a second Lamina process (or a
//! `lamina status` that would read a device the server is writing) fails clearly.

use crate::{check_range, BlockDevice, DeviceError};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
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

    /// Opens an existing regular file or block device.
    pub fn open(path: &Path, mode: OpenMode) -> Result<Self, DeviceError> {
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
        // SAFETY: flock on a file descriptor we own.
        let rc = unsafe { libc::flock(file.as_raw_fd(), op | libc::LOCK_NB) };
        if rc != 0 {
            return Err(open_err(match lock_holder(&meta) {
                Some((pid, cmd)) => format!("is in use by process {pid} ({cmd})"),
                None => {
                    "is in use by another Lamina process (or another program holds a lock on it)"
                        .to_string()
                }
            }));
        }
        let in_memory = !is_block_device && in_memory_fs(&file);
        Ok(FileDevice {
            path: path.to_path_buf(),
            file,
            size,
            is_block_device,
            in_memory,
        })
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
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| self.io_err("read", offset, buf.len(), e))
    }
    /// `preadv2(RWF_NOWAIT)`: served from the page cache or not at all (a short read,
    /// part of the range cached, counts as not at all). Block devices opened
    /// buffered work the same way.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> Result<bool, DeviceError> {
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
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        check_range(self, "write", offset, buf.len())?;
        self.file
            .write_all_at(buf, offset)
            .map_err(|e| self.io_err("write", offset, buf.len(), e))
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.file
            .sync_data()
            .map_err(|e| self.io_err("sync", 0, 0, e))
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
}
