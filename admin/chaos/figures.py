"""What happened in a run, read afterwards from the database and the worker logs: outcome statuses, the
flash sale's statuses, what the batching did, which workers lost ownership. Figures, not checks.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import sqlalchemy as sa

from admin.chaos.options import HOT_SKU
from admin.chaos.workload import Sent
from fencing.engines import make_engine
from reservations.models import pending_reservations, request_outcomes, sku_history, task_attempts

# The beat sweep's result in a worker's log: "reservations.serve_waiting[<id>] succeeded in <s>s: {...}".
SWEPT = re.compile(rb"serve_waiting\[[^\]]+\] succeeded in [0-9.e-]+s: \{'skus': \d+, 'served': (\d+)\}")
# A regression repair in a worker's log (fencing.manager's warning, after Celery's "[<local time>,<ms>:
# WARNING/<process>] "), with its time.
REPAIRED = re.compile(
    rb"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): WARNING/[^\]]*\] fencing token regression on scope",
    re.MULTILINE,
)


@dataclass
class Batching:
    """What the batching did, read from the database and the worker logs after the run (nothing here is
    a check)."""

    batches: int = 0  # committed batches: one fenced transaction each
    requests: int = 0  # requests whose final outcome a batch wrote
    for_others: int = 0  # of those, served by another task than their own (a holder, the SKU's watch)
    largest: int = 0  # requests in the largest batch
    stale_refused: int = 0  # batches refused whole at the stock row (rejected reserve without a key)
    writes_behind_newer_token: int = 0  # batch writes accepted under a token older than the newest
    left_pending: int = 0  # entries still on a pending list at the end (harmless once their request ended)
    watches: int = 0  # runs of a SKU queue's watch task (from the worker logs)
    swept: int = 0  # requests the beat sweep served, having waited longer than a lease ttl (worker logs)
    longest_wait: float = 0.0  # seconds from a batched request's first send to its outcome, at most

    def as_json(self) -> dict[str, float]:
        return {**asdict(self), "longest_wait": round(self.longest_wait, 1)}


@dataclass(frozen=True)
class WorkerLog:
    """One worker's log, as far as the report counts it."""

    lost_ownership: int  # refused writes: each logs "lost ownership of" in its worker
    lost_serving: int  # of those, a batch holder's ("while serving pending reservations")
    watches: int  # runs of a SKU queue's watch task
    swept: int  # requests the beat sweep served through this worker


def read_log(path: Path) -> WorkerLog:
    log = path.read_bytes()
    return WorkerLog(
        lost_ownership=log.count(b"lost ownership of"),
        lost_serving=log.count(b"while serving pending reservations"),
        watches=log.count(b"reservations.watch_waiting[") // 2,  # received, ended
        swept=sum(int(n) for n in SWEPT.findall(log)),
    )


def repair_times(path: Path) -> list[int]:
    """When the worker logging to ``path`` repaired a token regression (wall clock, ms)."""
    found = []
    for stamp, millis in REPAIRED.findall(path.read_bytes()):
        local = dt.datetime.strptime(stamp.decode(), "%Y-%m-%d %H:%M:%S")  # Celery logs local time
        found.append(int(local.timestamp()) * 1000 + int(millis))
    return found


def batching_figures(database_url: str, sent_at: dict[str, float] | None = None) -> Batching:
    """Batches and batched requests as the database recorded them: a batch writes one ``task_attempts``
    row per request it served ("served in a batch ..."), all in one statement, and puts ``served_by`` in
    each outcome; a stale batch leaves a ``rejected`` reserve without a key in the SKU's history."""
    figures = Batching()
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            sizes = conn.execute(
                sa.select(sa.func.count())
                .where(task_attempts.c.detail.like("served in a batch%"))
                .group_by(task_attempts.c.task_id, task_attempts.c.token, task_attempts.c.at_ms)
            ).all()
            rows = conn.execute(
                sa.select(
                    request_outcomes.c.key,
                    request_outcomes.c.task_id,
                    request_outcomes.c.detail,
                    request_outcomes.c.at_ms,
                ).where(request_outcomes.c.operation == "reserve")
            ).all()
            figures.stale_refused = int(
                conn.execute(
                    sa.select(sa.func.count()).where(
                        sku_history.c.kind == "rejected",
                        sku_history.c.operation == "reserve",
                        sku_history.c.idempotency_key.is_(None),
                    )
                ).scalar_one()
            )
            writes = conn.execute(
                sa.select(sku_history.c.sku, sku_history.c.token, sku_history.c.idempotency_key)
                .where(sku_history.c.kind == "write", sku_history.c.operation != "create")
                .order_by(sku_history.c.sku, sku_history.c.id)
            ).all()
            figures.left_pending = int(
                conn.execute(sa.select(sa.func.count()).select_from(pending_reservations)).scalar_one()
            )
    finally:
        engine.dispose()
    figures.batches = len(sizes)
    figures.largest = max((int(r[0]) for r in sizes), default=0)
    served = {r.key: (r.task_id, json.loads(r.detail).get("served_by"), r.at_ms) for r in rows}
    keys = {key for key, (_, server, _) in served.items() if server is not None}
    figures.requests = len(keys)
    figures.for_others = sum(1 for task, server, _ in served.values() if server not in (None, task))
    first_sent = sent_at or {}
    waits = [served[key][2] / 1000 - first_sent[key] for key in keys if key in first_sent]
    figures.longest_wait = max(waits, default=0.0)
    highest: dict[str, int] = {}
    for sku, token, key in writes:
        if token < highest.get(sku, 0) and key in keys:
            figures.writes_behind_newer_token += 1
        highest[sku] = max(token, highest.get(sku, 0))
    return figures


def flash_statuses(database_url: str, sent: dict[str, Sent]) -> Counter[str]:
    """Final statuses of the flash sale's reservations ("no outcome" for a request that has none)."""
    hot = {key for key, request in sent.items() if request.kwargs.get("sku") == HOT_SKU}
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(request_outcomes.c.key, request_outcomes.c.status).where(
                    request_outcomes.c.key.in_(sorted(hot))
                )
            ).all()
    finally:
        engine.dispose()
    found = Counter(r[1] for r in rows)
    found["no outcome"] += len(hot) - len(rows)
    return +found


def statuses(database_url: str) -> Counter[str]:
    """Final outcomes by status."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(request_outcomes.c.status, sa.func.count()).group_by(request_outcomes.c.status)
            ).all()
    finally:
        engine.dispose()
    return Counter({r[0]: int(r[1]) for r in rows})


def waiting_keys(database_url: str) -> set[str]:
    """Keys of the requests waiting on a pending list right now."""
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            return {row[0] for row in conn.execute(sa.select(pending_reservations.c.key))}
    finally:
        engine.dispose()
