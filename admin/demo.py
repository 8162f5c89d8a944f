"""The warehouse case study, replayed with real Celery worker processes.

Worker A takes the SKU's lease (token N) and is frozen with SIGSTOP before its write; its lease expires;
worker B takes N+1 and reserves; A is resumed with SIGCONT, its write is refused as lost ownership, and
its request is driven again in a new epoch.

It writes. By default only to its own folder, recreated on every run: SQLite for the inventory and the
leases, Celery's SQLAlchemy transport on SQLite as broker and result store, the worker logs and the
failpoint markers; no services are needed and the configured ``RESERVATIONS_*`` URLs are left alone.
Given :class:`Backends` (the CLI's ``--use-configured``) it runs on them instead, for example PostgreSQL
and Redis: it migrates that database and creates a new SKU there on every run, whose held units and
history stay; the folder then holds only the worker logs and the markers.
"""

from __future__ import annotations

import shutil
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fencing import LeaseManager
from fencing.urls import mask_url
from reservations import schema
from reservations.inventory import Inventory
from reservations.request_outcomes import RequestResult
from reservations.timeline import TimelineEntry, epochs
from reservations.validation import scope_of
from tasks.producer import Producer
from tasks.settings import Settings
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.harness import HarnessError, wait_until

LEASE_TTL = 2.0
MARKER = ".reservations-demo"


class DemoFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Backends:
    """Configured services to run the demo on instead of its own folder."""

    database_url: str
    lease_url: str
    lease_prefix: str
    broker_url: str
    result_backend: str


def _fresh_folder(folder: Path) -> None:
    """Recreate the demo's folder, so that nothing of an earlier run (a once-only failpoint marker above
    all, which would keep worker A from freezing) is there. Only a folder this demo made, or an empty one,
    is wiped: --folder could point anywhere."""
    if folder.exists() and any(folder.iterdir()) and not (folder / MARKER).exists():
        raise DemoFailed(f"{folder} is not empty and was not made by the demo; choose another --folder")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    (folder / MARKER).touch()


@dataclass
class Setup:
    folder: Path
    backends: Backends
    sku: str
    configured: bool

    @classmethod
    def own(cls, folder: Path) -> Setup:
        """Everything in the folder: no services, nothing written outside it."""
        _fresh_folder(folder)
        database = f"sqlite:///{folder / 'inventory.sqlite3'}"
        backends = Backends(
            database_url=database,
            lease_url=database,
            lease_prefix="fencing",
            broker_url=f"sqla+sqlite:///{folder / 'broker.sqlite3'}",
            result_backend=f"db+sqlite:///{folder / 'results.sqlite3'}",
        )
        return cls(folder=folder, backends=backends, sku="WIDGET", configured=False)

    @classmethod
    def on(cls, folder: Path, backends: Backends) -> Setup:
        _fresh_folder(folder)
        # On a shared database the demo must not touch real SKUs, nor an earlier run's: a fresh one per run.
        sku = f"DEMO-{uuid.uuid4().hex[:8].upper()}"
        return cls(folder=folder, backends=backends, sku=sku, configured=True)

    def writes(self) -> str:
        """What this run writes, and where, in one sentence."""
        if not self.configured:
            return (
                f"WRITES only to its own folder {self.folder} (recreated on every run): SQLite inventory, "
                "leases, broker and results, and the worker logs"
            )
        return (
            f"WRITES to the configured database {mask_url(self.backends.database_url)}: migrates it to the "
            f"newest schema and creates SKU {self.sku}, whose held units and history stay there; worker "
            f"logs in {self.folder} (recreated on every run)"
        )

    def worker_env(self, name: str, *, freeze: bool) -> dict[str, str]:
        settings = Settings(
            database_url=self.backends.database_url,
            lease_url=self.backends.lease_url,
            lease_prefix=self.backends.lease_prefix,
            broker_url=self.backends.broker_url,
            result_backend=self.backends.result_backend,
            lease_ttl=LEASE_TTL,
            max_epochs=3,
            failpoint_dir=str(self.folder / f"failpoints-{name}"),
        )
        if freeze:
            # A's renewal is slower than its pause, as for a request stuck in the network: nothing but
            # the fence stands between its late write and the stock row.
            settings = settings.with_(failpoints="before_write=stop,once;renew=skip")
        return worker_env(settings)


@dataclass
class Demo:
    setup: Setup
    console: Console
    started: float = field(default_factory=time.monotonic)
    workers: list[CeleryProcess] = field(default_factory=list)
    steps: list[tuple[str, str, str]] = field(default_factory=list)

    def step(self, who: str, what: str) -> None:
        at = f"{time.monotonic() - self.started:5.1f}s"
        self.steps.append((at, who, what))
        self.console.print(f"[dim]{at}[/]  [bold]{who:<7}[/] {what}", highlight=False)

    def start_worker(self, name: str, *, freeze: bool) -> CeleryProcess:
        worker = CeleryProcess(
            name, self.setup.worker_env(name, freeze=freeze), self.setup.folder / f"worker-{name}.log"
        )
        self.workers.append(worker)
        worker.start()
        worker.wait_ready()
        return worker

    def stop_workers(self) -> None:
        """Warm shutdown of every worker, A thawed first if it is still frozen."""
        stop_all(self.workers)


def _wait_outcome(inventory: Inventory, key: str, timeout: float) -> RequestResult:
    return wait_until(
        lambda: inventory.request_outcome(key), timeout=timeout, what=f"the outcome of {key}", interval=0.1
    )


