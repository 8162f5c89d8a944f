"""The ``db`` commands: the database schema through the Alembic migrations shipped with the package,
``upgrade`` (which writes) and ``current`` (exit 1 when workers of this version may not run on it).
"""

from __future__ import annotations

from typing import Annotated

import typer

from admin.cli.context import config
from admin.cli.failures import EXIT_FAILED, errors
from admin.cli.render import out
from fencing.urls import mask_url


def upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """WRITES: migrate the database schema to REVISION (default: the newest).

    Example: RESERVATIONS_DATABASE_URL=postgresql://app@db/inv reservations db upgrade
    """
    from reservations import schema

    with errors():
        schema.upgrade(config.database_url, revision)
        out.print(f"{mask_url(config.database_url)} is at revision {schema.current(config.database_url)}")


def current() -> None:
    """Show the database's schema revision, the newest one this package ships, and whether workers of
    this version may run on it. Exit 1 when they may not (behind: `reservations db upgrade`).

    Example: reservations db current
    """
    from reservations import schema

    with errors():
        fit = schema.fit(config.database_url)
    out.print(f"database: {mask_url(config.database_url)}")
    out.print(f"current:  {fit.found or 'none (empty database)'}")
    out.print(f"head:     {fit.needed}")
    out.print(fit.message, highlight=False, soft_wrap=True)
    if not fit.ok:
        raise typer.Exit(EXIT_FAILED)
