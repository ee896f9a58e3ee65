//! Striped arrays (SAID0, SAID5, SAID6): one virtual device over several members.
//!
//! The log writes a segment front to back. Here a segment is a **stripe**: one
//! segment (a *chunk*) on each member, `k` of them holding data and `m` (0, 1 or 2)
//! holding parity. Block `b` of a stripe lives in row `b / k` of data column `b % k`;
//! a row is `k` data blocks and their `m` parity blocks, one block on each member, all
//! at the same offset. The members of stripe `s` are taken in the order
//! `(s + j) mod n`, `j = 0..n`: data columns first, then P, then Q, so parity rotates
//! over every member from one stripe to the next.
//!
//! **No read-modify-write.** The engine writes only whole rows (its write units are
//! padded to a multiple of `k` blocks), so the parity of every row is computed from
//! the data being written, in memory, and written once beside it. Nothing is ever read
//! to write. A flush that persists a partly filled unit pads it to the row with dead
//! blocks: at most `k - 1` blocks per flush, the price of never rewriting parity.
//!
//! **Degraded service.** A member whose write or sync fails is marked failed and left
//! out of every later operation; rows written without it still carry its share in
//! their parity. Reads of a failed member's blocks, and reads that fail, are rebuilt
//! from the rest of the row. Only when more members have failed than the layout has
//! parity do writes fail (and reads of what cannot be rebuilt).

use crate::aligned::{is_aligned, AlignedBuf};
use crate::parity::{encode, reconstruct};
use crate::uring::{self, Op};
use crate::{BlockDevice, DeviceError};
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

const BLOCK: usize = 4096;
const BLOCK_U64: u64 = BLOCK as u64;

/// Shape of a striped array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StripeShape {
    /// Data members per stripe.
    pub data: usize,
    /// Parity members per stripe (0, 1 or 2).
    pub parity: usize,
    /// Blocks of one member's chunk of a stripe (a per-device segment).
    pub chunk_blocks: u64,
    /// Byte offset on every member where stripes start.
    pub data_offset: u64,
    /// Stripes in the array.
    pub stripes: u64,
}

impl StripeShape {
    pub fn members(&self) -> usize {
        self.data + self.parity
    }
    /// Member holding position `j` (data columns, then P, then Q) of stripe `s`.
    pub fn member(&self, s: u64, j: usize) -> usize {
        ((s + j as u64) % self.members() as u64) as usize
    }
    /// Byte offset on a member of row `row` of stripe `s`.
    pub fn member_offset(&self, s: u64, row: u64) -> u64 {
        self.data_offset + (s * self.chunk_blocks + row) * BLOCK_U64
    }
    /// Data blocks of one stripe.
    pub fn stripe_blocks(&self) -> u64 {
        self.chunk_blocks * self.data as u64
    }
}

/// What [`Striped::resync_rows`] found and did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResyncStats {
    pub rows: u64,
    /// Rows whose parity did not match their data.
    pub rows_mismatched: u64,
    /// Parity blocks (rows x parity members) rewritten.
    pub parity_rewritten: u64,
    /// Rows whose parity could not be made to match (a data member unavailable, or
    /// zoned members that cannot be rewritten in place).
    pub unprotected: u64,
}

impl ResyncStats {
    pub fn add(&mut self, o: &ResyncStats) {
        self.rows += o.rows;
        self.rows_mismatched += o.rows_mismatched;
        self.parity_rewritten += o.parity_rewritten;
        self.unprotected += o.unprotected;
    }
}

/// What a scrub of some rows found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ScrubStats {
    pub rows: u64,
    /// Data blocks whose checksum did not match.
    pub checksum_errors: u64,
    /// Rows whose parity did not match their data.
    pub parity_mismatches: u64,
    /// Data blocks rebuilt from parity and written back.
    pub blocks_repaired: u64,
    /// Parity blocks recomputed and written back.
    pub parity_repaired: u64,
    /// Parity mismatches with no block known bad (nothing rewritten).
    pub unresolved: u64,
    /// Bad blocks that could not be rebuilt.
    pub unrecoverable: u64,
}

impl ScrubStats {
    pub fn add(&mut self, o: &ScrubStats) {
        self.rows += o.rows;
        self.checksum_errors += o.checksum_errors;
        self.parity_mismatches += o.parity_mismatches;
        self.blocks_repaired += o.blocks_repaired;
        self.parity_repaired += o.parity_repaired;
        self.unresolved += o.unresolved;
        self.unrecoverable += o.unrecoverable;
    }
}

/// Health of one member.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemberState {
    pub name: String,
    pub failed: bool,
    /// A rebuild under way: stripes below this are done.
    pub rebuild_cursor: Option<u64>,
    /// A rebuild thread holds the slot (`claim_rebuild`): with a cursor and
    /// none running, the rebuild stopped.
    pub rebuild_running: bool,
    /// Reads of this member that failed and were rebuilt from parity.
    pub read_errors: u64,
    /// Blocks of this member that read back damaged (their checksum failed) and
    /// were rebuilt from parity.
    pub checksum_errors: u64,
    /// Writes, syncs and zone operations of this member that failed (the first
    /// fails the member; zpool's WRITE column).
    pub write_errors: u64,
    pub bytes_written: u64,
    pub bytes_read: u64,
}

/// Locks that keep a rebuild of rows and a write of the same rows apart.
const STRIPE_LOCKS: usize = 64;

/// No rebuild under way: every stripe of the member is current.
const NOT_REBUILDING: u64 = u64::MAX;

pub struct Striped {
    /// A slot per member; `replace` swaps the device in it.
    members: Vec<RwLock<Arc<dyn BlockDevice>>>,
    /// Per member: stripes below this are current on it (rebuilt, or written since
    /// it joined); [`NOT_REBUILDING`] when all are.
    rebuilt_below: Vec<AtomicU64>,
    stripe_locks: Vec<Mutex<()>>,
    /// Per member: a rebuild thread owns it.
    rebuild_claimed: Vec<AtomicBool>,
    /// Per member slot: bumped by every `replace`, so that a rebuild of an earlier
    /// device in the slot can tell and stop.
    slot_gen: Vec<AtomicU64>,
    shape: StripeShape,
    failed: Vec<AtomicBool>,
    read_errors: Vec<AtomicU64>,
    checksum_errors: Vec<AtomicU64>,
    write_errors: Vec<AtomicU64>,
    written: Vec<AtomicU64>,
    read_bytes: Vec<AtomicU64>,
    /// Bumped whenever a member fails, so the owner can notice and record it.
    failures: AtomicU64,
    /// Blocks rebuilt from parity for readers.
    rebuilt_blocks: AtomicU64,
    /// Stripes where a member failed a read (for the owner to move elsewhere).
    /// Stripes to repair, each once. Not capped: what it holds follows the stripes
    /// that failed, and a stripe left off it would never be repaired.
    repairs: Mutex<std::collections::BTreeSet<u64>>,
    /// The members are zoned: a member being rebuilt takes no writes in stripes
    /// not yet rebuilt (its zone there is written from its start by the rebuild).
    zoned: bool,
    /// Devices `replace` took out of their slots, kept open until the array is
    /// dropped: a descriptor [`Striped::read_target`] handed out may still be in
    /// a caller's ring, and must not be closed (and its number reused) under it.
    retired: Mutex<Vec<Arc<dyn BlockDevice>>>,
}

thread_local! {
    /// Gather / parity / rebuild buffers, reused across calls (no allocation per
    /// I/O), page-aligned so that they go to direct I/O as they are.
    static SCRATCH: RefCell<AlignedBuf> = const { RefCell::new(AlignedBuf::new()) };
}

fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    SCRATCH.with(|s| f(s.borrow_mut().get(len)))
}

