#!/usr/bin/env bash
# SALSA 5.1.2 (endurance) on an emulated TLC SSD (lamina-device's flash emulator:
# 16 KiB pages, 4 MiB erase blocks, 7% spare, page-mapped FTL with greedy GC):
# 10 full passes of 4 KiB random writes, raw and through Lamina (the real engine,
# 20% spare, in process). Printed: NAND bytes programmed per user byte and erases.
#
#   bench/endurance.sh [CAPACITY] [PASSES]      defaults: 1G 10
set -euo pipefail
cap=${1:-1G}
passes=${2:-10}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
for iu in 4K 16K; do
  echo "## $cap TLC SSD, indirection unit $iu, $passes passes"
  "$bin" bench endurance --capacity "$cap" --passes "$passes" --iu "$iu"
  echo
done
