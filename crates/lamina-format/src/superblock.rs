//! The superblock: what an array is, and where its last checkpoint lives.
//!
//! Every device of an array carries two copies, at [`SUPERBLOCK_OFFSETS`]. All copies on
//! all devices describe the same array (same `array_uuid`, same device table); they
//! differ only in `device_index`. An update writes copy 0 on every device, syncs, then
//! copy 1 on every device, and syncs again, so at any instant at least one complete
//! generation survives a torn write. On open, the valid copy with the highest
//! `generation` wins.
//!
//! The device table is what makes the array self-describing: it lists every member's
//! UUID, size and place in the layout, so the devices can be moved to another machine
//! and reassembled from the superblocks alone.

use crate::codec::{get_u32, get_u64, put_u16, put_u32, put_u64};
use crate::{
    check_crc, check_magic_versions, crc32c_with_hole, FormatError, BLOCK_SIZE, FORMAT_VERSION,
};

/// "LAMINASB" as a little-endian u64.
pub const SUPERBLOCK_MAGIC: u64 = u64::from_le_bytes(*b"LAMINASB");
/// Byte offsets of the two superblock copies on every device. They are 256 KiB apart so
/// that one localized failure (a bad erase block, a torn stripe) cannot hit both.
pub const SUPERBLOCK_OFFSETS: [u64; 2] = [0, 256 * 1024];
/// Where the segment area starts on each device by default: 1 MiB, past both copies,
/// aligned for O_DIRECT and for the erase blocks of every flash device we know.
pub const DEFAULT_DATA_OFFSET: u64 = 1024 * 1024;
/// Most devices one array can have (the device table must fit in one block).
pub const MAX_DEVICES: usize = 64;

/// Device state: a JBOD member taken out by `array evacuate` (it holds nothing,
/// its segments are never used again, its device is not needed).
pub const DEVICE_REMOVED: u32 = 3;

/// The superblock's version once a member is removed ([`DEVICE_REMOVED`]); other
/// superblocks keep [`FORMAT_VERSION`].
pub const VERSION_WITH_REMOVED: u16 = 2;
/// The superblock's version once volumes share blocks (snapshots and clones): a
/// build that knows nothing of shared blocks would take a block that only a
/// snapshot maps for dead and reuse its segment, so it must refuse the array.
pub const VERSION_WITH_SHARING: u16 = 3;
/// The superblock's version when the array has a cache tier ([`TIER_CACHE`]
/// members): a build that knows nothing of tiers would write user data anywhere
/// and take the cache's segments for capacity, so it must refuse the array. Such an
/// array may also share blocks (the version says so as 3 does).
pub const VERSION_WITH_TIERS: u16 = 4;
/// The superblock's version when the cache tier is a mirror (2 or 3 cache
/// members): a build that knows one cache member only would write the cache to
/// the first copy and leave the others stale without marking them failed, so it
/// must refuse the array. Otherwise as [`VERSION_WITH_TIERS`].
pub const VERSION_WITH_MIRROR: u16 = 5;
/// A member's tier: the capacity tier (every member of an array without tiers).
pub const TIER_CAPACITY: u32 = 0;
/// A member's tier: the cache tier, which takes every user write first (issue 14).
pub const TIER_CACHE: u32 = 1;
/// Longest array name, in bytes.
pub const MAX_NAME_LEN: usize = 63;

// Field offsets (see docs/format.md, "Superblock").
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_FLAGS: usize = 12;
const OFF_ARRAY_UUID: usize = 16;
const OFF_GENERATION: usize = 32;
const OFF_DEVICE_INDEX: usize = 40;
const OFF_DEVICE_COUNT: usize = 44;
const OFF_LAYOUT: usize = 48;
const OFF_BLOCK_SIZE: usize = 52;
const OFF_SEGMENT_BLOCKS: usize = 56;
const OFF_WRITE_UNIT_BLOCKS: usize = 60;
const OFF_OVERPROVISION_PPM: usize = 64;
const OFF_DATA_OFFSET: usize = 72;
const OFF_CREATED: usize = 80;
const OFF_VERSION_RESERVED: usize = 88;
const OFF_CKPT_VERSION: usize = 96;
const OFF_CKPT_GENERATION: usize = 104;
const OFF_CKPT_FIRST_INCARNATION: usize = 112;
const OFF_CKPT_PAYLOAD_BLOCKS: usize = 120;
const OFF_CKPT_FIRST_SEGMENT: usize = 128;
const OFF_CKPT_ROOT_CRC: usize = 132;
const OFF_NAME: usize = 192;
const OFF_DEVICE_TABLE: usize = 256;
const DEVICE_ENTRY_SIZE: usize = 48;
pub(crate) const OFF_CRC: usize = BLOCK_SIZE - 4;
const _: () = assert!(OFF_DEVICE_TABLE + MAX_DEVICES * DEVICE_ENTRY_SIZE <= OFF_CRC);
const _: () = assert!(OFF_NAME + MAX_NAME_LEN < OFF_DEVICE_TABLE);

