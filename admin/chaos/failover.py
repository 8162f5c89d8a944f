"""The lease-failover nemesis, as a step of the driver loop: the run's lease coordinator is a Redis Sentinel
topology (testing.redis_topologies.SentinelTopology: a primary, a replica, three sentinels) and its primary
is failed over twice during the stream, first with ``SENTINEL FAILOVER`` (the old primary keeps serving the
connections it has until the sentinels demote it, and forgets what it handed out meanwhile), then with a
kill -9 (what it had not replicated yet is gone; it comes back as a replica of the new primary).

Replication is asynchronous (``min-replicas-to-write 0``), so either failover can hand out a token that a
stock row has already accepted: the fence refuses that write, and the holder's repair
(LeaseManager.handle_stale, which ``hold`` runs on StaleToken) raises the counter past the row's token.
Each failover is recorded like a network nemesis (admin/chaos/nemesis_figures.py), every worker's
requests counted.
"""

from __future__ import annotations

import threading
import time

from admin.chaos.cluster import ChaosWorker
from admin.chaos.nemesis_figures import NemesisRun
from admin.chaos.options import FAILOVERS, LEASE_FAILED_OVER, LEASE_FAILOVER, SETTLE, Options
from admin.chaos.report import RunReport
from testing.harness import HarnessError
from testing.redis_topologies import SentinelTopology

# Longest wait for each stage of a failover: the sentinels agreeing on the new primary, then the topology
# healthy again. A forced failover's old primary is demoted only when the sentinels next look at it
# (their INFO every 10 s), so healing may take about that long.
STAGE_WITHIN = 30.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class LeaseFailovers:
    """The failovers of FAILOVERS, each due at its fraction of the stream, and not before SETTLE after the
    topology was healthy again from the one before (so that each one's figures are its own). The harness
    waits for each stage, so a failover runs in a thread of its own while the driver loop goes on sending
    requests and injecting the other faults; the next is started only from the loop, after that thread
    has ended."""

    def __init__(
        self,
        options: Options,
        topology: SentinelTopology,
        workers: list[ChaosWorker],
        report: RunReport,
        start: float,
    ) -> None:
        self.topology, self.report = topology, report
        logs = [worker.log_path for worker in workers]
        self.runs = [
            NemesisRun(LEASE_FAILOVER, fault, every_worker=True, logs=logs) for fault, _ in FAILOVERS
        ]
        self.due = [start + at * options.duration for _, at in FAILOVERS]
        self.next = 0
        self.after = start  # not before (monotonic)
        self.thread: threading.Thread | None = None
        self.broken = ""  # why the topology cannot be failed over again

    def step(self, now: float) -> None:
        if self.thread is not None:
            if self.thread.is_alive():
                return
            self.thread, self.after = None, now + SETTLE
        if self.broken or self.next >= len(self.runs) or now < max(self.due[self.next], self.after):
            return
        run = self.runs[self.next]
        self.next += 1
        self.report.faults[run.fault] += 1
        self.thread = threading.Thread(target=self._fail_over, args=(run,), name=run.fault, daemon=True)
        self.thread.start()

    def watching(self, now: float) -> bool:
        return False

    def _fail_over(self, run: NemesisRun) -> None:
        """One failover and its heal, recorded in ``run``; a stage that does not end in time ends the
        nemesis (the topology is then left as it is until the run stops it)."""
        topology = self.topology
        try:
            old = topology.primary(STAGE_WITHIN)
            run.target = f"lease primary {old.name}"
            run.started_ms = _now_ms()
            forced = run.fault == LEASE_FAILED_OVER
            new = topology.failover(STAGE_WITHIN) if forced else topology.kill_primary(STAGE_WITHIN)
            named = (_now_ms() - run.started_ms) / 1000
            how = "SENTINEL FAILOVER" if forced else "kill -9 of the primary"
            run.cuts = [f"{how}: {new.name} named primary after {named:.1f}s"]
            if forced:
                topology.wait_healthy(STAGE_WITHIN)  # the sentinels demote the old primary themselves
                run.cuts.append(f"{old.name} demoted by the sentinels")
            else:
                topology.heal(STAGE_WITHIN)
                run.cuts.append(f"{old.name} started again as its replica")
        except HarnessError as exc:
            self.broken = str(exc)
            if run.started_ms:
                run.cuts.append(f"gave up: {exc}")
            else:
                run.skipped = f"no primary to fail over: {exc}"
        finally:
            run.healed_ms = _now_ms()

    def close(self) -> list[NemesisRun]:
        """Wait for a failover still under way (each of its stages is bounded); the failovers as they
        happened, the ones whose turn did not come saying why."""
        if self.thread is not None:
            self.thread.join(timeout=3 * STAGE_WITHIN)
        for run in self.runs[self.next :]:
            run.skipped = (
                f"the topology did not recover: {self.broken}" if self.broken else "the stream ended first"
            )
        return self.runs
