//! Rebuilding a replaced member of a striped array, online.
//!
//! A log-structured array knows which stripes hold anything: the ones not in the
//! free queue. Only those are rebuilt; a free stripe is skipped, because whatever
//! is written to it later goes to the new member with the rest of its rows. So a
//! rebuild moves the array's *used* space, not the member's size (a whole-device
//! rebuild, as RAID does it, moves every stripe).
//!
//! The rebuild runs beside the engine (its own thread in the server), rebuilding
//! one stripe at a time under the stripe's lock so that a write to the same rows
//! cannot interleave. Its progress (the stripe below which the new member is
//! current) is recorded in the superblocks every few seconds, so a rebuild that is
//! interrupted resumes where the record says after a restart.

use crate::engine::Request;
use crate::error::EngineError;
use crate::shared::Shared;
use std::time::{Duration, Instant};

/// How a rebuild runs.
/// Zoned rebuilds hold a stripe quiet for at most about this many rows.
const HELD_ROWS: u64 = 16;

#[derive(Clone, Debug)]
pub struct RebuildOptions {
    /// Bytes per second written to the new member at most (`None`: no limit), so
    /// that foreground I/O keeps its share of the devices.
    pub rate_bytes_per_s: Option<u64>,
    /// How often progress is recorded in the superblocks.
    pub record_every: Duration,
    /// Stop after this many stripes, unfinished (tests of resumption).
    pub max_stripes: Option<u64>,
    /// Rebuild every stripe, free or not, as a RAID without a log would (for
    /// comparison benchmarks).
    pub all_stripes: bool,
}

impl Default for RebuildOptions {
    fn default() -> Self {
        RebuildOptions {
            rate_bytes_per_s: None,
            record_every: Duration::from_secs(2),
            max_stripes: None,
            all_stripes: false,
        }
    }
}

/// What a finished rebuild did.
#[derive(Clone, Debug, Default)]
pub struct RebuildReport {
    pub member: usize,
    /// Stripes the rebuild went through (from where it resumed).
    pub stripes_visited: u64,
    /// Stripes that held data and were rebuilt.
    pub stripes_rebuilt: u64,
    /// Bytes written to the new member.
    pub bytes_written: u64,
    /// Bytes a whole-device rebuild of the same stripes would have written.
    pub whole_device_bytes: u64,
    pub elapsed: Duration,
    /// The rebuild went through the last stripe (else it stopped at `max_stripes`).
    pub finished: bool,
}

