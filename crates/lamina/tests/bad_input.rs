//! What bad input gets: an error reply or a message that says what is wrong; never
//! a panic, a hang, or silent damage.

mod common;
use common::*;
use lamina_nbd::client::{Client, ClientError};
use lamina_nbd::proto::*;
use lamina_testkit::{decode_pattern, pattern, BS};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

/// Reads until EOF (or error); true when the server closed the connection in time.
fn closed_by_server(s: &mut UnixStream) -> bool {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) => {
                return e.kind() != std::io::ErrorKind::WouldBlock
                    && e.kind() != std::io::ErrorKind::TimedOut
            }
        }
    }
}

fn hello(sock: &Path) -> UnixStream {
    let mut s = UnixStream::connect(sock).unwrap();
    let mut h = [0u8; 18];
    s.read_exact(&mut h).unwrap();
    assert_eq!(&h[..8], b"NBDMAGIC");
    assert_eq!(&h[8..16], b"IHAVEOPT");
    s
}

fn option(s: &mut UnixStream, opt: u32, data: &[u8]) {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&opt.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
}

fn option_reply(s: &mut UnixStream) -> (u32, u32, Vec<u8>) {
    let mut h = [0u8; 20];
    s.read_exact(&mut h).unwrap();
    assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), REPLY_MAGIC);
    let opt = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let rep = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d).unwrap();
    (opt, rep, d)
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

#[test]
fn malformed_handshakes_close_only_their_connection() {
    let t = TempDir::new("bad-hs");
    let dir = small_array(&t, "8M");
    let srv = Server::start(&dir);
    // Unknown client flags.
    let mut s = hello(&srv.sock);
    s.write_all(&0xffff_ffffu32.to_be_bytes()).unwrap();
    assert!(closed_by_server(&mut s));
    // Bad option magic.
    let mut s = hello(&srv.sock);
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    s.write_all(b"NOTMAGIC\0\0\0\x07\0\0\0\0").unwrap();
    assert!(closed_by_server(&mut s));
    // An option claiming 1 GiB of data: refused without reading (or allocating) it.
    let mut s = hello(&srv.sock);
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&OPT_GO.to_be_bytes());
    b.extend_from_slice(&(1u32 << 30).to_be_bytes());
    s.write_all(&b).unwrap();
    assert!(closed_by_server(&mut s));
    // Pure garbage, and a connection that just goes away.
    let mut s = UnixStream::connect(&srv.sock).unwrap();
    s.write_all(&[0x5a; 300]).unwrap();
    assert!(closed_by_server(&mut s));
    drop(UnixStream::connect(&srv.sock).unwrap());
    // A malformed GO (name length larger than the data) gets an error reply, and the
    // same connection can go on.
    let mut s = hello(&srv.sock);
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    option(&mut s, OPT_GO, &[0, 0, 0x10, 0, b'v', 0, 0]);
    assert_eq!(option_reply(&mut s).1, REP_ERR_INVALID);
    // Unknown export: NBD_REP_ERR_UNKNOWN with a message naming it.
    option(&mut s, OPT_GO, &go_data("nope"));
    let (_, rep, msg) = option_reply(&mut s);
    assert_eq!(rep, REP_ERR_UNKNOWN);
    assert!(String::from_utf8_lossy(&msg).contains("nope"));
    // Unsupported options are refused politely (11: the experimental extended
    // headers).
    option(&mut s, 11, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ERR_UNSUP);
    option(&mut s, 999, b"xyz");
    assert_eq!(option_reply(&mut s).1, REP_ERR_UNSUP);
    option(&mut s, OPT_LIST, b"junk");
    assert_eq!(option_reply(&mut s).1, REP_ERR_INVALID);
    option(&mut s, OPT_GO, &go_data("v"));
    let mut saw_ack = false;
    while !saw_ack {
        let (_, rep, _) = option_reply(&mut s);
        assert!(rep == REP_INFO || rep == REP_ACK, "reply {rep:#x}");
        saw_ack = rep == REP_ACK;
    }
    // The server still serves everyone.
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    c.write(0, &pattern(0, 1), false).unwrap();
    assert_eq!(decode_pattern(0, &c.read(0, BS as u32).unwrap()), Ok(1));
    // NBD_OPT_ABORT is acknowledged and the connection ends.
    let mut s = hello(&srv.sock);
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    option(&mut s, OPT_ABORT, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ACK);
    assert!(closed_by_server(&mut s));
    // NBD_OPT_EXPORT_NAME for an unknown export cannot carry an error: hang up.
    let mut s = hello(&srv.sock);
    s.write_all(&FLAG_C_FIXED_NEWSTYLE.to_be_bytes()).unwrap();
    option(&mut s, OPT_EXPORT_NAME, b"nope");
    assert!(closed_by_server(&mut s));
    // A long name in NBD_OPT_EXPORT_NAME for the real volume works (no-zeroes off).
    let mut s = hello(&srv.sock);
    s.write_all(&0u32.to_be_bytes()).unwrap();
    option(&mut s, OPT_EXPORT_NAME, b"v");
    let mut info = [0u8; 10 + 124];
    s.read_exact(&mut info).unwrap();
    assert_eq!(u64::from_be_bytes(info[..8].try_into().unwrap()), 8 << 20);
    srv.stop();
}

