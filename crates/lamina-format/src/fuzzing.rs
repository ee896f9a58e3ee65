//! Support for the fuzz targets in `fuzz/` (not part of the format's API).
//!
//! Random bytes almost never carry a valid CRC, so a fuzzer left alone only ever
//! tests the checksum check. Each target therefore takes a mode byte first: with
//! bit 0 set, [`reseal`] recomputes the structure's checksum over the bytes the
//! fuzzer chose, and the decoder is exercised past it, on lengths and counts that
//! only damaged or hostile media would hold. [`seeds`] are valid encodings, the
//! committed starting corpus (`fuzz/corpus/`), checked by a test here.

use crate::checkpoint::{
    CheckpointHeader, CheckpointMeta, SegmentRecord, SegmentState, StreamRecord, VolumeRecord,
};
use crate::codec::{get_u16, put_u32};
use crate::summary::SummaryHeader;
use crate::superblock::{CheckpointRef, DeviceEntry, Layout, Superblock, DEFAULT_DATA_OFFSET};
use crate::unit::{header_blocks_for, put_record, RawRecord, StreamKind, UnitHeader, NO_SEGMENT};
use crate::{crc32c_with_hole, BLOCK_SIZE};

/// The structures a fuzz target decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Superblock,
    UnitHeader,
    Summary,
    Checkpoint,
}

/// Recomputes the checksum of the structure at the start of `buf` in place, over
/// the length its own header claims (clamped to `buf`).
pub fn reseal(kind: Kind, buf: &mut [u8]) {
    let (off, len) = match kind {
        Kind::Superblock => (crate::superblock::OFF_CRC, BLOCK_SIZE),
        // Both keep their block count at offset 10.
        Kind::UnitHeader | Kind::Summary if buf.len() >= 12 => {
            let off = if kind == Kind::UnitHeader {
                crate::unit::OFF_CRC
            } else {
                crate::summary::OFF_CRC
            };
            (off, get_u16(buf, 10) as usize * BLOCK_SIZE)
        }
        Kind::UnitHeader | Kind::Summary => return,
        Kind::Checkpoint => (crate::checkpoint::OFF_CRC, crate::checkpoint::HEADER_SIZE),
    };
    let len = len.min(buf.len());
    if len >= off + 4 {
        let crc = crc32c_with_hole(&buf[..len], off);
        put_u32(buf, off, crc);
    }
}

