#!/usr/bin/env bash
# SALSA 3.1 on lamina-device's host-managed SMR emulator: read bandwidth of
# read-hot data with geometry-aware placement on and off (see docs/benchmarks.md).
#
#   bench/geometry.sh [CAPACITY] [ZONE]      defaults: 4G 64M
set -euo pipefail
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
"$bin" bench geometry --capacity "${1:-4G}" --zone "${2:-64M}"
