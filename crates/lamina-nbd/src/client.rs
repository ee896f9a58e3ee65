//! A minimal NBD client: fixed newstyle handshake with `NBD_OPT_GO`, simple or
//! structured replies, `base:allocation` block status, and pipelining (send many
//! requests, then collect replies by handle). Used by the tests and the crash tester;
//! real clients are the kernel, QEMU, libnbd and fio. It checks what it receives as
//! strictly as the spec lets a client, so tests see a server's mistakes.

use crate::proto::*;
use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("server replied with error {0}")]
    Nbd(u32),
    #[error("protocol: {0}")]
    Protocol(String),
}

pub struct Client {
    r: BufReader<UnixStream>,
    w: BufWriter<UnixStream>,
    pub size: u64,
    pub flags: u16,
    next_handle: u64,
    /// Offset and length per outstanding read.
    reads: HashMap<u64, (u64, usize)>,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// The id the server gave `base:allocation`, if it was selected.
    pub allocation_context: Option<u32>,
    /// Structured replies still collecting chunks.
    partial: HashMap<u64, Received>,
}

/// The replies to one option: the informational ones (type, data), then the final
/// one's type and data.
pub type OptionReplies = (Vec<(u32, Vec<u8>)>, u32, Vec<u8>);

/// What to negotiate beyond the export.
#[derive(Clone, Copy, Debug, Default)]
pub struct Negotiate {
    /// NBD_OPT_STRUCTURED_REPLY.
    pub structured: bool,
    /// NBD_OPT_SET_META_CONTEXT `base:allocation` (needs `structured`).
    pub allocation: bool,
}

/// A reply collected by [`Client::recv`].
#[derive(Debug, Default)]
pub struct Received {
    pub handle: u64,
    pub error: u32,
    pub data: Vec<u8>,
    /// The error chunk's message (structured replies).
    pub message: String,
    /// Block status: the context id and its extents (length, flags).
    pub context: Option<u32>,
    pub extents: Vec<(u32, u32)>,
    /// The chunk types of a structured reply, in the order they came.
    pub chunks: Vec<u16>,
    /// Bytes of a read's data that content chunks covered.
    covered: usize,
}

fn rd<const N: usize>(r: &mut impl Read) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

impl Client {
    /// Makes [`Client::recv`] fail instead of waiting longer than `d` for a byte.
    pub fn set_read_timeout(&self, d: Option<std::time::Duration>) -> io::Result<()> {
        self.r.get_ref().set_read_timeout(d)
    }

    /// Connects to a Unix socket and opens `export` with NBD_OPT_GO.
    pub fn connect_unix(path: &Path, export: &str) -> Result<Client, ClientError> {
        Self::connect_unix_with(path, export, Negotiate::default())
    }

    /// Connects and opens `export`, negotiating what `want` asks for first.
    pub fn connect_unix_with(
        path: &Path,
        export: &str,
        want: Negotiate,
    ) -> Result<Client, ClientError> {
        let mut c = Self::open(path)?;
        c.handshake(export, want)?;
        Ok(c)
    }

    /// A client on a fresh connection, before the greeting.
    fn open(path: &Path) -> Result<Client, ClientError> {
        let s = UnixStream::connect(path)?;
        Ok(Client {
            r: BufReader::new(s.try_clone()?),
            w: BufWriter::new(s),
            size: 0,
            flags: 0,
            next_handle: 1,
            reads: HashMap::new(),
            structured: false,
            allocation_context: None,
            partial: HashMap::new(),
        })
    }

    /// Sends an option and collects its replies up to the final one: the
    /// informational replies (type, data), then the final reply's type and data.
    pub fn option(&mut self, option: u32, data: &[u8]) -> Result<OptionReplies, ClientError> {
        self.send_option(option, data)?;
        let mut infos = Vec::new();
        loop {
            let (reply, d) = self.recv_option_reply(option)?;
            if reply == REP_ACK || reply & (1 << 31) != 0 {
                return Ok((infos, reply, d));
            }
            infos.push((reply, d));
        }
    }

    /// The data of NBD_OPT_LIST/SET_META_CONTEXT for `export` and `queries`.
    pub fn meta_request(export: &str, queries: &[&str]) -> Vec<u8> {
        let mut d = (export.len() as u32).to_be_bytes().to_vec();
        d.extend_from_slice(export.as_bytes());
        d.extend_from_slice(&(queries.len() as u32).to_be_bytes());
        for q in queries {
            d.extend_from_slice(&(q.len() as u32).to_be_bytes());
            d.extend_from_slice(q.as_bytes());
        }
        d
    }

