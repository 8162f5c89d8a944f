"""Fault-injection run: real Celery workers (and celery beat, as deployed) on PostgreSQL and private Redis
servers take a stream of reserve / confirm / release / restock requests while workers are frozen past
their lease, killed and restarted, and the lease Redis loses its data; then an independent checker audits
the database.

A flash sale runs through it: a share of the requests are reservations of one hot SKU, sent in bursts,
so that they find its lease busy, wait on its pending list and are served in batches by whoever holds the
lease (or the SKU queue's watch, or beat's sweep); the faults then also hit holders serving batches
(frozen, paused by the run or killed with requests waiting on them).

The same workload runs twice, fenced and lease-only (fence condition off, never-lowers trigger dropped),
so the table shows what the fence prevents. Nothing here imports the workers: they are subprocesses.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import redis
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from admin.picture import save_timeline
from admin.proxy import DelayProxy
from fencing import BackendUnavailable, LeaseManager
from fencing.sql import make_engine
from reservations import schema
from reservations.audit import ONCE_PER_KEY, Rule
from reservations.inventory import Inventory
from reservations.models import (
    pending_reservations,
    request_outcomes,
    reservations,
    sku_history,
    stock,
    task_attempts,
)
from reservations.requests import request_id
from reservations.validation import scope_of
from tasks.producer import Producer

POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
LEASE_TTL = 1.0
# A frozen child is resumed only after its lease has certainly run out at the coordinator.
STOP_FOR = 2.0 * LEASE_TTL
MAX_EPOCHS = 5
# Redelivery of a killed worker's unacknowledged message: the smallest the settings allow (4x ttl), so
# the run can drain within its bounds; a request redelivered while still running is an idempotent replay.
VISIBILITY_TIMEOUT = 4 * LEASE_TTL
INITIAL_STOCK = 30
TICK = 0.05
# kombu scans for unacknowledged messages past the visibility timeout only every ~100 s by default
# (unacked_restore_interval x unacked_restore_throttle); the run sweeps itself this often instead.
SWEEP_EVERY = 1.0
# A client that saw no outcome sends the same key again (safe by design). Needed because a worker killed
# between the broker's BRPOP and kombu recording the message as unacknowledged loses that message.
RESEND_AFTER = 6.0
# celery beat runs alongside the workers, as in a deployment; its sweeps (expired holds, and queued
# requests that waited longer than a lease ttl: the batching's last resort) come this often, the same
# few lease ttls apart as the defaults (30 s sweeps, 30 s ttl) relative to a run this short.
BEAT_EVERY = 5 * LEASE_TTL
# The flash sale: its SKU, and how many of its requests are sent back to back (they reach several workers
# at once, so all but one find the lease busy and wait for the holder to serve them).
HOT_SKU = "HOT"
FLASH_BURST = 5
# The worker killed mid-run holds the hot SKU's lease with requests waiting on it: serving them in a
# batch if it is caught so between the first two fractions of the stream, else holding it for anything
# until the third (watched this often); if none is caught, a normal worker is killed anyway.
KILL_FROM, KILL_ANY_HOLDER, KILL_BY = 0.3, 0.6, 0.8
# Besides the workers that freeze themselves, the run pauses this many holders caught serving a batch of
# the hot SKU (SIGSTOP, resumed after STOP_FOR like the others), one at a time.
HOLDER_PAUSES = 3
WATCH_EVERY = 0.003
HOLDER_FROZEN = "hot-SKU holder frozen, requests waiting"
SERVER_FROZEN = "hot-SKU holder frozen serving a batch"
SERVER_PAUSED = "hot-SKU batch server SIGSTOPped by the run"
HOLDER_KILLED = "hot-SKU holder SIGKILLed, requests waiting"
SERVER_KILLED = "hot-SKU holder SIGKILLed serving a batch"
# Faults in the order the table lists them, each hot-SKU line under the fault it counts a part of.
FAULTS = (
    "pool child frozen past its lease",
    HOLDER_FROZEN,
    SERVER_FROZEN,
    SERVER_PAUSED,
    "worker SIGKILL + restart",
    HOLDER_KILLED,
    SERVER_KILLED,
    "lease Redis restart (data lost)",
    "client->postgres chunks delayed",
)
# How the table names them: under the fault they are part of.
FAULT_LABELS = {
    HOLDER_FROZEN: "  of which the hot SKU's holder, requests waiting",
    SERVER_FROZEN: "    of which serving them in a batch",
    SERVER_PAUSED: "  of which SIGSTOPped by the run serving a batch",
    HOLDER_KILLED: "  of which the hot SKU's holder, requests waiting",
    SERVER_KILLED: "    of which serving them in a batch",
}


# The beat sweep's result in a worker's log: "reservations.serve_waiting[<id>] succeeded in <s>s: {...}".
SWEPT = re.compile(rb"serve_waiting\[[^\]]+\] succeeded in [0-9.e-]+s: \{'skus': \d+, 'served': (\d+)\}")


class ChaosFailed(RuntimeError):
    """The run could not be carried out (a process did not start); not a failed check."""


@dataclass(frozen=True)
class Options:
    workers: int = 3
    skus: int = 3
    requests: int = 120
    duration: float = 20.0  # seconds of request stream and faults, per run; draining comes after
    drain: float = 40.0  # longest wait for the last outcomes after the stream
    seed: int = 1
    restart_lease_redis: bool = True  # off: only frozen and killed workers, to see what freezing alone does
    proxy_delay: float = 0.0  # > 0: one more worker reaches PostgreSQL through a DelayProxy (needs 3 workers)
    hot: float = 0.5  # share of the new requests that are flash-sale reservations of the hot SKU; 0: none
    batching: bool = True  # workers serve a busy SKU's reservations in batches (RESERVATIONS_BATCHING)
    postgres_url: str = POSTGRES_URL
    folder: Path | None = None  # worker logs; a temporary folder by default
    pictures: Path = Path("var/chaos")  # one SVG timeline per run is saved here


@dataclass
class Sent:
    key: str
    operation: str
    kwargs: dict[str, Any]


@dataclass
class Batching:
    """What the batching did, read from the database and the worker logs after the run (nothing here is
    a check)."""

    batches: int = 0  # committed batches: one fenced transaction each
    requests: int = 0  # requests whose final outcome a batch wrote
    for_others: int = 0  # of those, served by another task than their own (a holder, the SKU's watch)
    largest: int = 0  # requests in the largest batch
    stale_refused: int = 0  # batches refused whole at the stock row (rejected reserve without a key)
    writes_behind_newer_token: int = 0  # batch writes accepted under a token older than the newest
    left_pending: int = 0  # entries still on a pending list at the end (harmless once their request ended)
    watches: int = 0  # runs of a SKU queue's watch task (from the worker logs)
    swept: int = 0  # requests the beat sweep served, having waited longer than a lease ttl (worker logs)
    longest_wait: float = 0.0  # seconds from a batched request's first send to its outcome, at most

    def as_json(self) -> dict[str, float]:
        return {**asdict(self), "longest_wait": round(self.longest_wait, 1)}


@dataclass
class RunReport:
    mode: str
    seconds: float = 0.0
    enqueued: int = 0
    replayed: int = 0
    resent: int = 0
    # Requests still waiting on a pending list when the others without an outcome were sent again.
    waiting_at_resend: list[str] = field(default_factory=list)
    sent_at: dict[str, float] = field(default_factory=dict)  # wall clock of each key's first send
    lost_by_role: Counter[str] = field(default_factory=Counter)
    lost_serving_by_role: Counter[str] = field(default_factory=Counter)  # ownership lost serving a batch
    faults: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    checks: dict[str, list[str]] = field(default_factory=dict)
    rejected_stale_writes: int = 0
    batching: Batching = field(default_factory=Batching)
    batching_on: bool = True
    hot_sku: str | None = None
    hot_stock: int = 0
    flash: Counter[str] = field(default_factory=Counter)  # final statuses of the hot SKU's reservations
    sent: dict[str, Sent] = field(default_factory=dict)
    picture: Path | None = None

    @property
    def violations(self) -> int:
        return sum(len(found) for found in self.checks.values())

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seconds": round(self.seconds, 1),
            "enqueued": self.enqueued,
            "replayed": self.replayed,
            "resent": self.resent,
            "waiting_at_resend": self.waiting_at_resend,
            "faults": dict(self.faults),
            "statuses": dict(self.statuses),
            "rejected_stale_writes": self.rejected_stale_writes,
            "lost_ownership_by_worker_role": dict(self.lost_by_role),
            "lost_ownership_serving_batches_by_worker_role": dict(self.lost_serving_by_role),
            "batching_on": self.batching_on,
            "hot_sku": self.hot_sku,
            "hot_stock": self.hot_stock,
            "flash_sale": {"requests": sum(self.flash.values()), "statuses": dict(self.flash)},
            "batching": self.batching.as_json(),
            "violations": self.violations,
            "checks": self.checks,
            "picture": str(self.picture) if self.picture else None,
        }


# -- processes -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _server_port() -> int:
    """A free port below the ephemeral range, for a server restarted on the same port mid-run.

    Not one the kernel hands out for outgoing connections: while the server is down, a client's reconnect
    attempt to that port could otherwise be given it as its own source port and connect to itself, and
    the port would then stay taken (in TIME-WAIT) for a minute, so the restart could not bind it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    pick = random.Random()
    for _ in range(100):
        port = pick.randrange(max(1024, low - 12000), max(1025, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    return _free_port()


def _wait(what: str, check: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise ChaosFailed(f"timed out waiting for {what}")
        time.sleep(TICK)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return None


class RedisServer:
    """A private redis-server without persistence: a restart loses everything, as a crash would."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _server_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        log_path = self.folder / "redis-server.log"
        with log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                    *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal must not kill it before we clean up
            )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)

        def answers() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise ChaosFailed(f"redis-server on port {self.port} exited: see {log_path}")
            try:
                return bool(client.ping())
            except redis.RedisError:
                return False

        try:
            _wait(f"redis-server on port {self.port}", answers, timeout=10)
        finally:
            client.close()

    def kill(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            with suppress(ProcessLookupError):
                process.kill()
            process.wait()


@dataclass
class Worker:
    name: str
    env: dict[str, str]
    log_path: Path
    # "normal"; "freeze": stops before every write, resumed later; "delay": behind the proxy; "beat": not a
    # worker but celery beat, which schedules the periodic sweeps a deployment runs (no faults for it)
    role: str
    process: subprocess.Popen[bytes] | None = None
    stopped_since: dict[int, float] = field(default_factory=dict)
    # Frozen children seen holding the hot SKU's lease with requests waiting, counted once per freeze.
    frozen_holders: set[int] = field(default_factory=set)

    def start(self) -> None:
        if self.role == "beat":
            schedule = self.log_path.with_name(f"{self.name}-schedule")
            command = [*(sys.executable, "-m", "celery", "-A", "tasks", "beat", "-s", str(schedule))]
            command += ["--loglevel", "INFO"]
        else:
            command = [
                *(sys.executable, "-m", "celery", "-A", "tasks", "worker"),
                *("--pool", "prefork", "-c", "1", "-n", f"{self.name}@%h", "--loglevel", "INFO"),
                *("--without-gossip", "--without-mingle", "--without-heartbeat"),
            ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: signals reach the pool child too
            )

    def wait_ready(self, since: int = 0) -> None:
        def ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise ChaosFailed(f"worker {self.name} exited: see {self.log_path}")
            started = b"beat: Starting" if self.role == "beat" else b" ready."
            return started in self.log_path.read_bytes()[since:]

        _wait(f"worker {self.name} to be ready", ready, timeout=60)

    def children(self) -> list[int]:
        if self.process is None:
            return []
        found: list[int] = []
        for path in Path(f"/proc/{self.process.pid}/task").glob("*/children"):
            with suppress(OSError):
                found.extend(int(p) for p in path.read_text().split())
        return found

    def signal_group(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)
        if self.process is not None:
            self.process.wait()

    def terminate(self) -> None:
        self.signal_group(signal.SIGCONT)  # a stopped child cannot exit
        self.signal_group(signal.SIGTERM)

    def stop(self, deadline: float) -> None:
        if self.process is not None:
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()  # also any pool child the main process left behind


@contextmanager
def _pg_schema(admin_url: str, fenced: bool) -> Iterator[str]:
    name = f"chaos_{uuid.uuid4().hex[:12]}"
    admin = make_engine(admin_url)
    try:
        with admin.begin() as conn:
            conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
        url = f"{admin_url}?options=-csearch_path%3D{name}"
        schema.upgrade(url)
        if not fenced:
            # The trigger alone would refuse a lowered token: lease-only means both guards are off.
            with admin.begin() as conn:
                conn.execute(sa.text(f'DROP TRIGGER stock_fence_never_lowers ON "{name}".stock'))
        yield url
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA IF EXISTS "{name}" CASCADE'))
        admin.dispose()


# -- the workload ----------------------------------------------------------------------------------------


def flash_stock(options: Options) -> int:
    """The hot SKU's stock: about two thirds of a unit per flash-sale request expected, each asking for 1
    or 2, so it sells out partway through the sale (released reservations put some units back)."""
    return max(10, round(0.6 * options.requests * options.hot))


class Workload:
    """A seeded stream of requests; confirm and release pick reservations whose outcome came back.

    With ``hot`` > 0, bursts of FLASH_BURST reservations of the hot SKU make up about that share of the
    new requests; with 0, the seed draws the plain mixed stream over the other SKUs.
    """

    def __init__(self, options: Options, skus: list[str], inventory: Inventory) -> None:
        self.random = random.Random(options.seed)
        self.skus = skus
        self.inventory = inventory
        self.sent: dict[str, Sent] = {}
        self.replays = 0
        self.pending_reserves: list[str] = []
        self.open_reservations: list[str] = []
        self.counter = 0
        hot = min(max(options.hot, 0.0), 0.95)
        # A draw is a burst with this chance, so that bursts of FLASH_BURST are ``hot`` of the requests.
        self.burst_chance = hot / (FLASH_BURST * (1 - hot) + hot) if hot > 0 else 0.0

    def _key(self, operation: str) -> str:
        self.counter += 1
        return f"chaos-{self.counter:05d}-{operation}"

    def _harvest(self) -> None:
        still = []
        for key in self.pending_reserves:
            outcome = self.inventory.request_outcome(key)
            if outcome is None:
                still.append(key)
            elif outcome.status == "reserved":
                self.open_reservations.extend(outcome.detail.get("reservation_ids") or [])
        self.pending_reserves = still

    def next(self, room: int = FLASH_BURST) -> list[tuple[Sent, bool]]:
        """The next requests (one, or a flash-sale burst of at most ``room``), each with whether it
        replays an earlier key (same key, same arguments)."""
        if self.sent and self.random.random() < 0.1:
            self.replays += 1
            return [(self.random.choice(list(self.sent.values())), True)]
        self._harvest()
        if self.burst_chance and self.random.random() < self.burst_chance:
            return [(self._flash(), False) for _ in range(max(1, min(room, FLASH_BURST)))]
        return [(self._regular(), False)]

    def _flash(self) -> Sent:
        sent = Sent(self._key("reserve"), "reserve", {"sku": HOT_SKU, "quantity": self.random.randint(1, 2)})
        self.pending_reserves.append(sent.key)
        self.sent[sent.key] = sent
        return sent

    def _regular(self) -> Sent:
        roll = self.random.random()
        sku = self.random.choice(self.skus)
        if self.open_reservations and roll < 0.35:
            reservation = self.open_reservations.pop(self.random.randrange(len(self.open_reservations)))
            operation = "confirm" if self.random.random() < 0.6 else "release"
            sent = Sent(self._key(operation), operation, {"reservation_id": reservation})
        elif roll < 0.5:
            sent = Sent(self._key("restock"), "restock", {"sku": sku, "quantity": self.random.randint(1, 4)})
        else:
            sent = Sent(self._key("reserve"), "reserve", {"sku": sku, "quantity": self.random.randint(1, 3)})
            self.pending_reserves.append(sent.key)
        self.sent[sent.key] = sent
        return sent


# -- one run ---------------------------------------------------------------------------------------------


def _worker_env(base: dict[str, str], folder: Path, name: str, role: str, proxied_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESERVATIONS_")}
    env.update(base)
    env["PYTHONUNBUFFERED"] = "1"
    env["RESERVATIONS_FAILPOINT_DIR"] = str(folder / f"failpoints-{name}")
    if role in ("freeze", "delay"):
        # Renewal slower than the pause or the delay, as for a request stuck in the network: nothing but
        # the fence stands between the late write and the stock row.
        env["RESERVATIONS_LEASE_RENEW_EVERY"] = "600"
    if role == "freeze":
        env["RESERVATIONS_FAILPOINTS"] = "before_write=stop"  # every write, not ``once``
    if role == "delay":
        env["RESERVATIONS_DATABASE_URL"] = proxied_url
    return env


def _roles(options: Options) -> list[str]:
    # About a third of the workers freeze before each write; at least one, and one always stays normal
    # (the one that is killed and restarted).
    freezers = max(1, min(options.workers - 1, options.workers // 3))
    delayed = 1 if options.proxy_delay > 0 and options.workers - freezers >= 2 else 0
    return ["freeze"] * freezers + ["delay"] * delayed + ["normal"] * (options.workers - freezers - delayed)


def _via(proxy: DelayProxy, url: str) -> str:
    return (
        sa.engine.make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    )


def run_once(options: Options, *, fenced: bool, folder: Path, console: Console) -> RunReport:
    mode = "fenced" if fenced else "lease-only"
    report = RunReport(mode, batching_on=options.batching)
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    skus = [f"SKU{n}" for n in range(1, options.skus + 1)]
    initial = dict.fromkeys(skus, INITIAL_STOCK)
    if options.hot > 0:
        report.hot_sku, report.hot_stock = HOT_SKU, flash_stock(options)
        initial[HOT_SKU] = report.hot_stock
    broker = RedisServer(folder / "redis-broker")
    lease_redis = RedisServer(folder / "redis-leases")
    workers: list[Worker] = []
    roles = _roles(options)
    proxy: DelayProxy | None = None
    with _pg_schema(options.postgres_url, fenced) as database_url:
        try:
            if "delay" in roles:
                url = sa.engine.make_url(database_url)
                target = (url.host or "127.0.0.1", url.port or 5432)
                # The statement that opens a stock write (it locks the row) is the one whose delay lets a
                # newer epoch write first; a delay after the lock only blocks the others.
                proxy = DelayProxy(
                    target, delay=options.proxy_delay, fraction=0.5, match=b"FOR UPDATE", seed=options.seed
                ).start()
            broker.start()
            lease_redis.start()
            settings = {
                "RESERVATIONS_DATABASE_URL": database_url,
                "RESERVATIONS_BROKER_URL": broker.url(0),
                "RESERVATIONS_RESULT_BACKEND": broker.url(1),
                "RESERVATIONS_LEASE_URL": lease_redis.url(0),
                "RESERVATIONS_LEASE_TTL": str(LEASE_TTL),
                "RESERVATIONS_MAX_EPOCHS": str(MAX_EPOCHS),
                "RESERVATIONS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
                "RESERVATIONS_ENFORCE_FENCE": "1" if fenced else "0",
                "RESERVATIONS_BATCHING": "1" if options.batching else "0",
                "RESERVATIONS_EXPIRY_INTERVAL": str(BEAT_EVERY),
            }
            proxied = _via(proxy, database_url) if proxy is not None else database_url
            for n, role in enumerate(roles):
                name = f"{'f' if fenced else 'l'}{n + 1}"
                env = _worker_env(settings, folder, name, role, proxied)
                workers.append(Worker(name, env, folder / f"worker-{name}.log", role))
            beat = f"{'f' if fenced else 'l'}-beat"
            beat_env = _worker_env(settings, folder, beat, "beat", proxied)
            workers.append(Worker(beat, beat_env, folder / "beat.log", "beat"))
            for worker in workers:
                worker.start()  # all before any is waited for: the imports overlap
            for worker in workers:
                worker.wait_ready()
            console.print(
                f"[bold]{mode}[/]: {options.workers} workers ({roles.count('freeze')} freezing before "
                f"writes, {roles.count('delay')} behind a {options.proxy_delay:g}s delaying proxy), "
                f"{options.skus} SKUs, {options.requests} requests over {options.duration:g}s"
                + (
                    f", {options.hot:.0%} of them flash-sale reservations of {HOT_SKU} ({report.hot_stock}"
                    f" units) in bursts of {FLASH_BURST}"
                    if report.hot_sku
                    else ""
                )
                + f", batching {'on' if options.batching else 'off'}, beat sweeping every {BEAT_EVERY:g}s",
                highlight=False,
            )
            with Inventory.from_url(database_url) as inventory:
                for sku, units in initial.items():
                    inventory.add_sku(sku, on_hand=units)
                _drive(options, inventory, skus, settings, workers, lease_redis, report)
                report.checks = check(database_url, initial, report.sent)
                report.statuses = _statuses(database_url)
                report.rejected_stale_writes = sum(inventory.rejection_counts().values())
                report.batching = batching_figures(database_url, report.sent_at)
                if report.hot_sku:
                    report.flash = _flash_statuses(database_url, report.sent)
                report.picture = save_timeline(
                    options.pictures / f"timeline-{mode}.svg",
                    f"{mode}: {options.workers} workers, {options.requests} requests",
                    {sku: inventory.history(sku, limit=10_000) for sku in initial},
                )
            if proxy is not None:
                report.faults["client->postgres chunks delayed"] = proxy.delayed_chunks
            for worker in workers:
                # Which fault made the stale writes: each refused write logs "lost ownership" in its worker,
                # a batch holder's with "while serving pending reservations".
                if worker.role == "beat":
                    continue
                log = worker.log_path.read_bytes()
                report.lost_by_role[worker.role] += log.count(b"lost ownership of")
                report.lost_serving_by_role[worker.role] += log.count(b"while serving pending reservations")
                report.batching.watches += log.count(b"reservations.watch_waiting[") // 2  # received, ended
                report.batching.swept += sum(int(n) for n in SWEPT.findall(log))
        finally:
            for worker in workers:  # all at once: warm shutdowns overlap
                worker.terminate()
            deadline = time.monotonic() + 10
            for worker in workers:
                worker.stop(deadline)
            broker.kill()
            lease_redis.kill()
            if proxy is not None:
                proxy.close()
    report.seconds = time.monotonic() - started
    return report


def _drive(
    options: Options,
    inventory: Inventory,
    skus: list[str],
    settings: dict[str, str],
    workers: list[Worker],
    lease_redis: RedisServer,
    report: RunReport,
) -> None:
    """Send the stream while injecting faults, then wait (still resuming frozen children) for outcomes."""
    client = Producer(settings["RESERVATIONS_BROKER_URL"], settings.get("RESERVATIONS_RESULT_BACKEND"))
    # The sweep below restores what was unacknowledged longer than the workers' visibility timeout; it
    # reads that timeout from its own connection's options, which must therefore be the workers'.
    client.app.conf.broker_transport_options = {"visibility_timeout": VISIBILITY_TIMEOUT}
    workload = Workload(options, skus, inventory)
    report.sent = workload.sent
    database_url = settings["RESERVATIONS_DATABASE_URL"]
    watch = HotWatch(lease_redis.url(0), database_url, workload.sent) if report.hot_sku else None
    start = time.monotonic()
    gap = options.duration / max(1, options.requests)
    kill_from = start + KILL_FROM * options.duration
    kill_any_holder = start + KILL_ANY_HOLDER * options.duration
    # Without a flash sale there is no holder to catch: the kill comes at once.
    kill_by = start + (KILL_BY if watch is not None else KILL_FROM) * options.duration
    restart_redis_at = start + 0.55 * options.duration if options.restart_lease_redis else 0.0
    sweep = _sweeper(client)
    killable = [w for w in workers if w.role == "normal"]
    kill_pending = bool(killable)
    pauses_left, pause_after = (HOLDER_PAUSES if watch is not None else 0), start
    sent_count = 0
    restarted: list[tuple[Worker, int]] = []
    try:
        while sent_count < options.requests:
            now = time.monotonic()
            if now >= start + sent_count * gap:
                for request, replay in workload.next(room=options.requests - sent_count):
                    client.send(request.operation, request.key, request.kwargs)
                    report.sent_at.setdefault(request.key, time.time())
                    sent_count += 1
                    report.replayed += replay
            if kill_pending and now >= kill_from:
                victim = (
                    _holder_to_kill(watch, workers, report, serving_only=now < kill_any_holder)
                    if watch is not None
                    else None
                )
                if victim is None and now >= kill_by:
                    victim = killable[0]
                if victim is not None:
                    victim.kill()
                    report.faults["worker SIGKILL + restart"] += 1
                    offset = victim.log_path.stat().st_size
                    victim.start()
                    restarted.append((victim, offset))
                    kill_pending = False
            serving_paused = (
                pauses_left > 0
                and now >= pause_after
                and watch is not None
                and _pause_serving_holder(watch, workers, report)
            )
            if serving_paused:
                pauses_left, pause_after = pauses_left - 1, now + STOP_FOR
            if restart_redis_at and now >= restart_redis_at:
                # The lease coordinator loses its data (token counters included); the broker is separate
                # and keeps the queued requests.
                lease_redis.kill()
                time.sleep(0.3)
                lease_redis.start()
                report.faults["lease Redis restart (data lost)"] += 1
                restart_redis_at = 0.0
            _resume_frozen(workers, report, watch)
            sweep()
            # While a pause or the kill waits for the hot SKU's holder, look often: a holder keeps its lease
            # for tens of milliseconds unless something holds it up.
            watching = watch is not None and (pauses_left or (kill_pending and now >= kill_from))
            time.sleep(WATCH_EVERY if watching else TICK)
        for victim, offset in restarted:
            victim.wait_ready(since=offset)
        drain_start = time.monotonic()
        resend_at = drain_start + RESEND_AFTER
        pending = set(workload.sent)
        while pending and time.monotonic() < drain_start + options.drain:
            _resume_frozen(workers, report, watch)
            sweep()
            pending = {key for key in pending if inventory.request_outcome(key) is None}
            if pending and resend_at and time.monotonic() >= resend_at:
                # A request still waiting on a pending list is not lost: serving it is the batching's
                # job (its SKU's holder, its watch or beat's sweep), so only the others are sent again.
                report.waiting_at_resend = sorted(pending & _waiting_keys(database_url))
                for key in sorted(pending - set(report.waiting_at_resend)):
                    request = workload.sent[key]
                    client.send(request.operation, key, request.kwargs)
                    report.resent += 1
                resend_at = 0.0
            time.sleep(0.2)
    finally:
        client.close()
        if watch is not None:
            watch.close()
    report.enqueued = len(workload.sent)


def _waiting_keys(database_url: str) -> set[str]:
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return {row[0] for row in conn.execute(sa.select(pending_reservations.c.key))}
    finally:
        engine.dispose()


class HotWatch:
    """Who holds the hot SKU's lease right now (a worker's pool child, by pid), whether requests wait on
    its pending list, and whether the holder is serving them. Read from the lease Redis and the database,
    as any operator could."""

    def __init__(self, lease_url: str, database_url: str, sent: dict[str, Sent]) -> None:
        self.leases = LeaseManager.from_url(lease_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        self.engine = make_engine(database_url)
        self.sent = sent
        self.keys: dict[str, str] = {}  # task id -> key: a request's task id derives from its key

    def key_of(self, task_id: str) -> str | None:
        if len(self.keys) < len(self.sent):
            self.keys = {request_id(key): key for key in self.sent}
        return self.keys.get(task_id)

    def holder(self) -> tuple[int, str] | None:
        """The holding pool child's pid and its task id."""
        try:
            info = self.leases.current(scope_of(HOT_SKU))
        except BackendUnavailable:  # the lease Redis is being restarted
            return None
        if info is None:
            return None
        # A task's holder is "<host>:<pid>:<task id>" (tasks.jobs).
        host_pid, _, task_id = info.holder.rpartition(":")
        pid = host_pid.rpartition(":")[2]
        return (int(pid), task_id) if pid.isdigit() and task_id else None

    def holding(self, pids: set[int]) -> tuple[int, bool] | None:
        """(pid, serving a batch) when one of ``pids`` holds the lease while requests wait on it.

        A holder serves a batch when it is no request's task (the SKU queue's watch), when its own
        request waits on the list too (it queued itself, then found the lease free) or when its request
        already ended (the lease was taken again after its own write); otherwise it holds the lease for
        its own request.
        """
        found = self.holder()
        if found is None or found[0] not in pids:
            return None
        pid, task_id = found
        with self.engine.connect() as conn:
            waiting = conn.execute(
                sa.select(pending_reservations.c.task_id).where(pending_reservations.c.sku == HOT_SKU)
            ).all()
            if not waiting:
                return None
            key = self.key_of(task_id)
            if key is None:
                return pid, True
            ended = conn.execute(
                sa.select(request_outcomes.c.key).where(request_outcomes.c.key == key)
            ).first()
        return pid, ended is not None or any(row[0] == task_id for row in waiting)

    def close(self) -> None:
        self.leases.close()
        self.engine.dispose()


def _holder_to_kill(
    watch: HotWatch, workers: list[Worker], report: RunReport, *, serving_only: bool
) -> Worker | None:
    """A worker (not one of the freezing ones) whose pool child holds the hot SKU's lease while requests
    wait on it, serving them if ``serving_only``: killing it leaves them to the next holder, the SKU's
    watch or beat's sweep."""
    candidates = {pid: w for w in workers if w.role in ("normal", "delay") for pid in w.children()}
    found = watch.holding(set(candidates))
    if found is None or (serving_only and not found[1]):
        return None
    report.faults[HOLDER_KILLED] += 1
    report.faults[SERVER_KILLED] += found[1]
    return candidates[found[0]]


def _pause_serving_holder(watch: HotWatch, workers: list[Worker], report: RunReport) -> bool:
    """SIGSTOP a pool child (of a worker that does not freeze itself) caught serving a batch of the hot
    SKU; ``_resume_frozen`` resumes it once its lease has run out, as it does the self-frozen ones."""
    candidates = {pid for w in workers if w.role in ("normal", "delay") for pid in w.children()}
    found = watch.holding(candidates)
    if found is None or not found[1]:
        return False
    with suppress(ProcessLookupError):
        os.kill(found[0], signal.SIGSTOP)
        report.faults[SERVER_PAUSED] += 1
        return True
    return False


def _sweeper(client: Producer) -> Callable[[], None]:
    """Give messages unacknowledged past the visibility timeout (a killed worker's) back to the queue."""
    last = [time.monotonic()]

    def sweep() -> None:
        if time.monotonic() - last[0] < SWEEP_EVERY:
            return
        last[0] = time.monotonic()
        with client.app.connection_for_write() as conn:
            conn.default_channel.qos.restore_visible(num=1000, interval=1)

    return sweep


def _resume_frozen(workers: list[Worker], report: RunReport, watch: HotWatch | None = None) -> None:
    now = time.monotonic()
    for worker in workers:
        for pid in worker.children():
            if _state(pid) != "T":
                worker.stopped_since.pop(pid, None)
                worker.frozen_holders.discard(pid)
                continue
            since = worker.stopped_since.setdefault(pid, now)
            if since == now:
                report.faults["pool child frozen past its lease"] += 1
            found = watch.holding({pid}) if watch is not None and pid not in worker.frozen_holders else None
            if found is not None:
                # Frozen holding the hot SKU's lease (for its own reservation or to serve a batch) while
                # requests wait on it: until the lease runs out, nobody serves them.
                worker.frozen_holders.add(pid)
                report.faults[HOLDER_FROZEN] += 1
                report.faults[SERVER_FROZEN] += found[1]
            if now - since >= STOP_FOR:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                worker.stopped_since.pop(pid, None)
                worker.frozen_holders.discard(pid)


# -- the independent checker ----------------------------------------------------------------------------


def check(database_url: str, initial: dict[str, int], sent: dict[str, Sent]) -> dict[str, list[str]]:
    """Audit the database on its own terms: every broken rule as a sentence, grouped by rule."""
    found: dict[str, list[str]] = {name: [] for name in RULES}
    with Inventory.from_url(database_url) as inventory:
        for violation in inventory.invariant_violations():
            found[AUDITED[violation.rule]].append(str(violation))
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            levels = {r.sku: r for r in conn.execute(sa.select(stock))}
            units = conn.execute(
                sa.select(
                    reservations.c.sku, reservations.c.status, sa.func.sum(reservations.c.quantity)
                ).group_by(reservations.c.sku, reservations.c.status)
            ).all()
            outcomes = {r.key: r for r in conn.execute(sa.select(request_outcomes))}
            applied = conn.execute(
                sa.select(
                    sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation, sa.func.count()
                )
                .where(
                    sku_history.c.kind == "write",
                    sku_history.c.idempotency_key.is_not(None),
                    # those are already counted by the audit
                    sku_history.c.operation.not_in(ONCE_PER_KEY),
                )
                .group_by(sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation)
                .having(sa.func.count() > 1)
            ).all()
            made = conn.execute(
                sa.select(reservations.c.id, reservations.c.idempotency_key, reservations.c.status)
            ).all()
            wrote = {
                r[0]
                for r in conn.execute(
                    sa.select(sku_history.c.idempotency_key)
                    .where(sku_history.c.kind == "write", sku_history.c.idempotency_key.is_not(None))
                    .distinct()
                )
            }
    finally:
        engine.dispose()
    by_status: dict[tuple[str, str], int] = {(r[0], r[1]): int(r[2]) for r in units}
    restocked: Counter[str] = Counter()
    for key, request in sent.items():
        row = outcomes.get(key)
        if request.operation == "restock" and row is not None and row.status == "restocked":
            restocked[request.kwargs["sku"]] += int(request.kwargs["quantity"])
    oversells, conservation = found["oversells"], found["conservation"]
    for sku, level in sorted(levels.items()):
        held, confirmed = by_status.get((sku, "held"), 0), by_status.get((sku, "confirmed"), 0)
        supply = initial.get(sku, 0) + restocked[sku]
        if held + confirmed > supply:
            oversells.append(f"{sku}: {held} held + {confirmed} confirmed units > {supply} ever stocked")
        if supply - confirmed != level.on_hand:
            conservation.append(
                f"{sku}: initial + restocked - confirmed = {supply - confirmed}, on_hand {level.on_hand}"
            )
    found["keys_applied_twice"] += [f"{r[1]}: key {r[0]!r} applied {r[3]} times by {r[2]}" for r in applied]
    found["missing_outcomes"] = sorted(key for key in sent if key not in outcomes)
    found["unexpected_outcomes"] = sorted(key for key in outcomes if key not in sent)
    created = {r.idempotency_key: r.id for r in made}
    statuses = {r.id: r.status for r in made}
    for key, request in sorted(sent.items()):
        row = outcomes.get(key)
        if row is not None:
            said = _contradiction(
                request, row.status, json.loads(row.detail), key in wrote, created, statuses
            )
            if said:
                found["outcomes_contradicted"].append(f"{key}: {said}")
    return found


SUCCESS = {"reserve": "reserved", "confirm": "confirmed", "release": "released", "restock": "restocked"}


def _contradiction(
    request: Sent,
    status: str,
    detail: dict[str, Any],
    wrote: bool,
    created: dict[str, str],
    statuses: dict[str, str],
) -> str | None:
    """What the database says against a request's final outcome, or None when it agrees: a success wrote
    under the request's key (or replays a write that did), anything else wrote nothing under it."""
    succeeded = status == SUCCESS.get(request.operation)
    if succeeded and not wrote:
        return f"outcome {status}, but nothing in the history was written under the key"
    if not succeeded and wrote:
        return f"outcome {status}, but the history has a write under the key"
    if request.operation == "reserve":
        reported = list(detail.get("reservation_ids") or []) if succeeded else []
        actual = [created[request.key]] if request.key in created else []
        if reported != actual:
            return f"outcome {status} with reservations {reported}, the key created {actual}"
    if succeeded and request.operation in ("confirm", "release"):
        now = statuses.get(str(request.kwargs["reservation_id"]))
        if now != status:
            return f"outcome {status}, but the reservation is {now}"
    return None


RULES = (
    "oversells",
    "conservation",
    "keys_applied_twice",
    "missing_outcomes",
    "unexpected_outcomes",
    "writes_after_newer_token",
    "outcomes_contradicted",
)


# The audit's rules, in the columns of the report.
AUDITED = {
    Rule.OVERSELL: "oversells",
    Rule.CONSERVATION: "conservation",
    Rule.TOKEN_ORDER: "writes_after_newer_token",
    Rule.KEY_APPLIED_TWICE: "keys_applied_twice",
}


def batching_figures(database_url: str, sent_at: dict[str, float] | None = None) -> Batching:
    """Batches and batched requests as the database recorded them: a batch writes one ``task_attempts``
    row per request it served ("served in a batch ..."), all in one statement, and puts ``served_by`` in
    each outcome; a stale batch leaves a ``rejected`` reserve without a key in the SKU's history."""
    figures = Batching()
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            sizes = conn.execute(
                sa.select(sa.func.count())
                .where(task_attempts.c.detail.like("served in a batch%"))
                .group_by(task_attempts.c.task_id, task_attempts.c.token, task_attempts.c.at_ms)
            ).all()
            rows = conn.execute(
                sa.select(
                    request_outcomes.c.key,
                    request_outcomes.c.task_id,
                    request_outcomes.c.detail,
                    request_outcomes.c.at_ms,
                ).where(request_outcomes.c.operation == "reserve")
            ).all()
            figures.stale_refused = int(
                conn.execute(
                    sa.select(sa.func.count()).where(
                        sku_history.c.kind == "rejected",
                        sku_history.c.operation == "reserve",
                        sku_history.c.idempotency_key.is_(None),
                    )
                ).scalar_one()
            )
            writes = conn.execute(
                sa.select(sku_history.c.sku, sku_history.c.token, sku_history.c.idempotency_key)
                .where(sku_history.c.kind == "write", sku_history.c.operation != "create")
                .order_by(sku_history.c.sku, sku_history.c.id)
            ).all()
            figures.left_pending = int(
                conn.execute(sa.select(sa.func.count()).select_from(pending_reservations)).scalar_one()
            )
    finally:
        engine.dispose()
    figures.batches = len(sizes)
    figures.largest = max((int(r[0]) for r in sizes), default=0)
    served = {r.key: (r.task_id, json.loads(r.detail).get("served_by"), r.at_ms) for r in rows}
    keys = {key for key, (_, server, _) in served.items() if server is not None}
    figures.requests = len(keys)
    figures.for_others = sum(1 for task, server, _ in served.values() if server not in (None, task))
    first_sent = sent_at or {}
    waits = [served[key][2] / 1000 - first_sent[key] for key in keys if key in first_sent]
    figures.longest_wait = max(waits, default=0.0)
    highest: dict[str, int] = {}
    for sku, token, key in writes:
        if token < highest.get(sku, 0) and key in keys:
            figures.writes_behind_newer_token += 1
        highest[sku] = max(token, highest.get(sku, 0))
    return figures


def _flash_statuses(database_url: str, sent: dict[str, Sent]) -> Counter[str]:
    """Final statuses of the flash sale's reservations ("no outcome" for a request that has none)."""
    hot = {key for key, request in sent.items() if request.kwargs.get("sku") == HOT_SKU}
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(request_outcomes.c.key, request_outcomes.c.status).where(
                    request_outcomes.c.key.in_(sorted(hot))
                )
            ).all()
    finally:
        engine.dispose()
    found = Counter(r[1] for r in rows)
    found["no outcome"] += len(hot) - len(rows)
    return +found


def _statuses(database_url: str) -> Counter[str]:
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(request_outcomes.c.status, sa.func.count()).group_by(request_outcomes.c.status)
            ).all()
    finally:
        engine.dispose()
    return Counter({r[0]: int(r[1]) for r in rows})


