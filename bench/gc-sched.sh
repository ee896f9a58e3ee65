#!/usr/bin/env bash
# Where reads wait while GC runs: the steady-state setup of bench/nbd-vs-nbdkit.sh
# (2 GiB array on a filled file in /dev/shm, no discards, volume at 80%, written
# once and overwritten twice its size), then a writer (randwrite, iodepth 32) that
# keeps GC running and beside it a reader (randread, iodepth 32, held to READ_RATE
# IOPS), with `perf sched record` for SCHED_SECONDS in the middle. Prints the
# reader's p99 and p99.9 and, per group of threads (fio, the connection threads,
# the I/O threads, the engine thread), the CPU time each used and how long each
# waited from wake-up to running (perf sched latency): on a machine with few
# cores, what a read waits for is a core.
#
# Usage: bench/gc-sched.sh   (root: perf sched; env READ_RATE, default 2000;
#   SCHED_SECONDS, default 4)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
[ "$(id -u)" = 0 ] || { echo "bench: perf sched needs root" >&2; exit 2; }
for t in fio perf; do
  command -v $t >/dev/null || { echo "bench: $t is missing (apt-get install fio linux-perf)" >&2; exit 1; }
done
READ_RATE=${READ_RATE:-2000}
SCHED_SECONDS=${SCHED_SECONDS:-4}
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir 1 lamina-gc-sched
d=$work/array
mkdir -p "$d"
new_array "$d" 2048
usable=$("$lamina" status "$d" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["usable_bytes"])')
vs=$(( usable * 8 / 10 / 1048576 ))M
"$lamina" volume create "$d" vol --size "$vs" >/dev/null
LAMINA_ENGINE=$(no_discard_engine) lamina_configure "$d"
"$lamina" serve "$d" --unix "$d/nbd.sock" >"$d/serve.out" 2>"$d/serve.err" &
pids+=($!)
wait_sock "$d/nbd.sock"
S="nbd+unix:///vol?socket=$d/nbd.sock"
fio --name=fill --ioengine=nbd --uri="$S" --bs=1m --iodepth=8 --rw=write --size="$vs" >/dev/null 2>&1
fio --name=age --ioengine=nbd --uri="$S" --bs=4k --iodepth=32 --rw=randwrite --size="$vs" \
    --io_size=$(( ${vs%M} * 2 ))M --norandommap --randrepeat=0 >/dev/null 2>&1
run=$(( SCHED_SECONDS + 8 ))
fio --name=writer --ioengine=nbd --uri="$S" --bs=4k --iodepth=32 --rw=randwrite --size="$vs" \
    --time_based --runtime=$(( run + 2 )) --norandommap --randrepeat=0 >/dev/null 2>&1 &
writer=$!
sleep 2
fio --name=reader --ioengine=nbd --uri="$S" --bs=4k --iodepth=32 --rw=randread \
    --rate_iops="$READ_RATE" --size="$vs" --time_based --runtime="$run" --norandommap \
    --randrepeat=0 --output-format=json 2>/dev/null | sed -n '/^{/,$p' >"$work/reader.json" &
reader=$!
sleep 4
perf sched record -o "$work/sched.data" -- sleep "$SCHED_SECONDS" >/dev/null 2>&1
wait "$reader" "$writer"
python3 - "$work/reader.json" "$READ_RATE" <<'PY'
import json, sys
p = json.load(open(sys.argv[1]))["jobs"][0]["read"]["clat_ns"]["percentile"]
print(f"# reader at {sys.argv[2]} IOPS beside the writer, GC running")
print(f"read latency p99 {p['99.000000'] / 1000:.0f} us, p99.9 {p['99.900000'] / 1000:.0f} us")
PY
perf sched latency -i "$work/sched.data" 2>/dev/null | python3 -c '
import re, sys
groups = {}
for line in sys.stdin:
    m = re.match(r"\s*(\S+?)(?::\(?\d+\)?)?\s*\|\s*([\d.]+) ms \|\s*(\d+) \|\s*avg:\s*([\d.]+) ms \|\s*max:\s*([\d.]+) ms", line)
    if not m:
        continue
    name = re.sub(r"\d+$", "", m.group(1))
    if name not in ("fio", "nbd-conn", "lamina-io", "lamina-engine"):
        continue
    run, sw, avg, mx = float(m.group(2)), int(m.group(3)), float(m.group(4)), float(m.group(5))
    g = groups.setdefault(name, [0.0, 0, 0.0, 0.0])
    g[0] += run; g[2] += avg * sw; g[1] += sw; g[3] = max(g[3], mx)
total = sum(g[0] for g in groups.values())
print("%-14s %12s %8s %16s %14s" % ("threads", "cpu ms", "share", "avg wait (ms)", "max wait (ms)"))
for name, (run, sw, wsum, mx) in sorted(groups.items()):
    print("%-14s %12.0f %7.0f%% %16.3f %14.3f" % (name, run, 100 * run / total, wsum / max(sw, 1), mx))
'
