//! `lamina fsck`: e2fsck's exit codes on a clean array, damaged superblock copies,
//! blocks damaged at rest (JBOD: damage left; SAID5: repaired from parity), and a
//! served array.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_testkit::{pattern, BS};
use std::path::Path;

fn fsck(dir: &Path, args: &[&str]) -> (i32, serde_json::Value) {
    let mut a = vec!["fsck", dir.to_str().unwrap(), "--json"];
    a.extend_from_slice(args);
    let out = lamina_output(&a);
    let v = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out.status.code().unwrap_or(-1), v)
}

/// Writes `blocks` blocks of volume `v` and stops the server cleanly.
fn fill(dir: &Path, blocks: u64) {
    let srv = Server::start(dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in 0..blocks {
        c.write(lba * BS as u64, &pattern(lba, 1), false).unwrap();
    }
    c.flush().unwrap();
    drop(c);
    srv.stop();
}

/// Flips one bit in each of `n` pseudo-random bytes of `file` past its first MiB.
fn flip(file: &Path, n: u64, seed: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(file)
        .unwrap();
    let size = f.metadata().unwrap().len();
    let mut x = seed | 1;
    for _ in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let off = (1 << 20) + x % (size - (1 << 20));
        let mut b = [0u8; 1];
        f.read_exact_at(&mut b, off).unwrap();
        f.write_all_at(&[b[0] ^ 0x08], off).unwrap();
    }
}

#[test]
fn fsck_finds_repairs_and_reports_with_e2fsck_codes() {
    let t = TempDir::new("fsck");
    let dir = small_array(&t, "32M");
    fill(&dir, 4096);
    let (code, v) = fsck(&dir, &["--data"]);
    assert_eq!(code, 0, "{v}");
    assert_eq!(v["verdict"], "clean");
    assert_eq!(v["blocks_checked"], 4096);
    // A served array is not checked.
    let srv = Server::start(&dir);
    let out = lamina_output(&["fsck", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(8));
    assert!(String::from_utf8_lossy(&out.stderr).contains("being served"));
    srv.stop();
    // A damaged superblock copy: found (4), repaired (1), clean (0).
    let dev = dir.join("dev.img");
    {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        f.write_all_at(&[0xa5; 16], 256 * 1024 + 64).unwrap();
    }
    let (code, v) = fsck(&dir, &[]);
    assert_eq!(code, 4, "{v}");
    assert!(
        v["findings"][0]["what"]
            .as_str()
            .unwrap()
            .contains("superblock copy 1"),
        "{v}"
    );
    let (code, v) = fsck(&dir, &["--repair"]);
    assert_eq!(code, 1, "{v}");
    assert_eq!(fsck(&dir, &[]).0, 0);
    // Damage at rest on a JBOD (data, headers, summaries, the checkpoint, as the
    // flips fall): found, and nothing can mend it.
    flip(&dev, 2000, 7);
    let (code, v) = fsck(&dir, &["--data", "--repair"]);
    assert_eq!(code, 4, "{v}");
    let findings = v["findings"].as_array().unwrap();
    assert!(!findings.is_empty());
    assert!(findings.iter().all(|f| f["repairable"] == false), "{v}");
}

#[test]
fn fsck_repairs_a_said5_member_from_parity() {
    let t = TempDir::new("fsck5");
    let dir = t.join("arr");
    let devs: Vec<String> = (0..4)
        .map(|i| format!("{}:64M", t.join(&format!("d{i}.img")).display()))
        .collect();
    let mut args = vec![
        "array",
        "create",
        dir.to_str().unwrap(),
        "--layout",
        "said5",
    ];
    for d in &devs {
        args.extend_from_slice(&["--device", d]);
    }
    args.extend_from_slice(&["--segment-size", "256K", "--write-unit", "96K"]);
    lamina(&args);
    create_volume(&dir, "v", "48M");
    fill(&dir, 8192);
    flip(&t.join("d2.img"), 300, 11);
    let (code, v) = fsck(&dir, &["--data"]);
    assert_eq!(code, 4, "{v}");
    let findings = v["findings"].as_array().unwrap();
    assert!(
        !findings.is_empty() && findings.iter().all(|f| f["repairable"] == true),
        "{v}"
    );
    let (code, v) = fsck(&dir, &["--data", "--repair"]);
    assert_eq!(code, 1, "{v}");
    let (code, v) = fsck(&dir, &["--data"]);
    assert_eq!(code, 0, "{v}");
    // And the data is what was written.
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in (0..8192).step_by(37) {
        assert_eq!(c.read(lba * BS as u64, BS as u32).unwrap(), pattern(lba, 1));
    }
    drop(c);
    srv.stop();
}
