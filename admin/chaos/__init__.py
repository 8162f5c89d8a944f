"""``reservations chaos``: real workers on PostgreSQL and private redis-servers take a stream of requests
(a flash sale among them) while faults hit them, twice, fenced and lease-only; an independent checker
then audits the database, and the table shows what the fence prevents.
"""

from admin.chaos.checker import check
from admin.chaos.figures import Batching, batching_figures
from admin.chaos.options import (
    DELAYED,
    ETCD_LEADER,
    ETCD_LEADER_KILLED,
    FROZEN,
    HOLDER_FROZEN,
    HOLDER_KILLED,
    KILLED,
    LEASE_FAILED_OVER,
    LEASE_FAILOVER,
    LEASE_PRIMARY_KILLED,
    REDIS_RESTARTED,
    SERVER_FROZEN,
    SERVER_KILLED,
    SERVER_PAUSED,
    ChaosFailed,
    Options,
)
from admin.chaos.report import RunReport
from admin.chaos.run import run, run_once
from admin.chaos.workload import Sent

__all__ = [
    "DELAYED",
    "ETCD_LEADER",
    "ETCD_LEADER_KILLED",
    "FROZEN",
    "HOLDER_FROZEN",
    "HOLDER_KILLED",
    "KILLED",
    "LEASE_FAILED_OVER",
    "LEASE_FAILOVER",
    "LEASE_PRIMARY_KILLED",
    "REDIS_RESTARTED",
    "SERVER_FROZEN",
    "SERVER_KILLED",
    "SERVER_PAUSED",
    "Batching",
    "ChaosFailed",
    "Options",
    "RunReport",
    "Sent",
    "batching_figures",
    "check",
    "run",
    "run_once",
]
