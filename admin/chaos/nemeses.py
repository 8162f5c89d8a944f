"""The network nemeses of a chaos run, one at a time, as a step of the driver loop: a worker's host cut
off from the lease Redis, its packets to PostgreSQL dropped with a write in flight, the hot SKU's holder
isolated mid-batch, a slow link. Each is aimed at the hot SKU's holder when one is caught in time, healed
after its time, and recorded (whom, when, which pool children) for the figures per nemesis.
"""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path

from admin.chaos.cluster import ChaosWorker, Cluster
from admin.chaos.faults import HotWatch, unfrozen_children
from admin.chaos.nemesis_figures import NemesisRun
from admin.chaos.options import (
    CATCH_SHARE,
    CUT_FOR,
    DB_PARTITION,
    ISOLATE_HOLDER,
    LEASE_PARTITION,
    NEMESES_FROM,
    NEMESES_TO,
    NEMESIS_FAULTS,
    SLOW_FOR,
    SLOW_LINK,
    Options,
)
from admin.chaos.report import RunReport
from testing.links import Impairment, Link, LinkError

# The slow link, each way: 250 ms +- 200 ms, a fifth of the packets lost, a quarter let through at once
# (overtaking the held ones). A renewal's round trip alone takes half a second; one lost packet adds
# TCP's retransmission timeout, and the renewal lands past the lease ttl.
SLOW = Impairment(delay=0.25, jitter=0.2, loss=0.2, reorder=0.25)

# The holder each nemesis waits for: one serving a batch (a write in flight), or one holding the lease
# while requests wait on it.
WANTS_SERVING = {LEASE_PARTITION: False, DB_PARTITION: True, ISOLATE_HOLDER: True, SLOW_LINK: False}


def _now_ms() -> int:
    return int(time.time() * 1000)


def _signal(pid: int | None, sig: signal.Signals) -> None:
    if pid is not None:
        with suppress(ProcessLookupError):
            os.kill(pid, sig)


class Nemeses:
    """The nemeses asked for, in order, each in its own slice of the stream: it waits for its target for
    the first CATCH_SHARE of the slice, then takes any worker it may hit; one is healed before the next
    starts. Workers that freeze themselves are never the target (their pauses are a fault of their own)."""

    def __init__(
        self,
        options: Options,
        up: Cluster,
        report: RunReport,
        watch: HotWatch | None,
        start: float,
        folder: Path,
    ) -> None:
        self.up, self.report, self.watch, self.seed = up, report, watch, options.seed
        self.runs = [NemesisRun(name, NEMESIS_FAULTS[name]) for name in options.network_nemeses]
        span = (NEMESES_TO - NEMESES_FROM) * options.duration / max(1, len(self.runs))
        first = start + NEMESES_FROM * options.duration
        self.slices = [(first + n * span, first + (n + CATCH_SHARE) * span) for n in range(len(self.runs))]
        self.next = 0
        self.links = {name: Link(host, log=folder / f"linkem-{name}.log") for name, host in up.hosts.items()}
        for link in self.links.values():
            link.prepare()  # a cut is then one filter per end: it lands within milliseconds
        self.active: tuple[NemesisRun, Link, float] | None = None  # and when it is healed (monotonic)

    def step(self, now: float) -> None:
        if self.active is not None:
            if now >= self.active[2]:
                self._heal()
            return
        if self.next >= len(self.runs) or now < self.slices[self.next][0]:
            return
        run = self.runs[self.next]
        found = self._target(run.name, any_worker=now >= self.slices[self.next][1])
        if found is not None:
            self.next += 1
            self._hit(run, *found)

    def watching(self, now: float) -> bool:
        return (
            self.watch is not None
            and self.active is None
            and self.next < len(self.runs)
            and now >= self.slices[self.next][0]
        )

    def _target(self, name: str, *, any_worker: bool) -> tuple[ChaosWorker, str, int | None] | None:
        """The worker to hit, how it was picked, and the pool child holding the hot SKU's lease (None
        when no holder was caught)."""
        candidates = {pid: w for pid, w in unfrozen_children(self.up.workers).items() if w.host is not None}
        if self.watch is not None:
            found = self.watch.holding(set(candidates))
            if found is not None and (found[1] or not WANTS_SERVING[name]):
                caught = "serving a batch" if found[1] else "requests waiting"
                return candidates[found[0]], f"the hot SKU's holder, {caught}", found[0]
            if not any_worker:
                return None
            holder = self.watch.holder()
            if holder is not None and holder[0] in candidates:
                return candidates[holder[0]], "the hot SKU's holder", holder[0]
        normal = [w for w in self.up.workers if w.role == "normal" and w.host is not None]
        return (
            (normal[self.next % len(normal)], "a worker (no holder caught in time)", None) if normal else None
        )

    def _hit(self, run: NemesisRun, worker: ChaosWorker, caught: str, holder: int | None) -> None:
        link = self.links[worker.name]
        run.target, run.caught, run.logs = worker.name, caught, [worker.log_path]
        run.pids = set(worker.pool_children())
        run.started_ms = _now_ms()
        # A holder is held still (SIGSTOP) for the milliseconds a cut takes to put in place, so that the
        # cut lands where it was caught (mid-batch, a write in flight), not after it moved on; far below
        # the lease ttl, it changes nothing else. A slow link takes longer to start and needs no aim.
        holder = None if run.name == SLOW_LINK else holder
        _signal(holder, signal.SIGSTOP)
        try:
            self._inject(run.name, worker, link)
        except LinkError as exc:
            run.skipped = str(exc)
            return
        finally:
            _signal(holder, signal.SIGCONT)
        run.cuts = list(link.cuts) if link.cuts else ["every packet both ways, through the slow link"]
        lasts = SLOW_FOR if run.name == SLOW_LINK else CUT_FOR
        self.active = (run, link, time.monotonic() + lasts)
        self.report.faults[NEMESIS_FAULTS[run.name]] += 1

    def _inject(self, name: str, worker: ChaosWorker, link: Link) -> None:
        if name == LEASE_PARTITION:
            link.cut(self.up.ports["lease"])
        elif name == DB_PARTITION:
            link.cut(self.up.database_port(worker), inbound=False)
        elif name == ISOLATE_HOLDER:
            link.cut()
        else:
            link.slow(SLOW, seconds=SLOW_FOR, seed=self.seed)

    def _heal(self) -> None:
        if self.active is None:
            return
        run, link, _ = self.active
        self.active = None
        run.link = link.heal()
        run.healed_ms = _now_ms()
        for worker in self.up.workers:
            if worker.name == run.target:
                run.pids |= set(worker.pool_children())  # a worker restarted meanwhile has new children

    def close(self) -> list[NemesisRun]:
        """Heal what is still in place; the nemeses as they happened."""
        self._heal()
        for run in self.runs[self.next :]:
            run.skipped = run.skipped or "the run ended before its turn"
        return self.runs
