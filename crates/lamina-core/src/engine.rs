//! The engine: the single owner of where every block goes.
//!
//! One thread drives an [`Engine`] by feeding it requests ([`Engine::submit`]), device
//! completions ([`Engine::io_completed`]) and clock ticks ([`Engine::tick`]), and by
//! carrying out the device operations it asks for ([`Engine::drain_io`]). It makes no
//! system calls of its own, so tests and the simulator drive it deterministically.
//!
//! ## The write path
//! A write is copied block by block into the open write unit of its volume's user
//! stream, its map entries are pointed at the buffer slots, and it is acknowledged.
//! When a unit is full (or a flush needs it) it is *sealed*: it takes the next
//! version, records that were overwritten while it was open are marked dead, the
//! header is checksummed and the unit is written at the stream's write pointer. When
//! the write completes, map entries move from the buffer to the device.
//!
//! ## Durability
//! A flush seals every open unit, waits for every write issued so far to complete,
//! then syncs every device; only then does it reply. Each such round is a *flush
//! generation*; segments emptied by garbage collection wait for a generation that
//! covers the writes that emptied them, then for another that makes their release
//! record durable, before they may be reused (see docs/design.md, "Recovery").

use crate::error::EngineError;
use crate::gc::{policy_by_name, VictimPolicy};
use crate::geometry::{Geometry, Tier};
use crate::io::{IoCompletion, IoKind, IoOp};
use crate::map::{decode, Entry, UNMAPPED};
use crate::placement::Written;
use crate::shared::{Shared, VolumeShared};
use crate::types::{Lba, Pba, SegmentId, Version, VolumeId, BLOCK_SIZE, BLOCK_SIZE_U64};
use lamina_format::superblock::Superblock;
use lamina_format::unit::RawRecord;
use std::collections::VecDeque;
use std::sync::Arc;

/// How far ahead of the persisted lease versions may run before the lease is renewed.
pub const VERSION_LEASE: u64 = 1 << 32;

/// Default memory for cached unit headers: 64 MiB covers the checksums of about
/// 20 GiB of data in 512 KiB units.
pub const DEFAULT_HEADER_CACHE_BYTES: u64 = 64 << 20;

/// Tunables of a running engine (not part of the on-disk format).
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Write-unit buffers in the DRAM write buffer.
    pub buffer_units: u32,
    /// Memory for the unit headers' checksums and owners that the read path keeps
    /// (a read whose unit is not cached reads the header from the device too).
    pub header_cache_bytes: u64,
    /// Garbage collection victim policy (see [`crate::gc::POLICY_NAMES`]).
    pub gc_policy: String,
    /// Start a checkpoint after this many blocks were written since the last one.
    /// Bounds recovery time: replay reads the headers of what was written since.
    pub checkpoint_interval_blocks: u64,
    /// Seal a partly filled unit after it has been idle this long.
    pub idle_seal_ms: u64,
    /// Run a background flush at least this often when there are unsynced writes.
    pub auto_sync_ms: u64,
    /// Heat classifier of volumes without an override (see
    /// [`crate::placement::CLASSIFIER_NAMES`]; "auto" is SepBIT where its streams
    /// fit a zoned array's open-zone limit, else "none").
    pub classifier: String,
    /// Per-volume overrides: (volume name, classifier, victim policy).
    pub volume_overrides: Vec<(String, Option<String>, Option<String>)>,
    /// Wear-aware tie-breaking: among victims scoring within this fraction of the
    /// best, take the least erased (0 disables).
    pub wear_window: f64,
    /// Simulation: no data bytes are kept (writes carry only their LBAs), GC moves
    /// records without reading data, and emptied segments are reused without the
    /// durability protocol (nothing is durable in a simulation).
    pub metadata_only: bool,
    /// Refuse writes beyond the usable capacity (ENOSPC). Off in simulations, which
    /// size the array themselves.
    pub enforce_capacity: bool,
    /// Free segments below which GC starts (default: 4 + 2% of segments); GC stops
    /// one step above; user writes stop at `user_floor_segments`.
    pub gc_start_segments: Option<usize>,
    pub user_floor_segments: Option<usize>,
    /// Pace user writes to GC between the start watermark and the floor (SALSA
    /// 2.7, CSAL's user-write limiter): see [`crate::engine_gc`]. Off (the
    /// default): they run at full speed until the floor stops them.
    pub gc_pacing: bool,
    /// SepBIT's trigger: GC also runs while garbage (dead blocks) exceeds this
    /// fraction of the blocks stored in closed and open segments (SepBIT: 0.15).
    pub gc_garbage_ratio: Option<f64>,
    /// GC reads the live blocks of a victim in runs; runs separated by at most
    /// this many dead blocks are read as one (disks: a seek costs more than
    /// reading a megabyte; flash: 0, read only what is live).
    pub gc_read_gap_blocks: u32,
    /// Geometry-aware placement (SALSA 3.1): GC moves the live blocks of read-hot
    /// victims to the lowest addresses among the next free segments (the outer,
    /// faster tracks of a disk) and everything else to the highest. `None`: on
    /// for zoned arrays (SMR disks), off otherwise.
    pub geometry_aware: Option<bool>,
    /// Discard free segments (TRIM on SSDs, holes in files), so that a drive's
    /// own GC need not copy what Lamina no longer holds.
    pub discard: bool,
    /// How long a segment stays free before it is discarded (segments reused
    /// sooner are not): see [`Engine::discard_idle`].
    pub discard_delay_ms: u64,
    /// Fractions of the usable capacity at which the array is logged (and shown)
    /// as filling up and as nearly full (LVM thin pools: 80% and 95%).
    pub space_warn: f64,
    pub space_critical: f64,
    /// The most the volumes' sizes together may promise, as a multiple of the
    /// usable capacity (`volume create` beyond it is refused); `None`: no limit.
    pub max_overcommit: Option<f64>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            buffer_units: 8,
            header_cache_bytes: DEFAULT_HEADER_CACHE_BYTES,
            gc_policy: "auto".into(),
            checkpoint_interval_blocks: (1 << 30) / BLOCK_SIZE_U64,
            idle_seal_ms: 200,
            auto_sync_ms: 5000,
            classifier: "auto".into(),
            volume_overrides: Vec::new(),
            wear_window: 0.10,
            metadata_only: false,
            enforce_capacity: true,
            gc_start_segments: None,
            user_floor_segments: None,
            gc_pacing: false,
            gc_garbage_ratio: None,
            gc_read_gap_blocks: 0,
            geometry_aware: None,
            discard: true,
            discard_delay_ms: DEFAULT_DISCARD_DELAY_MS,
            space_warn: crate::space::DEFAULT_SPACE_WARN,
            space_critical: crate::space::DEFAULT_SPACE_CRITICAL,
            max_overcommit: None,
        }
    }
}

/// Who a reply goes to: a connection and the client's handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Token {
    pub conn: u32,
    pub handle: u64,
}

/// A client request the engine handles (reads do not come here; see [`Shared::read`]).
#[derive(Debug)]
pub enum Request {
    /// Write `data` at byte `offset` of a volume. Any alignment.
    Write {
        volume: VolumeId,
        offset: u64,
        data: Vec<u8>,
        fua: bool,
    },
    /// Unmap (trim or write-zeroes) `length` bytes at `offset`: afterwards the range
    /// reads as zeros. Partial blocks at the edges are zeroed by writing.
    Zero {
        volume: VolumeId,
        offset: u64,
        length: u64,
        fua: bool,
        /// Keep the range allocated (written as zero blocks) instead of unmapping
        /// it: NBD's WRITE_ZEROES with NO_HOLE, so that a thin array cannot later
        /// answer ENOSPC there.
        allocate: bool,
    },
    /// Make every write acknowledged so far durable.
    Flush,
    /// Simulation ([`EngineConfig::metadata_only`]): `count` blocks written at `lba`,
    /// without data.
    WriteBlocks {
        volume: VolumeId,
        lba: Lba,
        count: u32,
    },
    /// Create a volume (replies once a checkpoint records it).
    CreateVolume { name: String, size_bytes: u64 },
    /// Delete a volume and release its space.
    DeleteVolume { name: String },
    /// Grow or shrink a volume (replies once a checkpoint records the new size).
    /// Growing: the new blocks are unmapped; clients see the size on their next
    /// connection, once the checkpoint has committed. Shrinking: refused while
    /// blocks beyond the new end are mapped (trim them first: `Zero`, which is
    /// what `lamina volume resize --force` does) or requests of the volume are in
    /// progress; the new size holds at once.
    ResizeVolume { name: String, size_bytes: u64 },
    /// Rename a volume (replies once a checkpoint records the new name). New
    /// connections use the new name at once; open ones go on.
    RenameVolume { name: String, new_name: String },
    /// Give volume `name` the contents of its snapshot `snapshot` (replies once a
    /// checkpoint records it). Refused while requests of the volume are in
    /// progress; its writes are refused until the reply. When the checkpoint
    /// needs more free segments than there are, GC frees them first (the
    /// request waits, up to a minute; refused with ENOSPC if GC cannot).
    Rollback { name: String, snapshot: String },
    /// Make volume `name` from `origin` as it is now, sharing its blocks: a
    /// read-only snapshot, or (`writable`) a clone. Replies once a checkpoint
    /// records it; the new volume is visible to clients from then on.
    CreateSnapshot {
        origin: String,
        name: String,
        writable: bool,
    },
    /// Write a checkpoint now (replies when committed).
    Checkpoint,
    /// Report counters.
    Status,
    /// Take a member of a striped array out of service (replies once the
    /// superblocks of the others record it).
    FailMember { index: usize },
    /// Put `device` in the slot of failed member `index` and start its rebuild
    /// (replies once the superblocks record it).
    ReplaceMember {
        index: usize,
        device: NewDevice,
        uuid: [u8; 16],
    },
    /// Record the rebuild of member `index`: stripes below `cursor` are done
    /// (`None`: all; the member is active again). Replies once durable. Refused if
    /// the slot was replaced since the rebuild began (`generation` differs).
    RebuildProgress {
        index: usize,
        cursor: Option<u64>,
        generation: u64,
    },
}

