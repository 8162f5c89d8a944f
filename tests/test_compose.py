"""The reference deployment file stays valid and production-shaped: redelivery-safe broker settings, restart
policies, passwords only from secret files, light health checks that work against what the processes write,
resource limits, worker events, a RabbitMQ profile; and an image that installs the project, not a checkout.
With every profile: images pinned to releases, rotated logs, ports on loopback only, a Redis that asks for
its password and refuses writes when full rather than evict, Flower behind basic auth on the app's broker;
the app through PgBouncer in transaction pooling, with one ttl bounding leases, database and pooler; a
PostgreSQL standby made by its own entrypoint script, which postgres waits for only when told.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from fencing.manager import lease_backend
from reservations import schema
from tasks.settings import Settings, SettingsError
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.compose import COMPOSE, compose, resolved
from testing.harness import free_port, wait_until
from testing.pg_cluster import PG_BIN, pg_cluster, pg_unavailable, server_folder
from testing.redis_servers import redis_server

ROOT = Path(__file__).resolve().parent.parent
LONG_RUNNING = ("redis", "postgres", "rabbitmq", "worker", "beat")
ONE_SHOT = ("migrate", "demo")
APP = ("migrate", "worker", "beat", "demo")
SECRETS = ("postgres_password", "rabbitmq_password", "redis_password", "grafana_admin_password",
           "flower_auth")  # fmt: skip
REDIS_SECRET = "/run/secrets/redis_password"

needs_compose = pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is missing")


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
    assert {s["file"].rsplit("/", 1)[1] for s in config["secrets"].values()} == set(SECRETS)

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
        assert "redis_password" in mounted(services[name]), name
    assert "rabbitmq_password" in mounted(services["rabbitmq"])
    assert "redis_password" in mounted(services["redis"])


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


ETCD_URL = "etcd://etcd1:2379,etcd2:2379,etcd3:2379/reservations"


def test_etcd_is_a_profile_and_the_lease_coordinator_a_choice(services: dict[str, dict[str, Any]]) -> None:
    """Three etcd members behind the etcd profile, each advertising the address the others and the app
    reach it on; the app's leases stay on Redis unless both lease variables are exported, and then the
    worker's settings take the members' URL as an etcd lease URL."""
    worker = services["worker"]["environment"]
    assert worker["RESERVATIONS_LEASE_URL"] == "redis://redis:6379/2"
    assert worker["RESERVATIONS_LEASE_PASSWORD_FILE"] == REDIS_SECRET
    chosen = resolved(
        "--profile", "etcd", RESERVATIONS_LEASE_URL=ETCD_URL, RESERVATIONS_LEASE_PASSWORD_FILE=""
    )
    members = {name: chosen["services"][name] for name in ("etcd1", "etcd2", "etcd3")}
    peers = []
    for name, member in members.items():
        assert member["profiles"] == ["etcd"], name
        assert member["image"].startswith("quay.io/coreos/etcd:v3.5."), member["image"]
        env = member["environment"]
        assert env["ETCD_NAME"] == name
        assert env["ETCD_ADVERTISE_CLIENT_URLS"] == f"http://{name}:2379"
        assert env["ETCD_INITIAL_ADVERTISE_PEER_URLS"] == f"http://{name}:2380"
        assert env["ETCD_AUTO_COMPACTION_RETENTION"] and int(env["ETCD_QUOTA_BACKEND_BYTES"]) > 0
        assert "endpoint" in member["healthcheck"]["test"] and "health" in member["healthcheck"]["test"]
        peers.append(f"{name}=http://{name}:2380")
    assert {m["environment"]["ETCD_INITIAL_CLUSTER"] for m in members.values()} == {",".join(peers)}
    # A data volume each (docker-compose 1.x writes "source:target:mode", 2.x a mapping).
    volumes = [m["volumes"][0] for m in members.values()]
    assert len({v["source"] if isinstance(v, dict) else v.split(":")[0] for v in volumes}) == 3
    for name in ("worker", "beat", "api", "migrate"):
        env = chosen["services"][name]["environment"]
        assert env["RESERVATIONS_LEASE_URL"] == ETCD_URL, name
        assert env["RESERVATIONS_LEASE_PASSWORD_FILE"] == "", name
    # The members the URL names are the profile's, on their client ports; the worker accepts the URL
    # with the file's lease ttl (etcd keeps whole seconds, 2 at least).
    env = chosen["services"]["worker"]["environment"]
    hosts = urlsplit(env["RESERVATIONS_LEASE_URL"]).netloc.split(",")
    assert [f"http://{host}" for host in hosts] == [
        m["environment"]["ETCD_ADVERTISE_CLIENT_URLS"] for m in members.values()
    ]
    settings = Settings.from_env({k: v for k, v in env.items() if not k.endswith("PASSWORD_FILE")})
    assert settings.lease_url == ETCD_URL and lease_backend(settings.lease_url) == "etcd"
    assert settings.lease_ttl == int(settings.lease_ttl) >= 2


def test_the_image_installs_the_project_not_an_editable_checkout() -> None:
    installs = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if "pip install" in line]
    assert installs and not [line for line in installs if re.search(r"\s(-e|--editable)\s", line)]
    assert any(".whl" in line for line in installs)


# -- what the settings and the health checks read --------------------------------------------------------


def test_settings_take_passwords_from_files(tmp_path: Path) -> None:
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd%\n")  # a trailing newline, as `echo` or an editor leave it
    settings = Settings.from_env(
        {
            "RESERVATIONS_DATABASE_URL": "postgresql://app@db:5432/inv",
            "RESERVATIONS_DATABASE_PASSWORD_FILE": str(secret),
            "RESERVATIONS_BROKER_URL": "amqp://app@mq:5672/",
            "RESERVATIONS_BROKER_PASSWORD_FILE": str(secret),
        }
    )
    assert settings.database_url == "postgresql://app:p%40ss%3Aw%2Frd%25@db:5432/inv"
    assert settings.lease_url == settings.database_url
    assert settings.broker_url == "amqp://app:p%40ss%3Aw%2Frd%25@mq:5672/"
    assert "p%40ss" not in repr(settings)
    # Unset or empty: the URL as given.
    given = {"RESERVATIONS_BROKER_URL": "redis://r/0", "RESERVATIONS_BROKER_PASSWORD_FILE": ""}
    assert Settings.from_env(given).broker_url == "redis://r/0"
    with pytest.raises(SettingsError, match="RESERVATIONS_DATABASE_PASSWORD_FILE"):
        Settings.from_env(
            {
                "RESERVATIONS_DATABASE_URL": "postgresql://app:other@db/inv",
                "RESERVATIONS_DATABASE_PASSWORD_FILE": str(secret),
            }
        )
    with pytest.raises(SettingsError, match="cannot read"):
        Settings.from_env(
            {
                "RESERVATIONS_DATABASE_URL": "postgresql://db/i",
                "RESERVATIONS_DATABASE_PASSWORD_FILE": str(tmp_path / "missing"),
            }
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
    beat_command = health_command(services["beat"])

    def beat_check(where: Path) -> str:
        return beat_command.replace("/tmp", str(where))

    wait_until(
        lambda: shell_passes(worker_check) and shell_passes(beat_check(folder)), timeout=30, what="healthy"
    )

    # Files an hour old are unhealthy: shown on copies, which no process rewrites between aging and check
    # (beat rewrites its schedule every half second here).
    aged = folder / "aged"
    aged.mkdir()
    for path in [heartbeat, *folder.glob("celerybeat-schedule*")]:
        copy = Path(shutil.copy2(path, aged))
        os.utime(copy, (copy.stat().st_atime, copy.stat().st_mtime - 3600))
    assert not shell_passes(worker_check.replace(str(heartbeat), str(aged / heartbeat.name)))
    assert not shell_passes(beat_check(aged))
    # The live files, aged the same way, are healthy again once the worker and beat write them.
    for path in [heartbeat, *folder.glob("celerybeat-schedule*")]:
        os.utime(path, (path.stat().st_atime, path.stat().st_mtime - 3600))
    wait_until(lambda: shell_passes(worker_check), timeout=15, what="the worker to touch its heartbeat")
    wait_until(lambda: shell_passes(beat_check(folder)), timeout=15, what="beat to rewrite its schedule")


# -- every profile: pinned images, rotated logs, loopback ports, Redis's password and memory, Flower --------


def as_written() -> dict[str, Any]:
    """compose.yaml as written (anchors resolved, no variable substituted)."""
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


PROFILES = sorted({profile for s in as_written()["services"].values() for profile in s.get("profiles", [])})


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the deployment (compose file, what it builds and mounts) with a dummy file for each secret,
    as an operator's folder is once the secrets are made: compose checks what a profile mounts."""
    folder = tmp_path_factory.mktemp("project")
    for name in ("compose.yaml", "Dockerfile"):
        shutil.copy(ROOT / name, folder / name)
    shutil.copytree(ROOT / "deploy", folder / "deploy")
    for secret in as_written()["secrets"].values():
        path = folder / secret["file"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("dummy\n")
    return folder


@pytest.fixture(scope="module")
def everything(project: Path) -> dict[str, dict[str, Any]]:
    """Every service of every profile, resolved."""
    if shutil.which("docker-compose") is None:
        pytest.skip("docker-compose is missing")
    every = [arg for profile in PROFILES for arg in ("--profile", profile)]
    found: dict[str, dict[str, Any]] = resolved(*every, file=project / "compose.yaml")["services"]
    return found


def test_the_file_has_profiles() -> None:
    assert {"rabbitmq", "etcd", "monitoring", "flower", "pg-standby"} <= set(PROFILES)


@needs_compose
@pytest.mark.parametrize("profile", ["", *PROFILES])
def test_compose_accepts_the_file_with_each_profile(project: Path, profile: str) -> None:
    compose(*(("--profile", profile) if profile else ()), "config", "-q", file=project / "compose.yaml")


def test_every_image_is_pinned_to_a_release(everything: dict[str, dict[str, Any]]) -> None:
    """An exact version, never latest nor a major alone: a `pull` later gets the same servers."""
    for name, service in everything.items():
        if "build" in service:  # the project's own image, built from the Dockerfile checked below
            continue
        repository, _, tag = service["image"].rpartition(":")
        assert repository and "/" not in tag, f"{name}: {service['image']} has no tag"
        # PostgreSQL numbers its releases major.minor since 10 (15.7); the others major.minor.patch.
        release = r"\d+\.\d+" if repository == "postgres" else r"v?\d+\.\d+\.\d+"
        assert re.match(rf"{release}(?:$|[-.])", tag), f"{name}: {service['image']} is not a release"
    dockerfile = (ROOT / "Dockerfile").read_text()
    bases = re.findall(r"^ARG \w+_IMAGE=(\S+)|^FROM (\S+)", dockerfile, re.MULTILINE)
    images = [arg or base for arg, base in bases if not (arg or base).startswith("$")]
    assert images
    for image in images:
        assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[-\w.]*", image), f"Dockerfile: {image} is not a release"


def test_every_service_rotates_its_logs(everything: dict[str, dict[str, Any]]) -> None:
    anchor = as_written()["x-logging"]
    assert anchor["driver"] == "json-file"
    assert anchor["options"]["max-size"] and int(anchor["options"]["max-file"]) > 1
    for name, service in everything.items():
        assert service.get("logging") == anchor, name


def test_ports_are_published_on_loopback_only(everything: dict[str, dict[str, Any]]) -> None:
    published = {}
    for name, service in everything.items():
        assert service.get("network_mode") != "host", name
        for port in service.get("ports", []):
            # docker-compose 1.x writes "127.0.0.1:5555:5555/tcp", 2.x a mapping with host_ip.
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).rsplit(":", 2)[0]
            assert host_ip == "127.0.0.1", f"{name}: {port}"
            published[name] = port
    assert {"flower", "prometheus", "grafana"} <= set(published)


