//! Snapshots and clones: volumes that start as a copy of another's map and share
//! its blocks (docs/design.md, "Snapshots and clones"). Which volumes share is in
//! `lineage.rs`; this module has what the engine asks of it: who else maps a
//! block, and making a snapshot or clone.

use crate::engine::*;
use crate::error::EngineError;
use crate::map::{decode, Entry};
use crate::shared::VolumeShared;
use crate::types::{Lba, Version, VolumeId, BLOCK_SIZE_U64};
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Why a rollback was refused when it may be tried again at once.
pub const ROLLBACK_BUSY: &str = "a checkpoint is being written: try the rollback again";

/// How long a rollback waits for GC to free the segments its checkpoint needs
/// (engine time) before it is refused: writes elsewhere may take them as fast.
const ROLLBACK_WAIT_MS: u64 = 60_000;

/// What every refusal of a rollback for space says (a test looks for it).
const FREE_SPACE_FIRST: &str = "free space first (trim, or delete snapshots)";

/// A rollback that waits for GC to free `need` segments (see
/// [`Engine::request_rollback`]): of volume `vol` to snapshot `snap` (ids and
/// creation versions), asked at engine time `since_ms` when `user_blocks` user
/// blocks had been written.
pub(crate) struct RollbackWait {
    token: Token,
    name: String,
    snapshot: String,
    vol: (VolumeId, Version),
    snap: (VolumeId, Version),
    need: usize,
    since_ms: u64,
    user_blocks: u64,
}

/// What [`Engine::rollback`] did.
pub(crate) enum Rolled {
    /// Done: the checkpoint to make it durable is due.
    Done,
    /// Nothing yet: its checkpoint needs `need` free segments. The volume and
    /// the snapshot it found (ids and creation versions).
    NeedsSegments {
        need: usize,
        vol: (VolumeId, Version),
        snap: (VolumeId, Version),
    },
}

/// The most volumes a family may have, whatever the geometry: beyond a few dozen,
/// blocks that all of them share cost more header than data when GC moves them.
const MAX_FAMILY: usize = 64;

impl Engine {
    /// Whether volume `v` (live or being deleted) maps `entry` at `lba`.
    #[inline]
    pub(crate) fn maps(&self, v: VolumeId, lba: Lba, entry: u32) -> bool {
        self.volumes
            .get(v.0 as usize)
            .and_then(|v| v.as_ref())
            .is_some_and(|v| v.shared.map.load(lba) == entry)
    }

    /// Whether a volume of `vol`'s family other than `vol` maps the block `entry`
    /// at `lba`: then `vol` letting go of it does not free it.
    #[inline]
    pub(crate) fn shared_elsewhere(&self, vol: VolumeId, lba: Lba, entry: u32) -> bool {
        let Some(f) = self.lineage.family(vol) else {
            return false;
        };
        matches!(decode(entry), Entry::Device(_) | Entry::Buffer(_))
            && self
                .lineage
                .members(f)
                .iter()
                .any(|&m| m != vol && self.maps(m, lba, entry))
    }

    /// A volume that maps `entry` at `lba`: `named` (the one a record names) if
    /// it does, else the first member of its family that does.
    pub(crate) fn holder(&self, named: VolumeId, lba: Lba, entry: u32) -> Option<VolumeId> {
        if self.maps(named, lba, entry) {
            return Some(named);
        }
        let f = self.lineage.family(named)?;
        self.lineage
            .members(f)
            .iter()
            .copied()
            .find(|&m| self.maps(m, lba, entry))
    }

    /// Every volume that maps `entry` at `lba`, `named` first if it does; empty
    /// when only volumes being deleted do (GC leaves their blocks alone).
    pub(crate) fn referrers(&self, named: VolumeId, lba: Lba, entry: u32, out: &mut Vec<VolumeId>) {
        out.clear();
        if self.maps(named, lba, entry) {
            out.push(named);
        }
        if let Some(f) = self.lineage.family(named) {
            for &m in self.lineage.members(f) {
                if m != named && self.maps(m, lba, entry) {
                    out.push(m);
                }
            }
        }
        let deleting = |v: &VolumeId| {
            self.volumes[v.0 as usize]
                .as_ref()
                .is_some_and(|v| v.deleting.is_some())
        };
        if out.iter().all(deleting) {
            out.clear();
        }
    }

