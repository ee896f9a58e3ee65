//! Checkpoints: persisting the map and segment table so recovery replays only the tail.
//!
//! A checkpoint is *fuzzy*: it takes a version `C` and a snapshot of the small tables
//! (volumes, segment states, free queue, stream heads) at once, then streams the map
//! pages out through the metadata stream while the engine keeps serving. Map pages
//! are captured as they are when written, so they may already contain changes made
//! after `C`; that is harmless because recovery replays every unit with a version
//! above `C` and the ordering rule makes the replay idempotent (docs/design.md).
//!
//! When every payload block is sealed, a flush makes them durable, and the superblock
//! (both copies, every device) is rewritten to point at the new checkpoint. Only then
//! do the metadata segments of the previous checkpoint enter the release protocol.

use crate::engine::{Engine, Reply, SegState, Token};
use crate::error::EngineError;
use crate::map::{decode, encode_device, Entry};
use crate::types::{SegmentId, Version, BLOCK_SIZE};
use lamina_format::checkpoint::{
    meta_crc, CheckpointHeader, CheckpointMeta, PlacementRecord, SegmentRecord, SegmentState,
    SegmentTimes, StreamRecord, VolumeRecord,
};
use lamina_format::superblock::CheckpointRef;
use lamina_format::unit::{kind, put_record, RawRecord, NO_SEGMENT};

pub(crate) struct CkptState {
    /// Last committed generation.
    pub last_gen: u64,
    /// Generation that metadata segments opened now belong to.
    pub meta_gen: u64,
    writer: Option<Writer>,
    /// Waiting for the checkpoint in progress.
    waiters: Vec<Token>,
    /// Arrived while one was in progress; they need the next one.
    next_waiters: Vec<Token>,
    again: bool,
}

enum Phase {
    Writing,
    Syncing(u64),
    Superblock,
}

struct Writer {
    gen: u64,
    start_version: Version,
    header: Box<[u8; BLOCK_SIZE]>,
    meta: Vec<u8>,
    /// The volumes of the snapshot: pages are read from these maps even if the
    /// volume is deleted meanwhile.
    vols: Vec<std::sync::Arc<crate::shared::VolumeShared>>,
    /// (index into `vols`, page) in payload order.
    pages: Vec<(usize, u32)>,
    next: u64,
    total: u64,
    first: Option<(u32, u64)>,
    phase: Phase,
}

impl CkptState {
    pub(crate) fn new(last_gen: u64) -> Self {
        CkptState {
            last_gen,
            meta_gen: last_gen,
            writer: None,
            waiters: Vec::new(),
            next_waiters: Vec::new(),
            again: false,
        }
    }

    pub(crate) fn is_idle(&self) -> bool {
        self.writer.is_none() && !self.again
    }

    /// Generation of the first checkpoint whose snapshot will see a change made now.
    /// A checkpoint is being written (its tables were taken; its map pages are
    /// read from the live maps as they are written).
    pub(crate) fn in_progress(&self) -> bool {
        self.writer.is_some()
    }

    pub(crate) fn target_generation(&self) -> u64 {
        if self.writer.is_some() {
            self.last_gen + 2
        } else {
            self.last_gen + 1
        }
    }

    pub(crate) fn fail_waiters(&mut self, replies: &mut Vec<Reply>, msg: &str) {
        for token in self.waiters.drain(..).chain(self.next_waiters.drain(..)) {
            replies.push(Reply {
                token,
                result: Err(EngineError::Failed(msg.to_string())),
                buf: None,
                status: None,
            });
        }
        self.writer = None;
        self.again = false;
    }
}

fn state_of(s: SegState) -> SegmentState {
    match s {
        SegState::Free => SegmentState::Free,
        SegState::Open => SegmentState::Open,
        SegState::Meta => SegmentState::Checkpoint,
        SegState::Closing
        | SegState::Closed
        | SegState::Draining
        | SegState::ReleaseReady
        | SegState::Releasing => SegmentState::Closed,
    }
}

