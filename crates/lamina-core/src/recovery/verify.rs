//! Phase 4: verification of what no durability mark vouches for, and the write
//! hole. Units written after the last flush a later unit recorded as complete may
//! be torn: their data blocks are checked against their records, and what fails is
//! rebuilt from parity where the layout has it, else left out of replay. Rows
//! written after the last durable point then get parity that matches what their
//! members hold (docs/design.md, "The write hole").

use super::walk::{FoundUnit, Walk};
use super::{read_blocks, RecoveryReport};
use crate::error::EngineError;
use crate::shared::Shared;
use crate::types::{SegmentId, Version, BLOCK_SIZE};
use lamina_format::unit::kind;
use std::collections::{HashMap, HashSet};

/// The durability marks the walk found: per run (the version a run of the engine
/// started at), the highest version a unit of that run recorded as durable. A mark
/// covers versions of its own run only (`run_start ..= durable_version`): a later
/// run never synced what an earlier, crashed run left behind.
pub(super) struct Marks(HashMap<Version, Version>);

impl Marks {
    pub fn new(walk: &Walk) -> Self {
        let mut marks: HashMap<Version, Version> = HashMap::new();
        for u in walk.found.iter().flat_map(|f| f.units.iter()) {
            let m = marks.entry(u.run_start).or_insert(Version::ZERO);
            *m = (*m).max(u.durable_version);
        }
        Marks(marks)
    }

    /// Whether a mark of `u`'s own run says `u` was synced whole.
    pub fn vouch(&self, u: &FoundUnit) -> bool {
        self.0.get(&u.run_start).is_some_and(|&d| u.version <= d)
    }
}

/// What verification found.
#[derive(Default)]
pub(super) struct Verified {
    /// (segment, unit offset, record index) of data blocks that failed their
    /// checksum and could not be rebuilt: torn writes, left out of replay.
    pub torn: HashSet<(u32, u32, usize)>,
    /// (device offset, content) of headers and blocks rebuilt from parity, to be
    /// written back to their member before the parity resync.
    pub put_back: Vec<(u64, Vec<u8>)>,
}

/// Checks the data of every unit [`Marks`] does not vouch for. A read error is not
/// a tear: the block is read once more, then recovery refuses rather than fall back
/// to an older copy because a device failed to answer.
pub(super) fn unvouched_units(
    shared: &Shared,
    walk: &Walk,
    marks: &Marks,
    report: &mut RecoveryReport,
) -> Result<Verified, EngineError> {
    let geo = &shared.geo;
    // What recovery rebuilt from parity in units no durability mark vouches for
    // (headers here, data blocks below) goes back to its member before the parity
    // resync, so that the rows match their parity again; otherwise the resync would
    // make the parity match the damage and lose the only good copy. This covers a
    // flushed unit that no later unit vouches for yet, whose block a member dropped
    // or flipped, and a torn write whose header never reached its member while the
    // row's parity did (seed 21 of the SAID5 crash simulation).
    let mut put_back: Vec<(u64, Vec<u8>)> = Vec::new();
    for f in walk.kept() {
        for u in f.units.iter().filter(|u| !marks.vouch(u)) {
            if let Some((_, h)) = &u.rebuilt {
                put_back.push((geo.locate(SegmentId(f.seg), u.offset).1, h.clone()));
            }
        }
    }
    let mut torn: HashSet<(u32, u32, usize)> = HashSet::new();
    for f in walk.kept() {
        for u in f
            .units
            .iter()
            .filter(|u| !marks.vouch(u) && u.data_blocks > 0)
        {
            let first = u.offset + u.header_blocks;
            let whole = read_blocks(shared, report, f.seg, first, u.data_blocks).ok();
            for i in 0..u.data_blocks as usize {
                let r = &u.records[i];
                if r.kind != kind::DATA {
                    continue;
                }
                let block = match &whole {
                    Some(d) => d[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE].to_vec(),
                    // A read error is not a tear: never fall back to an older copy
                    // because a device failed to answer. Retry the block, then refuse.
                    None => {
                        let at = first + i as u32;
                        read_blocks(shared, report, f.seg, at, 1)
                            .or_else(|_| read_blocks(shared, report, f.seg, at, 1))
                            .map_err(|e| {
                                EngineError::Io(format!(
                                    "recovery cannot read segment {} block {at} to verify it: {e}",
                                    f.seg
                                ))
                            })?
                    }
                };
                if lamina_format::crc32c(&block) != r.b {
                    let at = first + i as u32;
                    if let Some(b) = shared.rebuild_block(SegmentId(f.seg), at, r.b) {
                        put_back.push((geo.locate(SegmentId(f.seg), at).1, b));
                        report.blocks_rebuilt += 1;
                        continue;
                    }
                    torn.insert((f.seg, u.offset, i));
                    report.torn_blocks_ignored += 1;
                }
            }
        }
    }
    Ok(Verified { torn, put_back })
}

