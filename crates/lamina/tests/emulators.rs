//! The emulated devices as the benchmarks use them.

mod common;
use common::*;

/// `lamina bench endurance`: the raw SSD under 4 KiB random writes amplifies, Lamina
/// on the same SSD writes it sequentially (device WA close to 1), and the report
/// carries its keys.
#[test]
fn endurance_reproduction_reports_raw_and_lamina() {
    let out = lamina(&[
        "bench",
        "endurance",
        "--capacity",
        "256M",
        "--passes",
        "2",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let raw = j["raw"]["write_amplification"].as_f64().unwrap();
    let dev = j["lamina"]["device_write_amplification"].as_f64().unwrap();
    let lam = j["lamina"]["write_amplification"].as_f64().unwrap();
    assert!(
        raw > 4.0,
        "random 4 KiB writes over a full SSD amplify: {j}"
    );
    assert!(
        dev < 1.1,
        "Lamina's segments reach the SSD sequentially: {j}"
    );
    assert!(lam < raw, "{j}");
    assert!(j["lamina"]["erases"].as_u64().unwrap() < j["raw"]["erases"].as_u64().unwrap());
    // The drive's SMART-like report.
    let smart = &j["lamina_drive_smart"];
    for k in [
        "Host_Writes",
        "NAND_Writes",
        "Block_Erases",
        "Wear_Leveling_Count",
        "Percent_Lifetime_Used",
    ] {
        assert!(smart[k].as_str().is_some(), "{k} in {smart}");
    }
    // Bad emulator configuration: a clear error.
    let o = lamina_output(&["bench", "endurance", "--capacity", "102M"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("multiple of the erase block"), "{err}");
}

/// `lamina bench smr`: Lamina on the host-managed disk writes sequentially near
/// the ideal and sustains random writes far above the drive-managed disk, whose
/// random bandwidth grows with its media cache; the plot is written.
#[test]
fn smr_reproduction_host_managed_against_drive_managed() {
    let t = TempDir::new("smr-bench");
    let plot = t.join("smr.svg");
    let out = lamina(&[
        "bench",
        "smr",
        "--capacity",
        "1G",
        "--zone",
        "16M",
        "--passes",
        "1",
        "--cache-percent",
        "0.25,1",
        "--plot",
        plot.to_str().unwrap(),
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    assert!(f(&j["lamina_sequential_of_ideal"]) > 0.85, "{j}");
    let dm = j["drive_managed"].as_array().unwrap();
    assert!(f(&dm[0]["random_mb_s"]) < f(&dm[1]["random_mb_s"]), "{j}");
    assert!(f(&dm[1]["random_lamina_over_drive_managed"]) > 3.0, "{j}");
    assert!(std::fs::read_to_string(&plot).unwrap().contains("<svg"));
    let o = lamina_output(&["bench", "smr", "--zone", "100K"]);
    assert!(
        !o.status.success(),
        "a zone that is not a multiple of the write fails"
    );
}

/// `lamina bench iops`: on drives busy with their own garbage collection, Lamina
/// SAID5 serves more 4 KiB requests than RAID-0 and far more than RAID-5 with
/// read-modify-write, at every depth, and deeper queues help it.
#[test]
fn iops_reproduction_said5_against_raid0_and_raid5() {
    let out = lamina(&[
        "bench",
        "iops",
        "--capacity",
        "128M",
        "--requests",
        "30000",
        "--depths",
        "1,8",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let rows = j["rows"].as_array().unwrap();
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap();
    for r in rows {
        assert!(f(r, "lamina_iops") > 2.0 * f(r, "raid0_iops"), "{r}");
        assert!(f(r, "raid0_iops") > f(r, "raid5_iops"), "{r}");
    }
    assert!(
        f(&rows[1], "lamina_iops") > f(&rows[0], "lamina_iops"),
        "{j}"
    );
    let o = lamina_output(&["bench", "iops", "--ssds", "2"]);
    assert!(!o.status.success(), "two drives make no RAID-5");
}

/// `lamina bench geometry`: with geometry-aware placement GC gathers read-hot data
/// at the outer edge of the SMR disk, and reading it is faster than without.
#[test]
fn geometry_aware_placement_reads_hot_data_faster() {
    let out = lamina(&[
        "bench",
        "geometry",
        "--capacity",
        "1G",
        "--zone",
        "16M",
        "--rounds",
        "12",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let on = &j["geometry_aware"];
    let off = &j["plain"];
    assert!(
        f(&on["hot_mean_position"]) < 0.5 * f(&off["hot_mean_position"]),
        "{j}"
    );
    assert!(f(&j["speedup"]) > 1.2, "{j}");
}

/// `lamina probe DEVICE` on a real file: refuses without --destroy, then times the
/// patterns with direct I/O and reports each verdict with its evidence. (What the
/// verdicts should be is checked on emulated drives, whose geometry is known.)
#[test]
fn probe_of_a_real_file_reports_verdicts_with_evidence() {
    let t = TempDir::new("probe-file");
    let img = t.join("dev.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(96 << 20)
        .unwrap();
    let o = lamina_output(&["probe", img.to_str().unwrap(), "--size", "64M"]);
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--destroy"));
    let o = lamina_output(&["probe", img.to_str().unwrap(), "--size", "1G", "--destroy"]);
    assert!(!o.status.success(), "larger than the file");
    let out = lamina(&[
        "probe",
        img.to_str().unwrap(),
        "--size",
        "64M",
        "--destroy",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["indirection_unit_bytes"].as_u64().unwrap() >= 4096, "{j}");
    assert!(j["parallel_units"].as_u64().unwrap() >= 1, "{j}");
    assert_eq!(
        j["indirection_unit_evidence"].as_array().unwrap().len(),
        6,
        "{j}"
    );
    assert_eq!(j["parallel_evidence"].as_array().unwrap().len(), 7, "{j}");
    assert!(j["truth"].is_null());
    assert!(j["mapping"].as_str().is_some());
}

/// `lamina sim --flash`: the simulated array's writes replayed on an emulated SSD;
/// Lamina's segments reach it sequentially, so the drive adds little.
#[test]
fn sim_replays_on_an_emulated_ssd() {
    let out = lamina(&[
        "sim",
        "--capacity",
        "256M",
        "--flash",
        "tlc,pages-per-block=64",
        "--quiet",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let f = &j["flash"];
    let dev = f["device_write_amplification"].as_f64().unwrap();
    let nand = f["nand_bytes_per_user_byte"].as_f64().unwrap();
    assert!((1.0..1.2).contains(&dev), "{f}");
    assert!(nand >= j["write_amplification"].as_f64().unwrap(), "{j}");
    assert!(f["erases"].as_u64().unwrap() > 0, "{f}");
    let o = lamina_output(&["sim", "--capacity", "256M", "--flash", "tlc,dies=0"]);
    assert!(!o.status.success(), "an impossible drive is refused");
}

/// `lamina sim --trace` replays the blkparse sample in the repository, whose device
/// ("8,33") is not a valid volume name as it stands: the volume takes a name that
/// is ("8_33").
#[test]
fn sim_replays_the_blkparse_sample() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../lamina-sim/testdata/blkparse-ext4-sample.txt"
    );
    let out = lamina(&[
        "sim",
        "--trace",
        trace,
        "--trace-format",
        "blkparse",
        "--overprovision",
        "0.07",
        "--quiet",
        "--json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(j["write_amplification"].as_f64().unwrap() >= 1.0, "{j}");
    assert!(out.contains("8_33"), "{out}");
}

/// `lamina bench parity`: every routine runs and reports a rate, Q by words beats
/// Q by tables by a wide margin (the reason the word path exists), and bad
/// arguments are refused.
#[test]
fn parity_bench_reports_words_faster_than_tables() {
    let out = lamina(&["bench", "parity", "--seconds", "0.05", "--json"]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    let r = &j["gb_per_s"];
    for k in [
        "p",
        "pq_words",
        "pq_tables",
        "rebuild_one_data",
        "rebuild_data_and_p",
        "rebuild_two_data",
    ] {
        assert!(r[k].as_f64().unwrap() > 0.0, "{k}: {j}");
    }
    let (words, tables) = (
        r["pq_words"].as_f64().unwrap(),
        r["pq_tables"].as_f64().unwrap(),
    );
    assert!(
        words > 2.0 * tables,
        "words {words} against tables {tables} GB/s"
    );
    for bad in [
        &["--members", "1"][..],
        &["--chunk", "1K"],
        &["--seconds", "0"],
    ] {
        let mut args = vec!["bench", "parity"];
        args.extend_from_slice(bad);
        assert_eq!(lamina_output(&args).status.code(), Some(1), "{bad:?}");
    }
}

/// Starts `lamina emulate DRIVE SPEC` on a backing file and a socket in `t` named
/// after `tag`; returns the process and the socket once it listens.
fn start_emulate(
    t: &TempDir,
    tag: &str,
    drive: &[&str],
    extra: &[&str],
) -> (std::process::Child, std::path::PathBuf) {
    let sock = t.join(&format!("{tag}.sock"));
    let backing = t.join(&format!("{tag}.img"));
    let mut args = vec!["emulate"];
    args.extend_from_slice(drive);
    args.extend_from_slice(&["--backing", backing.to_str().unwrap()]);
    args.extend_from_slice(&["--unix", sock.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let child = std::process::Command::new(lamina_bin())
        .args(&args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    wait_for(&sock);
    (child, sock)
}

/// Stops an emulator with SIGINT; the counters it prints.
fn stop_emulate(child: std::process::Child) -> serde_json::Value {
    // SAFETY: signalling our child.
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// Runs `lamina emulate` on a QLC drive, writes `n` blocks one at a time through
/// NBD, reads them back; returns the seconds the writes took and the drive's
/// counters printed at SIGINT.
fn emulated_writes(t: &TempDir, tag: &str, n: u64, extra: &[&str]) -> (f64, serde_json::Value) {
    let (child, sock) = start_emulate(t, tag, &["--ssd", "qlc,capacity=64M"], extra);
    let mut c = lamina_nbd::client::Client::connect_unix(&sock, "ssd").unwrap();
    assert_eq!(c.size, 64 << 20);
    let t0 = std::time::Instant::now();
    for i in 0..n {
        c.write(i * 4096, &[i as u8 + 1; 4096], false).unwrap();
    }
    let secs = t0.elapsed().as_secs_f64();
    c.flush().unwrap();
    for i in 0..n {
        assert_eq!(c.read(i * 4096, 4096).unwrap(), vec![i as u8 + 1; 4096]);
    }
    c.trim(0, 4096).unwrap();
    assert_eq!(
        c.read(0, 4096).unwrap(),
        vec![0; 4096],
        "trimmed reads as zeros"
    );
    c.disconnect().unwrap();
    (secs, stop_emulate(child))
}

/// `lamina emulate`: the drive's data round-trips over NBD, its counters see every
/// byte, and pacing makes the host wait for the drive: QLC writes one at a time take
/// the drive's program time, which --no-pace does not wait for. Bad settings are
/// refused.
#[test]
fn emulated_ssd_is_served_at_the_drives_pace() {
    let t = TempDir::new("emulate");
    let n = 64;
    let (paced, stats) = emulated_writes(&t, "paced", n, &[]);
    assert_eq!(stats["host_bytes_written"], n * 4096, "{stats}");
    assert!(
        stats["write_amplification"].as_f64().unwrap() >= 1.0,
        "{stats}"
    );
    assert_eq!(stats["trimmed_bytes"], 4096, "{stats}");
    // The host waited for the drive: as long as its virtual clock ran, within the
    // pacing error it reports.
    let virtual_s = stats["virtual_us"].as_f64().unwrap() / 1e6;
    assert!(virtual_s > 0.02, "QLC programs take milliseconds: {stats}");
    let late = stats["pacing_late_mean_us"].as_f64().unwrap();
    assert!(late < 5000.0, "{stats}");
    let (unpaced, stats2) = emulated_writes(&t, "unpaced", n, &["--no-pace"]);
    assert_eq!(stats2["host_bytes_written"], n * 4096);
    // A stall of this machine (writeback, another job) only ever slows a run: the
    // unpaced run is timed twice, and the faster counts.
    let (again, _) = emulated_writes(&t, "unpaced2", n, &["--no-pace"]);
    let unpaced = unpaced.min(again);
    assert!(
        paced > 2.0 * unpaced && paced > 0.02,
        "paced writes took {paced:.4} s, unpaced {unpaced:.4} s"
    );

    let backing = t.join("small.img");
    std::fs::write(&backing, vec![0u8; 4096]).unwrap();
    let sock = t.join("bad.sock");
    let (b, s) = (backing.to_str().unwrap(), sock.to_str().unwrap());
    for args in [
        vec!["emulate", "--ssd", "plc", "--backing", b, "--unix", s],
        vec!["emulate", "--ssd", "qlc", "--backing", b, "--unix", s],
        vec!["emulate", "--ssd", "qlc", "--backing", b],
        vec![
            "emulate",
            "--ssd",
            "qlc,capacity=64M",
            "--backing",
            "/nonexistent/x",
            "--unix",
            s,
        ],
        vec![
            "emulate",
            "--ssd",
            "qlc",
            "--backing",
            b,
            "--unix",
            s,
            "--threads",
            "0",
        ],
    ] {
        let out = lamina_output(&args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        assert!(!out.stderr.is_empty(), "{args:?}: no message");
    }
}

/// `lamina emulate --smr`: a drive-managed SMR disk over NBD keeps the data, counts
/// what it writes to its media cache, and makes random reads wait for seeks and
/// rotation (milliseconds each).
#[test]
fn emulated_smr_disk_is_served_at_the_disks_pace() {
    let t = TempDir::new("emulate-smr");
    let smr = ["--smr", "capacity=256M,zone=16M,cache=4M"];
    let (child, sock) = start_emulate(&t, "smr", &smr, &[]);
    let mut c = lamina_nbd::client::Client::connect_unix(&sock, "smr").unwrap();
    assert_eq!(c.size, 256 << 20);
    // Sequential writes continue each zone's frontier; these scattered ones go to
    // the media cache.
    for i in 0..8u64 {
        c.write(i * (64 << 10), &[i as u8 + 1; 64 << 10], false)
            .unwrap();
        c.write((100 << 20) + i * (1 << 20), &[0xa0 + i as u8; 4096], false)
            .unwrap();
    }
    c.flush().unwrap();
    let t0 = std::time::Instant::now();
    for i in 0..8u64 {
        assert_eq!(
            c.read(i * (64 << 10), 4096).unwrap(),
            vec![i as u8 + 1; 4096]
        );
        let far = (100 << 20) + i * (1 << 20);
        assert_eq!(c.read(far, 4096).unwrap(), vec![0xa0 + i as u8; 4096]);
    }
    let reads = t0.elapsed().as_secs_f64();
    c.disconnect().unwrap();
    let j = stop_emulate(child);
    assert_eq!(j["host_bytes_written"], 8 * (64 << 10) + 8 * 4096, "{j}");
    assert!(
        j["cache_bytes_written"].as_u64().unwrap() >= 8 * 4096,
        "{j}"
    );
    // 16 reads alternating between two far places: a seek and a rotation each.
    assert!(
        reads > 16.0 * 0.002,
        "16 random reads took {reads:.4} s: {j}"
    );
}
