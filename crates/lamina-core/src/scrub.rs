//! Scrub: read every live segment, check every data block against the CRC-32C its
//! unit header records and every stripe row against its parity, and repair what
//! the parity allows (a bad data block is rebuilt and written back; bad parity is
//! recomputed). JBOD and SAID0 have no parity: scrub reports what it finds there.
//!
//! Only the written part of a segment is scrubbed: its units whose writes have
//! completed (`Shared::written_end`), found by walking their headers (each
//! checked by its own checksum). Runs beside the engine; a segment is pinned
//! while it is scrubbed so that it is not reused under it.

use crate::engine::Request;
use crate::error::EngineError;
use crate::shared::Shared;
use crate::types::{SegmentId, BLOCK_SIZE};
use lamina_device::striped::ScrubStats;
use lamina_format::unit::{kind, record_at, UnitHeader};

/// What a scrub found and did.
#[derive(Clone, Debug, Default)]
pub struct ScrubReport {
    pub segments: u64,
    pub units: u64,
    pub blocks_checked: u64,
    /// Segments whose unit headers end before their summary says the units do: a
    /// damaged header hides the units after it (reported, not repaired).
    pub damaged_headers: u64,
    /// Damaged unit headers read correctly by leaving one member out (their
    /// blocks are then repaired like data blocks).
    pub headers_found_by_parity: u64,
    /// Segments emptied or reused while scrub read them: their findings are
    /// dropped (they hold nothing anyone reads any more).
    pub changed_while_read: u64,
    pub stats: ScrubStats,
    /// The checkpoint that ends a scrub failed (see [`scrub`]): until one
    /// commits, what the scrub did not read may still be needed after a crash.
    pub checkpoint_error: Option<String>,
}

impl ScrubReport {
    fn add(&mut self, o: &ScrubReport) {
        self.segments += o.segments;
        self.units += o.units;
        self.blocks_checked += o.blocks_checked;
        self.damaged_headers += o.damaged_headers;
        self.headers_found_by_parity += o.headers_found_by_parity;
        self.changed_while_read += o.changed_while_read;
        self.stats.add(&o.stats);
    }
}

/// What a block of a segment should hold.
#[derive(Clone, Copy)]
enum Expect {
    /// Beyond the units.
    Unknown,
    /// A data block with this CRC-32C.
    Crc(u32),
    /// A header block of a unit whose header checksum matched.
    Good,
}

/// One incarnation of a segment, as scrub found it when it started on it.
#[derive(Clone, Copy)]
struct Incarnation {
    seg: u32,
    incarnation: u64,
}

/// The unit header at `offset` of `seg`, if one that belongs there decodes.
fn header_at(
    shared: &Shared,
    seg: Incarnation,
    offset: u32,
    hdr: &mut [u8],
    without: Option<usize>,
) -> Option<UnitHeader> {
    let Incarnation { seg, incarnation } = seg;
    let geo = &shared.geo;
    let (dev, off) = geo.locate(SegmentId(seg), offset);
    let read = match (without, shared.striped_at(dev)) {
        (Some(m), Some(st)) => st.read_without(hdr, off, m),
        _ => shared.devices[dev].read_at(hdr, off),
    };
    read.ok()?;
    let u = UnitHeader::decode(hdr).ok()?;
    let ok = u.segment == seg
        && u.offset == offset
        && u.incarnation == incarnation
        && u.array_id == geo.array_id
        && offset + u.total_blocks() <= geo.data_end;
    ok.then_some(u)
}

