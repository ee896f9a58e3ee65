//! Per-volume limits (issue "Volumes", QoS): requests and bytes per second, set in
//! lamina.toml for every start or live with `lamina volume qos`.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_testkit::{pattern, BS};
use std::time::{Duration, Instant};

/// Writes `n` blocks of `blocks` 4 KiB blocks one at a time (queue depth 1) and
/// returns how long they took.
fn timed_writes(c: &mut Client, n: u64, blocks: u64) -> Duration {
    let data: Vec<u8> = (0..blocks).flat_map(|b| pattern(b, 1)).collect();
    let t = Instant::now();
    for i in 0..n {
        c.write(i * blocks * BS as u64, &data, false).unwrap();
    }
    t.elapsed()
}

/// A volume's clients get at most its rate (checked from below only: a slow
/// machine makes them slower, never faster); a limit changed live applies at once
/// to open connections, also those opened before the volume had any limit.
/// (That the other volume keeps its rate is measured by bench/qos.sh.)
#[test]
fn volume_limits_hold_requests_to_their_rate() {
    let t = TempDir::new("qos");
    let dir = small_array(&t, "16M");
    let d = dir.to_str().unwrap();
    create_volume(&dir, "w", "16M");
    let cfg = dir.join("lamina.toml");
    let text = std::fs::read_to_string(&cfg).unwrap();
    append_config(&dir, "[engine.volumes.v]\niops_limit = 200\n");
    let srv = Server::start(&dir);
    let mut v = Client::connect_unix(&srv.sock, "v").unwrap();
    let mut w = Client::connect_unix(&srv.sock, "w").unwrap();
    // 150 requests at 200/s, of which 20 ms' worth go at once: at least 0.73 s.
    let took = timed_writes(&mut v, 150, 1);
    assert!(
        took >= Duration::from_millis(700),
        "150 writes at 200/s took {took:?}"
    );
    let shown = lamina(&["volume", "qos", d, "v"]);
    assert!(
        shown.contains("requests 200/s") && shown.contains("bandwidth no limit"),
        "{shown}"
    );
    // Live: w gets a byte rate (1 MiB/s), v loses its limit.
    lamina(&["volume", "qos", d, "w", "--bandwidth", "1M"]);
    lamina(&["volume", "qos", d, "v", "--iops", "none"]);
    let st = status_json(&dir);
    assert_eq!(st["qos"]["w"]["bandwidth"], 1 << 20, "{st}");
    assert!(st["qos"].get("v").is_none(), "{st}");
    // Set live, and saved for every start (the lines of the config, not a rewrite).
    let saved = std::fs::read_to_string(&cfg).unwrap();
    assert!(
        saved.contains("[engine.volumes.w]\nbandwidth_limit = \"1M\"")
            && !saved.contains("iops_limit = 200")
            && saved.starts_with(&text),
        "{saved}"
    );
    // 20 writes of 64 KiB = 1.25 MiB at 1 MiB/s: at least a second.
    let took = timed_writes(&mut w, 20, 16);
    assert!(
        took >= Duration::from_millis(1000),
        "1.25 MiB at 1 MiB/s took {took:?}"
    );
    // A request the server refuses costs nothing: a read of almost 4 GiB beyond
    // the end (EINVAL) does not hold the next one for an hour at 1 MiB/s.
    assert!(w.read(0, 0xffff_f000).is_err());
    let t0 = Instant::now();
    w.write(0, &pattern(0, 2), false).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    // A wait ends when the limit is lifted: 8 MiB at 1 MiB/s leaves the next
    // request 8 s to wait, and lifting the limit half a second in ends it.
    w.write(0, &vec![7u8; 8 << 20], false).unwrap();
    let lift = {
        let d = d.to_string();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(500));
            lamina(&["volume", "qos", &d, "w", "--bandwidth", "none"]);
        })
    };
    let t0 = Instant::now();
    w.write(0, &pattern(0, 3), false).unwrap();
    lift.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    // Bad requests are refused with the reason.
    let out = lamina_output(&["volume", "qos", d, "nope", "--iops", "5"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no volume named"));
    let out = lamina_output(&["volume", "qos", d, "v", "--iops", "0"]);
    assert_eq!(out.status.code(), Some(2));
    let log = std::fs::read_to_string(dir.join("lamina.log")).unwrap();
    assert!(
        log.contains("volume \"v\" limited to 200 requests/s"),
        "{log}"
    );
    assert!(log.contains("volume \"w\" limited to 1.0 MiB/s"), "{log}");
    drop((v, w));
    srv.stop();
    // Without a server nothing is set live: --live-only is refused (the message
    // says where limits go), and without it the limit is saved for the next start.
    let out = lamina_output(&["volume", "qos", d, "v", "--iops", "5", "--live-only"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[engine.volumes.v]"));
    let out = lamina(&["volume", "qos", d, "v", "--iops", "5"]);
    assert!(out.contains("from the next start"), "{out}");
    let out = lamina_output(&["volume", "qos", d, "nope", "--iops", "5"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("no volume named"));
    let srv = Server::start(&dir);
    let shown = lamina(&["volume", "qos", d, "v"]);
    assert!(shown.contains("requests 5/s"), "{shown}");
    srv.stop();
    // A bad limit in the config stops the server before it opens the array.
    std::fs::write(
        &cfg,
        format!("{text}\n[engine.volumes.v]\nbandwidth_limit = \"0\"\n"),
    )
    .unwrap();
    let out = lamina_output(&["serve", d]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bandwidth_limit"));
}