impl Striped {
    /// A striped device over `members` (in array order). `failed[i]` marks members
    /// known to be failed (or missing) when the array is opened.
    pub fn new(
        members: Vec<Arc<dyn BlockDevice>>,
        shape: StripeShape,
        failed: &[bool],
    ) -> Result<Self, DeviceError> {
        let n = members.len();
        let bad = |detail: String| DeviceError::Open {
            device: "striped array".into(),
            detail,
        };
        if n != shape.members() || shape.data == 0 || shape.parity > 2 {
            return Err(bad(format!(
                "{n} members do not make a stripe of {} data and {} parity",
                shape.data, shape.parity
            )));
        }
        let need = shape.member_offset(shape.stripes, 0);
        for (i, m) in members.iter().enumerate() {
            if !failed.get(i).copied().unwrap_or(false) && m.size_bytes() < need {
                return Err(bad(format!(
                    "member {} has {} bytes, the stripes need {need}",
                    m.describe(),
                    m.size_bytes()
                )));
            }
        }
        let zoned = members.iter().any(|m| m.zone_layout().is_some());
        Ok(Striped {
            zoned,
            rebuilt_below: (0..n).map(|_| AtomicU64::new(NOT_REBUILDING)).collect(),
            stripe_locks: (0..STRIPE_LOCKS).map(|_| Mutex::new(())).collect(),
            rebuild_claimed: (0..n).map(|_| AtomicBool::new(false)).collect(),
            slot_gen: (0..n).map(|_| AtomicU64::new(0)).collect(),
            failed: (0..n)
                .map(|i| AtomicBool::new(failed.get(i).copied().unwrap_or(false)))
                .collect(),
            read_errors: (0..n).map(|_| AtomicU64::new(0)).collect(),
            checksum_errors: (0..n).map(|_| AtomicU64::new(0)).collect(),
            write_errors: (0..n).map(|_| AtomicU64::new(0)).collect(),
            written: (0..n).map(|_| AtomicU64::new(0)).collect(),
            read_bytes: (0..n).map(|_| AtomicU64::new(0)).collect(),
            members: members.into_iter().map(RwLock::new).collect(),
            shape,
            failures: AtomicU64::new(0),
            rebuilt_blocks: AtomicU64::new(0),
            repairs: Mutex::new(std::collections::BTreeSet::new()),
            retired: Mutex::new(Vec::new()),
        })
    }

    /// The members are zoned (rows cannot be rewritten in place).
    pub fn is_zoned(&self) -> bool {
        self.zoned
    }

    pub fn shape(&self) -> StripeShape {
        self.shape
    }

    /// The device in member slot `i`.
    pub fn member(&self, i: usize) -> Arc<dyn BlockDevice> {
        self.members[i].read().unwrap().clone()
    }

    /// Whether stripe `s` of member `i` can be read directly.
    fn current(&self, i: usize, s: u64) -> bool {
        !self.is_failed(i) && s < self.rebuilt_below[i].load(Ordering::Acquire)
    }

    /// Stripes below which member `i` is current (`None`: all of them).
    pub fn rebuild_cursor(&self, i: usize) -> Option<u64> {
        let c = self.rebuilt_below[i].load(Ordering::Acquire);
        (c != NOT_REBUILDING).then_some(c)
    }

    /// Puts `dev` in member slot `i` (which must be failed) and starts a rebuild
    /// at stripe `from`: stripes below it are current on `dev`, the others are
    /// read from parity until [`Striped::rebuild_stripe`] has been through them.
    pub fn replace(
        &self,
        i: usize,
        dev: Arc<dyn BlockDevice>,
        from: u64,
    ) -> Result<(), DeviceError> {
        let need = self.shape.member_offset(self.shape.stripes, 0);
        if dev.size_bytes() < need {
            return Err(DeviceError::Open {
                device: dev.describe(),
                detail: format!(
                    "{} bytes is too small: a member needs {need}",
                    dev.size_bytes()
                ),
            });
        }
        // Under the slot's lock, so that a rebuild of the previous device cannot
        // move the cursor of this one (see `set_rebuild_cursor_if`).
        let mut slot = self.members[i].write().unwrap();
        let old = std::mem::replace(&mut *slot, dev);
        self.retired.lock().unwrap().push(old);
        self.slot_gen[i].fetch_add(1, Ordering::SeqCst);
        self.read_errors[i].store(0, Ordering::Relaxed);
        self.checksum_errors[i].store(0, Ordering::Relaxed);
        self.write_errors[i].store(0, Ordering::Relaxed);
        self.rebuilt_below[i].store(from, Ordering::Release);
        self.failed[i].store(false, Ordering::SeqCst);
        drop(slot);
        Ok(())
    }

    /// Where a read of `len` bytes at `offset` lies whole on one member that is
    /// current there, driven by io_uring: its descriptor and the byte offset on
    /// it, for a caller that reads with a ring of its own and checks what it gets
    /// (one block of any stripe; any run when a stripe has one data column, as a
    /// mirror's). `None` sends the read through [`BlockDevice::read_at`], which
    /// rebuilds what a member cannot give. The descriptor stays open while the
    /// array does (`retired`).
    pub fn read_target(&self, offset: u64, len: usize) -> Option<(crate::UringTarget, u64)> {
        let (m, off) = self.whole_on_member(offset, len)?;
        let t = self.members[m].read().unwrap().uring_target()?;
        Some((t, off))
    }

    /// The current member and its byte offset holding all of a read of `len`
    /// bytes at `offset`: one block of any stripe, or any run of a stripe with one
    /// data column (a mirror).
    fn whole_on_member(&self, offset: u64, len: usize) -> Option<(usize, u64)> {
        let (s, b, blocks) = self.split("read", offset, len).ok()?;
        let k = self.shape.data as u64;
        if k != 1 && blocks != 1 {
            return None;
        }
        let m = self.shape.member(s, (b % k) as usize);
        self.current(m, s)
            .then(|| (m, self.shape.member_offset(s, b / k)))
    }

    /// A read [`Striped::read_target`] handed out finished: counted against its
    /// member as reads through the array are (bytes read, or a read error, whose
    /// stripe goes to the repair list).
    pub fn target_read_done(&self, offset: u64, len: usize, ok: bool) {
        let Some((m, _)) = self.whole_on_member(offset, len) else {
            return;
        };
        if ok {
            self.read_bytes[m].fetch_add(len as u64, Ordering::Relaxed);
        } else if let Ok((s, _, _)) = self.split("read", offset, len) {
            self.note_read_error(m, s);
        }
    }

    /// Whether any member is driven by io_uring (see [`Striped::read_target`]).
    pub fn has_uring_members(&self) -> bool {
        (0..self.members.len()).any(|i| self.member(i).uring_target().is_some())
    }

    /// Sets the bytes written to member `i` (restored from a checkpoint).
    pub fn set_bytes_written(&self, i: usize, bytes: u64) {
        self.written[i].store(bytes, Ordering::Relaxed);
    }

    /// Stripes where reads failed since the last call.
    pub fn take_repairs(&self) -> Vec<u64> {
        std::mem::take(&mut *self.repairs.lock().unwrap())
            .into_iter()
            .collect()
    }

    /// Whether stripes wait on the repair list.
    pub fn repairs_waiting(&self) -> bool {
        !self.repairs.lock().unwrap().is_empty()
    }

    /// A block of `member` at array `offset` failed its checksum (and was served
    /// from parity): counted against the member, and its row queued for repair.
    pub fn note_bad_block(&self, member: usize, offset: u64) {
        if let Ok((s, _, _)) = self.split("note", offset, 0) {
            self.checksum_errors[member].fetch_add(1, Ordering::Relaxed);
            self.repairs.lock().unwrap().insert(s);
        }
    }

    /// A write, sync or zone operation of `member` failed: counted against it, and
    /// the member is failed (the array serves on from parity while it can). Also
    /// for such errors met outside this device (the engine's superblock writes,
    /// recovery's syncs); [`Striped::fail_member`] alone is a failure by decision.
    pub fn write_failed(&self, member: usize) {
        self.write_errors[member].fetch_add(1, Ordering::Relaxed);
        self.fail_member(member);
    }

    fn note_read_error(&self, member: usize, s: u64) {
        self.read_errors[member].fetch_add(1, Ordering::Relaxed);
        self.repairs.lock().unwrap().insert(s);
    }

    /// Claims the rebuild of member `i` for the caller; false if another has it.
    pub fn claim_rebuild(&self, i: usize) -> bool {
        !self.rebuild_claimed[i].swap(true, Ordering::SeqCst)
    }

    pub fn release_rebuild(&self, i: usize) {
        self.rebuild_claimed[i].store(false, Ordering::SeqCst);
    }

    /// [`Striped::set_rebuild_cursor`] if slot `i` still holds generation `gen`;
    /// false (and nothing changed) if it was replaced since.
    pub fn set_rebuild_cursor_if(&self, i: usize, gen: u64, cursor: Option<u64>) -> bool {
        let _g = self.members[i].write().unwrap();
        if self.slot_generation(i) != gen {
            return false;
        }
        self.set_rebuild_cursor(i, cursor);
        true
    }

    /// Generation of member slot `i` (changes with every `replace`).
    pub fn slot_generation(&self, i: usize) -> u64 {
        self.slot_gen[i].load(Ordering::SeqCst)
    }

