# Shared by bench/said5.sh and bench/rebuild.sh (sourced, not run).
# said5_serve DIR FILL DEVICE_ARGS...: creates a SAID5 array in DIR/arr with 1 MiB
# chunks and a volume `v` of FILL x usable space, starts `lamina serve` on
# DIR/nbd.sock; sets $vol, $srv and $uri.
said5_serve() {
  local d=$1 f=$2
  shift 2
  "$bin" array create "$d/arr" --layout said5 "$@" --segment-size 1M >/dev/null
  local usable
  usable=$("$bin" status "$d/arr" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["usable_bytes"])')
  vol=$(python3 -c "print(int($usable * $f) // 1048576 * 1048576)")
  "$bin" volume create "$d/arr" v --size "$vol" >/dev/null
  "$bin" serve "$d/arr" --unix "$d/nbd.sock" >/dev/null 2>&1 &
  srv=$!
  while [ ! -S "$d/nbd.sock" ]; do sleep 0.1; done
  uri="nbd+unix:///v?socket=$d/nbd.sock"
}
