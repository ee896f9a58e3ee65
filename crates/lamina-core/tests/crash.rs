//! Power-cut tests against a reference model.
//!
//! A seeded workload of writes, zeroes and flushes runs against an engine on a
//! simulated disk that keeps synced and unsynced writes apart. Device operations
//! execute in random order, a few at a time. At random moments the power is cut: each
//! unsynced 512-byte sector survives with some probability, so multi-sector writes
//! tear. The engine is rebuilt from that image and every block is checked:
//!
//! * it holds exactly one version's content (never a mix, never another block's);
//! * that version is the one acknowledged before the last completed flush, or a
//!   version written after it (the NBD durability contract).
//!
//! Parity arrays run the same workload over one simulated disk per member. A power
//! cut then keeps or drops each member's unsynced writes on its own (members synced
//! in any order), and after recovery every single member (for SAID6, every pair) is
//! lost in turn: each block must still read back exactly as it did after recovery.
//! That is the RAID write hole; recovery closes it by resyncing the parity of rows
//! written after the last durable point.
//!
//! Failures print the seed; `LAMINA_CRASH_SEED=<seed>` replays one case.

mod common;
use common::*;
use lamina_core::{Request, Token, VolumeId};
use lamina_device::crash::{CrashDevice, PowerCut};
use lamina_device::fault::{FaultDevice, FaultOp};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use lamina_testkit::{FlushMark, Oracle, WriteMark};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// The connection of requests sent beside the workload ([`Run::side_call`]).
const SIDE: u32 = 2;

/// Outstanding requests of the workload, by handle.
#[derive(Default)]
struct Outstanding {
    writes: HashMap<u64, (u64, WriteMark)>,
    flushes: HashMap<u64, FlushMark>,
}

struct Run {
    rng: rand::rngs::StdRng,
    devs: Vec<Arc<CrashDevice>>,
    /// What the engine sees of each member: writes fail on demand.
    faults: Vec<Arc<FaultDevice>>,
    /// A member was failed by a write error: the array runs degraded from then
    /// on, and no further member can be lost.
    degraded: bool,
    /// A flush completed after the engine failed the member: its failure must be
    /// on record in every recovery from then on.
    failure_flushed: bool,
    /// Recoveries that found the failed member on record.
    failures_on_record: u64,
    /// Cache segments compacted (arrays with a cache tier), over every round.
    compactions: u64,
    /// End the round now (see `collect_replies`).
    cut_now: bool,
    /// The engine had failed a member before the operations of this step ran: a
    /// flush acknowledged in the step completed after the failure. (A member armed
    /// to fail has not failed until a write reaches it.)
    failure_seen: bool,
    /// The member that lies about its writes ([`Faults::Silent`]): the only one
    /// lost in the checks.
    liar: Option<usize>,
    layout: Layout,
    /// [`Faults::Replace`]: the member replaced, and whether its rebuild is done.
    replaced: Option<(usize, bool)>,
    /// The reply to the request [`Run::side_call`] waits for.
    side_reply: Option<Result<(), lamina_core::EngineError>>,
    /// The engine's clock while a side call waits for its reply.
    side_clock: u64,
    /// Members of the cache tier (the last ones); 2 or 3 mirror each other.
    cache_copies: usize,
    engine: lamina_core::Engine,
    driver: Driver,
    vol: VolumeId,
    model: Oracle,
    outstanding: Outstanding,
    next_handle: u64,
    next_version: u64,
    blocks: u64,
    seed: u64,
}

impl Run {
    fn submit(&mut self, req: Request) -> u64 {
        self.next_handle += 1;
        let h = self.next_handle;
        self.engine.submit(Token { conn: 1, handle: h }, req);
        h
    }

