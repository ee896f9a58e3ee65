//! What operators use around the server: systemd's readiness protocol, the manual
//! pages and the shell completions.

mod common;
use common::*;
use std::os::unix::net::UnixDatagram;
use std::time::{Duration, Instant};

/// Collects the service manager's datagrams until one holds `line`; all of them.
fn until(sock: &UnixDatagram, line: &str) -> Vec<String> {
    let mut seen = Vec::new();
    let t0 = Instant::now();
    let mut buf = [0u8; 4096];
    while !seen.iter().any(|m: &String| m.lines().any(|l| l == line)) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no {line} within 60 s; got {seen:?}"
        );
        if let Ok(n) = sock.recv(&mut buf) {
            seen.push(String::from_utf8_lossy(&buf[..n]).into_owned());
        }
    }
    seen
}

/// `lamina serve` under a service manager: STATUS while the array opens, READY=1 with
/// MAINPID once it serves, STOPPING=1 on SIGTERM, and a clean exit; to a socket path
/// and to an abstract socket (`@name`), the two forms systemd uses.
#[test]
fn serve_tells_systemd_when_it_is_ready_and_stopping() {
    let t = TempDir::new("notify");
    let dir = small_array(&t, "8M");
    let abstract_name = format!("lamina-test-notify-{}", std::process::id());
    let path = t.join("notify.sock");
    let sockets = [
        (
            UnixDatagram::bind(&path).unwrap(),
            path.to_str().unwrap().to_string(),
        ),
        (
            {
                use std::os::linux::net::SocketAddrExt;
                let addr =
                    std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())
                        .unwrap();
                UnixDatagram::bind_addr(&addr).unwrap()
            },
            format!("@{abstract_name}"),
        ),
    ];
    for (sock, name) in &sockets {
        sock.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let srv = Server::start_env(&dir, &[("NOTIFY_SOCKET", name)]);
        let got = until(sock, "READY=1");
        assert!(
            got[0].starts_with("STATUS=opening the array"),
            "{name}: {got:?}"
        );
        let ready = got.last().unwrap();
        assert!(ready.contains(&format!("MAINPID={}", srv.pid())), "{ready}");
        assert!(ready.contains("STATUS=serving array"), "{ready}");
        // Ready means serving.
        let mut c = lamina_nbd::client::Client::connect_unix(&srv.sock, "v").unwrap();
        c.write(0, &[9u8; 4096], true).unwrap();
        drop(c);
        let pid = srv.pid();
        srv.stop_with(libc::SIGTERM);
        let got = until(sock, "STOPPING=1");
        assert!(got.last().unwrap().contains("STATUS="), "{got:?}");
        assert!(!got.iter().any(|m| m.contains("READY=1")), "{pid}: {got:?}");
    }
    // Without NOTIFY_SOCKET nothing is sent and nothing fails (every other test).
}

