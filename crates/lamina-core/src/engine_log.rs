//! The log writer: streams, their open units and segments, and the unit buffers.
//!
//! Every block the engine writes (user writes, GC moves, trims and releases, the
//! metadata stream's checkpoints) goes through a stream: appended to the stream's
//! open unit in a write buffer, sealed into a unit (version, dead records marked,
//! header checksummed, rows padded), written at the stream's write pointer, and, when
//! the segment is full, closed with a summary. [`LogState`] is what the log writer
//! owns; the methods are on the engine because appending moves map entries and live
//! counts that other owners keep.

use crate::engine::{Blocked, Engine, Purpose, Want, ALLOC_WINDOW};
use crate::geometry::Tier;
use crate::io::IoKind;
use crate::map::{decode, encode_buffer, encode_device, Entry, UNMAPPED};
use crate::segments::{Seg, SegState};
use crate::types::{Lba, Pba, RecordAddr, SegmentId, Version, VolumeId, BLOCK_SIZE};
use crate::unit_buffers::{BufState, UnitBuffers};
use lamina_format::summary::SummaryHeader;
use lamina_format::unit::{
    kind, put_record, record_at, RawRecord, StreamKind, UnitHeader, NO_SEGMENT,
};

/// A stream's unit being filled: its buffer, where it goes, what it holds so far.
pub(crate) struct OpenUnit {
    pub buf: u32,
    pub offset: u32,
    pub data: u32,
    pub max_data: u32,
    pub opened_ms: u64,
    /// Its volume's time when it was opened (recorded in its header).
    pub volume_time: u64,
    /// GC units: sum and count of the user-write times of the blocks moved in.
    pub origin_sum: u128,
    pub origin_n: u32,
}

/// One sequence of segments written in order: a volume's user or GC heat class, or
/// the metadata stream.
pub(crate) struct Stream {
    pub kind: StreamKind,
    pub class: u8,
    pub volume: u16,
    pub seg: Option<u32>,
    /// Metadata stream only: the segment it continues in.
    pub next_seg: Option<u32>,
    pub write_ptr: u32,
    pub unit: Option<OpenUnit>,
    /// Non-data records (trims, releases) for the open unit.
    pub extras: Vec<RawRecord>,
    /// Records of the sealed units of the open segment, for its summary.
    pub summary: Vec<RawRecord>,
    /// Blocks appended so far, and the count at the last idle sweep.
    pub appended: u64,
    pub appended_at_sweep: u64,
    /// GC stream of blocks read since they were written (geometry-aware
    /// placement puts its segments outer).
    pub read_hot: bool,
    /// User stream that takes the short units flushes would otherwise write into
    /// sequential zones; its segments are conventional zones (SALSA 3.2).
    pub small: bool,
}

impl Stream {
    pub(crate) fn new(kind: StreamKind, class: u8, volume: u16) -> Self {
        Stream {
            kind,
            class,
            volume,
            seg: None,
            next_seg: None,
            write_ptr: 0,
            unit: None,
            extras: Vec::new(),
            appended: 0,
            appended_at_sweep: 0,
            read_hot: false,
            small: false,
            summary: Vec::new(),
        }
    }
}

/// What the log writer owns.
pub(crate) struct LogState {
    pub streams: Vec<Stream>,
    /// The metadata stream's index in `streams`.
    pub meta_stream: usize,
    /// Which unit buffer is free, open, in flight or waiting for readers.
    pub bufs: UnitBuffers,
    /// Open data segments that hold half a segment of dead blocks: closed at the
    /// next progress so that GC can reclaim them (a class that receives little
    /// would otherwise keep its garbage out of reach for ever).
    pub stale_open: Vec<u32>,
    /// User blocks written at the last sweep for idle open segments.
    pub last_idle_sweep: u64,
    /// Slots of deleted volumes' streams, closed, for new volumes' streams: the
    /// flush, the tick, the checkpoint and recovery's walk each go through every
    /// stream, and volumes come and go for as long as the array runs.
    pub retired: Vec<usize>,
}

impl LogState {
    /// The metadata stream alone, over `buffers` unit buffers.
    pub(crate) fn new(buffers: u32) -> Self {
        LogState {
            streams: vec![Stream::new(StreamKind::Meta, 0, u16::MAX)],
            meta_stream: 0,
            bufs: UnitBuffers::new(buffers),
            stale_open: Vec::new(),
            last_idle_sweep: 0,
            retired: Vec::new(),
        }
    }

