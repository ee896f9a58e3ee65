#!/usr/bin/env bash
# SAID5 against RAID-5 read-modify-write, for 4 KiB random writes at steady state,
# on the same kind of devices (sparse files) through the same NBD server and fio job.
#
#   bench/said5.sh [DEVICE_SIZE] [DATA_DEVICES] [FILL]     defaults: 512M 3 0.5
#
# SAID5: n+1 devices, a volume of FILL x usable space; fio writes it three times
# (warm-up: the array reaches its GC steady state), then once more: that last pass
# is measured. Media bytes are what the array wrote to its members (data, parity,
# GC relocations, padding, metadata), from `lamina status --json`.
# RAID-5: `lamina bench raid5-rmw` over n+1 fresh devices (64 KiB chunks): every
# 4 KiB write reads old data and old parity and writes both (as md does).
set -euo pipefail
size=${1:-512M}
n=${2:-3}
fill=${3:-0.5}
bin=${LAMINA:-target/release/lamina}
[ -x "$bin" ] || cargo build --release -q
t=$(mktemp -d /tmp/lamina-said5.XXXX)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$t"' EXIT
devs=(); raid=()
for i in $(seq 0 "$n"); do devs+=(--device "$t/s$i.img:$size"); raid+=(--device "$t/r$i.img:$size"); done

fio_pass() { # URI SIZE -> fio JSON on stdout
  fio --name=rw --ioengine=nbd --uri="$1" --rw=randwrite --bs=4k --iodepth=32 \
      --size="$2" --norandommap --randrepeat=0 --output-format=json
}
iops() { python3 -c 'import json,sys; t=sys.stdin.read(); print("%.0f" % json.loads(t[t.index("{"):])["jobs"][0]["write"]["iops"])'; }

source "$(dirname "$0")/said-lib.sh"
said5_serve "$t" "$fill" "${devs[@]}"
for _ in 1 2 3; do fio_pass "$uri" "$vol" >/dev/null; done
s1=$("$bin" status "$t/arr" --json)
said_iops=$(fio_pass "$uri" "$vol" | iops)
s2=$("$bin" status "$t/arr" --json)
kill -INT $srv; wait $srv || true
read -r said_w said_r gc_wa < <(python3 - "$s1" "$s2" <<'PY'
import json, sys
a, b = json.loads(sys.argv[1]), json.loads(sys.argv[2])
member = lambda s, k: sum(m[k] for m in s["array"]["members"])
user = b["user_bytes_written"] - a["user_bytes_written"]
media = member(b, "bytes_written") - member(a, "bytes_written")
read = member(b, "bytes_read") - member(a, "bytes_read")
gc = (b["gc_bytes_relocated"] - a["gc_bytes_relocated"]) / user
print("%.3f %.3f %.3f" % (media / user, read / user, 1 + gc))
PY
)

"$bin" bench raid5-rmw "${raid[@]}" --unix "$t/raid.sock" > "$t/raid.json" &
rpid=$!
while [ ! -S "$t/raid.sock" ]; do sleep 0.1; done
raid_iops=$(fio_pass "nbd+unix:///raid5?socket=$t/raid.sock" "$vol" | iops)
kill -INT $rpid; wait $rpid || true
read -r raid_w raid_r < <(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); u=d["user_bytes_written"]; print("%.3f %.3f" % (d["device_bytes_written"]/u, d["device_bytes_read"]/u))' "$t/raid.json")

echo "## 4 KiB random writes, $((n+1)) devices of $size, volume $((vol >> 20)) MiB ($fill of usable), fio iodepth 32"
echo "| layout | device bytes written / user byte | device bytes read / user byte | IOPS | model |"
echo "|---|---:|---:|---:|---|"
python3 - "$said_w" "$said_r" "$gc_wa" "$said_iops" "$raid_w" "$raid_r" "$raid_iops" "$n" <<'PY'
import sys
sw, sr, gc, si, rw, rr, ri, n = sys.argv[1:]
n = int(n)
print(f"| SAID5 (Lamina) | {sw} | {sr} (GC and client reads) | {si} | (n+1)/n x GC WA = {(n+1)/n:.3f} x {gc} = {(n+1)/n*float(gc):.3f} |")
print(f"| RAID-5 read-modify-write | {rw} | {rr} | {ri} | 2 writes + 2 reads |")
print(f"\nSAID5 / RAID-5: {float(si)/float(ri):.2f}x the IOPS, {float(sw)/float(rw):.2f}x the bytes written, {float(sr)/float(rr):.2f}x the bytes read")
PY
