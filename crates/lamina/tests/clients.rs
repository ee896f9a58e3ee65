//! Other real NBD clients: nbdinfo (what is advertised, the allocation map), nbdcopy
//! (multi-conn copies, sparse copies), qemu-img (compare, map, convert).

mod common;
use common::*;

#[test]
fn nbdinfo_reports_what_lamina_advertises() {
    if !need(
        "clients::nbdinfo_reports_what_lamina_advertises",
        &["nbdinfo"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("nbdinfo");
    let dir = t.join("arr");
    create_array(
        &dir,
        "128M",
        &["--segment-size", "1M", "--write-unit", "256K"],
    );
    create_volume(&dir, "alpha", "16M");
    create_volume(&dir, "beta", "8M");
    let s = Server::start(&dir);
    let info: serde_json::Value =
        serde_json::from_str(&run("nbdinfo", &["--json", &s.uri("beta")])).unwrap();
    let e = &info["exports"][0];
    assert_eq!(e["export-size"], 8 << 20);
    assert_eq!(e["can_multi_conn"], true);
    assert_eq!(e["can_flush"], true);
    assert_eq!(e["can_fua"], true);
    assert_eq!(e["can_trim"], true);
    assert_eq!(e["can_zero"], true);
    assert_eq!(e["block_size_preferred"], 4096);
    // NBD_OPT_LIST lists every volume; the empty name is the first volume.
    let list = run("nbdinfo", &["--list", &s.uri("")]);
    assert!(list.contains("alpha") && list.contains("beta"), "{list}");
    let default: serde_json::Value =
        serde_json::from_str(&run("nbdinfo", &["--json", &s.uri("")])).unwrap();
    assert_eq!(default["exports"][0]["export-size"], 16 << 20);
    s.stop();
}

#[test]
fn nbdcopy_in_and_out_and_qemu_img_compare() {
    if !need(
        "clients::nbdcopy_in_and_out_and_qemu_img_compare",
        &["nbdcopy", "qemu-img"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("nbdcopy");
    let dir = t.join("arr");
    create_array(
        &dir,
        "256M",
        &["--segment-size", "1M", "--write-unit", "256K"],
    );
    create_volume(&dir, "v", "64M");
    let s = Server::start(&dir);
    // Random data with holes: zero runs exercise NBD_CMD_WRITE_ZEROES / TRIM.
    let src = t.join("src.raw");
    let mut data = vec![0u8; 64 << 20];
    let mut x = 0x1234_5678_9abc_def0u64;
    for (i, chunk) in data.chunks_mut(8).enumerate() {
        if (i / 8192) % 3 == 1 {
            continue;
        }
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    std::fs::write(&src, &data).unwrap();
    // nbdcopy uses several connections when the server offers multi-conn.
    run(
        "nbdcopy",
        &["--connections=4", src.to_str().unwrap(), &s.uri("v")],
    );
    let back = t.join("back.raw");
    run("nbdcopy", &[&s.uri("v"), back.to_str().unwrap()]);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "nbdcopy round trip differs"
    );
    let qemu_uri = format!("nbd:unix:{}:exportname=v", s.sock.display());
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().unwrap(),
            &qemu_uri,
        ],
    );
    s.stop();
    // And after a restart.
    let s = Server::start(&dir);
    run(
        "qemu-img",
        &[
            "compare",
            "-f",
            "raw",
            "-F",
            "raw",
            src.to_str().unwrap(),
            &format!("nbd:unix:{}:exportname=v", s.sock.display()),
        ],
    );
    s.stop();
}

/// The allocated ranges (byte start, end) of a volume after the writes, trims and
/// zeroes of `block_status_seen_by_nbdinfo_and_qemu_img`, block by block.
const ALLOCATED: [(u64, u64); 6] = [
    (0, 256 << 10),
    (512 << 10, 1 << 20),
    (10 << 20, (10 << 20) + 4096),
    (20 << 20, (20 << 20) + (64 << 10)),
    ((20 << 20) + (72 << 10), 22 << 20),
    (40 << 20, (40 << 20) + (64 << 10)),
];

/// Merges `(start, length, allocated)` entries into the allocated ranges, checking
/// they cover `size` bytes from 0 without gaps.
fn allocated_ranges(entries: &[(u64, u64, bool)], size: u64) -> Vec<(u64, u64)> {
    let mut at = 0;
    let mut out: Vec<(u64, u64)> = Vec::new();
    for &(start, len, alloc) in entries {
        assert_eq!(start, at, "map has a gap or overlap at {at}: {entries:?}");
        at += len;
        if alloc {
            match out.last_mut() {
                Some(last) if last.1 == start => last.1 = at,
                _ => out.push((start, at)),
            }
        }
    }
    assert_eq!(at, size, "map covers {at} of {size} bytes");
    out
}

/// NBD_CMD_BLOCK_STATUS (`base:allocation`) through the clients that use it: what
/// was written is data, what was never written, trimmed or zeroed without NO_HOLE
/// is a hole that reads as zeros, zeroes written with NO_HOLE stay allocated; the
/// map is the same after a restart; nbdcopy and qemu-img convert make sparse copies
/// with the volume's contents.
#[test]
fn block_status_seen_by_nbdinfo_and_qemu_img() {
    if !need(
        "clients::block_status_seen_by_nbdinfo_and_qemu_img",
        &["nbdinfo", "nbdcopy", "qemu-img"],
        false,
    ) {
        return;
    }
    use lamina_nbd::proto::CMD_FLAG_NO_HOLE;
    let t = TempDir::new("block-status");
    let dir = t.join("arr");
    create_array(
        &dir,
        "256M",
        &["--segment-size", "1M", "--write-unit", "256K"],
    );
    create_volume(&dir, "v", "64M");
    let size = 64u64 << 20;
    let s = Server::start(&dir);
    let mut model = vec![0u8; size as usize];
    let mut c = lamina_nbd::client::Client::connect_unix(&s.sock, "v").unwrap();
    for (off, len) in [(0u64, 1usize << 20), (10 << 20, 4096), (20 << 20, 2 << 20)] {
        let data = noise(off, len);
        for (i, chunk) in data.chunks(1 << 20).enumerate() {
            c.write(off + (i << 20) as u64, chunk, false).unwrap();
        }
        model[off as usize..off as usize + len].copy_from_slice(&data);
    }
    c.trim(256 << 10, 256 << 10).unwrap();
    c.write_zeroes((20 << 20) + (64 << 10), 8192).unwrap();
    c.write_zeroes_flags(40 << 20, 64 << 10, CMD_FLAG_NO_HOLE)
        .unwrap();
    for (off, len) in [
        (256usize << 10, 256usize << 10),
        ((20 << 20) + (64 << 10), 8192),
    ] {
        model[off..off + len].fill(0);
    }
    c.flush().unwrap();
    c.disconnect().unwrap();

    let check_maps = |s: &Server| {
        let info = run("nbdinfo", &["--json", &s.uri("v")]);
        let info: serde_json::Value = serde_json::from_str(&info).unwrap();
        let e = &info["exports"][0];
        assert_eq!(e["can_cache"], true, "{e}");
        assert_eq!(e["can_df"], true, "{e}");
        assert_eq!(e["contexts"][0], "base:allocation", "{e}");
        let map: serde_json::Value =
            serde_json::from_str(&run("nbdinfo", &["--map", "--json", &s.uri("v")])).unwrap();
        let entries: Vec<(u64, u64, bool)> = map
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let kind = m["type"].as_u64().unwrap();
                // 0: data; 3: hole that reads as zeros; nothing else is reported.
                assert!(kind == 0 || kind == 3, "{m}");
                (
                    m["offset"].as_u64().unwrap(),
                    m["length"].as_u64().unwrap(),
                    kind == 0,
                )
            })
            .collect();
        assert_eq!(allocated_ranges(&entries, size), ALLOCATED, "nbdinfo --map");
        let qemu_uri = format!("nbd:unix:{}:exportname=v", s.sock.display());
        let map: serde_json::Value = serde_json::from_str(&run(
            "qemu-img",
            &["map", "--output=json", "-f", "raw", &qemu_uri],
        ))
        .unwrap();
        let entries: Vec<(u64, u64, bool)> = map
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let data = m["data"].as_bool().unwrap();
                assert_eq!(m["zero"].as_bool().unwrap(), !data, "{m}");
                (
                    m["start"].as_u64().unwrap(),
                    m["length"].as_u64().unwrap(),
                    data,
                )
            })
            .collect();
        assert_eq!(allocated_ranges(&entries, size), ALLOCATED, "qemu-img map");
    };
    check_maps(&s);
    s.stop();
    let s = Server::start(&dir);
    check_maps(&s);

    // Sparse copies out, with the volume's contents.
    let allocated: u64 = ALLOCATED.iter().map(|(a, b)| b - a).sum();
    let copies = [
        ("nbdcopy", t.join("nbdcopy.raw")),
        ("qemu-img", t.join("convert.raw")),
    ];
    for (tool, out) in &copies {
        let out_s = out.to_str().unwrap();
        match *tool {
            "nbdcopy" => run("nbdcopy", &[&s.uri("v"), out_s]),
            _ => run(
                "qemu-img",
                &[
                    "convert",
                    "-f",
                    "raw",
                    "-O",
                    "raw",
                    &format!("nbd:unix:{}:exportname=v", s.sock.display()),
                    out_s,
                ],
            ),
        };
        assert!(std::fs::read(out).unwrap() == model, "{tool} copy differs");
        use std::os::unix::fs::MetadataExt;
        let used = std::fs::metadata(out).unwrap().blocks() * 512;
        assert!(
            used <= allocated + (1 << 20),
            "{tool} copy takes {used} bytes for {allocated} allocated"
        );
    }
    s.stop();
}