    fn collect_replies(&mut self) {
        let mut replies = Vec::new();
        self.engine.drain_replies(&mut replies);
        for r in replies {
            let h = r.token.handle;
            if r.token.conn == SIDE {
                self.side_reply = Some(r.result);
            } else if let Some((first, mark)) = self.outstanding.writes.remove(&h) {
                r.result
                    .unwrap_or_else(|e| panic!("seed {}: write failed: {e}", self.seed));
                self.model.ack(first, &mark);
            } else if let Some(mark) = self.outstanding.flushes.remove(&h) {
                r.result
                    .unwrap_or_else(|e| panic!("seed {}: flush failed: {e}", self.seed));
                // The first flush acknowledged after a member failed: cut the power
                // right away, while the superblocks may still be on their way (they
                // must not be: the flush waits for them).
                self.cut_now |= self.failure_seen && !self.failure_flushed;
                self.failure_flushed |= self.failure_seen;
                self.model.flush_done(&mark);
            }
        }
    }

    /// Sends `req` beside the workload and runs the devices until it is answered
    /// (what the admin socket and the rebuild thread of a server do).
    fn side_call(&mut self, req: Request) -> Result<(), lamina_core::EngineError> {
        self.engine.submit(
            Token {
                conn: SIDE,
                handle: 0,
            },
            req,
        );
        for _ in 0..1_000_000 {
            if let Some(r) = self.side_reply.take() {
                return r;
            }
            let mut drv = std::mem::replace(&mut self.driver, Driver::new());
            drv.step(&mut self.engine, &mut self.rng, 4);
            let idle = drv.queue.is_empty();
            self.driver = drv;
            if idle {
                self.side_clock += 100;
                self.engine.tick(self.side_clock);
            }
            self.collect_replies();
        }
        panic!("seed {}: a side request got no reply", self.seed);
    }

    /// [`Faults::Replace`]: fails member `m`, puts a blank device in its place and
    /// starts its rebuild.
    fn replace(&mut self, m: usize) {
        self.side_call(Request::FailMember { index: m })
            .unwrap_or_else(|e| panic!("seed {}: fail member {m}: {e}", self.seed));
        let size = self.devs[m].size_bytes();
        let dev = Arc::new(CrashDevice::new(format!("crash{m}-new"), size));
        let fault = Arc::new(FaultDevice::new(dev.clone()));
        self.side_call(Request::ReplaceMember {
            index: m,
            device: lamina_core::NewDevice(fault.clone()),
            uuid: [0x5e; 16],
        })
        .unwrap_or_else(|e| panic!("seed {}: replace member {m}: {e}", self.seed));
        self.devs[m] = dev;
        self.faults[m] = fault;
        self.replaced = Some((m, false));
    }

    /// Rebuilds a few more stripes of the replaced member, as the rebuild thread
    /// does between the clients' requests.
    fn rebuild_some(&mut self) {
        let Some((m, false)) = self.replaced else {
            return;
        };
        let shared = self.engine.shared().clone();
        let opts = lamina_core::rebuild::RebuildOptions {
            record_every: std::time::Duration::ZERO,
            max_stripes: Some(self.rng.gen_range(1..=3)),
            ..Default::default()
        };
        let cell = std::cell::RefCell::new(&mut *self);
        let call = |r: Request| cell.borrow_mut().side_call(r);
        let report = lamina_core::rebuild::rebuild(&shared, m, &call, &opts, &mut |_, _| {});
        let seed = self.seed;
        let report = report.unwrap_or_else(|e| panic!("seed {seed}: rebuild of member {m}: {e}"));
        if report.finished {
            self.replaced = Some((m, true));
        }
    }

