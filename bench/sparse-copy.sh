#!/usr/bin/env bash
# Copying a thin volume out with nbdcopy: Lamina against `nbdkit file` serving a
# sparse file with the same contents, in the same run.
#
# The export is SIZE bytes (default 8g) holding DATA bytes (default 256m) of random
# data in 64 pieces spread over it, the rest never written. nbdcopy copies it to
# `null:`, so the copy costs what the server does: reading the data, and telling
# the client where the holes are (NBD_CMD_BLOCK_STATUS, `base:allocation`; nbdkit
# answers from the file's SEEK_DATA/SEEK_HOLE, Lamina from its map). The row
# "lamina, --no-extents" is the same copy by a client that does not ask for block
# status, which reads every byte: what every client got from Lamina before it
# answered block status. Runs alternate ROUNDS times; medians.
#
# With --shm the backing files live in /dev/shm (RAM): the servers' own cost is
# what is measured.
#
# Usage: bench/sparse-copy.sh [--shm]   env: ROUNDS (default 3), SIZE (8g), DATA (256m)
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
shm=0
for a in "$@"; do
  case $a in
    --shm) shm=1 ;;
    *) echo "usage: $0 [--shm]" >&2; exit 2 ;;
  esac
done
ROUNDS=${ROUNDS:-3}
SIZE=${SIZE:-8g}
DATA=${DATA:-256m}
for t in nbdcopy nbdkit; do
  command -v $t >/dev/null || { echo "bench: $t is missing (apt-get install libnbd-bin nbdkit)" >&2; exit 1; }
done
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"

bytes() { numfmt --from=iec "${1^^}"; }
size=$(bytes "$SIZE")
data=$(bytes "$DATA")
piece=$((data / 64))
bench_workdir $shm lamina-sparse

# The source: a sparse file with 64 random pieces.
truncate -s "$size" "$work/src.img"
for i in $(seq 0 63); do
  head -c "$piece" /dev/urandom |
    dd of="$work/src.img" bs=1M iflag=fullblock oflag=seek_bytes seek=$((i * (size / 64))) conv=notrunc status=none
done

mkdir -p "$work/lamina"
"$lamina" array create "$work/lamina" --device "$work/lamina/dev.img:$((size * 5 / 4 / 1048576))M" >/dev/null
"$lamina" volume create "$work/lamina" vol --size "$size" >/dev/null
"$lamina" serve "$work/lamina" --unix "$work/lamina/nbd.sock" >/dev/null 2>"$work/lamina/serve.err" &
pids+=($!)
nbdkit -U "$work/nbdkit.sock" --foreground file "$work/src.img" &
pids+=($!)
for s in "$work/lamina/nbd.sock" "$work/nbdkit.sock"; do
  for _ in $(seq 100); do [ -S "$s" ] && break; sleep 0.1; done
  [ -S "$s" ] || { echo "bench: server did not start ($s)" >&2; cat "$work/lamina/serve.err" >&2; exit 1; }
done
lamina_uri="nbd+unix:///vol?socket=$work/lamina/nbd.sock"
nbdkit_uri="nbd+unix:///?socket=$work/nbdkit.sock"
# The volume gets the source's contents (nbdcopy writes the data and zeroes the rest).
nbdcopy "$work/src.img" "$lamina_uri"

secs() { # nbdcopy args...: seconds the copy took
  local t0 t1
  t0=$(date +%s.%N)
  nbdcopy "$@" null:
  t1=$(date +%s.%N)
  python3 -c "print(round($t1 - $t0, 3))"
}
declare -A t
for r in $(seq "$ROUNDS"); do
  t[lamina]+=" $(secs "$lamina_uri")"
  t[nbdkit]+=" $(secs "$nbdkit_uri")"
  t[noext]+=" $(secs --no-extents "$lamina_uri")"
done
# shellcheck disable=SC2086 # the lists split into values on purpose
l=$(median_to 3 ${t[lamina]}) k=$(median_to 3 ${t[nbdkit]}) n=$(median_to 3 ${t[noext]})
where=disk; [ $shm = 1 ] && where=/dev/shm
echo "nbdcopy of a $SIZE export holding $DATA, to null: (backing files on $where; median of $ROUNDS)"
echo
echo "| server | seconds | time / nbdkit |"
echo "|---|---|---|"
echo "| lamina | $l | $(python3 -c "print(round($l / $k, 2))")x |"
echo "| lamina, nbdcopy --no-extents | $n | $(python3 -c "print(round($n / $k, 2))")x |"
echo "| nbdkit file | $k | 1.00x |"
