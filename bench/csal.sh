#!/usr/bin/env bash
# CSAL's experiment (issue 14) on the emulators: an emulated QLC SSD with a 64 KiB
# indirection unit, 4 KiB writes over eight volumes, for each workload: the raw
# QLC, an LRU write-back block cache on an emulated SLC SSD in front of it
# (dm-cache, Open-CAS), Lamina on the QLC, Lamina with the SLC SSD as its
# cache tier, and the same cache in front of a ZNS drive of the QLC's capacity.
# Prints one table per workload (`lamina bench csal`).
#
#   bench/csal.sh
#   env: WORKLOADS ("zipf:1.2 zipf:0.9 uniform"), CAPACITY (1G), CACHE (80M),
#        PASSES (4), VOLUMES (8)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
WORKLOADS=${WORKLOADS:-zipf:1.2 zipf:0.9 uniform}
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
bin="$here/target/release/lamina"
for w in $WORKLOADS; do
  echo "### $w"
  "$bin" bench csal --workload "$w" --capacity "${CAPACITY:-1G}" --cache "${CACHE:-80M}" \
    --passes "${PASSES:-4}" --volumes "${VOLUMES:-8}"
  echo
done