fn expect_errno(r: Result<Vec<u8>, ClientError>, errno: u32) {
    match r {
        Err(ClientError::Nbd(e)) => assert_eq!(e, errno),
        other => panic!("expected error {errno}, got {other:?}"),
    }
}

fn raw(
    c: &mut Client,
    kind: u16,
    flags: u16,
    offset: u64,
    len: u32,
    payload: &[u8],
) -> Result<Vec<u8>, ClientError> {
    let h = c.send(kind, flags, offset, len, payload)?;
    let r = c.recv()?;
    assert_eq!(r.handle, h);
    if r.error != 0 {
        Err(ClientError::Nbd(r.error))
    } else {
        Ok(r.data)
    }
}

#[test]
fn bad_requests_get_einval_and_the_connection_goes_on() {
    let t = TempDir::new("bad-req");
    let dir = small_array(&t, "8M");
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    let size = c.size;
    assert_eq!(size, 8 << 20);
    c.write(0, &pattern(0, 5), false).unwrap();
    // Past the end, overflowing, too long, unknown command, unknown or unnegotiated flags.
    expect_errno(raw(&mut c, CMD_READ, 0, size - 4096, 8192, &[]), EINVAL);
    expect_errno(raw(&mut c, CMD_READ, 0, u64::MAX - 100, 4096, &[]), EINVAL);
    expect_errno(raw(&mut c, CMD_READ, 0, 0, MAX_PAYLOAD + 4096, &[]), EINVAL);
    expect_errno(raw(&mut c, CMD_WRITE, 0, size, 4096, &[7u8; 4096]), EINVAL);
    let big = vec![1u8; MAX_PAYLOAD as usize + 4096];
    expect_errno(raw(&mut c, CMD_WRITE, 0, 0, big.len() as u32, &big), EINVAL);
    expect_errno(raw(&mut c, CMD_TRIM, 0, size - 4096, 8192, &[]), EINVAL);
    expect_errno(
        raw(&mut c, CMD_WRITE_ZEROES, 0, u64::MAX, 4096, &[]),
        EINVAL,
    );
    expect_errno(raw(&mut c, 42, 0, 0, 0, &[]), EINVAL);
    expect_errno(raw(&mut c, CMD_READ, 1 << 7, 0, 4096, &[]), EINVAL);
    expect_errno(raw(&mut c, CMD_READ, 1 << 2, 0, 4096, &[]), EINVAL); // DF without structured replies
    expect_errno(
        raw(&mut c, CMD_WRITE, CMD_FLAG_NO_HOLE, 0, 4096, &[0u8; 4096]),
        EINVAL,
    );
    expect_errno(raw(&mut c, CMD_FLUSH, 0, 4096, 0, &[]), EINVAL);
    // Nothing was damaged, and the connection still works.
    assert_eq!(decode_pattern(0, &c.read(0, 4096).unwrap()), Ok(5));
    // Zero-length requests are fine.
    assert!(c.read(4096, 0).unwrap().is_empty());
    c.write(4096, &[], false).unwrap();
    // Unaligned reads and writes, including across block boundaries.
    let mut expect = vec![0u8; 3 * BS];
    expect[..BS].copy_from_slice(&pattern(0, 5));
    let patch: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
    c.write(3000, &patch, false).unwrap();
    expect[3000..8000].copy_from_slice(&patch);
    assert_eq!(c.read(0, 3 * BS as u32).unwrap(), expect);
    assert_eq!(c.read(2999, 3).unwrap(), expect[2999..3002].to_vec());
    // Sub-block zeroing zeroes exactly the range.
    c.write_zeroes(4000, 300).unwrap();
    expect[4000..4300].fill(0);
    c.trim(8192, 4096).unwrap();
    expect[8192..].fill(0);
    c.flush().unwrap();
    assert_eq!(c.read(0, 3 * BS as u32).unwrap(), expect);
    // A request with a bad magic ends the connection; the server serves on.
    c.send(CMD_READ, 0, 0, 4096, &[]).unwrap();
    let _ = c.recv().unwrap();
    drop(c);
    let mut s = hello(&srv.sock);
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    option(&mut s, OPT_EXPORT_NAME, b"v");
    let mut info = [0u8; 10];
    s.read_exact(&mut info).unwrap();
    s.write_all(&[0xde; 28]).unwrap();
    assert!(closed_by_server(&mut s));
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    assert_eq!(c.read(0, 3 * BS as u32).unwrap(), expect);
    srv.stop();
    // Everything above survives a restart.
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    assert_eq!(c.read(0, 3 * BS as u32).unwrap(), expect);
    srv.stop();
}

