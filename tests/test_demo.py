"""The README's first command as a user runs it: ``reservations demo`` in a subprocess with real Celery
workers. By default it writes only to its own folder (embedded SQLite) even when service URLs are
configured; ``--use-configured`` runs it on PostgreSQL and a private redis-server, again and again in the
same folder. What it leaves is checked independently.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from admin.harness import redis_server
from fencing import mask_url
from fencing.sql import make_engine
from reservations import Inventory
from tasks.failpoints import failpoint

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


def test_demo_writes_only_its_own_folder_and_rejects_the_frozen_workers_write(
    tmp_path: Path, pg_url: str
) -> None:
    """Configured URLs (a reachable PostgreSQL schema, a SQLite broker) are named as not used and stay
    untouched; the folder's SQLite inventory holds the story."""
    configured = {
        "RESERVATIONS_DATABASE_URL": pg_url,
        "RESERVATIONS_LEASE_URL": pg_url,
        "RESERVATIONS_BROKER_URL": f"sqla+sqlite:///{tmp_path / 'configured-broker.sqlite3'}",
        "RESERVATIONS_RESULT_BACKEND": f"db+sqlite:///{tmp_path / 'configured-results.sqlite3'}",
    }
    folder = tmp_path / "demo"
    done = run_demo(folder, configured, columns=80)
    assert f"WRITES only to its own folder {folder}" in done.stdout
    # Piped, each line of the story stays whole, even past 80 columns.
    lines = done.stdout.splitlines()
    assert any("took sku:WIDGET with token" in line and "(SIGSTOP)" in line for line in lines)
    assert "not using the configured database, leases, broker, result backend" in done.stdout
    assert _tables(pg_url) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]
    with Inventory.from_url(f"sqlite:///{folder / 'inventory.sqlite3'}") as inventory:
        _check_demo_sku(inventory, "WIDGET")
        assert inventory.invariant_violations() == []
        assert inventory.rejection_counts() == {"WIDGET": 1}


def test_demo_on_the_configured_postgresql_and_redis_reruns_in_the_same_folder(
    tmp_path: Path, pg_url: str
) -> None:
    """After a default run (``make demo``) left its markers in the folder, two runs on the configured
    services each freeze worker A again and end with their own DEMO SKU."""
    folder = tmp_path / "demo"
    run_demo(folder, {})
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
    for run in ("first", "first", "second"):
        monkeypatch.setenv("RESERVATIONS_FAILPOINT_DIR", str(tmp_path / run))
        failpoint("after_write")
    fired = [r for r in caplog.records if r.getMessage().startswith("failpoint after_write: sleep:0")]
    assert len(fired) == 2


def test_demo_on_a_configured_database_that_does_not_answer_is_one_line_and_exit_4(tmp_path: Path) -> None:
    unreachable = {"RESERVATIONS_DATABASE_URL": "postgresql://app:s3cret@127.0.0.1:1/inv"}
    done = subprocess.run(
        [SCRIPT, "demo", "--folder", str(tmp_path / "demo"), "--use-configured"],
        env={**_clean_env(), **unreachable, "NO_COLOR": "1"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 4, done.stdout + done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "postgresql://app:***@127.0.0.1:1/inv" in done.stderr and "s3cret" not in done.stdout + done.stderr
