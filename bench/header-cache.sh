#!/bin/bash
# Cold-cache 4 KiB random reads (iodepth 32, one connection) before and after a
# run of random writes, with the header cache's misses and the reads the
# connection's ring carried out (docs/benchmarks.md, "The header cache").
#
# Usage: bench/header-cache.sh [WRITE_SECONDS]   (root: it drops the page cache)
#   LAMINA_ENGINE: extra [engine] lines, e.g. 'direct_io = "on"' or
#   'header_cache = "1M"' (a cache smaller than the array's units).
# A 4 GiB array on one file under $TMPDIR (written in full first), a 2 GiB volume,
# 1 GiB of it filled and then read.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "bench: needs root (drop_caches)" >&2; exit 2; }
command -v fio >/dev/null || { echo "bench: fio is missing" >&2; exit 1; }
WRITE_SECONDS=${1:-60}
RUNTIME=${RUNTIME:-8}
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir 0 lamina-header-cache
d=$work/l; mkdir -p "$d"
new_array "$d" 4096
"$lamina" volume create "$d" vol --size 2G >/dev/null
LAMINA_ENGINE=$(no_discard_engine) lamina_configure "$d"
"$lamina" serve "$d" --unix "$d/nbd.sock" >"$d/serve.out" 2>"$d/serve.err" &
pids+=($!)
wait_sock "$d/nbd.sock"
L="nbd+unix:///vol?socket=$d/nbd.sock"
counters() {
  "$lamina" status "$d" --json | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["header_cache_misses"], j["reads_by_connection"])'
}
iops() { # rw seconds
  fio --name=b --ioengine=nbd --uri="$L" --bs=4k --iodepth=32 --rw="$1" --size=1g \
      --time_based --runtime="$2" --norandommap --randrepeat=0 --output-format=json 2>/dev/null |
    sed -n '/^{/,$p' |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))'
}
cold_read() { # label
  sync; echo 3 > /proc/sys/vm/drop_caches
  local m0 c0 m1 c1 n
  read -r m0 c0 <<<"$(counters)"
  n=$(iops randread "$RUNTIME")
  read -r m1 c1 <<<"$(counters)"
  printf '%-34s %10s %14s %14s\n' "$1" "$n" "$((m1 - m0))" "$((c1 - c0))"
}
fio --name=fill --ioengine=nbd --uri="$L" --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null 2>&1
echo "# cold randread 4 KiB iodepth 32, ${RUNTIME}s; engine: ${LAMINA_ENGINE:-defaults}"
printf '%-34s %10s %14s %14s\n' "before the cold read" IOPS "header misses" "ring reads"
cold_read "the fill only"
iops randwrite "$WRITE_SECONDS" >/dev/null
cold_read "after ${WRITE_SECONDS}s of random writes"
