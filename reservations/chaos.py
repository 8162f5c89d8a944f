"""Fault-injection run: real Celery workers on PostgreSQL and private Redis servers take a stream of
reserve / confirm / release / restock requests while workers are frozen past their lease, killed and
restarted, and the lease Redis loses its data; then an independent checker audits the database.

The same workload runs twice, fenced and lease-only (fence condition off, never-lowers trigger dropped),
so the table shows what the fence prevents. Nothing here imports the workers: they are subprocesses.
"""

from __future__ import annotations

import json
import os
import random
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
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import redis
import sqlalchemy as sa
from rich.console import Console
from rich.table import Table

from fencing.sql import make_engine
from reservations import schema
from reservations.inventory import Inventory
from reservations.models import request_outcomes, reservations, sku_history, stock
from reservations.picture import save_timeline
from reservations.producer import Producer
from reservations.proxy import DelayProxy

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
    postgres_url: str = POSTGRES_URL
    folder: Path | None = None  # worker logs; a temporary folder by default
    pictures: Path = Path("var/chaos")  # one SVG timeline per run is saved here


@dataclass
class Sent:
    key: str
    operation: str
    kwargs: dict[str, Any]


@dataclass
class RunReport:
    mode: str
    seconds: float = 0.0
    enqueued: int = 0
    replayed: int = 0
    resent: int = 0
    lost_by_role: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    checks: dict[str, list[str]] = field(default_factory=dict)
    rejected_stale_writes: int = 0
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
            "faults": dict(self.faults),
            "statuses": dict(self.statuses),
            "rejected_stale_writes": self.rejected_stale_writes,
            "lost_ownership_by_worker_role": dict(self.lost_by_role),
            "violations": self.violations,
            "checks": self.checks,
            "picture": str(self.picture) if self.picture else None,
        }


# -- processes -------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        self.port = _free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no", "--dir", str(self.folder)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal must not kill it before we clean up
        )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)

        def answers() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise ChaosFailed(f"redis-server on port {self.port} exited")
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
    role: str  # "normal"; "freeze": stops before every write, resumed later; "delay": behind the proxy
    process: subprocess.Popen[bytes] | None = None
    stopped_since: dict[int, float] = field(default_factory=dict)

    def start(self) -> None:
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    *(sys.executable, "-m", "celery", "-A", "tasks", "worker"),
                    *("--pool", "prefork", "-c", "1", "-n", f"{self.name}@%h", "--loglevel", "INFO"),
                    *("--without-gossip", "--without-mingle", "--without-heartbeat"),
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: signals reach the pool child too
            )

    def wait_ready(self, since: int = 0) -> None:
        def ready() -> bool:
            if self.process is None or self.process.poll() is not None:
                raise ChaosFailed(f"worker {self.name} exited: see {self.log_path}")
            return b" ready." in self.log_path.read_bytes()[since:]

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


