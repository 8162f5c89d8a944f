"""The HTTP front door end to end: ``reservations serve`` as a real process in front of a real worker, on
PostgreSQL and a private redis-server as broker, driven over loopback by aiohttp's client.

1. ``POST /reservations`` (distinct keys, spread SKUs with ample stock, a fixed number of connections each
   sending its next request once answered) against the same server stack whose handler awaits a Celery
   no-op round trip (:mod:`bench.http_baseline`), in alternating rounds: requests/s, p50 / p99.
2. ``GET /healthz`` polled on a connection of its own at a steady rate while 1,000 reservation requests on
   one hot SKU are open and waiting for their outcomes (each connection sends its next as soon as one is
   answered, so the 1,000 stay open), idle first for comparison; the service's own in-flight gauge is read
   from ``/metrics`` beside the client's count.
3. The load generator's own cost: the same ``/healthz`` load from aiohttp's and from httpx's client,
   requests/s and the client process's CPU per 1,000 requests, so a reader sees the client is not what
   limits the figures above.

One uvicorn process for the service and one for the baseline (``--workers 1``): the machine's cores are
shared by the worker's pool, PostgreSQL, Redis and the load generator, and a second uvicorn process would
only compete with them for the same cores while splitting the outcome watcher's batched reads in two.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import sqlalchemy as sa
import uvloop

from bench import http_baseline, raw_tasks
from bench.costs import group_cpu
from bench.env import Scratch
from bench.leases import UnexpectedReply
from bench.tasks_e2e import CONCURRENCY, POOL
from bench.timing import CaseStats, Progress, Results
from reservations import Inventory, schema
from tasks import Settings
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.harness import free_port
from testing.redis_servers import redis_server
from testing.service_process import ServiceProcess as Server
from testing.service_process import front_door

ROOT = Path(__file__).resolve().parent.parent
SECTION_POST = "http: POST /reservations through the service vs FastAPI + Celery no-op round trip"
SECTION_COSTS = "http: per 1,000 requests (CPU seconds by process group)"
SECTION_HEALTH = "http: GET /healthz every 20 ms on its own connection"
SECTION_CLIENT = "http: load generator cost, GET /healthz"
SERVICE = "POST /reservations, service"
BASELINE = "POST /noop, FastAPI + Celery no-op"
# The physical reference for a front door that writes a reservation: the baseline's handler around the
# physical reference task (bench.raw_tasks), on SKUs of its own.
RAW = "POST /raw, FastAPI + raw reservation task"
RAW_SKUS = "R-"

CONNECTIONS = 64
SPREAD = 256
HOT_SKU = "H-0"
ON_HAND = 1_000_000
IN_FLIGHT = 1000
POLL_EVERY = 0.020
METRICS_EVERY = 2.0
CLIENT_CONNECTIONS = 300
WAIT = "wait=30"
REQUEST_TIMEOUT = 90.0
# uvicorn closes a connection idle for 5 s (--timeout-keep-alive): a client that reuses one as old races
# that close and sees the server hang up. Idle connections are dropped before.
KEEPALIVE_EXPIRY = 4.0
IN_FLIGHT_GAUGE = re.compile(rb"^reservations_http_in_flight(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)
QUEUE_GAUGE = re.compile(rb"^reservations_http_queue_depth(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)
SETTLE_TIMEOUT = 60.0


@dataclass(frozen=True)
class Sizing:
    warmup: int  # POSTs per case before the timed rounds
    posts: int  # POSTs per case and round
    repeats: int
    health_seconds: float  # /healthz polled this long with the 1,000 open
    idle_seconds: float  # and this long with nothing else
    client_requests: int  # /healthz requests per load generator and round, at most
    client_seconds: float  # and at most this long (httpx's client is far slower than aiohttp's)
    client_repeats: int


def sizing(quick: bool, repeats: int) -> Sizing:
    if quick:
        return Sizing(60, 300, min(repeats, 2), 6.0, 1.0, 5000, 3.0, 1)
    return Sizing(300, 2000, repeats, 15.0, 4.0, 20_000, 8.0, repeats)


# -- the processes -----------------------------------------------------------------------------------


def _service(settings: Settings, workdir: Path) -> Server:
    return front_door(worker_env(settings), workdir / "service.log")


def _baseline(broker_url: str, backend_url: str, raw_broker_url: str, workdir: Path) -> Server:
    port = free_port()
    command = [
        sys.executable, "-m", "uvicorn", f"{http_baseline.__name__}:create_app", "--factory",
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1", "--loop", "uvloop",
        "--http", "httptools", "--no-access-log",
    ]  # fmt: skip
    env = {
        **worker_env({}),
        http_baseline.BROKER_ENV: broker_url,
        http_baseline.BACKEND_ENV: backend_url,
        http_baseline.RAW_BROKER_ENV: raw_broker_url,
    }
    return Server("baseline", command, env, workdir / "baseline.log", port, cwd=ROOT)


def _run(coroutine: Awaitable[Any]) -> Any:
    """The load generator's loop is uvloop, as the servers' are."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coroutine)  # type: ignore[arg-type]


