#!/usr/bin/env bash
# SALSA 5.1.1 on lamina-device's flash emulator: 4 KiB uniform random requests,
# 80% reads, at queue depths 1 to 32 on 5 emulated 512 MiB TLC SSDs (7% device
# spare, page-mapped FTL, greedy GC, die/channel timing): RAID-0 and RAID-5
# (read-modify-write, 64 KiB chunks) on the raw drives against Lamina SAID5 on the
# same drives (the real engine in process, 25% spare). Every array is filled and
# overwritten twice before 100k requests are timed per depth on the virtual clock.
#
#   bench/iops.sh [PLOT]      default: docs/iops-vs-qd.svg
set -euo pipefail
plot=${1:-docs/iops-vs-qd.svg}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
"$bin" bench iops --plot "$plot"
