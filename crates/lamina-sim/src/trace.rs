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
}

impl Format {
    pub fn parse(s: &str) -> Result<Self, String> {
        Ok(match s {
            "msr" => Format::Msr,
            "alibaba" => Format::Alibaba,
            "tencent" => Format::Tencent,
            "spc" | "umass" => Format::Spc,
            "blkparse" => Format::Blkparse,
            _ => {
                return Err(format!(
                    "unknown trace format {s:?} (msr, alibaba, tencent, spc, blkparse)"
                ))
            }
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

fn parse_line(format: Format, line: &str) -> Result<Option<Request>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
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
                offset_bytes: num(&f, 1)? * 512,
                len_bytes: num(&f, 2)? * 512,
                write: num(&f, 3)? == 1,
                trim: false,
            }))
        }
        Format::Spc => {
            let f: Vec<&str> = line.split(',').collect();
            let op = field(&f, 3)?;
            Ok(Some(Request {
                volume: field(&f, 0)?.to_string(),
                offset_bytes: num(&f, 1)? * 512,
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
                offset_bytes: sector * 512,
                len_bytes: count * 512,
                write: write && !trim,
                trim,
            }))
        }
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
    pending: Option<Op>,
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
            pending: None,
            error: None,
        })
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
        self.names.push(name.to_string());
        id
    }
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
            let req = match parse_line(self.format, &line) {
                Ok(Some(r)) => r,
                Ok(None) => continue,
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
        assert_eq!(names, vec!["8,33"]);
        assert!(v.len() > 100, "{} writes", v.len());
        assert!(v.iter().all(|o| o.blocks >= 1));
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
}
