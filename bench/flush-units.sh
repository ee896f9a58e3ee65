#!/usr/bin/env bash
# Short units on a drive with a large indirection unit: Lamina on an aged emulated
# QLC SSD (CSAL's 64 KiB indirection unit, `lamina emulate --ssd qlc,iu=64K --aged`)
# through nbdfuse, 4 KiB random writes at iodepth 32 for RUNTIME seconds, with a
# flush every FSYNC writes (fio's fsync=N; 0: none). A flush seals the open unit
# however full it is, so the drive gets writes shorter than its indirection unit
# and pays a read-modify-write for each; the drive's own counters (printed at its
# exit) tell what that costs: its write amplification and the read-modify-writes.
#
#   bench/flush-units.sh                 # FSYNCS="0 8"
#   env: FSYNCS ("0 8"), RUNTIME (35), DRIVE (2G), VOL (1G)
# Needs fio (nbd engine), nbdfuse, nbdinfo.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
FSYNCS=${FSYNCS:-0 8}
RUNTIME=${RUNTIME:-35}
DRIVE=${DRIVE:-2G}
VOL=${VOL:-1G}
for t in fio nbdfuse nbdinfo fusermount3; do
  command -v $t >/dev/null || { echo "bench: $t is missing" >&2; exit 1; }
done
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
bin="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir 0 lamina-flush-units
# On the way out, whatever run is left: its nbdfuse first, then the servers.
trap 'for m in "$work"/fs*/m; do fusermount3 -u -z "$m" 2>/dev/null || true; done; bench_cleanup' EXIT

echo "| fio fsync= | write IOPS | drive WA | drive read-modify-writes (64 KiB units) | host MiB written |"
echo "|---:|---:|---:|---:|---:|"
for fs in $FSYNCS; do
  w="$work/fs$fs"
  mkdir -p "$w/m"
  "$bin" emulate --ssd "qlc,iu=64K,capacity=$DRIVE" --aged --backing "$w/q.img" \
    --unix "$w/q.sock" >"$w/q.out" 2>"$w/q.err" &
  drive=$!
  pids+=($drive)
  wait_sock "$w/q.sock"
  nbdfuse "$w/m/disk" "nbd+unix:///ssd?socket=$w/q.sock" &
  wait_file "$w/m/disk"
  "$bin" array create "$w/arr" --device "$w/m/disk" >/dev/null
  "$bin" volume create "$w/arr" v --size "$VOL" >/dev/null
  "$bin" serve "$w/arr" >"$w/serve.log" 2>&1 &
  server=$!
  pids+=($server)
  uri="nbd+unix:///v?socket=$w/arr/nbd.sock"
  for _ in $(seq 100); do nbdinfo --size "$uri" >/dev/null 2>&1 && break; sleep 0.1; done
  iops=$(fio --name=w --ioengine=nbd --uri="$uri" --rw=randwrite --bs=4k --iodepth=32 \
    --time_based --runtime="$RUNTIME" --fsync="$fs" --output-format=json |
    python3 -c 'import json,sys; t=sys.stdin.read(); print(round(json.loads(t[t.index("{"):])["jobs"][0]["write"]["iops"]))')
  kill -INT "$server"; wait "$server" || true
  fusermount3 -u "$w/m"
  kill -INT "$drive"; wait "$drive" || true
  tail -1 "$w/q.out" | python3 -c '
import json, sys
fs, iops = sys.argv[1:]
j = json.load(sys.stdin)
print("| %s | %s | %.2f | %d | %d |" % (fs, iops, j["write_amplification"], j["rmw_ius"], j["host_bytes_written"] >> 20))' "$fs" "$iops"
done