# -- load ----------------------------------------------------------------------------------------------


Request = Callable[[int], Awaitable[int]]  # sends request number i, returns its status


@dataclass
class Round:
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    samples: dict[int, str] = field(default_factory=dict)  # the first body of each unexpected status


async def _closed_loop(
    send: Request, connections: int, count: int, timeout: float, duration: float | None = None
) -> Round:
    """``count`` requests over ``connections`` senders, each sending its next once answered; with a
    ``duration``, none is sent after that many seconds (``seconds`` is then the time to the last answer)."""
    found = Round()
    numbers = iter(range(count))
    start = time.perf_counter()
    stop_at = start + duration if duration is not None else float("inf")

    async def sender() -> None:
        for i in numbers:
            t0 = time.perf_counter()
            if t0 > stop_at:
                return
            status = await send(i)
            found.latencies.append(time.perf_counter() - t0)
            found.statuses[status] += 1

    async with asyncio.timeout(timeout):
        await asyncio.gather(*(sender() for _ in range(connections)))
    found.seconds = time.perf_counter() - start
    return found


def _session(connections: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(
            limit=connections, limit_per_host=0, keepalive_timeout=KEEPALIVE_EXPIRY
        ),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT),
    )


def _poster(
    session: aiohttp.ClientSession, url: str, tag: str, sku: Callable[[int], str], samples: dict[int, str]
) -> Request:
    async def send(i: int) -> int:
        headers = {"Idempotency-Key": f"{tag}-{i}", "Prefer": WAIT}
        async with session.post(url, json={"sku": sku(i), "quantity": 1}, headers=headers) as response:
            body = await response.read()
            if response.status not in (201, 202):
                samples.setdefault(response.status, body[:300].decode(errors="replace"))
            return response.status

    return send


def _expect(what: str, found: Round, status: int) -> None:
    wrong = {code: n for code, n in found.statuses.items() if code != status}
    if wrong:
        raise UnexpectedReply(f"{what}: answers other than {status}: {wrong}; first bodies: {found.samples}")


def _post_round(server: Server, path: str, tag: str, count: int, skus: str = "S-") -> Round:
    async def go() -> Round:
        async with _session(CONNECTIONS) as session:
            samples: dict[int, str] = {}
            send = _poster(session, server.url + path, tag, lambda i: f"{skus}{i % SPREAD}", samples)
            found = await _closed_loop(send, CONNECTIONS, count, timeout=max(120.0, count / 20))
            found.samples = samples
            return found

    found: Round = _run(go())
    _expect(f"{server.name} {path}", found, 201)
    return found


# -- 1. throughput against the baseline ------------------------------------------------------------


@dataclass
class Spent:
    requests: int = 0
    cpu: dict[str, float] = field(default_factory=Counter)


