"""What each nemesis did, read afterwards from the database and the worker logs: the requests its host's
workers (every worker, for a lease failover) attempted, served or were refused for while it lasted (and
for SETTLE after the heal, while held-back writes still arrive), their final outcomes, the stale writes
refused, the token regressions repaired, the longest wait for an outcome across it, and the checker's
violations (and business harm) that name them. Figures, not checks: the checker's verdict is the run's.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from admin.chaos.checker import BUSINESS_HARM
from admin.chaos.figures import repair_times
from admin.chaos.options import SETTLE
from fencing.engines import make_engine
from reservations.models import request_outcomes, sku_history, task_attempts

_WRITE = re.compile(r"write #(\d+) ")  # how the audit names a history entry written behind a newer token


@dataclass
class NemesisRun:
    """One nemesis as it happened (admin/chaos/nemeses.py and failover.py record it): the worker it hit
    and how it was picked (or the lease primary it failed over, which every worker meets), when (wall
    clock, ms), the worker's pool children while it lasted and its log, what was cut (or how the failover
    went) and the slow link's packet counts; or why it did not run."""

    name: str
    fault: str = ""  # what it did, as the report's faults name it
    every_worker: bool = False  # it hit what every worker uses: their requests all count, not ``pids``'
    logs: list[Path] = field(default_factory=list)  # the logs of the workers it hit
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
    fault: str = ""
    every_worker: bool = False
    target: str = ""  # the worker whose host it hit (or the lease primary), and how it was picked
    caught: str = ""
    cuts: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the hit to the heal
    started_ms: int = 0  # wall clock
    link: dict[str, int] = field(default_factory=dict)  # the slow link's packet counts
    skipped: str = ""  # why it did not run
    requests: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    stale_refused: int = 0
    repairs: int = 0  # token regressions its workers repaired (LeaseManager.handle_stale), from their logs
    attempts: Counter[str] = field(default_factory=Counter)  # its host's attempts by result
    # Seconds from a request's first send to its outcome, at most, of those in flight across it.
    longest_wait: float = 0.0
    violations: int = 0
    harm: int = 0  # of the violations, business harm

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "fault": self.fault,
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
            "repairs": self.repairs,
            "attempts": dict(self.attempts),
            "longest_wait": round(self.longest_wait, 1),
            "violations": self.violations,
            "business_harm": self.harm,
        }


def _pid(identity: str | None, *, holder: bool) -> int | None:
    """The pid in a worker identity "<host>:<pid>" or a holder "<host>:<pid>:<task id>"."""
    if not identity:
        return None
    parts = identity.split(":")
    text = parts[-2] if holder and len(parts) >= 3 else parts[-1]
    return int(text) if text.isdigit() else None


def nemesis_figures(
    database_url: str,
    runs: Sequence[NemesisRun],
    checks: Mapping[str, list[str]],
    sent_at: Mapping[str, float],
) -> list[NemesisFigures]:
    """The figures of each nemesis, in order; ``sent_at`` is each key's first send (wall clock, s)."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return [_figures(conn, run, checks, sent_at) for run in runs]
    finally:
        engine.dispose()


def _figures(
    conn: sa.Connection, run: NemesisRun, checks: Mapping[str, list[str]], sent_at: Mapping[str, float]
) -> NemesisFigures:
    figures = NemesisFigures(
        run.name,
        run.fault,
        run.every_worker,
        run.target,
        run.caught,
        list(run.cuts),
        link=dict(run.link),
        skipped=run.skipped,
    )
    if run.skipped or not run.started_ms:
        return figures
    figures.seconds = (run.healed_ms - run.started_ms) / 1000
    figures.started_ms = run.started_ms
    window = (run.started_ms, run.healed_ms + int(SETTLE * 1000))
    hit = None if run.every_worker else run.pids
    keys = _attempts(conn, window, hit, figures.attempts)
    entries = _history(conn, window, hit, keys, figures)
    finished = _finished(conn, sent_at)
    if run.every_worker:
        # Every request waits on the lease coordinator: each one in flight across it, attempted or not.
        keys |= {key for key, at in sent_at.items() if _across(run, at, finished.get(key))}
    waits = [
        finished[key] - sent_at[key]
        for key in keys
        if key in finished and _across(run, sent_at.get(key), finished[key])
    ]
    figures.longest_wait = max(waits, default=0.0)
    figures.requests = len(keys)
    figures.outcomes = _outcomes(conn, keys)
    figures.repairs = sum(window[0] <= at <= window[1] for log in run.logs for at in repair_times(log))
    figures.violations, figures.harm = _violations(checks, keys, entries)
    return figures


def _finished(conn: sa.Connection, sent_at: Mapping[str, float]) -> dict[str, float]:
    """When each sent request got its outcome (wall clock, s)."""
    rows = conn.execute(sa.select(request_outcomes.c.key, request_outcomes.c.at_ms))
    return {key: at / 1000 for key, at in rows if key in sent_at}


def _across(run: NemesisRun, sent: float | None, finished: float | None) -> bool:
    """Whether a request was in flight across the nemesis: sent before the heal, its outcome (if any)
    after the hit."""
    if sent is None or sent * 1000 > run.healed_ms:
        return False
    return finished is None or finished * 1000 >= run.started_ms


def _attempts(
    conn: sa.Connection, window: tuple[int, int], pids: set[int] | None, results: Counter[str]
) -> set[str]:
    """The keys the pids (every worker's, for None) attempted in the window; counts the attempts by
    result."""
    keys: set[str] = set()
    rows = conn.execute(
        sa.select(task_attempts.c.key, task_attempts.c.worker, task_attempts.c.result).where(
            task_attempts.c.at_ms.between(*window)
        )
    )
    for key, worker, result in rows:
        if pids is None or _pid(worker, holder=False) in pids:
            keys.add(key)
            results[result] += 1
    return keys


def _history(
    conn: sa.Connection,
    window: tuple[int, int],
    pids: set[int] | None,
    keys: set[str],
    figures: NemesisFigures,
) -> set[int]:
    """The history entries the pids (every worker's, for None) wrote or were refused in the window; adds
    their keys, counts the refusals."""
    entries: set[int] = set()
    rows = conn.execute(
        sa.select(
            sku_history.c.id, sku_history.c.kind, sku_history.c.idempotency_key, sku_history.c.holder
        ).where(sku_history.c.at_ms.between(*window))
    )
    for entry, kind, key, holder in rows:
        if pids is None or _pid(holder, holder=True) in pids:
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


def _violations(checks: Mapping[str, list[str]], keys: Iterable[str], entries: set[int]) -> tuple[int, int]:
    """The checker's sentences that name one of the nemesis's requests, or a history entry its host wrote
    behind a newer token; and how many of them are business harm."""
    keys = list(keys)
    count = harm = 0
    for rule, sentences in checks.items():
        for sentence in sentences:
            entry = _WRITE.search(sentence)
            if (entry is not None and int(entry.group(1)) in entries) or any(k in sentence for k in keys):
                count += 1
                harm += rule in BUSINESS_HARM
    return count, harm
