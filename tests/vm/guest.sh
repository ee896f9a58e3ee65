#!/bin/bash
# The kernel test rig's checks, run inside the VM (tests/vm/rig.sh boots it; the
# guest's /init runs this in a chroot of the host's root file system). $1 is the
# run directory shared read-write with the host; its `env` file says where the
# host's server listens and which binaries to run.
set -euo pipefail
RUN=$1
# shellcheck disable=SC1091
. "$RUN/env"
cd /tmp # fio writes its verify state files in the current directory
say() { echo "guest: $*"; }
trap 'say "FAILED at line $LINENO: $BASH_COMMAND"' ERR
step() { say "== $*"; }
mb() { echo $(($1 >> 20)); }
# LAMINA_VM_ONLY=2,3 (given to rig.sh) runs only those checks.
want() { [ -z "${ONLY:-}" ] || [[ ",$ONLY," == *",$1,"* ]]; }

# fio with the checks the suite uses: crc32c on every block, fatal on the first
# mismatch; a job that fails prints its JSON error.
fio_check() {
  local out
  out=$(fio --output-format=json --bs=4k --verify=crc32c --verify_fatal=1 "$@") || {
    echo "$out"
    return 1
  }
  echo "$out" | python3 -c '
import json, sys
text = sys.stdin.read()
j = json.loads(text[text.find("{"):])
for job in j["jobs"]:
    if job["error"]:
        sys.exit("fio job %s: error %d" % (job["jobname"], job["error"]))
    w, r = job["write"], job["read"]
    print("guest:   fio %s: %d MiB written, %d MiB read (%d write IOPS, %d read IOPS)" % (
        job["jobname"], w["io_bytes"] >> 20, r["io_bytes"] >> 20, w["iops"], r["iops"]))
'
}

# A null_blk device made through configfs: nullb N key=value... makes /dev/nullbN
# (the kernel names a configfs device after its directory).
nullb() {
  local d=/sys/kernel/config/nullb/nullb$1 kv
  mkdir "$d"
  echo "$1" >"$d/index"
  shift
  for kv in "$@"; do echo "${kv#*=}" >"$d/${kv%%=*}"; done
  echo 1 >"$d/power"
  for _ in $(seq 50); do
    [ -b "/dev/${d##*/}" ] && return
    sleep 0.1
  done
  say "no /dev/${d##*/}; /sys/block has: $(ls /sys/block)"
  return 1
}

# A Lamina server inside the guest: serve DIR (its socket is DIR.sock).
serve() {
  "$LAMINA" serve "$1" --unix "$1.sock" --no-tcp >>"$1.log" 2>&1 &
  server=$!
  for _ in $(seq 200); do
    [ -S "$1.sock" ] && return
    kill -0 "$server" 2>/dev/null || break
    sleep 0.1
  done
  cat "$1.log"
  return 1
}
crash() {
  kill -9 "$server"
  wait "$server" 2>/dev/null || true
  rm -f "$1.sock"
}

# Random 4 KiB writes by fio to DIR's volume v, flushed, then kill -9 and restart:
# every block must read back. survives DIR NAME SIZE IODEPTH
survives() {
  local job=(--name="$2" --ioengine=nbd --rw=randwrite)
  job+=(--uri="nbd+unix:///v?socket=$1.sock" --size="$3" --iodepth="$4")
  fio_check "${job[@]}" --do_verify=0 --end_fsync=1
  crash "$1"
  serve "$1"
  fio_check "${job[@]}" --verify_only
  say "after kill -9 and restart, every block fio wrote and flushed reads back"
}

modprobe() { :; } # the initramfs loaded every module the checks use
step "kernel $(uname -r), $(nproc) CPUs"

