"""A capacity model fitted on one configuration and checked on another it was not fitted on.

The model (docs/capacity.md): a reservation costs fixed CPU seconds in each process group (worker,
PostgreSQL backend, redis-server, producer) and on the whole machine (those, PostgreSQL's background
processes, the kernel's loopback traffic), fixed WAL, disk and Redis commands, whatever the number of
SKUs, workers or pool processes; a SKU's lease keys cost memory by how many leases it has had, up to a full
history log. Throughput on one machine is bounded by its cores shared by every process (``cores / machine
CPU per reservation``) and, below that, by the pool processes each doing one task at a time:
a closed queueing network of ``slots`` tasks over one CPU station (the cores, taken as one server that
many times as fast) and a delay (the round trips, commits and polls a task waits on without CPU), solved
by exact mean value analysis. The delay is the one quantity fitted from the fit's throughput; everything
else is a measured cost.

What it cannot see: hot SKUs whose requests meet at a held lease go through batching, whose cost per
request differs (the check prints the share of requests served in a batch, and its costs say how much it
moved); whatever else runs on the machine while it measures (other test runs count in the machine CPU as if
reservations had cost it: re-run a disturbed measurement); and what more processes than cores cost
(switches, cold caches), which the per-process costs of the check show.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Mapping

from bench.capacity import Costs, Shape, reservation_costs
from bench.env import Scratch
from bench.timing import Progress, Results

FIT = Shape(1000, workers=1, concurrency=2)
CHECK = Shape(100_000, workers=2, concurrency=2, skew=1.0, warm_passes=0, warm_requests=400)
QUICK_FIT = Shape(200, workers=1, concurrency=2, measured=300)
QUICK_CHECK = Shape(10_000, workers=2, concurrency=2, skew=1.0, warm_passes=0, warm_requests=100,
                    measured=300)  # fmt: skip
TOLERANCE = 0.30
SMALL = 0.05e-3  # CPU seconds per reservation below which a ratio says nothing (ticks of 10 ms over a burst)
BISECTIONS = 60  # halvings of the delay's interval: far below a microsecond


def cores() -> int:
    """CPUs this process may run on: every process of the run shares them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def demand(costs: Costs) -> float:
    """What the cores are asked per reservation: everything the run keeps busy (its processes,
    PostgreSQL's background ones, the kernel's interrupts)."""
    return costs.run_cpu


def cpu_per_reservation(costs: Costs) -> float:
    """CPU seconds one reservation costs over the process groups measured (PostgreSQL's backends where
    they run here: elsewhere they do not share this machine's cores)."""
    return costs.worker_cpu + (costs.postgres_cpu or 0.0) + costs.redis_cpu + costs.producer_cpu


def mva(demand: float, cpus: int, delay: float, slots: int) -> float:
    """Throughput of ``slots`` tasks cycling through ``cpus`` cores (``demand`` CPU seconds each, the
    cores taken as one server ``cpus`` times as fast) and a delay of ``delay`` seconds: exact mean value
    analysis, one task added at a time."""
    service = demand / cpus
    queued = 0.0
    throughput = 0.0
    for n in range(1, slots + 1):
        residence = service * (1 + queued)
        throughput = n / (residence + delay)
        queued = throughput * residence
    return throughput


def fit_delay(demand: float, cpus: int, slots: int, throughput: float) -> float:
    """The delay per task with which :func:`mva` gives the measured ``throughput`` (0 where even no
    delay is slower than measured: the run was CPU bound)."""
    low, high = 0.0, slots / throughput
    if mva(demand, cpus, low, slots) <= throughput:
        return 0.0
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if mva(demand, cpus, middle, slots) > throughput else (low, middle)
    return (low + high) / 2


def lease_memory(by_leases: Mapping[int, float], requests_by_sku: Counter[int]) -> float:
    """Bytes of the lease keys of the SKUs in ``requests_by_sku``, each at the memory a SKU holds after
    that many leases: linear between the fitted points (the history log gains one entry a lease), flat
    past the last one (the log is capped). A SKU's leases are at most its requests (batching serves
    several in one)."""
    points = sorted(by_leases.items())
    (first, low), (last, high) = points[0], points[-1]
    per_lease = (high - low) / (last - first) if last > first else 0.0
    return sum(low + per_lease * (min(max(k, first), last) - first) for k in requests_by_sku.values())


