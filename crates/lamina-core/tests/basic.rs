mod common;
use common::*;
use lamina_core::Request;
use lamina_device::mem::MemDevice;
use lamina_device::BlockDevice;
use std::sync::Arc;

fn mem_array(segments: u64) -> Vec<Arc<dyn BlockDevice>> {
    let d: Arc<dyn BlockDevice> = Arc::new(MemDevice::new("mem0", device_bytes(segments)));
    let devs = vec![d];
    format_devices(&devs, &small_params());
    devs
}

#[test]
fn write_flush_read_restart() {
    let devs = mem_array(64);
    let mut e = open_rw(&devs, small_config());
    let vol = create_volume(&mut e, "v", 4 << 20);
    for lba in 0..100u64 {
        let r = call(&mut e, Request::Write { volume: vol, offset: lba * 4096, data: pattern(lba, 1), fua: false });
        r.result.unwrap();
    }
    call(&mut e, Request::Flush).result.unwrap();
    for lba in 0..100u64 {
        assert_eq!(decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(), 1);
    }
    assert_eq!(decode_pattern(500, &read_block(&e, vol, 500)).unwrap(), 0);
    drop(e);
    let mut e = open_rw(&devs, small_config());
    let vol = e.shared().volume("v").unwrap().id;
    for lba in 0..100u64 {
        assert_eq!(decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(), 1, "lba {lba} after restart");
    }
    // Overwrite, zero a range, restart again.
    for lba in 0..50u64 {
        call(&mut e, Request::Write { volume: vol, offset: lba * 4096, data: pattern(lba, 2), fua: false }).result.unwrap();
    }
    call(&mut e, Request::Zero { volume: vol, offset: 10 * 4096, length: 5 * 4096, fua: true }).result.unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    for lba in 0..100u64 {
        let want = if (10..15).contains(&lba) { 0 } else if lba < 50 { 2 } else { 1 };
        assert_eq!(decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(), want, "lba {lba}");
    }
}

#[test]
fn gc_runs_and_data_survives() {
    let devs = mem_array(64);
    let mut e = open_rw(&devs, small_config());
    let usable = e.usable_bytes();
    let blocks = (usable * 8 / 10) / 4096;
    let vol = create_volume(&mut e, "v", blocks * 4096);
    let mut version = vec![0u64; blocks as usize];
    let mut x = 12345u64;
    for i in 0..blocks * 6 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let lba = if i < blocks { i } else { x % blocks };
        version[lba as usize] += 1;
        let r = call(&mut e, Request::Write { volume: vol, offset: lba * 4096, data: pattern(lba, version[lba as usize]), fua: false });
        r.result.unwrap_or_else(|err| panic!("write {i} of lba {lba}: {err}"));
    }
    let st = e.status();
    eprintln!("{st:#?}");
    assert!(st.gc_bytes_relocated > 0, "GC must have run: {st:?}");
    assert!(st.write_amplification.unwrap() > 1.0);
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(), version[lba as usize], "lba {lba}");
    }
    call(&mut e, Request::Flush).result.unwrap();
    drop(e);
    let e = open_rw(&devs, small_config());
    for lba in 0..blocks {
        assert_eq!(decode_pattern(lba, &read_block(&e, vol, lba)).unwrap(), version[lba as usize], "lba {lba} after restart");
    }
}
