//! State shared between the engine thread and client threads, and the read path.
//!
//! Reads never go through the engine thread. A client thread looks the block up in the
//! volume's map; unmapped blocks are zeros, buffered blocks are copied out of the
//! write buffer, and device blocks are read with `pread` and verified against the
//! checksum in their unit header before they are returned.
//!
//! To keep the engine from reusing what a reader is about to read, readers pin: the
//! buffer (for buffered blocks) or the segment (for device blocks). The protocol is
//! "pin, then re-read the map entry": if the entry still names the same place, the
//! engine cannot have recycled it, because the engine changes map entries *before* it
//! checks pins (see [`crate::pins`], which `tests/loom.rs` model-checks).

use crate::buffer::BufferPool;
use crate::geometry::Geometry;
use crate::map::{decode, Entry, Map};
use crate::pins::Pins;
use crate::types::{Lba, Pba, SegmentId, Version, VolumeId, BLOCK_SIZE};
use lamina_device::BlockDevice;
use lamina_format::summary::SummaryHeader;
use lamina_format::unit::{kind, record_at, UnitHeader};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};

/// Blocks one device read covers at most.
const MAX_READ_RUN: u64 = 256;
/// Bytes of one NBD_CMD_CACHE hint that [`Shared::prefetch`] acts on.
const PREFETCH_MAX: u64 = 64 << 20;
/// Shards of the checksum cache (a lock per shard, never one lock for all readers).
const CRC_CACHE_SHARDS: usize = 16;

/// A volume as client threads see it.
pub struct VolumeShared {
    pub id: VolumeId,
    /// The export's name; changed only by a rename (the engine), so read it with
    /// [`VolumeShared::name`].
    name: RwLock<Arc<str>>,
    /// Bytes clients may address: at most the map's length (a volume grows by
    /// its map first, then this; shrinks by this first, then its map).
    size: AtomicU64,
    pub map: Map,
    /// Set when the volume is deleted; connections drop it.
    pub deleted: AtomicBool,
    /// A snapshot: served read-only, and the engine refuses writes to it.
    pub read_only: AtomicBool,
    /// New client connections are refused: a rollback of the volume is under
    /// way (set by whoever asks for it, for as long as the request lasts; the
    /// rollback may wait for GC to free space, and its map changes at once when
    /// it runs).
    pub closed_to_clients: AtomicBool,
    /// The version at which the volume was created (set by the engine as it
    /// attaches the volume): tells it from a later volume given the same id once
    /// this one is deleted (see `Engine::next_volume_id`).
    pub(crate) created: AtomicU64,
}

impl VolumeShared {
    pub fn new(id: VolumeId, name: String, size_bytes: u64, map: Map) -> Self {
        assert!(size_bytes / BLOCK_SIZE as u64 <= map.len());
        VolumeShared {
            id,
            name: RwLock::new(name.into()),
            size: AtomicU64::new(size_bytes),
            map,
            deleted: AtomicBool::new(false),
            read_only: AtomicBool::new(false),
            closed_to_clients: AtomicBool::new(false),
            created: AtomicU64::new(0),
        }
    }

    /// The version at which the volume was created: with the id, it names the
    /// volume for good (ids of deleted volumes are given out again).
    #[inline]
    pub fn created_version(&self) -> Version {
        Version(self.created.load(Ordering::Relaxed))
    }

    /// The volume's name (its export's).
    pub fn name(&self) -> Arc<str> {
        self.name.read().unwrap().clone()
    }

    /// Renames the volume (the engine; see `Shared::rename_volume`).
    pub(crate) fn set_name(&self, name: &str) {
        *self.name.write().unwrap() = name.into();
    }

    /// The volume's size in bytes.
    #[inline]
    pub fn size_bytes(&self) -> u64 {
        self.size.load(Ordering::Acquire)
    }

    /// Sets the size clients see (the engine, resizing; see `size`).
    pub(crate) fn set_size_bytes(&self, bytes: u64) {
        assert!(bytes / BLOCK_SIZE as u64 <= self.map.len());
        self.size.store(bytes, Ordering::Release);
    }

    pub fn blocks(&self) -> u64 {
        self.size_bytes() / BLOCK_SIZE as u64
    }

    /// The allocation of `length` bytes from `offset` as consecutive extents, each
    /// `(bytes, mapped)` passed to `f`, at most `max` of them; none longer than
    /// `max_extent` bytes. An unmapped block is a hole that reads as zeros. The last
    /// extent may run past `offset + length` to the end of its block; the extents
    /// may stop short of it when `max` runs out. Any thread, without waiting.
    pub fn allocation(
        &self,
        offset: u64,
        length: u64,
        max: usize,
        max_extent: u64,
        mut f: impl FnMut(u64, bool),
    ) {
        let bs = BLOCK_SIZE as u64;
        let end = offset.saturating_add(length).min(self.size_bytes());
        let end_block = end.div_ceil(bs);
        let mut pos = offset;
        let mut n = 0;
        while pos < end && n < max {
            let (mapped, run_end) = self.map.allocation_run(Lba(pos / bs), Lba(end_block));
            let len = (run_end.0 * bs - pos).min(max_extent.max(1));
            f(len, mapped);
            pos += len;
            n += 1;
        }
    }
}

/// Errors of the read path.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The device failed the read.
    #[error(transparent)]
    Device(#[from] lamina_device::DeviceError),
    /// The block's checksum, or its owner, does not match its unit header.
    #[error("volume {volume} block {lba}: {detail}")]
    Corrupt {
        volume: u16,
        lba: u64,
        detail: String,
    },
    /// Blocks beyond the volume's end: a client that connected before the volume
    /// shrank.
    #[error("volume {volume}: blocks {first}..{end} lie beyond its end (block {len})")]
    Beyond {
        volume: u16,
        first: u64,
        end: u64,
        len: u64,
    },
}

/// A device read [`Shared::read_start`] handed out: `buf.len()` bytes of
/// descriptor `fd` at `offset`. It holds a pin on its segment: hand it back to
/// [`Shared::read_finish`] exactly once.
#[derive(Debug)]
pub struct DeviceRead {
    pub fd: std::os::unix::io::RawFd,
    pub offset: u64,
    /// Opened with O_DIRECT: the read needs page-aligned memory.
    pub direct: bool,
    pub seg: SegmentId,
    pub seg_off: u32,
    pub first_lba: Lba,
    /// The unit's header, when its checksums are not cached: to be read beside
    /// the data and handed to [`Shared::read_finish`] with it.
    pub header: Option<HeaderRead>,
}

/// Where a unit header lies: `len` bytes of descriptor `fd` at `offset`
/// (`direct`: opened with O_DIRECT).
#[derive(Debug, Clone, Copy)]
pub struct HeaderRead {
    pub fd: std::os::unix::io::RawFd,
    pub offset: u64,
    pub len: u32,
    pub direct: bool,
}

/// How [`Shared::read_start`] started a read.
#[derive(Debug)]
pub enum ReadStart {
    /// Served, or failed.
    Done(Result<(), ReadError>),
    /// For the caller to read from a device.
    Device(DeviceRead),
    /// To be read with [`Shared::read`], which may wait.
    Wait,
}

