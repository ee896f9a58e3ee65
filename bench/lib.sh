# Shared by the bench scripts (sourced, not run).

# Median of the arguments, rounded to an integer (median) or to one decimal (medianf).
median() { python3 -c 'import sys,statistics; print(round(statistics.median(map(float,sys.argv[1:]))))' "$@"; }
# median_to DIGITS VALUES...: rounded to DIGITS decimals.
median_to() { python3 -c 'import sys,statistics; print(round(statistics.median(map(float,sys.argv[2:])), int(sys.argv[1])))' "$@"; }
medianf() { median_to 1 "$@"; }

# bench_workdir SHM NAME: makes $work, a scratch directory under $base (/dev/shm when
# SHM=1, else $TMPDIR), and $pids, the servers to stop; both go when the script exits.
bench_workdir() {
  base=${TMPDIR:-/tmp}
  [ "$1" = 1 ] && base=/dev/shm
  work=$(mktemp -d "$base/$2.XXXXXX")
  pids=()
  trap bench_cleanup EXIT
}
bench_cleanup() {
  for p in "${pids[@]:-}"; do [ -n "$p" ] && kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}

# lamina_configure DIR: adds the lines in LAMINA_ENGINE and LAMINA_SERVE to the
# [engine] and [serve] sections of the array in DIR (a key given replaces the one there).
lamina_configure() { # dir
  [ -z "${LAMINA_ENGINE:-}${LAMINA_SERVE:-}" ] && return 0
  python3 - "$1/lamina.toml" <<'PY'
import os, re, sys
p = sys.argv[1]
s = open(p).read()
for section, var in (("engine", "LAMINA_ENGINE"), ("serve", "LAMINA_SERVE")):
    lines = os.environ.get(var, "")
    head = "\n[" + section + "]\n"
    # A key given here replaces the one `array create` wrote.
    for l in lines.splitlines():
        k = l.split("=")[0].strip()
        s = re.sub(r"(?m)^" + re.escape(k) + r"\s*=.*\n", "", s)
    assert head in s, (p, section)
    if lines and lines not in s:
        s = s.replace(head, head + lines + "\n", 1)
open(p, "w").write(s)
PY
}

# new_array DIR MIB: an array on one backing file of MIB MiB, written in full first
# and made with --no-discard (uses $lamina), so that its writes land in blocks that
# exist, as on a block device: a discarded file's pages must be allocated again
# (on /dev/shm in a VM, faulted in by the host), which would be measured instead of
# Lamina (docs/benchmarks.md, "Discards undid the fill").
new_array() {
  dd if=/dev/zero of="$1/dev.img" bs=4M count=$(( $2 / 4 )) status=none
  "$lamina" array create "$1" --device "$1/dev.img" --no-discard >/dev/null
}
# no_discard_engine: LAMINA_ENGINE's lines with `discard = false` added, unless they
# name `discard` themselves (for arrays made by new_array).
no_discard_engine() {
  local lines=${LAMINA_ENGINE:-}
  [[ "$lines" == *discard\ =* ]] || lines="discard = false${lines:+
$lines}"
  printf '%s\n' "$lines"
}

# wait_sock PATH / wait_file PATH: wait up to 30 s for a socket / any file to appear
# (a server's or nbdfuse's); the script stops if it does not.
wait_sock() { for _ in $(seq 300); do [ -S "$1" ] && return; sleep 0.1; done; echo "bench: $1 did not appear" >&2; exit 1; }
wait_file() { for _ in $(seq 300); do [ -e "$1" ] && return; sleep 0.1; done; echo "bench: $1 did not appear" >&2; exit 1; }

# The real traces of ../shared/traces as `lamina sim` reads them: FILE:FORMAT:EXTRA
# (bench/placement.sh, bench/tiers-sim.sh). bench_trace_path DIR FILE: the trace
# in DIR, or the copy in crates/lamina-sim/testdata; empty when neither exists.
bench_traces=(
  "diskmon-win-desktop-sample.tsv:diskmon:--trace-shift=1"
  "diskmon-win-p2pdownload-sample.tsv:diskmon:"
  "msn-fileserver-sample.disksim.txt:disksim:"
  "tpcc-oltp-sample.disksim.txt:disksim:"
  "tencent-cbs-sample.csv:tencent:"
  "wpa-win11-boot-sample.csv.gz:wpa:"
  "blkparse-ext4-sample.txt:blkparse:"
)
