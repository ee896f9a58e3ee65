//! Geometry-aware placement (SALSA 3.1): data that is read often and rewritten
//! rarely ends up, through GC, in the segments at the lowest device offsets (the
//! outer, faster tracks of a disk); without it, it stays spread over the device.

mod common;

use common::*;
use lamina_core::map::{decode, Entry};
use lamina_core::{EngineConfig, Lba, VolumeId};
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

/// Mean physical block of the hot and of the cold blocks after a run where every
/// tenth block of the volume is read over and over and the others are rewritten
/// (so hot blocks share segments with cold ones, and GC moves them).
fn run(geometry_aware: bool) -> (f64, f64) {
    let devs: Vec<Arc<dyn BlockDevice>> = vec![Arc::new(MemDevice::new("d", device_bytes(96)))];
    format_devices(&devs, &small_params());
    let cfg = EngineConfig {
        geometry_aware: Some(geometry_aware),
        ..small_config()
    };
    let mut e = open_rw(&devs, cfg);
    let blocks = (e.status().usable_bytes / BS as u64) * 8 / 10;
    let vol = create_volume(&mut e, "v", blocks * BS as u64);
    let is_hot = |lba: u64| lba.is_multiple_of(10);
    let mut model = HashMap::new();
    overwrite(&mut e, vol, &mut model, blocks, 1000, |i| i);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for _ in 0..30 {
        for lba in (0..blocks).filter(|&l| is_hot(l)) {
            read_block(&e, vol, lba);
        }
        overwrite(&mut e, vol, &mut model, blocks / 8, 1000, |_| loop {
            let l = rng.gen_range(0..blocks);
            if !is_hot(l) {
                break l;
            }
        });
    }
    assert!(e.counters().gc_blocks > blocks, "GC moved data");
    verify_model(&e, vol, &model);
    let mean = |hot: bool, e: &lamina_core::Engine, vol: VolumeId| {
        let v = e.shared().volume_by_id(vol).unwrap();
        let (mut sum, mut n) = (0f64, 0f64);
        for lba in (0..blocks).filter(|&l| is_hot(l) == hot) {
            if let Entry::Device(p) = decode(v.map.load(Lba(lba))) {
                sum += p.0 as f64;
                n += 1.0;
            }
        }
        sum / n.max(1.0)
    };
    (mean(true, &e, vol), mean(false, &e, vol))
}

#[test]
fn read_hot_data_moves_to_the_outer_segments() {
    let (hot_on, cold_on) = run(true);
    let (hot_off, cold_off) = run(false);
    eprintln!("geometry-aware: hot {hot_on:.0} cold {cold_on:.0}; off: hot {hot_off:.0} cold {cold_off:.0}");
    assert!(
        hot_on < 0.6 * cold_on,
        "hot data is not outer: {hot_on} vs {cold_on}"
    );
    assert!(
        hot_on < 0.7 * hot_off,
        "no better than without: {hot_on} vs {hot_off}"
    );
}