/// How segments are spread over the devices of an array.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Devices concatenated; each segment lives on one device.
    Jbod = 0,
    /// Striped without redundancy.
    Said0 = 1,
    /// Striped with one parity segment per stripe.
    Said5 = 2,
    /// Striped with two parity segments per stripe.
    Said6 = 3,
}

impl Layout {
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Layout::Jbod,
            1 => Layout::Said0,
            2 => Layout::Said5,
            3 => Layout::Said6,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            Layout::Jbod => "jbod",
            Layout::Said0 => "said0",
            Layout::Said5 => "said5",
            Layout::Said6 => "said6",
        }
    }
}

/// A UUID as `lamina status`, `array list` and lamina.toml write it: 32 hex digits.
pub fn uuid_hex(u: &[u8; 16]) -> String {
    u.iter().map(|b| format!("{b:02x}")).collect()
}

/// One member of the array as every superblock lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceEntry {
    /// Identity written on the device at creation; a device whose own superblock
    /// carries another UUID is not this member.
    pub uuid: [u8; 16],
    /// Bytes of the device the array uses (may be less than the device's size).
    pub size_bytes: u64,
    /// Segments this device holds.
    pub segment_count: u32,
    /// Global id of this device's first segment (JBOD numbering).
    pub first_segment: u32,
    /// 0 = active, 1 = failed, 2 = rebuilding (striped layouts), 3 = removed
    /// (JBOD, `array evacuate`).
    pub state: u32,
    /// While rebuilding: stripes below this are current on the member.
    pub rebuild_cursor: u32,
    /// [`TIER_CAPACITY`] or [`TIER_CACHE`]. Cache members come after every
    /// capacity member, so the cache tier's segments are the highest numbers.
    pub tier: u32,
}

/// Where the last committed checkpoint is. See [`crate::checkpoint`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CheckpointRef {
    /// The array version at which the checkpoint started: replay starts after it.
    pub version: u64,
    /// Increments with every checkpoint.
    pub generation: u64,
    /// First segment of the metadata stream that holds the checkpoint.
    pub first_segment: u32,
    /// Incarnation of that segment when the checkpoint was written.
    pub first_incarnation: u64,
    /// Length of the checkpoint payload in blocks.
    pub payload_blocks: u64,
    /// CRC-32C of payload block 0 (the checkpoint header), a cross-check.
    pub root_crc: u32,
}

/// Decoded superblock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub array_uuid: [u8; 16],
    pub array_name: String,
    /// Bumped on every superblock update; the highest valid generation wins.
    pub generation: u64,
    /// Which entry of `devices` this copy was written to.
    pub device_index: u32,
    pub layout: Layout,
    pub block_size: u32,
    pub segment_blocks: u32,
    pub write_unit_blocks: u32,
    /// Over-provisioning as spare/user, in parts per million.
    pub overprovision_ppm: u32,
    /// Byte offset on every device where the segment area starts.
    pub data_offset: u64,
    pub created_unix: u64,
    /// Versions below this may have been used; a restart resumes numbering here so
    /// that no version (and no segment incarnation) is ever used twice.
    pub version_reserved: u64,
    pub checkpoint: Option<CheckpointRef>,
    pub devices: Vec<DeviceEntry>,
    /// Volumes may share blocks (a snapshot or clone was ever made): written as
    /// [`VERSION_WITH_SHARING`], and never cleared.
    pub shared_blocks: bool,
}