/// Read-side counters (written by client threads).
#[derive(Default)]
pub struct ReadStats {
    pub blocks_read: AtomicU64,
    pub checksum_errors: AtomicU64,
    /// Blocks that failed verification as read and were served rebuilt from parity.
    pub rebuilt_from_parity: AtomicU64,
    pub device_read_errors: AtomicU64,
    pub crc_cache_misses: AtomicU64,
    /// Device reads carried out by their connection ([`Shared::read_start`]).
    pub device_reads_async: AtomicU64,
    /// Of `blocks_read`, those read from the cache tier (arrays with one).
    pub cache_blocks_read: AtomicU64,
    /// Blocks read from the DRAM write buffer (not in `blocks_read`).
    pub buffer_blocks_read: AtomicU64,
}

/// Blocks one request read, by where they were found (see
/// [`Shared::commit_reads`]).
#[derive(Default)]
struct ReadTally {
    /// From devices (either tier).
    device: u64,
    /// Of `device`, from the cache tier.
    cache: u64,
    /// From the DRAM write buffer.
    buffer: u64,
}

/// The decoded data record of one block of a unit: its owner (`volume << 48 |
/// lba`) and CRC, and whether the slot was stale when sealed.
struct UnitEntry {
    owner: u64,
    crc: u32,
    dead: bool,
}

/// Decoded data records of one unit, a block each: one allocation per unit
/// (it is made as each unit's write completes).
type UnitCrcs = Arc<[UnitEntry]>;

thread_local! {
    /// A reader thread's buffer for the unit headers it reads (on checksum-cache
    /// misses), kept so that a miss allocates only the cache entry.
    static HEADER_BUF: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Runs `f` on a zeroed buffer of `blocks` header blocks: the thread's own (a
/// fresh one if `f` re-enters).
fn with_header_buf<R>(blocks: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    let len = blocks * BLOCK_SIZE;
    HEADER_BUF.with(|cell| match cell.try_borrow_mut() {
        Ok(mut b) => {
            b.clear();
            b.resize(len, 0);
            f(&mut b)
        }
        Err(_) => f(&mut vec![0u8; len]),
    })
}

/// Where [`Shared::verify_run`] takes a unit's checksums from.
enum Checksums {
    /// The header cache, or the header on the device (then cached).
    Header,
    /// The header cache only: a miss fails (on a thread that must not wait).
    Cached,
    /// The header with member `m` rebuilt from parity (not cached: the plain
    /// reading is what later reads see first).
    Without(usize),
    /// These, from a header just read beside the data.
    Given(UnitCrcs),
}

/// (segment, incarnation, unit offset) of a cached unit header.
type UnitKey = (u32, u64, u32);
type CrcShard = Mutex<HashMap<UnitKey, UnitCrcs>>;

struct CrcCache {
    shards: Vec<CrcShard>,
    per_shard: usize,
}

impl CrcCache {
    /// Entries that fit in `bytes` for units of `unit_blocks` blocks: a unit costs
    /// 16 bytes per block (owner, CRC, dead flag, padding) and about 128 bytes of
    /// table, box and count overhead.
    fn entries_for(bytes: u64, unit_blocks: u32) -> usize {
        (bytes / (16 * unit_blocks as u64 + 128)) as usize
    }

    fn new(entries: usize) -> Self {
        CrcCache {
            shards: (0..CRC_CACHE_SHARDS)
                .map(|_| Mutex::new(HashMap::new()))
                .collect(),
            per_shard: (entries / CRC_CACHE_SHARDS).max(4),
        }
    }
    fn shard(&self, key: &UnitKey) -> &CrcShard {
        let h = (key.0 as u64)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15)
            .wrapping_add(key.2 as u64);
        &self.shards[(h >> 32) as usize % CRC_CACHE_SHARDS]
    }
    fn get(&self, key: &UnitKey) -> Option<UnitCrcs> {
        self.shard(key).lock().unwrap().get(key).cloned()
    }
    fn contains(&self, key: &UnitKey) -> bool {
        self.shard(key).lock().unwrap().contains_key(key)
    }
    /// Caches `v` under `key`. A full shard first drops the units of segments'
    /// earlier incarnations (`current(segment, incarnation)` is false for them):
    /// nothing reads those again. Under random overwrites they are most of what
    /// was cached, and evicting at random among them threw out the live units'
    /// entries too, so after a long write run cold reads missed the cache and
    /// read every header again (`basic::after_a_long_write_run_the_header_cache_holds_the_live_units`).
    /// If more than seven eighths of the shard is left, arbitrary entries go down
    /// to that (hash order is as good as random here), so that the pass over the
    /// shard comes once per eighth of it inserted at most, not on every insert.
    fn insert(&self, key: UnitKey, v: UnitCrcs, current: impl Fn(u32, u64) -> bool) {
        let mut m = self.shard(&key).lock().unwrap();
        if m.len() >= self.per_shard {
            m.retain(|k, _| current(k.0, k.1));
            let keep = self.per_shard - (self.per_shard / 8).max(1);
            let mut excess = m.len().saturating_sub(keep);
            if excess > 0 {
                m.retain(|_, _| {
                    let drop = excess > 0;
                    excess = excess.saturating_sub(1);
                    !drop
                });
            }
        }
        m.insert(key, v);
    }
}

/// A pin on a segment (see [`Shared::pin_segment`]).
pub struct SegmentPin<'a> {
    shared: &'a Shared,
    seg: SegmentId,
}

impl Drop for SegmentPin<'_> {
    fn drop(&mut self) {
        self.shared.seg_pins.unpin(self.seg.0);
    }
}

pub struct Shared {
    pub geo: Geometry,
    /// The members (superblocks go to each), then for striped layouts the virtual
    /// striped device that holds the segments (see [`Geometry::locate`]).
    pub devices: Vec<Arc<dyn BlockDevice>>,
    /// The striped device, for its members' health.
    pub striped: Option<Arc<lamina_device::striped::Striped>>,
    pub buffers: BufferPool,
    seg_pins: Pins,
    /// Geometry-aware placement is on: reads mark their blocks in the map.
    pub track_reads: AtomicBool,
    seg_incarnation: Box<[AtomicU64]>,
    /// One bit per physical block: set where a unit header starts.
    unit_starts: Box<[AtomicU64]>,
    /// Per segment: its unit-start bits are complete. Segments recovered from a
    /// checkpoint start unknown and are loaded from their summary (or headers) by
    /// the first read that needs them, so opening an array reads nothing of them.
    starts_known: Box<[AtomicBool]>,
    /// Per segment: in the free queue (holds nothing anyone reads). A rebuild
    /// skips these.
    seg_free: Box<[AtomicBool]>,
    /// Per segment: the blocks from its start whose writes have completed (a
    /// prefix, moved to the write pointer whenever the segment's writes in flight
    /// drain; `u32::MAX` for what recovery found, since recovery never continues
    /// a segment). Zero while the segment
    /// holds no incarnation anyone reads: from the moment it is emptied (before
    /// its discard or zone reset) until units of its next incarnation complete.
    /// Scrub checks nothing beyond it, and drops what it found in a segment whose
    /// incarnation changed or whose prefix shrank while it read.
    seg_written: Box<[AtomicU32]>,
    volumes: RwLock<Vec<Option<Arc<VolumeShared>>>>,
    /// Per volume id: its snapshot family (its own id when it shares nothing), so
    /// that a read may accept a block whose unit names another member of the
    /// reader's family (snapshots and clones share blocks at the same LBA). An id
    /// is given again only once no family names it, and a volume created under
    /// it is made its own family again (`Engine::create_volume`). 128 KiB per
    /// array.
    family: Box<[AtomicU16]>,
    crc_cache: CrcCache,
    pub read_stats: ReadStats,
}

