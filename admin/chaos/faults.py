"""The faults a chaos run injects, each a step the driver loop calls on every tick: resuming pool children
frozen past their lease, the worker SIGKILL and restart, SIGSTOP of hot-SKU batch servers, the lease
Redis losing its data; and the hot-SKU watch that finds the holder those faults aim at.
"""

from __future__ import annotations

import os
import random
import signal
import time
from contextlib import suppress
from typing import Protocol

import sqlalchemy as sa

from admin.chaos.cluster import ChaosWorker
from admin.chaos.options import (
    BROKER_RESTART_AT,
    BROKER_RESTARTED,
    FROZEN,
    HOLDER_FROZEN,
    HOLDER_KILLED,
    HOLDER_PAUSES,
    HOT_SKU,
    KILL_ANY_HOLDER,
    KILL_BY,
    KILL_EVERY,
    KILL_FROM,
    KILLED,
    LEASE_TTL,
    LEASE_WIPES_AT,
    REDIS_RESTART_AT,
    REDIS_RESTARTED,
    SERVER_FROZEN,
    SERVER_KILLED,
    SERVER_PAUSED,
    STOP_FOR,
    Options,
)
from admin.chaos.report import RunReport
from admin.chaos.workload import Sent
from fencing import BackendUnavailable, LeaseManager
from fencing.engines import make_engine
from reservations.models import pending_reservations, request_outcomes
from reservations.request_outcomes import request_id
from reservations.validation import scope_of
from tasks.worker import client_options
from testing.harness import process_state
from testing.redis_servers import RedisServer

# How long the lease Redis stays down when it "crashes".
REDIS_DOWN_FOR = 0.3


class Step(Protocol):
    """One thing the driver loop does on every tick, in order; ``now`` is the tick's monotonic time."""

    def step(self, now: float) -> None: ...

    def watching(self, now: float) -> bool:
        """Whether it waits to catch the hot SKU's holder: a holder keeps its lease for tens of
        milliseconds unless something holds it up, so the loop then looks more often."""
        ...


class HotWatch:
    """Who holds the hot SKU's lease right now (a worker's pool child, by pid), whether requests wait on
    its pending list, and whether the holder is serving them. Read from the lease Redis and the database,
    as any operator could."""

    def __init__(
        self, lease_url: str, database_url: str, sent: dict[str, Sent], lease_ttl: float = LEASE_TTL
    ) -> None:
        # The workers' client options: a lease Redis (or a sentinel's primary, or an etcd cluster) that
        # does not answer holds the driver loop up for half a second, not for redis-py's default retries.
        self.leases = LeaseManager.from_url(lease_url, **client_options(lease_url, lease_ttl))
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
        except BackendUnavailable:  # the lease Redis is being restarted, or failed over
            return None
        if info is None:
            return None
        # A task's holder is "<host>:<pid>:<task id>" (tasks.worker, tasks.attempt).
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


def unfrozen_children(workers: list[ChaosWorker]) -> dict[int, ChaosWorker]:
    """Pool children of the workers that do not freeze themselves (normal, behind the proxy), by pid."""
    return {pid: w for w in workers if w.role in ("normal", "delay") for pid in w.pool_children()}


class ResumeFrozen:
    """Counts pool children stopped before a write (and whether one held the hot SKU's lease with requests
    waiting), and resumes each once its lease has certainly run out."""

    def __init__(
        self,
        workers: list[ChaosWorker],
        report: RunReport,
        watch: HotWatch | None,
        stop_for: float = STOP_FOR,
    ) -> None:
        self.workers, self.report, self.watch = workers, report, watch
        self.stop_for = stop_for

    def step(self, now: float) -> None:
        # Its own reading: a step before it in the same tick may have taken a while (a kill waits for the
        # process to end), and a child is resumed only once its lease has certainly run out.
        now = time.monotonic()
        for worker in self.workers:
            for pid in worker.pool_children():
                if process_state(pid) == "T":
                    self._stopped(worker, pid, now)
                else:
                    worker.stopped_since.pop(pid, None)
                    worker.frozen_holders.discard(pid)

    def _stopped(self, worker: ChaosWorker, pid: int, now: float) -> None:
        since = worker.stopped_since.setdefault(pid, now)
        if since == now:
            self.report.faults[FROZEN] += 1
        if self.watch is not None and pid not in worker.frozen_holders:
            found = self.watch.holding({pid})
            if found is not None:
                # Frozen holding the hot SKU's lease (for its own reservation or to serve a batch) while
                # requests wait on it: until the lease runs out, nobody serves them.
                worker.frozen_holders.add(pid)
                self.report.faults[HOLDER_FROZEN] += 1
                self.report.faults[SERVER_FROZEN] += found[1]
        if now - since >= self.stop_for:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            worker.stopped_since.pop(pid, None)
            worker.frozen_holders.discard(pid)

    def watching(self, now: float) -> bool:
        return False


