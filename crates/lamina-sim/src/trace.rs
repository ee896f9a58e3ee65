//! Block trace readers. Reads are skipped (write amplification concerns writes);
//! writes and discards become [`Op`]s. Each distinct device or volume in a trace is
//! replayed as its own isolated volume, numbered in order of first appearance.
//! Gzip-compressed files are read transparently.

use crate::workload::{Op, Workload};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

/// Trace formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// MSR Cambridge: `Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime`,
    /// offsets and sizes in bytes, Type `Read` or `Write`.
    Msr,
    /// Alibaba cloud block traces: `device_id,opcode,offset,length,timestamp`, opcode
    /// `R` or `W`, bytes.
    Alibaba,
    /// Tencent CBS: `timestamp,offset,size,iotype,volume_id`, offset and size in
    /// 512-byte sectors, iotype 1 for writes.
    Tencent,
    /// UMass / SPC ASCII: `ASU,LBA,size,opcode,timestamp`, LBA in 512-byte sectors,
    /// size in bytes, opcode `w` / `r`.
    Spc,
    /// `blkparse` default text output; dispatch (`D`) events, `W` writes and `D`
    /// (discard) in the RWBS field, sector and sector count.
    Blkparse,
    /// DiskSim ASCII: `time devno blkno bcount flags`, whitespace separated,
    /// block number and count in 512-byte sectors, flags bit 0 set for reads (the
    /// MSN file server and TPC-C samples; MQSim and DiskSim read them this way).
    Disksim,
    /// Sysinternals DiskMon logs: `seq time duration disk Read|Write sector length`,
    /// tab separated, sectors of 512 bytes (some logs end every line with a tab).
    Diskmon,
    /// Windows Performance Analyzer disk I/O export (`wpaexporter`, `;` separated,
    /// a header line): `IO Type` (column 1), `Size (B)` (8) with `.` as thousands
    /// separator, `Min Offset` (9) as a hex byte address, `Disk` (13). Flush rows
    /// are skipped.
    Wpa,
}

impl Format {
    /// The names `parse` takes.
    pub const NAMES: &'static str = "msr, alibaba, tencent, spc, blkparse, disksim, diskmon, wpa";

    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "msr" => Format::Msr,
            "alibaba" => Format::Alibaba,
            "tencent" => Format::Tencent,
            "spc" | "umass" => Format::Spc,
            "blkparse" => Format::Blkparse,
            "disksim" => Format::Disksim,
            "diskmon" => Format::Diskmon,
            "wpa" => Format::Wpa,
            _ => return Err(format!("unknown trace format {s:?} ({})", Format::NAMES)),
        })
    }
}

/// Errors reading a trace.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}: {detail}")]
    Parse {
        path: String,
        line: u64,
        detail: String,
    },
}

/// Opens a file, decompressing gzip when it starts with the gzip magic.
pub fn open_maybe_gzip(path: &Path) -> Result<Box<dyn BufRead>, TraceError> {
    let io = |e| TraceError::Io {
        path: path.display().to_string(),
        source: e,
    };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut magic = [0u8; 2];
    let n = f.read(&mut magic).map_err(io)?;
    let f = std::fs::File::open(path).map_err(io)?;
    if n == 2 && magic == [0x1f, 0x8b] {
        Ok(Box::new(BufReader::with_capacity(
            1 << 20,
            flate2::read::MultiGzDecoder::new(f),
        )))
    } else {
        Ok(Box::new(BufReader::with_capacity(1 << 20, f)))
    }
}

/// One request of a trace, before rounding to blocks.
struct Request {
    volume: String,
    offset_bytes: u64,
    len_bytes: u64,
    write: bool,
    trim: bool,
}

fn field<'a>(fields: &[&'a str], i: usize) -> Result<&'a str, String> {
    fields
        .get(i)
        .map(|f| f.trim())
        .ok_or_else(|| format!("missing field {}", i + 1))
}

fn num(fields: &[&str], i: usize) -> Result<u64, String> {
    let f = field(fields, i)?;
    f.parse::<u64>()
        .map_err(|_| format!("field {} is not a number: {f:?}", i + 1))
}

/// A WPA integer: `.` separates thousands (`16.384` is 16384).
fn wpa_int(fields: &[&str], i: usize) -> Result<u64, String> {
    let f = field(fields, i)?;
    f.replace('.', "")
        .parse::<u64>()
        .map_err(|_| format!("field {} is not a number: {f:?}", i + 1))
}

