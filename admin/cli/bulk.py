"""``reservations import-skus`` and ``export-skus``: the stock of many SKUs to and from CSV, a batch of
SKUs per statement (reservations.operations.add_skus) and a page of them per read.

An import reads and checks the whole file before it writes anything: a bad row is named by its line and
nothing is written. It then writes one transaction per batch of MAX_SKUS_ADDED SKUs rather than one for
the whole file: on SQLite a transaction holds the database's one write lock, so a file-long one would
stop every worker's write for the length of the import, and on PostgreSQL a long transaction holds back
vacuum. A batch refused when the file was checked but before it was written (another writer added one of
its SKUs meanwhile) leaves the earlier batches written, says how many, and a second run with
--skip-existing finishes the file.
"""

from __future__ import annotations

import csv
import io
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, TextIO

import typer

from admin.cli import context, render
from admin.cli.context import config
from admin.cli.failures import EXIT_FAILED, EXIT_USAGE, errors, fail
from admin.cli.options import JsonFlag
from admin.cli.render import out
from fencing.urls import mask_url
from reservations import Inventory, numerals
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.operations import MAX_SKUS_ADDED

# What export-skus writes; import-skus needs the first two and reads past the others, which a new SKU
# does not take (it starts with nothing reserved and fence token 0, as add-sku makes it).
EXPORTED = ("sku", "on_hand", "reserved", "available", "fence_token")
REQUIRED = ("sku", "on_hand")
# SKUs read from the database per page by export-skus.
PAGE = 1_000


@contextmanager
def _opened(name: str) -> Iterator[TextIO]:
    """The CSV file ``name`` (``-``: stdin) as text; a file that cannot be read is bad input."""
    if name == "-":
        yield io.TextIOWrapper(sys.stdin.buffer, encoding="utf-8-sig", newline="")
        return
    try:
        handle = open(name, encoding="utf-8-sig", newline="")  # noqa: SIM115 - closed below
    except OSError as exc:
        fail(EXIT_USAGE, f"{name}: cannot be read: {exc.strerror or exc}")
    with handle:
        yield handle


def read_levels(name: str, lines: TextIO) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """Every ``(sku, on_hand)`` of the CSV text ``lines``, each row checked as add-sku checks one and no
    SKU twice, and the line of each SKU; the first row that is not is refused with its line number (exit
    2)."""
    reader = csv.reader(lines)
    try:
        header = next(reader, None)
        if header is None:
            fail(EXIT_USAGE, f"{name}: empty; the first line names the columns: sku,on_hand")
        columns = [column.strip() for column in header]
        unknown = [column for column in columns if column not in EXPORTED]
        missing = [column for column in REQUIRED if column not in columns]
        if unknown or missing or len(set(columns)) != len(columns):
            fail(
                EXIT_USAGE,
                f"{name} line 1: the header must name the columns sku and on_hand, each once (and may name "
                f"{', '.join(EXPORTED[2:])}, which are read past); got {','.join(columns)}",
            )
        at_sku, at_on_hand = columns.index("sku"), columns.index("on_hand")
        levels: list[tuple[str, int]] = []
        first_seen: dict[str, int] = {}
        for row in reader:
            line = reader.line_num
            if not row:  # a blank line
                continue
            if len(row) != len(columns):
                fail(EXIT_USAGE, f"{name} line {line}: {len(row)} fields, the header names {len(columns)}")
            sku, written = row[at_sku], row[at_on_hand].strip()
            on_hand = numerals.whole(written)
            if on_hand is None:
                fail(
                    EXIT_USAGE,
                    f"{name} line {line}: on_hand {written!r}: write a whole number with the digits 0-9",
                )
            try:
                valid.sku(sku)
                valid.on_hand(on_hand)
            except InvalidRequest as exc:
                fail(EXIT_USAGE, f"{name} line {line}: {exc}")
            if sku in first_seen:
                fail(EXIT_USAGE, f"{name} line {line}: SKU {sku!r} again (first on line {first_seen[sku]})")
            first_seen[sku] = line
            levels.append((sku, on_hand))
    except (csv.Error, UnicodeDecodeError) as exc:
        fail(EXIT_USAGE, f"{name} line {reader.line_num + 1}: not CSV text in UTF-8: {exc}")
    return levels, first_seen