impl Shared {
    pub fn new(
        geo: Geometry,
        devices: Vec<Arc<dyn BlockDevice>>,
        striped: Option<Arc<lamina_device::striped::Striped>>,
        buffer_units: u32,
        header_cache_bytes: u64,
    ) -> Self {
        let segs = geo.segment_count as usize;
        let blocks = segs * geo.segment_blocks as usize;
        let buffers = BufferPool::new(buffer_units, geo.write_unit_blocks);
        Shared {
            seg_pins: Pins::new(segs),
            track_reads: AtomicBool::new(false),
            seg_incarnation: (0..segs).map(|_| AtomicU64::new(0)).collect(),
            unit_starts: (0..blocks.div_ceil(64))
                .map(|_| AtomicU64::new(0))
                .collect(),
            starts_known: (0..segs).map(|_| AtomicBool::new(false)).collect(),
            seg_free: (0..segs).map(|_| AtomicBool::new(false)).collect(),
            seg_written: (0..segs).map(|_| AtomicU32::new(u32::MAX)).collect(),
            volumes: RwLock::new(Vec::new()),
            family: (0..=u16::MAX).map(AtomicU16::new).collect(),
            crc_cache: CrcCache::new(CrcCache::entries_for(
                header_cache_bytes,
                geo.write_unit_blocks,
            )),
            read_stats: ReadStats::default(),
            buffers,
            devices,
            striped,
            geo,
        }
    }

    // ---- volumes ----

    /// Records that volume `vol` belongs to snapshot family `family` (the engine).
    pub(crate) fn set_family(&self, vol: VolumeId, family: u16) {
        self.family[vol.0 as usize].store(family, Ordering::Release);
    }

    /// The snapshot family of volume `vol`.
    #[cfg(test)]
    pub(crate) fn family_of(&self, vol: VolumeId) -> u16 {
        self.family[vol.0 as usize].load(Ordering::Acquire)
    }

    /// Whether a unit record naming `owner` (`volume << 48 | lba`) names block
    /// `lba` of volume `vol`: the same volume, or a member of its family.
    #[inline]
    fn owns(&self, vol: VolumeId, Lba(lba): Lba, owner: u64) -> bool {
        let (v, l) = (
            (owner >> 48) as u16,
            owner & lamina_format::unit::MAX_RECORD_LBA,
        );
        l == lba
            && (v == vol.0
                || self.family[v as usize].load(Ordering::Acquire)
                    == self.family[vol.0 as usize].load(Ordering::Acquire))
    }

    /// The volume exported under `name`; `""` is the first volume (the default).
    pub fn volume(&self, name: &str) -> Option<Arc<VolumeShared>> {
        let vols = self.volumes.read().unwrap();
        let mut live = vols
            .iter()
            .flatten()
            .filter(|v| !v.deleted.load(Ordering::Relaxed));
        if name.is_empty() {
            live.next().cloned()
        } else {
            live.find(|v| *v.name() == *name).cloned()
        }
    }

    pub fn volume_by_id(&self, id: VolumeId) -> Option<Arc<VolumeShared>> {
        self.volumes
            .read()
            .unwrap()
            .get(id.0 as usize)
            .and_then(|v| v.clone())
    }

    /// Names and sizes of all volumes, in id order.
    pub fn list_volumes(&self) -> Vec<Arc<VolumeShared>> {
        self.volumes
            .read()
            .unwrap()
            .iter()
            .flatten()
            .filter(|v| !v.deleted.load(Ordering::Relaxed))
            .cloned()
            .collect()
    }

    pub(crate) fn set_volume(&self, v: Arc<VolumeShared>) {
        let mut vols = self.volumes.write().unwrap();
        let i = v.id.0 as usize;
        if vols.len() <= i {
            vols.resize(i + 1, None);
        }
        vols[i] = Some(v);
    }

    /// A map for a volume of `blocks` blocks, packed for this array's size.
    pub fn new_map(&self, blocks: u64) -> Map {
        Map::new(
            blocks,
            self.geo.segment_count * self.geo.segment_blocks,
            self.buffers.count() * self.buffers.unit_blocks(),
        )
    }

    pub(crate) fn remove_volume(&self, id: VolumeId) {
        let mut vols = self.volumes.write().unwrap();
        if let Some(slot) = vols.get_mut(id.0 as usize) {
            if let Some(v) = slot.take() {
                v.deleted.store(true, Ordering::Relaxed);
            }
        }
    }

    // ---- segment pins and unit starts (engine side) ----

    #[inline]
    /// Whether `seg` is in the free queue (nothing on it is read).
    pub fn segment_free(&self, seg: u32) -> bool {
        self.seg_free[seg as usize].load(Ordering::SeqCst)
    }