# -- both runs -------------------------------------------------------------------------------------------


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up exactly like Ctrl-C: the finally blocks run


def run(options: Options, console: Console | None = None, *, as_json: bool = False) -> bool:
    """Both runs, the side-by-side table (or JSON); True when the fenced run has no violation."""
    console = console or Console(stderr=as_json)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    temporary = options.folder is None
    folder = options.folder or Path(tempfile.mkdtemp(prefix="reservations-chaos-"))
    try:
        fenced = run_once(options, fenced=True, folder=folder / "fenced", console=console)
        lease_only = run_once(options, fenced=False, folder=folder / "lease-only", console=console)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)
    if as_json:
        sys.stdout.write(
            json.dumps({"fenced": fenced.as_json(), "lease_only": lease_only.as_json()}, indent=2) + "\n"
        )
    else:
        _print(console, fenced, lease_only)
    return fenced.violations == 0


def _print(console: Console, fenced: RunReport, lease_only: RunReport) -> None:
    table = Table(title="Chaos: same workload and faults", title_justify="left")
    table.add_column("metric")
    table.add_column("fenced", justify="right")
    table.add_column("lease-only", justify="right")

    def row(name: str, value: Callable[[RunReport], object]) -> None:
        table.add_row(name, str(value(fenced)), str(value(lease_only)))

    row("requests enqueued (distinct keys)", lambda r: r.enqueued)
    if fenced.hot_sku:
        row(
            f"  flash sale: reservations of {fenced.hot_sku} ({fenced.hot_stock} units)",
            lambda r: sum(r.flash.values()),
        )
    row("replayed sends (same key)", lambda r: r.replayed)
    row("re-sent after no outcome", lambda r: r.resent)
    if fenced.batching_on or lease_only.batching_on:
        row("still waiting then, left to the batching", lambda r: len(r.waiting_at_resend))
    batching = fenced.batching_on or lease_only.batching_on
    seen = set(fenced.faults) | set(lease_only.faults)
    for fault in [f for f in FAULTS if f in seen] + sorted(seen - set(FAULTS)):
        row(FAULT_LABELS.get(fault, fault), lambda r, f=fault: r.faults[f])  # type: ignore[misc]
    for status in sorted(set(fenced.statuses) | set(lease_only.statuses)):
        row(f"outcome {status}", lambda r, s=status: r.statuses[s])  # type: ignore[misc]
    for status in sorted(set(fenced.flash) | set(lease_only.flash)):
        row(f"  flash sale {status}", lambda r, s=status: r.flash[s])  # type: ignore[misc]
    if batching:
        row("requests served in batches", lambda r: r.batching.requests)
        row("  by another task than their own", lambda r: r.batching.for_others)
        row("batches (largest)", lambda r: f"{r.batching.batches} ({r.batching.largest})")
        row("longest wait of a batched request (s)", lambda r: f"{r.batching.longest_wait:.1f}")
        row("SKU-queue watch runs", lambda r: r.batching.watches)
        row("served by the beat sweep (last resort)", lambda r: r.batching.swept)
        row("left on a pending list, request ended", lambda r: r.batching.left_pending)
    row("stale writes rejected", lambda r: r.rejected_stale_writes)
    if batching:
        row("  of which whole batches", lambda r: r.batching.stale_refused)
    for role in ("freeze", "delay", "normal"):
        row(f"  lost ownership, {role} workers", lambda r, k=role: r.lost_by_role[k])  # type: ignore[misc]
    if batching:
        row("  lost ownership serving a batch", lambda r: sum(r.lost_serving_by_role.values()))
    for name in fenced.checks:
        row(name.replace("_", " "), lambda r, n=name: len(r.checks.get(n, [])))  # type: ignore[misc]
        if name == "writes_after_newer_token" and batching:
            row("  of which by batches", lambda r: r.batching.writes_behind_newer_token)
    row("VIOLATIONS", lambda r: r.violations)
    row("seconds", lambda r: f"{r.seconds:.1f}")
    console.print(table)
    for report in (fenced, lease_only):
        if report.picture is not None:
            console.print(f"timeline of the {report.mode} run: {report.picture}", highlight=False)
    for report in (fenced, lease_only):
        for name, problems in report.checks.items():
            for problem in problems[:5]:
                console.print(f"  [red]{report.mode}[/] {name}: {problem}", highlight=False)
            if len(problems) > 5:
                console.print(f"  [red]{report.mode}[/] {name}: ... {len(problems) - 5} more")
