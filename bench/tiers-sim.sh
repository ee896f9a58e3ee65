#!/usr/bin/env bash
# A cache tier on real traces and synthetic workloads (issue 14), in `lamina sim`
# (the engine's own code, metadata only): blocks written to the capacity tier per
# user block, headers, summaries and metadata included, without a cache tier and
# with one of CACHE of the array's segments (at least 16) in front of it.
#
# Columns: blocks written to the capacity tier (the whole array without a cache)
# per user block, headers, summaries and metadata included; with a cache tier;
# and with a cache tier counting what it still holds live at the end (a short
# trace may leave most of its data in the cache: deferred, not saved).
#
#   bench/tiers-sim.sh [TRACE_DIR] [CACHE]
#   e.g. bench/tiers-sim.sh ../shared/traces 0.1
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-../shared/traces}
cache=${2:-0.1}
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
bin="$here/target/release/lamina"
source "$here/bench/lib.sh"
# Prints: capacity tier blocks per user block, the same counting what the cache
# still holds live at the end (as if it were emptied then), cache segments, user
# blocks.
wa() { "$bin" sim --quiet --json "$@" | python3 -c 'import json,sys; r=json.load(sys.stdin); c=r["cache"] or {}; w=r["capacity_write_amplification"]; print("%.3f %.3f %s %s" % (w, c.get("capacity_write_amplification_emptied", w), c.get("segments","-"), r["user_blocks_written"]))'; }
echo "| workload | user blocks | no cache | with a cache tier | ... counting what it still holds | cache segments | ratio (held counted) |"
echo "|---|---:|---:|---:|---:|---:|---:|"
row() {
  local name=$1; shift
  read -r a _ _ users < <(wa "$@")
  read -r b e segs _ < <(wa "$@" --cache "$cache")
  python3 -c "print('| %s | %s | %s | %s | %s | %s | %.2f |' % ('$name', '$users', '$a', '$b', '$e', '$segs', $a / max($e, 1e-9)))"
}
for t in "${bench_traces[@]}"; do
  IFS=: read -r file format extra <<<"$t"
  path=$dir/$file
  [ -f "$path" ] || path=$here/crates/lamina-sim/testdata/$file
  [ -f "$path" ] || { echo "missing trace $file" >&2; continue; }
  row "$file" --trace "$path" --trace-format "$format" $extra
done
for w in uniform zipf:0.9 zipf:1.2 hotcold:90/10; do
  row "$w, 2 GiB" --workload "$w" --capacity 2G
done
