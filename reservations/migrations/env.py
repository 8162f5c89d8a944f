"""Alembic environment: runs the inventory migrations on the connection or URL it is given, and compares
the database with the models (inventory tables and SQL lease tables) for ``alembic check`` and autogenerate.
"""

from __future__ import annotations

import os
import re
from collections.abc import Collection, Mapping, MutableMapping
from logging.config import fileConfig
from typing import Any, Literal

import sqlalchemy as sa
from alembic import context
from alembic.runtime.migration import MigrationContext, MigrationInfo
from sqlmodel import SQLModel
from sqlmodel.sql.sqltypes import AutoString

import reservations.models  # noqa: F401  (registers the inventory tables on SQLModel.metadata)
from fencing.engines import make_engine
from fencing.sql_backend import metadata as lease_metadata
from reservations.models import schema_compatibility
from reservations.schema import ONE_SHOT

config = context.config
if config.config_file_name is not None:  # the alembic CLI, with alembic.ini: its logging setup
    fileConfig(config.config_file_name, disable_existing_loggers=False)
URL_VARIABLE = "RESERVATIONS_DATABASE_URL"
# Everything the migrations create: the inventory's SQLModel tables and the SQL lease backend's tables.
target_metadata = [SQLModel.metadata, lease_metadata]


def same_type_here(
    ctx: MigrationContext,
    inspected_column: sa.Column[Any],
    metadata_column: sa.Column[Any],
    inspected_type: sa.types.TypeEngine[Any],
    metadata_type: sa.types.TypeEngine[Any],
) -> bool | None:
    """False for two types the database stores and checks alike, None to let Alembic compare.

    The models say ``str`` (an unbounded VARCHAR) where the migrations created TEXT, and SQLite keeps
    INTEGER and BIGINT as the same 64-bit integer: reporting those would teach people to ignore the check.
    """
    if isinstance(metadata_type, sa.TypeDecorator):  # SQLModel's AutoString for a plain ``str``
        metadata_type = metadata_type.load_dialect_impl(ctx.dialect)
    unbounded = (sa.Text, sa.String)
    if (
        isinstance(inspected_type, unbounded)
        and isinstance(metadata_type, unbounded)
        and inspected_type.length is None
        and metadata_type.length is None
    ):
        return False
    if ctx.dialect.name == "sqlite" and isinstance(inspected_type, sa.Integer):  # BigInteger included
        return not isinstance(metadata_type, sa.Integer)
    return None


def render_item(type_: str, obj: Any, autogen_context: object) -> str | Literal[False]:
    """Autogenerate writes SQLModel's AutoString as plain SQLAlchemy, as the migrations spell it."""
    if type_ == "type" and isinstance(obj, AutoString):
        return "sa.Text()" if obj.length is None else f"sa.String({obj.length})"
    return False


# The day and DEFAULT partitions of the partitioned history tables (revision 0010), and a partition
# detached by `reservations archive` and not yet dropped: made by code at run time, not by the models.
PARTITION_NAME = re.compile(r"^(sku_history|task_attempts)_(p[0-9]{8}|default)$")


def not_a_partition(name: str | None, type_: str, parent_names: MutableMapping[Any, str | None]) -> bool:
    return not (type_ == "table" and name is not None and PARTITION_NAME.match(name))


def migrate(connection: sa.Connection) -> None:
    # Batch mode: SQLite alters a table by copying it.
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=same_type_here,
        compare_server_default=True,
        render_item=render_item,
        on_version_apply=record_compatibility,
        include_name=not_a_partition,
    )
    with context.begin_transaction():
        context.run_migrations()


def record_compatibility(
    ctx: MigrationContext, step: MigrationInfo, heads: Collection[Any], run_args: Mapping[str, Any]
) -> None:
    """After each migration, in its transaction: which code may run on the schema as it now stands, the
    revision it is at and the oldest code revision its migration declares compatible
    (``oldest_compatible_code``; by default only its own). Older workers, which do not know this revision,
    read it before they start (reservations.schema)."""
    connection = ctx.connection
    if connection is None or len(heads) != 1:
        return
    if not sa.inspect(connection).has_table(schema_compatibility.name):
        return  # migrated down to before the table
    (revision,) = heads
    assert isinstance(revision, str)
    module = context.script.get_revision(revision).module
    oldest = getattr(module, "oldest_compatible_code", revision)
    connection.execute(schema_compatibility.delete())
    connection.execute(schema_compatibility.insert().values(revision=revision, oldest_code=oldest))


def run() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        migrate(connection)
        return
    # ``-x url=...`` on the command line, else the URL the code set (reservations.schema), else the
    # settings' variable: the alembic CLI and the workers then point at the same database.
    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    url = url or os.environ.get(URL_VARIABLE, "")
    if not url:
        raise SystemExit(f"no database: set {URL_VARIABLE} or pass -x url=...")
    engine = make_engine(url, pooling=ONE_SHOT)
    try:
        with engine.connect() as conn:
            migrate(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (SQL script) migrations are not supported; run against a database")
run()
