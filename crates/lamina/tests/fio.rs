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

/// The data path allocates nothing per request. fio's 4 KiB random writes, then
/// reads, at iodepth 32 through the server, counted by the server's own
/// allocator (`lamina_heap_allocations_total`): what a run of 40000 more
/// requests costs beyond a run of 2000 (so that each connection's setup, its
/// pools filling, cancels out), per request. Reads allocate nothing. Writes
/// share what is allocated per unit written (its checksums for readers, 1 per
/// unit of up to 64 blocks here), per segment (its summary) and by the victim
/// index's B-tree as GC runs (the volume is at 80%): 0.12 per write when this
/// was written, 0.32 before the unit's checksums took one allocation instead of
/// four, GC reused its vectors and the engine's queue became bounded. One
/// allocation per request anywhere would make it 1 or more.
#[test]
fn the_data_path_allocates_next_to_nothing_per_request() {
    if !need(
        "fio::the_data_path_allocates_next_to_nothing_per_request",
        &["fio"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("fio-alloc");
    let (dir, vol) = array_at_80_percent(&t);
    let array = array_name(&dir);
    let port = free_port();
    let s = Server::start_with(&dir, &[], &["--metrics", &format!("127.0.0.1:{port}")]);
    let allocations = || sample(&scrape(port), &array, "heap_allocations_total", "");
    // Waits until the server allocates nothing but what a scrape costs (GC,
    // checkpoints and seals after the last run have finished), for up to 20 s.
    let settle = || {
        let mut last = (allocations(), f64::NAN);
        for _ in 0..100 {
            std::thread::sleep(std::time::Duration::from_millis(200));
            let now = allocations();
            let d = now - last.0;
            if (d - last.1).abs() <= 2.0 {
                return;
            }
            last = (now, d);
        }
        panic!("the server kept allocating while idle");
    };
    let run = |rw: &str, ios: u64| {
        let j = fio_json(&[
            "--name=alloc",
            "--ioengine=nbd",
            &format!("--uri={}", s.uri("v")),
            "--bs=4k",
            "--iodepth=32",
            &format!("--rw={rw}"),
            &format!("--size={vol}"),
            &format!("--number_ios={ios}"),
            "--randrepeat=0",
            "--output-format=json",
        ]);
        assert_eq!(j["jobs"][0]["error"], 0, "fio: {j}");
    };
    // Fill the volume once, so that reads find data and writes overwrite.
    run("write", vol / 4096);
    let mut per_request = Vec::new();
    for rw in ["randwrite", "randread"] {
        let cost = |ios| {
            settle();
            let before = allocations();
            run(rw, ios);
            allocations() - before
        };
        let (short, long) = (cost(2000), cost(42000));
        let per = (long - short) / 40000.0;
        eprintln!(
            "{rw}: {short} allocations in 2000 requests, {long} in 42000: {per:.4} per request"
        );
        per_request.push((rw, per));
    }
    s.stop();
    for (rw, per) in per_request {
        let most = if rw == "randread" { 0.01 } else { 0.25 };
        assert!(per < most, "{rw}: {per:.4} heap allocations per request");
        // Below 0, the short run took allocations of work left from before.
        assert!(per > -0.01, "{rw}: {per:.4} heap allocations per request");
    }
}
