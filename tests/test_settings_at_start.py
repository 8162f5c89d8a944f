"""Settings as a worker, a library user and the command line meet them at start: a bad one refused in one
line naming its variable (exit 2, or SettingsError for a library), a ``RESERVATIONS_*`` name that is no
setting warned about with the closest one, and ``config`` listing where each value came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reservations import schema
from tasks.settings import VARIABLES, Settings, unknown_name_warnings, unknown_names
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.support import cli, refused_worker, run

TYPO = "RESERVATIONS_LEASE_TLL"
TYPO_WARNING = f"{TYPO} is not a setting; did you mean RESERVATIONS_LEASE_TTL?"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    path = tmp_path / "password"
    path.write_text("p@ss:w/rd%\n")
    return path


# -- unknown names ---------------------------------------------------------------------------------------


def test_unknown_names_come_with_the_closest_setting() -> None:
    env = {
        TYPO: "5",
        "RESERVATIONS_BROKER": "redis://r/0",
        "RESERVATIONS_NOTHING_LIKE_IT": "1",
        "RESERVATIONS_DATABASE_PASSWORD_FILE": "/run/secrets/db",
        "RESERVATIONS_CHAOS_POSTGRES_URL": "postgresql://db/test",
        "PATH": "/bin",
    }
    assert unknown_names(env) == [
        ("RESERVATIONS_BROKER", "RESERVATIONS_BROKER_URL"),
        (TYPO, "RESERVATIONS_LEASE_TTL"),
        ("RESERVATIONS_NOTHING_LIKE_IT", None),
    ]
    assert TYPO_WARNING in unknown_name_warnings(env)
    assert "RESERVATIONS_NOTHING_LIKE_IT is not a setting" in unknown_name_warnings(env)


# -- a real worker ---------------------------------------------------------------------------------------


def _own_services(folder: Path) -> Settings:
    """A worker that needs no services: SQLite inventory and leases, Celery's SQLAlchemy transport."""
    return Settings(
        database_url=f"sqlite:///{folder / 'inventory.sqlite3'}",
        broker_url=f"sqla+sqlite:///{folder / 'broker.sqlite3'}",
        result_backend=f"db+sqlite:///{folder / 'results.sqlite3'}",
    )


@pytest.mark.slow
def test_a_worker_with_bad_settings_says_so_in_one_line_and_exits(tmp_path: Path) -> None:
    fifo = tmp_path / "broker-password"
    os.mkfifo(fifo)  # nobody writes to it: reading it would block the start
    env = worker_env(
        {
            **_own_services(tmp_path).to_env(),
            "RESERVATIONS_LEASE_TTL": "abc",
            "RESERVATIONS_MAX_EPOCHS": "0",
            "RESERVATIONS_LEASE_URL": "redis+socket://s1:26379/inventory",
            "RESERVATIONS_LEASE_PREFIX": "bad{prefix}",
            "RESERVATIONS_BROKER_PASSWORD_FILE": str(fifo),
        }
    )
    done = refused_worker(env)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr + done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    for named in (
        "RESERVATIONS_LEASE_TTL must be a number",
        "RESERVATIONS_MAX_EPOCHS must be between 1 and 100",
        "RESERVATIONS_BROKER_PASSWORD_FILE",
    ):
        assert named in lines[0]
    # The lease URL and prefix are checked once the values parse: the same worker, its ttl fixed.
    env["RESERVATIONS_LEASE_TTL"], env["RESERVATIONS_MAX_EPOCHS"] = "10", "3"
    del env["RESERVATIONS_BROKER_PASSWORD_FILE"]
    done = refused_worker(env)
    assert done.returncode == 2 and "Traceback" not in done.stderr + done.stdout
    (line,) = done.stderr.strip().splitlines()
    assert "RESERVATIONS_LEASE_URL: unsupported lease URL" in line and "RESERVATIONS_LEASE_PREFIX" in line


@pytest.mark.slow
def test_a_worker_warns_about_a_name_that_is_no_setting(tmp_path: Path) -> None:
    settings = _own_services(tmp_path)
    schema.upgrade(settings.database_url)  # a worker starts only on a schema it was built for
    env = worker_env({**settings.to_env(), TYPO: "5"})
    worker = CeleryProcess("typo", env, tmp_path / "worker.log")
    try:
        worker.start()
        worker.wait_ready()
        assert TYPO_WARNING in worker.log()
    finally:
        stop_all([worker])


