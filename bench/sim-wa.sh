#!/usr/bin/env bash
# Write amplification with `lamina sim` (the engine's own placement and GC on a
# metadata-only device): model fidelity, skew targets, and the plots in docs/.
#
#   bench/sim-wa.sh [CAPACITY] [SEGMENT]      defaults: 8G 8M (1000+ segments)
set -euo pipefail
cap=${1:-8G}
seg=${2:-8M}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
wa() { "$bin" sim "$@" --json --quiet | python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["write_amplification"])'; }

echo "## Fidelity: uniform random overwrites, greedy, $cap volume, $seg segments"
echo "| over-provisioning | model | lamina sim | error |"
echo "|---:|---:|---:|---:|"
for op in 0.07 0.10 0.20 0.28 0.50; do
  w=$(wa --workload uniform --capacity "$cap" --segment-size "$seg" --overprovision $op)
  python3 - "$op" "$w" <<'PY'
import math, sys
op, w = float(sys.argv[1]), float(sys.argv[2])
u = 0.5
for _ in range(200):
    u = math.exp(-(1 + op) * (1 - u))
m = 1 / (1 - u)
print("| %.0f%% | %.3f | %.3f | %+.2f%% |" % (op * 100, m, w, (w / m - 1) * 100))
PY
done

echo
echo "## Skew at 28% over-provisioning ($cap, $seg segments)"
echo "| workload | none/greedy | frequency/greedy | sepbit/cost-benefit-sqrt | lamina/lamina | oracle/greedy |"
echo "|---|---:|---:|---:|---:|---:|"
for w in hotcold:80/20 hotcold:90/10 zipf:0.8 zipf:1.0; do
  row="| $w"
  for cp in "none greedy" "frequency greedy" "sepbit cost-benefit-sqrt" "lamina lamina" "oracle greedy"; do
    set -- $cp
    row="$row | $(wa --workload $w --capacity "$cap" --segment-size "$seg" --classifier $1 --policy $2)"
  done
  echo "$row |"
done

echo
echo "## Plots"
"$bin" sim --workload uniform --capacity 2G --segment-size 2M --write-unit 128K --quiet \
  --sweep-overprovision 0.07,0.1,0.2,0.28,0.5 \
  --sweep-policies greedy/none,cost-benefit/none,cost-benefit-sqrt/none,d-choices/none,salsa/none,lamina/lamina \
  --plot docs/wa-vs-op-uniform.svg
"$bin" sim --workload hotcold:90/10 --capacity 2G --segment-size 2M --write-unit 128K --quiet \
  --sweep-overprovision 0.1,0.2,0.28,0.5 \
  --sweep-policies greedy/none,cost-benefit/sepbit,cost-benefit-sqrt/sepbit,greedy/frequency,lamina/lamina,greedy/oracle \
  --plot docs/wa-vs-op-hotcold.svg
"$bin" sim --workload hotcold:90/10 --capacity 2G --segment-size 2M --write-unit 128K --quiet \
  --classifier lamina --policy lamina --plot docs/wa-over-time.svg
echo "wrote docs/wa-vs-op-uniform.svg docs/wa-vs-op-hotcold.svg docs/wa-over-time.svg"
