//! A client's bytes, handshake and requests, against the NBD server over a Unix
//! socket pair, with a small in-memory export behind it. Whatever the client sends,
//! the server answers or hangs up: never a panic, a hang, or memory out of
//! proportion to what was sent.
#![no_main]
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, ExportInfo, Extent};
use libfuzzer_sys::fuzz_target;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

struct Ram;

impl Backend for Ram {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        vec![ExportInfo {
            name: "v".into(),
            description: "fuzz".into(),
            size: 1 << 20,
        }]
    }
    fn open_export(&self, name: &str) -> Option<((), ExportInfo)> {
        (name == "v" || name.is_empty()).then(|| ((), self.exports().remove(0)))
    }
    fn read(&self, _: &(), _offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        buf.fill(0);
        Ok(())
    }
    /// Extents of every kind the server must cope with: empty ones, ones past the
    /// request, more than asked for.
    fn block_status(
        &self,
        _: &(),
        offset: u64,
        length: u32,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), u32> {
        for i in 0..(offset % 7) as u32 + max.min(3) as u32 {
            out.push(Extent {
                length: length.wrapping_mul(i) % 9000,
                flags: i,
            });
        }
        Ok(())
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        reply.complete_now(handle, 0, cmd);
    }
}

fuzz_target!(|data: &[u8]| {
    let (mut client, server) = UnixStream::pair().unwrap();
    // Replies are drained so that the server never blocks on a full socket.
    let mut rx = client.try_clone().unwrap();
    let drain = std::thread::spawn(move || {
        let mut sink = [0u8; 65536];
        while matches!(rx.read(&mut sink), Ok(n) if n > 0) {}
    });
    let feed = {
        let data = data.to_vec();
        std::thread::spawn(move || {
            let _ = client.write_all(&data);
            let _ = client.shutdown(std::net::Shutdown::Write);
        })
    };
    let _ = lamina_nbd::serve_connection(Arc::new(Ram), Box::new(server), None, None);
    feed.join().unwrap();
    drain.join().unwrap();
});
