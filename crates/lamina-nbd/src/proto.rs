//! Wire constants and message layouts of the NBD protocol (NetworkBlockDevice/nbd,
//! doc/proto.md), fixed newstyle negotiation. All integers are big-endian.

pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054; // "IHAVEOPT"
pub const REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// Handshake flags (server) and client flags.
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

// Option replies.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_TLS_REQD: u32 = (1 << 31) + 5;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_SHUTDOWN: u32 = (1 << 31) + 7;

// Info types.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// Transmission flags.
pub const TF_HAS_FLAGS: u16 = 1 << 0;
pub const TF_READ_ONLY: u16 = 1 << 1;
pub const TF_SEND_FLUSH: u16 = 1 << 2;
pub const TF_SEND_FUA: u16 = 1 << 3;
pub const TF_SEND_TRIM: u16 = 1 << 5;
pub const TF_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TF_SEND_DF: u16 = 1 << 7;
pub const TF_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TF_SEND_CACHE: u16 = 1 << 10;
pub const TF_SEND_FAST_ZERO: u16 = 1 << 11;

// Commands.
pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// Structured reply flags and chunk types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

// `base:allocation` status flags.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;
/// The one metadata context Lamina serves.
pub const META_BASE_ALLOCATION: &str = "base:allocation";

// Errors.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Largest request payload accepted (and advertised as the maximum block size).
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;
/// Block size advertised as preferred.
pub const PREFERRED_BLOCK: u32 = 4096;
/// Longest string (export name, description) the protocol allows.
pub const MAX_STRING: usize = 4096;
/// Largest option payload read into memory; longer ones end the connection.
pub const MAX_OPTION_DATA: u32 = 64 * 1024;

/// A transmission-phase request header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestHeader {
    pub flags: u16,
    pub kind: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

impl RequestHeader {
    pub const SIZE: usize = 28;

    pub fn decode(b: &[u8; Self::SIZE]) -> Result<Self, u32> {
        let magic = u32::from_be_bytes(b[0..4].try_into().unwrap());
        if magic != REQUEST_MAGIC {
            return Err(magic);
        }
        Ok(RequestHeader {
            flags: u16::from_be_bytes(b[4..6].try_into().unwrap()),
            kind: u16::from_be_bytes(b[6..8].try_into().unwrap()),
            handle: u64::from_be_bytes(b[8..16].try_into().unwrap()),
            offset: u64::from_be_bytes(b[16..24].try_into().unwrap()),
            length: u32::from_be_bytes(b[24..28].try_into().unwrap()),
        })
    }

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        b[4..6].copy_from_slice(&self.flags.to_be_bytes());
        b[6..8].copy_from_slice(&self.kind.to_be_bytes());
        b[8..16].copy_from_slice(&self.handle.to_be_bytes());
        b[16..24].copy_from_slice(&self.offset.to_be_bytes());
        b[24..28].copy_from_slice(&self.length.to_be_bytes());
        b
    }
}

/// A simple reply header.
pub fn simple_reply(handle: u64, error: u32) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    b[4..8].copy_from_slice(&error.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b
}

/// Bytes of a structured reply chunk's header.
pub const CHUNK_HEADER: usize = 20;

/// The header of a structured reply chunk whose payload is `length` bytes.
pub fn chunk_header(handle: u64, flags: u16, kind: u16, length: u32) -> [u8; CHUNK_HEADER] {
    let mut b = [0u8; CHUNK_HEADER];
    b[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&kind.to_be_bytes());
    b[8..16].copy_from_slice(&handle.to_be_bytes());
    b[16..20].copy_from_slice(&length.to_be_bytes());
    b
}

/// The most bytes [`ReplyHead`] holds: a chunk header and an OFFSET_DATA offset.
const HEAD_MAX: usize = CHUNK_HEADER + 8;

/// What goes on the wire before a read's data (or instead of it, on error): a
/// simple reply header, or with structured replies one final chunk, OFFSET_DATA
/// (the data follows) or ERROR. Built on the stack: nothing is allocated per reply.
#[derive(Clone, Copy)]
pub struct ReplyHead {
    bytes: [u8; HEAD_MAX],
    len: u8,
}

impl ReplyHead {
    /// No reply: a placeholder for arrays of heads.
    pub const EMPTY: ReplyHead = ReplyHead {
        bytes: [0; HEAD_MAX],
        len: 0,
    };

    /// The head of a read reply of `data_len` bytes at `offset`: `error` 0 means
    /// the data follows.
    pub fn read(structured: bool, handle: u64, offset: u64, data_len: usize, error: u32) -> Self {
        let mut h = ReplyHead {
            bytes: [0; HEAD_MAX],
            len: 0,
        };
        if !structured {
            h.put(&simple_reply(handle, error));
        } else if error == 0 && data_len == 0 {
            // OFFSET_DATA must carry a byte: an empty read is just done.
            h.put(&chunk_header(handle, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0));
        } else if error == 0 {
            let len = 8 + data_len as u32;
            h.put(&chunk_header(
                handle,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                len,
            ));
            h.put(&offset.to_be_bytes());
        } else {
            h.put(&chunk_header(handle, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, 6));
            h.put(&error.to_be_bytes());
            h.put(&0u16.to_be_bytes());
        }
        h
    }

    fn put(&mut self, b: &[u8]) {
        let at = self.len as usize;
        self.bytes[at..at + b.len()].copy_from_slice(b);
        self.len += b.len() as u8;
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

/// A final ERROR chunk carrying `message` (cut to the protocol's string limit).
pub fn error_chunk(handle: u64, error: u32, message: &str) -> Vec<u8> {
    let mut m = &message.as_bytes()[..message.len().min(MAX_STRING)];
    while std::str::from_utf8(m).is_err() {
        m = &m[..m.len() - 1];
    }
    let mut b = Vec::with_capacity(CHUNK_HEADER + 6 + m.len());
    b.extend_from_slice(&chunk_header(
        handle,
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        6 + m.len() as u32,
    ));
    b.extend_from_slice(&error.to_be_bytes());
    b.extend_from_slice(&(m.len() as u16).to_be_bytes());
    b.extend_from_slice(m);
    b
}

/// An option reply header followed by its data.
pub fn option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(20 + data.len());
    b.extend_from_slice(&REPLY_MAGIC.to_be_bytes());
    b.extend_from_slice(&option.to_be_bytes());
    b.extend_from_slice(&reply.to_be_bytes());
    b.extend_from_slice(&(data.len() as u32).to_be_bytes());
    b.extend_from_slice(data);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip_and_bad_magic() {
        let r = RequestHeader {
            flags: CMD_FLAG_FUA,
            kind: CMD_WRITE,
            handle: 0xdead_beef_0000_0001,
            offset: 1 << 40,
            length: 4096,
        };
        assert_eq!(RequestHeader::decode(&r.encode()), Ok(r));
        let mut b = r.encode();
        b[0] = 0;
        assert!(RequestHeader::decode(&b).is_err());
    }
}
