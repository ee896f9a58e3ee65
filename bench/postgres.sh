#!/usr/bin/env bash
# PostgreSQL on Lamina (issue 16, item 4): pgbench's TPC-B-like load on ext4 on a
# Lamina volume against the same stack on `nbdkit file`, and on an emulated QLC SSD
# raw against Lamina on the same drive (the SALSA poster's database experiment).
#
# Every row is the same stack above its NBD export: nbdfuse -> losetup -> ext4
# (mkfs -E nodiscard, mounted without discard) -> PostgreSQL (fsync on,
# synchronous_commit on, max_wal_size 256MB) -> pgbench -i -s SCALE, then pgbench
# with CLIENTS clients for RUNTIME seconds. Rows:
#   nbdkit         nbdkit file over a file of VOL
#   lamina-fresh   lamina serve: an array on a file, a volume of VOL never written
#   lamina-steady  the same array, the volume first written whole (1 MiB writes) and
#                  then over again with 4 KiB random writes (half its size), so GC
#                  runs from the start: the array's spare is what `array create`
#                  leaves (device = VOL / 0.7)
#   qlc-raw        `lamina emulate --ssd qlc,capacity=QLC --aged` (paced to wall
#                  time; a drive used for random writes, at its GC's steady state),
#                  ext4 on the drive
#   qlc-lamina     the same aged drive, a Lamina array on it (through nbdfuse), a
#                  volume of VOL, ext4 on the volume
# Printed: TPS (pgbench's, without connection time) and mean latency per row, and
# the ratios lamina/nbdkit and qlc-lamina/qlc-raw; for the QLC rows the drive's
# write amplification from its exit counters.
#
# Usage: bench/postgres.sh [--shm] [--rows "nbdkit lamina-fresh ..."]
#   --shm   files on /dev/shm (the engines' own cost shows; fsync costs nothing)
#   env: SCALE (10), CLIENTS (4), RUNTIME (30), VOL (2G), QLC (4G)
# Needs root (losetup, mount), fio, nbdkit, nbdfuse, PostgreSQL (Debian's layout).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shm=0
rows="nbdkit lamina-fresh lamina-steady qlc-raw qlc-lamina"
while [ $# -gt 0 ]; do
  case $1 in
    --shm) shm=1 ;;
    --rows) rows=$2; shift ;;
    *) echo "usage: $0 [--shm] [--rows ROWS]" >&2; exit 2 ;;
  esac
  shift
done
SCALE=${SCALE:-10}
CLIENTS=${CLIENTS:-4}
RUNTIME=${RUNTIME:-30}
VOL=${VOL:-2G}
QLC=${QLC:-4G}
source "$here/bench/pg-lib.sh"
pg_check_tools
for t in fio nbdkit nbdfuse; do
  command -v $t >/dev/null || { echo "bench: $t is missing" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "bench: needs root (losetup, mount)" >&2; exit 1; }
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir $shm lamina-pg
chmod 755 "$work"
cleanup() {
  pg_teardown
  for f in "$work"/fuse-*; do [ -d "$f" ] && fusermount3 -u -z "$f" 2>/dev/null || true; done
  bench_cleanup
}
trap cleanup EXIT
bytes() { numfmt --from=iec "$1"; }


# Functions that start processes set globals rather than print: a command
# substitution would run them in a subshell and lose the pids.

# fuse_file NAME URI: nbdfuse exposes URI as $work/fuse-NAME/disk, in $fuse_path.
fuse_file() {
  mkdir -p "$work/fuse-$1"
  nbdfuse "$work/fuse-$1/disk" "$2" >/dev/null 2>&1 &
  pids+=($!)
  wait_file "$work/fuse-$1/disk"
  fuse_path="$work/fuse-$1/disk"
}

# pg_on_uri ROW URI: ext4 + PostgreSQL on the export, pgbench; sets tps[ROW], lat[ROW].
pg_on_uri() {
  fuse_file top "$2"
  pg_on_file "$fuse_path" "$work"
  tps[$1]=$pg_tps
  lat[$1]=$pg_lat
  fusermount3 -u "$work/fuse-top"
}

# stop_all: every server and nbdfuse of the row, and its files.
stop_all() {
  for f in "$work"/fuse-*; do
    mountpoint -q "$f" && { fusermount3 -u "$f" 2>/dev/null || fusermount3 -u -z "$f"; }
  done
  for p in "${pids[@]:-}"; do [ -n "$p" ] && kill -INT "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  pids=()
  rm -rf "$work"/fuse-* "$work"/row
}

