//! An array with a cache tier (issue 14) end to end: a capacity file behind a
//! cache file, served over NBD; fio writes 4 KiB blocks at random with crc32c
//! verification, many times what the cache holds, so compaction moves data to
//! the capacity tier all along; kill -9 after a flush and in the middle of
//! writing; every block verifies after each restart.

mod common;
use common::*;

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
    let dir = t.join("arr");
    let d = dir.to_str().unwrap();
    let cap = format!("{}:256M", t.join("capacity.img").display());
    let cache = format!("{}:48M", t.join("cache.img").display());
    let out = lamina(&[
        "array",
        "create",
        d,
        "--device",
        &cap,
        "--cache-device",
        &cache,
        "--segment-size",
        "1M",
        "--write-unit",
        "128K",
    ]);
    assert!(out.contains("cache tier: 47 segments"), "{out}");
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
            && err.contains("the cache tier's device (member [1]) is missing")
            && err.contains("\"v\" "),
        "{err}"
    );
    std::fs::rename(&moved, t.join("cache.img")).unwrap();
    lamina(&["status", d]);
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
