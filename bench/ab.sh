#!/usr/bin/env bash
# A/B of two lamina builds on the same workload, in alternating runs: did a change
# make the data path slower or faster? Each run makes a fresh array (a 4 GiB file
# on /dev/shm, so the engine's own cost shows), a 1 GiB volume written once, then
# 8 s of fio (nbd engine, 4 KiB, iodepth 32, one connection).
#
# With LAYOUT=said5 (or said6, said0, jbod) and MEMBERS=N, the array is N files of
# 1 GiB with that layout instead.
#
# Usage: bench/ab.sh OLD_LAMINA NEW_LAMINA [randread|randwrite|randrw] [ROUNDS]
# e.g.   git worktree add /tmp/old HEAD~3 && (cd /tmp/old && cargo build --release)
#        bench/ab.sh /tmp/old/target/release/lamina target/release/lamina randwrite 3
# Prints IOPS and the server's CPU time per request (µs) of each run, then medians.
set -euo pipefail
old=$1 new=$2 rw=${3:-randread} rounds=${4:-3}
for t in fio; do command -v $t >/dev/null || { echo "ab: $t is missing" >&2; exit 1; }; done
hz=$(getconf CLK_TCK)
run() { # binary
  local lamina=$1 w pid t0 t1
  w=$(mktemp -d /dev/shm/lamina-ab.XXXXXX)
  if [ -n "${LAYOUT:-}" ]; then
    local devs=()
    for i in $(seq "${MEMBERS:-4}"); do devs+=(--device "$w/d$i.img:1G"); done
    "$lamina" array create "$w" --layout "$LAYOUT" "${devs[@]}" >/dev/null
  else
    "$lamina" array create "$w" --device "$w/dev.img:4G" >/dev/null
  fi
  "$lamina" volume create "$w" vol --size 1G >/dev/null
  "$lamina" serve "$w" --unix "$w/nbd.sock" >"$w/out" 2>"$w/err" &
  pid=$!
  for _ in $(seq 100); do [ -S "$w/nbd.sock" ] && break; sleep 0.1; done
  local uri="nbd+unix:///vol?socket=$w/nbd.sock"
  fio --name=fill --ioengine=nbd --uri="$uri" --bs=1m --iodepth=8 --rw=write --size=1g >/dev/null 2>&1
  t0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  fio --name=ab --ioengine=nbd --uri="$uri" --bs=4k --iodepth=32 --rw="$rw" --size=1g \
    --time_based --runtime=8 --norandommap --randrepeat=0 --output-format=json >"$w/fio.json" 2>/dev/null
  t1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
  python3 - "$w/fio.json" "$t0" "$t1" "$hz" <<'PY'
import json, sys
s = open(sys.argv[1]).read()
j = json.loads(s[s.index('{'):])["jobs"][0]
iops = j["read"]["iops"] + j["write"]["iops"]
t0, t1, hz = map(float, sys.argv[2:5])
print(round(iops), round((t1 - t0) / hz * 1e6 / (iops * 8), 1))
PY
  kill -TERM $pid
  wait $pid 2>/dev/null || true
  rm -rf "$w"
}
declare -a a b
printf '%-8s %10s %8s %10s %8s\n' round "old IOPS" "old cpu" "new IOPS" "new cpu"
for r in $(seq "$rounds"); do
  read -r ai ac <<<"$(run "$old")"
  read -r bi bc <<<"$(run "$new")"
  a+=("$ai"); b+=("$bi")
  printf '%-8s %10s %8s %10s %8s\n' "$r" "$ai" "$ac" "$bi" "$bc"
done
python3 -c 'import sys,statistics as s; n=len(sys.argv)//2; o=list(map(float,sys.argv[1:n+1])); w=list(map(float,sys.argv[n+1:])); print(f"median   old {s.median(o):.0f}  new {s.median(w):.0f}  new/old {s.median(w)/s.median(o):.2f}")' "${a[@]}" "${b[@]}"
