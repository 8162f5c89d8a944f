"""What the ``reservations`` command line refuses before it reads or writes anything: a revision the
migrations do not know, an empty SKU, a number not written as plain digits; and the one line it prints
for a database that answers but was never migrated. The command line runs in this process
(``testing.support.run``): its parsing is the thing under test, and a console script costs a second to
start (``tests/test_cli.py`` and ``tests/test_cli_audit.py`` run the installed script). Databases are
SQLite files and PostgreSQL schemas; every refused command leaves the stock as it was.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from fencing.urls import mask_url
from reservations import Inventory, schema
from testing.support import run

UNREACHABLE_BROKER = "redis://127.0.0.1:1/0"  # a command that got past its input checks would fail here


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database that answers but holds no tables: a SQLite file or a fresh PostgreSQL schema."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    return f"sqlite:///{tmp_path / 'empty.sqlite3'}"


def _stocked(folder: Path) -> dict[str, str]:
    """A migrated SQLite file with WIDGET (10 on hand), the SQL lease backend on it, an unreachable broker."""
    url = f"sqlite:///{folder / 'inventory.sqlite3'}"
    schema.upgrade(url)
    with Inventory.from_url(url) as inventory:
        inventory.add_sku("WIDGET", on_hand=10)
    return {"RESERVATIONS_DATABASE_URL": url, "RESERVATIONS_BROKER_URL": UNREACHABLE_BROKER}


@pytest.fixture(scope="module")
def stocked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """One stocked database for the tests of commands that must leave it as it was."""
    return _stocked(tmp_path_factory.mktemp("stocked"))


@pytest.fixture
def own_stocked(tmp_path: Path) -> dict[str, str]:
    """A stocked database of the test's own, for a command that writes."""
    return _stocked(tmp_path)


def _stock(env: dict[str, str]) -> list[dict[str, object]]:
    done = run("stock", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


# -- db upgrade -----------------------------------------------------------------------------------------


def test_upgrade_to_an_unknown_revision_is_one_line_and_exit_2(empty_url: str) -> None:
    done = run("db", "upgrade", "9999", env={"RESERVATIONS_DATABASE_URL": empty_url})
    assert done.returncode == 2, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert "'9999'" in line and f"newest is {schema.head()}" in line
    assert schema.current(empty_url) is None


# -- empty SKU ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ("stock", ""),
        ("stock", "", "--json"),
        ("leases", ""),
        ("leases", "", "--json"),
        ("rejections", "--sku", ""),
    ],
)
def test_an_empty_sku_is_refused_instead_of_meaning_every_sku(
    stocked: dict[str, str], args: tuple[str, ...]
) -> None:
    done = run(*args, env=stocked)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "SKU ''" in _one_line(done.stderr) and "WIDGET" not in done.stdout


# -- numbers --------------------------------------------------------------------------------------------


NOT_PLAIN_DIGITS = ["3.0", " 3", "3 ", "1_000", "+3", "\u0663", "0x3", "1e3", ""]


@pytest.mark.parametrize("text", NOT_PLAIN_DIGITS)
@pytest.mark.parametrize(
    ("command", "name"),
    [
        (("reserve", "WIDGET", "{}", "--key", "k1"), "quantity"),
        (("restock", "WIDGET", "{}", "--key", "k1"), "quantity"),
        (("add-sku", "GADGET", "--on-hand", "{}"), "--on-hand"),
        (("tokens", "WIDGET", "--limit", "{}"), "--limit"),
        (("rejections", "--limit", "{}"), "--limit"),
    ],
    ids=["reserve", "restock", "add-sku", "tokens", "rejections"],
)
def test_a_count_must_be_plain_digits(
    stocked: dict[str, str], command: tuple[str, ...], name: str, text: str
) -> None:
    before = _stock(stocked)
    done = run(*(text if part == "{}" else part for part in command), env=stocked)
    assert done.returncode == 2, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert f"{name} {text!r}" in line and "digits 0-9" in line
    assert _stock(stocked) == before


NOT_PLAIN_DECIMALS = ["nan", "inf", "1e3", " 5", "5 ", "1_0", ".5", "5.", "-1", "\u0665", ""]


@pytest.mark.parametrize("text", NOT_PLAIN_DECIMALS)
def test_seconds_must_be_plain_decimals(stocked: dict[str, str], text: str) -> None:
    done = run("reserve", "WIDGET", "1", "--key", "k1", "--wait", "--timeout", text, env=stocked)
    assert done.returncode == 2, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert f"--timeout {text!r}" in line and "digits 0-9" in line


@pytest.mark.parametrize(
    ("option", "text"),
    [
        ("--workers", "3.0"),
        ("--skus", " 2"),
        ("--requests", "1_000"),
        ("--seed", "-7"),
        ("--duration", "1e2"),
        ("--drain", "inf"),
        ("--proxy-delay", "nan"),
        ("--hot", ".5"),
    ],
)
def test_chaos_options_must_be_plain_numbers(option: str, text: str) -> None:
    # --skus 0 follows: a parser that let the first option through still refuses the run.
    guard = ["--requests", "0"] if option == "--skus" else ["--skus", "0"]
    done = run("chaos", option, text, *guard, env={})
    assert done.returncode == 2, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert f"{option} {text!r}" in line and "digits 0-9" in line


