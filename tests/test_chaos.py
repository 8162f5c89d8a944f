"""``reservations chaos`` as an operator runs it: the console script in a subprocess, small and short, with
JSON output. The fenced run must come out clean with stale writes refused; the lease-only run of the same
workload must show what the fence prevents; nothing the run created may be left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from fencing.sql import make_engine
from reservations.proxy import DelayProxy
from tests.conftest import POSTGRES_URL

pytestmark = pytest.mark.slow

SCRIPT = shutil.which("reservations", path=str(Path(sys.executable).parent)) or "reservations"


def _chaos_schemas() -> set[str]:
    engine = make_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE :p"),
                {"p": "chaos_%"},
            )
            return {row[0] for row in rows}
    finally:
        engine.dispose()


def test_fenced_run_is_clean_and_lease_only_run_is_not(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESERVATIONS_")}
    schemas_before = _chaos_schemas()
    done = subprocess.run(
        [
            *(SCRIPT, "chaos", "--workers", "3", "--skus", "3", "--requests", "50", "--duration", "10"),
            *("--drain", "30", "--proxy-delay", "1.5", "--postgres-url", POSTGRES_URL),
            *("--folder", str(tmp_path / "logs"), "--pictures", str(tmp_path / "pictures"), "--json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    fenced, lease_only = report["fenced"], report["lease_only"]

    assert fenced["violations"] == 0, fenced["checks"]
    assert fenced["rejected_stale_writes"] >= 1, fenced
    assert fenced["checks"]["missing_outcomes"] == []
    assert sum(fenced["statuses"].values()) == fenced["enqueued"]
    # The faults really happened, in both runs alike.
    for run in (fenced, lease_only):
        assert run["faults"]["pool child frozen past its lease"] >= 1, run["faults"]
        assert run["faults"]["worker SIGKILL + restart"] == 1
        assert run["faults"]["lease Redis restart (data lost)"] == 1
        assert run["faults"]["client->postgres chunks delayed"] >= 1

    assert lease_only["violations"] >= 1, lease_only
    assert lease_only["checks"]["writes_after_newer_token"], lease_only["checks"]
    assert lease_only["rejected_stale_writes"] == 0  # nothing refuses a stale write without the fence
    # The pictures show what the numbers say: refused stale writes only in the fenced run, writes
    # behind a newer token only in the lease-only one.
    fenced_svg = Path(fenced["picture"]).read_text()
    lease_only_svg = Path(lease_only["picture"]).read_text()
    assert "refused, highest" in fenced_svg and "<polygon" not in fenced_svg
    assert "<polygon" in lease_only_svg and "refused, highest" not in lease_only_svg

    # Nothing is left behind: no new chaos schema, no worker or redis-server started for the run (the
    # workers carry the run's folder in their environment; the redis-servers run in it).
    assert _chaos_schemas() <= schemas_before
    assert _processes_mentioning(str(tmp_path)) == []


def test_delay_proxy_holds_client_chunks_and_keeps_the_conversation_intact() -> None:
    url = sa.engine.make_url(POSTGRES_URL)
    proxy = DelayProxy((url.host or "127.0.0.1", url.port or 5432), delay=0.4, fraction=1.0).start()
    engine = make_engine(url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False))
    try:
        with engine.connect() as conn:
            started = time.monotonic()
            assert conn.execute(sa.text("SELECT 41 + 1")).scalar() == 42
            assert time.monotonic() - started >= 0.4
        assert proxy.delayed_chunks >= 2  # the connection's startup and the query, each held back
    finally:
        engine.dispose()
        proxy.close()


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            blob = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
            cwd = str((proc / "cwd").resolve())
        except OSError:
            continue
        if text.encode() in blob or cwd.startswith(text):
            found.append(int(proc.name))
    return found
