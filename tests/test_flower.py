"""``reservations flower`` on every broker the workers take: a real Flower process and a real worker on a
private Redis, a RabbitMQ virtual host and a Sentinel deployment, checked through Flower's HTTP API (the
worker, a task's final state, the queue lengths of its Broker tab) behind basic auth read from a file;
on Sentinel the Broker tab still answers after a failover with the first sentinel of the URL gone.
Without services: the address and auth-file checks, and the primary's URL built from a sentinel URL.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from admin.cli.flower import broker_problem, exposure_problem, parse_basic_auth, primary_url, sentinels_of
from tasks import Settings, SettingsError, create_app
from testing.celery_processes import worker_env
from testing.harness import end_process, free_port, tls, wait_until
from testing.redis_servers import redis_server
from testing.redis_topologies import SentinelTopology, sentinel_topology
from testing.support import run
from testing.workers import cluster, migrated_database, rabbitmq_vhost

needs_flower = pytest.mark.skipif(
    importlib.util.find_spec("flower") is None,
    reason="Flower is not installed: pip install '.[flower]' (the dev extra has it)",
)

USER, PASSWORD = "ops", "flower-pw-7Qx"
START_TIMEOUT = 30.0
SEEN_TIMEOUT = 20.0


# -- without services ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "authenticated", "refused"),
    [
        ("127.0.0.1", False, False),
        ("::1", False, False),
        ("localhost", False, False),
        ("0.0.0.0", False, True),
        ("", False, True),
        ("flower.internal", False, True),
        ("0.0.0.0", True, False),
    ],
)
def test_flower_needs_a_password_anywhere_but_loopback(
    address: str, authenticated: bool, refused: bool
) -> None:
    assert (exposure_problem(address, authenticated) is not None) == refused


def test_an_auth_file_holds_user_password_entries() -> None:
    assert parse_basic_auth("ops:pw\n", "f") == ["ops:pw"]
    assert parse_basic_auth("a:1, b:2:3\nc:4\n\n", "f") == ["a:1", "b:2:3", "c:4"]
    for bad in ("", "\n", "justapassword", "ops:", ":pw", "a:1,nopw"):
        with pytest.raises(SettingsError) as caught:
            parse_basic_auth(bad, "--basic-auth-file f")
        assert "--basic-auth-file f" in str(caught.value)
        assert "justapassword" not in str(caught.value)  # the entry may be a password


def test_the_broker_tab_gets_the_primary_with_the_sentinel_urls_password_and_database() -> None:
    url = "sentinel://:p%40ss@s1:26379/3;sentinel://:p%40ss@s2/3"
    assert sentinels_of(url) == [("s1", 26379), ("s2", 26379)]
    assert primary_url(url, "10.0.0.5", 6380) == "redis://:p%40ss@10.0.0.5:6380/3"
    assert primary_url("sentinel://s1:26379/0", "::1", 6379) == "redis://[::1]:6379/0"


def test_flower_watches_every_broker_but_sqlalchemys() -> None:
    for url in ("redis://r:6379/0", "rediss://r/0", "sentinel://s1:26379/0;sentinel://s2/0", "amqp://u@q/v"):
        assert broker_problem(url) is None, url
    assert "no fanout" in (broker_problem("sqla+sqlite:///broker.sqlite3") or "")


@needs_flower
def test_flower_refuses_a_sqlalchemy_broker() -> None:
    done = run("flower", env={"RESERVATIONS_BROKER_URL": "sqla+sqlite:///broker.sqlite3"})
    assert done.returncode == 2 and "RESERVATIONS_BROKER_URL" in done.stderr, done.stderr


@pytest.fixture
def root_logger_kept() -> Iterator[None]:
    """Flower's option parsing sets the root logger up for its process (tornado's
    enable_pretty_logging): put it back for the tests that run after, in this process."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)
    for handler in root.handlers[:]:
        if type(handler.formatter).__module__ == "tornado.log":
            root.removeHandler(handler)


@needs_flower
@pytest.mark.parametrize("address", ["0.0.0.0", "::"])
@pytest.mark.usefixtures("root_logger_kept")
def test_flower_refuses_every_interface_without_a_password(address: str) -> None:
    done = run("flower", "--host", address, env={"FLOWER_BASIC_AUTH": None})
    assert done.returncode == 2, done.stderr
    assert "not loopback" in done.stderr and "--basic-auth-file" in done.stderr


@needs_flower
def test_a_bad_auth_file_is_refused_without_showing_it(tmp_path: Path) -> None:
    (tmp_path / "auth").write_text("only-a-secret\n")
    done = run("flower", "--basic-auth-file", str(tmp_path / "auth"), env={})
    assert done.returncode == 2 and "not user:password" in done.stderr, done.stderr
    assert "only-a-secret" not in done.stdout + done.stderr
    done = run("flower", "--basic-auth-file", str(tmp_path / "missing"), env={})
    assert done.returncode == 2 and "cannot read" in done.stderr, done.stderr


# -- a real Flower on each broker -------------------------------------------------------------------------


