//! A real file system on a Lamina volume: nbdfuse exposes the export as a file,
//! losetup makes it a block device, mkfs.ext4, mount, copy a tree of real files,
//! unmount, restart `lamina serve`, mount again; e2fsck finds nothing and every
//! file's checksum is unchanged.

mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// nbdfuse + loop device + mount point, torn down in reverse order on drop.
struct Stack {
    fuse_dir: PathBuf,
    nbdfuse: Option<Child>,
    loopdev: Option<String>,
    mounted: Option<PathBuf>,
}

impl Stack {
    fn attach(uri: &str, fuse_dir: &Path) -> Stack {
        std::fs::create_dir_all(fuse_dir).unwrap();
        let child = Command::new("nbdfuse")
            .arg(fuse_dir.join("disk"))
            .arg(uri)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("nbdfuse");
        let mut s = Stack {
            fuse_dir: fuse_dir.to_path_buf(),
            nbdfuse: Some(child),
            loopdev: None,
            mounted: None,
        };
        let t0 = Instant::now();
        while !fuse_dir.join("disk").exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "nbdfuse did not come up"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let dev = run(
            "losetup",
            &["-f", "--show", fuse_dir.join("disk").to_str().unwrap()],
        );
        s.loopdev = Some(dev.trim().to_string());
        s
    }
    fn dev(&self) -> &str {
        self.loopdev.as_deref().unwrap()
    }
    fn mount(&mut self, at: &Path) {
        std::fs::create_dir_all(at).unwrap();
        run("mount", &[self.dev(), at.to_str().unwrap()]);
        self.mounted = Some(at.to_path_buf());
    }
    fn unmount(&mut self) {
        if let Some(m) = self.mounted.take() {
            run("umount", &[m.to_str().unwrap()]);
        }
    }
    fn detach(&mut self) {
        self.unmount();
        if let Some(d) = self.loopdev.take() {
            run("losetup", &["-d", &d]);
        }
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.fuse_dir)
                .status();
            let t0 = Instant::now();
            while c.try_wait().unwrap().is_none() && t0.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(m) = self.mounted.take() {
            let _ = Command::new("umount").arg("-l").arg(m).status();
        }
        if let Some(d) = self.loopdev.take() {
            let _ = Command::new("losetup").args(["-d", &d]).status();
        }
        if let Some(mut c) = self.nbdfuse.take() {
            let _ = Command::new("fusermount3")
                .arg("-u")
                .arg(&self.fuse_dir)
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[test]
fn ext4_survives_restart_with_identical_files() {
    if !need(
        "ext4::ext4_survives_restart_with_identical_files",
        &[
            "nbdfuse",
            "fusermount3",
            "losetup",
            "mkfs.ext4",
            "e2fsck",
            "mount",
            "sha256sum",
        ],
        true,
    ) {
        return;
    }
    let t = TempDir::new("ext4");
    let dir = t.join("arr");
    create_array(
        &dir,
        "1G",
        &["--segment-size", "2M", "--write-unit", "256K"],
    );
    create_volume(&dir, "fs", "512M");
    let s = Server::start(&dir);
    let mut stack = Stack::attach(&s.uri("fs"), &t.join("fuse"));
    run("mkfs.ext4", &["-q", "-F", "-E", "nodiscard", stack.dev()]);
    let mnt = t.join("mnt");
    stack.mount(&mnt);
    // A tree of real files (documentation: thousands of small and mid-sized files)
    // plus a few large ones of random bytes.
    run(
        "cp",
        &["-a", "/usr/share/doc", mnt.join("doc").to_str().unwrap()],
    );
    for i in 0..3 {
        run(
            "dd",
            &[
                "if=/dev/urandom",
                &format!("of={}", mnt.join(format!("big{i}")).display()),
                "bs=1M",
                "count=24",
                "status=none",
            ],
        );
    }
    run("fstrim", &[mnt.to_str().unwrap()]);
    let sums = run(
        "sh",
        &[
            "-c",
            &format!(
                "cd {} && find . -type f -print0 | sort -z | xargs -0 sha256sum",
                mnt.display()
            ),
        ],
    );
    assert!(sums.lines().count() > 100, "copied too few files");
    stack.detach();
    s.stop();

    let st = status_json(&dir);
    assert!(st["user_bytes_written"].as_u64().unwrap() > 64 << 20);

    let s = Server::start(&dir);
    let mut stack = Stack::attach(&s.uri("fs"), &t.join("fuse"));
    run("e2fsck", &["-fn", stack.dev()]);
    stack.mount(&mnt);
    let again = run(
        "sh",
        &[
            "-c",
            &format!(
                "cd {} && find . -type f -print0 | sort -z | xargs -0 sha256sum",
                mnt.display()
            ),
        ],
    );
    assert!(again == sums, "file checksums changed across the restart");
    stack.detach();
    s.stop();
}
