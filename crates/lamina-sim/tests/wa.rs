//! Write amplification of the real engine (through `lamina_sim`) against the
//! analytic model and the skew targets, at sizes that run in seconds: a 2 GiB
//! volume, 2 MiB segments, 128 KiB write units (1000 segments, where the model's
//! "large segments" assumption still holds to well under 1%). docs/benchmarks.md has
//! the full-size runs and the commands.

use lamina_sim::workload::Pattern;
use lamina_sim::{model_wa, run_synthetic, SimConfig, SimReport};

const BLOCKS: u64 = 2 << 30 >> 12;

fn run(pattern: &str, op: f64, classifier: &str, policy: &str) -> SimReport {
    let cfg = SimConfig {
        segment_blocks: 512,
        write_unit_blocks: 32,
        overprovision: op,
        classifier: classifier.into(),
        policy: policy.into(),
        ..Default::default()
    };
    let p = Pattern::parse(pattern).unwrap();
    run_synthetic(pattern, &p, BLOCKS, 4 * BLOCKS, 1, &cfg, &mut |_| {}).unwrap()
}

/// Greedy under uniform random overwrites lands within 2% of the model at every
/// over-provisioning of the table (7.82, 5.68, 3.19, 2.48, 1.72).
#[test]
fn uniform_greedy_matches_the_model() {
    let table = [
        (0.07, 7.82),
        (0.10, 5.68),
        (0.20, 3.19),
        (0.28, 2.48),
        (0.50, 1.72),
    ];
    for (op, published) in table {
        let model = model_wa(op);
        assert!((model - published).abs() < 0.01, "model {model} at {op}");
        let wa = run("uniform", op, "none", "greedy").write_amplification();
        let err = wa / model - 1.0;
        println!(
            "op {op}: WA {wa:.3}, model {model:.3} ({:+.2}%)",
            err * 100.0
        );
        assert!(err.abs() < 0.02, "op {op}: WA {wa:.3} vs model {model:.3}");
    }
}

/// SepBIT's trigger (GC while the garbage proportion exceeds 0.15, with space to
/// spare) holds the array at alpha = 1/(1 - 0.15) of the live data, where the model
/// gives 3.52 for greedy on uniform traffic: the steady state lands within 2%.
#[test]
fn uniform_under_the_garbage_trigger_matches_the_model() {
    let ratio = 0.15;
    let cfg = SimConfig {
        segment_blocks: 512,
        write_unit_blocks: 32,
        overprovision: 1.0,
        gc_garbage_ratio: Some(ratio),
        classifier: "none".into(),
        policy: "greedy".into(),
        ..Default::default()
    };
    let p = Pattern::parse("uniform").unwrap();
    let wa = run_synthetic("uniform", &p, BLOCKS, 4 * BLOCKS, 1, &cfg, &mut |_| {})
        .unwrap()
        .write_amplification();
    let model = model_wa(1.0 / (1.0 - ratio) - 1.0);
    assert!((model - 3.52).abs() < 0.01, "model {model}");
    println!("WA {wa:.3}, model {model:.3}");
    assert!(
        (wa / model - 1.0).abs() < 0.02,
        "WA {wa:.3} vs model {model:.3}"
    );
}

/// Uniform overwrites of a volume of `blocks` blocks on 8 MiB segments, on the array
/// greedy without separation gets at `op` spare (`footprint_classes: Some(1)`).
fn footprint_matched_uniform(blocks: u64, op: f64, classifier: &str, policy: &str) -> SimReport {
    footprint_matched("uniform", blocks, op, classifier, policy)
}

/// [`footprint_matched_uniform`] with another workload.
fn footprint_matched(
    pattern: &str,
    blocks: u64,
    op: f64,
    classifier: &str,
    policy: &str,
) -> SimReport {
    let cfg = SimConfig {
        segment_blocks: 2048,
        write_unit_blocks: 128,
        overprovision: op,
        classifier: classifier.into(),
        policy: policy.into(),
        footprint_classes: Some(1),
        ..Default::default()
    };
    let p = Pattern::parse(pattern).unwrap();
    run_synthetic(pattern, &p, blocks, 4 * blocks, 1, &cfg, &mut |_| {})
        .unwrap_or_else(|e| panic!("{classifier}/{policy}: {e}"))
}

