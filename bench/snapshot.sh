#!/usr/bin/env bash
# Snapshots (issue "Volumes"): how long `lamina volume snapshot` takes, end to end
# (the command, the map copy on the engine's thread and the checkpoint that makes
# it durable), as the volume holds more data, on an idle array and beside a writer
# (4 KiB random writes, iodepth 32); what one snapshot writes to the media; and the
# writer's IOPS with and without snapshots being taken.
# Usage: bench/snapshot.sh [--shm]   env: SIZES (volume sizes, written in full;
#   default "1G 4G 16G"), RUNTIME (seconds of the writer, default 8), TAKES (3)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shm=0
[ "${1:-}" = --shm ] && shm=1
SIZES=${SIZES:-1G 4G 16G}
RUNTIME=${RUNTIME:-8}
TAKES=${TAKES:-3}
command -v fio >/dev/null || { echo "bench: fio is missing" >&2; exit 1; }
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir $shm lamina-snap
status() { "$lamina" status "$1" --json | python3 -c "import json,sys; print(json.load(sys.stdin)[\"$2\"])"; }
# ms to take snapshot NAME of v in DIR
take() {
  local t0 t1
  t0=$(date +%s%N)
  "$lamina" volume snapshot "$1" v "$2" >/dev/null
  t1=$(date +%s%N)
  echo $(( (t1 - t0) / 1000000 ))
}
echo "| volume written | snapshot, idle (ms) | media bytes one snapshot writes | snapshot beside a writer (ms) | writer IOPS, no snapshots | writer IOPS, $TAKES snapshots |"
echo "|---|---:|---:|---:|---:|---:|"
for size in $SIZES; do
  gib=${size%G}
  dir="$work/a$gib"
  mkdir -p "$dir"
  # Room for the volume twice over (its snapshots keep what the writer replaces).
  "$lamina" array create "$dir" --device "$dir/dev.img:$(( gib * 3 + 1 ))G" >/dev/null
  "$lamina" volume create "$dir" v --size "$size" >/dev/null
  "$lamina" serve "$dir" >"$dir/serve.out" 2>"$dir/serve.err" &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$dir/nbd.sock" ] && break; sleep 0.1; done
  uri="nbd+unix:///v?socket=$dir/nbd.sock"
  fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=8 --rw=write --size="$size" >/dev/null 2>&1
  idle=()
  for i in $(seq "$TAKES"); do
    before=$(status "$dir" media_bytes_written)
    idle+=("$(take "$dir" "idle$i")")
    after=$(status "$dir" media_bytes_written)
    bytes=$(( after - before ))
    "$lamina" volume delete "$dir" "idle$i" >/dev/null
  done
  writer() {
    fio --name=w --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw=randwrite --size="$size" \
      --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 --output-format=json 2>/dev/null |
      sed -n '/^{/,$p' | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["write"]["iops"]))'
  }
  quiet=$(writer)
  writer >"$dir/iops" &
  wp=$!
  sleep 1
  loaded=()
  for i in $(seq "$TAKES"); do
    loaded+=("$(take "$dir" "load$i")")
    sleep 1
  done
  wait $wp
  echo "| $size | $(median "${idle[@]}") | $bytes | $(median "${loaded[@]}") | $quiet | $(cat "$dir/iops") |"
  kill "${pids[-1]}"
  wait "${pids[-1]}" 2>/dev/null || true
  rm -f "$dir/dev.img"
done
