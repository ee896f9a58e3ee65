//! Structured replies, metadata contexts and block status, as the spec has them
//! (NetworkBlockDevice/nbd doc/proto.md): reads answered with one OFFSET_DATA chunk
//! (or ERROR, or NONE for an empty read) once structured replies are negotiated,
//! errors with a reason, `base:allocation` selected only the way the spec allows,
//! and block status replies that are valid whatever the backend hands the server.

mod common;

use lamina_nbd::client::{Client, ClientError, Negotiate};
use lamina_nbd::proto::*;
use lamina_nbd::server::ReplySink;
use lamina_nbd::{Backend, Command, ExportInfo, Extent};
use std::path::Path;
use std::sync::Arc;

const SIZE: u64 = 1 << 20;
/// Reads at or past this offset fail with EIO.
const FAILING: u64 = SIZE / 2;

/// Two exports, "v" and "w"; a read returns a pattern of its offsets; block status
/// returns a deliberately sloppy list (an empty extent, then extents that run past
/// what was asked), which the server must make valid.
struct Pattern;

fn pattern(offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = ((offset + i as u64) % 251) as u8;
    }
}

impl Backend for Pattern {
    type Export = ();
    fn exports(&self) -> Vec<ExportInfo> {
        let mut e = common::one_export("pattern", SIZE);
        e.push(ExportInfo {
            name: "w".into(),
            description: "other".into(),
            size: SIZE,
        });
        e
    }
    fn open_export(&self, name: &str) -> Option<((), ExportInfo)> {
        let e = self.exports().into_iter().find(|e| e.name == name)?;
        Some(((), e))
    }
    fn read(&self, _: &(), offset: u64, buf: &mut [u8]) -> Result<(), u32> {
        if offset + buf.len() as u64 > FAILING {
            return Err(EIO);
        }
        pattern(offset, buf);
        Ok(())
    }
    fn block_status(
        &self,
        _: &(),
        offset: u64,
        _length: u32,
        max: usize,
        out: &mut Vec<Extent>,
    ) -> Result<(), u32> {
        let first = 4096 - (offset % 4096) as u32;
        let sloppy = [
            Extent {
                length: 0,
                flags: STATE_HOLE,
            },
            Extent {
                length: first,
                flags: STATE_HOLE | STATE_ZERO,
            },
            Extent {
                length: 8192,
                flags: 0,
            },
            Extent {
                length: 1 << 30,
                flags: STATE_HOLE | STATE_ZERO,
            },
            Extent {
                length: 4096,
                flags: 0,
            },
        ];
        out.extend(sloppy.iter().take(max.max(2)));
        Ok(())
    }
    fn submit(&self, _: &(), handle: u64, cmd: Command, reply: &Arc<ReplySink>) {
        reply.complete_now(handle, 0, cmd);
    }
}

fn server(test: &str) -> std::path::PathBuf {
    common::serve_unix(Arc::new(Pattern), test).0
}

fn one(
    c: &mut Client,
    kind: u16,
    flags: u16,
    offset: u64,
    len: u32,
) -> lamina_nbd::client::Received {
    let h = c.send(kind, flags, offset, len, &[]).unwrap();
    let r = c.recv().unwrap();
    assert_eq!(r.handle, h);
    r
}

