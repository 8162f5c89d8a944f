"""A cluster operators watch: two prefork workers with task events on, JSON logs and metrics on ports of
their own, a capture of every event they send (Events) and a scrape of their metrics; and a scripted
stale write (a worker stopped inside its write past its lease, its late write refused at the stock row).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery import Celery
from celery.events.state import State
from prometheus_client.parser import text_string_to_metric_families

from fencing import LeaseManager
from reservations import Inventory
from reservations.request_outcomes import RequestResult, request_id
from tasks import ReservationClient, ReservationHandle, Settings, create_app
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.harness import free_port, process_state, wait_until
from testing.redis_servers import RedisServer
from testing.workers import pg_schema

TTL = 1.5  # short: the paused holder's lease must run out while it is stopped


TIMEOUT = 30.0


FAILPOINTS = "in_write=stop,once"


class Events:
    """Every event the cluster sends, captured by a receiver thread of this test process."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self.received: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.connection = app.connection_for_read()
        self.receiver = app.events.Receiver(self.connection, handlers={"*": self._on})
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _on(self, event: dict[str, Any]) -> None:
        with self.lock:
            self.received.append(event)

    def _run(self) -> None:
        self.receiver.capture(limit=None, timeout=None, wakeup=False)

    def start(self) -> None:
        """Start capturing; returns once a probe event of ours came back (the fanout is bound)."""
        self.thread.start()

        def probed() -> bool:
            with self.app.events.default_dispatcher() as dispatcher:
                dispatcher.send("probe-ready")
            return any(e["type"] == "probe-ready" for e in self.copy())

        wait_until(probed, timeout=TIMEOUT, what="the event receiver to see its probe", interval=0.2)

    def stop(self) -> None:
        self.receiver.should_stop = True
        self.thread.join(timeout=10)
        self.connection.release()

    def copy(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.received)

    def of(self, task_id: str) -> list[dict[str, Any]]:
        return [e for e in self.copy() if e.get("uuid") == task_id]

    def state(self) -> State:
        """The events as Flower's state machine (celery.events.state) reads them."""
        state = State()
        for event in self.copy():
            state.event(event)
        return state

    def final_state(self, task_id: str, wanted: str) -> str:
        def reached() -> str | None:
            task = self.state().tasks.get(task_id)
            return task.state if task is not None and task.state == wanted else None

        try:
            return wait_until(reached, timeout=TIMEOUT, what=f"task {task_id} to reach {wanted}")
        except TimeoutError:
            seen = [(e["type"], e.get("outcome")) for e in self.of(task_id)]
            raise AssertionError(f"events of {task_id}: {seen}") from None


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scraped(port: int) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample ``/metrics`` on ``port`` serves: name, labels (sorted), value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return exposed(response.read().decode())


def exposed(text: str) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """Every sample of an exposition (``/metrics``, ``reservations metrics --once``): name, labels
    (sorted), value."""
    return [
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    ]


def samples_of(text: str) -> Samples:
    """An exposition's samples by name and labels, for :func:`sample`."""
    return {(name, labels): value for name, labels, value in exposed(text)}


