//! Little-endian field access on byte slices. Every on-disk field goes through these
//! so that widths are explicit at the call site.

/// Reads a little-endian `u16` at `off`.
#[inline]
pub fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes(b[off..off + 2].try_into().unwrap())
}
/// Reads a little-endian `u32` at `off`.
#[inline]
pub fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}
/// Reads a little-endian `u64` at `off`.
#[inline]
pub fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}
/// Writes a little-endian `u16` at `off`.
#[inline]
pub fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
/// Writes a little-endian `u32` at `off`.
#[inline]
pub fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
/// Writes a little-endian `u64` at `off`.
#[inline]
pub fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}

/// A growing byte buffer with typed little-endian appends, for variable-length
/// structures (the checkpoint's metadata section).
#[derive(Default, Debug, Clone)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    /// A string as a `u16` length followed by its UTF-8 bytes.
    pub fn str(&mut self, s: &str) {
        self.u16(s.len() as u16);
        self.buf.extend_from_slice(s.as_bytes());
    }
}

/// A cursor over a byte slice with typed little-endian reads that fail instead of
/// panicking when the data runs out (the input may be damaged).
pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, pos: 0, what }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], crate::FormatError> {
        if self.buf.len() - self.pos < n {
            return Err(crate::FormatError::Truncated {
                what: self.what,
                have: self.buf.len(),
                need: self.pos + n,
            });
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    pub fn u8(&mut self) -> Result<u8, crate::FormatError> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> Result<u16, crate::FormatError> {
        Ok(get_u16(self.take(2)?, 0))
    }
    pub fn u32(&mut self) -> Result<u32, crate::FormatError> {
        Ok(get_u32(self.take(4)?, 0))
    }
    pub fn u64(&mut self) -> Result<u64, crate::FormatError> {
        Ok(get_u64(self.take(8)?, 0))
    }
    pub fn str(&mut self) -> Result<String, crate::FormatError> {
        let n = self.u16()? as usize;
        let bytes = self.take(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| crate::FormatError::Invalid {
            what: self.what,
            detail: "string is not UTF-8".into(),
        })
    }
    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8], crate::FormatError> {
        self.take(n)
    }
    pub fn position(&self) -> usize {
        self.pos
    }
}
