#!/usr/bin/env bash
# Lamina against `nbdkit file` on the same kind of backing file, in the same run.
#
# For each workload (4 KiB, iodepth 32, fio's nbd engine): randread, randwrite and
# 70/30 randrw, on a fresh volume (the region is written once first so reads hit
# data on both servers). Runs alternate lamina / nbdkit ROUNDS times and the
# median IOPS of each is reported with the ratio lamina / nbdkit.
#
# Then the steady state with garbage collection running: a volume at 80% of the
# usable capacity, overwritten randomly until GC has run, and measured; the write
# amplification comes from `lamina status --json`. Then reads during GC: the p99 and
# p99.9 latency of a rate-limited reader on the idle array and beside a writer that
# keeps GC running.
#
# With --shm both servers' backing files live in /dev/shm (RAM), so that the servers'
# own cost is what is measured. With --cold (root), a randread row is added for
# which the page cache is dropped before every run: reads come from the disk.
# --no-steady skips the garbage-collection part.
#
# --no-fresh skips the first part (fresh volume against nbdkit).
#
# Usage: bench/nbd-vs-nbdkit.sh [--quick] [--shm] [--cold] [--no-steady] [--no-fresh]
#   env: ROUNDS (default 3), RUNTIME seconds per run (default 10), REGION (default 1g),
#   WORKLOADS: only these rows of the first part (randread randwrite randrw cold),
#   LAMINA_ENGINE: lines added to the [engine] section of every array made here,
#   e.g. LAMINA_ENGINE='direct_io = "on"' or LAMINA_ENGINE='io_engine = "sync"';
#   LAMINA_SERVE: lines added to the [serve] section, e.g. LAMINA_SERVE='io_nice = 0'.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
quick=0 shm=0 cold=0 steady=1 fresh=1
for a in "$@"; do
  case $a in
    --quick) quick=1 ;;
    --shm) shm=1 ;;
    --cold) cold=1 ;;
    --no-steady) steady=0 ;;
    --no-fresh) fresh=0 ;;
    *) echo "usage: $0 [--quick] [--shm] [--cold] [--no-steady] [--no-fresh]" >&2; exit 2 ;;
  esac
done
if [ $cold = 1 ] && [ "$(id -u)" != 0 ]; then echo "bench: --cold needs root (drop_caches)" >&2; exit 2; fi
ROUNDS=${ROUNDS:-3}
RUNTIME=${RUNTIME:-10}
REGION=${REGION:-1g}
if [ $quick = 1 ]; then ROUNDS=1; RUNTIME=4; REGION=256m; fi

for t in fio nbdkit nbdinfo; do
  command -v $t >/dev/null || { echo "bench: $t is missing (apt-get install fio nbdkit libnbd-bin)" >&2; exit 1; }
done
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"

source "$here/bench/lib.sh"
bench_workdir $shm lamina-bench

# start_filled DIR serves an array made by `new_array` (bench/lib.sh) with the
# engine's discards off unless LAMINA_ENGINE names `discard`.
start_filled() { # dir
  LAMINA_ENGINE=$(no_discard_engine) start_lamina "$1"
}
start_lamina() { # dir
  lamina_configure "$1"
  "$lamina" serve "$1" --unix "$1/nbd.sock" >"$1/serve.out" 2>"$1/serve.err" &
  pids+=($!)
  for _ in $(seq 100); do [ -S "$1/nbd.sock" ] && return 0; sleep 0.1; done
  echo "lamina did not start:" >&2; cat "$1/serve.err" >&2; exit 1
}
stop_lamina() { # dir
  local pid; pid=$(pgrep -f "lamina serve $1" || true)
  [ -n "$pid" ] && kill -TERM $pid && while kill -0 $pid 2>/dev/null; do sleep 0.1; done
}

# CPU time (user + system, in clock ticks) a process has used.
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
hz=$(getconf CLK_TCK)
# fio: prints IOPS (read+write) of one run, and the server's CPU time per request
# in microseconds (from /proc/PID/stat around the run).
run_fio() { # server-pid uri rw extra...
  local pid=$1 uri=$2 rw=$3; shift 3
  local t0 iops t1
  t0=$(cpu_ticks "$pid")
  iops=$(fio --name=b --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw="$rw" \
      --size="$REGION" --time_based --runtime="$RUNTIME" --norandommap --randrepeat=0 \
      --output-format=json "$@" 2>/dev/null | sed -n '/^{/,$p' |
    python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))')
  t1=$(cpu_ticks "$pid")
  echo "$iops $(python3 -c "print(round(($t1 - $t0) / $hz * 1e6 / max(1, $iops * $RUNTIME), 2))")"
}
fill() { # uri
  fio --name=fill --ioengine=nbd --uri="$1" --bs=1m --iodepth=8 --rw=write --size="$REGION" >/dev/null 2>&1
}

