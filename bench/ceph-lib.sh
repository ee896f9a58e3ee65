# A one-host Ceph cluster from Debian's packages, for bench/ceph.sh: one monitor,
# one manager and an OSD (BlueStore) on each block device given, replication 3
# across the OSDs (the failure domain is the OSD: there is one host), no cephx.
# Sourced; every daemon runs as root from $CEPH_DIR with its own log there.
#
#   ceph_up DIR DEV...   # makes and starts the cluster; DEV: block devices
#   cephc ARGS...        # the ceph CLI against it
#   ceph_down            # stops every daemon

cephc() { ceph -c "$CEPH_DIR/ceph.conf" "$@"; }

ceph_up() {
  CEPH_DIR=$1
  shift
  local fsid i uuid id dev
  fsid=$(cat /proc/sys/kernel/random/uuid)
  rm -rf "$CEPH_DIR"
  mkdir -p "$CEPH_DIR"/{run,log,mon/a,mgr/x}
  cat >"$CEPH_DIR/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = 127.0.0.1:6789
mon initial members = a
public network = 127.0.0.0/8
auth cluster required = none
auth service required = none
auth client required = none
run dir = $CEPH_DIR/run
log file = $CEPH_DIR/log/\$name.log
admin socket = $CEPH_DIR/run/\$name.asok
pid file = $CEPH_DIR/run/\$name.pid
osd pool default size = 3
osd pool default min size = 2
osd crush chooseleaf type = 0
mon allow pool delete = true
mon allow pool size one = true
mon warn on pool no redundancy = false
ms bind ipv6 = false
[mon]
mon data = $CEPH_DIR/mon/\$id
[mgr]
mgr data = $CEPH_DIR/mgr/\$id
[osd]
osd data = $CEPH_DIR/osd/\$id
osd objectstore = bluestore
osd memory target = 1073741824
# The OSDs do not place themselves in the CRUSH map when they start (ceph_up does,
# from the admin client): an OSD's own update at its first start was refused now
# and then with "wrong fsid" (EPERM), and then every restart of it too.
osd crush update on start = false
osd class update on start = false
# CEPH_DISCARD=1: BlueStore tells the device what it frees (Ceph's default is not
# to); it then also discards the whole device at mkfs.
bdev enable discard = ${CEPH_DISCARD:-0}
bdev async discard = ${CEPH_DISCARD:-0}
EOF
  monmaptool --create --add a 127.0.0.1:6789 --fsid "$fsid" "$CEPH_DIR/monmap" >/dev/null
  ceph-mon -c "$CEPH_DIR/ceph.conf" --mkfs -i a --monmap "$CEPH_DIR/monmap"
  ceph-mon -c "$CEPH_DIR/ceph.conf" -i a 2>>"$CEPH_DIR/log/daemons" || {
    echo "ceph: the monitor did not start:" >&2
    tail -5 "$CEPH_DIR/log/mon.a.log" >&2
    return 1
  }
  ceph-mgr -c "$CEPH_DIR/ceph.conf" -i x 2>>"$CEPH_DIR/log/daemons"
  # The monitor may refuse commands for a moment after it starts (EPERM).
  for _ in $(seq 100); do
    cephc -s >/dev/null 2>&1 && break
    sleep 0.2
  done
  i=0
  for dev in "$@"; do
    uuid=$(cat /proc/sys/kernel/random/uuid)
    id=$(cephc osd new "$uuid")
    cephc osd crush add "osd.$id" 1.0 root=default host=localhost >/dev/null 2>&1
    mkdir -p "$CEPH_DIR/osd/$id"
    ln -s "$dev" "$CEPH_DIR/osd/$id/block"
    ceph-osd -c "$CEPH_DIR/ceph.conf" -i "$id" --mkfs --osd-uuid "$uuid" >"$CEPH_DIR/log/mkfs.$id" 2>&1 || {
      cat "$CEPH_DIR/log/mkfs.$id" >&2
      return 1
    }
    # Should an OSD's first start fail all the same, say so and try again, twice
    # at most.
    local try
    for try in 1 2 3; do
      ceph-osd -c "$CEPH_DIR/ceph.conf" -i "$id" 2>>"$CEPH_DIR/log/daemons" && break
      echo "ceph: osd.$id did not start (exit $?, try $try):" >&2
      tail -n 5 "$CEPH_DIR/log/daemons" "$CEPH_DIR/log/osd.$id.log" >&2
      [ "$try" = 3 ] && return 1
      sleep 2
    done
    i=$((i + 1))
  done
  for _ in $(seq 120); do
    [ "$(cephc osd stat -f json 2>/dev/null |
      python3 -c 'import json,sys; print(json.load(sys.stdin)["num_up_osds"])' 2>/dev/null)" = "$i" ] &&
      return 0
    sleep 1
  done
  echo "ceph: the OSDs did not come up" >&2
  cephc -s >&2
  return 1
}

ceph_down() {
  local p pids=()
  # The pids first: a daemon removes its pid file before it has exited.
  for p in "$CEPH_DIR"/run/*.pid; do
    [ -f "$p" ] && pids+=("$(cat "$p")")
  done
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 100); do
      kill -0 "$p" 2>/dev/null || continue 2
      sleep 0.1
    done
    kill -9 "$p" 2>/dev/null || true
    while kill -0 "$p" 2>/dev/null; do sleep 0.1; done
  done
}
