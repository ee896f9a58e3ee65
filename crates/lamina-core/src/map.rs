//! The L2P map: one `u32` per logical block of a volume.
//!
//! An entry is one of:
//! * `0`: unmapped (reads as zeros, takes no space);
//! * `pba + 1` for `pba < PBA_LIMIT`: the block is on a device;
//! * `BUFFER_BASE + slot`: the block is in a write-unit buffer in RAM, not yet written
//!   (or not yet known written) to its device;
//! * `BAD`: the block's only copy failed its checksum; reads return an I/O error until
//!   the block is overwritten or trimmed.
//!
//! Four bytes per 4 KiB block is what keeps memory at 1 GiB of map per TiB of volume.
//! Entries are atomics so client threads can read the map while the engine thread,
//! its only writer, updates it: stores use `Release` after the data they point to is
//! in place, loads use `Acquire`.

use crate::types::Pba;
use std::sync::atomic::{AtomicU32, Ordering};

pub const UNMAPPED: u32 = 0;
pub const BAD: u32 = u32::MAX;
/// First entry value that names a buffer slot; 2^20 - 1 slots (4 GiB of buffers).
pub const BUFFER_BASE: u32 = 0xFFF0_0000;
/// Largest PBA an entry can hold, plus one.
pub const PBA_LIMIT: u32 = BUFFER_BASE - 1;

/// A decoded map entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Entry {
    Unmapped,
    Device(Pba),
    Buffer(u32),
    Bad,
}

#[inline]
pub fn decode(e: u32) -> Entry {
    match e {
        UNMAPPED => Entry::Unmapped,
        BAD => Entry::Bad,
        e if e >= BUFFER_BASE => Entry::Buffer(e - BUFFER_BASE),
        e => Entry::Device(Pba(e - 1)),
    }
}

#[inline]
pub fn encode_device(p: Pba) -> u32 {
    debug_assert!(p.0 < PBA_LIMIT);
    p.0 + 1
}

#[inline]
pub fn encode_buffer(slot: u32) -> u32 {
    debug_assert!(slot < BAD - BUFFER_BASE);
    BUFFER_BASE + slot
}

/// The map of one volume.
pub struct Map {
    entries: Box<[AtomicU32]>,
}

impl Map {
    /// A map of `blocks` unmapped entries. The allocation is zeroed memory that the
    /// kernel only backs with pages once they are written, so a thin volume costs RAM
    /// in proportion to what has been written, not to its size.
    pub fn new(blocks: u64) -> Self {
        let n = blocks as usize;
        let entries: Box<[AtomicU32]> = if n == 0 {
            Box::new([])
        } else {
            let layout = std::alloc::Layout::array::<AtomicU32>(n).expect("map too large");
            // SAFETY: AtomicU32 is valid when zeroed; the box takes ownership of an
            // allocation made with the layout of exactly `n` elements.
            unsafe {
                let ptr = std::alloc::alloc_zeroed(layout) as *mut AtomicU32;
                if ptr.is_null() {
                    std::alloc::handle_alloc_error(layout);
                }
                Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n))
            }
        };
        Map { entries }
    }

    #[inline]
    pub fn len(&self) -> u64 {
        self.entries.len() as u64
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    #[inline]
    pub fn load(&self, lba: u64) -> u32 {
        self.entries[lba as usize].load(Ordering::Acquire)
    }

    /// Load with sequential consistency, for the pin-then-recheck protocol of readers.
    #[inline]
    pub fn load_sc(&self, lba: u64) -> u32 {
        self.entries[lba as usize].load(Ordering::SeqCst)
    }

    /// Stores an entry (engine thread only). `SeqCst` orders it with readers' pins.
    #[inline]
    pub fn store(&self, lba: u64, e: u32) {
        self.entries[lba as usize].store(e, Ordering::SeqCst)
    }

    /// Raw entries of one 1024-entry page, for checkpoints.
    pub fn page(&self, page: u64, out: &mut [u32; 1024]) {
        let start = page as usize * 1024;
        for (i, o) in out.iter_mut().enumerate() {
            *o = self
                .entries
                .get(start + i)
                .map_or(0, |e| e.load(Ordering::Relaxed));
        }
    }

    /// True when a 1024-entry page has any mapped entry.
    pub fn page_in_use(&self, page: u64) -> bool {
        let start = page as usize * 1024;
        let end = (start + 1024).min(self.entries.len());
        self.entries[start..end]
            .iter()
            .any(|e| e.load(Ordering::Relaxed) != UNMAPPED)
    }

    pub fn pages(&self) -> u64 {
        (self.entries.len() as u64).div_ceil(1024)
    }
}
