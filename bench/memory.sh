#!/usr/bin/env bash
# Memory of `lamina serve` for a volume that is fully written.
#
# Creates an array on a sparse file large enough for a SIZE volume (default 64G),
# writes every block of the volume (1 MiB sequential writes through NBD: every map
# entry ends up populated, as with any other write pattern), and reads the server's
# resident set size (VmRSS) and peak (VmHWM) from /proc. Reports GiB of RSS per TiB
# of volume capacity. Needs SIZE x 1.13 of free disk space for the backing file,
# which is deleted afterwards.
#
# Usage: bench/memory.sh [SIZE]
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
size=${1:-64G}
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
work=$(mktemp -d "${TMPDIR:-/tmp}/lamina-memory.XXXXXX")
trap 'pkill -9 -f "lamina serve $work" 2>/dev/null || true; rm -rf "$work"' EXIT

bytes=$(python3 -c "import sys; s=sys.argv[1]; u={'K':10,'M':20,'G':30,'T':40}; print(int(float(s[:-1])*(1<<u[s[-1]])) if s[-1] in u else int(s))" "$size")
dev=$(( bytes * 113 / 100 ))
"$lamina" array create "$work/arr" --device "$work/arr/dev.img:$dev" >/dev/null
"$lamina" volume create "$work/arr" v --size "$bytes" >/dev/null
"$lamina" serve "$work/arr" --unix "$work/nbd.sock" >/dev/null 2>"$work/err" &
pid=$!
for _ in $(seq 100); do [ -S "$work/nbd.sock" ] && break; sleep 0.1; done
rss() { awk -v k="$1" '$1==k":" {print $2}' "/proc/$pid/status"; }
idle=$(rss VmRSS)
t0=$(date +%s)
fio --name=fill --ioengine=nbd --uri="nbd+unix:///v?socket=$work/nbd.sock" --bs=1m --iodepth=8 \
    --rw=write --size="$bytes" --end_fsync=1 >/dev/null 2>&1
t1=$(date +%s)
full=$(rss VmRSS)
peak=$(rss VmHWM)
live=$("$lamina" status "$work/arr" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["live_bytes"])')
python3 - "$size" "$bytes" "$idle" "$full" "$peak" "$live" "$((t1 - t0))" <<'EOF'
import sys
size, b, idle, full, peak, live, secs = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:])
tib = b / (1 << 40)
print(f"volume {size} ({b} bytes), live after fill {live} bytes ({100*live/b:.1f}%), fill took {secs}s")
print(f"RSS idle {idle/1024:.1f} MiB, RSS fully written {full/1024:.1f} MiB, peak {peak/1024:.1f} MiB")
print(f"=> {full/1024/1024/tib:.3f} GiB per TiB of volume (peak {peak/1024/1024/tib:.3f}); budget 1.1 GiB per TiB = {1.1*tib*1024:.1f} MiB")
EOF
kill -INT $pid; wait $pid 2>/dev/null || true