/// A 64 MiB array in `t/arr` with a volume `v` four times larger (thin); returns
/// the directory and the usable bytes.
fn thin_array(t: &TempDir) -> (std::path::PathBuf, u64) {
    let dir = t.join("arr");
    let usable = create_array(
        &dir,
        "64M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", &(4 * usable / (1 << 20) * (1 << 20)).to_string());
    (dir, usable)
}

/// Writes blocks holding `pattern(lba, 1)` from `first` on, in chunks, until the
/// server answers ENOSPC (never past `usable` bytes); returns the blocks written.
fn fill_until_enospc(c: &mut Client, first: u64, usable: u64) -> u64 {
    let chunk = 256u64;
    let mut written = 0u64;
    let mut buf = vec![0u8; chunk as usize * BS];
    loop {
        for k in 0..chunk {
            lamina_testkit::fill_pattern(
                first + written + k,
                1,
                &mut buf[k as usize * BS..(k as usize + 1) * BS],
            );
        }
        match c.write((first + written) * BS as u64, &buf, false) {
            Ok(()) => written += chunk,
            Err(ClientError::Nbd(e)) => {
                assert_eq!(e, ENOSPC, "out of space must be ENOSPC");
                return written;
            }
            Err(e) => panic!("{e}"),
        }
        assert!(
            written * (BS as u64) <= usable,
            "wrote more than the usable capacity"
        );
    }
}