    /// Adds `st`, in the slot of a retired stream that holds nothing any more
    /// where there is one; returns its index.
    pub(crate) fn add_stream(&mut self, st: Stream) -> usize {
        while let Some(s) = self.retired.pop() {
            let old = &self.streams[s];
            if old.seg.is_none()
                && old.next_seg.is_none()
                && old.unit.is_none()
                && old.extras.is_empty()
                && old.kind != StreamKind::Meta
            {
                self.streams[s] = st;
                return s;
            }
            // Not closed yet (it cannot happen: a deleted volume's streams are
            // closed as its deletion commits); left out for good.
            debug_assert!(false, "retired stream {s} still holds something");
        }
        self.streams.push(st);
        self.streams.len() - 1
    }
}

impl Engine {
    /// Drops one reference held by map entry `old` (the block moved or went away).
    pub(crate) fn unref(&mut self, old: u32) {
        let seg = match decode(old) {
            Entry::Device(pba) => self.geo.split(pba).0 .0,
            Entry::Buffer(slot) => self.slot_segment(slot),
            Entry::Unmapped | Entry::Bad => return,
        };
        let half = self.geo.data_blocks_per_segment() / 2;
        self.segments.drop_valid(seg);
        let s = &mut self.segments.segs[seg as usize];
        if let Some(v) = self.volumes.get(s.volume as usize).and_then(|v| v.as_ref()) {
            s.last_invalidated = v.user_blocks;
        }
        if s.valid == 0 && s.state == SegState::Closed {
            self.segment_emptied(seg);
        } else if s.state == SegState::Open
            && s.data_blocks.saturating_sub(s.valid) as u64 >= half.max(1)
            && self.log.stale_open.last() != Some(&seg)
        {
            self.log.stale_open.push(seg);
        }
    }

    /// The segment a buffer slot will be (or was) written to.
    fn slot_segment(&self, slot: u32) -> u32 {
        let (buf, _) = self.shared.buffers.unslot(slot);
        match self.log.bufs.state(buf) {
            BufState::Open { stream } => self.log.streams[stream as usize].seg.unwrap(),
            BufState::InFlight { seg, .. } => seg,
            s => panic!("map names slot {slot} of buffer in state {s:?}"),
        }
    }

    /// The physical block a buffer slot will be (or was) written to.
    pub(crate) fn slot_pba(&self, slot: u32) -> Pba {
        let (buf, block) = self.shared.buffers.unslot(slot);
        let (seg, offset) = match self.log.bufs.state(buf) {
            BufState::Open { stream } => {
                let st = &self.log.streams[stream as usize];
                (st.seg.unwrap(), st.unit.as_ref().unwrap().offset)
            }
            BufState::InFlight { seg, offset, .. } => (seg, offset),
            s => panic!("map names slot {slot} of buffer in state {s:?}"),
        };
        self.geo.pba(SegmentId(seg), offset + block)
    }

    /// Appends one data block to a stream's open unit (which must have room) and
    /// points the map at it. `crc` may be passed when already known.
    pub(crate) fn append_data(
        &mut self,
        s: usize,
        volume: VolumeId,
        lba: Lba,
        data: Option<&[u8]>,
        crc: Option<u32>,
    ) {
        let (slot, seg) = self.put_block(s, volume, lba, data, crc);
        let vol = self.vol_mut(volume);
        let old = vol.shared.map.load(lba);
        vol.shared.map.store(lba, encode_buffer(slot));
        if old == UNMAPPED {
            vol.live_blocks += 1;
            self.space.mapped(1);
        }
        self.segments.add_valid(seg);
        if self.shared_elsewhere(volume, lba, old) {
            // A snapshot or clone still maps the old block: it stays, and the new
            // one is a block more.
            self.space.mapped(1);
        } else {
            self.unref(old);
        }
    }

    /// Moves a block (GC) that every volume of `referrers` maps at `lba` as `old`:
    /// one copy, a DATA record naming the first and an ALIAS record for each other
    /// (room for them was asked of [`Engine::ensure_unit`]), every map pointed at it.
    pub(crate) fn relocate_data(
        &mut self,
        s: usize,
        referrers: &[VolumeId],
        lba: Lba,
        data: Option<&[u8]>,
        crc: Option<u32>,
        old: u32,
    ) {
        let (slot, seg) = self.put_block(s, referrers[0], lba, data, crc);
        let index = self.log.streams[s].unit.as_ref().expect("put_block").data - 1;
        for (k, &r) in referrers.iter().enumerate() {
            let m = &self.vol(r).shared.map;
            debug_assert_eq!(m.load(lba), old);
            m.store(lba, encode_buffer(slot));
            if k > 0 {
                self.log.streams[s]
                    .extras
                    .push(RawRecord::alias(r.0, lba.0, index));
            }
        }
        self.segments.add_valid(seg);
        self.unref(old);
    }

