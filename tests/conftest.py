"""Shared fixtures: real Redis, real PostgreSQL and real SQLite files, isolated per test.

Each test gets its own Redis key prefix and its own PostgreSQL schema, so tests can run in parallel and
never see each other's leases. ``stack`` runs one behaviour test against every lease backend, each paired
with a database holding the protected rows.

A migrated database is migrated once per run and copied per test: a SQLite file (``migrated_sqlite``), and
for PostgreSQL the statements the migrations ran on an empty schema, recorded from one real
``schema.upgrade`` and replayed into each fresh schema in one round trip (``migrate_pg_schema``). The tests
of the migrations themselves (tests/test_alembic.py, the worker start tests) still run them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from fencing import AsyncLeaseManager, LeaseManager
from reservations import Inventory
from testing.stores import (
    REDIS_URL,
    Stack,
    drop_migrated_schemas,
    migrate_pg_schema,
    migrated_pg_schema,
    own_pg_schema,
    own_redis_prefix,
    schema_of,
    unique,
)
from testing.support import Resource

# The command line's Rich consoles keep the width COLUMNS gives when they are built (on importing
# admin.cli) for good; without it they follow the COLUMNS each in-process run gives (testing.support.run).
os.environ.pop("COLUMNS", None)


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    with own_redis_prefix() as prefix:
        yield prefix


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    with own_pg_schema() as url:
        yield url


STACKS = ["redis+postgresql", "redis+sqlite", "sqlite", "postgresql"]
LEASE_BACKENDS = ["redis", "sqlite", "postgresql"]


def _stack(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> Stack:
    """The stack ``name``, asking for the servers it names only: a stack on SQLite alone reaches none (its
    tests run in the fast tier, ``-m fast``)."""
    db_url = (
        request.getfixturevalue("pg_url")
        if name.endswith("postgresql")
        else f"sqlite:///{tmp_path / 'fencing.sqlite3'}"
    )
    if name.startswith("redis"):
        return Stack(
            name=name, lease_url=REDIS_URL, db_url=db_url, prefix=request.getfixturevalue("redis_prefix")
        )
    return Stack(name=name, lease_url=db_url, db_url=db_url, prefix=unique("t"))


@pytest.fixture(params=STACKS)
def stack(request: pytest.FixtureRequest, tmp_path: Path) -> Stack:
    """Every lease backend with every database for the protected rows (Redis with both)."""
    return _stack(request.param, request, tmp_path)


@pytest.fixture(params=LEASE_BACKENDS)
def lease_stack(request: pytest.FixtureRequest, tmp_path: Path) -> Stack:
    """Each lease backend once: Redis (protected rows on SQLite), SQLite, PostgreSQL."""
    return _stack("redis+sqlite" if request.param == "redis" else request.param, request, tmp_path)


@pytest.fixture
def manager(lease_stack: Stack) -> Iterator[LeaseManager]:
    with lease_stack.manager() as manager:
        yield manager


@pytest.fixture
async def async_manager(lease_stack: Stack) -> AsyncIterator[AsyncLeaseManager]:
    manager = await lease_stack.async_manager()
    yield manager
    await manager.close()


@pytest.fixture
def resource(stack: Stack) -> Iterator[Resource]:
    res = Resource(stack.db_url)
    yield res
    res.close()


@pytest.fixture(scope="session")
def migrated_sqlite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SQLite inventory file migrated once per run, for tests to copy (the migrations leave no -wal file
    beside it)."""
    from reservations import schema

    path = tmp_path_factory.mktemp("migrated") / "inventory.sqlite3"
    schema.upgrade(f"sqlite:///{path}")
    return path


@pytest.fixture
def migrated_pg_url() -> Iterator[str]:
    """A PostgreSQL schema holding the newest inventory schema and no rows, emptied after the test for the
    next one of this process (testing.stores.migrated_pg_schema)."""
    with migrated_pg_schema() as url:
        yield url


@pytest.fixture(scope="session", autouse=True)
def _migrated_schemas_dropped() -> Iterator[None]:
    """The schemas a process kept for its next test are dropped when its run ends."""
    yield
    drop_migrated_schemas()


