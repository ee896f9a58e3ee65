//! NBD over TLS at the protocol level: STARTTLS as the spec describes it, FORCEDTLS
//! refusals before TLS, and data through the TLS pump with large, pipelined
//! requests (a rustls client against a RAM backend).

use lamina_nbd::proto::*;
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, Completion, ExportInfo, Listener, TlsPolicy};
use rustls::pki_types::{CertificateDer, ServerName};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};

const SIZE: u64 = 64 << 20;

/// A volume in memory.
struct Ram(Mutex<Vec<u8>>);

impl Backend for Ram {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: "v".into(),
            description: "ram".into(),
            size: SIZE,
        }]
    }
    fn open_export(&self, name: &str) -> Option<((), ExportInfo)> {
        (name == "v" || name.is_empty()).then(|| ((), self.exports().remove(0)))
    }
    fn read(&self, _: &(), offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        let d = self.0.lock().unwrap();
        buf.copy_from_slice(&d[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        let buf = match cmd {
            Command::Write { offset, data, .. } => {
                let o = offset as usize;
                self.0.lock().unwrap()[o..o + data.len()].copy_from_slice(&data);
                Some(data)
            }
            Command::Zero { offset, length, .. } => {
                let o = offset as usize;
                self.0.lock().unwrap()[o..o + length as usize].fill(0);
                None
            }
            Command::Flush => None,
        };
        reply.complete(&mut vec![Completion {
            handle,
            error: 0,
            buf,
        }]);
    }
}

struct Pki {
    dir: PathBuf,
    ca: CertificateDer<'static>,
}

/// A CA and a server certificate for "localhost", written as PEM files.
fn pki(name: &str) -> Pki {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair, KeyUsagePurpose};
    let dir = std::env::temp_dir().join(format!("lamina-nbd-tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["localhost".to_string()])
        .unwrap()
        .signed_by(&key, &ca_cert, &ca_key)
        .unwrap();
    std::fs::write(dir.join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.join("key.pem"), key.serialize_pem()).unwrap();
    Pki {
        dir,
        ca: ca_cert.der().clone(),
    }
}

/// Serves a RAM volume on a loopback TCP port with `tls`.
fn start(tls: Option<TlsPolicy>) -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let backend = Arc::new(Ram(Mutex::new(vec![0u8; SIZE as usize])));
    let stop = Arc::new(AtomicBool::new(false));
    std::thread::spawn(move || lamina_nbd::serve(backend, Listener::Tcp(l), tls, stop));
    port
}

fn policy(p: &Pki, required: bool) -> TlsPolicy {
    let config =
        lamina_nbd::tls::load_config(&p.dir.join("cert.pem"), &p.dir.join("key.pem"), None)
            .unwrap();
    TlsPolicy {
        config: Arc::new(config),
        required,
    }
}

fn rd<const N: usize>(s: &mut impl Read) -> [u8; N] {
    let mut b = [0u8; N];
    s.read_exact(&mut b).unwrap();
    b
}

/// Connects and gets through the greeting (fixed newstyle, no zeroes).
fn greet(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let hello = rd::<18>(&mut s);
    assert_eq!(&hello[..8], b"NBDMAGIC");
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    s
}

fn send_option(s: &mut impl Write, option: u32, data: &[u8]) {
    let mut b = IHAVEOPT.to_be_bytes().to_vec();
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    s.write_all(&b).unwrap();
    s.flush().unwrap();
}

/// Reads one option reply: (option, reply type, data).
fn option_reply(s: &mut impl Read) -> (u32, u32, Vec<u8>) {
    let h = rd::<20>(s);
    assert_eq!(u64::from_be_bytes(h[..8].try_into().unwrap()), REPLY_MAGIC);
    let option = u32::from_be_bytes(h[8..12].try_into().unwrap());
    let kind = u32::from_be_bytes(h[12..16].try_into().unwrap());
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    let mut d = vec![0u8; len as usize];
    s.read_exact(&mut d).unwrap();
    (option, kind, d)
}

fn go_data(name: &str) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&0u16.to_be_bytes());
    d
}

/// Sends NBD_OPT_GO for `name`; returns the final reply type (infos skipped).
fn go(s: &mut (impl Read + Write), name: &str) -> u32 {
    send_option(s, OPT_GO, &go_data(name));
    loop {
        let (_, kind, _) = option_reply(s);
        if kind != REP_INFO {
            return kind;
        }
    }
}

/// True when the server closes the connection (EOF or reset) without another option
/// reply (a TLS alert may come first).
fn closed(s: &mut TcpStream) -> bool {
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();
    let mut rest = Vec::new();
    match s.read_to_end(&mut rest) {
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ) =>
        {
            false
        }
        _ => !rest.windows(8).any(|w| w == REPLY_MAGIC.to_be_bytes()),
    }
}

