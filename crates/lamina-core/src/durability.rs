//! Durability: flush generations, the syncs that make them durable, and who waits
//! for them (group commit).
//!
//! Every device write takes a *ticket* when it is issued and completes it when the
//! device says so. A flush starts a *generation*: it remembers the newest ticket and
//! version issued so far and asks for a sync, which is sent to every data device
//! once all writes up to that ticket have completed; when every device has synced,
//! the generation (and every older one) is durable, and every flush, FUA write and
//! release step waiting for it goes on. Flushes that arrive while a sync is under
//! way share the next one: one sync covers every flush that asked before it was
//! sent, from however many connections.
//!
//! The engine seals units and sends the syncs; this module owns the generations,
//! the tickets and the waiters.

use crate::engine::Token;
use crate::types::Version;
use std::collections::VecDeque;

/// Monotonic tickets for writes, so a sync can wait for "every write issued so far".
#[derive(Default)]
pub(crate) struct Tickets {
    base: u64,
    done: VecDeque<bool>,
}

impl Tickets {
    fn issue(&mut self) -> u64 {
        self.done.push_back(false);
        self.base + self.done.len() as u64 - 1
    }

    fn complete(&mut self, t: u64) {
        assert!(
            t >= self.base && !self.done[(t - self.base) as usize],
            "ticket {t} completed twice"
        );
        let i = (t - self.base) as usize;
        self.done[i] = true;
        while self.done.front() == Some(&true) {
            self.done.pop_front();
            self.base += 1;
        }
    }

    /// The last ticket issued (0 when none).
    fn last_issued(&self) -> u64 {
        (self.base + self.done.len() as u64).saturating_sub(1)
    }

    /// Every ticket up to and including `t` has completed.
    fn completed_through(&self, t: u64) -> bool {
        t < self.base
    }
}

/// What a sync makes durable: writes up to `ticket`, versions up to `version`,
/// flush generations up to `gen`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SyncTarget {
    pub ticket: u64,
    pub version: Version,
    pub gen: u64,
}

/// A flush (or FUA write) waiting for its generation to be durable.
struct FlushWaiter {
    gen: u64,
    token: Token,
    buf: Option<Vec<u8>>,
}

pub(crate) struct Durability {
    tickets: Tickets,
    /// The newest flush generation started, and the newest known durable.
    pub flush_gen: u64,
    pub synced_gen: u64,
    /// The generation whose sync waits for its writes to complete.
    wanted: Option<SyncTarget>,
    /// The sync sent, with the devices that have not answered yet.
    inflight: Option<(SyncTarget, usize)>,
    /// A completed sync whose flushes wait until a member failure is recorded.
    pub deferred: Option<SyncTarget>,
    waiters: Vec<FlushWaiter>,
    /// Waiters whose generation became durable, to be answered.
    ready: VecDeque<FlushWaiter>,
    /// When the last flush started, and whether writes were issued since.
    pub last_sync_ms: u64,
    pub unsynced_writes: bool,
}

impl Durability {
    pub fn new() -> Self {
        let mut tickets = Tickets::default();
        // Ticket 0 stands for "nothing written yet" and is complete.
        let t = tickets.issue();
        tickets.complete(t);
        Durability {
            tickets,
            flush_gen: 0,
            synced_gen: 0,
            wanted: None,
            inflight: None,
            deferred: None,
            waiters: Vec::new(),
            ready: VecDeque::new(),
            last_sync_ms: 0,
            unsynced_writes: false,
        }
    }

    /// A ticket for a device write being issued.
    pub fn issue(&mut self) -> u64 {
        self.tickets.issue()
    }

    /// The write holding ticket `t` completed (successfully or not).
    pub fn complete(&mut self, t: u64) {
        self.tickets.complete(t);
    }

    /// Starts flush generation `flush_gen + 1`, covering every write issued and
    /// every version taken so far (`version`: the newest); returns it. A sync still
    /// wanted (not yet sent) is replaced: the new generation covers it.
    pub fn start_flush(&mut self, version: Version, now_ms: u64) -> u64 {
        self.flush_gen += 1;
        self.wanted = Some(SyncTarget {
            ticket: self.tickets.last_issued(),
            version,
            gen: self.flush_gen,
        });
        self.last_sync_ms = now_ms;
        self.unsynced_writes = false;
        self.flush_gen
    }

    /// Neither a sync waiting to be sent nor one in flight.
    pub fn sync_idle(&self) -> bool {
        self.wanted.is_none() && self.inflight.is_none()
    }

    /// A sync is in flight.
    pub fn sync_inflight(&self) -> bool {
        self.inflight.is_some()
    }

    /// The wanted sync, if it may be sent now (no sync in flight, every write it
    /// covers completed): it is in flight from now on, awaiting `devices` answers.
    pub fn send_sync(&mut self, devices: usize) -> Option<SyncTarget> {
        if self.inflight.is_some() {
            return None;
        }
        let t = self.wanted?;
        if !self.tickets.completed_through(t.ticket) {
            return None;
        }
        assert!(devices > 0);
        self.wanted = None;
        self.inflight = Some((t, devices));
        Some(t)
    }

