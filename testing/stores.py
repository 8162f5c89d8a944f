"""The stores the tests run on: the test Redis and PostgreSQL (TEST_REDIS_URL, TEST_POSTGRES_URL), a
fresh Redis key prefix or PostgreSQL schema per test, and a migrated schema copied from one real
migration per run; a lease backend paired with the database that holds the protected rows (Stack).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime
from typing import Any

import redis
import sqlalchemy as sa

from fencing import AsyncLeaseManager, LeaseManager
from fencing.engines import make_engine

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def unique(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:12]}"


@contextmanager
def own_redis_prefix() -> Iterator[str]:
    """A fresh Redis key prefix, its keys deleted on exit."""
    prefix = unique("t")
    try:
        yield prefix
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


def schema_url(schema: str) -> str:
    """The test PostgreSQL's URL with ``schema`` as its search_path."""
    return f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"


def schema_of(url: str) -> str:
    """The schema a URL of :func:`schema_url` names."""
    options = sa.engine.make_url(url).query.get("options", "")
    assert isinstance(options, str) and options.startswith("-csearch_path="), url
    return options.removeprefix("-csearch_path=")


@functools.cache
def _admin() -> sa.Engine:
    """One engine for the run's schema management, rather than a connection made and closed per test. It
    pings before each use: a connection the server dropped meanwhile is replaced, not failed on."""
    return make_engine(POSTGRES_URL, pool_pre_ping=True)


