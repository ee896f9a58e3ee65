//! An array with a cache tier (issue 14) end to end: a capacity file behind a
//! cache file, served over NBD; fio writes 4 KiB blocks at random with crc32c
//! verification, many times what the cache holds, so compaction moves data to
//! the capacity tier all along; kill -9 after a flush and in the middle of
//! writing; every block verifies after each restart.

mod common;
use common::*;

/// An array in `t/arr` on a 256 MiB capacity file behind cache files of the
/// given names and sizes (two or three mirror each other), 1 MiB segments: the
/// cache tier holds 47 of them.
fn create_tiered(t: &TempDir, caches: &[(&str, &str)]) -> std::path::PathBuf {
    let dir = t.join("arr");
    let mut args: Vec<String> = ["array", "create", dir.to_str().unwrap(), "--device"]
        .map(String::from)
        .to_vec();
    args.push(format!("{}:256M", t.join("capacity.img").display()));
    for (name, size) in caches {
        args.push("--cache-device".into());
        args.push(format!("{}:{size}", t.join(name).display()));
    }
    args.extend(["--segment-size", "1M", "--write-unit", "128K"].map(String::from));
    let out = lamina(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    assert!(out.contains("cache tier: 47 segments"), "{out}");
    dir
}

#[test]
fn cache_tier_fio_verify_compaction_kill9() {
    if !need(
        "tiers::cache_tier_fio_verify_compaction_kill9",
        &["fio"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("tiers");
    let dir = create_tiered(&t, &[("cache.img", "48M")]);
    let d = dir.to_str().unwrap();
    let st = status_json(&dir);
    assert_eq!(st["cache"]["segment_count"], 47, "{st}");
    // Usable capacity is the capacity tier's alone.
    let usable = st["usable_bytes"].as_u64().unwrap();
    assert!(usable < 256 << 20, "{st}");
    let vol = usable * 7 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());

    // Three passes of random writes (each more than the cache), verified.
    let s = Server::start(&dir);
    let (w, r) = fio_ok(&fio(&fio_job("tiers", &s.uri("v"), vol, &["--loops=3"])));
    assert!(w >= 3 * vol && r == w, "wrote {w}, verified {r}");
    let st = status_json(&dir);
    let c = &st["cache"];
    assert!(
        c["compactions"].as_u64().unwrap() > 0 && c["compacted_bytes"].as_u64().unwrap() > 0,
        "compaction ran: {st}"
    );
    let members = st["array"]["members"].as_array().unwrap();
    assert!(
        members[0]["bytes_written"].as_u64().unwrap() > vol / 2,
        "{st}"
    );
    assert_eq!(
        (&members[0]["tier"], &members[1]["tier"]),
        (&"capacity".into(), &"cache".into()),
        "{st}"
    );
    let text = lamina(&["status", d]);
    assert!(text.contains("cache tier: 47 segments"), "{text}");
    assert!(text.contains("cache.img (cache tier)"), "{text}");
    // fio's verification read everything back: from both tiers, counted apart.
    assert!(
        c["read_bytes_cache"].as_u64().unwrap() > 0
            && c["read_bytes_capacity"].as_u64().unwrap() > 0
            && c["hit_ratio"].as_f64().is_some_and(|h| h > 0.0 && h < 1.0)
            && c["capacity_write_amplification"].as_f64().unwrap() > 0.3,
        "{st}"
    );
    assert!(text.contains("cache reads: "), "{text}");
    let prom = lamina(&["status", d, "--prometheus"]);
    assert!(
        prom.contains("lamina_tier_read_bytes_total{array=\"arr\",tier=\"cache\"}")
            || prom.contains("lamina_tier_read_bytes_total{tier=\"cache\",array=\"arr\"}"),
        "{prom}"
    );

    // A pass written and flushed, then kill -9: everything comes back, from
    // whichever tier holds it.
    let s = kill9_after_flush(s, "tiers", vol);

    // kill -9 in the middle of random writes (compaction running): after the
    // restart the array takes writes again and verifies.
    let s = kill9_while_writing(s, "tiers", vol);
    let (w, r) = fio_ok(&fio(&fio_job("tiers", &s.uri("v"), vol, &["--loops=2"])));
    assert!(
        w >= 2 * vol && r == w,
        "wrote {w}, verified {r} after the crash"
    );
    s.stop();
    // fsck agrees with what the engine holds, offline.
    let out = lamina_output(&["fsck", d]);
    assert!(
        out.status.success(),
        "fsck: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The superblocks say which member is the cache.
    let list: serde_json::Value = serde_json::from_str(&lamina(&[
        "array",
        "list",
        t.path().to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    let tiers: Vec<&str> = list["arrays"][0]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["tier"].as_str().unwrap())
        .collect();
    assert_eq!(tiers, ["capacity", "cache"], "{list}");

    // Without the cache device the array is not served, and says what is lost.
    let moved = t.join("cache.away");
    std::fs::rename(t.join("cache.img"), &moved).unwrap();
    let out = lamina_output(&["status", d]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("no complete copy of the cache tier is left (members [1] missing")
            && err.contains("\"v\" "),
        "{err}"
    );
    std::fs::rename(&moved, t.join("cache.img")).unwrap();
    lamina(&["status", d]);
}

/// A mirrored cache tier (two `--cache-device`s) end to end: one copy rots whole
/// under the running server and a scrub mends it from the other, which is then
/// failed (every block verifies from the mended copy) and rebuilt online; one
/// copy's file disappears after a kill -9 that followed a flush; the array is
/// listed degraded, served from the other copy with every block verified, and
/// takes writes; the lost copy is replaced online and rebuilt; then the other
/// copy is failed and every block reads back from the rebuilt one.
#[test]
fn mirrored_cache_loses_a_copy_and_rebuilds_it() {
    if !need(
        "tiers::mirrored_cache_loses_a_copy_and_rebuilds_it",
        &["fio"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("mirror");
    // A larger copy: the mirror holds what the smallest copy holds.
    let dir = create_tiered(&t, &[("cache0.img", "48M"), ("cache1.img", "64M")]);
    let d = dir.to_str().unwrap();
    let st = status_json(&dir);
    assert_eq!(
        (&st["cache"]["copies"], &st["cache"]["copies_ok"]),
        (&2.into(), &2.into()),
        "{st}"
    );
    let tiers: Vec<&str> = st["array"]["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["tier"].as_str().unwrap())
        .collect();
    assert_eq!(tiers, ["capacity", "cache", "cache"], "{st}");
    let usable = st["usable_bytes"].as_u64().unwrap();
    let vol = usable * 7 / 10 / (1 << 20) * (1 << 20);
    create_volume(&dir, "v", &vol.to_string());

    let s = Server::start(&dir);
    let (w, r) = fio_ok(&fio(&fio_job("mirror", &s.uri("v"), vol, &["--loops=2"])));
    assert!(w >= 2 * vol && r == w, "wrote {w}, verified {r}");
    let st = status_json(&dir);
    let members = st["array"]["members"].as_array().unwrap();
    let (a, b) = (
        members[1]["bytes_written"].as_u64().unwrap(),
        members[2]["bytes_written"].as_u64().unwrap(),
    );
    assert!(
        a > vol && a == b,
        "both copies take every cache write: {st}"
    );
    assert!(st["cache"]["compactions"].as_u64().unwrap() > 0, "{st}");

    // One copy rots under the running server: junk over all its segments. A
    // scrub finds it and rewrites what is live from the other copy.
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(t.join("cache1.img"))
            .unwrap();
        for seg in 0..47u64 {
            f.write_all_at(&vec![0x5a; 1 << 20], (1 << 20) + seg * (1 << 20))
                .unwrap();
        }
        f.sync_all().unwrap();
    }
    let v: serde_json::Value =
        serde_json::from_str(&lamina(&["array", "scrub", d, "--json", "--quiet"])).unwrap();
    let n = |k: &str| v[k].as_u64().unwrap();
    assert!(
        n("blocks_repaired") + n("parity_repaired") > 0 && n("unrecoverable") == 0,
        "{v}"
    );
    // The good copy failed: everything reads back from the repaired one. Then the
    // good copy's slot is rebuilt (on a new file) from it.
    lamina(&["array", "fail", d, "--device", "1"]);
    let (_, r) = fio_ok(&fio(&fio_job(
        "mirror",
        &s.uri("v"),
        vol,
        &["--verify_only"],
    )));
    assert!(r >= vol, "verified {r} of {vol} from the scrubbed copy");
    let new0 = format!("{}:48M", t.join("cache0-new.img").display());
    lamina(&[
        "array", "replace", d, "--old", "1", "--new", &new0, "--quiet",
    ]);
    assert_eq!(status_json(&dir)["cache"]["copies_ok"], 2);

    // Flushed, killed; then one copy's device is gone.
    let s = kill9_after_flush(s, "mirror", vol);
    s.kill9();
    std::fs::remove_file(t.join("cache1.img")).unwrap();
    // Found on its devices, the array is degraded, not incomplete.
    let list: serde_json::Value = serde_json::from_str(&lamina(&[
        "array",
        "list",
        t.path().to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    assert_eq!(list["arrays"][0]["state"], "degraded", "{list}");
    let s = Server::start(&dir);
    let st = status_json(&dir);
    assert_eq!(st["array"]["members"][2]["state"], "failed", "{st}");
    assert_eq!(st["cache"]["copies_ok"], 1, "{st}");
    let text = lamina(&["status", d]);
    assert!(
        text.contains("cache mirror: 2 copies, 1 out of service (degraded)"),
        "{text}"
    );
    let (_, r) = fio_ok(&fio(&fio_job(
        "mirror",
        &s.uri("v"),
        vol,
        &["--verify_only"],
    )));
    assert!(r >= vol, "verified {r} of {vol} from one copy");
    // Degraded, it takes writes (one pass, verified).
    let (w, r) = fio_ok(&fio(&fio_job("mirror", &s.uri("v"), vol, &[])));
    assert!(w >= vol && r == w, "wrote {w}, verified {r} degraded");

    // The lost copy replaced online and rebuilt from the other.
    let new = format!("{}:48M", t.join("cache1-new.img").display());
    lamina(&[
        "array", "replace", d, "--old", "2", "--new", &new, "--quiet",
    ]);
    let st = status_json(&dir);
    assert_eq!(st["array"]["members"][2]["state"], "ok", "{st}");
    assert_eq!(st["cache"]["copies_ok"], 2, "{st}");
    // The other copy failed: everything reads back from the rebuilt one.
    lamina(&["array", "fail", d, "--device", "1"]);
    let st = status_json(&dir);
    assert_eq!(st["array"]["members"][1]["state"], "failed", "{st}");
    let (_, r) = fio_ok(&fio(&fio_job(
        "mirror",
        &s.uri("v"),
        vol,
        &["--verify_only"],
    )));
    assert!(r >= vol, "verified {r} of {vol} from the rebuilt copy");
    // The last copy cannot be failed.
    let out = lamina_output(&["array", "fail", d, "--device", "2"]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("would leave data unrecoverable"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Nor can a capacity member, which has no copy.
    let out = lamina_output(&["array", "fail", d, "--device", "0"]);
    assert!(!out.status.success());
    s.stop();
}

#[test]
fn a_cache_tier_is_refused_where_it_is_not_built() {
    let t = TempDir::new("tiers-bad");
    let dir = t.join("arr");
    let devs: Vec<String> = (0..3)
        .map(|i| format!("{}:64M", t.join(&format!("d{i}.img")).display()))
        .collect();
    let cache = format!("{}:32M", t.join("c.img").display());
    let out = lamina_output(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--layout",
        "said5",
        "--device",
        &devs[0],
        "--device",
        &devs[1],
        "--device",
        &devs[2],
        "--cache-device",
        &cache,
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("jbod"), "{err}");
}

/// CSAL's experiment, small (`lamina bench csal`; the full run is in
/// docs/benchmarks.md): on an emulated QLC SSD with a 64 KiB indirection unit,
/// 4 KiB writes over eight volumes cost the drive fewer NAND bytes per user byte
/// under Lamina than raw, and fewer again with a cache tier in front.
#[test]
fn csal_bench_the_cache_tier_spares_the_qlc() {
    let out = lamina(&[
        "bench",
        "csal",
        "--capacity",
        "256M",
        "--cache",
        "40M",
        "--passes",
        "2",
        "--workload",
        "zipf:0.9",
        "--json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let nand = |i: usize| {
        v["rows"][i]["qlc_nand_bytes_per_user_byte"]
            .as_f64()
            .unwrap()
    };
    let (raw, plain, tiered) = (nand(0), nand(2), nand(3));
    assert!(
        tiered < plain && plain < raw,
        "raw {raw}, Lamina {plain}, Lamina + cache {tiered}: {v}"
    );
    assert!(
        v["rows"][3]["compacted_bytes_per_user_byte"]
            .as_f64()
            .unwrap()
            > 0.0
    );
}

/// `lamina sim --cache`: the same engine, metadata only. Under skewed writes a
/// cache tier in front cuts what the capacity tier is written per user block,
/// counting what the cache still holds at the end.
#[test]
fn sim_with_a_cache_tier_writes_the_capacity_tier_less() {
    let run = |extra: &[&str]| {
        let mut args = vec![
            "sim",
            "--quiet",
            "--json",
            "--workload",
            "zipf:0.9",
            "--capacity",
            "512M",
        ];
        args.extend_from_slice(extra);
        let v: serde_json::Value = serde_json::from_str(&lamina(&args)).expect("JSON");
        v
    };
    let plain = run(&[]);
    let tiered = run(&["--cache", "0.1"]);
    assert!(plain["cache"].is_null());
    let a = plain["capacity_write_amplification"].as_f64().unwrap();
    let b = tiered["cache"]["capacity_write_amplification_emptied"]
        .as_f64()
        .unwrap();
    assert!(
        tiered["cache"]["compactions"].as_u64().unwrap() > 0 && b < 0.8 * a,
        "capacity tier written {a} without a cache, {b} with one: {tiered}"
    );
}
