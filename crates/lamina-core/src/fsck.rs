//! `lamina fsck`: an offline check of an array's metadata against itself, as
//! `e2fsck` checks a file system.
//!
//! Recovery (read-only, in memory) already loads the checkpoint (every payload block
//! verified) and walks the log; what it had to work around it reports as warnings,
//! and those are findings here. On top of that, with the array recovered:
//!
//! * every superblock copy of every device decodes and is of the newest generation;
//! * every mapped block lies in a segment that holds data, and the unit header
//!   before it names it (volume, or a volume of its snapshot family, and LBA); with `data`, its CRC-32C matches too
//!   (on layouts with parity a block that needs rebuilding from its row is a
//!   repairable finding);
//! * every segment's live count equals the blocks the map points into it, and no
//!   free segment holds one;
//! * every segment summary decodes, and each unit it lists starts with a header
//!   that decodes and lists the same blocks.

use crate::engine::{Engine, SegState};
use crate::map::{decode, Entry};
use crate::types::{SegmentId, BLOCK_SIZE};
use lamina_device::BlockDevice;
use lamina_format::summary::SummaryHeader;
use lamina_format::superblock::{Superblock, SUPERBLOCK_OFFSETS};
use lamina_format::unit::{kind, record_at, UnitHeader};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// One thing found wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Finding {
    pub what: String,
    /// `lamina fsck --repair` can mend it safely.
    pub repairable: bool,
}

/// What a check looked at and found.
#[derive(Clone, Debug, Default)]
pub struct FsckReport {
    pub superblock_copies: u64,
    pub volumes: u64,
    pub blocks_checked: u64,
    pub segments_checked: u64,
    pub summaries_checked: u64,
    pub findings: Vec<Finding>,
}

impl FsckReport {
    fn find(&mut self, repairable: bool, what: String) {
        self.findings.push(Finding { what, repairable });
    }
}

/// Checks both superblock copies of every device: each must decode and carry the
/// newest generation found (a copy a crash left behind, or a damaged one, is
/// rewritten by a read-write open: repairable).
pub fn check_superblocks(devices: &[Arc<dyn BlockDevice>], report: &mut FsckReport) {
    let mut copies = Vec::new();
    for d in devices {
        for (i, off) in SUPERBLOCK_OFFSETS.iter().enumerate() {
            let mut b = vec![0u8; BLOCK_SIZE];
            report.superblock_copies += 1;
            let sb = d
                .read_at(&mut b, *off)
                .map_err(|e| e.to_string())
                .and_then(|_| Superblock::decode(&b).map_err(|e| e.to_string()));
            copies.push((d.describe(), i, sb));
        }
    }
    let newest_sb = copies
        .iter()
        .filter_map(|(_, _, s)| s.as_ref().ok())
        .max_by_key(|s| s.generation)
        .cloned();
    let newest = newest_sb.as_ref().map(|s| s.generation);
    // A removed member's device (`array evacuate`) takes no superblocks any more.
    let removed = |sb: &Superblock| {
        newest_sb.as_ref().is_some_and(|n| {
            n.array_uuid == sb.array_uuid
                && n.devices.get(sb.device_index as usize).is_some_and(|d| {
                    d.state == crate::recovery::MEMBER_REMOVED
                        && sb.devices.get(sb.device_index as usize).map(|o| o.uuid) == Some(d.uuid)
                })
        })
    };
    for (name, i, sb) in copies {
        match sb {
            Ok(sb) if removed(&sb) => {}
            Err(e) => report.find(true, format!("{name}: superblock copy {i} is damaged: {e}")),
            Ok(sb) if Some(sb.generation) != newest => report.find(
                true,
                format!(
                    "{name}: superblock copy {i} is of generation {}, the newest is {}",
                    sb.generation,
                    newest.unwrap_or(0)
                ),
            ),
            Ok(_) => {}
        }
    }
}