impl Engine {
    /// Starts a checkpoint (or joins / queues behind the one in progress).
    pub(crate) fn start_checkpoint(&mut self, waiter: Option<Token>) {
        if let Some(f) = self.failed.clone() {
            if let Some(t) = waiter {
                self.reply(t, Err(EngineError::Failed(f)), None);
            }
            return;
        }
        if self.ckpt.writer.is_some() {
            // The snapshot is already taken; the caller's change needs the next one.
            self.ckpt.next_waiters.extend(waiter);
            self.ckpt.again = true;
            return;
        }
        self.ckpt.waiters.extend(waiter);
        let gen = self.ckpt.last_gen + 1;
        // The metadata stream moves to a fresh segment: everything of this
        // generation lives in segments opened from here on.
        let ms = self.log.meta_stream;
        self.close_segment(ms);
        self.ckpt.meta_gen = gen;
        let start_version = self.take_version();

        let mut volumes = Vec::new();
        let mut placement = Vec::new();
        let mut policies = Vec::new();
        let mut pages = Vec::new();
        let mut vols = Vec::new();
        for v in self
            .volumes
            .iter()
            .flatten()
            .filter(|v| v.deleting.is_none())
        {
            let map = &v.shared.map;
            let used = map.used_pages();
            pages.extend(used.iter().map(|&p| (vols.len(), p)));
            vols.push(v.shared.clone());
            volumes.push(VolumeRecord {
                id: v.shared.id.0,
                name: v.shared.name().to_string(),
                size_bytes: v.recorded_size(),
                created_version: v.created_version.0,
                user_blocks_written: v.user_blocks,
                gc_blocks_relocated: v.gc_blocks,
                media_blocks_written: v.media_blocks,
                pages: used,
            });
            // Every volume: the name records what "auto" resolved to.
            placement.push(PlacementRecord {
                volume: v.shared.id.0,
                classifier: v.classifier.name().into(),
                state: v.classifier.save(),
            });
            let state = v.policy.save();
            if !state.is_empty() {
                policies.push(PlacementRecord {
                    volume: v.shared.id.0,
                    classifier: v.policy.name().into(),
                    state,
                });
            }
        }
        // What the maps take in the checkpoints: the pages this one writes (see
        // `Space::maps_extra`), and those that requests admitted but not yet
        // done will start.
        self.space
            .set_map_pages(pages.len() as u64 + self.admitted_unused_pages());
        // Segments whose release record is already sealed will join the free queue
        // when that record is synced, possibly after this checkpoint's version; a
        // walk from this checkpoint would not see their (older) release records. So
        // the snapshot lists them at the tail of the free queue, in the order the
        // engine will append them. Their content is dead either way: they emptied
        // before their release record was written.
        let mut free_queue: Vec<u32> = self.segments.all_free().collect();
        free_queue.extend(self.segments.releasing.iter().copied());
        let segments = self
            .segments
            .segs
            .iter()
            .map(|s| SegmentRecord {
                state: if s.state == SegState::Releasing {
                    SegmentState::Free
                } else {
                    state_of(s.state)
                },
                stream_kind: s.kind as u8,
                stream_class: s.class,
                has_summary: s.has_summary as u8,
                volume: s.volume,
                write_ptr: s.write_ptr,
                data_blocks: s.data_blocks,
                incarnation: s.incarnation.0,
                close_version: s.close_version.0,
                erase_count: s.erase_count,
            })
            .collect();
        let segment_times = self
            .segments
            .segs
            .iter()
            .map(|s| SegmentTimes {
                born: s.born,
                closed: s.closed,
                origins: s.origins.as_ref().map(|o| o.mean),
            })
            .collect();
        let streams = self
            .log
            .streams
            .iter()
            .map(|s| StreamRecord {
                kind: s.kind as u8,
                class: s.class,
                volume: s.volume,
                segment: s.seg.unwrap_or(NO_SEGMENT),
                next_segment: s.next_seg.unwrap_or(NO_SEGMENT),
            })
            .collect();
        self.counters.member_blocks = match &self.shared.striped {
            // The striped device's members count their own writes (a mirrored
            // cache's); the rest are JBOD members.
            Some(st) => {
                let states = st.member_states();
                (0..self.geo.members)
                    .map(|i| match self.geo.striped_index(i) {
                        Some(m) => states[m].bytes_written / 4096,
                        None => self.device_blocks.get(i).copied().unwrap_or(0),
                    })
                    .collect()
            }
            None => self.device_blocks.clone(),
        };
        let meta = CheckpointMeta {
            volumes,
            segments,
            free_queue,
            streams,
            counters: self.counters.to_vec(),
            segment_times,
            placement,
            policies,
            discarded: self.segments.discarded_runs(),
            lineage: self.lineage.records(),
            skipped: Vec::new(),
        }
        .encode();
        let header = CheckpointHeader {
            array_id: self.geo.array_id,
            generation: gen,
            start_version: start_version.0,
            payload_blocks: 1
                + (meta.len() as u64).div_ceil(BLOCK_SIZE as u64)
                + pages.len() as u64,
            meta_bytes: meta.len() as u64,
            map_pages: pages.len() as u64,
            meta_crc: meta_crc(&meta),
        };
        self.ckpt.writer = Some(Writer {
            gen,
            start_version,
            total: header.payload_blocks,
            header: header.encode(),
            meta,
            vols,
            pages,
            next: 0,
            first: None,
            phase: Phase::Writing,
        });
        self.blocks_since_checkpoint = 0;
        tracing::debug!(
            generation = gen,
            blocks = header.payload_blocks,
            "checkpoint started"
        );
    }

