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
//! data, in pages made only where data was written. Client threads read the map while the engine thread, its only writer,
//! updates it.

use crate::sync::{fence, spin_wait, AtomicPtr, AtomicU64, Ordering};
use crate::types::{Lba, LbaRun, Pba};

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
const PAGE_SHIFT: u32 = PAGE_ENTRIES.trailing_zeros();
/// Children of an inner node of the page tree.
const FAN_BITS: u32 = 10;
const FAN: usize = 1 << FAN_BITS;
/// Largest root: up to this many children the tree grows no deeper.
const ROOT_MAX: u64 = 4096;
/// Words at the head of a page: the sequence counter, the read bits, then the
/// number of mapped entries (the engine's own: see [`Map::used_page_count`]).
const SEQ_WORD: usize = 0;
const READ_WORDS: usize = PAGE_ENTRIES / 64;
const COUNT_WORD: usize = 1 + READ_WORDS;
const HEAD_WORDS: usize = 2 + READ_WORDS;
/// Largest volume a map can describe: checkpoints name map pages by a `u32`.
pub const MAX_BLOCKS: u64 = (u32::MAX as u64 + 1) * PAGE_ENTRIES as u64;

/// The map of one volume: a tree of pages, bit-packed.
///
/// **Memory follows what is stored.** Entries live in pages of 1024, and a page
/// exists only once an entry in it was mapped: an unwritten (thin) range costs
/// nothing, whatever the volume's size. Pages hang from a tree of inner nodes of
/// 1024 children; its height follows the volume's size (one level up to 16 GiB,
/// two up to 16 TiB, three beyond), so a lookup is one to three pointer loads plus
/// the page. Pages and nodes, once made, live as long as the map (readers hold no
/// lock, so nothing is freed under them); a page emptied by trims is dropped at the
/// next start, which rebuilds the map from the checkpoint's used pages.
///
/// An entry needs only enough bits for the array's block count plus the write-buffer
/// slots plus two special values: 25 bits for a 64 GiB array, 29 for 1 TiB, 32 at the
/// 16 TiB limit. Entries are packed at that width into 64-bit words, and an entry may
/// straddle two words, so a reader cannot load it with one atomic operation. Instead
/// each page has a sequence counter (a seqlock): the engine, the only writer, makes it
/// odd while it changes an entry of the page and even again after; a reader retries
/// when the counter was odd or changed while it read. Writes are rare enough per page
/// that readers practically never retry.
pub struct Map {
    /// The top of the tree; replaced whole when the volume grows past what it can
    /// address ([`Map::grow`]).
    root: AtomicPtr<Root>,
    /// Roots [`Map::grow`] replaced. They name the same nodes and pages as the
    /// current root, and a reader may still be walking one, so they live as long
    /// as the map (one per growth past the root's reach: a few at most). Kept as
    /// raw pointers: readers hold references to them.
    old_roots: std::sync::Mutex<Vec<OldRoot>>,
    /// Words of one page: head, then the packed entries and a spare word so that a
    /// straddling read of the last entry stays in bounds.
    page_words: usize,
    /// Entries: the volume's blocks. Changes only by [`Map::grow`] and
    /// [`Map::shrink`] (the engine).
    len: AtomicU64,
    width: u32,
    mask: u64,
    /// Largest device code: the array's block count (codes 1..=pba_codes are PBA+1).
    pba_codes: u32,
    buffer_slots: u32,
    /// Pages with a mapped entry: what a checkpoint writes of this map. Kept by
    /// the one writer as entries change (each page counts its mapped entries).
    used: AtomicU64,
}

/// The top of the page tree: its children, and the pointer levels from it to the
/// pages (1: the children are pages).
struct Root {
    children: Box<[AtomicPtr<AtomicU64>]>,
    height: u32,
}

/// Root children and height for a map of `blocks` entries, at least `height`
/// levels high: one level while the pages fit [`ROOT_MAX`] children, another for
/// every FAN-fold beyond.
fn shape(blocks: u64, mut height: u32) -> (usize, u32) {
    let pages = blocks.div_ceil(PAGE_ENTRIES as u64).max(1);
    let mut span = 1u64 << (FAN_BITS * (height - 1)); // pages under one root child
    while pages.div_ceil(span) > ROOT_MAX {
        span <<= FAN_BITS;
        height += 1;
    }
    (pages.div_ceil(span) as usize, height)
}

/// A root [`Map::grow`] replaced (freed when the map is dropped).
struct OldRoot(*mut Root);
// SAFETY: a root is plain atomics; the pointer is only freed by the map's drop.
unsafe impl Send for OldRoot {}

/// A zeroed array of `n` words or pointers, leaked: the tree owns it until `Drop`.
#[cfg(not(lamina_loom))]
fn zeroed_block<T>(n: usize) -> *mut T {
    let v: Vec<u64> = vec![0; n];
    debug_assert_eq!(std::mem::size_of::<T>(), 8);
    Box::into_raw(v.into_boxed_slice()) as *mut T
}

/// Frees what [`zeroed_block`] made.
///
/// SAFETY: `p` came from `zeroed_block::<T>(n)` and is freed once.
#[cfg(not(lamina_loom))]
unsafe fn free_block<T>(p: *mut T, n: usize) {
    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
        p as *mut u64,
        n,
    )));
}