    /// Writes one data block and its record into stream `s`'s open unit: the
    /// block's buffer slot and its segment. The caller points maps at it.
    fn put_block(
        &mut self,
        s: usize,
        volume: VolumeId,
        lba: Lba,
        data: Option<&[u8]>,
        crc: Option<u32>,
    ) -> (u32, u32) {
        let h = self.geo.header_blocks as u32;
        let st = &mut self.log.streams[s];
        let u = st.unit.as_mut().expect("append without an open unit");
        let block = h + u.data;
        let crc = match data {
            Some(data) => {
                // SAFETY: the slot is beyond every published slot of this buffer.
                unsafe { self.shared.buffers.blocks_mut(u.buf, block, 1) }.copy_from_slice(data);
                crc.unwrap_or_else(|| lamina_format::crc32c(data))
            }
            // Metadata-only (simulation): the record is all there is.
            None => crc.unwrap_or(0),
        };
        // SAFETY: header blocks are never read by clients.
        let hdr = unsafe { self.shared.buffers.blocks_mut(u.buf, 0, h) };
        put_record(hdr, u.data as usize, &RawRecord::data(volume.0, lba.0, crc));
        let slot = self.shared.buffers.slot(u.buf, block);
        u.data += 1;
        let seg = st.seg.unwrap();
        st.appended += 1;
        self.durability.unsynced_writes = true;
        self.blocks_since_checkpoint += 1;
        (slot, seg)
    }

    /// Makes sure stream `s` has an open unit with room for `data` more data blocks and
    /// `extras` more non-data records.
    pub(crate) fn ensure_unit(
        &mut self,
        s: usize,
        data: u32,
        extras: usize,
    ) -> Result<(), Blocked> {
        let records = self.geo.unit_records as usize;
        if let Some(u) = &self.log.streams[s].unit {
            let used = u.data as usize + self.log.streams[s].extras.len();
            // Room is kept for the dead blocks that pad a unit to whole rows.
            let pad = self.geo.row_blocks as usize - 1;
            if u.data + data <= u.max_data && used + data as usize + extras + pad <= records {
                return Ok(());
            }
            self.seal_unit(s);
        }
        let h = self.geo.header_blocks as u32;
        assert!(
            data as usize + extras + self.geo.row_blocks as usize - 1 <= records,
            "a unit cannot hold {data} blocks and {extras} records"
        );
        // The segment must hold a header and at least one data block (or just a
        // header for a records-only unit).
        let need = self.geo.round_to_row(h + data.max(1));
        let full = {
            let st = &self.log.streams[s];
            st.seg.is_none() || st.write_ptr + need > self.geo.data_end
        };
        if full {
            if self.log.streams[s].seg.is_some() {
                self.close_segment(s);
            }
            self.open_segment(s)?;
        }
        let buf = self.alloc_buffer(s)?;
        let volume_time = self.volume_time(self.log.streams[s].volume);
        let st = &mut self.log.streams[s];
        let room = self.geo.data_end - st.write_ptr - h;
        st.unit = Some(OpenUnit {
            buf,
            offset: st.write_ptr,
            data: 0,
            max_data: room.min(self.geo.unit_data_max),
            opened_ms: self.now_ms,
            volume_time,
            origin_sum: 0,
            origin_n: 0,
        });
        Ok(())
    }

    fn alloc_buffer(&mut self, requester: usize) -> Result<u32, Blocked> {
        if let Some(b) = self.log.bufs.open(requester as u32) {
            return Ok(b);
        }
        // Every buffer is open in some stream: seal the fullest other one so that
        // its write frees a buffer (otherwise nothing would ever complete).
        if !self.log.bufs.any_coming_back() {
            let victim = (0..self.log.streams.len())
                .filter(|&s| s != requester)
                .filter_map(|s| self.log.streams[s].unit.as_ref().map(|u| (u.data, s)))
                .max();
            if let Some((_, s)) = victim {
                self.seal_unit(s);
            }
        }
        Err(Blocked)
    }