impl Superblock {
    /// Serialises into one block, checksum included.
    pub fn encode(&self) -> Box<[u8; BLOCK_SIZE]> {
        assert!(self.devices.len() <= MAX_DEVICES);
        assert!(self.array_name.len() <= MAX_NAME_LEN);
        let mut b = Box::new([0u8; BLOCK_SIZE]);
        put_u64(&mut b[..], OFF_MAGIC, SUPERBLOCK_MAGIC);
        // Version 2 only once a member is removed: a build that knows nothing of
        // removed members must refuse the array rather than use their segments.
        let cache = self.devices.iter().filter(|d| d.tier == TIER_CACHE).count();
        let version = if cache > 1 {
            VERSION_WITH_MIRROR
        } else if cache == 1 {
            VERSION_WITH_TIERS
        } else if self.shared_blocks {
            VERSION_WITH_SHARING
        } else if self.devices.iter().any(|d| d.state == DEVICE_REMOVED) {
            VERSION_WITH_REMOVED
        } else {
            FORMAT_VERSION
        };
        put_u16(&mut b[..], OFF_VERSION, version);
        put_u32(&mut b[..], OFF_FLAGS, 0);
        b[OFF_ARRAY_UUID..OFF_ARRAY_UUID + 16].copy_from_slice(&self.array_uuid);
        put_u64(&mut b[..], OFF_GENERATION, self.generation);
        put_u32(&mut b[..], OFF_DEVICE_INDEX, self.device_index);
        put_u32(&mut b[..], OFF_DEVICE_COUNT, self.devices.len() as u32);
        put_u32(&mut b[..], OFF_LAYOUT, self.layout as u32);
        put_u32(&mut b[..], OFF_BLOCK_SIZE, self.block_size);
        put_u32(&mut b[..], OFF_SEGMENT_BLOCKS, self.segment_blocks);
        put_u32(&mut b[..], OFF_WRITE_UNIT_BLOCKS, self.write_unit_blocks);
        put_u32(&mut b[..], OFF_OVERPROVISION_PPM, self.overprovision_ppm);
        put_u64(&mut b[..], OFF_DATA_OFFSET, self.data_offset);
        put_u64(&mut b[..], OFF_CREATED, self.created_unix);
        put_u64(&mut b[..], OFF_VERSION_RESERVED, self.version_reserved);
        if let Some(c) = &self.checkpoint {
            put_u64(&mut b[..], OFF_CKPT_VERSION, c.version);
            put_u64(&mut b[..], OFF_CKPT_GENERATION, c.generation);
            put_u64(&mut b[..], OFF_CKPT_FIRST_INCARNATION, c.first_incarnation);
            put_u64(&mut b[..], OFF_CKPT_PAYLOAD_BLOCKS, c.payload_blocks);
            put_u32(&mut b[..], OFF_CKPT_FIRST_SEGMENT, c.first_segment);
            put_u32(&mut b[..], OFF_CKPT_ROOT_CRC, c.root_crc);
        }
        b[OFF_NAME..OFF_NAME + self.array_name.len()].copy_from_slice(self.array_name.as_bytes());
        for (i, d) in self.devices.iter().enumerate() {
            let o = OFF_DEVICE_TABLE + i * DEVICE_ENTRY_SIZE;
            b[o..o + 16].copy_from_slice(&d.uuid);
            put_u64(&mut b[..], o + 16, d.size_bytes);
            put_u32(&mut b[..], o + 24, d.segment_count);
            put_u32(&mut b[..], o + 28, d.first_segment);
            put_u32(&mut b[..], o + 32, d.state);
            put_u32(&mut b[..], o + 36, d.rebuild_cursor);
            put_u32(&mut b[..], o + 40, d.tier);
        }
        let crc = crc32c_with_hole(&b[..], OFF_CRC);
        put_u32(&mut b[..], OFF_CRC, crc);
        b
    }

