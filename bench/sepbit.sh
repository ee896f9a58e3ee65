#!/usr/bin/env bash
# SepBIT against Lamina's placement in the same harness (`lamina sim`), with
# SepBIT's defaults: 512 MiB segments, GC while the garbage proportion exceeds 15%
# (the array is given room enough, --overprovision 0.6, that this trigger decides),
# 6 classes. Each row also shows the oracle (future knowledge) and both gaps to it.
#
#   bench/sepbit.sh [CAPACITY] [THETAS] [TRACE FORMAT]...
#   bench/sepbit.sh 32G "0 0.2 0.4 0.6 0.8 1.0"
#   bench/sepbit.sh 32G "" crates/lamina-sim/testdata/blkparse-ext4-sample.txt blkparse
set -euo pipefail
cap=${1:-32G}
thetas=${2:-"0 0.2 0.4 0.6 0.8 1.0"}
shift 2 2>/dev/null || shift $#
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
common=(--segment-size 512M --overprovision 0.6 --gc-garbage 0.15 --json --quiet)
ours=(--classifier lamina --policy "${OURS_POLICY:-cost-benefit-sqrt}")
sepbit=(--classifier sepbit --policy cost-benefit-sqrt)
oracle=(--classifier oracle --policy greedy)
wa() { "$bin" sim "$@" | python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["write_amplification"])'; }
printf "%-28s %8s %8s %8s %10s %10s\n" workload sepbit lamina oracle "sepbit-gap" "lamina-gap"
row() {
  local name=$1; shift
  local s l o
  s=$(wa "$@" "${common[@]}" "${sepbit[@]}")
  l=$(wa "$@" "${common[@]}" "${ours[@]}")
  o=$(wa "$@" "${common[@]}" "${oracle[@]}")
  python3 - "$name" "$s" "$l" "$o" <<'PY'
import sys
n, s, l, o = sys.argv[1], *map(float, sys.argv[2:])
print("%-28s %8.3f %8.3f %8.3f %9.1f%% %9.1f%%" % (n, s, l, o, (s / o - 1) * 100, (l / o - 1) * 100))
PY
}
for t in $thetas; do
  row "zipf:$t ($cap)" --workload "zipf:$t" --capacity "$cap"
done
while [ $# -ge 2 ]; do
  row "$(basename "$1")" --trace "$1" --trace-format "$2"
  shift 2
done
