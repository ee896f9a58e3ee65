//! `lamina volume resize` and `rename` (issue 15). Resize: a volume grows online (new connections see
//! the new size, connections made before keep theirs), refuses to shrink over data
//! without --force, shrinks with it (the tail is discarded, old connections get an
//! error there), and every size survives kill -9 once the command has returned.
//! Offline resizes work too, and a thin volume can grow to petabytes and be deleted
//! at once. Rename: online, the old connections go on, the new name is served,
//! the volume's section in lamina.toml and its limits follow, and all of it holds
//! after kill -9.

mod common;
use common::*;
use lamina_nbd::client::{Client, ClientError};
use lamina_nbd::proto::{EINVAL, EIO};
use lamina_testkit::{pattern, BS};
use std::path::Path;
use std::time::{Duration, Instant};

const MIB: u64 = 1 << 20;

fn resize(dir: &Path, size: &str, extra: &[&str]) -> std::process::Output {
    let mut a = vec![
        "volume",
        "resize",
        dir.to_str().unwrap(),
        "v",
        "--size",
        size,
    ];
    a.extend_from_slice(extra);
    lamina_output(&a)
}

fn volume_size(dir: &Path) -> u64 {
    status_json(dir)["volumes"][0]["size_bytes"]
        .as_u64()
        .unwrap()
}

fn block(lba: u64) -> u64 {
    lba * BS as u64
}

