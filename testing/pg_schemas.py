"""Migrated inventory databases in PostgreSQL schemas of their own, dropped after the run."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import sqlalchemy as sa

from fencing.engines import make_engine
from reservations import schema


@contextmanager
def pg_schema(
    admin_url: str, *, prefix: str = "run", after_upgrade: Callable[[str], None] | None = None
) -> Iterator[str]:
    """A migrated inventory database in a fresh PostgreSQL schema (URL with its search_path), dropped on
    exit. ``after_upgrade(schema_name)`` may change it before it is handed out."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    engine = make_engine(admin_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
        url = f"{admin_url}?options=-csearch_path%3D{name}"
        schema.upgrade(url)
        if after_upgrade is not None:
            after_upgrade(name)
        yield url
    finally:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        engine.dispose()