# ---- servers on the same filesystem, same kind of backing file
if [ $fresh = 1 ]; then
mkdir -p "$work/lamina" "$work/nbdkit"
# Both backing files are written in full up front, as a block device's blocks all
# exist: on a VM the first touch of guest memory (or of a file system's new blocks)
# costs far more than the copy itself (here 224 MB/s into fresh tmpfs pages against
# 4.3 GB/s into written ones; fallocate does not touch tmpfs pages), and a
# log-structured writer moves over new space where nbdkit rewrites the same blocks.
# Discards would undo the fill for Lamina alone: `array create` discards its devices
# (holes in a file) and the engine discards segments that stay free for 30 s, so
# unit writes would land in pages the kernel must allocate and the VM's host fault
# in. On this 2-core VM that took half the server's CPU (4 KiB randwrite 0.65x
# nbdkit at 19.2 us per request, against 0.9-1.0x at 9-10 us without discards;
# docs/benchmarks.md). A block device's blocks stay where they are when discarded,
# so this part runs Lamina as on one: --no-discard, and `discard = false` unless
# LAMINA_ENGINE names `discard` itself.
new_array "$work/lamina" 4096
dd if=/dev/zero of="$work/nbdkit/dev.img" bs=4M count=512 status=none
"$lamina" volume create "$work/lamina" vol --size 2G >/dev/null
start_filled "$work/lamina"
lpid=${pids[-1]}
nbdkit -U "$work/nbdkit/nbd.sock" --foreground file "$work/nbdkit/dev.img" &
pids+=($!)
kpid=$!
for _ in $(seq 100); do [ -S "$work/nbdkit/nbd.sock" ] && break; sleep 0.1; done
L="nbd+unix:///vol?socket=$work/lamina/nbd.sock"
K="nbd+unix:///?socket=$work/nbdkit/nbd.sock"
fill "$L"; fill "$K"

drop_caches() { sync; echo 3 > /proc/sys/vm/drop_caches; }
echo "# fresh volume on $base: 4 KiB, iodepth 32, fio nbd engine, region $REGION, ${RUNTIME}s x $ROUNDS rounds (median IOPS)"
echo "# cpu: the server's CPU time (user + system) per request, microseconds"
printf '%-22s %12s %12s %8s %10s %10s\n' workload lamina nbdkit ratio "cpu lamina" "cpu nbdkit"
specs=("randread" "randwrite" "randrw --rwmixread=70")
[ $cold = 1 ] && specs+=("randread(cold)")
if [ -n "${WORKLOADS:-}" ]; then
  # Only the rows named (randread randwrite randrw cold).
  keep=()
  for spec in "${specs[@]}"; do
    name=${spec%% *}; [ "$name" = "randread(cold)" ] && name=cold
    [[ " $WORKLOADS " == *" $name "* ]] && keep+=("$spec")
  done
  specs=("${keep[@]}")
fi
for spec in "${specs[@]}"; do
  c=0
  [ "$spec" = "randread(cold)" ] && { c=1; spec=randread; }
  # shellcheck disable=SC2086
  set -- $spec
  rw=$1; shift
  l=(); k=(); lc=(); kc=()
  for _ in $(seq "$ROUNDS"); do
    [ $c = 1 ] && drop_caches
    read -r i u <<<"$(run_fio "$lpid" "$L" "$rw" "$@")"; l+=("$i"); lc+=("$u")
    [ $c = 1 ] && drop_caches
    read -r i u <<<"$(run_fio "$kpid" "$K" "$rw" "$@")"; k+=("$i"); kc+=("$u")
  done
  [ $c = 1 ] && spec="randread, cold cache"
  lm=$(median "${l[@]}"); km=$(median "${k[@]}")
  lcm=$(medianf "${lc[@]}"); kcm=$(medianf "${kc[@]}")
  printf '%-22s %12s %12s %8.2f %10s %10s\n' "${spec// --rwmixread=/ }" "$lm" "$km" \
    "$(python3 -c "print($lm/$km)")" "$lcm" "$kcm"
done
stop_lamina "$work/lamina"
kill "$kpid" 2>/dev/null || true; wait "$kpid" 2>/dev/null || true
# Give the space back before the next parts: with --shm everything is in RAM, and
# all parts' files together (4 + 2 + 2 + 16 GiB) fill a 24 GiB machine.
rm -rf "$work/lamina" "$work/nbdkit"
fi
[ $steady = 1 ] || exit 0