    /// Member `i` holds every stripe: neither failed nor still being rebuilt.
    pub fn available(&self, i: usize) -> bool {
        !self.is_failed(i) && self.rebuild_cursor(i).is_none()
    }

    /// Members that are failed or still being rebuilt: neither adds redundancy.
    pub fn unavailable_count(&self) -> usize {
        (0..self.members.len())
            .filter(|&i| !self.available(i))
            .count()
    }

    /// Marks stripes below `cursor` of member `i` current (a rebuild resumed, or
    /// one that has moved on); `None` ends the rebuild.
    pub fn set_rebuild_cursor(&self, i: usize, cursor: Option<u64>) {
        self.rebuilt_below[i].store(cursor.unwrap_or(NOT_REBUILDING), Ordering::Release);
    }

    /// Rebuilds stripe `s` of member `i` from the other members and writes it to
    /// member `i`; returns the bytes written.
    pub fn rebuild_stripe(&self, i: usize, s: u64) -> Result<u64, DeviceError> {
        self.rebuild_stripe_range(i, s, 0, self.shape.chunk_blocks)
    }

    /// Rebuilds rows `from..upto` of member `i`'s chunk of stripe `s`. On zoned
    /// members the zone is reset first when `from` is 0, else continued at `from`,
    /// where an earlier call stopped; it is left open at `upto` when that is below
    /// the chunk (the rest of the stripe follows through ordinary writes).
    pub fn rebuild_stripe_range(
        &self,
        i: usize,
        s: u64,
        from: u64,
        upto: u64,
    ) -> Result<u64, DeviceError> {
        let sh = self.shape;
        let n = sh.members();
        let j = (0..n)
            .find(|&j| sh.member(s, j) == i)
            .expect("member in stripe");
        if self.zoned && from == 0 {
            self.member(i)
                .reset_zone(sh.member_offset(s, 0))
                .inspect_err(|_| self.write_failed(i))?;
        }
        const BATCH: u64 = 64;
        let mut written = 0;
        let mut row = from;
        let end = upto.min(sh.chunk_blocks);
        while row < end {
            let rows = BATCH.min(end - row);
            let len = rows as usize * BLOCK;
            let _g = self.stripe_locks[(s as usize) % STRIPE_LOCKS]
                .lock()
                .unwrap();
            with_scratch(n * len, |all| -> Result<(), DeviceError> {
                let mut cols: Vec<&mut [u8]> = all.chunks_mut(len).collect();
                let mut have = vec![false; n];
                // The rebuilt member counts as lost for these rows.
                self.rebuild_rows(s, row, &mut cols, &mut have, Some(i))?;
                let off = sh.member_offset(s, row);
                self.member(i)
                    .write_at(cols[j], off)
                    .inspect_err(|_| self.write_failed(i))?;
                Ok(())
            })?;
            self.written[i].fetch_add(len as u64, Ordering::Relaxed);
            written += len as u64;
            row += rows;
        }
        Ok(written)
    }

    /// Scrubs rows `0..rows` of stripe `s`: reads every member, checks the data
    /// blocks with `check(block, bytes)` (their checksums: `Some(true)` good,
    /// `Some(false)` bad, `None` unknown) and the parity against the data, and
    /// repairs in place what parity and checksums allow.
    pub fn scrub_rows(
        &self,
        s: u64,
        rows: u64,
        check: &dyn Fn(u64, &[u8]) -> Option<bool>,
    ) -> ScrubStats {
        let sh = self.shape;
        let (n, k) = (sh.members(), sh.data);
        let mut st = ScrubStats::default();
        let zoned = self.zone_layout().is_some();
        const BATCH: u64 = 64;
        let mut row0 = 0;
        while row0 < rows.min(sh.chunk_blocks) {
            let nr = BATCH.min(rows.min(sh.chunk_blocks) - row0) as usize;
            let len = nr * BLOCK;
            let off = sh.member_offset(s, row0);
            let _g = self.stripe_locks[(s as usize) % STRIPE_LOCKS]
                .lock()
                .unwrap();
            let mut cols: Vec<Vec<u8>> = vec![vec![0u8; len]; n];
            let mut readable = vec![false; n];
            for (j, col) in cols.iter_mut().enumerate() {
                let m = sh.member(s, j);
                if self.current(m, s) {
                    match self.member_read(m, col, off) {
                        Ok(()) => readable[j] = true,
                        Err(_) => self.note_read_error(m, s),
                    }
                }
            }
            // Parity recomputed from the data as read.
            let mut computed: Vec<Vec<u8>> = vec![vec![0u8; len]; sh.parity];
            if sh.parity > 0 {
                let refs: Vec<&[u8]> = cols[..k].iter().map(|c| &c[..]).collect();
                let (p, q) = computed.split_at_mut(1);
                encode(&refs, &mut p[0], q.first_mut().map(|q| &mut q[..]));
            }
            for r in 0..nr {
                st.rows += 1;
                let blk = |c: &Vec<u8>| c[r * BLOCK..(r + 1) * BLOCK].to_vec();
                let mut verdict = vec![None; k];
                let mut bad = vec![false; n];
                for j in 0..k {
                    if !readable[j] {
                        bad[j] = true;
                        continue;
                    }
                    let b = (row0 + r as u64) * k as u64 + j as u64;
                    verdict[j] = check(b, &cols[j][r * BLOCK..(r + 1) * BLOCK]);
                    if verdict[j] == Some(false) {
                        st.checksum_errors += 1;
                        bad[j] = true;
                    }
                }
                for (pj, c) in computed.iter().enumerate() {
                    let j = k + pj;
                    if !readable[j] {
                        bad[j] = true;
                    } else if !bad[..k].iter().any(|&x| x)
                        && cols[j][r * BLOCK..(r + 1) * BLOCK] != c[r * BLOCK..(r + 1) * BLOCK]
                    {
                        st.parity_mismatches += 1;
                        // Bad parity if every data block is known good; otherwise
                        // the culprit is unknown.
                        if verdict.iter().all(|v| *v == Some(true)) {
                            bad[j] = true;
                        } else {
                            st.unresolved += 1;
                        }
                    }
                }
                let lost = bad.iter().filter(|&&b| b).count();
                let to_fix: Vec<usize> = (0..n)
                    .filter(|&j| bad[j] && self.current(sh.member(s, j), s))
                    .collect();
                if to_fix.is_empty() {
                    continue;
                }
                if lost > sh.parity {
                    st.unrecoverable += to_fix.iter().filter(|&&j| j < k).count() as u64;
                    continue;
                }
                let mut row: Vec<Vec<u8>> = cols.iter().map(blk).collect();
                let mut refs: Vec<&mut [u8]> = row.iter_mut().map(|b| &mut b[..]).collect();
                if reconstruct(&mut refs, sh.parity, &bad).is_err() {
                    st.unrecoverable += 1;
                    continue;
                }
                // Every rebuilt data block must pass its checksum before anything
                // of the row (data or parity computed from it) is written back.
                let bad_rebuild = to_fix.iter().any(|&j| {
                    j < k && check((row0 + r as u64) * k as u64 + j as u64, &row[j]) == Some(false)
                });
                if bad_rebuild {
                    st.unrecoverable += 1;
                    continue;
                }
                if zoned {
                    // A zone cannot be rewritten in place: the stripe goes to the
                    // repair list, and GC moves its live blocks (rebuilt from parity
                    // as reads of them are) to a new segment.
                    st.unresolved += 1;
                    self.repairs.lock().unwrap().insert(s);
                    continue;
                }
                for &j in &to_fix {
                    let m = sh.member(s, j);
                    if self
                        .member(m)
                        .write_at(&row[j], off + (r * BLOCK) as u64)
                        .is_ok()
                    {
                        if j < k {
                            st.blocks_repaired += 1;
                        } else {
                            st.parity_repaired += 1;
                        }
                    } else {
                        self.write_failed(m);
                    }
                }
            }
            row0 += nr as u64;
        }
        st
    }

    /// Makes the parity of the rows under `offset..offset + len` match the data on the
    /// members (recovery's closing of the write hole: rows written after the last
    /// durable point may hold new data on some members and old content on others).
    /// Data is read as it is, checksums are not consulted: whatever a member holds is
    /// what a later reconstruction must give back. Parity that differs is rewritten
    /// in place; on zoned members it cannot be, and such rows count as unprotected,
    /// as do rows with a data member unavailable (their parity cannot be known).
    /// Nothing is synced here.
    ///
    /// `offset` and `len` address the striped device, as reads and writes do; every
    /// row they touch is resynced. A stripe with unprotected rows goes to the repair
    /// list, so that GC moves its live blocks to rows whose parity is whole.
    pub fn resync(&self, offset: u64, len: usize) -> Result<ResyncStats, DeviceError> {
        let (s, b, blocks) = self.split("resync", offset, len)?;
        let k = self.shape.data as u64;
        let st = self.resync_rows(s, b / k, (b + blocks).div_ceil(k))?;
        if st.unprotected > 0 {
            self.repairs.lock().unwrap().insert(s);
        }
        Ok(st)
    }

