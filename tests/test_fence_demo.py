"""The README's first command, run as a user runs it: a subprocess with no service URLs set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import sqlalchemy as sa


def test_fence_demo_rejects_the_late_write_and_keeps_the_stock(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_URL")}
    database = tmp_path / "demo.sqlite3"
    done = subprocess.run(
        [sys.executable, "-m", "admin", "fence-demo", "--database", str(database), "--ttl", "0.2"],
        env={**env, "COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REJECTED" in done.stdout and "Invariant holds" in done.stdout
    engine = sa.create_engine(f"sqlite:///{database}")
    with engine.connect() as conn:
        available, token = conn.execute(sa.text("SELECT available, fence_token FROM demo_stock")).one()
        events = conn.execute(
            sa.text("SELECT event, token, previous_end FROM fencing_lease_events ORDER BY id")
        ).all()
    engine.dispose()
    assert (available, token) == (8, 2)
    assert [tuple(e) for e in events] == [
        ("acquired", 1, None),
        ("acquired", 2, "expired"),
        ("released", 2, None),
    ]
