//! The engine's volumes: creating, resizing, renaming and deleting them, what each
//! is promised and may be placed on, and making their changes visible once the
//! checkpoint that records them has committed (`volumes_committed`).

use crate::engine::*;
use crate::error::EngineError;
use crate::gc::{policy_by_name, VictimPolicy};
use crate::map::UNMAPPED;
use crate::shared::VolumeShared;
use crate::types::{Lba, Version, VolumeId, BLOCK_SIZE_U64};
use lamina_format::unit::StreamKind;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Below this many volume ids left, each new volume logs a warning.
pub(crate) const VOLUME_IDS_WARN: u64 = 1000;

/// Ids not held among the `next` given out so far, plus those never given out.
fn count_left(held: &[bool], next: u64) -> u64 {
    let next = next.min(u16::MAX as u64);
    let free_below = held[..next as usize].iter().filter(|&&h| !h).count() as u64;
    free_below + (u16::MAX as u64 - next)
}

/// The id a new volume gets: the next new one while there are any, then the
/// lowest one nothing holds (`held` from `Engine::volume_ids_held`).
fn pick_id(held: &[bool], next: u64) -> Result<VolumeId, EngineError> {
    if next < u16::MAX as u64 {
        return Ok(VolumeId(next as u16));
    }
    (0..u16::MAX)
        .find(|&i| !held[i as usize])
        .map(VolumeId)
        .ok_or_else(|| {
            EngineError::Invalid(
                "all 65535 volume ids of this array are held: by volumes, snapshots and clones, by deleted ones whose blocks a snapshot or clone still shares, and by deleted ones whose segments are still being released".into(),
            )
        })
}

impl Engine {
    pub(crate) fn create_volume(&mut self, name: &str, size_bytes: u64) -> Result<(), EngineError> {
        self.check_new_name(name)?;
        check_volume_size(size_bytes)?;
        self.check_promise(name, size_bytes)?;
        let next = self.next_volume_id()?;
        let placement = self.placement_for(name, size_bytes / BLOCK_SIZE_U64, None);
        self.check_zone_room(name, placement.0.as_ref())?;
        self.counters.next_volume_id = self.counters.next_volume_id.max(next.0 as u64 + 1);
        let created = self.take_version();
        let publish_at = self.ckpt.target_generation();
        // A family of its own: the id may have been a snapshot family member's.
        self.shared.set_family(next, next.0);
        let shared = Arc::new(VolumeShared::new(
            next,
            name.to_string(),
            size_bytes,
            self.shared.new_map(size_bytes / BLOCK_SIZE_U64),
        ));
        let vol = self.attach_volume_with(shared, created, false, placement);
        vol.publish_at = publish_at;
        self.update_class_caps();
        Ok(())
    }

    /// Refuses a change to volume `id` while requests of it wait in the engine.
    pub(crate) fn check_no_requests(&self, name: &str, id: VolumeId) -> Result<(), EngineError> {
        if self.pending.iter().any(|p| p.span().0 == id) {
            return Err(EngineError::Invalid(format!(
                "volume {name:?} has requests in progress"
            )));
        }
        Ok(())
    }

    /// Map pages not in use yet in the ranges of the requests that were admitted
    /// against the usable space and wait to be done (a page each that their
    /// writes may start; at most, as a request may be partly done).
    pub(crate) fn admitted_unused_pages(&self) -> u64 {
        let per = crate::map::PAGE_ENTRIES as u64;
        self.pending
            .iter()
            .map(Pending::span)
            .filter(|&(_, _, admitted)| admitted)
            .filter_map(|(volume, bytes, _)| {
                let map = &self.volumes.get(volume.0 as usize)?.as_ref()?.shared.map;
                let blocks = bytes.start / BLOCK_SIZE_U64..bytes.end.div_ceil(BLOCK_SIZE_U64);
                let pages = (blocks.start / per..blocks.end.div_ceil(per))
                    .filter(|&page| !map.page_used(Lba(page * per)))
                    .count();
                Some(pages as u64)
            })
            .sum()
    }

    /// Map pages in use in the maps of the volumes a checkpoint writes: what the
    /// next one writes of them, exactly.
    pub(crate) fn used_map_pages(&self) -> u64 {
        self.volumes
            .iter()
            .flatten()
            .filter(|v| v.deleting.is_none())
            .map(|v| v.shared.map.used_page_count())
            .sum()
    }

    /// Map pages the volumes hold, about (what a checkpoint writes of them).
    pub(crate) fn map_pages(&self) -> u64 {
        self.volumes
            .iter()
            .flatten()
            .map(|v| v.live_blocks / 1024 + 1)
            .sum()
    }