    /// Opens a fresh segment for stream `s` from the free queue.
    pub(crate) fn open_segment(&mut self, s: usize) -> Result<(), Blocked> {
        let kind = self.log.streams[s].kind;
        // Zoned devices: a new zone only while the device's open limit allows (a
        // closing segment frees its zone when its last write lands). The metadata
        // stream's next segment may be conventional and need no zone, and so is
        // every segment of a cache tier.
        let needs_zone = match (kind, self.log.streams[s].next_seg) {
            (StreamKind::Meta, Some(next)) => !self.seg_conventional(next),
            _ => self.holds_zones(s),
        };
        if needs_zone && !self.zones.may_open() {
            return Err(Blocked);
        }
        let seg = if kind == StreamKind::Meta {
            // The metadata stream always knows its next segment, so a reader of a
            // checkpoint can follow it; it reserves a new one as it moves on.
            let seg = match self.log.streams[s].next_seg.take() {
                Some(seg) => seg,
                None => self.pop_free_for(Want::meta()).ok_or(Blocked)?,
            };
            match self.pop_free_for(Want::meta()) {
                Some(next) => {
                    self.segments.segs[next as usize].state = SegState::Meta;
                    self.segments.segs[next as usize].gen = self.ckpt.meta_gen;
                    self.log.streams[s].next_seg = Some(next);
                }
                None => {
                    self.log.streams[s].next_seg = Some(seg);
                    return Err(Blocked);
                }
            }
            seg
        } else {
            // With a cache tier, user streams write only into it: the capacity
            // tier's floor is then compaction's to keep, and the cache's last
            // segment may go to a user stream (compaction needs none of it).
            let tier = self.stream_tier(kind);
            let floor = match (kind, tier) {
                (_, Tier::Cache) => 0,
                (StreamKind::User, _) => self.user_floor(),
                _ => 1,
            };
            if self.segments.free_in(tier).len() <= floor {
                return Err(Blocked);
            }
            // Geometry-aware: the read-hot GC stream's segments go outer, other
            // GC streams' inner; fresh writes (read heat unknown) take the queue's
            // order.
            let outer = (kind == StreamKind::Gc).then_some(self.log.streams[s].read_hot);
            let want = Want {
                outer,
                conventional: Some(self.log.streams[s].small),
                tier,
            };
            if self.log.streams[s].small && !self.conventional_free() {
                // The small stream holds no zone: without a conventional segment
                // at hand, flushes write their short units in place instead.
                return Err(Blocked);
            }
            self.pop_free_for(want).ok_or(Blocked)?
        };

        let incarnation = self.take_version();
        let born = self.volume_time(self.log.streams[s].volume);
        let st = &mut self.log.streams[s];
        let erase_count = self.segments.segs[seg as usize].erase_count + 1;
        self.segments.segs[seg as usize] = Seg {
            born,
            last_invalidated: born,
            origins: crate::segments::Origins::for_segment(kind, born),
            state: if kind == StreamKind::Meta {
                SegState::Meta
            } else {
                SegState::Open
            },
            kind,
            class: st.class,
            volume: st.volume,
            incarnation,
            erase_count,
            gen: self.ckpt.meta_gen,
            ..Seg::free(erase_count)
        };
        self.segments.opened(seg);
        self.shared.reset_segment(SegmentId(seg), incarnation);
        st.seg = Some(seg);
        st.write_ptr = 0;
        st.summary.clear();
        self.zones.opened(seg);
        Ok(())
    }

    /// A conventional segment is among the free ones allocation may take.
    fn conventional_free(&self) -> bool {
        (0..self.segments.free.len().min(ALLOC_WINDOW))
            .any(|i| self.seg_conventional(self.segments.free[i]))
    }

    /// The tier a stream of `kind` writes into: with a cache tier, user writes go
    /// there and everything else (GC, compaction, checkpoints) to the capacity
    /// tier.
    pub(crate) fn stream_tier(&self, kind: StreamKind) -> Tier {
        if kind == StreamKind::User && self.geo.tiered() {
            Tier::Cache
        } else {
            Tier::Capacity
        }
    }

    /// Stream `s` takes segments that hold a zone open on a zoned array (the
    /// metadata stream's may not; see `open_segment`): not the small stream's,
    /// which are conventional, nor a cache tier's.
    pub(crate) fn holds_zones(&self, s: usize) -> bool {
        let st = &self.log.streams[s];
        !st.small && self.stream_tier(st.kind) == Tier::Capacity
    }

    /// Segment `seg` lies in a conventional zone of a zoned device.
    pub(crate) fn seg_conventional(&self, seg: u32) -> bool {
        self.zones.conventional(seg)
    }

    /// Takes a segment of the free queue, waiting out any last readers, for a
    /// stream that wants a kind of segment (see
    /// [`Want`]), chosen among the first [`ALLOC_WINDOW`] of the queue (recovery's
    /// walk of the free queue allows for that window).
    fn pop_free_for(&mut self, want: Want) -> Option<u32> {
        loop {
            let seg = self.take_free(want)?;
            if !self.zones.holds_zone(seg) {
                return Some(seg);
            }
            // The zone still holds the segment's previous incarnation (or what a
            // crashed run left): rewind it before the first write. No write of
            // the old incarnation is in flight (it was released) and no reader
            // holds it (pins were waited out). A zone that cannot be reset
            // (offline, read-only) is set aside; it returns to the free queue at
            // the next start and is tried again.
            let (dev, off) = self.geo.locate(SegmentId(seg), 0);
            match self.shared.devices[dev].reset_zone(off) {
                Ok(()) => return Some(seg),
                Err(e) => {
                    tracing::error!("segment {seg} set aside: its zone cannot be reset: {e}");
                    self.segments.quarantined += 1;
                }
            }
        }
    }