/// Under loom, atomics are objects of the model checker, made one by one.
#[cfg(lamina_loom)]
fn zeroed_block<T: crate::sync::Zero>(n: usize) -> *mut T {
    Box::into_raw((0..n).map(|_| T::zero()).collect::<Box<[T]>>()) as *mut T
}

/// SAFETY: `p` came from `zeroed_block::<T>(n)` and is freed once.
#[cfg(lamina_loom)]
unsafe fn free_block<T>(p: *mut T, n: usize) {
    drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(p, n)));
}

impl Map {
    /// A map of `blocks` unmapped entries for an array of `array_blocks` physical
    /// blocks and `buffer_slots` write-buffer slots.
    pub fn new(blocks: u64, array_blocks: u32, buffer_slots: u32) -> Self {
        assert!(array_blocks < PBA_LIMIT && buffer_slots < BAD - BUFFER_BASE);
        assert!(
            blocks <= MAX_BLOCKS,
            "volume of {blocks} blocks beyond the map's limit"
        );
        let largest = array_blocks as u64 + buffer_slots as u64 + 1;
        let width = 64 - largest.leading_zeros();
        let (children, height) = shape(blocks, 1);
        let root = Root {
            children: (0..children)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
            height,
        };
        Map {
            root: AtomicPtr::new(Box::into_raw(Box::new(root))),
            old_roots: Default::default(),
            page_words: HEAD_WORDS + PAGE_ENTRIES * width as usize / 64 + 1,
            len: AtomicU64::new(blocks),
            width,
            mask: (1u64 << width) - 1,
            pba_codes: array_blocks,
            buffer_slots,
            used: AtomicU64::new(0),
        }
    }

    /// The current root.
    #[inline]
    fn root(&self) -> &Root {
        // SAFETY: roots are made by `new` and `grow`, published with Release, and
        // freed only when the map is dropped (replaced ones wait in `old_roots`).
        unsafe { &*self.root.load(Ordering::Acquire) }
    }

    /// Makes the map `blocks` entries long, `blocks` at least its length: the new
    /// entries are unmapped. The engine thread only. Pages and nodes stay where they
    /// are; when the tree must reach further, a new root names them (under new inner
    /// nodes if it must be higher), and readers still walking the old root see
    /// what they would have seen a moment earlier.
    pub fn grow(&self, blocks: u64) {
        assert!(
            blocks >= self.len() && blocks <= MAX_BLOCKS,
            "map growth to {blocks} entries"
        );
        let cur = self.root();
        // Never lower: after a shrink the tree may be taller than the size needs,
        // and its nodes stay what they are.
        let (children, height) = shape(blocks, cur.height);
        if height == cur.height && children <= cur.children.len() {
            self.len.store(blocks, Ordering::Release);
            return;
        }
        let mut level: Vec<*mut AtomicU64> = cur
            .children
            .iter()
            .map(|c| c.load(Ordering::Acquire))
            .collect();
        // Each level added groups FAN of the level below under one new node.
        for _ in cur.height..height {
            level = level
                .chunks(FAN)
                .map(|group| {
                    if group.iter().all(|c| c.is_null()) {
                        return std::ptr::null_mut();
                    }
                    let node = zeroed_block::<AtomicU64>(FAN);
                    let slots = node as *const AtomicPtr<AtomicU64>;
                    for (i, &c) in group.iter().enumerate() {
                        // SAFETY: `node` holds FAN pointers; unpublished yet.
                        unsafe { &*slots.add(i) }.store(c, Ordering::Relaxed);
                    }
                    node
                })
                .collect();
        }
        assert!(level.len() <= children, "a new root too small for the old");
        let root = Root {
            children: (0..children)
                .map(|i| AtomicPtr::new(level.get(i).copied().unwrap_or(std::ptr::null_mut())))
                .collect(),
            height,
        };
        let old = self
            .root
            .swap(Box::into_raw(Box::new(root)), Ordering::AcqRel);
        self.old_roots.lock().unwrap().push(OldRoot(old));
        self.len.store(blocks, Ordering::Release);
    }

    /// Makes the map `blocks` entries long, at most its length. The engine thread
    /// only, once the entries beyond were unmapped; their pages stay until the
    /// next start (readers hold no lock).
    pub fn shrink(&self, blocks: u64) {
        assert!(blocks <= self.len(), "map shrink to {blocks} entries");
        self.len.store(blocks, Ordering::Release);
    }

    /// The page holding `lba`, if one was made.
    #[inline]
    fn page_of(&self, lba: u64) -> Option<&[AtomicU64]> {
        let page = lba >> PAGE_SHIFT;
        let root = self.root();
        let mut level = root.height - 1;
        let mut p = root
            .children
            .get((page >> (FAN_BITS * level)) as usize)?
            .load(Ordering::Acquire);
        while level > 0 {
            if p.is_null() {
                return None;
            }
            level -= 1;
            // SAFETY: a non-null child of an inner level is an inner node of FAN
            // pointers made by `page_mut`, alive as long as `self`.
            let node = p as *const AtomicPtr<AtomicU64>;
            let i = ((page >> (FAN_BITS * level)) as usize) & (FAN - 1);
            p = unsafe { &*node.add(i) }.load(Ordering::Acquire);
        }
        // SAFETY: a non-null child of the last level is a page of `page_words` words,
        // published with Release after it was zeroed, alive as long as `self`.
        (!p.is_null()).then(|| unsafe { std::slice::from_raw_parts(p, self.page_words) })
    }