@contextmanager
def own_pg_schema(*, migrated: bool = False, prefix: str = "t_") -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped on exit; ``migrated``: holding the
    newest inventory schema (:func:`migrate_pg_schema`)."""
    schema = unique(prefix)
    with _admin().begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        if migrated:
            migrate_pg_schema(schema)
        yield schema_url(schema)
    finally:
        with _admin().begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


@functools.cache
def _migration_script(day: date) -> str:
    """Every statement ``schema.upgrade`` sent to an empty schema of the test PostgreSQL, in order, with its
    parameters bound as the driver bound them: one script that, run in another empty schema, makes it what
    the migrations make it (tables, indexes, sequences, functions and triggers, the alembic_version and
    schema_compatibility rows). Recorded once per run, from a real migration, so it follows every new
    migration by itself; tests/test_migrated_copies.py compares a replayed schema with a migrated one.

    The statements carry no schema name: the migrations create everything in the connection's search_path,
    and the catalog queries they make find the schema through it too. They do carry the day they ran on
    (revision 0010 makes the partitions from that day on), so the script is recorded again for a run that
    goes past midnight UTC: ``day`` is today's."""
    import psycopg

    from reservations import schema

    name = unique("migrated_")
    recorded: list[tuple[str, Any, bool]] = []

    def record(
        conn: sa.Connection, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        if conn.engine.url.query.get("options") == f"-csearch_path={name}":  # the migration's engine only
            recorded.append((statement, parameters, executemany))

    with _admin().begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
    sa.event.listen(sa.Engine, "before_cursor_execute", record)
    try:
        schema.upgrade(schema_url(name))
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", record)
        with _admin().begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{name}" CASCADE'))

    raw = _admin().raw_connection()
    try:
        driver = raw.driver_connection
        assert isinstance(driver, psycopg.Connection)  # the test PostgreSQL's URL names psycopg
        cursor = psycopg.ClientCursor(driver)
        statements = [
            cursor.mogrify(statement, _driver_params(params))
            for statement, parameters, executemany in recorded
            for params in (parameters if executemany else [parameters])
        ]
    finally:
        raw.close()
    return ";\n".join(statements)


def _driver_params(params: Any) -> Any:
    """The parameters as psycopg takes them: an empty mapping still formats the statement (its ``%%``)."""
    if isinstance(params, Mapping):
        return dict(params)
    if isinstance(params, Sequence) and not isinstance(params, str):
        return list(params)
    return params


def migrate_pg_schema(schema: str) -> None:
    """Bring an empty schema of the test PostgreSQL to the newest revision, as ``schema.upgrade`` does, by
    replaying what it did once this run (:func:`_migration_script`): a tenth of its time, in one
    transaction."""
    script = _migration_script(datetime.now(UTC).date())
    with _admin().begin() as conn:
        conn.execute(sa.text(f'SET LOCAL search_path TO "{schema}"'))
        # No parameters: the script's own '%' (in the functions' messages) reaches the server as written.
        conn.execution_options(no_parameters=True).exec_driver_sql(script)


# What a migrated schema is, read from the catalog with the schema as the search_path (so that no name in
# it is qualified): every relation with its kind, partition bound, options and grants, its columns with
# their types and defaults, its constraints, indexes and triggers (enabled or not), the functions, and the
# rows the migrations leave in the two version tables. Two schemas alike here hold the same structure.
_STRUCTURE = """
SELECT md5(string_agg(item, E'\n' ORDER BY item)) FROM (
  SELECT concat_ws(' ', c.relname, c.relkind, c.relispartition, pg_get_expr(c.relpartbound, c.oid),
                   c.reloptions::text, c.relacl::text) AS item
    FROM pg_class c WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT concat_ws(' ', c.relname, a.attnum, a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull,
                   pg_get_expr(d.adbin, d.adrelid))
    FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE c.relnamespace = current_schema()::regnamespace AND a.attnum > 0 AND NOT a.attisdropped
  UNION ALL
  SELECT concat_ws(' ', conname, pg_get_constraintdef(oid)) FROM pg_constraint
    WHERE connamespace = current_schema()::regnamespace
  UNION ALL
  SELECT pg_get_indexdef(i.indexrelid) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
    WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT concat_ws(' ', t.tgname, t.tgenabled, pg_get_triggerdef(t.oid)) FROM pg_trigger t
    JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = current_schema()::regnamespace
  UNION ALL
  SELECT concat_ws(' ', proname, md5(prosrc), proconfig::text) FROM pg_proc
    WHERE pronamespace = current_schema()::regnamespace
  UNION ALL
  SELECT 'alembic_version ' || version_num FROM alembic_version
  UNION ALL
  SELECT 'schema_compatibility ' || row_to_json(s)::text FROM schema_compatibility s
) items
"""
# Kept as the migrations leave them: the versions the structure above includes.
_VERSION_TABLES = ("alembic_version", "schema_compatibility")


@dataclass
class _Migrated:
    """This process's migrated schemas that tests gave back empty, for the next test to take, and what a
    freshly migrated one is (``structure``), on ``day`` (the migrations make partitions from that day)."""

    day: date | None = None
    structure: str | None = None
    free: list[str] = dataclasses.field(default_factory=list)


_migrated = _Migrated()


def _structure(conn: sa.Connection, schema: str) -> str:
    conn.execute(sa.text(f'SET LOCAL search_path TO "{schema}"'))
    return str(conn.execute(sa.text(_STRUCTURE)).scalar_one())


@contextmanager
def migrated_pg_schema() -> Iterator[str]:
    """A URL of a schema holding the newest inventory schema and no rows, as :func:`own_pg_schema` with
    ``migrated`` gives, without migrating one per test: a schema given back with its structure unchanged
    is emptied (every table truncated, every sequence restarted) for the next test of this process, and
    one a test changed (a table dropped, a partition detached, a version row rewritten) is dropped. Replaying
    the migrations costs about 0.6 s a schema, mostly the server's; emptying one a tenth of that."""
    today = datetime.now(UTC).date()
    if _migrated.day != today:  # a run past midnight: the schemas of yesterday hold yesterday's partitions
        drop_migrated_schemas()
        _migrated.day, _migrated.structure = today, None
    if _migrated.free:
        schema = _migrated.free.pop()
    else:
        schema = unique("t_")
        with _admin().begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
        migrate_pg_schema(schema)
        if _migrated.structure is None:
            with _admin().begin() as conn:
                _migrated.structure = _structure(conn, schema)
    try:
        yield schema_url(schema)
    finally:
        if _emptied(schema):
            _migrated.free.append(schema)
        else:
            with _admin().begin() as conn:
                conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


def _emptied(schema: str) -> bool:
    """Empty ``schema`` for the next test if its structure is the migrations'; False (nothing done) when it
    is not, or when a lock held elsewhere (a connection a test left open) keeps it from being emptied."""
    try:
        with _admin().begin() as conn:
            conn.execute(sa.text("SET LOCAL lock_timeout = '2s'"))
            if _structure(conn, schema) != _migrated.structure:
                return False
            tables = conn.execute(
                sa.text(
                    "SELECT quote_ident(c.relname) FROM pg_class c"
                    " WHERE c.relnamespace = CAST(:ns AS regnamespace) AND c.relkind IN ('r', 'p')"
                    " AND NOT c.relispartition AND c.relname <> ALL(:kept)"
                ),
                {"ns": schema, "kept": list(_VERSION_TABLES)},
            ).scalars()
            conn.execute(sa.text(f"TRUNCATE {', '.join(tables)} RESTART IDENTITY CASCADE"))
            sequences = conn.execute(
                sa.text("SELECT quote_ident(sequencename) FROM pg_sequences WHERE schemaname = :ns"),
                {"ns": schema},
            ).scalars()
            for sequence in sequences:
                conn.execute(sa.text(f"ALTER SEQUENCE {sequence} RESTART"))
        return True
    except sa.exc.DBAPIError:
        return False


def drop_migrated_schemas() -> None:
    """Drop the schemas this process keeps for the next test (at the end of a run)."""
    while _migrated.free:
        schema = _migrated.free.pop()
        with _admin().begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))


@dataclass
class Stack:
    """A lease backend and the database that holds the protected rows."""

    name: str
    lease_url: str
    db_url: str
    prefix: str

    def manager(self, **kwargs: Any) -> LeaseManager:
        manager = LeaseManager.from_url(self.lease_url, prefix=self.prefix, **kwargs)
        manager.create_schema()
        return manager

    async def async_manager(self, **kwargs: Any) -> AsyncLeaseManager:
        manager = AsyncLeaseManager.from_url(self.lease_url, prefix=self.prefix, **kwargs)
        await manager.create_schema()
        return manager