#[test]
fn structured_reads_are_one_chunk_each() {
    let sock = server("structured-reads");
    let want = Negotiate {
        structured: true,
        allocation: false,
    };
    let mut c = Client::connect_unix_with(&sock, "v", want).unwrap();
    assert!(c.structured);
    assert_ne!(
        c.flags & TF_SEND_DF,
        0,
        "DF is offered with structured replies"
    );
    assert_ne!(c.flags & TF_SEND_CACHE, 0);

    // Pipelined reads of assorted sizes and alignments: each one OFFSET_DATA chunk
    // holding exactly the bytes asked for.
    let reads: Vec<(u64, u32)> = (0..64u64)
        .map(|i| {
            (
                (i * 7919) % (FAILING - 70_000),
                1 + (i as u32 * 977) % 65_536,
            )
        })
        .collect();
    let mut handles = std::collections::HashMap::new();
    for &(off, len) in &reads {
        let flags = if off % 2 == 0 { CMD_FLAG_DF } else { 0 };
        handles.insert(c.send(CMD_READ, flags, off, len, &[]).unwrap(), (off, len));
    }
    for _ in 0..reads.len() {
        let r = c.recv().unwrap();
        let (off, len) = handles.remove(&r.handle).expect("a reply per read");
        assert_eq!(r.error, 0);
        assert_eq!(r.chunks, vec![REPLY_TYPE_OFFSET_DATA]);
        let mut want = vec![0u8; len as usize];
        pattern(off, &mut want);
        assert!(r.data == want, "read {off}+{len}");
    }

    // An empty read is done without content; a failing one is one ERROR chunk.
    let r = one(&mut c, CMD_READ, 0, 4096, 0);
    assert_eq!((r.error, r.chunks.clone()), (0, vec![REPLY_TYPE_NONE]));
    let r = one(&mut c, CMD_READ, 0, FAILING, 4096);
    assert_eq!((r.error, r.chunks.clone()), (EIO, vec![REPLY_TYPE_ERROR]));
    // Invalid reads get an error chunk with the reason, never a simple reply.
    for (flags, off, len) in [
        (0, SIZE - 4096, 8192),
        (CMD_FLAG_REQ_ONE, 0, 4096),
        (0, 0, MAX_PAYLOAD + 1),
    ] {
        let r = one(&mut c, CMD_READ, flags, off, len);
        assert_eq!(r.error, EINVAL, "{flags:#x} {off}+{len}");
        assert_eq!(r.chunks, vec![REPLY_TYPE_ERROR]);
        assert!(!r.message.is_empty());
    }

    // A DF read too long for one chunk: EOVERFLOW, as the spec suggests.
    let r = one(&mut c, CMD_READ, CMD_FLAG_DF, 0, MAX_PAYLOAD + 1);
    assert_eq!(
        (r.error, r.chunks.clone()),
        (EOVERFLOW, vec![REPLY_TYPE_ERROR])
    );
    // Other commands: cache checks its range; the connection goes on after errors.
    assert_eq!(one(&mut c, CMD_CACHE, 0, 0, 65536).error, 0);
    assert_eq!(one(&mut c, CMD_CACHE, 0, SIZE, 1).error, EINVAL);
    assert_eq!(one(&mut c, CMD_CACHE, CMD_FLAG_NO_HOLE, 0, 1).error, EINVAL);
    c.write(0, &[1u8; 4096], false).unwrap();
    c.flush().unwrap();
    let back = c.read(8192, 100).unwrap();
    let mut want = vec![0u8; 100];
    pattern(8192, &mut want);
    assert_eq!(back, want);

    // Without structured replies: simple replies, and no DF.
    let mut s = Client::connect_unix(&sock, "v").unwrap();
    assert_eq!(s.flags & TF_SEND_DF, 0);
    assert!(matches!(
        s.call_raw(CMD_READ, CMD_FLAG_DF, 0, 512),
        Err(ClientError::Nbd(EINVAL))
    ));
    assert_eq!(s.read(1000, 10).unwrap().len(), 10);
    // Block status needs a context, and a context needs structured replies.
    assert!(matches!(
        s.block_status(0, 4096, 0),
        Err(ClientError::Nbd(EINVAL))
    ));
    assert!(matches!(
        c.block_status(0, 4096, 0),
        Err(ClientError::Nbd(EINVAL))
    ));
}

/// The options' replies: (informational replies, final reply type).
fn haggle(c: &mut Client, option: u32, data: &[u8]) -> (Vec<(u32, Vec<u8>)>, u32) {
    let (infos, reply, _) = c.option(option, data).unwrap();
    (infos, reply)
}

fn context_names(infos: &[(u32, Vec<u8>)]) -> Vec<(u32, String)> {
    infos
        .iter()
        .map(|(t, d)| {
            assert_eq!(*t, REP_META_CONTEXT);
            let id = u32::from_be_bytes(d[0..4].try_into().unwrap());
            (id, String::from_utf8(d[4..].to_vec()).unwrap())
        })
        .collect()
}