def run(folder: Path, console: Console | None = None, backends: Backends | None = None) -> bool:
    """Replay the case study in ``folder``, or on ``backends`` when given; True when A's late write was
    refused and every invariant holds."""
    # Piped output keeps each line whole (a terminal wraps it at its width).
    console = console or Console(soft_wrap=not sys.stdout.isatty())
    setup = Setup.own(folder) if backends is None else Setup.on(folder, backends)
    urls = setup.backends
    sku, scope = setup.sku, scope_of(setup.sku)
    run_id = uuid.uuid4().hex[:6]
    key_a, key_b = f"demo-{run_id}-A", f"demo-{run_id}-B"
    console.print(setup.writes(), highlight=False)
    console.print(f"[bold]Warehouse case study[/]: SKU {sku}, lease ttl {LEASE_TTL:g}s")
    console.print(
        f"  inventory {mask_url(urls.database_url)}\n  leases    {mask_url(urls.lease_url)}\n"
        f"  broker    {mask_url(urls.broker_url)}\n"
    )
    schema.upgrade(urls.database_url)
    demo = Demo(setup, console)
    try:
        with (
            Inventory.from_url(urls.database_url) as inventory,
            LeaseManager.from_url(urls.lease_url, prefix=urls.lease_prefix) as leases,
            Producer(urls.broker_url, urls.result_backend) as producer,
        ):
            inventory.add_sku(sku, on_hand=10)
            demo.step("setup", f"{sku}: 10 on hand")
            a = demo.start_worker("A", freeze=True)
            demo.step("A", "worker A started (it freezes with SIGSTOP between taking its lease and writing)")
            producer.send("reserve", key_a, {"sku": sku, "quantity": 5})
            demo.step("client", f"request {key_a}: reserve 5")
            wait_until(a.stopped_child, timeout=30, what="worker A to take the lease and stop")
            held = leases.current(scope)
            token_a = held.token if held else None
            demo.step("A", f"took {scope} with token {token_a} and froze before its write (SIGSTOP)")
            wait_until(
                lambda: leases.current(scope) is None, timeout=LEASE_TTL + 10, what="A's lease to expire"
            )
            demo.step("lease", f"token {token_a} expires at the coordinator; A is still frozen")
            demo.start_worker("B", freeze=False)
            demo.step("B", "worker B started")
            producer.send("reserve", key_b, {"sku": sku, "quantity": 2})
            demo.step("client", f"request {key_b}: reserve 2")
            outcome_b = _wait_outcome(inventory, key_b, timeout=30)
            demo.step("B", f"{key_b}: {outcome_b.status} under token {outcome_b.detail.get('token')}")
            a.thaw()
            demo.step("A", "SIGCONT: A resumes; its write with the old token reaches the stock row")
            outcome_a = _wait_outcome(inventory, key_a, timeout=40)
            rejected = inventory.rejection_counts().get(sku, 0)
            attempts = inventory.attempts(key_a)
            lost = [t for t in attempts if t.result == "lost_ownership"]
            for attempt in lost:
                demo.step("fence", f"write with token {attempt.token} REJECTED: {attempt.detail}")
            demo.step(
                "A",
                f"{key_a}: driven again in a new epoch -> {outcome_a.status} under token "
                f"{outcome_a.detail.get('token')} (lost epochs: {outcome_a.epochs})",
            )
            timeline = inventory.timeline(sku, leases)
            level = inventory.stock(sku)
            # On a shared database only the demo's own SKU is its business.
            violations = [v for v in inventory.invariant_violations() if v.sku == sku]
    except HarnessError as exc:  # a worker that did not start, or a wait that ran out: the run failed
        raise DemoFailed(str(exc)) from exc
    finally:
        demo.stop_workers()
    _print_tokens(console, sku, timeline)
    console.print(
        f"\nStock of {sku}: on hand {level.on_hand}, reserved {level.reserved}, "
        f"available {level.available}, highest accepted token {level.fence_token}"
    )
    expected = (10, 7, 3)
    checks = [
        ("A's stale write was rejected by the database", rejected >= 1 and bool(lost)),
        ("every request reached one final outcome", {outcome_a.status, outcome_b.status} == {"reserved"}),
        (
            "stock is 10 on hand, 7 reserved, 3 available",
            (level.on_hand, level.reserved, level.available) == expected,
        ),
        ("invariants hold (conservation, tokens, history, idempotency)", not violations),
    ]
    for text, ok in checks:
        console.print(f"  {'[green]ok[/]  ' if ok else '[red]FAIL[/]'} {text}")
    for violation in violations:
        console.print(f"       [red]{violation}[/]")
    return all(ok for _, ok in checks)


def _print_tokens(console: Console, sku: str, timeline: list[TimelineEntry]) -> None:
    table = Table(title=f"Token history of {sku}", title_justify="left")
    for column in ("token", "holder", "ended", "accepted writes", "rejected"):
        table.add_column(column, overflow="fold")
    for epoch in epochs(timeline):
        table.add_row(
            str(epoch.token),
            (epoch.holder or "").rsplit(":", 1)[0],
            epoch.ended or "current",
            ", ".join(f"{w.operation} {w.quantity}" for w in epoch.writes) or "-",
            ", ".join(f"{r.operation} (highest {r.highest_token})" for r in epoch.rejections) or "-",
        )
    console.print()
    console.print(table)
