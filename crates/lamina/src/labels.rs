//! Finding arrays by their devices' superblocks, as `mdadm --examine --scan` and
//! `zpool import` do: `lamina array list`, `array import`, and the check that a
//! directory's lamina.toml and its devices name the same array.
//!
//! A device's label is the newer valid copy of its two superblocks. Devices are
//! grouped by array UUID; in each group the label of the highest generation is
//! the reference, and a device takes the member slot its own label names
//! (`device_index`) only if the reference still lists that member with the same
//! device UUID: a member replaced since (its old device still carrying the old
//! label) is not taken for the current one.

use anyhow::{bail, Context, Result};
use lamina_core::recovery::MEMBER_FAILED;
use lamina_format::superblock::{Superblock, SUPERBLOCK_OFFSETS};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use lamina_format::superblock::uuid_hex;

/// How long a scan waits for devices to give their labels before it goes on
/// without those that have not (a disk that stopped answering, an NBD device
/// whose server is gone): they are reported as unreadable, with this reason.
pub const LABEL_TIMEOUT: Duration = Duration::from_secs(10);

/// The label on `path`: its newest valid superblock, `None` if it has none.
/// Reads with plain `pread`s (no lock, no O_DIRECT), so it may look at devices
/// an array holds open. Only files and block devices are opened: opening a FIFO
/// would wait for a writer, a character device could be anything.
pub fn read_label(path: &Path) -> Result<Option<Superblock>> {
    let meta =
        std::fs::metadata(path).with_context(|| format!("cannot look at {}", path.display()))?;
    if !(meta.is_file() || meta.file_type().is_block_device()) {
        bail!("{} is not a file or a block device", path.display());
    }
    let f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut best: Option<Superblock> = None;
    let mut b = vec![0u8; 4096];
    for off in SUPERBLOCK_OFFSETS {
        if f.read_exact_at(&mut b, off).is_err() {
            continue;
        }
        if let Ok(sb) = Superblock::decode(&b) {
            if best.as_ref().is_none_or(|s| sb.generation > s.generation) {
                best = Some(sb);
            }
        }
    }
    Ok(best)
}

/// An array found on devices.
pub struct Found {
    pub uuid: [u8; 16],
    /// The label of the highest generation.
    pub reference: Superblock,
    /// By member index: the device found for it (as it was named), if any.
    pub members: Vec<Option<PathBuf>>,
    /// Why a device that carries the array's label was not taken for its member.
    pub passed_over: Vec<String>,
}

impl Found {
    /// Members with no device found (removed ones need none).
    pub fn missing(&self) -> usize {
        (0..self.members.len())
            .filter(|&i| self.members[i].is_none() && !self.removed(i))
            .count()
    }

    /// Members in the array (removed ones not counted).
    pub fn in_array(&self) -> usize {
        (0..self.members.len())
            .filter(|&i| !self.removed(i))
            .count()
    }

    /// Member `i` is in the cache tier (issue 14).
    pub fn cache(&self, i: usize) -> bool {
        self.reference
            .devices
            .get(i)
            .is_some_and(|d| d.tier == lamina_format::superblock::TIER_CACHE)
    }

    /// Whether member `i` was taken out by `array evacuate` (it holds nothing).
    pub fn removed(&self, i: usize) -> bool {
        self.reference
            .devices
            .get(i)
            .is_some_and(|d| d.state == lamina_core::recovery::MEMBER_REMOVED)
    }

    /// Whether the array took member `i` out of service.
    pub fn failed(&self, i: usize) -> bool {
        self.reference
            .devices
            .get(i)
            .is_some_and(|d| d.state == MEMBER_FAILED)
    }

    /// Member `i` is one the array must do without: not found, or failed.
    fn lost(&self, i: usize) -> bool {
        !self.removed(i) && (self.members[i].is_none() || self.failed(i))
    }