#[test]
fn metadata_contexts_are_negotiated_as_the_spec_says() {
    let sock = server("meta-contexts");
    let req = Client::meta_request;
    let alloc = META_BASE_ALLOCATION.to_string();
    let mut c = Client::connect_unix_greeted(&sock).unwrap();
    // Contexts need structured replies first; structured replies take no data.
    assert_eq!(
        haggle(&mut c, OPT_LIST_META_CONTEXT, &req("v", &[])).1,
        REP_ERR_INVALID
    );
    assert_eq!(
        haggle(&mut c, OPT_SET_META_CONTEXT, &req("v", &[&alloc])).1,
        REP_ERR_INVALID
    );
    assert_eq!(
        haggle(&mut c, OPT_STRUCTURED_REPLY, &[1]).1,
        REP_ERR_INVALID
    );
    assert_eq!(haggle(&mut c, OPT_STRUCTURED_REPLY, &[]).1, REP_ACK);
    // LIST: no query and the `base:` wildcard list base:allocation (id 0, as the
    // spec reserves); unknown namespaces are ignored.
    for queries in [
        &[][..],
        &["base:"],
        &["base:allocation"],
        &["qemu:dirty-bitmap:x", "base:"],
    ] {
        let (infos, reply) = haggle(&mut c, OPT_LIST_META_CONTEXT, &req("v", queries));
        assert_eq!(reply, REP_ACK, "{queries:?}");
        assert_eq!(
            context_names(&infos),
            vec![(0, alloc.clone())],
            "{queries:?}"
        );
    }
    let (infos, reply) = haggle(&mut c, OPT_LIST_META_CONTEXT, &req("v", &["x-other:thing"]));
    assert_eq!((infos.len(), reply), (0, REP_ACK));
    // SET: the wildcard and no query select nothing; an unknown export and a
    // malformed request are refused.
    for queries in [&[][..], &["base:"], &["base:allocatio"]] {
        let (infos, reply) = haggle(&mut c, OPT_SET_META_CONTEXT, &req("v", queries));
        assert_eq!((infos.len(), reply), (0, REP_ACK), "{queries:?}");
    }
    assert_eq!(
        haggle(&mut c, OPT_SET_META_CONTEXT, &req("nope", &[&alloc])).1,
        REP_ERR_UNKNOWN
    );
    let mut bad = req("v", &[&alloc]);
    bad.truncate(bad.len() - 1);
    assert_eq!(
        haggle(&mut c, OPT_SET_META_CONTEXT, &bad).1,
        REP_ERR_INVALID
    );
    let mut bad = req("v", &[&alloc]);
    bad.push(0);
    assert_eq!(
        haggle(&mut c, OPT_SET_META_CONTEXT, &bad).1,
        REP_ERR_INVALID
    );
    let (infos, reply) = haggle(&mut c, OPT_SET_META_CONTEXT, &req("v", &[&alloc, "base:"]));
    assert_eq!(reply, REP_ACK);
    let ctx = context_names(&infos);
    assert_eq!(ctx.len(), 1);
    assert_eq!(ctx[0].1, alloc);
    // Selected for "v" but "w" is opened: no block status there.
    c.structured = true;
    c.go("w").unwrap();
    assert!(matches!(
        c.block_status(0, 4096, 0),
        Err(ClientError::Nbd(EINVAL))
    ));

    // A failed SET forgets an earlier selection.
    let mut c = Client::connect_unix_greeted(&sock).unwrap();
    assert_eq!(haggle(&mut c, OPT_STRUCTURED_REPLY, &[]).1, REP_ACK);
    assert_eq!(
        haggle(&mut c, OPT_SET_META_CONTEXT, &req("v", &[&alloc]))
            .0
            .len(),
        1
    );
    assert_eq!(
        haggle(&mut c, OPT_SET_META_CONTEXT, &req("nope", &[&alloc])).1,
        REP_ERR_UNKNOWN
    );
    c.structured = true;
    c.go("v").unwrap();
    assert!(matches!(
        c.block_status(0, 4096, 0),
        Err(ClientError::Nbd(EINVAL))
    ));

    // Selected for the export opened: served, under the id the server gave.
    let want = Negotiate {
        structured: true,
        allocation: true,
    };
    let mut c = Client::connect_unix_with(&sock, "v", want).unwrap();
    assert!(c.allocation_context.is_some());
    assert!(!c.block_status(0, 4096, 0).unwrap().is_empty());
}

