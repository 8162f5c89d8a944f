"""What one run reports (RunReport), and both runs side by side: the table, built from a list of row
specs, or the JSON the CLI's ``chaos --json`` prints.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from admin.chaos.callers import HttpFigures
from admin.chaos.checker import business_harm
from admin.chaos.figures import Batching
from admin.chaos.nemesis_figures import NemesisFigures
from admin.chaos.options import (
    BROKER_RESTARTED,
    DELAYED,
    ETCD_LEADER_KILLED,
    FROZEN,
    HOLDER_FROZEN,
    HOLDER_KILLED,
    KILLED,
    LEASE_FAILED_OVER,
    LEASE_PRIMARY_KILLED,
    NEMESIS_FAULTS,
    REDIS_RESTARTED,
    SERVER_FROZEN,
    SERVER_KILLED,
    SERVER_PAUSED,
)
from admin.chaos.workload import Sent

# Faults in the order the table lists them, each hot-SKU line under the fault it counts a part of.
FAULTS = (
    FROZEN,
    HOLDER_FROZEN,
    SERVER_FROZEN,
    SERVER_PAUSED,
    KILLED,
    HOLDER_KILLED,
    SERVER_KILLED,
    REDIS_RESTARTED,
    BROKER_RESTARTED,
    LEASE_FAILED_OVER,
    LEASE_PRIMARY_KILLED,
    ETCD_LEADER_KILLED,
    DELAYED,
)
# How the table names them: under the fault they are part of.
FAULT_LABELS = {
    HOLDER_FROZEN: "  of which the hot SKU's holder, requests waiting",
    SERVER_FROZEN: "    of which serving them in a batch",
    SERVER_PAUSED: "  of which SIGSTOPped by the run serving a batch",
    HOLDER_KILLED: "  of which the hot SKU's holder, requests waiting",
    SERVER_KILLED: "    of which serving them in a batch",
}
SHOWN_PROBLEMS = 5  # per rule and run, under the table


@dataclass
class RunReport:
    mode: str
    seconds: float = 0.0
    enqueued: int = 0
    replayed: int = 0
    resent: int = 0
    # Requests still waiting on a pending list when the others without an outcome were sent again.
    waiting_at_resend: list[str] = field(default_factory=list)
    sent_at: dict[str, float] = field(default_factory=dict)  # wall clock of each key's first send
    lost_by_role: Counter[str] = field(default_factory=Counter)
    lost_serving_by_role: Counter[str] = field(default_factory=Counter)  # ownership lost serving a batch
    faults: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    checks: dict[str, list[str]] = field(default_factory=dict)
    rejected_stale_writes: int = 0
    batching: Batching = field(default_factory=Batching)
    batching_on: bool = True
    hot_sku: str | None = None
    hot_stock: int = 0
    flash: Counter[str] = field(default_factory=Counter)  # final statuses of the hot SKU's reservations
    sent: dict[str, Sent] = field(default_factory=dict)
    picture: Path | None = None
    nemeses: list[NemesisFigures] = field(default_factory=list)  # the nemeses, in order
    http: HttpFigures | None = None  # the HTTP run's callers

    @property
    def violations(self) -> int:
        return sum(len(found) for found in self.checks.values())

    @property
    def business_harm(self) -> int:
        """Violations a warehouse pays for (oversells, unexplained stock, lost updates, replenishment past
        par, keys applied twice), of all the violations."""
        return business_harm(self.checks)

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seconds": round(self.seconds, 1),
            "enqueued": self.enqueued,
            "replayed": self.replayed,
            "resent": self.resent,
            "waiting_at_resend": self.waiting_at_resend,
            "faults": dict(self.faults),
            "statuses": dict(self.statuses),
            "rejected_stale_writes": self.rejected_stale_writes,
            "lost_ownership_by_worker_role": dict(self.lost_by_role),
            "lost_ownership_serving_batches_by_worker_role": dict(self.lost_serving_by_role),
            "batching_on": self.batching_on,
            "hot_sku": self.hot_sku,
            "hot_stock": self.hot_stock,
            "flash_sale": {"requests": sum(self.flash.values()), "statuses": dict(self.flash)},
            "batching": self.batching.as_json(),
            "violations": self.violations,
            "business_harm": self.business_harm,
            "checks": self.checks,
            "picture": str(self.picture) if self.picture else None,
            "nemeses": [nemesis.as_json() for nemesis in self.nemeses],
            "http": self.http.as_json() if self.http is not None else None,
        }


def write_json(fenced: RunReport, lease_only: RunReport) -> None:
    sys.stdout.write(
        json.dumps({"fenced": fenced.as_json(), "lease_only": lease_only.as_json()}, indent=2) + "\n"
    )


# -- the table -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of the table: its name and how to read its value from a run's report; a ``batching``
    row is left out when neither run had batching on."""

    name: str
    value: Callable[[RunReport], object]
    batching: bool = False


