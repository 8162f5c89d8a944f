"""What each network nemesis did, read afterwards from the database: the requests its host's workers
attempted, served or were refused for while it lasted (and for SETTLE after the heal, while held-back
writes still arrive), their final outcomes, the stale writes refused, and the checker's violations that
name them. Figures, not checks: the checker's verdict is the run's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from admin.chaos.options import SETTLE
from fencing.sql import make_engine
from reservations.models import request_outcomes, sku_history, task_attempts

_WRITE = re.compile(r"write #(\d+) ")  # how the audit names a history entry written behind a newer token


@dataclass
class NemesisRun:
    """One nemesis as it happened (admin/chaos/nemeses.py records it): the worker it hit and how it was
    picked, when (wall clock, ms), the worker's pool children while it lasted, what was cut and the slow
    link's packet counts; or why it did not run."""

    name: str
    target: str = ""
    caught: str = ""
    pids: set[int] = field(default_factory=set)
    started_ms: int = 0
    healed_ms: int = 0
    cuts: list[str] = field(default_factory=list)
    link: dict[str, int] = field(default_factory=dict)
    skipped: str = ""


@dataclass
class NemesisFigures:
    name: str
    target: str = ""  # the worker whose host it hit, and how it was picked
    caught: str = ""
    cuts: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the hit to the heal
    started_ms: int = 0  # wall clock
    link: dict[str, int] = field(default_factory=dict)  # the slow link's packet counts
    skipped: str = ""  # why it did not run
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    stale_refused: int = 0
    attempts: Counter[str] = field(default_factory=Counter)  # its host's attempts by result
    violations: int = 0

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "caught": self.caught,
            "cuts": self.cuts,
            "seconds": round(self.seconds, 1),
            "started_ms": self.started_ms,
            "link": self.link,
            "skipped": self.skipped,
            "requests": self.requests,
            "outcomes": dict(self.outcomes),
            "stale_refused": self.stale_refused,
            "attempts": dict(self.attempts),
            "violations": self.violations,
        }


def _pid(identity: str | None, *, holder: bool) -> int | None:
    """The pid in a worker identity "<host>:<pid>" or a holder "<host>:<pid>:<task id>"."""
    if not identity:
        return None
    parts = identity.split(":")
    text = parts[-2] if holder and len(parts) >= 3 else parts[-1]
    return int(text) if text.isdigit() else None


def nemesis_figures(
    database_url: str, runs: Sequence[NemesisRun], checks: Mapping[str, list[str]]
) -> list[NemesisFigures]:
    """The figures of each nemesis, in order."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return [_figures(conn, run, checks) for run in runs]
    finally:
        engine.dispose()


def _figures(conn: sa.Connection, run: NemesisRun, checks: Mapping[str, list[str]]) -> NemesisFigures:
    figures = NemesisFigures(
        run.name, run.target, run.caught, list(run.cuts), link=dict(run.link), skipped=run.skipped
    )
    if run.skipped or not run.started_ms:
        return figures
    figures.seconds = (run.healed_ms - run.started_ms) / 1000
    figures.started_ms = run.started_ms
    window = (run.started_ms, run.healed_ms + int(SETTLE * 1000))
    keys = _attempts(conn, window, run.pids, figures.attempts)
    entries = _history(conn, window, run.pids, keys, figures)
    figures.requests = len(keys)
    figures.outcomes = _outcomes(conn, keys)
    figures.violations = _violations(checks, keys, entries)
    return figures


def _attempts(
    conn: sa.Connection, window: tuple[int, int], pids: set[int], results: Counter[str]
) -> set[str]:
    """The keys the pids attempted in the window; counts the attempts by result."""
    keys: set[str] = set()
    rows = conn.execute(
        sa.select(task_attempts.c.key, task_attempts.c.worker, task_attempts.c.result).where(
            task_attempts.c.at_ms.between(*window)
        )
    )
    for key, worker, result in rows:
        if _pid(worker, holder=False) in pids:
            keys.add(key)
            results[result] += 1
    return keys


def _history(
    conn: sa.Connection, window: tuple[int, int], pids: set[int], keys: set[str], figures: NemesisFigures
) -> set[int]:
    """The history entries the pids wrote or were refused in the window; adds their keys, counts the
    refusals."""
    entries: set[int] = set()
    rows = conn.execute(
        sa.select(
            sku_history.c.id, sku_history.c.kind, sku_history.c.idempotency_key, sku_history.c.holder
        ).where(sku_history.c.at_ms.between(*window))
    )
    for entry, kind, key, holder in rows:
        if _pid(holder, holder=True) in pids:
            entries.add(int(entry))
            figures.stale_refused += kind == "rejected"
            if key:
                keys.add(key)
    return entries


def _outcomes(conn: sa.Connection, keys: set[str]) -> Counter[str]:
    found: Counter[str] = Counter()
    if keys:
        rows = conn.execute(
            sa.select(request_outcomes.c.key, request_outcomes.c.status).where(
                request_outcomes.c.key.in_(sorted(keys))
            )
        ).all()
        found.update(row[1] for row in rows)
        found["no outcome"] += len(keys) - len(rows)
    return +found


def _violations(checks: Mapping[str, list[str]], keys: Iterable[str], entries: set[int]) -> int:
    """The checker's sentences that name one of the nemesis's requests, or a history entry its host wrote
    behind a newer token."""
    keys = list(keys)
    count = 0
    for sentences in checks.values():
        for sentence in sentences:
            entry = _WRITE.search(sentence)
            if (entry is not None and int(entry.group(1)) in entries) or any(k in sentence for k in keys):
                count += 1
    return count