    /// The id a new volume (snapshot, clone, rollback) gets: a new one while
    /// the 16-bit space has them, then the lowest id nothing refers to any more
    /// ([`Engine::volume_ids_held`]). Logs a warning while fewer than
    /// [`VOLUME_IDS_WARN`] are left.
    ///
    /// Why an id may be given again. Recovery replays only units and trims
    /// written after its checkpoint, and the deleted volume's were all written
    /// before the new volume was created (its deletion committed first, and no
    /// segment holds its blocks any more); replay also skips a volume's records
    /// older than its creation. A client still connected to the deleted volume
    /// names it by id and creation version (`Engine::submit_to`), so its writes
    /// cannot reach the new one.
    pub(crate) fn next_volume_id(&self) -> Result<VolumeId, EngineError> {
        let next = self.ids_given();
        let held = self.volume_ids_held();
        let id = pick_id(&held, next)?;
        let left = count_left(&held, next) - 1;
        if left < VOLUME_IDS_WARN {
            tracing::warn!(
                "{left} volume ids left after this one: every volume, snapshot, clone and rollback holds one until it is deleted and its blocks are gone"
            );
        }
        Ok(id)
    }

    /// Volume ids this array can still give out: new ones, and those of deleted
    /// volumes nothing refers to any more.
    pub(crate) fn volume_ids_left(&self) -> u64 {
        count_left(&self.volume_ids_held(), self.ids_given())
    }

    /// How many ids were given out new (`0..` this one).
    fn ids_given(&self) -> u64 {
        self.counters.next_volume_id.max(self.volumes.len() as u64)
    }

    /// Which of the ids given out so far something still refers to: a volume
    /// (being created, deleted or rolled back included), a segment that holds or
    /// is releasing its blocks, or a snapshot family (its deleted members'
    /// blocks may still be shared). One pass over the segments: only volume
    /// creation and status ask.
    fn volume_ids_held(&self) -> Vec<bool> {
        let mut held = vec![false; u16::MAX as usize];
        for (i, v) in self.volumes.iter().enumerate() {
            held[i] |= v.is_some();
        }
        // (A segment reserved for the metadata stream is in the Meta state with
        // a free segment's fields.)
        for s in &self.segments.segs {
            if !matches!(s.state, SegState::Free | SegState::Meta) && s.kind != StreamKind::Meta {
                held[s.volume as usize] = true;
            }
        }
        for id in self.lineage.ids() {
            held[id as usize] = true;
        }
        held
    }

    /// Whether the streams of a new volume with classifier `c` fit the devices'
    /// open-zone limit beside the metadata stream and every other volume's.
    pub(crate) fn check_zone_room(
        &self,
        name: &str,
        c: &dyn crate::placement::Classifier,
    ) -> Result<(), EngineError> {
        if self.zones.limit > 0 {
            let need = self.zone_streams(c);
            let used = self.zone_streams_used();
            if 1 + used + need > self.zones.limit as usize {
                return Err(EngineError::Invalid(format!(
                    "the devices let {} zones be open at once; the metadata stream and the volumes' {used} streams hold {}, and volume {name:?} needs {need} more (fewer heat classes: classifier = \"none\" needs 2)",
                    self.zones.limit,
                    1 + used
                )));
            }
        }
        Ok(())
    }

    /// Attaches a volume whose map already exists, creating its streams. `publish`:
    /// visible to clients at once (recovery) or only after the next checkpoint.
    /// `recorded`: the classifier the checkpoint names for the volume, which is
    /// what "auto" resolved to when the volume was created.
    pub(crate) fn attach_volume(
        &mut self,
        shared: Arc<VolumeShared>,
        created_version: Version,
        publish: bool,
        recorded: Option<&str>,
    ) -> &mut Vol {
        let placement = self.placement_for(&shared.name(), shared.blocks(), recorded);
        self.attach_volume_with(shared, created_version, publish, placement)
    }

