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