    /// Members the array must do without, each counted once.
    pub fn unusable(&self) -> usize {
        (0..self.members.len()).filter(|&i| self.lost(i)).count()
    }

    /// Members the layout's parity lets the array do without (a mirrored cache
    /// tier: all its copies but one).
    pub fn parity(&self) -> usize {
        match self.reference.layout {
            lamina_format::superblock::Layout::Said5 => 1,
            lamina_format::superblock::Layout::Said6 => 2,
            _ => self.cache_copies().saturating_sub(1),
        }
    }

    /// Members of the cache tier (2 or 3 mirror each other).
    fn cache_copies(&self) -> usize {
        (0..self.members.len()).filter(|&i| self.cache(i)).count()
    }

    /// "complete", "degraded" (members missing or failed that parity covers) or
    /// "incomplete" (the array cannot be served from what was found).
    pub fn state(&self) -> &'static str {
        let n = self.unusable();
        let jbod = self.reference.layout == lamina_format::superblock::Layout::Jbod;
        // Beside a mirrored cache, a JBOD's capacity members have no copy.
        let capacity_ok = !jbod || (0..self.members.len()).all(|i| self.cache(i) || !self.lost(i));
        match n {
            0 => "complete",
            n if n <= self.parity() && capacity_ok => "degraded",
            _ => "incomplete",
        }
    }
}

/// What [`scan`] found: the arrays, and the devices it could not read (with why).
pub struct Scan {
    pub arrays: Vec<Found>,
    pub unreadable: Vec<(PathBuf, String)>,
}

