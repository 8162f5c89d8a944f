"""The README's first command as a user runs it: ``reservations demo`` in a subprocess, no service URLs,
real Celery workers on embedded SQLite; then the SQLite file it leaves is checked independently.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from reservations import Inventory

SCRIPT = shutil.which("reservations", path=str(Path(sys.executable).parent)) or "reservations"


def test_demo_rejects_the_frozen_workers_write_and_keeps_the_invariants(tmp_path: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if not k.endswith("_URL") and not k.startswith("RESERVATIONS_")
    }
    folder = tmp_path / "demo"
    done = subprocess.run(
        [SCRIPT, "demo", "--folder", str(folder)],
        env={**env, "COLUMNS": "100"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "REJECTED" in done.stdout and "FAIL" not in done.stdout
    with Inventory.from_url(f"sqlite:///{folder / 'inventory.sqlite3'}") as inventory:
        level = inventory.stock("WIDGET")
        assert (level.on_hand, level.reserved, level.available) == (10, 7, 3)
        assert inventory.invariant_violations() == []
        assert inventory.rejection_counts() == {"WIDGET": 1}
        outcomes = [inventory.request_outcome(r.idempotency_key) for r in inventory.reservations("WIDGET")]
        assert sorted(o.status for o in outcomes if o) == ["reserved", "reserved"]
        assert sorted(o.epochs for o in outcomes if o) == [0, 1]