    fn resync_rows(&self, s: u64, from: u64, to: u64) -> Result<ResyncStats, DeviceError> {
        let sh = self.shape;
        let (n, k) = (sh.members(), sh.data);
        let mut st = ResyncStats::default();
        if sh.parity == 0 {
            return Ok(st);
        }
        const BATCH: u64 = 64;
        let to = to.min(sh.chunk_blocks);
        let mut row0 = from;
        while row0 < to {
            let nr = BATCH.min(to - row0) as usize;
            let len = nr * BLOCK;
            let off = sh.member_offset(s, row0);
            st.rows += nr as u64;
            let _g = self.stripe_locks[(s as usize) % STRIPE_LOCKS]
                .lock()
                .unwrap();
            let mut cols: Vec<Vec<u8>> = vec![vec![0u8; len]; n];
            let mut data_ok = true;
            let mut parity_ok = vec![false; sh.parity];
            for (j, col) in cols.iter_mut().enumerate() {
                let m = sh.member(s, j);
                let ok = self.current(m, s) && self.member_read(m, col, off).is_ok();
                if j < k {
                    data_ok &= ok;
                } else {
                    parity_ok[j - k] = ok;
                }
            }
            if !data_ok {
                st.unprotected += nr as u64;
                row0 += nr as u64;
                continue;
            }
            let mut computed: Vec<Vec<u8>> = vec![vec![0u8; len]; sh.parity];
            {
                let refs: Vec<&[u8]> = cols[..k].iter().map(|c| &c[..]).collect();
                let (p, q) = computed.split_at_mut(1);
                encode(&refs, &mut p[0], q.first_mut().map(|q| &mut q[..]));
            }
            let mut differ = 0;
            let mut stuck = false;
            for (pj, c) in computed.iter().enumerate() {
                let j = k + pj;
                let m = sh.member(s, j);
                if parity_ok[pj] && cols[j] == *c {
                    continue;
                }
                differ += (0..nr)
                    .filter(|&r| {
                        cols[j][r * BLOCK..(r + 1) * BLOCK] != c[r * BLOCK..(r + 1) * BLOCK]
                    })
                    .count() as u64;
                if !self.current(m, s) {
                    // A failed member: the rows have its redundancy no longer anyway.
                    continue;
                }
                if self.zoned {
                    stuck = true;
                    continue;
                }
                // A member that cannot take the write is failed, as on any write
                // error, and the array serves on degraded: recovery must not stop
                // on it (the next open would meet it again).
                if self.member(m).write_at(c, off).is_err() {
                    self.write_failed(m);
                    continue;
                }
                self.written[m].fetch_add(len as u64, Ordering::Relaxed);
                st.parity_rewritten += nr as u64;
            }
            st.rows_mismatched += differ.min(nr as u64);
            if stuck {
                st.unprotected += nr as u64;
            }
            row0 += nr as u64;
        }
        Ok(st)
    }