    /// See [`Request::CreateSnapshot`].
    pub(crate) fn create_snapshot(
        &mut self,
        origin: &str,
        name: &str,
        writable: bool,
    ) -> Result<(), EngineError> {
        let from = self
            .volumes
            .iter()
            .flatten()
            .find(|v| *v.shared.name() == *origin && v.deleting.is_none())
            .ok_or_else(|| EngineError::Invalid(format!("no volume named {origin:?}")))?;
        if !from.published {
            return Err(EngineError::Invalid(format!(
                "volume {origin:?} is still being created"
            )));
        }
        let (from_id, size_bytes) = (from.shared.id, from.shared.size_bytes());
        if from.growing.is_some() {
            return Err(EngineError::Invalid(format!(
                "volume {origin:?} is being resized; try again"
            )));
        }
        self.check_new_name(name)?;
        // GC moves a block that every member maps with one record per member in
        // one unit header: the family must fit one, with room to spare.
        let most = self.max_family();
        let members = self
            .lineage
            .family(from_id)
            .map_or(1, |f| self.lineage.members(f).len());
        if members >= most {
            return Err(EngineError::Invalid(format!(
                "volume {origin:?} and the snapshots and clones related to it are {members} volumes, the most one family may have on this array ({most}): delete some first"
            )));
        }
        if writable {
            self.check_promise(name, size_bytes)?;
        }
        // Every checkpoint writes the new map too: refused when the checkpoints
        // would not fit beside the data (taking snapshots of a full array used
        // to leave a checkpoint waiting for segments nothing would free).
        // (The copy is of exactly the origin's pages in use.)
        let from_pages = from.shared.map.used_page_count();
        self.space.admit_maps(from_pages)?;
        let id = self.next_volume_id()?;
        let placement = self.placement_for(name, size_bytes / BLOCK_SIZE_U64, None);
        // A snapshot takes no writes, and GC moves the blocks it shares within the
        // streams of the volumes whose segments hold them: its streams never open
        // a segment, so on zoned devices they hold no zone.
        if writable {
            self.check_zone_room(name, placement.0.as_ref())?;
        }
        // The point in time: every write acknowledged so far is in the origin's
        // map. Units still open are sealed first, so that the copy names no block
        // of a unit whose records are not yet final (a sealed unit's blocks are
        // converted in every map that holds them when their write completes).
        self.start_flush();
        let publish_at = self.ckpt.target_generation();
        let vol = self.add_member(from_id, id, name, !writable, placement);
        vol.publish_at = publish_at;
        let live = vol.live_blocks;
        self.space.set_map_pages(self.space.map_pages + from_pages);
        self.update_class_caps();
        tracing::info!(
            "{} {name:?} of volume {origin:?} taken ({live} blocks shared)",
            if writable { "clone" } else { "snapshot" }
        );
        Ok(())
    }

    /// See [`Request::Rollback`]. The volume's map becomes a copy of the
    /// snapshot's at once; its old map moves to a hidden volume that is deleted
    /// by the same checkpoint, so the blocks only it maps are freed when (and only
    /// when) the rollback is durable. Until then GC moves nothing and the volume
    /// takes no writes: a crash before the checkpoint commits finds the volume
    /// exactly as it was (its old map in the previous checkpoint, every block of
    /// it where that map says).
    pub(crate) fn rollback(&mut self, name: &str, snapshot: &str) -> Result<Rolled, EngineError> {
        let find = |n: &str| {
            self.volumes
                .iter()
                .flatten()
                .find(|v| *v.shared.name() == *n && v.deleting.is_none() && v.published)
                .map(|v| v.shared.id)
                .ok_or_else(|| EngineError::Invalid(format!("no volume named {n:?}")))
        };
        let (id, snap) = (find(name)?, find(snapshot)?);
        if self.lineage.origin(snap) != Some(id) || !self.lineage.read_only(snap) {
            return Err(EngineError::Invalid(format!(
                "{snapshot:?} is not a snapshot of volume {name:?}"
            )));
        }
        if self.lineage.read_only(id) {
            return Err(EngineError::ReadOnly(format!(
                "volume {name:?} is a snapshot"
            )));
        }
        let v = self.vol(id);
        if v.growing.is_some() || v.rolling_back || self.rollback_until.is_some() {
            return Err(EngineError::Invalid(
                "a resize or rollback is in progress: try again in a moment".into(),
            ));
        }
        if self.vol(snap).shared.size_bytes() != v.shared.size_bytes() {
            return Err(EngineError::Invalid(format!(
                "volume {name:?} was resized since snapshot {snapshot:?} was taken: resize it back first"
            )));
        }
        self.check_no_requests(name, id)?;
        // The map changes without records in the log: a checkpoint being written
        // now would save some pages from before and some from after it.
        if self.ckpt.in_progress() {
            return Err(EngineError::Invalid(ROLLBACK_BUSY.into()));
        }
        // GC and user writes wait for the checkpoint: it must fit in what is free,
        // every map page written (the volume's pages become the snapshot's).
        let pages = self.used_map_pages() + self.vol(snap).shared.map.used_page_count();
        let need =
            self.user_floor() as u64 + pages.div_ceil(self.geo.data_blocks_per_segment()) + 2;
        if (self.segments.free.len() as u64) < need {
            let named = |v: VolumeId| (v, self.vol(v).created_version);
            return Ok(Rolled::NeedsSegments {
                need: need as usize,
                vol: named(id),
                snap: named(snap),
            });
        }
        let ghost = self.next_volume_id()?;
        self.start_flush();
        let gen = self.ckpt.target_generation();
        let placement = self.placement_for("", 0, None);
        let g = self.add_member(id, ghost, &format!("{name}@rollback"), true, placement);
        g.deleting = Some(gen);
        // The volume takes the snapshot's map: unmapped where it has nothing.
        // Entry by entry, through the map's sequence words: a client that reads
        // meanwhile (there should be none) gets each block old or new, never torn.
        let v = self.vol(id);
        let (map, from) = (&v.shared.map, &self.vol(snap).shared.map);
        map.for_each_mapped(|lba, _| {
            if from.load(lba) == crate::map::UNMAPPED {
                map.store(lba, crate::map::UNMAPPED);
            }
        });
        from.for_each_mapped(|lba, e| map.store(lba, e));
        let live = self.vol(snap).live_blocks;
        let v = self.vol_mut(id);
        v.live_blocks = live;
        v.rolling_back = true;
        self.rollback_until = Some(gen);
        tracing::info!(
            "volume {name:?} rolled back to snapshot {snapshot:?} (durable at checkpoint {gen})"
        );
        Ok(Rolled::Done)
    }