/// Prometheus metrics: over HTTP from a running server, and from `status --prometheus`.
#[test]
fn prometheus_metrics() {
    use std::io::{Read, Write};
    let t = TempDir::new("metrics");
    let dir = t.join("arr");
    create_array(
        &dir,
        "64M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", "8M");
    let array = array_name(&dir);
    // Find a free port, then hand it to the server.
    let port = free_port();
    let metrics = format!("127.0.0.1:{port}");
    let srv = Server::start_with(&dir, &[], &["--metrics", &metrics]);
    let sock = srv.sock.clone();
    let scrape = || scrape(port);
    let value = |body: &str, name: &str, labels: &str| sample(body, &array, name, labels);
    let mut c = lamina_nbd::client::Client::connect_unix(&sock, "v").unwrap();
    c.write(0, &[7u8; 8192], true).unwrap();
    for i in 0..5u64 {
        c.write(i * 4096, &[1u8; 4096], false).unwrap();
        c.read(i * 4096, 4096).unwrap();
    }
    c.trim(1 << 20, 65536).unwrap();
    c.flush().unwrap();
    assert!(c.read(8 << 20, 4096).is_err(), "beyond the end");
    let body = scrape();
    assert_eq!(
        value(&body, "user_bytes_written_total", ""),
        8192.0 + 5.0 * 4096.0
    );
    assert_eq!(
        value(&body, "volume_live_bytes", ",volume=\"v\""),
        5.0 * 4096.0
    );
    assert_eq!(
        value(&body, "volume_size_bytes", ",volume=\"v\""),
        (8 << 20) as f64
    );
    assert_eq!(
        value(&body, "member_rebuild_progress_ratio", ",member=\"0\""),
        1.0
    );
    assert_eq!(value(&body, "nbd_connections", ""), 1.0);
    // HEAD: GET's headers, its length included, and no body; other methods and
    // paths are refused.
    let ask = |req: &[u8]| {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.write_all(req).unwrap();
        let mut answer = String::new();
        s.read_to_string(&mut answer).unwrap();
        answer
    };
    let head = ask(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
    let (headers, rest) = head.split_once("\r\n\r\n").unwrap();
    assert!(
        headers.starts_with("HTTP/1.1 200") && rest.is_empty(),
        "{head}"
    );
    let length: usize = headers
        .lines()
        .find_map(|l| l.strip_prefix("Content-Length: "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(length > 1000, "{headers}");
    assert!(ask(b"POST /metrics HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    assert!(ask(b"GET /other HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 404"));
    assert!(ask(b"hello\r\n\r\n").starts_with("HTTP/1.1 400"));
    // OpenMetrics: typed families (a counter's samples end in _total), one # EOF.
    assert!(
        body.contains("Content-Type: application/openmetrics-text"),
        "{body}"
    );
    assert!(body.contains("# TYPE lamina_user_bytes_written counter\n"));
    assert!(body.ends_with("# EOF\n") && body.matches("# EOF").count() == 1);
    let op = |o: &str| format!(",volume=\"v\",op=\"{o}\"");
    assert_eq!(value(&body, "nbd_requests_total", &op("write")), 6.0);
    assert_eq!(
        value(&body, "nbd_request_bytes_total", &op("write")),
        8192.0 + 5.0 * 4096.0
    );
    assert_eq!(value(&body, "nbd_requests_total", &op("read")), 6.0);
    assert_eq!(value(&body, "nbd_request_errors_total", &op("read")), 1.0);
    assert_eq!(
        value(&body, "nbd_request_bytes_total", &op("read")),
        5.0 * 4096.0
    );
    assert_eq!(value(&body, "nbd_requests_total", &op("trim")), 1.0);
    assert_eq!(
        value(&body, "nbd_request_bytes_total", &op("trim")),
        65536.0
    );
    assert_eq!(value(&body, "nbd_requests_total", &op("flush")), 1.0);
    // The histogram: buckets never go down, and +Inf holds every request.
    let mut last = 0.0;
    for line in body.lines().filter(|l| {
        l.starts_with("lamina_nbd_request_duration_seconds_bucket") && l.contains("op=\"write\"")
    }) {
        let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!(v >= last, "{line}");
        last = v;
    }
    assert_eq!(last, 6.0);
    let d = "nbd_request_duration_seconds";
    assert_eq!(value(&body, &format!("{d}_count"), &op("write")), 6.0);
    assert!(value(&body, &format!("{d}_sum"), &op("write")) > 0.0);
    // Counts outlive their connections; the gauge follows them.
    c.disconnect().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(200));
    let body = scrape();
    assert_eq!(value(&body, "nbd_connections", ""), 0.0);
    assert_eq!(value(&body, "nbd_requests_total", &op("write")), 6.0);
    // Every metric the Grafana dashboard queries is one the server exposes.
    let dash = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../contrib/grafana/lamina.json"
    );
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dash).unwrap()).unwrap();
    let mut queries: Vec<String> = Vec::new();
    for p in dash["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().unwrap() {
            queries.push(t["expr"].as_str().unwrap().to_string());
        }
    }
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"].as_str() {
            queries.push(q.to_string());
        }
    }
    let mut used = 0;
    for q in &queries {
        for (i, _) in q.match_indices("lamina_") {
            let name: String = q[i..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            assert!(
                body.lines()
                    .any(|l| l.starts_with(&format!("{name}{{"))
                        || l.starts_with(&format!("{name} "))),
                "the dashboard queries {name}, which the server does not expose"
            );
            used += 1;
        }
    }
    assert!(used >= 20, "only {used} metrics found in the dashboard");
    // `status --prometheus` asks the running server: the same names.
    let text = lamina(&["status", dir.to_str().unwrap(), "--prometheus"]);
    assert!(
        text.contains("# TYPE lamina_write_amplification gauge"),
        "{text}"
    );
    assert_eq!(value(&text, "nbd_requests_total", &op("write")), 6.0);
    srv.stop();
}

