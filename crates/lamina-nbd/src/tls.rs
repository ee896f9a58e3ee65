//! TLS for NBD connections (NBD_OPT_STARTTLS, NetworkBlockDevice/nbd doc/proto.md
//! "TLS support"), with rustls.
//!
//! The handshake starts in plaintext; when the client asks for `NBD_OPT_STARTTLS`
//! the server acknowledges, then the TLS handshake runs on the same socket and the
//! option haggling goes on inside it. A listener with [`TlsPolicy::required`] set
//! is in the spec's FORCEDTLS mode: every option but STARTTLS and ABORT is refused
//! with `NBD_REP_ERR_TLS_REQD` until TLS is up, so no export is listed, described or
//! served in plaintext.
//!
//! Once TLS is up, the connection's plaintext side is one end of a Unix socket pair
//! and a *pump* thread owns the TLS state: it decrypts what the client sends into
//! the pair and encrypts what the server writes to the pair. Why a pump and not a
//! TLS stream shared by the connection's threads: the reader, the replier and any
//! thread completing commands write to the connection (replies go out without
//! blocking when the socket takes them), while a TLS session is one state machine
//! for both directions. With the pump it has one owner and no lock, and the
//! transmission code is the same for plaintext and TLS. The price is one copy each
//! way through the pair, small beside the encryption itself.

use crate::server::Conn;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
pub use rustls::ServerConfig;
use rustls::{RootCertStore, ServerConnection};
use std::io::{self, Read, Write};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;

/// How a listener treats TLS.
#[derive(Clone)]
pub struct TlsPolicy {
    pub config: Arc<ServerConfig>,
    /// Refuse everything but STARTTLS and ABORT until TLS is up (FORCEDTLS).
    pub required: bool,
}