/// The devices to look at: `paths` as given (a directory stands for the files
/// and block devices in it, not below), or without any, every block device the
/// kernel lists in /proc/partitions.
pub fn candidates(paths: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    if paths.is_empty() {
        let parts = std::fs::read_to_string("/proc/partitions").unwrap_or_default();
        for line in parts.lines().skip(2) {
            if let Some(name) = line.split_whitespace().nth(3) {
                out.push(Path::new("/dev").join(name));
            }
        }
        return Ok(out);
    }
    for p in paths {
        let meta =
            std::fs::metadata(p).with_context(|| format!("cannot look at {}", p.display()))?;
        if meta.is_dir() {
            let mut entries: Vec<PathBuf> = std::fs::read_dir(p)
                .with_context(|| format!("cannot list {}", p.display()))?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|e| {
                    std::fs::metadata(e)
                        .is_ok_and(|m| m.is_file() || m.file_type().is_block_device())
                })
                .collect();
            entries.sort();
            out.extend(entries);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// The arrays on `devices`, in the order their first device was found.
///
/// A member slot takes the device whose label is of the reference's generation
/// (or one less: a crash between the members' superblock writes); a device with an
/// older label missed updates (pulled while the array went on) and is passed over.
/// Two devices with equally new labels for one slot are the same member seen
/// twice (a loop device over its file, multipath legs and their map, the legs of
/// a mirror): the slot is left empty and both are named, rather than guess.
pub fn scan(devices: &[PathBuf]) -> Scan {
    scan_with(devices, LABEL_TIMEOUT, read_label)
}

/// [`scan`] with the time allowed and the way labels are read given.
fn scan_with(
    devices: &[PathBuf],
    timeout: Duration,
    read: fn(&Path) -> Result<Option<Superblock>>,
) -> Scan {
    let mut seen = Vec::new();
    let mut unique = Vec::new();
    for d in devices {
        // The same file under two names is looked at once; the name kept is the
        // one given (a /dev/disk/by-id name stays one).
        let canon = d.canonicalize().unwrap_or_else(|_| d.clone());
        if !seen.contains(&canon) {
            seen.push(canon);
            unique.push(d.clone());
        }
    }
    let mut labelled: Vec<(PathBuf, Superblock)> = Vec::new();
    let mut unreadable = Vec::new();
    for (d, label) in unique.iter().zip(read_all(&unique, timeout, read)) {
        match label {
            Some(Ok(Some(sb))) => labelled.push((d.clone(), sb)),
            Some(Ok(None)) => {}
            Some(Err(e)) => unreadable.push((d.clone(), format!("{e:#}"))),
            None => unreadable.push((
                d.clone(),
                format!("did not answer within {} s", timeout.as_secs_f64()),
            )),
        }
    }
    let mut found: Vec<Found> = Vec::new();
    for (_, sb) in &labelled {
        match found.iter_mut().find(|f| f.uuid == sb.array_uuid) {
            Some(f) if sb.generation > f.reference.generation => f.reference = sb.clone(),
            Some(_) => {}
            None => found.push(Found {
                uuid: sb.array_uuid,
                reference: sb.clone(),
                members: Vec::new(),
                passed_over: Vec::new(),
            }),
        }
    }
    for f in &mut found {
        let n = f.reference.devices.len();
        let newest = f.reference.generation;
        let mut by_slot: Vec<Vec<&PathBuf>> = vec![Vec::new(); n];
        for (path, sb) in labelled.iter().filter(|(_, sb)| sb.array_uuid == f.uuid) {
            let i = sb.device_index as usize;
            let same_member = match (sb.devices.get(i), f.reference.devices.get(i)) {
                (Some(own), Some(want)) => own.uuid == want.uuid,
                _ => false,
            };
            if !same_member {
                f.passed_over.push(format!(
                    "{}: a former member {i} (replaced since)",
                    path.display()
                ));
            } else if sb.generation + 1 < newest {
                f.passed_over.push(format!(
                    "{}: member {i}, but its label is of generation {} and the array's of {newest} (it missed updates)",
                    path.display(),
                    sb.generation
                ));
            } else {
                by_slot[i].push(path);
            }
        }
        f.members = by_slot
            .into_iter()
            .enumerate()
            .map(|(i, paths)| match paths.as_slice() {
                [one] => Some((*one).clone()),
                [] => None,
                many => {
                    f.passed_over.push(format!(
                        "member {i} is on {} at once (a loop device over its file, multipath, \
                         the legs of a mirror?): give the one to use",
                        many.iter()
                            .map(|p| p.display().to_string())
                            .collect::<Vec<_>>()
                            .join(" and ")
                    ));
                    None
                }
            })
            .collect();
    }
    Scan {
        arrays: found,
        unreadable,
    }
}

/// Every device's label, read at once, one thread each: a device that does not
/// answer (a read stuck in the kernel cannot be interrupted) holds up neither
/// the others nor the scan, which gives it up (`None`) at `timeout` after the
/// start and leaves its thread behind. Results come back in `devices`' order.
fn read_all(
    devices: &[PathBuf],
    timeout: Duration,
    read: fn(&Path) -> Result<Option<Superblock>>,
) -> Vec<Option<Result<Option<Superblock>>>> {
    let deadline = Instant::now() + timeout;
    let (tx, rx) = std::sync::mpsc::channel();
    for (i, d) in devices.iter().enumerate() {
        let (to_scan, d) = (tx.clone(), d.clone());
        let spawned = std::thread::Builder::new()
            .name("label".into())
            .spawn(move || {
                let _ = to_scan.send((i, read(&d)));
            });
        if let Err(e) = spawned {
            let _ = tx.send((
                i,
                Err(anyhow::anyhow!("cannot start a thread to read it: {e}")),
            ));
        }
    }
    drop(tx);
    let mut out: Vec<Option<Result<Option<Superblock>>>> = devices.iter().map(|_| None).collect();
    let mut left = devices.len();
    while left > 0 {
        let wait = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(wait) {
            Ok((i, r)) => {
                out[i] = Some(r);
                left -= 1;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => break,
            // Every reader is done, and some sent nothing: they failed.
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                for o in out.iter_mut().filter(|o| o.is_none()) {
                    *o = Some(Err(anyhow::anyhow!("the thread reading it failed")));
                }
                break;
            }
        }
    }
    out
}

/// Checks that the devices of a directory's configuration carry the array its
/// lamina.toml names (`array_uuid`; nothing to check when it names none): a
/// configuration copied or edited to point at another array's devices says so,
/// before anything is written to them.
pub fn check_config_devices(dir: &Path, uuid: Option<&str>, devices: &[PathBuf]) -> Result<()> {
    let Some(want) = uuid else {
        return Ok(());
    };
    for d in devices {
        // A device that cannot be read or holds no label is for the open to report.
        if let Ok(Some(sb)) = read_label(d) {
            let have = uuid_hex(&sb.array_uuid);
            if !have.eq_ignore_ascii_case(want) {
                bail!(
                    "{} holds array {:?} ({have}), but {}/lamina.toml is for array {want}: \
                     the configuration does not belong to these devices (`lamina array list {}` \
                     shows what they hold)",
                    d.display(),
                    sb.array_name,
                    dir.display(),
                    d.display()
                );
            }
        }
    }
    Ok(())
}

/// Opens `path` for [`wipe_label`] under its exclusive lock, as opening an array
/// does: a device that a server (or any Lamina process) holds is refused. The lock
/// lasts as long as the file.
pub fn lock_for_wipe(path: &Path) -> Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {} to wipe its superblocks", path.display()))?;
    // SAFETY: flock on a descriptor we own; released when it closes.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        bail!(
            "{} is in use (a running Lamina server holds it?): nothing wiped",
            path.display()
        );
    }
    Ok(f)
}