def sample(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class Cluster:
    workers: list[CeleryProcess]
    settings: Settings
    failpoints: Path
    client: ReservationClient
    inventory: Inventory
    leases: LeaseManager
    app: Celery
    events: Events
    metric_ports: list[int] = field(default_factory=list)

    def arm(self, point: str) -> None:
        (self.failpoints / point).unlink(missing_ok=True)

    def result(self, handle: ReservationHandle) -> RequestResult:
        try:
            return handle.result_sync(timeout=TIMEOUT)
        except TimeoutError as exc:
            tails = "\n".join(worker.tail() for worker in self.workers)
            raise AssertionError(f"{exc}\n{tails}") from None

    def stopped_child(self) -> int | None:
        return next((c for w in self.workers if (c := w.stopped_child()) is not None), None)

    def log_records(self) -> list[dict[str, Any]]:
        """Every JSON line the workers logged (Celery's banner is printed, not logged: skipped)."""
        records = []
        for worker in self.workers:
            for line in worker.log().splitlines():
                if line.startswith("{"):
                    records.append(json.loads(line))
        return records

    def scrape(self) -> Samples:
        """The workers' metrics, summed over the workers (each serves its pool children's sum)."""
        total: Samples = {}
        for port in self.metric_ports:
            for name, labels, value in scraped(port):
                total[(name, labels)] = total.get((name, labels), 0.0) + value
        return total

    def logged(self, event: str, **match: Any) -> list[dict[str, Any]]:
        return [
            r
            for r in self.log_records()
            if r.get("event") == event and all(r.get(k) == v for k, v in match.items())
        ]


@contextmanager
def cluster(workdir: Path, server: RedisServer, **variables: str) -> Iterator[Cluster]:
    """Two prefork workers (one pool child each) with task events on, JSON logs and a one-shot in_write
    failpoint (or those of RESERVATIONS_FAILPOINTS), disarmed; leases on the private Redis (database 2),
    which a test may wipe."""
    failpoints = workdir / "failpoints"
    failpoints.mkdir(parents=True, exist_ok=True)
    for point in variables.get("RESERVATIONS_FAILPOINTS", FAILPOINTS).split(";"):
        (failpoints / point.partition("=")[0]).touch()
    with pg_schema() as db:
        settings = Settings.from_env(
            {
                "RESERVATIONS_BROKER_URL": server.url(0),
                "RESERVATIONS_RESULT_BACKEND": server.url(1),
                "RESERVATIONS_DATABASE_URL": db,
                "RESERVATIONS_LEASE_URL": server.url(2),
                "RESERVATIONS_LEASE_TTL": str(TTL),
                "RESERVATIONS_TASK_EVENTS": "1",
                "RESERVATIONS_LOG_FORMAT": "json",
                # A busy lease dead-letters an order-like request at once: a dead letter on demand.
                "RESERVATIONS_MAX_RETRIES": "0",
                "RESERVATIONS_FAILPOINTS": FAILPOINTS,
                "RESERVATIONS_FAILPOINT_DIR": str(failpoints),
                # Requests keep their Celery result here: what AsyncResult.get() returns is under test.
                "RESERVATIONS_RESULT_EXPIRES": "600",
                **variables,
            }
        )
        env = worker_env(settings)
        # Each worker serves its metrics on a port of its own (two workers on one host).
        ports = [free_port(), free_port()]
        workers = [
            CeleryProcess(f"obs{n}", {**env, "RESERVATIONS_METRICS_PORT": str(port)}, workdir / f"obs{n}.log")
            for n, port in zip((1, 2), ports, strict=True)
        ]
        app = create_app(settings)
        events = Events(app)
        events.start()
        inventory = Inventory.from_url(db)
        leases = LeaseManager.from_url(settings.lease_url)
        client = ReservationClient(create_app(settings))
        try:
            start_all(workers)
            yield Cluster(workers, settings, failpoints, client, inventory, leases, app, events, ports)
        finally:
            stop_all(workers)
            events.stop()
            client.close()
            client.app.close()
            leases.close()
            inventory.close()
            app.close()


@dataclass(frozen=True)
class StaleWrite:
    """A request whose first attempt wrote with a stale token (refused), and the request that took over."""

    late: RequestResult
    winner: RequestResult
    paused_child: int
    paused_token: int


def stale_write(run: Cluster, sku: str) -> StaleWrite:
    """Scripted: A stops inside its write (failpoint in_write), its lease runs out, B takes a newer token
    and reserves; A resumes and sends its write, which the stock row refuses; A is driven again."""
    run.inventory.add_sku(sku, on_hand=10)
    run.arm("in_write")
    late = run.client.enqueue_reservation_sync(sku, 2, idempotency_key=f"{sku}-late")
    child = wait_until(run.stopped_child, timeout=TIMEOUT, what="a worker to stop inside its write")
    try:
        wait_until(
            lambda: run.leases.current(f"sku:{sku}") is None,
            timeout=TIMEOUT,
            what="the stopped holder's lease to run out",
        )
        assert process_state(child) == "T"
        holder = f"{socket.gethostname()}:{child}:{request_id(f'{sku}-late')}"
        (acquired,) = [e for e in run.leases.history(f"sku:{sku}") if e.holder == holder]
        winner = run.result(run.client.enqueue_reservation_sync(sku, 3, idempotency_key=f"{sku}-winner"))
        assert winner.status == "reserved"
    finally:
        os.kill(child, signal.SIGCONT)
    outcome = run.result(late)
    rejected = [h for h in run.inventory.history(sku) if h.kind == "rejected"]
    assert [(h.token, h.highest_token) for h in rejected] == [(acquired.token, winner.detail["token"])]
    return StaleWrite(outcome, winner, child, acquired.token)