@contextmanager
def broker(kind: str, folder: Path) -> Iterator[tuple[dict[str, str], SentinelTopology | None]]:
    """The broker and result backend settings of a private deployment of ``kind``, a password read from a
    file where the broker has one; and the Sentinel deployment, for ``sentinel``."""
    with redis_server(folder / "redis") as results:
        if kind == "redis":
            yield (
                {"RESERVATIONS_BROKER_URL": results.url(0), "RESERVATIONS_RESULT_BACKEND": results.url(1)},
                None,
            )
        elif kind == "rabbitmq":
            if shutil.which("rabbitmqctl") is None:
                pytest.skip("rabbitmqctl is not installed: no RabbitMQ virtual host can be made")
            with rabbitmq_vhost("flower") as url:
                user, _, rest = url.partition("://")[2].partition("@")
                name, _, password = user.partition(":")
                (folder / "broker-password").write_text(password + "\n")
                env = {
                    "RESERVATIONS_BROKER_URL": f"amqp://{name}@{rest}",
                    "RESERVATIONS_BROKER_PASSWORD_FILE": str(folder / "broker-password"),
                    "RESERVATIONS_RESULT_BACKEND": results.url(1),
                }
                yield env, None
        else:
            with sentinel_topology(folder / "sentinel", service="broker", password=None) as topology:
                env = {
                    "RESERVATIONS_BROKER_URL": topology.broker_url(0),
                    "RESERVATIONS_RESULT_BACKEND": results.url(1),
                    "RESERVATIONS_SENTINEL_MASTER": "broker",
                }
                yield env, topology


@contextmanager
def flower(env: dict[str, str], folder: Path) -> Iterator[tuple[httpx.Client, subprocess.Popen[bytes], Path]]:
    """``reservations flower`` in a session of its own on a free loopback port, once it answers; a client
    that logs in to it, the process and its log."""
    auth = folder / "flower-auth"
    auth.write_text(f"{USER}:{PASSWORD}\n")
    port = free_port()
    log = folder / "flower.log"
    command = [sys.executable, "-m", "admin", "flower", "--port", str(port), "--basic-auth-file", str(auth)]
    with log.open("wb") as out:
        process = subprocess.Popen(
            command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", auth=(USER, PASSWORD), timeout=5.0, verify=tls()
    )

    def answers() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"flower exited {process.returncode}: {log.read_text()}")
        try:
            return client.get("/healthcheck").text == "OK"
        except httpx.TransportError:
            return False

    try:
        wait_until(answers, timeout=START_TIMEOUT, what="flower to answer /healthcheck")
        yield client, process, log
    finally:
        client.close()
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        end_process(process, time.monotonic() + 10, group=True)


def seen(client: httpx.Client, task_id: str, worker: str) -> dict[str, Any] | None:
    """The task as Flower lists it once it has its final state and worker, else None."""
    task: dict[str, Any] = client.get("/api/tasks").json().get(task_id, {})
    return task if task.get("state") == "SUCCESS" and task.get("worker") == worker else None


@needs_flower
@pytest.mark.parametrize("kind", ["redis", "rabbitmq", pytest.param("sentinel", marks=pytest.mark.slow)])
def test_flower_sees_the_worker_and_its_task_on_each_broker(
    kind: str, tmp_path: Path, migrated_sqlite: Path
) -> None:
    with (
        broker(kind, tmp_path) as (settings, topology),
        migrated_database("sqlite", tmp_path, migrated_sqlite) as database,
    ):
        env = {**settings, "RESERVATIONS_DATABASE_URL": database, "RESERVATIONS_TASK_EVENTS": "1"}
        with cluster(tmp_path / "workers", env, count=1, prefix="flower") as running:
            app = create_app(Settings.from_env(running.settings))
            with flower(worker_env(running.settings), tmp_path) as (client, process, log):
                # Its API asks for the password: none, or a wrong one, is refused.
                assert (
                    httpx.get(client.base_url.join("/api/workers"), timeout=5, verify=tls()).status_code
                    == 401
                )
                wrong = httpx.get(
                    client.base_url.join("/api/workers"), auth=(USER, "nope"), timeout=5, verify=tls()
                )
                assert wrong.status_code == 401

                def worker_listed() -> str | None:
                    workers = client.get("/api/workers", params={"refresh": 1}).json()
                    return next((name for name in workers if name.startswith("flower1@")), None)

                name = wait_until(worker_listed, timeout=SEEN_TIMEOUT, what="flower to list the worker")
                task_id = app.send_task("reservations.noop", args=[7]).id
                task = wait_until(
                    lambda: seen(client, task_id, name), timeout=SEEN_TIMEOUT, what=f"flower to see {task_id}"
                )
                assert task["result"] == "7"

                queues = client.get("/api/queues/length")
                assert queues.status_code == 200, log.read_text()
                if kind != "rabbitmq":  # RabbitMQ's lengths need its management plugin (docs/operations.md)
                    assert [q["name"] for q in queues.json()["active_queues"]] == ["celery"]

                if topology is not None:
                    # The Broker tab follows a failover, with the URL's first sentinel gone.
                    topology.failover()
                    topology.sentinels[0].kill()

                    # Polled with a deadline: on a loaded machine an answer may take past one call's 5 s.
                    def lengths() -> Any:
                        try:
                            answer = client.get("/api/queues/length", timeout=10)
                        except httpx.TimeoutException:
                            return None
                        assert answer.status_code == 200, log.read_text()
                        return answer.json()

                    after = wait_until(lengths, timeout=SEEN_TIMEOUT, what="the broker tab, failed over")
                    assert [q["name"] for q in after["active_queues"]] == ["celery"]

                shown = log.read_text()
                assert "Visit me at http://127.0.0.1:" in shown
                assert PASSWORD not in shown and ":guest@" not in shown
                assert PASSWORD not in " ".join(process.args)  # type: ignore[arg-type]
            app.close()