def _throughput(
    service: Server, baseline: Server, worker: CeleryProcess, raw_worker: CeleryProcess, results: Results,
    size: Sizing, progress: Progress | None,
) -> int:  # fmt: skip
    """Rounds of each case in turn; returns how many reservations the service made."""
    run_id = uuid.uuid4().hex[:8]
    cases = [
        (SERVICE, service, "/reservations", worker, "S-"),
        (BASELINE, baseline, "/noop", worker, "S-"),
        (RAW, baseline, "/raw", raw_worker, RAW_SKUS),
    ]
    if progress:
        progress(f"  warm-up: {size.warmup} POSTs each")
    for _, server, path, _, skus in cases:
        _post_round(server, path, f"{run_id}-w-{path[1:]}", size.warmup, skus)
    made = size.warmup
    stats = {name: CaseStats(name) for name, *_ in cases}
    spent = {name: Spent() for name, *_ in cases}
    for repeat in range(size.repeats):
        shift = repeat % len(cases)
        for name, server, path, serving, skus in [*cases[shift:], *cases[:shift]]:
            if progress:
                progress(f"  run {repeat + 1}/{size.repeats}: {name} ({size.posts} POSTs)")
            groups = {"server": server.pid, "worker": serving.pid}
            before = {k: group_cpu(pid) for k, pid in groups.items()}
            client_before = time.process_time()
            found = _post_round(server, path, f"{run_id}-r{repeat}-{path[1:]}", size.posts, skus)
            spent[name].cpu["client"] += time.process_time() - client_before
            for k, pid in groups.items():
                spent[name].cpu[k] += group_cpu(pid) - before[k]
            spent[name].requests += size.posts
            stats[name].ops_per_s.append(size.posts / found.seconds)
            stats[name].latencies.extend(found.latencies)
        made += size.posts
    results.add(SECTION_POST, stats, SERVICE, BASELINE)
    results.add(SECTION_POST, stats, RAW, BASELINE)
    results.add(SECTION_POST, stats, SERVICE, RAW)
    for name, used in spent.items():
        per = 1000 / used.requests
        values = {f"{k} CPU s": f"{v * per:.2f}" for k, v in used.cpu.items()}
        results.cost(SECTION_COSTS, name, values)
    return made


def _recorded(inventory: Inventory, prefix: str) -> int:
    """How many requests the database holds a record of under keys starting ``prefix`` (any caller's
    space: the stored key is ``<space>:<key>``)."""
    with inventory.executor.engine.connect() as conn:
        found = conn.execute(
            sa.text("SELECT count(*) FROM accepted_requests WHERE key LIKE :keys"), {"keys": f"%:{prefix}%"}
        )
        return int(found.scalar_one())


def _check_stock(database_url: str, made: int) -> str:
    with Inventory.from_url(database_url) as inventory:
        problems = inventory.invariant_violations()
        reserved = sum(level.reserved for level in inventory.all_stock() if level.sku.startswith("S-"))
    if problems or reserved != made:
        raise UnexpectedReply(f"stock check: {problems[:3]}; {reserved} units reserved for {made} requests")
    return f"{made} reservations on {SPREAD} SKUs, stock consistent"


# -- 2. liveness with 1,000 requests open ----------------------------------------------------------


@dataclass
class Health:
    latencies: list[float] = field(default_factory=list)
    open_seen: list[int] = field(default_factory=list)  # the client's count of open POSTs at each poll
    gauge: list[float] = field(default_factory=list)  # reservations_http_in_flight, as /metrics said
    posts: Round = field(default_factory=Round)
    polled_for: float = 0.0
    settled_in: float = 0.0  # seconds from the first POST until the polls began
    shares: dict[str, float] = field(default_factory=dict)  # CPU over the polls, in cores


def _machine_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat (zeros without it)."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    tick = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - idle) / tick, sum(fields) / tick


@contextmanager
def _cpu_shares(groups: Mapping[str, int], into: dict[str, float]) -> Iterator[None]:
    """Cores used over the block by each process group and by the whole machine (every process, this
    machine's other tenants included): whether a slow answer was the service computing or waiting for a
    core."""
    before = {name: group_cpu(pid) for name, pid in groups.items()}
    busy, total = _machine_busy()
    start, client = time.perf_counter(), time.process_time()
    yield
    took = time.perf_counter() - start
    for name, pid in groups.items():
        into[name] = (group_cpu(pid) - before[name]) / took
    into["load generator"] = (time.process_time() - client) / took
    busy_after, total_after = _machine_busy()
    if total_after > total:
        into["machine"] = (busy_after - busy) / (total_after - total) * (os.cpu_count() or 1)


async def _poll(url: str, seconds: float, found: Health, open_now: Callable[[], int]) -> None:
    """``GET url`` every :data:`POLL_EVERY` on one connection; a late poll goes at once, never twice."""
    async with _session(1) as session:
        start = time.perf_counter()
        next_at = start
        while (now := time.perf_counter()) - start < seconds:
            if next_at > now:
                await asyncio.sleep(next_at - now)
            next_at = max(next_at + POLL_EVERY, time.perf_counter())
            t0 = time.perf_counter()
            async with session.get(url) as response:
                await response.read()
                if response.status != 200:
                    raise UnexpectedReply(f"GET {url}: {response.status}")
            found.latencies.append(time.perf_counter() - t0)
            found.open_seen.append(open_now())
    found.polled_for = time.perf_counter() - start