/// Rebuilds member `index` from where its rebuild stands. `call` sends a request
/// to the engine and waits for the reply; `progress(done, total)` is called after
/// each stripe.
pub fn rebuild(
    shared: &Shared,
    index: usize,
    call: &dyn Fn(Request) -> Result<(), EngineError>,
    opts: &RebuildOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RebuildReport, EngineError> {
    let st = shared
        .striped
        .clone()
        .ok_or_else(|| EngineError::Invalid("not a striped array".into()))?;
    // `index` is the array's member; `m` the striped device's (a mirrored cache
    // tier's members are the array's last).
    let m = shared.geo.striped_index(index).ok_or_else(|| {
        EngineError::Invalid(format!("member {index} has no redundancy to rebuild from"))
    })?;
    let stripes = st.shape().stripes;
    // The segment of a stripe (a mirrored cache's stripes are its segments).
    let seg = |s: u64| shared.geo.stripe_segment(s);
    let chunk_bytes = st.shape().chunk_blocks * 4096;
    let stripe_bytes = chunk_bytes * st.shape().data as u64;
    let zoned = shared.devices[shared.geo.members].zone_layout().is_some();
    let t0 = Instant::now();
    let mut report = RebuildReport {
        member: index,
        ..Default::default()
    };
    let Some(from) = st.rebuild_cursor(m) else {
        return Ok(report);
    };
    // The device this rebuild is for: a later replace of the slot ends it.
    let generation = st.slot_generation(m);
    let replaced = || {
        EngineError::Io(format!(
            "member {index} was replaced during its rebuild; the new rebuild takes over"
        ))
    };
    // Progress is recorded only once what it covers is durable on the new member.
    let record = |cursor: Option<u64>| -> Result<(), EngineError> {
        st.member(m)
            .sync()
            .map_err(|e| EngineError::Io(format!("rebuild of member {index}: {e}")))?;
        call(Request::RebuildProgress {
            index,
            cursor,
            generation,
        })
    };
    let mut last_record = Instant::now();
    for s in from..stripes {
        if st.slot_generation(m) != generation {
            return Err(replaced());
        }
        if opts
            .max_stripes
            .is_some_and(|m| report.stripes_visited >= m)
        {
            record(Some(s))?;
            report.elapsed = t0.elapsed();
            return Ok(report);
        }
        if st.is_failed(m) {
            return Err(EngineError::Io(format!(
                "member {index} failed during its rebuild (stripe {s})"
            )));
        }
        let rebuilt = if zoned {
            // Zoned members: the new member's zone of the stripe is written from its
            // start. Most of it is caught up while writes of the stripe go on (rows
            // below the write pointer never change; writes skip the new member
            // until the hand-over); then the stripe is held quiet at its write
            // plug for the last rows and handed over (cursor past it), so that its
            // next write lands on the new member at its write pointer too.
            let data = &shared.devices[shared.geo.members];
            let start = shared.geo.data_offset + s * stripe_bytes;
            let k = st.shape().data as u64;
            let rows_at = |wp: u64| (wp - start) / 4096 / k;
            let (mut done, mut seen, mut n) = (0u64, None, 0u64);
            while !shared.segment_free(seg(s)) || opts.all_stripes {
                let Some((wp, resets)) = data.zone_progress(start) else {
                    break;
                };
                if seen.is_some_and(|r| r != resets) {
                    done = 0;
                }
                seen = Some(resets);
                let rows = rows_at(wp);
                if rows <= done + HELD_ROWS {
                    break;
                }
                n += st
                    .rebuild_stripe_range(m, s, done, rows)
                    .map_err(|e| EngineError::Io(format!("rebuild of stripe {s}: {e}")))?;
                done = rows;
            }
            data.with_zone_held(start, &mut |held| {
                let free = shared.segment_free(seg(s)) && !opts.all_stripes;
                let (rows, from) = match held {
                    _ if free => (0, 0),
                    Some((wp, resets)) => {
                        let rows = rows_at(wp);
                        let same = seen.is_none_or(|r| r == resets) && rows >= done;
                        (rows, if same { done } else { 0 })
                    }
                    None => (st.shape().chunk_blocks, 0),
                };
                n += st.rebuild_stripe_range(m, s, from, rows)?;
                if !st.set_rebuild_cursor_if(m, generation, Some(s + 1)) {
                    return Err(lamina_device::DeviceError::Open {
                        device: st.member(m).describe(),
                        detail: "replaced during its rebuild".into(),
                    });
                }
                Ok(())
            })
            .map_err(|e| EngineError::Io(format!("rebuild of stripe {s}: {e}")))?;
            (n > 0).then_some(n)
        } else if opts.all_stripes || !shared.segment_free(seg(s)) {
            Some(
                st.rebuild_stripe(m, s)
                    .map_err(|e| EngineError::Io(format!("rebuild of stripe {s}: {e}")))?,
            )
        } else {
            None
        };
        if let Some(n) = rebuilt {
            report.bytes_written += n;
            report.stripes_rebuilt += 1;
            if let Some(rate) = opts.rate_bytes_per_s.filter(|&r| r > 0) {
                let due = Duration::from_secs_f64(report.bytes_written as f64 / rate as f64);
                if let Some(wait) = due.checked_sub(t0.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
        }
        report.stripes_visited += 1;
        report.whole_device_bytes += chunk_bytes;
        if !st.set_rebuild_cursor_if(m, generation, Some(s + 1)) {
            return Err(replaced());
        }
        progress(s + 1, stripes);
        if last_record.elapsed() >= opts.record_every {
            record(Some(s + 1))?;
            last_record = Instant::now();
        }
    }
    // Free stripes were skipped, but recovery from the durable checkpoint still
    // reads the segments released since it (the first header of each decides
    // where its walk of the free queue ends), and on the new member those are
    // blank. After a checkpoint started now, every segment recovery reads was
    // either rebuilt (it held data when the rebuild passed it) or taken from the
    // free queue after the rebuild passed it (all of it written with the new
    // member current); only then is the member complete, so that losing another
    // one loses nothing
    // (`tiers::a_crash_after_a_rebuild_and_the_loss_of_the_other_copy_loses_nothing`).
    call(Request::Checkpoint)?;
    record(None)?;
    report.elapsed = t0.elapsed();
    report.finished = true;
    Ok(report)
}
