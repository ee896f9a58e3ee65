//! On-disk structures of a Lamina array, with explicit little-endian widths.
//!
//! Everything Lamina writes to a device is one of four structures, each of which
//! starts with a magic, a format version and ends its fixed part with a CRC-32C:
//!
//! * [`superblock::Superblock`]: names the array, its devices and layout, and points
//!   at the last committed checkpoint. Two copies per device.
//! * [`unit::UnitHeader`]: the first block(s) of every write unit. It says which
//!   segment incarnation the unit belongs to, its sequence version, and for every
//!   data block that follows it the volume, LBA and checksum of that block.
//! * [`summary::SegmentSummary`]: written at the tail of a segment when it closes;
//!   the concatenation of its units' block records, so garbage collection can find
//!   the owner of every block with one read.
//! * [`checkpoint`]: the map and segment table, serialised into blocks that are
//!   written through ordinary write units of the metadata stream.
//!
//! The byte tables live in `docs/format.md`; the offsets there are the constants here.

pub mod checkpoint;
pub mod codec;
#[doc(hidden)]
pub mod fuzzing;
pub mod summary;
pub mod superblock;
pub mod unit;

/// Size of a logical and physical block. Every address in Lamina counts these.
pub const BLOCK_SIZE: usize = 4096;
/// The same as a `u64`, for byte offset arithmetic.
pub const BLOCK_SIZE_U64: u64 = BLOCK_SIZE as u64;
/// Version of the on-disk format written by this code. Readers refuse other versions.
pub const FORMAT_VERSION: u16 = 1;

/// Errors found while decoding an on-disk structure.
#[derive(Debug, thiserror::Error, PartialEq, Eq, Clone)]
pub enum FormatError {
    /// The magic number is not the one this structure carries: not ours, or never written.
    #[error("{what}: bad magic (not a Lamina {what}, or never written)")]
    BadMagic { what: &'static str },
    /// Written by a newer or older format this code does not read.
    #[error("{what}: unsupported format version {found} (this build reads {FORMAT_VERSION})")]
    UnsupportedVersion { what: &'static str, found: u16 },
    /// Checksum over the structure does not match: torn write or corruption.
    #[error("{what}: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        what: &'static str,
        stored: u32,
        computed: u32,
    },
    /// A field holds a value that cannot be right (a count larger than its space, ...).
    #[error("{what}: invalid field: {detail}")]
    Invalid { what: &'static str, detail: String },
    /// The buffer is shorter than the structure claims to be.
    #[error("{what}: truncated ({have} bytes, need {need})")]
    Truncated {
        what: &'static str,
        have: usize,
        need: usize,
    },
}

/// CRC-32C (Castagnoli), hardware accelerated where the CPU has it.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// CRC-32C of `data` computed as if the four bytes at `hole` were zero.
/// Used for headers that carry their own checksum inside the checksummed range.
pub fn crc32c_with_hole(data: &[u8], hole: usize) -> u32 {
    let crc = crc32c::crc32c(&data[..hole]);
    let crc = crc32c::crc32c_append(crc, &[0u8; 4]);
    crc32c::crc32c_append(crc, &data[hole + 4..])
}

/// Checks what every structure starts with: at least `need` bytes, its magic at
/// offset 0 and the format version at offset 8.
pub(crate) fn check_magic_version(
    b: &[u8],
    what: &'static str,
    magic: u64,
    need: usize,
) -> Result<(), FormatError> {
    check_magic_versions(b, what, magic, need, &[FORMAT_VERSION]).map(|_| ())
}

/// [`check_magic_version`] for a structure some of whose versions this build
/// reads; returns the version found.
pub(crate) fn check_magic_versions(
    b: &[u8],
    what: &'static str,
    magic: u64,
    need: usize,
    accepted: &[u16],
) -> Result<u16, FormatError> {
    if b.len() < need.max(10) {
        return Err(FormatError::Truncated {
            what,
            have: b.len(),
            need: need.max(10),
        });
    }
    if codec::get_u64(b, 0) != magic {
        return Err(FormatError::BadMagic { what });
    }
    let found = codec::get_u16(b, 8);
    if !accepted.contains(&found) {
        return Err(FormatError::UnsupportedVersion { what, found });
    }
    Ok(found)
}

/// Checks the CRC-32C stored at `crc_off` over all of `b` (the field taken as zero).
pub(crate) fn check_crc(b: &[u8], what: &'static str, crc_off: usize) -> Result<(), FormatError> {
    let stored = codec::get_u32(b, crc_off);
    let computed = crc32c_with_hole(b, crc_off);
    if stored != computed {
        return Err(FormatError::Checksum {
            what,
            stored,
            computed,
        });
    }
    Ok(())
}
