#!/usr/bin/env bash
# Recovery time after kill -9 against the data written since the last checkpoint.
#
# For each amount, a fresh array (checkpoints disabled by a huge interval) is filled
# with that much data (1 MiB sequential writes through NBD), flushed, and the server
# is killed with SIGKILL. The page cache is dropped (when running as root) so the
# restart reads from the device, and the restart's own measurement of its recovery
# ("recovered ... in Xs", which includes loading the checkpoint, walking and
# replaying the units written after it, and writing the post-recovery checkpoint)
# is reported, with the bytes recovery read: the checkpoint, the headers of the units
# written after it, and the data of units not yet covered by a completed sync (their
# checksums are verified, since only they can be torn).
#
# Usage: bench/recovery.sh [AMOUNT...]   (default: 256M 512M 1G 2G)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
amounts=("$@")
[ ${#amounts[@]} -gt 0 ] || amounts=(256M 512M 1G 2G)
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
work=$(mktemp -d "${TMPDIR:-/tmp}/lamina-recovery.XXXXXX")
trap 'pkill -9 -f "lamina serve $work" 2>/dev/null || true; rm -rf "$work"' EXIT

drop_caches() { [ "$(id -u)" = 0 ] && sync && echo 3 > /proc/sys/vm/drop_caches 2>/dev/null || true; }

printf '%-10s %14s %12s %16s %12s\n' written units_replayed recovery_s checkpoint_blocks bytes_read
for amt in "${amounts[@]}"; do
  d="$work/$amt"
  "$lamina" array create "$d" --device "$d/dev.img:8G" >/dev/null
  "$lamina" volume create "$d" v --size 6G >/dev/null
  sed -i 's/^\[engine\]$/[engine]\ncheckpoint_interval = "1T"/' "$d/lamina.toml"
  "$lamina" serve "$d" --unix "$d/nbd.sock" >/dev/null 2>"$d/err1" &
  pid=$!
  for _ in $(seq 100); do [ -S "$d/nbd.sock" ] && break; sleep 0.1; done
  fio --name=fill --ioengine=nbd --uri="nbd+unix:///v?socket=$d/nbd.sock" --bs=1m --iodepth=8 \
      --rw=write --size="$amt" --fsync=256 --end_fsync=1 >/dev/null 2>&1
  kill -9 $pid; wait $pid 2>/dev/null || true
  drop_caches
  "$lamina" serve "$d" --unix "$d/nbd.sock" >/dev/null 2>"$d/err2" &
  pid=$!
  for _ in $(seq 600); do grep -q "recovered" "$d/err2" 2>/dev/null && break; sleep 0.1; done
  line=$(grep "recovered" "$d/err2")
  kill -INT $pid; wait $pid 2>/dev/null || true
  secs=$(sed -E 's/.* in ([0-9.]+)s.*/\1/' <<<"$line")
  units=$(sed -E 's/.*, ([0-9]+) units.*/\1/' <<<"$line")
  read_b=$(sed -E 's/.*ignored, (.*) read$/\1/' <<<"$line")
  ckpt=$(sed -E 's/.*generation [0-9]+ \(([0-9]+) blocks\).*/\1/' <<<"$line")
  printf '%-10s %14s %12s %16s %12s\n' "$amt" "$units" "$secs" "$ckpt" "$read_b"
  rm -rf "$d"
done
