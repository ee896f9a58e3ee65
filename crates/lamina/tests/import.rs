//! Arrays managed like mdadm and zpool (issue 15): `array list` finds arrays on
//! devices, `export` lets go of one (refused while served), `import` serves it
//! from another directory (choosing among several, whole or degraded when parity
//! covers a missing member), a configuration pointed at another array's devices is
//! refused before anything is written, and `destroy` wipes the superblocks.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_testkit::{pattern, BS};
use std::path::Path;

const BLOCKS: u64 = 512;

fn write_blocks(sock: &Path) {
    let mut c = Client::connect_unix(sock, "v").unwrap();
    for lba in 0..BLOCKS {
        c.write(lba * BS as u64, &pattern(lba, 1), false).unwrap();
    }
    c.flush().unwrap();
}

fn check_blocks(dir: &Path) {
    let s = Server::start(dir);
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    for lba in 0..BLOCKS {
        assert!(
            c.read(lba * BS as u64, BS as u32).unwrap() == pattern(lba, 1),
            "block {lba} in {}",
            dir.display()
        );
    }
    drop(c);
    s.stop();
}

fn fails(args: &[&str], why: &str) {
    let out = lamina_output(args);
    assert_eq!(out.status.code(), Some(1), "{args:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(why), "{args:?}: {err}");
}

fn list(disks: &Path) -> Vec<serde_json::Value> {
    let out = lamina(&["array", "list", disks.to_str().unwrap(), "--json"]);
    serde_json::from_str::<serde_json::Value>(&out).unwrap()["arrays"]
        .as_array()
        .unwrap()
        .clone()
}

#[test]
fn arrays_are_listed_exported_imported_and_destroyed() {
    let t = TempDir::new("import");
    let disks = t.join("disks");
    let (a, b, c) = (t.join("a"), t.join("b"), t.join("c"));
    let dev = |n: &str| format!("{}:32M", disks.join(n).display());
    let (d0, d1, d2, d3, j) = (
        dev("d0.img"),
        dev("d1.img"),
        dev("d2.img"),
        dev("d3.img"),
        dev("j.img"),
    );
    let geometry = ["--segment-size", "1M", "--write-unit", "128K"];
    let mut args = vec!["array", "create", a.to_str().unwrap(), "--layout", "said5"];
    for d in [&d0, &d1, &d2, &d3] {
        args.extend(["--device", d.as_str()]);
    }
    args.extend(geometry);
    lamina(&args);
    let mut args = vec![
        "array",
        "create",
        b.to_str().unwrap(),
        "--device",
        j.as_str(),
    ];
    args.extend(geometry);
    lamina(&args);
    create_volume(&a, "v", "16M");
    let s = Server::start(&a);
    write_blocks(&s.sock);

    let found = list(&disks);
    assert_eq!(found.len(), 2, "{found:?}");
    let fa = found.iter().find(|f| f["name"] == "a").unwrap();
    assert_eq!(
        (fa["layout"].as_str(), fa["state"].as_str()),
        (Some("said5"), Some("complete"))
    );
    let uuid_a = fa["uuid"].as_str().unwrap().to_string();
    assert_eq!(status_json(&a)["array"]["uuid"], uuid_a.as_str());
    for (i, m) in fa["members"].as_array().unwrap().iter().enumerate() {
        assert!(m["path"].as_str().unwrap().ends_with(&format!("d{i}.img")));
    }

    let (ad, cd) = (a.to_str().unwrap(), c.to_str().unwrap());
    fails(&["array", "export", ad], "is being served");
    s.stop();
    lamina(&["array", "export", ad]);
    fails(&["status", ad], "was exported");
    let dd = disks.to_str().unwrap();
    fails(&["array", "import", cd, dd], "2 arrays found");
    fails(
        &["array", "import", cd, dd, "--name", "nope"],
        "no Lamina array named",
    );
    lamina(&["array", "import", cd, dd, "--name", "a"]);
    fails(
        &["array", "import", cd, dd, "--name", "a"],
        "already holds an array",
    );
    check_blocks(&c);

    // b's configuration pointed at a's device: refused, and nothing written to it.
    let generation = |d: &Path| {
        list(d)
            .iter()
            .find(|f| f["name"] == "a")
            .map(|f| f["generation"].as_u64().unwrap())
    };
    let before = generation(&disks);
    let cfg = b.join("lamina.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    std::fs::write(&cfg, text.replace("j.img", "d0.img")).unwrap();
    fails(&["serve", b.to_str().unwrap()], "holds array \"a\"");
    assert_eq!(generation(&disks), before);
    std::fs::write(&cfg, text).unwrap();

    // The same member seen twice (a copy of its file: as a loop device over it,
    // or multipath, would show it): neither is taken, and both are named.
    let copies = t.join("copies");
    std::fs::create_dir_all(&copies).unwrap();
    std::fs::copy(disks.join("d1.img"), copies.join("d1.img")).unwrap();
    let both = serde_json::from_str::<serde_json::Value>(&lamina(&[
        "array",
        "list",
        dd,
        copies.to_str().unwrap(),
        "--json",
    ]))
    .unwrap();
    let fa = both["arrays"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["name"] == "a")
        .unwrap()
        .clone();
    assert_eq!(fa["state"], "degraded", "{fa}");
    assert!(fa["members"][1]["path"].is_null(), "{fa}");
    assert!(
        fa["passed_over"][0].as_str().unwrap().contains("at once"),
        "{fa}"
    );
    std::fs::remove_dir_all(&copies).unwrap();

    // A member lost: the export remembers where the others are; importing
    // degraded takes --degraded, and then parity serves every block.
    lamina(&["array", "export", cd]);
    std::fs::remove_file(disks.join("d2.img")).unwrap();
    fails(&["array", "import", cd], "--degraded");
    let out = lamina(&["array", "import", cd, "--degraded"]);
    assert!(
        out.contains("3 of 4 members") && out.contains("degraded"),
        "{out}"
    );
    check_blocks(&c);
    // Two lost is more than SAID5 covers.
    lamina(&["array", "export", cd]);
    std::fs::remove_file(disks.join("d3.img")).unwrap();
    fails(&["array", "import", cd, "--degraded"], "incomplete");

    // Destroy: only with --force; afterwards the devices hold no array.
    let e = t.join("e");
    let mut args = vec!["array", "create", e.to_str().unwrap()];
    let de = dev("e.img");
    args.extend(["--device", de.as_str()]);
    args.extend(geometry);
    lamina(&args);
    let ed = e.to_str().unwrap();
    fails(&["array", "destroy", ed], "--force");
    lamina(&["array", "destroy", ed, "--force"]);
    assert!(!e.join("lamina.toml").exists());
    assert!(disks.join("e.img").exists(), "the file itself stays");
    let names: Vec<String> = list(&disks)
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect();
    assert!(!names.contains(&"e".to_string()), "{names:?}");
}

/// `array create` discards its devices' data areas first, as mkfs does (a file's
/// old contents become holes, an SSD learns its blocks are free), not with
/// --no-discard, and not at all on a device that belongs to another array: that is
/// refused before anything is discarded, and the other array still serves its data.
#[test]
fn array_create_discards_old_contents_but_never_another_array() {
    use std::os::unix::fs::MetadataExt;
    let t = TempDir::new("create-discard");
    let allocated = |p: &Path| std::fs::metadata(p).unwrap().blocks() * 512;
    let old = vec![0x5au8; 192 << 20];
    let (a, b) = (t.join("a.img"), t.join("b.img"));
    std::fs::write(&a, &old).unwrap();
    std::fs::write(&b, &old).unwrap();
    let create = |dir: &str, dev: &Path, extra: &[&str]| {
        let (dir, dev) = (t.join(dir), dev.to_str().unwrap().to_string());
        let mut args = vec!["array", "create", dir.to_str().unwrap(), "--device", &dev];
        args.extend_from_slice(extra);
        lamina_output(&args)
    };
    assert!(create("one", &a, &[]).status.success());
    assert!(
        allocated(&a) < 8 << 20,
        "{} bytes still allocated after create",
        allocated(&a)
    );
    assert!(create("two", &b, &["--no-discard"]).status.success());
    assert!(allocated(&b) >= 190 << 20, "--no-discard discarded");
    // A device of another array: refused, and nothing of it discarded.
    create_volume(&t.join("one"), "v", "64M");
    let s = Server::start(&t.join("one"));
    write_blocks(&s.sock);
    s.stop();
    let before = allocated(&a);
    let out = create("three", &a, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("already belongs to Lamina array"));
    assert_eq!(allocated(&a), before);
    check_blocks(&t.join("one"));
}

/// `array grow` (as `zpool add`): refused while served, for a member, and for a
/// striped array; adds a device to a JBOD array whose data stays and whose
/// capacity grows; lamina.toml keeps its comments and names the new device, and
/// `array list` finds both members. `array replace` on JBOD then moves a member
/// to another device.
#[test]
fn a_jbod_array_grows_and_moves_a_member() {
    let t = TempDir::new("grow");
    let disks = t.join("disks");
    let a = t.join("a");
    let ad = a.to_str().unwrap();
    let dev = |n: &str| format!("{}:32M", disks.join(n).display());
    let geometry = ["--segment-size", "1M", "--write-unit", "128K"];
    let d0 = dev("d0.img");
    let mut args = vec!["array", "create", ad, "--device", d0.as_str()];
    args.extend(geometry);
    lamina(&args);
    append_config(&a, "# kept: a comment of the administrator's\n");
    create_volume(&a, "v", "16M");
    let before = status_json(&a)["usable_bytes"].as_u64().unwrap();
    let s = Server::start(&a);
    write_blocks(&s.sock);
    let d1 = dev("d1.img");
    fails(&["array", "grow", ad, "--device", &d1], "is being served");
    s.kill9();
    assert!(!disks.join("d1.img").exists(), "nothing made by a refusal");

    let out = lamina(&["array", "grow", ad, "--device", &d1]);
    assert!(out.contains("grew from 1 to 2 devices"), "{out}");
    let st = status_json(&a);
    let after = st["usable_bytes"].as_u64().unwrap();
    assert!(after > 2 * before - (4 << 20), "usable {before} -> {after}");
    assert_eq!(st["array"]["members"].as_array().unwrap().len(), 2, "{st}");
    let cfg = std::fs::read_to_string(a.join("lamina.toml")).unwrap();
    assert!(
        cfg.contains("# kept: a comment") && cfg.contains("d1.img"),
        "{cfg}"
    );
    check_blocks(&a);
    let found = list(&disks);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0]["state"], "complete");
    assert_eq!(found[0]["members"].as_array().unwrap().len(), 2);

    let d1_again = disks.join("d1.img").display().to_string();
    fails(
        &["array", "grow", ad, "--device", &d1_again],
        "already a member",
    );

    // A member moved to a new device (as pvmove): refused while served, then
    // copied; the old file is no longer needed.
    let d2 = dev("d2.img");
    let s = Server::start(&a);
    fails(
        &["array", "replace", ad, "--old", "0", "--new", &d2],
        "is being served",
    );
    s.stop();
    let out = lamina_output(&[
        "array", "replace", ad, "--old", "0", "--new", &d2, "--rate", "1M",
    ]);
    assert_eq!(out.status.code(), Some(2), "a usage error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("for rebuilds of striped members"), "{err}");
    let out = lamina(&["array", "replace", ad, "--old", "0", "--new", &d2, "--json"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(r["old"].as_str().unwrap().ends_with("d0.img"), "{r}");
    assert!(r["segments_copied"].as_u64().unwrap() > 0, "{r}");
    let cfg = std::fs::read_to_string(a.join("lamina.toml")).unwrap();
    assert!(
        cfg.contains("d2.img") && !cfg.contains("d0.img") && cfg.contains("# kept"),
        "{cfg}"
    );
    std::fs::remove_file(disks.join("d0.img")).unwrap();
    check_blocks(&a);
    // Striped arrays are refused, with nothing changed.
    let b = t.join("b");
    let bd = b.to_str().unwrap();
    let mut args = vec!["array", "create", bd, "--layout", "said5"];
    let ds: Vec<String> = (0..3).map(|i| dev(&format!("s{i}.img"))).collect();
    for d in &ds {
        args.extend(["--device", d.as_str()]);
    }
    args.extend(geometry);
    lamina(&args);
    let n = dev("s3.img");
    fails(
        &["array", "grow", bd, "--device", &n],
        "only JBOD arrays grow",
    );
    assert!(!disks.join("s3.img").exists());
    assert_eq!(
        status_json(&b)["array"]["members"]
            .as_array()
            .unwrap()
            .len(),
        3
    );
}

/// `array evacuate` (as pvmove then vgreduce): refused while served; moves a JBOD
/// member's data onto the others and takes it out; lamina.toml stops naming it,
/// its file can go, `status` and `array list` show it removed, and the data reads
/// back; a replace of the removed member is refused.
#[test]
fn a_jbod_member_is_evacuated() {
    let t = TempDir::new("evacuate");
    let disks = t.join("disks");
    let a = t.join("a");
    let ad = a.to_str().unwrap();
    let dev = |n: &str| format!("{}:32M", disks.join(n).display());
    let (d0, d1, d2) = (dev("d0.img"), dev("d1.img"), dev("d2.img"));
    let mut args = vec!["array", "create", ad];
    for d in [&d0, &d1, &d2] {
        args.extend(["--device", d.as_str()]);
    }
    args.extend(["--segment-size", "1M", "--write-unit", "128K"]);
    lamina(&args);
    create_volume(&a, "v", "16M");
    let s = Server::start(&a);
    write_blocks(&s.sock);
    fails(
        &["array", "evacuate", ad, "--device", "1"],
        "is being served",
    );
    s.kill9();
    let before = status_json(&a)["usable_bytes"].as_u64().unwrap();
    let out = lamina(&["array", "evacuate", ad, "--device", "1", "--json"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(r["device"].as_str().unwrap().ends_with("d1.img"), "{r}");
    assert!(
        r["segments"].as_u64().unwrap() > 0,
        "member 1 held data: {r}"
    );
    let cfg = std::fs::read_to_string(a.join("lamina.toml")).unwrap();
    assert!(!cfg.contains("d1.img") && cfg.contains("d2.img"), "{cfg}");
    let kept = t.join("d1.kept");
    std::fs::rename(disks.join("d1.img"), &kept).unwrap();
    let st = status_json(&a);
    assert_eq!(st["array"]["members"][1]["state"], "removed", "{st}");
    assert!(st["usable_bytes"].as_u64().unwrap() < before);
    check_blocks(&a);
    let found = list(&disks);
    assert_eq!(found[0]["state"], "complete", "{found:?}");
    assert_eq!(found[0]["members"][1]["removed"], true);
    fails(
        &["array", "evacuate", ad, "--device", "1"],
        "removed already",
    );
    fails(
        &[
            "array",
            "replace",
            ad,
            "--old",
            "1",
            "--new",
            &dev("d3.img"),
        ],
        "was removed",
    );
    // Imported elsewhere with the removed member's old file lying among the
    // others: it is left out of the new lamina.toml.
    std::fs::rename(&kept, disks.join("d1.img")).unwrap();
    lamina(&["array", "export", ad]);
    let b = t.join("b");
    let out = lamina(&[
        "array",
        "import",
        b.to_str().unwrap(),
        disks.to_str().unwrap(),
    ]);
    assert!(out.contains("2 of 2 members"), "{out}");
    let cfg = std::fs::read_to_string(b.join("lamina.toml")).unwrap();
    assert!(!cfg.contains("d1.img") && cfg.contains("d2.img"), "{cfg}");
    check_blocks(&b);
}

/// A tiered array's members move with the array stopped (issue 14): `array
/// replace` copies a capacity member and the cache device to new files, `array
/// evacuate` moves a capacity member's data onto the other; lamina.toml follows
/// and the data reads back after each step. Evacuating the cache and growing
/// are refused with the reason.
#[test]
fn a_tiered_arrays_members_move() {
    let t = TempDir::new("tiered-move");
    let disks = t.join("disks");
    let a = t.join("a");
    let ad = a.to_str().unwrap();
    let dev = |n: &str, size: &str| format!("{}:{size}", disks.join(n).display());
    let mut args: Vec<String> = ["array", "create", ad].map(String::from).to_vec();
    for d in [dev("d0.img", "32M"), dev("d1.img", "32M")] {
        args.extend(["--device".into(), d]);
    }
    args.extend(["--cache-device".into(), dev("c0.img", "24M")]);
    args.extend(["--segment-size", "1M", "--write-unit", "128K"].map(String::from));
    lamina(&args.iter().map(|s| s.as_str()).collect::<Vec<_>>());
    create_volume(&a, "v", "16M");
    let s = Server::start(&a);
    write_blocks(&s.sock);
    // More than the cache holds, over the rest of the volume: compaction moves
    // the first blocks on to the capacity members.
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    for round in 2..5 {
        for lba in BLOCKS..4096 {
            c.write(lba * BS as u64, &pattern(lba, round), false)
                .unwrap();
        }
    }
    c.flush().unwrap();
    drop(c);
    let st = status_json(&a);
    assert!(st["cache"]["compactions"].as_u64().unwrap() > 0, "{st}");
    s.kill9();

    lamina(&[
        "array",
        "replace",
        ad,
        "--old",
        "0",
        "--new",
        &dev("d0b.img", "32M"),
    ]);
    lamina(&[
        "array",
        "replace",
        ad,
        "--old",
        "2",
        "--new",
        &dev("c1.img", "24M"),
    ]);
    let cfg = std::fs::read_to_string(a.join("lamina.toml")).unwrap();
    assert!(
        cfg.contains("d0b.img") && cfg.contains("c1.img") && !cfg.contains("c0.img"),
        "{cfg}"
    );
    let st = status_json(&a);
    assert_eq!(st["array"]["members"][2]["tier"], "cache", "{st}");
    check_blocks(&a);

    fails(
        &["array", "evacuate", ad, "--device", "2"],
        "is its cache tier",
    );
    fails(
        &["array", "grow", ad, "--device", &dev("d2.img", "32M")],
        "cannot grow yet",
    );
    let out = lamina(&["array", "evacuate", ad, "--device", "1", "--json"]);
    let r: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        r["segments"].as_u64().unwrap() > 0,
        "member 1 held data: {r}"
    );
    let cfg = std::fs::read_to_string(a.join("lamina.toml")).unwrap();
    assert!(!cfg.contains("d1.img") && cfg.contains("c1.img"), "{cfg}");
    let st = status_json(&a);
    assert_eq!(st["array"]["members"][1]["state"], "removed", "{st}");
    assert!(st["cache"].is_object(), "{st}");
    check_blocks(&a);
}
