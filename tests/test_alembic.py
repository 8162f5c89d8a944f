"""The alembic CLI with the repository's alembic.ini: `upgrade head` migrates, and `alembic check` finds the
migrated database equal to the models on SQLite and PostgreSQL, and fails once the schema drifts by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from fencing.engines import make_engine
from reservations import schema
from testing.celery_processes import worker_env

ROOT = Path(__file__).resolve().parent.parent


def alembic(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI, from the repository root, with no RESERVATIONS_* setting but those in ``env``."""
    return subprocess.run(
        [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini"), *args],
        cwd=ROOT,
        env=worker_env(env or {}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture(params=["sqlite", "postgresql"])
def empty_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database: a new SQLite file or a fresh PostgreSQL schema."""
    if request.param == "postgresql":
        url: str = request.getfixturevalue("pg_url")
        return url
    return f"sqlite:///{tmp_path / 'alembic.sqlite3'}"


def alter(url: str, statement: str) -> None:
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(statement))
    finally:
        engine.dispose()


def test_upgrade_head_then_check_passes(empty_url: str) -> None:
    # The URL from the settings' variable, as a worker's environment would give it.
    upgraded = alembic("upgrade", "head", env={"RESERVATIONS_DATABASE_URL": empty_url})
    assert upgraded.returncode == 0, upgraded.stderr
    assert schema.current(empty_url) == schema.head()

    checked = alembic("-x", f"url={empty_url}", "check")
    assert checked.returncode == 0, checked.stderr
    assert "No new upgrade operations detected" in checked.stdout + checked.stderr


def test_check_fails_on_drift_made_by_hand(empty_url: str) -> None:
    schema.upgrade(empty_url)
    alter(empty_url, "ALTER TABLE stock ADD COLUMN note TEXT")
    narrowed = empty_url.startswith("postgresql")  # SQLite cannot change a column's type in place
    if narrowed:
        # Unbounded VARCHAR and TEXT count as one type; a length that differs from the model's does not.
        alter(empty_url, "ALTER TABLE reservations ALTER COLUMN idempotency_key TYPE varchar(100)")

    checked = alembic("-x", f"url={empty_url}", "check")
    assert checked.returncode != 0
    assert "remove_column" in checked.stderr and "note" in checked.stderr, checked.stderr
    if narrowed:
        assert "modify_type" in checked.stderr and "idempotency_key" in checked.stderr, checked.stderr


def test_no_database_named_is_an_error() -> None:
    checked = alembic("check")
    assert checked.returncode != 0
    assert "RESERVATIONS_DATABASE_URL" in checked.stderr
