"""Four worker processes reserve, confirm, release and restock on one hot SKU, then on eight, through short
leases, pauses past the ttl and redelivered idempotency keys; the database is then audited against every
answer the workers got. A lease-only control run shows the audit catches what the fence prevents.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from fencing.engines import make_engine
from reservations import Inventory
from reservations.audit import Rule
from testing.stores import REDIS_URL
from testing.support import Gated
from tests.inventory_worker import WORKLOADS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 4  # worker 0 is the sleeper: each of its pauses lasts until a newer epoch has written its SKU
PHASES = ("hot", "multi")
TTL = 0.15
OPS = 12  # per worker and phase
# A sleeper cycle lasts several ttls, so it does fewer: each of them should still find the others
# contending, rather than run alone after they have finished.
SLEEPER_OPS = 6
START_TIMEOUT = 60.0  # four interpreters importing SQLAlchemy at once on a busy 2-core machine
RUN_TIMEOUT = 90.0

STACKS = [
    pytest.param("sqlite", "sql", id="sqlite+sql-leases"),
    pytest.param("postgresql", "sql", id="postgresql+sql-leases"),
    pytest.param("postgresql", "redis", id="postgresql+redis-leases"),
]


@dataclass(frozen=True)
class Answer:
    """What one call returned to a worker; ``changes`` are (sku, on_hand, reserved) deltas if applied."""

    key: str
    op: str
    kind: str  # applied, replayed, refused, refused_replayed
    ids: tuple[str, ...]
    token: int | None
    changes: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class Run:
    reports: list[dict[str, Any]]
    seconds: float

    def total(self, name: str) -> int:
        return sum(int(report[name]) for report in self.reports)

    @property
    def answers(self) -> list[Answer]:
        return [
            Answer(key, op, kind, tuple(ids), token, tuple(tuple(c) for c in changes))
            for report in self.reports
            for key, op, kind, ids, token, changes in report["answers"]
        ]

    @property
    def unexpected(self) -> list[str]:
        return [f"w{r['worker']} {line}" for r in self.reports for line in r["unexpected"]]


def initial_stock(phases: tuple[str, ...]) -> dict[str, int]:
    return {sku: WORKLOADS[phase].on_hand for phase in phases for sku in WORKLOADS[phase].skus}


def run_workers(
    db_url: str, lease_url: str, prefix: str, logs: Path, *, phases: tuple[str, ...], enforce: bool = True
) -> Run:
    with Inventory.from_url(db_url) as inventory:
        for sku, on_hand in initial_stock(phases).items():
            inventory.add_sku(sku, on_hand=on_hand)
    gate = Gated(logs)
    try:
        for worker in range(WORKERS):
            gate.start([
                sys.executable, "-m", "tests.inventory_worker",
                "--db-url", db_url, "--lease-url", lease_url, "--prefix", prefix,
                "--report", str(logs / f"worker-{worker}.json"), "--phases", ",".join(phases),
                "--worker", str(worker), "--seed", str(worker), "--ttl", str(TTL),
                "--ops", str(SLEEPER_OPS if worker == 0 else OPS),
                "--role", "sleeper" if worker == 0 else "mixed",
                *([] if enforce else ["--no-enforce"]),
            ], cwd=ROOT)  # fmt: skip
        gate.await_ready(START_TIMEOUT)
        started = time.monotonic()
        for n, _ in enumerate(phases):
            if n:
                gate.await_ready(RUN_TIMEOUT)
            gate.go(last=n == len(phases) - 1)
        gate.wait(started + RUN_TIMEOUT)
        seconds = time.monotonic() - started
        reports = [json.loads((logs / f"worker-{w}.json").read_text()) for w in range(WORKERS)]
        return Run(reports=reports, seconds=seconds)
    finally:
        gate.kill()


def audit_answers(inventory: Inventory, stock: dict[str, int], run: Run) -> dict[str, Answer]:
    """The workers' own view: each key applied once, every other answer for it the stored outcome, and the
    applied changes alone explain the final stock. Returns the applied answers by key."""
    answers = run.answers
    applied_counts = Counter(a.key for a in answers if a.kind == "applied")
    assert [k for k, n in applied_counts.items() if n > 1] == [], "a key was applied twice"
    applied = {a.key: a for a in answers if a.kind == "applied"}
    for a in answers:
        if a.key in applied and a.kind != "applied":
            first = applied[a.key]
            assert (a.kind, a.ids, a.token) == ("replayed", first.ids, first.token), (a, first)
    expected = {sku: [on_hand, 0] for sku, on_hand in stock.items()}
    for a in applied.values():
        for sku, on_hand, reserved in a.changes:
            expected[sku][0] += on_hand
            expected[sku][1] += reserved
    levels = {s.sku: [s.on_hand, s.reserved] for s in inventory.all_stock()}
    assert levels == expected
    return applied


def audit_history(inventory: Inventory, stock: dict[str, int], applied: dict[str, Answer]) -> None:
    """The database's own record, SKU by SKU."""
    for sku in stock:
        level = inventory.stock(sku)
        history = inventory.history(sku, limit=10_000)
        writes = [h for h in history if h.kind == "write" and h.operation != "create"]
        rejected = [h for h in history if h.kind == "rejected"]
        explained = [h for h in history if h.kind == "write"]
        assert sum(h.on_hand_delta for h in explained) == level.on_hand
        assert sum(h.reserved_delta for h in explained) == level.reserved
        tokens = [h.token for h in writes]
        assert all(a <= b for a, b in pairwise(tokens)), f"{sku}: a stale write was accepted: {tokens}"
        for r in rejected:
            assert r.highest_token is not None and r.highest_token > r.token, r
            # A rejected lease is lost for good: nothing it sent later may have been accepted.
            assert not [w for w in writes if w.lease_id == r.lease_id and w.id > r.id], r
        # One history row per applied (key, SKU) and nothing else: the history explains every change.
        recorded = Counter((h.operation, h.idempotency_key) for h in writes)
        told: Counter[tuple[str, str | None]] = Counter(
            (a.op, a.key) for a in applied.values() for change in a.changes if change[0] == sku
        )
        assert recorded == told, f"{sku}: history {recorded - told} vs answers {told - recorded}"


