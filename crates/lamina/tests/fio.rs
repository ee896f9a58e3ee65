//! fio through its nbd engine, with checksummed verification.

mod common;
use common::*;

fn fio_json(args: &[&str]) -> serde_json::Value {
    let out = run("fio", args);
    let json = &out[out.find('{').expect("fio printed JSON")..];
    serde_json::from_str(json).expect("fio JSON")
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
    let dir = t.join("arr");
    let usable = create_array(
        &dir,
        "256M",
        &["--segment-size", "1M", "--write-unit", "256K"],
    );
    let vol = usable * 8 / 10 / (1 << 20) * (1 << 20);
    lamina(&[
        "volume",
        "create",
        dir.to_str().unwrap(),
        "v",
        "--size",
        &vol.to_string(),
    ]);
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
    lamina(&[
        "volume",
        "create",
        dir.to_str().unwrap(),
        "v",
        "--size",
        "128M",
    ]);
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