# lamina_array DEVICE: an array on DEVICE with one volume `pg` of VOL, served; the
# export's URI in $uri.
lamina_array() {
  "$lamina" array create "$work/row/arr" --device "$1" >/dev/null
  "$lamina" volume create "$work/row/arr" pg --size "$VOL" >/dev/null
  "$lamina" serve "$work/row/arr" >"$work/row/serve.log" 2>&1 &
  lamina_pid=$!
  pids+=($!)
  wait_sock "$work/row/arr/nbd.sock"
  uri="nbd+unix:///pg?socket=$work/row/arr/nbd.sock"
}

# qlc_drive: an emulated QLC SSD at its GC's steady state; its URI in $uri.
qlc_drive() {
  "$lamina" emulate --ssd "qlc,capacity=$QLC" --aged --backing "$work/row/qlc.img" --unix "$work/row/qlc.sock" \
    >"$work/row/qlc.out" 2>"$work/row/qlc.err" &
  pids+=($!)
  qlc_pid=$!
  wait_sock "$work/row/qlc.sock"
  uri="nbd+unix:///ssd?socket=$work/row/qlc.sock"
}
# qlc_wa: stops the drive and sets wa[$row] from its exit counters (not in a
# command substitution: the subshell could not wait for the drive).
qlc_wa() {
  kill -INT "$qlc_pid"; wait "$qlc_pid" || true
  wa[$row]=$(tail -1 "$work/row/qlc.out" | python3 -c 'import json,sys; j=json.load(sys.stdin); print(round(j["write_amplification"],2))' 2>/dev/null || echo "-")
}

declare -A tps lat wa
for row in $rows; do
  mkdir -p "$work/row"
  wa[$row]="-"
  case $row in
    nbdkit)
      truncate -s "$VOL" "$work/row/file.img"
      nbdkit --foreground -U "$work/row/kit.sock" file "$work/row/file.img" >/dev/null 2>&1 &
      pids+=($!)
      wait_sock "$work/row/kit.sock"
      pg_on_uri $row "nbd+unix:///?socket=$work/row/kit.sock"
      ;;
    lamina-fresh | lamina-steady)
      dev_bytes=$(($(bytes "$VOL") * 10 / 7))
      lamina_array "$work/row/dev.img:$dev_bytes"
      if [ $row = lamina-steady ]; then
        fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=16 --rw=write >/dev/null 2>&1
        fio --name=churn --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw=randwrite \
          --io_size=$(($(bytes "$VOL") / 2)) --norandommap --randrepeat=0 >/dev/null 2>&1
      fi
      pg_on_uri $row "$uri"
      ;;
    qlc-raw)
      qlc_drive
      pg_on_uri $row "$uri"
      qlc_wa
      ;;
    qlc-lamina)
      qlc_drive
      fuse_file qlc "$uri"
      lamina_array "$fuse_path"
      pg_on_uri $row "$uri"
      # Lamina first (it flushes and checkpoints onto the drive), then the drive.
      kill -INT "$lamina_pid"; wait "$lamina_pid" || true
      fusermount3 -u "$work/fuse-qlc"
      qlc_wa
      ;;
    *) echo "bench: unknown row $row" >&2; exit 2 ;;
  esac
  stop_all
done

where=disk; [ $shm = 1 ] && where=/dev/shm
echo "pgbench -s $SCALE, $CLIENTS clients, ${RUNTIME}s, files on $where, volume $VOL, QLC drive $QLC"
echo
echo "| row | TPS | mean latency (ms) | drive WA |"
echo "|---|---:|---:|---:|"
for row in $rows; do echo "| $row | ${tps[$row]} | ${lat[$row]} | ${wa[$row]} |"; done
ratio() { python3 -c 'import sys; a,b=sys.argv[1:]; print(f"{float(a)/float(b):.2f}x")' "$1" "$2" 2>/dev/null || echo "-"; }
echo
[ -n "${tps[nbdkit]:-}" ] && for r in lamina-fresh lamina-steady; do
  [ -n "${tps[$r]:-}" ] && echo "$r / nbdkit: $(ratio "${tps[$r]}" "${tps[nbdkit]}")"
done
[ -n "${tps[qlc-raw]:-}" ] && [ -n "${tps[qlc-lamina]:-}" ] && echo "qlc-lamina / qlc-raw: $(ratio "${tps[qlc-lamina]}" "${tps[qlc-raw]}")"
true
