#!/usr/bin/env bash
# Ceph on Lamina (issue 16, item 5; the SALSA poster's Ceph experiment): a one-host
# Ceph cluster (bench/ceph-lib.sh: a monitor, a manager, three BlueStore OSDs,
# replication 3) whose three OSD devices are, by MODE:
#   raw:        loop devices on files of OSD bytes (what Ceph gets from the files);
#   lamina:     one Lamina array per file, one volume on each (85% of the file, the
#               rest is the array's spare), through nbdfuse and a loop device;
#   ssd-raw:    emulated SSDs (`lamina emulate --ssd $SSD --aged`: a drive in use
#               for random writes, at its GC's steady state) through nbdfuse and a
#               loop device;
#   ssd-lamina: the same emulated SSDs, each under its own Lamina array as above.
# An RBD image of IMAGE bytes is written once, then fio's rbd engine runs 4 KiB
# random I/O, 80% reads and 20% writes (the poster's mix), iodepth 32, RUNTIME
# seconds of warm-up and RUNTIME seconds measured; then `rbd bench` 4 KiB random
# 80/20 for RBD_TOTAL bytes. For the emulated SSDs the table adds the drives' own
# write amplification (NAND bytes programmed per byte the host wrote, over the run).
# Last, PostgreSQL on a second RBD image of PGIMAGE bytes: qemu-nbd serves the image
# through librbd (qemu's rbd driver, as a VM's disk would be), and the stack of
# bench/postgres.sh runs on it (nbdfuse -> loop -> ext4 -> PostgreSQL with fsync on,
# pgbench -s SCALE, CLIENTS clients, RUNTIME seconds; bench/pg-lib.sh).
#
#   bench/ceph.sh                 # all four rows; MODES="raw lamina" for some
#
# Env: OSD (each OSD device, default 6G), IMAGE (2G), RUNTIME (30), RBD_TOTAL (64M),
# PGIMAGE (1G; 0 leaves PostgreSQL out), SCALE (10), CLIENTS (4),
# SSD (qlc,iu=64K: CSAL's low-cost QLC drive, 64 KiB indirection unit), ROUNDS (1),
# MODES, CEPH_DISCARD=1 (BlueStore's bdev_enable_discard, off by default, as in
# Ceph), LAMINA_ENGINE and LAMINA_SERVE (lib.sh). Files go to $BENCH_DIR (default
# /var/tmp). Needs root (losetup) and Debian's ceph-mon, ceph-mgr, ceph-osd,
# ceph-common, fio (with its rbd engine), nbdfuse, and for PostgreSQL qemu-nbd with
# qemu-block-extra (its rbd driver) and postgresql.
set -Eeuo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh
source bench/ceph-lib.sh
source bench/pg-lib.sh
OSD=${OSD:-6G}
IMAGE=${IMAGE:-2G}
RUNTIME=${RUNTIME:-30}
RBD_TOTAL=${RBD_TOTAL:-64M}
SSD=${SSD:-qlc,iu=64K}
ROUNDS=${ROUNDS:-1}
MODES=${MODES:-raw lamina ssd-raw ssd-lamina}
PGIMAGE=${PGIMAGE:-1G}
SCALE=${SCALE:-10}
CLIENTS=${CLIENTS:-4}
for t in ceph-mon ceph-mgr ceph-osd ceph rbd fio nbdfuse losetup; do
  command -v "$t" >/dev/null || {
    echo "bench: $t not found (apt-get install ceph-mon ceph-mgr ceph-osd ceph-common fio nbdfuse)" >&2
    exit 1
  }
done
if [ "$PGIMAGE" != 0 ]; then
  pg_check_tools
  command -v qemu-nbd >/dev/null && [ -e /usr/lib/x86_64-linux-gnu/qemu/block-rbd.so ] || {
    echo "bench: qemu-nbd with its rbd driver is missing (apt-get install qemu-utils qemu-block-extra), or PGIMAGE=0" >&2
    exit 1
  }