@pytest.fixture(params=["sqlite", "postgresql"])
def inventory_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated inventory database: a copy of the migrated SQLite file, or a fresh PostgreSQL schema (the
    ``pg_url`` of the test) migrated by replay (:func:`migrate_pg_schema`)."""
    if request.param == "postgresql":
        if "pg_url" in request.fixturenames:  # the test reaches the same schema through pg_url too
            url: str = request.getfixturevalue("pg_url")
            migrate_pg_schema(schema_of(url))
            return url
        return str(request.getfixturevalue("migrated_pg_url"))
    path = tmp_path / "inventory.sqlite3"
    shutil.copyfile(request.getfixturevalue("migrated_sqlite"), path)
    return f"sqlite:///{path}"


@pytest.fixture
def inventory(inventory_url: str) -> Iterator[Inventory]:
    with Inventory.from_url(inventory_url) as inv:
        yield inv


@pytest.fixture
def leases(inventory_url: str) -> Iterator[LeaseManager]:
    """The SQL lease backend on the inventory's own database (its tables come from the migrations)."""
    with LeaseManager.from_url(inventory_url) as manager:
        yield manager


# Seconds each module took (setup, calls and teardown) in one run of the whole suite with --durations=0 on
# 2 CPUs, in four processes; modules under 5 s are left out. It only orders the modules: a stale or missing
# figure costs balance (a long module taken last runs alone at the end), never a result.
MODULE_SECONDS = {
    "test_chaos.py": 157,
    "test_service.py": 97,
    "test_inventory_concurrency.py": 62,
    "test_demo.py": 52,
    "test_inventory.py": 52,
    "test_flower.py": 45,
    "test_console.py": 42,
    "test_batching_e2e.py": 50,
    "test_observability.py": 47,
    "test_worker_start.py": 43,
    "test_lease_failover.py": 40,
    "test_relay.py": 40,
    "test_etcd_leases.py": 36,
    "test_inventory_properties.py": 30,
    "test_compose.py": 29,
    "test_tasks_e2e.py": 28,
    "test_message_formats.py": 27,
    "test_leases.py": 27,
    "test_alembic.py": 24,
    "test_broker_failover.py": 23,
    "test_concurrency.py": 22,
    "test_request_truth.py": 21,
    "test_tracing_e2e.py": 22,
    "test_cli_bulk.py": 21,
    "test_alerts.py": 20,
    "test_pgbouncer.py": 20,
    "test_bad_input.py": 19,
    "test_settings_at_start.py": 19,
    "test_properties.py": 19,
    "test_archive.py": 18,
    "test_dead_letters.py": 18,
    "test_batch_in_hand.py": 17,
    "test_counting.py": 16,
    "test_pg_failover.py": 16,
    "test_batching.py": 16,
    "test_deadlines.py": 14,
    "test_request_identity.py": 14,
    "test_cli_input.py": 13,
    "test_cli.py": 12,
    "test_outcome_watch.py": 11,
    "test_one_statement_races.py": 10,
    "test_shell_parity.py": 10,
    "test_cli_audit.py": 9,
    "test_partitions.py": 9,
    "test_redis_faults.py": 8,
    "test_consumer_survives.py": 8,
    "test_counting_e2e.py": 7,
    "test_tasks_async.py": 7,
    "test_tracing.py": 7,
    "test_fence.py": 6,
    "test_one_statement_steps.py": 6,
}


# -- the fast tier ---------------------------------------------------------------------------------------
#
# ``pytest -m fast`` (``make test-fast``) runs every test that reaches no server: SQLite files, the SQL lease
# backend on them, pure decision code, plans stepped with scripted answers. A test is marked ``services``
# when anything it runs could reach Redis, PostgreSQL or RabbitMQ, or start a server of its own (a private
# redis-server, PgBouncer, Prometheus): a parameter naming one, a fixture that provides one, or a name that
# reaches one in its code, its module's fixtures or the helpers of tests/ they call. Every other test that
# is not ``slow`` is marked ``fast``. The Makefile runs the tier with the service URLs pointing at a closed
# port and a short timeout, so a test this reading misjudges fails at once rather than hanging; .ci/run
# runs it in a network namespace of its own, where no server answers at all.

# Parameter values that name a server (the backends, brokers and stacks the tests are parametrized over).
SERVICE_PARAMS = frozenset(
    {"redis", "postgresql", "rabbitmq", "redis+sqlite", "redis+postgresql", "sentinel"}
)

