"""The HTTP front door as its callers meet it: ``reservations serve`` running as a process of its own,
driven over HTTP, with real ``celery worker`` processes behind it.

Per database (SQLite and PostgreSQL) one worker and four services share a private Redis: the one callers
use; one whose broker is a closed port and one whose database cannot be reached (503 unavailable, nothing
stored); and one whose broker no worker reads, with a queue bound of 1 and a bound of 1 request in flight
per caller, whose callers name themselves or not (202 while in flight, 503 overloaded, 429). Every answer
of the contract is shown on both databases: 201, 409, 422, the three 400s, 202, 404, the stored 503 of a
dead letter, 504 for a request reached after its deadline, the lifecycle routes, the OpenAPI document and
the metrics. On SQLite alone, a service whose callers name themselves or not keeps each caller's keys its
own. Then, on PostgreSQL alone, 200 concurrent requests with duplicated keys on one hot SKU, and a stop
with requests in flight that loses none of them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import re
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

import aiohttp
import httpx
import pytest
import redis

from fencing import LeaseManager
from reservations import Inventory
from reservations import validation as valid
from service.app import create_app
from service.routes import RESPONSES
from tasks.settings import Settings
from testing.celery_processes import worker_env
from testing.harness import free_port, tls, wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.support import SCRIPT, run
from testing.workers import Cluster, cluster, migrated_database

pytestmark = pytest.mark.slow

T = TypeVar("T")

START_TIMEOUT = 60.0  # a service imports FastAPI, Celery and SQLAlchemy: seconds on a busy 2-CPU box
STOP_TIMEOUT = 15.0
PROBLEM = "application/problem+json"
# Long enough for any outcome here; a test that expects 202 asks for no wait at all.
WAIT = {"Prefer": "wait=20"}
ASYNC = {"Prefer": "respond-async"}


# -- a service process -------------------------------------------------------------------------------------


@dataclass
class Service:
    """``reservations serve`` in a session of its own, on a free port, logging to ``log_path``."""

    name: str
    settings: dict[str, str]
    log_path: Path
    port: int = field(default_factory=free_port)
    factory: str | None = None  # module:function of a deployment's own app (None: the service's)
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self._log = self.log_path.open("ab")
        own = [] if self.factory is None else ["--factory", self.factory]
        self.process = subprocess.Popen(
            [SCRIPT, "serve", "--port", str(self.port), "--no-access-log", *own],
            env=worker_env(self.settings),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def tail(self, lines: int = 40) -> str:
        return f"--- last lines of {self.name}'s log ---\n" + "\n".join(self.log().splitlines()[-lines:])

    def wait_ready(self, path: str = "/readyz", timeout: float = START_TIMEOUT) -> None:
        """Poll ``path`` until it answers 200 (``/healthz`` for a service whose backends are away)."""

        def answers() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"{self.name} exited with {self.process.returncode}\n{self.tail()}")
            try:
                return httpx.get(self.url + path, timeout=2, verify=tls()).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, timeout=timeout, what=f"{self.name} to answer {path} with 200", interval=0.05)

    def stop(self) -> int | None:
        """SIGTERM; the exit code (None: it had to be killed)."""
        if self.process is None:
            return 0
        process, self.process = self.process, None
        with suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            with suppress(ProcessLookupError):
                process.kill()
            process.wait()
            return None
        finally:
            if self._log is not None:
                self._log.close()

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, verify=tls())


def stopped_cleanly(service: Service) -> None:
    """Stop ``service`` and assert it went on SIGTERM: uvicorn finishes and raises the signal again."""
    code = service.stop()
    assert code in (0, -signal.SIGTERM), f"{service.name} ended {code}\n{service.tail()}"
    assert "Finished server process" in service.log(), service.tail()


def started(services: list[Service], path: str = "/readyz") -> None:
    for service in services:
        service.wait_ready(path)


# -- the shared processes ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """The broker and result backend of every process here (a Redis database per use)."""
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@dataclass
class Served:
    kind: str
    settings: dict[str, str]  # the worker's and the main service's
    cluster: Cluster
    main: Service
    no_broker: Service  # its broker is a closed port
    no_database: Service  # its database cannot be reached
    idle: Service  # its broker is read by no worker; queue bound 1, one request in flight per caller
    idle_broker: redis.Redis
    inventory: Inventory
    leases: LeaseManager

    def idle_queue(self) -> int:
        """Messages waiting in the idle service's broker (every priority list of the default queue)."""
        return sum(
            int(self.idle_broker.llen(k))
            for k in self.idle_broker.scan_iter("celery*")
            if self.idle_broker.type(k) == b"list"
        )

    def empty_idle_queue(self) -> None:
        """Nothing waiting for the idle service, and the service's own sample says so."""
        for k in list(self.idle_broker.scan_iter("celery*")):
            if self.idle_broker.type(k) == b"list":
                self.idle_broker.delete(k)
        sampled_depth(self.idle, 0)


def sampled_depth(service: Service, depth: int) -> None:
    """Wait until the service's own sample of its queue (``/readyz``) is ``depth``."""

    def seen() -> bool:
        return bool(
            httpx.get(service.url + "/readyz", timeout=5, verify=tls()).json().get("queue_depth") == depth
        )

    wait_until(seen, timeout=10, what=f"{service.name} to sample a queue of {depth}", interval=0.05)