/// What each block of a segment should hold, the end of its units, their count,
/// whether a damaged header hid units, and how many damaged headers were found
/// good again by leaving one member out (their blocks are then expected by CRC,
/// so that scrub rewrites them). Only units that end within `written` (the
/// prefix whose writes completed) count: a unit still being written may show its
/// header before its data.
#[allow(clippy::type_complexity)]
fn unit_crcs(
    shared: &Shared,
    inc: Incarnation,
    written: u32,
) -> Result<(Vec<Expect>, u32, u64, bool, u64), EngineError> {
    let geo = &shared.geo;
    let h = geo.header_blocks as u32;
    let Incarnation { seg, incarnation } = inc;
    let limit = written.min(geo.data_end);
    let mut crcs = vec![Expect::Unknown; geo.data_end as usize];
    let mut hdr = vec![0u8; h as usize * BLOCK_SIZE];
    // A closed segment's summary says where its units end.
    let mut summary_end = None;
    let mut sum = vec![0u8; geo.summary_blocks as usize * BLOCK_SIZE];
    // Read as reads of metadata are: a summary damaged on one member is rebuilt
    // from the others (a mirror's copies), or the damage of a whole column, its
    // summary and headers included, would hide the column from the scrub.
    let (dev, off) = geo.locate(SegmentId(seg), geo.data_end);
    let decoded = shared.read_decoded(dev, off, &mut sum, |b| {
        lamina_format::summary::SummaryHeader::decode(b)
            .ok()
            .filter(|s| s.segment == seg && s.incarnation == incarnation)
    });
    if let Ok(Some(s)) = decoded {
        summary_end = Some(s.data_end);
    }
    let members = shared
        .striped_at(geo.locate(SegmentId(seg), 0).0)
        .map_or(0, |st| st.shape().members());
    let mut offset = 0;
    let mut units = 0;
    let mut rebuilt = 0;
    // Where the walk stopped because the rest is not written yet (not damage).
    let mut unwritten = false;
    while offset + h <= geo.data_end {
        if offset + h > limit {
            unwritten = true;
            break;
        }
        let mut found = header_at(shared, inc, offset, &mut hdr, None).map(|u| (u, false));
        // Units should go on here (the summary says so, or the engine wrote this
        // far in this run): a damaged header? Try each member left out.
        let expected =
            summary_end.is_some_and(|e| offset < e) || (written != u32::MAX && offset < limit);
        if found.is_none() && expected {
            found = (0..members)
                .find_map(|m| header_at(shared, inc, offset, &mut hdr, Some(m)))
                .map(|u| (u, true));
        }
        let Some((u, was_rebuilt)) = found else {
            break;
        };
        if offset + u.total_blocks() > limit {
            unwritten = true;
            break;
        }
        for (i, b) in (offset..offset + h).enumerate() {
            crcs[b as usize] = if was_rebuilt {
                Expect::Crc(lamina_format::crc32c(
                    &hdr[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE],
                ))
            } else {
                Expect::Good
            };
        }
        rebuilt += was_rebuilt as u64;
        for i in 0..u.data_blocks as usize {
            let r = record_at(&hdr, i);
            if kind::is_data_bearing(r.kind) {
                crcs[(offset + h) as usize + i] = Expect::Crc(r.b as u32);
            }
        }
        units += 1;
        offset += u.total_blocks();
    }
    let damaged = !unwritten && summary_end.is_some_and(|e| offset < e);
    Ok((crcs, offset, units, damaged, rebuilt))
}

