//! systemd's readiness protocol (sd_notify(3)) for `Type=notify` units: state
//! lines sent as one datagram to the socket named by `$NOTIFY_SOCKET` (a path, or an
//! abstract name after `@`). Without the variable, when systemd did not start us,
//! nothing is sent. Written by hand: it is one datagram.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;

/// Tells the service manager `state` (lines like `READY=1`, `STATUS=...`); a failure
/// is logged, never fatal: serving matters more than being seen to serve.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    if let Err(e) = send(&path, state) {
        tracing::warn!("cannot notify the service manager at {path:?}: {e}");
    }
}

fn send(path: &OsStr, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    match path.as_bytes().strip_prefix(b"@") {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        }
        None => {
            sock.send_to(state.as_bytes(), std::path::Path::new(path))?;
        }
    }
    Ok(())
}