/// Valid encodings of every structure, by kind: the seed corpus.
pub fn seeds() -> Vec<(Kind, Vec<u8>)> {
    let mut out = Vec::new();
    for layout in [Layout::Jbod, Layout::Said6] {
        let sb = Superblock {
            array_uuid: [7; 16],
            array_name: "tank".into(),
            generation: 42,
            device_index: 1,
            layout,
            block_size: BLOCK_SIZE as u32,
            segment_blocks: 2048,
            write_unit_blocks: 256,
            overprovision_ppm: 100_000,
            data_offset: DEFAULT_DATA_OFFSET,
            created_unix: 1_700_000_000,
            version_reserved: 1 << 32,
            shared_blocks: layout == Layout::Said6,
            checkpoint: Some(CheckpointRef {
                version: 99,
                generation: 3,
                first_segment: 17,
                first_incarnation: 98,
                payload_blocks: 12,
                root_crc: 0xdead_beef,
            }),
            devices: (0..4)
                .map(|i| DeviceEntry {
                    uuid: [i + 1; 16],
                    size_bytes: 1 << 30,
                    segment_count: 127,
                    first_segment: 127 * i as u32,
                    state: 0,
                    rebuild_cursor: 0,
                    tier: 0,
                })
                .collect(),
        };
        out.push((Kind::Superblock, sb.encode().to_vec()));
    }
    for records in [5u32, 300] {
        let h = UnitHeader {
            header_blocks: header_blocks_for(records as usize),
            record_count: records,
            array_id: 0x1234,
            segment: 9,
            offset: 256,
            incarnation: 77,
            version: 80,
            data_blocks: records - 2,
            stream_kind: StreamKind::User,
            stream_class: 0,
            volume: 3,
            next_segment: NO_SEGMENT,
            durable_version: 70,
            run_start: 60,
            opened_time: 890,
            volume_time: 900,
            origin: 300,
        };
        let mut buf = vec![0u8; h.header_blocks as usize * BLOCK_SIZE];
        for i in 0..records as usize - 2 {
            put_record(&mut buf, i, &RawRecord::data(3, 10 + i as u64, 0xaa));
        }
        put_record(&mut buf, records as usize - 2, &RawRecord::trim(3, 100, 8));
        put_record(&mut buf, records as usize - 1, &RawRecord::version(79));
        h.seal_into(&mut buf);
        out.push((Kind::UnitHeader, buf));
    }
    let s = SummaryHeader {
        summary_blocks: 1,
        record_count: 3,
        array_id: 5,
        segment: 6,
        data_end: 60,
        incarnation: 7,
        close_version: 8,
    };
    let mut buf = vec![0u8; BLOCK_SIZE];
    put_record(&mut buf, 0, &RawRecord::unit(0, 2, 1));
    put_record(&mut buf, 1, &RawRecord::data(1, 2, 3));
    put_record(&mut buf, 2, &RawRecord::data(1, 3, 4));
    s.seal_into(&mut buf);
    out.push((Kind::Summary, buf));
    // A checkpoint: header block, then its metadata section.
    let meta = CheckpointMeta {
        volumes: vec![VolumeRecord {
            id: 0,
            name: "default".into(),
            size_bytes: 1 << 30,
            created_version: 5,
            user_blocks_written: 1000,
            gc_blocks_relocated: 10,
            media_blocks_written: 1020,
            pages: vec![0, 3, 9],
        }],
        segments: vec![SegmentRecord {
            state: SegmentState::Closed,
            stream_kind: 0,
            stream_class: 0,
            has_summary: 1,
            volume: 0,
            write_ptr: 2039,
            data_blocks: 2020,
            incarnation: 9,
            close_version: 20,
            erase_count: 2,
        }],
        free_queue: vec![1],
        streams: vec![StreamRecord {
            kind: 0,
            class: 0,
            volume: 0,
            segment: 0,
            next_segment: 5,
        }],
        counters: vec![1, 2, 3],
        segment_times: vec![crate::checkpoint::SegmentTimes {
            born: 4,
            closed: 900,
            origins: Some([2; crate::checkpoint::ORIGIN_SLOTS]),
        }],
        placement: vec![crate::checkpoint::PlacementRecord {
            volume: 0,
            classifier: "sepbit".into(),
            state: vec![1, 2, 3, 4, 5, 6, 7, 8],
        }],
        policies: vec![],
        discarded: vec![(0, 1)],
        lineage: vec![crate::checkpoint::LineageRecord {
            volume: 0,
            family: 0,
            origin: crate::checkpoint::NO_ORIGIN,
            flags: 0,
        }],
        skipped: vec![],
    }
    .encode();
    let h = CheckpointHeader {
        array_id: 5,
        generation: 3,
        start_version: 99,
        payload_blocks: 1 + (meta.len() as u64).div_ceil(BLOCK_SIZE as u64) + 3,
        meta_bytes: meta.len() as u64,
        map_pages: 3,
        meta_crc: crate::checkpoint::meta_crc(&meta),
    };
    let mut buf = h.encode().to_vec();
    buf.extend_from_slice(&meta);
    out.push((Kind::Checkpoint, buf));
    out
}