#[test]
fn forced_tls_refuses_everything_but_starttls_before_tls() {
    let p = pki("forced");
    let port = start(Some(policy(&p, true)));
    let mut s = greet(port);
    send_option(&mut s, OPT_LIST, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ERR_TLS_REQD);
    send_option(&mut s, OPT_INFO, &go_data("v"));
    assert_eq!(option_reply(&mut s).1, REP_ERR_TLS_REQD);
    assert_eq!(go(&mut s, "v"), REP_ERR_TLS_REQD);
    send_option(&mut s, OPT_STARTTLS, b"x");
    assert_eq!(option_reply(&mut s).1, REP_ERR_INVALID);
    send_option(&mut s, OPT_ABORT, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ACK);
    assert!(closed(&mut s));

    // NBD_OPT_EXPORT_NAME cannot carry an error: the server hangs up.
    let mut s = greet(port);
    send_option(&mut s, OPT_EXPORT_NAME, b"v");
    assert!(closed(&mut s), "export served in plaintext");

    // Plaintext sent after STARTTLS, before the TLS handshake, is not acted on.
    let mut s = greet(port);
    let mut both = Vec::new();
    for (o, d) in [(OPT_STARTTLS, vec![]), (OPT_GO, go_data("v"))] {
        both.extend_from_slice(&IHAVEOPT.to_be_bytes());
        both.extend_from_slice(&o.to_be_bytes());
        both.extend_from_slice(&(d.len() as u32).to_be_bytes());
        both.extend_from_slice(&d);
    }
    s.write_all(&both).unwrap();
    assert_eq!(option_reply(&mut s).1, REP_ACK);
    assert!(closed(&mut s));
}

#[test]
fn starttls_without_tls_configured_is_refused_by_policy() {
    let port = start(None);
    let mut s = greet(port);
    send_option(&mut s, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ERR_POLICY);
    // The connection goes on in plaintext.
    assert_eq!(go(&mut s, "v"), REP_ACK);
}

/// STARTTLS, then the TLS handshake, then the rest of the negotiation inside TLS.
fn tls_client(port: u16, p: &Pki) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    tls_client_after(port, p, |_| {})
}

