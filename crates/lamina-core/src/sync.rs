//! The atomics of the lock-free read protocol (map seqlock, pins), switchable to
//! loom's for the model checker: `RUSTFLAGS="--cfg lamina_loom" cargo test -p
//! lamina-core --test loom` (see `tests/loom.rs`). Everything else uses std directly.

#[cfg(lamina_loom)]
pub(crate) use loom::sync::atomic::{fence, AtomicPtr, AtomicU32, AtomicU64, Ordering};
#[cfg(not(lamina_loom))]
pub(crate) use std::sync::atomic::{fence, AtomicPtr, AtomicU32, AtomicU64, Ordering};

/// Waits a moment for another thread (a seqlock writer) to finish. Under loom, a
/// yield, so the checker schedules the writer instead of spinning forever.
#[inline]
pub(crate) fn spin_wait() {
    #[cfg(lamina_loom)]
    loom::thread::yield_now();
    #[cfg(not(lamina_loom))]
    std::hint::spin_loop();
}

/// Values an array of atomics starts with, for the map's tree under loom (whose
/// atomics are not plain words that zeroed memory can stand for).
#[cfg(lamina_loom)]
pub(crate) trait Zero {
    fn zero() -> Self;
}

#[cfg(lamina_loom)]
impl Zero for AtomicU64 {
    fn zero() -> Self {
        AtomicU64::new(0)
    }
}

#[cfg(lamina_loom)]
impl<T> Zero for AtomicPtr<T> {
    fn zero() -> Self {
        AtomicPtr::new(std::ptr::null_mut())
    }
}