    /// [`Request::Rollback`]: done at once when the free segments allow, else
    /// GC is asked to free what its checkpoint needs and the rollback waits (see
    /// [`Engine::progress_rollback_wait`]); the volume refuses writes meanwhile,
    /// as it does until the rollback is durable. One rollback waits at a time.
    pub(crate) fn request_rollback(&mut self, token: Token, name: String, snapshot: String) {
        let refused = if let Some(f) = &self.failed {
            Some(EngineError::Failed(f.clone()))
        } else if self.shutting_down {
            Some(EngineError::ShuttingDown)
        } else if self.rollback_wait.is_some() {
            Some(EngineError::Invalid(
                "another rollback is waiting for garbage collection to free space: try again in a moment".into(),
            ))
        } else {
            None
        };
        if let Some(e) = refused {
            return self.reply(token, Err(e), None);
        }
        match self.rollback(&name, &snapshot) {
            Ok(Rolled::Done) => self.start_checkpoint(Some(token)),
            Ok(Rolled::NeedsSegments { need, vol, snap }) => {
                let free = self.segments.free.len();
                // What GC could free at most: the dead blocks of closed segments.
                let per_seg = self.geo.data_blocks_per_segment().max(1);
                let reclaimable = (self.segments.reclaimable_blocks() / per_seg) as usize;
                if free + reclaimable < need {
                    let why = format!(
                        "a rollback needs {need} free segments; {free} are free and garbage collection could free {reclaimable} more: {FREE_SPACE_FIRST}"
                    );
                    return self.reply(token, Err(EngineError::NoSpace(why)), None);
                }
                tracing::info!(
                    "rollback of volume {name:?} to {snapshot:?} waits for garbage collection to free {need} segments ({free} free)"
                );
                self.vol_mut(vol.0).rollback_waiting = true;
                self.space.set_reserve(need);
                self.rollback_wait = Some(RollbackWait {
                    token,
                    name,
                    snapshot,
                    vol,
                    snap,
                    need,
                    since_ms: self.now_ms,
                    user_blocks: self.counters.user_blocks,
                });
            }
            Err(e) => self.reply(token, Err(e), None),
        }
    }