    /// Takes a free segment (see [`Engine::pop_free_for`]) and waits out its last
    /// readers.
    fn take_free(&mut self, want: Want) -> Option<u32> {
        let free = self.segments.free_in(want.tier);
        // A segment being discarded is not taken: the discard could land on what
        // is written next. (If the whole window is being discarded, which takes a
        // free queue of at most `MAX_DISCARDS`, the stream waits for a discard to
        // end; `discard_idle` leaves the head of the queue alone.)
        //
        // Nor is one a reader still reads (a pin that outlived the segment's
        // release): the wait below would last as long as that read, and a
        // connection that reads through its own ring may be the very thread running
        // this engine, with the read in flight until it reaps it. Pins taken after
        // this look are a reader's check that finds the map moved on (a free
        // segment holds nothing mapped), and end at once.
        let window = (0..free.len().min(ALLOC_WINDOW)).filter(|&i| {
            let seg = free[i];
            !self.segments.segs[seg as usize].discarding
                && !self.shared.segment_pinned(SegmentId(seg))
        });
        // Segments of the kind the stream does not want come last.
        let miss = |i: usize| {
            want.conventional
                .is_some_and(|c| self.seg_conventional(free[i]) != c) as u8
        };
        let offset = |i: usize| self.geo.locate(SegmentId(free[i]), 0).1;
        let i = if let Some(outer) = want.outer.filter(|_| self.geometry_aware) {
            window.min_by_key(|&i| {
                (
                    miss(i),
                    if outer {
                        offset(i)
                    } else {
                        u64::MAX - offset(i)
                    },
                )
            })?
        } else if self.geo.layout == lamina_format::superblock::Layout::Jbod && self.geo.members > 1
        {
            // Wear levelling across JBOD members: among the next free segments,
            // take one on the member with the least written per byte of capacity.
            window.min_by(|&a, &b| {
                let wa = self.member_wear(self.geo.locate(SegmentId(free[a]), 0).0);
                let wb = self.member_wear(self.geo.locate(SegmentId(free[b]), 0).0);
                miss(a).cmp(&miss(b)).then(wa.total_cmp(&wb))
            })?
        } else {
            window.min_by_key(|&i| (miss(i), i))?
        };
        let seg = self.segments.take_free_at(want.tier, i)?;
        self.shared.set_segment_free(seg, false);
        while self.shared.segment_pinned(SegmentId(seg)) {
            std::thread::yield_now();
        }
        Some(seg)
    }

