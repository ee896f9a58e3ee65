//! Superblock updates: one at a time, each a new generation written as two copies
//! in turn (copy 0 on every member, sync every member, then copy 1, sync again), so
//! that a crash at any point leaves at least one whole copy of the newest or the
//! previous generation on every member. This module owns the sequence, the
//! requests waiting for a generation to be durable, and which member failures the
//! durable superblocks record; the engine owns the superblock itself and issues
//! the writes and syncs this module asks for.
//!
//! Why the failure epochs live here: a write that left out a failed member may be
//! acknowledged only once the superblocks say the member failed, or a restart could
//! trust the member's stale data (see `Engine::sync_part_done`). The epoch a write
//! carries becomes durable exactly when its last sync completes.

use crate::engine::Token;
use lamina_format::superblock::SUPERBLOCK_OFFSETS;

/// What the engine must do next for the update under way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SbStep {
    /// Write the superblock at `offset` (copy `copy`) to every member in service.
    Write { copy: usize, offset: u64 },
    /// Sync every member in service.
    Sync,
    /// The update is durable.
    Done,
}

/// An update in progress: which copy, whether it is in its sync, and how many
/// member writes or syncs of the current step have not completed.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    copy: usize,
    syncing: bool,
    remaining: usize,
}

#[derive(Default)]
pub(crate) struct SbWriter {
    in_flight: Option<InFlight>,
    /// The superblock changed and must be written.
    dirty: bool,
    /// Generation of the newest durable superblock, and of the one being written.
    durable_gen: u64,
    writing_gen: u64,
    /// The striped device's failure epoch last copied into the superblock, the
    /// epoch the update under way carries, and the epoch known durable.
    failures_recorded: u64,
    failures_writing: u64,
    failures_durable: u64,
    /// Requests waiting for a generation to be durable.
    waiters: Vec<(Token, u64)>,
}

impl SbWriter {
    /// An update is under way.
    pub fn busy(&self) -> bool {
        self.in_flight.is_some()
    }

    /// Something changed in the superblock that no update has written yet.
    pub fn dirty(&self) -> bool {
        self.dirty
    }

    /// Asks for an update, replying to `token` once a generation after `current`
    /// (the superblock's generation now) is durable.
    pub fn wait(&mut self, token: Token, current: u64) {
        self.dirty = true;
        self.waiters.push((token, current + 1));
    }

    /// The failure epoch copied into the superblock.
    pub fn recorded(&mut self, epoch: u64) {
        self.failures_recorded = epoch;
    }

    pub fn failures_recorded(&self) -> u64 {
        self.failures_recorded
    }

    pub fn failures_durable(&self) -> u64 {
        self.failures_durable
    }

    /// Starts writing generation `generation` (the superblock must already carry
    /// it and the failures recorded so far): the first step is copy 0.
    pub fn begin(&mut self, generation: u64) -> SbStep {
        assert!(
            self.in_flight.is_none(),
            "superblock update already under way"
        );
        assert!(
            generation > self.writing_gen.max(self.durable_gen),
            "superblock generation {generation} does not advance"
        );
        self.dirty = false;
        self.writing_gen = generation;
        self.failures_writing = self.failures_recorded;
        self.in_flight = Some(InFlight {
            copy: 0,
            syncing: false,
            remaining: 0,
        });
        SbStep::Write {
            copy: 0,
            offset: SUPERBLOCK_OFFSETS[0],
        }
    }

    /// The engine issued the current step to `members` members.
    pub fn issued(&mut self, members: usize) {
        let f = self.in_flight.as_mut().expect("no superblock update");
        assert!(members > 0, "a superblock step on no member");
        f.remaining = members;
    }

    /// One member's write or sync of the current step completed (whatever its
    /// result: a failed member is the engine's business). Returns the next step
    /// once the current one is complete.
    pub fn step_done(&mut self) -> Option<SbStep> {
        let f = self.in_flight.as_mut().expect("no superblock update");
        assert!(f.remaining > 0, "more superblock completions than requests");
        f.remaining -= 1;
        if f.remaining > 0 {
            return None;
        }
        if !f.syncing {
            f.syncing = true;
            return Some(SbStep::Sync);
        }
        f.syncing = false;
        f.copy += 1;
        if f.copy < SUPERBLOCK_OFFSETS.len() {
            return Some(SbStep::Write {
                copy: f.copy,
                offset: SUPERBLOCK_OFFSETS[f.copy],
            });
        }
        self.in_flight = None;
        self.durable_gen = self.writing_gen;
        self.failures_durable = self.failures_writing;
        Some(SbStep::Done)
    }

