//! The counters `lamina status` reports. Key names are a stable interface for scripts.

use crate::engine::{Engine, SegState};
use crate::types::BLOCK_SIZE_U64;
use lamina_format::unit::StreamKind;

/// One heat class of a volume.
#[derive(Clone, Debug, Default)]
pub struct ClassStatus {
    pub class: u8,
    /// "user" (fresh writes) or "gc" (relocated blocks).
    pub kind: String,
    pub segments: u64,
    pub live_bytes: u64,
    /// Bytes placed in this class: user writes or GC relocations.
    pub bytes_written: u64,
    /// Bytes GC moved out of this class's segments.
    pub bytes_relocated_out: u64,
    /// Segments of this class collected by GC.
    pub victims: u64,
    /// For user classes: (bytes written here + bytes GC moved out of here and
    /// everything that followed) / bytes written here is not separable per class, so
    /// this is relocated-out / written: the GC cost this class caused per byte.
    pub gc_cost: Option<f64>,
}

/// One member device of the array.
#[derive(Clone, Debug, Default)]
pub struct MemberStatus {
    pub index: usize,
    pub name: String,
    /// "ok", "failed" or "rebuilding".
    pub state: String,
    pub bytes_written: u64,
    /// Bytes read from the member (striped layouts; since the array was opened).
    pub bytes_read: u64,
    /// Reads of this member that failed (and were rebuilt from parity).
    pub read_errors: u64,
    /// Blocks of this member that failed their checksum (and were rebuilt).
    pub checksum_errors: u64,
    /// Writes, syncs and zone operations of this member that failed (striped
    /// layouts: the first fails the member; JBOD: a failed write stops the array).
    pub write_errors: u64,
    /// While rebuilding: the fraction of stripes done.
    pub rebuild_progress: Option<f64>,
    /// While rebuilding: a rebuild is running (in the server: its thread holds
    /// the member). False with a `rebuild_progress` means it stopped (the server
    /// log says why; it resumes when the server starts again).
    pub rebuild_running: bool,
    /// "capacity", or "cache" for a member of the cache tier.
    pub tier: String,
}

#[derive(Clone, Debug, Default)]
pub struct VolumeStatus {
    pub id: u16,
    pub name: String,
    pub size_bytes: u64,
    pub live_bytes: u64,
    pub segments: u64,
    pub user_bytes_written: u64,
    pub media_bytes_written: u64,
    pub gc_bytes_relocated: u64,
    /// media / user; `None` before the first write.
    pub write_amplification: Option<f64>,
    pub classifier: String,
    pub gc_policy: String,
    pub classes: Vec<ClassStatus>,
    /// User and GC classes kept open (fewer than the classifier's when the spare
    /// is short or its classes predict nothing; see `classcap`).
    pub classes_open: (u8, u8),
    /// A snapshot (read-only).
    pub snapshot: bool,
    /// The volume this one was made from, if it is a snapshot or clone.
    pub origin: Option<String>,
    /// Of `live_bytes`, what no other volume maps: what deleting this volume
    /// would free (as `zfs list -o used`; `live_bytes` is `refer`). For volumes
    /// of a snapshot family, only after [`count_exclusive`].
    pub exclusive_bytes: u64,
    /// The snapshot family, if the volume shares blocks.
    pub family: Option<u16>,
    /// The version the volume was created at: with `id`, names it for good (ids
    /// are given again), so that [`count_exclusive`], which runs after the report
    /// was taken, does not count a later volume that took a deleted one's id.
    pub created_version: u64,
}

