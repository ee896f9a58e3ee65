//! Page-aligned byte buffers: what `O_DIRECT` I/O needs from memory.
//!
//! A `Vec<u8>` is aligned to whatever the allocator gives (16 bytes from glibc), and
//! the kernel refuses direct I/O from such memory with EINVAL. [`AlignedBuf`] is
//! aligned to [`ALIGN`] and only grows, so a buffer kept per thread costs one
//! allocation per size it reaches, not one per I/O.

use std::alloc::Layout;

/// Alignment of memory, offsets and lengths for direct I/O. 4 KiB covers every
/// logical block size Lamina meets (512 and 4096 bytes).
pub const ALIGN: usize = 4096;

/// Whether `ptr` may be handed to a direct read or write.
#[inline]
pub fn is_aligned(ptr: *const u8) -> bool {
    (ptr as usize).is_multiple_of(ALIGN)
}

/// A zeroed, [`ALIGN`]-aligned buffer that grows on demand.
pub struct AlignedBuf {
    ptr: *mut u8,
    cap: usize,
}

// SAFETY: the buffer owns its memory exclusively, like a Vec<u8>.
unsafe impl Send for AlignedBuf {}

impl AlignedBuf {
    pub const fn new() -> Self {
        AlignedBuf {
            ptr: std::ptr::null_mut(),
            cap: 0,
        }
    }

    /// The first `len` bytes, growing the buffer (contents not kept) if it is smaller.
    pub fn get(&mut self, len: usize) -> &mut [u8] {
        if len > self.cap {
            self.release();
            let cap = len.next_multiple_of(ALIGN);
            let layout = Layout::from_size_align(cap, ALIGN).expect("buffer size overflows");
            // SAFETY: non-zero size (len > cap >= 0).
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
            if ptr.is_null() {
                std::alloc::handle_alloc_error(layout);
            }
            self.ptr = ptr;
            self.cap = cap;
        }
        if len == 0 {
            return &mut [];
        }
        // SAFETY: `ptr` holds `cap >= len` initialised bytes we own.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, len) }
    }

    fn release(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated in `get` with this layout.
            unsafe {
                std::alloc::dealloc(self.ptr, Layout::from_size_align_unchecked(self.cap, ALIGN))
            };
            self.ptr = std::ptr::null_mut();
            self.cap = 0;
        }
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grows_aligned() {
        let mut b = AlignedBuf::new();
        assert!(b.get(0).is_empty());
        for len in [1, 4096, 5000, 100, 1 << 20] {
            let s = b.get(len);
            assert_eq!(s.len(), len);
            assert!(is_aligned(s.as_ptr()));
            s.fill(7);
        }
    }
}