    /// Runs the waiting rollback once GC has freed what it needs (and no
    /// checkpoint is being written: asked before a due checkpoint starts, so
    /// that checkpoints one after the other cannot keep it waiting). Refuses it
    /// with ENOSPC when GC can free no more, or has not within
    /// [`ROLLBACK_WAIT_MS`] while writes elsewhere took what it freed; when the
    /// engine shuts down; when its volume or snapshot went meanwhile. (A failed
    /// engine answers it in [`Engine::fail`].)
    pub(crate) fn progress_rollback_wait(&mut self) {
        let Some(w) = &self.rollback_wait else {
            return;
        };
        if self.failed.is_some() {
            return;
        }
        let (need, since_ms) = (w.need, w.since_ms);
        // Only writes can take what GC frees: without any (an offline rollback,
        // whose clock jumps an hour per round) the wait ends when GC has freed
        // enough or can free no more.
        let written = self.counters.user_blocks > w.user_blocks;
        let same = |(id, created): (VolumeId, Version), name: &str| {
            self.volumes
                .get(id.0 as usize)
                .and_then(|v| v.as_ref())
                .is_some_and(|v| {
                    v.created_version == created
                        && *v.shared.name() == *name
                        && v.deleting.is_none()
                })
        };
        let free = self.segments.free.len();
        let refuse = if self.shutting_down {
            Some(EngineError::ShuttingDown)
        } else if !same(w.vol, &w.name) || !same(w.snap, &w.snapshot) {
            Some(EngineError::Invalid(format!(
                "volume {:?} or snapshot {:?} was deleted or renamed while the rollback waited for free space",
                w.name, w.snapshot
            )))
        } else if free >= need {
            if self.ckpt.in_progress() {
                return;
            }
            None
        } else if self.gc_cannot_free_more() {
            Some(EngineError::NoSpace(format!(
                "a rollback needs {need} free segments and garbage collection can free no more than {free}: {FREE_SPACE_FIRST}"
            )))
        } else if written && self.now_ms.saturating_sub(since_ms) >= ROLLBACK_WAIT_MS {
            Some(EngineError::NoSpace(format!(
                "a rollback needs {need} free segments and garbage collection got {free} in {} s while writes took the rest: {FREE_SPACE_FIRST}, or try again when writes are fewer",
                ROLLBACK_WAIT_MS / 1000
            )))
        } else {
            return;
        };
        self.end_rollback_wait(refuse);
    }

    /// Ends the waiting rollback: refused with `refuse`, or run now.
    pub(crate) fn end_rollback_wait(&mut self, refuse: Option<EngineError>) {
        let Some(w) = self.rollback_wait.take() else {
            return;
        };
        self.space.set_reserve(0);
        if let Some(Some(v)) = self.volumes.get_mut(w.vol.0 .0 as usize) {
            v.rollback_waiting = false;
        }
        match refuse {
            Some(e) => self.reply(w.token, Err(e), None),
            None => self.request_rollback(w.token, w.name, w.snapshot),
        }
    }

    /// Attaches volume `id` (unpublished), made from `from` as it is now: a copy
    /// of its map, sharing its blocks, in its family (read-only: a snapshot). The
    /// caller has sealed the open units (see `create_snapshot`).
    fn add_member(
        &mut self,
        from: VolumeId,
        id: VolumeId,
        name: &str,
        read_only: bool,
        placement: (
            Box<dyn crate::placement::Classifier>,
            Box<dyn crate::gc::VictimPolicy>,
        ),
    ) -> &mut Vol {
        let v = self.vol(from);
        let map = self.shared.new_map(v.shared.map.len());
        map.copy_entries_from(&v.shared.map);
        let live = v.live_blocks;
        let shared = Arc::new(VolumeShared::new(
            id,
            name.to_string(),
            v.shared.size_bytes(),
            map,
        ));
        shared.read_only.store(read_only, Ordering::Release);
        self.counters.next_volume_id = self.counters.next_volume_id.max(id.0 as u64 + 1);
        self.lineage.add(from, id, read_only);
        let family = self.lineage.family(id).expect("just added");
        self.shared.set_family(from, family);
        self.shared.set_family(id, family);
        self.sb.shared_blocks = true;
        let created = self.take_version();
        let vol = self.attach_volume_with(shared, created, false, placement);
        vol.live_blocks = live;
        vol
    }

    /// The most volumes one family may have: GC writes a record per member that
    /// maps a block it moves, all in the unit that takes the block.
    pub(crate) fn max_family(&self) -> usize {
        let pad = self.geo.row_blocks as usize - 1;
        (self.geo.unit_records as usize - pad - 1).clamp(2, MAX_FAMILY)
    }

    /// The names of the live volumes made from `vol`.
    pub(crate) fn children_names(&self, vol: VolumeId) -> Vec<String> {
        self.lineage
            .children(vol)
            .into_iter()
            .filter_map(|c| self.volumes.get(c.0 as usize)?.as_ref())
            // Those being deleted too: they hold their blocks until that commits.
            .map(|v| v.shared.name().to_string())
            .collect()
    }
}
