//! TLS end to end, with the clients users have: certificates from
//! `tools/make-tls-certs.sh` (the README's recipe), libnbd's `nbds://` URIs (nbdinfo,
//! nbdcopy) and QEMU's `tls-creds-x509`. Plaintext on TCP is refused, a client
//! without a certificate is refused when the server names a CA, and the Unix socket
//! stays plaintext.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Makes a CA, server and client certificates in `dir`.
fn make_certs(dir: &Path) {
    let out = Command::new(repo_root().join("tools/make-tls-certs.sh"))
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "make-tls-certs.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Starts `lamina serve DIR` with `args`, waits for the TCP port.
fn serve(dir: &Path, port: u16, args: &[&str]) -> Child {
    let child = Command::new(lamina_bin())
        .args([
            "serve",
            dir.to_str().unwrap(),
            "--tcp",
            &format!("127.0.0.1:{port}"),
        ])
        .args(["--unix", dir.join("nbd.sock").to_str().unwrap()])
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "TCP listener did not come up"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

fn stop(mut child: Child) {
    // SAFETY: signalling our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    assert!(child.wait().unwrap().success());
}

/// Runs a command; returns (success, stdout + stderr).
fn try_run(cmd: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(cmd).args(args).output().unwrap();
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; len];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

#[test]
fn tls_with_libnbd_and_qemu_and_client_certificates() {
    if !need(
        "tls::tls_with_libnbd_and_qemu_and_client_certificates",
        &["openssl", "nbdinfo", "nbdcopy", "qemu-img"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("tls");
    let certs = t.join("pki");
    make_certs(&certs);
    let c = |f: &str| certs.join(f).to_str().unwrap().to_string();
    let dir = t.join("arr");
    create_array(
        &dir,
        "96M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", "16M");
    let port = free_port();
    let child = serve(
        &dir,
        port,
        &[
            "--tls-cert",
            &c("server-cert.pem"),
            "--tls-key",
            &c("server-key.pem"),
            "--tls-ca",
            &c("ca-cert.pem"),
        ],
    );
    let tls_uri = format!(
        "nbds://localhost:{port}/v?tls-certificates={}",
        certs.display()
    );

    // libnbd over TLS: the export is there and says TLS.
    let (ok, info) = try_run("nbdinfo", &[&tls_uri]);
    assert!(ok, "{info}");
    assert!(info.contains("with TLS"), "{info}");
    assert!(info.contains("export-size: 16777216"), "{info}");

    // Data through TLS both ways, 16 MiB in requests up to nbdcopy's 256 KiB.
    let src = t.join("src.raw");
    let data = pattern(16 << 20, 1);
    std::fs::write(&src, &data).unwrap();
    run("nbdcopy", &[src.to_str().unwrap(), &tls_uri]);
    let back = t.join("back.raw");
    run("nbdcopy", &[&tls_uri, back.to_str().unwrap()]);
    assert!(
        std::fs::read(&back).unwrap() == data,
        "data read over TLS differs"
    );

    // QEMU with tls-creds-x509 reads the same bytes.
    let qcow = t.join("copy.qcow2");
    let (ok, out) = try_run(
        "qemu-img",
        &[
            "convert",
            "-O",
            "raw",
            "--object",
            &format!(
                "tls-creds-x509,id=tls0,dir={},endpoint=client",
                certs.display()
            ),
            "--image-opts",
            &format!("driver=nbd,host=localhost,port={port},export=v,tls-creds=tls0"),
            qcow.to_str().unwrap(),
        ],
    );
    assert!(ok, "qemu-img over TLS: {out}");
    assert!(
        std::fs::read(&qcow).unwrap() == data,
        "QEMU read other data over TLS"
    );

    // Plaintext on TCP gets nothing: no export, no list.
    let plain_uri = format!("nbd://127.0.0.1:{port}/v");
    let (ok, out) = try_run("nbdinfo", &[&plain_uri]);
    assert!(!ok, "plaintext TCP was served: {out}");
    let (ok, out) = try_run("nbdinfo", &["--list", &plain_uri]);
    assert!(
        !ok && !out.contains("export=\"v\""),
        "plaintext TCP listed exports: {out}"
    );

    // A client that trusts the CA but has no certificate of its own is refused.
    let nocert = t.join("nocert");
    std::fs::create_dir_all(&nocert).unwrap();
    std::fs::copy(certs.join("ca-cert.pem"), nocert.join("ca-cert.pem")).unwrap();
    let (ok, out) = try_run(
        "nbdinfo",
        &[&format!(
            "nbds://localhost:{port}/v?tls-certificates={}",
            nocert.display()
        )],
    );
    assert!(!ok, "a client without a certificate was served: {out}");

    // A client that does not trust the server's CA refuses the server.
    let other = t.join("other-pki");
    make_certs(&other);
    let (ok, out) = try_run(
        "nbdinfo",
        &[&format!(
            "nbds://localhost:{port}/v?tls-certificates={}",
            other.display()
        )],
    );
    assert!(!ok, "a client accepted a server from another CA: {out}");

    // The Unix socket stays plaintext (file permissions guard it).
    let unix_uri = format!("nbd+unix:///v?socket={}", dir.join("nbd.sock").display());
    let (ok, out) = try_run("nbdinfo", &[&unix_uri]);
    assert!(ok && out.contains("without TLS"), "{out}");
    stop(child);
}

/// TLS from `[serve]` in lamina.toml, without client certificates; bad TLS settings
/// stop the server with a message before it opens the array.
#[test]
fn tls_from_the_config_file_and_bad_settings() {
    if !need(
        "tls::tls_from_the_config_file_and_bad_settings",
        &["openssl", "nbdinfo"],
        false,
    ) {
        return;
    }
    let t = TempDir::new("tls-config");
    let certs = t.join("pki");
    make_certs(&certs);
    let dir = t.join("arr");
    create_array(
        &dir,
        "64M",
        &["--segment-size", "1M", "--write-unit", "128K"],
    );
    create_volume(&dir, "v", "4M");

    // Bad settings: each is refused with a message naming the problem.
    let port = free_port();
    let tcp = format!("127.0.0.1:{port}");
    let d = dir.to_str().unwrap();
    let missing = t.join("missing.pem");
    let garbage = t.join("garbage.pem");
    std::fs::write(&garbage, "not a certificate\n").unwrap();
    let server_cert = certs.join("server-cert.pem");
    let server_key = certs.join("server-key.pem");
    let client_key = certs.join("client-key.pem");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec![
                "--tls-cert",
                missing.to_str().unwrap(),
                "--tls-key",
                server_key.to_str().unwrap(),
            ],
            "cannot read the TLS certificate",
        ),
        (
            vec![
                "--tls-cert",
                garbage.to_str().unwrap(),
                "--tls-key",
                server_key.to_str().unwrap(),
            ],
            "holds no PEM certificate",
        ),
        (
            vec![
                "--tls-cert",
                server_cert.to_str().unwrap(),
                "--tls-key",
                garbage.to_str().unwrap(),
            ],
            "no usable PEM private key",
        ),
        (
            // The key of another certificate.
            vec![
                "--tls-cert",
                server_cert.to_str().unwrap(),
                "--tls-key",
                client_key.to_str().unwrap(),
            ],
            "with key",
        ),
        (
            vec!["--tls-cert", server_cert.to_str().unwrap()],
            "--tls-key",
        ),
    ];
    for (args, want) in cases {
        let mut all = vec!["serve", d, "--tcp", &tcp];
        all.extend(&args);
        let out = lamina_output(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }

    // The same certificate from the config file: TLS on TCP, no client certificate.
    let cfg_path = dir.join("lamina.toml");
    let mut cfg = std::fs::read_to_string(&cfg_path).unwrap();
    let serve_section = format!(
        "tls_cert = \"{}\"\ntls_key = \"{}\"\n",
        server_cert.display(),
        server_key.display()
    );
    cfg = if cfg.contains("[serve]\n") {
        cfg.replacen("[serve]\n", &format!("[serve]\n{serve_section}"), 1)
    } else {
        format!("{cfg}\n[serve]\n{serve_section}")
    };
    std::fs::write(&cfg_path, cfg).unwrap();
    let child = serve(&dir, port, &[]);
    // Only the CA: the server asks for no client certificate.
    let trust = t.join("trust");
    std::fs::create_dir_all(&trust).unwrap();
    std::fs::copy(certs.join("ca-cert.pem"), trust.join("ca-cert.pem")).unwrap();
    let (ok, out) = try_run(
        "nbdinfo",
        &[&format!(
            "nbds://localhost:{port}/v?tls-certificates={}",
            trust.display()
        )],
    );
    assert!(ok && out.contains("with TLS"), "{out}");
    let (ok, out) = try_run("nbdinfo", &[&format!("nbd://127.0.0.1:{port}/v")]);
    assert!(!ok, "plaintext TCP was served: {out}");
    stop(child);
}