def import_skus(
    file: Annotated[str, typer.Argument(metavar="FILE.csv", help="The CSV file, or - for stdin.")],
    skip_existing: Annotated[
        bool,
        typer.Option("--skip-existing", help="Leave SKUs that exist as they are and create the others."),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """WRITES (directly to the database): create the SKUs of a CSV file with their units on hand.

    The first line names the columns: sku and on_hand, in any order (an export's reserved, available
    and fence_token are read past: a new SKU starts with nothing reserved and fence token 0, as add-sku
    makes it). Every row is checked before anything is written: a bad row, a SKU given twice or (without
    --skip-existing) one that exists already is refused with its line number, exit 2, nothing written.
    The SKUs are then written 1,000 per transaction; if another writer adds one of them meanwhile, the
    batches before stay written (exit 1, with their count): run again with --skip-existing.

    JSON: {"added", "skipped"}  (counts)

    Example: reservations import-skus skus.csv
    Example: reservations export-skus - | reservations import-skus - --skip-existing
    """
    with _opened(file) as lines:
        levels, line_of = read_levels("stdin" if file == "-" else file, lines)
    batches = [levels[start : start + MAX_SKUS_ADDED] for start in range(0, len(levels), MAX_SKUS_ADDED)]
    added = skipped = 0
    with errors(), context.inventory() as inventory:
        if not skip_existing:
            there = [sku for batch in batches for sku in inventory.existing_skus([sku for sku, _ in batch])]
            if there:
                shown = ", ".join(repr(sku) for sku in there[:5]) + (", ..." if len(there) > 5 else "")
                first = min(line_of[sku] for sku in there)
                fail(
                    EXIT_USAGE,
                    f"{file}: {len(there)} SKU(s) exist already ({shown}; the first on line {first}): "
                    "nothing written; --skip-existing creates the others",
                )
        with render.progress("importing SKUs", len(levels), quiet=as_json) as advance:
            for batch in batches:
                try:
                    done = inventory.add_skus(batch, skip_existing=skip_existing)
                except InvalidRequest as exc:
                    fail(
                        EXIT_FAILED,
                        f"{file}: {exc} (created since the file was checked); {added} SKU(s) of it were "
                        "written before: run again with --skip-existing for the rest",
                    )
                added += len(done.added)
                skipped += len(done.skipped)
                advance(len(batch))
    if as_json:
        render.emit_json({"added": added, "skipped": skipped})
        return
    also = f", skipped {skipped} that exist" if skip_existing else ""
    out.print(f"created {added} SKU(s){also} in {mask_url(config.database_url)}", soft_wrap=True)


def export_skus(
    file: Annotated[
        str, typer.Argument(metavar="[FILE.csv]", help="Where to write the CSV (- or none: stdout).")
    ] = "-",
    prefix: Annotated[str | None, typer.Option(help="Only SKUs starting with this.")] = None,
) -> None:
    """Every SKU's stock as CSV, in SKU order: sku,on_hand,reserved,available,fence_token, with that
    header line. The table is read 1,000 SKUs at a time, each page as it is then; a FILE is written
    beside itself and renamed into place once whole.

    reservations import-skus takes the file back into an empty database: the same SKUs and units on hand
    (held units and fence tokens do not travel: a new SKU has neither).

    Example: reservations export-skus stock.csv
    """
    with errors(), context.inventory() as inventory:
        total = inventory.sku_count(prefix=prefix)
        if file == "-":
            _write_csv(inventory, sys.stdout, prefix, None, quiet=True)
            return
        target = Path(file)
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "w", encoding="utf-8", newline="") as handle:
                _write_csv(inventory, handle, prefix, total, quiet=False)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(partial, target)
        except OSError as exc:
            partial.unlink(missing_ok=True)
            fail(EXIT_USAGE, f"{file}: cannot be written: {exc.strerror or exc}")
    out.print(f"wrote {total} SKU(s) to {file}", soft_wrap=True)


def _write_csv(
    inventory: Inventory, handle: TextIO, prefix: str | None, total: int | None, *, quiet: bool
) -> None:
    writer = csv.writer(handle, lineterminator="\n")
    writer.writerow(EXPORTED)
    after: str | None = None
    with render.progress("exporting SKUs", total, quiet=quiet) as advance:
        while True:
            page = inventory.all_stock(after=after, limit=PAGE, prefix=prefix)
            writer.writerows((s.sku, s.on_hand, s.reserved, s.available, s.fence_token) for s in page)
            advance(len(page))
            if len(page) < PAGE:
                return
            after = page[-1].sku