def size(text: str | int, *, redis: bool = False) -> int:
    """A byte count as Redis (1mb = 2**20, 1m = 10**6) or Docker (1M = 2**20) writes it."""
    if isinstance(text, int) or str(text).isdigit():
        return int(text)
    matched = re.fullmatch(r"(\d+)\s*([kmg])(b?)", str(text).lower())
    assert matched, text
    power = "kmg".index(matched[2]) + 1
    base = 1000 if redis and not matched[3] else 1024
    return int(matched[1]) * base**power


def test_redis_refuses_writes_when_full_below_its_memory_limit(
    everything: dict[str, dict[str, Any]],
) -> None:
    redis = everything["redis"]
    options = dict(zip(redis["command"][::2], redis["command"][1::2], strict=True))
    assert options["--maxmemory-policy"] == "noeviction"
    limit = size(redis["deploy"]["resources"]["limits"]["memory"])
    assert 0 < size(options["--maxmemory"], redis=True) < limit


def test_redis_asks_for_a_password_every_app_service_reads_from_the_secret(
    everything: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    redis = everything["redis"]
    assert [s["source"] if isinstance(s, dict) else s for s in redis["secrets"]] == ["redis_password"]
    script = redis["entrypoint"][2]
    assert REDIS_SECRET in script and "requirepass" in script
    assert not [arg for arg in redis["command"] if "pass" in arg.lower()]  # never on a command line
    check = " ".join(redis["healthcheck"]["test"][1:])
    assert "REDISCLI_AUTH" in check and REDIS_SECRET in check

    secret = tmp_path / "redis_password"
    secret.write_text("0123abcd\n")
    for name in APP:
        env = everything[name]["environment"]
        files = {key for key, value in env.items() if key.endswith("PASSWORD_FILE") and value == REDIS_SECRET}
        assert files == {
            "RESERVATIONS_BROKER_PASSWORD_FILE",
            "RESERVATIONS_RESULT_BACKEND_PASSWORD_FILE",
            "RESERVATIONS_LEASE_PASSWORD_FILE",
        }, name
        # What the settings make of it, the secret's path pointed at this test's file.
        local = {key: str(secret) if value == REDIS_SECRET else value for key, value in env.items()}
        local["RESERVATIONS_DATABASE_PASSWORD_FILE"] = ""
        settings = Settings.from_env(local)
        for url in (settings.broker_url, settings.result_backend, settings.lease_url):
            assert urlsplit(url).password == "0123abcd" and urlsplit(url).hostname == "redis", name
        assert "0123abcd" not in repr(settings) and "0123abcd" not in json.dumps(settings.report())


def run_shell(command: str, **env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, **env}
    return subprocess.run(["sh", "-c", command], env=environment, capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is missing")
def test_redis_starts_with_the_secret_and_its_health_check_authenticates(
    everything: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The compose file's own entrypoint script and health check, run against a real redis-server with the
    container's paths pointed at this test's folder."""
    redis = everything["redis"]
    secret, wrong = tmp_path / "redis_password", tmp_path / "wrong_password"
    secret.write_text("5ecret-0f-the-test\n")
    wrong.write_text("not-it\n")
    run_dir = tmp_path / "run"

    def local(text: str) -> str:  # compose's $$ is a $; the container's paths are this test's
        return text.replace("$$", "$").replace(REDIS_SECRET, str(secret)).replace("/run/redis", str(run_dir))

    kind, _, script, name = redis["entrypoint"]
    assert (kind, _) == ("sh", "-c")
    script = local(script).replace("chown -R redis", ": chown")
    script = script.replace("docker-entrypoint.sh redis-server", "redis-server")  # the image's, then gosu
    port = free_port()
    own = ["--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""]
    with (tmp_path / "redis.log").open("wb") as log:
        server = subprocess.Popen(["sh", "-c", script, name, *redis["command"], *own], stdout=log, stderr=log)
    try:
        cli = f"redis-cli -p {port}"

        def up() -> bool:
            assert server.poll() is None, (tmp_path / "redis.log").read_text()
            return "NOAUTH" in run_shell(f"{cli} ping").stdout

        wait_until(up, timeout=30, what="redis-server to answer")
        assert stat.S_IMODE((run_dir / "auth.conf").stat().st_mode) == 0o600
        check = local(redis["healthcheck"]["test"][1]).replace("redis-cli", cli)
        healthy = run_shell(check)
        assert healthy.returncode == 0, healthy
        assert "5ecret" not in healthy.stdout + healthy.stderr
        assert run_shell(check.replace(str(secret), str(wrong))).returncode != 0
        config = run_shell(f"{cli} config get maxmemory-policy", REDISCLI_AUTH="5ecret-0f-the-test").stdout
        assert config.split() == ["maxmemory-policy", "noeviction"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_flower_asks_for_a_password_and_watches_the_apps_broker(
    everything: dict[str, dict[str, Any]],
) -> None:
    flower = everything["flower"]
    assert flower["profiles"] == ["flower"]
    mounted = {s["source"] if isinstance(s, dict) else s for s in flower["secrets"]}
    assert {"flower_auth", "redis_password", "rabbitmq_password"} <= mounted
    script = flower["entrypoint"][2]
    # Basic auth from the secret, through the environment: Flower reads FLOWER_BASIC_AUTH itself.
    assert re.search(r"FLOWER_BASIC_AUTH=\"\$\$\(cat /run/secrets/flower_auth\)\"", script), script
    assert "export FLOWER_BASIC_AUTH" in script and 'exec "$$@"' in script
    assert flower["command"][:2] == ["celery", "flower"]
    on_command_line = ("--basic-auth", "--basic_auth", "--broker")
    assert not [arg for arg in flower["command"] if arg.startswith(on_command_line)]
    worker = everything["worker"]["environment"]
    for key in ("RESERVATIONS_BROKER_URL", "RESERVATIONS_BROKER_PASSWORD_FILE"):
        assert flower["environment"][key] == worker[key], key
    helper = next(v.split(":")[1] for v in flower["volumes"] if v.split(":")[0].endswith("broker_url.py"))
    assert f'CELERY_BROKER_URL="$$(python {helper})"' in script

    # With RabbitMQ chosen, Flower follows.
    chosen = resolved(
        "--profile", "flower", "--profile", "rabbitmq",
        file=COMPOSE,
        RESERVATIONS_BROKER_URL="amqp://reservations@rabbitmq:5672/",
        RESERVATIONS_BROKER_PASSWORD_FILE="/run/secrets/rabbitmq_password",
    )["services"]  # fmt: skip
    assert chosen["flower"]["environment"] == {
        key: chosen["worker"]["environment"][key] for key in chosen["flower"]["environment"]
    }
    assert chosen["flower"]["environment"]["RESERVATIONS_BROKER_URL"].startswith("amqp://")


@pytest.mark.parametrize("url", ["redis://redis:6379/0", "amqp://reservations@rabbitmq:5672/", "redis://r"])
def test_flowers_broker_url_is_the_one_the_settings_give(tmp_path: Path, url: str) -> None:
    secret = tmp_path / "password"
    secret.write_text("p@ss:w/rd%\n")
    helper = ROOT / "deploy" / "flower" / "broker_url.py"
    for env in (
        {"RESERVATIONS_BROKER_URL": url, "RESERVATIONS_BROKER_PASSWORD_FILE": str(secret)},
        {"RESERVATIONS_BROKER_URL": url, "RESERVATIONS_BROKER_PASSWORD_FILE": ""},
    ):
        done = subprocess.run(
            [sys.executable, str(helper)], env=env, capture_output=True, text=True, timeout=30, check=True
        )
        assert done.stdout.strip() == Settings.from_env(env).broker_url


# -- PgBouncer: the app through the pooler, the bounds in the database, one ttl everywhere ----------------


POSTGRES_SECRET = "/run/secrets/postgres_password"


def ini_of(service: dict[str, Any]) -> dict[str, str]:
    """The pgbouncer.ini the service's entrypoint writes, as option -> value."""
    script = service["entrypoint"][2]
    body = script.split("<<'INI'\n", 1)[1].split("\nINI\n", 1)[0]
    pairs = (line.split("=", 1) for line in body.splitlines() if "=" in line and not line.startswith(";"))
    return {name.strip(): value.strip() for name, value in pairs}


def test_the_app_goes_through_the_pooler_and_migrations_go_direct(
    everything: dict[str, dict[str, Any]],
) -> None:
    for name in ("worker", "beat", "metrics"):
        env = everything[name]["environment"]
        assert urlsplit(env["RESERVATIONS_DATABASE_URL"]).hostname == "pgbouncer", name
        assert env["RESERVATIONS_DATABASE_POOLING"] == "transaction", name
        assert "pgbouncer" in everything[name]["depends_on"], name
        # A combination the settings accept (the secrets exist only in the containers).
        Settings.from_env({k: v for k, v in env.items() if not k.endswith("_PASSWORD_FILE")})
    migrate = everything["migrate"]["environment"]
    assert urlsplit(migrate["RESERVATIONS_DATABASE_URL"]).hostname == "postgres"
    assert migrate["RESERVATIONS_DATABASE_POOLING"] == "session"


def test_one_ttl_bounds_the_leases_the_database_and_the_pooler(everything: dict[str, dict[str, Any]]) -> None:
    """A frozen holder's row locks must go within a lease ttl behind the pooler: PostgreSQL's own bounds
    (every server session starts with them) and PgBouncer's idle_transaction_timeout equal the workers'
    ttl, which a worker checks at start (docs/operations.md, "PgBouncer")."""
    ttl = everything["worker"]["environment"]["RESERVATIONS_LEASE_TTL"]
    command = everything["postgres"]["command"]
    assert f"idle_in_transaction_session_timeout={ttl}s" in command
    assert f"lock_timeout={ttl}s" in command
    ini = ini_of(everything["pgbouncer"])
    assert ini["idle_transaction_timeout"] == ttl
    assert ini["pool_mode"] == "transaction"
    # Runs on every PgBouncer the docs name: 1.18 refuses max_prepared_statements (added in 1.21).
    assert "max_prepared_statements" not in ini


@pytest.mark.skipif(not os.access("/usr/sbin/pgbouncer", os.X_OK), reason="pgbouncer is missing")
def test_pgbouncer_starts_from_the_secret_and_asks_for_the_password(
    everything: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """The compose file's own entrypoint script, run as the postgres user against a real pgbouncer and the
    test PostgreSQL, with the container's paths, port and server pointed at this test's."""
    import pwd

    import psycopg

    from testing.pgbouncer import pooled_role

    # A folder the postgres user can reach (pytest's own are its owner's only), as the container's /tmp.
    owner = pwd.getpwnam("postgres")
    base = Path(tempfile.mkdtemp(prefix="compose-pgbouncer-"))
    os.chmod(base, 0o755)
    folder = base / "run"
    folder.mkdir()
    os.chown(folder, owner.pw_uid, owner.pw_gid)
    secret = base / "postgres_password"
    secret.write_text("5ecret-0f-the-test\n")
    secret.chmod(0o644)
    port = free_port()
    kind, _, script, name = [*everything["pgbouncer"]["entrypoint"], "pgbouncer"][:4]
    assert (kind, _) == ("sh", "-c")
    with pooled_role() as role:
        replacements = {
            "$$": "$", POSTGRES_SECRET: str(secret), "/tmp/pgbouncer": str(folder),
            '"reservations" "%s"': f'"{role}" "%s"', "host=postgres": "host=127.0.0.1",
            "dbname=reservations": "dbname=test", "listen_addr = 0.0.0.0": "listen_addr = 127.0.0.1",
            "listen_port = 6432": f"listen_port = {port}", "exec pgbouncer": "exec /usr/sbin/pgbouncer",
            "admin_users = reservations": f"admin_users = {role}",
        }  # fmt: skip
        for old, new in replacements.items():
            assert old in script, old
            script = script.replace(old, new)
        log = (tmp_path / "pgbouncer.log").open("wb")
        server = subprocess.Popen(["sh", "-c", script, name], user="postgres", stdout=log, stderr=log)
        try:
            url = f"postgresql://{role}@127.0.0.1:{port}/reservations"

            def up() -> bool:
                assert server.poll() is None, (tmp_path / "pgbouncer.log").read_text()
                try:
                    psycopg.connect(url, password="5ecret-0f-the-test", connect_timeout=2).close()
                except psycopg.OperationalError:
                    return False
                return True

            wait_until(up, timeout=20, what="pgbouncer to let the role in")
            assert stat.S_IMODE((folder / "userlist.txt").stat().st_mode) == 0o600
            with pytest.raises(psycopg.OperationalError, match="SASL authentication failed"):
                psycopg.connect(url, password="not-it", connect_timeout=2).close()
            with psycopg.connect(url, password="5ecret-0f-the-test", prepare_threshold=None) as conn:
                assert conn.execute("SELECT current_user").fetchone() == (role,)
            # The role may RECONNECT the pooler's server sessions (new role settings reach them): the
            # admin console speaks the simple query protocol only.
            console = url.rsplit("/", 1)[0] + "/pgbouncer"
            with psycopg.connect(console, password="5ecret-0f-the-test", autocommit=True) as admin:
                done = admin.pgconn.exec_(b"RECONNECT")
                assert done.status == psycopg.pq.ExecStatus.COMMAND_OK, done.error_message
        finally:
            server.terminate()
            server.wait(timeout=10)
            log.close()
            shutil.rmtree(base, ignore_errors=True)


# -- the pg-standby profile: a synchronous standby of postgres, made by its own entrypoint script ----------


def settings_of(command: list[str]) -> dict[str, str]:
    """A postgres command's ``-c name=value`` options, as name -> value."""
    pairs = [command[i + 1] for i, arg in enumerate(command) if arg == "-c"]
    return dict(pair.split("=", 1) for pair in pairs)


def test_the_standby_is_a_profile_and_postgres_waits_for_it_only_when_told(
    everything: dict[str, dict[str, Any]], project: Path
) -> None:
    """Without the variable postgres waits for no standby (a commit that waits for one that is not there
    never returns); with it, for the standby by the name the standby gives. Once promoted the standby
    bounds sessions as postgres does, and itself waits for none."""
    primary, standby = everything["postgres"], everything["postgres-standby"]
    assert standby["profiles"] == ["pg-standby"] and primary.get("profiles") is None
    assert settings_of(primary["command"])["synchronous_standby_names"] == ""
    told = resolved(
        "--profile", "pg-standby", file=project / "compose.yaml", RESERVATIONS_PG_SYNC_STANDBY="standby"
    )["services"]
    assert settings_of(told["postgres"]["command"])["synchronous_standby_names"] == "standby"
    assert standby["environment"]["STANDBY_NAME"] == "standby"
    ours = settings_of(standby["command"])
    assert "synchronous_standby_names" not in ours
    assert ours == {
        k: v for k, v in settings_of(primary["command"]).items() if k != "synchronous_standby_names"
    }
    assert standby["environment"]["REPLICATION_PASSWORD_FILE"] == POSTGRES_SECRET
    assert standby["environment"]["PRIMARY_HOST"] == "postgres"
    for service in (primary, standby):
        assert any(v.endswith(":/etc/postgresql/pg_hba.conf:ro") for v in service["volumes"])


@pytest.mark.skipif(pg_unavailable() is not None, reason=str(pg_unavailable()))
def test_the_standby_entrypoint_makes_a_synchronous_standby_of_postgres(
    everything: dict[str, dict[str, Any]],
) -> None:
    """The profile's own entrypoint script, run as the postgres user against a local primary started with
    postgres's settings and client rules (the container's paths pointed at this test's): a base backup,
    then a standby the primary counts as synchronous; started again, it follows without a new backup."""
    primary, standby = everything["postgres"], everything["postgres-standby"]
    folder = server_folder("compose-standby-")
    try:
        for name in ("pg_hba.conf", "standby-entrypoint.sh"):
            shutil.copy(ROOT / "deploy" / "postgres" / name, folder / name)
        secret = folder / "postgres_password"
        secret.write_text("5ecret-0f-the-test\n")
        for path in folder.iterdir():
            shutil.chown(path, "postgres", "postgres")
        local = {"hba_file": str(folder / "pg_hba.conf"), "synchronous_standby_names": "standby"}
        settings = {**settings_of(primary["command"]), **local}
        quoted = {name: f"'{value}'" for name, value in settings.items()}
        with pg_cluster(standby=False, primary_settings=quoted) as cluster:
            wrong = cluster.primary.query("SELECT error FROM pg_hba_file_rules WHERE error <> ''")
            assert wrong == []
            rules = cluster.primary.query("SELECT database, user_name, auth_method FROM pg_hba_file_rules")
            assert (["replication"], ["reservations"], "scram-sha-256") in rules

            server = cluster.standby
            env = {
                **standby["environment"],
                "PRIMARY_HOST": "127.0.0.1", "PRIMARY_PORT": str(cluster.primary.port),
                "REPLICATION_USER": "postgres", "REPLICATION_PASSWORD_FILE": str(secret),
                "PGDATA": str(server.data), "HOME": str(folder),
                "PATH": f"{PG_BIN}:{os.environ['PATH']}",
            }  # fmt: skip
            options = {**settings_of(standby["command"]), "hba_file": str(folder / "pg_hba.conf")}
            command = [
                "sh", str(folder / "standby-entrypoint.sh"), str(PG_BIN / "postgres"), "-p", str(server.port),
                *(arg for name, value in options.items() for arg in ("-c", f"{name}={value}")),
                "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
            ]  # fmt: skip
            for _ in range(2):  # the first start makes the standby, the second finds it made
                server.start(command, env)
                cluster.wait_streaming()
                cluster.primary.query("CREATE TABLE IF NOT EXISTS replicated (n int)")
                cluster.primary.query("INSERT INTO replicated VALUES (1)")  # returns: the standby has it
                server.stop()
            assert stat.S_IMODE((folder / "standby.pgpass").stat().st_mode) == 0o600
            assert "5ecret-0f-the-test" in (folder / "standby.pgpass").read_text()
            conf = (server.data / "postgresql.auto.conf").read_text()
            assert "application_name=standby" in conf and "5ecret" not in conf
            assert (server.data / "standby.signal").exists()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
