//! Running a single owner on whichever thread brings it work.
//!
//! State with one owner (the engine) is usually given a thread of its own, and
//! every message to it pays for a hand-off: the sender wakes the owner's thread,
//! which runs, answers and sleeps again. On a small machine that wake-up costs more
//! than the work (a 4 KiB write into the write buffer is a copy and a checksum).
//! Here the owner still has exactly one holder at a time, but the thread that
//! posts a message runs it when it is free: it takes the owner, drains the queue
//! (its own message and any others), and lets go. If the owner is busy, the message
//! waits in the queue and the holder drains it before it leaves. A poster lends
//! itself for a bounded number of rounds, then rings the owner's own thread (the
//! backstop, which also runs the owner on a timer) for whatever is left.
//!
//! Why no message is left behind: a poster queues its message, then (after a
//! SeqCst fence) tries the lock; a holder lets go of the lock, then (after a SeqCst
//! fence) looks at the queue again. With fences on both sides, either the poster's
//! try sees the lock free (and it drains) or the holder's look sees the message
//! (and it takes the lock again, or someone else has): the store-buffer outcome,
//! each missing the other's write, is what the two fences forbid.

use crossbeam_channel::{bounded, Receiver, Sender, TrySendError};
use std::sync::atomic::{fence, AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Messages the queue holds. Bounded, so that queueing allocates nothing (an
/// unbounded channel allocates a block every 31 messages): a poster that finds
/// it full runs the owner itself (or waits for whoever holds it; a thread that
/// hands off rings the backstop instead) until there is room, which is safe
/// because the owner never posts to its own queue.
const QUEUE_CAPACITY: usize = 4096;

/// What a [`Combiner`] runs.
pub trait Owner: Send {
    type Msg: Send;
    /// Handles up to a round of queued messages (taken from `inbox`) and whatever
    /// work they and the clock make due. Returns true once the owner has stopped
    /// for good.
    fn round(&mut self, inbox: &Receiver<Self::Msg>) -> bool;
    /// Answers a message that arrives after the owner stopped.
    fn refuse(m: Self::Msg);
}

/// An owner, its queue, and the protocol that runs it.
pub struct Combiner<O: Owner> {
    tx: Sender<O::Msg>,
    inbox: Receiver<O::Msg>,
    owner: Mutex<O>,
    /// Rung when queued work is left for the backstop thread.
    doorbell: Sender<()>,
    rung: Receiver<()>,
    stopped: AtomicBool,
    /// Rounds a poster runs (for itself and others) before it leaves the rest to
    /// the backstop.
    lent_rounds: usize,
}

impl<O: Owner> Combiner<O> {
    pub fn new(owner: O, lent_rounds: usize) -> Self {
        let (tx, inbox) = bounded(QUEUE_CAPACITY);
        let (doorbell, rung) = bounded(1);
        Combiner {
            tx,
            inbox,
            owner: Mutex::new(owner),
            doorbell,
            rung,
            stopped: AtomicBool::new(false),
            lent_rounds: lent_rounds.max(1),
        }
    }

    /// Queues a message and runs the owner if it is free.
    pub fn post(&self, m: O::Msg) {
        self.queue(m);
        self.kick();
    }

    /// Queues a message for whoever runs the owner next: the caller's next
    /// [`Combiner::post`] or [`Combiner::kick`], another poster, or at the latest
    /// the backstop's timer.
    pub fn queue(&self, m: O::Msg) {
        self.enqueue(m, true);
    }

    /// Queues `m`; when the queue is full, drains it (`run_owner`) or rings the
    /// backstop to, until there is room. Refused once the owner has stopped.
    fn enqueue(&self, mut m: O::Msg, run_owner: bool) {
        loop {
            if self.stopped.load(Ordering::SeqCst) {
                O::refuse(m);
                return;
            }
            match self.tx.try_send(m) {
                Ok(()) | Err(TrySendError::Disconnected(_)) => return,
                Err(TrySendError::Full(back)) => {
                    m = back;
                    if run_owner {
                        self.kick();
                        std::thread::yield_now();
                    } else {
                        let _ = self.doorbell.try_send(());
                        std::thread::sleep(Duration::from_micros(100));
                    }
                }
            }
        }
    }

    /// Queues a message for the backstop thread (or a poster that comes first),
    /// without ever running the owner on this thread: for threads of low priority,
    /// which holding the owner would make everybody wait for.
    pub fn hand_off(&self, m: O::Msg) {
        self.enqueue(m, false);
        let _ = self.doorbell.try_send(());
    }

    /// Runs what is queued if the owner is free (a bounded number of rounds).
    pub fn kick(&self) {
        self.combine(None, self.lent_rounds);
    }

    pub fn stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    /// Drains the queue while this thread can take the owner, at most `rounds`
    /// rounds; `held` is the owner when the caller holds it already.
    fn combine(&self, mut held: Option<MutexGuard<'_, O>>, rounds: usize) {
        for _ in 0..rounds {
            let mut owner = match held.take() {
                Some(g) => g,
                None => {
                    fence(Ordering::SeqCst);
                    if self.inbox.is_empty() {
                        return;
                    }
                    match self.owner.try_lock() {
                        Ok(g) => g,
                        // The holder looks at the queue after it lets go.
                        Err(_) => return,
                    }
                }
            };
            if owner.round(&self.inbox) {
                self.stopped.store(true, Ordering::SeqCst);
            }
            drop(owner);
        }
        fence(Ordering::SeqCst);
        if !self.inbox.is_empty() {
            let _ = self.doorbell.try_send(());
        }
    }

    /// The backstop: runs the owner every `tick` (and when rung) until it stops.
    /// Meant for a thread of its own.
    pub fn backstop(&self, tick: Duration) {
        while !self.stopped() {
            let _ = self.rung.recv_timeout(tick);
            let owner = self.owner.lock().unwrap();
            self.combine(Some(owner), usize::MAX);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;
    use std::sync::Arc;

    /// Counts messages; each carries the sum it adds.
    struct Counter {
        seen: u64,
        sum: u64,
        stop_at: Option<u64>,
    }

    static REFUSED: AtomicU64 = AtomicU64::new(0);

    impl Owner for Counter {
        type Msg = u64;
        fn round(&mut self, inbox: &Receiver<u64>) -> bool {
            // Small rounds, so that posters run many of them against each other.
            for _ in 0..3 {
                let Ok(m) = inbox.try_recv() else { break };
                self.seen += 1;
                self.sum += m;
            }
            self.stop_at.is_some_and(|s| self.seen >= s)
        }
        fn refuse(_: u64) {
            REFUSED.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Posters only, no backstop, unbounded lending: when every poster has
    /// returned, every message has been handled. Fails if a holder leaves without
    /// looking at the queue again (a message posted while it held the owner would
    /// stay queued).
    #[test]
    fn no_message_is_left_behind_without_a_backstop() {
        for round in 0..20 {
            let c = Arc::new(Combiner::new(
                Counter {
                    seen: 0,
                    sum: 0,
                    stop_at: None,
                },
                usize::MAX,
            ));
            let threads = 4;
            let per = 20_000u64;
            let hs: Vec<_> = (0..threads)
                .map(|t| {
                    let c = c.clone();
                    std::thread::spawn(move || {
                        for i in 0..per {
                            let v = t * per + i;
                            // Some messages are only queued and started later
                            // with the next post or a kick, as deferred commands are.
                            if (v + round).is_multiple_of(5) {
                                c.queue(v);
                            } else {
                                c.post(v);
                            }
                        }
                        c.kick();
                    })
                })
                .collect();
            for h in hs {
                h.join().unwrap();
            }
            let o = c.owner.lock().unwrap();
            let n = threads * per;
            assert_eq!(o.seen, n, "round {round}: messages left in the queue");
            assert_eq!(o.sum, n * (n - 1) / 2);
        }
    }

    /// A full queue: a poster that only queues (as deferred commands are) while
    /// another thread holds the owner waits, then runs the owner itself once it
    /// is free, and every message arrives.
    #[test]
    fn a_full_queue_is_drained_by_the_poster_that_finds_it_full() {
        let c = Arc::new(Combiner::new(
            Counter {
                seen: 0,
                sum: 0,
                stop_at: None,
            },
            1,
        ));
        let n = QUEUE_CAPACITY as u64 + 1000;
        let held = c.owner.lock().unwrap();
        let poster = {
            let c = c.clone();
            std::thread::spawn(move || (0..n).for_each(|v| c.queue(v)))
        };
        while c.inbox.len() < QUEUE_CAPACITY {
            std::thread::yield_now();
        }
        assert!(!poster.is_finished(), "queued beyond the capacity");
        drop(held);
        // Nobody else drains: the poster must (a blocking send would wait here
        // for ever).
        let t0 = std::time::Instant::now();
        while !poster.is_finished() && t0.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(poster.is_finished(), "the poster waits on a full queue");
        poster.join().unwrap();
        c.kick();
        while !c.inbox.is_empty() {
            c.kick();
        }
        let o = c.owner.lock().unwrap();
        assert_eq!((o.seen, o.sum), (n, n * (n - 1) / 2));
    }

    /// With lending bounded, what posters leave is run by the backstop; after the
    /// owner stops, messages are refused, not queued.
    #[test]
    fn the_backstop_runs_what_posters_leave_and_stops() {
        let total = 50_000u64;
        let c = Arc::new(Combiner::new(
            Counter {
                seen: 0,
                sum: 0,
                stop_at: Some(total),
            },
            1,
        ));
        let b = {
            let c = c.clone();
            std::thread::spawn(move || c.backstop(Duration::from_millis(5)))
        };
        let hs: Vec<_> = (0..2)
            .map(|t| {
                let c = c.clone();
                std::thread::spawn(move || {
                    for i in 0..total / 2 {
                        c.post(t * total / 2 + i);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        b.join().unwrap();
        assert!(c.stopped());
        assert_eq!(c.owner.lock().unwrap().seen, total);
        let before = REFUSED.load(Ordering::SeqCst);
        c.post(1);
        assert_eq!(REFUSED.load(Ordering::SeqCst), before + 1);
    }

    /// Records the threads that ran it.
    struct Threads(Vec<std::thread::ThreadId>, u64);

    impl Owner for Threads {
        type Msg = u64;
        fn round(&mut self, inbox: &Receiver<u64>) -> bool {
            while inbox.try_recv().is_ok() {
                self.0.push(std::thread::current().id());
                self.1 += 1;
            }
            false
        }
        fn refuse(_: u64) {}
    }

    /// A handed-off message is run by the backstop, rung at once (its timer here is
    /// far longer than the test), and never on the thread that handed it off.
    #[test]
    fn handed_off_messages_never_run_on_the_caller() {
        let c = Arc::new(Combiner::new(Threads(Vec::new(), 0), 4));
        {
            let c = c.clone();
            std::thread::spawn(move || c.backstop(Duration::from_secs(600)));
        }
        let me = std::thread::current().id();
        let t0 = std::time::Instant::now();
        for i in 0..100 {
            c.hand_off(i);
            while c.owner.lock().unwrap().1 <= i {
                assert!(t0.elapsed() < Duration::from_secs(30), "message {i} left");
                std::thread::yield_now();
            }
        }
        let o = c.owner.lock().unwrap();
        assert!(o.0.iter().all(|t| *t != me), "ran on the caller's thread");
    }
}
