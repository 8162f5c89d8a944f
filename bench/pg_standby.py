"""``python -m bench.pg_standby``: what a synchronous standby costs a reservation.

A private primary and streaming standby (testing.pg_cluster) on this host's loopback, once with the standby
named in the primary's ``synchronous_standby_names`` (a commit returns once the standby has flushed it) and
once without (it returns once the primary has). Each run reserves one unit per call through
``Inventory.reserve_request`` (one statement, one commit) of one SKU under one lease made in place (the
fence reads its token alone), from ``--callers`` threads (they queue on the SKU's row), and reports calls
per second and the median and 99th percentile latency. Loopback hides the network: between hosts add one
round trip to the standby per commit.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid

from fencing import Lease
from fencing.lease import new_lease_id
from reservations import Inventory, schema, scope_of
from testing.pg_cluster import pg_cluster, pg_unavailable

SKU = "STANDBY"


def run(*, synchronous: bool, calls: int, callers: int) -> dict[str, float]:
    """Reserve ``calls`` units from ``callers`` threads; throughput and latency (ms)."""
    with pg_cluster(synchronous=synchronous) as cluster:
        url = cluster.primary.url()
        schema.upgrade(url)
        with Inventory.from_url(url, pool_size=callers) as inventory:
            inventory.add_sku(SKU, on_hand=calls * 2)
            # The lease's token is all the fence reads: no coordinator is needed to measure the commit.
            lease = Lease(scope_of(SKU), 1, new_lease_id(), "bench", 3600.0, time.monotonic())
            latencies: list[float] = []
            lock = threading.Lock()

            def caller(count: int) -> None:
                mine = []
                for _ in range(count):
                    started = time.perf_counter()
                    inventory.reserve_request(lease, SKU, 1, key=f"b-{uuid.uuid4().hex}")
                    mine.append(time.perf_counter() - started)
                with lock:
                    latencies.extend(mine)

            threads = [threading.Thread(target=caller, args=(calls // callers,)) for _ in range(callers)]
            began = time.perf_counter()
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            took = time.perf_counter() - began
    latencies.sort()
    return {
        "per_second": len(latencies) / took,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99) - 1] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--callers", type=int, default=1)
    args = parser.parse_args()
    why = pg_unavailable()
    if why is not None:
        parser.exit(2, f"no cluster here: {why}\n")
    for synchronous in (False, True):
        figures = run(synchronous=synchronous, calls=args.calls, callers=args.callers)
        print(
            f"{'synchronous' if synchronous else 'asynchronous':>12}: {args.callers} callers, "
            f"{figures['per_second']:.0f} reservations/s, p50 {figures['p50_ms']:.2f} ms, "
            f"p99 {figures['p99_ms']:.2f} ms"
        )


if __name__ == "__main__":
    main()
