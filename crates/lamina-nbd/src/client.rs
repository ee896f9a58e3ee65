//! A minimal NBD client: fixed newstyle handshake with `NBD_OPT_GO`, simple replies,
//! and pipelining (send many requests, then collect replies by handle). Used by the
//! tests and the crash tester; real clients are the kernel, QEMU, libnbd and fio.

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
    /// Read length per outstanding handle.
    reads: HashMap<u64, usize>,
}

/// A reply collected by [`Client::recv`].
#[derive(Debug)]
pub struct Received {
    pub handle: u64,
    pub error: u32,
    pub data: Vec<u8>,
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
        let s = UnixStream::connect(path)?;
        let mut c = Client {
            r: BufReader::new(s.try_clone()?),
            w: BufWriter::new(s),
            size: 0,
            flags: 0,
            next_handle: 1,
            reads: HashMap::new(),
        };
        c.handshake(export)?;
        Ok(c)
    }

    fn handshake(&mut self, export: &str) -> Result<(), ClientError> {
        let magic = u64::from_be_bytes(rd(&mut self.r)?);
        let opt = u64::from_be_bytes(rd(&mut self.r)?);
        let _flags = u16::from_be_bytes(rd(&mut self.r)?);
        if magic != NBDMAGIC || opt != IHAVEOPT {
            return Err(ClientError::Protocol("not a newstyle NBD server".into()));
        }
        self.w
            .write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())?;
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
            self.reads.insert(handle, length as usize);
        }
        Ok(handle)
    }

    /// Pushes queued requests to the server.
    pub fn push(&mut self) -> io::Result<()> {
        self.w.flush()
    }

    /// Receives the next reply, whichever request it answers.
    pub fn recv(&mut self) -> Result<Received, ClientError> {
        self.w.flush()?;
        let magic = u32::from_be_bytes(rd(&mut self.r)?);
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(ClientError::Protocol(format!("bad reply magic {magic:#x}")));
        }
        let error = u32::from_be_bytes(rd(&mut self.r)?);
        let handle = u64::from_be_bytes(rd(&mut self.r)?);
        let len = self.reads.remove(&handle).unwrap_or(0);
        let mut data = Vec::new();
        if error == 0 && len > 0 {
            data.resize(len, 0);
            self.r.read_exact(&mut data)?;
        }
        Ok(Received {
            handle,
            error,
            data,
        })
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