/// Fills in `exclusive_bytes` of the volumes that share blocks, by walking their
/// maps (a few ns per mapped block): any thread, without the engine, so that a
/// large snapshot does not hold up writes while `volume list` counts. Blocks
/// written meanwhile may or may not be counted.
pub fn count_exclusive(shared: &crate::shared::Shared, report: &mut StatusReport) {
    let bs = crate::types::BLOCK_SIZE_U64;
    let members = |f: u16| -> Vec<std::sync::Arc<crate::shared::VolumeShared>> {
        report
            .volumes
            .iter()
            .filter(|v| v.family == Some(f))
            .filter_map(|v| {
                shared
                    .volume_by_id(crate::types::VolumeId(v.id))
                    .filter(|s| s.created_version().0 == v.created_version)
            })
            .collect()
    };
    let counts: Vec<Option<u64>> = report
        .volumes
        .iter()
        .map(|v| {
            let f = v.family?;
            let all = members(f);
            let me = all.iter().find(|m| m.id.0 == v.id)?;
            let mut n = 0u64;
            me.map.for_each_mapped(|lba, e| {
                if !all.iter().any(|o| o.id != me.id && o.map.load(lba) == e) {
                    n += 1;
                }
            });
            Some(n * bs)
        })
        .collect();
    for (v, n) in report.volumes.iter_mut().zip(counts) {
        if let Some(n) = n {
            v.exclusive_bytes = n;
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct StatusReport {
    pub array_name: String,
    pub array_uuid: String,
    pub layout: String,
    pub devices: Vec<String>,
    pub members: Vec<MemberStatus>,
    /// Member failures the layout can still absorb (negative: data is lost).
    pub redundancy_left: i64,
    /// (most - least) bytes written to a member, over the mean: how evenly the
    /// members wear.
    pub wear_spread: f64,
    /// Dead blocks written to pad flushed units to whole stripe rows.
    pub pad_bytes_written: u64,
    /// Blocks rebuilt from parity for readers.
    pub blocks_rebuilt_from_parity: u64,
    /// Segments moved by GC because a member failed a read in them.
    pub segments_repaired: u64,
    /// Zoned devices: zones held open by the engine (open or closing segments),
    /// and the most the devices allow (0: no limit). `None` for other devices.
    pub zones_open: Option<u64>,
    pub zone_open_limit: u64,
    pub segment_size_bytes: u64,
    pub write_unit_bytes: u64,
    pub overprovision: f64,
    /// Bytes of segment space on all devices.
    pub capacity_bytes: u64,
    /// Live data the array accepts before writes fail with ENOSPC.
    pub usable_bytes: u64,
    pub live_bytes: u64,
    /// What the volumes' maps take in the checkpoints beyond the room the usable
    /// capacity leaves them (snapshots' and clones', or pages of writes
    /// scattered over a thin volume): in use as much as `live_bytes` (the
    /// fullness level and ENOSPC count both).
    pub maps_bytes: u64,
    /// The volumes' sizes together (above `usable_bytes`: thin, overcommitted).
    pub promised_bytes: u64,
    /// Volume ids this array can still give out (65535 at most): every volume,
    /// snapshot, clone and rollback holds one until it is deleted and nothing
    /// refers to it any more.
    pub volume_ids_left: u64,
    /// "ok", "warning", "critical" or "full" (see `[engine] space_warn`).
    pub space_state: String,
    pub space_warn: f64,
    pub space_critical: f64,
    /// Writes refused with ENOSPC since the array was opened.
    pub writes_refused_nospace: u64,
    /// Segments of the capacity tier (of the array, without a cache tier), and
    /// how many of them are free and in use.
    pub segment_count: u64,
    pub free_segments: u64,
    pub used_segments: u64,
    /// The cache tier, if the array has one.
    pub cache: Option<CacheStatus>,
    pub user_bytes_written: u64,
    pub media_bytes_written: u64,
    pub gc_bytes_relocated: u64,
    pub metadata_bytes_written: u64,
    pub write_amplification: Option<f64>,
    pub gc_policy: String,
    pub gc_victims: u64,
    /// Times user writes waited at the user floor for a segment to be freed
    /// (GC, or the release of what it emptied, fell behind the writes).
    pub gc_floor_waits: u64,
    /// Times user writes waited for GC to earn them room (pacing, between the start
    /// watermark and the floor).
    pub gc_pace_waits: u64,
    /// Segments discarded (TRIM, holes in files) since the array was opened.
    pub segments_discarded: u64,
    /// Of those discards, the ones that kept the segment's first unit header
    /// (segments opened after the durable checkpoint: see
    /// docs/design.md, "Segment lifecycle").
    pub segments_tail_discarded: u64,
    pub flushes: u64,
    pub syncs: u64,
    pub checkpoints: u64,
    pub checkpoint_generation: u64,
    pub corrupt_blocks: u64,
    pub read_checksum_errors: u64,
    /// Device reads carried out by the client's connection (io_uring), without a
    /// read thread.
    pub reads_by_connection: u64,
    /// Unit headers read from a device because their checksums were not in the
    /// header cache (`[engine] header_cache`).
    pub header_cache_misses: u64,
    pub blocks_read_from_devices: u64,
    pub durable_version: u64,
    pub failed: Option<String>,
    pub volumes: Vec<VolumeStatus>,
}

/// The cache tier of an array (issue 14): every user write lands there first, and
/// compaction moves what is still live to the capacity tier.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheStatus {
    pub segment_count: u64,
    pub free_segments: u64,
    /// Live blocks in cache segments: data not yet on the capacity tier.
    pub dirty_bytes: u64,
    /// Cache segments compacted, and the live bytes compaction moved out of them,
    /// since the array was opened.
    pub compactions: u64,
    pub compacted_bytes: u64,
    /// Compaction starts below this many free cache segments and stops at the
    /// second figure.
    pub compaction_start: u64,
    pub compaction_stop: u64,
    /// Devices of the cache tier (2 or 3 mirror each other), and how many of them
    /// are in service (not failed, missing or still being rebuilt).
    pub copies: u64,
    pub copies_ok: u64,
    /// Bytes read (since the array was opened) from the cache tier, from the
    /// capacity tier, and from the DRAM write buffer, which holds the newest
    /// writes before they reach the cache.
    pub read_bytes_cache: u64,
    pub read_bytes_capacity: u64,
    pub read_bytes_buffer: u64,
    /// Of the bytes read that were mapped, the share served without the capacity
    /// tier (the cache tier or the write buffer); `None` before any read.
    pub hit_ratio: Option<f64>,
    /// Bytes written to the capacity tier's members (compaction, GC, metadata)
    /// per user byte written, since the array was created.
    pub capacity_write_amplification: Option<f64>,
}

fn ratio(media: u64, user: u64) -> Option<f64> {
    (user > 0).then(|| media as f64 / user as f64)
}

impl Engine {
    pub fn status(&self) -> StatusReport {
        let bs = BLOCK_SIZE_U64;
        let c = &self.counters;
        let mut volumes = Vec::new();
        for v in self
            .volumes
            .iter()
            .flatten()
            .filter(|v| v.deleting.is_none())
        {
            let mut classes: Vec<ClassStatus> = v
                .classes
                .iter()
                .enumerate()
                .map(|(c, k)| ClassStatus {
                    class: c as u8,
                    kind: match v
                        .streams
                        .iter()
                        .map(|&st| &self.log.streams[st])
                        .find(|st| st.class as usize == c)
                    {
                        Some(st) if st.small => "small",
                        Some(st) if st.read_hot => "gc-read-hot",
                        Some(st) if st.kind == StreamKind::User => "user",
                        Some(_) => "gc",
                        None => "unused",
                    }
                    .into(),
                    bytes_written: k.blocks * bs,
                    bytes_relocated_out: k.relocated_out * bs,
                    victims: k.victims,
                    gc_cost: (k.blocks > 0).then(|| k.relocated_out as f64 / k.blocks as f64),
                    ..Default::default()
                })
                .collect();
            let mut segments = 0u64;
            for s in self.segments.segs.iter().filter(|s| {
                s.state != SegState::Free && s.state != SegState::Meta && s.volume == v.shared.id.0
            }) {
                segments += 1;
                if let Some(c) = classes.get_mut(s.class as usize) {
                    c.segments += 1;
                    c.live_bytes += s.valid as u64 * bs;
                }
            }
            // The reserved class numbers of extra streams this configuration does
            // not use are left out unless old segments still carry them.
            classes.retain(|c| c.kind != "unused" || c.segments > 0 || c.bytes_written > 0);
            let id = v.shared.id;
            let family = self.lineage.family(id);
            let origin = self
                .lineage
                .origin(id)
                .and_then(|o| self.volumes.get(o.0 as usize)?.as_ref())
                .map(|o| o.shared.name().to_string());
            volumes.push(VolumeStatus {
                id: v.shared.id.0,
                name: v.shared.name().to_string(),
                size_bytes: v.shared.size_bytes(),
                live_bytes: v.live_blocks * bs,
                segments,
                user_bytes_written: v.user_blocks * bs,
                media_bytes_written: v.media_blocks * bs,
                gc_bytes_relocated: v.gc_blocks * bs,
                write_amplification: ratio(v.media_blocks, v.user_blocks),
                classifier: v.classifier.name().into(),
                gc_policy: v.policy.describe(),
                classes,
                classes_open: (v.caps.user, v.caps.gc),
                snapshot: self.lineage.read_only(id),
                origin,
                // Members of a family: counted by `count_exclusive`, off the
                // engine's thread.
                exclusive_bytes: if family.is_none() {
                    v.live_blocks * bs
                } else {
                    0
                },
                family,
                created_version: v.shared.created_version().0,
            });
        }
        let rs = &self.shared.read_stats;
        use std::sync::atomic::Ordering::Relaxed;
        // Members of the striped device (every member of a striped layout, the
        // cache members of a mirrored cache tier) report their own health.
        let striped_states = self
            .shared
            .striped
            .as_ref()
            .map(|st| (st.member_states(), st.shape().stripes));
        let members: Vec<MemberStatus> = (0..self.geo.members)
            .map(|i| {
                let tier = if self.geo.is_cache_member(i) {
                    "cache"
                } else {
                    "capacity"
                };
                match (self.geo.striped_index(i), &striped_states) {
                    (Some(k), Some((states, stripes))) => {
                        let m = &states[k];
                        MemberStatus {
                            index: i,
                            name: m.name.clone(),
                            state: if m.failed {
                                "failed"
                            } else if m.rebuild_cursor.is_some() {
                                "rebuilding"
                            } else {
                                "ok"
                            }
                            .into(),
                            bytes_written: m.bytes_written,
                            bytes_read: m.bytes_read,
                            read_errors: m.read_errors,
                            checksum_errors: m.checksum_errors,
                            write_errors: m.write_errors,
                            rebuild_progress: m
                                .rebuild_cursor
                                .map(|c| c as f64 / (*stripes).max(1) as f64),
                            rebuild_running: m.rebuild_running,
                            tier: tier.into(),
                        }
                    }
                    _ => MemberStatus {
                        index: i,
                        name: self.shared.devices[i].describe(),
                        state: if self.geo.devices[i].removed {
                            "removed"
                        } else {
                            "ok"
                        }
                        .into(),
                        bytes_written: self.device_blocks.get(i).copied().unwrap_or(0) * bs,
                        bytes_read: 0,
                        read_errors: 0,
                        checksum_errors: 0,
                        write_errors: 0,
                        rebuild_progress: None,
                        rebuild_running: false,
                        tier: tier.into(),
                    },
                }
            })
            .collect();
        // Wear: bytes written per segment of capacity (members of a stripe all have
        // the same number of segments), among the capacity tier's members (the
        // cache takes every write by design).
        let written: Vec<f64> = members
            .iter()
            .filter(|m| m.state != "removed" && !self.geo.is_cache_member(m.index))
            .map(|m| {
                let segs = match self.geo.striped_index(m.index) {
                    Some(_) => 1.0,
                    None => self.geo.devices[m.index].segment_count.max(1) as f64,
                };
                m.bytes_written as f64 / segs
            })
            .collect();
        let mean = written.iter().sum::<f64>() / written.len().max(1) as f64;
        let spread = if mean > 0.0 {
            (written.iter().cloned().fold(f64::MIN, f64::max)
                - written.iter().cloned().fold(f64::MAX, f64::min))
                / mean
        } else {
            0.0
        };
        StatusReport {
            array_name: self.sb.array_name.clone(),
            array_uuid: lamina_format::superblock::uuid_hex(&self.sb.array_uuid),
            layout: self.sb.layout.name().into(),
            devices: self.shared.devices[..self.geo.members]
                .iter()
                .map(|d| d.describe())
                .collect(),
            redundancy_left: self
                .shared
                .striped
                .as_ref()
                // A mirrored cache's copies protect the cache alone: the array as
                // a whole (a JBOD capacity tier) has none, unless the mirror has
                // lost every copy.
                .map_or(0, |st| {
                    let r = st.redundancy_left() as i64;
                    if self.geo.mirrored() {
                        r.min(0)
                    } else {
                        r
                    }
                }),
            members,
            wear_spread: spread,
            pad_bytes_written: c.pad_blocks * bs,
            segments_repaired: self.gc.repaired,
            zones_open: self.zones.zoned.then_some(self.zones.active as u64),
            zone_open_limit: self.zones.limit as u64,
            blocks_rebuilt_from_parity: self
                .shared
                .striped
                .as_ref()
                .map_or(0, |st| st.rebuilt_blocks()),
            segment_size_bytes: self.geo.segment_blocks as u64 * bs,
            write_unit_bytes: self.geo.write_unit_blocks as u64 * bs,
            overprovision: self.sb.overprovision_ppm as f64 / 1e6,
            capacity_bytes: self.geo.usable_segments() as u64 * self.geo.segment_blocks as u64 * bs,
            usable_bytes: self.space.usable * bs,
            live_bytes: self.space.live * bs,
            maps_bytes: self.space.maps_extra() * bs,
            promised_bytes: self.promised_bytes(),
            volume_ids_left: self.volume_ids_left(),
            space_state: self.space.fullness().name().into(),
            space_warn: self.cfg.space_warn,
            space_critical: self.cfg.space_critical,
            writes_refused_nospace: self.space.refused,
            segment_count: self.geo.usable_segments() as u64,
            free_segments: self.segments.free.len() as u64,
            cache: self.geo.tiered().then(|| {
                let (start, stop) = self.cache_watermarks();
                let read = |c: &std::sync::atomic::AtomicU64| c.load(Relaxed);
                let cache_read = read(&rs.cache_blocks_read);
                let capacity_read = read(&rs.blocks_read).saturating_sub(cache_read);
                let buffer_read = read(&rs.buffer_blocks_read);
                CacheStatus {
                    segment_count: self.geo.cache_segments() as u64,
                    free_segments: self.segments.cache_free.len() as u64,
                    dirty_bytes: self.cache_live_blocks() * bs,
                    compactions: self.gc.compactions,
                    compacted_bytes: self.gc.compacted_blocks * bs,
                    compaction_start: start as u64,
                    compaction_stop: stop as u64,
                    read_bytes_cache: cache_read * bs,
                    read_bytes_capacity: capacity_read * bs,
                    read_bytes_buffer: buffer_read * bs,
                    hit_ratio: ratio(
                        cache_read + buffer_read,
                        cache_read + buffer_read + capacity_read,
                    ),
                    capacity_write_amplification: ratio(
                        (0..self.geo.cache_member0)
                            .map(|i| self.device_blocks.get(i).copied().unwrap_or(0))
                            .sum(),
                        c.user_blocks,
                    ),
                    copies: self.geo.cache_copies as u64,
                    copies_ok: match (&self.shared.striped, self.geo.mirrored()) {
                        (Some(st), true) => (self.geo.cache_copies - st.unavailable_count()) as u64,
                        _ => self.geo.cache_copies as u64,
                    },
                }
            }),
            used_segments: (self.geo.usable_segments() as u64)
                .saturating_sub(self.segments.free.len() as u64),
            user_bytes_written: c.user_blocks * bs,
            media_bytes_written: c.media_blocks * bs,
            gc_bytes_relocated: c.gc_blocks * bs,
            metadata_bytes_written: c.meta_blocks * bs,
            write_amplification: ratio(c.media_blocks, c.user_blocks),
            gc_policy: self.cfg.gc_policy.clone(),
            gc_victims: self.gc.victims,
            gc_floor_waits: self.gc.floor_waits,
            gc_pace_waits: self.gc.pace_waits,
            segments_discarded: self.segments.discarded,
            segments_tail_discarded: self.segments.tail_discards,
            flushes: c.flushes,
            syncs: c.syncs,
            checkpoints: c.checkpoints,
            checkpoint_generation: self.ckpt.last_gen,
            corrupt_blocks: c.corrupt_blocks,
            read_checksum_errors: rs.checksum_errors.load(Relaxed),
            reads_by_connection: rs.device_reads_async.load(Relaxed),
            header_cache_misses: rs.crc_cache_misses.load(Relaxed),
            blocks_read_from_devices: rs.blocks_read.load(Relaxed),
            durable_version: self.durable_version.0,
            failed: self.failed.clone(),
            volumes,
        }
    }
}
