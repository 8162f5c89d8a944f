"""The ``reservations`` admin command line: inspect token history, leases, stock and rejections; enqueue
and operate. Reads go straight to the database and the lease coordinator; writes either go through the
Celery workers (enqueued by task name, so this package never imports them) or say plainly that they write.

Exit codes: 0 success, 1 a check failed, 2 bad usage or input, 3 not found, 4 a backend is unreachable
(or reachable without its schema: ``reservations db upgrade`` creates it).

Modules: ``context`` (the URLs), ``failures`` (exit codes, error -> one line), ``options`` (shared options
and number parsers), ``render`` (tables, JSON, progress), and the commands: ``reads``, ``writes``,
``bulk`` (import-skus, export-skus), ``archives``, ``migrations`` (``db``), ``serve``, ``flower``,
``runs`` (demo, chaos, fence-demo). This module holds the app and the order of its commands.
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

import typer

from admin.cli import archives, bulk, flower, metrics, migrations, reads, runs, serve, writes
from admin.cli.context import config
from admin.cli.failures import EXIT_USAGE, complain, fail
from tasks.settings import Settings, SettingsError, unknown_name_warnings, variable

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
    # Help paragraphs are plain text: a docstring's line breaks are joined and rewrapped at the terminal's
    # width (with Rich markup they were kept, and a narrow terminal broke every line twice).
    rich_markup_mode=None,
)
db_app = typer.Typer(
    help="Database schema (Alembic migrations shipped with the package).",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(db_app, name="db")


def _option(field: str, help: str) -> Any:
    return typer.Option(help=f"{help} Overrides {variable(field).name}.", show_default=False)


@app.callback()
def _root(
    database_url: Annotated[str | None, _option("database_url", "Inventory database URL.")] = None,
    lease_url: Annotated[
        str | None, _option("lease_url", "Lease backend URL (default: the database).")
    ] = None,
    lease_prefix: Annotated[str | None, _option("lease_prefix", "Redis key prefix of leases.")] = None,
    broker_url: Annotated[str | None, _option("broker_url", "Celery broker, for enqueue commands.")] = None,
    result_backend: Annotated[
        str | None, _option("result_backend", "Celery result backend (demo --use-configured).")
    ] = None,
) -> None:
    # The workers' settings object, from the same variables (passwords from their files included), the
    # options before the command winning over them. A bad setting refuses every command: each runs on
    # these settings, or starts workers that would refuse them.
    for line in unknown_name_warnings():
        complain(logging.WARNING, line)
    given = {
        "database_url": database_url,
        "lease_url": lease_url,
        "lease_prefix": lease_prefix,
        "broker_url": broker_url,
        "result_backend": result_backend,
    }
    try:
        config.settings = Settings.from_env(options={k: v for k, v in given.items() if v})
    except SettingsError as exc:
        fail(EXIT_USAGE, str(exc))
    if config.settings.log_format == "json":
        from tasks.logs import use_json_on_stderr  # only then: importing tasks loads Celery

        use_json_on_stderr()


# The commands in the order the help lists them: reads, then writes, then the scenario runs.
app.command("tokens")(reads.tokens)
app.command("leases")(reads.leases)
app.command("requests")(reads.requests)
app.command("stock")(reads.stock)
app.command("rejections")(reads.rejections)
app.command("show")(reads.show)
app.command("audit")(reads.audit)
app.command("dead-letters")(reads.dead_letters)
app.command("actions")(reads.actions)
app.command("reserve")(writes.reserve)
app.command("restock")(writes.restock)
app.command("count")(writes.count)
app.command("replenish")(writes.replenish)
app.command("confirm")(writes.confirm)
app.command("release")(writes.release)
app.command("add-sku")(writes.add_sku)
app.command("import-skus")(bulk.import_skus)
app.command("export-skus")(bulk.export_skus)
app.command("redrive")(writes.redrive)
app.command("archive")(archives.archive_command)
app.command("config")(reads.show_config)
app.command("metrics")(metrics.metrics_command)
app.command("serve")(serve.serve_command)
app.command("flower")(flower.flower_command)
db_app.command("upgrade")(migrations.upgrade)
db_app.command("current")(migrations.current)
app.command("demo")(runs.demo_command)
app.command("chaos")(runs.chaos_command)
app.command("fence-demo")(runs.fence_demo_command)


def main() -> None:
    app()