# The fixtures, helpers and constants through which a test reaches a server or starts one.
SERVICE_NAMES = frozenset(
    {
        # tests/conftest.py, testing/stores.py
        "pg_url",
        "redis_prefix",
        "own_pg_schema",
        "own_redis_prefix",
        "migrate_pg_schema",
        "schema_url",
        "REDIS_URL",
        "POSTGRES_URL",
        # testing/workers.py, testing/pgbouncer.py
        "RABBITMQ_URL",
        "rabbitmq_vhost",
        "pg_schema",
        "cluster",
        # testing.redis_servers, testing.redis_topologies: servers of a test's own
        "RedisServer",
        "RedisNode",
        "redis_server",
        "SentinelTopology",
        "ClusterTopology",
        # testing.pg_cluster: a PostgreSQL primary and standby of a test's own
        "pg_cluster",
        "PgCluster",
        "bouncer",
        "pgbouncer",
        "prometheus",
        "promtool",
    }
)


def _reached(code: Any, seen: set[int], found: set[str], module_globals: Mapping[str, Any]) -> None:
    """The service names ``code`` refers to (names, and strings such as a fixture's name given to
    ``getfixturevalue``), following the functions and classes of tests/ it calls."""
    if id(code) in seen:
        return
    seen.add(id(code))
    for name in (*code.co_names, *(c for c in code.co_consts if isinstance(c, str))):
        if name in SERVICE_NAMES:
            found.add(name)
        _follow(module_globals.get(name), seen, found)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            _reached(const, seen, found, module_globals)


def _follow(obj: Any, seen: set[int], found: set[str]) -> None:
    """Follow a function or class defined in tests/ (never the project's own code: the tier's closed ports
    and timeout catch a default that reaches a server there)."""
    if not getattr(obj, "__module__", "").startswith("tests."):
        return
    if isinstance(obj, type):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        for member in vars(obj).values():
            _follow(getattr(member, "__func__", getattr(member, "fget", member)), seen, found)
        return
    code = getattr(obj, "__code__", None)
    if code is not None:
        _reached(code, seen, found, getattr(obj, "__globals__", {}))


# Parameter values that name a backend needing no server: a test or fixture given one takes its branch.
LOCAL_PARAMS = frozenset({"sqlite", "sql"})


def services_of(item: pytest.Item) -> set[str]:
    """Why ``item`` may reach a server: the parameters, fixtures and names that could (empty: none).

    A test run with a backend parameter of :data:`LOCAL_PARAMS` (its own or a fixture's, such as
    ``stack``) is read by its parameters, not its code: a test parametrized over backends names each
    backend's helpers in its code and takes the branch of the one it is given. So is a fixture of a test
    module given such a parameter. This file's fixtures ask for a server by their parameter only."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    found = {v for v in params.values() if isinstance(v, str) and v in SERVICE_PARAMS}
    names = set(getattr(item, "fixturenames", ()))
    found |= names & SERVICE_NAMES
    seen: set[int] = set()
    if not any(isinstance(v, str) and v in LOCAL_PARAMS for v in params.values()):
        _follow(getattr(item, "obj", None), seen, found)
    fixtureinfo = getattr(item, "_fixtureinfo", None)
    for name in names - {n for n, v in params.items() if isinstance(v, str) and v in LOCAL_PARAMS}:
        for fixturedef in fixtureinfo.name2fixturedefs.get(name, ()) if fixtureinfo else ():
            if fixturedef.func.__module__ != __name__:
                _follow(fixturedef.func, seen, found)
    return found


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test ``services`` or ``fast`` (above): a test marked ``services`` by hand stays out of the
    fast tier whatever its reading says.

    Spread over several processes (pytest-xdist, ``--dist loadfile --no-loadscope-reorder``), the
    longest modules go first (:data:`MODULE_SECONDS`; then those that run real processes), so that the
    last module a process takes is a short one and no process is left running a long module alone at
    the end. A run in one process keeps its order."""
    for item in items:
        if services_of(item) or item.get_closest_marker("services") is not None:
            item.add_marker(pytest.mark.services)
        elif item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.fast)
    if not hasattr(config, "workerinput"):  # set in each process of pytest-xdist, which collect and run
        return
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    # Stable: each module keeps the order of its own tests.
    items.sort(key=lambda item: (-MODULE_SECONDS.get(item.path.name, 0), item.path not in slow))