class Workload:
    """A seeded stream of requests; confirm and release pick reservations whose outcome came back."""

    def __init__(self, options: Options, skus: list[str], inventory: Inventory) -> None:
        self.random = random.Random(options.seed)
        self.skus = skus
        self.inventory = inventory
        self.sent: dict[str, Sent] = {}
        self.replays = 0
        self.pending_reserves: list[str] = []
        self.open_reservations: list[str] = []
        self.counter = 0

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

    def next(self) -> tuple[Sent, bool]:
        """The next request and whether it replays an earlier key (same key, same arguments)."""
        if self.sent and self.random.random() < 0.1:
            self.replays += 1
            return self.random.choice(list(self.sent.values())), True
        self._harvest()
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
        return sent, False


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
    report = RunReport(mode)
    started = time.monotonic()
    folder.mkdir(parents=True, exist_ok=True)
    skus = [f"SKU{n}" for n in range(1, options.skus + 1)]
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
            }
            proxied = _via(proxy, database_url) if proxy is not None else database_url
            for n, role in enumerate(roles):
                name = f"{'f' if fenced else 'l'}{n + 1}"
                env = _worker_env(settings, folder, name, role, proxied)
                workers.append(Worker(name, env, folder / f"worker-{name}.log", role))
            for worker in workers:
                worker.start()  # all before any is waited for: the imports overlap
            for worker in workers:
                worker.wait_ready()
            console.print(
                f"[bold]{mode}[/]: {options.workers} workers ({roles.count('freeze')} freezing before "
                f"writes, {roles.count('delay')} behind a {options.proxy_delay:g}s delaying proxy), "
                f"{options.skus} SKUs, {options.requests} requests over {options.duration:g}s",
                highlight=False,
            )
            with Inventory.from_url(database_url) as inventory:
                for sku in skus:
                    inventory.add_sku(sku, on_hand=INITIAL_STOCK)
                _drive(options, inventory, skus, settings, workers, lease_redis, report)
                report.checks = check(database_url, {s: INITIAL_STOCK for s in skus}, report.sent)
                report.statuses = _statuses(database_url)
                report.rejected_stale_writes = sum(inventory.rejection_counts().values())
                report.picture = save_timeline(
                    options.pictures / f"timeline-{mode}.svg",
                    f"{mode}: {options.workers} workers, {options.requests} requests",
                    {sku: inventory.history(sku, limit=10_000) for sku in skus},
                )
            if proxy is not None:
                report.faults["client->postgres chunks delayed"] = proxy.delayed_chunks
            for worker in workers:
                # Which fault made the stale writes: each refused write logs "lost ownership" in its worker.
                lost = worker.log_path.read_bytes().count(b"lost ownership of")
                report.lost_by_role[worker.role] += lost
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
    workload = Workload(options, skus, inventory)
    report.sent = workload.sent
    start = time.monotonic()
    gap = options.duration / max(1, options.requests)
    kill_at = start + 0.3 * options.duration
    restart_redis_at = start + 0.55 * options.duration if options.restart_lease_redis else 0.0
    sweep = _sweeper(client)
    killable = [w for w in workers if w.role == "normal"]
    sent_count = 0
    restarted: list[tuple[Worker, int]] = []
    try:
        while sent_count < options.requests:
            now = time.monotonic()
            if now >= start + sent_count * gap:
                request, replay = workload.next()
                client.send(request.operation, request.key, request.kwargs)
                sent_count += 1
                report.replayed += replay
            if kill_at and now >= kill_at and killable:
                victim = killable[0]
                victim.kill()
                report.faults["worker SIGKILL + restart"] += 1
                offset = victim.log_path.stat().st_size
                victim.start()
                restarted.append((victim, offset))
                kill_at = 0.0
            if restart_redis_at and now >= restart_redis_at:
                # The lease coordinator loses its data (token counters included); the broker is separate
                # and keeps the queued requests.
                lease_redis.kill()
                time.sleep(0.3)
                lease_redis.start()
                report.faults["lease Redis restart (data lost)"] += 1
                restart_redis_at = 0.0
            _resume_frozen(workers, report)
            sweep()
            time.sleep(TICK)
        for victim, offset in restarted:
            victim.wait_ready(since=offset)
        drain_start = time.monotonic()
        resend_at = drain_start + RESEND_AFTER
        pending = set(workload.sent)
        while pending and time.monotonic() < drain_start + options.drain:
            _resume_frozen(workers, report)
            sweep()
            pending = {key for key in pending if inventory.request_outcome(key) is None}
            if pending and resend_at and time.monotonic() >= resend_at:
                for key in sorted(pending):
                    request = workload.sent[key]
                    client.send(request.operation, key, request.kwargs)
                    report.resent += 1
                resend_at = 0.0
            time.sleep(0.2)
    finally:
        client.close()
    report.enqueued = len(workload.sent)


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


def _resume_frozen(workers: list[Worker], report: RunReport) -> None:
    now = time.monotonic()
    for worker in workers:
        for pid in worker.children():
            if _state(pid) != "T":
                worker.stopped_since.pop(pid, None)
                continue
            since = worker.stopped_since.setdefault(pid, now)
            if since == now:
                report.faults["pool child frozen past its lease"] += 1
            if now - since >= STOP_FOR:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
                worker.stopped_since.pop(pid, None)


# -- the independent checker ----------------------------------------------------------------------------


def check(database_url: str, initial: dict[str, int], sent: dict[str, Sent]) -> dict[str, list[str]]:
    """Audit the database on its own terms: every broken rule as a sentence, grouped by rule."""
    found: dict[str, list[str]] = {name: [] for name in RULES}
    with Inventory.from_url(database_url) as inventory:
        for sentence in inventory.invariant_violations():
            found[_rule_of(sentence)].append(sentence)
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
                    # reserve, restock and adjust keys are already counted by invariant_violations()
                    sku_history.c.operation.not_in(("reserve", "reserve_many", "restock", "adjust")),
                )
                .group_by(sku_history.c.idempotency_key, sku_history.c.sku, sku_history.c.operation)
                .having(sa.func.count() > 1)
            ).all()
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
    return found


RULES = (
    "oversells",
    "conservation",
    "keys_applied_twice",
    "missing_outcomes",
    "unexpected_outcomes",
    "writes_after_newer_token",
    "other_invariants",
)


def _rule_of(sentence: str) -> str:
    """The rule an ``invariant_violations()`` sentence belongs to, so nothing is counted twice."""
    if "available is negative" in sentence:
        return "oversells"
    if "accepted with token" in sentence:
        return "writes_after_newer_token"
    if " times by " in sentence:
        return "keys_applied_twice"
    if "on_hand" in sentence or "reserved" in sentence or "history explains" in sentence:
        return "conservation"
    return "other_invariants"


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
    row("replayed sends (same key)", lambda r: r.replayed)
    row("re-sent after no outcome", lambda r: r.resent)
    for fault in sorted(set(fenced.faults) | set(lease_only.faults)):
        row(fault, lambda r, f=fault: r.faults[f])  # type: ignore[misc]
    for status in sorted(set(fenced.statuses) | set(lease_only.statuses)):
        row(f"outcome {status}", lambda r, s=status: r.statuses[s])  # type: ignore[misc]
    row("stale writes rejected", lambda r: r.rejected_stale_writes)
    for role in ("freeze", "delay", "normal"):
        row(f"  lost ownership, {role} workers", lambda r, k=role: r.lost_by_role[k])  # type: ignore[misc]
    for name in fenced.checks:
        row(name.replace("_", " "), lambda r, n=name: len(r.checks.get(n, [])))  # type: ignore[misc]
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
