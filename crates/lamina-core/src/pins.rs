//! Reader pins: how client threads keep the engine from reusing what they read,
//! without a lock.
//!
//! A reader found a map entry naming a place (a write-buffer unit, or a segment on
//! the devices). It pins the place, then reads the entry again ([`Pins::pin_run`]);
//! only if the entry still names the same place does it read there, and it unpins
//! after. The engine changes map entries first and checks pins after
//! ([`Pins::pinned`]); it reuses a place only when nobody pins it.
//!
//! This is a store-then-load on each side (Dekker): the reader stores its pin and
//! loads the entry, the engine stores the entry and loads the pin. A sequentially
//! consistent fence between the store and the load on both sides makes at least one
//! of them see the other: either the reader sees the new entry (and does not read
//! the old place), or the engine sees the pin (and waits). Unpinning releases, and
//! the engine's check acquires, so a reader's copy happens before the engine's reuse.
//! `tests/loom.rs` checks all of this under the loom model checker, with the map's
//! real seqlock.

use crate::map::Map;
use crate::sync::{fence, AtomicU32, Ordering};
use crate::types::Lba;

/// One pin counter per place (buffer unit or segment).
pub struct Pins {
    counts: Box<[AtomicU32]>,
}

impl Pins {
    pub fn new(places: usize) -> Self {
        Pins {
            counts: (0..places).map(|_| AtomicU32::new(0)).collect(),
        }
    }

    /// Pins `place` and keeps it pinned if entries `lba..lba + n` of `map` still
    /// hold `first, first + 1, …`: returns how many leading entries do (their
    /// blocks may be read until [`Pins::unpin`]). Returns 0, unpinned, when even
    /// the first moved.
    #[inline]
    pub fn pin_run(&self, place: u32, map: &Map, lba: Lba, first: u32, n: u64) -> u64 {
        self.pin(place);
        let mut valid = 0u64;
        while valid < n && map.load(lba + valid) == first + valid as u32 {
            valid += 1;
        }
        if valid == 0 {
            self.unpin(place);
        }
        valid
    }

    /// Pins `place` whatever the map says; the caller then checks by its own means
    /// that the place is still what it wants (scrub: that the segment is not free).
    #[inline]
    pub fn pin(&self, place: u32) {
        self.counts[place as usize].fetch_add(1, Ordering::SeqCst);
        // The pin before the caller's re-check (see the module comment).
        fence(Ordering::SeqCst);
    }

    /// Ends a pin taken by [`Pins::pin`] or a non-zero [`Pins::pin_run`].
    #[inline]
    pub fn unpin(&self, place: u32) {
        let before = self.counts[place as usize].fetch_sub(1, Ordering::Release);
        debug_assert!(before > 0, "unpin of unpinned place {place}");
    }

    /// Whether a reader pins `place`. The engine calls this after it changed the map
    /// entries naming the place; when false, no reader that pins later will read it.
    #[inline]
    pub fn pinned(&self, place: u32) -> bool {
        // The map stores before the pin check (see the module comment).
        fence(Ordering::SeqCst);
        self.counts[place as usize].load(Ordering::Acquire) != 0
    }
}