async def _gauge(url: str, stop: asyncio.Event, found: Health) -> None:
    async with _session(1) as session:
        while not stop.is_set():
            async with session.get(url) as response:
                match = IN_FLIGHT_GAUGE.search(await response.read())
            if match:
                found.gauge.append(float(match.group(1)))
            with suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), METRICS_EVERY)


async def _settle(recorded: Callable[[], int], open_now: Callable[[], int]) -> None:
    """Until every connection has its POST open and the database holds a record of as many (``recorded``):
    the burst is admitted and published (a batch's requests are published as soon as they are recorded),
    and the requests wait for outcomes. The broker's queue says less: the worker drains it as fast as it
    hands the hot SKU's requests to the holder's queue."""
    deadline = time.perf_counter() + SETTLE_TIMEOUT
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.25)
        if open_now() >= IN_FLIGHT and await asyncio.to_thread(recorded) >= IN_FLIGHT:
            return
    raise UnexpectedReply(f"the {IN_FLIGHT} POSTs were not recorded within {SETTLE_TIMEOUT:.0f} s")


async def _answered_once(found: Health, open_now: Callable[[], int]) -> None:
    """Until every connection has its POST open and as many POSTs were answered: the first burst is past."""
    deadline = time.perf_counter() + SETTLE_TIMEOUT
    while time.perf_counter() < deadline:
        await asyncio.sleep(0.25)
        if open_now() >= IN_FLIGHT and len(found.posts.latencies) >= IN_FLIGHT:
            return
    raise UnexpectedReply(f"the first {IN_FLIGHT} POSTs were not answered within {SETTLE_TIMEOUT:.0f} s")


async def _health_under_load(
    service: Server,
    groups: Mapping[str, int],
    seconds: float,
    run_id: str,
    recorded: Callable[[str], int] | None = None,
) -> Health:
    """/healthz polled with :data:`IN_FLIGHT` POSTs open: reservations on the hot SKU, settled once
    ``recorded(prefix)`` counts as many records of keys with the run's prefix; without ``recorded``, the
    baseline's no-op round trips (which record nothing: settled once as many were answered)."""
    found = Health()
    stop = asyncio.Event()
    numbers = iter(range(10**9))
    open_now = 0

    async with _session(IN_FLIGHT) as session:
        url = service.url + ("/noop" if recorded is None else "/reservations")
        send = _poster(session, url, f"{run_id}-hot", lambda i: HOT_SKU, found.posts.samples)

        async def sender() -> None:
            nonlocal open_now
            for i in numbers:
                if stop.is_set():
                    return
                open_now += 1
                t0 = time.perf_counter()
                try:
                    status = await send(i)
                finally:
                    open_now -= 1
                found.posts.latencies.append(time.perf_counter() - t0)
                found.posts.statuses[status] += 1

        began = time.perf_counter()
        senders = [asyncio.create_task(sender()) for _ in range(IN_FLIGHT)]
        try:
            if recorded is None:
                await _answered_once(found, lambda: open_now)
            else:
                await _settle(partial(recorded, f"{run_id}-hot-"), lambda: open_now)
            found.settled_in = time.perf_counter() - began
            counted = len(found.posts.latencies)
            gauge = asyncio.create_task(
                _gauge(service.url + "/metrics", stop, found) if recorded is not None else stop.wait()
            )
            with _cpu_shares(groups, found.shares):
                await _poll(service.url + "/healthz", seconds, found, lambda: open_now)
            found.posts.seconds = found.polled_for
            answered = len(found.posts.latencies) - counted
            stop.set()
            await gauge
            found.posts.latencies = found.posts.latencies[counted : counted + answered]
        finally:
            # The requests still open are abandoned (their connections close): this is the section's last
            # load, and stopping the service answers their handlers at once.
            stop.set()
            for task in senders:
                task.cancel()
            await asyncio.gather(*senders, return_exceptions=True)
    return found


