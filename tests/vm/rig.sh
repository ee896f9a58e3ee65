#!/usr/bin/env bash
# The kernel test rig (issue 16, item 3): Debian's own kernel in a QEMU VM, for the
# paths this machine's kernel cannot exercise (no nbd, null_blk or zoned modules).
#
#   tests/vm/rig.sh            # about 4 minutes under TCG on 2 cores
#
# The kernel package (the one linux-image-amd64 depends on) is downloaded and
# unpacked, not installed, into $LAMINA_VM_DIR (default target/vm); the initramfs
# holds busybox, tests/vm/init and the modules the tests load. The guest sees the
# host's root file system read-only over 9p, so it runs the host's own binaries
# (this tree's release build, fio, nbd-client, mkfs); tests/vm/guest.sh is what it
# runs. What it checks:
#   1. the kernel NBD client (nbd-client, two connections) on a `lamina serve` on
#      the host, over TCP: fio verify with direct I/O, write-zeroes and trim, ext4
#      and XFS made, filled, checked and compared; a pattern written and flushed
#      through the kernel is read back on the host after the server was killed -9;
#   2. the zone conformance rules on a zoned null_blk through the kernel's zone
#      ioctls (blkzoned.rs), then a Lamina array on a zoned null_blk with open and
#      active zone limits: fio verify, kill -9 and restart, overwrites until GC has
#      reset zones, verify again;
#   3. a Lamina array on a conventional null_blk with 512-byte sectors, driven with
#      io_uring and O_DIRECT (the default on block devices): fio verify, kill -9,
#      restart, verify.
# Exit status 0 when the guest and the host's checks pass. LAMINA_VM_TIMEOUT bounds
# the VM's run (seconds, default 1500). KVM is used when /dev/kvm works, else TCG.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
VM=${LAMINA_VM_DIR:-$ROOT/target/vm}
TIMEOUT=${LAMINA_VM_TIMEOUT:-1500}

say() { echo "rig: $*"; }
die() {
  say "$*" >&2
  exit 1
}
for t in qemu-system-x86_64 busybox depmod apt-get dpkg-deb nbd-client fio nbdcopy mkfs.xfs; do
  command -v "$t" >/dev/null || die "$t not found (.ci/run installs it)"
done

# 1. Debian's kernel, unpacked into $VM/kernel/VERSION.
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
if [ -z "$kpkg" ]; then
  apt-get update >/dev/null
  kpkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
