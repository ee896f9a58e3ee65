#!/usr/bin/env bash
# What [serve] io_nice costs a flush: 4 KiB random writes at iodepth 1 with a flush
# after each (fio --fsync=1), on a 2 GiB array file on the disk, the server
# restarted with each io_nice value in turn; ROUNDS alternating rounds.
#
# Usage: bench/io-nice.sh [VALUE...]   (default: 0 10)
#   env: ROUNDS (default 3), RUNTIME seconds (default 6), TMPDIR (where the array goes)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
source "$here/bench/lib.sh"
values=("$@"); [ ${#values[@]} -gt 0 ] || values=(0 10)
ROUNDS=${ROUNDS:-3}; RUNTIME=${RUNTIME:-6}
command -v fio >/dev/null || { echo "bench: fio is missing" >&2; exit 1; }
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
work=$(mktemp -d "${TMPDIR:-/var/tmp}/lamina-ionice.XXXXXX")
pid=""
trap '[ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
"$lamina" array create "$work" --device "$work/dev.img:2G" >/dev/null
"$lamina" volume create "$work" vol --size 1G >/dev/null
cp "$work/lamina.toml" "$work/base.toml"
declare -A got
for _ in $(seq "$ROUNDS"); do
  for n in "${values[@]}"; do
    sed "s/^\[serve\]\$/[serve]\nio_nice = $n/" "$work/base.toml" >"$work/lamina.toml"
    "$lamina" serve "$work" --unix "$work/nbd.sock" >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 100); do [ -S "$work/nbd.sock" ] && break; sleep 0.1; done
    iops=$(fio --name=wf --ioengine=nbd --uri="nbd+unix:///vol?socket=$work/nbd.sock" \
      --bs=4k --iodepth=1 --rw=randwrite --fsync=1 --size=256m --time_based \
      --runtime="$RUNTIME" --output-format=json 2>/dev/null | sed -n '/^{/,$p' |
      python3 -c 'import json,sys; print(round(json.load(sys.stdin)["jobs"][0]["write"]["iops"]))')
    got[$n]="${got[$n]:-} $iops"
    kill "$pid"; wait "$pid" 2>/dev/null || true; pid=""; rm -f "$work/nbd.sock"
  done
done
echo "# write+flush (4 KiB, iodepth 1, --fsync=1), flushed writes per second, $ROUNDS rounds"
for n in "${values[@]}"; do
  # shellcheck disable=SC2086
  printf 'io_nice %-3s median %6s   runs%s\n' "$n" "$(median ${got[$n]})" "${got[$n]}"
done