async def _idle_health(service: Server, groups: Mapping[str, int], seconds: float) -> Health:
    found = Health()
    with _cpu_shares(groups, found.shares):
        await _poll(service.url + "/healthz", seconds, found, lambda: 0)
    return found


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def _quantile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _health(
    service: Server, baseline: Server, worker: CeleryProcess, results: Results, size: Sizing,
    progress: Progress | None, recorded: Callable[[str], int],
) -> tuple[float, float]:  # fmt: skip
    """Returns the p99 of /healthz under load, the service's and the baseline's, in seconds."""
    if progress:
        progress(f"  /healthz idle for {size.idle_seconds:.0f} s")
    groups = {"service": service.pid, "worker": worker.pid}
    idle: Health = _run(_idle_health(service, groups, size.idle_seconds))
    if progress:
        progress(f"  /healthz for {size.health_seconds:.0f} s with {IN_FLIGHT} POSTs open on {HOT_SKU}")
    run_id = uuid.uuid4().hex[:8]
    loaded: Health = _run(_health_under_load(service, groups, size.health_seconds, run_id, recorded))
    if progress:
        progress(
            f"  the baseline's /healthz for {size.health_seconds:.0f} s with {IN_FLIGHT} no-op POSTs open"
        )
    plain = {"service": baseline.pid, "worker": worker.pid}
    reference: Health = _run(_health_under_load(baseline, plain, size.health_seconds, uuid.uuid4().hex[:8]))
    cases = (
        ("idle", idle),
        (f"{IN_FLIGHT} POSTs open on one hot SKU", loaded),
        (f"baseline: {IN_FLIGHT} no-op POSTs open", reference),
    )
    for case, found in cases:
        posts = found.posts
        values = {
            "polls": f"{len(found.latencies)}",
            "p50": _ms(statistics.median(found.latencies)),
            "p99": _ms(_quantile(found.latencies, 99)),
            "max": _ms(max(found.latencies)),
            "open (client) min / median": (
                f"{min(found.open_seen)} / {statistics.median(found.open_seen):.0f}"
                if posts.latencies else "-"
            ),
            "in flight (/metrics) min / median": (
                f"{min(found.gauge):.0f} / {statistics.median(found.gauge):.0f}" if found.gauge else "-"
            ),
            "POSTs answered/s": f"{len(posts.latencies) / posts.seconds:,.0f}" if posts.latencies else "-",
            "POST p50 / p99": (
                f"{statistics.median(posts.latencies):.2f} s / {_quantile(posts.latencies, 99):.2f} s"
                if len(posts.latencies) > 1 else "-"
            ),
            "POST answers": ", ".join(f"{n} x {code}" for code, n in sorted(posts.statuses.items())) or "-",
            **{f"{name} cores": f"{used:.2f}" for name, used in found.shares.items()},
        }  # fmt: skip
        results.cost(SECTION_HEALTH, case, values)
    results.notes.append(
        f"http /healthz: polled every {POLL_EVERY * 1000:.0f} ms on a connection of its own (a late poll "
        f"goes at once), {size.idle_seconds:.0f} s idle, then {size.health_seconds:.0f} s while "
        f"{IN_FLIGHT} connections each keep one POST /reservations on {HOT_SKU} open (Prefer: {WAIT}, the "
        f"next sent once one is answered), from when the database held a record of {IN_FLIGHT} of them "
        f"({loaded.settled_in:.1f} s after the first: the burst admitted and published); open (client) = "
        "the client's count at each poll, in flight "
        f"(/metrics) = reservations_http_in_flight read every {METRICS_EVERY:.0f} s (it counts the poll "
        f"itself); POSTs answered/s and POST p50 / p99 over the polling; POST answers = every answer of "
        "the run; the POSTs still open when the polls ended were abandoned. Cores: CPU seconds per second "
        "over the polls of the service's process, the worker's group, this load generator and the whole "
        "machine (/proc/stat, "
        f"every process of every tenant; {os.cpu_count()} cores in all): a machine near its core count "
        "leaves the service waiting for a core, which /healthz then measures too. The baseline's row: the "
        f"same polls of the baseline server (FastAPI + Celery no-op) while {IN_FLIGHT} connections each keep "
        f"one POST /noop open, from when the first {IN_FLIGHT} were answered ({reference.settled_in:.1f} s), "
        "the least a front door awaiting a Celery round trip does per request."
    )
    return _quantile(loaded.latencies, 99), _quantile(reference.latencies, 99)


# -- 3. the load generator's cost ------------------------------------------------------------------


