"""The ``reservations`` admin command line.

Exit codes: 0 success, 1 the check a command performs failed, 2 bad usage or input, 3 not found,
4 a backend (Redis or the database) is unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fencing import mask_url

app = typer.Typer(
    help="Fenced inventory reservations: demo and administration.",
    no_args_is_help=True,
    add_completion=False,
)

EXIT_FAILED = 1


@app.callback()
def _root() -> None:
    """Fenced inventory reservations: demo and administration."""


@app.command("fence-demo")
def fence_demo(
    database: Annotated[Path, typer.Option(help="SQLite file to (re)create for the demo.")] = Path(
        "var/fence-demo.sqlite3"
    ),
    ttl: Annotated[float, typer.Option(min=0.05, max=10, help="Lease ttl of worker A, in seconds.")] = 0.5,
) -> None:
    """Replay the seed timeline: A's lease expires, B writes, A's late write is rejected.

    Runs on an embedded SQLite database with no services.

    Example: reservations fence-demo --ttl 0.3
    """
    from reservations import fence_demo as demo

    if not demo.run(database, ttl=ttl):
        raise typer.Exit(EXIT_FAILED)


db_app = typer.Typer(
    help="Database schema (Alembic migrations shipped with the package).", no_args_is_help=True
)
app.add_typer(db_app, name="db")

DatabaseUrl = Annotated[
    str,
    typer.Option(
        "--database-url",
        envvar="RESERVATIONS_DATABASE_URL",
        help="Inventory database URL (env RESERVATIONS_DATABASE_URL).",
        show_default=False,
    ),
]


@db_app.command("upgrade")
def db_upgrade(database_url: DatabaseUrl, revision: str = "head") -> None:
    """WRITES: migrate the database schema to REVISION (default: the newest).

    Example: reservations db upgrade --database-url postgresql://app@db/reservations
    """
    from reservations import schema

    schema.upgrade(database_url, revision)
    typer.echo(f"{mask_url(database_url)} is at revision {schema.current(database_url)}")


@db_app.command("current")
def db_current(database_url: DatabaseUrl) -> None:
    """Show the schema revision of the database and the newest one this package ships.

    Example: reservations db current
    """
    from reservations import schema

    typer.echo(f"database: {mask_url(database_url)}")
    typer.echo(f"current:  {schema.current(database_url) or 'none (empty database)'}")
    typer.echo(f"head:     {schema.head()}")


def main() -> None:
    app()
