"""``reservations archive``: whole UTC days of history out of the database into archive files, each SKU's
sums kept as a checkpoint (reservations.archive). It writes, and says so.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from admin.cli import context, render
from admin.cli.context import config
from admin.cli.failures import errors
from admin.cli.options import JsonFlag, parse_since
from admin.cli.render import out
from fencing.urls import mask_url
from reservations import archive as history_archive
from reservations.errors import InvalidRequest


def _cutoff(text: str) -> int:
    """``30d``, ``12h`` ago, or a date / ISO time (UTC when it has no zone) -> epoch milliseconds."""
    try:
        seconds = parse_since(text)
    except InvalidRequest as exc:
        raise InvalidRequest(str(exc).replace("--since", "--before"), field="before") from None
    assert seconds is not None
    return round(seconds * 1000)


def _span_json(span: history_archive.ArchivedSpan) -> dict[str, Any]:
    return {
        "table": span.table,
        "partition": span.partition,
        "from": history_archive.iso(span.from_ms),
        "to": history_archive.iso(span.to_ms),
        "rows": span.rows,
        "checkpoints": span.checkpoints,
        "file": span.file,
        "sha256": span.sha256,
        "resumed": span.resumed,
    }


def archive_command(
    before: Annotated[
        str,
        typer.Option(
            "--before",
            help="Archive the whole UTC days that end by then: a date (2026-11-01), an ISO time, or 30d ago.",
            show_default=False,
        ),
    ],
    to: Annotated[
        Path,
        typer.Option("--to", help="Directory for the archive files (made if missing).", show_default=False),
    ],
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say which days and rows would go; write nothing.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """WRITES (directly to the database and to --to): archive old history, one file per day and table.

    For each UTC day of sku_history and task_attempts that ends by --before, oldest first: each SKU's
    checkpoint (on hand, reserved, highest accepted token) is written to sku_checkpoints, the day's rows
    to DIR/<table>_pYYYYMMDD.csv.gz (gzip CSV with a header row) and a .json manifest (rows, first and
    last at_ms, SHA-256 of the CSV), both fsynced and read back, and only then do they leave the database:
    on PostgreSQL the day's partition is detached, then dropped; on SQLite the rows are deleted. A run
    that stopped halfway is taken up by the next. The audit and `reservations tokens` start from the
    checkpoints. On PostgreSQL it also makes the day partitions of the coming week that are missing.

    --before must end by the start of the current UTC day (the database's clock): today's rows are still
    being written. Two runs of one database exclude each other.

    Exit codes: 0 done (or nothing to do); 1 stopped at a day, whose rows stay in the database or its
    detached table for the next run (a file could not be written: a full disk), or another run holds the
    archive lock; 2 bad input (a cutoff today or later, a --to that cannot be made or written); 4 the
    database does not answer.

    JSON: {"before", "dry_run", "archived": [{"table", "partition", "from", "to", "rows", "checkpoints",
    "file", "sha256", "resumed"}], "created_partitions": [...]}

    Example: reservations archive --before 30d --to /var/lib/reservations/archive
    """
    with errors():
        cutoff = _cutoff(before)
        # One call archives every day due, so the progress is a spinner with the time it has taken.
        with context.inventory() as inventory, render.progress("archiving", None, quiet=as_json):
            report = history_archive.archive(
                inventory.executor.engine, before_ms=cutoff, to=to, dry_run=dry_run
            )
    if as_json:
        render.emit_json(
            {
                "before": history_archive.iso(report.before_ms),
                "dry_run": report.dry_run,
                "archived": [_span_json(s) for s in report.spans],
                "created_partitions": report.created,
            }
        )
        return
    verb = "would archive" if dry_run else "archived"
    for span in report.spans:
        line = f"{verb} {span.partition}: {span.rows} rows of {history_archive.iso(span.from_ms)}"
        if span.table == "sku_history" and not dry_run:
            line += f", {span.checkpoints} SKU checkpoints"
        if span.file is not None:
            line += f" -> {span.file} (sha256 {span.sha256})"
        if span.resumed:
            line += " (resumed: detached by an earlier run)"
        out.print(line, soft_wrap=True)
    if report.created:
        out.print(f"made partitions ahead: {', '.join(report.created)}", soft_wrap=True)
    where, until = mask_url(config.database_url), history_archive.iso(report.before_ms)
    if not report.spans:
        out.print(f"nothing to archive before {until} in {where}")
    elif dry_run:
        out.print(f"dry run: wrote nothing ({len(report.spans)} spans before {until})")
    else:
        out.print(f"archived {len(report.spans)} spans from {where} to {to}")
