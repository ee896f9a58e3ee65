//! Reads a connection carries out itself (its own io_uring, issue "Data path v2"):
//! on a device driven by io_uring, block reads at queue depth go through the
//! connection's ring, come back verified, and a block damaged on the device is
//! caught there and answered with an error, not with its bytes. With the devices
//! driven by plain system calls the read threads serve the same reads.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_nbd::proto::{CMD_READ, EIO};
use lamina_testkit::{pattern, BS};
use std::os::unix::fs::FileExt;
use std::path::Path;

const BLOCKS: u64 = 2048;

/// Writes BLOCKS blocks of `v` through `sock` and flushes.
fn write_all(sock: &Path) {
    let mut c = Client::connect_unix(sock, "v").unwrap();
    for lba in 0..BLOCKS {
        c.write(lba * BS as u64, &pattern(lba, 1), false).unwrap();
    }
    c.flush().unwrap();
}

/// Reads every block with 64 requests in flight; returns the blocks that came back
/// with an error (the others must hold their pattern).
fn read_all(sock: &Path) -> Vec<u64> {
    let mut c = Client::connect_unix(sock, "v").unwrap();
    let mut bad = Vec::new();
    for first in (0..BLOCKS).step_by(64) {
        let mut want = std::collections::HashMap::new();
        for lba in first..first + 64 {
            want.insert(
                c.send(CMD_READ, 0, lba * BS as u64, BS as u32, &[])
                    .unwrap(),
                lba,
            );
        }
        c.push().unwrap();
        for _ in 0..64 {
            let r = c.recv().unwrap();
            let lba = want.remove(&r.handle).unwrap();
            if r.error != 0 {
                assert_eq!((r.error, r.data.len()), (EIO, 0));
                bad.push(lba);
            } else {
                assert!(r.data == pattern(lba, 1), "block {lba} came back wrong");
            }
        }
    }
    bad
}

/// The byte offset in `file` of the block holding `lba`'s pattern.
fn find_block(file: &Path, lba: u64) -> u64 {
    let f = std::fs::File::open(file).unwrap();
    let want = pattern(lba, 1);
    let mut b = vec![0u8; BS];
    let size = f.metadata().unwrap().len();
    (0..size / BS as u64)
        .map(|k| k * BS as u64)
        .find(|&off| {
            f.read_exact_at(&mut b, off).unwrap();
            b == want
        })
        .expect("the block is on the device")
}

fn counter(dir: &Path, key: &str) -> u64 {
    status_json(dir)[key].as_u64().unwrap()
}

#[test]
fn connections_read_from_the_device_themselves_and_catch_damage() {
    let t = TempDir::new("ring-reads");
    let dir = small_array(&t, "32M");
    let s = Server::start(&dir);
    write_all(&s.sock);
    assert!(read_all(&s.sock).is_empty());
    let by_conn = counter(&dir, "reads_by_connection");
    assert!(
        by_conn >= BLOCKS / 2,
        "only {by_conn} of {BLOCKS} reads went through the connection's ring"
    );

    // Damage one block on the device behind the array's back (the file is written
    // through the page cache, as the server reads it).
    let victim = 777;
    let off = find_block(&dir.join("dev.img"), victim);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join("dev.img"))
        .unwrap();
    f.write_all_at(&[0x5a; 16], off + 100).unwrap();
    drop(f);
    let errors = counter(&dir, "read_checksum_errors");
    assert_eq!(read_all(&s.sock), vec![victim]);
    assert!(counter(&dir, "read_checksum_errors") > errors);
    assert!(counter(&dir, "reads_by_connection") > by_conn + BLOCKS / 2);
    s.stop();
}

#[test]
fn with_plain_system_calls_the_read_threads_serve() {
    let t = TempDir::new("ring-reads-sync");
    let dir = small_array(&t, "32M");
    let cfg_path = dir.join("lamina.toml");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(cfg.contains("\n[engine]\n"));
    std::fs::write(
        &cfg_path,
        cfg.replace("\n[engine]\n", "\n[engine]\nio_engine = \"sync\"\n"),
    )
    .unwrap();
    let s = Server::start(&dir);
    write_all(&s.sock);
    assert!(read_all(&s.sock).is_empty());
    assert_eq!(counter(&dir, "reads_by_connection"), 0);
    s.stop();
}