    fn random_op(&mut self) {
        let p: f64 = self.rng.gen();
        if p < 0.04 {
            let mark = self.model.flush_sent();
            let h = self.submit(Request::Flush);
            self.outstanding.flushes.insert(h, mark);
            return;
        }
        let count = if self.rng.gen_bool(0.8) {
            1
        } else {
            self.rng.gen_range(1..=16)
        };
        // Skewed toward a hot region so GC sees mixed segments.
        let first = if self.rng.gen_bool(0.6) {
            self.rng.gen_range(0..self.blocks / 8)
        } else {
            self.rng.gen_range(0..self.blocks)
        }
        .min(self.blocks - count);
        let zero = p < 0.10;
        let fua = self.rng.gen_bool(0.02);
        let base = self.next_version;
        self.next_version += count;
        let version = |lba: u64| if zero { 0 } else { base + 1 + (lba - first) };
        let mark = self.model.issue(first, count, version);
        let mut data = Vec::new();
        if !zero {
            for lba in first..first + count {
                data.extend_from_slice(&pattern(lba, version(lba)));
            }
        }
        let req = if zero {
            Request::Zero {
                volume: self.vol,
                offset: first * BS as u64,
                length: count * BS as u64,
                fua,
                // WRITE_ZEROES with NO_HOLE: written as zero blocks, not unmapped.
                allocate: self.rng.gen_bool(0.3),
            }
        } else {
            Request::Write {
                volume: self.vol,
                offset: first * BS as u64,
                data,
                fua,
            }
        };
        let h = self.submit(req);
        self.outstanding.writes.insert(h, (first, mark));
    }

    /// Images a power cut leaves: each member keeps its unsynced sectors with its
    /// own probability (one member may have synced everything, another nothing).
    fn power_cut(&mut self, devs: &[Arc<CrashDevice>]) -> (Vec<Arc<CrashDevice>>, String) {
        let shared_keep = [0.0, 0.5, 0.9, 1.0][self.rng.gen_range(0..4)];
        let mut keeps = Vec::new();
        let out = devs
            .iter()
            .enumerate()
            .map(|(i, d)| {
                let keep = if devs.len() == 1 {
                    shared_keep
                } else {
                    [0.0, 0.5, 1.0][self.rng.gen_range(0..3)]
                };
                keeps.push(keep);
                let mut image = d.power_cut(
                    &mut self.rng,
                    PowerCut {
                        keep_probability: keep,
                    },
                );
                if self.liar == Some(i) {
                    // The liar also decays at rest: bits flip in its data area.
                    let from = lamina_format::superblock::DEFAULT_DATA_OFFSET as usize;
                    for _ in 0..self.rng.gen_range(0..=24) {
                        let at = self.rng.gen_range(from..image.len());
                        image[at] ^= 1 << self.rng.gen_range(0..8);
                    }
                }
                Arc::new(CrashDevice::from_image(format!("crash{i}"), image))
            })
            .collect();
        (out, format!("keep {keeps:?}"))
    }

