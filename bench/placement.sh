#!/usr/bin/env bash
# Placement on real traces and synthetic workloads, footprint-matched: every
# placement of a row gets the same array, the one greedy without separation gets
# (the working set x (1 + spare), plus its reserve), and pays for its extra open
# segments and reserve out of the spare. Prints WA for greedy without separation, SepBIT (Lamina's
# implementation, its published defaults: 6 classes, cost-benefit with sqrt age),
# the default (what `lamina sim` and `lamina serve` do without options), the
# tuned Lamina classifier and the oracle, with default/greedy and default/SepBIT.
#
#   bench/placement.sh [TRACES_DIR] [SPARES] [SEGMENTS] [SYNTHETIC_CAPACITY] [WORKLOADS]
#   bench/placement.sh ../shared/traces "0.07 0.176 0.28" "8M 512M" 4G
#   bench/placement.sh ../shared/traces "0.07 0.176 0.28" 512M 4G ""   (traces only)
#
# A cell that fails (ENOSPC: the placement's open segments do not fit the spare)
# prints "fail". "segments" is the array's size in segments, reserve included.
#
# SEEDS="1 2 3" runs each synthetic cell once per seed and prints the mean WA: a
# few GC choices early in a run move a single run's WA by 1-2% either way, so
# differences that small between placements are noise unless they hold over seeds.
# A trace is one ordering of requests: it runs once.
set -uo pipefail
dir=${1:-../shared/traces}
spares=${2:-"0.07 0.176 0.28"}
segs=${3:-"8M 512M"}
cap=${4:-4G}
workloads=${5-"uniform zipf:0.2 zipf:0.6 zipf:1.0 zipf:1.2 hotcold:90/10"}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
seeds=${SEEDS:-1}
source "$(dirname "$0")/lib.sh"
wa_once() {
  "$bin" sim "$@" --footprint-classes 1 --json --quiet 2>/dev/null |
    python3 -c 'import json,sys; d=json.load(sys.stdin); print("%.4f/%d" % (d["write_amplification"], d["config"]["segments"]))' 2>/dev/null ||
    echo fail/0
}
# The mean over $seeds for a synthetic workload, one run for a trace.
wa() {
  local runs=() s
  case " $* " in
    *" --workload "*) for s in $seeds; do runs+=("$(wa_once "$@" --seed "$s")"); done ;;
    *) runs+=("$(wa_once "$@")") ;;
  esac
  python3 - "${runs[@]}" <<'PY'
import sys
runs = sys.argv[1:]
if any(r.startswith("fail") for r in runs):
    print("fail/0")
else:
    w = [float(r.split("/")[0]) for r in runs]
    print("%.3f/%s" % (sum(w) / len(w), runs[0].split("/")[1]))
PY
}
placements=(
  "greedy:--classifier none --policy greedy"
  "sepbit:--classifier sepbit --policy cost-benefit-sqrt"
  "default:"
  "lamina:--classifier lamina --policy lamina"
  "oracle:--classifier oracle --policy greedy"
)
printf "| %-36s | %5s | %4s | %8s |" workload spare seg segments
for p in "${placements[@]}"; do printf " %7s |" "${p%%:*}"; done
printf " %s | %s |\n" "default/greedy" "default/sepbit"
printf "|%s|---:|---:|---:|" "---"
for p in "${placements[@]}"; do printf "%s|" "---:"; done
printf "%s|%s|\n" "---:" "---:"
row() {
  local name=$1 spare=$2 seg=$3; shift 3
  local out=() p
  for p in "${placements[@]}"; do
    # shellcheck disable=SC2086
    out+=("$(wa "$@" --overprovision "$spare" --segment-size "$seg" ${p#*:})")
  done
  python3 - "$name" "$spare" "$seg" "${out[@]}" <<'PY'
import sys
name, spare, seg, *w = sys.argv[1:]
segments = max(int(x.split("/")[1]) for x in w)
w = [x.split("/")[0] for x in w]
def ratio(a, b):
    try:
        return "%.3f" % (float(a) / float(b))
    except ValueError:
        return "-"
cells = " | ".join("%7s" % x for x in w)
print("| %-36s | %5s | %4s | %8d | %s | %s | %s |" % (name, spare, seg, segments, cells, ratio(w[2], w[0]), ratio(w[2], w[1])))
PY
}
for seg in $segs; do
  for spare in $spares; do
    for t in "${bench_traces[@]}"; do
      IFS=: read -r file format extra <<<"$t"
      path=$dir/$file
      [ -f "$path" ] || path=crates/lamina-sim/testdata/$file
      [ -f "$path" ] || { echo "missing trace $file" >&2; continue; }
      # shellcheck disable=SC2086
      row "$file" "$spare" "$seg" --trace "$path" --trace-format "$format" $extra
    done
    for w in $workloads; do
      row "$w ($cap)" "$spare" "$seg" --workload "$w" --capacity "$cap"
    done
  done
done