/// Checks a recovered engine's map, segments and summaries (see the module text);
/// `data` reads and verifies every live block as well.
pub fn check(engine: &Engine, data: bool, report: &mut FsckReport) {
    let shared = engine.shared();
    let geo = engine.geometry();
    let mut live = vec![0u32; engine.segments.segs.len()];
    for v in engine.volumes.iter().flatten() {
        let vs = &v.shared;
        report.volumes += 1;
        let mut block = vec![0u8; BLOCK_SIZE];
        vs.map.for_each_mapped(|lba, e| {
            report.blocks_checked += 1;
            match decode(e) {
                Entry::Bad => report.find(
                    false,
                    format!("volume {:?} block {lba}: damaged, with no good copy", vs.name()),
                ),
                Entry::Buffer(_) | Entry::Unmapped => report.find(
                    false,
                    format!("volume {:?} block {lba}: map entry {e:#x} offline", vs.name()),
                ),
                Entry::Device(pba) => {
                    let (seg, _) = geo.split(pba);
                    let s = seg.0 as usize;
                    if s >= live.len() {
                        return report.find(
                            false,
                            format!("volume {:?} block {lba}: beyond the array", vs.name()),
                        );
                    }
                    // A block that snapshots or clones share is one block: counted
                    // for the first volume (by id) of its family that maps it.
                    let counted = engine.lineage.family(vs.id).is_some_and(|f| {
                        engine
                            .lineage
                            .members(f)
                            .iter()
                            .any(|&m| m.0 < vs.id.0 && engine.maps(m, lba, e))
                    });
                    if !counted {
                        live[s] += 1;
                    }
                    let st = engine.segments.segs[s].state;
                    if !matches!(st, SegState::Closed | SegState::Open | SegState::Closing) {
                        report.find(
                            false,
                            format!(
                                "volume {:?} block {lba}: in segment {s}, which holds no data ({st:?})",
                                vs.name()
                            ),
                        );
                    }
                    if let Err(e) = shared.check_owner(vs, lba, pba) {
                        report.find(false, format!("volume {:?} block {lba}: {e}", vs.name()));
                    } else if data {
                        let before = shared.read_stats.rebuilt_from_parity.load(Ordering::SeqCst);
                        match shared.read_blocks(vs, lba, &mut block) {
                            Err(e) => report.find(
                                false,
                                format!("volume {:?} block {lba}: {e}", vs.name()),
                            ),
                            Ok(())
                                if shared.read_stats.rebuilt_from_parity.load(Ordering::SeqCst)
                                    > before =>
                            {
                                report.find(
                                    true,
                                    format!(
                                        "volume {:?} block {lba}: damaged on a member, rebuilt from parity",
                                        vs.name()
                                    ),
                                )
                            }
                            Ok(()) => {}
                        }
                    }
                }
            }
        });
    }
    for (s, seg) in engine.segments.segs.iter().enumerate() {
        report.segments_checked += 1;
        if seg.state == SegState::Meta {
            continue;
        }
        if seg.valid != live[s] {
            report.find(
                false,
                format!(
                    "segment {s}: counts {} live blocks, the map points {} into it",
                    seg.valid, live[s]
                ),
            );
        }
        if seg.state == SegState::Closed && seg.has_summary {
            check_summary(engine, SegmentId(s as u32), report);
        }
    }
}

/// The summary of a closed segment decodes and agrees with its unit headers.
fn check_summary(engine: &Engine, seg: SegmentId, report: &mut FsckReport) {
    let shared = engine.shared();
    let geo = engine.geometry();
    let incarnation = engine.segments.segs[seg.0 as usize].incarnation;
    report.summaries_checked += 1;
    let mut buf = vec![0u8; geo.summary_blocks as usize * BLOCK_SIZE];
    let (dev, off) = geo.locate(seg, geo.data_end);
    let summary = shared.read_decoded(dev, off, &mut buf, |b| {
        SummaryHeader::decode(b).ok().filter(|h| {
            h.segment == seg.0 && h.incarnation == incarnation.0 && h.array_id == geo.array_id
        })
    });
    let Ok(Some(h)) = summary else {
        return report.find(
            false,
            format!("{seg}: summary unreadable (GC walks its unit headers instead)"),
        );
    };
    let mut hdr = vec![0u8; geo.header_blocks as usize * BLOCK_SIZE];
    let mut i = 0usize;
    while i < h.record_count as usize {
        let u = record_at(&buf, i);
        i += 1;
        if u.kind != kind::UNIT {
            continue;
        }
        let (uoff, d) = (u.a as u32, u.b as usize);
        let (dev, off) = geo.locate(seg, uoff);
        let header = shared.read_decoded(dev, off, &mut hdr, |b| {
            UnitHeader::decode(b).ok().filter(|x| {
                x.segment == seg.0 && x.offset == uoff && x.incarnation == incarnation.0
            })
        });
        match header {
            Ok(Some(x)) if x.data_blocks as usize == d => {
                let differs = (0..d.min(h.record_count as usize - i))
                    .any(|k| record_at(&buf, i + k) != record_at(&hdr, k));
                if differs {
                    report.find(
                        false,
                        format!("{seg}: summary and unit header at {uoff} list different blocks"),
                    );
                }
            }
            _ => report.find(
                false,
                format!("{seg}: summary lists a unit at {uoff} whose header does not decode"),
            ),
        }
        i += d;
    }
}