Section = Callable[[RunReport, RunReport], list[Row]]


def _requests(fenced: RunReport, _: RunReport) -> list[Row]:
    flash = (
        [
            Row(
                f"  flash sale: reservations of {fenced.hot_sku} ({fenced.hot_stock} units)",
                lambda r: sum(r.flash.values()),
            )
        ]
        if fenced.hot_sku
        else []
    )
    return [
        Row("requests enqueued (distinct keys)", lambda r: r.enqueued),
        *flash,
        Row("replayed sends (same key)", lambda r: r.replayed),
        Row("re-sent after no outcome", lambda r: r.resent),
        _when_batching("still waiting then, left to the batching", lambda r: len(r.waiting_at_resend)),
    ]


def _http(fenced: RunReport, lease_only: RunReport) -> list[Row]:
    """The HTTP run's callers: what their POSTs were answered, and whether each 202 reached its outcome
    by GET alone."""
    if fenced.http is None:
        return []
    statuses = sorted({s for r in (fenced, lease_only) if r.http is not None for s in r.http.posts})

    def http(value: Callable[[HttpFigures], object]) -> Callable[[RunReport], object]:
        return lambda r: value(r.http) if r.http is not None else "-"

    return [
        Row("HTTP callers", http(lambda h: h.clients)),
        *(Row(f"  POSTs answered {status or 'nothing (connection)'}", _posts(status)) for status in statuses),
        Row("  keys recorded (accepted)", http(lambda h: h.recorded)),
        Row("  keys answered 202", http(lambda h: h.answered_later)),
        Row("    outcome reached by GET alone", http(lambda h: h.followed_to_outcome)),
        Row("    STILL WITHOUT AN OUTCOME", http(lambda h: len(h.unresolved))),
        Row("  last outcome after the last fault (s)", http(lambda h: f"{h.after_last_fault:.1f}")),
    ]


def _posts(status: int) -> Callable[[RunReport], object]:
    return lambda r: r.http.posts[status] if r.http is not None else "-"


def _count(name: str, counts: Callable[[RunReport], Counter[str]], key: str) -> Row:
    return Row(name, lambda r: counts(r)[key])


def _faults(fenced: RunReport, lease_only: RunReport) -> list[Row]:
    seen = set(fenced.faults) | set(lease_only.faults)
    ordered = [f for f in FAULTS if f in seen] + sorted(seen - set(FAULTS))
    return [_count(FAULT_LABELS.get(fault, fault), lambda r: r.faults, fault) for fault in ordered]


def _outcomes(fenced: RunReport, lease_only: RunReport) -> list[Row]:
    statuses = sorted(set(fenced.statuses) | set(lease_only.statuses))
    flash = sorted(set(fenced.flash) | set(lease_only.flash))
    return [_count(f"outcome {status}", lambda r: r.statuses, status) for status in statuses] + [
        _count(f"  flash sale {status}", lambda r: r.flash, status) for status in flash
    ]


def _when_batching(name: str, value: Callable[[RunReport], object]) -> Row:
    return Row(name, value, batching=True)


def _batching(_: RunReport, __: RunReport) -> list[Row]:
    return [
        _when_batching("requests served in batches", lambda r: r.batching.requests),
        _when_batching("  by another task than their own", lambda r: r.batching.for_others),
        _when_batching("batches (largest)", lambda r: f"{r.batching.batches} ({r.batching.largest})"),
        _when_batching("longest wait of a batched request (s)", lambda r: f"{r.batching.longest_wait:.1f}"),
        _when_batching("SKU-queue watch runs", lambda r: r.batching.watches),
        _when_batching("served by the beat sweep (last resort)", lambda r: r.batching.swept),
        _when_batching("left on a pending list, request ended", lambda r: r.batching.left_pending),
    ]


def _stale_writes(_: RunReport, __: RunReport) -> list[Row]:
    return [
        Row("stale writes rejected", lambda r: r.rejected_stale_writes),
        _when_batching("  of which whole batches", lambda r: r.batching.stale_refused),
        *(
            _count(f"  lost ownership, {role} workers", lambda r: r.lost_by_role, role)
            for role in ("freeze", "delay", "normal")
        ),
        _when_batching("  lost ownership serving a batch", lambda r: sum(r.lost_serving_by_role.values())),
    ]


def _checks(fenced: RunReport, _: RunReport) -> list[Row]:
    rows = []
    for name in fenced.checks:
        rows.append(Row(name.replace("_", " "), _found(name)))
        if name == "writes_after_newer_token":
            rows.append(
                _when_batching("  of which by batches", lambda r: r.batching.writes_behind_newer_token)
            )
    return [
        *rows,
        Row("BUSINESS HARM (of the violations)", lambda r: r.business_harm),
        Row("VIOLATIONS", lambda r: r.violations),
        Row("seconds", lambda r: f"{r.seconds:.1f}"),
    ]