impl Request {
    /// The write's buffer, if it is one: what goes back with a refusal.
    fn into_data(self) -> Option<Vec<u8>> {
        match self {
            Request::Write { data, .. } => Some(data),
            _ => None,
        }
    }
}

/// A device handed to the engine (for [`Request::ReplaceMember`]).
pub struct NewDevice(pub Arc<dyn lamina_device::BlockDevice>);

impl std::fmt::Debug for NewDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0.describe())
    }
}

/// What comes back for a request.
#[derive(Debug)]
pub struct Reply {
    pub token: Token,
    pub result: Result<(), EngineError>,
    /// The data buffer of a write, handed back for reuse.
    pub buf: Option<Vec<u8>>,
    pub status: Option<Box<crate::status::StatusReport>>,
}

use crate::durability::{Durability, SyncTarget};
use crate::outbox::Outbox;
use crate::sb_writer::SbWriter;
pub(crate) use crate::segments::{Extent, Seg, SegState, SegmentTable};
use crate::space::Space;
use crate::zones::Zones;

pub(crate) use crate::engine_log::{LogState, Stream};

/// What one heat class of a volume has written.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClassCounters {
    /// Blocks placed in this class (user writes for user classes, relocations for GC
    /// classes).
    pub blocks: u64,
    /// Blocks relocated out of this class's segments by GC.
    pub relocated_out: u64,
    /// Segments of this class chosen as GC victims.
    pub victims: u64,
}

pub(crate) struct Vol {
    pub shared: Arc<VolumeShared>,
    /// Stream of each user class, then of each GC class (indexed by class).
    pub streams: Vec<usize>,
    pub user_classes: u8,
    /// Geometry-aware placement: the GC stream of read-hot blocks.
    pub read_hot_stream: Option<usize>,
    /// Zoned arrays with conventional segments: the stream of small flushed units.
    pub small_stream: Option<usize>,
    pub classifier: Box<dyn crate::placement::Classifier>,
    pub policy: Box<dyn VictimPolicy>,
    pub classes: Vec<ClassCounters>,
    /// The classes kept open while the spare is short (see `classcap`).
    pub caps: crate::classcap::Caps,
    pub created_version: Version,
    pub user_blocks: u64,
    pub gc_blocks: u64,
    pub media_blocks: u64,
    pub live_blocks: u64,
    /// Visible to clients. A new volume becomes visible only once a checkpoint that
    /// records it has committed, so nothing acknowledged on it can be lost with it.
    pub published: bool,
    /// Checkpoint generation after whose commit the volume is published.
    pub publish_at: u64,
    /// Being deleted: hidden, refuses I/O, its blocks stay where they are (GC leaves
    /// them alone) until the checkpoint of this generation, which no longer lists the
    /// volume, commits; then its blocks are unmapped and its space released.
    pub deleting: Option<u64>,
    /// Growing: (checkpoint generation, new size in bytes). The map is already
    /// that long; clients see (and may write) the new size only once a checkpoint
    /// that records it has committed, so no acknowledged write lies beyond the
    /// size recovery would find.
    pub growing: Option<(u64, u64)>,
    /// Rolled back to a snapshot, until the checkpoint that records it commits
    /// (see `Engine::rollback_until`).
    pub rolling_back: bool,
    /// A rollback of this volume waits for GC to free space (see
    /// `Engine::rollback_wait`): writes are refused as while rolling back.
    pub rollback_waiting: bool,
}

impl Vol {
    /// The size the next checkpoint records: a growth in progress counts.
    pub(crate) fn recorded_size(&self) -> u64 {
        self.growing
            .map_or_else(|| self.shared.size_bytes(), |(_, bytes)| bytes)
    }
}

/// What kind of free segment a stream would like.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Want {
    /// Geometry-aware placement: lowest (`Some(true)`) or highest device offset.
    pub outer: Option<bool>,
    /// Zoned devices: a segment in a conventional zone (`Some(true)`, the
    /// metadata stream's small writes) or in a sequential one (data).
    pub conventional: Option<bool>,
    /// The tier whose free queue the segment comes from.
    pub tier: Tier,
}

impl Want {
    pub(crate) fn meta() -> Self {
        Want {
            outer: None,
            conventional: Some(true),
            tier: Tier::Capacity,
        }
    }
}

/// Counters of the whole array, in blocks.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    pub user_blocks: u64,
    pub media_blocks: u64,
    pub gc_blocks: u64,
    pub meta_blocks: u64,
    pub flushes: u64,
    pub syncs: u64,
    pub checkpoints: u64,
    pub corrupt_blocks: u64,
    /// The lowest id never given out yet (new ids come first; then those of
    /// deleted volumes nothing refers to: see `Engine::next_volume_id`).
    pub next_volume_id: u64,
    /// Dead zero blocks written to pad units to whole stripe rows.
    pub pad_blocks: u64,
    /// Blocks written to each member device (as of the checkpoint, for wear).
    pub member_blocks: Vec<u64>,
}

impl Counters {
    pub(crate) fn to_vec(&self) -> Vec<u64> {
        vec![
            self.user_blocks,
            self.media_blocks,
            self.gc_blocks,
            self.meta_blocks,
            self.flushes,
            self.syncs,
            self.checkpoints,
            self.corrupt_blocks,
            self.next_volume_id,
            self.pad_blocks,
        ]
        .into_iter()
        .chain(std::iter::once(self.member_blocks.len() as u64))
        .chain(self.member_blocks.iter().copied())
        .collect()
    }
    pub(crate) fn from_slice(v: &[u64]) -> Self {
        let g = |i: usize| v.get(i).copied().unwrap_or(0);
        Counters {
            user_blocks: g(0),
            media_blocks: g(1),
            gc_blocks: g(2),
            meta_blocks: g(3),
            flushes: g(4),
            syncs: g(5),
            checkpoints: g(6),
            corrupt_blocks: g(7),
            next_volume_id: g(8),
            pad_blocks: g(9),
            member_blocks: (0..g(10).min(1024) as usize).map(|i| g(11 + i)).collect(),
        }
    }
}

/// What an I/O tag stands for.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Purpose {
    UnitWrite {
        buf: u32,
        ticket: u64,
    },
    SummaryWrite {
        seg: u32,
        ticket: u64,
    },
    /// A segment discarded: released, joining the free queue when done (`wait`,
    /// with `discard_delay_ms = 0`), or free (see [`SegmentTable::next_to_discard`]).
    Discard {
        seg: u32,
        wait: bool,
        /// What the discard covers.
        extent: Extent,
    },
    /// A zone finished at a segment's write pointer (zoned devices).
    ZoneFinish {
        seg: u32,
        ticket: u64,
    },
    Sync,
    GcRead {
        batch_index: u32,
    },
    GcMeta,
    /// `gen`: the member slot's generation when the operation was queued.
    SuperblockWrite {
        ticket: u64,
        device: usize,
        gen: u64,
    },
    SuperblockSync {
        device: usize,
        gen: u64,
    },
}

pub(crate) enum Pending {
    Write {
        token: Token,
        volume: VolumeId,
        offset: u64,
        data: Vec<u8>,
        /// Blocks already applied.
        done: u64,
        fua: bool,
        checked_space: bool,
        /// Class chosen for the block at `done`, kept while it waits for room.
        class: Option<u8>,
    },
    Zero {
        token: Token,
        volume: VolumeId,
        offset: u64,
        length: u64,
        fua: bool,
        allocate: bool,
        /// 0: edges not yet zeroed; 1: head done; 2: tail done; from 2 on, with
        /// `allocate`, 2 + the whole blocks written so far.
        stage: u64,
        /// Class of the whole block waiting for room (`allocate`).
        class: Option<u8>,
        /// Admitted against the usable space (`allocate`), once: admission
        /// counts the map pages it starts (see `Space::admit`).
        checked_space: bool,
    },
    /// A metadata-only write (simulation).
    Blocks {
        token: Token,
        volume: VolumeId,
        lba: Lba,
        count: u64,
        done: u64,
        class: Option<u8>,
        /// Admitted (simulations that enforce capacity), once.
        checked_space: bool,
    },
}

impl Pending {
    /// The volume the request names, the bytes of it the request covers, and
    /// whether it was admitted against the usable space yet.
    pub(crate) fn span(&self) -> (VolumeId, std::ops::Range<u64>, bool) {
        match self {
            Pending::Write {
                volume,
                offset,
                data,
                checked_space,
                ..
            } => (
                *volume,
                *offset..*offset + data.len() as u64,
                *checked_space,
            ),
            Pending::Zero {
                volume,
                offset,
                length,
                checked_space,
                ..
            } => (*volume, *offset..*offset + *length, *checked_space),
            Pending::Blocks {
                volume,
                lba,
                count,
                checked_space,
                ..
            } => (
                *volume,
                lba.0 * BLOCK_SIZE_U64..(lba.0 + *count) * BLOCK_SIZE_U64,
                *checked_space,
            ),
        }
    }
}

/// Resources a step could not get; the request waits and is retried.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Blocked;

