//! Arrays are self-describing, and real block devices work as members.

mod common;
use common::*;
use lamina_nbd::client::Client;
use lamina_testkit::{decode_pattern, pattern, BS};

/// Move the device files elsewhere and describe them in another order: the array
/// comes back from its superblocks, data intact.
#[test]
fn devices_can_move_and_be_listed_in_any_order() {
    let t = TempDir::new("move");
    let dir = t.join("arr");
    let a = t.join("a.img");
    let b = t.join("b.img");
    lamina(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--device",
        &format!("{}:48M", a.display()),
        "--device",
        &format!("{}:64M", b.display()),
        "--segment-size",
        "1M",
        "--write-unit",
        "128K",
    ]);
    create_volume(&dir, "v", "64M");
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in (0..16384u64).step_by(7) {
        c.write(lba * BS as u64, &pattern(lba, 1), false).unwrap();
    }
    c.flush().unwrap();
    drop(c);
    srv.stop();
    // Another machine: new paths, new configuration directory, reversed order.
    let moved = t.join("elsewhere");
    std::fs::create_dir_all(&moved).unwrap();
    std::fs::rename(&a, moved.join("first.img")).unwrap();
    std::fs::rename(&b, moved.join("second.img")).unwrap();
    let dir2 = t.join("arr2");
    std::fs::create_dir_all(&dir2).unwrap();
    std::fs::write(
        dir2.join("lamina.toml"),
        format!(
            "devices = [\"{}\", \"{}\"]\n",
            moved.join("second.img").display(),
            moved.join("first.img").display()
        ),
    )
    .unwrap();
    let srv = Server::start(&dir2);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in (0..16384u64).step_by(7) {
        assert_eq!(
            decode_pattern(lba, &c.read(lba * BS as u64, BS as u32).unwrap()),
            Ok(1),
            "block {lba}"
        );
    }
    drop(c);
    srv.stop();
    assert_eq!(
        status_json(&dir2)["array"]["devices"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

/// A loop block device as the array's member (the raw block device path).
#[test]
fn block_device_member() {
    if !need("devices::block_device_member", &["losetup"], true) {
        return;
    }
    let t = TempDir::new("blockdev");
    let img = t.join("backing.img");
    std::fs::File::create(&img)
        .unwrap()
        .set_len(96 << 20)
        .unwrap();
    let loopdev = run("losetup", &["-f", "--show", img.to_str().unwrap()])
        .trim()
        .to_string();
    struct Detach(String);
    impl Drop for Detach {
        fn drop(&mut self) {
            let _ = std::process::Command::new("losetup")
                .args(["-d", &self.0])
                .status();
        }
    }
    let _detach = Detach(loopdev.clone());
    let dir = t.join("arr");
    lamina(&[
        "array",
        "create",
        dir.to_str().unwrap(),
        "--device",
        &loopdev,
        "--segment-size",
        "1M",
        "--write-unit",
        "128K",
    ]);
    create_volume(&dir, "v", "32M");
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in 0..512u64 {
        c.write(lba * BS as u64, &pattern(lba, 2), false).unwrap();
    }
    c.flush().unwrap();
    drop(c);
    srv.kill9();
    let srv = Server::start(&dir);
    let mut c = Client::connect_unix(&srv.sock, "v").unwrap();
    for lba in 0..512u64 {
        assert_eq!(
            decode_pattern(lba, &c.read(lba * BS as u64, BS as u32).unwrap()),
            Ok(2)
        );
    }
    drop(c);
    srv.stop();
    let st = status_json(&dir);
    assert_eq!(st["array"]["devices"][0], loopdev.as_str());
}