    /// Seals stream `s`'s open unit and queues its write.
    pub(crate) fn seal_unit(&mut self, s: usize) {
        let Some(mut u) = self.log.streams[s].unit.take() else {
            return;
        };
        let h = self.geo.header_blocks;
        if u.data == 0 && self.log.streams[s].extras.is_empty() {
            self.log.bufs.release_empty(u.buf);
            return;
        }
        let version = self.take_version();
        let seg = self.log.streams[s].seg.unwrap();
        // SAFETY: header blocks are never read by clients; the engine owns them.
        let hdr = unsafe { self.shared.buffers.blocks_mut(u.buf, 0, h as u32) };
        // Records overwritten while the unit was open are marked dead, so that
        // recovery never resurrects them (see docs/design.md, "Ordering rule").
        let mut live = 0u32;
        for i in 0..u.data as usize {
            let mut r = record_at(hdr, i);
            if r.kind == kind::DATA {
                let slot = self.shared.buffers.slot(u.buf, h as u32 + i as u32);
                // The record names a volume that maps the block: the one it was
                // written for, or (snapshots and clones) another of its family.
                match self.holder(VolumeId(r.volume()), r.block(), encode_buffer(slot)) {
                    Some(v) => {
                        live += 1;
                        if v.0 != r.volume() {
                            r = RawRecord::data(v.0, r.lba(), r.b);
                            put_record(hdr, i, &r);
                        }
                    }
                    None => {
                        r.kind = kind::DEAD;
                        put_record(hdr, i, &r);
                    }
                }
            }
        }
        // Aliases (GC moving a shared block) likewise name only volumes that
        // still map the block, and never the one its DATA record names.
        if self.log.streams[s]
            .extras
            .iter()
            .any(|r| r.kind == kind::ALIAS)
        {
            let mut extras = std::mem::take(&mut self.log.streams[s].extras);
            extras.retain(|a| {
                a.kind != kind::ALIAS || {
                    let slot = self.shared.buffers.slot(u.buf, h as u32 + a.b);
                    let named = record_at(hdr, a.b as usize);
                    named.kind == kind::DATA
                        && named.volume() != a.volume()
                        && self.maps(VolumeId(a.volume()), a.block(), encode_buffer(slot))
                }
            });
            self.log.streams[s].extras = extras;
        }
        // Striped layouts: pad the unit to whole rows with dead zero blocks, so that
        // the row's parity is computed from this write alone (no read-modify-write).
        let end = h as u32 + u.data;
        let pad = self.geo.round_to_row(end) - end;
        if pad > 0 {
            // SAFETY: slots beyond the unit's data, owned by the engine.
            unsafe { self.shared.buffers.blocks_mut(u.buf, end, pad) }.fill(0);
            let mut r = RawRecord::data(0, 0, self.zero_block_crc);
            r.kind = kind::DEAD;
            for i in 0..pad {
                put_record(hdr, (u.data + i) as usize, &r);
            }
            u.data += pad;
            self.counters.pad_blocks += pad as u64;
        }
        // What recovery dates the segment by (placement ages) if the checkpoint
        // does not have it.
        let (volume_time, origin) = match self.log.streams[s].kind {
            StreamKind::Meta => (0, 0),
            _ => (
                self.volume_time(self.log.streams[s].volume),
                u.origin_sum
                    .checked_div(u.origin_n as u128)
                    .map_or(0, |m| m as u64),
            ),
        };
        let st = &mut self.log.streams[s];
        for (k, r) in st.extras.iter().enumerate() {
            put_record(hdr, u.data as usize + k, r);
        }
        let header = UnitHeader {
            header_blocks: h,
            record_count: u.data + st.extras.len() as u32,
            array_id: self.geo.array_id,
            segment: seg,
            offset: u.offset,
            incarnation: self.segments.segs[seg as usize].incarnation.0,
            version: version.0,
            data_blocks: u.data,
            stream_kind: st.kind,
            stream_class: st.class,
            volume: st.volume,
            next_segment: st.next_seg.unwrap_or(NO_SEGMENT),
            durable_version: self.durable_version.0,
            run_start: self.run_start.0,
            opened_time: u.volume_time,
            volume_time,
            origin,
        };
        header.seal_into(hdr);
        st.extras.clear();
        if st.kind != StreamKind::Meta {
            st.summary.push(RawRecord::unit(u.offset, u.data, h));
            for i in 0..u.data as usize {
                st.summary.push(record_at(hdr, i));
            }
        }
        let _ = live;
        let blocks = h as u32 + u.data;
        st.write_ptr = u.offset + blocks;
        let stream_kind = st.kind;
        let volume = st.volume;
        self.shared
            .mark_unit_start(self.geo.pba(SegmentId(seg), u.offset));
        let sg = &mut self.segments.segs[seg as usize];
        sg.writes_inflight += 1;
        sg.write_ptr = u.offset + blocks;
        self.segments.sealed(seg, u.data);
        self.log.bufs.sealed(u.buf, seg, u.offset, u.data);
        self.counters.media_blocks += blocks as u64;
        match stream_kind {
            StreamKind::Meta => self.counters.meta_blocks += blocks as u64,
            _ => {
                if let Some(v) = self.volumes[volume as usize].as_mut() {
                    v.media_blocks += blocks as u64;
                }
            }
        }
        let ticket = self.issue_ticket();
        let (dev, off) = self.geo.locate(SegmentId(seg), u.offset);
        self.count_device_blocks(dev, blocks);
        self.submit_io(
            Purpose::UnitWrite { buf: u.buf, ticket },
            dev,
            off,
            IoKind::WriteUnit {
                unit: u.buf,
                blocks,
            },
        );
        // Close the segment if another unit would not fit.
        if self.log.streams[s].write_ptr + self.geo.round_to_row(h as u32 + 1) > self.geo.data_end {
            self.close_segment(s);
        }
    }

    /// Closes the open segments [`Engine::unref`] found half dead, and (once per
    /// 1/64 of the usable space written) those of streams that received nothing
    /// since the previous sweep and whose written part is mostly dead: a class that
    /// stopped receiving writes would otherwise hold its garbage out of GC's reach.
    pub(crate) fn close_stale_segments(&mut self) {
        let period = (self.space.usable / 64).max(1024);
        if self.counters.user_blocks >= self.log.last_idle_sweep + period {
            self.log.last_idle_sweep = self.counters.user_blocks;
            self.update_class_caps();
            for s in 0..self.log.streams.len() {
                let st = &mut self.log.streams[s];
                let idle = st.appended == st.appended_at_sweep;
                st.appended_at_sweep = st.appended;
                if st.kind == StreamKind::Meta || !idle {
                    continue;
                }
                if let Some(seg) = st.seg {
                    let sg = &self.segments.segs[seg as usize];
                    if sg.data_blocks > 0 && sg.valid * 2 <= sg.data_blocks {
                        self.log.stale_open.push(seg);
                    }
                }
            }
        }
        while let Some(seg) = self.log.stale_open.pop() {
            if let Some(s) = self.log.streams.iter().position(|st| st.seg == Some(seg)) {
                if self.log.streams[s].kind != StreamKind::Meta && self.failed.is_none() {
                    self.close_segment(s);
                }
            }
        }
    }