class WorkerKill:
    """SIGKILL one worker mid-stream and start it again: the hot SKU's holder with requests waiting on it,
    serving them in a batch if caught so early enough, else any normal worker at the latest moment."""

    def __init__(
        self,
        options: Options,
        workers: list[ChaosWorker],
        report: RunReport,
        watch: HotWatch | None,
        start: float,
    ) -> None:
        self.workers, self.report, self.watch = workers, report, watch
        self.killable = [w for w in workers if w.role == "normal"]
        self.pending = bool(self.killable)
        self.kill_from = start + KILL_FROM * options.duration
        self.kill_any_holder = start + KILL_ANY_HOLDER * options.duration
        # Without a flash sale there is no holder to catch: the kill comes at once.
        self.kill_by = start + (KILL_BY if watch is not None else KILL_FROM) * options.duration
        self.restarted: list[ChaosWorker] = []

    def step(self, now: float) -> None:
        if not self.pending or now < self.kill_from:
            return
        serving_only = now < self.kill_any_holder
        victim = self._holder(self.watch, serving_only=serving_only) if self.watch is not None else None
        if victim is None and now >= self.kill_by:
            victim = self.killable[0]
        if victim is not None:
            victim.kill()
            self.report.faults[KILLED] += 1
            victim.start()
            self.restarted.append(victim)
            self.pending = False

    def _holder(self, watch: HotWatch, *, serving_only: bool) -> ChaosWorker | None:
        """A worker (not one of the freezing ones) whose pool child holds the hot SKU's lease while
        requests wait on it, serving them if ``serving_only``: killing it leaves them to the next holder,
        the SKU's watch or beat's sweep."""
        candidates = unfrozen_children(self.workers)
        found = watch.holding(set(candidates))
        if found is None or (serving_only and not found[1]):
            return None
        self.report.faults[HOLDER_KILLED] += 1
        self.report.faults[SERVER_KILLED] += found[1]
        return candidates[found[0]]

    def watching(self, now: float) -> bool:
        return self.watch is not None and self.pending and now >= self.kill_from

    def wait_restarted(self) -> None:
        """Wait until the restarted worker is ready again, so the drain counts on all of them."""
        for victim in self.restarted:
            victim.wait_ready()


class HolderPauses:
    """SIGSTOP a pool child (of a worker that does not freeze itself) caught serving a batch of the hot
    SKU, HOLDER_PAUSES times, one at a time; ResumeFrozen resumes it once its lease has run out, as it
    does the self-frozen ones."""

    def __init__(
        self,
        workers: list[ChaosWorker],
        report: RunReport,
        watch: HotWatch | None,
        start: float,
        stop_for: float = STOP_FOR,
    ) -> None:
        self.workers, self.report, self.watch = workers, report, watch
        self.left = HOLDER_PAUSES if watch is not None else 0
        self.after, self.stop_for = start, stop_for

    def step(self, now: float) -> None:
        if self.left > 0 and now >= self.after and self.watch is not None and self._pause(self.watch):
            self.left, self.after = self.left - 1, now + self.stop_for

    def _pause(self, watch: HotWatch) -> bool:
        found = watch.holding(set(unfrozen_children(self.workers)))
        if found is None or not found[1]:
            return False
        with suppress(ProcessLookupError):
            os.kill(found[0], signal.SIGSTOP)
            self.report.faults[SERVER_PAUSED] += 1
            return True
        return False

    def watching(self, now: float) -> bool:
        return self.left > 0


class WorkerKills:
    """The HTTP run's kills: every KILL_EVERY seconds (drawn from the range), SIGKILL the normal worker
    that has run longest since its last start, whatever it was doing (a message just taken from the queue,
    a write under its lease), and start it again at once."""

    def __init__(self, options: Options, workers: list[ChaosWorker], report: RunReport, start: float) -> None:
        self.report = report
        self.random = random.Random(options.seed)
        self.killable = [w for w in workers if w.role == "normal"]
        self.started = dict.fromkeys((w.name for w in self.killable), start)
        self.end = start + options.duration
        self.next = start + self.random.uniform(*KILL_EVERY)

    def step(self, now: float) -> None:
        if not self.killable or now < self.next or now >= self.end:
            return
        victim = min(self.killable, key=lambda worker: self.started[worker.name])
        victim.kill()
        victim.start()
        self.report.faults[KILLED] += 1
        self.started[victim.name] = self.next = time.monotonic()
        self.next += self.random.uniform(*KILL_EVERY)

    def watching(self, now: float) -> bool:
        return False

    def wait_restarted(self) -> None:
        for worker in self.killable:
            worker.wait_ready()


class ServerRestarts:
    """A redis-server loses its data (killed, and started again empty after a moment) at fractions of the
    stream: the lease coordinator (token counters included; the broker, a separate server, keeps the
    queued requests), or in the HTTP run the broker too (every queued and unacknowledged message gone:
    the relay publishes again what was recorded). Not on a Sentinel topology or an etcd cluster (``server``
    None): there the lease-failover nemesis's kill -9 is the data loss, and etcd loses no committed write."""

    def __init__(
        self,
        server: RedisServer | None,
        fault: str,
        report: RunReport,
        at: list[float],
    ) -> None:
        self.server, self.fault, self.report = server, fault, report
        self.at = sorted(at) if server is not None else []

    def step(self, now: float) -> None:
        if not self.at or now < self.at[0] or self.server is None:
            return
        self.server.kill()
        time.sleep(REDIS_DOWN_FOR)  # down for a moment, as after a crash, not a sync point
        self.server.start()
        self.report.faults[self.fault] += 1
        self.at.pop(0)

    def watching(self, now: float) -> bool:
        return False


def lease_wipes(options: Options, lease_redis: RedisServer | None, report: RunReport, start: float) -> Step:
    """The lease Redis losing its data: once mid-stream, or at each of LEASE_WIPES_AT in the HTTP run."""
    fractions = LEASE_WIPES_AT if options.http else (REDIS_RESTART_AT,)
    at = (
        [start + fraction * options.duration for fraction in fractions] if options.restart_lease_redis else []
    )
    return ServerRestarts(lease_redis, REDIS_RESTARTED, report, at)


def broker_restart(options: Options, broker: RedisServer | None, report: RunReport, start: float) -> Step:
    """The broker Redis restarted empty once, in the HTTP run only."""
    at = [start + BROKER_RESTART_AT * options.duration] if options.http else []
    return ServerRestarts(broker, BROKER_RESTARTED, report, at)
