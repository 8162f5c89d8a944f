"""``reservations import-skus`` and ``export-skus`` on SQLite and PostgreSQL: a file's SKUs created in
batches, each as add-sku creates one; every bad row named by its line with nothing written; SKUs that
exist refused unless skipped; an export taken back into an empty database gives the same stock; progress
drawn only on a terminal.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservations import Inventory
from reservations.errors import InvalidRequest
from reservations.operations import MAX_SKUS_ADDED
from testing.stores import migrate_pg_schema, own_pg_schema, schema_of
from testing.support import run


def _env(url: str) -> dict[str, str]:
    return {"RESERVATIONS_DATABASE_URL": url}


def _stock(url: str) -> list[dict[str, int | str]]:
    return json.loads(run("stock", "--json", env=_env(url)).stdout)


def _write(path: Path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.fixture
def empty_url(inventory_url: str, tmp_path: Path, migrated_sqlite: Path) -> Iterator[str]:
    """A second migrated, empty database of the same kind as ``inventory_url``."""
    if inventory_url.startswith("sqlite"):
        path = tmp_path / "empty.sqlite3"
        shutil.copyfile(migrated_sqlite, path)
        yield f"sqlite:///{path}"
        return
    with own_pg_schema() as url:
        migrate_pg_schema(schema_of(url))
        yield url


def test_an_export_imported_into_an_empty_database_gives_the_same_stock(
    inventory_url: str, empty_url: str, tmp_path: Path
) -> None:
    # Columns in another order, a blank line, and more SKUs than one batch takes.
    rows = [f"{n},SKU-{n:05d}" for n in range(MAX_SKUS_ADDED + 250)]
    source = _write(
        tmp_path / "in.csv", "on_hand,sku\n" + "\n".join(rows[:10]) + "\n\n" + "\n".join(rows[10:])
    )
    done = run("import-skus", source, env=_env(inventory_url))
    assert done.returncode == 0, done.stderr
    assert f"created {len(rows)} SKU(s)" in done.stdout
    with Inventory.from_url(inventory_url) as inventory:
        assert inventory.history("SKU-00007")[0].operation == "create"  # as add-sku records a creation
        assert inventory.stock("SKU-01249").fence_token == 0  # where add-sku's fence starts
        assert not inventory.invariant_violations()

    exported = tmp_path / "out.csv"
    done = run("export-skus", str(exported), env=_env(inventory_url))
    assert done.returncode == 0, done.stderr
    with exported.open(newline="") as handle:
        table = list(csv.reader(handle))
    assert table[0] == ["sku", "on_hand", "reserved", "available", "fence_token"]
    assert len(table) == len(rows) + 1 and table[8] == ["SKU-00007", "7", "0", "7", "0"]

    assert run("import-skus", str(exported), env=_env(empty_url)).returncode == 0
    assert _stock(empty_url) == _stock(inventory_url)
    again = run("export-skus", env=_env(empty_url))  # to stdout
    assert again.stdout == exported.read_text(), again.stderr


def test_import_reads_stdin_and_export_narrows_by_prefix(inventory_url: str) -> None:
    done = run("import-skus", "-", "--json", env=_env(inventory_url), stdin="sku,on_hand\nA-1,3\nB-1,4\n")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"added": 2, "skipped": 0}
    shown = run("export-skus", "--prefix", "B-", env=_env(inventory_url)).stdout
    assert shown == "sku,on_hand,reserved,available,fence_token\nB-1,4,0,4,0\n"


def test_a_sku_that_exists_is_refused_unless_skipped(inventory_url: str, tmp_path: Path) -> None:
    with Inventory.from_url(inventory_url) as inventory:
        inventory.add_sku("OLD", on_hand=5)
    source = _write(tmp_path / "in.csv", "sku,on_hand\nNEW-1,1\nOLD,9\nNEW-2,2\n")
    before = _stock(inventory_url)
    refused = run("import-skus", source, env=_env(inventory_url))
    assert refused.returncode == 2
    assert "1 SKU(s) exist already ('OLD'; the first on line 3)" in refused.stderr
    assert "--skip-existing" in refused.stderr and _stock(inventory_url) == before
    done = run("import-skus", source, "--skip-existing", env=_env(inventory_url))
    assert done.returncode == 0, done.stderr
    assert "created 2 SKU(s), skipped 1 that exist" in done.stdout
    assert {row["sku"]: row["on_hand"] for row in _stock(inventory_url)} == {"NEW-1": 1, "NEW-2": 2, "OLD": 5}


# Every row is checked before the database is asked anything: SQLite shows that for both.
@pytest.mark.parametrize("inventory_url", ["sqlite"], indirect=True)
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty; the first line names the columns"),
        ("sku,onhand\nA,1\n", "line 1: the header must name the columns sku and on_hand"),
        ("sku,on_hand,colour\nA,1,red\n", "line 1: the header must name"),
        ("A,1\nB,2\n", "line 1: the header must name"),
        ("sku,on_hand\nA,1\nB,two\n", "line 3: on_hand 'two': write a whole number"),
        ("sku,on_hand\nA,1\nB,-2\n", "line 3: on_hand '-2'"),
        ("sku,on_hand\nA,1\n\nB,3.0\n", "line 4: on_hand '3.0'"),
        ("sku,on_hand\nA,1\nB,99999999\n", "line 3: on_hand"),
        ("sku,on_hand\nA,1\nWID GET,2\n", "line 3: SKU 'WID GET' is not"),
        ("sku,on_hand\nA,1\nB,2\nA,3\n", "line 4: SKU 'A' again (first on line 2)"),
        ("sku,on_hand\nA,1\nB\n", "line 3: 1 fields, the header names 2"),
        ('sku,on_hand\nA,1\n"B\n', "line"),
    ],
)
def test_a_bad_row_is_named_by_its_line_and_nothing_is_written(
    inventory_url: str, tmp_path: Path, text: str, message: str
) -> None:
    source = _write(tmp_path / "in.csv", text)
    done = run("import-skus", source, env=_env(inventory_url))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert _stock(inventory_url) == []


def test_an_unreadable_file_is_bad_input(inventory_url: str, tmp_path: Path) -> None:
    done = run("import-skus", str(tmp_path / "missing.csv"), env=_env(inventory_url))
    assert done.returncode == 2 and "cannot be read" in done.stderr
    done = run("export-skus", str(tmp_path / "no" / "such" / "dir.csv"), env=_env(inventory_url))
    assert done.returncode == 2 and "cannot be written" in done.stderr


def test_import_says_it_writes_in_its_help(inventory_url: str) -> None:
    assert "WRITES" in run("import-skus", "--help", env=_env(inventory_url)).stdout
    assert "WRITES" not in run("export-skus", "--help", env=_env(inventory_url)).stdout


def test_progress_is_drawn_on_a_terminal_only(inventory_url: str, tmp_path: Path) -> None:
    rows = "\n".join(f"P-{n:04d},1" for n in range(1500))
    piped = run("import-skus", _write(tmp_path / "a.csv", "sku,on_hand\n" + rows), env=_env(inventory_url))
    assert piped.returncode == 0 and piped.stderr == ""
    terminal = {**_env(inventory_url), "TTY_COMPATIBLE": "1"}
    rows = "\n".join(f"Q-{n:04d},1" for n in range(1500))
    drawn = run("import-skus", _write(tmp_path / "b.csv", "sku,on_hand\n" + rows), env=terminal)
    assert drawn.returncode == 0, drawn.stderr
    assert "importing SKUs" in drawn.stderr and "1500/1500" in drawn.stderr
    quiet = run("import-skus", "-", "--json", env=terminal, stdin="sku,on_hand\nR-1,1\n")
    assert quiet.stderr == "" and json.loads(quiet.stdout) == {"added": 1, "skipped": 0}
    exported = run("export-skus", str(tmp_path / "out.csv"), env=terminal)
    assert "exporting SKUs" in exported.stderr and "3001/3001" in exported.stderr
    assert "exporting" not in run("export-skus", str(tmp_path / "out.csv"), env=_env(inventory_url)).stderr


def test_add_skus_refuses_a_batch_with_one_that_exists_and_writes_nothing(inventory: Inventory) -> None:
    """What a batch meets when another writer added one of its SKUs after the file was checked."""
    inventory.add_sku("TAKEN", on_hand=1)
    with pytest.raises(InvalidRequest, match="1 SKU\\(s\\) already exist: 'TAKEN'"):
        inventory.add_skus([("FRESH", 2), ("TAKEN", 3)])
    assert [level.sku for level in inventory.all_stock()] == ["TAKEN"]
    with pytest.raises(InvalidRequest, match="row 2: SKU 'X' given twice"):
        inventory.add_skus([("X", 1), ("X", 2)])
    with pytest.raises(InvalidRequest, match="at once"):
        inventory.add_skus([(f"M{n}", 1) for n in range(MAX_SKUS_ADDED + 1)])
    done = inventory.add_skus([("FRESH", 2), ("TAKEN", 3)], skip_existing=True)
    assert [level.sku for level in done.added] == ["FRESH"] and done.skipped == ["TAKEN"]
    assert inventory.stock("TAKEN").on_hand == 1 and not inventory.invariant_violations()