    /// Content of payload block `index` of the checkpoint being written.
    fn checkpoint_block(&self, w: &Writer, index: u64, out: &mut [u8; BLOCK_SIZE]) {
        let meta_blocks = (w.meta.len() as u64).div_ceil(BLOCK_SIZE as u64);
        if index == 0 {
            out.copy_from_slice(&w.header[..]);
        } else if index <= meta_blocks {
            out.fill(0);
            let o = (index as usize - 1) * BLOCK_SIZE;
            let n = (w.meta.len() - o).min(BLOCK_SIZE);
            out[..n].copy_from_slice(&w.meta[o..o + n]);
        } else {
            let (vol, page) = w.pages[(index - 1 - meta_blocks) as usize];
            let mut entries = [0u32; crate::map::PAGE_ENTRIES];
            w.vols[vol].map.page(page as u64, &mut entries);
            for (i, e) in entries.iter().enumerate() {
                // Blocks still in the write buffer are recorded at the place they
                // are being written to; the commit flush makes that place durable.
                let e = match decode(*e) {
                    Entry::Buffer(slot) => encode_device(self.slot_pba(slot)),
                    _ => *e,
                };
                out[i * 4..i * 4 + 4].copy_from_slice(&e.to_le_bytes());
            }
        }
    }

    pub(crate) fn progress_checkpoint(&mut self) {
        if self.failed.is_some() {
            return;
        }
        self.maybe_renew_lease();
        if self.ckpt.writer.is_none() {
            if self.ckpt.again {
                self.ckpt.again = false;
                let waiters = std::mem::take(&mut self.ckpt.next_waiters);
                self.ckpt.waiters.extend(waiters);
                self.start_checkpoint(None);
            } else {
                let map_pages = self.map_pages();
                let due = self.cfg.checkpoint_interval_blocks.max(16 * map_pages);
                if self.blocks_since_checkpoint >= due
                    && !self.shutting_down
                    && !self.hold_checkpoints
                {
                    self.start_checkpoint(None);
                }
            }
        }
        let Some(w) = self.ckpt.writer.take() else {
            return;
        };
        let mut w = w;
        match w.phase {
            Phase::Writing => {
                let ms = self.log.meta_stream;
                let mut budget = 2 * self.geo.unit_data_max as u64;
                let mut block = [0u8; BLOCK_SIZE];
                while w.next < w.total && budget > 0 {
                    if self.ensure_unit(ms, 1, 0).is_err() {
                        break;
                    }
                    self.checkpoint_block(&w, w.next, &mut block);
                    if w.first.is_none() {
                        let seg = self.log.streams[ms].seg.unwrap();
                        w.first = Some((seg, self.segments.segs[seg as usize].incarnation.0));
                    }
                    self.append_checkpoint_block(w.gen, w.next, &block);
                    w.next += 1;
                    budget -= 1;
                }
                if w.next == w.total {
                    let gen = self.start_flush();
                    w.phase = Phase::Syncing(gen);
                }
            }
            Phase::Syncing(gen) => {
                if self.durability.synced_gen >= gen && !self.sbw.busy() {
                    let (seg, inc) = w.first.expect("checkpoint without blocks");
                    self.sb.checkpoint = Some(CheckpointRef {
                        version: w.start_version.0,
                        generation: w.gen,
                        first_segment: seg,
                        first_incarnation: inc,
                        payload_blocks: w.total,
                        root_crc: lamina_format::crc32c(&w.header[..]),
                    });
                    w.phase = Phase::Superblock;
                    self.ckpt.writer = Some(w);
                    self.start_superblock_write();
                    return;
                }
            }
            Phase::Superblock => {}
        }
        self.ckpt.writer = Some(w);
    }

