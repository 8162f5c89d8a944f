"""The shipped alert rules (deploy/prometheus/alerts.yml) work on a real Prometheus server scraping real
workers and the database exporter: every series an alert reads exists from the start, so the first stale
write and the first dead letter after a worker starts move them. The metrics listeners bind the address
they are given, and a worker whose metrics cannot work says so in one line at start.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from reservations import schema
from reservations.statuses import RequestStatus
from tasks.messages import SHAPES
from testing.celery_processes import CeleryProcess, worker_env
from testing.harness import free_port, wait_until
from testing.observed import Cluster, cluster, stale_write
from testing.redis_servers import redis_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "alerts.yml"
TIMEOUT = 30.0
# Loopback only, but not 127.0.0.1: a listener bound to 127.0.0.1 alone refuses it, one on every
# interface accepts it (the whole 127/8 is the loopback interface's on Linux).
OTHER_LOOPBACK = "127.0.0.2"
# An alert's expression is its measure compared with a threshold (comparisons bind loosest in PromQL).
THRESHOLD = re.compile(r"^(?P<measure>.+?)\s*(?:==|!=|>=|<=|>|<)\s*[-+0-9.e]+$", re.DOTALL)


def tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is missing (Debian: apt-get install prometheus; .ci/run installs it)")
    return found


def test_the_rules_file_passes_promtool() -> None:
    command = [tool("promtool"), "check", "rules", str(RULES)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


@dataclass
class Prometheus:
    """A Prometheus server of this test's own: its port, config and data directory."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[tuple[dict[str, str], float]]:
        """Instant vector ``expr`` now: each series' labels and value."""
        return [(r["metric"], float(r["value"][1])) for r in self.get("/api/v1/query", query=expr)["result"]]

    def alerts(self) -> dict[str, str]:
        """Active alerts by name: pending or firing."""
        return {a["labels"]["alertname"]: a["state"] for a in self.get("/api/v1/alerts")["alerts"]}

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def running(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.process.returncode}:\n{self.log.read_text()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False


@contextmanager
def prometheus(binary: str, folder: Path, jobs: dict[str, list[str]]) -> Iterator[Prometheus]:
    """Prometheus (``binary``) on a free port, scraping ``jobs`` (name -> targets) and evaluating the
    shipped rules every second; stopped at the end. Never the system's server or its port."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": targets}]} for job, targets in jobs.items()
        ],
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    server = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        wait_until(server.running, timeout=TIMEOUT, what="prometheus to be ready")
        yield server
    finally:
        stopped(process)


def stopped(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if ``process`` has not gone within 10 s."""
    process.terminate()
    with suppress(subprocess.TimeoutExpired):
        process.wait(timeout=10)
    if process.poll() is None:
        process.kill()
        process.wait()


@contextmanager
def exporter(run: Cluster, host: str, port: int) -> Iterator[subprocess.Popen[bytes]]:
    """``reservations metrics`` serving the cluster's database on ``host:port``."""
    process = subprocess.Popen(
        [sys.executable, "-m", "admin", "metrics", "--host", host, "--port", str(port)],
        env={**os.environ, **run.settings.to_env()},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        yield process
    finally:
        stopped(process)
        if process.stderr is not None:
            process.stderr.close()


@contextmanager
def front_door(run: Cluster, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``reservations serve`` in front of the cluster, on 127.0.0.1:``port``."""
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "admin", "serve", "--port", str(port), "--no-access-log"],
            env={**os.environ, **run.settings.to_env()},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        yield process
    finally:
        stopped(process)


@dataclass
class Targets:
    """What Prometheus scrapes: two workers on their default metrics address (127.0.0.1), the exporter
    on another loopback address, and the HTTP front door."""

    run: Cluster
    exporter: subprocess.Popen[bytes]
    exporter_port: int
    folder: Path
    api_port: int

    def exporter_answers(self) -> bool:
        if self.exporter.poll() is not None:
            error = self.exporter.stderr.read().decode() if self.exporter.stderr else ""
            raise AssertionError(f"the exporter exited with {self.exporter.returncode}: {error}")
        try:
            socket.create_connection((OTHER_LOOPBACK, self.exporter_port), timeout=5).close()
        except OSError:
            return False
        return True


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Targets]:
    folder = tmp_path_factory.mktemp("alerts")
    with redis_server(folder / "redis") as broker, cluster(folder / "cluster", broker) as run:
        port, api_port = free_port(), free_port()
        with exporter(run, OTHER_LOOPBACK, port) as process, front_door(run, api_port, folder / "api.log"):
            yield Targets(run, process, port, folder, api_port)


@dataclass
class Observed:
    run: Cluster
    prometheus: Prometheus


@pytest.fixture(scope="module")
def observed(targets: Targets) -> Iterator[Observed]:
    """A Prometheus scraping the targets as the rules file expects (jobs reservations-workers,
    reservations-db and reservations-api), once it has read all four."""
    jobs = {
        "reservations-workers": [f"127.0.0.1:{p}" for p in targets.run.metric_ports],
        "reservations-db": [f"{OTHER_LOOPBACK}:{targets.exporter_port}"],
        "reservations-api": [f"127.0.0.1:{targets.api_port}"],
    }
    with prometheus(tool("prometheus"), targets.folder / "prometheus", jobs) as server:

        def all_up() -> bool:
            targets.exporter_answers()  # raises if it exited
            return sorted(v for _, v in server.query("up")) == [1.0, 1.0, 1.0, 1.0]

        wait_until(all_up, timeout=TIMEOUT, what="prometheus to scrape the workers, exporter and api")
        yield Observed(targets.run, server)


def measure(expr: str) -> str:
    matched = THRESHOLD.match(expr.strip())
    assert matched, f"no threshold in {expr!r}"
    return matched["measure"]


def test_alerts_see_the_first_stale_write_and_dead_letter_after_a_start(observed: Observed) -> None:
    server, run = observed.prometheus, observed.run
    rules = {rule["name"]: rule["query"] for rule in server.rules()}
    expected = {"StaleWriteSeen", "StaleWritesRising", "DeadLetters", "LeasesLostOften", "HotSkuBacklog"}
    expected |= {"ApiOverloaded", "LeaseBackendDown", "BrokerDown", "RequestsStuck"}
    expected |= {"HistoryInDefaultPartition"}
    assert expected <= set(rules)

    # Before any request: every alert's measure is a series already (NaN where it divides 0 by 0), read
    # from label values each worker created at 0 when it started.
    def every_measure_exists() -> bool:
        return all(server.query(measure(expr)) for expr in rules.values())

    try:
        wait_until(every_measure_exists, timeout=TIMEOUT, what="every alert's measure to exist")
    except TimeoutError:
        missing = [name for name, expr in rules.items() if not server.query(measure(expr))]
        raise AssertionError(f"alerts reading no series: {missing}") from None
    assert all(rule["health"] == "ok" for rule in server.rules()), server.rules()

    def labels(metric: str, label: str) -> set[str]:
        found = server.query(f"sum by ({label}) ({metric})")
        assert all(value == 0 for _, value in found), found
        return {series[label] for series, _ in found}

    assert labels("reservations_outcomes_total", "status") == set(RequestStatus)
    assert labels("reservations_stale_writes_refused_total", "operation") == {
        *(shape.operation for shape in SHAPES.values()),
        "serve_pending",
    }
    assert labels("reservations_leases_total", "result") == {"acquired", "busy", "lost"}
    assert labels("reservations_transient_failures_total", "backend") == {"database", "redis"}
    assert labels("reservations_db_outcomes", "status") == set(RequestStatus)  # the exporter's
    # The front door's answers: every code each route can give, by route template (never a path).
    assert {"201", "202", "409", "422", "503", "504"} <= labels(
        'reservations_http_requests_total{route="/reservations",method="POST"}', "code"
    )
    # No alert before any request. A target's first scrapes may come before it answers, or time out
    # (after 1 s) on a loaded machine: ApiDown is then pending until the next evaluation after a good
    # scrape. Each rule is evaluated every second, so an alert still active after TIMEOUT is real.
    try:
        wait_until(lambda: server.alerts() == {}, timeout=TIMEOUT, what="no alert to be active")
    except TimeoutError:
        raise AssertionError(f"active alerts before any request: {server.alerts()}") from None

    # One stale write, one dead letter: each alert that counts them sees it.
    stale_write(run, "ALERT-S")
    run.inventory.add_sku("ALERT-D", on_hand=1)
    with run.leases.hold("sku:ALERT-D", ttl=30, holder="test:holder"):
        dead = run.client.enqueue_sync("restock", idempotency_key="alert-dead", sku="ALERT-D", quantity=1)
        assert run.result(dead).status == "dead_lettered"

    def raised() -> dict[str, str] | None:
        active = server.alerts()
        return active if {"DeadLetters", "LeasesLostOften", "StaleWriteSeen"} <= set(active) else None

    try:
        active = wait_until(raised, timeout=TIMEOUT, what="the alerts on the first events")
    except TimeoutError:
        raise AssertionError(f"active alerts: {server.alerts()}") from None
    assert active["DeadLetters"] == "firing"  # for: 0m
    assert active["StaleWriteSeen"] == "firing"  # the first stale write shows, at info severity
    assert active["LeasesLostOften"] in ("pending", "firing")  # 1 lost of 3 acquired, held for 15m
    # One refused write is below the stale-write threshold, but its rate is not 0.
    ((_, rate),) = server.query(measure(rules["StaleWritesRising"]))
    assert rate > 0


def test_metrics_listeners_bind_only_the_address_they_are_given(targets: Targets) -> None:
    """Workers on their default, 127.0.0.1; the exporter on the address of its --host."""
    for port in targets.run.metric_ports:  # listening once the workers are ready
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((OTHER_LOOPBACK, port), timeout=5).close()
    wait_until(targets.exporter_answers, timeout=TIMEOUT, what="the exporter to answer")
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", targets.exporter_port), timeout=5).close()


def test_a_multiprocess_dir_that_is_a_file_stops_the_worker_in_one_line(tmp_path: Path) -> None:
    not_a_folder = tmp_path / "metrics"
    not_a_folder.write_text("")
    database = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"
    schema.upgrade(database)  # a worker waits for a usable database before its metrics are switched on
    env = worker_env(
        {
            # The broker is contacted only after the check: one that does not answer keeps a worker
            # that got past it retrying until the deadline.
            "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:1/0",
            "RESERVATIONS_RESULT_BACKEND": "redis://127.0.0.1:1/1",
            "RESERVATIONS_DATABASE_URL": database,
            "RESERVATIONS_METRICS_PORT": str(free_port()),
        }
    )
    env["PROMETHEUS_MULTIPROC_DIR"] = str(not_a_folder)
    worker = CeleryProcess("badmetrics", env, tmp_path / "worker.log")
    worker.start()
    try:
        wait_until(lambda: not worker.alive(), timeout=TIMEOUT, what="the worker to exit")
    except TimeoutError:
        raise AssertionError(worker.tail()) from None
    finally:
        worker.stop()
    assert worker.process is not None and worker.process.returncode == 2, worker.tail()
    (said,) = [line for line in worker.log().splitlines() if line.startswith("reservations: ")]
    assert f"PROMETHEUS_MULTIPROC_DIR={not_a_folder} is not a directory" in said, worker.tail()
    assert "Traceback" not in worker.log()