    /// Writes whole blocks of data back to the members that hold them, leaving parity
    /// alone: recovery puts back what it rebuilt from parity (a block or unit header
    /// a member dropped, tore or lost to a bit flip) so that the rows match their
    /// parity again before the resync reads them, instead of the resync making the
    /// parity match the damage. A member that fails the write is failed; the rows
    /// then rebuild from parity, which holds the right content. Nothing is synced.
    /// Not for zoned members (rows are never rewritten in place there).
    pub fn write_back(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        assert!(!self.zoned, "write_back on zoned members");
        let (s, b, blocks) = self.split("write back", offset, data.len())?;
        let sh = self.shape;
        let k = sh.data as u64;
        let _g = self.stripe_locks[(s as usize) % STRIPE_LOCKS]
            .lock()
            .unwrap();
        for i in 0..blocks {
            let (row, col) = ((b + i) / k, ((b + i) % k) as usize);
            let m = sh.member(s, col);
            if !self.current(m, s) {
                continue;
            }
            let block = &data[i as usize * BLOCK..(i as usize + 1) * BLOCK];
            if self
                .member(m)
                .write_at(block, sh.member_offset(s, row))
                .is_err()
            {
                self.write_failed(m);
                continue;
            }
            self.written[m].fetch_add(BLOCK as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    /// Reads as if member `member` were lost: its share is rebuilt from the others
    /// (scrub uses it to find which member holds a damaged block).
    pub fn read_without(
        &self,
        buf: &mut [u8],
        offset: u64,
        member: usize,
    ) -> Result<(), DeviceError> {
        self.read_inner(buf, offset, Some(member))
    }

    /// Reads, rebuilding from parity what member `exclude` holds (and whatever
    /// cannot be read).
    fn read_inner(
        &self,
        buf: &mut [u8],
        offset: u64,
        exclude: Option<usize>,
    ) -> Result<(), DeviceError> {
        let (s, b, blocks) = self.split("read", offset, buf.len())?;
        let sh = self.shape;
        let k = sh.data as u64;
        // Column by column: the blocks of one column are consecutive on its member.
        for c in 0..sh.data {
            let Some((first, last)) = column_rows(b, blocks, c, sh.data) else {
                continue;
            };
            let rows = (last - first) as usize;
            let m = sh.member(s, c);
            let scatter = |col: &[u8], buf: &mut [u8]| {
                for r in 0..rows {
                    let vb = (first + r as u64) * k + c as u64 - b;
                    let d = vb as usize * BLOCK;
                    buf[d..d + BLOCK].copy_from_slice(&col[r * BLOCK..(r + 1) * BLOCK]);
                }
            };
            let ok = with_scratch(rows * BLOCK, |col| {
                if !self.current(m, s) || exclude == Some(m) {
                    return false;
                }
                match self.member_read(m, col, sh.member_offset(s, first)) {
                    Ok(()) => {
                        scatter(col, buf);
                        true
                    }
                    Err(_) => {
                        self.note_read_error(m, s);
                        false
                    }
                }
            });
            if ok {
                continue;
            }
            // Rebuild the column from the rest of the rows.
            let n = sh.members();
            let len = rows * BLOCK;
            with_scratch(n * len, |all| -> Result<(), DeviceError> {
                let mut cols: Vec<&mut [u8]> = all.chunks_mut(len).collect();
                let mut have = vec![false; n];
                self.rebuild_rows(s, first, &mut cols, &mut have, exclude)?;
                scatter(cols[c], buf);
                Ok(())
            })?;
            self.rebuilt_blocks
                .fetch_add(rows as u64, Ordering::Relaxed);
        }
        Ok(())
    }

    pub fn member_states(&self) -> Vec<MemberState> {
        (0..self.members.len())
            .map(|i| MemberState {
                name: self.member(i).describe(),
                rebuild_cursor: self.rebuild_cursor(i),
                rebuild_running: self.rebuild_claimed[i].load(Ordering::SeqCst),
                failed: self.is_failed(i),
                read_errors: self.read_errors[i].load(Ordering::Relaxed),
                checksum_errors: self.checksum_errors[i].load(Ordering::Relaxed),
                write_errors: self.write_errors[i].load(Ordering::Relaxed),
                bytes_written: self.written[i].load(Ordering::Relaxed),
                bytes_read: self.read_bytes[i].load(Ordering::Relaxed),
            })
            .collect()
    }

    pub fn is_failed(&self, i: usize) -> bool {
        self.failed[i].load(Ordering::SeqCst)
    }

    pub fn failed_count(&self) -> usize {
        (0..self.members.len())
            .filter(|&i| self.is_failed(i))
            .count()
    }

    /// Failures still tolerated: parity members minus failed members (negative when
    /// data is lost).
    pub fn redundancy_left(&self) -> isize {
        self.shape.parity as isize - self.unavailable_count() as isize
    }

    /// Counter of failures so far (changes when a member fails).
    pub fn failure_epoch(&self) -> u64 {
        self.failures.load(Ordering::SeqCst)
    }

    /// Blocks rebuilt from parity for readers so far.
    pub fn rebuilt_blocks(&self) -> u64 {
        self.rebuilt_blocks.load(Ordering::Relaxed)
    }

    /// Takes member `i` out of service (an administrator's `fail`, or an I/O error).
    pub fn fail_member(&self, i: usize) {
        if !self.failed[i].swap(true, Ordering::SeqCst) {
            self.failures.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// Runs a zone operation on every available member; a member that fails it is
    /// failed, as for a write error.
    fn each_member_zone(
        &self,
        op: &'static str,
        offset: u64,
        f: impl Fn(&dyn BlockDevice) -> Result<(), DeviceError>,
    ) -> Result<(), DeviceError> {
        let (s, _, _) = self.split(op, offset, 0)?;
        for i in 0..self.members.len() {
            // A member being rebuilt has its zone of a stripe not yet rebuilt
            // written (from its start) by the rebuild alone.
            if self.current(i, s) && f(&*self.member(i)).is_err() {
                self.write_failed(i);
            }
        }
        if self.unavailable_count() > self.shape.parity {
            return Err(self.too_many_failed(op, offset));
        }
        Ok(())
    }

    fn too_many_failed(&self, op: &'static str, offset: u64) -> DeviceError {
        DeviceError::Io {
            device: self.describe(),
            op,
            offset,
            len: 0,
            source: std::io::Error::other(format!(
                "{} of {} members failed ({} more being rebuilt); the layout tolerates {}",
                self.failed_count(),
                self.members.len(),
                self.unavailable_count() - self.failed_count(),
                self.shape.parity
            )),
        }
    }

    /// Stripe, first block within it, and block count of a virtual range.
    fn split(
        &self,
        op: &'static str,
        offset: u64,
        len: usize,
    ) -> Result<(u64, u64, u64), DeviceError> {
        let sh = &self.shape;
        let out = || DeviceError::OutOfRange {
            device: self.describe(),
            op,
            offset,
            len,
            size: self.size_bytes(),
        };
        if offset < sh.data_offset
            || !(offset - sh.data_offset).is_multiple_of(BLOCK_U64)
            || !len.is_multiple_of(BLOCK)
        {
            return Err(out());
        }
        let first = (offset - sh.data_offset) / BLOCK_U64;
        let blocks = (len / BLOCK) as u64;
        let s = first / sh.stripe_blocks();
        let b = first % sh.stripe_blocks();
        if s >= sh.stripes || b + blocks > sh.stripe_blocks() {
            return Err(out());
        }
        Ok((s, b, blocks))
    }

    /// Reads `buf` from `member` at `off`, counting the bytes read.
    fn member_read(&self, member: usize, buf: &mut [u8], off: u64) -> Result<(), DeviceError> {
        self.read_bytes[member].fetch_add(buf.len() as u64, Ordering::Relaxed);
        self.member(member).read_at(buf, off)
    }

    /// Counts a member write of `len` bytes that succeeded; fails the member whose
    /// write did not.
    fn write_done(&self, member: usize, len: usize, ok: bool) {
        if ok {
            self.written[member].fetch_add(len as u64, Ordering::Relaxed);
        } else {
            self.write_failed(member);
        }
    }

    /// Gathers `rows` rows of `buf` into columns, computes their parity and
    /// writes every member's column at `off` (the caller holds the stripe lock).
    fn write_rows(&self, s: u64, buf: &[u8], rows: usize, off: u64) {
        let sh = self.shape;
        let (n, len) = (sh.members(), rows * BLOCK);
        with_scratch(n * len, |all| {
            let mut cols: Vec<&mut [u8]> = all.chunks_mut(len).collect();
            // Gather each data column.
            for (c, col) in cols.iter_mut().take(sh.data).enumerate() {
                for r in 0..rows {
                    let src = (r * sh.data + c) * BLOCK;
                    col[r * BLOCK..(r + 1) * BLOCK].copy_from_slice(&buf[src..src + BLOCK]);
                }
            }
            if sh.parity > 0 {
                let (data, par) = cols.split_at_mut(sh.data);
                let refs: Vec<&[u8]> = data.iter().map(|d| &**d).collect();
                let (p, q) = par.split_at_mut(1);
                encode(&refs, p[0], q.first_mut().map(|q| &mut **q));
            }
            let cols: Vec<&[u8]> = cols.iter().map(|c| &**c).collect();
            self.write_columns(s, &cols, off);
        });
    }

    /// Writes column `j` of `cols` to the member at position `j` of stripe `s`, all
    /// at `off`: members driven by io_uring in one batch (every column in flight at
    /// once), others one after the other. A member whose write fails is failed.
    fn write_columns(&self, s: u64, cols: &[&[u8]], off: u64) {
        let sh = self.shape;
        // (member, its device, its column); the devices are held for the batch.
        let targets: Vec<(usize, Arc<dyn BlockDevice>, &[u8])> = cols
            .iter()
            .enumerate()
            .map(|(j, col)| (sh.member(s, j), &**col))
            // On zoned members, a member being rebuilt skips stripes not yet rebuilt.
            .filter(|&(m, _)| !self.is_failed(m) && (!self.zoned || self.current(m, s)))
            .map(|(m, col)| (m, self.member(m), col))
            .collect();
        let mut ops = Vec::with_capacity(targets.len());
        let mut batched = Vec::with_capacity(targets.len());
        for (m, dev, col) in &targets {
            match dev.uring_target() {
                Some(t) if !t.direct || is_aligned(col.as_ptr()) => {
                    ops.push(Op::write(t.fd, col, off));
                    batched.push(*m);
                }
                _ => self.write_done(*m, col.len(), dev.write_at(col, off).is_ok()),
            }
        }
        uring::run(&mut ops, true);
        for (op, m) in ops.iter().zip(batched) {
            self.write_done(m, cols[0].len(), op.result.is_ok());
        }
    }

    /// Rebuilds rows `row..row + rows` of stripe `s` into `cols` (`n` column buffers
    /// of `rows` blocks each, in stripe order), reading every position not yet
    /// present. `have[j]` says column `j` already holds good data.
    fn rebuild_rows(
        &self,
        s: u64,
        row: u64,
        cols: &mut [&mut [u8]],
        have: &mut [bool],
        exclude: Option<usize>,
    ) -> Result<(), DeviceError> {
        let sh = &self.shape;
        let off = sh.member_offset(s, row);
        for j in 0..sh.members() {
            if have[j] {
                continue;
            }
            let m = sh.member(s, j);
            if self.current(m, s) && exclude != Some(m) {
                match self.member_read(m, cols[j], off) {
                    Ok(()) => have[j] = true,
                    Err(_) => {
                        self.note_read_error(m, s);
                    }
                }
            }
        }
        let lost: Vec<bool> = have.iter().map(|h| !h).collect();
        reconstruct(cols, sh.parity, &lost).map_err(|e| DeviceError::Io {
            device: self.describe(),
            op: "read",
            offset: off,
            len: cols[0].len(),
            source: std::io::Error::other(format!(
                "stripe {s} rows {row}+{}: {} members unreadable, the layout tolerates {}",
                cols[0].len() / BLOCK,
                e.lost,
                e.tolerated
            )),
        })
    }
}

/// The rows `first..last` of a stripe whose column `c` (of `data`) holds blocks
/// of the range `b..b + blocks` (blocks numbered row by row), if any: the rows r
/// with `b <= r * data + c < b + blocks`. A column's rows are consecutive on its
/// member.
fn column_rows(b: u64, blocks: u64, c: usize, data: usize) -> Option<(u64, u64)> {
    let (c, k, end) = (c as u64, data as u64, b + blocks);
    let first = if b > c { (b - c).div_ceil(k) } else { 0 };
    let last = if end > c { (end - c).div_ceil(k) } else { 0 };
    (last > first).then_some((first, last))
}

impl BlockDevice for Striped {
    /// Each column of the range to the member that holds it (members out of date
    /// for the stripe are left alone: a read would rebuild from the others). A
    /// range the array cannot split is ignored: it is a hint.
    fn prefetch(&self, offset: u64, len: u64) {
        let Ok((s, b, blocks)) = self.split("prefetch", offset, len as usize) else {
            return;
        };
        let sh = self.shape;
        for c in 0..sh.data {
            if let Some((first, last)) = column_rows(b, blocks, c, sh.data) {
                let m = sh.member(s, c);
                if self.current(m, s) {
                    self.member(m)
                        .prefetch(sh.member_offset(s, first), (last - first) * BLOCK_U64);
                }
            }
        }
    }

    fn size_bytes(&self) -> u64 {
        self.shape.data_offset + self.shape.stripes * self.shape.stripe_blocks() * BLOCK_U64
    }

    fn describe(&self) -> String {
        let kind = match self.shape.parity {
            0 => "said0",
            1 => "said5",
            _ => "said6",
        };
        format!("{kind}({} members)", self.members.len())
    }

    /// A read that lies whole on one current member, from its page cache; false
    /// (the caller reads with `read_at`, which rebuilds what it must) otherwise.
    fn try_read_at(&self, buf: &mut [u8], offset: u64) -> Result<bool, DeviceError> {
        let Some((m, off)) = self.whole_on_member(offset, buf.len()) else {
            return Ok(false);
        };
        // A member's error is not the array's: the waiting path rebuilds.
        let hit = self.member(m).try_read_at(buf, off).unwrap_or(false);
        if hit {
            self.read_bytes[m].fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
        Ok(hit)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.read_inner(buf, offset, None)
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        let (s, b, blocks) = self.split("write", offset, buf.len())?;
        let sh = self.shape;
        let k = sh.data as u64;
        if b % k != 0 || blocks % k != 0 {
            return Err(DeviceError::Io {
                device: self.describe(),
                op: "write",
                offset,
                len: buf.len(),
                source: std::io::Error::other(format!(
                    "writes must cover whole rows of {k} blocks (block {b}, {blocks} blocks)"
                )),
            });
        }
        // A member being rebuilt cannot stand in for a failed one in the stripes
        // not yet rebuilt: count it too.
        if self.unavailable_count() > sh.parity {
            return Err(self.too_many_failed("write", offset));
        }
        let rows = (blocks / k) as usize;
        let row = b / k;
        let n = sh.members();
        let off = sh.member_offset(s, row);
        let _g = self.stripe_locks[(s as usize) % STRIPE_LOCKS]
            .lock()
            .unwrap();
        if sh.data == 1 {
            // A mirror: P and Q of one column are copies of it, so every member
            // takes the caller's buffer as it is (no gather, no parity to compute).
            self.write_columns(s, &vec![buf; n], off);
        } else {
            self.write_rows(s, buf, rows, off);
        }
        if self.unavailable_count() > sh.parity {
            return Err(self.too_many_failed("write", offset));
        }
        Ok(())
    }

    /// Members driven by io_uring sync in one batch, in parallel; others one after
    /// the other.
    fn sync(&self) -> Result<(), DeviceError> {
        let members: Vec<(usize, Arc<dyn BlockDevice>)> = (0..self.members.len())
            .filter(|&i| !self.is_failed(i))
            .map(|i| (i, self.member(i)))
            .collect();
        let mut ops = Vec::with_capacity(members.len());
        let mut batched = Vec::with_capacity(members.len());
        for (i, dev) in &members {
            match dev.uring_target() {
                Some(t) => {
                    ops.push(Op::datasync(t.fd));
                    batched.push(*i);
                }
                None => {
                    if dev.sync().is_err() {
                        self.write_failed(*i);
                    }
                }
            }
        }
        uring::run(&mut ops, true);
        for (op, i) in ops.iter().zip(batched) {
            if op.result.is_err() {
                self.write_failed(i);
            }
        }
        if self.failed_count() > self.shape.parity {
            return Err(self.too_many_failed("sync", 0));
        }
        Ok(())
    }

    /// Zoned members: stripe `s` is zone `s` of every member (each member's chunk
    /// is one of its zones), so the striped device has one zone per stripe.
    fn zone_layout(&self) -> Option<crate::ZoneLayout> {
        let sh = self.shape;
        let mut limit = 0u32;
        let mut any = false;
        for i in (0..self.members.len()).filter(|&i| !self.is_failed(i)) {
            let l = self.member(i).zone_layout()?;
            if l.conventional_bytes != sh.data_offset
                || l.zone_capacity != sh.chunk_blocks * BLOCK_U64
            {
                return None;
            }
            any = true;
            limit = match (limit, l.open_limit()) {
                (0, b) => b,
                (a, 0) => a,
                (a, b) => a.min(b),
            };
        }
        any.then(|| crate::ZoneLayout {
            conventional_bytes: sh.data_offset,
            zone_bytes: sh.stripe_blocks() * BLOCK_U64,
            zone_capacity: sh.stripe_blocks() * BLOCK_U64,
            zones: sh.stripes,
            max_open: limit,
            max_active: limit,
        })
    }

    /// A stripe's zone is empty (or full) when every available member's is; its
    /// write pointer is the lowest of the members' rows.
    fn report_zones(&self) -> Result<Vec<crate::zoned::Zone>, DeviceError> {
        use crate::zoned::{Zone, ZoneCond, ZoneType};
        let sh = self.shape;
        let zb = sh.stripe_blocks() * BLOCK_U64;
        let mut zones: Vec<Zone> = (0..sh.stripes)
            .map(|s| Zone {
                start: sh.data_offset + s * zb,
                len: zb,
                capacity: zb,
                wp: u64::MAX,
                cond: ZoneCond::Empty,
                ty: ZoneType::SequentialRequired,
            })
            .collect();
        let mut all_full = vec![true; zones.len()];
        for i in (0..self.members.len()).filter(|&i| !self.is_failed(i)) {
            let seq = self
                .member(i)
                .report_zones()?
                .into_iter()
                .filter(|z| z.ty == ZoneType::SequentialRequired);
            for (s, mz) in seq.enumerate().take(zones.len()) {
                if !self.current(i, s as u64) {
                    continue;
                }
                let rows = (mz.wp.saturating_sub(mz.start) / BLOCK_U64).min(sh.chunk_blocks);
                let z = &mut zones[s];
                z.wp = z.wp.min(z.start + rows * sh.data as u64 * BLOCK_U64);
                if mz.cond != ZoneCond::Empty {
                    z.cond = ZoneCond::Closed;
                }
                all_full[s] &= mz.cond == ZoneCond::Full;
                if matches!(mz.cond, ZoneCond::Offline | ZoneCond::ReadOnly) {
                    z.cond = mz.cond;
                }
            }
        }
        for (z, full) in zones.iter_mut().zip(all_full) {
            if full {
                z.cond = ZoneCond::Full;
            }
            if z.wp == u64::MAX {
                z.wp = z.start;
            }
        }
        let mut all = vec![Zone {
            start: 0,
            len: sh.data_offset,
            capacity: sh.data_offset,
            wp: 0,
            cond: ZoneCond::NotWritePointer,
            ty: ZoneType::Conventional,
        }];
        all.extend(zones);
        Ok(all)
    }

    /// Discards whole rows on every available member (data and parity alike, so
    /// the rows stay consistent whatever the members return for them).
    fn discard(&self, offset: u64, len: u64) -> Result<(), DeviceError> {
        let (s, b, blocks) = self.split("discard", offset, len as usize)?;
        let k = self.shape.data as u64;
        let (first, last) = (b.div_ceil(k), (b + blocks) / k);
        if last <= first {
            return Ok(());
        }
        let off = self.shape.member_offset(s, first);
        for i in 0..self.members.len() {
            if !self.is_failed(i) {
                // Advisory: a member that refuses keeps its data.
                let _ = self.member(i).discard(off, (last - first) * BLOCK_U64);
            }
        }
        Ok(())
    }

    fn reset_zone(&self, offset: u64) -> Result<(), DeviceError> {
        let (s, _, _) = self.split("reset zone", offset, 0)?;
        self.each_member_zone("reset zone", offset, |m| {
            m.reset_zone(self.shape.member_offset(s, 0))
        })
    }

    /// Finishes each member's zone at the row holding `offset`. A member whose zone
    /// is still empty (a crash tore the stripe's first row) may refuse, at its
    /// open-zone limit: that zone is left empty, not counted as a member failure.
    fn finish_zone(&self, offset: u64) -> Result<(), DeviceError> {
        let (s, b, _) = self.split("finish zone", offset, 0)?;
        let row = b / self.shape.data as u64;
        let at = self.shape.member_offset(s, 0);
        self.each_member_zone("finish zone", offset, |m| {
            m.finish_zone(self.shape.member_offset(s, row))
                .or_else(|e| {
                    let empty = m.report_zones().is_ok_and(|zs| {
                        zs.iter()
                            .any(|z| z.start == at && z.cond == crate::zoned::ZoneCond::Empty)
                    });
                    if empty {
                        Ok(())
                    } else {
                        Err(e)
                    }
                })
        })
    }
}

/// Member `i` of a striped array as a device of its own (superblocks, syncs):
/// whatever device is in the slot now, the replacement after a `replace`.
pub struct MemberSlot {
    pub array: Arc<Striped>,
    pub index: usize,
}

impl BlockDevice for MemberSlot {
    fn size_bytes(&self) -> u64 {
        self.array.member(self.index).size_bytes()
    }
    fn describe(&self) -> String {
        self.array.member(self.index).describe()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<(), DeviceError> {
        self.array.member(self.index).read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<(), DeviceError> {
        self.array.member(self.index).write_at(buf, offset)
    }
    fn sync(&self) -> Result<(), DeviceError> {
        self.array.member(self.index).sync()
    }
}

/// The slot of a member that is missing: every operation fails, size 0.
pub struct Absent {
    name: String,
    reason: String,
}

impl Absent {
    pub fn new(name: impl Into<String>) -> Self {
        Self::with_reason(name, "device is missing")
    }
    /// An absent device that says why it could not be opened.
    pub fn with_reason(name: impl Into<String>, reason: impl Into<String>) -> Self {
        Absent {
            name: name.into(),
            reason: reason.into(),
        }
    }
    fn err(&self) -> DeviceError {
        DeviceError::Open {
            device: self.name.clone(),
            detail: self.reason.clone(),
        }
    }
}

impl BlockDevice for Absent {
    fn size_bytes(&self) -> u64 {
        0
    }
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn read_at(&self, _: &mut [u8], _: u64) -> Result<(), DeviceError> {
        Err(self.err())
    }
    fn write_at(&self, _: &[u8], _: u64) -> Result<(), DeviceError> {
        Err(self.err())
    }
    fn sync(&self) -> Result<(), DeviceError> {
        Err(self.err())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fault::{FaultDevice, FaultOp};
    use crate::mem::MemDevice;
    use proptest::prelude::*;

    /// A hint over part of a stripe reaches every data member for exactly its
    /// column's rows, where a read of the range would read them.
    #[test]
    fn prefetch_hands_each_column_to_its_member() {
        let (a, rec) = array(3, 1);
        let shape = a.shape;
        // Stripe 2, blocks 4..17 of it: 13 blocks over 3 columns.
        let (s, b, blocks) = (2u64, 4u64, 13u64);
        let offset = shape.data_offset + (s * shape.stripe_blocks() + b) * BLOCK_U64;
        a.prefetch(offset, blocks * BLOCK_U64);
        let mut total = 0;
        for c in 0..shape.data {
            let (first, last) = column_rows(b, blocks, c, shape.data).unwrap();
            let m = shape.member(s, c);
            let asked = rec[m].prefetched.lock().unwrap().clone();
            assert_eq!(
                asked,
                vec![(shape.member_offset(s, first), (last - first) * BLOCK_U64)],
                "column {c} on member {m}"
            );
            total += last - first;
        }
        assert_eq!(total, blocks);
        // The parity member is asked for nothing; a range it cannot split, ignored.
        let parity = (0..shape.members())
            .find(|&m| (0..shape.data).all(|c| shape.member(s, c) != m))
            .unwrap();
        assert!(rec[parity].prefetched.lock().unwrap().is_empty());
        a.prefetch(offset + 1, 4096);
        a.prefetch(u64::MAX - 4096, 4096);
    }

    fn array(data: usize, parity: usize) -> (Striped, Vec<Arc<FaultDevice>>) {
        let shape = StripeShape {
            data,
            parity,
            chunk_blocks: 8,
            data_offset: 2 * BLOCK_U64,
            stripes: 4,
        };
        let size = shape.member_offset(shape.stripes, 0);
        let faults: Vec<Arc<FaultDevice>> = (0..shape.members())
            .map(|i| {
                Arc::new(FaultDevice::new(Arc::new(MemDevice::new(
                    format!("m{i}"),
                    size,
                ))))
            })
            .collect();
        let members = faults
            .iter()
            .map(|f| f.clone() as Arc<dyn BlockDevice>)
            .collect();
        (Striped::new(members, shape, &[]).unwrap(), faults)
    }

    /// One data column (a mirror, as the cache tier's copies are driven): every
    /// member holds the data as written, byte for byte, in every stripe; reads
    /// survive all members but one lost, and a read that lies on one current
    /// member is handed out to the caller's ring (or page cache) from it.
    #[test]
    fn one_data_column_is_a_mirror() {
        for copies in [2, 3] {
            let (a, f) = array(1, copies - 1);
            let sh = a.shape;
            for s in 0..sh.stripes {
                let data = pattern(s + 1, 8);
                let off = sh.data_offset + s * sh.stripe_blocks() * BLOCK_U64;
                a.write_at(&data, off).unwrap();
                for m in &f {
                    let mut got = vec![0u8; data.len()];
                    m.read_at(&mut got, sh.member_offset(s, 0)).unwrap();
                    assert!(got == data, "{copies} copies, stripe {s}, {}", m.describe());
                }
                assert_eq!(
                    a.whole_on_member(off, data.len()),
                    Some((sh.member(s, 0), sh.member_offset(s, 0)))
                );
            }
            // A read handed out to a caller's ring is counted against its member
            // when it finishes: bytes, or an error and a repair of the stripe.
            let off = sh.data_offset + sh.stripe_blocks() * BLOCK_U64;
            let m = sh.member(1, 0);
            let before = a.member_states()[m].bytes_read;
            a.target_read_done(off, BLOCK, true);
            assert_eq!(a.member_states()[m].bytes_read, before + BLOCK_U64);
            a.target_read_done(off, BLOCK, false);
            assert_eq!(a.member_states()[m].read_errors, 1);
            assert_eq!(a.take_repairs(), vec![1]);
            for (lost, m) in f.iter().enumerate().take(copies - 1) {
                m.vanish();
                a.fail_member(lost);
            }
            for s in 0..sh.stripes {
                let mut got = vec![0u8; 8 * BLOCK];
                let off = sh.data_offset + s * sh.stripe_blocks() * BLOCK_U64;
                a.read_at(&mut got, off).unwrap();
                assert!(got == pattern(s + 1, 8), "{copies} copies, stripe {s}");
                // Only the member left is current: reads go to it or nowhere.
                let on = a.whole_on_member(off, got.len());
                assert!(on.is_none() || on.unwrap().0 == copies - 1);
            }
        }
    }

    fn pattern(seed: u64, blocks: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..blocks * BLOCK)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    /// Fills every stripe with known data, returns the image.
    fn fill(a: &Striped) -> Vec<u8> {
        let sh = a.shape();
        let img = pattern(7, (sh.stripes * sh.stripe_blocks()) as usize);
        let unit = sh.data * 2 * BLOCK;
        for (i, chunk) in img.chunks(unit).enumerate() {
            a.write_at(chunk, sh.data_offset + (i * unit) as u64)
                .unwrap();
        }
        img
    }

    fn read_all(a: &Striped, img: &[u8]) {
        let sh = a.shape();
        // Odd-sized reads at every alignment.
        for start in 0..(sh.stripe_blocks() - 3) {
            for s in 0..sh.stripes {
                let v = s * sh.stripe_blocks() + start;
                let mut buf = vec![0u8; 3 * BLOCK];
                a.read_at(&mut buf, sh.data_offset + v * BLOCK_U64).unwrap();
                let o = v as usize * BLOCK;
                assert!(buf == img[o..o + 3 * BLOCK], "stripe {s} block {start}");
            }
        }
    }

    /// SAID6 over files driven by io_uring with direct I/O, members written and
    /// synced as batches: the data reads back, through two lost members too, and
    /// a member whose batched write fails is failed.
    #[test]
    fn batched_members_on_files_with_direct_io() {
        use crate::file::{DirectIo, FileDevice, IoEngine, IoOptions, OpenMode};
        let dir = std::env::temp_dir().join(format!("lamina-striped-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let shape = StripeShape {
            data: 3,
            parity: 2,
            chunk_blocks: 8,
            data_offset: 2 * BLOCK_U64,
            stripes: 4,
        };
        let size = shape.member_offset(shape.stripes, 0);
        let io = IoOptions {
            engine: IoEngine::Uring,
            direct: DirectIo::On,
        };
        let files: Vec<Arc<FileDevice>> = (0..shape.members())
            .map(|i| {
                let p = dir.join(format!("m{i}"));
                let _ = std::fs::remove_file(&p);
                drop(FileDevice::create_sparse(&p, size).unwrap());
                Arc::new(FileDevice::open_with(&p, OpenMode::ReadWrite, io).unwrap())
            })
            .collect();
        assert!(files[0].uring_target().is_some_and(|t| t.direct));
        let members = files
            .iter()
            .map(|f| f.clone() as Arc<dyn BlockDevice>)
            .collect();
        let a = Striped::new(members, shape, &[]).unwrap();
        let img = fill(&a);
        a.sync().unwrap();
        assert_eq!(a.failed_count(), 0);
        read_all(&a, &img);
        a.fail_member(1);
        a.fail_member(3);
        read_all(&a, &img);
        // A write the kernel refuses (a member opened read-only) fails that member.
        let ro = dir.join("m0");
        drop((a, files));
        let members: Vec<Arc<dyn BlockDevice>> = (0..shape.members())
            .map(|i| {
                let mode = if i == 0 {
                    OpenMode::ReadOnly
                } else {
                    OpenMode::ReadWrite
                };
                let p = if i == 0 {
                    ro.clone()
                } else {
                    dir.join(format!("m{i}"))
                };
                Arc::new(FileDevice::open_with(&p, mode, io).unwrap()) as Arc<dyn BlockDevice>
            })
            .collect();
        let a = Striped::new(members, shape, &[]).unwrap();
        a.write_at(&img[..shape.data * BLOCK], shape.data_offset)
            .unwrap();
        assert!(a.is_failed(0), "the read-only member failed its write");
        assert_eq!(a.failed_count(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn parity_rotates_over_every_member() {
        let (a, _) = array(3, 1);
        let sh = a.shape();
        let p: Vec<usize> = (0..4).map(|s| sh.member(s, 3)).collect();
        let mut sorted = p.clone();
        sorted.sort();
        assert_eq!(sorted, vec![0, 1, 2, 3], "P members {p:?}");
    }

    #[test]
    fn partial_rows_are_refused() {
        let (a, _) = array(3, 1);
        let e = a.write_at(&[0u8; 2 * BLOCK], 2 * BLOCK_U64).unwrap_err();
        assert!(e.to_string().contains("whole rows"), "{e}");
    }

    #[test]
    fn said5_reads_through_a_lost_member() {
        let (a, f) = array(3, 1);
        let img = fill(&a);
        read_all(&a, &img);
        f[2].vanish();
        read_all(&a, &img);
        assert!(a.rebuilt_blocks() > 0);
        // Writes go on without it, reads still match.
        let sh = a.shape();
        let more = pattern(9, 6);
        a.write_at(&more, sh.data_offset).unwrap();
        assert!(a.is_failed(2), "the failed write marked it");
        assert_eq!(a.redundancy_left(), 0);
        let mut img = img;
        img[..more.len()].copy_from_slice(&more);
        read_all(&a, &img);
        // A second loss is beyond SAID5.
        f[0].vanish();
        assert!(a.write_at(&more, sh.data_offset).is_err());
    }

    #[test]
    fn read_errors_on_one_block_are_rebuilt() {
        let (a, f) = array(4, 1);
        let img = fill(&a);
        let sh = a.shape();
        f[1].fail(
            FaultOp::Read,
            sh.member_offset(1, 2),
            sh.member_offset(1, 3),
            u64::MAX,
        );
        read_all(&a, &img);
        assert!(!a.is_failed(1), "a read error does not fail the member");
        assert!(a.member_states()[1].read_errors > 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(40))]
        /// SAID6: lose any two members, every block still reads back.
        #[test]
        fn said6_survives_any_two_losses(k in 2usize..6, x in 0usize..8, y in 0usize..8) {
            let (a, f) = array(k, 2);
            let img = fill(&a);
            let n = k + 2;
            f[x % n].vanish();
            a.fail_member(x % n);
            f[y % n].vanish();
            a.fail_member(y % n);
            read_all(&a, &img);
        }
    }

    #[test]
    fn said0_retries_a_transient_read_error() {
        let (a, f) = array(3, 0);
        let img = fill(&a);
        let sh = a.shape();
        f[1].fail(FaultOp::Read, 0, u64::MAX, 1);
        read_all(&a, &img);
        let _ = sh;
    }

    #[test]
    fn said0_has_no_redundancy() {
        let (a, f) = array(3, 0);
        let img = fill(&a);
        read_all(&a, &img);
        f[0].vanish();
        let mut buf = vec![0u8; 3 * BLOCK];
        assert!(a.read_at(&mut buf, a.shape().data_offset).is_err());
    }

    /// Resync after a crash: parity that does not match is rewritten; a member that
    /// fails the rewrite is failed (the array goes on degraded, reads rebuild from
    /// the rest) instead of the resync, and with it the array's open, failing.
    #[test]
    fn resync_rewrites_stale_parity_and_survives_a_failing_member() {
        let (a, f) = array(3, 1);
        let img = fill(&a);
        let sh = a.shape();
        // A torn row: new data reached one member, its parity did not.
        let (s, row) = (1u64, 2u64);
        let m = sh.member(s, 0);
        f[m].write_at(&pattern(99, 1), sh.member_offset(s, row))
            .unwrap();
        let at = sh.data_offset + s * sh.stripe_blocks() * BLOCK_U64;
        let st = a.resync(at, sh.stripe_blocks() as usize * BLOCK).unwrap();
        assert_eq!((st.rows_mismatched, st.parity_rewritten), (1, 8));
        // Now whatever a member held is what its loss rebuilds.
        let mut want = img.clone();
        let o = ((s * sh.stripe_blocks() + row * 3) as usize) * BLOCK;
        want[o..o + BLOCK].copy_from_slice(&pattern(99, 1));
        let mut b = vec![0u8; BLOCK];
        a.read_without(&mut b, sh.data_offset + (o / BLOCK) as u64 * BLOCK_U64, m)
            .unwrap();
        assert!(b == want[o..o + BLOCK]);
        // Tear the row again; this time the parity member refuses the rewrite.
        f[m].write_at(&pattern(64, 1), sh.member_offset(s, row))
            .unwrap();
        want[o..o + BLOCK].copy_from_slice(&pattern(64, 1));
        let p = sh.member(s, 3);
        f[p].fail(FaultOp::Write, 0, u64::MAX, u64::MAX);
        let st = a.resync(at, sh.stripe_blocks() as usize * BLOCK).unwrap();
        assert_eq!((st.rows_mismatched, st.parity_rewritten), (1, 0));
        assert!(a.is_failed(p));
        read_all(&a, &want);
    }

    /// A member whose write fails is failed with the error counted against it (as
    /// zpool's WRITE column); one failed by hand counts none; a sync error counts
    /// too; a replacement starts from zero.
    #[test]
    fn write_errors_are_counted_against_their_member() {
        let (a, f) = array(3, 1);
        let img = fill(&a);
        let sh = a.shape();
        f[2].fail(FaultOp::Write, 0, u64::MAX, u64::MAX);
        let unit = sh.data * 2 * BLOCK;
        a.write_at(&img[..unit], sh.data_offset).unwrap();
        let st = a.member_states();
        assert!(st[2].failed);
        assert_eq!(st[2].write_errors, 1, "failed on its first write error");
        assert_eq!(st.iter().map(|m| m.write_errors).sum::<u64>(), 1);
        read_all(&a, &img);
        a.fail_member(0);
        assert_eq!(a.member_states()[0].write_errors, 0, "failed by hand");
        let (b, g) = array(3, 1);
        g[1].fail(FaultOp::Sync, 0, u64::MAX, u64::MAX);
        b.sync().unwrap();
        assert_eq!(b.member_states()[1].write_errors, 1);
        assert!(b.is_failed(1));
        b.replace(1, Arc::new(MemDevice::new("new", g[1].size_bytes())), 0)
            .unwrap();
        assert_eq!(b.member_states()[1].write_errors, 0);
    }

    /// Every stripe with a bad block stays on the repair list, however many there
    /// are (the list once stopped at 4096 and dropped the rest silently).
    #[test]
    fn the_repair_list_keeps_every_stripe_once() {
        let shape = StripeShape {
            data: 2,
            parity: 1,
            chunk_blocks: 1,
            data_offset: 0,
            stripes: 5000,
        };
        let size = shape.member_offset(shape.stripes, 0);
        let members = (0..3)
            .map(|i| Arc::new(MemDevice::new(format!("m{i}"), size)) as Arc<dyn BlockDevice>)
            .collect();
        let a = Striped::new(members, shape, &[]).unwrap();
        for round in 0..2 {
            for s in 0..shape.stripes {
                a.note_bad_block(round, s * shape.stripe_blocks() * BLOCK_U64);
            }
        }
        assert!(a.repairs_waiting());
        let r = a.take_repairs();
        assert_eq!(r, (0..shape.stripes).collect::<Vec<_>>());
        assert!(!a.repairs_waiting());
    }
}