/// TCP: `--tcp HOST:PORT` serves the same exports; clients connect with nbd:// URIs.
#[test]
fn tcp_listener_serves_exports() {
    if !need(
        "clients::tcp_listener_serves_exports",
        &["nbdinfo", "nbdcopy"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("tcp");
    let dir = t.join("arr");
    create_array(
        &dir,
        "64M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", "4M");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut child = std::process::Command::new(lamina_bin())
        .args([
            "serve",
            dir.to_str().unwrap(),
            "--tcp",
            &format!("127.0.0.1:{port}"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let uri = format!("nbd://127.0.0.1:{port}/v");
    let t0 = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(t0.elapsed().as_secs() < 30, "TCP listener did not come up");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let info: serde_json::Value = serde_json::from_str(&run("nbdinfo", &["--json", &uri])).unwrap();
    assert_eq!(info["exports"][0]["export-size"], 4 << 20);
    let src = t.join("src.raw");
    std::fs::write(
        &src,
        (0..4u32 << 20)
            .map(|i| (i * 7 % 251) as u8)
            .collect::<Vec<u8>>(),
    )
    .unwrap();
    run("nbdcopy", &[src.to_str().unwrap(), &uri]);
    let back = t.join("back.raw");
    run("nbdcopy", &[&uri, back.to_str().unwrap()]);
    assert!(std::fs::read(&src).unwrap() == std::fs::read(&back).unwrap());
    // SAFETY: signalling our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert!(child.wait().unwrap().success());
}

/// Read-only serving: `serve --read-only` advertises every volume read-only (nbdinfo
/// sees it, nbdcopy into it fails, the data stays), and `[serve] read_only_volumes`
/// freezes only the volumes it names.
#[test]
fn read_only_volumes_refuse_writes() {
    if !need(
        "clients::read_only_volumes_refuse_writes",
        &["nbdinfo", "nbdcopy"],
        false,
    ) {
        return;
    }
    use lamina_nbd::client::{Client, ClientError};
    let t = TempDir::new("read-only");
    let dir = t.join("arr");
    create_array(
        &dir,
        "128M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "gold", "8M");
    create_volume(&dir, "scratch", "8M");
    let s = Server::start(&dir);
    let mut c = Client::connect_unix(&s.sock, "gold").unwrap();
    c.write(0, &[5u8; 8192], true).unwrap();
    c.disconnect().unwrap();
    s.stop();

    // Everything read-only.
    let srv = Server::start_with(&dir, &[], &["--read-only"]);
    let sock = srv.sock.clone();
    let uri = |v: &str| format!("nbd+unix:///{v}?socket={}", sock.display());
    let info: serde_json::Value =
        serde_json::from_str(&run("nbdinfo", &["--json", &uri("gold")])).unwrap();
    assert_eq!(info["exports"][0]["is_read_only"], true, "{info}");
    assert_eq!(info["exports"][0]["can_trim"], false, "{info}");
    let src = t.join("src.raw");
    std::fs::write(&src, vec![9u8; 1 << 20]).unwrap();
    let copy = std::process::Command::new("nbdcopy")
        .args([src.to_str().unwrap(), &uri("scratch")])
        .output()
        .unwrap();
    assert!(
        !copy.status.success(),
        "nbdcopy wrote to a read-only export"
    );
    let mut c = Client::connect_unix(&sock, "gold").unwrap();
    assert!(matches!(
        c.write(0, &[1u8; 4096], false),
        Err(ClientError::Nbd(1))
    ));
    assert_eq!(c.read(0, 8192).unwrap(), vec![5u8; 8192]);
    c.disconnect().unwrap();
    srv.stop();

    // One volume read-only, from the configuration.
    let toml = dir.join("lamina.toml");
    let cfg = std::fs::read_to_string(&toml).unwrap();
    let cfg = cfg.replacen("[serve]\n", "[serve]\nread_only_volumes = [\"gold\"]\n", 1);
    std::fs::write(&toml, cfg).unwrap();
    let s = Server::start(&dir);
    let mut gold = Client::connect_unix(&s.sock, "gold").unwrap();
    assert!(matches!(gold.trim(0, 4096), Err(ClientError::Nbd(1))));
    let mut scratch = Client::connect_unix(&s.sock, "scratch").unwrap();
    scratch.write(0, &[3u8; 4096], true).unwrap();
    assert_eq!(scratch.read(0, 4096).unwrap(), vec![3u8; 4096]);
    assert_eq!(gold.read(0, 4096).unwrap(), vec![5u8; 4096]);
    s.stop();
}
