"""Shared fixtures: real Redis, real PostgreSQL and real SQLite files, isolated per test.

Each test gets its own Redis key prefix and its own PostgreSQL schema, so tests can run in parallel and
never see each other's leases. ``stack`` runs one behaviour test against every lease backend, each paired
with a database holding the protected rows.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from fencing import AsyncLeaseManager, LeaseManager
from fencing.sql import make_engine
from reservations import Inventory
from tests.support import Resource

REDIS_URL = os.environ.get("TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
POSTGRES_URL = os.environ.get("TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

# The command line's Rich consoles keep the width COLUMNS gives when they are built (on importing
# admin.cli) for good; without it they follow the COLUMNS each in-process run gives (tests.support.run).
os.environ.pop("COLUMNS", None)


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


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    with own_redis_prefix() as prefix:
        yield prefix


@contextmanager
def own_pg_schema() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped on exit."""
    schema = unique("t_")
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{schema}"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A PostgreSQL URL whose search_path is a fresh schema, dropped afterwards."""
    with own_pg_schema() as url:
        yield url


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


STACKS = ["redis+postgresql", "redis+sqlite", "sqlite", "postgresql"]
LEASE_BACKENDS = ["redis", "sqlite", "postgresql"]


def _stack(name: str, request: pytest.FixtureRequest, prefix: str, tmp_path: Path) -> Stack:
    db_url = (
        request.getfixturevalue("pg_url")
        if name.endswith("postgresql")
        else f"sqlite:///{tmp_path / 'fencing.sqlite3'}"
    )
    lease_url = REDIS_URL if name.startswith("redis") else db_url
    return Stack(name=name, lease_url=lease_url, db_url=db_url, prefix=prefix)


@pytest.fixture(params=STACKS)
def stack(request: pytest.FixtureRequest, redis_prefix: str, tmp_path: Path) -> Stack:
    """Every lease backend with every database for the protected rows (Redis with both)."""
    return _stack(request.param, request, redis_prefix, tmp_path)


@pytest.fixture(params=LEASE_BACKENDS)
def lease_stack(request: pytest.FixtureRequest, redis_prefix: str, tmp_path: Path) -> Stack:
    """Each lease backend once: Redis (protected rows on SQLite), SQLite, PostgreSQL."""
    name = "redis+sqlite" if request.param == "redis" else request.param
    return _stack(name, request, redis_prefix, tmp_path)


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


@pytest.fixture(params=["sqlite", "postgresql"])
def inventory_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated inventory database: a copy of the migrated SQLite file, or a fresh PostgreSQL schema."""
    from reservations import schema

    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        schema.upgrade(url)
        return url
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
