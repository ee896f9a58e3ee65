#!/usr/bin/env bash
# SAID5 against the kernel's own RAID-5 (md), in Debian's kernel under QEMU (the
# kernel test rig, tests/vm/rig.sh): four memory-backed null_blk devices, each
# completing an I/O R5_LAT ns after it starts (default 100000), at most R5_QD at a
# time (32) and R5_MBPS MB/s (500); md RAID-5 with 64 KiB chunks on them, then a
# Lamina SAID5 array on the same four; both reached through the kernel block layer
# (md0, and the kernel NBD client on Lamina's Unix socket) by the same fio job: 4 KiB
# random writes, iodepth 32, over half of the usable space, R5_RUNTIME seconds
# (default 20) to warm up, then as long measured. Prints IOPS, p99, and the member
# bytes written and read per user byte (from the devices' stat).
#
#   bench/vm-raid5.sh                                   # an SSD-like member
#   R5_LAT=4000000 R5_QD=1 R5_MBPS=150 bench/vm-raid5.sh  # a disk-like one
#
# Under TCG the guest's CPU is emulated, so both sides pay for it; compare the ratio.
set -euo pipefail
cd "$(dirname "$0")/.."
LAMINA_VM_ONLY=raid5 LAMINA_VM_MODULES=raid456 tests/vm/rig.sh
cat "${LAMINA_VM_DIR:-target/vm}/run/raid5.md"
