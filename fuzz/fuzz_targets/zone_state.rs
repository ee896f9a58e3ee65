//! Opens an emulated zoned device from a zone-state file (`FILE.zones`) holding the
//! input: a damaged file must give an error or offline zones, never a panic.
//! The input's first byte, with bit 0 set, asks for the records' checksums to be
//! made valid, so that what follows them is exercised too.
#![no_main]
use lamina_device::mem::MemDevice;
use lamina_device::zoned::ZonedDevice;
use libfuzzer_sys::fuzz_target;
use std::sync::Arc;

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    let mut state = rest.to_vec();
    if mode & 1 == 1 {
        lamina_device::zoned::fuzzing_reseal_state(&mut state);
    }
    let path = std::env::temp_dir().join(format!("lamina-fuzz-{}.zones", std::process::id()));
    std::fs::write(&path, &state).unwrap();
    let inner = Arc::new(MemDevice::new("fuzz", 8 << 20));
    if let Ok(d) = ZonedDevice::open_persistent(inner, &path) {
        let _ = d.zones();
        let _ = d.damaged_zones();
    }
});