pub struct Engine {
    pub(crate) shared: Arc<Shared>,
    pub(crate) geo: Geometry,
    /// Zoned arrays: conventional segments and open zones (see `zones.rs`).
    pub(crate) zones: Zones,
    /// Geometry-aware placement (see [`EngineConfig::geometry_aware`]).
    pub(crate) geometry_aware: bool,
    /// Start version of the checkpoint the durable superblocks name (recovery
    /// would start from it now).
    pub(crate) durable_ckpt_version: Version,
    pub(crate) cfg: EngineConfig,
    pub(crate) sb: Superblock,
    /// CRC-32C of a zero block (the pad blocks of striped layouts).
    pub(crate) zero_block_crc: u32,
    /// Blocks written to each member (JBOD; striped members count their own).
    pub(crate) device_blocks: Vec<u64>,
    /// Superblock updates: their sequence, waiters and the failures they record.
    pub(crate) sbw: SbWriter,
    /// Flush generations, syncs, write tickets and flush waiters (group commit).
    pub(crate) durability: Durability,
    /// Every segment, the free queue and the release pipeline.
    pub(crate) segments: SegmentTable,
    pub(crate) volumes: Vec<Option<Vol>>,
    /// Snapshot families: which volumes share blocks (`lineage.rs`).
    pub(crate) lineage: crate::lineage::Lineage,
    /// The largest number of GC streams of any volume (see
    /// [`Engine::refresh_gc_classes`]): the watermarks read it on every GC step, so
    /// it is kept instead of walking the volumes each time.
    pub(crate) gc_classes: usize,
    /// The streams, their open units and segments, and the unit buffers.
    pub(crate) log: LogState,
    pub(crate) next_version: Version,
    pub(crate) durable_version: Version,
    /// First version of this run; durability marks in headers start here.
    pub(crate) run_start: Version,
    pub(crate) pending: VecDeque<Pending>,
    pub(crate) gc: crate::engine_gc::GcState,
    pub(crate) ckpt: crate::engine_ckpt::CkptState,
    /// Device operations under way (by tag) and replies not yet drained.
    pub(crate) out: Outbox,
    pub(crate) counters: Counters,
    /// Usable capacity, mapped blocks and the GC watermarks.
    pub(crate) space: Space,
    pub(crate) blocks_since_checkpoint: u64,
    pub(crate) failed: Option<String>,
    pub(crate) now_ms: u64,
    pub(crate) shutting_down: bool,
    /// The final checkpoint committed ([`Engine::finish_shutdown`]): every request
    /// is refused, and GC starts no new victim, while what is under way completes.
    pub(crate) closed: bool,
    /// No checkpoint starts by itself (recovery holds them while it moves the blocks
    /// of rows a crash left without parity; see `recovery::open`).
    pub(crate) hold_checkpoints: bool,
    /// A rollback waits for the checkpoint of this generation: until it commits,
    /// GC moves nothing (so a crash finds every block of the volume as it was) and
    /// the rolled-back volume takes no writes.
    pub(crate) rollback_until: Option<u64>,
    /// A rollback waiting for GC to free the segments its checkpoint needs.
    pub(crate) rollback_wait: Option<crate::engine_snap::RollbackWait>,
    pub(crate) classifier_factory: Option<ClassifierFactory>,
}

/// Builds a classifier by name for a volume of the given block count.
/// Builds a classifier from (classifier name, volume name, volume blocks).
pub type ClassifierFactory =
    Box<dyn Fn(&str, &str, u64) -> Option<Box<dyn crate::placement::Classifier>> + Send>;

/// Allocation picks among this many segments at the head of the free queue (JBOD
/// wear levelling); recovery's walk of the free queue allows for the skips.
pub const ALLOC_WINDOW: usize = 32;
/// See [`EngineConfig::discard_delay_ms`].
pub const DEFAULT_DISCARD_DELAY_MS: u64 = 30_000;
/// Discards of free segments in flight at once (see [`Engine::discard_idle`]).
const MAX_DISCARDS: usize = 4;
/// Free-queue entries a tick looks at for segments to discard.
const DISCARD_SCAN: usize = 256;