def test_a_library_user_gets_settings_error_not_an_exit() -> None:
    """Importing ``tasks`` succeeds; constructing a client on the environment's settings raises."""
    program = (
        "import tasks\n"
        "try:\n"
        "    tasks.ReservationClient()\n"
        "except tasks.SettingsError as exc:\n"
        "    print('SettingsError:', exc)\n"
    )
    env = worker_env({"RESERVATIONS_LEASE_TTL": "abc"})
    done = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == (
        "SettingsError: RESERVATIONS_LEASE_TTL must be a number written with the digits 0-9, like 2 or 0.5, "
        "got 'abc'"
    )


# -- the command line ------------------------------------------------------------------------------------


def test_config_lists_every_setting_with_where_it_came_from(secret: Path) -> None:
    env = {
        "RESERVATIONS_DATABASE_URL": "postgresql://app@db/inv",
        "RESERVATIONS_DATABASE_PASSWORD_FILE": str(secret),
        "RESERVATIONS_LEASE_TTL": "10",
    }
    code, stdout, _ = run("--broker-url", "redis://:pw2@mq:6379/0", "config", "--json", env=env)
    assert code == 0
    rows = {row["name"]: row for row in json.loads(stdout)}
    assert list(rows) == [v.name for v in VARIABLES]
    assert rows["RESERVATIONS_DATABASE_URL"] == {
        "name": "RESERVATIONS_DATABASE_URL",
        "value": "postgresql://app:***@db/inv",
        "source": "file",
        "password_file": str(secret),
    }
    assert rows["RESERVATIONS_LEASE_TTL"]["source"] == "environment"
    assert rows["RESERVATIONS_LEASE_TTL"]["value"] == "10s"
    assert rows["RESERVATIONS_BROKER_URL"] == {
        "name": "RESERVATIONS_BROKER_URL",
        "value": "redis://:***@mq:6379/0",
        "source": "option",
    }
    assert rows["RESERVATIONS_LEASE_URL"]["source"] == "default"
    assert rows["RESERVATIONS_BATCH_SIZE"] == {
        "name": "RESERVATIONS_BATCH_SIZE",
        "value": "100",
        "source": "default",
    }
    assert "p%40ss" not in stdout and "pw2" not in stdout

    code, stdout, _ = run("config", env=env, columns=200)  # the table keeps each row on one line
    assert code == 0
    line = next(line for line in stdout.splitlines() if line.startswith("RESERVATIONS_DATABASE_URL"))
    assert line.split() == ["RESERVATIONS_DATABASE_URL", "postgresql://app:***@db/inv", "file", str(secret)]


def test_a_bad_setting_refuses_every_command_with_its_name(tmp_path: Path) -> None:
    bad = {"RESERVATIONS_LEASE_TTL": "abc", "RESERVATIONS_BATCHING": "maybe"}
    code, stdout, stderr = run("config", env=bad)
    assert code == 2 and stdout == ""
    assert "RESERVATIONS_LEASE_TTL must be a number" in stderr and "RESERVATIONS_BATCHING" in stderr
    # The installed script too: one line, exit 2, nothing read.
    done = cli("stock", env={**bad, "RESERVATIONS_DATABASE_URL": f"sqlite:///{tmp_path / 'none.sqlite3'}"})
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert "RESERVATIONS_LEASE_TTL" in done.stderr
    assert not (tmp_path / "none.sqlite3").exists()


def test_the_command_line_warns_about_a_name_that_is_no_setting() -> None:
    code, _, stderr = run("config", env={TYPO: "5"})
    assert code == 0
    assert stderr.strip() == f"warning: {TYPO_WARNING}"


def test_with_json_logs_the_command_line_writes_its_warnings_and_errors_as_json() -> None:
    json_logs = {"RESERVATIONS_LOG_FORMAT": "json", TYPO: "5"}
    code, _, stderr = run("config", env=json_logs)
    assert code == 0
    (warning,) = [json.loads(line) for line in stderr.splitlines()]
    assert warning["level"] == "WARNING" and warning["message"] == TYPO_WARNING
    code, _, stderr = run("config", env={**json_logs, "RESERVATIONS_LEASE_TTL": "abc"})
    assert code == 2
    lines = [json.loads(line) for line in stderr.splitlines()]  # a line that is not JSON fails here
    assert [line["level"] for line in lines] == ["WARNING", "ERROR"]
    assert "RESERVATIONS_LEASE_TTL must be a number" in lines[1]["message"]
