//! A read-only export: advertised as such (NBD_FLAG_READ_ONLY, no trim or zeroes),
//! every write, trim and zeroes refused with EPERM while reads and flushes go on,
//! and the refused write's payload consumed so the connection stays in step.

mod common;

use lamina_nbd::client::{Client, ClientError};
use lamina_nbd::proto::*;
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, ExportInfo};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Export "v" read-only, "w" writable; counts the commands that reach it.
#[derive(Default)]
struct Frozen {
    commands: AtomicU64,
}

impl Backend for Frozen {
    type Export = bool;
    fn exports(&self) -> Vec<ExportInfo> {
        let mut e = common::one_export("frozen", 1 << 20);
        e.push(ExportInfo {
            name: "w".into(),
            description: "writable".into(),
            size: 1 << 20,
        });
        e
    }
    fn open_export(&self, name: &str) -> Option<(bool, ExportInfo)> {
        let e = self.exports().into_iter().find(|e| e.name == name)?;
        Some((name == "v", e))
    }
    fn read_only(&self, export: &bool) -> bool {
        *export
    }
    fn read(&self, _: &bool, offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        buf.fill(offset as u8 | 1);
        Ok(())
    }
    fn submit(&self, _: &bool, handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        if !matches!(cmd, Command::Flush) {
            self.commands.fetch_add(1, Ordering::SeqCst);
        }
        reply.complete_now(handle, 0, cmd);
    }
}

#[test]
fn a_read_only_export_refuses_writes_and_goes_on() {
    let backend = Arc::new(Frozen::default());
    let (sock, _stop) = common::serve_unix(backend.clone(), "read-only");
    let mut c = Client::connect_unix(&sock, "v").unwrap();
    assert_ne!(c.flags & TF_READ_ONLY, 0);
    for f in [TF_SEND_TRIM, TF_SEND_WRITE_ZEROES, TF_SEND_FAST_ZERO] {
        assert_eq!(c.flags & f, 0, "flag {f:#x} offered on a read-only export");
    }
    let eperm = |r: Result<(), ClientError>| matches!(r, Err(ClientError::Nbd(EPERM)));
    assert!(eperm(c.write(0, &[7u8; 65536], true)));
    assert!(eperm(c.trim(0, 4096)));
    assert!(eperm(c.write_zeroes(0, 4096)));
    // The refused payload was read off the socket: the next requests are understood.
    assert_eq!(c.read(4096, 8).unwrap(), vec![1u8; 8]);
    c.flush().unwrap();
    assert_eq!(
        backend.commands.load(Ordering::SeqCst),
        0,
        "a write reached the backend"
    );
    // Out of range is still EINVAL, checked first.
    assert!(matches!(
        c.write(1 << 20, &[0; 512], false),
        Err(ClientError::Nbd(EINVAL))
    ));

    // The writable export on the same server takes writes.
    let mut w = Client::connect_unix(&sock, "w").unwrap();
    assert_eq!(w.flags & TF_READ_ONLY, 0);
    w.write(0, &[7u8; 4096], false).unwrap();
    w.trim(0, 4096).unwrap();
    assert_eq!(backend.commands.load(Ordering::SeqCst), 2);
}