/// A hex byte address, `0x` first.
fn hex(fields: &[&str], i: usize) -> Result<u64, String> {
    let f = field(fields, i)?;
    let digits = f
        .strip_prefix("0x")
        .or_else(|| f.strip_prefix("0X"))
        .unwrap_or(f);
    u64::from_str_radix(digits, 16).map_err(|_| format!("field {} is not hex: {f:?}", i + 1))
}

/// Sectors to bytes; `None` (a garbage record) where that overflows.
fn sectors(n: u64) -> Option<u64> {
    n.checked_mul(512)
}

/// Sectors to bytes, an error where that overflows.
fn bytes_of_sectors(n: u64) -> Result<u64, String> {
    sectors(n).ok_or_else(|| format!("{n} sectors do not fit 64 bits in bytes"))
}

/// What a line holds.
enum Line {
    Request(Request),
    /// Nothing to replay (a header, a comment, another event).
    Skip,
    /// Well formed but impossible (DiskMon logs hold a few records whose sector
    /// does not fit 64 bits in bytes): counted and skipped.
    Garbage,
}

/// A request addressed in 512-byte sectors (DiskSim, DiskMon); garbage where the
/// range does not fit 64 bits in bytes.
fn sector_line(volume: &str, sector: u64, count: u64, write: bool) -> Line {
    match (sectors(sector), sectors(count)) {
        (Some(offset_bytes), Some(len_bytes)) if offset_bytes.checked_add(len_bytes).is_some() => {
            Line::Request(Request {
                volume: volume.to_string(),
                offset_bytes,
                len_bytes,
                write,
                trim: false,
            })
        }
        _ => Line::Garbage,
    }
}

fn parse_line(format: Format, line: &str) -> Result<Line, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(Line::Skip);
    }
    match format {
        Format::Disksim => {
            let f: Vec<&str> = line.split_whitespace().collect();
            Ok(sector_line(
                field(&f, 1)?,
                num(&f, 2)?,
                num(&f, 3)?,
                num(&f, 4)? & 1 == 0,
            ))
        }
        Format::Diskmon => {
            let f: Vec<&str> = line.split('\t').collect();
            let kind = field(&f, 4)?;
            if !kind.eq_ignore_ascii_case("write") && !kind.eq_ignore_ascii_case("read") {
                return Err(format!("field 5 is neither Read nor Write: {kind:?}"));
            }
            Ok(sector_line(
                field(&f, 3)?,
                num(&f, 5)?,
                num(&f, 6)?,
                kind.eq_ignore_ascii_case("write"),
            ))
        }
        Format::Wpa => {
            let f: Vec<&str> = line.split(';').collect();
            let kind = field(&f, 0)?;
            if kind == "IO Type" {
                let col = |i: usize| f.get(i).map(|c| c.trim());
                if col(7) != Some("Size (B)")
                    || col(8) != Some("Min Offset")
                    || col(12) != Some("Disk")
                {
                    return Err(
                        "a WPA header without Size (B), Min Offset and Disk in columns 8, 9 and 13"
                            .into(),
                    );
                }
                return Ok(Line::Skip);
            }
            if !kind.eq_ignore_ascii_case("write") {
                return Ok(Line::Skip); // reads, flushes
            }
            let (offset_bytes, len_bytes) = (hex(&f, 8)?, wpa_int(&f, 7)?);
            if offset_bytes.checked_add(len_bytes).is_none() {
                return Ok(Line::Garbage);
            }
            Ok(Line::Request(Request {
                volume: field(&f, 12)?.to_string(),
                offset_bytes,
                len_bytes,
                write: true,
                trim: false,
            }))
        }
        _ => Ok(parse_line_csv(format, line)?.map_or(Line::Skip, Line::Request)),
    }
}

