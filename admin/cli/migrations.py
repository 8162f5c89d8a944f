"""The ``db`` commands: the database schema through the Alembic migrations shipped with the package,
``upgrade`` (which writes) and ``current``.
"""

from __future__ import annotations

from typing import Annotated

import typer

from admin.cli.context import config
from admin.cli.failures import errors
from admin.cli.render import out
from fencing import mask_url


def upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """WRITES: migrate the database schema to REVISION (default: the newest).

    Example: RESERVATIONS_DATABASE_URL=postgresql://app@db/inv reservations db upgrade
    """
    from reservations import schema

    with errors():
        schema.upgrade(config.database_url, revision)
        out.print(f"{mask_url(config.database_url)} is at revision {schema.current(config.database_url)}")


def current() -> None:
    """Show the database's schema revision and the newest one this package ships.

    Example: reservations db current
    """
    from reservations import schema

    with errors():
        out.print(f"database: {mask_url(config.database_url)}")
        out.print(f"current:  {schema.current(config.database_url) or 'none (empty database)'}")
        out.print(f"head:     {schema.head()}")
