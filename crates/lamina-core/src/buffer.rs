//! Write-unit buffers: the DRAM write buffer that user writes are acknowledged from.
//!
//! A fixed pool of buffers, each one write unit long and 4 KiB aligned (so the same
//! memory can go to `O_DIRECT` I/O). The engine thread fills a buffer (header area
//! first, then data slots), seals it and hands it to a device write; client threads
//! may meanwhile copy blocks out of it, which they announce with a pin count so the
//! engine never recycles a buffer under a reader.
//!
//! Access is through raw pointers: the engine writes only slots no map entry points to
//! yet, and readers read only slots a map entry pointed to when they pinned, so no
//! byte is ever written and read at the same time.

use crate::pins::Pins;
use crate::types::BLOCK_SIZE;
use std::alloc::Layout;

pub struct BufferPool {
    base: *mut u8,
    layout: Layout,
    count: u32,
    unit_blocks: u32,
    /// Readers of each buffer (see [`crate::pins`]).
    pub pins: Pins,
}

// SAFETY: the pool hands out disjoint access as documented above.
unsafe impl Send for BufferPool {}
unsafe impl Sync for BufferPool {}

impl BufferPool {
    pub fn new(count: u32, unit_blocks: u32) -> Self {
        assert!(count > 0 && unit_blocks > 0);
        let bytes = count as usize * unit_blocks as usize * BLOCK_SIZE;
        let layout = Layout::from_size_align(bytes, BLOCK_SIZE).unwrap();
        // SAFETY: non-zero size.
        let base = unsafe { std::alloc::alloc_zeroed(layout) };
        if base.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        BufferPool {
            base,
            layout,
            count,
            unit_blocks,
            pins: Pins::new(count as usize),
        }
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    pub fn unit_blocks(&self) -> u32 {
        self.unit_blocks
    }

    /// Map-entry slot number of block `block` of buffer `unit`.
    #[inline]
    pub fn slot(&self, unit: u32, block: u32) -> u32 {
        unit * self.unit_blocks + block
    }

    /// Buffer and block of a slot number.
    #[inline]
    pub fn unslot(&self, slot: u32) -> (u32, u32) {
        (slot / self.unit_blocks, slot % self.unit_blocks)
    }

    #[inline]
    fn ptr(&self, unit: u32, block: u32) -> *mut u8 {
        assert!(unit < self.count && block < self.unit_blocks);
        // SAFETY: in bounds by the assertion.
        unsafe {
            self.base
                .add((unit as usize * self.unit_blocks as usize + block as usize) * BLOCK_SIZE)
        }
    }

    /// Mutable view of `blocks` blocks of buffer `unit` starting at `block`.
    ///
    /// # Safety
    /// Only the engine thread calls this, and only for blocks no reader can reach
    /// (no map entry names them, or they are header blocks).
    #[allow(clippy::mut_from_ref)]
    #[inline]
    pub unsafe fn blocks_mut(&self, unit: u32, block: u32, blocks: u32) -> &mut [u8] {
        assert!(block + blocks <= self.unit_blocks);
        std::slice::from_raw_parts_mut(self.ptr(unit, block), blocks as usize * BLOCK_SIZE)
    }

    /// Shared view of `blocks` blocks of buffer `unit` starting at `block`.
    ///
    /// # Safety
    /// The caller must have pinned the buffer (readers) or own it (engine, device
    /// writes of a sealed unit), and nobody may write these blocks meanwhile.
    #[inline]
    pub unsafe fn blocks(&self, unit: u32, block: u32, blocks: u32) -> &[u8] {
        assert!(block + blocks <= self.unit_blocks);
        std::slice::from_raw_parts(self.ptr(unit, block), blocks as usize * BLOCK_SIZE)
    }
}

impl Drop for BufferPool {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.base, self.layout) }
    }
}