fi
[ -n "$kpkg" ] || die "no linux-image-amd64 package known to apt"
KVER=${kpkg#linux-image-}
K=$VM/kernel/$KVER
if [ ! -f "$K/boot/vmlinuz-$KVER" ]; then
  say "downloading $kpkg"
  mkdir -p "$VM/kernel"
  fetch() { (cd "$VM/kernel" && apt-get download "$kpkg" 2>&1 | grep -v "couldn't be accessed by user '_apt'" || true); }
  fetch
  ls "$VM/kernel/${kpkg}"_*.deb >/dev/null 2>&1 || {
    apt-get update >/dev/null
    fetch
  }
  deb=$(ls "$VM/kernel/${kpkg}"_*.deb) || die "cannot download $kpkg"
  rm -rf "$K.tmp"
  dpkg-deb -x "$deb" "$K.tmp"
  depmod -b "$K.tmp" "$KVER"
  rm -f "$deb"
  mv "$K.tmp" "$K"
fi

# 2. The initramfs: busybox, /init, the modules below and what they depend on.
load=(virtio_pci virtio_net 9pnet_virtio 9p configfs nbd null_blk loop crc32c_generic
  crc32c_intel ext4 xfs)
# More modules, loaded at boot too (bench/vm-raid5.sh: raid456).
modules=${LAMINA_VM_MODULES:-}
extra=(${modules//,/ })
initrd=$VM/initrd-$KVER.gz
stage=$VM/initrd.d
rm -rf "$stage"
mkdir -p "$stage"/{bin,proc,sys,dev,host,tmp}
cp /bin/busybox "$stage/bin/busybox"
case $(ldd /bin/busybox 2>&1 || true) in
  *"not a dynamic"*) ;;
  *) die "/bin/busybox is not static (install busybox-static)" ;;
esac
cp tests/vm/init "$stage/init"
chmod +x "$stage/init"
printf '%s\n' "${load[@]}" >"$stage/modules.load"
moddir=lib/modules/$KVER
declare -A dep_of path_of
while IFS=: read -r p deps; do
  n=${p##*/}
  n=${n%.ko*}
  n=${n//-/_}
  path_of[$n]=$p
  dep_of[$p]=$deps
done <"$K/$moddir/modules.dep"
declare -A take
want=()
for m in "${load[@]}" "${extra[@]}"; do
  p=${path_of[$m]:-}
  [ -n "$p" ] || die "module $m is not in $KVER's modules.dep"
  want+=("$p")
done
while [ ${#want[@]} -gt 0 ]; do
  p=${want[-1]}
  unset 'want[-1]'
  [ -z "${take[$p]:-}" ] || continue
  take[$p]=1
  for d in ${dep_of[$p]}; do want+=("$d"); done
done
for p in "${!take[@]}"; do
  mkdir -p "$stage/$moddir/$(dirname "$p")"
  cp "$K/$moddir/$p" "$stage/$moddir/$p"
done
cp "$K/$moddir"/modules.{builtin,builtin.modinfo,order} "$stage/$moddir/"
depmod -b "$stage" "$KVER"
(cd "$stage" && find . | busybox cpio -o -H newc 2>/dev/null) | gzip -1 >"$initrd"
say "initramfs: ${#take[@]} modules, $(du -k "$initrd" | cut -f1) KiB"

# 3. What the guest runs: this tree's release build and lamina-device's test binary.
cargo build --release -p lamina --quiet
devtest=$(cargo test --release -p lamina-device --no-run --message-format=json 2>/dev/null |
  grep -o '"executable":"[^"]*/lamina_device-[^"]*"' | tail -1 | cut -d'"' -f4)
[ -x "$devtest" ] || die "cannot find lamina-device's test binary"
LAMINA=$ROOT/target/release/lamina

RUN=$VM/run
rm -rf "$RUN"
mkdir -p "$RUN"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill -9 "$p" 2>/dev/null || true; done
}
trap cleanup EXIT

# 4. The host's side of check 1: a server on TCP for the guest's kernel client.
port=$((20000 + RANDOM % 20000))
"$LAMINA" array create "$RUN/host" --device "$RUN/host.img:3G" >/dev/null
"$LAMINA" volume create "$RUN/host" knbd --size 1G >/dev/null
"$LAMINA" volume create "$RUN/host" kraw --size 128M >/dev/null
serve_host() {
  "$LAMINA" serve "$RUN/host" --tcp "127.0.0.1:$port" --unix "$RUN/host.sock" >>"$RUN/host-serve.log" 2>&1 &
  pids+=($!)
  server=$!
  for _ in $(seq 100); do
    [ -S "$RUN/host.sock" ] && return
    sleep 0.1
  done
  die "the host's server did not start (see $RUN/host-serve.log)"
}
serve_host

cat >"$RUN/env" <<EOF
PORT=$port
LAMINA=$LAMINA
DEVTEST=$devtest
REPO=$ROOT
ONLY=${LAMINA_VM_ONLY:-}
R5_LAT=${R5_LAT:-100000}
R5_SIZE=${R5_SIZE:-512}
R5_RUNTIME=${R5_RUNTIME:-20}
R5_QD=${R5_QD:-32}
R5_MBPS=${R5_MBPS:-500}
EOF

# 5. The VM. With -no-reboot and panic=-1 a panic ends QEMU too.
accel=tcg
if [ -w /dev/kvm ] && grep -qE 'vmx|svm' /proc/cpuinfo; then accel=kvm; fi
say "booting $KVER ($accel, 2 vCPUs, 4 GiB); console in $RUN/console.log"
start=$(date +%s)
set +e
timeout -k 10 "$TIMEOUT" qemu-system-x86_64 -machine q35,accel=$accel -cpu max -smp 2 -m 4G \
  -display none -monitor none -no-reboot \
  -chardev stdio,id=con,signal=off,logfile="$RUN/console.log" -serial chardev:con \
  -kernel "$K/boot/vmlinuz-$KVER" -initrd "$initrd" \
  -append "console=ttyS0 quiet panic=-1 lamina.run=$RUN lamina.script=$ROOT/tests/vm/guest.sh lamina.ci=${CI:-} lamina.modules=${LAMINA_VM_MODULES:-}" \
  -virtfs local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap \
  -virtfs local,path="$RUN",mount_tag=run,security_model=none,multidevs=remap \
  -netdev user,id=n0 -device virtio-net-pci,netdev=n0 </dev/null |
  sed -u 's/^/  vm: /'
qemu=${PIPESTATUS[0]}
set -e
say "the VM ran $(($(date +%s) - start)) s (qemu exit $qemu)"
[ "$qemu" = 0 ] || die "QEMU failed or timed out after ${TIMEOUT}s"
[ -f "$RUN/guest.rc" ] || die "the guest did not finish"
rc=$(cat "$RUN/guest.rc")
[ "$rc" = 0 ] || die "the guest's checks failed (exit $rc)"

# 6. Check 1's last part: what the guest flushed through the kernel client is on
# the host's array after kill -9.
if [ ! -f "$RUN/pattern" ]; then
  say "checks ${LAMINA_VM_ONLY} passed"
  exit 0
fi
kill -9 "$server"
wait "$server" 2>/dev/null || true
serve_host
want=$(sha256sum <"$RUN/pattern" | cut -d' ' -f1)
got=$(nbdcopy "nbd+unix:///kraw?socket=$RUN/host.sock" - | sha256sum | cut -d' ' -f1)
[ "$want" = "$got" ] || die "the pattern flushed through the kernel client is not on the array after kill -9"
say "the pattern flushed by the guest's kernel client survived kill -9 of the host's server"
say "all checks passed"