    /// A device answered the sync in flight: the target, once all have.
    pub fn sync_part_done(&mut self) -> Option<SyncTarget> {
        let (t, remaining) = self
            .inflight
            .take()
            .expect("sync completion without a sync");
        if remaining > 1 {
            self.inflight = Some((t, remaining - 1));
            return None;
        }
        Some(t)
    }

    /// `t`'s generation (and every older one) is durable: its waiters are ready
    /// (one pass over the waiters, in the order they came).
    pub fn synced(&mut self, t: SyncTarget) {
        self.synced_gen = self.synced_gen.max(t.gen);
        let (synced, ready) = (self.synced_gen, &mut self.ready);
        self.waiters.retain_mut(|w| {
            if w.gen > synced {
                return true;
            }
            ready.push_back(FlushWaiter {
                gen: w.gen,
                token: w.token,
                buf: w.buf.take(),
            });
            false
        });
    }

    /// `token` waits until generation `gen` is durable; `buf` goes back with the
    /// reply.
    pub fn wait(&mut self, gen: u64, token: Token, buf: Option<Vec<u8>>) {
        self.waiters.push(FlushWaiter { gen, token, buf });
    }

    /// A waiter whose generation is durable, if any, oldest first.
    pub fn take_ready(&mut self) -> Option<(Token, Option<Vec<u8>>)> {
        let w = self.ready.pop_front()?;
        debug_assert!(w.gen <= self.synced_gen);
        Some((w.token, w.buf))
    }

    /// Every waiter, durable or not (the array failed).
    pub fn take_all(&mut self) -> impl Iterator<Item = (Token, Option<Vec<u8>>)> {
        std::mem::take(&mut self.ready)
            .into_iter()
            .chain(std::mem::take(&mut self.waiters))
            .map(|w| (w.token, w.buf))
    }

    pub fn has_waiters(&self) -> bool {
        !self.waiters.is_empty() || !self.ready.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(handle: u64) -> Token {
        Token { conn: 1, handle }
    }

    #[test]
    fn a_sync_waits_for_the_writes_before_its_flush_and_not_for_later_ones() {
        let mut d = Durability::new();
        let (a, b) = (d.issue(), d.issue());
        let gen = d.start_flush(Version(7), 100);
        d.wait(gen, token(1), None);
        let late = d.issue();
        d.complete(b);
        assert!(d.send_sync(2).is_none(), "write {a} has not completed");
        d.complete(a);
        let t = d.send_sync(2).expect("every covered write completed");
        assert_eq!((t.gen, t.version, t.ticket), (gen, Version(7), b));
        assert!(d.sync_inflight() && !d.sync_idle());
        assert!(d.sync_part_done().is_none(), "one device of two answered");
        let t = d.sync_part_done().unwrap();
        d.synced(t);
        assert_eq!(d.take_ready().map(|(t, _)| t), Some(token(1)));
        assert!(d.sync_idle() && !d.has_waiters());
        d.complete(late);
    }

    #[test]
    fn flushes_during_a_sync_share_the_next_one() {
        let mut d = Durability::new();
        let w = d.issue();
        let g1 = d.start_flush(Version(1), 0);
        d.wait(g1, token(1), None);
        d.complete(w);
        let t1 = d.send_sync(1).unwrap();
        // Three flushes from three connections while the first sync is out.
        for h in 2..5 {
            let g = d.start_flush(Version(2), 0);
            d.wait(g, token(h), Some(vec![h as u8]));
        }
        assert!(d.send_sync(1).is_none(), "one sync at a time");
        let t = d.sync_part_done().unwrap();
        d.synced(t);
        assert_eq!(t1.gen, g1);
        assert_eq!(d.take_ready().map(|(t, _)| t), Some(token(1)));
        assert!(
            d.take_ready().is_none(),
            "the later flushes are not durable yet"
        );
        let t2 = d.send_sync(1).expect("the shared sync");
        assert_eq!(t2.gen, g1 + 3, "the newest generation covers all three");
        let t = d.sync_part_done().unwrap();
        d.synced(t);
        let woken: Vec<_> = std::iter::from_fn(|| d.take_ready()).collect();
        assert_eq!(
            woken,
            (2..5u64)
                .map(|h| (token(h), Some(vec![h as u8])))
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn a_failed_array_hands_back_every_waiter() {
        let mut d = Durability::new();
        let g = d.start_flush(Version(1), 0);
        d.wait(g, token(1), Some(vec![1]));
        d.wait(g + 1, token(2), None);
        assert_eq!(d.take_all().count(), 2);
        assert!(!d.has_waiters());
    }

    #[test]
    #[should_panic(expected = "completed twice")]
    fn a_ticket_completed_twice_is_a_bug() {
        let mut d = Durability::new();
        let t = d.issue();
        d.complete(t);
        d.complete(t);
    }
}
