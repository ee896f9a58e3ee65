#!/usr/bin/env bash
# The seed papers' endurance experiments on lamina-device's flash emulator (page-
# mapped FTL, greedy GC, 7% device spare), raw and through Lamina (the real engine,
# in process, 20% spare, segments = erase blocks):
#
#   SALSA 5.1.2: a TLC SSD, 10 full passes of 4 KiB random writes (IU 4 KiB, 16 KiB).
#   CSAL: a QLC SSD with a 64 KiB indirection unit, 4 KiB uniform and Zipf(1.2)
#         writes: device-level write amplification raw against through Lamina.
#
#   bench/endurance.sh [TLC_CAPACITY] [PASSES] [QLC_CAPACITY]   defaults: 1G 10 4G
set -euo pipefail
cap=${1:-1G}
passes=${2:-10}
qcap=${3:-4G}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
for iu in 4K 16K; do
  echo "## SALSA 5.1.2: $cap TLC SSD, indirection unit $iu, $passes passes of 4 KiB random writes"
  "$bin" bench endurance --capacity "$cap" --passes "$passes" --iu "$iu" \
    --plot "docs/endurance-tlc-$iu.svg"
  echo
done
for w in uniform zipf:1.2; do
  echo "## CSAL: $qcap QLC SSD, indirection unit 64 KiB, 4 passes of 4 KiB writes, $w"
  "$bin" bench endurance --capacity "$qcap" --passes 4 --iu 64K --cell qlc --workload "$w" \
    --plot "docs/endurance-qlc-64K-${w%%:*}.svg"
  echo
done