/// Wipes both superblock copies of the device `f` (opened by [`lock_for_wipe`]):
/// it stops being a member of anything; its data stays where it is, unreachable
/// (`mdadm --zero-superblock`).
pub fn wipe_label(f: &std::fs::File, path: &Path) -> Result<()> {
    let zero = vec![0u8; 4096];
    for off in SUPERBLOCK_OFFSETS {
        f.write_all_at(&zero, off)
            .with_context(|| format!("cannot wipe the superblock of {}", path.display()))?;
    }
    f.sync_all()
        .with_context(|| format!("cannot sync {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slow_or_empty(p: &Path) -> Result<Option<Superblock>> {
        if p.ends_with("stuck") {
            std::thread::sleep(Duration::from_secs(30));
        }
        if p.ends_with("bad") {
            bail!("input/output error");
        }
        Ok(None)
    }

    /// A device that does not answer is given up at the timeout and named; the
    /// others are read meanwhile, and the scan does not wait for the stuck one.
    #[test]
    fn a_device_that_does_not_answer_is_reported_not_waited_for() {
        let devices: Vec<PathBuf> = ["/x/a", "/x/stuck", "/x/bad", "/x/b"]
            .iter()
            .map(PathBuf::from)
            .collect();
        let t = Instant::now();
        let scan = scan_with(&devices, Duration::from_millis(300), slow_or_empty);
        let took = t.elapsed();
        assert!(took >= Duration::from_millis(300), "{took:?}");
        assert!(took < Duration::from_secs(5), "{took:?}");
        assert!(scan.arrays.is_empty());
        let names: Vec<_> = scan
            .unreadable
            .iter()
            .map(|(p, e)| format!("{}: {e}", p.display()))
            .collect();
        assert_eq!(
            names,
            [
                "/x/stuck: did not answer within 0.3 s",
                "/x/bad: input/output error"
            ]
        );
    }

    /// A FIFO is refused, not opened (opening it would wait for a writer).
    #[test]
    fn a_fifo_is_refused_without_being_opened() {
        let dir = std::env::temp_dir().join(format!("lamina-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let fifo = dir.join("f");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_label(&fifo).unwrap_err();
        assert!(
            format!("{e}").contains("not a file or a block device"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
