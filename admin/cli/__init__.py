"""The ``reservations`` admin command line: inspect token history, leases, stock and rejections; enqueue
and operate. Reads go straight to the database and the lease coordinator; writes either go through the
Celery workers (enqueued by task name, so this package never imports them) or say plainly that they write.

Exit codes: 0 success, 1 a check failed, 2 bad usage or input, 3 not found, 4 a backend is unreachable
(or reachable without its schema: ``reservations db upgrade`` creates it).

Modules: ``context`` (the URLs), ``failures`` (exit codes, error -> one line), ``options`` (shared options
and number parsers), ``render`` (tables, JSON), and the commands: ``reads``, ``writes``, ``migrations``
(``db``), ``runs`` (demo, chaos, fence-demo). This module holds the app and the order of its commands.
"""

from __future__ import annotations

import os
from typing import Annotated

import typer

from admin.cli import migrations, reads, runs, writes
from admin.cli.context import Config, config
from admin.cli.failures import EXIT_USAGE, fail

__all__ = ["app", "main"]

app = typer.Typer(
    help=(
        "Fenced inventory reservations: inspect token history, leases, stock and rejections; operate.\n\n"
        "A SKU is the first argument or --sku, on every command that takes one. --json prints stable "
        "field names with times in ISO 8601 (UTC).\n\n"
        "Exit codes: 0 ok, 1 check failed, 2 bad usage or input, 3 not found, 4 backend unreachable "
        "(or without its schema)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(
    help="Database schema (Alembic migrations shipped with the package).", no_args_is_help=True
)
app.add_typer(db_app, name="db")


@app.callback()
def _root(
    database_url: Annotated[
        str, typer.Option(envvar="RESERVATIONS_DATABASE_URL", help="Inventory database URL.")
    ] = Config.database_url,
    lease_url: Annotated[
        str | None,
        typer.Option(envvar="RESERVATIONS_LEASE_URL", help="Lease backend URL (default: the database)."),
    ] = None,
    lease_prefix: Annotated[
        str, typer.Option(envvar="RESERVATIONS_LEASE_PREFIX", help="Redis key prefix of leases.")
    ] = Config.lease_prefix,
    broker_url: Annotated[
        str, typer.Option(envvar="RESERVATIONS_BROKER_URL", help="Celery broker, for enqueue commands.")
    ] = Config.broker_url,
    result_backend: Annotated[
        str,
        typer.Option(
            envvar="RESERVATIONS_RESULT_BACKEND", help="Celery result backend (demo --use-configured)."
        ),
    ] = Config.result_backend,
) -> None:
    # Passwords mounted as files (compose secrets), read as the workers read them. Only then is the tasks
    # package imported: it brings Celery, which no other read of this command line needs.
    if any(os.environ.get(f"RESERVATIONS_{name}_PASSWORD_FILE") for name in ("DATABASE", "BROKER")):
        try:  # importing tasks builds the workers' app from the same variables: it may refuse them first
            from tasks.settings import url_with_password_file

            database_url = url_with_password_file(os.environ, "DATABASE", database_url)
            broker_url = url_with_password_file(os.environ, "BROKER", broker_url)
        except ValueError as exc:  # tasks.settings.SettingsError, from the import or the call
            fail(EXIT_USAGE, str(exc))
    config.database_url = database_url
    config.lease_url = lease_url or None
    config.lease_prefix = lease_prefix
    config.broker_url = broker_url
    config.result_backend = result_backend


# The commands in the order the help lists them: reads, then writes, then the scenario runs.
app.command("tokens")(reads.tokens)
app.command("leases")(reads.leases)
app.command("stock")(reads.stock)
app.command("rejections")(reads.rejections)
app.command("show")(reads.show)
app.command("audit")(reads.audit)
app.command("reserve")(writes.reserve)
app.command("restock")(writes.restock)
app.command("count")(writes.count)
app.command("replenish")(writes.replenish)
app.command("confirm")(writes.confirm)
app.command("release")(writes.release)
app.command("add-sku")(writes.add_sku)
app.command("config")(reads.show_config)
db_app.command("upgrade")(migrations.upgrade)
db_app.command("current")(migrations.current)
app.command("demo")(runs.demo_command)
app.command("chaos")(runs.chaos_command)
app.command("fence-demo")(runs.fence_demo_command)


def main() -> None:
    app()