#[test]
fn thin_array_out_of_space_gets_enospc_and_keeps_data() {
    let t = TempDir::new("enospc");
    // Thin provisioning: the volume is four times larger than the array.
    let (dir, usable) = thin_array(&t);
    let d = dir.to_str().unwrap();
    // Another volume: creating it warns that the volumes promise more than there is.
    let out = lamina_output(&["volume", "create", d, "w", "--size", "16M"]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("thin provisioning") && err.contains("x the usable"),
        "{err}"
    );
    // With a limit on the overcommit, one that goes beyond it is refused.
    let cfg_path = dir.join("lamina.toml");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        cfg.replace("[engine]\n", "[engine]\nmax_overcommit = 4.5\n"),
    )
    .unwrap();
    let out = lamina_output(&["volume", "create", d, "x", "--size", "64M"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("above max_overcommit = 4.5"), "{err}");
    let st = status_json(&dir);
    assert_eq!(st["space_state"], "ok", "{st}");
    assert!(
        st["promised_bytes"].as_u64().unwrap()
            > 4 * st["usable_bytes"].as_u64().unwrap() - (8 << 20)
    );
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    let written = fill_until_enospc(&mut c, 0, usable);
    assert!(
        written * BS as u64 > usable / 2,
        "ENOSPC came too early: {written} blocks of {usable} bytes"
    );
    // Full is said in the status, the metrics and the log (warning, critical or
    // full, and the refused writes), not left to the client's error.
    let st = status_json(&dir);
    let state = st["space_state"].as_str().unwrap().to_string();
    assert!(state == "critical" || state == "full", "{st}");
    assert!(st["writes_refused_nospace"].as_u64().unwrap() >= 1, "{st}");
    let text = lamina(&["status", d]);
    assert!(text.contains("CRITICAL") || text.contains("FULL"), "{text}");
    let prom = lamina(&["status", d, "--prometheus"]);
    assert!(
        prom.lines()
            .any(|l| l.starts_with("lamina_space_state{")
                && (l.ends_with(" 2") || l.ends_with(" 3"))),
        "{prom}"
    );
    let log_says_one_of = |needles: &[&str]| {
        let t0 = std::time::Instant::now();
        loop {
            let log = std::fs::read_to_string(dir.join("lamina.log")).unwrap_or_default();
            if needles.iter().any(|n| log.contains(n)) {
                return;
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(10),
                "{needles:?} not in:\n{log}"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    let log_says = |needle: &str| log_says_one_of(&[needle]);
    // (The engine looks every 10 ms: a fast fill crosses several thresholds at
    // once, and the highest is what is logged.)
    log_says_one_of(&[
        "above the warning threshold of 80%",
        "above the critical threshold of 95%",
        "the array is full",
    ]);
    log_says("writes refused with ENOSPC");
    // Nothing already written is damaged.
    c.flush().unwrap();
    for lba in (0..written).step_by(97) {
        assert_eq!(
            decode_pattern(lba, &c.read(lba * BS as u64, BS as u32).unwrap()),
            Ok(1),
            "block {lba}"
        );
    }
    // Overwrites of mapped blocks still work when full; trimming frees space.
    c.write(0, &pattern(0, 2), false).unwrap();
    c.trim(0, (written / 2 * BS as u64) as u32).unwrap();
    c.write(written * BS as u64, &pattern(written, 3), false)
        .expect("space after a trim");
    c.flush().unwrap();
    log_says("below the warning threshold again");
    assert_eq!(status_json(&dir)["space_state"], "ok");
    assert_eq!(
        decode_pattern(written, &c.read(written * BS as u64, BS as u32).unwrap()),
        Ok(3)
    );
    srv.stop();
}

#[test]
fn damaged_metadata_is_named() {
    let t = TempDir::new("damage");
    let dir = small_array(&t, "8M");
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    c.write(0, &pattern(0, 4), true).unwrap();
    drop(c);
    srv.stop();
    let dev = dir.join("dev.img");
    let poke = |off: u64| {
        let f = std::fs::OpenOptions::new().write(true).open(&dev).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[0xa5; 64], off).unwrap();
    };
    // The checkpoint: find its first payload block from the superblock.
    let mut sbuf = vec![0u8; BS];
    let f = std::fs::File::open(&dev).unwrap();
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut sbuf, 0).unwrap();
    let sb = lamina_format::superblock::Superblock::decode(&sbuf).unwrap();
    let geo = lamina_core::geometry::Geometry::from_superblock(&sb);
    let cref = sb.checkpoint.unwrap();
    let (_, off) = geo.locate(
        lamina_core::SegmentId(cref.first_segment),
        geo.header_blocks as u32,
    );
    // One damaged superblock copy: the other is used.
    poke(100);
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    assert_eq!(decode_pattern(0, &c.read(0, 4096).unwrap()), Ok(4));
    drop(c);
    srv.stop();
    // Restarting rewrote the superblocks and the checkpoint; damage the new checkpoint.
    std::os::unix::fs::FileExt::read_exact_at(&f, &mut sbuf, 0).unwrap();
    let sb = lamina_format::superblock::Superblock::decode(&sbuf).unwrap();
    let cref = sb.checkpoint.unwrap();
    let (_, off2) = geo.locate(
        lamina_core::SegmentId(cref.first_segment),
        geo.header_blocks as u32,
    );
    let _ = off;
    poke(off2 + 100);
    let out = lamina_output(&[
        "serve",
        dir.to_str().unwrap(),
        "--unix",
        dir.join("nbd.sock").to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("checkpoint"),
        "the message must name the checkpoint: {err}"
    );
    // Both superblock copies damaged.
    poke(100);
    poke(256 * 1024 + 100);
    let out = lamina_output(&["status", dir.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("superblock"),
        "the message must name the superblock: {err}"
    );
}

#[test]
fn bad_configuration_and_commands_get_clear_messages() {
    let t = TempDir::new("bad-cfg");
    let dir = small_array(&t, "8M");
    let d = dir.to_str().unwrap();
    let cfg_path = dir.join("lamina.toml");
    let good = std::fs::read_to_string(&cfg_path).unwrap();
    // Exits with `code` (1: failure, 2: bad usage) and says `needle`.
    let exits = |code: i32, args: &[&str], needle: &str| {
        let out = lamina_output(args);
        assert_eq!(out.status.code(), Some(code), "lamina {args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle),
            "lamina {args:?}: expected {needle:?} in: {err}"
        );
    };
    let fails_with = |args: &[&str], needle: &str| exits(1, args, needle);
    // A size the command line gets wrong is bad usage: exit 2, as the README says.
    let usage = |args: &[&str], needle: &str| exits(2, args, needle);
    std::fs::write(&cfg_path, format!("{good}\nbogus_key = 1\n")).unwrap();
    fails_with(&["status", d], "bogus_key");
    std::fs::write(
        &cfg_path,
        good.replace("[engine]", "[engine]\ngc_policy = \"magic\""),
    )
    .unwrap();
    fails_with(&["status", d], "gc_policy");
    for (key, value) in [("io_engine", "fast"), ("direct_io", "maybe")] {
        std::fs::write(
            &cfg_path,
            good.replace("[engine]", &format!("[engine]\n{key} = \"{value}\"")),
        )
        .unwrap();
        fails_with(
            &["status", d],
            &format!("[engine] {key} = \"{value}\": give"),
        );
    }
    std::fs::write(&cfg_path, "devices = [\"/nonexistent/lamina.img\"]\n").unwrap();
    fails_with(&["status", d], "/nonexistent/lamina.img: cannot be opened");
    std::fs::write(&cfg_path, "devices = [").unwrap();
    fails_with(&["status", d], "lamina.toml");
    std::fs::write(&cfg_path, &good).unwrap();
    // Volume requests.
    fails_with(
        &["volume", "create", d, "v", "--size", "1M"],
        "already exists",
    );
    fails_with(
        &["volume", "create", d, "w", "--size", "1000"],
        "multiple of 4096",
    );
    usage(
        &["volume", "create", d, "w", "--size", "12Q"],
        "invalid size",
    );
    // Snapshots, clones and rollbacks (offline here): each refusal names why.
    fails_with(
        &["volume", "snapshot", d, "nope", "s"],
        "no volume named \"nope\"",
    );
    fails_with(&["volume", "snapshot", d, "v", "v"], "already exists");
    fails_with(&["volume", "snapshot", d, "v", "a b"], "volume name");
    fails_with(
        &["volume", "clone", d, "nope", "c"],
        "no volume named \"nope\"",
    );
    fails_with(
        &["volume", "rollback", d, "v", "nope"],
        "no volume named \"nope\"",
    );
    lamina(&["volume", "snapshot", d, "v", "s1"]);
    lamina(&["volume", "clone", d, "s1", "c1"]);
    fails_with(
        &["volume", "rollback", d, "v", "c1"],
        "is not a snapshot of volume \"v\"",
    );
    lamina(&["volume", "snapshot", d, "s1", "s2"]);
    fails_with(
        &["volume", "rollback", d, "s1", "s2"],
        "\"s1\" is a snapshot",
    );
    lamina(&["volume", "delete", d, "s2"]);
    fails_with(
        &["volume", "resize", d, "s1", "--size", "16M"],
        "is a snapshot",
    );
    fails_with(&["volume", "delete", d, "v"], "delete them first");
    fails_with(&["volume", "delete", d, "s1"], "\"c1\"");
    for name in ["c1", "s1"] {
        lamina(&["volume", "delete", d, name]);
    }
    // 10^10 or 10 GiB? Not guessed.
    usage(
        &["volume", "create", d, "w", "--size", "10GB"],
        "write 10G or 10GiB",
    );
    let fresh = t.join("fresh");
    let (f, dev) = (
        fresh.to_str().unwrap(),
        format!("{}/d.img:64M", fresh.display()),
    );
    usage(
        &[
            "array",
            "create",
            f,
            "--device",
            &dev,
            "--segment-size",
            "1X",
        ],
        "segment size",
    );
    usage(
        &[
            "array",
            "create",
            f,
            "--device",
            &dev,
            "--write-unit",
            "1000",
        ],
        "multiple of 4 KiB",
    );
    usage(&["serve", "--default-size", "8GB"], "--default-size");
    assert!(
        !fresh.join("lamina.toml").exists(),
        "a refused create left a config"
    );
    fails_with(&["volume", "delete", d, "nope"], "no volume named");
    // Names that would break an NBD URI, qemu's nbd: syntax or a command line.
    for bad in ["a b", "x?y", "x#y", "50%", "a:b", ".hidden", "ä", "a/b", ""] {
        fails_with(
            &["volume", "create", d, bad, "--size", "1M"],
            "letters, digits",
        );
    }
    // Array creation: nothing is written when the input is wrong.
    let other = t.join("other");
    let dev = dir.join("dev.img");
    let before = std::fs::read(&dev).unwrap();
    let o = other.to_str().unwrap();
    fails_with(
        &["array", "create", o, "--device", dev.to_str().unwrap()],
        "already belongs",
    );
    let x = t.join("x.img");
    let xs = format!("{}:64M", x.display());
    fails_with(
        &["array", "create", o, "--device", &xs, "--device", &xs],
        "listed twice",
    );
    fails_with(
        &[
            "array",
            "create",
            o,
            "--device",
            &format!("{}:2M", t.join("tiny.img").display()),
        ],
        "too small",
    );
    fails_with(
        &["array", "create", o, "--device", &xs, "--layout", "said5"],
        "said5 needs at least 3 devices, 1 given",
    );
    let ys: Vec<String> = (0..3)
        .map(|i| format!("{}:64M", t.join(&format!("y{i}.img")).display()))
        .collect();
    fails_with(
        &[
            "array", "create", o, "--layout", "said6", "--device", &ys[0], "--device", &ys[1],
            "--device", &ys[2],
        ],
        "said6 needs at least 4 devices, 3 given",
    );
    assert!(
        !t.join("y0.img").exists(),
        "a refused create leaves no files behind"
    );
    // Failing or replacing members: clear refusals.
    fails_with(
        &["array", "fail", d, "--device", "0"],
        "JBOD array has no redundancy",
    );
    usage(
        &["array", "replace", d, "--old", "7", "--new", &xs],
        "no member 7",
    );
    fails_with(
        &["array", "create", o, "--device", &xs, "--overprovision=-1"],
        "over-provisioning",
    );
    usage(
        &[
            "array",
            "create",
            o,
            "--device",
            &xs,
            "--segment-size",
            "5000",
        ],
        "multiple of 4 KiB",
    );
    fails_with(
        &[
            "array",
            "create",
            o,
            "--device",
            t.join("missing.img").to_str().unwrap(),
        ],
        "PATH:SIZE",
    );
    assert!(
        std::fs::read(&dev).unwrap() == before,
        "a refused create must not touch the device"
    );
    assert!(
        !x.exists() && !t.join("tiny.img").exists(),
        "refused creates leave no files behind"
    );
    fails_with(
        &["serve", t.path().to_str().unwrap()],
        "holds no Lamina array",
    );
    // Usage errors exit with 2.
    assert_eq!(lamina_output(&["frobnicate"]).status.code(), Some(2));
    assert_eq!(lamina_output(&["array", "create"]).status.code(), Some(2));
}

/// A device that starts failing: writes and flushes get EIO, and the array stops
/// accepting writes with a reason that `lamina status` shows.
#[test]
fn device_errors_become_eio() {
    if !need(
        "bad_input::device_errors_become_eio",
        &["nbdkit", "nbdfuse", "fusermount3"],
        true,
    ) {
        return;
    }
    let t = TempDir::new("eio");
    let mut guard = Guard::new();
    let trigger = t.join("fail-now");
    let error_file = format!("error-file={}", trigger.display());
    let (kit, nbdfuse, dev) = nbdkit_as_file(
        &t,
        &[
            "--filter=error",
            "memory",
            "128M",
            "error=EIO",
            "error-rate=100%",
            &error_file,
        ],
    );
    guard.children.push(kit);
    guard.children.push(nbdfuse);
    guard.mounts.push(t.join("fuse"));
    let dir = t.join("arr");
    lamina(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--device",
        dev.to_str().unwrap(),
        "--segment-size",
        "1M",
        "--write-unit",
        "128K",
    ]);
    create_volume(&dir, "v", "16M");
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    c.write(0, &pattern(0, 1), false).unwrap();
    c.flush().unwrap();
    std::fs::write(&trigger, b"").unwrap();
    let mut saw_eio = false;
    for i in 0..64u64 {
        let w = c.write(i * 4096, &pattern(i, 2), false);
        let f = c.flush();
        if matches!(w, Err(ClientError::Nbd(EIO))) || matches!(f, Err(ClientError::Nbd(EIO))) {
            saw_eio = true;
            break;
        }
    }
    assert!(saw_eio, "a failing device must surface as EIO");
    let st = status_json(&dir);
    assert!(
        st["failed"].as_str().is_some_and(|f| !f.is_empty()),
        "status must say the array failed: {st}"
    );
    drop(c);
    drop(srv);
}

/// A client that disconnects in the middle of a write payload, or with requests
/// still outstanding, leaves nothing stuck: the server keeps serving.
#[test]
fn disconnects_mid_request_leave_nothing_stuck() {
    let t = TempDir::new("disconnect");
    let dir = small_array(&t, "8M");
    let srv = Server::start(&dir);
    for _ in 0..5 {
        let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
        // Header of a 1 MiB write, then only half the payload.
        c.send(CMD_WRITE, 0, 0, 1 << 20, &vec![3u8; 1 << 19])
            .unwrap();
        c.push().unwrap();
        drop(c);
        let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
        for i in 0..64 {
            c.send(CMD_WRITE, 0, i * 4096, 4096, &[1u8; 4096]).unwrap();
        }
        c.send(CMD_FLUSH, 0, 0, 0, &[]).unwrap();
        c.push().unwrap();
        drop(c);
    }
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    c.write(0, &pattern(0, 8), true).unwrap();
    assert_eq!(decode_pattern(0, &c.read(0, 4096).unwrap()), Ok(8));
    drop(c);
    srv.stop();
}

/// Resident memory of a process, from /proc.
fn rss_bytes(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// Memory follows what is stored, not what a client names: huge thin volumes on a
/// 1 GiB array, the lamina classifier, writes at the far end of each. The first of
/// these writes used to abort the server (a per-block array sized by the highest LBA
/// written); creating the 100 TiB volume used to abort the CLI (the map was reserved
/// by virtual size).
#[test]
fn huge_thin_volumes_cost_memory_for_what_is_written() {
    let t = TempDir::new("huge");
    let dir = t.join("arr");
    create_array(&dir, "1G", &[]);
    let cfg_path = dir.join("lamina.toml");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    assert!(cfg.contains("\n[engine]\n"));
    let cfg = cfg.replace("\n[engine]\n", "\n[engine]\nclassifier = \"lamina\"\n");
    std::fs::write(&cfg_path, cfg).unwrap();
    let t0 = std::time::Instant::now();
    create_volume(&dir, "big", "16T");
    create_volume(&dir, "huge", "100T");
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "creating huge thin volumes took {:?}",
        t0.elapsed()
    );
    let srv = Server::start(&dir);
    let idle = rss_bytes(srv.pid());
    for (name, size) in [("big", 16u64 << 40), ("huge", 100u64 << 40)] {
        let mut c = Client::connect_unix(&srv.sock, name).unwrap();
        assert_eq!(c.size, size);
        let blocks = size / BS as u64;
        let lbas = [blocks - 1, blocks - 4096, blocks / 2 + 17, blocks / 3, 5];
        for (i, &lba) in lbas.iter().enumerate() {
            c.write(lba * BS as u64, &pattern(lba, i as u64 + 1), false)
                .unwrap();
            // Overwritten once: the classifier keeps state for the block.
            c.write(lba * BS as u64, &pattern(lba, i as u64 + 2), false)
                .unwrap();
        }
        c.flush().unwrap();
        for (i, &lba) in lbas.iter().enumerate() {
            assert_eq!(
                decode_pattern(lba, &c.read(lba * BS as u64, BS as u32).unwrap()),
                Ok(i as u64 + 2),
                "{name} block {lba}"
            );
        }
        assert!(c
            .read(BS as u64 * 1000, BS as u32)
            .unwrap()
            .iter()
            .all(|&b| b == 0));
    }
    let grown = rss_bytes(srv.pid()).saturating_sub(idle);
    assert!(
        grown < 64 << 20,
        "ten blocks written to thin volumes grew the server by {grown} bytes"
    );
    // Restart: start-up does not walk the virtual size, and the blocks are there.
    srv.stop();
    let t0 = std::time::Instant::now();
    let srv = Server::start(&dir);
    assert!(
        t0.elapsed() < Duration::from_secs(20),
        "restart took {:?}",
        t0.elapsed()
    );
    let mut c = Client::connect_unix(&srv.sock, "huge").unwrap();
    let last = (100u64 << 40) / BS as u64 - 1;
    assert_eq!(
        decode_pattern(last, &c.read(last * BS as u64, BS as u32).unwrap()),
        Ok(2)
    );
    srv.stop();
    // Beyond the map's limit: a clear refusal, not an abort.
    let out = lamina_output(&[
        "volume",
        "create",
        dir.to_str().unwrap(),
        "x",
        "--size",
        "32768T",
    ]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("too large"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// WRITE_ZEROES with NBD_CMD_FLAG_NO_HOLE keeps the range allocated: on a thin
/// array filled to ENOSPC afterwards, writes into that range still succeed (the
/// flag used to be dropped and the range unmapped). Without the flag the range is
/// unmapped and holds no space; with FAST_ZERO as well, the server says ENOTSUP
/// (allocated zeroes are no faster than a write).
#[test]
fn write_zeroes_no_hole_keeps_space_allocated() {
    let t = TempDir::new("nohole");
    let (dir, usable) = thin_array(&t);
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    let live = |dir: &Path| status_json(dir)["live_bytes"].as_u64().unwrap();
    let region = 4u64 << 20;
    c.write(0, &pattern(0, 1), false).unwrap();
    c.flush().unwrap();
    let before = live(&dir);
    // Plain WRITE_ZEROES: unmapped, no space held.
    c.write_zeroes(0, region as u32).unwrap();
    c.flush().unwrap();
    assert!(live(&dir) < before, "plain zeroes unmap");
    // NO_HOLE: the whole region (unaligned edges included) is allocated.
    c.write_zeroes_flags(BS as u64 / 2, (region - BS as u64) as u32, CMD_FLAG_NO_HOLE)
        .unwrap();
    c.flush().unwrap();
    assert_eq!(live(&dir), region, "NO_HOLE allocates the range");
    assert!(c.read(0, region as u32).unwrap().iter().all(|&b| b == 0));
    assert_eq!(
        c.write_zeroes_flags(0, BS as u32, CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO)
            .err()
            .map(|e| matches!(e, ClientError::Nbd(ENOTSUP))),
        Some(true)
    );
    // Fill the rest of the array until ENOSPC...
    fill_until_enospc(&mut c, region / BS as u64, usable);
    // ...and the allocated region still takes writes.
    for l in (0..region / BS as u64).step_by(61) {
        c.write(l * BS as u64, &pattern(l, 7), false)
            .unwrap_or_else(|e| panic!("write into the NO_HOLE range at block {l}: {e}"));
    }
    c.flush().unwrap();
    assert_eq!(
        decode_pattern(61, &c.read(61 * BS as u64, BS as u32).unwrap()),
        Ok(7)
    );
    drop(c);
    srv.stop();
}