    /// [`Engine::attach_volume`] with the volume's classifier and victim policy.
    pub(crate) fn attach_volume_with(
        &mut self,
        shared: Arc<VolumeShared>,
        created_version: Version,
        publish: bool,
        (classifier, policy): (Box<dyn crate::placement::Classifier>, Box<dyn VictimPolicy>),
    ) -> &mut Vol {
        let id = shared.id;
        shared.created.store(created_version.0, Ordering::Relaxed);
        if publish {
            self.shared.set_volume(shared.clone());
        }
        self.counters.next_volume_id = self.counters.next_volume_id.max(id.0 as u64 + 1);
        let user_classes = classifier.user_classes();
        let total = user_classes + classifier.gc_classes();
        let active = classifier.active_classes();
        let mut streams = Vec::with_capacity(total as usize + 1);
        for c in 0..total {
            let kind = if c < user_classes {
                StreamKind::User
            } else {
                StreamKind::Gc
            };
            streams.push(self.log.add_stream(Stream::new(kind, c, id.0)));
        }
        // Extra streams take the class numbers after the classifier's.
        // The extra streams have fixed class numbers after the classifier's (the
        // read-hot GC stream `total`, the small stream `total + 1`), so that a
        // restart with other settings reads old segments' classes the same way.
        let extra = |engine: &mut Self, kind: StreamKind, class: u8, f: fn(&mut Stream)| {
            let mut st = Stream::new(kind, class, id.0);
            f(&mut st);
            engine.log.add_stream(st)
        };
        let read_hot_stream = self
            .geometry_aware
            .then(|| extra(self, StreamKind::Gc, total, |st| st.read_hot = true));
        // With a cache tier, user writes land there, in conventional segments:
        // no short unit needs a way around a zone.
        let small_stream = (self.zones.any_conventional && !self.geo.tiered())
            .then(|| extra(self, StreamKind::User, total + 1, |st| st.small = true));
        streams.extend(read_hot_stream);
        streams.extend(small_stream);
        let n_streams = total as usize + 2;
        let i = id.0 as usize;
        if self.volumes.len() <= i {
            self.volumes.resize_with(i + 1, || None);
        }
        self.volumes[i] = Some(Vol {
            shared,
            streams,
            user_classes,
            read_hot_stream,
            small_stream,
            classifier,
            policy,
            classes: vec![ClassCounters::default(); n_streams],
            caps: crate::classcap::Caps {
                user: active.0.clamp(1, user_classes),
                gc: active.1.clamp(1, total - user_classes),
                want_user: user_classes,
                want_gc: total - user_classes,
            },
            created_version,
            user_blocks: 0,
            gc_blocks: 0,
            media_blocks: 0,
            live_blocks: 0,
            published: publish,
            publish_at: 0,
            growing: None,
            deleting: None,
            rolling_back: false,
            rollback_waiting: false,
        });
        self.refresh_gc_classes();
        self.volumes[i].as_mut().unwrap()
    }

    /// Fits the volumes' open classes to the spare space (see `classcap`): classes
    /// no longer kept have their open segments closed, so that GC can reclaim them.
    pub(crate) fn update_class_caps(&mut self) {
        // Snapshots take no writes and open no segment: the spare is shared by the
        // volumes that write.
        let ids: Vec<usize> = (0..self.volumes.len())
            .filter(|&i| self.volumes[i].is_some() && !self.lineage.read_only(VolumeId(i as u16)))
            .collect();
        let wanted: Vec<crate::classcap::Caps> = ids
            .iter()
            .map(|&i| {
                let v = self.volumes[i].as_ref().unwrap();
                let (user, gc) = v.classifier.active_classes();
                crate::classcap::Caps {
                    user: user.clamp(1, v.user_classes),
                    gc: gc.clamp(1, v.classifier.gc_classes()),
                    want_user: v.user_classes,
                    want_gc: v.classifier.gc_classes(),
                }
            })
            .collect();
        let spare = self
            .space
            .spare_segments(self.geo.data_blocks_per_segment());
        let mut caps = crate::classcap::caps(spare, &wanted);
        if self.geo.tiered() {
            // User classes hold their open segments in the cache tier: they share
            // its segments (a head is what compaction cannot take), GC classes
            // the capacity tier's spare.
            let cache = crate::classcap::caps(self.geo.cache_segments() as u64, &wanted);
            for (c, k) in caps.iter_mut().zip(cache) {
                c.user = k.user;
            }
        }
        let free = self.segments.free.len();
        let mut dropped = Vec::new();
        for (&i, mut cap) in ids.iter().zip(caps) {
            let v = self.volumes[i].as_mut().unwrap();
            if cap.gc > v.caps.gc {
                // More GC classes raise the floor at once; GC may then need a fresh
                // segment in each. Wait for a sweep with free segments to spare.
                let more = (cap.gc - v.caps.gc) as usize;
                if free < self.space.gc_start(self.gc_classes + more) {
                    cap.gc = v.caps.gc;
                }
            }
            if v.caps == cap {
                continue;
            }
            v.caps = cap;
            let (uc, total) = (v.user_classes, v.user_classes + v.classifier.gc_classes());
            // Streams no class folds into any more; the kept ones stay open.
            dropped.extend(
                crate::classcap::dropped(cap, uc, total)
                    .into_iter()
                    .map(|c| v.streams[c as usize]),
            );
        }
        self.refresh_gc_classes();
        for s in dropped {
            if self.log.streams[s].seg.is_some() && self.failed.is_none() {
                self.close_segment(s);
            }
        }
    }