def test_fence_demo_ttl_must_be_a_plain_decimal(tmp_path: Path) -> None:
    database = tmp_path / "fence-demo.sqlite3"
    done = run("fence-demo", "--database", str(database), "--ttl", " 0.3", env={})
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--ttl ' 0.3'" in _one_line(done.stderr)
    assert not database.exists()


def test_since_must_be_written_with_plain_digits(stocked: dict[str, str]) -> None:
    for text in (" 1h", "\u0661h", "1_0m"):
        done = run("tokens", "WIDGET", "--since", text, env=stocked)
        assert done.returncode == 2, (text, done.stdout + done.stderr)
        assert "--since" in _one_line(done.stderr)


@pytest.mark.parametrize("command", [("tokens", "WIDGET"), ("rejections",)], ids=["tokens", "rejections"])
def test_since_is_one_rule_for_every_command(stocked: dict[str, str], command: tuple[str, ...]) -> None:
    """A command that filters in memory refuses what one that asks the database refuses."""
    for text in ("99999999999d", "9999-12-31T23:59:59-01:00"):
        done = run(*command, "--since", text, env=stocked)
        assert done.returncode == 2, (text, done.stdout + done.stderr)
        assert f"--since {text!r} is out of range" in _one_line(done.stderr)
    assert run(*command, "--since", "60000d", env=stocked).returncode == 0  # all of it, not a mistake


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("reserve", "WIDGET", "0", "--key", "k1"), "quantity must be between 1 and"),
        (("add-sku", "GADGET", "--on-hand", "-3"), "--on-hand '-3'"),
        (("rejections", "--limit", "-1"), "--limit '-1'"),
        (("tokens", "WIDGET", "--limit", "0"), "--limit must be between 1 and 10000, got 0"),
        (("tokens", "WIDGET", "--limit", "10001"), "--limit must be between 1 and 10000, got 10001"),
        (("reserve", "WIDGET", "1", "--key", "k1", "--timeout", "0.05"), "--timeout must be between 0.1"),
        (("chaos", "--hot", "0.95"), "--hot must be between 0 and 0.9, got 0.95"),
    ],
)
def test_numbers_out_of_range_are_one_line(
    stocked: dict[str, str], args: tuple[str, ...], message: str
) -> None:
    before = _stock(stocked)
    done = run(*args, env=stocked)
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in _one_line(done.stderr)
    assert _stock(stocked) == before


def test_plain_digits_are_accepted(own_stocked: dict[str, str]) -> None:
    done = run("add-sku", "GADGET", "--on-hand", "007", env=own_stocked)
    assert done.returncode == 0, done.stderr
    assert {row["sku"]: row["on_hand"] for row in _stock(own_stocked)} == {"WIDGET": 10, "GADGET": 7}
    assert run("tokens", "WIDGET", "--limit", "10", "--since", "1.5h", env=own_stocked).returncode == 0


# -- a database without its schema ----------------------------------------------------------------------


@pytest.mark.parametrize("args", [("stock",), ("stock", "WIDGET"), ("leases",), ("tokens", "WIDGET")])
def test_a_database_without_its_schema_says_to_upgrade(empty_url: str, args: tuple[str, ...]) -> None:
    done = run(*args, env={"RESERVATIONS_DATABASE_URL": empty_url})
    assert done.returncode == 4, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert line.startswith(f"error: schema missing: run `reservations db upgrade` on {mask_url(empty_url)} (")
    assert "unavailable" not in line


@pytest.mark.parametrize("args", [("leases",), ("leases", "WIDGET"), ("tokens", "WIDGET")])
def test_a_lease_database_without_its_schema_says_to_upgrade_it(
    stocked: dict[str, str], empty_url: str, args: tuple[str, ...]
) -> None:
    done = run(*args, env={**stocked, "RESERVATIONS_LEASE_URL": empty_url})
    assert done.returncode == 4, done.stdout + done.stderr
    line = _one_line(done.stderr)
    assert line.startswith(
        f"error: schema missing: run `reservations db upgrade` on the lease database {mask_url(empty_url)} ("
    )


def test_a_database_that_does_not_answer_is_still_unreachable() -> None:
    done = run("stock", env={"RESERVATIONS_DATABASE_URL": "postgresql://app@127.0.0.1:1/inv"})
    assert done.returncode == 4, done.stdout + done.stderr
    assert "schema" not in _one_line(done.stderr)


def test_metrics_on_a_taken_port_is_one_line_and_exit_1(stocked: dict[str, str]) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        done = run("metrics", "--port", str(port), env=stocked)
    assert done.returncode == 1
    assert f"cannot serve metrics on 127.0.0.1 port {port}" in _one_line(done.stderr)


def test_config_on_a_narrow_terminal_cuts_no_name(stocked: dict[str, str]) -> None:
    done = run("config", env=stocked, columns=60)
    assert done.returncode == 0, done.stderr
    assert "RESERVATIONS_MAX_TRANSIENT_RETRIES" in done.stdout and "…" not in done.stdout, done.stdout