@dataclass
class Load:
    """One timed round of a load generator, and the client process's CPU seconds over it."""

    found: Round
    cpu: float


async def _timed(send: Request, count: int, duration: float) -> Load:
    """Every connection opened and used once first (untimed), then ``count`` requests or ``duration``."""
    await _closed_loop(send, CLIENT_CONNECTIONS, CLIENT_CONNECTIONS, timeout=60.0)
    before = time.process_time()
    found = await _closed_loop(send, CLIENT_CONNECTIONS, count, timeout=duration + 60.0, duration=duration)
    return Load(found, time.process_time() - before)


async def _aiohttp_load(url: str, count: int, duration: float) -> Load:
    async with _session(CLIENT_CONNECTIONS) as session:

        async def send(i: int) -> int:
            async with session.get(url) as response:
                await response.read()
                return response.status

        return await _timed(send, count, duration)


async def _httpx_load(url: str, count: int, duration: float) -> Load:
    limits = httpx.Limits(
        max_connections=CLIENT_CONNECTIONS,
        max_keepalive_connections=CLIENT_CONNECTIONS,
        keepalive_expiry=KEEPALIVE_EXPIRY,
    )
    async with httpx.AsyncClient(limits=limits, timeout=REQUEST_TIMEOUT) as client:

        async def send(i: int) -> int:
            try:
                return (await client.get(url)).status_code
            except httpx.RemoteProtocolError:
                # uvicorn closed the connection as idle the moment httpx reused it (its expiry is checked
                # only when the busy loop gets to it): the GET was never read, and is sent again, as a
                # browser does.
                return (await client.get(url)).status_code

        return await _timed(send, count, duration)


def _clients(service: Server, results: Results, size: Sizing, progress: Progress | None) -> None:
    url = service.url + "/healthz"
    clients: list[tuple[str, Callable[[str, int, float], Awaitable[Load]]]] = [
        (f"aiohttp {aiohttp.__version__} ClientSession", _aiohttp_load),
        (f"httpx {httpx.__version__} AsyncClient", _httpx_load),
    ]
    rates: dict[str, list[float]] = {name: [] for name, _ in clients}
    cpu = dict.fromkeys(rates, 0.0)
    server_cpu = dict.fromkeys(rates, 0.0)
    done = dict.fromkeys(rates, 0)
    latencies: dict[str, list[float]] = {name: [] for name in rates}
    for repeat in range(size.client_repeats):
        shift = repeat % len(clients)
        for name, load in [*clients[shift:], *clients[:shift]]:
            if progress:
                progress(
                    f"  run {repeat + 1}/{size.client_repeats}: {name}, {size.client_requests} GETs or "
                    f"{size.client_seconds:.0f} s"
                )
            server_before = group_cpu(service.pid)
            ran: Load = _run(load(url, size.client_requests, size.client_seconds))
            server_cpu[name] += group_cpu(service.pid) - server_before
            _expect(name, ran.found, 200)
            answered = len(ran.found.latencies)
            cpu[name] += ran.cpu
            done[name] += answered
            rates[name].append(answered / ran.found.seconds)
            latencies[name].extend(ran.found.latencies)
    for name in rates:
        p50, p99 = statistics.median(latencies[name]), _quantile(latencies[name], 99)
        results.cost(
            SECTION_CLIENT,
            name,
            {
                "requests": f"{done[name]:,}",
                "requests/s": f"{statistics.median(rates[name]):,.0f}",
                "p50 / p99": f"{_ms(p50)} / {_ms(p99)}",
                "client CPU s / 1,000": f"{cpu[name] * 1000 / done[name]:.3f}",
                "server CPU s / 1,000 (whole round)": f"{server_cpu[name] * 1000 / done[name]:.3f}",
            },
        )
    results.notes.append(
        f"http load generators: {CLIENT_CONNECTIONS} connections on GET /healthz, each sending its next "
        f"request once answered, {size.client_requests:,} requests or {size.client_seconds:.0f} s per "
        f"round, whichever ends first, {size.client_repeats} round(s) each, alternating, after every "
        "connection was opened and used once (untimed); client CPU = this process's time.process_time() "
        "over the timed part; the loop is uvloop for both."
    )


# -- the section ---------------------------------------------------------------------------------


@contextmanager
def _running(servers: list[Server]) -> Iterator[None]:
    try:
        for server in servers:
            server.start()
        yield
    finally:
        for server in servers:
            server.stop()