    /// Reads the greeting and sends the client flags.
    pub fn greet(&mut self) -> Result<(), ClientError> {
        let magic = u64::from_be_bytes(rd(&mut self.r)?);
        let opt = u64::from_be_bytes(rd(&mut self.r)?);
        let _flags = u16::from_be_bytes(rd(&mut self.r)?);
        if magic != NBDMAGIC || opt != IHAVEOPT {
            return Err(ClientError::Protocol("not a newstyle NBD server".into()));
        }
        self.w
            .write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
        Ok(())
    }

    /// Connects and stops after the greeting, for tests that haggle by hand
    /// ([`Client::option`]) and then [`Client::go`].
    pub fn connect_unix_greeted(path: &Path) -> Result<Client, ClientError> {
        let mut c = Self::open(path)?;
        c.greet()?;
        Ok(c)
    }

    fn handshake(&mut self, export: &str, want: Negotiate) -> Result<(), ClientError> {
        self.greet()?;
        if want.structured {
            let (_, reply, d) = self.option(OPT_STRUCTURED_REPLY, &[])?;
            if reply != REP_ACK {
                return Err(ClientError::Protocol(format!(
                    "structured replies refused ({reply:#x}): {}",
                    String::from_utf8_lossy(&d)
                )));
            }
            self.structured = true;
        }
        if want.allocation {
            let req = Self::meta_request(export, &[META_BASE_ALLOCATION]);
            let (infos, reply, d) = self.option(OPT_SET_META_CONTEXT, &req)?;
            if reply != REP_ACK {
                return Err(ClientError::Protocol(format!(
                    "base:allocation refused ({reply:#x}): {}",
                    String::from_utf8_lossy(&d)
                )));
            }
            for (t, d) in infos {
                if t == REP_META_CONTEXT
                    && d.len() >= 4
                    && &d[4..] == META_BASE_ALLOCATION.as_bytes()
                {
                    self.allocation_context = Some(u32::from_be_bytes(d[0..4].try_into().unwrap()));
                }
            }
        }
        self.go(export)
    }

    /// Sends NBD_OPT_GO for `export` and enters transmission.
    pub fn go(&mut self, export: &str) -> Result<(), ClientError> {
        let mut data = Vec::new();
        data.extend_from_slice(&(export.len() as u32).to_be_bytes());
        data.extend_from_slice(export.as_bytes());
        data.extend_from_slice(&0u16.to_be_bytes());
        self.send_option(OPT_GO, &data)?;
        loop {
            let (reply, data) = self.recv_option_reply(OPT_GO)?;
            match reply {
                REP_INFO => {
                    if data.len() >= 12 && u16::from_be_bytes([data[0], data[1]]) == INFO_EXPORT {
                        self.size = u64::from_be_bytes(data[2..10].try_into().unwrap());
                        self.flags = u16::from_be_bytes(data[10..12].try_into().unwrap());
                    }
                }
                REP_ACK => return Ok(()),
                e => {
                    return Err(ClientError::Protocol(format!(
                        "NBD_OPT_GO refused ({e:#x}): {}",
                        String::from_utf8_lossy(&data)
                    )))
                }
            }
        }
    }

    /// Sends one option (handshake phase).
    pub fn send_option(&mut self, option: u32, data: &[u8]) -> io::Result<()> {
        self.w.write_all(&IHAVEOPT.to_be_bytes())?;
        self.w.write_all(&option.to_be_bytes())?;
        self.w.write_all(&(data.len() as u32).to_be_bytes())?;
        self.w.write_all(data)?;
        self.w.flush()
    }

    fn recv_option_reply(&mut self, option: u32) -> Result<(u32, Vec<u8>), ClientError> {
        let magic = u64::from_be_bytes(rd(&mut self.r)?);
        let opt = u32::from_be_bytes(rd(&mut self.r)?);
        let reply = u32::from_be_bytes(rd(&mut self.r)?);
        let len = u32::from_be_bytes(rd(&mut self.r)?);
        if magic != REPLY_MAGIC || opt != option {
            return Err(ClientError::Protocol("bad option reply".into()));
        }
        let mut data = vec![0u8; len as usize];
        self.r.read_exact(&mut data)?;
        Ok((reply, data))
    }