def _found(rule: str) -> Callable[[RunReport], object]:
    return lambda r: len(r.checks.get(rule, []))


SECTIONS: tuple[Section, ...] = (_requests, _http, _faults, _outcomes, _batching, _stale_writes, _checks)


def rows(fenced: RunReport, lease_only: RunReport) -> list[Row]:
    """The table's rows, in order, for these two runs."""
    batching = fenced.batching_on or lease_only.batching_on
    every = [row for section in SECTIONS for row in section(fenced, lease_only)]
    return [row for row in every if batching or not row.batching]


def print_table(console: Console, fenced: RunReport, lease_only: RunReport) -> None:
    table = Table(title="Chaos: same workload and faults", title_justify="left")
    table.add_column("metric")
    table.add_column("fenced", justify="right")
    table.add_column("lease-only", justify="right")
    for row in rows(fenced, lease_only):
        table.add_row(row.name, str(row.value(fenced)), str(row.value(lease_only)))
    console.print(table)
    for report in (fenced, lease_only):
        if report.picture is not None:
            console.print(f"timeline of the {report.mode} run: {report.picture}", highlight=False)
    for report in (fenced, lease_only):
        _print_problems(console, report)


def _print_problems(console: Console, report: RunReport) -> None:
    for name, problems in report.checks.items():
        for problem in problems[:SHOWN_PROBLEMS]:
            console.print(f"  [red]{report.mode}[/] {name}: {problem}", highlight=False)
        if len(problems) > SHOWN_PROBLEMS:
            console.print(f"  [red]{report.mode}[/] {name}: ... {len(problems) - SHOWN_PROBLEMS} more")


# -- the nemeses: one table each -------------------------------------------------------------------------


def _hit(figures: NemesisFigures) -> str:
    return f"{figures.target}: {figures.caught}" if figures.caught else figures.target


def _nemesis_rows(fenced: NemesisFigures, lease_only: NemesisFigures) -> list[tuple[str, object, object]]:
    # A lease failover hits what every worker uses: its rows count every worker's requests and writes.
    whose = "every worker's" if fenced.every_worker else "its host's"
    rows: list[tuple[str, object, object]] = [
        ("hit", _hit(fenced), _hit(lease_only)),
        ("failover" if fenced.every_worker else "cut", "; ".join(fenced.cuts), "; ".join(lease_only.cuts)),
        ("lasted (s)", f"{fenced.seconds:.1f}", f"{lease_only.seconds:.1f}"),
    ]
    if fenced.link or lease_only.link:
        rows.append(("packets held / let through at once / dropped", _link(fenced), _link(lease_only)))
    touched = (
        "requests in flight across it or touched"
        if fenced.every_worker
        else "requests its host's workers touched"
    )
    rows.append((touched, fenced.requests, lease_only.requests))
    for status in sorted(set(fenced.outcomes) | set(lease_only.outcomes)):
        rows.append((f"  outcome {status}", fenced.outcomes[status], lease_only.outcomes[status]))
    rows.append(
        (
            "longest wait for an outcome across it (s)",
            f"{fenced.longest_wait:.1f}",
            f"{lease_only.longest_wait:.1f}",
        )
    )
    rows.append(("stale writes refused", fenced.stale_refused, lease_only.stale_refused))
    rows.append(("token regressions repaired", fenced.repairs, lease_only.repairs))
    for result in sorted((set(fenced.attempts) | set(lease_only.attempts)) - {"applied", "replayed"}):
        rows.append((f"  attempts {result}", fenced.attempts[result], lease_only.attempts[result]))
    rows.append((f"VIOLATIONS naming {whose} writes or requests", fenced.violations, lease_only.violations))
    rows.append(("  of which BUSINESS HARM", fenced.harm, lease_only.harm))
    return rows


def _link(figures: NemesisFigures) -> str:
    counts = figures.link
    return f"{counts.get('held', 0)} / {counts.get('at_once', 0)} / {counts.get('dropped', 0)}"


def print_nemeses(console: Console, fenced: RunReport, lease_only: RunReport) -> None:
    """One table per nemesis, both runs side by side (a nemesis that did not run says why)."""
    for mine, theirs in zip(fenced.nemeses, lease_only.nemeses, strict=False):
        what = mine.fault or NEMESIS_FAULTS.get(mine.name, mine.name)
        table = Table(title=f"Nemesis {mine.name}: {what}", title_justify="left")
        table.add_column("metric")
        table.add_column("fenced", justify="right")
        table.add_column("lease-only", justify="right")
        if mine.skipped or theirs.skipped:
            table.add_row("did not run", mine.skipped or "-", theirs.skipped or "-")
        for name, a, b in _nemesis_rows(mine, theirs):
            table.add_row(name, str(a), str(b))
        console.print(table)