def http_front_door(
    scratch: Scratch, results: Results, *, quick: bool, repeats: int, progress: Progress | None = None
) -> None:
    """Needs PostgreSQL and a ``redis-server`` binary; the caller checks both."""
    size = sizing(quick, repeats)
    with ExitStack() as stack:
        workdir = Path(tempfile.mkdtemp(prefix="fencing-bench-http-"))
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        if progress:
            progress("  starting a private redis-server, migrating a fresh schema, starting a worker")
        base = stack.enter_context(redis_server(workdir / "redis")).url(None)
        database_url = scratch.postgres_url("http")
        schema.upgrade(database_url)
        with Inventory.from_url(database_url) as inventory:
            for n in range(SPREAD):
                inventory.add_sku(f"S-{n}", on_hand=ON_HAND)
            inventory.add_sku(HOT_SKU, on_hand=ON_HAND)
            inventory.add_skus([(f"{RAW_SKUS}{n}", ON_HAND) for n in range(SPREAD)])
        settings = Settings(
            broker_url=f"{base}/0",
            result_backend=f"{base}/1",
            database_url=database_url,
            lease_url=f"{base}/2",
        )
        worker = CeleryProcess(
            "bench-http", worker_env(settings), workdir / "worker.log", pool=POOL, concurrency=CONCURRENCY,
            cwd=ROOT,
        )  # fmt: skip
        # The physical reference task's worker (bench.raw_tasks): Celery's defaults, a broker of its own.
        raw_env = raw_tasks.environment(base, 3, database_url)
        raw_worker = CeleryProcess(
            "bench-http-raw", worker_env(raw_env), workdir / "raw-worker.log", app=raw_tasks.__name__,
            pool=POOL, concurrency=CONCURRENCY, cwd=ROOT,
        )  # fmt: skip
        stack.callback(stop_all, [worker, raw_worker])
        reader = stack.enter_context(Inventory.from_url(database_url))
        worker.start()
        raw_worker.start()
        service = _service(settings, workdir)
        baseline = _baseline(settings.broker_url, settings.result_backend, f"{base}/3", workdir)
        stack.enter_context(_running([service, baseline]))
        worker.wait_ready()
        raw_worker.wait_ready()
        service.wait_ready("/readyz")
        baseline.wait_ready("/healthz")

        started = time.perf_counter()
        made = _throughput(service, baseline, worker, raw_worker, results, size, progress)
        stock = _check_stock(database_url, made)
        throughput_took = time.perf_counter() - started
        if progress:
            progress(f"  load generators: {CLIENT_CONNECTIONS} connections on /healthz")
        _clients(service, results, size, progress)
        p99, baseline_p99 = _health(
            service, baseline, worker, results, size, progress, partial(_recorded, reader)
        )
    results.notes.append(
        f"http POST rows: {CONNECTIONS} connections, each sending its next request once answered (distinct "
        f"Idempotency-Keys, {SPREAD} SKUs of {ON_HAND:,} units, Prefer: {WAIT}, every answer 201); "
        f"{size.posts} POSTs per case and run, {size.repeats} runs taking the cases in turn, after "
        f"{size.warmup} each ({throughput_took:.0f} s); {stock}. Both servers are one uvicorn process on "
        "uvloop + httptools, access log off (reservations serve --workers 1 --no-access-log; the baseline is "
        "bench.http_baseline: the same body model, Celery send_task of reservations.noop from one thread, "
        "its result awaited through one Redis pattern subscription; its POST /raw the same round trip of "
        "the physical reference task, bench.raw_tasks, on a worker of its own at Celery's defaults, on SKUs "
        f"{RAW_SKUS}0 to {RAW_SKUS}{SPREAD - 1}), in front of one worker (prefork "
        f"-c {CONCURRENCY}, Redis leases) on a private redis-server; one process each because the "
        "machine's cores are shared with the worker, PostgreSQL, Redis and this load generator. CPU per "
        "1,000: the serving process, the worker's group (pool children included), this client."
    )
    results.notes.append(
        f"http /healthz p99 with {IN_FLIGHT} POSTs open: {_ms(p99)} "
        f"({'within' if p99 < 0.050 else 'over'} the 50 ms goal); the baseline's with {IN_FLIGHT} no-op "
        f"POSTs open: {_ms(baseline_p99)}."
    )