/// Footprint-matched on a small array (every placement gets the array greedy gets:
/// 45 segments of 8 MiB for a 256 MiB volume at 17.6% spare), every classifier
/// completes and none writes much more than greedy: the classes kept open follow
/// the spare. (With every class open, SepBIT wrote 164 times what greedy wrote
/// here, and the Lamina classifier and the oracle ran out of space.)
#[test]
fn placements_fit_their_open_segments_into_a_small_spare() {
    let run = |classifier: &str, policy: &str| {
        footprint_matched_uniform(256 << 20 >> 12, 0.176, classifier, policy)
    };
    let greedy = run("none", "greedy");
    for (classifier, policy) in [
        ("sepbit", "cost-benefit-sqrt"),
        ("frequency", "greedy"),
        ("lamina", "lamina"),
        ("oracle", "greedy"),
    ] {
        let r = run(classifier, policy);
        assert_eq!(r.segments, greedy.segments, "same footprint");
        let ratio = r.write_amplification() / greedy.write_amplification();
        println!(
            "{classifier}/{policy}: {:.3} ({ratio:.3} x greedy)",
            r.write_amplification()
        );
        assert!(ratio < 1.3, "{classifier}/{policy}: {ratio:.3} x greedy");
    }
}

/// The default placement (SepBIT's classes with the `auto` victim policy, which
/// `lamina sim` and `lamina serve` use without options) costs nothing where it has nothing to learn: on uniform
/// traffic, footprint-matched, it writes within 0.5% of what greedy without
/// separation writes, at 7% and 17.6% spare (with its classes always open it wrote
/// 18% more at 7%, 2 GiB).
#[test]
fn the_default_ties_greedy_on_uniform() {
    let default = SimConfig::default();
    assert_eq!(
        (default.classifier.as_str(), default.policy.as_str()),
        ("auto", "auto"),
        "this test is about the default"
    );
    for op in [0.07, 0.176] {
        let run = |classifier: &str, policy: &str| {
            footprint_matched_uniform(1 << 30 >> 12, op, classifier, policy).write_amplification()
        };
        let greedy = run("none", "greedy");
        let placed = run(&default.classifier, &default.policy);
        println!("spare {op}: greedy {greedy:.3}, default {placed:.3}");
        assert!(
            placed / greedy < 1.005,
            "spare {op}: default {placed:.3} vs greedy {greedy:.3}"
        );
    }
}

/// Where the spare holds one class only (7%, 1 GiB, footprint-matched), SepBIT's
/// win on hot/cold traffic comes from cost-benefit victims, not from its classes:
/// the default's miniatures (`shadow.rs`) see it and follow cost-benefit, where
/// greedy writes half as much again.
#[test]
fn the_default_follows_cost_benefit_on_hot_cold_traffic() {
    let run = |classifier: &str, policy: &str| {
        footprint_matched("hotcold:90/10", 1 << 30 >> 12, 0.07, classifier, policy)
            .write_amplification()
    };
    let greedy = run("none", "greedy");
    let sepbit = run("sepbit", "cost-benefit-sqrt");
    let default = SimConfig::default();
    let placed = run(&default.classifier, &default.policy);
    println!("greedy {greedy:.3}, SepBIT {sepbit:.3}, default {placed:.3}");
    assert!(sepbit < greedy * 0.8, "the case this test is about");
    assert!(
        placed < sepbit * 1.01,
        "default {placed:.3} vs SepBIT {sepbit:.3}"
    );
}

/// In one stream (`classifier = none`), the `auto` policy's miniature (`shadow.rs`)
/// is what decides: it follows cost-benefit on hot/cold traffic, where greedy
/// writes half as much again, and stays with greedy on uniform traffic.
#[test]
fn auto_victims_follow_the_better_policy_in_one_stream() {
    let run = |pattern: &str, policy: &str| {
        footprint_matched(pattern, 1 << 30 >> 12, 0.07, "none", policy).write_amplification()
    };
    let (greedy, cb, auto) = (
        run("hotcold:90/10", "greedy"),
        run("hotcold:90/10", "cost-benefit-sqrt"),
        run("hotcold:90/10", "auto"),
    );
    println!("hot/cold: greedy {greedy:.3}, cost-benefit {cb:.3}, auto {auto:.3}");
    assert!(cb < greedy * 0.8, "the case this test is about");
    assert!(auto < cb * 1.02, "auto {auto:.3} vs cost-benefit {cb:.3}");
    let (greedy, auto) = (run("uniform", "greedy"), run("uniform", "auto"));
    println!("uniform: greedy {greedy:.3}, auto {auto:.3}");
    assert!(
        auto < greedy * 1.005,
        "auto {auto:.3} vs greedy {greedy:.3}"
    );
}

