//! Device operations the engine asks for, and their completions.
//!
//! The engine never performs device writes or syncs itself: it queues [`IoOp`]s, a
//! driver executes them (on I/O threads in the server, inline in tests and the
//! simulator) and hands back [`IoCompletion`]s. The tag lets the engine match the two.

use crate::shared::Shared;
use lamina_device::DeviceError;

/// What a device operation does.
pub enum IoKind {
    /// Write the first `blocks` blocks of write buffer `unit`.
    WriteUnit { unit: u32, blocks: u32 },
    /// Write owned bytes (summaries, superblocks).
    WriteOwned { data: Vec<u8> },
    /// Read into the given buffer (its length is the read length); returned in the
    /// completion.
    Read { buf: Vec<u8> },
    /// Make completed writes durable.
    Sync,
    /// Finish the zone at `offset` once the writes before it have landed (zoned
    /// devices).
    FinishZone,
    /// Discard `len` bytes at `offset` (advisory).
    Discard { len: u64 },
}

pub struct IoOp {
    pub tag: u64,
    pub device: usize,
    pub offset: u64,
    pub kind: IoKind,
}

pub struct IoCompletion {
    pub tag: u64,
    pub result: Result<(), DeviceError>,
    /// The buffer of a `Read` (or of a `WriteOwned`, for reuse).
    pub buf: Option<Vec<u8>>,
}

/// Executes one operation synchronously against the shared devices.
pub fn execute(shared: &Shared, op: IoOp) -> IoCompletion {
    let dev = &shared.devices[op.device];
    let (result, buf) = match op.kind {
        IoKind::WriteUnit { unit, blocks } => {
            // SAFETY: the engine sealed this buffer and does not touch it until the
            // completion comes back.
            let data = unsafe { shared.buffers.blocks(unit, 0, blocks) };
            (dev.write_at(data, op.offset), None)
        }
        IoKind::WriteOwned { data } => (dev.write_at(&data, op.offset), Some(data)),
        IoKind::Read { mut buf } => (dev.read_at(&mut buf, op.offset), Some(buf)),
        IoKind::Sync => (dev.sync(), None),
        IoKind::FinishZone => (dev.finish_zone(op.offset), None),
        IoKind::Discard { len } => (dev.discard(op.offset, len), None),
    };
    IoCompletion {
        tag: op.tag,
        result,
        buf,
    }
}