/// What a fuzz target does with one input: decode every structure it holds, and
/// check that what decodes encodes back to what was read. Panics only on a bug.
pub fn decode(kind: Kind, data: &[u8]) {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut buf = rest.to_vec();
    if mode & 1 == 1 {
        reseal(kind, &mut buf);
    }
    match kind {
        Kind::Superblock => {
            if let Ok(sb) = Superblock::decode(&buf) {
                assert_eq!(Superblock::decode(&sb.encode()[..]).as_ref(), Ok(&sb));
            }
        }
        Kind::UnitHeader => {
            if let Ok(h) = UnitHeader::decode(&buf) {
                for i in 0..h.record_count as usize {
                    let r = crate::unit::record_at(&buf, i);
                    let _ = (r.volume(), r.lba());
                }
                let _ = h.total_blocks();
            }
        }
        Kind::Summary => {
            if let Ok(h) = SummaryHeader::decode(&buf) {
                for i in 0..h.record_count as usize {
                    let _ = crate::unit::record_at(&buf, i);
                }
            }
        }
        Kind::Checkpoint => {
            if let Ok(h) = CheckpointHeader::decode(&buf) {
                let _ = h.meta_blocks();
                let meta = buf.get(BLOCK_SIZE..).unwrap_or(&[]);
                let meta = &meta[..meta.len().min(h.meta_bytes as usize)];
                if let Ok(mut m) = CheckpointMeta::decode(meta) {
                    // What was skipped is not written again.
                    m.skipped.clear();
                    assert_eq!(CheckpointMeta::decode(&m.encode()).as_ref(), Ok(&m));
                }
            }
            // The metadata section alone, as a damaged checkpoint might hold it.
            let _ = CheckpointMeta::decode(&buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(kind: Kind) -> &'static str {
        match kind {
            Kind::Superblock => "superblock",
            Kind::UnitHeader => "unit_header",
            Kind::Summary => "summary",
            Kind::Checkpoint => "checkpoint",
        }
    }

    /// The committed seed corpus is what `seeds()` encodes (the format changed
    /// otherwise: `LAMINA_WRITE_FUZZ_SEEDS=1 cargo test -p lamina-format` rewrites
    /// it), every seed decodes, and so does every file of the corpus, resealed or
    /// not, without a panic.
    #[test]
    fn seed_corpus_is_current_and_decodes() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus");
        let write = std::env::var("LAMINA_WRITE_FUZZ_SEEDS").is_ok();
        let mut n: std::collections::HashMap<&str, usize> = Default::default();
        for (kind, bytes) in seeds() {
            let t = target(kind);
            let i = n.entry(t).or_default();
            let path = root.join(t).join(format!("seed-{i}"));
            *i += 1;
            // Mode byte 0: as is.
            let mut input = vec![0u8];
            input.extend_from_slice(&bytes);
            if write {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &input).unwrap();
            }
            let committed = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("{}: {e} (LAMINA_WRITE_FUZZ_SEEDS=1)", path.display()));
            assert_eq!(committed, input, "{} is stale", path.display());
            let ok = match kind {
                Kind::Superblock => Superblock::decode(&bytes).is_ok(),
                Kind::UnitHeader => UnitHeader::decode(&bytes).is_ok(),
                Kind::Summary => SummaryHeader::decode(&bytes).is_ok(),
                Kind::Checkpoint => CheckpointHeader::decode(&bytes).is_ok_and(|h| {
                    CheckpointMeta::decode(&bytes[BLOCK_SIZE..][..h.meta_bytes as usize]).is_ok()
                }),
            };
            assert!(ok, "seed {} decodes", path.display());
        }
        for t in ["superblock", "unit_header", "summary", "checkpoint"] {
            let kind = seeds()
                .into_iter()
                .map(|(k, _)| k)
                .find(|&k| target(k) == t)
                .unwrap();
            for e in std::fs::read_dir(root.join(t)).unwrap() {
                let input = std::fs::read(e.unwrap().path()).unwrap();
                decode(kind, &input);
                let mut resealed = input.clone();
                if let Some(m) = resealed.first_mut() {
                    *m |= 1;
                }
                decode(kind, &resealed);
            }
        }
    }

    /// Resealing makes a changed structure pass its checksum again.
    #[test]
    fn reseal_restores_the_checksum() {
        for (kind, mut bytes) in seeds() {
            bytes[20] ^= 0x40;
            reseal(kind, &mut bytes);
            let ok = match kind {
                Kind::Superblock => !matches!(
                    Superblock::decode(&bytes),
                    Err(crate::FormatError::Checksum { .. })
                ),
                Kind::UnitHeader => !matches!(
                    UnitHeader::decode(&bytes),
                    Err(crate::FormatError::Checksum { .. })
                ),
                Kind::Summary => !matches!(
                    SummaryHeader::decode(&bytes),
                    Err(crate::FormatError::Checksum { .. })
                ),
                Kind::Checkpoint => !matches!(
                    CheckpointHeader::decode(&bytes),
                    Err(crate::FormatError::Checksum { .. })
                ),
            };
            assert!(ok, "{kind:?}");
        }
    }
}