    /// The current incarnation of `seg`.
    pub fn incarnation(&self, seg: SegmentId) -> u64 {
        self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst)
    }

    /// Keeps `seg` from being reused while the guard lives.
    pub fn pin_segment(&self, seg: SegmentId) -> SegmentPin<'_> {
        self.seg_pins.pin(seg.0);
        SegmentPin { shared: self, seg }
    }

    pub(crate) fn set_segment_free(&self, seg: u32, free: bool) {
        self.seg_free[seg as usize].store(free, Ordering::SeqCst);
    }

    /// How many blocks from the start of `seg` hold completed writes (see
    /// `seg_written`).
    pub fn written_end(&self, seg: SegmentId) -> u32 {
        self.seg_written[seg.0 as usize].load(Ordering::SeqCst)
    }

    /// The writes of `seg` up to block `end` have completed; `0` when the
    /// segment stops holding anything anyone reads (emptied, superseded).
    pub(crate) fn set_written_end(&self, seg: SegmentId, end: u32) {
        self.seg_written[seg.0 as usize].store(end, Ordering::SeqCst);
    }

    pub(crate) fn segment_pinned(&self, seg: SegmentId) -> bool {
        self.seg_pins.pinned(seg.0)
    }

    /// Prepares a segment for a new incarnation: clears its unit-start bits.
    pub(crate) fn reset_segment(&self, seg: SegmentId, incarnation: Version) {
        // Before the incarnation: whoever sees the new one sees no old prefix.
        self.set_written_end(seg, 0);
        self.seg_incarnation[seg.0 as usize].store(incarnation.0, Ordering::SeqCst);
        let first = seg.0 as usize * self.geo.segment_blocks as usize;
        let last = first + self.geo.segment_blocks as usize;
        for bit in first..last {
            self.unit_starts[bit / 64].fetch_and(!(1u64 << (bit % 64)), Ordering::Relaxed);
        }
        self.starts_known[seg.0 as usize].store(true, Ordering::SeqCst);
    }

    /// Declares a segment's unit starts complete (recovery marked them itself).
    pub(crate) fn set_starts_known(&self, seg: SegmentId) {
        self.starts_known[seg.0 as usize].store(true, Ordering::SeqCst);
    }

    /// Loads the unit starts of a segment from its summary, or by walking its unit
    /// headers when it has none. The caller holds a pin on the segment.
    fn load_unit_starts(&self, seg: SegmentId) -> Result<(), ReadError> {
        let geo = &self.geo;
        let incarnation = self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst);
        let mut buf = vec![0u8; geo.summary_blocks as usize * BLOCK_SIZE];
        let (dev, off) = geo.locate(seg, geo.data_end);
        let summary = self.read_decoded(dev, off, &mut buf, |b| {
            SummaryHeader::decode(b).ok().filter(|h| {
                h.segment == seg.0 && h.incarnation == incarnation && h.array_id == geo.array_id
            })
        });
        if let Ok(Some(h)) = summary {
            for k in 0..h.record_count as usize {
                let r = record_at(&buf, k);
                if r.kind == kind::UNIT {
                    self.mark_unit_start(geo.pba(seg, r.a as u32));
                }
            }
            self.starts_known[seg.0 as usize].store(true, Ordering::SeqCst);
            return Ok(());
        }
        let h = geo.header_blocks as u32;
        let mut hdr = vec![0u8; h as usize * BLOCK_SIZE];
        let mut offset = 0;
        while offset + h <= geo.data_end {
            let (dev, off) = geo.locate(seg, offset);
            let found = self.read_decoded(dev, off, &mut hdr, |b| {
                UnitHeader::decode(b).ok().filter(|u| {
                    u.segment == seg.0
                        && u.offset == offset
                        && u.incarnation == incarnation
                        && u.array_id == geo.array_id
                })
            })?;
            let Some(u) = found else {
                break;
            };
            self.mark_unit_start(geo.pba(seg, offset));
            offset += u.total_blocks();
        }
        self.starts_known[seg.0 as usize].store(true, Ordering::SeqCst);
        Ok(())
    }

    /// Reads `buf` at `off` of device `dev` and decodes it with `decode`. On a layout
    /// with parity, what does not decode as read is read again with each member
    /// rebuilt from the others in turn (metadata damaged on one member); the member
    /// that was wrong gets the read error and its stripe goes to the repair list.
    pub(crate) fn read_decoded<T>(
        &self,
        dev: usize,
        off: u64,
        buf: &mut [u8],
        decode: impl Fn(&[u8]) -> Option<T>,
    ) -> Result<Option<T>, ReadError> {
        let plain = self.devices[dev].read_at(buf, off);
        if plain.is_ok() {
            if let Some(t) = decode(buf) {
                return Ok(Some(t));
            }
        }
        if let Some(st) = self.parity_at(dev) {
            for m in 0..st.shape().members() {
                if st.read_without(buf, off, m).is_ok() {
                    if let Some(t) = decode(buf) {
                        st.note_bad_block(m, off);
                        return Ok(Some(t));
                    }
                }
            }
        }
        plain?;
        Ok(None)
    }

    /// Records that a unit header starts at `pba`.
    pub(crate) fn mark_unit_start(&self, pba: Pba) {
        let bit = pba.0 as usize;
        self.unit_starts[bit / 64].fetch_or(1u64 << (bit % 64), Ordering::Release);
    }

    /// Sets the incarnation readers use to key cached unit headers.
    pub(crate) fn set_incarnation(&self, seg: SegmentId, incarnation: Version) {
        self.seg_incarnation[seg.0 as usize].store(incarnation.0, Ordering::SeqCst);
    }

    /// Offset within its segment of the unit that holds `pba`.
    fn unit_start_of(&self, pba: Pba) -> Option<u32> {
        let (seg, _) = self.geo.split(pba);
        let seg_first = self.geo.pba(seg, 0).0 as usize;
        let mut bit = pba.0 as usize;
        loop {
            let word = self.unit_starts[bit / 64].load(Ordering::Acquire);
            let masked = word & (u64::MAX >> (63 - bit % 64));
            if masked != 0 {
                let found = (bit / 64) * 64 + 63 - masked.leading_zeros() as usize;
                return (found >= seg_first).then(|| (found - seg_first) as u32);
            }
            if bit / 64 * 64 <= seg_first {
                return None;
            }
            bit = bit / 64 * 64 - 1;
        }
    }

    // ---- the read path ----

    /// Reads `buf.len()` bytes at byte `offset` of a volume. Any alignment.
    pub fn read(&self, vol: &VolumeShared, offset: u64, buf: &mut [u8]) -> Result<(), ReadError> {
        let bs = BLOCK_SIZE as u64;
        let mut pos = 0usize;
        let mut off = offset;
        while pos < buf.len() {
            let lba = off / bs;
            let within = (off % bs) as usize;
            let remaining = buf.len() - pos;
            if within == 0 && remaining >= BLOCK_SIZE {
                let whole = remaining / BLOCK_SIZE;
                let n = whole * BLOCK_SIZE;
                self.read_blocks(vol, Lba(lba), &mut buf[pos..pos + n])?;
                pos += n;
                off += n as u64;
            } else {
                let mut scratch = [0u8; BLOCK_SIZE];
                self.read_blocks(vol, Lba(lba), &mut scratch)?;
                let n = (BLOCK_SIZE - within).min(remaining);
                buf[pos..pos + n].copy_from_slice(&scratch[within..within + n]);
                pos += n;
                off += n as u64;
            }
        }
        Ok(())
    }

    /// Reads `buf` if that needs no wait for a device: every block is unmapped, in
    /// the write buffer, or on a device that has it at hand (the page cache), with
    /// its unit header's checksums already in memory and the block passing them.
    /// `None` when any of that does not hold: nothing is counted or charged, and the
    /// caller reads with [`Shared::read`] where it may wait (a thread of its own),
    /// which also deals with damage. Block-aligned requests only.
    pub fn read_nowait(
        &self,
        vol: &VolumeShared,
        offset: u64,
        buf: &mut [u8],
    ) -> Option<Result<(), ReadError>> {
        let bs = BLOCK_SIZE as u64;
        if !offset.is_multiple_of(bs) || !buf.len().is_multiple_of(BLOCK_SIZE) {
            return None;
        }
        match self.read_blocks_inner(vol, Lba(offset / bs), buf, true) {
            Ok(true) => Some(Ok(())),
            Ok(false) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// Starts bringing the blocks of `vol` in `[offset, offset + length)` that lie
    /// on devices into memory ([`BlockDevice::prefetch`], NBD_CMD_CACHE), run by run
    /// of consecutive blocks; unmapped and buffered blocks need nothing. A hint: it
    /// pins nothing (a segment reused meanwhile only wastes the hint) and never
    /// waits. Returns the blocks hinted.
    pub fn prefetch(&self, vol: &VolumeShared, offset: u64, length: u64) -> u64 {
        let bs = BLOCK_SIZE as u64;
        // It runs on a connection's reader: a hint of up to 4 GiB is honoured for
        // its first PREFETCH_MAX bytes, which bounds the map walk and the advice
        // calls (the spec lets a server do less than asked, or nothing).
        let length = length.min(PREFETCH_MAX);
        let end = offset
            .saturating_add(length)
            .div_ceil(bs)
            .min(vol.map.len());
        let mut hinted = 0;
        for run in vol.map.mapped_runs(Lba(offset / bs), Lba(end)) {
            let (mut lba, run_end) = (run.start, run.end);
            while lba < run_end {
                let e = vol.map.load(lba);
                let Entry::Device(pba) = decode(e) else {
                    lba += 1;
                    continue;
                };
                let (seg, seg_off) = self.geo.split(pba);
                let n = self.run_from(vol, lba, e, seg_off, run_end - lba);
                let (dev, byte_off) = self.geo.locate(seg, seg_off);
                self.devices[dev].prefetch(byte_off, n * bs);
                hinted += n;
                lba += n;
            }
        }
        hinted
    }

    /// Whether [`Shared::read_start`] can hand out device reads: the devices that
    /// hold segments (the members of a JBOD, the members of the striped device of
    /// the other layouts and of a mirrored cache) are driven through io_uring.
    pub fn device_reads(&self) -> bool {
        self.geo.data_devices().any(|d| match self.striped_at(d) {
            Some(st) => st.has_uring_members(),
            None => self.devices[d].uring_target().is_some(),
        })
    }

    /// Starts a read for a caller that carries out device reads itself (a
    /// connection's io_uring): [`ReadStart::Device`] when the whole request is one
    /// run of blocks on a device driven by io_uring (with the unit's header to read
    /// beside it when its checksums are not cached, and the header lies whole on
    /// such a device too), pinned until [`Shared::read_finish`]; else [`ReadStart::Done`] when
    /// it needed no wait (as [`Shared::read_nowait`]); else [`ReadStart::Wait`]
    /// (the caller reads with [`Shared::read`] where it may wait).
    ///
    /// A device read is handed out without first trying the page cache
    /// (`RWF_NOWAIT`): io_uring serves a cached read at submission anyway, and the
    /// extra system call was a tenth of a cold read's cost.
    pub fn read_start(&self, vol: &VolumeShared, offset: u64, buf: &mut [u8]) -> ReadStart {
        if let Some(d) = self.device_read(vol, offset, buf) {
            return ReadStart::Device(d);
        }
        match self.read_nowait(vol, offset, buf) {
            Some(r) => ReadStart::Done(r),
            None => ReadStart::Wait,
        }
    }

    /// The device read of [`Shared::read_start`], pinned, if the request is one.
    fn device_read(&self, vol: &VolumeShared, offset: u64, buf: &[u8]) -> Option<DeviceRead> {
        let bs = BLOCK_SIZE as u64;
        let n = (buf.len() / BLOCK_SIZE) as u64;
        if !offset.is_multiple_of(bs) || !buf.len().is_multiple_of(BLOCK_SIZE) {
            return None;
        }
        if n == 0 || n > MAX_READ_RUN {
            return None;
        }
        let first = Lba(offset / bs);
        if first.0 + n > vol.map.len() {
            return None; // the waiting path reports it
        }
        let e = vol.map.load(first);
        let Entry::Device(pba) = decode(e) else {
            return None;
        };
        let (seg, seg_off) = self.geo.split(pba);
        if self.run_from(vol, first, e, seg_off, n) < n {
            return None;
        }
        let (dev, byte_off) = self.geo.locate(seg, seg_off);
        // On the striped device, the member that holds the run, if one does whole.
        let (target, byte_off) = match self.striped_at(dev) {
            Some(st) => st.read_target(byte_off, buf.len())?,
            None => (self.devices[dev].uring_target()?, byte_off),
        };
        // Verifying must not wait for a device either (the caller's thread serves
        // the connection): the unit's checksums are at hand, or its header is read
        // beside the data, on the same ring. Without that, every read of a unit
        // not cached went to the read pool and read the header first: with direct
        // I/O, on an array larger than the cache covers, two device reads one
        // after the other and a hand-off (docs/benchmarks.md, "The header cache").
        let key = self.unit_key(seg, seg_off)?;
        let header = if self.crc_cache.contains(&key) {
            None
        } else {
            let len = self.geo.header_blocks as usize * BLOCK_SIZE;
            let (hdev, hoff) = self.geo.locate(seg, key.2);
            let (t, hoff) = match self.striped_at(hdev) {
                Some(st) => st.read_target(hoff, len)?,
                None => (self.devices[hdev].uring_target()?, hoff),
            };
            Some(HeaderRead {
                fd: t.fd,
                offset: hoff,
                len: len as u32,
                direct: t.direct,
            })
        };
        let valid = self.seg_pins.pin_run(seg.0, &vol.map, first, e, n);
        if valid < n {
            if valid > 0 {
                self.seg_pins.unpin(seg.0);
            }
            return None;
        }
        Some(DeviceRead {
            fd: target.fd,
            offset: byte_off,
            direct: target.direct,
            seg,
            seg_off,
            first_lba: first,
            header,
        })
    }

    /// Finishes a read [`Shared::read_start`] started: `result` is what reading
    /// `read` into `buf` returned (bytes read), `header` the unit header and what
    /// reading it returned, if `read` asked for it. Releases the read's pin. True
    /// when `buf` holds the data; false for a read that failed, came back short or
    /// does not verify (its header included), which the caller reads again the
    /// way that waits ([`Shared::read`]: parity rebuild, error reports), off the
    /// thread that must not wait.
    pub fn read_finish(
        &self,
        vol: &VolumeShared,
        read: DeviceRead,
        buf: &mut [u8],
        result: std::io::Result<usize>,
        header: Option<(&[u8], std::io::Result<usize>)>,
    ) -> bool {
        let DeviceRead {
            seg,
            seg_off,
            first_lba,
            header: wanted,
            ..
        } = read;
        let read_ok = matches!(result, Ok(n) if n == buf.len());
        // A striped member's read is counted against it (JBOD reads locate
        // nothing here).
        if self.striped.is_some() {
            let (dev, voff) = self.geo.locate(seg, seg_off);
            if let Some(st) = self.striped_at(dev) {
                st.target_read_done(voff, buf.len(), read_ok);
            }
        }
        // Without a header read, the checksums were cached when the read started;
        // if they were evicted since, the read is done again off this thread
        // rather than reading the header here, where nothing may wait.
        let mut given = Checksums::Cached;
        if let Some(h) = wanted {
            // The header read beside the data: its checksums, cached for the reads
            // that follow. The pin keeps the segment's incarnation what it was when
            // the read started, so the key is the header's.
            let Some((hdr, res)) = header else {
                self.seg_pins.unpin(seg.0);
                return false;
            };
            let hdr_ok = matches!(res, Ok(n) if n == h.len as usize) && hdr.len() == h.len as usize;
            let key = self.unit_key(seg, seg_off);
            // Counted against the striped member that holds the header, as the
            // data read is above.
            if let Some((_, _, unit_start)) = key.filter(|_| self.striped.is_some()) {
                let (hdev, hoff) = self.geo.locate(seg, unit_start);
                if let Some(st) = self.striped_at(hdev) {
                    st.target_read_done(hoff, h.len as usize, hdr_ok);
                }
            }
            let parsed = key.filter(|_| hdr_ok).and_then(|key| {
                self.parse_unit_crcs(seg, key.2, key.1, hdr)
                    .ok()
                    .map(|c| (key, c))
            });
            let Some((key, c)) = parsed else {
                self.seg_pins.unpin(seg.0);
                return false;
            };
            self.read_stats
                .crc_cache_misses
                .fetch_add(1, Ordering::Relaxed);
            self.cache_crcs(key, c.clone());
            given = Checksums::Given(c);
        }
        let ok = read_ok
            && self
                .verify_run(vol, first_lba, seg, seg_off, buf, given)
                .is_ok();
        self.seg_pins.unpin(seg.0);
        if !ok {
            return false;
        }
        let mut tally = ReadTally::default();
        self.count_read(
            &mut tally,
            vol,
            first_lba,
            seg,
            (buf.len() / BLOCK_SIZE) as u64,
        );
        self.commit_reads(&tally);
        self.read_stats
            .device_reads_async
            .fetch_add(1, Ordering::Relaxed);
        true
    }

    /// How many blocks from `lba` (whose entry `e` names block `seg_off` of its
    /// segment), at most `max`, lie one after the other in that segment: the run
    /// one device read covers.
    fn run_from(&self, vol: &VolumeShared, lba: Lba, e: u32, seg_off: u32, max: u64) -> u64 {
        let mut n = 1u64;
        while n < max
            && seg_off as u64 + n < self.geo.segment_blocks as u64
            && vol.map.load(lba + n) == e + n as u32
        {
            n += 1;
        }
        n
    }

    /// Counts `n` blocks from `lba` read from a device of `seg` into `tally`
    /// (and marks them read for placement, when it tracks reads).
    fn count_read(
        &self,
        tally: &mut ReadTally,
        vol: &VolumeShared,
        lba: Lba,
        seg: SegmentId,
        n: u64,
    ) {
        tally.device += n;
        if self.geo.is_cache(seg.0) {
            tally.cache += n;
        }
        if self.track_reads.load(Ordering::Relaxed) {
            vol.map.mark_read(lba, n);
        }
    }

    /// Adds what a served request read to the counters.
    fn commit_reads(&self, t: &ReadTally) {
        let rs = &self.read_stats;
        for (c, n) in [
            (&rs.blocks_read, t.device),
            (&rs.cache_blocks_read, t.cache),
            (&rs.buffer_blocks_read, t.buffer),
        ] {
            if n > 0 {
                c.fetch_add(n, Ordering::Relaxed);
            }
        }
    }

    /// The checksum-cache key of the unit holding block `seg_off` of `seg`, if
    /// the segment's unit starts are known without reading (and one precedes it).
    fn unit_key(&self, seg: SegmentId, seg_off: u32) -> Option<UnitKey> {
        if !self.starts_known[seg.0 as usize].load(Ordering::SeqCst) {
            return None;
        }
        let unit_start = self.unit_start_of(self.geo.pba(seg, seg_off))?;
        let incarnation = self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst);
        Some((seg.0, incarnation, unit_start))
    }

    /// Reads whole blocks starting at `first` into `out` (a multiple of 4 KiB).
    pub fn read_blocks(
        &self,
        vol: &VolumeShared,
        first: Lba,
        out: &mut [u8],
    ) -> Result<(), ReadError> {
        self.read_blocks_inner(vol, first, out, false).map(|_| ())
    }

    /// [`Shared::read_blocks`]; with `nowait`, `Ok(false)` when a device read would
    /// have to wait (see [`Shared::read_nowait`]).
    fn read_blocks_inner(
        &self,
        vol: &VolumeShared,
        first: Lba,
        out: &mut [u8],
        nowait: bool,
    ) -> Result<bool, ReadError> {
        // Counted once the request is served: a no-wait attempt that gives up is
        // read again, and counted then.
        let mut tally = ReadTally::default();
        let r = self.read_blocks_tallied(vol, first, out, nowait, &mut tally);
        if !matches!(r, Ok(false)) {
            self.commit_reads(&tally);
        }
        r
    }

    fn read_blocks_tallied(
        &self,
        vol: &VolumeShared,
        Lba(first): Lba,
        out: &mut [u8],
        nowait: bool,
        tally: &mut ReadTally,
    ) -> Result<bool, ReadError> {
        let nblocks = (out.len() / BLOCK_SIZE) as u64;
        let len = vol.map.len();
        if first.saturating_add(nblocks) > len {
            return Err(ReadError::Beyond {
                volume: vol.id.0,
                first,
                end: first.saturating_add(nblocks),
                len,
            });
        }
        let mut i = 0u64;
        while i < nblocks {
            let lba = Lba(first + i);
            let dst_off = i as usize * BLOCK_SIZE;
            let e = vol.map.load(lba);
            match decode(e) {
                Entry::Unmapped => {
                    out[dst_off..dst_off + BLOCK_SIZE].fill(0);
                    i += 1;
                }
                Entry::Bad => {
                    return Err(ReadError::Corrupt {
                        volume: vol.id.0,
                        lba: lba.0,
                        detail: "block was found damaged earlier and has no good copy".into(),
                    })
                }
                Entry::Buffer(slot) => {
                    let (unit, block) = self.buffers.unslot(slot);
                    if self.buffers.pins.pin_run(unit, &vol.map, lba, e, 1) == 0 {
                        continue; // moved meanwhile: look again
                    }
                    // SAFETY: pinned, and the entry still names this slot.
                    let src = unsafe { self.buffers.blocks(unit, block, 1) };
                    out[dst_off..dst_off + BLOCK_SIZE].copy_from_slice(src);
                    self.buffers.pins.unpin(unit);
                    tally.buffer += 1;
                    i += 1;
                }
                Entry::Device(pba) => {
                    let (seg, seg_off) = self.geo.split(pba);
                    let n = self.run_from(vol, lba, e, seg_off, (nblocks - i).min(MAX_READ_RUN));
                    // Keep the prefix of the run that still points where it did.
                    let valid = self.seg_pins.pin_run(seg.0, &vol.map, lba, e, n);
                    if valid == 0 {
                        continue;
                    }
                    let dst = &mut out[dst_off..dst_off + valid as usize * BLOCK_SIZE];
                    let r = if nowait {
                        self.read_device_run_nowait(vol, lba, seg, seg_off, dst)
                    } else {
                        self.read_device_run(vol, lba, seg, seg_off, dst)
                            .map(|()| true)
                    };
                    self.seg_pins.unpin(seg.0);
                    if !r? {
                        return Ok(false);
                    }
                    self.count_read(tally, vol, lba, seg, valid);
                    i += valid;
                }
            }
        }
        Ok(true)
    }

    /// [`Shared::read_device_run`] without waiting: false when the device does not
    /// have the run at hand, the unit's checksums are not in memory, or a block does
    /// not pass them (the waiting path then reads again and deals with it).
    fn read_device_run_nowait(
        &self,
        vol: &VolumeShared,
        first_lba: Lba,
        seg: SegmentId,
        seg_off: u32,
        dst: &mut [u8],
    ) -> Result<bool, ReadError> {
        let Some(key @ (_, incarnation, unit_start)) = self.unit_key(seg, seg_off) else {
            return Ok(false);
        };
        if self.crc_cache.get(&key).is_none() {
            // The header is likely at hand too (a miss costs the cache entry's
            // allocation, once per unit).
            let (hdev, hoff) = self.geo.locate(seg, unit_start);
            let blocks = self.geo.header_blocks as usize;
            let parsed: Result<Option<UnitCrcs>, ReadError> = with_header_buf(blocks, |hdr| {
                if !self.devices[hdev].try_read_at(hdr, hoff)? {
                    return Ok(None);
                }
                Ok(self.parse_unit_crcs(seg, unit_start, incarnation, hdr).ok())
            });
            let Some(c) = parsed? else {
                return Ok(false);
            };
            self.read_stats
                .crc_cache_misses
                .fetch_add(1, Ordering::Relaxed);
            self.cache_crcs(key, c);
        }
        let (dev, byte_off) = self.geo.locate(seg, seg_off);
        if !self.devices[dev].try_read_at(dst, byte_off)? {
            return Ok(false);
        }
        Ok(self
            .verify_run(vol, first_lba, seg, seg_off, dst, Checksums::Header)
            .is_ok())
    }

    /// Reads a run of blocks that sit consecutively in one unit, and verifies them.
    ///
    /// On a layout with parity, a block that fails verification (a bit flip, a
    /// misdirected or lost write on one member) is rebuilt from the rest of its row,
    /// member by member left out, until it passes; the stripe then goes to the
    /// repair list, so that GC moves its blocks off the bad spot. Only when no
    /// reading passes is the block an error.
    fn read_device_run(
        &self,
        vol: &VolumeShared,
        first_lba: Lba,
        seg: SegmentId,
        seg_off: u32,
        dst: &mut [u8],
    ) -> Result<(), ReadError> {
        let (dev, byte_off) = self.geo.locate(seg, seg_off);
        if let Err(e) = self.devices[dev].read_at(dst, byte_off) {
            self.read_stats
                .device_read_errors
                .fetch_add(1, Ordering::Relaxed);
            return Err(e.into());
        }
        let first_bad = match self.verify_run(vol, first_lba, seg, seg_off, dst, Checksums::Header)
        {
            Ok(()) => return Ok(()),
            Err((k, e)) => match self.parity_at(dev) {
                Some(_) => k,
                None => return Err(self.report_corrupt(vol, seg, e)),
            },
        };
        let st = self.parity_at(dev).expect("parity layout");
        for k in first_bad..dst.len() / BLOCK_SIZE {
            let block = &mut dst[k * BLOCK_SIZE..(k + 1) * BLOCK_SIZE];
            let off = seg_off + k as u32;
            let lba = first_lba + k as u64;
            if self
                .verify_run(vol, lba, seg, off, block, Checksums::Header)
                .is_ok()
            {
                continue;
            }
            let (_, boff) = self.geo.locate(seg, off);
            let mut fixed = false;
            for m in 0..st.shape().members() {
                if st.read_without(block, boff, m).is_ok()
                    && self
                        .verify_run(vol, lba, seg, off, block, Checksums::Without(m))
                        .is_ok()
                {
                    tracing::warn!(
                        volume = vol.id.0,
                        lba = lba.0,
                        segment = seg.0,
                        "block failed verification on member {m}; served from parity"
                    );
                    st.note_bad_block(m, boff);
                    self.read_stats
                        .rebuilt_from_parity
                        .fetch_add(1, Ordering::Relaxed);
                    fixed = true;
                    break;
                }
            }
            if !fixed {
                // What the plain reading says is the error to report.
                let mut plain = [0u8; BLOCK_SIZE];
                let e = match self.devices[dev].read_at(&mut plain, boff) {
                    Ok(()) => self
                        .verify_run(vol, lba, seg, off, &plain, Checksums::Header)
                        .err(),
                    Err(e) => return Err(e.into()),
                };
                let e = e.map(|(_, e)| e).unwrap_or_else(|| ReadError::Corrupt {
                    volume: vol.id.0,
                    lba: lba.0,
                    detail: "no reading of the block passes its checksum".into(),
                });
                return Err(self.report_corrupt(vol, seg, e));
            }
        }
        Ok(())
    }

    /// Block `offset` of `seg` rebuilt from the rest of its row, each member left
    /// out in turn, until it matches `crc` (a block damaged on one member; layouts
    /// with parity, `None` elsewhere or when no reading matches). The member that
    /// was wrong gets the read error and the stripe goes to the repair list.
    pub(crate) fn rebuild_block(&self, seg: SegmentId, offset: u32, crc: u32) -> Option<Vec<u8>> {
        let (dev, off) = self.geo.locate(seg, offset);
        let st = self.parity_at(dev)?;
        let mut b = vec![0u8; BLOCK_SIZE];
        for m in 0..st.shape().members() {
            if st.read_without(&mut b, off, m).is_ok() && lamina_format::crc32c(&b) == crc {
                st.note_bad_block(m, off);
                return Some(b);
            }
        }
        None
    }

    /// Whether the unit header before `pba` names it as block `lba` of `vol` (fsck:
    /// the map checked against the log without reading data). On layouts with
    /// parity a header damaged on one member is rebuilt, as reads do.
    pub fn check_owner(&self, vol: &VolumeShared, lba: Lba, pba: Pba) -> Result<(), ReadError> {
        let (seg, seg_off) = self.geo.split(pba);
        if !self.starts_known[seg.0 as usize].load(Ordering::SeqCst) {
            self.load_unit_starts(seg)?;
        }
        let bad = |detail: String| ReadError::Corrupt {
            volume: vol.id.0,
            lba: lba.0,
            detail,
        };
        let unit_start = self
            .unit_start_of(pba)
            .ok_or_else(|| bad("no unit header precedes the block".into()))?;
        let mut crcs = self.unit_crcs(seg, unit_start);
        if let (Err(_), Some(st)) = (&crcs, self.parity_at(self.geo.locate(seg, 0).0)) {
            for m in 0..st.shape().members() {
                crcs = self.unit_crcs_without(seg, unit_start, m);
                if crcs.is_ok() {
                    // The header is damaged on member m: charge it and queue the
                    // stripe for repair, as a rebuilt block does.
                    st.note_bad_block(m, self.geo.locate(seg, unit_start).1);
                    break;
                }
            }
        }
        let crcs = crcs?;
        // A map entry pointing into a header (damaged metadata) is no block of it.
        let idx = (seg_off - unit_start)
            .checked_sub(self.geo.header_blocks as u32)
            .map_or(usize::MAX, |i| i as usize);
        if crcs
            .get(idx)
            .is_none_or(|u| !self.owns(vol.id, lba, u.owner) || u.dead)
        {
            return Err(bad(format!(
                "the unit header at {seg} offset {unit_start} does not name this block"
            )));
        }
        Ok(())
    }

    /// The striped device when device `dev` (an index in `devices`) is it and
    /// has parity to rebuild from: a layout with parity, or a mirrored cache tier
    /// (whose copies are its parity); never a JBOD member.
    fn parity_at(&self, dev: usize) -> Option<&lamina_device::striped::Striped> {
        self.striped_at(dev).filter(|st| st.shape().parity > 0)
    }

    /// The striped device when device `dev` (an index in `devices`, as
    /// [`Geometry::locate`] gives it) is it.
    pub(crate) fn striped_at(&self, dev: usize) -> Option<&lamina_device::striped::Striped> {
        self.striped.as_deref().filter(|_| dev == self.geo.members)
    }

    /// Counts and logs a block that failed verification with no good copy.
    fn report_corrupt(&self, vol: &VolumeShared, seg: SegmentId, e: ReadError) -> ReadError {
        if let ReadError::Corrupt { lba, detail, .. } = &e {
            self.read_stats
                .checksum_errors
                .fetch_add(1, Ordering::Relaxed);
            tracing::error!(
                volume = vol.id.0,
                lba,
                segment = seg.0,
                "read verification failed: {detail}"
            );
        }
        e
    }

    /// Verifies the blocks of `dst` (read from `seg` at `seg_off`, holding
    /// `first_lba` on) against their unit's checksums, taken where `crcs` says. On
    /// failure, the index of the first bad block and why.
    fn verify_run(
        &self,
        vol: &VolumeShared,
        first_lba: Lba,
        seg: SegmentId,
        seg_off: u32,
        dst: &[u8],
        crcs: Checksums,
    ) -> Result<(), (usize, ReadError)> {
        let corrupt = |lba: Lba, detail: String| ReadError::Corrupt {
            volume: vol.id.0,
            lba: lba.0,
            detail,
        };
        let pba = self.geo.pba(seg, seg_off);
        if !self.starts_known[seg.0 as usize].load(Ordering::SeqCst) {
            self.load_unit_starts(seg).map_err(|e| (0, e))?;
        }
        let unit_start = self.unit_start_of(pba).ok_or_else(|| {
            (
                0,
                corrupt(first_lba, "no unit header precedes the block".into()),
            )
        })?;
        let crcs = match crcs {
            Checksums::Given(c) => Ok(c),
            Checksums::Cached => {
                let incarnation = self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst);
                self.crc_cache
                    .get(&(seg.0, incarnation, unit_start))
                    .ok_or_else(|| ReadError::Corrupt {
                        volume: vol.id.0,
                        lba: first_lba.0,
                        detail: "the unit's checksums left the cache".into(),
                    })
            }
            Checksums::Header => self.unit_crcs(seg, unit_start),
            Checksums::Without(m) => self.unit_crcs_without(seg, unit_start, m),
        }
        .map_err(|e| match e {
            ReadError::Corrupt { detail, .. } => (0, corrupt(first_lba, detail)),
            other => (0, other),
        })?;
        // A map entry pointing into a header (damaged metadata) is no block of it.
        let first_index = (seg_off - unit_start)
            .checked_sub(self.geo.header_blocks as u32)
            .map_or(usize::MAX / 2, |i| i as usize);
        for (k, block) in dst.chunks_exact(BLOCK_SIZE).enumerate() {
            let idx = first_index + k;
            let lba = first_lba + k as u64;
            let Some(u) = crcs
                .get(idx)
                .filter(|u| self.owns(vol.id, lba, u.owner) && !u.dead)
            else {
                return Err((
                    k,
                    corrupt(
                        lba,
                        format!("unit header at {seg} offset {unit_start} names another owner for this block (misdirected write?)"),
                    ),
                ));
            };
            let crc = lamina_format::crc32c(block);
            if crc != u.crc {
                return Err((
                    k,
                    corrupt(
                        lba,
                        format!(
                            "checksum mismatch (stored {:#010x}, computed {crc:#010x})",
                            u.crc
                        ),
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The data records of the unit at `unit_start` of `seg`, from cache or device.
    fn unit_crcs(&self, seg: SegmentId, unit_start: u32) -> Result<UnitCrcs, ReadError> {
        let incarnation = self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst);
        let key = (seg.0, incarnation, unit_start);
        if let Some(c) = self.crc_cache.get(&key) {
            return Ok(c);
        }
        self.read_stats
            .crc_cache_misses
            .fetch_add(1, Ordering::Relaxed);
        let c = self.decode_unit_crcs(seg, unit_start, None)?;
        self.cache_crcs(key, c.clone());
        Ok(c)
    }

    /// The same, with member `without` rebuilt from parity (a header damaged on one
    /// member); not cached: the plain reading is what later reads see first.
    fn unit_crcs_without(
        &self,
        seg: SegmentId,
        unit_start: u32,
        without: usize,
    ) -> Result<UnitCrcs, ReadError> {
        // A header that decodes as it is needs no rebuilding.
        if let Ok(c) = self.unit_crcs(seg, unit_start) {
            return Ok(c);
        }
        self.decode_unit_crcs(seg, unit_start, Some(without))
    }

    fn decode_unit_crcs(
        &self,
        seg: SegmentId,
        unit_start: u32,
        without: Option<usize>,
    ) -> Result<UnitCrcs, ReadError> {
        let incarnation = self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst);
        let (dev, byte_off) = self.geo.locate(seg, unit_start);
        with_header_buf(self.geo.header_blocks as usize, |hdr| {
            match (without, self.parity_at(dev)) {
                (Some(m), Some(st)) => st.read_without(hdr, byte_off, m)?,
                _ => self.devices[dev].read_at(hdr, byte_off)?,
            }
            self.parse_unit_crcs(seg, unit_start, incarnation, hdr)
        })
    }

    /// Caches a unit's checksums (see [`CrcCache::insert`]).
    fn cache_crcs(&self, key: UnitKey, c: UnitCrcs) {
        self.crc_cache.insert(key, c, |seg, incarnation| {
            self.seg_incarnation[seg as usize].load(Ordering::Relaxed) == incarnation
        });
    }

    /// Caches the checksums of the unit at `unit_start` of `seg` from its header as
    /// written (the engine, when the unit's write completed).
    pub(crate) fn remember_unit(&self, seg: SegmentId, unit_start: u32, hdr: &[u8]) {
        let incarnation = self.seg_incarnation[seg.0 as usize].load(Ordering::SeqCst);
        if let Ok(c) = self.parse_unit_crcs(seg, unit_start, incarnation, hdr) {
            self.cache_crcs((seg.0, incarnation, unit_start), c);
        }
    }

    /// The checksums and owners of the unit whose header is `hdr`, checked to be
    /// the header expected at `unit_start` of `seg` in `incarnation`.
    fn parse_unit_crcs(
        &self,
        seg: SegmentId,
        unit_start: u32,
        incarnation: u64,
        hdr: &[u8],
    ) -> Result<UnitCrcs, ReadError> {
        let bad = |detail: String| ReadError::Corrupt {
            volume: 0,
            lba: 0,
            detail,
        };
        let uh = UnitHeader::decode(hdr).map_err(|e| bad(format!("unit header: {e}")))?;
        if uh.array_id != self.geo.array_id
            || uh.segment != seg.0
            || uh.offset != unit_start
            || uh.incarnation != incarnation
        {
            return Err(bad(format!(
                "unit header at {seg} offset {unit_start} belongs elsewhere (segment {} offset {} incarnation {})",
                uh.segment, uh.offset, uh.incarnation
            )));
        }
        // One allocation: a `Range` mapped is an iterator of known length.
        Ok((0..uh.data_blocks as usize)
            .map(|i| {
                let r = record_at(hdr, i);
                UnitEntry {
                    owner: r.a,
                    crc: r.b,
                    dead: r.kind != kind::DATA,
                }
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::map::encode_device;

    /// Extents follow the map at byte granularity: unaligned starts, a request
    /// ending inside a block, the cap on one extent's length and on their number.
    #[test]
    fn allocation_extents_follow_the_map() {
        let bs = BLOCK_SIZE as u64;
        let blocks = 3 * crate::map::PAGE_ENTRIES as u64;
        let vol = VolumeShared::new(
            VolumeId(0),
            "v".into(),
            blocks * bs,
            Map::new(blocks, 1 << 20, 16),
        );
        let mapped = |lba: u64| (4..10).contains(&lba) || (1500..2100).contains(&lba);
        for lba in (0..blocks).filter(|&l| mapped(l)) {
            vol.map.store(Lba(lba), encode_device(Pba(lba as u32)));
        }
        let extents = |offset: u64, length: u64, max: usize, max_extent: u64| {
            let mut v = Vec::new();
            vol.allocation(offset, length, max, max_extent, |l, m| v.push((l, m)));
            v
        };
        let size = vol.size_bytes();
        for offset in [0, 1, 4095, 4 * bs + 17, 9 * bs, 1499 * bs + 100, size - 1] {
            for length in [1, 100, bs, 7 * bs + 3, 2000 * bs, size] {
                let length = length.min(size - offset);
                for (max, max_extent) in [(usize::MAX, u64::MAX), (3, u64::MAX), (usize::MAX, 8192)]
                {
                    let ex = extents(offset, length, max, max_extent);
                    assert!(!ex.is_empty() && ex.len() <= max, "{offset}+{length}");
                    let mut at = offset;
                    for (i, &(l, m)) in ex.iter().enumerate() {
                        assert!(l > 0 && l <= max_extent.max(1));
                        // Every byte of the extent is in its state.
                        for lba in at / bs..=(at + l - 1) / bs {
                            assert_eq!(mapped(lba), m, "{offset}+{length}: block {lba}");
                        }
                        at += l;
                        if i + 1 < ex.len() {
                            assert!(at < offset + length, "{offset}+{length}: {ex:?}");
                        }
                    }
                    assert!(at <= size, "past the end: {offset}+{length}: {ex:?}");
                    if ex.len() < max {
                        assert!(at >= offset + length, "{offset}+{length} short: {ex:?}");
                    }
                }
            }
        }
    }
}
