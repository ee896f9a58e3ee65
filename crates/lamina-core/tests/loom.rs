//! Model checking of the lock-free read protocol: the map's seqlock and the reader
//! pins (`src/map.rs`, `src/pins.rs`), the real code, under loom, which runs every
//! interleaving of the threads (up to a preemption bound) and the weak-memory
//! outcomes the orderings allow. A "device block" or "buffer slot" is a loom
//! `UnsafeCell`: loom fails the test if a reader's copy and the engine's reuse of
//! the same place are not ordered by happens-before, which is the bug the protocol
//! exists to prevent.
//!
//! Run: `RUSTFLAGS="--cfg lamina_loom" cargo test -p lamina-core --release --test loom`
//! (`.ci/run` does, with its own target directory). Without the cfg this file is
//! empty.
#![cfg(lamina_loom)]

use lamina_core::map::{encode_buffer, encode_device, Map};
use lamina_core::pins::Pins;
use lamina_core::{Lba, Pba};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::thread;

/// What a block holds: its LBA's data, or what a reused place holds afterwards.
const DATA: u64 = 0x1111;
const REUSED: u64 = 0xdead;

/// Blocks per segment in these models (segment `s` holds PBAs `4s..4s + 4`).
const SEG_BLOCKS: u32 = 4;

/// A small array: 100 blocks and 8 buffer slots make entries 7 bits wide, so entry 9
/// straddles two words (bits 63..70) and a torn read would be possible.
fn map() -> Map {
    Map::new(64, 100, 8)
}

/// Places a reader may copy from, one cell per segment (or buffer unit).
struct Places {
    cells: Vec<UnsafeCell<u64>>,
}

// SAFETY: every access goes through loom, which fails the test on a racing pair.
unsafe impl Sync for Places {}

impl Places {
    fn new(n: usize, value: u64) -> Self {
        Places {
            cells: (0..n).map(|_| UnsafeCell::new(value)).collect(),
        }
    }

    fn write(&self, place: u32, v: u64) {
        self.cells[place as usize].with_mut(|p| unsafe { *p = v });
    }

    fn read(&self, place: u32) -> u64 {
        self.cells[place as usize].with(|p| unsafe { *p })
    }
}

/// Runs `a` and `b` on two threads of their own (loom explores too little when one
/// role runs on the model's main thread, whose first accesses it does not revisit).
fn both(a: impl FnOnce() + Send + 'static, b: impl FnOnce() + Send + 'static) {
    let a = thread::spawn(a);
    let b = thread::spawn(b);
    a.join().unwrap();
    b.join().unwrap();
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    // Enough to find the store/load reorderings this protocol is about, small
    // enough to run in seconds.
    b.preemption_bound.get_or_insert(3);
    b.check(f);
}

/// GC moves LBA 0 (and a run of LBAs 0..2) from segment 0 to segment 1, then reuses
/// segment 0 as soon as nobody pins it. A reader looks LBAs 0..2 up, pins the
/// segment they name and copies out the prefix of the run the map still names: it
/// must never copy from segment 0 after its reuse, and the copy must never race
/// with the reuse.
#[test]
fn a_reader_never_copies_from_a_segment_gc_reuses() {
    model(|| {
        let map = Arc::new(map());
        let pins = Arc::new(Pins::new(2));
        let places = Arc::new(Places::new(2, 0));
        places.write(0, DATA);
        map.store(Lba(0), encode_device(Pba(0)));
        map.store(Lba(1), encode_device(Pba(1)));

        let gc = {
            let (map, pins, places) = (map.clone(), pins.clone(), places.clone());
            move || {
                places.write(1, DATA); // the copy, then the remap
                map.store(Lba(0), encode_device(Pba(SEG_BLOCKS)));
                map.store(Lba(1), encode_device(Pba(SEG_BLOCKS + 1)));
                while pins.pinned(0) {
                    thread::yield_now();
                }
                places.write(0, REUSED);
            }
        };
        let reader = move || {
            let mut lba = 0u64;
            while lba < 2 {
                let e = map.load(Lba(lba));
                let seg = (e - 1) / SEG_BLOCKS;
                let valid = pins.pin_run(seg, &map, Lba(lba), e, 2 - lba);
                if valid == 0 {
                    continue; // moved meanwhile: look again
                }
                assert_eq!(
                    places.read(seg),
                    DATA,
                    "LBA {lba} read from a reused segment"
                );
                pins.unpin(seg);
                lba += valid;
            }
        };
        both(gc, reader);
    });
}

