#!/bin/sh
# The pg-standby profile's standby: on its first start (an empty data directory) a base backup of the
# primary with the WAL it needs, then the server, following the primary under the name the primary's
# synchronous_standby_names gives (docs/operations.md, "PostgreSQL failover and restore").
#
#   PRIMARY_HOST, PRIMARY_PORT     the primary (postgres, 5432)
#   REPLICATION_USER               a role with REPLICATION (the image's superuser, reservations)
#   REPLICATION_PASSWORD_FILE      its password, one line (the postgres_password secret)
#   STANDBY_NAME                   the application name the primary knows this standby by
#   PGDATA                         the data directory (the image's)
#
# Run as root (the container), it makes the data directory the postgres user's and runs itself again as
# that user, as the image's own entrypoint does; the server is its arguments ("$@").
set -eu

: "${PGDATA:=/var/lib/postgresql/data}"
: "${PRIMARY_HOST:=postgres}"
: "${PRIMARY_PORT:=5432}"
: "${REPLICATION_USER:=reservations}"
: "${REPLICATION_PASSWORD_FILE:=/run/secrets/postgres_password}"
: "${STANDBY_NAME:=standby}"

if [ "$(id -u)" = 0 ]; then
    mkdir -p "$PGDATA"
    chown postgres:postgres "$PGDATA"
    chmod 700 "$PGDATA"
    exec gosu postgres sh "$0" "$@"
fi

# The password reaches libpq through a password file of the postgres user's own, written from the secret
# at every start (a changed secret is taken at the next restart), never through the environment or a
# command line. primary_conninfo names the file, not the password.
umask 077
passfile="$HOME/standby.pgpass"
printf '%s:%s:replication:%s:%s\n' "$PRIMARY_HOST" "$PRIMARY_PORT" "$REPLICATION_USER" \
    "$(cat "$REPLICATION_PASSWORD_FILE")" > "$passfile"

if [ ! -s "$PGDATA/PG_VERSION" ]; then
    until pg_isready -q -h "$PRIMARY_HOST" -p "$PRIMARY_PORT"; do
        echo "standby: waiting for the primary at $PRIMARY_HOST:$PRIMARY_PORT" >&2
        sleep 1
    done
    PGPASSFILE="$passfile" pg_basebackup -h "$PRIMARY_HOST" -p "$PRIMARY_PORT" -U "$REPLICATION_USER" \
        -D "$PGDATA" -X stream --checkpoint=fast
    touch "$PGDATA/standby.signal"
    # Once promoted this server is a primary with no standby of its own: it must not wait for one.
    cat >> "$PGDATA/postgresql.auto.conf" <<CONF
primary_conninfo = 'host=$PRIMARY_HOST port=$PRIMARY_PORT user=$REPLICATION_USER application_name=$STANDBY_NAME passfile=$passfile'
synchronous_standby_names = ''
CONF
fi

exec "$@"