def _broker_dbs(kind: str) -> tuple[int, int]:
    """The Redis databases of a kind: the worker's broker (its results one up) and the idle broker."""
    return (0, 2) if kind == "sqlite" else (4, 6)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def served(
    request: pytest.FixtureRequest,
    server: RedisServer,
    migrated_sqlite: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    kind: str = request.param
    workdir = tmp_path_factory.mktemp(f"service_{kind}")
    broker_db, idle_db = _broker_dbs(kind)
    with migrated_database(kind, workdir, migrated_sqlite) as url, ExitStack() as stack:
        settings = {
            "RESERVATIONS_BROKER_URL": server.url(broker_db),
            "RESERVATIONS_RESULT_BACKEND": server.url(broker_db + 1),
            "RESERVATIONS_DATABASE_URL": url,
            # A request finding its SKU's lease busy is dead-lettered at once: a test holding the lease
            # makes a real dead letter. One worker process, so nothing else ever finds a lease busy.
            "RESERVATIONS_MAX_RETRIES": "0",
            "RESERVATIONS_BATCHING": "0",
        }
        closed = f"redis://127.0.0.1:{free_port()}/0"
        unreachable = (
            f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test"
            if kind == "postgresql"
            else f"sqlite:///{workdir / 'no-such-folder' / 'inventory.sqlite3'}"
        )
        services = [
            Service("main", settings, workdir / "main.log"),
            Service(
                "no-broker",
                {**settings, "RESERVATIONS_BROKER_URL": closed, "RESERVATIONS_RESULT_BACKEND": closed},
                workdir / "no-broker.log",
            ),
            Service(
                "no-database", {**settings, "RESERVATIONS_DATABASE_URL": unreachable}, workdir / "no-db.log"
            ),
            Service(
                "idle",
                {
                    **settings,
                    "RESERVATIONS_BROKER_URL": server.url(idle_db),
                    "RESERVATIONS_QUEUE_BOUND": "1",
                    "RESERVATIONS_HTTP_CALLER_BOUND": "1",
                },
                workdir / "idle.log",
                factory="tests.service_callers:open_app",  # unnamed callers are anonymous
            ),
        ]
        for service in services:
            stack.callback(stopped_cleanly, service)
            service.start()  # their imports overlap the worker's start
        running = stack.enter_context(cluster(workdir, settings, count=1, prefix=f"svc{kind[:2]}"))
        main, no_broker, no_database, idle = services
        started([main, idle])
        started([no_broker, no_database], "/healthz")
        inventory = stack.enter_context(Inventory.from_url(url))
        leases = stack.enter_context(LeaseManager.from_url(running.lease_url))
        idle_broker = stack.enter_context(redis.Redis.from_url(server.url(idle_db)))
        yield Served(
            kind, settings, running, main, no_broker, no_database, idle, idle_broker, inventory, leases
        )


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with served.main.client() as client:
        yield client


@contextmanager
def beside(served: Served, name: str, factory: str) -> Iterator[Service]:
    """A service of the deployment factory ``factory`` beside the module's, on its settings and worker,
    ready; stopped cleanly afterwards."""
    service = Service(name, served.settings, served.main.log_path.with_name(f"{name}.log"), factory=factory)
    service.start()
    try:
        service.wait_ready()
        yield service
    finally:
        stopped_cleanly(service)


@pytest.fixture(scope="module")
def open_door(served: Served) -> Iterator[Service]:
    """A deployment's service in front of the worker whose callers name themselves in ``X-Caller`` or are
    anonymous (tests.service_callers:open_app); a name is passed on as sent. Its tests run on SQLite: the
    scoping is the service's, whatever the database."""
    with beside(served, "open-door", "tests.service_callers:open_app") as service:
        yield service


ON_SQLITE = pytest.mark.parametrize("served", ["sqlite"], indirect=True)


_counter = iter(range(1_000_000))


def key(stem: str) -> str:
    """A key of its own for each request a test makes (the module's services outlive the tests)."""
    return f"{stem}-{next(_counter)}-{random.randrange(1 << 30):x}"


def reserve(
    client: httpx.Client, sku: str, quantity: int, k: str | None, headers: dict[str, str] | None = None
) -> httpx.Response:
    sent = {**WAIT, **(headers or {})}
    if k is not None:
        sent["Idempotency-Key"] = k
    return client.post("/reservations", json={"sku": sku, "quantity": quantity}, headers=sent)


def problem_of(answer: httpx.Response, name: str, status: int) -> dict[str, Any]:
    """The answer's problem document, checked to be of type ``name`` with ``status``."""
    assert answer.status_code == status, answer.text
    assert answer.headers["content-type"] == PROBLEM, answer.headers
    doc: dict[str, Any] = answer.json()
    assert (doc["type"], doc["status"]) == (f"/problems/{name}", status), doc
    return doc


def sku(stem: str, inventory: Inventory, on_hand: int) -> str:
    name = f"{stem}-{random.randrange(1 << 30):x}"
    inventory.add_sku(name, on_hand=on_hand)
    return name


# -- every answer, on both databases ----------------------------------------------------------------------


def test_a_reservation_is_201_and_its_key_answers_the_same_bytes_again(
    served: Served, http: httpx.Client
) -> None:
    item, k = sku("R", served.inventory, 10), key("made")
    made = reserve(http, item, 3, k)
    assert made.status_code == 201, made.text
    body = made.json()
    assert (body["key"], body["operation"], body["status"]) == (k, "reserve", "reserved")
    assert re.fullmatch(r"r_[0-9a-f]{32}", body["reservation_id"]), body
    assert isinstance(body["token"], int) and body["token"] > 0
    assert body["at"].endswith("Z") and body["detail"]["reservation_ids"] == [body["reservation_id"]]

    again = reserve(http, item, 3, k)
    assert (again.status_code, again.content) == (201, made.content)
    # Read back: 200, the same outcome.
    for path in (f"/reservations/{k}", f"/requests/{k}"):
        read = http.get(path)
        assert (read.status_code, read.content) == (200, made.content), path
    stock = http.get(f"/skus/{item}")
    assert stock.status_code == 200
    assert stock.json() == {"sku": item, "on_hand": 10, "reserved": 3, "available": 7, "token": body["token"]}
    # Applied once, under the key.
    (held,) = served.inventory.reservations(item)
    # Stored in the anonymous callers' space: the service names no caller.
    assert (held.id, held.idempotency_key, held.quantity) == (body["reservation_id"], f"*:{k}", 3)


def test_not_enough_stock_is_409_and_final_for_the_key(served: Served, http: httpx.Client) -> None:
    item, k = sku("S", served.inventory, 2), key("short")
    refused = reserve(http, item, 5, k)
    doc = problem_of(refused, "insufficient-stock", 409)
    assert (doc["sku"], doc["requested"], doc["available"], doc["key"]) == (item, 5, 2, k)
    assert doc["instance"] == f"/reservations/{k}"
    # Final: stock added since does not change the key's answer, on a POST or a GET.
    served.inventory.add_sku(f"{item}-other", on_hand=1)
    assert reserve(http, item, 5, k).content == refused.content
    read = http.get(f"/reservations/{k}")
    assert (read.status_code, read.content) == (409, refused.content)
    assert served.inventory.stock(item).reserved == 0


def test_a_key_sent_with_another_request_is_422_and_changes_nothing(
    served: Served, http: httpx.Client
) -> None:
    item, k = sku("K", served.inventory, 10), key("reused")
    first = reserve(http, item, 1, k)
    assert first.status_code == 201, first.text
    for other in ({"sku": item, "quantity": 2}, {"sku": item, "quantity": 1, "hold_for": 60}):
        reused = http.post("/reservations", json=other, headers={**WAIT, "Idempotency-Key": k})
        doc = problem_of(reused, "idempotency-key-reused", 422)
        assert doc["key"] == k
    # The key still answers its own request, and nothing more was reserved.
    assert reserve(http, item, 1, k).content == first.content
    assert served.inventory.stock(item).reserved == 1


def test_malformed_requests_are_400_and_store_nothing(served: Served, http: httpx.Client) -> None:
    item = sku("M", served.inventory, 10)
    missing = reserve(http, item, 1, None)
    problem_of(missing, "idempotency-key-missing", 400)

    k = key("malformed")
    bodies: list[Any] = [
        {"sku": item, "quantity": 0},
        {"sku": item, "quantity": "two"},
        {"sku": item},
        {"sku": item, "quantity": 1, "colour": "red"},
        [1, 2],
    ]
    for body in bodies:
        answer = http.post("/reservations", json=body, headers={**WAIT, "Idempotency-Key": k})
        doc = problem_of(answer, "invalid-request", 400)
        assert doc["errors"], (body, doc)
    # Well formed, but refused by the domain's rules before anything is recorded.
    for body, where in [
        ({"sku": item, "quantity": 1, "hold_for": -5}, "hold_for"),
        ({"sku": "has space", "quantity": 1}, "sku"),
    ]:
        answer = http.post("/reservations", json=body, headers={**WAIT, "Idempotency-Key": k})
        assert problem_of(answer, "invalid-request", 400)["field"] == where, answer.text
    not_json = http.post(
        "/reservations",
        content=b"{",
        headers={**WAIT, "Idempotency-Key": k, "Content-Type": "application/json"},
    )
    problem_of(not_json, "invalid-request", 400)
    for bad in ("has space", "x" * 201):
        header = problem_of(reserve(http, item, 1, bad), "invalid-request", 400)
        assert header["field"] == "Idempotency-Key"
    for deadline in ("soon", "0", "-5", "nan"):
        late = problem_of(reserve(http, item, 1, k, {"Request-Deadline": deadline}), "invalid-request", 400)
        assert late["field"] == "Request-Deadline"
    # None of them was accepted.
    problem_of(http.get(f"/reservations/{k}"), "not-found", 404)
    assert served.inventory.stock(item).reserved == 0


def test_a_boolean_is_no_number_of_units_or_seconds(served: Served, http: httpx.Client) -> None:
    """JSON's true is no quantity (read as 1 it would reserve a unit, and false would count the shelf
    empty), nor are "1" or 1.0: each is refused as malformed before anything is recorded."""
    item, k = sku("BOOL", served.inventory, 10), key("bool")
    for body, where in [
        ({"sku": item, "quantity": True}, "quantity"),
        ({"sku": item, "quantity": False}, "quantity"),
        ({"sku": item, "quantity": 1.0}, "quantity"),
        ({"sku": item, "quantity": "1"}, "quantity"),
        ({"sku": item, "quantity": 1, "hold_for": True}, "hold_for"),
        ({"sku": item, "quantity": 1, "hold_for": "60"}, "hold_for"),
    ]:
        answer = http.post("/reservations", json=body, headers={**WAIT, "Idempotency-Key": k})
        doc = problem_of(answer, "invalid-request", 400)
        assert f"body.{where}" in [e["where"] for e in doc["errors"]], (body, doc)
    for counted in (True, False, 40.0):
        answer = http.post(
            f"/skus/{item}/count", json={"counted": counted}, headers={**WAIT, "Idempotency-Key": k}
        )
        assert problem_of(answer, "invalid-request", 400)["errors"][0]["where"] == "body.counted", answer.text
    problem_of(http.get(f"/reservations/{k}"), "not-found", 404)
    level = served.inventory.stock(item)
    assert (level.on_hand, level.reserved) == (10, 0)
    # Whole seconds are seconds still.
    held = http.post(
        "/reservations",
        json={"sku": item, "quantity": 1, "hold_for": 60},
        headers={**WAIT, "Idempotency-Key": k},
    )
    assert held.status_code == 201, held.text


def test_a_re_drive_s_name_cannot_be_taken_by_a_request(served: Served, http: httpx.Client) -> None:
    """``K~redrive-<n>`` is the key the operator's n-th re-drive of the dead-lettered K runs under: a
    request a caller sent under it would be reported as K's outcome once K is driven again."""
    item, k = sku("RD", served.inventory, 10), key("origin")
    made = reserve(http, item, 1, k)
    assert made.status_code == 201, made.text
    for taken in (f"{k}~redrive-1", f"{k}~redrive-12"):
        doc = problem_of(reserve(http, item, 1, taken), "invalid-request", 400)
        assert doc["field"] == "Idempotency-Key" and "~redrive-<n>" in doc["detail"], doc
        confirm = http.post(f"/reservations/{k}/confirm", headers={**WAIT, "Idempotency-Key": taken})
        problem_of(confirm, "invalid-request", 400)
        count = http.post(
            f"/skus/{item}/count", json={"counted": 3}, headers={**WAIT, "Idempotency-Key": taken}
        )
        problem_of(count, "invalid-request", 400)
        problem_of(http.get(f"/requests/{taken}"), "not-found", 404)
    level = served.inventory.stock(item)
    assert (level.on_hand, level.reserved) == (10, 1)
    # A key that only looks like one is a key like any other.
    assert reserve(http, item, 1, f"{k}~redrive-one").status_code == 201


def test_a_request_a_worker_finds_invalid_is_a_final_400(served: Served, http: httpx.Client) -> None:
    k = key("unknown-sku")
    refused = reserve(http, "NO-SUCH-SKU", 1, k)
    doc = problem_of(refused, "invalid-request", 400)
    assert (doc["key"], doc["error"]) == (k, "UnknownSku"), doc
    assert reserve(http, "NO-SUCH-SKU", 1, k).content == refused.content
    assert http.get(f"/reservations/{k}").content == refused.content


def test_a_preference_the_service_cannot_read_is_ignored(served: Served, http: httpx.Client) -> None:
    """RFC 7240: an unreadable preference is ignored, as ``²`` (a digit to Python, Latin-1 on the wire) is
    for a wait; the request is answered as if it had none, after the deployment's own wait."""
    item, k = sku("W", served.inventory, 10), key("odd-wait")
    made = http.post(
        "/reservations",
        json={"sku": item, "quantity": 1},
        headers={b"Idempotency-Key": k.encode(), b"Prefer": b"wait=\xb2"},
    )
    assert made.status_code == 201, made.text


def test_keys_never_seen_are_404(served: Served, http: httpx.Client) -> None:
    for path in (f"/reservations/{key('never')}", f"/requests/{key('never')}", "/skus/NO-SUCH-SKU"):
        problem_of(http.get(path), "not-found", 404)
    confirm = http.post(f"/reservations/{key('never')}/confirm", headers={"Idempotency-Key": key("c")})
    problem_of(confirm, "not-found", 404)


def test_a_dead_lettered_request_is_a_stored_503(served: Served, http: httpx.Client) -> None:
    item, k = sku("D", served.inventory, 10), key("dead")
    held = served.leases.acquire(valid.scope_of(item), ttl=60, holder="test")
    try:
        dead = reserve(http, item, 1, k)
    finally:
        served.leases.release(held)
    doc = problem_of(dead, "dead-lettered", 503)
    assert doc["key"] == k and "lease busy" in doc["detail"], doc
    assert "retry-after" not in dead.headers  # final: retrying the key does not help
    # The lease is free now; the key still answers its dead letter, and nothing was reserved.
    assert reserve(http, item, 1, k).content == dead.content
    read = http.get(f"/reservations/{k}")
    assert (read.status_code, read.content) == (503, dead.content)
    assert served.inventory.stock(item).reserved == 0


def test_a_request_reached_after_its_deadline_is_504(served: Served, http: httpx.Client) -> None:
    item, k = sku("E", served.inventory, 10), key("late")
    # A millisecond: gone before any worker can have taken the request from the broker.
    late = reserve(http, item, 1, k, {"Request-Deadline": "0.001"})
    doc = problem_of(late, "expired", 504)
    assert doc["key"] == k
    assert reserve(http, item, 1, k).content == late.content  # final, without a deadline too
    assert served.inventory.stock(item).reserved == 0
    in_time = reserve(http, item, 1, key("in-time"), {"Request-Deadline": "60"})
    assert in_time.status_code == 201, in_time.text


def test_confirm_release_and_count(served: Served, http: httpx.Client) -> None:
    item = sku("L", served.inventory, 10)
    kept, dropped, short = key("kept"), key("dropped"), key("short")
    for k in (kept, dropped):
        assert reserve(http, item, 2, k).status_code == 201
    assert reserve(http, item, 50, short).status_code == 409

    def step(k: str, what: str, own: str | None) -> httpx.Response:
        headers = {**WAIT, **({} if own is None else {"Idempotency-Key": own})}
        return http.post(f"/reservations/{k}/{what}", headers=headers)

    confirm_key = key("confirm")
    confirmed = step(kept, "confirm", confirm_key)
    assert confirmed.status_code == 200, confirmed.text
    assert (confirmed.json()["status"], confirmed.json()["operation"]) == ("confirmed", "confirm")
    assert step(kept, "confirm", confirm_key).content == confirmed.content
    read = http.get(f"/requests/{confirm_key}")
    assert (read.status_code, read.content) == (200, confirmed.content)
    # Releasing a confirmed reservation can never succeed: final for its key.
    release_key = key("release")
    refused = step(kept, "release", release_key)
    problem_of(refused, "invalid-transition", 409)
    assert step(kept, "release", release_key).content == refused.content

    released = step(dropped, "release", key("release"))
    assert (released.status_code, released.json()["status"]) == (200, "released")
    problem_of(step(short, "confirm", key("confirm")), "not-reserved", 409)
    problem_of(step(kept, "confirm", None), "idempotency-key-missing", 400)
    level = served.inventory.stock(item)
    assert (level.on_hand, level.reserved) == (8, 0)  # the confirmed units left the shelf

    count_key = key("count")
    counted = http.post(
        f"/skus/{item}/count", json={"counted": 40}, headers={**WAIT, "Idempotency-Key": count_key}
    )
    assert counted.status_code == 200, counted.text
    assert counted.json()["operation"] == "count"
    assert http.get(f"/requests/{count_key}").content == counted.content
    assert http.get(f"/skus/{item}").json()["on_hand"] == 40
    bad = http.post(
        f"/skus/{item}/count", json={"counted": -1}, headers={**WAIT, "Idempotency-Key": key("n")}
    )
    problem_of(bad, "invalid-request", 400)


def test_health_readiness_and_problem_types(served: Served, http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    for name, status in [("expired", 504), ("overloaded", 503), ("idempotency-key-reused", 422)]:
        described = http.get(f"/problems/{name}")
        assert described.status_code == 200
        assert (described.json()["type"], described.json()["status"]) == (f"/problems/{name}", status)
    problem_of(http.get("/problems/no-such-problem"), "not-found", 404)


def test_the_openapi_document_lists_every_answer_of_each_route(served: Served, http: httpx.Client) -> None:
    paths = http.get("/openapi.json").json()["paths"]
    for (route, method), answers in RESPONSES.items():
        if route == "/metrics":
            assert route not in paths  # not part of the API
            continue
        documented = paths[route][method.lower()]["responses"]
        assert set(documented) == {str(code) for code in answers}, (route, method)
        for code, answer in answers.items():
            if PROBLEM in answer.get("content", {}):
                # A problem is described as what it is served as, and only as that.
                assert documented[str(code)]["content"] == {
                    PROBLEM: {"schema": {"$ref": "#/components/schemas/ProblemModel"}}
                }, (route, method, code)


def _metric(exposition: str, name: str, **labels: str) -> float | None:
    """The value of the series of ``name`` with exactly ``labels``, or None."""
    for line in exposition.splitlines():
        sample = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if sample is not None and dict(re.findall(r'(\w+)="([^"]*)"', sample[1] or "")) == labels:
            return float(sample[2])
    return None


def test_metrics_count_each_answer_under_its_route_template(served: Served, http: httpx.Client) -> None:
    never = key("metered")
    labels = {"route": "/reservations/{key}", "method": "GET", "code": "404"}
    before = _metric(http.get("/metrics").text, "reservations_http_requests_total", **labels)
    assert before is not None  # every declared answer's series exists from the start
    for _ in range(3):
        http.get(f"/reservations/{never}")
    http.get(f"/no/such/{never}")
    exposition = http.get("/metrics").text
    assert _metric(exposition, "reservations_http_requests_total", **labels) == before + 3
    assert never not in exposition  # a key is never a label
    assert (
        _metric(exposition, "reservations_http_requests_total", route="unmatched", method="GET", code="404")
        or 0
    ) >= 1
    assert _metric(exposition, "reservations_http_in_flight") == 1  # the scrape itself
    assert _metric(exposition, "reservations_http_queue_depth") is not None
    assert "reservations_http_request_seconds_bucket" in exposition


# -- backends away, and a queue no worker reads --------------------------------------------------------------


def test_an_unreachable_broker_is_202_and_the_relay_carries_the_request(
    served: Served, http: httpx.Client
) -> None:
    """The request is recorded before it is published: a broker that does not take it costs the caller
    nothing but time. The answer is 202 with the Location, and the workers' relay publishes the request
    once a broker answers; its outcome is then read by GET alone, with no second POST."""
    item, k = sku("B", served.inventory, 10), key("no-broker")
    with served.no_broker.client() as down:
        accepted = reserve(down, item, 1, k)
        assert accepted.status_code == 202, accepted.text
        assert accepted.headers["location"] == f"/reservations/{k}"
        ready = down.get("/readyz")
        assert ready.status_code == 503 and any(p.startswith("broker") for p in ready.json()["problems"])
    assert http.get(f"/reservations/{k}").status_code == 202  # recorded: pending, not "never seen"

    def ended() -> httpx.Response | None:
        read = http.get(f"/reservations/{k}")
        return read if read.status_code != 202 else None

    # The relay looks after RESERVATIONS_REPUBLISH_AFTER (10 s), in a pass every 5 s at most.
    made = wait_until(ended, timeout=40, what="the relay to carry the request", interval=0.2)
    assert made.status_code == 200 and made.json()["status"] == "reserved", made.text
    assert served.inventory.stock(item).reserved == 1


def test_an_unreachable_database_is_503(served: Served) -> None:
    k = key("no-db")
    with served.no_database.client() as down:
        refused = reserve(down, "ANY", 1, k)
        doc = problem_of(refused, "unavailable", 503)
        assert "database" in doc["detail"] and refused.headers["retry-after"] == "5", doc
        for path in (f"/reservations/{k}", "/skus/ANY"):
            problem_of(down.get(path), "unavailable", 503)
        ready = down.get("/readyz")
        assert ready.status_code == 503 and any(p.startswith("database") for p in ready.json()["problems"])


def test_a_request_in_flight_is_202_with_its_location_and_published_once(served: Served) -> None:
    served.empty_idle_queue()
    item, k = sku("F", served.inventory, 10), key("in-flight")
    with served.idle.client() as idle:
        accepted = reserve(idle, item, 1, k, ASYNC)
        assert accepted.status_code == 202, accepted.text
        assert accepted.json() == {"key": k, "status": "pending", "location": f"/reservations/{k}"}
        assert (accepted.headers["location"], accepted.headers["retry-after"]) == (f"/reservations/{k}", "1")
        for path in (f"/reservations/{k}", f"/requests/{k}"):
            read = idle.get(path)
            assert read.status_code == 202 and read.json()["status"] == "pending", path
        # A duplicate in flight waits as asked, then is told the same; another request is refused.
        started_at = time.monotonic()
        again = reserve(idle, item, 1, k, {"Prefer": "wait=1"})
        assert again.status_code == 202 and time.monotonic() - started_at >= 1
        assert again.content == accepted.content
        problem_of(reserve(idle, item, 2, k, ASYNC), "idempotency-key-reused", 422)
        # Confirming it must wait for its outcome.
        early = idle.post(f"/reservations/{k}/confirm", headers={"Idempotency-Key": key("c")})
        assert problem_of(early, "not-reserved", 409) and early.headers["retry-after"] == "1"
    assert served.idle_queue() == 1  # one message, whatever was sent under the key


def test_a_key_s_location_names_that_key_whatever_its_characters(served: Served, http: httpx.Client) -> None:
    """A key may hold any printable ASCII: the Location of its 202 and the instance of its problem must
    lead back to it, not to another key (``a?b`` read as ``a`` with a query) or to nothing."""
    item, stem = sku("U", served.inventory, 10), key("odd")
    base = httpx.URL(served.main.url)
    for k in (f"{stem}?x=1", f"{stem}#part", f"{stem}%41", f"{stem}&+;=@:,$!'()*", f"{stem}/a/b"):
        refused = problem_of(reserve(http, item, 50, k), "insufficient-stock", 409)
        read = http.get(base.join(refused["instance"]))
        assert (read.status_code, read.json().get("key")) == (409, k), (k, refused["instance"], read.text)
    served.empty_idle_queue()
    k = f"{stem}?pending"
    with served.idle.client() as idle:
        accepted = reserve(idle, item, 1, k, ASYNC)
        assert accepted.status_code == 202, accepted.text
        location = accepted.headers["location"]
        assert accepted.json()["location"] == location
        read = idle.get(httpx.URL(served.idle.url).join(location))
        assert (read.status_code, read.json().get("key")) == (202, k), (location, read.text)


def test_a_key_holding_slashes_is_read_confirmed_and_released_by_its_location(
    served: Served, http: httpx.Client
) -> None:
    item, k = sku("SL", served.inventory, 10), f"{key('order')}/line/1"
    made = reserve(http, item, 2, k)
    assert made.status_code == 201, made.text
    read = http.get(f"/reservations/{quote(k, safe='')}")
    assert (read.status_code, read.json()["key"]) == (200, k), read.text
    confirmed = http.post(
        f"/reservations/{quote(k, safe='')}/confirm", headers={**WAIT, "Idempotency-Key": f"{k}/confirm"}
    )
    assert (confirmed.status_code, confirmed.json()["status"]) == (200, "confirmed"), confirmed.text
    again = http.get(f"/requests/{quote(f'{k}/confirm', safe='')}")
    assert again.status_code == 200 and again.json()["key"] == f"{k}/confirm", again.text


def test_unknown_paths_and_methods_are_problem_documents(served: Served, http: httpx.Client) -> None:
    assert problem_of(http.get("/no/such/path"), "not-found", 404)["instance"] == "/no/such/path"
    wrong = http.delete("/reservations")
    assert problem_of(wrong, "method-not-allowed", 405) and "POST" in wrong.headers["allow"]


def test_a_caller_dependency_gives_each_caller_keys_of_its_own(served: Served) -> None:
    """A deployment's factory passes a caller dependency: two callers' same key names two requests, a
    caller reads only its own, and a request naming no caller is refused as a problem document."""
    if served.kind != "sqlite":
        pytest.skip("the scoping is the service's, whatever the database: shown once")
    with beside(served, "callers", "tests.service_callers:app") as scoped:
        item, k = sku("SC", served.inventory, 10), key("shared")
        with scoped.client() as http:
            alice = reserve(http, item, 1, k, {"X-Caller": "alice"})
            bob = reserve(http, item, 3, k, {"X-Caller": "bob"})  # another body: no 422, another scope
            assert (alice.status_code, bob.status_code) == (201, 201), (alice.text, bob.text)
            assert alice.json()["key"] == bob.json()["key"] == k
            assert alice.json()["reservation_id"] != bob.json()["reservation_id"]
            mine = http.get(f"/reservations/{k}", headers={"X-Caller": "bob"})
            assert mine.json()["reservation_id"] == bob.json()["reservation_id"]
            assert http.get(f"/reservations/{k}", headers={"X-Caller": "carol"}).status_code == 404
            nobody = reserve(http, item, 1, key("anon"))
            assert (
                problem_of(nobody, "unauthorized", 401) and nobody.headers["www-authenticate"] == "X-Caller"
            )
        stored = {r.idempotency_key for r in served.inventory.reservations(item)}
        assert stored == {f"alice:{k}", f"bob:{k}"}


@ON_SQLITE
def test_an_anonymous_caller_cannot_reach_a_named_caller_s_keys(served: Served, open_door: Service) -> None:
    """A caller the deployment leaves unnamed keeps keys in a space of its own: sending ``alice:K`` it
    names its own key, never alice's K. It reads nothing of hers, confirms nothing of hers, and takes none
    of the keys she has yet to send."""
    item, hers, later = sku("AN", served.inventory, 10), key("hers"), key("later")
    alice = {"X-Caller": "alice"}
    with open_door.client() as http:
        made = reserve(http, item, 2, hers, alice)
        assert made.status_code == 201, made.text
        for path in (f"/reservations/alice:{hers}", f"/requests/alice:{hers}"):
            problem_of(http.get(path), "not-found", 404)
        confirm = http.post(
            f"/reservations/alice:{hers}/confirm", headers={**WAIT, "Idempotency-Key": key("c")}
        )
        problem_of(confirm, "not-found", 404)

        anonymous = reserve(http, item, 1, f"alice:{later}")
        assert anonymous.status_code == 201 and anonymous.json()["key"] == f"alice:{later}", anonymous.text
        mine = reserve(http, item, 3, later, alice)  # another request: the same key would be 422
        assert (mine.status_code, mine.json()["key"]) == (201, later), mine.text
        # Each reads back its own.
        back = http.get(f"/reservations/alice:{later}").json()
        assert back["reservation_id"] == anonymous.json()["reservation_id"]
        back = http.get(f"/reservations/{later}", headers=alice).json()
        assert back["reservation_id"] == mine.json()["reservation_id"]
    held = {r.idempotency_key: r for r in served.inventory.reservations(item)}
    assert set(held) == {f"alice:{hers}", f"alice:{later}", f"*:alice:{later}"}
    assert held[f"alice:{hers}"].status == "held"  # not confirmed by anyone else


@ON_SQLITE
def test_a_caller_named_outside_the_rule_is_403_not_a_server_error(
    served: Served, open_door: Service
) -> None:
    """The deployment's dependency names a caller the service cannot keep keys for (an e-mail address, a
    colon, ``*``): a problem document naming the rule, on every route of a caller, and nothing stored."""
    item, k = sku("IC", served.inventory, 10), key("named")
    with open_door.client() as http:
        for name in ("alice@example.com", "has:colon", "*", "x" * 65):
            who = {"X-Caller": name}
            for answer in (
                reserve(http, item, 1, k, who),
                http.get(f"/reservations/{k}", headers=who),
                http.get(f"/requests/{k}", headers=who),
                http.post(f"/skus/{item}/count", json={"counted": 1}, headers={**who, "Idempotency-Key": k}),
            ):
                doc = problem_of(answer, "invalid-caller", 403)
                assert "[A-Za-z0-9._-]{1,64}" in doc["detail"] and name not in doc["detail"], doc
    level = served.inventory.stock(item)
    assert (level.on_hand, level.reserved) == (10, 0)
    log = open_door.log()
    assert "Traceback" not in log and "returned a name of 17 characters, with '@' outside the rule" in log
    assert "alice@example.com" not in log  # the operator learns what was wrong, not who


@ON_SQLITE
def test_the_keys_dot_and_dot_dot_have_a_location_that_leads_back_to_them(
    served: Served, open_door: Service
) -> None:
    """``.`` and ``..`` are dot segments a client resolves away (``/reservations/.`` is
    ``/reservations/``): their Location and instance escape the dots, and following them reaches the key."""
    item, base = sku("DOT", served.inventory, 10), httpx.URL(open_door.url)
    # A caller of its own: the keys are the same in every run.
    who = {"X-Caller": f"dots-{random.randrange(1 << 30):x}"}
    with open_door.client() as http:
        for k in (".", ".."):
            accepted = reserve(http, item, 1, k, {**who, **ASYNC})
            assert accepted.status_code == 202, accepted.text
            location = accepted.headers["location"]
            assert location == "/reservations/" + "%2E" * len(k) == accepted.json()["location"]
            followed = http.get(base.join(location), headers=who)
            assert followed.status_code in (200, 202), (location, followed.text)
            assert followed.json()["key"] == k, (location, followed.text)
            made = reserve(http, item, 1, k, who)
            assert made.status_code == 201, made.text
            read = http.get(base.join(location), headers=who)
            assert (read.status_code, read.json()["key"]) == (200, k), read.text
            # The lifecycle routes find it under the same escaped segment (else: 404).
            confirm = http.post(
                base.join(location + "/confirm"), headers={**who, **ASYNC, "Idempotency-Key": k + "c"}
            )
            assert confirm.status_code in (200, 202), confirm.text
        short = {"X-Caller": f"dots-{random.randrange(1 << 30):x}"}
        for k in (".", ".."):
            refused = problem_of(reserve(http, item, 50, k, short), "insufficient-stock", 409)
            assert refused["instance"] == "/reservations/" + "%2E" * len(k)
            read = http.get(base.join(refused["instance"]), headers=short)
            assert (read.status_code, read.json()["key"]) == (409, k), read.text
        counter = {"X-Caller": f"dots-{random.randrange(1 << 30):x}"}
        for k in (".", ".."):
            counted = http.post(
                f"/skus/{item}/count",
                json={"counted": 20},
                headers={**counter, **ASYNC, "Idempotency-Key": k},
            )
            assert counted.headers["location"] == "/requests/" + "%2E" * len(k), counted.text
            read = http.get(base.join(counted.headers["location"]), headers=counter)
            assert read.status_code in (200, 202) and read.json()["key"] == k, read.text


@ON_SQLITE
def test_a_caller_at_its_bound_of_requests_in_flight_is_429_and_others_are_served(served: Served) -> None:
    """The idle service takes one request in flight per caller: while alice's first waits for its outcome
    her second is refused 429 (nothing stored, Retry-After), bob's goes in; once her first is answered,
    her second goes in too."""
    served.empty_idle_queue()
    item, first, second = sku("IF", served.inventory, 10), key("first"), key("second")
    alice, bob = {"X-Caller": "alice"}, {"X-Caller": "bob"}
    with ThreadPoolExecutor(1) as pool, served.idle.client() as idle, served.idle.client() as waiting:
        # Five seconds of waiting: room for the rest on a busy machine; if the first is answered before the
        # second is sent, the second goes in and the test fails rather than passing by chance.
        answer = pool.submit(reserve, waiting, item, 1, first, {**alice, "Prefer": "wait=5"})
        wait_until(lambda: served.idle_queue() == 1, timeout=10, what="alice's first request to go out")
        refused = reserve(idle, item, 1, second, {**alice, **ASYNC})
        doc = problem_of(refused, "too-many-requests", 429)
        assert refused.headers["retry-after"] == "1" and "(1)" in doc["detail"], doc
        others = reserve(idle, item, 1, key("bob"), {**bob, **ASYNC})
        assert others.status_code == 202, others.text
        assert not answer.done()  # alice's first was in flight throughout
        assert answer.result(timeout=15).status_code == 202
        problem_of(idle.get(f"/reservations/{second}", headers=alice), "not-found", 404)
        served.empty_idle_queue()  # under the queue's bound of 1 again
        again = reserve(idle, item, 1, second, {**alice, **ASYNC})
        assert again.status_code == 202, again.text
    assert served.idle_queue() == 1


def test_a_queue_deeper_than_its_bound_is_503_overloaded(served: Served) -> None:
    served.empty_idle_queue()
    item = sku("O", served.inventory, 10)
    with served.idle.client() as idle:
        for k in (key("fill"), key("fill")):
            assert reserve(idle, item, 1, k, ASYNC).status_code == 202
        sampled_depth(served.idle, 2)
        k = key("refused")
        refused = reserve(idle, item, 1, k, ASYNC)
        doc = problem_of(refused, "overloaded", 503)
        assert "2 requests are waiting" in doc["detail"], doc
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        problem_of(idle.get(f"/reservations/{k}"), "not-found", 404)
        # A key with its outcome is still answered.
        decided = key("decided")
        with served.main.client() as http:
            made = reserve(http, item, 1, decided)
        assert made.status_code == 201
        assert reserve(idle, item, 1, decided, ASYNC).content == made.content
    assert served.idle_queue() == 2


# -- on PostgreSQL: many at once, and a stop ---------------------------------------------------------------


async def until(check: Callable[[], Awaitable[T | None]], *, timeout: float, what: str) -> T:
    """Poll ``check`` without blocking the event loop, until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.02)


async def post(
    session: aiohttp.ClientSession, url: str, k: str, body: dict[str, Any], wait: int
) -> tuple[int, bytes, float]:
    """One request, as a caller sends it: its status, body and how long it took."""
    started_at = time.monotonic()
    headers = {"Idempotency-Key": k, "Prefer": f"wait={wait}"}
    async with session.post(url + "/reservations", json=body, headers=headers) as answer:
        content = await answer.read()
        return answer.status, content, time.monotonic() - started_at


async def final(
    session: aiohttp.ClientSession, url: str, k: str, body: dict[str, Any], tries: list[str]
) -> tuple[int, bytes]:
    """The key's final answer, as a caller gets it: a 503 unavailable stores nothing and asks for the same
    request again (the shared PostgreSQL may run out of connections with every test of the machine on
    it). Each such try is noted in ``tries``."""
    deadline = time.monotonic() + 30
    while True:
        status, content, _ = await post(session, url, k, body, 20)
        if status != 503 or json.loads(content)["type"] != "/problems/unavailable":
            return status, content
        tries.append(k)
        assert time.monotonic() < deadline, content
        await asyncio.sleep(0.1)  # a pause before trying again, shorter than its Retry-After


@pytest.mark.parametrize("served", ["postgresql"], indirect=True)
async def test_200_concurrent_requests_with_duplicate_keys_reserve_exactly_the_stock(served: Served) -> None:
    stock, keys = 40, [key("hot") for _ in range(100)]
    item = sku("HOT", served.inventory, stock)
    sent = keys * 2
    random.Random(7).shuffle(sent)
    connector = aiohttp.TCPConnector(limit=0)
    tries: list[str] = []
    async with aiohttp.ClientSession(connector=connector) as session:
        answers = await asyncio.gather(
            *(final(session, served.main.url, k, {"sku": item, "quantity": 1}, tries) for k in sent)
        )
    assert len(tries) < len(sent) // 4, f"{len(tries)} requests were answered 503 unavailable first"
    by_key: dict[str, set[tuple[int, bytes]]] = {}
    for k, (status, content) in zip(sent, answers, strict=True):
        by_key.setdefault(k, set()).add((status, content))
    differing = {k: seen for k, seen in by_key.items() if len(seen) != 1}
    assert not differing, f"duplicates answered differently: {differing}"
    statuses = {k: next(iter(seen))[0] for k, seen in by_key.items()}
    made = sorted(k for k, status in statuses.items() if status == 201)
    assert len(made) == stock and set(statuses.values()) == {201, 409}, sorted(statuses.values())

    level = served.inventory.stock(item)
    assert (level.reserved, level.available) == (stock, 0)
    held = served.inventory.reservations(item, limit=1000)
    # Each key at most one, each 201 one (in the anonymous callers' space).
    assert sorted(r.idempotency_key or "" for r in held) == [f"*:{k}" for k in made]
    ids = {json.loads(next(iter(by_key[k]))[1])["reservation_id"] for k in made}
    assert ids == {r.id for r in held}
    audit = run("audit", env=served.settings)
    assert audit.returncode == 0, audit


@pytest.mark.parametrize("served", ["postgresql"], indirect=True)
async def test_a_stop_answers_waiting_requests_202_at_once_and_loses_none(
    served: Served, server: RedisServer, tmp_path: Path
) -> None:
    """A service whose broker no worker reads yet holds requests waiting 20 s each; SIGTERM answers them
    all 202 at once and the process exits. A worker started then, behind a fresh service, carries each out:
    its message was in the broker all along."""
    db = 8
    settings = {
        **served.settings,
        "RESERVATIONS_BROKER_URL": server.url(db),
        "RESERVATIONS_RESULT_BACKEND": server.url(db + 1),
    }
    item = sku("STOP", served.inventory, 10)
    keys = [key("stopping") for _ in range(8)]
    first = Service("stopping", settings, tmp_path / "stopping.log")
    first.start()
    try:
        await asyncio.to_thread(first.wait_ready)
        broker = redis.Redis.from_url(server.url(db))
        async with aiohttp.ClientSession() as session:
            waiting = [
                asyncio.ensure_future(post(session, first.url, k, {"sku": item, "quantity": 1}, 20))
                for k in keys
            ]

            async def all_published() -> bool:
                return int(broker.llen("celery")) == len(keys)

            await until(all_published, timeout=20, what="every request to be published")
            assert not any(w.done() for w in waiting)
            assert first.process is not None
            first.process.send_signal(signal.SIGTERM)
            stopped_at = time.monotonic()
            answers = await asyncio.wait_for(asyncio.gather(*waiting), timeout=15)
        took = time.monotonic() - stopped_at
        assert took < 5, f"answered {took:.1f}s after the stop"
        for k, (status, content, _) in zip(keys, answers, strict=True):
            assert status == 202, content
            assert json.loads(content) == {"key": k, "status": "pending", "location": f"/reservations/{k}"}
        process = first.process
        code = await asyncio.to_thread(process.wait, STOP_TIMEOUT)
        assert code in (0, -signal.SIGTERM), first.tail()
        assert int(broker.llen("celery")) == len(keys)  # still there
        broker.close()
    finally:
        stopped_cleanly(first)

    second = Service("fresh", settings, tmp_path / "fresh.log")
    second.start()
    try:
        with cluster(tmp_path, settings, count=1, prefix="late"):
            await asyncio.to_thread(second.wait_ready)
            async with aiohttp.ClientSession() as session:
                again = await asyncio.gather(
                    *(final(session, second.url, k, {"sku": item, "quantity": 1}, []) for k in keys)
                )
            assert [status for status, _ in again] == [201] * len(keys), again
    finally:
        stopped_cleanly(second)
    assert served.inventory.stock(item).reserved == len(keys)
    stored = sorted(r.idempotency_key or "" for r in served.inventory.reservations(item))
    assert stored == sorted(f"*:{k}" for k in keys)


async def test_while_it_serves_collections_leave_out_what_the_service_started_with(tmp_path: Path) -> None:
    """A full garbage collection stops the event loop for as long as it walks the process's objects: from
    the end of its start the service freezes what it made until then (gc.freeze), so a collection walks
    only what requests make; its stop unfreezes them."""
    database = f"sqlite:///{tmp_path / 'frozen.db'}"
    settings = Settings.from_env(
        {"RESERVATIONS_DATABASE_URL": database, "RESERVATIONS_BROKER_URL": f"sqla+{database}"}
    )
    app = create_app(settings)
    assert gc.get_freeze_count() == 0
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() > 10_000
    assert gc.get_freeze_count() == 0