impl Engine {
    /// Builds an engine around recovered state. Used by [`crate::recovery`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn assemble(
        shared: Arc<Shared>,
        cfg: EngineConfig,
        sb: Superblock,
        segs: Vec<Seg>,
        free: VecDeque<u32>,
        next_version: Version,
        counters: Counters,
        last_ckpt_gen: u64,
    ) -> Result<Self, EngineError> {
        let geo = shared.geo.clone();
        if let Some(st) = &shared.striped {
            for (i, &b) in counters.member_blocks.iter().enumerate().take(geo.members) {
                if let Some(m) = geo.striped_index(i) {
                    st.set_bytes_written(m, b * BLOCK_SIZE_U64);
                }
            }
        }
        // Removed members' segments are never used (`array evacuate`).
        let removed: Vec<std::ops::Range<u32>> = geo.removed_spans().collect();
        let free: VecDeque<u32> = free
            .into_iter()
            .filter(|s| !removed.iter().any(|r| r.contains(s)))
            .collect();
        for s in free
            .iter()
            .copied()
            .chain(removed.iter().flat_map(|r| r.clone()))
        {
            shared.set_segment_free(s, true);
        }
        policy_by_name(&cfg.gc_policy).ok_or_else(|| {
            EngineError::Invalid(format!("unknown GC policy {:?}", cfg.gc_policy))
        })?;
        let nbufs = shared.buffers.count();
        let mut space = Space::new(
            Space::usable_blocks(&geo, &sb),
            cfg.enforce_capacity,
            cfg.user_floor_segments,
            cfg.gc_start_segments,
            geo.usable_segments() as usize,
        );
        crate::space::check_thresholds(cfg.space_warn, cfg.space_critical)
            .and_then(|()| {
                cfg.max_overcommit
                    .map_or(Ok(()), crate::space::check_overcommit)
            })
            .map_err(EngineError::Invalid)?;
        space.set_thresholds(cfg.space_warn, cfg.space_critical);
        space.set_checkpoint_room(crate::space::map_room_of(
            geo.usable_segments() as u64,
            geo.data_blocks_per_segment(),
        ));
        // A cache tier in front of zoned devices is conventional: the zone rules
        // are the capacity tier's, and every cache segment counts as lying in a
        // conventional zone (it holds none open and is never reset). Each cache
        // member is checked (a mirror's copies as the striped device holds them:
        // their slots do not speak of zones).
        let cache_device = |d: usize| match (geo.striped_index(d), &shared.striped) {
            (Some(m), Some(st)) => st.member(m),
            _ => shared.devices[d].clone(),
        };
        if let Some(d) = (0..geo.members)
            .filter(|&d| geo.is_cache_member(d))
            .map(cache_device)
            .find(|d| d.zone_layout().is_some())
        {
            return Err(EngineError::Invalid(format!(
                "cache device {} is zoned, but the array's cache tier is conventional (it \
                 takes writes anywhere); an emulated device's zone state file beside it \
                 (FILE.zones) may be left from an earlier use",
                d.describe()
            )));
        }
        let zone_layout = geo
            .capacity_devices()
            .map(|d| shared.devices[d].zone_layout())
            .collect::<Option<Vec<_>>>();
        let zone_limit = zone_layout
            .as_ref()
            .and_then(|ls| ls.iter().map(|l| l.open_limit()).filter(|&l| l > 0).min())
            .unwrap_or(0);
        let geometry_aware = cfg.geometry_aware.unwrap_or(zone_layout.is_some());
        shared
            .track_reads
            .store(geometry_aware, std::sync::atomic::Ordering::Relaxed);
        Ok(Engine {
            geometry_aware,
            zones: Zones::new(
                &geo,
                zone_layout.is_some(),
                zone_limit,
                &shared
                    .devices
                    .iter()
                    .enumerate()
                    .map(|(i, d)| match d.zone_layout() {
                        _ if geo.holds_cache(i) => u64::MAX,
                        Some(l) => l.conventional_bytes,
                        None => 0,
                    })
                    .collect::<Vec<_>>(),
            ),
            durable_ckpt_version: sb
                .checkpoint
                .as_ref()
                .map_or(Version::ZERO, |c| Version(c.version)),
            shared,
            cfg,
            sb,
            zero_block_crc: lamina_format::crc32c(&[0u8; BLOCK_SIZE]),
            device_blocks: counters.member_blocks.clone(),
            durability: Durability::new(),
            segments: {
                let mut t = SegmentTable::new(
                    segs,
                    free,
                    next_version,
                    geo.data_blocks_per_segment() as u32,
                    geo.cache_first,
                );
                for r in removed {
                    t.withhold(r);
                }
                t
            },
            volumes: Vec::new(),
            lineage: Default::default(),
            gc_classes: 1,
            log: LogState::new(nbufs),
            next_version,
            // Nothing of this run is durable yet; what earlier runs wrote is vouched
            // for by their own marks, not by ours (see `run_start`).
            durable_version: next_version.prev(),
            run_start: next_version,
            pending: VecDeque::new(),
            gc: Default::default(),
            ckpt: crate::engine_ckpt::CkptState::new(last_ckpt_gen),
            out: Outbox::default(),
            counters,
            space,
            blocks_since_checkpoint: 0,
            failed: None,
            now_ms: 0,
            shutting_down: false,
            closed: false,
            hold_checkpoints: false,
            rollback_until: None,
            rollback_wait: None,
            sbw: SbWriter::default(),
            classifier_factory: None,
            geo,
        })
    }

    /// Brings the map entry of `lba` in `volume` into the cache ahead of a write
    /// to it (see [`crate::map::Map::prefetch`]): a caller that knows its next
    /// request overlaps the memory wait with the current one.
    pub fn prefetch(&self, volume: VolumeId, lba: Lba) {
        if let Some(Some(v)) = self.volumes.get(volume.0 as usize) {
            v.shared.map.prefetch(lba);
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geo
    }

    pub fn superblock(&self) -> &Superblock {
        &self.sb
    }

    /// Free segments set aside because their zone could not be reset.
    pub fn segments_set_aside(&self) -> u64 {
        self.segments.quarantined
    }

    /// The engine's clock: the last time [`Engine::tick`] was given.
    pub fn now_ms(&self) -> u64 {
        self.now_ms
    }

    /// Segments discarded since the array was opened.
    pub fn segments_discarded(&self) -> u64 {
        self.segments.discarded
    }

    /// Discards done since the array was opened for segments opened after the
    /// durable checkpoint, which keep their first unit header (see
    /// `SegmentTable::discardable`).
    pub fn segments_tail_discarded(&self) -> u64 {
        self.segments.tail_discards
    }

    /// Discards done since the array was opened of the first unit headers that
    /// tail discards kept, once a later checkpoint was durable.
    pub fn segments_head_discarded(&self) -> u64 {
        self.segments.head_discards
    }

    /// Free segments discarded since they were last written.
    pub fn free_segments_discarded(&self) -> usize {
        let segs = &self.segments.segs;
        self.segments
            .all_free()
            .filter(|&s| segs[s as usize].clean)
            .count()
    }

    /// Short units flushes moved to conventional zones.
    pub fn small_units_moved(&self) -> u64 {
        self.zones.small_units_moved
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn usable_bytes(&self) -> u64 {
        self.space.usable * BLOCK_SIZE_U64
    }

    /// Free segments of the capacity tier (of the array, without a cache tier).
    pub fn free_segments(&self) -> usize {
        self.segments.free.len()
    }

    /// Free segments of the cache tier (0 without one).
    pub fn cache_free_segments(&self) -> usize {
        self.segments.cache_free.len()
    }

    /// Live blocks in the cache tier's segments (0 without one): what compaction
    /// has not moved to the capacity tier yet.
    pub fn cache_live_blocks(&self) -> u64 {
        self.segments.segs[self.geo.cache_first as usize..]
            .iter()
            .map(|s| s.valid as u64)
            .sum()
    }

    // ---------------------------------------------------------------- versions

    /// The state of volume `v`, which a request or a record names only while the
    /// engine holds it (a request is checked against the volumes when it arrives,
    /// and a volume with requests in progress is not deleted).
    pub(crate) fn vol(&self, v: VolumeId) -> &Vol {
        self.volumes[v.0 as usize]
            .as_ref()
            .expect("a volume the engine holds")
    }

    pub(crate) fn vol_mut(&mut self, v: VolumeId) -> &mut Vol {
        self.volumes[v.0 as usize]
            .as_mut()
            .expect("a volume the engine holds")
    }

    pub(crate) fn take_version(&mut self) -> Version {
        let v = self.next_version;
        assert!(
            v.0 < self.sb.version_reserved,
            "version {v} beyond the persisted lease {}",
            self.sb.version_reserved
        );
        self.next_version = v.next();
        v
    }

    // ---------------------------------------------------------------- I/O plumbing

    pub(crate) fn submit_io(&mut self, p: Purpose, device: usize, offset: u64, kind: IoKind) {
        self.out.submit(p, device, offset, kind);
    }

    pub(crate) fn issue_ticket(&mut self) -> u64 {
        self.durability.issue()
    }

    /// Moves queued device operations to `out`.
    pub fn drain_io(&mut self, out: &mut Vec<IoOp>) {
        self.out.drain_io(out);
    }

    /// Moves ready replies to `out`.
    pub fn drain_replies(&mut self, out: &mut Vec<Reply>) {
        self.out.drain_replies(out);
    }

    pub(crate) fn reply(
        &mut self,
        token: Token,
        result: Result<(), EngineError>,
        buf: Option<Vec<u8>>,
    ) {
        self.out.reply(token, result, buf);
    }

    /// True when nothing is queued, in flight or in progress.
    pub fn is_idle(&self) -> bool {
        self.pending.is_empty()
            && self.out.queued() == 0
            && self.out.in_flight() == 0
            && !self.durability.has_waiters()
            && self.ckpt.is_idle()
            && self.gc.is_idle()
    }

    /// Requests waiting for resources.
    pub fn pending_requests(&self) -> usize {
        self.pending.len()
    }

    // ---------------------------------------------------------------- entry points

    /// Accepts a request. Its reply appears in [`Engine::drain_replies`], possibly
    /// right away.
    /// [`Engine::submit`] for a client that addresses volume `created` names
    /// by its creation version as well as its id (an NBD connection: the ids of
    /// deleted volumes are given out again, and a connection to one that was
    /// deleted must not write into the volume that got its id).
    pub fn submit_to(&mut self, token: Token, req: Request, created: Version) {
        let volume = match &req {
            Request::Write { volume, .. } | Request::Zero { volume, .. } => *volume,
            _ => return self.submit(token, req),
        };
        let current = self
            .volumes
            .get(volume.0 as usize)
            .and_then(|v| v.as_ref())
            .map(|v| v.shared.created_version());
        if current != Some(created) {
            let e = EngineError::Invalid(format!("no {volume}: it was deleted"));
            return self.reply(token, Err(e), req.into_data());
        }
        self.submit(token, req)
    }

    pub fn submit(&mut self, token: Token, req: Request) {
        if self.closed {
            return self.reply(token, Err(EngineError::ShuttingDown), req.into_data());
        }
        // Shutting down: the final checkpoint is under way, and what would need
        // one of its own after it is refused (flushes and checkpoints are served;
        // writes are refused by `check_io`, rollbacks by `request_rollback`).
        if self.shutting_down
            && matches!(
                req,
                Request::CreateVolume { .. }
                    | Request::DeleteVolume { .. }
                    | Request::ResizeVolume { .. }
                    | Request::RenameVolume { .. }
                    | Request::CreateSnapshot { .. }
                    | Request::ReplaceMember { .. }
            )
        {
            return self.reply(token, Err(EngineError::ShuttingDown), None);
        }
        match req {
            Request::Write {
                volume,
                offset,
                data,
                fua,
            } => {
                if let Err(e) = self.check_io(volume, offset, data.len() as u64) {
                    self.reply(token, Err(e), Some(data));
                } else if data.is_empty() {
                    self.reply(token, Ok(()), Some(data));
                } else {
                    self.pending.push_back(Pending::Write {
                        token,
                        volume,
                        offset,
                        data,
                        done: 0,
                        fua,
                        checked_space: false,
                        class: None,
                    });
                }
            }
            Request::Zero {
                volume,
                offset,
                length,
                fua,
                allocate,
            } => {
                if let Err(e) = self.check_io(volume, offset, length) {
                    self.reply(token, Err(e), None);
                } else if length == 0 {
                    self.reply(token, Ok(()), None);
                } else {
                    self.pending.push_back(Pending::Zero {
                        token,
                        volume,
                        offset,
                        length,
                        fua,
                        allocate,
                        stage: 0,
                        class: None,
                        checked_space: false,
                    });
                }
            }
            Request::Flush => {
                if let Some(f) = &self.failed {
                    let e = EngineError::Failed(f.clone());
                    self.reply(token, Err(e), None);
                } else {
                    self.counters.flushes += 1;
                    let gen = self.start_flush();
                    self.durability.wait(gen, token, None);
                }
            }
            Request::WriteBlocks { volume, lba, count } => {
                if !self.cfg.metadata_only {
                    self.reply(
                        token,
                        Err(EngineError::Invalid(
                            "WriteBlocks needs a metadata-only engine".into(),
                        )),
                        None,
                    );
                } else if let Err(e) = self.check_io(
                    volume,
                    lba.0 * BLOCK_SIZE_U64,
                    count as u64 * BLOCK_SIZE_U64,
                ) {
                    self.reply(token, Err(e), None);
                } else {
                    self.pending.push_back(Pending::Blocks {
                        token,
                        volume,
                        lba,
                        count: count as u64,
                        done: 0,
                        class: None,
                        checked_space: false,
                    });
                }
            }
            Request::CreateVolume { name, size_bytes } => {
                match self.create_volume(&name, size_bytes) {
                    Ok(()) => self.start_checkpoint(Some(token)),
                    Err(e) => self.reply(token, Err(e), None),
                }
            }
            Request::ResizeVolume { name, size_bytes } => {
                match self.resize_volume(&name, size_bytes) {
                    Ok(()) => self.start_checkpoint(Some(token)),
                    Err(e) => self.reply(token, Err(e), None),
                }
            }
            Request::RenameVolume { name, new_name } => {
                match self.rename_volume(&name, &new_name) {
                    Ok(()) => self.start_checkpoint(Some(token)),
                    Err(e) => self.reply(token, Err(e), None),
                }
            }
            Request::CreateSnapshot {
                origin,
                name,
                writable,
            } => match self.create_snapshot(&origin, &name, writable) {
                Ok(()) => self.start_checkpoint(Some(token)),
                Err(e) => self.reply(token, Err(e), None),
            },
            Request::Rollback { name, snapshot } => self.request_rollback(token, name, snapshot),
            Request::DeleteVolume { name } => match self.delete_volume(&name) {
                Ok(()) => self.start_checkpoint(Some(token)),
                Err(e) => self.reply(token, Err(e), None),
            },
            Request::Checkpoint => self.start_checkpoint(Some(token)),
            Request::FailMember { index } => match self.striped_of(index) {
                None if index >= self.geo.members => self.reply(
                    token,
                    Err(EngineError::Invalid(format!(
                        "no member {index}: the array has members 0 to {}",
                        self.geo.members - 1
                    ))),
                    None,
                ),
                None => self.reply(
                    token,
                    Err(EngineError::Invalid(format!(
                        "member {index} is in a JBOD, which has no redundancy: it cannot be failed"
                    ))),
                    None,
                ),
                Some((st, m)) if st.available(m) && st.redundancy_left() <= 0 => {
                    self.reply(
                    token,
                    Err(EngineError::Invalid(format!(
                        "failing member {index} would leave data unrecoverable ({} members failed, the layout tolerates {})",
                        st.failed_count(),
                        st.shape().parity
                    ))),
                    None,
                    );
                }
                Some((st, m)) => {
                    st.fail_member(m);
                    self.await_superblock(token);
                }
            },
            Request::ReplaceMember {
                index,
                device,
                uuid,
            } => {
                let r = self.replace_member(index, device.0, uuid);
                match r {
                    Ok(()) => self.await_superblock(token),
                    Err(e) => self.reply(token, Err(e), None),
                }
            }
            Request::RebuildProgress {
                index,
                cursor,
                generation,
            } if self.shared.striped.is_some()
                && self
                    .striped_of(index)
                    .is_none_or(|(st, m)| st.slot_generation(m) != generation) =>
            {
                let _ = cursor;
                self.reply(
                    token,
                    Err(EngineError::Invalid(format!(
                        "rebuild of member {index} is stale: the slot was replaced"
                    ))),
                    None,
                );
            }
            Request::RebuildProgress { index, cursor, .. } => {
                if let (Some((st, m)), Some(e)) =
                    (self.striped_of(index), self.sb.devices.get_mut(index))
                {
                    if e.state == crate::recovery::MEMBER_REBUILDING && !st.is_failed(m) {
                        match cursor {
                            Some(c) => e.rebuild_cursor = c as u32,
                            None => {
                                e.state = 0;
                                e.rebuild_cursor = 0;
                            }
                        }
                    }
                    st.set_rebuild_cursor(m, cursor);
                }
                self.await_superblock(token);
            }
            Request::Status => {
                let status = self.status();
                self.out.push_reply(Reply {
                    token,
                    result: Ok(()),
                    buf: None,
                    status: Some(Box::new(status)),
                });
            }
        }
        self.progress();
    }

    fn check_io(&self, volume: VolumeId, offset: u64, length: u64) -> Result<(), EngineError> {
        if let Some(f) = &self.failed {
            return Err(EngineError::Failed(f.clone()));
        }
        if self.shutting_down {
            return Err(EngineError::ShuttingDown);
        }
        let vol = self
            .volumes
            .get(volume.0 as usize)
            .and_then(|v| v.as_ref())
            .filter(|v| v.published && v.deleting.is_none())
            .ok_or_else(|| {
                EngineError::Invalid(format!("no {volume} (or it is being created or deleted)"))
            })?;
        if vol.rolling_back || vol.rollback_waiting {
            return Err(EngineError::Invalid(format!(
                "volume {:?} is being rolled back: try again in a moment",
                vol.shared.name()
            )));
        }
        if vol
            .shared
            .read_only
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            return Err(EngineError::ReadOnly(format!(
                "volume {:?} is a snapshot",
                vol.shared.name()
            )));
        }
        let size = vol.shared.size_bytes();
        if offset.checked_add(length).is_none_or(|end| end > size) {
            return Err(EngineError::Invalid(format!(
                "range {offset}+{length} is past the end of volume {:?} ({size} bytes)",
                vol.shared.name()
            )));
        }
        Ok(())
    }

    /// Feeds a device completion back.
    pub fn io_completed(&mut self, c: IoCompletion) {
        let purpose = self.out.completed(c.tag);
        match purpose {
            Purpose::UnitWrite { buf, ticket } => {
                self.durability.complete(ticket);
                match c.result {
                    Ok(()) => self.unit_written(buf),
                    Err(e) => self.fail(format!("unit write failed: {e}")),
                }
            }
            Purpose::SummaryWrite { seg, ticket } => {
                self.durability.complete(ticket);
                if let Err(e) = c.result {
                    self.fail(format!("summary write failed: {e}"));
                }
                // The summary fills the segment's zone.
                self.zones.done(seg);
                self.segment_write_done(seg);
            }
            Purpose::Discard { seg, wait, extent } => {
                if let Err(e) = &c.result {
                    tracing::debug!("discard of segment {seg}: {e}");
                }
                let ok = c.result.is_ok() as u64;
                match extent {
                    Extent::Tail => self.segments.tail_discards += ok,
                    Extent::Head => self.segments.head_discards += ok,
                    Extent::Whole => {}
                }
                if wait || self.cfg.metadata_only {
                    // Released (or, in a simulation, freed as it was discarded).
                    self.segments.discarded += ok;
                    if wait {
                        self.segments.discards.insert(seg, Some(extent));
                    }
                } else {
                    self.segments.discard_done(seg, ok == 1, extent);
                }
            }
            Purpose::ZoneFinish { seg, ticket } => {
                self.durability.complete(ticket);
                if let Err(e) = c.result {
                    self.fail(format!("zone finish of segment {seg} failed: {e}"));
                }
                self.zones.done(seg);
                if self.segments.segs[seg as usize].state == SegState::Closing {
                    self.segment_write_done(seg);
                }
            }
            Purpose::Sync => {
                if let Err(e) = c.result {
                    self.fail(format!("sync failed: {e}"));
                }
                self.sync_part_done();
            }
            Purpose::GcRead { batch_index } => self.gc_read_done(batch_index, c),
            Purpose::GcMeta => self.gc_meta_done(c),
            Purpose::SuperblockWrite {
                ticket,
                device,
                gen,
            } => {
                self.durability.complete(ticket);
                if let Err(e) = c.result {
                    self.sb_member_error(device, gen, "superblock write", e);
                }
                self.sb_step_done();
            }
            Purpose::SuperblockSync { device, gen } => {
                if let Err(e) = c.result {
                    self.sb_member_error(device, gen, "superblock sync", e);
                }
                self.sb_step_done();
            }
        }
        self.progress();
    }

    /// Advances timers: idle units are sealed, background flushes and checkpoints
    /// start when due.
    pub fn tick(&mut self, now_ms: u64) {
        self.now_ms = now_ms;
        let idle = self.cfg.idle_seal_ms;
        for s in 0..self.log.streams.len() {
            if let Some(u) = &self.log.streams[s].unit {
                if u.data > 0 && now_ms.saturating_sub(u.opened_ms) >= idle {
                    self.seal_unit(s);
                }
            }
        }
        if self.durability.unsynced_writes
            && self.failed.is_none()
            && now_ms.saturating_sub(self.durability.last_sync_ms) >= self.cfg.auto_sync_ms
            && !self.durability.sync_inflight()
        {
            self.start_flush();
        }
        self.discard_idle();
        self.report_space();
        self.progress();
    }

    /// Logs the fullness thresholds crossed and the writes refused for space.
    fn report_space(&mut self) {
        let r = self.space.report(self.now_ms);
        if r.crossed.is_none() && r.refused.is_none() {
            // Most ticks: nothing to say, and nothing to add up or format.
            return;
        }
        let pct = 100.0 * self.space.in_use_blocks() as f64 / self.space.usable.max(1) as f64;
        let usable = self.space.usable * BLOCK_SIZE_U64;
        let promised = self.promised_bytes();
        let thin = if promised > usable {
            format!(
                "; the volumes promise {:.1}x that (thin provisioning)",
                promised as f64 / usable as f64
            )
        } else {
            String::new()
        };
        let what = "trim, delete volumes, or add capacity";
        use crate::space::Fullness::*;
        match r.crossed {
            Some((from, Ok)) => tracing::info!(
                "space: {pct:.1}% of the usable {usable} bytes in use, below the warning threshold again (was {})",
                from.name()
            ),
            Some((_, Warning)) => tracing::warn!(
                "space: {pct:.1}% of the usable {usable} bytes in use, above the warning threshold of {:.0}%{thin}",
                self.cfg.space_warn * 100.0
            ),
            Some((_, Critical)) => tracing::error!(
                "space: {pct:.1}% of the usable {usable} bytes in use, above the critical threshold of {:.0}%{thin}; writes to unwritten blocks fail when it is full: {what}",
                self.cfg.space_critical * 100.0
            ),
            Some((_, Full)) => tracing::error!(
                "space: the array is full ({usable} usable bytes in use{thin}); writes to unwritten blocks get ENOSPC: {what}"
            ),
            None => {}
        }
        if let Some(n) = r.refused {
            tracing::error!(
                "array full: {n} writes refused with ENOSPC ({pct:.1}% of the usable capacity in use): {what}"
            );
        }
    }

    /// What the volumes' sizes add up to (thin provisioning may promise more than
    /// the usable capacity).
    pub fn promised_bytes(&self) -> u64 {
        self.volumes
            .iter()
            .flatten()
            // A snapshot takes no writes: it holds what it shares, and what its
            // origin overwrites, never more than the origin promised.
            .filter(|v| v.deleting.is_none() && !self.lineage.read_only(v.shared.id))
            .fold(0u64, |a, v| a.saturating_add(v.recorded_size()))
    }

    /// Discards free segments that stayed free for `discard_delay_ms` (TRIM on an
    /// SSD, a hole in a file), a few at a time. Discarding a segment as soon as it
    /// is released would pay for it twice when it is soon reused: a file system
    /// allocates the hole's pages or blocks again, a drive maps the range again.
    ///
    /// With `discard_delay_ms = 0` released segments are discarded as they are
    /// released, and this only discards the first headers their tail discards
    /// kept, once a later checkpoint is durable.
    fn discard_idle(&mut self) {
        if self.cfg.metadata_only || self.failed.is_some() || self.shutting_down {
            return;
        }
        let heads_only = self.cfg.discard_delay_ms == 0;
        // The cache tier's free segments too: a flash cache takes every write.
        let tiers: &[Tier] = if self.geo.tiered() {
            &[Tier::Capacity, Tier::Cache]
        } else {
            &[Tier::Capacity]
        };
        for &tier in tiers {
            let before = self.discard_before(tier);
            while self.segments.discarding < MAX_DISCARDS {
                let shared = &self.shared;
                let Some((seg, extent)) = self.segments.next_to_discard(
                    tier,
                    self.now_ms,
                    self.cfg.discard_delay_ms,
                    before,
                    1,
                    DISCARD_SCAN,
                    heads_only,
                    |s| shared.segment_pinned(SegmentId(s)),
                ) else {
                    break;
                };
                self.submit_discard(seg, false, extent);
            }
        }
    }

    pub(crate) fn fail(&mut self, msg: String) {
        if self.failed.is_none() {
            tracing::error!("array stops accepting writes: {msg}");
            self.failed = Some(msg.clone());
        }
        // Everything waiting for durability or space now fails.
        let waiters: Vec<_> = self.durability.take_all().collect();
        for (token, buf) in waiters {
            self.reply(token, Err(EngineError::Failed(msg.clone())), buf);
        }
        self.refuse_pending(|| EngineError::Failed(msg.clone()));
        self.ckpt.fail_waiters(self.out.replies(), &msg);
        self.end_rollback_wait(Some(EngineError::Failed(msg)));
    }

    /// Answers every request waiting for resources with `err`.
    fn refuse_pending(&mut self, err: impl Fn() -> EngineError) {
        while let Some(p) = self.pending.pop_front() {
            let (token, buf) = match p {
                Pending::Write { token, data, .. } => (token, Some(data)),
                Pending::Zero { token, .. } | Pending::Blocks { token, .. } => (token, None),
            };
            self.reply(token, Err(err()), buf);
        }
    }

    /// The server is shutting down: writes, rollbacks and the requests that change
    /// volumes or members are refused from now on (a rollback waiting for free
    /// space included), so that nothing starts after the final checkpoint.
    pub fn begin_shutdown(&mut self) {
        self.shutting_down = true;
        self.end_rollback_wait(Some(EngineError::ShuttingDown));
    }

    /// The final checkpoint committed: from now on every request is refused and GC
    /// picks no new victim. Requests still waiting for space are refused now;
    /// flushes and FUA writes waiting for a sync already wanted or sent are
    /// answered when it completes. Writes that waited for space before the
    /// shutdown began and went in after the checkpoint's own flush are flushed
    /// too. The host stops once [`Engine::quiesced`] says so, not before: a sync
    /// it stopped waiting for would leave a flush unanswered.
    pub fn finish_shutdown(&mut self) {
        self.shutting_down = true;
        self.closed = true;
        self.refuse_pending(|| EngineError::ShuttingDown);
        if self.failed.is_none() {
            self.start_flush();
        }
        self.progress();
    }

    /// Nothing is in flight or waiting: no device operation, no reply to drain, no
    /// flush waiting for a sync, no checkpoint under way. After
    /// [`Engine::finish_shutdown`] only what is under way goes on (GC's victim,
    /// releases, the tick's periodic sync), so the host stops at the first time
    /// this is true.
    pub fn quiesced(&self) -> bool {
        self.out.queued() == 0
            && self.out.in_flight() == 0
            && !self.out.has_replies()
            && !self.durability.has_waiters()
            && self.durability.sync_idle()
            && self.ckpt.is_idle()
    }

    // ---------------------------------------------------------------- progress

    /// Moves everything along as far as resources allow.
    pub(crate) fn progress(&mut self) {
        for _ in 0..4 {
            // GC's credit and phase too: writes held by pacing go on once it changes.
            let before = (
                self.pending.len(),
                self.out.queued(),
                self.segments.free_count(),
                self.gc_progress_mark(),
            );
            self.progress_pending();
            self.close_stale_segments();
            self.progress_gc();
            self.progress_rollback_wait();
            self.progress_checkpoint();
            self.progress_releases();
            self.progress_sync();
            self.progress_member_failures();
            self.recycle_buffers();
            if (
                self.pending.len(),
                self.out.queued(),
                self.segments.free_count(),
                self.gc_progress_mark(),
            ) == before
            {
                break;
            }
        }
    }

    fn progress_pending(&mut self) {
        while let Some(mut p) = self.pending.pop_front() {
            if self.failed.is_some() {
                self.pending.push_front(p);
                let msg = self.failed.clone().unwrap();
                self.fail(msg);
                return;
            }
            let r = match &mut p {
                Pending::Write { .. } => self.apply_write(&mut p),
                Pending::Zero { .. } => self.apply_zero(&mut p),
                Pending::Blocks { .. } => self.apply_blocks(&mut p),
            };
            match r {
                Ok(true) => self.finish_pending(p, Ok(())),
                Ok(false) => {
                    self.pending.push_front(p);
                    if self.stuck_without_space() {
                        self.space.refused += 1;
                        let p = self.pending.pop_front().unwrap();
                        self.finish_pending(
                            p,
                            Err(EngineError::NoSpace(
                                "no free segment and nothing left to garbage-collect".into(),
                            )),
                        );
                        continue;
                    }
                    return;
                }
                Err(e) => self.finish_pending(p, Err(e)),
            }
        }
    }

    fn finish_pending(&mut self, p: Pending, result: Result<(), EngineError>) {
        let (token, buf, fua) = match p {
            Pending::Write {
                token, data, fua, ..
            } => (token, Some(data), fua),
            Pending::Zero { token, fua, .. } => (token, None, fua),
            Pending::Blocks { token, .. } => (token, None, false),
        };
        if result.is_ok() && fua {
            let gen = self.start_flush();
            self.durability.wait(gen, token, buf);
        } else {
            self.reply(token, result, buf);
        }
    }

    /// Whether something under way may still free segments: GC moving a victim,
    /// segments on their way to the free list, a flush or writes in flight (or a
    /// rollback's checkpoint, which GC waits for).
    fn frees_under_way(&self) -> bool {
        self.rollback_until.is_some()
            || !self.gc.is_idle()
            || self.segments.in_release() != 0
            || !self.durability.sync_idle()
            || self.out.in_flight() != 0
    }

    /// True when nothing under way frees a segment of the capacity tier (of the
    /// array, without a cache tier) and GC has no victim left.
    pub(crate) fn gc_cannot_free_more(&mut self) -> bool {
        !self.frees_under_way() && self.pick_victim().is_none()
    }

    /// True when user writes wait for a segment that nothing can free.
    fn stuck_without_space(&mut self) -> bool {
        let (free, floor, _) = self.user_room();
        if free > floor || self.frees_under_way() {
            return false;
        }
        if self.geo.tiered() {
            // User writes wait for a cache segment: compaction frees one when it
            // has a closed segment to take (or a stream head to close) and the
            // capacity tier has room, or GC can make room there.
            let victim = self.segments.victims.oldest_cached().is_some()
                || self.cache_head_to_close().is_some();
            let room = self.segments.free.len() > self.user_floor() || self.pick_victim().is_some();
            return !(victim && room);
        }
        self.gc_cannot_free_more()
    }

    // ---------------------------------------------------------------- writes

    /// Applies as much of a pending write as resources allow. `Ok(true)` when done.
    fn apply_write(&mut self, p: &mut Pending) -> Result<bool, EngineError> {
        let Pending::Write {
            volume,
            offset,
            data,
            checked_space,
            ..
        } = p
        else {
            unreachable!()
        };
        let bs = BLOCK_SIZE_U64;
        let first_lba = *offset / bs;
        let last_lba = (*offset + data.len() as u64 - 1) / bs;
        let vol_shared = self.vol(*volume).shared.clone();
        if !*checked_space {
            self.check_space(&vol_shared, first_lba..last_lba + 1)?;
            *checked_space = true;
        }
        let mut block = [0u8; BLOCK_SIZE];
        let Pending::Write { class, .. } = p else {
            unreachable!()
        };
        let mut class_slot = *class;
        let Pending::Write {
            volume,
            offset,
            data,
            done,
            ..
        } = p
        else {
            unreachable!()
        };
        while first_lba + *done <= last_lba {
            let lba = Lba(first_lba + *done);
            let stream = self.user_stream_for(*volume, lba, &mut class_slot);
            if !self.room_for_user_block(stream) {
                if let Pending::Write { class, .. } = p {
                    *class = class_slot;
                }
                return Ok(false);
            }
            let block_start = lba.0 * bs;
            let src_lo = block_start.max(*offset);
            let src_hi = (block_start + bs).min(*offset + data.len() as u64);
            let data_slice: &[u8] = if src_lo == block_start && src_hi == block_start + bs {
                let o = (block_start - *offset) as usize;
                &data[o..o + BLOCK_SIZE]
            } else {
                // Partial block: merge with its current content.
                if let Err(e) = self.shared.read_blocks(&vol_shared, lba, &mut block) {
                    return Err(EngineError::Io(format!(
                        "read-modify-write of block {lba}: {e}"
                    )));
                }
                let a = (src_lo - block_start) as usize;
                let b = (src_hi - block_start) as usize;
                let so = (src_lo - *offset) as usize;
                block[a..b].copy_from_slice(&data[so..so + (b - a)]);
                &block
            };
            self.spend_credit();
            self.append_user(stream, *volume, lba, Some(data_slice), &mut class_slot);
            *done += 1;
        }
        Ok(true)
    }

    /// Applies a metadata-only write (simulation).
    fn apply_blocks(&mut self, p: &mut Pending) -> Result<bool, EngineError> {
        let Pending::Blocks {
            volume,
            lba,
            count,
            done,
            class,
            checked_space,
            ..
        } = p
        else {
            unreachable!()
        };
        // Admission as for writes, when the simulation enforces it (with
        // snapshots: what they keep can fill the array).
        if !*checked_space && self.cfg.enforce_capacity {
            let shared = self.vol(*volume).shared.clone();
            self.check_space(&shared, lba.0..lba.0 + *count)?;
            *checked_space = true;
        }
        while *done < *count {
            let b = Lba(lba.0 + *done);
            let stream = self.user_stream_for(*volume, b, class);
            if !self.room_for_user_block(stream) {
                return Ok(false);
            }
            self.spend_credit();
            self.append_user(stream, *volume, b, None, class);
            *done += 1;
        }
        Ok(true)
    }

    /// The user stream block `lba` goes to: the class cached in `class` (a block
    /// waiting for room keeps its class), else what the volume's classifier says,
    /// folded into the classes kept open now (the cache holds the classifier's
    /// class: the caps may change while the block waits).
    fn user_stream_for(&mut self, volume: VolumeId, lba: Lba, class: &mut Option<u8>) -> usize {
        let c = match *class {
            Some(c) => c,
            None => {
                let vol = self.vol(volume);
                let prev = match decode(vol.shared.map.load(lba)) {
                    Entry::Device(pba) => Some(self.written_at(pba, vol.user_blocks)),
                    Entry::Buffer(slot) => {
                        Some(self.written_at(self.slot_pba(slot), vol.user_blocks))
                    }
                    Entry::Unmapped | Entry::Bad => None,
                };
                let vol = self.vol_mut(volume);
                vol.policy.user_write(lba);
                *class.insert(vol.classifier.classify_user(lba, vol.user_blocks, prev))
            }
        };
        let vol = self.vol(volume);
        vol.streams[vol.caps.user_class(c) as usize]
    }

    /// Every segment's (born, closed, origin) times, for tests.
    #[doc(hidden)]
    pub fn segment_times(&self) -> Vec<(u64, u64, u64)> {
        self.segments
            .segs
            .iter()
            .map(|s| {
                (
                    s.born,
                    s.closed,
                    s.origins.as_ref().map_or(s.born, |o| o.mean[0]),
                )
            })
            .collect()
    }

    /// A volume's time: the user blocks written to it (0 for the metadata stream's
    /// volume number, which names no volume).
    pub(crate) fn volume_time(&self, volume: u16) -> u64 {
        self.volumes
            .get(volume as usize)
            .and_then(|v| v.as_ref())
            .map_or(0, |v| v.user_blocks)
    }

    /// When the block at `pba` was written, in its volume's time (`now` is that
    /// volume's time now), as classifiers read it ([`Written`]): a segment's blocks
    /// are written in order from its opening to its closing (or to now, while it is
    /// open), so a block's place in the segment dates it.
    pub(crate) fn written_at(&self, pba: Pba, now: u64) -> Written {
        let (seg, offset) = self.geo.split(pba);
        let s = &self.segments.segs[seg.0 as usize];
        let at = if let Some(o) = &s.origins {
            // GC writes blocks of many ages: what dates them is where they came from.
            o.mean[crate::segments::Origins::slot(offset, self.geo.segment_blocks)]
        } else {
            // Blocks of the unit being filled lie past the write pointer: written now.
            let end = if s.state == SegState::Open {
                now
            } else {
                s.closed
            };
            let span = end.saturating_sub(s.born) as u128;
            s.born + (span * offset.min(s.write_ptr) as u128 / s.write_ptr.max(1) as u128) as u64
        };
        Written { at, class: s.class }
    }

    /// Appends a user block and accounts for it (time, counters, class).
    fn append_user(
        &mut self,
        stream: usize,
        volume: VolumeId,
        lba: Lba,
        data: Option<&[u8]>,
        class: &mut Option<u8>,
    ) {
        self.append_data(stream, volume, lba, data, None);
        let vol = self.vol_mut(volume);
        // New contents have not been read (the engine's own read of a block it
        // merges into does not count either).
        vol.shared.map.take_read(lba);
        vol.user_blocks += 1;
        let kept = vol.caps.user_class(class.take().unwrap_or(0));
        vol.classes[kept as usize].blocks += 1;
        self.counters.user_blocks += 1;
        self.user_block_written();
    }

    /// ENOSPC unless the array has room for the blocks of `lbas` not yet mapped,
    /// and for those a snapshot or clone shares: an overwrite keeps the shared
    /// block and takes another (thin provisioning: checked before a write or an
    /// allocating zero starts); and for the map pages the unmapped ones start,
    /// which the checkpoints write.
    fn check_space(
        &mut self,
        vol: &VolumeShared,
        lbas: std::ops::Range<u64>,
    ) -> Result<(), EngineError> {
        let (mut new_blocks, mut new_pages) = (0, 0);
        // The last page looked at, so that a run within one page counts it once.
        let mut looked = u64::MAX;
        for l in lbas {
            let e = vol.map.load(Lba(l));
            if e == UNMAPPED {
                new_blocks += 1;
                let page = l / crate::map::PAGE_ENTRIES as u64;
                if page != looked {
                    looked = page;
                    new_pages += !vol.map.page_used(Lba(l)) as u64;
                }
            } else if self.shared_elsewhere(vol.id, Lba(l), e) {
                new_blocks += 1;
            }
        }
        self.space.admit(new_blocks, new_pages)
    }

    /// Applies a zero / trim request: unmaps whole blocks, zeroes partial edges.
    fn apply_zero(&mut self, p: &mut Pending) -> Result<bool, EngineError> {
        let Pending::Zero {
            volume,
            offset,
            length,
            stage,
            allocate,
            class: waiting,
            checked_space,
            ..
        } = p
        else {
            unreachable!()
        };
        let bs = BLOCK_SIZE_U64;
        let (start, end) = (*offset, *offset + *length);
        // The whole blocks of the range (empty when it lies inside one block).
        let full_first = Lba(start.div_ceil(bs));
        let full_end = Lba(end / bs); // exclusive
        let vol_shared = self.vol(*volume).shared.clone();
        if *allocate && !*checked_space {
            // Allocated zeroes take space like a write: refuse up front, as writes do.
            self.check_space(&vol_shared, start / bs..end.div_ceil(bs))?;
            *checked_space = true;
        }
        // Partial edges first (they are writes of zeros merged into the old block).
        let edges: [(u64, u64); 2] = if full_first > full_end {
            // The whole range lies inside one block.
            [(start, end), (0, 0)]
        } else {
            [
                (start, (full_first.0 * bs).min(end)),
                ((full_end.0 * bs).max(start), end),
            ]
        };
        while *stage < 2 {
            let (lo, hi) = edges[*stage as usize];
            if lo < hi {
                let lba = Lba(lo / bs);
                // An unmapped edge already reads as zeros; with `allocate` it is
                // written all the same, so that it holds space.
                if *allocate || vol_shared.map.load(lba) != UNMAPPED {
                    let mut class = None;
                    let stream = self.user_stream_for(*volume, lba, &mut class);
                    if self.ensure_unit(stream, 1, 0).is_err() {
                        return Ok(false);
                    }
                    let mut block = [0u8; BLOCK_SIZE];
                    self.shared
                        .read_blocks(&vol_shared, lba, &mut block)
                        .map_err(|e| EngineError::Io(format!("zeroing block {lba}: {e}")))?;
                    block[(lo - lba.0 * bs) as usize..(hi - lba.0 * bs) as usize].fill(0);
                    self.append_user(stream, *volume, lba, Some(&block), &mut class);
                }
            }
            *stage += 1;
        }
        if *allocate {
            // Whole blocks are written as zero blocks, like data: they keep their
            // space. Resumable: `stage - 2` blocks are done.
            static ZERO: [u8; BLOCK_SIZE] = [0; BLOCK_SIZE];
            while full_first + (*stage - 2) < full_end {
                let lba = full_first + (*stage - 2);
                let stream = self.user_stream_for(*volume, lba, waiting);
                if self.ensure_unit(stream, 1, 0).is_err() {
                    return Ok(false);
                }
                self.append_user(stream, *volume, lba, Some(&ZERO), waiting);
                *stage += 1;
            }
            return Ok(true);
        }
        if full_first < full_end {
            let count = full_end - full_first;
            // Trim records go to the metadata stream, not the volume's data stream:
            // a data segment is released once its blocks are dead, and the trim
            // records in it would go with it, while metadata segments live until a
            // later checkpoint (which reflects the trim) commits.
            let ms = self.log.meta_stream;
            // Trim records carry at most u32::MAX blocks; one record pair per chunk.
            let chunks = count.div_ceil(u32::MAX as u64) as usize;
            if self.ensure_unit(ms, 0, 2 * chunks).is_err() {
                return Ok(false);
            }
            // Run by run: trimming the unwritten part of a thin volume costs
            // nothing per block.
            for lba in vol_shared.map.mapped_runs(full_first, full_end).flatten() {
                let old = vol_shared.map.load(lba);
                if old != UNMAPPED {
                    vol_shared.map.store(lba, UNMAPPED);
                    vol_shared.map.take_read(lba);
                    if !self.shared_elsewhere(*volume, lba, old) {
                        self.unref(old);
                        self.space.unmapped(1);
                    }
                    let v = self.vol_mut(*volume);
                    v.live_blocks -= 1;
                    v.policy.trimmed(lba);
                }
            }
            let mut lba = full_first;
            while lba < full_end {
                let n = (full_end - lba).min(u32::MAX as u64);
                let v = self.take_version();
                let st = &mut self.log.streams[ms];
                st.extras.push(RawRecord::trim(volume.0, lba.0, n as u32));
                st.extras.push(RawRecord::version(v.0));
                lba += n;
            }
            self.durability.unsynced_writes = true;
        }
        Ok(true)
    }

    // ---------------------------------------------------------------- discards and releases

    /// Discards are issued on the devices of `tier` where they take writes
    /// anywhere (a zoned device's zone is reset when its segment is reused
    /// instead; a cache tier in front of zoned devices is conventional).
    fn discard_enabled(&self, tier: Tier) -> bool {
        self.cfg.discard && (!self.zones.zoned || tier == Tier::Cache)
    }

    /// Free segments of `tier` whose contents were opened before this version
    /// may be discarded (see [`SegmentTable::discardable`]); `None` when discards
    /// are off there.
    fn discard_before(&self, tier: Tier) -> Option<Version> {
        self.discard_enabled(tier)
            .then_some(self.durable_ckpt_version)
    }

    /// Segment `seg`'s discard on release, when there is one (no delay): before
    /// which version it may be discarded.
    fn release_discards(&self, seg: u32) -> Option<Version> {
        self.discard_before(self.geo.tier(seg))
            .filter(|_| self.cfg.discard_delay_ms == 0)
    }

    /// Queues the discard of segment `seg`'s `extent`.
    fn submit_discard(&mut self, seg: u32, wait: bool, extent: Extent) {
        let (h, end) = (self.geo.header_blocks as u32, self.geo.segment_blocks);
        let (from, to) = match extent {
            Extent::Whole => (0, end),
            Extent::Tail => (h, end),
            Extent::Head => (0, h),
        };
        let (dev, off) = self.geo.locate(SegmentId(seg), from);
        let len = (to - from) as u64 * BLOCK_SIZE_U64;
        self.submit_io(
            Purpose::Discard { seg, wait, extent },
            dev,
            off,
            IoKind::Discard { len },
        );
    }

    /// A closed segment has no live block left: start releasing it.
    pub(crate) fn segment_emptied(&mut self, seg: u32) {
        // Scrub stops trusting it before its discard (or zone reset) can start.
        self.shared.set_written_end(SegmentId(seg), 0);
        if self.cfg.metadata_only {
            // Nothing is durable in a simulation: reuse at once (an emulated SSD
            // under the simulator still hears of it).
            if self.discard_enabled(self.geo.tier(seg)) {
                self.submit_discard(seg, false, Extent::Whole);
            }
            self.segments.make_free(seg, self.now_ms);
            self.shared.set_segment_free(seg, true);
            return;
        }
        // The writes that emptied it are in units sealed by the next flush at the
        // latest; that flush's generation must be synced first.
        self.segments.emptied(seg, self.durability.flush_gen + 1);
    }

    // ---------------------------------------------------------------- flush & sync

    /// Seals every open unit and asks for a sync covering everything issued so far.
    /// Returns the flush generation a caller waits for.
    pub(crate) fn start_flush(&mut self) -> u64 {
        self.add_release_records();
        if self.zones.any_conventional {
            for s in 0..self.log.streams.len() {
                self.move_small_unit(s);
            }
        }
        for s in 0..self.log.streams.len() {
            self.seal_unit(s);
        }
        self.durability
            .start_flush(self.next_version.prev(), self.now_ms)
    }

    /// Puts release records for segments whose emptiness is durable into the
    /// metadata stream.
    fn add_release_records(&mut self) {
        let ms = self.log.meta_stream;
        while !self.segments.release_ready.is_empty() {
            if self.ensure_unit(ms, 0, 1).is_err() {
                break;
            }
            let seg = self
                .segments
                .release_recorded(self.durability.flush_gen + 1);
            let inc = self.segments.segs[seg as usize].incarnation;
            self.log.streams[ms]
                .extras
                .push(RawRecord::release(seg, inc.0));
        }
    }

    fn progress_sync(&mut self) {
        let geo = &self.geo;
        let in_use = geo.data_devices().filter(|&d| !geo.is_removed(d)).count();
        if self.durability.send_sync(in_use).is_none() {
            return;
        }
        self.counters.syncs += 1;
        for d in self.geo.data_devices() {
            if !self.geo.is_removed(d) {
                self.submit_io(Purpose::Sync, d, 0, IoKind::Sync);
            }
        }
    }

    fn sync_part_done(&mut self) {
        let Some(t) = self.durability.sync_part_done() else {
            return;
        };
        if self.failed.is_some() {
            return;
        }
        // Writes that left out a failed member are acknowledged only once the
        // superblocks say it failed: otherwise a restart could trust its stale data.
        if let Some(st) = &self.shared.striped {
            if st.failure_epoch() != self.sbw.failures_durable() {
                self.durability.deferred = Some(t);
                return;
            }
        }
        self.finish_sync(t);
    }

    pub(crate) fn finish_sync(&mut self, t: SyncTarget) {
        self.durable_version = self.durable_version.max(t.version);
        self.durability.synced(t);
        while let Some((token, buf)) = self.durability.take_ready() {
            self.reply(token, Ok(()), buf);
        }
        self.ckpt_synced();
    }

    /// Moves emptied segments along the release protocol as flushes complete.
    fn progress_releases(&mut self) {
        if self.segments.in_release() == 0 {
            return;
        }
        let synced = self.durability.synced_gen;
        self.segments.synced(synced);
        // With no delay, released segments are discarded before they join the free
        // queue (once no reader holds them), all those whose release is durable at
        // once; see `SegmentTable::discardable`. Otherwise `discard_idle` discards
        // those that stay free.
        if self.cfg.discard_delay_ms == 0 {
            for i in 0..self.segments.released(synced) {
                let s = self.segments.releasing[i];
                let Some(before) = self.release_discards(s) else {
                    continue;
                };
                // Released: nobody reads it any more (scrub and rebuild skip it).
                self.shared.set_segment_free(s, true);
                let Some(extent) = self.segments.discardable(s, Some(before)) else {
                    continue;
                };
                if !self.segments.discards.contains_key(&s)
                    && !self.shared.segment_pinned(SegmentId(s))
                {
                    self.segments.discards.insert(s, None);
                    self.submit_discard(s, true, extent);
                }
            }
        }
        // Segments are freed in the order their release records were sealed, which
        // is the order recovery walks them.
        while let Some(&first) = self.segments.releasing.first() {
            let release_discards = self.release_discards(first);
            let Some(s) = self
                .segments
                .free_next_released(synced, release_discards, self.now_ms)
            else {
                break;
            };
            self.shared.set_segment_free(s, true);
        }
        // When free segments run low, run a flush to move the protocol forward.
        let (user_free, _, user_start) = self.user_room();
        let low = self.segments.free.len() < self.gc_start_segments() || user_free < user_start;
        let stalled = !self.pending.is_empty() || !self.gc.is_idle();
        if (low || stalled)
            && self.segments.wants_flush(synced)
            && self.durability.sync_idle()
            && self.failed.is_none()
        {
            self.start_flush();
        }
    }

    /// Blocks written to JBOD member `dev` per block of its capacity.
    pub(crate) fn member_wear(&self, dev: usize) -> f64 {
        let written = self.device_blocks.get(dev).copied().unwrap_or(0) as f64;
        // The striped device of a mirrored cache (`dev` past the members) holds
        // the cache tier's segments.
        let segments = self
            .geo
            .devices
            .get(dev)
            .map_or(self.geo.cache_segments(), |d| d.segment_count);
        written / (segments.max(1) as f64)
    }

    pub(crate) fn count_device_blocks(&mut self, dev: usize, blocks: u32) {
        if dev >= self.device_blocks.len() {
            self.device_blocks.resize(dev + 1, 0);
        }
        self.device_blocks[dev] += blocks as u64;
    }

    /// The largest number of GC classes of any volume (GC may need a fresh segment
    /// in each to finish one victim; see [`Space::user_floor`]).
    fn gc_classes(&self) -> usize {
        debug_assert_eq!(
            self.gc_classes,
            self.count_gc_classes(),
            "stale GC class count"
        );
        self.gc_classes
    }

    fn count_gc_classes(&self) -> usize {
        self.volumes
            .iter()
            .flatten()
            .map(|v| {
                // The classifier's GC classes beyond the kept ones take no segment.
                let folded = v.classifier.gc_classes() - v.caps.gc;
                v.streams.len() - v.user_classes as usize - folded as usize
            })
            .max()
            .unwrap_or(1)
    }

    /// Recounts [`Engine::gc_classes`]: after volumes come and go, and when the
    /// classes they keep open change.
    pub(crate) fn refresh_gc_classes(&mut self) {
        self.gc_classes = self.count_gc_classes();
    }

    /// Free segments user streams leave to GC and the metadata stream.
    pub(crate) fn user_floor(&self) -> usize {
        self.space.user_floor(self.gc_classes())
    }

    /// Free segments below which GC runs (always above the user floor).
    pub(crate) fn gc_start_segments(&self) -> usize {
        self.space.gc_start(self.gc_classes())
    }

    /// Free segments at which GC stops.
    pub(crate) fn gc_stop_segments(&self) -> usize {
        self.space.gc_stop(self.gc_classes())
    }
}