/// Loads a server certificate chain and key (PEM) and, when `ca` is given, the
/// certificate authorities client certificates must chain to: with `ca`, a client
/// without a valid certificate is refused during the TLS handshake.
pub fn load_config(cert: &Path, key: &Path, ca: Option<&Path>) -> Result<ServerConfig, String> {
    let read = |what: &str, p: &Path| {
        std::fs::read(p).map_err(|e| format!("cannot read the TLS {what} {}: {e}", p.display()))
    };
    let certs = CertificateDer::pem_slice_iter(&read("certificate", cert)?)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file: {e}", cert.display()))?;
    if certs.is_empty() {
        return Err(format!("{}: holds no PEM certificate", cert.display()));
    }
    let key = PrivateKeyDer::from_pem_slice(&read("key", key)?)
        .map_err(|e| format!("{}: holds no usable PEM private key: {e}", key.display()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS setup: {e}"))?;
    let builder = match ca {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_slice_iter(&read("CA certificate", ca)?) {
                let c =
                    c.map_err(|e| format!("{}: not a PEM certificate file: {e}", ca.display()))?;
                roots
                    .add(c)
                    .map_err(|e| format!("{}: unusable CA certificate: {e}", ca.display()))?;
            }
            if roots.is_empty() {
                return Err(format!("{}: holds no PEM certificate", ca.display()));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("TLS certificate {} with key: {e}", cert.display()))
}

/// Starts TLS on an accepted connection whose plaintext handshake just acknowledged
/// STARTTLS. Returns the plaintext side; the TLS handshake itself runs in the pump,
/// so a client that stalls there is caught by the NBD handshake's read timeout.
pub(crate) fn start(net: Box<dyn Conn>, config: &Arc<ServerConfig>) -> io::Result<Box<dyn Conn>> {
    let mut tls = ServerConnection::new(config.clone()).map_err(io::Error::other)?;
    // The pump reads plaintext only when the TLS output is drained, in bounded
    // chunks, so the buffer needs no limit of its own.
    tls.set_buffer_limit(None);
    let (inner, outer) = UnixStream::pair()?;
    std::thread::Builder::new()
        .name("nbd-tls".into())
        .spawn(move || {
            let mut pump = match net.try_clone_conn() {
                Ok(r) => Pump {
                    // rustls reads at most 4 KiB per call: a buffer in front of the
                    // socket turns that into one system call per 256 KiB.
                    net_in: std::io::BufReader::with_capacity(CHUNK, r),
                    net,
                    tls,
                    plain: inner,
                    to_plain: Vec::new(),
                },
                Err(e) => {
                    tracing::warn!("TLS connection dropped: {e}");
                    return;
                }
            };
            if let Err(e) = pump.run() {
                tracing::info!("TLS connection closed: {e}");
            }
            pump.net.shutdown_conn();
            let _ = pump.plain.shutdown(std::net::Shutdown::Both);
        })?;
    Ok(Box::new(outer))
}

/// Largest chunk moved per step, and most decrypted bytes held for the server side.
const CHUNK: usize = 256 * 1024;
/// How long a closed connection waits for the client to take its last bytes.
const LINGER_MS: i32 = 30_000;

struct Pump {
    /// The client's socket (encrypted), for sending.
    net: Box<dyn Conn>,
    /// The same socket, for receiving.
    net_in: std::io::BufReader<Box<dyn Conn>>,
    tls: ServerConnection,
    /// The server's side of the pair (plaintext).
    plain: UnixStream,
    /// Decrypted bytes the server side has not taken yet.
    to_plain: Vec<u8>,
}

fn set_nonblocking(fd: i32) -> io::Result<()> {
    // SAFETY: fcntl on an open descriptor with valid flags.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) < 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

fn would_block(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::WouldBlock
}

impl Pump {
    fn run(&mut self) -> io::Result<()> {
        set_nonblocking(self.net.raw_fd())?;
        self.plain.set_nonblocking(true)?;
        let mut buf = vec![0u8; CHUNK];
        // The client sent its last byte (FIN or close_notify).
        let mut net_done = false;
        // The server side closed the pair: the connection is over.
        let mut plain_done = false;
        let mut plain_shut = false;
        loop {
            self.flush_net()?;
            if self.flush_plain()? {
                return Ok(()); // the server side is gone
            }
            if net_done && self.tls.is_handshaking() {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "client left during the TLS handshake",
                ));
            }
            if net_done && self.to_plain.is_empty() && !plain_shut {
                // Pass the end of the client's stream on: the server finishes the
                // commands in flight and closes its side.
                let _ = self.plain.shutdown(std::net::Shutdown::Write);
                plain_shut = true;
            }
            if plain_done && !self.tls.wants_write() {
                return Ok(());
            }
            let net_in = !net_done && self.to_plain.len() < CHUNK && self.tls.wants_read();
            // Read from the server side even during the TLS handshake: that is how
            // the pump learns that the server gave up on a stalled client.
            let plain_in = !plain_done && !self.tls.wants_write();
            let mut fds = [
                libc::pollfd {
                    fd: self.net.raw_fd(),
                    events: (if net_in { libc::POLLIN } else { 0 })
                        | (if self.tls.wants_write() {
                            libc::POLLOUT
                        } else {
                            0
                        }),
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.plain.as_raw_fd(),
                    events: (if plain_in { libc::POLLIN } else { 0 })
                        | (if self.to_plain.is_empty() {
                            0
                        } else {
                            libc::POLLOUT
                        }),
                    revents: 0,
                },
            ];
            // Bytes already in `net_in` are not seen by poll: do not wait then.
            let buffered = net_in && !self.net_in.buffer().is_empty();
            // Once the server side is closed, a client that does not take the rest
            // gets a bounded time to do so.
            let timeout = if buffered {
                0
            } else if plain_done {
                LINGER_MS
            } else {
                -1
            };
            // SAFETY: polls two open descriptors described by a valid array.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if n == 0 && !buffered {
                return Ok(());
            }
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            let ready =
                |f: &libc::pollfd, ev: i16| f.revents & (ev | libc::POLLHUP | libc::POLLERR) != 0;
            if buffered || (net_in && ready(&fds[0], libc::POLLIN)) {
                net_done = self.read_net()?;
            }
            if plain_in && ready(&fds[1], libc::POLLIN) {
                match self.plain.read(&mut buf) {
                    Ok(0) => {
                        plain_done = true;
                        self.tls.send_close_notify();
                    }
                    Ok(n) => self.tls.writer().write_all(&buf[..n])?,
                    Err(e) if would_block(&e) || e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
        }
    }

    /// Reads what the client sent and decrypts it into `to_plain`, until the socket
    /// is drained or `to_plain` is full. True when the client's stream has ended.
    fn read_net(&mut self) -> io::Result<bool> {
        loop {
            let ended = match self.tls.read_tls(&mut self.net_in) {
                Ok(0) => true,
                Ok(_) => false,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if would_block(&e) => return Ok(false),
                Err(e) => return Err(e),
            };
            let state = match self.tls.process_new_packets() {
                Ok(s) => s,
                Err(e) => {
                    // Tell the client why (rustls queued an alert), then give up.
                    let _ = self.tls.write_tls(&mut self.net);
                    return Err(io::Error::new(io::ErrorKind::InvalidData, e));
                }
            };
            let closed = state.peer_has_closed();
            let mut want = state.plaintext_bytes_to_read();
            while want > 0 {
                let at = self.to_plain.len();
                self.to_plain.resize(at + want, 0);
                let n = self.tls.reader().read(&mut self.to_plain[at..])?;
                self.to_plain.truncate(at + n);
                if n == 0 {
                    break;
                }
                want -= n;
            }
            if ended || closed {
                return Ok(true);
            }
            if self.to_plain.len() >= CHUNK {
                return Ok(false);
            }
        }
    }

    /// Sends what TLS has queued for the client, as far as the socket takes it.
    fn flush_net(&mut self) -> io::Result<()> {
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.net) {
                Ok(_) => {}
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Hands decrypted bytes to the server side, as far as the pair takes them.
    /// True when the server side has closed.
    fn flush_plain(&mut self) -> io::Result<bool> {
        let mut off = 0;
        while off < self.to_plain.len() {
            match self.plain.write(&self.to_plain[off..]) {
                Ok(n) => off += n,
                Err(e) if would_block(&e) => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::BrokenPipe => return Ok(true),
                Err(e) => return Err(e),
            }
        }
        self.to_plain.drain(..off);
        Ok(false)
    }
}
