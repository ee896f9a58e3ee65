//! Newtypes for the address spaces of the engine, so an index into one space is never
//! used in another by accident.

use std::fmt;

pub use lamina_format::{BLOCK_SIZE, BLOCK_SIZE_U64};

/// A logical block address within one volume (4 KiB blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lba(pub u64);

impl std::ops::Add<u64> for Lba {
    type Output = Lba;
    /// The block `n` blocks after this one.
    #[inline]
    fn add(self, n: u64) -> Lba {
        Lba(self.0 + n)
    }
}

impl std::ops::AddAssign<u64> for Lba {
    #[inline]
    fn add_assign(&mut self, n: u64) {
        self.0 += n;
    }
}

impl std::ops::Sub for Lba {
    type Output = u64;
    /// The number of blocks from `other` to this one (`other` must not be after it).
    #[inline]
    fn sub(self, other: Lba) -> u64 {
        self.0 - other.0
    }
}

/// The blocks `start..end` of a volume: what the map's run queries
/// ([`crate::map::Map::mapped_runs`]) hand out. Iterating it gives each block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbaRun {
    pub start: Lba,
    pub end: Lba,
}

impl LbaRun {
    /// Blocks in the run.
    #[inline]
    pub fn len(&self) -> u64 {
        self.end.0.saturating_sub(self.start.0)
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl IntoIterator for LbaRun {
    type Item = Lba;
    type IntoIter = std::iter::Map<std::ops::Range<u64>, fn(u64) -> Lba>;
    fn into_iter(self) -> Self::IntoIter {
        (self.start.0..self.end.0).map(Lba as fn(u64) -> Lba)
    }
}

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
/// Only versions are compared with versions (the ordering rule); generations, volume
/// time and block counts are other spaces. On disk it is a raw `u64`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Version(pub u64);

impl Version {
    /// Before every version the array gives (fresh arrays start at 1).
    pub const ZERO: Version = Version(0);

    /// The version after this one.
    #[inline]
    pub fn next(self) -> Version {
        Version(self.0 + 1)
    }

    /// The version before this one (`ZERO` stays `ZERO`).
    #[inline]
    pub fn prev(self) -> Version {
        Version(self.0.saturating_sub(1))
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "version {}", self.0)
    }
}

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
