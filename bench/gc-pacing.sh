#!/usr/bin/env bash
# GC pacing (issue 12, item 5): user writes slowed smoothly as GC falls behind
# (`[engine] gc_pacing = true`) against running at full speed until the user floor
# stops them (`gc_pacing = false`, the default), in alternating runs.
#
# Each run: a fresh array on one file of 2 GiB (or the emulated drive, below), a
# volume at 80% of its usable capacity written once and then overwritten randomly
# twice its size (GC in steady state), then RUNTIME seconds of 4 KiB random writes at iodepth 32 (one
# connection): IOPS and the writes' completion latency (p50, p99, p99.9, max); then
# RUNTIME seconds of the same writer beside a reader (4 KiB randread, iodepth 32,
# held to READ_RATE IOPS, its own connection): the reader's p99 and p99.9. The
# server's waits for GC (paced, at the floor) over both.
#
# --qlc: the array's device is an emulated QLC SSD (`lamina emulate --ssd
# qlc,capacity=1G,channels=8,dies=4`, paced to wall time, through nbdfuse), where GC's reads are slow
# against the writes it makes room for.
#
# Usage: bench/gc-pacing.sh [--shm] [--qlc] [ROUNDS]
#   env: RUNTIME (default 10), READ_RATE (2000), MODES (default "true false")
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shm=0 qlc=0
while [ $# -gt 0 ]; do
  case $1 in
    --shm) shm=1 ;;
    --qlc) qlc=1 ;;
    *) break ;;
  esac
  shift
done
rounds=${1:-3}
RUNTIME=${RUNTIME:-10}
READ_RATE=${READ_RATE:-2000}
command -v fio >/dev/null || { echo "bench: fio is missing" >&2; exit 1; }
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir $shm lamina-pacing

# fio's JSON on stdin -> "iops p50 p99 p99.9 max" (µs) of the job's writes or reads.
lat() { # read|write
  sed -n '/^{/,$p' | python3 -c '
import json, sys
jobs = json.load(sys.stdin)["jobs"]
k = sys.argv[1]
j = next(j for j in jobs if j[k]["total_ios"] > 0)[k]
p = j["clat_ns"]["percentile"]
print(round(j["iops"]), *(round(p[q] / 1000) for q in ("50.000000", "99.000000", "99.900000")),
      round(j["clat_ns"]["max"] / 1000))' "$1"
}
waits() { "$lamina" status "$1" --json | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["gc_pace_waits"], j["gc_floor_waits"])'; }

# run PACING: sets $result to "iops p50 p99 p99.9 max r99 r99.9 pace_waits floor_waits"
# (not printed: in a command substitution set -e would not apply, and the pids
# the EXIT trap needs would be lost).
run() {
  local d="$work/arr" pid usable vol uri w r pw0 fw0 pw1 fw1 epid="" fpid=""
  rm -rf "$d"
  if [ $qlc = 1 ]; then
    "$lamina" emulate --ssd qlc,capacity=1G,channels=8,dies=4 --backing "$work/qlc.img" --unix "$work/qlc.sock" \
      >/dev/null 2>&1 &
    epid=$!
    wait_sock "$work/qlc.sock"
    mkdir -p "$work/fuse"
    nbdfuse "$work/fuse/dev" "nbd+unix:///ssd?socket=$work/qlc.sock" >/dev/null 2>&1 &
    fpid=$!
    pids+=($epid $fpid)
    wait_file "$work/fuse/dev"
    "$lamina" array create "$d" --device "$work/fuse/dev" >/dev/null
  else
    "$lamina" array create "$d" --device "$d.img:2G" >/dev/null
  fi
  LAMINA_ENGINE="gc_pacing = $1" lamina_configure "$d"
  usable=$("$lamina" status "$d" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["usable_bytes"])')
  vol=$(( usable * 8 / 10 / 1048576 ))M
  "$lamina" volume create "$d" vol --size "$vol" >/dev/null
  "$lamina" serve "$d" --unix "$d/nbd.sock" >"$work/serve.out" 2>"$work/serve.err" &
  pid=$!
  pids+=($pid)
  wait_sock "$d/nbd.sock"
  uri="nbd+unix:///vol?socket=$d/nbd.sock"
  fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=8 --rw=write --size="$vol" >/dev/null 2>&1
  fio --name=age --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw=randwrite --size="$vol" \
      --io_size=$(( ${vol%M} * 2 ))M --norandommap --randrepeat=0 >/dev/null 2>&1
  read -r pw0 fw0 <<<"$(waits "$d")"
  w=$(fio --name=w --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw=randwrite --size="$vol" \
      --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json 2>/dev/null | lat write)
  r=$(fio --ioengine=nbd --uri="$uri" --bs=4k --size="$vol" --time_based --runtime="$RUNTIME" \
      --norandommap --randrepeat=0 --output-format=json \
      --name=reader --rw=randread --iodepth=32 --rate_iops="$READ_RATE" \
      --name=writer --rw=randwrite --iodepth=32 2>/dev/null | lat read)
  read -r pw1 fw1 <<<"$(waits "$d")"
  kill -TERM $pid; wait $pid 2>/dev/null || true
  if [ -n "$epid" ]; then
    fusermount3 -u "$work/fuse" || fusermount3 -u -z "$work/fuse"
    wait "$fpid" 2>/dev/null || true
    kill -INT "$epid"; wait "$epid" 2>/dev/null || true
  fi
  pids=()
  rm -rf "$d" "$d.img" "$work/qlc.img" "$work/qlc.sock"
  read -r _ _ r99 r999 _ <<<"$r"
  result="$w $r99 $r999 $((pw1 - pw0)) $((fw1 - fw0))"
}

declare -A res
modes=${MODES:-true false}
for i in $(seq "$rounds"); do
  for p in $modes; do
    run $p
    res[$p,$i]=$result
    echo "round $i gc_pacing=$p: ${res[$p,$i]}" >&2
  done
done
where="a file of 2 GiB on disk"; [ $shm = 1 ] && where="a file of 2 GiB on /dev/shm"
[ $qlc = 1 ] && where="an emulated 1 GiB QLC SSD (32 dies)"
echo "GC steady state (an array on $where, volume 80% of usable), 4 KiB randwrite iodepth 32, ${RUNTIME}s; medians of $rounds alternating rounds"
echo
echo "| gc_pacing | write IOPS | write p50 (µs) | p99 | p99.9 | max | read p99 beside the writer (µs) | read p99.9 | paced waits | floor waits |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
for p in $modes; do
  cols=()
  for c in 1 2 3 4 5 6 7 8 9; do
    vals=()
    for i in $(seq "$rounds"); do vals+=("$(echo "${res[$p,$i]}" | cut -d' ' -f$c)"); done
    cols+=("$(median "${vals[@]}")")
  done
  row="| $p"
  for c in "${cols[@]}"; do row+=" | $c"; done
  echo "$row |"
done