/// [`tls_client`], with `before` haggling in plaintext first.
fn tls_client_after(
    port: u16,
    p: &Pki,
    before: impl FnOnce(&mut TcpStream),
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let mut s = greet(port);
    before(&mut s);
    send_option(&mut s, OPT_STARTTLS, &[]);
    let (o, kind, _) = option_reply(&mut s);
    assert_eq!((o, kind), (OPT_STARTTLS, REP_ACK));
    let mut roots = rustls::RootCertStore::empty();
    roots.add(p.ca.clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let conn =
        rustls::ClientConnection::new(Arc::new(config), ServerName::try_from("localhost").unwrap())
            .unwrap();
    rustls::StreamOwned::new(conn, s)
}

fn request(kind: u16, handle: u64, offset: u64, len: u32) -> Vec<u8> {
    let mut b = REQUEST_MAGIC.to_be_bytes().to_vec();
    b.extend_from_slice(&0u16.to_be_bytes());
    b.extend_from_slice(&kind.to_be_bytes());
    b.extend_from_slice(&handle.to_be_bytes());
    b.extend_from_slice(&offset.to_be_bytes());
    b.extend_from_slice(&len.to_be_bytes());
    b
}

/// Reads a simple reply; returns (handle, error).
fn reply(s: &mut impl Read) -> (u64, u32) {
    let r = rd::<16>(s);
    assert_eq!(
        u32::from_be_bytes(r[..4].try_into().unwrap()),
        SIMPLE_REPLY_MAGIC
    );
    (
        u64::from_be_bytes(r[8..16].try_into().unwrap()),
        u32::from_be_bytes(r[4..8].try_into().unwrap()),
    )
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    use rand::{RngCore, SeedableRng};
    let mut v = vec![0u8; len];
    rand::rngs::SmallRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

#[test]
fn data_through_tls_large_and_pipelined() {
    let p = pki("data");
    let port = start(Some(policy(&p, true)));
    let mut s = tls_client(port, &p);
    // Inside TLS: listing works, a second STARTTLS is invalid, then GO.
    send_option(&mut s, OPT_LIST, &[]);
    assert_eq!(option_reply(&mut s).1, REP_SERVER);
    assert_eq!(option_reply(&mut s).1, REP_ACK);
    send_option(&mut s, OPT_STARTTLS, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ERR_INVALID);
    assert_eq!(go(&mut s, "v"), REP_ACK);

    // Pipelined writes: many small ones, then the largest the server takes.
    let small: Vec<Vec<u8>> = (0..64)
        .map(|i| pattern(4096 * (1 + i % 7), i as u64))
        .collect();
    let mut batch = Vec::new();
    let mut off = 0u64;
    let mut layout = Vec::new();
    for (i, d) in small.iter().enumerate() {
        batch.extend_from_slice(&request(CMD_WRITE, i as u64, off, d.len() as u32));
        batch.extend_from_slice(d);
        layout.push((off, d.len()));
        off += d.len() as u64;
    }
    s.write_all(&batch).unwrap();
    let big = pattern(MAX_PAYLOAD as usize, 999);
    let big_off = 16 << 20;
    s.write_all(&request(CMD_WRITE, 1000, big_off, MAX_PAYLOAD))
        .unwrap();
    s.write_all(&big).unwrap();
    s.write_all(&request(CMD_FLUSH, 1001, 0, 0)).unwrap();
    s.flush().unwrap();
    let mut seen = std::collections::HashSet::new();
    for _ in 0..small.len() + 2 {
        let (h, e) = reply(&mut s);
        assert_eq!(e, 0, "handle {h}");
        assert!(seen.insert(h));
    }

    // Pipelined reads of everything written; replies come in any order.
    let mut want: std::collections::HashMap<u64, &[u8]> = std::collections::HashMap::new();
    for (i, (o, l)) in layout.iter().enumerate() {
        s.write_all(&request(CMD_READ, 2000 + i as u64, *o, *l as u32))
            .unwrap();
        want.insert(2000 + i as u64, &small[i]);
    }
    s.write_all(&request(CMD_READ, 3000, big_off, MAX_PAYLOAD))
        .unwrap();
    want.insert(3000, &big);
    s.flush().unwrap();
    while !want.is_empty() {
        let (h, e) = reply(&mut s);
        assert_eq!(e, 0);
        let d = want.remove(&h).expect("a reply per read");
        let mut back = vec![0u8; d.len()];
        s.read_exact(&mut back).unwrap();
        assert!(back == d, "read {h} differs");
    }

    // A clean disconnect.
    s.write_all(&request(CMD_DISC, 4000, 0, 0)).unwrap();
    s.flush().unwrap();
    let mut rest = Vec::new();
    let _ = s.read_to_end(&mut rest);
    assert!(rest.is_empty());
}

/// The data of NBD_OPT_SET_META_CONTEXT selecting `base:allocation` on "v".
fn select_allocation(s: &mut (impl Read + Write)) {
    let mut d = 1u32.to_be_bytes().to_vec();
    d.push(b'v');
    d.extend_from_slice(&1u32.to_be_bytes());
    d.extend_from_slice(&(META_BASE_ALLOCATION.len() as u32).to_be_bytes());
    d.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
    send_option(s, OPT_SET_META_CONTEXT, &d);
    assert_eq!(option_reply(s).1, REP_META_CONTEXT);
    assert_eq!(option_reply(s).1, REP_ACK);
}

/// What was negotiated before STARTTLS is forgotten (the spec): structured replies
/// asked for in plaintext do not apply inside TLS, so a read gets a simple reply,
/// and a metadata context selected in plaintext is not selected inside.
#[test]
fn starttls_forgets_what_was_negotiated_before() {
    let p = pki("forget");
    let port = start(Some(policy(&p, false)));
    let mut s = tls_client_after(port, &p, |s| {
        send_option(s, OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(option_reply(s).1, REP_ACK);
        select_allocation(s);
    });
    assert_eq!(go(&mut s, "v"), REP_ACK);
    s.write_all(&request(CMD_READ, 7, 0, 4096)).unwrap();
    s.flush().unwrap();
    assert_eq!(reply(&mut s), (7, 0), "a simple reply");
    let _data = rd::<4096>(&mut s);
    // Negotiated inside TLS, structured replies do apply.
    let mut s = tls_client(port, &p);
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ACK);
    assert_eq!(go(&mut s, "v"), REP_ACK);
    s.write_all(&request(CMD_READ, 8, 4096, 4096)).unwrap();
    s.flush().unwrap();
    let h = rd::<{ CHUNK_HEADER + 8 }>(&mut s);
    assert_eq!(
        h[..CHUNK_HEADER],
        chunk_header(8, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 8 + 4096)
    );
    assert_eq!(h[CHUNK_HEADER..], 4096u64.to_be_bytes());
    let _data = rd::<4096>(&mut s);
    // Block status: refused, the context chosen in plaintext being forgotten.
    let mut s = tls_client_after(port, &p, |s| {
        send_option(s, OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(option_reply(s).1, REP_ACK);
        select_allocation(s);
    });
    send_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(option_reply(&mut s).1, REP_ACK);
    assert_eq!(go(&mut s, "v"), REP_ACK);
    s.write_all(&request(CMD_BLOCK_STATUS, 9, 0, 4096)).unwrap();
    s.flush().unwrap();
    let h = rd::<{ CHUNK_HEADER + 6 }>(&mut s);
    let len = u32::from_be_bytes(h[16..20].try_into().unwrap());
    assert_eq!(
        h[..16],
        chunk_header(9, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, len)[..16]
    );
    assert_eq!(h[CHUNK_HEADER..CHUNK_HEADER + 4], EINVAL.to_be_bytes());
}
