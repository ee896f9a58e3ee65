#!/usr/bin/env bash
# How well `lamina emulate` paces an emulated SSD to wall time.
#
# An emulated drive (SPEC, default tlc,capacity=2G) is served twice, paced and with
# --no-pace; its first REGION (default 512m) is written sequentially, then fio (nbd
# engine, 4 KiB, RUNTIME s) runs random reads and writes at queue depth 1 and 32.
# For each: fio's mean completion latency paced and unpaced (the difference is what
# the drive added), and the emulator's own pacing error (how late replies were let
# go after the drive's virtual completion time: mean and max, from its exit JSON,
# one emulator per run).
#
# Usage: bench/emulate-pacing.sh   env: SPEC, REGION, RUNTIME (default 5)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
SPEC=${SPEC:-tlc,capacity=2G}
REGION=${REGION:-512m}
RUNTIME=${RUNTIME:-5}
command -v fio >/dev/null || { echo "bench: fio is missing" >&2; exit 1; }
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir 0 lamina-emulate

# fio: mean completion latency (µs) and IOPS of one run.
run_fio() { # uri rw qd
  fio --name=e --ioengine=nbd --uri="$1" --bs=4k --iodepth="$3" --rw="$2" --size="$REGION" \
      --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json 2>/dev/null |
    sed -n '/^{/,$p' |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; k="read" if "read" in sys.argv[1] else "write"; print(round(j[k]["clat_ns"]["mean"]/1000,1), round(j[k]["iops"]))' "$2"
}
declare -A lat iops pacing
jobs=("randread 1" "randwrite 1" "randread 32" "randwrite 32")
for job in "${jobs[@]}"; do
  for mode in paced unpaced; do
    flag=""; [ $mode = unpaced ] && flag=--no-pace
    rm -f "$work/drive.img" "$work/e.sock"
    "$lamina" emulate --ssd "$SPEC" --backing "$work/drive.img" --unix "$work/e.sock" $flag \
      >"$work/e.out" 2>"$work/e.err" &
    pid=$!
    pids+=($pid)
    for _ in $(seq 100); do [ -S "$work/e.sock" ] && break; sleep 0.1; done
    uri="nbd+unix:///ssd?socket=$work/e.sock"
    fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=8 --rw=write --size="$REGION" >/dev/null 2>&1
    read -r l i < <(run_fio "$uri" $job)
    lat["$mode $job"]=$l; iops["$mode $job"]=$i
    kill -INT $pid; wait $pid || true
    pacing["$mode $job"]=$(tail -1 "$work/e.out" |
      python3 -c 'import json,sys; j=json.load(sys.stdin); print(round(j["pacing_late_mean_us"],1), j["pacing_late_max_us"])')
  done
done
echo "lamina emulate --ssd $SPEC: fio 4 KiB over $REGION written once, ${RUNTIME}s per run"
echo
echo "| job | paced: mean latency (µs) | IOPS | unpaced: mean latency (µs) | IOPS | pacing error: mean, max (µs) |"
echo "|---|---:|---:|---:|---:|---:|"
for job in "${jobs[@]}"; do
  read -r m x <<<"${pacing[paced $job]}"
  echo "| ${job% *} QD${job#* } | ${lat[paced $job]} | ${iops[paced $job]} | ${lat[unpaced $job]} | ${iops[unpaced $job]} | $m, $x |"
done
echo
echo "Pacing error: how late replies were let go after the drive's completion time, over"
echo "the run (the sequential fill included), from the emulator's exit JSON."