fn parse_line_csv(format: Format, line: &str) -> Result<Option<Request>, String> {
    match format {
        Format::Msr => {
            let f: Vec<&str> = line.split(',').collect();
            // A header line, if any.
            if field(&f, 0)?.eq_ignore_ascii_case("timestamp") {
                return Ok(None);
            }
            let kind = field(&f, 3)?;
            Ok(Some(Request {
                volume: format!("{}_{}", field(&f, 1)?, field(&f, 2)?),
                offset_bytes: num(&f, 4)?,
                len_bytes: num(&f, 5)?,
                write: kind.eq_ignore_ascii_case("write"),
                trim: false,
            }))
        }
        Format::Alibaba => {
            let f: Vec<&str> = line.split(',').collect();
            if field(&f, 0)?.eq_ignore_ascii_case("device_id") {
                return Ok(None);
            }
            let op = field(&f, 1)?;
            Ok(Some(Request {
                volume: field(&f, 0)?.to_string(),
                offset_bytes: num(&f, 2)?,
                len_bytes: num(&f, 3)?,
                write: op.eq_ignore_ascii_case("w"),
                trim: false,
            }))
        }
        Format::Tencent => {
            let f: Vec<&str> = line.split(',').collect();
            if field(&f, 0)?.eq_ignore_ascii_case("timestamp") {
                return Ok(None);
            }
            Ok(Some(Request {
                volume: field(&f, 4)?.to_string(),
                offset_bytes: bytes_of_sectors(num(&f, 1)?)?,
                len_bytes: bytes_of_sectors(num(&f, 2)?)?,
                write: num(&f, 3)? == 1,
                trim: false,
            }))
        }
        Format::Spc => {
            let f: Vec<&str> = line.split(',').collect();
            let op = field(&f, 3)?;
            Ok(Some(Request {
                volume: field(&f, 0)?.to_string(),
                offset_bytes: bytes_of_sectors(num(&f, 1)?)?,
                len_bytes: num(&f, 2)?,
                write: op.eq_ignore_ascii_case("w"),
                trim: false,
            }))
        }
        Format::Blkparse => {
            // "8,33 4 1 0.000000000 3922 D W 540544 + 8 [proc]"
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 10 || f[5] != "D" || f[8] != "+" {
                return Ok(None); // other events, summaries, unparsable noise
            }
            let rwbs = f[6];
            let write = rwbs.contains('W');
            let trim = rwbs.contains('D');
            if !write && !trim {
                return Ok(None);
            }
            let sector: u64 = f[7].parse().map_err(|_| format!("bad sector {:?}", f[7]))?;
            let count: u64 = f[9]
                .parse()
                .map_err(|_| format!("bad sector count {:?}", f[9]))?;
            Ok(Some(Request {
                volume: f[0].to_string(),
                offset_bytes: bytes_of_sectors(sector)?,
                len_bytes: bytes_of_sectors(count)?,
                write: write && !trim,
                trim,
            }))
        }
        Format::Disksim | Format::Diskmon | Format::Wpa => unreachable!("parsed by parse_line"),
    }
}

/// Reads a trace as a stream of operations.
pub struct TraceReader {
    path: String,
    format: Format,
    lines: std::io::Lines<Box<dyn BufRead>>,
    line_no: u64,
    volumes: HashMap<String, u32>,
    names: Vec<String>,
    /// The volume names given so far.
    taken: std::collections::HashSet<String>,
    pending: Option<Op>,
    /// Added to every offset, in bytes (a partition that starts at sector 63 puts
    /// 4 KiB clusters on 4 KiB boundaries with +512).
    shift: i64,
    /// Records skipped as impossible (see [`Line::Garbage`]).
    pub garbage: u64,
    pub error: Option<TraceError>,
}

impl TraceReader {
    pub fn open(path: &Path, format: Format) -> Result<Self, TraceError> {
        Ok(TraceReader {
            path: path.display().to_string(),
            format,
            lines: open_maybe_gzip(path)?.lines(),
            line_no: 0,
            volumes: HashMap::new(),
            names: Vec::new(),
            taken: Default::default(),
            pending: None,
            shift: 0,
            garbage: 0,
            error: None,
        })
    }

    /// Adds `bytes` to every offset (records that would start below 0 are
    /// garbage).
    pub fn with_shift(mut self, bytes: i64) -> Self {
        self.shift = bytes;
        self
    }

    /// Names of the volumes seen so far, by id.
    pub fn volume_names(&self) -> &[String] {
        &self.names
    }

    fn volume_id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.volumes.get(name) {
            return id;
        }
        let id = self.names.len() as u32;
        self.volumes.insert(name.to_string(), id);
        // Two devices that meet on one name ("8,33" and "8;33") stay apart: the
        // later one takes the first free name with a number appended.
        let base = volume_name(name);
        let mut volume = base.clone();
        let mut n = id;
        while self.taken.contains(&volume) {
            // Room for the number within the 64 characters of a name.
            volume = format!("{}-{n}", &base[..base.len().min(48)]);
            n += 1;
        }
        self.taken.insert(volume.clone());
        self.names.push(volume);
        id
    }
}