    /// Closes stream `s`'s segment: writes its summary (data streams) and detaches it.
    pub(crate) fn close_segment(&mut self, s: usize) {
        self.seal_unit(s);
        let Some(seg) = self.log.streams[s].seg.take() else {
            return;
        };
        if self.zones.zoned && self.finish_zone_early(s, seg) {
            return;
        }
        let st = &mut self.log.streams[s];
        if st.kind == StreamKind::Meta {
            // Metadata segments have no summary; they live until a later checkpoint
            // supersedes them.
            return;
        }
        let records = std::mem::take(&mut st.summary);
        let close_version = self.next_version.prev();
        let sb_blocks = self.geo.summary_blocks;
        let mut buf = vec![0u8; sb_blocks as usize * BLOCK_SIZE];
        for (i, r) in records.iter().enumerate() {
            put_record(&mut buf, i, r);
        }
        let sg = &mut self.segments.segs[seg as usize];
        SummaryHeader {
            summary_blocks: sb_blocks as u16,
            record_count: records.len() as u32,
            array_id: self.geo.array_id,
            segment: seg,
            data_end: sg.write_ptr,
            incarnation: sg.incarnation.0,
            close_version: close_version.0,
        }
        .seal_into(&mut buf);
        self.mark_closing(seg, true, close_version);
        let volume = self.segments.segs[seg as usize].volume;
        self.counters.media_blocks += sb_blocks as u64;
        if let Some(v) = self.volumes[volume as usize].as_mut() {
            v.media_blocks += sb_blocks as u64;
        }
        let ticket = self.issue_ticket();
        let (dev, off) = self.geo.locate(SegmentId(seg), self.geo.data_end);
        self.count_device_blocks(dev, sb_blocks);
        self.submit_io(
            Purpose::SummaryWrite { seg, ticket },
            dev,
            off,
            IoKind::WriteOwned { data: buf },
        );
        // Give the records vector back for the next segment.
        let mut records = records;
        records.clear();
        self.log.streams[s].summary = records;
    }

    /// Segment `seg` is closing: its last write (summary or zone finish) is queued.
    fn mark_closing(&mut self, seg: u32, has_summary: bool, close_version: Version) {
        let closed = self.volume_time(self.segments.segs[seg as usize].volume);
        let sg = &mut self.segments.segs[seg as usize];
        sg.state = SegState::Closing;
        sg.has_summary = has_summary;
        sg.close_version = close_version;
        sg.closed = closed;
        sg.writes_inflight += 1;
    }

    /// Zoned devices: a segment closed before its data area is full (or a
    /// metadata segment, which has no summary) cannot take its summary at the
    /// tail, as that would skip part of the zone: its zone is finished where the
    /// segment's last unit ends, and GC reads its unit headers instead of a
    /// summary (as for segments a crash left open). True when that was done.
    fn finish_zone_early(&mut self, s: usize, seg: u32) -> bool {
        if self.seg_conventional(seg) {
            // Writable anywhere: the summary goes to the tail as usual.
            return false;
        }
        let st = &mut self.log.streams[s];
        let meta = st.kind == StreamKind::Meta;
        let wp = self.segments.segs[seg as usize].write_ptr;
        if !meta && wp == self.geo.data_end {
            return false;
        }
        st.summary.clear();
        if wp == 0 {
            // Nothing written: the zone is still empty.
            self.zones.done(seg);
            if !meta {
                self.segments.close(seg);
                self.segment_emptied(seg);
            }
            return true;
        }
        let ticket = self.issue_ticket();
        if !meta {
            self.mark_closing(seg, false, self.next_version.prev());
        }
        let (dev, off) = self.geo.locate(SegmentId(seg), wp);
        self.submit_io(
            Purpose::ZoneFinish { seg, ticket },
            dev,
            off,
            IoKind::FinishZone,
        );
        true
    }