def audit_reservations(inventory: Inventory, applied: dict[str, Answer]) -> None:
    """One reservation row per applied reserve line, with the id its client was told, under its request's
    key (a single reserve) or its order's key (a reserve_many line)."""
    rows = {r.id: r for r in inventory.reservations(limit=10_000)}
    told: dict[str, tuple[str, str | None, str | None]] = {}  # id -> (sku, key, order key)
    for a in applied.values():
        if a.op == "reserve":
            told[a.ids[0]] = (a.changes[0][0], a.key, None)
        elif a.op == "reserve_many":
            for rid, (sku, _, _) in zip(a.ids, a.changes, strict=True):
                told[rid] = (sku, None, a.key)
    found = {rid: (r.sku, None if r.order_key else r.idempotency_key, r.order_key) for rid, r in rows.items()}
    # Applied keys are unique, so this also says: one reservation per reserve key, one per order line.
    assert found == told
    finished = {a.ids[0]: a.op for a in applied.values() if a.op in ("confirm", "release")}
    status = {"confirm": "confirmed", "release": "released"}
    expected = {rid: status.get(finished.get(rid, ""), "held") for rid in rows}
    assert {rid: r.status for rid, r in rows.items()} == expected


@pytest.mark.parametrize(("inventory_url", "lease_backend"), STACKS, indirect=["inventory_url"])
def test_stale_holders_and_redeliveries_leave_the_inventory_consistent(
    inventory_url: str, lease_backend: str, redis_prefix: str, tmp_path: Path
) -> None:
    lease_url = REDIS_URL if lease_backend == "redis" else inventory_url
    run = run_workers(inventory_url, lease_url, redis_prefix, tmp_path, phases=PHASES)

    assert run.unexpected == []
    assert run.total("long_pauses") > 0, "the fault was never injected"
    assert run.total("repaired") == 0  # no coordinator fault here: every rejection is a lost race
    assert any(a.kind == "replayed" for a in run.answers), "no key was ever redelivered"
    stock = initial_stock(PHASES)
    with Inventory.from_url(inventory_url) as inventory:
        assert inventory.invariant_violations() == []
        applied = audit_answers(inventory, stock, run)
        audit_history(inventory, stock, applied)
        audit_reservations(inventory, applied)
        counts = inventory.rejection_counts()
    # Every StaleToken a worker saw was recorded durably, and the race did happen in both workloads.
    assert sum(counts.values()) == run.total("stale")
    for phase in PHASES:
        assert sum(counts.get(sku, 0) for sku in WORKLOADS[phase].skus) > 0, f"no rejection in {phase}"
    print(
        f"\n{run.seconds:.1f}s, rejections {counts}, applied {len(applied)}, "
        f"replayed {sum(a.kind == 'replayed' for a in run.answers)} (late {run.total('late_replays')}), "
        f"busy {run.total('busy')}, lost {run.total('lost')}"
    )


@pytest.mark.parametrize("inventory_url", ["sqlite"], indirect=True)
def test_lease_only_control_lets_a_stale_holder_write_after_a_newer_one(
    inventory_url: str, redis_prefix: str, tmp_path: Path
) -> None:
    # The migration's trigger refuses any UPDATE that lowers stock.fence_token: a second fence in the
    # schema. With it in place enforce_fence=False only changes how a late write fails (a raw
    # IntegrityError instead of a recorded StaleToken), so it goes for this run to be truly lease-only.
    engine = make_engine(inventory_url)
    with engine.begin() as conn:
        conn.execute(sa.text("DROP TRIGGER stock_fence_never_lowers"))
    engine.dispose()
    run = run_workers(inventory_url, inventory_url, redis_prefix, tmp_path, phases=("hot",), enforce=False)

    assert run.unexpected == []
    with Inventory.from_url(inventory_url) as inventory:
        violations = inventory.invariant_violations()
        assert inventory.rejection_counts() == {}  # nothing refuses a late write any more
    assert run.total("stale") == 0
    assert [v for v in violations if v.rule is Rule.TOKEN_ORDER], violations
    print(f"\ncontrol: {run.seconds:.1f}s, violations {violations}")