/// On uniform traffic nothing beats greedy (the model is a lower bound for online
/// policies there): a policy or classifier that does is counting wrong.
#[test]
fn no_policy_beats_greedy_on_uniform() {
    let greedy = run("uniform", 0.28, "none", "greedy").write_amplification();
    for policy in lamina_core::gc::POLICY_NAMES {
        for classifier in ["none", "lamina"] {
            let wa = run("uniform", 0.28, classifier, policy).write_amplification();
            println!("{policy}/{classifier}: {wa:.3} (greedy {greedy:.3})");
            // Noise of one seed is about 0.2%.
            assert!(
                wa >= greedy * 0.995,
                "{policy}/{classifier} {wa:.3} beats greedy {greedy:.3} on uniform"
            );
        }
    }
}

/// Skew at 28% over-provisioning: Lamina's classifier and policy reach the issue's
/// targets (within 10% of the optimal-split bounds 1.87 and 1.41), and beat the
/// single-stream greedy baseline by far.
#[test]
fn skewed_workloads_meet_the_targets() {
    for (pattern, target) in [("hotcold:80/20", 2.06), ("hotcold:90/10", 1.55)] {
        let ours = run(pattern, 0.28, "lamina", "lamina").write_amplification();
        let base = run(pattern, 0.28, "none", "greedy").write_amplification();
        println!("{pattern}: lamina {ours:.3}, greedy without classes {base:.3}");
        assert!(
            ours <= target,
            "{pattern}: WA {ours:.3} above the target {target}"
        );
        assert!(
            ours < base * 0.9,
            "{pattern}: {ours:.3} vs baseline {base:.3}"
        );
    }
}

/// The simulator is fast: at least a million block writes per second (the issue's
/// bar on one core). Loose in debug builds, where it means little.
#[test]
fn simulates_a_million_blocks_per_second() {
    let r = run("uniform", 0.28, "lamina", "lamina");
    let rate = r.blocks_per_second();
    println!("{:.2} M blocks/s", rate / 1e6);
    if cfg!(debug_assertions) {
        return;
    }
    assert!(rate > 1e6, "{rate:.0} blocks/s");
}

/// The JSON report carries the stable keys.
#[test]
fn json_report_has_the_stable_keys() {
    let j = run("hotcold:90/10", 0.28, "sepbit", "cost-benefit").to_json();
    for key in [
        "write_amplification",
        "user_blocks_written",
        "media_blocks_written",
    ] {
        assert!(
            j[key].as_f64().is_some() || j[key].as_u64().is_some(),
            "{key} in {j}"
        );
    }
    let v = &j["volumes"][0];
    assert!(v["write_amplification"].as_f64().unwrap() > 1.0, "{v}");
    let classes = v["classes"].as_array().expect("classes");
    assert_eq!(classes.len(), 6, "SepBIT has 6 classes: {j}");
    assert!(j["series"].as_array().unwrap().len() > 10);
}

/// Many volumes smaller than a segment (as in the TPC-C and Tencent samples):
/// volumes never share a segment, so the simulated array gives each its own whole
/// segments and open streams, and every placement runs instead of stopping for
/// space.
#[test]
fn volumes_smaller_than_a_segment_fit() {
    use lamina_sim::workload::{Op, Workload};
    use lamina_sim::{simulate, VolumeSpec};
    use rand::{Rng, SeedableRng};
    struct Small {
        rng: rand::rngs::StdRng,
        left: u64,
    }
    impl Workload for Small {
        fn next_op(&mut self) -> Option<Op> {
            self.left = self.left.checked_sub(1)?;
            Some(Op {
                volume: self.rng.gen_range(0..16),
                lba: self.rng.gen_range(0..400),
                blocks: 1,
                trim: false,
            })
        }
    }
    let volumes: Vec<VolumeSpec> = (0..16)
        .map(|i| VolumeSpec {
            name: format!("v{i}"),
            blocks: 400,
            working_set: 400,
        })
        .collect();
    for (classifier, policy) in [
        ("none", "greedy"),
        ("sepbit", "cost-benefit-sqrt"),
        ("auto", "cost-benefit-sqrt"),
        ("auto", "auto"),
        ("lamina", "lamina"),
    ] {
        let cfg = SimConfig {
            segment_blocks: 512,
            write_unit_blocks: 32,
            overprovision: 0.07,
            classifier: classifier.into(),
            policy: policy.into(),
            footprint_classes: Some(1),
            ..Default::default()
        };
        let mut w = Small {
            rng: rand::rngs::StdRng::seed_from_u64(3),
            left: 16 * 400 * 20,
        };
        let r = simulate(&mut w, &volumes, &cfg, None, "small", &mut |_| {})
            .unwrap_or_else(|e| panic!("{classifier}/{policy}: {e}"));
        assert!(r.write_amplification() >= 1.0);
        assert!(r.end.gc_blocks > 0, "{classifier}/{policy}: GC ran");
    }
}
