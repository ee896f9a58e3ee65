//! What a snapshot's map copy costs at 64 GiB written (16 Mi entries), per entry
//! as it was first written and page by page as `volume snapshot` does it:
//! `cargo run --release -p lamina-core --example snapshot_copy`.
use lamina_core::map::{encode_device, Map};
use lamina_core::types::{Lba, Pba};
fn main() {
    let n: u64 = 16 << 20; // 64 GiB of 4 KiB blocks
    let m = Map::new(n, (n * 2) as u32, 4096);
    for i in 0..n {
        m.store(Lba(i), encode_device(Pba((i * 2 % (n * 2)) as u32)));
    }
    let t = std::time::Instant::now();
    let c = Map::new(n, (n * 2) as u32, 4096);
    m.for_each_mapped(|l, e| c.store(l, e));
    println!("copy of {n} entries: {:?}", t.elapsed());
    let t = std::time::Instant::now();
    let d = Map::new(n, (n * 2) as u32, 4096);
    d.copy_entries_from(&m);
    println!("page copy of {n} entries: {:?}", t.elapsed());
    for i in (0..n).step_by(4099) {
        assert_eq!(d.load(Lba(i)), m.load(Lba(i)));
    }
}