#[test]
fn volumes_grow_and_shrink_online_and_keep_their_size() {
    let t = TempDir::new("resize");
    let dir = small_array(&t, "16M");
    let s = Server::start(&dir);
    let mut old = Client::connect_unix(&s.sock, "v").unwrap();
    assert_eq!(old.size, 16 * MIB);
    for lba in (0..64).chain([4095]) {
        old.write(block(lba), &pattern(lba, 1), false).unwrap();
    }
    old.flush().unwrap();

    // Grow: a new connection sees 32 MiB and can write beyond the old end.
    let out = resize(&dir, "+16M", &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(volume_size(&dir), 32 * MIB);
    let mut new = Client::connect_unix(&s.sock, "v").unwrap();
    assert_eq!(new.size, 32 * MIB);
    assert!(new.read(block(5000), BS as u32).unwrap() == vec![0u8; BS]);
    for lba in [4096, 6200, 8191] {
        new.write(block(lba), &pattern(lba, 2), false).unwrap();
    }
    new.flush().unwrap();
    // The old connection keeps the size it was told, and keeps working.
    assert!(old.read(block(4095), BS as u32).unwrap() == pattern(4095, 1));

    // Shrinking over data is refused without --force, and changes nothing.
    let out = resize(&dir, "24M", &[]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("holds data beyond") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(volume_size(&dir), 32 * MIB);
    assert!(new.read(block(6200), BS as u32).unwrap() == pattern(6200, 2));

    // With --force the tail goes: the connection that saw 32 MiB gets errors
    // beyond the new end, and fine answers before it.
    let out = resize(&dir, "-8M", &["--force"]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(volume_size(&dir), 24 * MIB);
    let w = new.write(block(6300), &pattern(6300, 3), false);
    assert!(matches!(w, Err(ClientError::Nbd(EINVAL))), "{w:?}");
    assert!(matches!(
        new.read(block(6200), BS as u32),
        Err(ClientError::Nbd(EIO))
    ));
    assert!(new.read(block(4096), BS as u32).unwrap() == pattern(4096, 2));
    drop((old, new));

    // What the command returned is durable: kill -9 and start again.
    s.kill9();
    let s = Server::start(&dir);
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    assert_eq!(c.size, 24 * MIB);
    for lba in (0..64).chain([4095]) {
        assert!(c.read(block(lba), BS as u32).unwrap() == pattern(lba, 1));
    }
    assert!(c.read(block(4096), BS as u32).unwrap() == pattern(4096, 2));
    drop(c);
    // Growing again: what was cut off reads as zeros.
    assert!(resize(&dir, "32M", &[]).status.success());
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    assert_eq!(c.size, 32 * MIB);
    assert!(c.read(block(6200), BS as u32).unwrap() == vec![0u8; BS]);
    assert!(c.read(block(8191), BS as u32).unwrap() == vec![0u8; BS]);
    drop(c);
    s.stop();

    // Bad sizes are refused with a clear error, not a crash.
    for bad in ["0", "4097", "-64M", "+17E", "lots"] {
        let out = resize(&dir, bad, &[]);
        assert!(!out.status.success(), "--size {bad} was taken");
        assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
    }
    assert_eq!(volume_size(&dir), 32 * MIB);
}

/// Relative resizes sent at once all count: each is applied to the size the
/// volume has when the server gets to it (they were computed by each client from
/// the size it had read, so that two "+4M" at once grew the volume by 4 MiB, and
/// both said they had).
#[test]
fn relative_resizes_at_once_all_count() {
    let t = TempDir::new("resize-race");
    let dir = small_array(&t, "16M");
    let s = Server::start(&dir);
    let outs: Vec<_> = std::thread::scope(|sc| {
        let grows: Vec<_> = (0..4)
            .map(|_| sc.spawn(|| resize(&dir, "+4M", &[])))
            .collect();
        let shrink = sc.spawn(|| resize(&dir, "-2M", &[]));
        grows
            .into_iter()
            .chain([shrink])
            .map(|h| h.join().unwrap())
            .collect()
    });
    for o in &outs {
        assert!(o.status.success(), "{o:?}");
    }
    assert_eq!(volume_size(&dir), (16 + 4 * 4 - 2) * MIB);
    // Each says what it did, from the size it found: the five steps chain.
    let mut steps: Vec<(String, String)> = outs
        .iter()
        .map(|o| {
            let line = String::from_utf8_lossy(&o.stdout).to_string();
            let (from, to) = line
                .trim()
                .split_once(" from ")
                .and_then(|(_, r)| r.split_once(" to "))
                .unwrap_or_else(|| panic!("{line}"));
            (from.to_string(), to.to_string())
        })
        .collect();
    let mut at = "16.0 MiB".to_string();
    while let Some(i) = steps.iter().position(|(from, _)| *from == at) {
        at = steps.swap_remove(i).1;
    }
    assert!(
        steps.is_empty(),
        "steps that do not chain: {steps:?} after {at}"
    );
    assert_eq!(at, "30.0 MiB");
    s.stop();
}

#[test]
fn offline_resize_to_petabytes_and_a_quick_delete() {
    let t = TempDir::new("resize-thin");
    let dir = small_array(&t, "16M");
    // Offline (no server): grow to 1 PiB, then write at its far end.
    let out = resize(&dir, "1P", &[]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(volume_size(&dir), 1 << 50);
    let s = Server::start(&dir);
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    assert_eq!(c.size, 1 << 50);
    let far = (1u64 << 50) / BS as u64 - 1;
    c.write(block(far), &pattern(far, 1), false).unwrap();
    c.write(block(7), &pattern(7, 1), false).unwrap();
    c.flush().unwrap();
    drop(c);
    s.stop();
    let s = Server::start(&dir);
    let mut c = Client::connect_unix(&s.sock, "v").unwrap();
    assert!(c.read(block(far), BS as u32).unwrap() == pattern(far, 1));
    // Trimming the whole unwritten petabyte is a walk over the pages that exist.
    let t0 = Instant::now();
    c.trim(block(8), (1u32 << 31) - BS as u32).unwrap();
    assert!(c.read(block(7), BS as u32).unwrap() == pattern(7, 1));
    drop(c);
    // A forced shrink back to 16 MiB discards the far block in one trim.
    let out = resize(&dir, "16M", &["--force"]);
    assert!(out.status.success(), "{out:?}");
    let out = lamina_output(&["volume", "delete", dir.to_str().unwrap(), "v"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "trim, shrink and delete of a thin petabyte took {:?}",
        t0.elapsed()
    );
    s.stop();
}

#[test]
fn volumes_are_renamed_online_with_their_settings() {
    let t = TempDir::new("rename");
    let dir = small_array(&t, "16M");
    let d = dir.to_str().unwrap();
    create_volume(&dir, "w", "16M");
    append_config(
        &dir,
        "# the web volume\n[engine.volumes.v]\niops_limit = 100000\n",
    );
    let cfg = dir.join("lamina.toml");
    let s = Server::start(&dir);
    let mut old = Client::connect_unix(&s.sock, "v").unwrap();
    old.write(0, &pattern(0, 1), false).unwrap();

    let out = lamina(&["volume", "rename", d, "v", "web.1"]);
    assert!(out.contains("lamina.toml"), "{out}");
    // The old connection goes on; new ones use the new name only.
    old.write(block(1), &pattern(1, 1), false).unwrap();
    old.flush().unwrap();
    assert!(Client::connect_unix(&s.sock, "v").is_err());
    let mut c = Client::connect_unix(&s.sock, "web.1").unwrap();
    assert!(c.read(block(1), BS as u32).unwrap() == pattern(1, 1));
    drop(c);
    // The section follows, quoted (a '.' would split a bare key), comment kept.
    let text = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        text.contains("# the web volume\n[engine.volumes.\"web.1\"]\niops_limit = 100000"),
        "{text}"
    );
    assert!(!text.contains("[engine.volumes.v]"), "{text}");
    let shown = lamina(&["volume", "qos", d, "web.1"]);
    assert!(shown.contains("requests 100000/s"), "{shown}");
    let names: Vec<String> = status_json(&dir)["volumes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(names, ["web.1", "w"]);

    // Refused: a name taken, a malformed name, a volume that is not there.
    for (args, why) in [
        (["web.1", "w"], "already exists"),
        (["web.1", "x?y"], "must be 1 to 64"),
        (["nope", "x"], "no volume named"),
    ] {
        let out = lamina_output(&["volume", "rename", d, args[0], args[1]]);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
    }
    drop(old);

    // Durable once the command returned; the renamed section applies at start.
    s.kill9();
    let s = Server::start(&dir);
    let mut c = Client::connect_unix(&s.sock, "web.1").unwrap();
    assert!(c.read(0, BS as u32).unwrap() == pattern(0, 1));
    drop(c);
    let shown = lamina(&["volume", "qos", d, "web.1"]);
    assert!(shown.contains("requests 100000/s"), "{shown}");
    s.stop();
    // Offline, and back.
    lamina(&["volume", "rename", d, "web.1", "v"]);
    assert!(std::fs::read_to_string(&cfg)
        .unwrap()
        .contains("[engine.volumes.v]\n"));
    let s = Server::start(&dir);
    assert!(Client::connect_unix(&s.sock, "v").is_ok());
    s.stop();
}