    fn append_checkpoint_block(&mut self, gen: u64, index: u64, data: &[u8; BLOCK_SIZE]) {
        let h = self.geo.header_blocks as u32;
        let ms = self.log.meta_stream;
        let st = &mut self.log.streams[ms];
        let u = st.unit.as_mut().unwrap();
        // SAFETY: metadata buffers are never named by map entries.
        unsafe { self.shared.buffers.blocks_mut(u.buf, h + u.data, 1) }.copy_from_slice(data);
        let hdr = unsafe { self.shared.buffers.blocks_mut(u.buf, 0, h) };
        let mut r = RawRecord::checkpoint(index, lamina_format::crc32c(data));
        r.c = gen as u16;
        debug_assert_eq!(r.kind, kind::CHECKPOINT);
        put_record(hdr, u.data as usize, &r);
        u.data += 1;
    }

    /// Called when a flush generation is synced.
    pub(crate) fn ckpt_synced(&mut self) {
        // The state machine advances in progress_checkpoint.
    }

    /// Called when a superblock update finished.
    pub(crate) fn sb_done(&mut self) {
        let is_ckpt = matches!(
            self.ckpt.writer.as_ref().map(|w| &w.phase),
            Some(Phase::Superblock)
        );
        if !is_ckpt {
            return;
        }
        let w = self.ckpt.writer.take().unwrap();
        self.ckpt.last_gen = w.gen;
        self.durable_ckpt_version = w.start_version;
        self.counters.checkpoints += 1;
        self.volumes_committed(w.gen);
        // Metadata segments of earlier generations are superseded now.
        let ms = &self.log.streams[self.log.meta_stream];
        let keep = [ms.seg, ms.next_seg];
        for seg in 0..self.segments.segs.len() {
            let s = &self.segments.segs[seg];
            if s.state == SegState::Meta && s.gen < w.gen && !keep.contains(&Some(seg as u32)) {
                self.segments.superseded(seg as u32);
                self.shared.set_written_end(SegmentId(seg as u32), 0);
            }
        }
        for t in std::mem::take(&mut self.ckpt.waiters) {
            self.reply(t, Ok(()), None);
        }
        tracing::debug!(generation = w.gen, "checkpoint committed");
    }
}
