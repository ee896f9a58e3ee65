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
//! That is the logical value every caller sees. In memory, entries are bit-packed at
//! the width the array needs (see [`Map`]): at most four bytes per 4 KiB block, 29
//! bits for a 1 TiB array, which is what keeps memory under 1 GiB of map per TiB of
//! volume. Client threads read the map while the engine thread, its only writer,
//! updates it.

use crate::types::Pba;
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

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

/// Entries per seqlock page, the same as a checkpoint map page.
pub const PAGE_ENTRIES: usize = lamina_format::checkpoint::MAP_ENTRIES_PER_PAGE;

/// The map of one volume, bit-packed.
///
/// An entry needs only enough bits for the array's block count plus the write-buffer
/// slots plus two special values: 25 bits for a 64 GiB array, 29 for 1 TiB, 32 at the
/// 16 TiB limit. Entries are packed at that width into 64-bit words, and an entry may
/// straddle two words, so a reader cannot load it with one atomic operation. Instead
/// each page of 1024 entries has a sequence counter (a seqlock): the engine, the only
/// writer, makes it odd while it changes an entry of the page and even again after;
/// a reader retries when the counter was odd or changed while it read. Writes are
/// rare enough per page that readers practically never retry.
pub struct Map {
    words: Box<[AtomicU64]>,
    seqs: Box<[AtomicU32]>,
    len: u64,
    width: u32,
    mask: u64,
    /// Largest device code: the array's block count (codes 1..=pba_codes are PBA+1).
    pba_codes: u32,
    buffer_slots: u32,
    /// One bit per block: read from the device since GC last moved it (read heat
    /// for geometry-aware placement; only kept when that is on).
    read: Box<[AtomicU64]>,
}

fn zeroed_atomics<T>(n: usize) -> Box<[T]> {
    if n == 0 {
        return Vec::new().into_boxed_slice();
    }
    let layout = std::alloc::Layout::array::<T>(n).expect("map too large");
    // SAFETY: the atomics used here are valid when zeroed; the box owns an allocation
    // made with the layout of exactly `n` elements. Zeroed memory is backed by the
    // kernel only once written, so an unwritten (thin) map costs no RAM.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout) as *mut T;
        if ptr.is_null() {
            std::alloc::handle_alloc_error(layout);
        }
        Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n))
    }
}

impl Map {
    /// A map of `blocks` unmapped entries for an array of `array_blocks` physical
    /// blocks and `buffer_slots` write-buffer slots.
    pub fn new(blocks: u64, array_blocks: u32, buffer_slots: u32) -> Self {
        assert!(array_blocks < PBA_LIMIT && buffer_slots < BAD - BUFFER_BASE);
        let largest = array_blocks as u64 + buffer_slots as u64 + 1;
        let width = 64 - largest.leading_zeros();
        let bits = blocks * width as u64;
        Map {
            // One spare word so a straddling read of the last entry stays in bounds.
            words: zeroed_atomics(bits.div_ceil(64) as usize + 1),
            seqs: zeroed_atomics(blocks.div_ceil(PAGE_ENTRIES as u64) as usize),
            len: blocks,
            width,
            mask: (1u64 << width) - 1,
            pba_codes: array_blocks,
            buffer_slots,
            read: zeroed_atomics(blocks.div_ceil(64) as usize),
        }
    }

