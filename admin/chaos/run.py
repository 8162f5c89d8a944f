"""Both runs of the same workload, fenced and lease-only: for each, the cluster up, the stream sent while
the faults (and the nemeses asked for: network ones, lease failovers) are injected (the driver loop: one
list of steps per tick), the drain, then the checker and the figures; the side-by-side tables or the JSON
at the end.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from types import FrameType

from rich.console import Console

from admin.chaos.callers import SPACE, Callers, recorded
from admin.chaos.checker import check
from admin.chaos.cluster import Cluster, cluster, harness_failures, roles
from admin.chaos.failover import coordinator_faults
from admin.chaos.faults import (
    HolderPauses,
    HotWatch,
    ResumeFrozen,
    Step,
    WorkerKill,
    WorkerKills,
    broker_restart,
    lease_wipes,
)
from admin.chaos.figures import batching_figures, flash_statuses, read_log, statuses, waiting_keys
from admin.chaos.nemeses import Nemeses
from admin.chaos.nemesis_figures import NemesisRun, nemesis_figures
from admin.chaos.options import (
    BEAT_EVERY,
    DELAYED,
    ETCD_KILLS_AT,
    FLASH_BURST,
    HOT_SKU,
    RESEND_AFTER,
    SELF_INFLICTED,
    SLOW_LINK,
    SWEEP_EVERY,
    TICK,
    WATCH_EVERY,
    ChaosFailed,
    Options,
    nemeses_problem,
)
from admin.chaos.progress import Progress
from admin.chaos.report import RunReport, print_nemeses, print_table, write_json
from admin.chaos.workload import Sent, Workload, flash_stock, regular_stock
from admin.picture import save_timeline
from reservations.inventory import Inventory
from tasks.producer import Producer
from testing import links, netns

DRAIN_EVERY = 0.2  # how often the drain looks for the last outcomes


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up exactly like Ctrl-C: the finally blocks run


def run(options: Options, console: Console | None = None, *, as_json: bool = False) -> bool:
    """Both runs, the side-by-side table (or JSON); True when the fenced run has no violation."""
    console = console or Console(stderr=as_json)
    problem = nemeses_problem(options.nemeses, http=options.http)
    if problem is not None:
        raise ChaosFailed(problem)
    options = _network(options, console)
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
        write_json(fenced, lease_only)
    else:
        print_table(console, fenced, lease_only)
        print_nemeses(console, fenced, lease_only)
    return fenced.violations == 0 and (fenced.http is None or not fenced.http.unresolved)


def _network(options: Options, console: Console) -> Options:
    """The network nemeses this machine can inject: one line for what it cannot, and the run goes on."""
    if not options.network_nemeses:
        return options
    reason = netns.unavailable()
    if reason is not None:
        console.print(
            f"[yellow]network nemeses skipped[/] ({', '.join(options.network_nemeses)}): {reason}",
            highlight=False,
        )
        return replace(options, nemeses=tuple(n for n in options.nemeses if n not in options.network_nemeses))
    slow = links.slow_link_unavailable() if SLOW_LINK in options.nemeses else None
    if slow is not None:
        console.print(f"[yellow]nemesis {SLOW_LINK} skipped[/]: {slow}", highlight=False)
        return replace(options, nemeses=tuple(n for n in options.nemeses if n != SLOW_LINK))
    return options


def run_once(options: Options, *, fenced: bool, folder: Path, console: Console) -> RunReport:
    mode = "fenced" if fenced else "lease-only"
    report = RunReport(mode, batching_on=options.batching)
    started = time.monotonic()
    skus = [f"SKU{n}" for n in range(1, options.skus + 1)]
    initial = dict.fromkeys(skus, regular_stock(options))
    if options.hot > 0:
        report.hot_sku, report.hot_stock = HOT_SKU, flash_stock(options)
        initial[HOT_SKU] = report.hot_stock
    console.print(_describe(options, report), highlight=False)
    with Progress(console, mode) as progress, harness_failures():
        door = ", the front door" if options.http else ""
        progress.phase(f"starting PostgreSQL schema, redis-servers, workers and beat{door}")
        with cluster(options, fenced=fenced, folder=folder) as up:
            _one_run(options, up, report, initial, skus, progress)
            progress.phase("stopping workers and servers")
    report.seconds = time.monotonic() - started
    return report


def _one_run(
    options: Options,
    up: Cluster,
    report: RunReport,
    initial: dict[str, int],
    skus: list[str],
    progress: Progress,
) -> None:
    mode = report.mode
    with Inventory.from_url(up.database_url) as inventory:
        for sku, units in initial.items():
            inventory.add_sku(sku, on_hand=units)
        runs = drive(options, inventory, skus, up, report, progress)
        progress.phase("checking the database")
        report.checks = check(up.database_url, initial, report.sent)
        report.nemeses = nemesis_figures(up.database_url, runs, report.checks, report.sent_at)
        _read_database(up.database_url, inventory, report)
        report.picture = save_timeline(
            options.pictures / f"timeline-{mode}.svg",
            f"{mode}: {options.workers} workers, {options.requests} requests",
            {sku: inventory.history(sku, limit=10_000) for sku in initial},
        )
    _read_processes(up, report)


def _describe(options: Options, report: RunReport) -> str:
    parts = roles(options)
    flash = (
        f", {options.hot:.0%} of them flash-sale reservations of {HOT_SKU} ({report.hot_stock} units)"
        f" in bursts of {FLASH_BURST}"
        if report.hot_sku
        else ""
    )
    network = ", ".join(options.network_nemeses)
    hosts = f"; each worker on a host of its own (network namespace), nemeses: {network}" if network else ""
    leases = ""
    if options.lease_failover:
        leases = (
            "; leases on Redis Sentinel (a primary, a replica, three sentinels), the primary failed over"
            " twice (SENTINEL FAILOVER, then kill -9)"
        )
    elif options.etcd_leader:
        leases = (
            f"; leases on a 3-member etcd cluster (lease ttl {options.lease_ttl:g}s), its leader"
            f" SIGKILLed and restarted {len(ETCD_KILLS_AT)} times"
        )
    return (
        f"[bold]{report.mode}[/]: {options.workers} workers ({parts.count('freeze')} freezing before "
        f"writes, {parts.count('delay')} behind a {options.proxy_delay:g}s delaying proxy), "
        f"{options.skus} SKUs, {options.requests} requests over {options.duration:g}s{flash}"
        f", batching {'on' if options.batching else 'off'}, beat sweeping every {BEAT_EVERY:g}s"
        f"{hosts}{leases}"
    )


def _read_database(database_url: str, inventory: Inventory, report: RunReport) -> None:
    report.statuses = statuses(database_url)
    report.rejected_stale_writes = sum(inventory.rejection_counts().values())
    report.batching = batching_figures(database_url, report.sent_at)
    if report.hot_sku:
        report.flash = flash_statuses(database_url, report.sent)


def _read_processes(up: Cluster, report: RunReport) -> None:
    if up.proxy is not None:
        report.faults[DELAYED] = up.proxy.delayed_chunks
    for worker in up.workers:
        # Which fault made the stale writes: each refused write logs "lost ownership" in its worker, a
        # batch holder's with "while serving pending reservations".
        if worker.role == "beat":
            continue
        log = read_log(worker.log_path)
        report.lost_by_role[worker.role] += log.lost_ownership
        report.lost_serving_by_role[worker.role] += log.lost_serving
        report.batching.watches += log.watches
        report.batching.swept += log.swept


# -- the driver loop -------------------------------------------------------------------------------------


class Stream:
    """Sends the workload's requests evenly over the run's duration (a flash-sale burst at once)."""

    def __init__(
        self,
        options: Options,
        send: Callable[[Sent], None],
        workload: Workload,
        report: RunReport,
        start: float,
    ) -> None:
        self.send, self.workload, self.report = send, workload, report
        self.requests, self.start = options.requests, start
        self.gap = options.duration / max(1, options.requests)
        self.count = 0

    @property
    def done(self) -> bool:
        return self.count >= self.requests

    def step(self, now: float) -> None:
        if now < self.start + self.count * self.gap:
            return
        for request, replay in self.workload.next(room=self.requests - self.count):
            self.send(request)
            self.report.sent_at.setdefault(request.key, time.time())
            self.count += 1
            self.report.replayed += replay

    def watching(self, now: float) -> bool:
        return False


class Sweeper:
    """Gives messages unacknowledged past the visibility timeout (a killed worker's) back to the queue."""

    def __init__(self, client: Producer) -> None:
        self.client = client
        self.last = time.monotonic()

    def step(self, now: float) -> None:
        if now - self.last < SWEEP_EVERY:
            return
        self.last = now
        with self.client.app.connection_for_write() as conn:
            conn.default_channel.qos.restore_visible(num=1000, interval=1)

    def watching(self, now: float) -> bool:
        return False


def drive(
    options: Options,
    inventory: Inventory,
    skus: list[str],
    up: Cluster,
    report: RunReport,
    progress: Progress,
) -> list[NemesisRun]:
    """Send the stream while injecting faults, then wait (still resuming frozen children, and healing a
    nemesis still in place) for outcomes; the nemeses as they happened (network ones, then failovers)."""
    if options.http:
        _drive_http(options, inventory, skus, up, report, progress)
        return []
    client = Producer(up.settings.broker_url, up.settings.result_backend)
    # The sweep restores what was unacknowledged longer than the workers' visibility timeout; it reads
    # that timeout from its own connection's options, which must therefore be the workers'.
    client.app.conf.broker_transport_options = {"visibility_timeout": options.visibility_timeout}
    workload = Workload(options, skus, inventory)
    report.sent = workload.sent
    watch = _watch(options, up, workload) if report.hot_sku else None
    start = time.monotonic()
    stream = Stream(options, partial(_publish, client), workload, report, start)
    kill = WorkerKill(options, up.workers, report, watch, start)
    resume, sweep = ResumeFrozen(up.workers, report, watch, options.stop_for), Sweeper(client)
    folder = up.folder or Path(tempfile.gettempdir())
    nemeses = Nemeses(options, up, report, watch, start, folder) if up.hosts else None
    failovers = coordinator_faults(options, up, report, start)
    # One tick: send what is due, then each fault in turn, then the housekeeping.
    steps: list[Step] = [
        stream,
        kill,
        HolderPauses(up.workers, report, watch, start, options.stop_for),
        lease_wipes(options, up.lease_redis, report, start),
        *([nemeses] if nemeses is not None else []),
        *([failovers] if failovers is not None else []),
        resume,
        sweep,
    ]
    try:
        _send(options, stream, steps, workload, report, progress)
        kill.wait_restarted()
        housekeeping: list[Step] = [resume, sweep, *([nemeses] if nemeses is not None else [])]
        progress.phase("waiting for every request's outcome")
        resend = partial(_resend, client, workload, report)
        _drain(
            options, inventory, set(workload.sent), report, up.database_url, housekeeping, progress, resend
        )
    finally:
        runs = nemeses.close() if nemeses is not None else []
        runs += failovers.close() if failovers is not None else []
        client.close()
        if watch is not None:
            watch.close()
    report.enqueued = len(workload.sent)
    return runs


def _watch(options: Options, up: Cluster, workload: Workload) -> HotWatch:
    return HotWatch(up.settings.lease_url, up.database_url, workload.sent, options.lease_ttl)


def _publish(client: Producer, request: Sent) -> None:
    client.send(request.operation, request.key, request.kwargs)


def _send(
    options: Options,
    stream: Stream,
    steps: list[Step],
    workload: Workload,
    report: RunReport,
    progress: Progress,
) -> float:
    """The driver loop: one tick sends what is due, then takes each step in turn; when the last fault the
    run injected came (monotonic: a kill, a wipe, a restart; not a child freezing itself)."""
    progress.phase(f"sending {options.requests} requests over {options.duration:g}s, with faults")
    last_fault = time.monotonic()
    injected = 0
    while not stream.done:
        now = time.monotonic()
        for step in steps:
            step.step(now)
        now_injected = sum(n for fault, n in report.faults.items() if fault not in SELF_INFLICTED)
        if now_injected != injected:
            injected, last_fault = now_injected, time.monotonic()
        faults = sum(report.faults.values())
        progress.tick(f"{len(workload.sent)}/{options.requests} requests sent, {faults} faults so far")
        time.sleep(WATCH_EVERY if any(step.watching(now) for step in steps) else TICK)
    return last_fault


def _drive_http(
    options: Options,
    inventory: Inventory,
    skus: list[str],
    up: Cluster,
    report: RunReport,
    progress: Progress,
) -> None:
    """The HTTP run: the stream through ``options.clients`` callers of the front door, workers killed every
    few seconds, the lease Redis wiped and the broker restarted empty; then every key answered 202 followed
    by GET alone, up to ``options.drain`` after the last fault. Nothing sends a request again."""
    assert up.service is not None
    callers = Callers(up.service.url, options.clients, options.respond_async)
    report.http = callers.figures
    workload = Workload(options, skus, inventory, space=SPACE)
    watch = HotWatch(up.settings.lease_url, up.database_url, workload.sent) if report.hot_sku else None
    start = time.monotonic()
    stream = Stream(options, callers.send, workload, report, start)
    kills, resume = WorkerKills(options, up.workers, report, start), ResumeFrozen(up.workers, report, watch)
    steps: list[Step] = [
        stream,
        kills,
        HolderPauses(up.workers, report, watch, start),
        lease_wipes(options, up.lease_redis, report, start),
        broker_restart(options, up.broker, report, start),
        resume,
    ]
    try:
        last_fault = _send(options, stream, steps, workload, report, progress)
        progress.phase(f"waiting for the answers of {callers.queued} POSTs still queued at the callers")
        callers.close()
        kills.wait_restarted()
        progress.phase("following every 202 by GET alone")
        deadline = last_fault + options.drain
        found = callers.follow(workload.sent, deadline, lambda: resume.step(time.monotonic()), progress.tick)
        report.http.after_last_fault = max((at - last_fault for at in found.values()), default=0.0)
        sent = {key: workload.sent[key] for key in recorded(up.database_url, workload.sent)}
        report.http.recorded = len(sent)
        progress.phase("waiting for every recorded request's outcome")
        _drain(options, inventory, set(sent), report, up.database_url, [resume], progress, None, deadline)
    finally:
        if watch is not None:
            watch.close()
    report.sent = sent
    report.enqueued = len(sent)


def _drain(
    options: Options,
    inventory: Inventory,
    pending: set[str],
    report: RunReport,
    database_url: str,
    steps: list[Step],
    progress: Progress,
    resend: Callable[[set[str], str], None] | None,
    deadline: float | None = None,
) -> None:
    """Wait for the outcome of every key in ``pending`` (up to ``options.drain``, or ``deadline``), still
    taking ``steps``; once, after RESEND_AFTER, ``resend`` what has no outcome yet (if given)."""
    total = len(pending)
    deadline = deadline if deadline is not None else time.monotonic() + options.drain
    resend_at: float | None = time.monotonic() + RESEND_AFTER if resend is not None else None
    while pending and time.monotonic() < deadline:
        for step in steps:
            step.step(time.monotonic())
        pending = {key for key in pending if inventory.request_outcome(key) is None}
        progress.tick(f"waiting for {len(pending)} of {total} outcomes")
        if pending and resend is not None and resend_at is not None and time.monotonic() >= resend_at:
            resend(pending, database_url)
            resend_at = None
        time.sleep(DRAIN_EVERY)


def _resend(
    client: Producer, workload: Workload, report: RunReport, pending: set[str], database_url: str
) -> None:
    """The Celery run's client: what has no outcome yet is sent again under its key (harmless by
    design)."""
    # A request still waiting on a pending list is not lost: serving it is the batching's job (its SKU's
    # holder, its watch or beat's sweep), so only the others are sent again.
    report.waiting_at_resend = sorted(pending & waiting_keys(database_url))
    for key in sorted(pending - set(report.waiting_at_resend)):
        request = workload.sent[key]
        client.send(request.operation, key, request.kwargs)
        report.resent += 1