    /// Cuts the power, recovers from the surviving image and checks every block.
    fn crash_and_check(&mut self, round: usize) {
        if let Some(c) = self.engine.status().cache {
            self.compactions += c.compactions;
        }
        let devs = self.devs.clone();
        let (mut devs, mut keep) = self.power_cut(&devs);
        self.driver.queue.clear();
        // Sometimes the power fails again while recovery writes the checkpoint of
        // what it recovered: the next recovery must still find exactly the same.
        if self.rng.gen_bool(0.3) {
            let (mut half, _) = lamina_core::open_unfinished(
                dyn_devs(&wrap(&devs)),
                config(self.seed),
                lamina_core::OpenMode::ReadWrite,
            )
            .unwrap_or_else(|e| panic!("seed {} round {round}: recovery failed: {e}", self.seed));
            let mut drv = Driver::new();
            let n = self.rng.gen_range(0..40);
            drv.step(&mut half, &mut self.rng, n);
            let (d, k) = self.power_cut(&devs);
            devs = d;
            keep = format!("{keep}, then {k}");
        }
        // A rebuilt member is a whole member: a cut, then the loss of any one
        // member before recovery runs, loses nothing flushed.
        if matches!(self.replaced, Some((_, true))) {
            self.lose_before_recovery(&devs, round, &keep);
        }
        // A read-only open (status, fsck) of what the cut left recovers in memory
        // and writes nothing, torn rows and all.
        if devs.len() > 1 {
            let image = |rng: &mut rand::rngs::StdRng, d: &CrashDevice| {
                d.power_cut(
                    rng,
                    PowerCut {
                        keep_probability: 1.0,
                    },
                )
            };
            let before: Vec<Vec<u8>> = devs.iter().map(|d| image(&mut self.rng, d)).collect();
            let (ro, _) = lamina_core::open(
                dyn_devs(&devs),
                config(self.seed),
                lamina_core::OpenMode::ReadOnly,
            )
            .unwrap_or_else(|e| panic!("seed {} round {round}: read-only open: {e}", self.seed));
            drop(ro);
            for (i, d) in devs.iter().enumerate() {
                assert!(
                    image(&mut self.rng, d) == before[i],
                    "seed {} round {round}: a read-only open wrote to member {i}",
                    self.seed
                );
            }
        }
        let faults = wrap(&devs);
        if let Some(l) = self.liar {
            // ... and grows latent sector errors: reads of a few ranges fail.
            let from = lamina_format::superblock::DEFAULT_DATA_OFFSET;
            let size = devs[l].size_bytes();
            for _ in 0..self.rng.gen_range(0..=2) {
                let at = self.rng.gen_range(from..size - 16384) & !4095;
                faults[l].fail(FaultOp::Read, at, at + 16384, u64::MAX);
            }
        }
        let (engine, _report) = lamina_core::open(
            dyn_devs(&faults),
            config(self.seed),
            lamina_core::OpenMode::ReadWrite,
        )
        .unwrap_or_else(|e| panic!("seed {} round {round}: recovery failed: {e}", self.seed));
        self.engine = engine;
        self.devs = devs;
        self.faults = faults;
        let vol = self.engine.shared().volume("v").expect("volume survives");
        assert_eq!(vol.id, self.vol);
        let mut observed = Vec::new();
        let mut contents = Vec::new();
        for lba in 0..self.blocks {
            let b = read_block(&self.engine, self.vol, lba);
            let v = self
                .model
                .check(lba, &b)
                .unwrap_or_else(|e| panic!("seed {} round {round} ({keep}): {e}", self.seed));
            observed.push(v);
            contents.push(b);
        }
        if !self.degraded {
            self.lose_members_and_check(round, &keep, &contents);
        }
        if self.degraded {
            let failed = self.engine.shared().striped.clone().unwrap().failed_count();
            assert!(
                failed == 1 || !self.failure_flushed,
                "seed {} round {round} ({keep}): a flush was acknowledged after a member \
                 failed, but recovery does not know it failed",
                self.seed
            );
            // Without a flush after it, the failure may be forgotten (the member is
            // whole again: the devices come back healthy after a power cut); once on
            // record, it stays there in every later recovery.
            self.degraded = failed == 1;
            self.failure_flushed = self.degraded;
            self.failures_on_record += self.degraded as u64;
        }
        self.model.reset_to(&observed);
        self.outstanding = Outstanding::default();
    }

