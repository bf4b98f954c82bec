#!/usr/bin/env bash
# A throwaway local PostgreSQL server (Debian's package) for the PostgreSQL tier of the test suite.
#
#   scripts/postgres.sh install        apt-get install postgresql when its binaries are missing (root)
#   scripts/postgres.sh start          initdb + start on 127.0.0.1:$PALIMPSEST_PG_PORT; prints the URL
#   scripts/postgres.sh stop           stop it and remove its data directory
#   scripts/postgres.sh run -- CMD...  run CMD with PALIMPSEST_TEST_POSTGRES set: an already exported
#                                      URL is used as it is, otherwise a server is started for CMD and
#                                      stopped afterwards (CMD runs without one where none can start)
set -euo pipefail
DIR=${PALIMPSEST_PG_DIR:-/tmp/palimpsest-pg}
PORT=${PALIMPSEST_PG_PORT:-54329}
DB=palimpsest_test
URL="postgresql://palimpsest@127.0.0.1:${PORT}/${DB}"

bindir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
    [ -n "$d" ] && [ -x "$d/initdb" ] && echo "$d"
}

# PostgreSQL refuses to run as root: run its tools as the package's `postgres` user then.
as_owner() {
    if [ "$(id -u)" = 0 ]; then (cd / && runuser -u postgres -- "$@"); else "$@"; fi
}

install() {
    [ -n "$(bindir)" ] && return 0
    if [ "$(id -u)" != 0 ]; then
        echo "postgres.sh: PostgreSQL is not installed; run 'apt-get install postgresql' as root" >&2
        return 1
    fi
    echo "installing PostgreSQL (Debian's package)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
}

start() {
    local bin
    bin=$(bindir) || { echo "postgres.sh: no PostgreSQL binaries (scripts/postgres.sh install)" >&2; return 1; }
    stop >/dev/null 2>&1 || true
    mkdir -p "$DIR"
    [ "$(id -u)" = 0 ] && chown postgres: "$DIR"
    as_owner "$bin/initdb" -D "$DIR/data" -U palimpsest -A trust -E UTF8 --no-instructions >"$DIR/initdb.log" 2>&1 \
        || { cat "$DIR/initdb.log" >&2; return 1; }
    as_owner "$bin/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t 60 \
        -o "-p $PORT -k $DIR -c listen_addresses=127.0.0.1 -c max_connections=200" start >/dev/null \
        || { cat "$DIR/server.log" >&2; return 1; }
    as_owner "$bin/createdb" -h 127.0.0.1 -p "$PORT" -U palimpsest "$DB"
    echo "$URL"
}

stop() {
    local bin
    bin=$(bindir) || return 0
    if [ -f "$DIR/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null
    fi
    rm -rf "$DIR"
}

case "${1:-}" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    run)
        shift
        [ "${1:-}" = "--" ] && shift
        if [ -n "${PALIMPSEST_TEST_POSTGRES:-}" ]; then
            exec "$@"
        fi
        if url=$(start 2>"${TMPDIR:-/tmp}/palimpsest-pg-start.log"); then
            trap stop EXIT
            export PALIMPSEST_TEST_POSTGRES="$url"
            echo "PostgreSQL tier: $url (stopped afterwards)"
        else
            echo "PostgreSQL tier skipped: no local server could start ($(tail -n 1 "${TMPDIR:-/tmp}/palimpsest-pg-start.log"))"
        fi
        set +e
        "$@"
        rc=$?
        exit "$rc"
        ;;
    *) echo "usage: $0 install|start|stop|run -- CMD..." >&2; exit 2 ;;
esac
