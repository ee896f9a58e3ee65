//! A real file system on a Lamina volume: nbdfuse exposes the export as a file,
//! losetup makes it a block device, mkfs.ext4, mount, copy a tree of real files,
//! unmount, restart `lamina serve`, mount again; e2fsck finds nothing and every
//! file's checksum is unchanged.

mod common;
use common::*;

#[test]
fn ext4_survives_restart_with_identical_files() {
    if !need(
        "ext4::ext4_survives_restart_with_identical_files",
        EXT4_TOOLS,
        true,
    ) {
        return;
    }
    let t = TempDir::new("ext4");
    ext4_round_trip(&t, &[]);
}

/// The same on an array with a cache tier (issue 14): the files pass through the
/// cache and compaction moves most of them to the capacity tier.
#[test]
fn ext4_on_a_cache_tier_survives_restart_with_identical_files() {
    if !need(
        "ext4::ext4_on_a_cache_tier_survives_restart_with_identical_files",
        EXT4_TOOLS,
        true,
    ) {
        return;
    }
    let t = TempDir::new("ext4-tiered");
    let cache = format!("{}:64M", t.join("cache.img").display());
    let st = ext4_round_trip(&t, &["--cache-device", &cache]);
    // More reached the capacity member than the whole cache holds: compaction
    // moved it there (user writes go only to the cache).
    let m = &st["array"]["members"];
    assert_eq!(m[1]["tier"], "cache", "{st}");
    assert!(m[0]["bytes_written"].as_u64().unwrap() > 64 << 20, "{st}");
}

/// mkfs.ext4 on a volume of an array created with `extra`, a tree of files
/// copied in, a restart, e2fsck and the files' checksums; returns the status
/// before the restart.
fn ext4_round_trip(t: &TempDir, extra: &[&str]) -> serde_json::Value {
    let dir = t.join("arr");
    let mut args = vec!["--segment-size", "2M", "--write-unit", "256K"];
    args.extend_from_slice(extra);
    create_array(&dir, "1G", &args);
    create_volume(&dir, "fs", "512M");
    let s = Server::start(&dir);
    let mut stack = Stack::attach(&s.uri("fs"), &t.join("fuse"));
    run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", stack.dev()]);
    let mnt = t.join("mnt");
    stack.mount(&mnt);
    // A tree of real files (documentation: thousands of small and mid-sized files)
    // plus a few large ones of random bytes.
    run(
        "cp",
        &["-a", "/usr/share/doc", mnt.join("doc").to_str().unwrap()],
    );
    for i in 0..3 {
        run(
            "dd",
            &[
                "if=/dev/urandom",
                &format!("of={}", mnt.join(format!("big{i}")).display()),
                "bs=1M",
                "count=24",
                "status=none",
            ],
        );
    }
    run("fstrim", &[mnt.to_str().unwrap()]);
    let sums = run(
        "sh",
        &[
            "-c",
            &format!(
                "cd {} && find . -type f -print0 | sort -z | xargs -0 sha256sum",
                mnt.display()
            ),
        ],
    );
    assert!(sums.lines().count() > 100, "copied too few files");
    stack.detach();
    s.stop();

    let st = status_json(&dir);
    assert!(st["user_bytes_written"].as_u64().unwrap() > 64 << 20);

    let s = Server::start(&dir);
    let mut stack = Stack::attach(&s.uri("fs"), &t.join("fuse"));
    run("e2fsck", &["-fn", stack.dev()]);
    stack.mount(&mnt);
    let again = run(
        "sh",
        &[
            "-c",
            &format!(
                "cd {} && find . -type f -print0 | sort -z | xargs -0 sha256sum",
                mnt.display()
            ),
        ],
    );
    assert!(again == sums, "file checksums changed across the restart");
    stack.detach();
    s.stop();
    st
}