# ---- steady state: volume at 80% of usable capacity, GC running
mkdir -p "$work/steady"
new_array "$work/steady" 2048
usable=$("$lamina" status "$work/steady" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["usable_bytes"])')
volsize=$(( usable * 8 / 10 / 1048576 ))M
"$lamina" volume create "$work/steady" vol --size "$volsize" >/dev/null
start_filled "$work/steady"
S="nbd+unix:///vol?socket=$work/steady/nbd.sock"
REGION=$volsize
fill "$S"
# Overwrite about twice the volume so GC is in its steady state, then measure.
fio --name=age --ioengine=nbd --uri="$S" --bs=4k --iodepth=32 --rw=randwrite --size="$volsize" \
    --io_size=$(( ${volsize%M} * 2 ))M --norandommap --randrepeat=0 >/dev/null 2>&1
before=$("$lamina" status "$work/steady" --json)
read -r steady _ <<<"$(run_fio "${pids[-1]}" "$S" randwrite)"
after=$("$lamina" status "$work/steady" --json)
python3 - "$before" "$after" "$steady" "$volsize" <<'EOF'
import json, sys
b, a = json.loads(sys.argv[1]), json.loads(sys.argv[2])
user = a["user_bytes_written"] - b["user_bytes_written"]
media = a["media_bytes_written"] - b["media_bytes_written"]
gc = a["gc_bytes_relocated"] - b["gc_bytes_relocated"]
print(f"# steady state: volume {sys.argv[4]} = 80% of usable, 4 KiB randwrite iodepth 32 after 2x overwrite")
print(f"randwrite IOPS {sys.argv[3]}, write amplification in the window {media/user:.3f} "
      f"(gc relocated {gc/user:.3f} per user byte), cumulative WA {a['write_amplification']:.3f}, "
      f"writes waited at the floor {a['gc_floor_waits'] - b['gc_floor_waits']} times")
EOF

# Reads during garbage collection: a reader (4 KiB randread, iodepth 32, held to
# READ_RATE IOPS so that its latency shows waiting, not its own throughput) on the
# idle array, then beside a writer (randwrite, iodepth 32, its own connection) that
# keeps GC running. p99 and p99.9 of the reader's completion latency.
READ_RATE=${READ_RATE:-2000}
read_lat() { # extra fio job options...
  fio --ioengine=nbd --uri="$S" --bs=4k --size="$volsize" --time_based --runtime="$RUNTIME" \
      --norandommap --randrepeat=0 --output-format=json \
      --name=reader --rw=randread --iodepth=32 --rate_iops="$READ_RATE" "$@" 2>/dev/null |
    sed -n '/^{/,$p' | python3 -c '
import json, sys
p = json.load(sys.stdin)["jobs"][0]["read"]["clat_ns"]["percentile"]
print(round(p["99.000000"] / 1000), round(p["99.900000"] / 1000))'
}
gc_bytes() { "$lamina" status "$1" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["gc_bytes_relocated"])'; }
# GC goes on for a while after the aging writes: "idle" starts once it has stopped.
for _ in $(seq 60); do
  g=$(gc_bytes "$work/steady"); sleep 1; [ "$(gc_bytes "$work/steady")" = "$g" ] && break
done
read -r i99 i999 <<<"$(read_lat)"
gc0=$(gc_bytes "$work/steady")
read -r b99 b999 <<<"$(read_lat --name=writer --rw=randwrite --iodepth=32 --rate_iops=0)"
gc1=$(gc_bytes "$work/steady")
stop_lamina "$work/steady"
rm -rf "$work/steady"
# The same reader and writer on the same volume in an array eight times larger, where
# the writer's run never needs GC: what the writer alone costs the reader (on 2 cores,
# mostly CPU), to tell it from what GC adds.
mkdir -p "$work/nogc"
new_array "$work/nogc" 16384
"$lamina" volume create "$work/nogc" vol --size "$volsize" >/dev/null
start_filled "$work/nogc"
S="nbd+unix:///vol?socket=$work/nogc/nbd.sock"
fill "$S"
read -r n99 n999 <<<"$(read_lat --name=writer --rw=randwrite --iodepth=32 --rate_iops=0)"
gcn=$(gc_bytes "$work/nogc")
stop_lamina "$work/nogc"
echo "# reads during GC: randread at $READ_RATE IOPS, iodepth 32; GC relocated $(( (gc1 - gc0) >> 20 )) MiB during the busy run"
printf '%-40s %10s %10s\n' "read latency (us)" p99 p99.9
printf '%-40s %10s %10s\n' "idle array" "$i99" "$i999"
printf '%-40s %10s %10s\n' "beside randwrite, no GC ($(( gcn >> 20 )) MiB moved)" "$n99" "$n999"
printf '%-40s %10s %10s\n' "beside randwrite, GC running" "$b99" "$b999"
printf '%-40s %10.2f %10.2f\n' "GC running / idle" "$(python3 -c "print($b99/$i99)")" "$(python3 -c "print($b999/$i999)")"
printf '%-40s %10.2f %10.2f\n' "GC running / no GC, same writer" "$(python3 -c "print($b99/$n99)")" "$(python3 -c "print($b999/$n999)")"