    /// The page holding `lba`, made if missing (the engine thread, or recovery).
    fn page_mut(&self, lba: u64) -> &[AtomicU64] {
        let page = lba >> PAGE_SHIFT;
        let root = self.root();
        let mut level = root.height - 1;
        let mut slot = &root.children[(page >> (FAN_BITS * level)) as usize];
        loop {
            let n = if level == 0 { self.page_words } else { FAN };
            let mut p = slot.load(Ordering::Acquire);
            if p.is_null() {
                let fresh = zeroed_block::<AtomicU64>(n);
                p = match slot.compare_exchange(
                    std::ptr::null_mut(),
                    fresh,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                ) {
                    Ok(_) => fresh,
                    Err(theirs) => {
                        // SAFETY: `fresh` was never published.
                        unsafe { free_block(fresh, n) };
                        theirs
                    }
                };
            }
            if level == 0 {
                // SAFETY: as in `page_of`.
                return unsafe { std::slice::from_raw_parts(p, n) };
            }
            level -= 1;
            let node = p as *const AtomicPtr<AtomicU64>;
            let i = ((page >> (FAN_BITS * level)) as usize) & (FAN - 1);
            // SAFETY: as in `page_of`.
            slot = unsafe { &*node.add(i) };
        }
    }

    /// Calls `f` with every page made so far, in LBA order (the engine thread).
    fn for_each_page(&self, mut f: impl FnMut(u64, &[AtomicU64])) {
        fn walk(
            map: &Map,
            p: *mut AtomicU64,
            level: u32,
            first: u64,
            f: &mut dyn FnMut(u64, &[AtomicU64]),
        ) {
            if p.is_null() {
                return;
            }
            if level == 0 {
                // SAFETY: as in `page_of`.
                return f(first, unsafe {
                    std::slice::from_raw_parts(p, map.page_words)
                });
            }
            let node = p as *const AtomicPtr<AtomicU64>;
            for i in 0..FAN {
                // SAFETY: as in `page_of`.
                let c = unsafe { &*node.add(i) }.load(Ordering::Acquire);
                walk(
                    map,
                    c,
                    level - 1,
                    first + ((i as u64) << (FAN_BITS * (level - 1))),
                    f,
                );
            }
        }
        let root = self.root();
        let level = root.height - 1;
        for (i, c) in root.children.iter().enumerate() {
            let first = (i as u64) << (FAN_BITS * level);
            walk(self, c.load(Ordering::Acquire), level, first, &mut f);
        }
    }

    /// Notes that blocks `lba..lba + n` were read from the device.
    pub fn mark_read(&self, lba: Lba, n: u64) {
        let Lba(lba) = lba;
        let mut l = lba;
        let end = (lba + n).min(self.len());
        while l < end {
            let hi = end.min((l / 64 + 1) * 64);
            let bits = if hi - l == 64 {
                u64::MAX
            } else {
                ((1u64 << (hi - l)) - 1) << (l % 64)
            };
            // Blocks read from a device are mapped, so their page exists.
            if let Some(page) = self.page_of(l) {
                let w = &page[1 + (l as usize % PAGE_ENTRIES) / 64];
                if w.load(Ordering::Relaxed) & bits != bits {
                    w.fetch_or(bits, Ordering::Relaxed);
                }
            }
            l = hi;
        }
    }

    fn read_word(&self, lba: u64) -> Option<&AtomicU64> {
        if lba >= self.len() {
            return None;
        }
        self.page_of(lba)
            .map(|p| &p[1 + (lba as usize % PAGE_ENTRIES) / 64])
    }

    /// Whether `lba` was read since its mark was last cleared.
    pub fn was_read(&self, Lba(lba): Lba) -> bool {
        self.read_word(lba)
            .is_some_and(|w| w.load(Ordering::Relaxed) & (1 << (lba % 64)) != 0)
    }

    /// Whether `lba` was read since the last call for it (and clears the mark).
    pub fn take_read(&self, Lba(lba): Lba) -> bool {
        let bit = 1u64 << (lba % 64);
        self.read_word(lba).is_some_and(|w| {
            w.load(Ordering::Relaxed) & bit != 0 && w.fetch_and(!bit, Ordering::Relaxed) & bit != 0
        })
    }

    /// Bits per entry.
    pub fn entry_bits(&self) -> u32 {
        self.width
    }