    /// Queues a request (not yet flushed to the socket). Returns its handle.
    pub fn send(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> io::Result<u64> {
        let handle = self.next_handle;
        self.next_handle += 1;
        let h = RequestHeader {
            flags,
            kind,
            handle,
            offset,
            length,
        };
        self.w.write_all(&h.encode())?;
        self.w.write_all(payload)?;
        if kind == CMD_READ {
            self.reads.insert(handle, (offset, length as usize));
        }
        Ok(handle)
    }

    /// Pushes queued requests to the server.
    pub fn push(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    /// Receives the next whole reply, whichever request it answers (the chunks of a
    /// structured reply are collected until its final one).
    pub fn recv(&mut self) -> Result<Received, ClientError> {
        self.w.flush()?;
        loop {
            let magic = u32::from_be_bytes(rd(&mut self.r)?);
            match magic {
                SIMPLE_REPLY_MAGIC => return self.recv_simple(),
                STRUCTURED_REPLY_MAGIC if self.structured => {
                    if let Some(r) = self.recv_chunk()? {
                        return Ok(r);
                    }
                }
                _ => return Err(ClientError::Protocol(format!("bad reply magic {magic:#x}"))),
            }
        }
    }

    fn recv_simple(&mut self) -> Result<Received, ClientError> {
        let error = u32::from_be_bytes(rd(&mut self.r)?);
        let handle = u64::from_be_bytes(rd(&mut self.r)?);
        let read = self.reads.remove(&handle);
        if self.structured && read.is_some() {
            return Err(ClientError::Protocol(
                "simple reply to a read after structured replies were negotiated".into(),
            ));
        }
        let len = read.map_or(0, |(_, l)| l);
        let mut data = Vec::new();
        if error == 0 && len > 0 {
            data.resize(len, 0);
            self.r.read_exact(&mut data)?;
        }
        Ok(Received {
            handle,
            error,
            data,
            ..Received::default()
        })
    }

    /// One structured chunk (its magic read); the reply when this chunk ends it.
    fn recv_chunk(&mut self) -> Result<Option<Received>, ClientError> {
        let flags = u16::from_be_bytes(rd(&mut self.r)?);
        let kind = u16::from_be_bytes(rd(&mut self.r)?);
        let handle = u64::from_be_bytes(rd(&mut self.r)?);
        let length = u32::from_be_bytes(rd(&mut self.r)?) as usize;
        let bad = |m: String| Err(ClientError::Protocol(m));
        if length > MAX_PAYLOAD as usize + 4096 {
            return bad(format!("chunk of {length} bytes"));
        }
        let mut payload = vec![0u8; length];
        self.r.read_exact(&mut payload)?;
        let read = self.reads.get(&handle).copied();
        let mut r = self.partial.remove(&handle).unwrap_or_else(|| Received {
            handle,
            data: vec![0; read.map_or(0, |(_, l)| l)],
            ..Received::default()
        });
        r.chunks.push(kind);
        let be32 = |b: &[u8]| u32::from_be_bytes(b.try_into().unwrap());
        match kind {
            REPLY_TYPE_NONE if length == 0 && flags & REPLY_FLAG_DONE != 0 => {}
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let Some((start, len)) = read else {
                    return bad(format!("content chunk for handle {handle}, not a read"));
                };
                let min = if kind == REPLY_TYPE_OFFSET_DATA {
                    9
                } else {
                    12
                };
                if length < min || (kind == REPLY_TYPE_OFFSET_HOLE && length != 12) {
                    return bad(format!("content chunk of {length} bytes"));
                }
                let off = u64::from_be_bytes(payload[0..8].try_into().unwrap());
                let n = if kind == REPLY_TYPE_OFFSET_DATA {
                    length - 8
                } else {
                    be32(&payload[8..12]) as usize
                };
                let at = off.checked_sub(start).map(|a| a as usize);
                let Some(at) = at.filter(|&a| a + n <= len) else {
                    return bad(format!(
                        "content chunk {off}+{n} outside the read {start}+{len}"
                    ));
                };
                if kind == REPLY_TYPE_OFFSET_DATA {
                    r.data[at..at + n].copy_from_slice(&payload[8..]);
                } else {
                    r.data[at..at + n].fill(0);
                }
                r.covered += n;
            }
            REPLY_TYPE_BLOCK_STATUS if read.is_none() => {
                if length < 12 || !(length - 4).is_multiple_of(8) {
                    return bad(format!("block status chunk of {length} bytes"));
                }
                r.context = Some(be32(&payload[0..4]));
                for d in payload[4..].chunks(8) {
                    r.extents.push((be32(&d[0..4]), be32(&d[4..8])));
                }
            }
            k if k & (1 << 15) != 0 => {
                if length < 6 {
                    return bad(format!("error chunk of {length} bytes"));
                }
                r.error = be32(&payload[0..4]);
                let ml = u16::from_be_bytes([payload[4], payload[5]]) as usize;
                if r.error == 0 || 6 + ml > length {
                    return bad("malformed error chunk".into());
                }
                r.message = String::from_utf8_lossy(&payload[6..6 + ml]).into_owned();
            }
            k => return bad(format!("unexpected chunk type {k} of {length} bytes")),
        }
        if flags & REPLY_FLAG_DONE == 0 {
            self.partial.insert(handle, r);
            return Ok(None);
        }
        if let Some((_, len)) = self.reads.remove(&handle) {
            if r.error == 0 && r.covered != len {
                return bad(format!("read of {len} bytes answered with {}", r.covered));
            }
            if r.error != 0 {
                r.data.clear();
            }
        }
        Ok(Some(r))
    }

    /// NBD_CMD_BLOCK_STATUS: the extents (length, flags) of `base:allocation`.
    pub fn block_status(
        &mut self,
        offset: u64,
        len: u32,
        flags: u16,
    ) -> Result<Vec<(u32, u32)>, ClientError> {
        let h = self.send(CMD_BLOCK_STATUS, flags, offset, len, &[])?;
        let r = self.recv()?;
        if r.handle != h {
            return Err(ClientError::Protocol("reply for another handle".into()));
        }
        if r.error != 0 {
            return Err(ClientError::Nbd(r.error));
        }
        if r.context.is_none() || r.context != self.allocation_context {
            return Err(ClientError::Protocol(format!(
                "block status for context {:?}, not {:?}",
                r.context, self.allocation_context
            )));
        }
        Ok(r.extents)
    }

    fn call(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> Result<Vec<u8>, ClientError> {
        let h = self.send(kind, flags, offset, length, payload)?;
        let r = self.recv()?;
        if r.handle != h {
            return Err(ClientError::Protocol("reply for another handle".into()));
        }
        if r.error != 0 {
            return Err(ClientError::Nbd(r.error));
        }
        Ok(r.data)
    }

    /// Sends one request without payload and waits for its reply: the data, or
    /// the error the server gave.
    pub fn call_raw(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
    ) -> Result<Vec<u8>, ClientError> {
        self.call(kind, flags, offset, length, &[])
    }

    pub fn read(&mut self, offset: u64, len: u32) -> Result<Vec<u8>, ClientError> {
        self.call(CMD_READ, 0, offset, len, &[])
    }

    pub fn write(&mut self, offset: u64, data: &[u8], fua: bool) -> Result<(), ClientError> {
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        self.call(CMD_WRITE, flags, offset, data.len() as u32, data)
            .map(|_| ())
    }

    pub fn flush(&mut self) -> Result<(), ClientError> {
        self.call(CMD_FLUSH, 0, 0, 0, &[]).map(|_| ())
    }

    pub fn trim(&mut self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.call(CMD_TRIM, 0, offset, len, &[]).map(|_| ())
    }

    pub fn write_zeroes(&mut self, offset: u64, len: u32) -> Result<(), ClientError> {
        self.write_zeroes_flags(offset, len, 0)
    }

    /// NBD_CMD_WRITE_ZEROES with command flags (NO_HOLE, FAST_ZERO, FUA).
    pub fn write_zeroes_flags(
        &mut self,
        offset: u64,
        len: u32,
        flags: u16,
    ) -> Result<(), ClientError> {
        self.call(CMD_WRITE_ZEROES, flags, offset, len, &[])
            .map(|_| ())
    }

    /// Sends NBD_CMD_DISC and closes.
    pub fn disconnect(mut self) -> io::Result<()> {
        self.send(CMD_DISC, 0, 0, 0, &[])?;
        self.w.flush()
    }
}
