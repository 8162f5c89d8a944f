"""What one task costs besides time: worker CPU (by process group), Redis commands (from the server's
counters, less what an idle cluster sends), and PostgreSQL round trips and transactions (through a counting
proxy in front of a worker of its own).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import redis
from sqlalchemy.engine import make_url

from bench.bursts import BurstFn
from bench.timing import Progress
from bench.wire import CountingProxy, transactions_in

# Tasks through the counting proxy: a warm-up that gets each pool child past psycopg's preparing of its
# statements (prepared on the sixth use per connection), then the counted burst.
COUNT_WARMUP = 24
COUNTED = 20


def group_cpu(group: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``group``, from
    /proc; 0.0 where there is no /proc. A worker started in its own session is the group of its pid,
    pool children included."""
    ticks = 0
    try:
        entries = os.scandir("/proc")
    except OSError:
        return 0.0
    with entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                text = Path(entry.path, "stat").read_text()
            except OSError:  # exited meanwhile
                continue
            # After "pid (comm) ": state, ppid, pgrp, ..., utime and stime at 11 and 12.
            fields = text[text.rindex(")") + 2 :].split()
            if int(fields[2]) == group:
                ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


class RedisCommands:
    """Commands the private redis-server ran, by name, from INFO commandstats: every client's, producer
    and workers alike. The INFO calls that read them are left out."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        # The harness starts the server in a session of its own: its pid is its process group.
        self.pid = int(self.client.info("server")["process_id"])

    def snapshot(self) -> Counter[str]:
        stats = self.client.info("commandstats")
        return Counter({
            name.removeprefix("cmdstat_"): int(values["calls"])
            for name, values in stats.items() if name != "cmdstat_info"
        })

    def close(self) -> None:
        self.client.close()


@dataclass
class Commands:
    """One case's Redis commands over its timed bursts, how long those bursts took, and the CPU its
    worker (main process and pool children), the redis-server and this process (the producer) used."""

    seen: Counter[str]
    seconds: float = 0.0
    tasks: int = 0
    worker_cpu: float = 0.0
    redis_cpu: float = 0.0
    producer_cpu: float = 0.0

    def per_task(self, idle: Mapping[str, float]) -> dict[str, float]:
        """Commands per task by name, less what the server's idle traffic (``idle``, commands per second)
        ran meanwhile."""
        net = {name: calls - idle.get(name, 0.0) * self.seconds for name, calls in self.seen.items()}
        return {name: calls / self.tasks for name, calls in net.items() if self.tasks}


def idle_rates(commands: RedisCommands, seconds: float) -> dict[str, float]:
    before = commands.snapshot()
    time.sleep(seconds)
    return {name: calls / seconds for name, calls in (commands.snapshot() - before).items()}


@dataclass(frozen=True)
class DatabaseCount:
    """The reservation task's PostgreSQL traffic as the counting proxy saw it, over ``tasks`` tasks."""

    tasks: int
    trips: Counter[str]  # round trips by label, preparing excluded
    prepares: int  # psycopg preparing a statement: a round trip once per connection and statement
    transactions: int

    def describe(self) -> str:
        parts = ", ".join(f"{label} {n / self.tasks:.2f}" for label, n in self.trips.most_common())
        return parts + (f"; plus {self.prepares} statement preparations in the counted burst"
                        if self.prepares else "")


def count_database(
    burst: BurstFn, proxy: CountingProxy, tag: str, *, progress: Progress | None
) -> DatabaseCount:
    """Run a warm-up burst and then a counted one through ``burst``, whose worker reaches PostgreSQL
    through ``proxy``; only the counted burst's round trips are kept."""
    if progress:
        progress(f"  counting PostgreSQL round trips: {COUNT_WARMUP} + {COUNTED} reservation tasks via proxy")
    burst(f"{tag}-w", COUNT_WARMUP)
    mark = proxy.mark()
    burst(tag, COUNTED)
    connections = proxy.since(mark)
    trips = Counter(trip for conn in connections for trip in conn if not trip.startswith("prepare "))
    prepares = sum(1 for conn in connections for trip in conn if trip.startswith("prepare "))
    return DatabaseCount(COUNTED, trips, prepares, sum(transactions_in(conn) for conn in connections))


def proxied(database_url: str, proxy: CountingProxy) -> str:
    """``database_url`` through the proxy, unencrypted so that the proxy can read it."""
    url = make_url(database_url).set(host="127.0.0.1", port=proxy.port)
    return url.update_query_dict({"sslmode": "disable", "gssencmode": "disable"}).render_as_string(
        hide_password=False
    )


def per_task_text(counts: Mapping[str, float]) -> str:
    """The commands a task costs by name, the biggest first; traces of idle traffic left out."""
    shown = sorted(((n, name) for name, n in counts.items() if n >= 0.05), reverse=True)
    return " ".join(f"{name.upper()} {n:.1f}" for n, name in shown)