fi
[ "$(id -u)" = 0 ] || {
  echo "bench: needs root (losetup)" >&2
  exit 1
}
cargo build --release -q
bin=$PWD/target/release/lamina
work=$(mktemp -d "${BENCH_DIR:-/var/tmp}/lamina-ceph.XXXX")
# What to undo, in the order it was done: the stack is undone backwards.
undo=()
stop_all() {
  local i
  [ -n "${CEPH_DIR:-}" ] && ceph_down
  CEPH_DIR=
  for ((i = ${#undo[@]} - 1; i >= 0; i--)); do eval "${undo[i]}" 2>/dev/null || true; done
  undo=()
}
trap 'pg_teardown; stop_all; rm -rf "$work"' EXIT
trap 'echo "bench: failed at line $LINENO: $BASH_COMMAND" >&2' ERR

# server NAME CMD...: starts a server listening on $work/NAME.sock (its stdout in
# $work/NAME.out); it is stopped with SIGINT, and waited for, when undone.
server() {
  local name=$1
  shift
  "$@" >"$work/$name.out" 2>"$work/$name.log" &
  undo+=("kill -INT $!; wait $!")
  wait_sock "$work/$name.sock"
}
# fuse_file NAME URI: URI as the file $work/NAME/disk (nbdfuse), in $file.
fuse_file() {
  mkdir -p "$work/$1"
  nbdfuse "$work/$1/disk" "$2" >/dev/null 2>&1 &
  undo+=("fusermount3 -u $work/$1 || umount -l $work/$1")
  wait_file "$work/$1/disk"
  file=$work/$1/disk
}
# loop FILE: a loop device on FILE, appended to $devs.
loop() {
  devs+=("$(losetup -f --show "$1")")
  undo+=("losetup -d ${devs[-1]}")
}
# lamina_on NAME MEMBER: an array on MEMBER (a file, or PATH:SIZE to create one)
# with one volume of 85% of its size, served and exposed as a loop device.
lamina_on() {
  local bytes
  "$bin" array create "$work/$1" --device "$2" >/dev/null
  lamina_configure "$work/$1"
  bytes=$(stat -c %s "${2%%:*}")
  "$bin" volume create "$work/$1" osd --size "$((bytes * 85 / 100 / 4096 * 4096))" >/dev/null
  server "$1" "$bin" serve "$work/$1" --unix "$work/$1.sock" --no-tcp
  fuse_file "$1-vol" "nbd+unix:///osd?socket=$work/$1.sock"
  loop "$file"
}
# ssd NAME: an emulated SSD of OSD bytes, in use, as the file $file.
ssd() {
  server "$1" "$bin" emulate --ssd "$SSD,capacity=$OSD" --aged --backing "$work/$1.img" \
    --unix "$work/$1.sock"
  fuse_file "$1-drive" "nbd+unix:///ssd?socket=$work/$1.sock"
}

# Three OSD devices for MODE, as block devices in $devs.
make_devices() {
  devs=()
  local i
  for i in 0 1 2; do
    case $1 in
      raw)
        truncate -s "$OSD" "$work/raw$i.img"
        loop "$work/raw$i.img"
        ;;
      lamina) lamina_on "arr$i" "$work/arr$i.img:$OSD" ;;
      ssd-raw)
        ssd "ssd$i"
        loop "$file"
        ;;
      ssd-lamina)
        ssd "ssd$i"
        lamina_on "arr$i" "$file"
        ;;
    esac
  done
}

# The emulated drives' write amplification over the run (after they stopped).
drive_wa() {
  python3 - "$work"/ssd?.out <<'PY'
import json, sys
host = nand = 0
for p in sys.argv[1:]:
    t = open(p).read()
    j = json.loads(t[t.index("{"):])
    host += j["host_bytes_written"]; nand += j["nand_bytes_programmed"]
print("%.2f" % (nand / host) if host else "-")
PY
}

fio_rbd() { # NAME RW [fio args...] -> JSON
  local name=$1 rw=$2
  shift 2
  fio --name="$name" --ioengine=rbd --clientname=admin --pool=rbd --rbdname=img \
    --rw="$rw" --bs=4k --iodepth=32 --output-format=json "$@"
}

rows=()
for round in $(seq "$ROUNDS"); do
  for mode in $MODES; do
    echo "bench: round $round, OSDs on $mode" >&2
    make_devices "$mode"
    export CEPH_CONF=$work/ceph/ceph.conf # rbd and fio's rbd engine read it
    ceph_up "$work/ceph" "${devs[@]}"
    cephc osd pool create rbd 32 32 >/dev/null 2>&1
    cephc osd pool application enable rbd rbd >/dev/null 2>&1
    rbd create --size "$IMAGE" rbd/img
    # Written once, so reads find data.
    fio_rbd fill write --bs=1M --iodepth=8 >/dev/null
    fio_rbd warm randrw --rwmixread=80 --time_based --runtime="$RUNTIME" >/dev/null
    j=$(fio_rbd mix randrw --rwmixread=80 --time_based --runtime="$RUNTIME")
    rb=$(rbd bench --io-type readwrite --rw-mix-read 80 --io-size 4K --io-threads 32 \
      --io-total "$RBD_TOTAL" --io-pattern rand rbd/img 2>&1 |
      awk '/elapsed:/ {for (i = 1; i <= NF; i++) if ($i == "ops/sec:") print $(i + 1)}')
    tps=-
    if [ "$PGIMAGE" != 0 ]; then
      rbd create --size "$PGIMAGE" rbd/pg
      server pg qemu-nbd --persistent -f raw -k "$work/pg.sock" "rbd:rbd/pg:conf=$CEPH_CONF"
      qnbd=$!
      fuse_file pg-img "nbd+unix:///?socket=$work/pg.sock"
      pg_on_file "$file" "$work"
      tps=$(printf "%.1f" "$pg_tps")
      # Down before Ceph is (stop_all takes Ceph down first).
      fusermount3 -u "$work/pg-img"
      kill -INT "$qnbd"
      wait "$qnbd" || true
    fi
    row=$(echo "$j" | python3 -c '
import json, sys
t = sys.stdin.read(); j = json.loads(t[t.index("{"):])["jobs"][0]
r, w = j["read"], j["write"]
p = lambda x: x["clat_ns"]["percentile"]["99.000000"] / 1000
print("%.0f %.0f %.0f %.0f" % (r["iops"], w["iops"], p(r), p(w)))')
    stop_all
    wa=-
    case $mode in ssd-*) wa=$(drive_wa) ;; esac
    rows+=("$mode $row ${rb%.*} $tps $wa")
    rm -rf "${work:?}"/*
  done
done

echo "| OSD devices | 80/20 read IOPS | 80/20 write IOPS | read p99 (µs) | write p99 (µs) | rbd bench 80/20 ops/s | pgbench TPS | drives' WA |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
for r in "${rows[@]}"; do
  read -r m ri wi rp wp rb tps wa <<<"$r"
  echo "| $m | $ri | $wi | $rp | $wp | $rb | $tps | $wa |"
done
