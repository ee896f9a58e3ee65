#!/usr/bin/env bash
# The device engines side by side, on one SAID5 array of four files on the disk:
#   sync          [engine] io_engine = "sync": pread/pwrite/fdatasync, the members
#                 of a row set written one after another, and synced one after another
#   uring         io_engine = "auto": io_uring batches (every member's columns of a
#                 row set in flight at once, every member's data sync at once)
#   uring+direct  the same with direct_io = "on" (O_DIRECT, no page cache)
# Workloads (fio's nbd engine, 4 KiB, one connection):
#   write+flush   random writes at iodepth 1 with a flush after each (fio --fsync=1):
#                 what a flush costs, which is what parallel member syncs change
#   randwrite     random writes at iodepth 32
#   randread cold random reads at iodepth 32 after dropping the page cache (root)
# Each round runs every engine in turn on the same array (the server restarted with
# the other setting); medians over ROUNDS.
#
# Usage: bench/io-engines.sh    env: ROUNDS (default 3), RUNTIME seconds (default 8)
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-8}
if [ "$(id -u)" != 0 ]; then echo "bench: needs root (drop_caches)" >&2; exit 2; fi
for t in fio nbdinfo; do
  command -v $t >/dev/null || { echo "bench: $t is missing (apt-get install fio libnbd-bin)" >&2; exit 1; }
done
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"

work=$(mktemp -d "${TMPDIR:-/tmp}/lamina-engines.XXXXXX")
pid=""
cleanup() {
  [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

arr="$work/arr"
mkdir -p "$arr"
devs=()
for i in 0 1 2 3; do
  # Written in full, as a block device's blocks all exist.
  dd if=/dev/zero of="$work/d$i.img" bs=4M count=128 status=none
  devs+=(--device "$work/d$i.img")
done
"$lamina" array create "$arr" --layout said5 "${devs[@]}" >/dev/null
"$lamina" volume create "$arr" v --size 1G >/dev/null
cp "$arr/lamina.toml" "$work/base.toml"

declare -A settings=(
  [sync]='io_engine = "sync"'
  [uring]='io_engine = "auto"'
  [uring+direct]=$'io_engine = "auto"\ndirect_io = "on"'
)
engines=(sync uring uring+direct)

start() { # engine
  python3 - "$work/base.toml" "$arr/lamina.toml" "${settings[$1]}" <<'PY'
import sys
s = open(sys.argv[1]).read()
assert "\n[engine]\n" in s
open(sys.argv[2], "w").write(s.replace("\n[engine]\n", "\n[engine]\n" + sys.argv[3] + "\n", 1))
PY
  "$lamina" serve "$arr" --unix "$arr/nbd.sock" >/dev/null 2>"$work/serve.err" &
  pid=$!
  for _ in $(seq 100); do
    nbdinfo --size "nbd+unix:///v?socket=$arr/nbd.sock" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "lamina did not start:" >&2; cat "$work/serve.err" >&2; exit 1
}
stop() {
  kill -TERM "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done; pid=""
}
uri="nbd+unix:///v?socket=$arr/nbd.sock"
run_fio() { # rw iodepth extra...
  local rw=$1 qd=$2; shift 2
  fio --name=b --ioengine=nbd --uri="$uri" --bs=4k --iodepth="$qd" --rw="$rw" \
      --size=512m --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 \
      --output-format=json "$@" 2>/dev/null | sed -n '/^{/,$p' |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))'
}

start sync
fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=8 --rw=write --size=512m >/dev/null 2>&1
stop

declare -A res
workloads=("write+flush" "randwrite" "randread cold")
for _ in $(seq "$ROUNDS"); do
  for e in "${engines[@]}"; do
    start "$e"
    res["$e|write+flush"]+="$(run_fio randwrite 1 --fsync=1) "
    res["$e|randwrite"]+="$(run_fio randwrite 32) "
    stop
    sync; echo 3 > /proc/sys/vm/drop_caches
    start "$e"
    res["$e|randread cold"]+="$(run_fio randread 32) "
    stop
  done
done

source "$here/bench/lib.sh"
echo "# SAID5 over 4 files of 512M on $(df --output=source,fstype "$work" | tail -1 | tr -s ' ' ' '); 4 KiB, one connection, ${RUNTIME}s x $ROUNDS rounds (median IOPS)"
printf '%-16s %12s %12s %14s %16s\n' workload sync uring uring+direct "uring / sync"
for w in "${workloads[@]}"; do
  # shellcheck disable=SC2086
  s=$(median ${res["sync|$w"]}); u=$(median ${res["uring|$w"]}); d=$(median ${res["uring+direct|$w"]})
  printf '%-16s %12s %12s %14s %16s\n' "$w" "$s" "$u" "$d" "$(python3 -c "print(round($u / max(1, $s), 2))")"
done