    #[inline]
    pub fn len(&self) -> u64 {
        self.len.load(Ordering::Acquire)
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
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

    /// The packed code of entry `i` of `page`.
    #[inline]
    fn raw(&self, page: &[AtomicU64], i: usize) -> u64 {
        let bit = i * self.width as usize;
        let w = HEAD_WORDS + bit / 64;
        let o = (bit % 64) as u32;
        let lo = page[w].load(Ordering::Relaxed) >> o;
        let v = if o + self.width > 64 {
            lo | (page[w + 1].load(Ordering::Relaxed) << (64 - o))
        } else {
            lo
        };
        v & self.mask
    }

    /// The entry of `lba`; unmapped beyond the end (blocks a unit header names
    /// there, or a reader racing a shrink, find nothing). A reader that then pins
    /// what it names re-reads it through [`crate::pins::Pins::pin_run`].
    #[inline]
    pub fn load(&self, Lba(lba): Lba) -> u32 {
        if lba >= self.len() {
            return UNMAPPED;
        }
        let Some(page) = self.page_of(lba) else {
            return UNMAPPED;
        };
        let seq = &page[SEQ_WORD];
        let i = lba as usize % PAGE_ENTRIES;
        loop {
            let s1 = seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                spin_wait();
                continue;
            }
            let v = self.raw(page, i);
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return self.decode_code(v);
            }
        }
    }

    /// Asks the CPU to bring `lba`'s entry into the cache, so that a later
    /// [`Map::load`] of it does not wait on memory: a caller about to look up many
    /// scattered entries (GC checking a victim's blocks) prefetches them first and
    /// the misses overlap instead of following one another.
    #[inline]
    pub fn prefetch(&self, Lba(lba): Lba) {
        if lba >= self.len() {
            return;
        }
        let Some(page) = self.page_of(lba) else {
            return;
        };
        let bit = (lba as usize % PAGE_ENTRIES) * self.width as usize;
        let word = &page[HEAD_WORDS + bit / 64];
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch is a hint; it reads nothing and cannot fault.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            // The atomic's own address (a std atomic is its value; under loom
            // the hint lands on loom's object, which is as harmless).
            _mm_prefetch::<_MM_HINT_T0>((word as *const AtomicU64).cast::<i8>());
            _mm_prefetch::<_MM_HINT_T0>((&page[SEQ_WORD] as *const AtomicU64).cast::<i8>());
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = word;
    }

    /// Whether `lba` is mapped, and where the run of blocks in the same state that
    /// starts there ends (exclusive, at most `end`). Pages never made are stepped
    /// over whole, so a thin range costs one lookup per page, not per block. Any
    /// thread: like [`Map::load`], a store racing the walk may or may not be seen.
    /// Blocks beyond the map's end (a reader racing a shrink) are one unmapped run.
    pub fn allocation_run(&self, Lba(lba): Lba, Lba(end): Lba) -> (bool, Lba) {
        assert!(lba < end, "run {lba}..{end} is empty");
        let len = self.len();
        if lba >= len {
            return (false, Lba(end));
        }
        let end = end.min(len);
        let mapped = self.load(Lba(lba)) != UNMAPPED;
        let mut at = lba + 1;
        while at < end {
            let page_start = at & !(PAGE_ENTRIES as u64 - 1);
            let page_end = (page_start + PAGE_ENTRIES as u64).min(end);
            match self.page_of(at) {
                None if mapped => break,
                None => at = page_end,
                Some(p) => {
                    let (from, to) = ((at - page_start) as usize, (page_end - page_start) as usize);
                    at = page_start + self.first_change(p, from, to, mapped) as u64;
                    if at < page_end {
                        break;
                    }
                }
            }
        }
        (mapped, Lba(at.min(end)))
    }

    /// The runs of mapped blocks in `from..to`, in LBA order, found with
    /// [`Map::allocation_run`] (pages never made are stepped over whole, so a thin
    /// range costs its pages, not its blocks). Each run is looked for after the
    /// caller is done with the one before, so the caller may unmap what it is given.
    pub fn mapped_runs(&self, from: Lba, to: Lba) -> impl Iterator<Item = LbaRun> + '_ {
        let mut at = from;
        std::iter::from_fn(move || {
            while at < to {
                let (mapped, end) = self.allocation_run(at, to);
                let start = std::mem::replace(&mut at, end);
                if mapped {
                    return Some(LbaRun { start, end });
                }
            }
            None
        })
    }

    /// The first index in `from..to` of `page` whose entry is not in the `mapped`
    /// state, or `to`: one pass under the page's sequence counter, retried if the
    /// engine changed the page meanwhile (see [`Map::load`]).
    fn first_change(&self, page: &[AtomicU64], from: usize, to: usize, mapped: bool) -> usize {
        let seq = &page[SEQ_WORD];
        loop {
            let s1 = seq.load(Ordering::Acquire);
            if s1 & 1 == 1 {
                spin_wait();
                continue;
            }
            // Code 0 is UNMAPPED, whatever the packing.
            let mut i = from;
            while i < to && (self.raw(page, i) != 0) == mapped {
                i += 1;
            }
            fence(Ordering::Acquire);
            if seq.load(Ordering::Relaxed) == s1 {
                return i;
            }
        }
    }

    /// Stores an entry. Only the engine thread (or recovery, before serving) writes.
    #[inline]
    pub fn store(&self, Lba(lba): Lba, e: u32) {
        assert!(lba < self.len(), "map index {lba} out of range");
        let page = if e == UNMAPPED {
            // Unmapping where nothing was mapped makes no page.
            match self.page_of(lba) {
                Some(p) => p,
                None => return,
            }
        } else {
            self.page_mut(lba)
        };
        let code = self.encode_code(e);
        let seq = &page[SEQ_WORD];
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1), Ordering::Relaxed);
        fence(Ordering::Release);
        let bit = (lba as usize % PAGE_ENTRIES) * self.width as usize;
        let w = HEAD_WORDS + bit / 64;
        let o = (bit % 64) as u32;
        let word = page[w].load(Ordering::Relaxed);
        let mut old = word >> o;
        page[w].store((word & !(self.mask << o)) | (code << o), Ordering::Relaxed);
        if o + self.width > 64 {
            let spill = o + self.width - 64;
            let hi_mask = (1u64 << spill) - 1;
            let word = page[w + 1].load(Ordering::Relaxed);
            old |= word << (64 - o);
            page[w + 1].store((word & !hi_mask) | (code >> (64 - o)), Ordering::Relaxed);
        }
        // A reader that pins after this reads the new entry: the engine's pin
        // check puts a sequentially consistent fence after it (see `crate::pins`).
        seq.store(s.wrapping_add(2), Ordering::Release);
        let (was, is) = (old & self.mask != 0, code != 0);
        if was != is {
            let count = &page[COUNT_WORD];
            let n = count.load(Ordering::Relaxed);
            let n = if is { n + 1 } else { n - 1 };
            count.store(n, Ordering::Relaxed);
            if n == is as u64 {
                // The page's first mapped entry, or its last one gone.
                self.set_used(is);
            }
        }
    }

    /// One more page holds a mapped entry (`more`), or one fewer.
    fn set_used(&self, more: bool) {
        let u = self.used.load(Ordering::Relaxed);
        self.used
            .store(if more { u + 1 } else { u - 1 }, Ordering::Relaxed);
    }

    /// Whether the page of `lba` holds a mapped entry (it is among `used_pages`).
    pub fn page_used(&self, Lba(lba): Lba) -> bool {
        self.page_of(lba)
            .is_some_and(|p| p[COUNT_WORD].load(Ordering::Relaxed) > 0)
    }

    /// Pages that hold a mapped entry: [`Map::used_pages`]'s count, kept as
    /// entries change (one load).
    pub fn used_page_count(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// Entries of one 1024-entry page, for checkpoints (engine thread).
    pub fn page(&self, page: u64, out: &mut [u32; PAGE_ENTRIES]) {
        let start = page * PAGE_ENTRIES as u64;
        let p = self.page_of(start);
        for (i, o) in out.iter_mut().enumerate() {
            *o = match p {
                Some(p) if start + (i as u64) < self.len() => self.decode_code(self.raw(p, i)),
                _ => UNMAPPED,
            };
        }
    }

    /// The pages that hold a mapped entry, in order (engine thread, for checkpoints).
    pub fn used_pages(&self) -> Vec<u32> {
        let mut used = Vec::new();
        self.for_each_page(|page, p| {
            if p[COUNT_WORD].load(Ordering::Relaxed) > 0 {
                used.push(page as u32);
            }
        });
        used
    }

    /// Calls `f(lba, entry)` for every mapped entry, in LBA order, walking only the
    /// pages that exist (engine thread or recovery; `f` may store into the map).
    pub fn for_each_mapped(&self, mut f: impl FnMut(Lba, u32)) {
        let len = self.len();
        self.for_each_page(|page, p| {
            let first = page * PAGE_ENTRIES as u64;
            if first >= len {
                return; // a page beyond a shrunk end
            }
            for i in 0..PAGE_ENTRIES.min((len - first) as usize) {
                let c = self.raw(p, i);
                if c != 0 {
                    f(Lba(first + i as u64), self.decode_code(c));
                }
            }
        });
    }

    /// Makes this map's entries those of `src`, page by page as words (a
    /// snapshot's map from its origin's: a copy of a few bytes per block instead
    /// of a store per entry). Engine thread only, while nothing else writes `src`
    /// (the engine is its only writer) and no one reads `self` (not published
    /// yet); both maps are of one array, so their entries are coded alike.
    pub fn copy_entries_from(&self, src: &Map) {
        assert!(
            self.width == src.width
                && self.pba_codes == src.pba_codes
                && self.buffer_slots == src.buffer_slots
                && self.len() >= src.len(),
            "maps of different arrays or sizes"
        );
        let len = src.len();
        let entries = HEAD_WORDS..self.page_words;
        src.for_each_page(|page, p| {
            let first = page * PAGE_ENTRIES as u64;
            // Pages beyond a shrunk end, and pages with nothing mapped.
            if first >= len || entries.clone().all(|w| p[w].load(Ordering::Relaxed) == 0) {
                return;
            }
            let d = self.page_mut(first);
            for w in entries.clone() {
                d[w].store(p[w].load(Ordering::Relaxed), Ordering::Relaxed);
            }
            let (was, is) = (
                d[COUNT_WORD].load(Ordering::Relaxed),
                p[COUNT_WORD].load(Ordering::Relaxed),
            );
            d[COUNT_WORD].store(is, Ordering::Relaxed);
            if (was != 0) != (is != 0) {
                self.set_used(is != 0);
            }
        });
    }

    /// Pages made so far (memory: each is `page_bytes()`).
    pub fn pages_made(&self) -> u64 {
        let mut n = 0;
        self.for_each_page(|_, _| n += 1);
        n
    }

    /// Bytes of one page in memory.
    pub fn page_bytes(&self) -> usize {
        self.page_words * 8
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        fn free(map: &Map, p: *mut AtomicU64, level: u32) {
            if p.is_null() {
                return;
            }
            if level > 0 {
                let node = p as *const AtomicPtr<AtomicU64>;
                for i in 0..FAN {
                    // SAFETY: as in `page_of`; children are freed before their node.
                    free(
                        map,
                        unsafe { &*node.add(i) }.load(Ordering::Relaxed),
                        level - 1,
                    );
                }
                // SAFETY: made by `page_mut` with FAN words, freed once.
                unsafe { free_block(p, FAN) };
            } else {
                // SAFETY: made by `page_mut` with `page_words` words, freed once.
                unsafe { free_block(p, map.page_words) };
            }
        }
        // SAFETY: the current root, from Box::into_raw; nobody else holds the map.
        let root = unsafe { Box::from_raw(self.root.load(Ordering::Relaxed)) };
        for c in root.children.iter() {
            free(self, c.load(Ordering::Relaxed), root.height - 1);
        }
        // The old roots name the same nodes: only their own arrays go with them.
        for OldRoot(p) in self.old_roots.get_mut().unwrap().drain(..) {
            // SAFETY: from Box::into_raw in `new` or `grow`, freed once, here.
            drop(unsafe { Box::from_raw(p) });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot's copy: device, buffer and bad entries alike, pages with
    /// nothing mapped left unmade.
    #[test]
    fn a_page_copy_holds_every_entry_and_no_more() {
        let m = Map::new(5000, 1 << 20, 64);
        let entries = [
            (0, encode_device(Pba(7))),
            (1023, encode_buffer(3)),
            (1024, BAD),
        ];
        for (lba, e) in entries {
            m.store(Lba(lba), e);
        }
        m.store(Lba(4999), encode_device(Pba(99)));
        m.store(Lba(3000), encode_device(Pba(5)));
        m.store(Lba(3000), UNMAPPED); // a page left with nothing mapped
        let c = Map::new(5000, 1 << 20, 64);
        c.copy_entries_from(&m);
        for lba in 0..5000 {
            assert_eq!(c.load(Lba(lba)), m.load(Lba(lba)), "lba {lba}");
        }
        assert_eq!(c.pages_made(), 3, "the empty page is not copied");
        assert_eq!(c.used_page_count(), 3);
        assert_eq!(m.used_page_count(), 3, "the emptied page is not used");
    }

    /// The count of used pages follows every store (entries of every width
    /// position, straddling words included) and equals `used_pages`.
    #[test]
    fn the_used_page_count_follows_the_entries() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let n = 40 * PAGE_ENTRIES as u64;
        // 2^20 + 64 codes: 21-bit entries, which straddle words.
        let m = Map::new(n, 1 << 20, 64);
        // The pages with a mapped entry, found entry by entry.
        let scan = |m: &Map| {
            let mut pages = std::collections::BTreeSet::new();
            m.for_each_mapped(|l, _| {
                pages.insert(l.0 / PAGE_ENTRIES as u64);
            });
            pages.len() as u64
        };
        for i in 0..200_000 {
            // Few LBAs per page, so that pages empty out and fill again.
            let lba = rng.gen_range(0..40) * PAGE_ENTRIES as u64 + rng.gen_range(0..4) * 331;
            let e = match rng.gen_range(0..4) {
                0 => UNMAPPED,
                1 => encode_buffer(rng.gen_range(0..64)),
                _ => encode_device(Pba(rng.gen_range(0..1 << 20))),
            };
            m.store(Lba(lba), e);
            if i % 1000 == 0 {
                assert_eq!(m.used_page_count(), scan(&m), "store {i}");
                assert_eq!(m.used_pages().len() as u64, scan(&m), "store {i}");
            }
        }
        assert_eq!(m.used_page_count(), scan(&m));
        let c = Map::new(n, 1 << 20, 64);
        c.copy_entries_from(&m);
        assert_eq!(c.used_page_count(), m.used_page_count());
    }

    /// Runs follow the entries exactly, across made and never-made pages, and stop
    /// at the end asked for.
    #[test]
    fn allocation_runs_follow_the_entries() {
        let n = 10 * PAGE_ENTRIES as u64;
        let m = Map::new(n, 1 << 20, 16);
        let mapped: Vec<std::ops::Range<u64>> =
            vec![5..9, 1023..1025, 3 * 1024..5 * 1024 + 1, 9 * 1024 + 1..n];
        for r in &mapped {
            for lba in r.clone() {
                m.store(Lba(lba), encode_device(Pba(lba as u32)));
            }
        }
        // A page made and emptied again: unmapped, though it exists.
        m.store(Lba(7 * 1024 + 3), encode_device(Pba(1)));
        m.store(Lba(7 * 1024 + 3), UNMAPPED);
        let is_mapped = |lba: u64| mapped.iter().any(|r| r.contains(&lba));
        for start in [
            0, 4, 5, 8, 9, 1000, 1023, 1024, 1025, 2048, 3072, 5120, 7000, 9217,
        ] {
            for end in [start + 1, start + 3, start + 2000, n] {
                let end = end.min(n);
                if start >= end {
                    continue;
                }
                let (state, Lba(run_end)) = m.allocation_run(Lba(start), Lba(end));
                assert_eq!(state, is_mapped(start), "state at {start}");
                assert!(run_end > start && run_end <= end);
                assert!(
                    (start..run_end).all(|l| is_mapped(l) == state),
                    "{start}..{run_end}"
                );
                assert!(
                    run_end == end || is_mapped(run_end) != state,
                    "run from {start} stops early at {run_end}"
                );
                // The mapped runs cover exactly the mapped blocks of the range.
                let runs: Vec<u64> = m
                    .mapped_runs(Lba(start), Lba(end))
                    .flatten()
                    .map(|l| l.0)
                    .collect();
                let want: Vec<u64> = (start..end).filter(|&l| is_mapped(l)).collect();
                assert_eq!(runs, want, "mapped runs of {start}..{end}");
            }
        }
    }

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
                m.store(Lba(i), values(i));
            }
            for i in 0..5000 {
                assert_eq!(
                    m.load(Lba(i)),
                    values(i),
                    "entry {i} at width {}",
                    m.entry_bits()
                );
            }
            // Overwrite every other entry: neighbours (which may share a word) keep.
            for i in (0..5000).step_by(2) {
                m.store(Lba(i), UNMAPPED);
            }
            for i in 0..5000 {
                let want = if i % 2 == 0 { UNMAPPED } else { values(i) };
                assert_eq!(m.load(Lba(i)), want);
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
                            let e = m.load(Lba(i));
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
                    Lba(i as u64),
                    encode_device(Pba(k * 4096 % ((1 << 26) - 4096) + i)),
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        for r in readers {
            assert!(r.join().unwrap() > 0);
        }
    }

    #[test]
    fn a_huge_thin_map_costs_memory_only_where_written() {
        // 100 TiB of volume: three levels, nothing made until written.
        let blocks = 100u64 << 28;
        let m = Map::new(blocks, 1 << 18, 1024);
        assert_eq!(m.pages_made(), 0);
        assert!(m.used_pages().is_empty());
        for lba in [0, 12345, blocks / 2, blocks - 1] {
            assert_eq!(m.load(Lba(lba)), UNMAPPED);
            m.store(Lba(lba), UNMAPPED); // makes nothing
        }
        assert_eq!(m.pages_made(), 0);
        let far = [blocks - 1, blocks / 3, 5];
        for (i, &lba) in far.iter().enumerate() {
            m.store(Lba(lba), encode_device(Pba(i as u32 + 7)));
        }
        for (i, &lba) in far.iter().enumerate() {
            assert_eq!(m.load(Lba(lba)), encode_device(Pba(i as u32 + 7)));
            assert_eq!(m.load(Lba(lba ^ 1)), UNMAPPED);
        }
        assert_eq!(m.pages_made(), 3);
        let mut want: Vec<u32> = far
            .iter()
            .map(|l| (l / PAGE_ENTRIES as u64) as u32)
            .collect();
        want.sort();
        assert_eq!(m.used_pages(), want);
        let mut out = [0u32; PAGE_ENTRIES];
        m.page((blocks - 1) / PAGE_ENTRIES as u64, &mut out);
        assert_eq!(
            out[((blocks - 1) % PAGE_ENTRIES as u64) as usize],
            encode_device(Pba(7))
        );
        assert_eq!(out.iter().filter(|&&e| e != UNMAPPED).count(), 1);
        let mut seen = Vec::new();
        m.for_each_mapped(|lba, e| seen.push((lba.0, e)));
        assert_eq!(
            seen,
            vec![
                (5, encode_device(Pba(9))),
                (blocks / 3, encode_device(Pba(8))),
                (blocks - 1, encode_device(Pba(7)))
            ]
        );
        // Unmapped again: the page stays made, but checkpoints skip it.
        m.store(Lba(5), UNMAPPED);
        assert_eq!(m.used_pages().len(), 2);
        // Read marks live in the pages too.
        m.mark_read(Lba(blocks - 2), 2);
        assert!(
            m.was_read(Lba(blocks - 1))
                && m.take_read(Lba(blocks - 1))
                && !m.was_read(Lba(blocks - 1))
        );
        assert!(!m.was_read(Lba(77)) && !m.take_read(Lba(77)));
    }

    #[test]
    fn every_tree_height_finds_its_entries() {
        // One, two and three levels (the root holds at most 4096 children).
        for blocks in [
            1u64,
            1000,
            4096 * 1024,
            4096 * 1024 + 1,
            1 << 33,
            (1 << 42) - 3,
        ] {
            let m = Map::new(blocks, 1 << 20, 16);
            let lbas: Vec<u64> = (0..64u64)
                .map(|i| (i * 0x9E37_79B9_7F4A_7C15) % blocks)
                .chain([0, blocks - 1])
                .collect();
            for &l in &lbas {
                m.store(Lba(l), encode_device(Pba((l % (1 << 20)) as u32)));
            }
            for &l in &lbas {
                assert_eq!(
                    m.load(Lba(l)),
                    encode_device(Pba((l % (1 << 20)) as u32)),
                    "{l} of {blocks}"
                );
            }
            let used = m.used_pages();
            assert!(used.windows(2).all(|w| w[0] < w[1]));
            for &l in &lbas {
                assert!(used
                    .binary_search(&((l / PAGE_ENTRIES as u64) as u32))
                    .is_ok());
            }
        }
    }

    /// Growing keeps every entry, past each change of height (one level up to
    /// 4 Mi entries, two up to 4 Gi, three beyond), and makes the new ones
    /// unmapped; shrinking hides the tail, and growing again shows it unmapped.
    #[test]
    fn growing_keeps_entries_across_heights() {
        let m = Map::new(3000, 1 << 20, 16);
        let lbas = [0u64, 1, 1023, 1024, 2999];
        for &l in &lbas {
            m.store(Lba(l), encode_device(Pba(l as u32 + 7)));
        }
        let mut far = Vec::new();
        for (i, blocks) in [
            3001u64,
            4 << 20,
            (4 << 20) + 1,
            5 << 30,
            1 << 40,
            MAX_BLOCKS,
        ]
        .into_iter()
        .enumerate()
        {
            m.grow(blocks);
            assert_eq!(m.len(), blocks);
            for &l in &lbas {
                assert_eq!(
                    m.load(Lba(l)),
                    encode_device(Pba(l as u32 + 7)),
                    "{l} at {blocks}"
                );
            }
            for &(l, e) in &far {
                assert_eq!(m.load(Lba(l)), e, "{l} at {blocks}");
            }
            assert_eq!(m.load(Lba(blocks - 1)), UNMAPPED);
            let l = blocks - 1 - 10 * i as u64;
            let e = encode_device(Pba(100 + i as u32));
            m.store(Lba(l), e);
            far.push((l, e));
        }
        let mut mapped = Vec::new();
        m.for_each_mapped(|l, _| mapped.push(l));
        assert_eq!(mapped.len(), lbas.len() + far.len());
        assert!(mapped.windows(2).all(|w| w[0] < w[1]), "in LBA order");
        // Shrink below the far entries (after unmapping them, as the engine does).
        for &(l, _) in &far {
            m.store(Lba(l), UNMAPPED);
        }
        m.shrink(3000);
        assert_eq!(m.load(Lba(5000)), UNMAPPED, "beyond the end reads unmapped");
        assert_eq!(m.allocation_run(Lba(2999), Lba(9000)), (true, Lba(3000)));
        assert_eq!(m.allocation_run(Lba(4000), Lba(9000)), (false, Lba(9000)));
        // Growing after a shrink to a size a lower tree would do keeps the tree
        // as tall as it is (its nodes stay nodes) and finds every entry.
        for blocks in [1 << 20, 5 << 20, 5 << 30] {
            m.grow(blocks);
            for &l in &lbas {
                assert_eq!(
                    m.load(Lba(l)),
                    encode_device(Pba(l as u32 + 7)),
                    "{l} at {blocks}"
                );
            }
            assert_eq!(
                m.allocation_run(Lba(3000), Lba(blocks)),
                (false, Lba(blocks))
            );
            m.store(Lba(blocks - 1), encode_device(Pba(9)));
            assert_eq!(m.load(Lba(blocks - 1)), encode_device(Pba(9)));
            m.store(Lba(blocks - 1), UNMAPPED);
        }
        let mut n = 0;
        m.for_each_mapped(|_, _| n += 1);
        assert_eq!(n, lbas.len());
    }

    /// Readers walking the tree while it grows (and gets new roots) always find
    /// the entries stored before.
    #[test]
    fn readers_find_entries_while_the_map_grows() {
        use std::sync::Arc;
        let m = Arc::new(Map::new(2048, 1 << 20, 16));
        for l in 0..2048u64 {
            m.store(Lba(l), encode_device(Pba(l as u32)));
        }
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let passes = Arc::new(AtomicU64::new(0));
        let reader = {
            let (m, stop, passes) = (m.clone(), stop.clone(), passes.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for l in 0..2048u64 {
                        assert_eq!(m.load(Lba(l)), encode_device(Pba(l as u32)));
                    }
                    passes.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        let mut blocks = 2048u64;
        while blocks < MAX_BLOCKS / 2 {
            blocks = blocks * 3 / 2 + 4096;
            m.grow(blocks);
            m.store(Lba(blocks - 1), encode_device(Pba(5)));
            // Let the reader walk this tree before the next growth.
            let seen = passes.load(Ordering::Relaxed);
            while passes.load(Ordering::Relaxed) < seen + 2 && !reader.is_finished() {
                std::thread::yield_now();
            }
        }
        stop.store(true, Ordering::Relaxed);
        reader.join().expect("the reader found every entry");
    }
}
