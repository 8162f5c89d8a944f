"""The reference deployment file stays valid and production-shaped: redelivery-safe broker settings, restart
policies, passwords only from secret files, light health checks that work against what the processes write,
resource limits, worker events, a RabbitMQ profile; and an image that installs the project, not a checkout.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from admin.harness import CeleryProcess, redis_server, start_all, stop_all, wait_until, worker_env
from reservations import schema
from tasks.settings import Settings, SettingsError, url_with_password_file

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "compose.yaml"
LONG_RUNNING = ("redis", "postgres", "rabbitmq", "worker", "beat")
ONE_SHOT = ("migrate", "demo")
APP = ("migrate", "worker", "beat", "demo")

needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is missing")


def compose(*args: str, **variables: str) -> str:
    """``docker-compose -f compose.yaml ARGS`` with these variables set (and no profile from outside)."""
    done = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE), *args],
        env={**os.environ, "COMPOSE_PROFILES": "", **variables},
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def resolved(*args: str, **variables: str) -> dict[str, Any]:
    """``docker-compose config`` as data. docker-compose 1.x is a Python program whose own interpreter
    has PyYAML (this project does not depend on it); 2.x prints JSON when asked."""
    first_line = Path(shutil.which("docker-compose") or "").read_bytes()[:200].partition(b"\n")[0]
    if not first_line.startswith(b"#!"):
        data: dict[str, Any] = json.loads(compose(*args, "config", "--format", "json", **variables))
        return data
    to_json = "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"
    done = subprocess.run(
        [*first_line[2:].decode().split(), "-c", to_json],
        input=compose(*args, "config", **variables), capture_output=True, text=True, timeout=60, check=True,
    )
    data = json.loads(done.stdout)
    return data


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is missing")
    return resolved()


@pytest.fixture(scope="module")
def services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = config["services"]
    return found


def health_command(service: dict[str, Any]) -> str:
    kind, *rest = service["healthcheck"]["test"]
    assert kind == "CMD-SHELL", service["healthcheck"]
    command: str = rest[0]
    return command


@needs_compose
def test_compose_file_is_valid() -> None:
    text = compose("config")
    for needle in ("appendonly", "appendfsync", "service_completed_successfully", "celery"):
        assert needle in text


def test_long_running_services_restart_and_one_shots_do_not(services: dict[str, dict[str, Any]]) -> None:
    for name in LONG_RUNNING:
        assert services[name].get("restart") in ("always", "unless-stopped", "on-failure"), name
    for name in ONE_SHOT:
        assert services[name].get("restart") == "no", name


def test_passwords_come_only_from_secret_files(
    config: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    raw = COMPOSE.read_text()
    # No password with a default to fall back on, and none written into the file.
    assert not re.search(r"\$\{\w*PASS(WORD)?:?-", raw)
    assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", raw), "a URL with a password in it"
    for name, service in services.items():
        env = service.get("environment") or {}
        assert not [key for key in env if re.search(r"PASS(WORD)?$", key)], name
    assert {s["file"].rsplit("/", 1)[1] for s in config["secrets"].values()} == {
        "postgres_password", "rabbitmq_password"
    }

    def mounted(service: dict[str, Any]) -> set[str]:
        return {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}

    assert services["postgres"]["environment"]["POSTGRES_PASSWORD_FILE"] == "/run/secrets/postgres_password"
    assert "postgres_password" in mounted(services["postgres"])
    for name in APP:
        env = services[name]["environment"]
        secret = env["RESERVATIONS_DATABASE_PASSWORD_FILE"].removeprefix("/run/secrets/")
        assert secret in mounted(services[name]), name
        assert urlsplit(env["RESERVATIONS_DATABASE_URL"]).password is None, name
        assert "rabbitmq_password" in mounted(services[name]), name
    assert "rabbitmq_password" in mounted(services["rabbitmq"])


def test_health_checks_are_present_and_start_no_client(services: dict[str, dict[str, Any]]) -> None:
    for name in LONG_RUNNING:
        assert services[name].get("healthcheck", {}).get("test"), name
    for name in ("worker", "beat"):
        command = health_command(services[name])
        # A file's age, not `celery inspect ping` (a new Celery client and broker round trip per check).
        assert "celery" not in command.replace("celerybeat-schedule", ""), command
        assert "find " in command and "-mmin" in command, command
    heartbeat = services["worker"]["environment"]["RESERVATIONS_HEARTBEAT_FILE"]
    assert heartbeat in health_command(services["worker"])
    schedule = services["beat"]["entrypoint"][services["beat"]["entrypoint"].index("--schedule") + 1]
    assert Path(schedule).name in health_command(services["beat"])


def test_workers_send_events_and_every_service_has_limits(services: dict[str, dict[str, Any]]) -> None:
    assert "-E" in services["worker"]["entrypoint"]
    for name in (*LONG_RUNNING, "migrate"):
        limits = services[name].get("deploy", {}).get("resources", {}).get("limits", {})
        assert limits.get("cpus") and limits.get("memory"), name


def test_metrics_listen_on_every_interface_of_their_container(services: dict[str, dict[str, Any]]) -> None:
    """A container's loopback is its own: Prometheus in another container reaches a listener only when it
    binds every interface (the default is 127.0.0.1)."""
    assert services["worker"]["environment"]["RESERVATIONS_METRICS_HOST"] == "0.0.0.0"
    command = services["metrics"]["command"]
    assert command[command.index("--host") + 1] == "0.0.0.0"


def test_rabbitmq_is_a_profile_and_the_broker_a_choice(services: dict[str, dict[str, Any]]) -> None:
    assert services["rabbitmq"]["profiles"] == ["rabbitmq"]
    assert services["redis"].get("profiles") is None
    assert services["worker"]["environment"]["RESERVATIONS_BROKER_URL"] == "redis://redis:6379/0"
    chosen = resolved(
        "--profile",
        "rabbitmq",
        RESERVATIONS_BROKER_URL="amqp://reservations@rabbitmq:5672/",
        RESERVATIONS_BROKER_PASSWORD_FILE="/run/secrets/rabbitmq_password",
    )
    worker = chosen["services"]["worker"]["environment"]
    assert worker["RESERVATIONS_BROKER_URL"].startswith("amqp://")
    assert worker["RESERVATIONS_BROKER_PASSWORD_FILE"] == "/run/secrets/rabbitmq_password"


def test_the_image_installs_the_project_not_an_editable_checkout() -> None:
    installs = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if "pip install" in line]
    assert installs and not [line for line in installs if re.search(r"\s(-e|--editable)\s", line)]
    assert any(".whl" in line for line in installs)


# -- what the settings and the health checks read --------------------------------------------------------


def test_settings_take_passwords_from_files(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd%\n")  # a trailing newline, as `echo` or an editor leave it
    settings = Settings.from_env({
        "RESERVATIONS_DATABASE_URL": "postgresql://app@db:5432/inv",
        "RESERVATIONS_DATABASE_PASSWORD_FILE": str(secret),
        "RESERVATIONS_BROKER_URL": "amqp://app@mq:5672/",
        "RESERVATIONS_BROKER_PASSWORD_FILE": str(secret),
    })
    assert settings.database_url == "postgresql://app:p%40ss%3Aw%2Frd%25@db:5432/inv"
    assert settings.lease_url == settings.database_url
    assert settings.broker_url == "amqp://app:p%40ss%3Aw%2Frd%25@mq:5672/"
    assert "p%40ss" not in repr(settings)
    # Unset or empty: the URL as given.
    assert url_with_password_file({"RESERVATIONS_BROKER_PASSWORD_FILE": ""}, "BROKER", "redis://r/0") == (
        "redis://r/0"
    )
    with pytest.raises(SettingsError, match="RESERVATIONS_DATABASE_PASSWORD_FILE"):
        url_with_password_file(
            {"RESERVATIONS_DATABASE_PASSWORD_FILE": str(secret)}, "DATABASE", "postgresql://app:other@db/inv"
        )
    with pytest.raises(SettingsError, match="cannot read"):
        url_with_password_file(
            {"RESERVATIONS_DATABASE_PASSWORD_FILE": str(tmp_path / "missing")}, "DATABASE", "postgresql://db/i"
        )


def shell_passes(command: str) -> bool:
    return subprocess.run(["sh", "-c", command], capture_output=True, timeout=30, check=False).returncode == 0


@pytest.fixture
def worker_and_beat(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """A real worker touching its heartbeat file and a real beat writing its schedule, on a private Redis."""
    database = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"
    schema.upgrade(database)  # migrated first, as compose's one-shot migrate service does
    with redis_server(tmp_path / "redis") as server:
        settings = {
            "RESERVATIONS_BROKER_URL": server.url(0),
            "RESERVATIONS_RESULT_BACKEND": server.url(1),
            "RESERVATIONS_DATABASE_URL": database,
            "RESERVATIONS_HEARTBEAT_FILE": str(tmp_path / "worker.heartbeat"),
            "RESERVATIONS_EXPIRY_INTERVAL": "0.5",
        }
        env = worker_env(settings)
        processes = [
            CeleryProcess("health", env, tmp_path / "worker.log"),
            CeleryProcess("celerybeat", env, tmp_path / "beat.log", kind="beat"),
        ]
        try:
            start_all(processes)
            yield tmp_path / "worker.heartbeat", tmp_path
        finally:
            stop_all(processes)


@pytest.mark.slow
def test_health_checks_read_what_the_worker_and_beat_write(
    services: dict[str, dict[str, Any]], worker_and_beat: tuple[Path, Path]
) -> None:
    heartbeat, folder = worker_and_beat
    # The compose file's own commands, pointed at this test's files instead of the container's.
    worker_check = health_command(services["worker"]).replace(
        services["worker"]["environment"]["RESERVATIONS_HEARTBEAT_FILE"], str(heartbeat)
    )
    # The harness names beat's schedule after the process: "celerybeat-schedule*", as in the container.
    beat_check = health_command(services["beat"]).replace("/tmp", str(folder))
    wait_until(lambda: shell_passes(worker_check) and shell_passes(beat_check), timeout=30, what="healthy")

    # Files an hour old: unhealthy, until the worker touches its heartbeat and beat rewrites its schedule.
    for path in [heartbeat, *folder.glob("celerybeat-schedule*")]:
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - 3600))
    assert not shell_passes(worker_check) and not shell_passes(beat_check)
    wait_until(lambda: shell_passes(worker_check), timeout=15, what="the worker to touch its heartbeat")
    wait_until(lambda: shell_passes(beat_check), timeout=15, what="beat to rewrite its schedule")
