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
    // Bad emulator configuration: a clear error.
    let o = lamina_output(&["bench", "endurance", "--capacity", "102M"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("multiple of the erase block"), "{err}");
}
