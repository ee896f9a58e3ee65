#!/usr/bin/env bash
# What a mirrored cache tier costs (issue 14): the same array with one cache device
# and with two that mirror each other, in alternating rounds. Each run makes a
# fresh array (a 2 GiB capacity file and 256 MiB cache files, written in full
# first and made with --no-discard, on /dev/shm unless DISK=1, so the engine's own
# cost shows), a 1 GiB volume written once through the cache (compaction moves it
# on), then RUNTIME seconds of fio per workload (nbd engine, 4 KiB, iodepth 32, one
# connection, random over the volume).
#
# Usage: bench/mirror.sh [ROUNDS]   (env: RUNTIME=8, DISK=1, WORKLOADS="randwrite randread")
# Prints IOPS and the server's CPU time per request (µs) of each run, then medians
# and the ratio mirrored / single.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh
rounds=${1:-3}
runtime=${RUNTIME:-8}
workloads=${WORKLOADS:-randwrite randread}
for t in fio; do command -v $t >/dev/null || { echo "mirror: $t is missing" >&2; exit 1; }; done
lamina=${LAMINA:-target/release/lamina}
[ -x "$lamina" ] || cargo build --release -q
bench_workdir "$([ "${DISK:-0}" = 1 ] && echo 0 || echo 1)" lamina-mirror
hz=$(getconf CLK_TCK)

run() { # copies workload -> "IOPS CPU"
  local copies=$1 rw=$2 w="$work/a" pid t0 t1 args=()
  rm -rf "$w"; mkdir -p "$w"
  dd if=/dev/zero of="$w/cap.img" bs=4M count=512 status=none
  args=(--device "$w/cap.img")
  for i in $(seq "$copies"); do
    dd if=/dev/zero of="$w/cache$i.img" bs=4M count=64 status=none
    args+=(--cache-device "$w/cache$i.img")
  done
  "$lamina" array create "$w/arr" "${args[@]}" --no-discard >/dev/null
  LAMINA_ENGINE=$(no_discard_engine) lamina_configure "$w/arr"
  "$lamina" volume create "$w/arr" vol --size 1G >/dev/null
  "$lamina" serve "$w/arr" --unix "$w/nbd.sock" --no-tcp >"$w/out" 2>"$w/err" &
  pid=$!
  pids+=("$pid")
  wait_sock "$w/nbd.sock"
  local uri="nbd+unix:///vol?socket=$w/nbd.sock"
  fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null 2>&1
  t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  fio --name=m --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw="$rw" --size=1g \
    --time_based --runtime="$runtime" --norandommap --randrepeat=0 --output-format=json \
    >"$w/fio.json" 2>/dev/null
  t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  python3 - "$w/fio.json" "$t0" "$t1" "$hz" "$runtime" <<'PY'
import json, sys
s = open(sys.argv[1]).read()
j = json.loads(s[s.index('{'):])["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
t0, t1, hz, rt = map(float, sys.argv[2:6])
print(round(iops), round((t1 - t0) / hz * 1e6 / (iops * rt), 1))
PY
  kill -TERM "$pid"
  wait "$pid" 2>/dev/null || true
}

printf '%-10s %-6s %12s %8s %12s %8s\n' workload round "1 copy IOPS" "cpu µs" "2 copies" "cpu µs"
for rw in $workloads; do
  a=() b=()
  for r in $(seq "$rounds"); do
    read -r ai ac <<<"$(run 1 "$rw")"
    read -r bi bc <<<"$(run 2 "$rw")"
    a+=("$ai"); b+=("$bi")
    printf '%-10s %-6s %12s %8s %12s %8s\n' "$rw" "$r" "$ai" "$ac" "$bi" "$bc"
  done
  ma=$(median "${a[@]}") mb=$(median "${b[@]}")
  printf '%-10s %-6s %12s %8s %12s %8s   mirrored / single %s\n' "$rw" median "$ma" "" "$mb" "" \
    "$(python3 -c "print(round($mb / $ma, 2))")"
done
