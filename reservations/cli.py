"""The ``reservations`` admin command line.

Exit codes: 0 success, 1 the check a command performs failed, 2 bad usage or input, 3 not found,
4 a backend (Redis or the database) is unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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


def main() -> None:
    app()
