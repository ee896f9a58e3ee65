#!/usr/bin/env bash
# SALSA 5.3 on lamina-device's SMR emulators: 64 KiB sequential, then random
# writes through Lamina (the real engine, in process, 4 MiB write units, segments =
# zones) on an emulated host-managed SMR disk, against the same writes on an
# emulated drive-managed SMR disk (media cache + zone read-modify-write cleaning)
# with media caches of 0.1% to 2% of its capacity. Bandwidth from the disks'
# timing model (seek + half rotation, outer tracks twice the inner bandwidth).
#
#   bench/smr.sh [CAPACITY] [ZONE] [PLOT]      defaults: 4G 64M docs/smr-random.svg
set -euo pipefail
cap=${1:-4G}
zone=${2:-64M}
plot=${3:-docs/smr-random.svg}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
"$bin" bench smr --capacity "$cap" --zone "$zone" --cache-percent 0.1,0.25,0.5,1,2 --plot "$plot"
