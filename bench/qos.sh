#!/usr/bin/env bash
# Per-volume limits (issue "Volumes", QoS): two volumes of one array, each with its
# own fio job (4 KiB random writes, iodepth 32, one connection each). Volume `capped`
# is limited to CAP requests per second (`lamina volume qos`); `free` is not.
# Runs: `free` alone, then both at once. Reports how close `capped` stays to its cap
# and what `free` keeps of its rate alone.
# Usage: bench/qos.sh [--shm]   env: CAP (default 5000), RUNTIME (default 10), ROUNDS (3)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
shm=0
[ "${1:-}" = --shm ] && shm=1
CAP=${CAP:-5000}
RUNTIME=${RUNTIME:-10}
ROUNDS=${ROUNDS:-3}
command -v fio >/dev/null || { echo "bench: fio is missing" >&2; exit 1; }
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
lamina="$here/target/release/lamina"
source "$here/bench/lib.sh"
bench_workdir $shm lamina-qos
"$lamina" array create "$work" --device "$work/dev.img:4G" >/dev/null
"$lamina" volume create "$work" capped --size 1G >/dev/null
"$lamina" volume create "$work" free --size 1G >/dev/null
"$lamina" serve "$work" >"$work/serve.out" 2>"$work/serve.err" &
pids+=($!)
for _ in $(seq 100); do [ -S "$work/nbd.sock" ] && break; sleep 0.1; done
uri() { echo "nbd+unix:///$1?socket=$work/nbd.sock"; }
for v in capped free; do
  fio --name=fill --ioengine=nbd --uri="$(uri $v)" --bs=1m --iodepth=8 --rw=write --size=512m >/dev/null 2>&1
done
"$lamina" volume qos "$work" capped --iops "$CAP" >/dev/null
job() { # name volume
  echo "--name=$1 --ioengine=nbd --uri=$(uri "$2") --bs=4k --iodepth=32 --rw=randwrite --size=512m --time_based --runtime=$RUNTIME --norandommap --randrepeat=0"
}
iops_of() { python3 -c 'import json,sys; j=json.load(sys.stdin); print(" ".join(str(round(x["write"]["iops"])) for x in j["jobs"]))'; }
alone=(); both_c=(); both_f=()
for _ in $(seq "$ROUNDS"); do
  # shellcheck disable=SC2046
  a=$(fio $(job free free) --output-format=json 2>/dev/null | sed -n '/^{/,$p' | iops_of)
  # shellcheck disable=SC2046
  read -r c f <<<"$(fio $(job capped capped) $(job free free) --output-format=json 2>/dev/null | sed -n '/^{/,$p' | iops_of)"
  alone+=("$a"); both_c+=("$c"); both_f+=("$f")
done
ma=$(median "${alone[@]}"); mc=$(median "${both_c[@]}"); mf=$(median "${both_f[@]}")
echo "# two volumes, 4 KiB randwrite iodepth 32 each, ${RUNTIME}s x $ROUNDS rounds (medians); capped at $CAP/s"
printf '%-34s %10s\n' "free alone (IOPS)" "$ma"
printf '%-34s %10s\n' "free beside capped (IOPS)" "$mf"
printf '%-34s %10s\n' "capped beside free (IOPS)" "$mc"
python3 -c "print(f'capped / cap {$mc/$CAP:.3f}   free beside / alone {$mf/$ma:.3f}')"
