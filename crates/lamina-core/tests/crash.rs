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
//! Failures print the seed; `LAMINA_CRASH_SEED=<seed>` replays one case.

mod common;
use common::*;
use lamina_core::{Request, Token, VolumeId};
use lamina_device::crash::{CrashDevice, PowerCut};
use lamina_device::BlockDevice;
use lamina_testkit::{FlushMark, Oracle, WriteMark};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// Outstanding requests of the workload, by handle.
#[derive(Default)]
struct Outstanding {
    writes: HashMap<u64, (u64, WriteMark)>,
    flushes: HashMap<u64, FlushMark>,
}

struct Run {
    rng: rand::rngs::StdRng,
    dev: Arc<CrashDevice>,
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
            if let Some((first, mark)) = self.outstanding.writes.remove(&h) {
                r.result
                    .unwrap_or_else(|e| panic!("seed {}: write failed: {e}", self.seed));
                self.model.ack(first, &mark);
            } else if let Some(mark) = self.outstanding.flushes.remove(&h) {
                r.result
                    .unwrap_or_else(|e| panic!("seed {}: flush failed: {e}", self.seed));
                self.model.flush_done(&mark);
            }
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

    /// Cuts the power, recovers from the surviving image and checks every block.
    fn crash_and_check(&mut self, round: usize) {
        let keep = [0.0, 0.5, 0.9, 1.0][self.rng.gen_range(0..4)];
        let image = self.dev.power_cut(
            &mut self.rng,
            PowerCut {
                keep_probability: keep,
            },
        );
        self.driver.queue.clear();
        let mut dev = Arc::new(CrashDevice::from_image("crash0", image));
        // Sometimes the power fails again while recovery writes the checkpoint of
        // what it recovered: the next recovery must still find exactly the same.
        if self.rng.gen_bool(0.3) {
            let devs: Vec<Arc<dyn BlockDevice>> = vec![dev.clone()];
            let (mut half, _) = lamina_core::open_unfinished(
                devs,
                small_config(),
                lamina_core::OpenMode::ReadWrite,
            )
            .unwrap_or_else(|e| panic!("seed {} round {round}: recovery failed: {e}", self.seed));
            let mut drv = Driver::new();
            let n = self.rng.gen_range(0..40);
            drv.step(&mut half, &mut self.rng, n);
            let keep2 = [0.0, 0.5, 1.0][self.rng.gen_range(0..3)];
            let image = dev.power_cut(
                &mut self.rng,
                PowerCut {
                    keep_probability: keep2,
                },
            );
            dev = Arc::new(CrashDevice::from_image("crash0", image));
        }
        let devs: Vec<Arc<dyn BlockDevice>> = vec![dev.clone()];
        let (engine, _report) =
            lamina_core::open(devs, small_config(), lamina_core::OpenMode::ReadWrite)
                .unwrap_or_else(|e| {
                    panic!("seed {} round {round}: recovery failed: {e}", self.seed)
                });
        self.engine = engine;
        self.dev = dev;
        let vol = self.engine.shared().volume("v").expect("volume survives");
        assert_eq!(vol.id, self.vol);
        let mut observed = Vec::new();
        for lba in 0..self.blocks {
            let b = read_block(&self.engine, self.vol, lba);
            let v = self
                .model
                .check(lba, &b)
                .unwrap_or_else(|e| panic!("seed {} round {round} (keep {keep}): {e}", self.seed));
            observed.push(v);
        }
        self.model.reset_to(&observed);
        self.outstanding = Outstanding::default();
    }
}

fn run_seed(seed: u64, ops: usize, crashes: usize) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let dev = Arc::new(CrashDevice::new("crash0", device_bytes(48)));
    let devs: Vec<Arc<dyn BlockDevice>> = vec![dev.clone()];
    format_devices(&devs, &small_params());
    let mut engine = open_rw(&devs, small_config());
    let usable = engine.usable_bytes() / BS as u64;
    let blocks = usable * 7 / 10;
    let vol = create_volume(&mut engine, "v", blocks * BS as u64);
    let mut run = Run {
        rng: rand::rngs::StdRng::seed_from_u64(rng.gen()),
        dev,
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
    for round in 0..crashes {
        let n = run.rng.gen_range(ops / 2..=ops);
        for i in 0..n {
            // Keep outstanding work bounded like a client with a queue depth.
            if run.engine.pending_requests() < 32 {
                run.random_op();
            }
            let k = run.rng.gen_range(0..4);
            let mut drv = std::mem::replace(&mut run.driver, Driver::new());
            drv.step(&mut run.engine, &mut run.rng, k);
            run.driver = drv;
            if i % 64 == 0 {
                run.engine.tick(i as u64 * 10);
            }
            run.collect_replies();
        }
        run.crash_and_check(round);
    }
}

#[test]
fn power_cuts_never_lose_flushed_writes() {
    if let Ok(seed) = std::env::var("LAMINA_CRASH_SEED") {
        run_seed(seed.parse().unwrap(), 3000, 4);
        return;
    }
    let seeds: u64 = std::env::var("LAMINA_CRASH_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    for seed in 0..seeds {
        run_seed(seed, 3000, 4);
    }
}
