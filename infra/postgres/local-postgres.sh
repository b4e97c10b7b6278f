#!/usr/bin/env bash
# A throwaway PostgreSQL server for CI and tests, from the distribution's packages (Debian:
# apt-get install postgresql). It listens on 127.0.0.1 only, on a free port, with its data, socket
# and log in DIR, and a role and database `kiln` whose password is random and never written to disk.
#
#   eval "$(infra/postgres/local-postgres.sh start DIR)"   # exports DAGSTER_PG_HOST/PORT/USER/PASSWORD/DB
#   infra/postgres/local-postgres.sh stop DIR               # stops it and removes DIR
#
# PREFIX=KILN_TEST_PG exports KILN_TEST_PG_HOST/... instead (CI does, so that only the Postgres test
# uses the server and every other test keeps its own sqlite instance).
# PostgreSQL refuses to run as root: as root, the server runs as the `postgres` user.
set -euo pipefail
cmd=${1:?usage: $0 start|stop DIR}
dir=${2:?usage: $0 start|stop DIR}
prefix=${PREFIX:-DAGSTER_PG}

# The newest of Debian's installed server versions.
bindir=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -name bin -type d 2>/dev/null | sort -V | tail -n 1)
if [ -z "$bindir" ] || [ ! -x "$bindir/initdb" ]; then
  initdb_path=$(command -v initdb || true)
  [ -n "$initdb_path" ] || { echo "PostgreSQL server binaries (initdb) not found" >&2; exit 3; }
  bindir=$(dirname "$initdb_path")
fi

as_server_user() {
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "$cmd" in
  start)
    mkdir -p "$dir"
    [ "$(id -u)" = 0 ] && chown postgres:postgres "$dir"
    chmod 700 "$dir"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    as_server_user "$bindir/initdb" -D "$dir/data" -U postgres -E UTF8 --no-locale \
      --auth-local=trust --auth-host=scram-sha-256 >"$dir/initdb.log" 2>&1 \
      || { cat "$dir/initdb.log" >&2; exit 1; }
    as_server_user "$bindir/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
      -o "-c listen_addresses=127.0.0.1 -p $port -c unix_socket_directories=$dir" start >/dev/null \
      || { cat "$dir/server.log" >&2; exit 1; }
    password=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
    # The password reaches psql through its environment (\getenv), never a command line or a file.
    KILN_PG_PASSWORD="$password" as_server_user "$bindir/psql" -q -v ON_ERROR_STOP=1 -h "$dir" -p "$port" \
      -U postgres -d postgres >/dev/null <<'SQL'
\getenv pw KILN_PG_PASSWORD
CREATE ROLE kiln LOGIN CREATEDB PASSWORD :'pw';
CREATE DATABASE kiln OWNER kiln;
SQL
    echo "export ${prefix}_HOST=127.0.0.1 ${prefix}_PORT=$port ${prefix}_USER=kiln ${prefix}_DB=kiln" \
         "${prefix}_PASSWORD=$password"
    ;;
  stop)
    if [ -f "$dir/data/postmaster.pid" ]; then
      as_server_user "$bindir/pg_ctl" -D "$dir/data" -m fast -w stop >/dev/null
    fi
    rm -rf "$dir"
    ;;
  *)
    echo "usage: $0 start|stop DIR" >&2
    exit 2
    ;;
esac