    /// Notes that blocks `lba..lba + n` were read from the device.
    pub fn mark_read(&self, lba: u64, n: u64) {
        let mut l = lba;
        let end = (lba + n).min(self.len);
        while l < end {
            let w = (l / 64) as usize;
            let hi = end.min((l / 64 + 1) * 64);
            let bits = if hi - l == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - l)) - 1) << (l % 64)
            };
            if self.read[w].load(Ordering::Relaxed) & bits != bits {
                self.read[w].fetch_or(bits, Ordering::Relaxed);
            }
            l = hi;
        }
    }

    /// Whether `lba` was read since its mark was last cleared.
    pub fn was_read(&self, lba: u64) -> bool {
        let (w, bit) = ((lba / 64) as usize, 1u64 << (lba % 64));
        w < self.read.len() && self.read[w].load(Ordering::Relaxed) & bit != 0
    }

    /// Whether `lba` was read since the last call for it (and clears the mark).
    pub fn take_read(&self, lba: u64) -> bool {
        let (w, bit) = ((lba / 64) as usize, 1u64 << (lba % 64));
        w < self.read.len() && self.read[w].fetch_and(!bit, Ordering::Relaxed) & bit != 0
    }

    /// Bits per entry.
    pub fn entry_bits(&self) -> u32 {
        self.width
    }

    #[inline]
    pub fn len(&self) -> u64 {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    #[inline]
    fn encode_code(&self, e: u32) -> u64 {
        match e {
            UNMAPPED => 0,
            BAD => self.pba_codes as u64 + self.buffer_slots as u64 + 1,
            e if e >= BUFFER_BASE => {
                debug_assert!(e - BUFFER_BASE < self.buffer_slots);
                self.pba_codes as u64 + 1 + (e - BUFFER_BASE) as u64
            }
            e => {
                debug_assert!(e <= self.pba_codes);
                e as u64
            }
        }
    }

    #[inline]
    fn decode_code(&self, c: u64) -> u32 {
        let p = self.pba_codes as u64;
        if c <= p {
            c as u32
        } else if c <= p + self.buffer_slots as u64 {
            BUFFER_BASE + (c - p - 1) as u32
        } else {
            BAD
        }
    }

    #[inline]
    fn raw(&self, lba: u64) -> u64 {
        let bit = lba * self.width as u64;
        let w = (bit / 64) as usize;
        let o = (bit % 64) as u32;
        let lo = self.words[w].load(Ordering::Relaxed) >> o;
        let v = if o + self.width > 64 {
            lo | (self.words[w + 1].load(Ordering::Relaxed) << (64 - o))
        } else {
            lo
        };
        v & self.mask
    }

    #[inline]
    fn read(&self, lba: u64, first: Ordering) -> u32 {
        assert!(lba < self.len, "map index {lba} out of range");
        let seq = &self.seqs[lba as usize / PAGE_ENTRIES];
        loop {
            let s1 = seq.load(first);
            if s1 & 1 == 1 {
                std::hint::spin_loop();
                continue;
            }
            let v = self.raw(lba);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return self.decode_code(v);
            }
        }
    }

    #[inline]
    pub fn load(&self, lba: u64) -> u32 {
        self.read(lba, Ordering::Acquire)
    }

    /// Load ordered with sequential consistency, for the pin-then-recheck protocol of
    /// readers (see `shared.rs`).
    #[inline]
    pub fn load_sc(&self, lba: u64) -> u32 {
        self.read(lba, Ordering::SeqCst)
    }

    /// Stores an entry. Only the engine thread (or recovery, before serving) writes.
    #[inline]
    pub fn store(&self, lba: u64, e: u32) {
        assert!(lba < self.len, "map index {lba} out of range");
        let code = self.encode_code(e);
        let seq = &self.seqs[lba as usize / PAGE_ENTRIES];
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let bit = lba * self.width as u64;
        let w = (bit / 64) as usize;
        let o = (bit % 64) as u32;
        let word = self.words[w].load(Ordering::Relaxed);
        self.words[w].store((word & !(self.mask << o)) | (code << o), Ordering::Relaxed);
        if o + self.width > 64 {
            let spill = o + self.width - 64;
            let hi_mask = (1u64 << spill) - 1;
            let word = self.words[w + 1].load(Ordering::Relaxed);
            self.words[w + 1].store((word & !hi_mask) | (code >> (64 - o)), Ordering::Relaxed);
        }
        // Sequentially consistent, so that a reader's pin is ordered with it.
        seq.store(s.wrapping_add(2), Ordering::SeqCst);
    }

    /// Entries of one 1024-entry page, for checkpoints (engine thread).
    pub fn page(&self, page: u64, out: &mut [u32; PAGE_ENTRIES]) {
        let start = page * PAGE_ENTRIES as u64;
        for (i, o) in out.iter_mut().enumerate() {
            let lba = start + i as u64;
            *o = if lba < self.len {
                self.decode_code(self.raw(lba))
            } else {
                UNMAPPED
            };
        }
    }

    /// True when a page has any mapped entry (engine thread).
    pub fn page_in_use(&self, page: u64) -> bool {
        let start = page * PAGE_ENTRIES as u64;
        let end = (start + PAGE_ENTRIES as u64).min(self.len);
        (start..end).any(|lba| self.raw(lba) != 0)
    }

    pub fn pages(&self) -> u64 {
        self.len.div_ceil(PAGE_ENTRIES as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_entries_roundtrip_at_every_width() {
        for array_blocks in [
            16u32,
            1000,
            1 << 20,
            (1 << 25) - 3,
            PBA_LIMIT - (1 << 20) - 2,
        ] {
            let slots = 1024;
            let m = Map::new(5000, array_blocks, slots);
            let values = |i: u64| -> u32 {
                match i % 5 {
                    0 => UNMAPPED,
                    1 => encode_device(Pba((i as u32 * 7919) % array_blocks)),
                    2 => encode_buffer((i as u32 * 31) % slots),
                    3 => BAD,
                    _ => encode_device(Pba(array_blocks - 1)),
                }
            };
            for i in 0..5000 {
                m.store(i, values(i));
            }
            for i in 0..5000 {
                assert_eq!(
                    m.load(i),
                    values(i),
                    "entry {i} at width {}",
                    m.entry_bits()
                );
            }
            // Overwrite every other entry: neighbours (which may share a word) keep.
            for i in (0..5000).step_by(2) {
                m.store(i, UNMAPPED);
            }
            for i in 0..5000 {
                let want = if i % 2 == 0 { UNMAPPED } else { values(i) };
                assert_eq!(m.load(i), want);
            }
        }
        assert_eq!(Map::new(1, (1 << 25) - 2000, 1024).entry_bits(), 25);
    }

    #[test]
    fn concurrent_readers_never_see_a_torn_entry() {
        use std::sync::Arc;
        let m = Arc::new(Map::new(4096, (1 << 27) - 5, 1024));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let readers: Vec<_> = (0..2)
            .map(|_| {
                let (m, stop) = (m.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        for i in 0..4096 {
                            let e = m.load(i);
                            // Every value the writer stores is pba+1 with pba = k * 4096 + i.
                            if e != UNMAPPED {
                                assert_eq!((e - 1) % 4096, i as u32, "torn entry {e:#x} at {i}");
                            }
                            n += 1;
                        }
                    }
                    n
                })
            })
            .collect();
        for k in 0..2000u32 {
            for i in 0..4096u32 {
                m.store(
                    i as u64,
                    encode_device(Pba(k * 4096 % ((1 << 26) - 4096) + i)),
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
    }
}