# ---------------------------------------------------------------------------
check1() {
  step "1. the kernel NBD client on the host's lamina serve over TCP (10.0.2.2:$PORT)"
  nbd-client -N knbd 10.0.2.2 "$PORT" /dev/nbd0 -b 4096 -C 2 -t 60
  size=$(blockdev --getsize64 /dev/nbd0)
  [ "$size" = $((1 << 30)) ] || {
    say "/dev/nbd0 has $size bytes, not 1 GiB"
    false
  }
  say "/dev/nbd0: $(mb "$size") MiB over two connections"
  fio_check --name=kernel-client --filename=/dev/nbd0 --direct=1 --ioengine=libaio --iodepth=16 \
    --rw=randwrite --numjobs=2 --size=128M --offset_increment=128M --group_reporting=0

  step "write-zeroes and trim through the kernel client"
  head -c 16M /dev/urandom | dd of=/dev/nbd0 bs=1M oflag=direct status=none
  blkdiscard -z -o 0 -l 8M /dev/nbd0
  blkdiscard -o 8M -l 8M /dev/nbd0
  cmp -n $((8 << 20)) <(dd if=/dev/nbd0 bs=1M count=8 iflag=direct status=none) /dev/zero
  say "8 MiB written, zeroed with BLKZEROOUT and read back as zeroes; 8 MiB trimmed"

  for fs in ext4 xfs; do
    step "$fs on the kernel client: make, fill, check, compare"
    case $fs in
      ext4) mkfs.ext4 -q -F -E discard /dev/nbd0 ;;
      xfs) mkfs.xfs -q -f /dev/nbd0 ;;
    esac
    mkdir -p /tmp/fs
    mount -o discard /dev/nbd0 /tmp/fs
    cp -a "$REPO/crates" "$REPO/docs" /tmp/fs/
    (cd "$REPO" && find crates docs -type f -print0 | sort -z | xargs -0 sha256sum) >/tmp/sums
    fstrim /tmp/fs
    umount /tmp/fs
    case $fs in
      ext4) e2fsck -fn /dev/nbd0 >/dev/null ;;
      xfs) xfs_repair -n /dev/nbd0 >/dev/null 2>&1 ;;
    esac
    echo 3 >/proc/sys/vm/drop_caches
    mount /dev/nbd0 /tmp/fs
    (cd /tmp/fs && sha256sum --quiet -c /tmp/sums)
    umount /tmp/fs
    say "$fs: $(wc -l </tmp/sums) files copied, the file system checked clean, every file read back equal"
  done
  nbd-client -d /dev/nbd0 >/dev/null

  step "a pattern written and flushed through the kernel client (the host checks it after kill -9)"
  nbd-client -N kraw 10.0.2.2 "$PORT" /dev/nbd1 -b 4096 -t 60
  head -c 128M /dev/urandom >"$RUN/pattern"
  dd if="$RUN/pattern" of=/dev/nbd1 bs=1M oflag=direct conv=fsync status=none
  nbd-client -d /dev/nbd1 >/dev/null
}
if want 1; then check1; fi

# ---------------------------------------------------------------------------
check2() {
  step "2. zoned null_blk: the zone conformance rules through the kernel's ioctls"
  nullb 1 blocksize=4096 size=256 zoned=1 zone_size=8 zone_nr_conv=2 memory_backed=1 \
    zone_max_open=4 zone_max_active=6
  LAMINA_ZONED_DEVICE=/dev/nullb1 "$DEVTEST" --exact \
    blkzoned::tests::kernel_zoned_device_passes_the_conformance_rules --nocapture 2>&1 |
    sed 's/^/guest:   /'
  [ "${PIPESTATUS[0]}" = 0 ]

  step "a Lamina array on a zoned null_blk (8 MiB zones, 8 open, 10 active)"
  nullb 2 blocksize=4096 size=512 zoned=1 zone_size=8 zone_nr_conv=4 memory_backed=1 \
    zone_max_open=8 zone_max_active=10
  say "/dev/nullb2: $(cat /sys/block/nullb2/queue/zoned), $(cat /sys/block/nullb2/queue/nr_zones) zones"
  "$LAMINA" array create /tmp/za --device /dev/nullb2 --segment-size 8M
  "$LAMINA" volume create /tmp/za v --size 320M
  serve /tmp/za
  survives /tmp/za zoned-write 128M 16
  fio_check --name=zoned-gc --ioengine=nbd --uri="nbd+unix:///v?socket=/tmp/za.sock" --iodepth=16 \
    --rw=randwrite --size=320M --loops=2
  victims=$("$LAMINA" status /tmp/za --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["gc_victims"])')
  [ "$victims" -gt 0 ] || {
    say "GC never ran on the zoned array"
    false
  }
  say "GC took $victims victims: their zones were reset and written again"
  survives /tmp/za zoned-last 128M 16
  crash /tmp/za
}
if want 2; then check2; fi

# ---------------------------------------------------------------------------
check3() {
  step "3. a Lamina array on a conventional null_blk, 512-byte sectors, io_uring and O_DIRECT"
  nullb 3 blocksize=512 size=512 memory_backed=1
  "$LAMINA" array create /tmp/ca --device /dev/nullb3
  "$LAMINA" volume create /tmp/ca v --size 320M
  serve /tmp/ca
  grep -i "direct\|uring" /tmp/ca.log | sed 's/^/guest:   serve: /' || true
  survives /tmp/ca conv-write 256M 32
  crash /tmp/ca
}
if want 3; then check3; fi

