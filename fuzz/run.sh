#!/usr/bin/env bash
# Runs every fuzz target for SECONDS (default 30) on its committed corpus, with
# memory limits: a panic, an abort, a hang or an allocation past the limit fails.
# New inputs the fuzzer finds are added to fuzz/corpus/TARGET. A failing input is
# left in fuzz/artifacts/TARGET; replay it with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run -O TARGET fuzz/artifacts/TARGET/crash-...
# cargo-fuzz needs nightly flags; RUSTC_BOOTSTRAP lets the stable toolchain take them.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-30}
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
targets=(superblock unit_header summary checkpoint zone_state nbd_server)
cargo fuzz build -O
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for t in "${targets[@]}"; do
  echo "fuzz: $t for ${secs}s"
  if ! cargo fuzz run -O "$t" "corpus/$t" -- \
      -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=512 \
      >"$log" 2>&1; then
    tail -n 60 "$log" >&2
    echo "fuzz: $t failed (input in fuzz/artifacts/$t)" >&2
    exit 1
  fi
  grep -E '^Done [0-9]+ runs' "$log" || true
done
echo "fuzz: ${#targets[@]} targets ran ${secs}s each without a failure"
