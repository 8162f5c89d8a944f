"""Timing core: run a group of cases interleaved, repeat, and reduce to medians and paired ratios.

A case is a zero-argument callable doing one unit of work (one acquire+release pair, one write
transaction). Cases that are compared with each other are measured in the same group.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Op = Callable[[], None]
Progress = Callable[[str], None]

BLOCKS = 20


@dataclass(frozen=True)
class Case:
    name: str
    op: Op


@dataclass
class CaseStats:
    """One case's measurements: ops/s of every repeat, and every iteration's latency in seconds."""

    name: str
    ops_per_s: list[float] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    @property
    def median_ops(self) -> float:
        return statistics.median(self.ops_per_s)

    @property
    def p50(self) -> float:
        return statistics.median(self.latencies)

    @property
    def p99(self) -> float:
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[98]


@dataclass(frozen=True)
class Row:
    """One line of the report: ``subject`` against ``baseline``, both from the same group."""

    section: str
    subject: CaseStats
    baseline: CaseStats

    @property
    def ratio(self) -> float:
        # Pairing by repeat cancels drift (thermal, other tenants) that hits both cases of a repeat.
        pairs = zip(self.subject.ops_per_s, self.baseline.ops_per_s, strict=True)
        return statistics.median(s / b for s, b in pairs)


def _timed_run(op: Op, iterations: int, latencies: list[float]) -> float:
    """Run ``op`` ``iterations`` times; append each latency and return the wall time of the run."""
    clock = time.perf_counter
    start = clock()
    for _ in range(iterations):
        t0 = clock()
        op()
        latencies.append(clock() - t0)
    return clock() - start


def measure(
    cases: Sequence[Case],
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    blocks: int = BLOCKS,
    progress: Progress | None = None,
) -> dict[str, CaseStats]:
    """Warm every case up, then time ``repeats`` runs of ``iterations`` calls per case.

    A run interleaves the cases in ``blocks`` short blocks, rotating their order block by block: a
    burst from another tenant of the machine then lands on every case alike instead of on whichever
    case happened to be running, and no case always goes first (cold) or last.
    """
    for case in cases:
        for _ in range(warmup):
            case.op()
    stats = {case.name: CaseStats(case.name) for case in cases}
    block = max(1, -(-iterations // blocks))  # ceiling division: at most ``blocks`` blocks
    for repeat in range(repeats):
        if progress is not None:
            progress(f"  run {repeat + 1}/{repeats}: {', '.join(case.name for case in cases)}")
        seconds = dict.fromkeys(stats, 0.0)
        gc.collect()  # every run starts from the same heap, not the debris of the previous one
        for n, start in enumerate(range(0, iterations, block)):
            count = min(block, iterations - start)
            shift = (repeat + n) % len(cases)
            for case in [*cases[shift:], *cases[:shift]]:
                seconds[case.name] += _timed_run(case.op, count, stats[case.name].latencies)
        for name, total in seconds.items():
            stats[name].ops_per_s.append(iterations / total)
    return stats


@dataclass(frozen=True)
class Cost:
    """What one operation of a case cost, counted in the same run (round trips off the wire, CPU from
    the process clock): the table of ratios says how much slower, this says where the time went."""

    section: str
    case: str
    values: dict[str, str]


@dataclass
class Results:
    """The rows of the report in print order, plus per-operation costs, footnotes and context lines
    (what a section ran on, known only once it ran) the benchmarks want to add."""

    rows: list[Row] = field(default_factory=list)
    costs: list[Cost] = field(default_factory=list)
    context: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def add(self, section: str, stats: dict[str, CaseStats], subject: str, baseline: str) -> None:
        self.rows.append(Row(section, stats[subject], stats[baseline]))

    def cost(self, section: str, case: str, values: dict[str, str]) -> None:
        self.costs.append(Cost(section, case, values))
