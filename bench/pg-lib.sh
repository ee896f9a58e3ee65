# PostgreSQL on a block device, for bench/postgres.sh and bench/ceph.sh (sourced).
# The stack is the same in both: losetup on a file (an nbdfuse export) -> ext4
# (mkfs -E nodiscard, mounted without discard) -> PostgreSQL (fsync on,
# synchronous_commit on, max_wal_size 256MB, shared_buffers 128MB) -> pgbench -i -s
# SCALE, a CHECKPOINT, then pgbench with CLIENTS clients for RUNTIME seconds.
#
#   pg_check_tools           # stops the script if PostgreSQL or a tool is missing
#   pg_on_file FILE WORKDIR  # runs it all on FILE; sets pg_tps and pg_lat (ms)
#
# Needs root (losetup, mount). $postmaster, $pg_mnt and $pg_dev name what is up, so
# that the caller's cleanup can take it down (pg_teardown) when the script stops.

pgbin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1)
postmaster=""
pg_mnt=""
pg_dev=""

pg_check_tools() {
  [ -x "$pgbin/initdb" ] || { echo "bench: PostgreSQL is missing (apt-get install postgresql)" >&2; exit 1; }
  local t
  for t in losetup mkfs.ext4 setpriv; do
    command -v $t >/dev/null || { echo "bench: $t is missing" >&2; exit 1; }
  done
}

# Stops PostgreSQL and takes the file system and loop device down.
pg_teardown() {
  if [ -n "$postmaster" ]; then
    kill -INT "$postmaster" 2>/dev/null || true
    wait "$postmaster" 2>/dev/null || true
    postmaster=""
  fi
  if [ -n "$pg_mnt" ]; then umount "$pg_mnt" 2>/dev/null || umount -l "$pg_mnt" 2>/dev/null || true; fi
  pg_mnt=""
  if [ -n "$pg_dev" ]; then losetup -d "$pg_dev" 2>/dev/null || true; fi
  pg_dev=""
}

pg_on_file() { # FILE WORKDIR
  local data sock psql=("$pgbin/psql" -X -q -h "$2/pg-run" -p 5432 -U postgres)
  pg_dev=$(losetup -f --show "$1")
  mkfs.ext4 -q -F -E nodiscard "$pg_dev"
  pg_mnt="$2/pg-mnt"
  mkdir -p "$pg_mnt"
  mount "$pg_dev" "$pg_mnt"
  data="$pg_mnt/pgdata"
  sock="$2/pg-run"
  mkdir -p "$data" "$sock"
  chown postgres:postgres "$data"
  chmod 1777 "$sock"
  chmod 755 "$2"
  setpriv --reuid=postgres --regid=postgres --init-groups -- "$pgbin/initdb" -D "$data" -A trust -U postgres >/dev/null
  setpriv --reuid=postgres --regid=postgres --init-groups -- "$pgbin/postgres" -D "$data" \
    -c listen_addresses= -c unix_socket_directories="$sock" -c port=5432 \
    -c shared_buffers=128MB -c max_wal_size=256MB -c fsync=on -c synchronous_commit=on \
    >"$2/pg.log" 2>&1 &
  postmaster=$!
  for _ in $(seq 600); do "$pgbin/pg_isready" -q -h "$sock" -p 5432 && break; sleep 0.1; done
  "$pgbin/pgbench" -h "$sock" -p 5432 -U postgres -i -q -s "$SCALE" postgres >/dev/null 2>&1
  "${psql[@]}" -c CHECKPOINT postgres
  "$pgbin/pgbench" -h "$sock" -p 5432 -U postgres -n -c "$CLIENTS" -j "$CLIENTS" -T "$RUNTIME" postgres >"$2/pgbench.out" 2>&1
  pg_tps=$(sed -n 's/^tps = \([0-9.]*\) (without.*/\1/p' "$2/pgbench.out")
  pg_lat=$(sed -n 's/^latency average = \([0-9.]*\) ms/\1/p' "$2/pgbench.out")
  [ -n "$pg_tps" ] || { echo "bench: pgbench gave no TPS:" >&2; cat "$2/pgbench.out" >&2; exit 1; }
  pg_teardown
}
