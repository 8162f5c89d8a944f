"""The long commands (audit, archive, redrive --since) draw progress on stderr on a terminal, and say
nothing more than their result when piped or with --json, on SQLite and PostgreSQL. A terminal is what
Rich takes for one: ``TTY_COMPATIBLE=1`` stands for it here (import-skus and export-skus:
tests/test_cli_bulk.py).
"""

from __future__ import annotations

from pathlib import Path

from reservations import Inventory
from reservations.redrives import carried_request
from tasks.messages import request_fingerprint
from testing.harness import free_port
from testing.support import run

TERMINAL = {"TTY_COMPATIBLE": "1"}


def test_audit_and_archive_draw_progress_on_a_terminal_only(
    inventory: Inventory, inventory_url: str, tmp_path: Path
) -> None:
    inventory.add_sku("WIDGET", on_hand=3)
    env = {"RESERVATIONS_DATABASE_URL": inventory_url}
    archive = ("archive", "--before", "2d", "--to", str(tmp_path / "archive"), "--dry-run")
    for args, says, result in (
        (("audit",), "checking the invariants", "consistent: every invariant holds"),
        (archive, "archiving", "nothing to archive before"),
    ):
        piped = run(*args, env=env)
        assert piped.returncode == 0 and piped.stderr == "", piped.stderr
        drawn = run(*args, env={**env, **TERMINAL})
        assert drawn.returncode == 0, drawn.stderr
        assert says in drawn.stderr and "0:00:0" in drawn.stderr  # the spinner's line, with its time
        assert result in piped.stdout and result in drawn.stdout
        quiet = run(*args, "--json", env={**env, **TERMINAL})
        assert quiet.returncode == 0 and quiet.stderr == ""


def test_redrive_since_counts_the_dead_letters_it_checks_on_a_terminal(
    inventory: Inventory, inventory_url: str
) -> None:
    arguments = {"sku": "WIDGET", "quantity": 1}
    for n in range(3):
        inventory.record_outcome(
            f"dl-{n}",
            "reserve",
            "dead_lettered",
            {"reason": "backend unavailable", "request": carried_request("reserve", arguments)},
            worker="host:1",
            task_id=f"t-{n}",
            fingerprint=request_fingerprint("reserve", arguments),
        )
    env = {
        "RESERVATIONS_DATABASE_URL": inventory_url,
        "RESERVATIONS_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    piped = run("redrive", "--since", "1h", "--dry-run", env=env, columns=200)
    assert piped.returncode == 0 and piped.stderr == "", piped.stderr
    assert "dry run: 3 request(s) would be re-driven" in piped.stdout
    drawn = run("redrive", "--since", "1h", "--dry-run", env={**env, **TERMINAL}, columns=200)
    assert "checking dead letters" in drawn.stderr and "3/3" in drawn.stderr
    assert "dry run: 3 request(s) would be re-driven" in drawn.stdout
