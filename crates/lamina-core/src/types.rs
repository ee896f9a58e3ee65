//! Newtypes for the address spaces of the engine, so an index into one space is never
//! used in another by accident.

use std::fmt;

pub use lamina_format::{BLOCK_SIZE, BLOCK_SIZE_U64};

/// A logical block address within one volume (4 KiB blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lba(pub u64);

/// A physical block address within the array: `segment * segment_blocks + offset`.
/// 32 bits address 16 TiB of 4 KiB blocks, the engine's limit per array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Pba(pub u32);

/// A segment of the array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SegmentId(pub u32);

/// A volume of the array.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct VolumeId(pub u16);

/// A point in the array's single sequence of versions. Units, trims and segment
/// incarnations all take their version from it; it never repeats, even across crashes.
pub type Version = u64;

/// The typed addresses of a data record (`lamina-format` keeps them raw).
pub trait RecordAddr {
    /// The volume the block belongs to.
    fn vol(&self) -> VolumeId;
    /// Its logical block in that volume.
    fn block(&self) -> Lba;
}

impl RecordAddr for lamina_format::unit::RawRecord {
    fn vol(&self) -> VolumeId {
        VolumeId(self.volume())
    }
    fn block(&self) -> Lba {
        Lba(self.lba())
    }
}

impl fmt::Display for Lba {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for SegmentId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "segment {}", self.0)
    }
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "volume {}", self.0)
    }
}