def capacity_check(
    scratch: Scratch, results: Results, *, quick: bool = False, progress: Progress | None = None
) -> None:
    """Fit on :data:`FIT`, predict :data:`CHECK`, measure it, print both. Needs what ``capacity`` needs."""
    fit_shape, check_shape = (QUICK_FIT, QUICK_CHECK) if quick else (FIT, CHECK)
    cpus = cores()
    if progress:
        progress(f"  fit: {fit_shape.label}")
    fit = reservation_costs(scratch, results, progress=progress, shape=fit_shape)
    cpu = demand(fit)
    spare = cpus - fit.other_cores  # what the fit had of the machine: other runs share it
    delay = fit_delay(cpu, spare, fit_shape.slots, fit.throughput)
    if progress:
        progress(f"  check: {check_shape.label}")
    check = reservation_costs(scratch, results, progress=progress, shape=check_shape)

    section = (
        f"Capacity model: fitted on {fit_shape.label}, predicting {check_shape.label} "
        f"({cpus} cores shared by every process)"
    )

    def row(
        what: str, fitted: float, predicted: float, measured: float, unit: str, scale: float = 1.0
    ) -> None:
        fmt = ",.2f" if scale == 1e3 else ",.0f"
        ratio = measured / predicted if predicted else float("nan")
        verdict = "within" if abs(ratio - 1) <= TOLERANCE else "OUTSIDE"
        judged = f"{ratio:.2f} ({verdict} ±{TOLERANCE:.0%})"
        if scale == 1e3 and max(predicted, measured) < SMALL:
            judged = "- (too small to judge)"
        results.cost(section, what, {
            "fitted": f"{fitted * scale:{fmt}} {unit}",
            "predicted": f"{predicted * scale:{fmt}} {unit}",
            "measured": f"{measured * scale:{fmt}} {unit}",
            "measured / predicted": judged,
        })  # fmt: skip

    # The cores the check had are an input like its slots: whatever other runs left it, measured.
    available = cpus - check.other_cores
    predicted = mva(cpu, available, delay, check_shape.slots)
    row("throughput (reservations/s)", fit.throughput, predicted, check.throughput, "/s")
    row("  bound: cores left / CPU", spare / cpu, available / cpu, available / demand(check), "/s")
    row("CPU per reservation, whole run", cpu, cpu, demand(check), "ms", 1e3)
    attributed = cpu_per_reservation(fit)
    row("  the four groups below", attributed, attributed, cpu_per_reservation(check), "ms", 1e3)
    row("  worker", fit.worker_cpu, fit.worker_cpu, check.worker_cpu, "ms", 1e3)
    if fit.postgres_cpu is not None and check.postgres_cpu is not None:
        row("  PostgreSQL backends", fit.postgres_cpu, fit.postgres_cpu, check.postgres_cpu, "ms", 1e3)
    row("  redis-server", fit.redis_cpu, fit.redis_cpu, check.redis_cpu, "ms", 1e3)
    row("  producer", fit.producer_cpu, fit.producer_cpu, check.producer_cpu, "ms", 1e3)
    if fit.background_cpu is not None and check.background_cpu is not None:
        background = fit.background_cpu
        row("  PostgreSQL background", background, background, check.background_cpu, "ms", 1e3)
    row("  kernel interrupts", fit.kernel_cpu, fit.kernel_cpu, check.kernel_cpu, "ms", 1e3)
    row("Redis commands per reservation", fit.commands, fit.commands, check.commands, "")
    row("Redis network bytes per reservation", fit.net_in + fit.net_out, fit.net_in + fit.net_out,
        check.net_in + check.net_out, "B")  # fmt: skip
    row("WAL per reservation", fit.wal, fit.wal, check.wal, "B")
    row("PostgreSQL disk per reservation", fit.disk, fit.disk, check.disk, "B")
    touched = len(check.requests_by_sku)
    row(f"lease memory of the {touched:,} SKUs touched", fit.lease_memory,
        lease_memory(fit.sku_memory, check.requests_by_sku), check.lease_memory, "B")  # fmt: skip
    idle = mva(cpu, cpus, delay, check_shape.slots)
    results.notes.append(
        f"Capacity model: the run's CPU per reservation (fitted) is {cpu * 1e3:.2f} ms, of which "
        f"{attributed * 1e3:.2f} ms in the worker, its PostgreSQL backends, the redis-server and the "
        f"producer; so at most {cpus} / {cpu * 1e3:.2f} ms = {cpus / cpu:,.0f} reservations/s on this "
        f"machine alone. Other processes kept {fit.other_cores:.2f} cores busy during the fit and "
        f"{check.other_cores:.2f} during the check (machine CPU per reservation {fit.machine_cpu * 1e3:.2f} "
        f"/ {check.machine_cpu * 1e3:.2f} ms); the prediction gets the cores the check had left "
        f"({available:.2f}), on an idle machine it is {idle:,.0f}/s. The fit's {fit.throughput:,.0f}/s on "
        f"{fit_shape.slots} pool "
        f"processes gives a delay of {delay * 1e3:.2f} ms per task besides CPU (mean value analysis), "
        f"which with {check_shape.slots} processes predicts {predicted:,.0f}/s. Everything else predicted "
        f"is the fit's cost per reservation unchanged; lease memory per SKU by leases "
        + ", ".join(f"{k}: {v:,.0f} B" for k, v in sorted(fit.sku_memory.items()))
        + f". The check served {check.batched / check.n:.1%} of its {check.n:,} requests in a hot SKU's "
        f"batch; its most requested SKU had {max(check.requests_by_sku.values()):,} of "
        f"{sum(check.requests_by_sku.values()):,} requests (warm-up included)."
    )


__all__ = ["CHECK", "FIT", "capacity_check", "fit_delay", "lease_memory", "mva"]