    /// Parses and verifies one superblock copy.
    pub fn decode(b: &[u8]) -> Result<Self, FormatError> {
        const WHAT: &str = "superblock";
        let version = check_magic_versions(
            b,
            WHAT,
            SUPERBLOCK_MAGIC,
            BLOCK_SIZE,
            &[
                FORMAT_VERSION,
                VERSION_WITH_REMOVED,
                VERSION_WITH_SHARING,
                VERSION_WITH_TIERS,
                VERSION_WITH_MIRROR,
            ],
        )?;
        let b = &b[..BLOCK_SIZE];
        check_crc(b, WHAT, OFF_CRC)?;
        let invalid = |detail: String| FormatError::Invalid { what: WHAT, detail };
        let device_count = get_u32(b, OFF_DEVICE_COUNT) as usize;
        if device_count == 0 || device_count > MAX_DEVICES {
            return Err(invalid(format!("device count {device_count}")));
        }
        let layout = Layout::from_u32(get_u32(b, OFF_LAYOUT))
            .ok_or_else(|| invalid(format!("layout {}", get_u32(b, OFF_LAYOUT))))?;
        let block_size = get_u32(b, OFF_BLOCK_SIZE);
        if block_size as usize != BLOCK_SIZE {
            return Err(invalid(format!("block size {block_size}")));
        }
        let device_index = get_u32(b, OFF_DEVICE_INDEX);
        if device_index as usize >= device_count {
            return Err(invalid(format!(
                "device index {device_index} of {device_count}"
            )));
        }
        let name_bytes = &b[OFF_NAME..OFF_NAME + MAX_NAME_LEN];
        let name_len = name_bytes
            .iter()
            .position(|&c| c == 0)
            .unwrap_or(MAX_NAME_LEN);
        let array_name = String::from_utf8(name_bytes[..name_len].to_vec())
            .map_err(|_| invalid("array name is not UTF-8".into()))?;
        let ckpt_version = get_u64(b, OFF_CKPT_VERSION);
        let checkpoint = (ckpt_version != 0).then(|| CheckpointRef {
            version: ckpt_version,
            generation: get_u64(b, OFF_CKPT_GENERATION),
            first_segment: get_u32(b, OFF_CKPT_FIRST_SEGMENT),
            first_incarnation: get_u64(b, OFF_CKPT_FIRST_INCARNATION),
            payload_blocks: get_u64(b, OFF_CKPT_PAYLOAD_BLOCKS),
            root_crc: get_u32(b, OFF_CKPT_ROOT_CRC),
        });
        let devices = (0..device_count)
            .map(|i| {
                let o = OFF_DEVICE_TABLE + i * DEVICE_ENTRY_SIZE;
                DeviceEntry {
                    uuid: b[o..o + 16].try_into().unwrap(),
                    size_bytes: get_u64(b, o + 16),
                    segment_count: get_u32(b, o + 24),
                    first_segment: get_u32(b, o + 28),
                    state: get_u32(b, o + 32),
                    rebuild_cursor: get_u32(b, o + 36),
                    tier: get_u32(b, o + 40),
                }
            })
            .collect::<Vec<_>>();
        let tiered = devices.iter().any(|d| d.tier == TIER_CACHE);
        if let Some(d) = devices.iter().find(|d| d.tier > TIER_CACHE) {
            return Err(invalid(format!("device tier {}", d.tier)));
        }
        let cache_members = devices.iter().filter(|d| d.tier == TIER_CACHE).count();
        let expected = match cache_members {
            0 => version < VERSION_WITH_TIERS,
            1 => version == VERSION_WITH_TIERS,
            _ => version == VERSION_WITH_MIRROR,
        };
        if !expected {
            return Err(invalid(format!(
                "a version {version} superblock with {cache_members} cache members"
            )));
        }
        if tiered {
            // The cache tier is the last members, after at least one capacity
            // member, and (in this version) in front of a JBOD.
            let first_cache = devices.iter().position(|d| d.tier == TIER_CACHE).unwrap();
            if first_cache == 0
                || devices[first_cache..].iter().any(|d| d.tier != TIER_CACHE)
                || layout != Layout::Jbod
            {
                return Err(invalid(
                    "cache members must follow the capacity members of a jbod".into(),
                ));
            }
            // Several cache members mirror each other: each holds every cache
            // segment, so they span the same ones; a mirror has 2 or 3 copies.
            let cache = &devices[first_cache..];
            if cache.len() > 3
                || cache.iter().any(|d| {
                    (d.first_segment, d.segment_count)
                        != (cache[0].first_segment, cache[0].segment_count)
                })
            {
                return Err(invalid(
                    "mirrored cache members must be 2 or 3 that span the same segments".into(),
                ));
            }
        }
        if version == FORMAT_VERSION && devices.iter().any(|d| d.state == DEVICE_REMOVED) {
            return Err(invalid(format!(
                "a removed member in a version {FORMAT_VERSION} superblock"
            )));
        }
        let sb = Superblock {
            array_uuid: b[OFF_ARRAY_UUID..OFF_ARRAY_UUID + 16].try_into().unwrap(),
            array_name,
            generation: get_u64(b, OFF_GENERATION),
            device_index,
            layout,
            block_size,
            segment_blocks: get_u32(b, OFF_SEGMENT_BLOCKS),
            write_unit_blocks: get_u32(b, OFF_WRITE_UNIT_BLOCKS),
            overprovision_ppm: get_u32(b, OFF_OVERPROVISION_PPM),
            data_offset: get_u64(b, OFF_DATA_OFFSET),
            created_unix: get_u64(b, OFF_CREATED),
            version_reserved: get_u64(b, OFF_VERSION_RESERVED),
            checkpoint,
            devices,
            shared_blocks: version >= VERSION_WITH_SHARING,
        };
        if sb.segment_blocks < 8
            || sb.write_unit_blocks < 2
            || sb.write_unit_blocks > sb.segment_blocks
        {
            return Err(invalid(format!(
                "segment of {} blocks with write unit of {} blocks",
                sb.segment_blocks, sb.write_unit_blocks
            )));
        }
        Ok(sb)
    }

