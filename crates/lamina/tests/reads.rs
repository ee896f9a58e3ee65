//! Reads a connection carries out itself (its own io_uring, issue "Data path v2"):
//! on a device driven by io_uring, block reads at queue depth go through the
//! connection's ring, come back verified, and a block damaged on the device is
//! caught there and answered with an error, not with its bytes. With the devices
//! driven by plain system calls the read threads serve the same reads.
//! NBD_CMD_CACHE reads ahead into the page cache.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_nbd::proto::{CMD_CACHE, CMD_READ, EIO};
use lamina_testkit::{pattern, BS};
use std::os::unix::fs::FileExt;
use std::path::Path;

const BLOCKS: u64 = 2048;

/// Writes `blocks` blocks of `v` through `sock` and flushes.
fn write_all(sock: &Path, blocks: u64) {
    let mut c = Client::connect_unix(sock, "v").unwrap();
    for lba in 0..blocks {
        c.write(lba * BS as u64, &pattern(lba, 1), false).unwrap();
    }
    c.flush().unwrap();
}

/// Reads the first `blocks` blocks with 64 requests in flight; returns the blocks
/// that came back with an error (the others must hold their pattern).
fn read_all(sock: &Path, blocks: u64) -> Vec<u64> {
    let mut c = Client::connect_unix(sock, "v").unwrap();
    let mut bad = Vec::new();
    for first in (0..blocks).step_by(64) {
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
    ring_reads("ring-reads", "");
}

/// The same with O_DIRECT on the device file: the connection reads into an
/// aligned window of its buffer (no read goes to the pool for alignment).
#[test]
fn direct_io_reads_go_through_the_ring_too() {
    ring_reads("ring-reads-direct", "direct_io = \"on\"\n");
}

fn ring_reads(name: &str, engine: &str) {
    let t = TempDir::new(name);
    let dir = small_array(&t, "32M");
    if !engine.is_empty() {
        let cfg_path = dir.join("lamina.toml");
        let cfg = std::fs::read_to_string(&cfg_path).unwrap();
        std::fs::write(
            &cfg_path,
            cfg.replace("\n[engine]\n", &format!("\n[engine]\n{engine}")),
        )
        .unwrap();
    }
    let s = Server::start(&dir);
    write_all(&s.sock, BLOCKS);
    assert!(read_all(&s.sock, BLOCKS).is_empty());
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
    assert_eq!(read_all(&s.sock, BLOCKS), vec![victim]);
    assert!(counter(&dir, "read_checksum_errors") > errors);
    assert!(counter(&dir, "reads_by_connection") > by_conn + BLOCKS / 2);
    s.stop();
}

/// With a header cache much smaller than the units written (the smallest it
/// gets: 64 units of 32 blocks, for 8192 blocks in about 265 units), reads of
/// units it lost still go through the connection's ring: the unit's header is
/// read beside the data and its checksums cached. They used to go to the read
/// pool, which read the header first and the data after it.
#[test]
fn reads_of_units_the_header_cache_lost_stay_on_the_ring() {
    let t = TempDir::new("ring-reads-headers");
    let dir = small_array(&t, "32M");
    let cfg_path = dir.join("lamina.toml");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        cfg.replace("\n[engine]\n", "\n[engine]\nheader_cache = \"8K\"\n"),
    )
    .unwrap();
    let s = Server::start(&dir);
    let blocks = 8192;
    write_all(&s.sock, blocks);
    let (misses, by_conn) = (
        counter(&dir, "header_cache_misses"),
        counter(&dir, "reads_by_connection"),
    );
    assert!(read_all(&s.sock, blocks).is_empty());
    let misses = counter(&dir, "header_cache_misses") - misses;
    let by_conn = counter(&dir, "reads_by_connection") - by_conn;
    assert!(misses > 100, "{misses} headers read for {blocks} blocks");
    assert_eq!(by_conn, blocks, "reads that left the ring");
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
    write_all(&s.sock, BLOCKS);
    assert!(read_all(&s.sock, BLOCKS).is_empty());
    assert_eq!(counter(&dir, "reads_by_connection"), 0);
    s.stop();
}

/// Whether the page of `file` at `off` is in the page cache (mincore).
fn resident(file: &Path, off: u64) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).unwrap();
    let page = off / 4096 * 4096;
    // SAFETY: maps one page of our open file read-only, asks which pages are in
    // memory, unmaps it.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ,
            libc::MAP_SHARED,
            f.as_raw_fd(),
            page as libc::off_t,
        );
        assert_ne!(p, libc::MAP_FAILED);
        let mut v = [0u8; 1];
        assert_eq!(libc::mincore(p, 4096, v.as_mut_ptr()), 0);
        libc::munmap(p, 4096);
        v[0] & 1 == 1
    }
}

/// Drops the clean pages of `file` from the page cache.
fn drop_cached(file: &Path) {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(file).unwrap();
    // SAFETY: an advisory call on our own descriptor.
    unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
}

#[test]
fn cache_hints_bring_blocks_into_the_page_cache() {
    let t = TempDir::new("cache-hint");
    let dir = small_array(&t, "32M");
    let s = Server::start(&dir);
    write_all(&s.sock, BLOCKS);
    let dev = dir.join("dev.img");
    let (a, b) = (find_block(&dev, 100), find_block(&dev, 1900));
    drop_cached(&dev);
    assert!(
        !resident(&dev, a) && !resident(&dev, b),
        "the pages did not leave the page cache"
    );
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    // A hint over part of the volume: its blocks come in, before any read.
    c.call_raw(CMD_CACHE, 0, 0, 1000 * BS as u32).unwrap();
    let t0 = std::time::Instant::now();
    while !resident(&dev, a) {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "block 100 was not read ahead"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!resident(&dev, b), "block 1900 was outside the hint");
    drop(c);
    s.stop();
}