# ---------------------------------------------------------------------------
# Not a check: bench/vm-raid5.sh's measurement (LAMINA_VM_ONLY=raid5).
raid5() {
  step "raid5: md RAID-5 against Lamina SAID5 on four null_blk devices (${R5_SIZE} MiB, ${R5_LAT} ns per I/O, queue depth ${R5_QD}, ${R5_MBPS} MB/s)"
  local i devs=() region=$((R5_SIZE * 3 / 2)) out=$RUN/raid5.md
  for i in 4 5 6 7; do
    nullb $i blocksize=4096 size="$R5_SIZE" memory_backed=1 irqmode=2 completion_nsec="$R5_LAT" \
      submit_queues=1 hw_queue_depth="$R5_QD" mbps="$R5_MBPS"
    devs+=(/dev/nullb$i)
  done
  # Sectors read and written by the members since boot.
  member_sectors() { cat /sys/block/nullb{4,5,6,7}/stat | awk '{r += $3; w += $7} END {print r, w}'; }
  # 4 KiB random writes on DEV over the region, R5_RUNTIME seconds to warm up, then
  # as long measured: IOPS, member bytes written and read per user byte, write p99.
  measure() {
    local dev=$1 r0 w0 r1 w1 j
    fio --name=warm --filename="$dev" --direct=1 --ioengine=libaio --iodepth=32 --rw=randwrite \
      --bs=4k --size="${region}M" --norandommap --randrepeat=0 --time_based --runtime="$R5_RUNTIME" \
      >/dev/null
    read -r r0 w0 < <(member_sectors)
    j=$(fio --name=run --filename="$dev" --direct=1 --ioengine=libaio --iodepth=32 --rw=randwrite \
      --bs=4k --size="${region}M" --norandommap --randrepeat=0 --time_based --runtime="$R5_RUNTIME" \
      --output-format=json)
    read -r r1 w1 < <(member_sectors)
    echo "$j" | python3 -c '
import json, sys
t = sys.stdin.read(); w = json.loads(t[t.index("{"):])["jobs"][0]["write"]
user = w["io_bytes"]; r0, w0, r1, w1 = map(int, sys.argv[1:])
print("%.0f %.2f %.2f %.0f" % (w["iops"], (w1 - w0) * 512 / user, (r1 - r0) * 512 / user,
      w["clat_ns"]["percentile"]["99.000000"] / 1000))' "$r0" "$w0" "$r1" "$w1"
  }
  mdadm --create /dev/md0 --level=5 --raid-devices=4 --chunk=64 --assume-clean --run \
    --metadata=1.2 "${devs[@]}" 2>&1 | sed 's/^/guest:   /'
  read -r md_iops md_w md_r md_p99 < <(measure /dev/md0)
  mdadm --stop /dev/md0 >/dev/null 2>&1
  mdadm --zero-superblock "${devs[@]}"
  "$LAMINA" array create /tmp/s5 --layout said5 "${devs[@]/#/--device=}" >/dev/null
  "$LAMINA" volume create /tmp/s5 v --size "${region}M" >/dev/null
  serve /tmp/s5
  nbd-client -unix /tmp/s5.sock /dev/nbd2 -N v -b 4096 -t 60 >/dev/null
  read -r s5_iops s5_w s5_r s5_p99 < <(measure /dev/nbd2)
  nbd-client -d /dev/nbd2 >/dev/null
  crash /tmp/s5
  {
    echo "| 4 KiB random writes, iodepth 32, ${region} MiB region | IOPS | p99 (µs) | member bytes written / user byte | member bytes read / user byte |"
    echo "|---|---:|---:|---:|---:|"
    echo "| md RAID-5 (64 KiB chunks), /dev/md0 | $md_iops | $md_p99 | $md_w | $md_r |"
    echo "| Lamina SAID5 (8 MiB chunks), kernel NBD client | $s5_iops | $s5_p99 | $s5_w | $s5_r |"
    echo "| Lamina / md | $(python3 -c "print('%.2f' % ($s5_iops / $md_iops))") | | | |"
  } >"$out"
  sed 's/^/guest:   /' "$out"
}
if want raid5 && [ -n "${ONLY:-}" ]; then raid5; fi

say "all checks passed"