    /// Generation `generation` was written and synced outside the engine's queue
    /// (before it serves), with the failures recorded so far.
    pub fn written_directly(&mut self, generation: u64) {
        assert!(self.in_flight.is_none());
        self.durable_gen = generation;
        self.failures_durable = self.failures_recorded;
    }

    /// Takes the waiters whose generation is durable.
    pub fn take_ready(&mut self, out: &mut Vec<Token>) {
        let durable = self.durable_gen;
        self.waiters.retain(|&(t, gen)| {
            let ready = gen <= durable;
            if ready {
                out.push(t);
            }
            !ready
        });
    }

    /// Takes every waiter (the engine failed: none will be answered with success).
    pub fn take_all(&mut self, out: &mut Vec<Token>) {
        out.extend(self.waiters.drain(..).map(|(t, _)| t));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(handle: u64) -> Token {
        Token { conn: 1, handle }
    }

    /// Runs the update to its end with `members` members, returning the steps.
    fn run(w: &mut SbWriter, generation: u64, members: usize) -> Vec<SbStep> {
        let mut steps = vec![w.begin(generation)];
        loop {
            w.issued(members);
            let mut next = None;
            for i in 0..members {
                let s = w.step_done();
                assert_eq!(
                    s.is_some(),
                    i + 1 == members,
                    "step ends with its last member"
                );
                next = s;
            }
            let s = next.unwrap();
            steps.push(s);
            if s == SbStep::Done {
                return steps;
            }
        }
    }

    #[test]
    fn each_copy_is_written_then_synced_in_turn() {
        let mut w = SbWriter::default();
        let steps = run(&mut w, 1, 3);
        assert_eq!(
            steps,
            vec![
                SbStep::Write {
                    copy: 0,
                    offset: SUPERBLOCK_OFFSETS[0]
                },
                SbStep::Sync,
                SbStep::Write {
                    copy: 1,
                    offset: SUPERBLOCK_OFFSETS[1]
                },
                SbStep::Sync,
                SbStep::Done,
            ]
        );
        assert!(!w.busy());
    }

    #[test]
    fn waiters_are_released_by_a_later_generation_only() {
        let mut w = SbWriter::default();
        let mut out = Vec::new();
        w.begin(1);
        // Asked while generation 1 is being written: it may have been copied into
        // the superblock too late, so it waits for generation 2.
        w.wait(token(7), 1);
        assert!(w.dirty());
        w.issued(1);
        while w.step_done() != Some(SbStep::Done) {
            w.issued(1);
        }
        w.take_ready(&mut out);
        assert!(
            out.is_empty(),
            "generation 1 answered a request made after it began"
        );
        run(&mut w, 2, 2);
        assert!(!w.dirty());
        w.take_ready(&mut out);
        assert_eq!(out, vec![token(7)]);
    }

    #[test]
    fn a_failure_is_durable_when_the_update_carrying_it_ends() {
        let mut w = SbWriter::default();
        w.recorded(3);
        w.begin(5);
        // Recorded after the update began: not carried by it.
        w.recorded(4);
        w.issued(2);
        w.step_done();
        w.step_done();
        assert_eq!(w.failures_durable(), 0, "durable before the last sync");
        for _ in 0..3 {
            w.issued(2);
            w.step_done();
            w.step_done();
        }
        assert!(!w.busy());
        assert_eq!(w.failures_durable(), 3);
        run(&mut w, 6, 1);
        assert_eq!(w.failures_durable(), 4);
    }

    #[test]
    fn written_directly_makes_the_recorded_failures_durable() {
        let mut w = SbWriter::default();
        w.recorded(2);
        w.wait(token(1), 0);
        w.written_directly(1);
        let mut out = Vec::new();
        w.take_ready(&mut out);
        assert_eq!(out, vec![token(1)]);
        assert_eq!(w.failures_durable(), 2);
    }

    #[test]
    #[should_panic(expected = "already under way")]
    fn one_update_at_a_time() {
        let mut w = SbWriter::default();
        w.begin(1);
        w.begin(2);
    }
}