/// The same for the write buffer: a unit write completes, the engine points the
/// entry at the device and recycles the buffer for the next unit once unpinned.
#[test]
fn a_reader_never_copies_from_a_recycled_buffer() {
    model(|| {
        let map = Arc::new(map());
        let pins = Arc::new(Pins::new(1));
        let buffer = Arc::new(Places::new(1, DATA));
        let device = Arc::new(Places::new(1, 0));
        map.store(Lba(5), encode_buffer(3));

        let engine = {
            let (map, pins, buffer, device) =
                (map.clone(), pins.clone(), buffer.clone(), device.clone());
            move || {
                device.write(0, DATA);
                map.store(Lba(5), encode_device(Pba(7)));
                if !pins.pinned(0) {
                    buffer.write(0, REUSED);
                }
            }
        };
        let reader = move || loop {
            let e = map.load(Lba(5));
            if e == encode_buffer(3) {
                if pins.pin_run(0, &map, Lba(5), e, 1) == 0 {
                    continue;
                }
                assert_eq!(buffer.read(0), DATA, "read a recycled buffer");
                pins.unpin(0);
            } else {
                assert_eq!(e, encode_device(Pba(7)));
                assert_eq!(device.read(0), DATA, "the device write was not visible");
            }
            break;
        };
        both(engine, reader);
    });
}

/// An entry that straddles two words is never seen half old, half new: the seqlock.
/// The page is made by the writer while the reader looks (its publication is part
/// of what is checked).
#[test]
fn a_straddling_entry_is_never_torn() {
    model(|| {
        let map = Arc::new(map());
        // Entry 9's code has its lowest bit in one word and six bits in the next;
        // codes 3 (0b000_0011) and 62 (0b011_1110) differ in both parts, and every
        // mix of the parts of 0, 3 and 62 is another code.
        let (a, b) = (encode_device(Pba(2)), encode_device(Pba(61)));
        let writer = {
            let map = map.clone();
            move || {
                map.store(Lba(9), a);
                map.store(Lba(9), b);
            }
        };
        let reader = {
            let map = map.clone();
            move || {
                let seen = map.load(Lba(9));
                assert!(
                    seen == 0 || seen == a || seen == b,
                    "torn entry {seen:#x} (values {a:#x}, {b:#x})"
                );
            }
        };
        both(writer, reader);
        assert_eq!(map.load(Lba(9)), b);
    });
}

/// The checker has teeth: a reader that pins but does not look at the map again
/// (the bug the re-read prevents) is caught copying from a reused segment.
#[test]
#[should_panic]
fn a_reader_that_does_not_look_again_is_caught() {
    model(|| {
        let map = Arc::new(map());
        let pins = Arc::new(Pins::new(2));
        let places = Arc::new(Places::new(2, DATA));
        map.store(Lba(0), encode_device(Pba(0)));
        let gc = {
            let (map, pins, places) = (map.clone(), pins.clone(), places.clone());
            move || {
                map.store(Lba(0), encode_device(Pba(SEG_BLOCKS)));
                if !pins.pinned(0) {
                    places.write(0, REUSED);
                }
            }
        };
        let reader = move || {
            let e = map.load(Lba(0));
            let seg = (e - 1) / SEG_BLOCKS;
            pins.pin(seg);
            assert_eq!(places.read(seg), DATA);
            pins.unpin(seg);
        };
        both(gc, reader);
    });
}