    /// The sets of members the layout must survive losing, as things stand: every
    /// copy of a mirrored cache but one, every member of SAID5, every pair of
    /// SAID6; only the liar when one lies ([`Faults::Silent`]), and only the member
    /// being rebuilt while its rebuild runs (it holds part of the stripes).
    fn losses(&self) -> Vec<Vec<usize>> {
        let n = self.devs.len();
        let first_copy = n - self.cache_copies;
        match self.layout {
            _ if self.liar.is_some() => vec![vec![self.liar.unwrap()]],
            _ if matches!(self.replaced, Some((_, false))) => vec![vec![self.replaced.unwrap().0]],
            // A mirrored cache: every copy but one lost in turn.
            Layout::Jbod if self.cache_copies > 1 => (first_copy..n)
                .map(|keep| (first_copy..n).filter(|&i| i != keep).collect())
                .collect(),
            Layout::Said5 => (0..n).map(|a| vec![a]).collect(),
            Layout::Said6 => (0..n)
                .flat_map(|a| (a + 1..n).map(move |b| vec![a, b]))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// What a power cut left (`devs`), opened read-only without each set of
    /// [`Run::losses`] in turn, before any recovery has written to it: every
    /// block holds what the oracle allows (flushed data survives the cut and the
    /// loss together).
    fn lose_before_recovery(&mut self, devs: &[Arc<CrashDevice>], round: usize, keep: &str) {
        for lost in self.losses() {
            let e = self.open_without(wrap(devs), &lost, round);
            for lba in 0..self.blocks {
                let b = read_block(&e, self.vol, lba);
                self.model.check(lba, &b).unwrap_or_else(|err| {
                    panic!(
                        "seed {} round {round} ({keep}): cut, then members {lost:?} lost \
                         before recovery: {err}",
                        self.seed
                    )
                });
            }
        }
    }

    /// Opens `members` read-only (recovery in memory, nothing written) with those
    /// of `lost` gone.
    fn open_without(
        &self,
        members: Vec<Arc<FaultDevice>>,
        lost: &[usize],
        round: usize,
    ) -> lamina_core::Engine {
        for &i in lost {
            members[i].vanish();
        }
        lamina_core::open(
            dyn_devs(&members),
            config(self.seed),
            lamina_core::OpenMode::ReadOnly,
        )
        .unwrap_or_else(|e| {
            panic!(
                "seed {} round {round}: open without {lost:?} failed: {e}",
                self.seed
            )
        })
        .0
    }

    /// After recovery, loses every member (every pair, for SAID6) in turn: every
    /// block must read back as it did with all members present.
    fn lose_members_and_check(&mut self, round: usize, keep: &str, contents: &[Vec<u8>]) {
        let losses = self.losses();
        if losses.is_empty() {
            return;
        }
        // The members as they are now (recovery's own writes included).
        let images: Vec<Vec<u8>> = self
            .devs
            .iter()
            .map(|d| {
                d.power_cut(
                    &mut self.rng,
                    PowerCut {
                        keep_probability: 1.0,
                    },
                )
            })
            .collect();
        for lost in losses {
            let members: Vec<Arc<FaultDevice>> = images
                .iter()
                .enumerate()
                .map(|(i, im)| {
                    Arc::new(FaultDevice::new(Arc::new(MemDevice::from_image(
                        format!("m{i}"),
                        im.clone(),
                    ))))
                })
                .collect();
            let e = self.open_without(members, &lost, round);
            let v = e.shared().volume_by_id(self.vol).unwrap();
            for lba in 0..self.blocks {
                let mut b = vec![0u8; BS];
                let r = e.shared().read(&v, lba * BS as u64, &mut b);
                assert!(
                    r.is_ok() && b == contents[lba as usize],
                    "seed {} round {round} ({keep}): block {lba} changed when members {lost:?} \
                     were lost ({:?}): the write hole",
                    self.seed,
                    r.err()
                );
            }
        }
    }
}

fn run_seed(seed: u64, ops: usize, crashes: usize) {
    run_layout(seed, ops, crashes, Layout::Jbod, 1, Faults::None);
}

/// Faults injected besides the power cuts.
#[derive(Clone, Copy, PartialEq)]
enum Faults {
    None,
    /// One member starts failing every write at a random moment of the first round.
    FailMember,
    /// One member (the same all run) silently drops or misdirects its writes for
    /// stretches of every round, reporting success (a drive that lies), has bits
    /// flipped in its data area at each power cut, and grows latent sector errors
    /// (reads of a few ranges fail). Only that member is then lost in the checks (a
    /// second fault is beyond the layout).
    Silent,
    /// One member (a copy of a mirrored cache) is failed and replaced by a blank
    /// device at a random moment of the first round, and rebuilt a few stripes at
    /// a time between the workload's operations, across power cuts. Once its
    /// rebuild is done, each power cut is also followed by the loss of every other
    /// member in turn before recovery runs.
    Replace,
}

/// Each member as the engine sees it: through a fault-injecting device.
fn wrap(devs: &[Arc<CrashDevice>]) -> Vec<Arc<FaultDevice>> {
    devs.iter()
        .map(|d| Arc::new(FaultDevice::new(d.clone())))
        .collect()
}

/// A seeded run of `crashes` power cuts on `members` simulated disks. With
/// [`Faults::FailMember`], one member starts failing every write at a random moment
/// of the first round: the engine fails it and must record that in the other
/// members' superblocks before it acknowledges any flush that depended on it, or
/// recovery would trust the stale member again. With [`Faults::Silent`], one member
/// lies about its writes: reads, GC and recovery must rebuild what it lost from
/// parity, and recovery must put it back before resyncing parity, or the resync
/// would make the parity match the damage.
fn run_layout(
    seed: u64,
    ops: usize,
    crashes: usize,
    layout: Layout,
    members: usize,
    injected: Faults,
) -> u64 {
    run_members(seed, ops, crashes, layout, members, injected, (0, 0)).0
}

/// [`run_layout`], with a cache tier of `cache.0` segments on `cache.1` more
/// members (2 or 3 mirror each other); returns the recoveries that found a failed
/// member on record, the cache segments compacted and whether a replaced member's
/// rebuild finished ([`Faults::Replace`]).
fn run_members(
    seed: u64,
    ops: usize,
    crashes: usize,
    layout: Layout,
    members: usize,
    injected: Faults,
    cache: (u64, usize),
) -> (u64, u64, u64) {
    let (cache_segments, cache_copies) = cache;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let segments = if members == 1 { 48 } else { 24 };
    let mut sizes = vec![device_bytes(segments); members];
    for _ in 0..cache_copies {
        sizes.push(device_bytes(cache_segments));
    }
    let devs: Vec<Arc<CrashDevice>> = sizes
        .iter()
        .enumerate()
        .map(|(i, &size)| Arc::new(CrashDevice::new(format!("crash{i}"), size)))
        .collect();
    let params = lamina_core::FormatParams {
        cache_devices: cache_copies,
        ..layout_params(layout)
    };
    format_devices(&dyn_devs(&devs), &params);
    let faults = wrap(&devs);
    let mut engine = open_rw(&dyn_devs(&faults), config(seed));
    let usable = engine.usable_bytes() / BS as u64;
    let blocks = usable * 7 / 10;
    let vol = create_volume(&mut engine, "v", blocks * BS as u64);
    let mut run = Run {
        rng: rand::rngs::StdRng::seed_from_u64(rng.gen()),
        devs,
        faults,
        degraded: false,
        failure_flushed: false,
        failures_on_record: 0,
        compactions: 0,
        cut_now: false,
        failure_seen: false,
        liar: None,
        layout,
        replaced: None,
        side_reply: None,
        side_clock: 1 << 40,
        cache_copies,
        engine,
        driver: Driver::new(),
        vol,
        model: Oracle::new(blocks),
        outstanding: Outstanding::default(),
        next_handle: 0,
        next_version: 0,
        blocks,
        seed,
    };
    // A flush must wait for the record of a member failure: make superblock writes
    // as late as a device may, so that a flush that did not wait would complete
    // first and the power cut after it find no record.
    run.driver.starve_superblocks = injected == Faults::FailMember;
    // With a mirrored cache, the liar is one of its copies.
    let liar = if cache_copies > 1 {
        members + run.rng.gen_range(0..cache_copies)
    } else {
        run.rng.gen_range(0..members)
    };
    run.liar = (injected == Faults::Silent).then_some(liar);
    for round in 0..crashes {
        let n = run.rng.gen_range(ops / 2..=ops);
        let fail_at =
            (injected == Faults::FailMember && round == 0).then(|| run.rng.gen_range(0..n));
        let replace_at =
            (injected == Faults::Replace && round == 0).then(|| run.rng.gen_range(0..n / 2));
        // Stretches of lies: (from op, to op, misdirect by this many bytes or drop).
        let lies: Vec<(usize, usize, Option<u64>)> = if injected == Faults::Silent {
            (0..run.rng.gen_range(1..=3))
                .map(|_| {
                    let a = run.rng.gen_range(0..n);
                    let b = (a + run.rng.gen_range(1..200)).min(n);
                    let how = run
                        .rng
                        .gen_bool(0.5)
                        .then(|| run.rng.gen_range(1..64u64) * BS as u64);
                    (a, b, how)
                })
                .collect()
        } else {
            Vec::new()
        };
        for i in 0..n {
            if fail_at == Some(i) {
                let m = run.rng.gen_range(0..members);
                run.faults[m].fail(FaultOp::Write, 0, u64::MAX, u64::MAX);
                run.degraded = true;
            }
            if replace_at == Some(i) {
                let m = if cache_copies > 1 {
                    members + run.rng.gen_range(0..cache_copies)
                } else {
                    run.rng.gen_range(0..members)
                };
                run.replace(m);
            }
            if i % 8 == 0 {
                run.rebuild_some();
            }
            for &(a, b, how) in &lies {
                if a == i {
                    match how {
                        Some(delta) => run.faults[liar].misdirect_writes(delta),
                        None => run.faults[liar].drop_writes(),
                    }
                }
                if b == i {
                    run.faults[liar].heal();
                }
            }
            // Keep outstanding work bounded like a client with a queue depth.
            if run.engine.pending_requests() < 32 {
                run.random_op();
            }
            let k = run.rng.gen_range(0..4);
            run.failure_seen = run
                .engine
                .shared()
                .striped
                .as_ref()
                .is_some_and(|st| st.failed_count() > 0);
            let mut drv = std::mem::replace(&mut run.driver, Driver::new());
            drv.step(&mut run.engine, &mut run.rng, k);
            run.driver = drv;
            if i % 64 == 0 {
                run.engine.tick(i as u64 * 10);
            }
            run.collect_replies();
            if std::mem::take(&mut run.cut_now) {
                break;
            }
        }
        run.crash_and_check(round);
    }
    let rebuilt = matches!(run.replaced, Some((_, true))) as u64;
    (run.failures_on_record, run.compactions, rebuilt)
}

/// The engine's configuration for `seed`: free segments are discarded as they are
/// released (odd seeds) or once they have stayed free for 50 ms of the run's clock
/// (even seeds: at about every tick), while the driver runs device operations in
/// any order, so a discard that allocation did not wait for would land on new data.
fn config(seed: u64) -> lamina_core::EngineConfig {
    lamina_core::EngineConfig {
        discard_delay_ms: if seed % 2 == 1 { 0 } else { 50 },
        ..small_config()
    }
}

/// Seeds to run: `LAMINA_CRASH_SEED` replays one, `LAMINA_CRASH_SEEDS` sets how many.
fn seeds(default: u64) -> std::ops::Range<u64> {
    if let Ok(seed) = std::env::var("LAMINA_CRASH_SEED") {
        let s: u64 = seed.parse().unwrap();
        return s..s + 1;
    }
    let n = std::env::var("LAMINA_CRASH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default);
    0..n
}

#[test]
fn power_cuts_never_lose_flushed_writes() {
    for seed in seeds(24) {
        run_seed(seed, 3000, 4);
    }
}

/// A cache tier (issue 14): every user write lands on the cache member and
/// compaction moves what is live to the capacity member, many times over in each
/// round. At each power cut the two members keep or drop their unsynced writes
/// each on its own (the cache synced and the capacity tier not, and the other way
/// round), during compaction too: every block acknowledged before the last
/// completed flush reads back.
#[test]
fn cache_tier_power_cuts_never_lose_flushed_writes() {
    let mut compactions = 0;
    for seed in seeds(16) {
        compactions += run_members(seed, 3000, 4, Layout::Jbod, 1, Faults::None, (20, 1)).1;
    }
    assert!(compactions > 0, "compaction ran");
}

/// A mirrored cache tier: two copies (three every fourth seed), each keeping or
/// dropping its unsynced writes on its own at a power cut, as the capacity member
/// does. After each recovery every copy but one is lost in turn: every block reads
/// back as it did with all of them, so recovery made the copies agree where the
/// cut left them apart (the mirror's write hole) before anything could depend on
/// one of them alone.
#[test]
fn mirrored_cache_power_cuts_then_a_copy_loss_keep_every_block() {
    let mut compactions = 0;
    for seed in seeds(16) {
        let copies = if seed % 4 == 3 { 3 } else { 2 };
        compactions += run_members(seed, 2500, 3, Layout::Jbod, 1, Faults::None, (20, copies)).1;
    }
    assert!(compactions > 0, "compaction ran");
}

/// A copy of a mirrored cache that lies about its writes (drops or misdirects
/// them, reporting success), has bits flipped at rest and grows latent sector
/// errors, with power cuts on top: every block reads back after recovery, and
/// still does when that copy is then lost, so recovery never copied what the liar
/// holds over the good copy.
#[test]
fn a_lying_cache_copy_and_power_cuts_keep_every_block() {
    for seed in seeds(12) {
        run_members(seed, 2000, 3, Layout::Jbod, 1, Faults::Silent, (20, 2));
    }
}

/// The RAID write hole: SAID5 over four members, each keeping or dropping its
/// unsynced writes on its own at a power cut; then each member is lost in turn.
#[test]
fn said5_power_cuts_then_a_member_loss_keep_every_block() {
    for seed in seeds(16) {
        run_layout(seed, 2000, 3, Layout::Said5, 4, Faults::None);
    }
}

/// As above for SAID6 over five members, losing every pair in turn.
#[test]
fn said6_power_cuts_then_two_member_losses_keep_every_block() {
    for seed in seeds(8) {
        run_layout(seed, 2000, 3, Layout::Said6, 5, Faults::None);
    }
}

/// A flush waits for the member-failure record: SAID5 and SAID6, one member starts
/// failing its writes mid-run, power cuts follow (each member keeping or dropping
/// its own unsynced writes); every block acknowledged before the last completed
/// flush reads back, and a flush acknowledged after the engine failed the member
/// means recovery knows it failed. Superblock writes are run as late as a device
/// may, and the power is cut right after that flush: without the gate this fails.
#[test]
fn flushes_after_a_member_failure_survive_power_cuts() {
    let mut on_record = 0;
    for seed in seeds(16) {
        on_record += run_layout(seed, 2000, 3, Layout::Said5, 4, Faults::FailMember);
        on_record += run_layout(seed, 1500, 2, Layout::Said6, 5, Faults::FailMember);
    }
    assert!(
        on_record > 0,
        "some recovery found a member failure on record"
    );
}

/// A member that lies about its writes (drops them, or stores them elsewhere, and
/// reports success) for stretches of each round, has bits flipped at rest and grows
/// latent sector errors, with power cuts on top: every
/// block acknowledged before the last completed flush reads back after recovery,
/// and still does when that member is then lost, so recovery never resynced parity
/// to match what the liar holds.
#[test]
fn a_lying_member_and_power_cuts_keep_every_block() {
    for seed in seeds(12) {
        run_layout(seed, 2000, 3, Layout::Said5, 4, Faults::Silent);
        run_layout(seed, 1500, 2, Layout::Said6, 5, Faults::Silent);
    }
}

/// A member replaced and rebuilt online (a few stripes at a time between the
/// workload's requests, across power cuts; its progress recorded as it goes), on
/// SAID5, SAID6 and a mirrored cache. While it rebuilds, losing it loses nothing;
/// once it is done, a power cut followed by the loss of any other member (any
/// pair on SAID6, the other copy of the cache) before recovery loses nothing
/// flushed, and neither does the loss after recovery.
#[test]
fn a_member_rebuilt_online_is_whole_across_power_cuts() {
    let runs = [
        (Layout::Said5, 4, (0, 0)),
        (Layout::Said6, 5, (0, 0)),
        (Layout::Jbod, 1, (40, 2)),
    ];
    let mut rebuilt = [0u64; 3];
    for seed in seeds(8) {
        for (i, &(layout, members, cache)) in runs.iter().enumerate() {
            rebuilt[i] += run_members(seed, 1500, 3, layout, members, Faults::Replace, cache).2;
        }
    }
    // Each layout had rebuilds done before a cut: the checks after them ran.
    assert!(
        rebuilt.iter().all(|&n| n > 0),
        "rebuilds finished: {rebuilt:?}"
    );
}