/// The write hole, on a writable open of a layout with parity: rows written after
/// the last durable point may hold new data on some members and old content on
/// others, so their parity is made to match what the members hold before anything
/// is trusted to it. Units vouched for were synced whole, and rows are never
/// rewritten in place, so only the units checked by [`unvouched_units`], and
/// summaries (written after their segment's last unit, with no mark of their own),
/// need it. Rebuilt blocks go back first. Zoned rows are never rewritten: there the
/// resync rewrites no parity either, and the rows go to the repair list, whose
/// relocation reads through parity. Read-only opens (status, fsck, inspection) do
/// not call this: the next read-write open resyncs.
pub(super) fn close_write_hole(
    shared: &Shared,
    walk: &Walk,
    marks: &Marks,
    put_back: &[(u64, Vec<u8>)],
    report: &mut RecoveryReport,
) -> Result<(), EngineError> {
    let geo = &shared.geo;
    if let Some(st) = shared
        .striped
        .as_ref()
        .filter(|st| st.shape().parity > 0 && !st.is_zoned())
    {
        for (off, data) in put_back {
            st.write_back(*off, data)
                .map_err(|e| EngineError::Io(format!("writing back a rebuilt block: {e}")))?;
        }
    }
    if let Some(st) = shared.striped.as_ref().filter(|st| st.shape().parity > 0) {
        let mut total = lamina_device::striped::ResyncStats::default();
        for f in walk.kept() {
            // (first block, blocks) of each range to resync
            let mut ranges: Vec<(u32, u32)> = Vec::new();
            if let Some(u) = f.units.iter().find(|u| !marks.vouch(u)) {
                ranges.push((u.offset, f.end - u.offset));
            }
            if f.has_summary {
                ranges.push((geo.data_end, geo.summary_blocks));
            }
            for (from, len) in ranges {
                let (dev, off) = geo.locate(SegmentId(f.seg), from);
                // Only the striped device's segments have rows (with a mirrored
                // cache tier, the capacity tier's are plain JBOD segments).
                if shared.striped_at(dev).is_none() {
                    continue;
                }
                let r = st.resync(off, len as usize * BLOCK_SIZE).map_err(|e| {
                    EngineError::Io(format!("parity resync of segment {}: {e}", f.seg))
                })?;
                total.add(&r);
            }
        }
        report.resync_rows = total.rows;
        report.resync_mismatched = total.rows_mismatched;
        report.resync_unprotected = total.unprotected;
        if total.parity_rewritten > 0 {
            shared.devices[geo.members]
                .sync()
                .map_err(|e| EngineError::Io(format!("sync after parity resync: {e}")))?;
        }
        if total.unprotected > 0 {
            report.warnings.push(format!(
                "{} rows written before the crash could not get matching parity (a member \
                 unavailable, or zoned members); their live blocks are moved",
                total.unprotected
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{
        call, devices, engine_with_volume, found, unit, up_to_walk, walk_of, write,
    };
    use super::*;
    use crate::engine::Request;
    use lamina_device::BlockDevice;

    /// A mark vouches for the versions of its own run only: a later run's flush
    /// says nothing of what an earlier, crashed run left behind.
    #[test]
    fn marks_vouch_for_their_own_run_only() {
        let walk = walk_of(
            vec![
                found(
                    1,
                    5,
                    1,
                    vec![unit(0, 12, 10, 0, vec![]), unit(8, 13, 10, 12, vec![])],
                ),
                found(
                    2,
                    30,
                    1,
                    vec![unit(0, 31, 30, 0, vec![]), unit(8, 33, 30, 32, vec![])],
                ),
            ],
            &[],
        );
        let m = Marks::new(&walk);
        let v = |f: usize, u: usize| m.vouch(&walk.found[f].units[u]);
        assert!(v(0, 0), "run 10 recorded version 12 durable");
        assert!(!v(0, 1), "nothing recorded version 13 durable");
        assert!(v(1, 0));
        assert!(!v(1, 1), "run 30's mark 32 is below 33");
        let stranger = unit(0, 20, 15, 0, vec![]);
        assert!(!m.vouch(&stranger), "no unit of run 15 recorded anything");
    }

    /// Only units no mark vouches for are read back: a damaged block of such a unit
    /// is torn, a damaged block of a vouched unit is not looked at here (reads and
    /// scrub find it by its checksum).
    #[test]
    fn unvouched_units_are_checked_and_their_damage_is_torn() {
        let (dev, devs) = devices();
        let (mut e, v) = engine_with_volume(&devs);
        call(&mut e, Request::Checkpoint);
        write(&mut e, v, 0, 7, 1);
        call(&mut e, Request::Flush);
        write(&mut e, v, 7, 7, 2);
        call(&mut e, Request::Flush);
        drop(e);

        let (shared, _, walk) = up_to_walk(&devs);
        let marks = Marks::new(&walk);
        let user: Vec<(u32, &FoundUnit)> = walk
            .found
            .iter()
            .filter(|f| f.kind == lamina_format::unit::StreamKind::User)
            .flat_map(|f| f.units.iter().map(move |u| (f.seg, u)))
            .collect();
        let vouched = user
            .iter()
            .find(|(_, u)| marks.vouch(u))
            .expect("a vouched unit");
        let open = user
            .iter()
            .find(|(_, u)| !marks.vouch(u))
            .expect("an unvouched unit");
        for (seg, u) in [vouched, open] {
            let (_, off) = shared
                .geo
                .locate(SegmentId(*seg), u.offset + u.header_blocks + 2);
            dev.write_at(&[0xee; BLOCK_SIZE], off).unwrap();
        }
        let mut report = RecoveryReport::default();
        let got = unvouched_units(&shared, &walk, &marks, &mut report).unwrap();
        let want: HashSet<_> = [(open.0, open.1.offset, 2)].into_iter().collect();
        assert_eq!(got.torn, want);
        assert_eq!(report.torn_blocks_ignored, 1);
        assert!(got.put_back.is_empty(), "nothing to rebuild without parity");
    }
}
