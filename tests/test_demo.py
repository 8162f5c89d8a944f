"""The README's first command as a user runs it: ``reservations demo`` in a subprocess with real Celery
workers. By default it writes only to its own folder (embedded SQLite) even when service URLs are
configured; ``--use-configured`` runs it on PostgreSQL and a private redis-server, again and again in a
folder the default run left. What it leaves is checked independently. The default run is made once for
the module (each demo run costs seconds of real workers); the test that reruns in its folder copies it.
A configured database that does not answer stops the demo before any worker starts, so that case runs
the command line in process.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from fencing.engines import make_engine
from fencing.urls import mask_url
from reservations import Inventory
from tasks.failpoints import failpoint
from testing.redis_servers import redis_server
from testing.stores import own_pg_schema
from testing.support import run

SCRIPT = shutil.which("reservations", path=str(Path(sys.executable).parent)) or "reservations"


def run_demo(
    folder: Path, env: dict[str, str], *options: str, columns: int = 200
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [SCRIPT, "demo", "--folder", str(folder), *options],
        env={**_clean_env(), **env, "COLUMNS": str(columns), "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REJECTED" in done.stdout and "FAIL" not in done.stdout
    return done


def _clean_env() -> dict[str, str]:
    return {
        k: v for k, v in os.environ.items() if not k.endswith("_URL") and not k.startswith("RESERVATIONS_")
    }


def _tables(url: str) -> list[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return sa.inspect(conn).get_table_names()
    finally:
        engine.dispose()


def _check_demo_sku(inventory: Inventory, sku: str) -> None:
    level = inventory.stock(sku)
    assert (level.on_hand, level.reserved, level.available) == (10, 7, 3)
    assert [v for v in inventory.invariant_violations() if v.sku == sku] == []
    assert inventory.rejection_counts().get(sku) == 1
    outcomes = [inventory.request_outcome(r.idempotency_key) for r in inventory.reservations(sku)]
    assert sorted(o.status for o in outcomes if o) == ["reserved", "reserved"]
    assert sorted(o.epochs for o in outcomes if o) == [0, 1]


@dataclass(frozen=True)
class DefaultRun:
    """A default run (as ``make demo`` runs it) with service URLs configured that it must not use."""

    place: Path  # the demo's folder and where the configured SQLite broker and result store would be
    folder: Path
    pg_url: str  # the configured database and leases: a reachable PostgreSQL schema
    stdout: str


@pytest.fixture(scope="module")
def default_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DefaultRun]:
    place = tmp_path_factory.mktemp("default-run")
    with own_pg_schema() as pg_url:
        configured = {
            "RESERVATIONS_DATABASE_URL": pg_url,
            "RESERVATIONS_LEASE_URL": pg_url,
            "RESERVATIONS_BROKER_URL": f"sqla+sqlite:///{place / 'configured-broker.sqlite3'}",
            "RESERVATIONS_RESULT_BACKEND": f"db+sqlite:///{place / 'configured-results.sqlite3'}",
        }
        done = run_demo(place / "demo", configured, columns=80)
        yield DefaultRun(place=place, folder=place / "demo", pg_url=pg_url, stdout=done.stdout)


@pytest.mark.slow
def test_demo_writes_only_its_own_folder_and_rejects_the_frozen_workers_write(
    default_run: DefaultRun,
) -> None:
    """Configured URLs (a reachable PostgreSQL schema, a SQLite broker) are named as not used and stay
    untouched; the folder's SQLite inventory holds the story."""
    folder, stdout = default_run.folder, default_run.stdout
    assert f"WRITES only to its own folder {folder}" in stdout
    # Piped, each line of the story stays whole, even past 80 columns.
    lines = stdout.splitlines()
    assert any("took sku:WIDGET with token" in line and "(SIGSTOP)" in line for line in lines)
    assert "not using the configured database, leases, broker, result backend" in stdout
    assert _tables(default_run.pg_url) == []
    assert sorted(p.name for p in default_run.place.iterdir()) == ["demo"]
    with Inventory.from_url(f"sqlite:///{folder / 'inventory.sqlite3'}") as inventory:
        _check_demo_sku(inventory, "WIDGET")
        assert inventory.invariant_violations() == []
        assert inventory.rejection_counts() == {"WIDGET": 1}


@pytest.mark.slow
def test_demo_on_the_configured_postgresql_and_redis_reruns_in_the_same_folder(
    default_run: DefaultRun, tmp_path: Path, pg_url: str
) -> None:
    """After a default run (``make demo``) left its markers in the folder, two runs on the configured
    services each freeze worker A again and end with their own DEMO SKU."""
    folder = tmp_path / "demo"
    shutil.copytree(default_run.folder, folder)  # the default run's folder as it left it, markers and all
    with redis_server(tmp_path / "redis") as server:
        configured = {
            "RESERVATIONS_DATABASE_URL": pg_url,
            "RESERVATIONS_LEASE_URL": server.url(2),
            "RESERVATIONS_LEASE_PREFIX": "demo-leases",
            "RESERVATIONS_BROKER_URL": server.url(0),
            "RESERVATIONS_RESULT_BACKEND": server.url(1),
        }
        outputs = [run_demo(folder, configured, "--use-configured").stdout for _ in range(2)]
        leases = redis.Redis.from_url(server.url(2))
        try:
            assert any(leases.scan_iter(match="demo-leases:*"))
        finally:
            leases.close()
    assert not (folder / "inventory.sqlite3").exists()  # recreated: the default run's files are gone
    with Inventory.from_url(pg_url) as inventory:
        skus = [level.sku for level in inventory.all_stock()]
        assert len(skus) == 2 and all(sku.startswith("DEMO-") for sku in skus)
        for sku in skus:
            _check_demo_sku(inventory, sku)
    assert sorted(skus) == sorted(m for o in outputs for m in re.findall(r"creates SKU (DEMO-\w+)", o))
    assert all(f"WRITES to the configured database {mask_url(pg_url)}" in o for o in outputs)


def test_a_once_failpoint_fires_once_per_directory_and_needs_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Markers outlive a run: only a directory the run names decides whether it already fired."""
    monkeypatch.setenv("RESERVATIONS_FAILPOINTS", "after_write=sleep:0,once")
    monkeypatch.delenv("RESERVATIONS_FAILPOINT_DIR", raising=False)
    with pytest.raises(ValueError, match="RESERVATIONS_FAILPOINT_DIR"):
        failpoint("after_write")
    caplog.set_level(logging.WARNING, logger="tasks.failpoints")
    for directory in ("first", "first", "second"):
        monkeypatch.setenv("RESERVATIONS_FAILPOINT_DIR", str(tmp_path / directory))
        failpoint("after_write")
    fired = [r for r in caplog.records if r.getMessage().startswith("failpoint after_write: sleep:0")]
    assert len(fired) == 2


def test_demo_on_a_configured_database_that_does_not_answer_is_one_line_and_exit_4(tmp_path: Path) -> None:
    unreachable = {"RESERVATIONS_DATABASE_URL": "postgresql://app:s3cret@127.0.0.1:1/inv"}
    done = run("demo", "--folder", str(tmp_path / "demo"), "--use-configured", env=unreachable)
    assert done.returncode == 4, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "postgresql://app:***@127.0.0.1:1/inv" in done.stderr and "s3cret" not in done.stdout + done.stderr
