//! The Lamina engine: log-structured placement, mapping, garbage collection,
//! checkpoints and recovery, with no operating system calls of its own.
//!
//! * [`recovery::format`] writes a new array; [`recovery::open`] opens one.
//! * [`engine::Engine`] owns all placement decisions; one thread drives it.
//! * [`shared::Shared`] is what client threads read through, without the engine.
//! * [`io`] is the boundary to devices: the engine asks, a driver executes.

pub mod buffer;
mod classcap;
mod durability;
pub mod engine;
mod engine_ckpt;
mod engine_gc;
mod engine_log;
mod engine_members;
mod engine_snap;
pub use engine_snap::ROLLBACK_BUSY;
mod engine_volumes;
pub use engine_volumes::{check_volume_size, trim_tail};
pub mod error;
pub mod fsck;
pub mod gc;
pub mod geometry;
pub mod io;
mod lineage;
pub mod map;
mod outbox;
pub mod pins;
pub mod placement;
pub mod rebuild;
pub mod recovery;
mod sb_writer;
pub mod scrub;
mod segments;
mod shadow;
pub mod shared;
mod space;
pub mod status;
mod sync;
pub mod types;
mod unit_buffers;
mod victims;
mod zones;

pub use engine::{Engine, EngineConfig, NewDevice, Reply, Request, Token};
pub use error::EngineError;
pub use recovery::{
    call_inline, evacuate, format, grow, open, open_unfinished, replace, run_inline,
    EvacuateReport, FormatParams, GrowParams, OpenMode, RecoveryReport, ReplaceReport,
    RECOVERY_TOKEN,
};
pub use shared::{DeviceRead, HeaderRead, ReadError, ReadStart, Shared, VolumeShared};
pub use space::{check_overcommit, check_thresholds, usable_blocks_of};
pub use status::{CacheStatus, ClassStatus, MemberStatus, StatusReport, VolumeStatus};
pub use types::{Lba, Pba, SegmentId, Version, VolumeId, BLOCK_SIZE};