#[test]
fn block_status_replies_are_valid_whatever_the_backend_gives() {
    let sock = server("block-status");
    let want = Negotiate {
        structured: true,
        allocation: true,
    };
    let mut c = Client::connect_unix_with(&sock, "v", want).unwrap();
    for (offset, len) in [
        (0u64, 4096u32),
        (0, 100_000),
        (1000, 5000),
        (4096, 12_288),
        (SIZE - 512, 512),
        (0, SIZE as u32),
    ] {
        let ex = c.block_status(offset, len, 0).unwrap();
        assert!(
            !ex.is_empty() && ex.iter().all(|&(l, _)| l > 0),
            "{offset}+{len}: {ex:?}"
        );
        // Every extent but the last lies within the request (the spec).
        let before_last: u64 = ex[..ex.len() - 1].iter().map(|&(l, _)| l as u64).sum();
        assert!(before_last < len as u64, "{offset}+{len}: {ex:?}");
        // Nothing past the end of the export, though the backend says more.
        let total: u64 = ex.iter().map(|&(l, _)| l as u64).sum();
        assert!(total <= SIZE - offset, "{offset}+{len}: {ex:?}");
        let first = 4096 - (offset % 4096) as u32;
        assert_eq!(ex[0], (first, STATE_HOLE | STATE_ZERO), "{offset}+{len}");
        // With REQ_ONE: one extent, no longer than asked.
        let one = c.block_status(offset, len, CMD_FLAG_REQ_ONE).unwrap();
        assert_eq!(
            one,
            vec![(first.min(len), STATE_HOLE | STATE_ZERO)],
            "{offset}+{len}"
        );
    }
    for (flags, offset, len) in [
        (0, SIZE, 1),
        (0, SIZE - 4096, 8192),
        (0, 0, 0),
        (CMD_FLAG_DF, 0, 4096),
    ] {
        let r = c.block_status(offset, len, flags);
        assert!(
            matches!(r, Err(ClientError::Nbd(EINVAL))),
            "{flags:#x} {offset}+{len}: {r:?}"
        );
    }
    // FUA is accepted on any command (the spec).
    assert!(c.block_status(0, 4096, CMD_FLAG_FUA).is_ok());
    assert!(Path::new(&sock).exists());
}

/// Without a read pool the connection's own thread reads and replies: structured
/// there too.
#[test]
fn reads_on_the_connection_thread_are_structured_too() {
    let dir = std::env::temp_dir().join(format!("lamina-nbd-nopool-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("s.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let conn = Box::new(conn.unwrap());
            std::thread::spawn(move || {
                let _ = lamina_nbd::serve_connection(Arc::new(Pattern), conn, None, None);
            });
        }
    });
    let want = Negotiate {
        structured: true,
        allocation: false,
    };
    let mut c = Client::connect_unix_with(&sock, "v", want).unwrap();
    let r = one(&mut c, CMD_READ, 0, 12_345, 7000);
    assert_eq!(
        (r.error, r.chunks.clone()),
        (0, vec![REPLY_TYPE_OFFSET_DATA])
    );
    let mut want = vec![0u8; 7000];
    pattern(12_345, &mut want);
    assert!(r.data == want);
    let r = one(&mut c, CMD_READ, 0, FAILING, 4096);
    assert_eq!((r.error, r.chunks.clone()), (EIO, vec![REPLY_TYPE_ERROR]));
    let r = one(&mut c, CMD_READ, 0, 0, 0);
    assert_eq!((r.error, r.chunks.clone()), (0, vec![REPLY_TYPE_NONE]));
    let r = one(&mut c, CMD_READ, 0, SIZE, 1);
    assert_eq!(
        (r.error, r.chunks.clone()),
        (EINVAL, vec![REPLY_TYPE_ERROR])
    );
    // The same connection, simple replies, when not negotiated.
    let mut s = Client::connect_unix(&sock, "v").unwrap();
    let mut w = vec![0u8; 50];
    pattern(100, &mut w);
    assert_eq!(s.read(100, 50).unwrap(), w);
}
