"""What a chaos run can be asked for (Options), the timings and sizes it keeps fixed, and the names of the
faults it injects, as the report and the JSON spell them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

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
# The lease Redis loses its data at this fraction of the stream.
REDIS_RESTART_AT = 0.55
# Besides the workers that freeze themselves, the run pauses this many holders caught serving a batch of
# the hot SKU (SIGSTOP, resumed after STOP_FOR like the others), one at a time.
HOLDER_PAUSES = 3
WATCH_EVERY = 0.003

# The faults, as counted in RunReport.faults (and keys of the JSON's "faults").
FROZEN = "pool child frozen past its lease"
HOLDER_FROZEN = "hot-SKU holder frozen, requests waiting"
SERVER_FROZEN = "hot-SKU holder frozen serving a batch"
SERVER_PAUSED = "hot-SKU batch server SIGSTOPped by the run"
KILLED = "worker SIGKILL + restart"
HOLDER_KILLED = "hot-SKU holder SIGKILLed, requests waiting"
SERVER_KILLED = "hot-SKU holder SIGKILLed serving a batch"
REDIS_RESTARTED = "lease Redis restart (data lost)"
DELAYED = "client->postgres chunks delayed"
# Faults that workers give themselves (a child stopping before a write); the run injects the others.
SELF_INFLICTED = (FROZEN, HOLDER_FROZEN, SERVER_FROZEN)

# The HTTP run (``--http``): callers POST to a real front door (``reservations serve``) and, after the
# stream, follow each 202 with GET alone (no second POST), while a normal worker is SIGKILLed and restarted
# every KILL_EVERY seconds (drawn from the range), the lease Redis loses its data at each of
# LEASE_WIPES_AT and the broker Redis is restarted empty at BROKER_RESTART_AT of the stream. The relay
# runs at the deployment's defaults: the bounds it is held to are the documented ones.
KILL_EVERY = (2.0, 3.0)
LEASE_WIPES_AT = (0.3, 0.7)
BROKER_RESTART_AT = 0.5
BROKER_RESTARTED = "broker Redis restarted empty"
# How often a caller follows a 202's Location during the convergence.
FOLLOW_EVERY = 0.5

# The network nemeses (``--nemesis NAME``, or ``--partitions`` for all): each worker then runs on a host of
# its own (a network namespace, testing/netns.py), and one nemesis at a time hits one worker's host, in the
# order asked for, each in its own slice of the stream, on top of the faults above.
LEASE_PARTITION = "lease-partition"
DB_PARTITION = "db-partition"
ISOLATE_HOLDER = "isolate-holder"
SLOW_LINK = "slow-link"
NEMESES = (LEASE_PARTITION, DB_PARTITION, ISOLATE_HOLDER, SLOW_LINK)
# What each does, as the report and the JSON's "faults" name it.
NEMESIS_FAULTS = {
    LEASE_PARTITION: "host cut off from the lease Redis (both ways), database kept",
    DB_PARTITION: "host's packets to PostgreSQL dropped (one way), a write in flight",
    ISOLATE_HOLDER: "hot-SKU holder's host isolated mid-batch (everything, both ways)",
    SLOW_LINK: "host's link slowed: delay, jitter, loss, reordering",
}
# A partition lasts past the lease ttl, so another worker takes the lease meanwhile; the slow link longer,
# so that several renewals cross it.
CUT_FOR = 2.5 * LEASE_TTL
SLOW_FOR = 5 * LEASE_TTL
# The slices of the stream the nemeses share, and the part of its slice a nemesis waits in for its target
# (the hot SKU's holder) before it takes any worker it may hit.
NEMESES_FROM, NEMESES_TO = 0.1, 0.9
CATCH_SHARE = 0.5
# A write held back by a 2.5 s partition arrives within this long after the heal (TCP retransmits it at
# 0.2, 0.6, 1.4, 3.0 s... after it was sent): the figures per nemesis look this far past the heal.
SETTLE = 3.0

# The lease nemesis (``--nemesis lease-failover``): the lease coordinator is a Redis Sentinel topology
# (admin/chaos/failover.py) instead of the lease Redis, and its primary is failed over twice during the
# stream; no host of its own for anyone, so it needs neither root nor ip netns. Its wipe is the kill -9,
# so the lease Redis restart above is left out.
LEASE_FAILOVER = "lease-failover"
# The two failovers, in order, as the report and the JSON's "faults" name them, and the fraction of the
# stream at which each is due (the second waits for the topology to be healthy again after the first).
LEASE_FAILED_OVER = "lease primary failed over (SENTINEL FAILOVER)"
LEASE_PRIMARY_KILLED = "lease primary SIGKILLed, replica promoted, back as replica"
FAILOVERS = ((LEASE_FAILED_OVER, 0.2), (LEASE_PRIMARY_KILLED, 0.6))

# The etcd nemesis (``--nemesis etcd-leader``): the leases are on a private 3-member etcd cluster
# (testing/etcd_cluster.py) instead of the lease Redis, and its leader is SIGKILLed and restarted on its
# data at each of ETCD_KILLS_AT of the stream (each kill waits for the cluster to be whole again after the
# one before). Loopback only, like lease-failover. etcd keeps leases of whole seconds, 2 at least: the run's
# lease ttl is ETCD_LEASE_TTL, and what follows from the ttl (freezes, redelivery) scales with it.
ETCD_LEADER = "etcd-leader"
ETCD_LEADER_KILLED = "etcd leader SIGKILLed, new one elected, restarted on its data"
ETCD_KILLS_AT = (0.15, 0.45, 0.75)
ETCD_LEASE_TTL = 2.0
# The nemeses that put the leases on a coordinator of their own (on loopback).
COORDINATOR_NEMESES = (LEASE_FAILOVER, ETCD_LEADER)


class ChaosFailed(RuntimeError):
    """The run could not be carried out (a process did not start); not a failed check."""


def nemeses_problem(names: tuple[str, ...], *, http: bool = False) -> str | None:
    """Why these nemeses cannot run together, or None. The sentinels name the lease primary by its
    loopback address, and the etcd members listen on loopback, which a worker on a host of its own cannot
    reach; the HTTP run's front door and its callers are on loopback too."""
    if http and names:
        return "the HTTP run takes no nemeses: its faults are kills, pauses and wipes (see --http)"
    for name in COORDINATOR_NEMESES:
        if name in names and any(other in NEMESES for other in names):
            return f"{name} runs on loopback, not together with the network nemeses"
    if all(name in names for name in COORDINATOR_NEMESES):
        return f"{LEASE_FAILOVER} and {ETCD_LEADER} each put the leases on a coordinator of their own"
    return None


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
    # Network nemeses (NEMESES), in order, each worker then on a host of its own; or LEASE_FAILOVER, or
    # ETCD_LEADER.
    nemeses: tuple[str, ...] = ()
    # The HTTP run: ``clients`` callers through a real front door, GET alone after a 202 (see KILL_EVERY).
    http: bool = False
    clients: int = 40
    # The share of the HTTP run's POSTs sent with ``Prefer: respond-async`` (202 at once, then followed by
    # GET); the others wait for their outcome up to the door's default HTTP wait.
    respond_async: float = 0.25
    # The workers' relay (off: a message the broker loses stays lost, to see what the relay does).
    relay: bool = True

    @property
    def network_nemeses(self) -> tuple[str, ...]:
        return tuple(name for name in self.nemeses if name in NEMESES)

    @property
    def lease_failover(self) -> bool:
        return LEASE_FAILOVER in self.nemeses

    @property
    def etcd_leader(self) -> bool:
        return ETCD_LEADER in self.nemeses

    @property
    def lease_ttl(self) -> float:
        return ETCD_LEASE_TTL if self.etcd_leader else LEASE_TTL

    @property
    def stop_for(self) -> float:
        """How long a frozen child stays stopped: past its lease at the coordinator (STOP_FOR)."""
        return STOP_FOR * self.lease_ttl / LEASE_TTL

    @property
    def visibility_timeout(self) -> float:
        return VISIBILITY_TIMEOUT * self.lease_ttl / LEASE_TTL
