#!/usr/bin/env bash
# Rebuild of a replaced SAID5 member: Lamina rebuilds only the stripes that hold
# data; a RAID that does not know what is in use rebuilds every stripe. Both run
# here, on the same array, with the same code (`lamina array replace`, the second
# time with --whole-device), offline and without a rate limit.
#
#   bench/rebuild.sh [DEVICE_SIZE] [FILL]     defaults: 1G 0.5
set -euo pipefail
size=${1:-1G}
fill=${2:-0.5}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
t=$(mktemp -d /tmp/lamina-rebuild.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$t"' EXIT
devs=()
for i in 0 1 2 3; do devs+=(--device "$t/d$i.img:$size"); done
source "$(dirname "$0")/said-lib.sh"
said5_serve "$t" "$fill" "${devs[@]}"
fio --name=fill --ioengine=nbd --uri="$uri" --rw=write --bs=1M \
    --iodepth=8 --size="$vol" --output-format=terse >/dev/null
kill -INT $srv; wait $srv || true
"$bin" array fail "$t/arr" --device 1 >/dev/null
live=$("$bin" array replace "$t/arr" --old 1 --new "$t/n1.img:$size" --quiet --json)
"$bin" array fail "$t/arr" --device 1 >/dev/null
whole=$("$bin" array replace "$t/arr" --old 1 --new "$t/w1.img:$size" --quiet --json --whole-device)
echo "## SAID5 rebuild of one member: 4 devices of $size, volume $((vol >> 20)) MiB ($fill of usable) written once"
echo "| rebuild | stripes rebuilt | bytes written to the new member | time (s) |"
echo "|---|---:|---:|---:|"
python3 - "$live" "$whole" <<'PY'
import json, sys
l, w = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, r in (("Lamina: live stripes only", l), ("whole device (every stripe)", w)):
    print(f"| {name} | {r['stripes_rebuilt']} of {r['stripes_visited']} | {r['bytes_written'] >> 20} MiB | {r['seconds']:.2f} |")
print(f"\nLamina moves {l['bytes_written'] / w['bytes_written']:.2f}x the bytes in {l['seconds'] / w['seconds']:.2f}x the time of a whole-device rebuild")
PY