    /// A 64-bit identity derived from the UUID, stamped into every unit header and
    /// summary so that a block misdirected from another array is recognised.
    pub fn array_id(&self) -> u64 {
        array_id(&self.array_uuid)
    }
}

/// The 64-bit array identity stamped into unit headers: the first 8 bytes of the UUID.
pub fn array_id(uuid: &[u8; 16]) -> u64 {
    u64::from_le_bytes(uuid[..8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Superblock {
        Superblock {
            array_uuid: [7; 16],
            array_name: "tank".into(),
            generation: 42,
            device_index: 1,
            layout: Layout::Jbod,
            block_size: BLOCK_SIZE as u32,
            segment_blocks: 2048,
            write_unit_blocks: 256,
            overprovision_ppm: 100_000,
            data_offset: DEFAULT_DATA_OFFSET,
            created_unix: 1_700_000_000,
            version_reserved: 1 << 32,
            shared_blocks: false,
            checkpoint: Some(CheckpointRef {
                version: 99,
                generation: 3,
                first_segment: 17,
                first_incarnation: 98,
                payload_blocks: 12,
                root_crc: 0xdead_beef,
            }),
            devices: vec![
                DeviceEntry {
                    uuid: [1; 16],
                    size_bytes: 1 << 30,
                    segment_count: 127,
                    first_segment: 0,
                    state: 0,
                    rebuild_cursor: 0,
                    tier: 0,
                },
                DeviceEntry {
                    uuid: [2; 16],
                    size_bytes: 1 << 31,
                    segment_count: 255,
                    first_segment: 127,
                    state: 0,
                    rebuild_cursor: 0,
                    tier: 0,
                },
            ],
        }
    }

    #[test]
    fn shared_blocks_take_version_3_and_survive_a_roundtrip() {
        let mut sb = sample();
        sb.shared_blocks = true;
        let b = sb.encode();
        assert_eq!(
            crate::codec::get_u16(&b[..], OFF_VERSION),
            VERSION_WITH_SHARING
        );
        assert_eq!(Superblock::decode(&b[..]).unwrap(), sb);
        sb.shared_blocks = false;
        assert_eq!(
            crate::codec::get_u16(&sb.encode()[..], OFF_VERSION),
            FORMAT_VERSION
        );
    }

    /// A cache member makes the superblock version 4 (sharing included); decoding
    /// refuses a cache member in another version, a version 4 without one, and
    /// cache members that do not follow the capacity members of a JBOD.
    #[test]
    fn a_cache_tier_takes_version_4_and_its_rules() {
        let mut sb = sample();
        sb.devices[1].tier = TIER_CACHE;
        let b = sb.encode();
        assert_eq!(
            crate::codec::get_u16(&b[..], OFF_VERSION),
            VERSION_WITH_TIERS
        );
        let back = Superblock::decode(&b[..]).unwrap();
        assert_eq!(back.devices[1].tier, TIER_CACHE);
        assert!(back.shared_blocks);
        let refused = |mut b: Box<[u8; BLOCK_SIZE]>, edit: &dyn Fn(&mut [u8])| {
            edit(&mut b[..]);
            let crc = crc32c_with_hole(&b[..], OFF_CRC);
            put_u32(&mut b[..], OFF_CRC, crc);
            Superblock::decode(&b[..]).is_err()
        };
        let entry = |i: usize| OFF_DEVICE_TABLE + i * DEVICE_ENTRY_SIZE + 40;
        assert!(refused(sb.encode(), &|b| put_u16(
            b,
            OFF_VERSION,
            VERSION_WITH_SHARING
        )));
        assert!(refused(sb.encode(), &|b| put_u32(b, entry(1), 0)));
        assert!(refused(sb.encode(), &|b| put_u32(b, entry(1), 2)));
        assert!(refused(sb.encode(), &|b| {
            put_u32(b, entry(0), TIER_CACHE);
            put_u32(b, entry(1), TIER_CAPACITY);
        }));
        assert!(refused(sb.encode(), &|b| put_u32(
            b,
            OFF_LAYOUT,
            Layout::Said0 as u32
        )));
        assert!(!refused(sb.encode(), &|_| {}));
    }

    /// Several cache members mirror each other: 2 or 3 of them, spanning the
    /// same segments; anything else is refused.
    #[test]
    fn mirrored_cache_members_span_the_same_segments() {
        let mut sb = sample();
        let mut copy = sb.devices[1].clone();
        sb.devices[1].tier = TIER_CACHE;
        copy.tier = TIER_CACHE;
        copy.uuid = [9; 16];
        sb.devices.push(copy.clone());
        let b = sb.encode();
        assert_eq!(
            crate::codec::get_u16(&b[..], OFF_VERSION),
            VERSION_WITH_MIRROR
        );
        let back = Superblock::decode(&b[..]).unwrap();
        assert_eq!(back.devices.len(), 3);
        assert!(back.shared_blocks);
        // A build that knows one cache member only must not take it for one.
        let mut b4 = sb.encode();
        put_u16(&mut b4[..], OFF_VERSION, VERSION_WITH_TIERS);
        let crc = crc32c_with_hole(&b4[..], OFF_CRC);
        put_u32(&mut b4[..], OFF_CRC, crc);
        assert!(Superblock::decode(&b4[..]).is_err());
        let mut other = sb.clone();
        other.devices[2].segment_count -= 1;
        assert!(Superblock::decode(&other.encode()[..]).is_err());
        let mut other = sb.clone();
        other.devices[2].first_segment += 1;
        assert!(Superblock::decode(&other.encode()[..]).is_err());
        let mut three = sb.clone();
        three.devices.push(copy.clone());
        assert!(Superblock::decode(&three.encode()[..]).is_ok());
        three.devices.push(copy);
        assert!(Superblock::decode(&three.encode()[..]).is_err());
    }

    #[test]
    fn roundtrip() {
        let sb = sample();
        let enc = sb.encode();
        assert_eq!(Superblock::decode(&enc[..]).unwrap(), sb);
    }

    #[test]
    fn every_single_bit_flip_is_detected() {
        let enc = sample().encode();
        for byte in 0..BLOCK_SIZE {
            let mut damaged = enc.clone();
            damaged[byte] ^= 0x10;
            assert!(
                Superblock::decode(&damaged[..]).is_err(),
                "flip at byte {byte} went unnoticed"
            );
        }
    }

    /// A superblock with a removed member is version 2, which builds that know
    /// nothing of removed members refuse; a version-1 one cannot claim one, and a
    /// version beyond 2 is refused.
    #[test]
    fn a_removed_member_raises_the_version() {
        use crate::codec::get_u16;
        let mut sb = sample();
        assert_eq!(
            crate::codec::get_u16(&sb.encode()[..], OFF_VERSION),
            FORMAT_VERSION
        );
        sb.devices[0].state = DEVICE_REMOVED;
        let enc = sb.encode();
        assert_eq!(get_u16(&enc[..], OFF_VERSION), VERSION_WITH_REMOVED);
        assert_eq!(Superblock::decode(&enc[..]).unwrap(), sb);
        let reversion = |v: u16| {
            let mut b = enc.clone();
            put_u16(&mut b[..], OFF_VERSION, v);
            let crc = crc32c_with_hole(&b[..], OFF_CRC);
            put_u32(&mut b[..], OFF_CRC, crc);
            Superblock::decode(&b[..])
        };
        assert!(matches!(
            reversion(FORMAT_VERSION),
            Err(FormatError::Invalid { .. })
        ));
        assert!(matches!(
            reversion(6),
            Err(FormatError::UnsupportedVersion { found: 6, .. })
        ));
        // Version 5 is known (a mirrored cache) but says what this one is not.
        assert!(matches!(
            reversion(VERSION_WITH_MIRROR),
            Err(FormatError::Invalid { .. })
        ));
    }

    #[test]
    fn zeroes_are_not_a_superblock() {
        assert_eq!(
            Superblock::decode(&[0u8; BLOCK_SIZE]),
            Err(FormatError::BadMagic { what: "superblock" })
        );
    }
}