#[test]
fn manual_pages_and_shell_completions() {
    let t = TempDir::new("man");
    let dir = t.join("man1");
    let listed = lamina(&["man", "--dir", dir.to_str().unwrap()]);
    // A page per command, each named as man(1) looks it up.
    for page in [
        "lamina.1",
        "lamina-serve.1",
        "lamina-status.1",
        "lamina-array-create.1",
        "lamina-array-replace.1",
        "lamina-volume-create.1",
        "lamina-fsck.1",
        "lamina-completions.1",
    ] {
        let p = dir.join(page);
        assert!(
            listed.contains(p.to_str().unwrap()),
            "{page} not listed: {listed}"
        );
        let roff = std::fs::read_to_string(&p).unwrap();
        let name = page.trim_end_matches(".1");
        assert!(roff.contains(&format!(".TH {name} 1")), "{page}: {roff}");
    }
    // The long help is in the page: what `serve` says about systemd.
    let serve = std::fs::read_to_string(dir.join("lamina-serve.1")).unwrap();
    assert!(serve.contains("Type=notify"), "{serve}");
    if need("ops::manual_pages_and_shell_completions", &["man"], false) {
        let text = run(
            "man",
            &["-l", dir.join("lamina-array-create.1").to_str().unwrap()],
        );
        assert!(text.contains("overprovision"), "{text}");
    }
    // lamina(1) on standard output, and a reader that stops early is no error.
    assert!(lamina(&["man"]).contains(".TH lamina 1"));
    // (`array list` prints with `println!`, which a broken pipe made panic: it
    // now ends with the status of a SIGPIPE, 141, and says nothing.)
    let empty = t.path().to_str().unwrap();
    for args in [
        &["man"][..],
        &["completions", "bash"],
        &["array", "list", empty],
    ] {
        // A pipe whose reader is gone before the command starts: every write fails.
        let mut fds = [0; 2];
        // SAFETY: pipe(2) fills two descriptors, which the OwnedFds then own.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        let (reader, writer) = unsafe {
            use std::os::fd::FromRawFd;
            (
                std::os::fd::OwnedFd::from_raw_fd(fds[0]),
                std::os::fd::OwnedFd::from_raw_fd(fds[1]),
            )
        };
        drop(reader);
        let out = std::process::Command::new(lamina_bin())
            .args(args)
            .stdout(std::process::Stdio::from(writer))
            .output()
            .unwrap();
        let want = if args[0] == "array" { 141 } else { 0 };
        assert_eq!(out.status.code(), Some(want), "{args:?}: {out:?}");
        assert!(
            out.stderr.is_empty(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // Completions: bash parses them and knows the commands and their options.
    let bash = lamina(&["completions", "bash"]);
    assert!(bash.contains("_lamina()") && bash.contains("--overprovision"));
    let script = t.join("lamina.bash");
    std::fs::write(&script, &bash).unwrap();
    run("bash", &["-n", script.to_str().unwrap()]);
    for shell in ["zsh", "fish", "elvish", "powershell"] {
        assert!(lamina(&["completions", shell]).contains("serve"), "{shell}");
    }
    let bad = lamina_output(&["completions", "tcsh"]);
    assert_eq!(bad.status.code(), Some(2), "an unknown shell is bad usage");
}

/// `lamina top` against a running server that a client keeps busy: one view per
/// interval, the volume's writes per second in it; a clear error without a server.
#[test]
fn top_shows_a_busy_volume() {
    let t = TempDir::new("top");
    let dir = small_array(&t, "8M");
    let d = dir.to_str().unwrap();
    let out = lamina_output(&["top", d, "--count", "1"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("running `lamina serve`"), "{err}");
    assert_eq!(
        lamina_output(&["top", d, "--interval", "0"]).status.code(),
        Some(2)
    );

    let srv = Server::start(&dir);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let (sock, stop) = (srv.sock.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut c = lamina_nbd::client::Client::connect_unix(&sock, "v").unwrap();
            let mut n = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.write((n % 2048) * 4096, &[n as u8; 4096], false).unwrap();
                c.read((n % 2048) * 4096, 4096).unwrap();
                n += 1;
            }
            n
        })
    };
    let view = lamina(&["top", d, "--interval", "0.5", "--count", "2"]);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let n = busy.join().unwrap();
    assert!(n > 100, "the client made only {n} requests");
    assert_eq!(view.matches("lamina top ").count(), 2, "{view}");
    let row = view
        .lines()
        .rev()
        .find(|l| l.starts_with("v "))
        .unwrap_or_else(|| panic!("no row for volume v:\n{view}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    let reads: f64 = cols[1].parse().unwrap();
    let writes: f64 = cols[5].parse().unwrap();
    assert!(reads > 50.0 && writes > 50.0, "{row}");
    assert!(view.contains("connections 1"), "{view}");
    srv.stop();
}

/// What a new user tripped over (issue "Volumes", friction list), each now one rule:
/// a failed `array create` leaves nothing behind; arrays listen on TCP only where
/// told to, and a TCP address that cannot be had stops the server instead of being
/// dropped; `--unix` and `--tcp` each replace their own kind, with `--no-unix` and
/// `--no-tcp` to drop one, and paths on the command line are relative to the
/// current directory; the volume commands default to ./lamina-data as `serve` and
/// `status` do; members are named by index or by path; a scrub that leaves damage
/// exits 4 as fsck does (2 is bad usage); bad sizes of bench and emulate are usage.
#[test]
fn the_command_line_follows_one_set_of_rules() {
    let t = TempDir::new("rules");
    let exits = |code: i32, args: &[&str], needle: &str| {
        let out = lamina_output(args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "lamina {args:?}: {err}");
        assert!(
            err.contains(needle),
            "lamina {args:?}: {needle:?} not in {err}"
        );
    };
    // A create that fails (too small for 16 segments) takes back the directories
    // and files it made.
    let deep = t.join("new/deeper");
    let dev = format!("{}/dev.img:64M", deep.display());
    exits(
        1,
        &["array", "create", deep.to_str().unwrap(), "--device", &dev],
        "too small",
    );
    assert!(
        !t.join("new").exists(),
        "a failed create left {}",
        t.join("new").display()
    );

    // TCP only where asked: a plain array has none, --tcp writes one.
    let a = t.join("a");
    let a_s = a.to_str().unwrap();
    let dev = format!("{}/dev.img:256M", a.display());
    lamina(&["array", "create", a_s, "--device", &dev]);
    let cfg = std::fs::read_to_string(a.join("lamina.toml")).unwrap();
    assert!(!cfg.contains("tcp"), "{cfg}");
    let b = t.join("b");
    let dev = format!("{}/dev.img:256M", b.display());
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    lamina(&[
        "array",
        "create",
        b.to_str().unwrap(),
        "--device",
        &dev,
        "--tcp",
        &addr,
    ]);
    let cfg = std::fs::read_to_string(b.join("lamina.toml")).unwrap();
    assert!(cfg.contains(&format!("tcp = \"{addr}\"")), "{cfg}");

    // Volume commands without DIR work on ./lamina-data, as serve and status do.
    let home = t.join("home");
    std::fs::create_dir_all(&home).unwrap();
    let in_home = |args: &[&str]| {
        let out = std::process::Command::new(lamina_bin())
            .args(args)
            .current_dir(&home)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "lamina {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    in_home(&[
        "array",
        "create",
        "lamina-data",
        "--device",
        "lamina-data/d.img:256M",
    ]);
    in_home(&["volume", "create", "v1", "--size", "16M"]);
    assert!(in_home(&["volume", "list"]).contains("v1"));
    in_home(&["volume", "delete", "v1"]);
    assert!(!in_home(&["volume", "list"]).contains("v1"));

    // --tcp alone keeps the config's Unix socket; --no-unix drops it; a relative
    // --unix is relative to the current directory.
    lamina(&["volume", "create", a_s, "v", "--size", "16M"]);
    let serve = |dir: &std::path::Path, args: &[&str]| {
        std::process::Command::new(lamina_bin())
            .arg("serve")
            .arg(dir)
            .args(args)
            .current_dir(&home)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap()
    };
    let stop = |mut c: std::process::Child| {
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        assert!(c.wait().unwrap().success());
    };
    let port2 = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let addr2 = format!("127.0.0.1:{port2}");
    let c = serve(&a, &["--tcp", &addr2]);
    wait_for(&a.join("nbd.sock"));
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(&addr2).is_err() {
        assert!(Instant::now() < deadline, "no TCP listener on {addr2}");
        std::thread::sleep(Duration::from_millis(50));
    }
    stop(c);
    assert!(!a.join("nbd.sock").exists(), "socket removed at exit");
    let c = serve(&a, &["--unix", "rel.sock"]);
    wait_for(&home.join("rel.sock"));
    stop(c);
    exits(2, &["serve", a_s, "--no-unix"], "nothing to listen on");

    // A TCP address in lamina.toml that is taken stops the server with the reason;
    // --no-tcp serves without it.
    let holder = std::net::TcpListener::bind(&addr).unwrap();
    exits(
        1,
        &["serve", b.to_str().unwrap()],
        &format!("cannot listen on TCP {addr}"),
    );
    lamina(&[
        "volume",
        "create",
        b.to_str().unwrap(),
        "v",
        "--size",
        "16M",
    ]);
    let c = serve(&b, &["--no-tcp"]);
    wait_for(&b.join("nbd.sock"));
    stop(c);
    drop(holder);

    // Members by index or path (relative to the current directory).
    let r = t.join("r");
    let devs: Vec<String> = (0..3)
        .map(|i| format!("{}/m{i}.img:256M", r.display()))
        .collect();
    let r_s = r.to_str().unwrap();
    lamina(&[
        "array", "create", r_s, "--layout", "said5", "--device", &devs[0], "--device", &devs[1],
        "--device", &devs[2],
    ]);
    exits(
        2,
        &["array", "fail", r_s, "--device", "3"],
        "members 0 to 2",
    );
    exits(
        2,
        &["array", "fail", r_s, "--device", "/nowhere.img"],
        "not a member",
    );
    // A member path relative to the current directory.
    let out = std::process::Command::new(lamina_bin())
        .args(["array", "fail", r_s, "--device", "m1.img"])
        .current_dir(&r)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = status_json(&r);
    assert_eq!(st["array"]["members"][1]["state"], "failed", "{st}");

    // Sizes of bench and emulate options are usage, as everywhere else.
    exits(2, &["bench", "endurance", "--capacity", "1Q"], "--capacity");
    exits(
        2,
        &[
            "emulate",
            "--ssd",
            "tlc,capacity=10GB",
            "--backing",
            "x.img",
            "--unix",
            "x.sock",
        ],
        "capacity",
    );
}

/// What an operator reads afterwards, as `zpool history` and `zpool status` give
/// it: every admin action in the log (done or refused, with its arguments), every
/// client's connection and disconnection with the export and who it was, and the
/// last scrub's findings in the log and in `status`.
#[test]
fn actions_clients_and_scrubs_are_logged_and_shown() {
    let t = TempDir::new("oplog");
    let dir = small_array(&t, "16M");
    let d = dir.to_str().unwrap();
    let srv = Server::start(&dir);
    lamina(&["volume", "create", d, "w", "--size", "8M"]);
    let out = lamina_output(&["volume", "delete", d, "nope"]);
    assert_eq!(out.status.code(), Some(1));
    let mut c = lamina_nbd::client::Client::connect_unix(&srv.sock, "v").unwrap();
    c.write(0, &lamina_testkit::pattern(0, 1), true).unwrap();
    drop(c);
    let before = lamina(&["status", d]);
    assert!(
        before.contains("scrub: none since the server started"),
        "{before}"
    );
    let scrub: serde_json::Value =
        serde_json::from_str(&lamina(&["array", "scrub", d, "--json", "--quiet"])).unwrap();
    assert!(scrub["blocks_checked"].as_u64().unwrap() >= 1, "{scrub}");
    let text = lamina(&["status", d]);
    assert!(
        text.contains("scrub: ") && text.contains("no damage left"),
        "{text}"
    );
    let st = status_json(&dir);
    assert_eq!(
        st["last_scrub"]["blocks_checked"], scrub["blocks_checked"],
        "{st}"
    );
    let me = format!("pid {}", std::process::id());
    let t0 = Instant::now();
    let wanted = [
        "admin: volume-create name=\"w\" size=8388608: done".to_string(),
        "admin: volume-delete force=false name=\"nope\": refused: ".to_string(),
        format!("client {me}"),
        "connected to export \"v\"".to_string(),
        "disconnected from export \"v\"".to_string(),
        "admin: scrub started".to_string(),
        "scrub finished in".to_string(),
    ];
    loop {
        let log = std::fs::read_to_string(dir.join("lamina.log")).unwrap_or_default();
        let missing: Vec<&String> = wanted
            .iter()
            .filter(|w| !log.contains(w.as_str()))
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{missing:?} not in:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    srv.stop();
}
