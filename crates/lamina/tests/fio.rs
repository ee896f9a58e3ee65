//! fio through its nbd engine, with checksummed verification.

mod common;
use common::*;

fn fio_json(args: &[&str]) -> serde_json::Value {
    let out = run("fio", args);
    let json = &out[out.find('{').expect("fio printed JSON")..];
    serde_json::from_str(json).expect("fio JSON")
}

/// A 256 MiB array of 1 MiB segments with a volume `v` of 80% of its usable space
/// (so overwrites make GC work); returns DIR and the volume's size.
fn array_at_80_percent(t: &TempDir) -> (std::path::PathBuf, u64) {
    let dir = t.join("arr");
    let usable = create_array(
        &dir,
        "256M",
        &["--segment-size", "1M", "--write-unit", "256K"],
    );
    let vol = usable * 8 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());
    (dir, vol)
}

/// 4 KiB random writes at iodepth 32 over a volume at 80% of usable capacity,
/// four full passes (4x the volume) each verified with crc32c: GC must run and no
/// block may come back wrong.
#[test]
fn random_writes_with_gc_verify_clean() {
    if !need("fio::random_writes_with_gc_verify_clean", &["fio"], false) {
        return;
    }
    let t = TempDir::new("fio-gc");
    let (dir, vol) = array_at_80_percent(&t);
    let s = Server::start(&dir);
    let j = fio_json(&[
        "--name=gc",
        "--ioengine=nbd",
        &format!("--uri={}", s.uri("v")),
        "--bs=4k",
        "--iodepth=32",
        "--rw=randwrite",
        &format!("--size={vol}"),
        "--loops=4",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--output-format=json",
    ]);
    let job = &j["jobs"][0];
    assert_eq!(job["error"], 0, "fio reported an error: {job}");
    let written = job["write"]["io_bytes"].as_u64().unwrap();
    let verified = job["read"]["io_bytes"].as_u64().unwrap();
    assert!(
        written >= 4 * vol,
        "wrote {written} bytes, want at least 4 x {vol}"
    );
    assert_eq!(
        verified, written,
        "every written block was read back and verified"
    );
    let st = status_json(&dir);
    eprintln!(
        "fio gc: user {} media {} gc {} WA {}",
        st["user_bytes_written"],
        st["media_bytes_written"],
        st["gc_bytes_relocated"],
        st["write_amplification"]
    );
    assert!(
        st["gc_bytes_relocated"].as_u64().unwrap() > 0,
        "GC relocated nothing: {st}"
    );
    let wa = st["write_amplification"].as_f64().unwrap();
    assert!(wa > 1.0 && wa < 10.0, "write amplification {wa}");
    assert!(st["user_bytes_written"].as_u64().unwrap() >= 4 * vol);
    assert_eq!(st["volumes"][0]["name"], "v");
    assert!(st["volumes"][0]["write_amplification"].as_f64().is_some());
    s.stop();
}

/// Several connections at once (multi-conn), each verifying its own region.
#[test]
fn several_connections_verify_clean() {
    if !need("fio::several_connections_verify_clean", &["fio"], false) {
        return;
    }
    let t = TempDir::new("fio-mc");
    let dir = t.join("arr");
    create_array(
        &dir,
        "256M",
        &["--segment-size", "1M", "--write-unit", "256K"],
    );
    create_volume(&dir, "v", "128M");
    let s = Server::start(&dir);
    let j = fio_json(&[
        "--name=mc",
        "--ioengine=nbd",
        &format!("--uri={}", s.uri("v")),
        "--bs=4k",
        "--iodepth=16",
        "--rw=randrw",
        "--rwmixread=50",
        "--numjobs=4",
        "--size=32M",
        "--offset_increment=32M",
        "--fsync=64",
        "--verify=crc32c",
        "--verify_fatal=1",
        "--output-format=json",
    ]);
    for job in j["jobs"].as_array().unwrap() {
        assert_eq!(job["error"], 0, "fio job failed: {job}");
    }
    assert!(
        status_json(&dir)["flushes"].as_u64().unwrap() > 0,
        "fsync=64 must send flushes"
    );
    s.stop();
}

/// Writes `passes` times a volume's size with fio at the given distribution on a
/// fresh array whose `lamina.toml` picks Lamina's classifier and policy for the
/// volume; returns the volume's status.
fn placement_run(name: &str, distribution: &str, passes: u64) -> serde_json::Value {
    let t = TempDir::new(name);
    let (dir, vol) = array_at_80_percent(&t);
    // Per-volume placement in the configuration file.
    let cfg = dir.join("lamina.toml");
    let mut text = std::fs::read_to_string(&cfg).unwrap();
    text.push_str("\n[engine.volumes.v]\nclassifier = \"lamina\"\ngc_policy = \"lamina\"\n");
    std::fs::write(&cfg, text).unwrap();
    let s = Server::start(&dir);
    let uri = s.uri("v");
    // Fill once sequentially, then overwrite at the distribution.
    for args in [
        vec!["--rw=write".to_string(), format!("--size={vol}")],
        vec![
            "--rw=randwrite".to_string(),
            format!("--random_distribution={distribution}"),
            format!("--size={vol}"),
            format!("--io_size={}", passes * vol),
            "--norandommap".to_string(),
        ],
    ] {
        let mut a = vec![
            "--name=placement".to_string(),
            "--ioengine=nbd".to_string(),
            format!("--uri={uri}"),
            "--bs=4k".to_string(),
            "--iodepth=32".to_string(),
            "--output-format=json".to_string(),
        ];
        a.extend(args);
        let a: Vec<&str> = a.iter().map(|s| s.as_str()).collect();
        let j = fio_json(&a);
        assert_eq!(j["jobs"][0]["error"], 0, "fio failed: {j}");
    }
    let st = status_json(&dir);
    s.stop();
    st["volumes"][0].clone()
}

/// The engine as served, end to end: with the same over-provisioning, a skewed
/// (Zipf 1.2) overwrite load costs less write amplification than a uniform one, and
/// the volume runs the classifier and policy its configuration names, with its
/// blocks spread over several heat classes.
#[test]
fn zipf_costs_less_write_amplification_than_uniform() {
    if !need(
        "fio::zipf_costs_less_write_amplification_than_uniform",
        &["fio"],
        false,
    ) {
        return;
    }
    let uniform = placement_run("fio-uniform", "random", 3);
    let zipf = placement_run("fio-zipf", "zipf:1.2", 3);
    let wa = |v: &serde_json::Value| {
        let u = v["user_bytes_written"].as_f64().unwrap();
        (u + v["gc_bytes_relocated"].as_f64().unwrap()) / u
    };
    let (wu, wz) = (wa(&uniform), wa(&zipf));
    eprintln!("WA uniform {wu:.3}, zipf:1.2 {wz:.3}");
    assert!(wu > 1.2, "uniform overwrites must make GC work: {uniform}");
    assert!(wz < wu * 0.9, "zipf WA {wz:.3} not below uniform {wu:.3}");
    for v in [&uniform, &zipf] {
        assert_eq!(v["classifier"], "lamina", "{v}");
        assert_eq!(v["gc_policy"], "lamina", "{v}");
        let used = v["classes"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|c| c["bytes_written"].as_u64().unwrap() > 0)
            .count();
        assert!(used >= 3, "blocks spread over {used} classes: {v}");
        // The classes the spare lets it keep open (at least one of each kind).
        let open = |k: &str| v["classes_open"][k].as_u64().unwrap_or(0);
        assert!(open("user") >= 1 && open("gc") >= 1, "{v}");
    }
}