/// The volume name a trace's device becomes: as it is where it is a valid volume
/// name, else its first 48 characters with every one a name may not hold replaced
/// by '_' and, where it does not start with a letter or digit, after a 'v'
/// (blkparse names its devices "8,33").
fn volume_name(device: &str) -> String {
    let ok = |c: char| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-');
    let starts_well = device.starts_with(|c: char| c.is_ascii_alphanumeric());
    if starts_well && device.len() <= 64 && device.chars().all(ok) {
        return device.to_string();
    }
    let mut name: String = device
        .chars()
        .map(|c| if ok(c) { c } else { '_' })
        .take(48)
        .collect();
    if !name.starts_with(|c: char| c.is_ascii_alphanumeric()) {
        name.insert(0, 'v');
    }
    name
}

impl Workload for TraceReader {
    fn next_op(&mut self) -> Option<Op> {
        if let Some(op) = self.pending.take() {
            return Some(op);
        }
        loop {
            let line = match self.lines.next()? {
                Ok(l) => l,
                Err(e) => {
                    self.error = Some(TraceError::Io {
                        path: self.path.clone(),
                        source: e,
                    });
                    return None;
                }
            };
            self.line_no += 1;
            let mut req = match parse_line(self.format, &line) {
                Ok(Line::Request(r)) => r,
                Ok(Line::Skip) => continue,
                Ok(Line::Garbage) => {
                    self.garbage += 1;
                    continue;
                }
                Err(detail) => {
                    self.error = Some(TraceError::Parse {
                        path: self.path.clone(),
                        line: self.line_no,
                        detail,
                    });
                    return None;
                }
            };
            if (!req.write && !req.trim) || req.len_bytes == 0 {
                continue;
            }
            // Beyond the largest volume the engine maps (16 PiB) is garbage too: a
            // simulated volume is sized to the highest block written.
            let limit = lamina_core::map::MAX_BLOCKS * 4096;
            match req.offset_bytes.checked_add_signed(self.shift) {
                Some(o) if o.checked_add(req.len_bytes).is_some_and(|end| end <= limit) => {
                    req.offset_bytes = o
                }
                _ => {
                    self.garbage += 1;
                    continue;
                }
            }
            let first = req.offset_bytes / 4096;
            let last = (req.offset_bytes + req.len_bytes - 1) / 4096;
            let (first, blocks) = if req.trim {
                // Only whole blocks can be discarded.
                let a = req.offset_bytes.div_ceil(4096);
                let b = (req.offset_bytes + req.len_bytes) / 4096;
                if b <= a {
                    continue;
                }
                (a, b - a)
            } else {
                (first, last - first + 1)
            };
            let volume = self.volume_id(&req.volume);
            return Some(Op {
                volume,
                lba: first,
                blocks: blocks.min(u32::MAX as u64) as u32,
                trim: req.trim,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn write_tmp(name: &str, text: &str, gz: bool) -> std::path::PathBuf {
        let p = std::env::temp_dir().join(format!("lamina-trace-{}-{name}", std::process::id()));
        let f = std::fs::File::create(&p).unwrap();
        if gz {
            let mut e = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
            e.write_all(text.as_bytes()).unwrap();
            e.finish().unwrap();
        } else {
            let mut f = f;
            f.write_all(text.as_bytes()).unwrap();
        }
        p
    }

    fn ops(path: &Path, f: Format) -> (Vec<Op>, Vec<String>) {
        let mut r = TraceReader::open(path, f).unwrap();
        let v: Vec<Op> = std::iter::from_fn(|| r.next_op()).collect();
        assert!(r.error.is_none(), "{:?}", r.error);
        (v, r.volume_names().to_vec())
    }

    #[test]
    fn msr_rounds_out_and_splits_volumes() {
        let p = write_tmp(
            "msr",
            "128166372003061629,hm,0,Write,8192,4096,1000\n\
             128166372003061630,hm,0,Read,0,4096,1000\n\
             128166372003061631,hm,1,Write,4000,200,1000\n\
             128166372003061632,hm,0,Write,4095,8194,1000\n",
            true,
        );
        let (v, names) = ops(&p, Format::Msr);
        assert_eq!(names, vec!["hm_0", "hm_1"]);
        assert_eq!(
            v[0],
            Op {
                volume: 0,
                lba: 2,
                blocks: 1,
                trim: false
            }
        );
        assert_eq!(
            v[1],
            Op {
                volume: 1,
                lba: 0,
                blocks: 2,
                trim: false
            }
        );
        // 4095 .. 12289 touches blocks 0..=3.
        assert_eq!(
            v[2],
            Op {
                volume: 0,
                lba: 0,
                blocks: 4,
                trim: false
            }
        );
    }

    #[test]
    fn alibaba_tencent_spc() {
        let p = write_tmp(
            "ali",
            "device_id,opcode,offset,length,timestamp\n7,W,4096,8192,1\n7,R,0,4096,2\n",
            false,
        );
        assert_eq!(
            ops(&p, Format::Alibaba).0,
            vec![Op {
                volume: 0,
                lba: 1,
                blocks: 2,
                trim: false
            }]
        );
        let p = write_tmp("tc", "1,16,8,1,1005\n2,0,8,0,1005\n3,0,8,1,7\n", false);
        let (v, names) = ops(&p, Format::Tencent);
        assert_eq!(names, vec!["1005", "7"]);
        assert_eq!(
            v[0],
            Op {
                volume: 0,
                lba: 2,
                blocks: 1,
                trim: false
            }
        );
        let p = write_tmp(
            "spc",
            "0,8,4096,w,0.1\n0,8,4096,r,0.2\n1,0,512,W,0.3\n",
            false,
        );
        let (v, _) = ops(&p, Format::Spc);
        assert_eq!(
            v,
            vec![
                Op {
                    volume: 0,
                    lba: 1,
                    blocks: 1,
                    trim: false
                },
                Op {
                    volume: 1,
                    lba: 0,
                    blocks: 1,
                    trim: false
                }
            ]
        );
    }

    #[test]
    fn blkparse_sample_parses() {
        let sample = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../../shared/traces/blkparse-ext4-sample.txt");
        let local = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/blkparse-ext4-sample.txt");
        let path = if local.exists() { local } else { sample };
        let (v, names) = ops(&path, Format::Blkparse);
        assert_eq!(names, vec!["8_33"]);
        assert!(v.len() > 100, "{} writes", v.len());
        assert!(v.iter().all(|o| o.blocks >= 1));
    }

    #[test]
    fn devices_become_valid_volume_names() {
        assert_eq!(volume_name("8,33"), "8_33");
        assert_eq!(volume_name("src1_0"), "src1_0");
        assert_eq!(volume_name(".x y"), "v.x_y");
        assert_eq!(volume_name(&"a".repeat(100)).len(), 48);
        let p = write_tmp(
            "names",
            "1,a b,0,Write,0,4096,1\n2,a_b,0,Write,0,4096,1\n",
            false,
        );
        let mut r = TraceReader::open(&p, Format::Msr).unwrap();
        while r.next_op().is_some() {}
        assert_eq!(
            r.volume_names(),
            ["a_b_0", "a_b_0-1"],
            "distinct devices stay distinct"
        );
        // A sanitised name that meets a valid one and then that one with the
        // number appended.
        let line = |dev: &str| format!("{dev} 1 1 0.0 1 D W 0 + 8 [p]\n");
        let text: String = ["8_33-2", "8,33", "8;33"].map(line).concat();
        let p = write_tmp("names2", &text, false);
        let mut r = TraceReader::open(&p, Format::Blkparse).unwrap();
        while r.next_op().is_some() {}
        assert_eq!(r.volume_names(), ["8_33-2", "8_33", "8_33-3"]);
    }

    #[test]
    fn bad_lines_are_reported_with_their_number() {
        let p = write_tmp(
            "bad",
            "1,hm,0,Write,8192,4096,1\n2,hm,0,Write,abc,4096,1\n",
            false,
        );
        let mut r = TraceReader::open(&p, Format::Msr).unwrap();
        assert!(r.next_op().is_some());
        assert!(r.next_op().is_none());
        let e = r.error.unwrap().to_string();
        assert!(e.contains(":2:") && e.contains("abc"), "{e}");
    }

    /// Excerpts of the traces in `../shared/traces` (see its SOURCES.md), quirks
    /// included.
    #[test]
    fn disksim_flags_bit_zero_is_a_read() {
        let p = write_tmp(
            "disksim",
            "0.000 5 174224064 16 1\n938513000 4 264719034 16 0\n938944000 13 93230992 32 0\n",
            false,
        );
        let (v, names) = ops(&p, Format::Disksim);
        assert_eq!(names, vec!["4", "13"]);
        // Sector 264719034 is 2 sectors into block 33089879: 16 sectors touch three.
        assert_eq!((v[0].lba, v[0].blocks), (33089879, 3));
        assert_eq!((v[1].volume, v[1].lba, v[1].blocks), (1, 93230992 / 8, 4));
    }

    #[test]
    fn diskmon_skips_garbage_records_and_trailing_tabs() {
        let p = write_tmp(
            "diskmon",
            "0\t0.484119\t0.00530243\t0\tWrite\t8486082789636758048\t2742488\t\r\n\
             2\t0.613500\t0.00968933\t0\tWrite\t34767\t80\t\r\n\
             3\t0.613759\t0.00968933\t0\tRead\t215\t8\t\r\n\
             4\t0.016375\t0.00038147\t1\tWrite\t3271215\t8\r\n",
            false,
        );
        let mut r = TraceReader::open(&p, Format::Diskmon).unwrap();
        let v: Vec<Op> = std::iter::from_fn(|| r.next_op()).collect();
        assert!(r.error.is_none(), "{:?}", r.error);
        assert_eq!(r.garbage, 1);
        assert_eq!(r.volume_names(), ["0", "1"]);
        // A sector within 64 bits but beyond the largest volume: garbage as well
        // (the simulated volume would be sized to it).
        let far = write_tmp(
            "diskmon-far",
            "0\t0.1\t0.1\t0\tWrite\t1125899906842624\t8\r\n",
            false,
        );
        let mut r = TraceReader::open(&far, Format::Diskmon).unwrap();
        assert!(r.next_op().is_none() && r.error.is_none());
        assert_eq!(r.garbage, 1);
        // 34767 sectors = byte 17800704 (block 4345.875), 80 sectors: 11 blocks.
        assert_eq!((v[0].lba, v[0].blocks), (4345, 11));
        // 3271215 is 7 mod 8: a 4 KiB write straddles two blocks...
        assert_eq!((v[1].lba, v[1].blocks), (3271215 / 8, 2));
        // ...and with the partition shifted by one sector it covers one.
        let mut r = TraceReader::open(&p, Format::Diskmon)
            .unwrap()
            .with_shift(512);
        let v: Vec<Op> = std::iter::from_fn(|| r.next_op()).collect();
        assert_eq!((v[1].lba, v[1].blocks), (3271216 / 8, 1));
    }

    #[test]
    fn wpa_reads_its_locale_and_hex_offsets() {
        let p = write_tmp(
            "wpa",
            "IO Type;Priority;Process (Name);Init Time (s);Complete Time (s);IO Time (\u{b5}s);Disk Service Time (\u{b5}s);Size (B);Min Offset;Max Offset;QD/I - Queue Depth at Init Time;QD/C - Queue Depth at Complete Time;Disk;Count\r\n\
             Read;Normal;System;1,079943800;1,080031000;87,200;87,200;512;0x0000000000000000;0x00000000000001FF;0;0;1;1\r\n\
             Write;Normal;System;2,5;2,6;1.795,900;1,0;16.384;0x0000000000014000;0x0000000000017FFF;0;0;1;1\r\n\
             Flush;Normal;System;3,0;3,1;1,0;1,0;0;0xFFFFFFFFFFFFFFFF;0xFFFFFFFFFFFFFFFF;0;0;1;1\r\n",
            true,
        );
        let (v, names) = ops(&p, Format::Wpa);
        assert_eq!(names, vec!["1"]);
        assert_eq!(
            v,
            vec![Op {
                volume: 0,
                lba: 0x14000 / 4096,
                blocks: 4,
                trim: false
            }]
        );
        let p = write_tmp("wpa-cols", "IO Type;Priority;Size\r\n", false);
        let mut r = TraceReader::open(&p, Format::Wpa).unwrap();
        assert!(r.next_op().is_none());
        assert!(r.error.unwrap().to_string().contains("WPA header"));
    }

    #[test]
    fn sector_counts_that_overflow_are_errors() {
        let p = write_tmp("tencent-big", "1,36028797018963968,8,1,7\n", false);
        let mut r = TraceReader::open(&p, Format::Tencent).unwrap();
        assert!(r.next_op().is_none());
        assert!(r.error.unwrap().to_string().contains("do not fit"));
    }
}