    /// Streams of a volume with classifier `c` that may hold a zone open (the small
    /// stream takes conventional segments only: no zone; nor do user streams in
    /// front of a cache tier).
    pub(crate) fn zone_streams(&self, c: &dyn crate::placement::Classifier) -> usize {
        let user = if self.geo.tiered() {
            0
        } else {
            c.user_classes()
        };
        (user + c.gc_classes()) as usize + self.geometry_aware as usize
    }

    /// Streams of the volumes attached so far that may hold a zone open. Volumes
    /// being deleted keep their open segments until the checkpoint that drops them
    /// commits: they count.
    pub(crate) fn zone_streams_used(&self) -> usize {
        self.volumes
            .iter()
            .flatten()
            // A snapshot's streams open no segment (see `create_snapshot`).
            .filter(|v| !self.lineage.read_only(v.shared.id))
            .map(|v| v.streams.iter().filter(|&&s| self.holds_zones(s)).count())
            .sum()
    }

    /// What `classifier = "auto"` (the default) is for the next volume: SepBIT,
    /// unless its streams would not fit a zoned array's open-zone limit beside those
    /// already open, where greedy's one user and one GC stream are the most that
    /// fits.
    pub(crate) fn auto_classifier(&self) -> &'static str {
        let sepbit = crate::placement::SepBit::default();
        if self.zones.limit > 0
            && 1 + self.zone_streams_used() + self.zone_streams(&sepbit) > self.zones.limit as usize
        {
            "none"
        } else {
            "sepbit"
        }
    }

    /// The classifier and victim policy a volume uses: its override, else the
    /// engine's defaults. Unknown names were rejected when the configuration was read.
    pub(crate) fn placement_for(
        &self,
        name: &str,
        blocks: u64,
        recorded: Option<&str>,
    ) -> (Box<dyn crate::placement::Classifier>, Box<dyn VictimPolicy>) {
        let o = self.cfg.volume_overrides.iter().find(|o| o.0 == name);
        let mut cname = o
            .and_then(|o| o.1.clone())
            .unwrap_or_else(|| self.cfg.classifier.clone());
        if cname == "auto" {
            // Resolved once, when the volume was created (the checkpoint records
            // it): resolving again at recovery could see other volumes' streams
            // (those being deleted then are gone now) and choose otherwise.
            cname = match recorded {
                Some(r @ ("sepbit" | "none")) => r.into(),
                _ => self.auto_classifier().into(),
            };
        }
        let pname = o
            .and_then(|o| o.2.clone())
            .unwrap_or_else(|| self.cfg.gc_policy.clone());
        let classifier = self
            .classifier_factory
            .as_ref()
            .and_then(|f| f(&cname, name, blocks))
            .or_else(|| {
                crate::placement::classifier_for(&cname, blocks, self.geo.data_blocks_per_segment())
            })
            .unwrap_or_else(|| Box::new(crate::placement::NoClassifier));
        let mut policy = policy_by_name(&pname).unwrap_or_else(|| Box::new(crate::gc::Greedy));
        // A thin volume larger than the array holds at most the array's blocks: the
        // miniature samples what can be stored.
        let per_segment = self.geo.data_blocks_per_segment();
        let stored = blocks.min(self.geo.usable_segments() as u64 * per_segment);
        policy.configure(stored, per_segment);
        (classifier, policy)
    }

    /// Lets the simulator supply classifiers the engine cannot build by name (the
    /// oracle needs the whole workload in advance).
    pub fn set_classifier_factory(&mut self, f: ClassifierFactory) {
        self.classifier_factory = Some(f);
    }

    /// A name a volume may take: well formed, and no other volume's.
    pub(crate) fn check_new_name(&self, name: &str) -> Result<(), EngineError> {
        // Names go into NBD URIs (`nbd+unix:///NAME?socket=...`), qemu's
        // `nbd:unix:SOCK:exportname=NAME` and command lines: '?', '#', '%', ':',
        // spaces and a leading '-' would break one of them.
        let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
        let starts_well = name
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphanumeric());
        if name.len() > 64 || !starts_well || !name.chars().all(ok) {
            return Err(EngineError::Invalid(format!(
                "volume name {name:?} must be 1 to 64 letters, digits, '.', '_' or '-', \
                 starting with a letter or digit"
            )));
        }
        if self
            .volumes
            .iter()
            .flatten()
            .any(|v| *v.shared.name() == *name && v.deleting.is_none())
        {
            return Err(EngineError::Invalid(format!(
                "volume {name:?} already exists"
            )));
        }
        Ok(())
    }

    /// See [`Request::RenameVolume`].
    pub(crate) fn rename_volume(&mut self, name: &str, new_name: &str) -> Result<(), EngineError> {
        self.check_new_name(new_name)?;
        let vol = self
            .volumes
            .iter()
            .flatten()
            .find(|v| *v.shared.name() == *name && v.deleting.is_none())
            .ok_or_else(|| EngineError::Invalid(format!("no volume named {name:?}")))?;
        vol.shared.set_name(new_name);
        // Per-volume choices follow the volume (they apply when it is opened).
        for o in self.cfg.volume_overrides.iter_mut().filter(|o| o.0 == name) {
            o.0 = new_name.to_string();
        }
        tracing::info!("volume {name:?} is named {new_name:?} now");
        Ok(())
    }

    /// Refuses `more` bytes of volume `name` beyond what the volumes promise when
    /// that would pass `max_overcommit`.
    pub(crate) fn check_promise(&self, name: &str, more: u64) -> Result<(), EngineError> {
        if let Some(limit) = self.cfg.max_overcommit {
            let usable = self.space.usable * BLOCK_SIZE_U64;
            let promised = self.promised_bytes().saturating_add(more);
            if promised as f64 > limit * usable as f64 {
                return Err(EngineError::Invalid(format!(
                    "volume {name:?} would make the volumes promise {:.2}x the usable capacity of {usable} bytes, above max_overcommit = {limit}",
                    promised as f64 / usable.max(1) as f64
                )));
            }
        }
        Ok(())
    }

    /// See [`Request::ResizeVolume`].
    pub(crate) fn resize_volume(&mut self, name: &str, size_bytes: u64) -> Result<(), EngineError> {
        check_volume_size(size_bytes)?;
        let i = self
            .volumes
            .iter()
            .position(|v| {
                v.as_ref()
                    .is_some_and(|v| *v.shared.name() == *name && v.deleting.is_none())
            })
            .ok_or_else(|| EngineError::Invalid(format!("no volume named {name:?}")))?;
        let vol = self.volumes[i].as_ref().unwrap();
        if !vol.published || vol.growing.is_some() {
            return Err(EngineError::Invalid(format!(
                "volume {name:?} is being created or resized: try again in a moment"
            )));
        }
        if self.lineage.read_only(vol.shared.id) {
            return Err(EngineError::ReadOnly(format!(
                "volume {name:?} is a snapshot: it keeps its size"
            )));
        }
        let old = vol.shared.size_bytes();
        let (old_blocks, new_blocks) = (old / BLOCK_SIZE_U64, size_bytes / BLOCK_SIZE_U64);
        if size_bytes > old {
            self.check_promise(name, size_bytes - old)?;
            let gen = self.ckpt.target_generation();
            let vol = self.volumes[i].as_mut().unwrap();
            vol.shared.map.grow(new_blocks);
            vol.growing = Some((gen, size_bytes));
            tracing::info!(
                "volume {name:?} grows from {old} to {size_bytes} bytes (clients see it once checkpoint {gen} commits)"
            );
        } else if size_bytes < old {
            // Requests accepted before but not yet applied must not land in the
            // tail (the map would no longer have room for them); elsewhere they
            // may go on.
            let id = vol.shared.id;
            if self.pending.iter().any(|p| {
                let (volume, bytes, _) = p.span();
                volume == id && bytes.end > size_bytes
            }) {
                return Err(EngineError::Invalid(format!(
                    "volume {name:?} has requests in progress beyond {size_bytes} bytes"
                )));
            }
            let map = &vol.shared.map;
            if let Some(data) = map.mapped_runs(Lba(new_blocks), Lba(old_blocks)).next() {
                return Err(EngineError::Invalid(format!(
                    "volume {name:?} holds data beyond {size_bytes} bytes (at byte {}); --force discards it",
                    data.start.0 * BLOCK_SIZE_U64
                )));
            }
            // Clients stop addressing the tail, then the map lets it go. Nothing
            // there is mapped, so nothing else changes.
            vol.shared.set_size_bytes(size_bytes);
            map.shrink(new_blocks);
            tracing::info!("volume {name:?} shrinks from {old} to {size_bytes} bytes");
        }
        Ok(())
    }

    pub(crate) fn delete_volume(&mut self, name: &str) -> Result<(), EngineError> {
        let id = self
            .volumes
            .iter()
            .flatten()
            .find(|v| *v.shared.name() == *name && v.deleting.is_none())
            .map(|v| v.shared.id)
            .ok_or_else(|| EngineError::Invalid(format!("no volume named {name:?}")))?;
        let children = self.children_names(id);
        if !children.is_empty() {
            return Err(EngineError::Invalid(format!(
                "volume {name:?} has snapshots or clones made from it ({}): delete them first",
                children
                    .iter()
                    .map(|c| format!("{c:?}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        self.check_no_requests(name, id)?;
        // Hidden and closed to I/O now; destroyed when a checkpoint without it commits.
        self.shared.remove_volume(id);
        let gen = self.ckpt.target_generation();
        self.volumes[id.0 as usize].as_mut().unwrap().deleting = Some(gen);
        Ok(())
    }

    /// Publishes created volumes and destroys deleted ones once checkpoint `gen`
    /// has committed.
    pub(crate) fn volumes_committed(&mut self, gen: u64) {
        for i in 0..self.volumes.len() {
            let Some(v) = self.volumes[i].as_mut() else {
                continue;
            };
            if !v.published && v.publish_at <= gen && v.deleting.is_none() {
                v.published = true;
                self.shared.set_volume(v.shared.clone());
            }
            if let Some((at, bytes)) = v.growing.filter(|&(at, _)| at <= gen) {
                v.growing = None;
                v.shared.set_size_bytes(bytes);
                tracing::info!(
                    "volume {:?} is {bytes} bytes now (checkpoint {at} recorded it)",
                    v.shared.name()
                );
            }
            if v.rolling_back && self.rollback_until.is_some_and(|r| r <= gen) {
                v.rolling_back = false;
                tracing::info!(
                    "volume {:?} rolled back (checkpoint {gen})",
                    v.shared.name()
                );
            }
            if v.deleting.is_some_and(|d| d <= gen) {
                let (streams, map) = (v.streams.clone(), v.shared.clone());
                // A failed array writes nothing more (its summaries included);
                // the deletion is recorded in the checkpoint that committed.
                if self.failed.is_none() {
                    for &s in &streams {
                        self.close_segment(s);
                    }
                }
                self.log.retired.extend(streams);
                // Only the pages that were made: a thin volume of petabytes with
                // a few blocks written is a few pages, not a loop over its size.
                let id = map.id;
                map.map.for_each_mapped(|lba, old| {
                    map.map.store(lba, UNMAPPED);
                    // What a snapshot or clone still maps stays.
                    if !self.shared_elsewhere(id, lba, old) {
                        self.unref(old);
                        self.space.unmapped(1);
                    }
                });
                self.lineage.deleted(id);
                self.volumes[i] = None;
                self.refresh_gc_classes();
            }
        }
        if self.rollback_until.is_some_and(|r| r <= gen) {
            self.rollback_until = None;
        }
    }
}

/// The trim that empties volume `volume` from byte `from` to `to` (its end), what
/// a forced shrink sends before [`Request::ResizeVolume`].
pub fn trim_tail(volume: VolumeId, from: u64, to: u64) -> Request {
    Request::Zero {
        volume,
        offset: from,
        length: to.saturating_sub(from),
        fua: false,
        allocate: false,
    }
}

/// A volume size must be a positive multiple of 4 KiB the map can hold.
pub fn check_volume_size(size_bytes: u64) -> Result<(), EngineError> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(BLOCK_SIZE_U64) {
        return Err(EngineError::Invalid(format!(
            "volume size {size_bytes} must be a positive multiple of 4096 bytes"
        )));
    }
    if size_bytes / BLOCK_SIZE_U64 > crate::map::MAX_BLOCKS {
        return Err(EngineError::Invalid(format!(
            "volume size {size_bytes} is too large: at most {} (16 PiB)",
            crate::map::MAX_BLOCKS * BLOCK_SIZE_U64
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::engine::{Request, Token};
    use crate::recovery::call_inline;
    use lamina_device::{mem::MemDevice, BlockDevice};
    use std::sync::Arc;

    /// `devs` opened again, as after a crash.
    fn reopen(devs: Vec<Arc<dyn BlockDevice>>) -> crate::Engine {
        let cfg = crate::EngineConfig::default();
        crate::open(devs, cfg, crate::OpenMode::ReadWrite)
            .unwrap()
            .0
    }

    /// The first byte of volume `name`.
    fn first_byte(e: &crate::Engine, name: &str) -> u8 {
        let v = e.shared().volume(name).unwrap();
        let mut b = vec![0u8; 4096];
        e.shared().read(&v, 0, &mut b).unwrap();
        b[0]
    }

    /// A fresh array of 40 small segments on a memory device, open.
    fn engine() -> (crate::Engine, Vec<Arc<dyn BlockDevice>>) {
        let devs: Vec<Arc<dyn BlockDevice>> =
            vec![Arc::new(MemDevice::new("m", (1 << 20) + (40 << 18)))];
        let params = crate::FormatParams {
            segment_blocks: 64,
            write_unit_blocks: 8,
            ..Default::default()
        };
        crate::format(&devs, &params, [7; 16], &[[1; 16]], 0).unwrap();
        let cfg = crate::EngineConfig::default();
        let (e, _) = crate::open(devs.clone(), cfg, crate::OpenMode::ReadWrite).unwrap();
        (e, devs)
    }

    /// Ids come new while the 16-bit space has them; then the ids of deleted
    /// volumes are given out again, but only once nothing refers to them: not a
    /// snapshot family that still shares a deleted member's blocks, not a
    /// segment still releasing them. A client still connected to the deleted
    /// volume (it names the volume by id and creation version) cannot write
    /// into the one that got its id, and a restart finds each volume's own data.
    #[test]
    fn ids_of_deleted_volumes_are_given_again_once_nothing_refers_to_them() {
        let (mut e, devs) = engine();
        let t = Token { conn: 9, handle: 1 };
        let call = |e: &mut crate::Engine, req| call_inline(e, t, req, 100_000).unwrap().result;
        let create = |name: &str| Request::CreateVolume {
            name: name.into(),
            size_bytes: 1 << 20,
        };
        let write = |volume, byte: u8| Request::Write {
            volume,
            offset: 0,
            data: vec![byte; 64 << 10],
            fua: false,
        };
        let id = |e: &crate::Engine, name: &str| e.shared().volume(name).unwrap().id;
        let ids = e.status().volume_ids_left;
        assert_eq!(ids, u16::MAX as u64);
        call(&mut e, create("a")).unwrap();
        let a = id(&e, "a");
        let a_created = e.shared().volume("a").unwrap().created_version();
        call(&mut e, write(a, 1)).unwrap();
        call(&mut e, Request::Flush).unwrap();
        call(
            &mut e,
            Request::CreateSnapshot {
                origin: "a".into(),
                name: "s".into(),
                writable: false,
            },
        )
        .unwrap();
        let snap = id(&e, "s");
        call(
            &mut e,
            Request::CreateSnapshot {
                origin: "s".into(),
                name: "k".into(),
                writable: true,
            },
        )
        .unwrap();
        // k holds no block of its own: only its family refers to its id.
        let k = id(&e, "k");
        call(&mut e, Request::DeleteVolume { name: "k".into() }).unwrap();
        call(&mut e, Request::Checkpoint).unwrap();
        // New ids first, as long as there are any.
        call(&mut e, create("b")).unwrap();
        assert!(id(&e, "b").0 > k.0);
        assert_eq!(
            e.status().volume_ids_left,
            ids - 4,
            "k's id is held by its family"
        );
        // The new ids run out: the lowest id nothing refers to is given again,
        // never k's while its family lives on.
        e.counters.next_volume_id = u16::MAX as u64;
        call(&mut e, Request::DeleteVolume { name: "b".into() }).unwrap();
        call(&mut e, Request::Checkpoint).unwrap();
        call(&mut e, create("c")).unwrap();
        let c = id(&e, "c");
        assert!(![a, snap, k].contains(&c), "{c} given while it is held");
        call(&mut e, Request::DeleteVolume { name: "s".into() }).unwrap();
        call(&mut e, Request::DeleteVolume { name: "a".into() }).unwrap();
        call(&mut e, Request::Checkpoint).unwrap();
        // The family is gone, but a's segment is still on its way back to the
        // free queue: s's id comes first.
        assert_eq!(e.shared().family_of(snap), a.0, "s was of a's family");
        call(&mut e, create("x")).unwrap();
        assert_eq!(id(&e, "x"), snap, "a's blocks are still being released");
        assert_eq!(
            e.shared().family_of(snap),
            snap.0,
            "x is a family of its own"
        );
        call(&mut e, Request::DeleteVolume { name: "x".into() }).unwrap();
        for _ in 0..4 {
            call(&mut e, Request::Flush).unwrap();
            call(&mut e, Request::Checkpoint).unwrap();
        }
        let left = e.status().volume_ids_left;
        call(&mut e, create("d")).unwrap();
        let d = id(&e, "d");
        assert_eq!(d, a, "the lowest id nothing refers to any more");
        assert_eq!(e.status().volume_ids_left, left - 1);
        // A client of the deleted volume names it by id and creation version.
        let d_created = e.shared().volume("d").unwrap().created_version();
        assert_ne!(d_created, a_created);
        e.submit_to(t, write(d, 9), a_created);
        let mut replies = Vec::new();
        e.drain_replies(&mut replies);
        let err = replies.pop().unwrap().result.unwrap_err().to_string();
        assert!(err.contains("deleted"), "{err}");
        e.submit_to(t, write(d, 2), d_created);
        crate::run_inline(&mut e);
        replies.clear();
        e.drain_replies(&mut replies);
        replies.pop().unwrap().result.unwrap();
        call(&mut e, Request::Flush).unwrap();
        let read = first_byte;
        assert_eq!((read(&e, "c"), read(&e, "d")), (0, 2));
        drop(e);
        let e = reopen(devs);
        assert_eq!((read(&e, "c"), read(&e, "d")), (0, 2));
        assert_eq!(id(&e, "d"), d);
        assert!(e.shared().volume("a").is_none() && e.shared().volume("s").is_none());
    }

    /// Once every id is held, a new volume is refused with an error that says
    /// why; before that, the lowest id nothing holds is given.
    #[test]
    fn a_new_volume_is_refused_when_every_id_is_held() {
        let max = u16::MAX as usize;
        let mut held = vec![true; max];
        assert_eq!(super::pick_id(&held, 7).unwrap().0, 7, "new ids first");
        let err = super::pick_id(&held, max as u64).unwrap_err().to_string();
        assert!(err.contains("all 65535 volume ids"), "{err}");
        assert_eq!(super::count_left(&held, max as u64), 0);
        held[max - 1] = false;
        held[40_000] = false;
        assert_eq!(super::pick_id(&held, max as u64).unwrap().0, 40_000);
        assert_eq!(super::count_left(&held, max as u64), 2);
    }

    /// `count_exclusive` runs after the report was taken, without the engine: a
    /// volume that took the id of one in the report meanwhile is not counted as
    /// that one.
    #[test]
    fn exclusive_bytes_are_not_taken_from_a_volume_that_reused_the_id() {
        let (mut e, _devs) = engine();
        let t = Token { conn: 9, handle: 1 };
        let call = |e: &mut crate::Engine, req| call_inline(e, t, req, 100_000).unwrap().result;
        let write = |volume, byte: u8| Request::Write {
            volume,
            offset: 0,
            data: vec![byte; 64 << 10],
            fua: false,
        };
        call(
            &mut e,
            Request::CreateVolume {
                name: "a".into(),
                size_bytes: 1 << 20,
            },
        )
        .unwrap();
        let a = e.shared().volume("a").unwrap().id;
        call(&mut e, write(a, 1)).unwrap();
        call(
            &mut e,
            Request::CreateSnapshot {
                origin: "a".into(),
                name: "s".into(),
                writable: true,
            },
        )
        .unwrap();
        let snap = e.shared().volume("s").unwrap().id;
        let mut report = e.status();
        // Both are deleted, and the ids run out: s's id is given to x.
        call(&mut e, Request::DeleteVolume { name: "s".into() }).unwrap();
        call(&mut e, Request::DeleteVolume { name: "a".into() }).unwrap();
        call(&mut e, Request::Checkpoint).unwrap();
        e.counters.next_volume_id = u16::MAX as u64;
        call(
            &mut e,
            Request::CreateVolume {
                name: "x".into(),
                size_bytes: 1 << 20,
            },
        )
        .unwrap();
        assert_eq!(e.shared().volume("x").unwrap().id, snap);
        call(&mut e, write(snap, 2)).unwrap();
        crate::status::count_exclusive(e.shared(), &mut report);
        let s = report.volumes.iter().find(|v| v.name == "s").unwrap();
        assert_eq!(s.exclusive_bytes, 0, "x's blocks counted as s's");
    }

    /// A deleted volume's streams are given to the volumes created after it:
    /// volumes that come and go for as long as the array runs do not make every
    /// flush, tick, checkpoint and recovery walk go through more streams.
    #[test]
    fn deleted_volumes_streams_are_given_to_new_volumes() {
        let (mut e, devs) = engine();
        let t = Token { conn: 9, handle: 1 };
        let call = |e: &mut crate::Engine, req| call_inline(e, t, req, 100_000).unwrap().result;
        let mut streams = 0;
        for round in 0..20u8 {
            let name = format!("v{round}");
            call(
                &mut e,
                Request::CreateVolume {
                    name: name.clone(),
                    size_bytes: 1 << 20,
                },
            )
            .unwrap();
            let v = e.shared().volume(&name).unwrap();
            call(
                &mut e,
                Request::Write {
                    volume: v.id,
                    offset: 0,
                    data: vec![round; 64 << 10],
                    fua: false,
                },
            )
            .unwrap();
            call(&mut e, Request::Flush).unwrap();
            if round == 0 {
                streams = e.log.streams.len();
            }
            assert_eq!(e.log.streams.len(), streams, "round {round}");
            if round < 19 {
                call(&mut e, Request::DeleteVolume { name }).unwrap();
                call(&mut e, Request::Checkpoint).unwrap();
            }
        }
        drop(e);
        let e = reopen(devs);
        assert_eq!(first_byte(&e, "v19"), 19);
        assert_eq!(e.log.streams.len(), streams);
    }
}
