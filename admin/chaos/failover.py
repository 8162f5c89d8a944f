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

The etcd-leader nemesis is the same driver step on a private 3-member etcd cluster: at each of
ETCD_KILLS_AT its leader is SIGKILLed, the two others elect a new one, and the killed member is started
again on its data and catches up. A token is a create revision that a majority committed, so a leader's
loss hands out no token twice: the report's repairs stay at 0 where the Sentinel topology's do not.
"""

from __future__ import annotations

import threading
import time

from admin.chaos.cluster import ChaosWorker, Cluster
from admin.chaos.nemesis_figures import NemesisRun
from admin.chaos.options import (
    ETCD_KILLS_AT,
    ETCD_LEADER,
    ETCD_LEADER_KILLED,
    FAILOVERS,
    LEASE_FAILED_OVER,
    LEASE_FAILOVER,
    SETTLE,
    Options,
)
from admin.chaos.report import RunReport
from testing.etcd_cluster import EtcdCluster
from testing.harness import HarnessError
from testing.redis_topologies import SentinelTopology

# Longest wait for each stage of a failover: the sentinels agreeing on the new primary (or the etcd members
# on a new leader), then the topology healthy again. A forced failover's old primary is demoted only when
# the sentinels next look at it (their INFO every 10 s), so healing may take about that long.
STAGE_WITHIN = 30.0


def _now_ms() -> int:
    return int(time.time() * 1000)


class CoordinatorFaults:
    """Faults of the lease coordinator, each due at its fraction of the stream (``schedule``: fault and
    fraction, in order), and not before SETTLE after the coordinator was healthy again from the one before
    (so that each one's figures are its own). The harness waits for each stage, so a fault runs in a
    thread of its own while the driver loop goes on sending requests and injecting the other faults; the
    next is started only from the loop, after that thread has ended. A subclass does one fault in
    :meth:`_inject`."""

    name = ""  # the nemesis, as the report names it

    def __init__(
        self,
        options: Options,
        schedule: tuple[tuple[str, float], ...],
        workers: list[ChaosWorker],
        report: RunReport,
        start: float,
    ) -> None:
        self.report = report
        logs = [worker.log_path for worker in workers]
        self.runs = [NemesisRun(self.name, fault, every_worker=True, logs=logs) for fault, _ in schedule]
        self.due = [start + at * options.duration for _, at in schedule]
        self.next = 0
        self.after = start  # not before (monotonic)
        self.thread: threading.Thread | None = None
        self.broken = ""  # why the coordinator cannot be hit again

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
        self.thread = threading.Thread(target=self._recorded, args=(run,), name=run.fault, daemon=True)
        self.thread.start()

    def watching(self, now: float) -> bool:
        return False

    def _recorded(self, run: NemesisRun) -> None:
        """One fault and its heal, recorded in ``run``; a stage that does not end in time ends the
        nemesis (the coordinator is then left as it is until the run stops it)."""
        try:
            self._inject(run)
        except HarnessError as exc:
            self.broken = str(exc)
            if run.started_ms:
                run.cuts.append(f"gave up: {exc}")
            else:
                run.skipped = f"nothing to hit: {exc}"
        finally:
            run.healed_ms = _now_ms()

    def _inject(self, run: NemesisRun) -> None:
        """The fault: sets ``run.target``, ``run.started_ms`` when it hits, and ``run.cuts`` as it goes."""
        raise NotImplementedError

    def close(self) -> list[NemesisRun]:
        """Wait for a fault still under way (each of its stages is bounded); the faults as they happened,
        the ones whose turn did not come saying why."""
        if self.thread is not None:
            self.thread.join(timeout=3 * STAGE_WITHIN)
        for run in self.runs[self.next :]:
            run.skipped = (
                f"the coordinator did not recover: {self.broken}" if self.broken else "the stream ended first"
            )
        return self.runs


class LeaseFailovers(CoordinatorFaults):
    """The Sentinel topology's failovers of FAILOVERS."""

    name = LEASE_FAILOVER

    def __init__(
        self,
        options: Options,
        topology: SentinelTopology,
        workers: list[ChaosWorker],
        report: RunReport,
        start: float,
    ) -> None:
        super().__init__(options, FAILOVERS, workers, report, start)
        self.topology = topology

    def _inject(self, run: NemesisRun) -> None:
        topology = self.topology
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


class EtcdLeaderKills(CoordinatorFaults):
    """The etcd cluster's leader SIGKILLed at each of ETCD_KILLS_AT: a new leader elected by the two
    others, then the killed member started again on its data, healed once it answers and a leader that
    every running member names is back."""

    name = ETCD_LEADER

    def __init__(
        self,
        options: Options,
        cluster: EtcdCluster,
        workers: list[ChaosWorker],
        report: RunReport,
        start: float,
    ) -> None:
        schedule = tuple((ETCD_LEADER_KILLED, at) for at in ETCD_KILLS_AT)
        super().__init__(options, schedule, workers, report, start)
        self.cluster = cluster

    def _inject(self, run: NemesisRun) -> None:
        cluster = self.cluster
        old = cluster.wait_for_leader(STAGE_WITHIN)
        run.target = f"etcd leader {old.name} ({old.client_url})"
        run.started_ms = _now_ms()
        old.kill()
        new = cluster.wait_for_leader(STAGE_WITHIN)
        elected = (_now_ms() - run.started_ms) / 1000
        run.cuts = [f"kill -9 of the leader: {new.name} elected after {elected:.1f}s"]
        cluster.heal(STAGE_WITHIN)
        run.cuts.append(f"{old.name} restarted on its data, following {new.name}")


def coordinator_faults(
    options: Options, up: Cluster, report: RunReport, start: float
) -> CoordinatorFaults | None:
    """The lease coordinator's nemesis of this run, if it has one."""
    if up.sentinel is not None:
        return LeaseFailovers(options, up.sentinel, up.workers, report, start)
    if up.etcd is not None:
        return EtcdLeaderKills(options, up.etcd, up.workers, report, start)
    return None