    /// A unit write completed: its blocks are now readable from the device.
    pub(crate) fn unit_written(&mut self, buf: u32) {
        let (seg, offset, data) = self.log.bufs.written(buf);
        let h = self.geo.header_blocks as u32;
        // SAFETY: the engine owns the buffer until it is recycled.
        let hdr = unsafe { self.shared.buffers.blocks(buf, 0, h) };
        // Readers of these blocks need the unit's checksums: they are at hand now,
        // so the first read of freshly written data costs no header read (and can
        // go through its connection's ring, which wants them cached).
        self.shared.remember_unit(SegmentId(seg), offset, hdr);
        for i in 0..data {
            let r = record_at(hdr, i as usize);
            if r.kind != kind::DATA {
                continue;
            }
            let slot = self.shared.buffers.slot(buf, h + i);
            let pba = self.geo.pba(SegmentId(seg), offset + h + i);
            let (named, lba) = (VolumeId(r.volume()), r.block());
            let to_device = |v: &crate::engine::Vol| {
                if v.shared.map.load(lba) == encode_buffer(slot) {
                    v.shared.map.store(lba, encode_device(pba));
                }
            };
            // Every member of the family that maps the block (aliases, and
            // snapshots taken while the unit was being written).
            let holders = match self.lineage.family(named) {
                None => std::slice::from_ref(&named),
                Some(f) => self.lineage.members(f),
            };
            for m in holders {
                if let Some(v) = self.volumes[m.0 as usize].as_ref() {
                    to_device(v);
                }
            }
        }
        self.segment_write_done(seg);
        self.recycle_buffers();
    }

    pub(crate) fn recycle_buffers(&mut self) {
        let pins = &self.shared.buffers.pins;
        self.log.bufs.recycle(|b| pins.pinned(b));
    }

    /// One of a segment's writes completed.
    pub(crate) fn segment_write_done(&mut self, seg: u32) {
        let sg = &mut self.segments.segs[seg as usize];
        sg.writes_inflight -= 1;
        if sg.writes_inflight == 0 {
            self.shared.set_written_end(SegmentId(seg), sg.write_ptr);
        }
        if sg.writes_inflight == 0 && sg.state == SegState::Closing {
            self.segments.close(seg);
            if self.segments.segs[seg as usize].valid == 0 {
                self.segment_emptied(seg);
            }
        }
    }

    /// SALSA 3.2: a flush would write user stream `s`'s open unit into its
    /// sequential zone however little it holds. If it holds a few blocks, they move
    /// to the volume's small stream instead (whose segments are conventional
    /// zones), exactly as overwrites with the same contents would, and the unit is
    /// dropped unwritten: the zone keeps taking whole units. GC later moves the
    /// small stream's blocks to sequential zones like any others.
    pub(crate) fn move_small_unit(&mut self, s: usize) {
        let st = &self.log.streams[s];
        let Some(u) = st.unit.as_ref() else { return };
        if st.kind != StreamKind::User
            || st.small
            || !st.extras.is_empty()
            || u.data == 0
            || u.data > (self.geo.unit_data_max / 4).max(1)
        {
            return;
        }
        let volume = st.volume;
        let Some(small) = self
            .volumes
            .get(volume as usize)
            .and_then(|v| v.as_ref())
            .and_then(|v| v.small_stream)
        else {
            return;
        };
        let (buf, n) = (u.buf, u.data);
        let h = self.geo.header_blocks as u32;
        if self.ensure_unit(small, n, 0).is_err() {
            return;
        }
        // Making room may have sealed this very unit (to free a buffer): then it
        // is on its way to the zone already.
        if self.log.streams[s].unit.as_ref().map(|u| u.buf) != Some(buf) {
            return;
        }
        let mut block = [0u8; BLOCK_SIZE];
        for i in 0..n {
            // SAFETY: the engine owns the open unit's header; its data slots are
            // only read by clients, never written by them.
            let r = record_at(unsafe { self.shared.buffers.blocks(buf, 0, h) }, i as usize);
            let slot = self.shared.buffers.slot(buf, h + i);
            let live = r.kind == kind::DATA
                && self.volumes[r.volume() as usize]
                    .as_ref()
                    .is_some_and(|v| v.shared.map.load(r.block()) == encode_buffer(slot));
            if live {
                // SAFETY: as above; the block stays in place until the buffer is
                // recycled, which waits for readers' pins.
                block.copy_from_slice(unsafe { self.shared.buffers.blocks(buf, h + i, 1) });
                self.append_data(small, r.vol(), r.block(), Some(&block), Some(r.b));
            }
        }
        // Nothing of the unit is live any more: it is dropped, its buffer recycled
        // once no reader holds it.
        self.log.streams[s].unit = None;
        self.log.bufs.dropped(buf);
        self.zones.small_units_moved += 1;
        let class = self.log.streams[small].class as usize;
        if let Some(c) = self.volumes[volume as usize]
            .as_mut()
            .and_then(|v| v.classes.get_mut(class))
        {
            c.blocks += n as u64;
        }
    }
}