/// Scrubs every segment in use; `progress(done, total)` after each segment.
/// `call` sends a request to the engine and waits for its reply (a scrub ends with
/// a checkpoint, below).
pub fn scrub(
    shared: &Shared,
    call: &dyn Fn(Request) -> Result<(), EngineError>,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ScrubReport, EngineError> {
    let total = shared.geo.segment_count as u64;
    let mut report = ScrubReport::default();
    for seg in 0..shared.geo.segment_count {
        let _pin = shared.pin_segment(SegmentId(seg));
        if !shared.segment_free(seg) {
            // The incarnation before the prefix: the engine zeroes the prefix
            // before it sets a new incarnation (`Shared::reset_segment`).
            let inc = Incarnation {
                seg,
                incarnation: shared.incarnation(SegmentId(seg)),
            };
            let written = shared.written_end(SegmentId(seg));
            let found = scrub_segment(shared, inc, written)?;
            // The pin keeps the segment from being discarded or taken for reuse,
            // except in one window: `take_free` marks it in use, then waits out
            // the pins, and a pin that arrives just after its check is not waited
            // for. The prefix covers that: it is zero from the moment a segment is
            // emptied until units of its next incarnation complete. A segment
            // emptied or reused while it was read anyway holds nothing of the old
            // incarnation that is read any more: its findings are dropped. (A
            // repair written meanwhile was checked against the old checksums
            // under the stripe lock, so it only ever put back old content.) Here
            // the prefix is read first, the reverse of the reads above, so that
            // the check holds even without the pin.
            let written_after = shared.written_end(SegmentId(seg));
            if written_after < written || shared.incarnation(SegmentId(seg)) != inc.incarnation {
                report.changed_while_read += 1;
            } else {
                report.add(&found);
            }
        }
        progress(seg as u64 + 1, total);
    }
    // Free segments are not scrubbed, but recovery from the durable checkpoint
    // still reads the first headers of those released since it (they tell its
    // walk of the free queue where the allocations ended); on a copy or member
    // that rotted they may be junk, and once the good one is lost a crash would
    // stop the walk early. After a checkpoint, recovery reads only what this scrub
    // checked or what was written after it
    // (`tiers::a_crash_after_a_scrub_and_the_loss_of_the_good_copy_loses_nothing`).
    // Its failure (the array failed, the server is stopping) is reported with
    // what the scrub found and mended, which is on the devices either way.
    if let Err(e) = call(Request::Checkpoint) {
        tracing::warn!("the checkpoint that ends the scrub failed: {e}");
        report.checkpoint_error = Some(e.to_string());
    }
    Ok(report)
}

/// [`scrub`] of an engine that no server runs (offline commands, tests): its
/// requests are served inline.
pub fn scrub_inline(
    engine: &mut crate::Engine,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<ScrubReport, EngineError> {
    crate::recovery::with_inline_calls(engine, |shared, call| scrub(shared, call, progress))
}

/// Scrubs the blocks of one incarnation of a segment within its written prefix.
fn scrub_segment(
    shared: &Shared,
    inc: Incarnation,
    written: u32,
) -> Result<ScrubReport, EngineError> {
    let geo = &shared.geo;
    let seg = inc.seg;
    let mut report = ScrubReport::default();
    let (crcs, end, units, damaged, rebuilt) = unit_crcs(shared, inc, written)?;
    if damaged {
        report.damaged_headers += 1;
    }
    report.headers_found_by_parity += rebuilt;
    if end == 0 {
        return Ok(report);
    }
    report.segments += 1;
    report.units += units;
    report.blocks_checked += crcs.iter().filter(|c| matches!(c, Expect::Crc(_))).count() as u64;
    let check = |b: u64, data: &[u8]| match crcs.get(b as usize) {
        Some(Expect::Crc(c)) => Some(lamina_format::crc32c(data) == *c),
        Some(Expect::Good) => Some(true),
        _ => None,
    };
    match shared.striped_at(geo.locate(SegmentId(seg), 0).0) {
        Some(st) => {
            let rows = (end as u64).div_ceil(geo.row_blocks as u64);
            let stripe = (seg - geo.stripe_segment(0)) as u64;
            report.stats.add(&st.scrub_rows(stripe, rows, &check));
        }
        None => {
            let (dev, off) = geo.locate(SegmentId(seg), 0);
            let mut buf = vec![0u8; end as usize * BLOCK_SIZE];
            match shared.devices[dev].read_at(&mut buf, off) {
                Ok(()) => {
                    for b in 0..end as usize {
                        if check(b as u64, &buf[b * BLOCK_SIZE..(b + 1) * BLOCK_SIZE])
                            == Some(false)
                        {
                            report.stats.checksum_errors += 1;
                            report.stats.unrecoverable += 1;
                        }
                    }
                }
                Err(_) => report.stats.unrecoverable += 1,
            }
            report.stats.rows += end as u64;
        }
    }
    Ok(report)
}
