"""The independent checker: after a run, the database audited on its own terms, rule by rule; every broken
rule a sentence. The database's own invariants come from ``reservations.audit``; the rules that need to
know what was sent (supply, outcomes, keys) are checked here against one read of the database, and so is
the business harm of decisions made from a stale read: counts and replenishments that overwrote or
topped up a stock they had not seen.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from admin.chaos.workload import Sent
from fencing.engines import make_engine
from reservations.audit import ONCE_PER_KEY, Rule, keys_written_twice
from reservations.counting import DECIDED
from reservations.inventory import Inventory
from reservations.models import request_outcomes, reservations, sku_history, stock
from reservations.statuses import SUCCEEDED

# The rules, in the order of the report's rows and of the JSON's "checks".
RULES = (
    "oversells",
    "conservation",
    "lost_updates",
    "replenished_past_par",
    "keys_applied_twice",
    "missing_outcomes",
    "unexpected_outcomes",
    "writes_after_newer_token",
    "outcomes_contradicted",
)

# The rules whose violations a warehouse pays for: units promised that are not there, stock the accepted
# operations do not explain, a newer stock overwritten by an older decision, units ordered past par, a
# request applied twice. The others are the protocol's (outcomes, token order).
BUSINESS_HARM = ("oversells", "conservation", "lost_updates", "replenished_past_par", "keys_applied_twice")


def business_harm(checks: Mapping[str, list[str]]) -> int:
    """How many of the violations found are business harm."""
    return sum(len(checks.get(rule, [])) for rule in BUSINESS_HARM)


# The audit's rules, in the columns of the report.
AUDITED = {
    Rule.OVERSELL: "oversells",
    Rule.CONSERVATION: "conservation",
    Rule.TOKEN_ORDER: "writes_after_newer_token",
    Rule.KEY_APPLIED_TWICE: "keys_applied_twice",
    Rule.PAST_PAR: "replenished_past_par",
}


@dataclass(frozen=True)
class Outcome:
    status: str
    detail: dict[str, Any]


@dataclass(frozen=True)
class Written:
    """One accepted write of a SKU's history, as far as the harm rules look at it."""

    id: int
    operation: str
    key: str | None
    on_hand_delta: int
    detail: dict[str, Any]  # what a count or a replenishment recorded: what it saw, its par


@dataclass(frozen=True)
class Facts:
    """What was sent and stocked, and what the database holds after the run: all a rule looks at."""

    initial: Mapping[str, int]
    sent: Mapping[str, Sent]
    on_hand: dict[str, int]  # per SKU
    units: dict[tuple[str, str], int]  # (SKU, reservation status) -> units
    outcomes: dict[str, Outcome]  # key -> final outcome
    applied_again: list[tuple[str, str, str, int]]  # (key, SKU, operation, writes) for keys written twice
    created: dict[str, str]  # idempotency key -> the reservation it created
    statuses: dict[str, str]  # reservation id -> its status
    wrote: set[str]  # keys with a write in the history
    writes: dict[str, list[Written]]  # per SKU, its accepted writes in the order they were applied

    def supply(self, sku: str) -> int:
        """Units the accepted operations brought in or counted out, as their outcomes report them: the
        initial stock, each restock, each replenishment's order and each count's correction (counted
        minus on hand when it was written: a count is absolute)."""
        total = self.initial.get(sku, 0)
        for key, request in self.sent.items():
            outcome = self.outcomes.get(key)
            if request.kwargs.get("sku") != sku or outcome is None:
                continue
            if outcome.status != SUCCEEDED.get(request.operation):
                continue
            if request.operation == "restock":
                total += int(request.kwargs["quantity"])
            elif request.operation in DECIDED:
                total += int(outcome.detail["quantity"])
        return total


def read_facts(database_url: str, initial: Mapping[str, int], sent: Mapping[str, Sent]) -> Facts:
    engine = make_engine(database_url)
    try:
        with engine.connect() as conn:
            levels = {r.sku: int(r.on_hand) for r in conn.execute(sa.select(stock))}
            units = conn.execute(
                sa.select(
                    reservations.c.sku, reservations.c.status, sa.func.sum(reservations.c.quantity)
                ).group_by(reservations.c.sku, reservations.c.status)
            ).all()
            outcomes = {
                r.key: Outcome(r.status, json.loads(r.detail))
                for r in conn.execute(sa.select(request_outcomes))
            }
            # The operations the audit checks are already counted by it.
            applied = conn.execute(keys_written_twice(sku_history.c.operation.not_in(ONCE_PER_KEY))).all()
            made = conn.execute(
                sa.select(reservations.c.id, reservations.c.idempotency_key, reservations.c.status)
            ).all()
            wrote = conn.execute(
                sa.select(sku_history.c.idempotency_key)
                .where(sku_history.c.kind == "write", sku_history.c.idempotency_key.is_not(None))
                .distinct()
            ).all()
            writes = _writes(conn)
    finally:
        engine.dispose()
    return Facts(
        initial=initial,
        sent=sent,
        on_hand=levels,
        units={(r[0], r[1]): int(r[2]) for r in units},
        outcomes=outcomes,
        applied_again=[(r[0], r[1], r[2], int(r[3])) for r in applied],
        created={r.idempotency_key: r.id for r in made},
        statuses={r.id: r.status for r in made},
        wrote={r[0] for r in wrote},
        writes=writes,
    )


def _writes(conn: sa.Connection) -> dict[str, list[Written]]:
    rows = conn.execute(
        sa.select(
            sku_history.c.sku,
            sku_history.c.id,
            sku_history.c.operation,
            sku_history.c.idempotency_key,
            sku_history.c.on_hand_delta,
            sku_history.c.detail,
        )
        .where(sku_history.c.kind == "write")
        .order_by(sku_history.c.sku, sku_history.c.id)
    ).all()
    found: dict[str, list[Written]] = {}
    for sku, entry, operation, key, delta, detail in rows:
        recorded = json.loads(detail) if operation in DECIDED and detail else {}
        found.setdefault(sku, []).append(Written(int(entry), operation, key, int(delta), recorded))
    return found


def _oversells(facts: Facts) -> list[str]:
    found = []
    for sku in sorted(facts.on_hand):
        held, confirmed = facts.units.get((sku, "held"), 0), facts.units.get((sku, "confirmed"), 0)
        supply = facts.supply(sku)
        if held + confirmed > supply:
            found.append(f"{sku}: {held} held + {confirmed} confirmed units > {supply} ever stocked")
    return found


def _conservation(facts: Facts) -> list[str]:
    found = []
    for sku, on_hand in sorted(facts.on_hand.items()):
        left = facts.supply(sku) - facts.units.get((sku, "confirmed"), 0)
        if left != on_hand:
            found.append(
                f"{sku}: initial + restocked + replenished + counted - confirmed = {left}, on_hand {on_hand}"
            )
    return found


def _lost_updates(facts: Facts) -> list[str]:
    """Counts and replenishments applied after a write that changed on hand (the figure they decide from)
    which they had not seen: the write's id is newer than the version they read. A count then overwrites
    that newer stock with a figure decided before it; a replenishment orders for a level that was gone."""
    found = []
    for sku, writes in sorted(facts.writes.items()):
        changed: Written | None = None  # the latest write so far that changed on hand
        for write in writes:
            seen = write.detail.get("seen")
            if seen is not None and changed is not None and changed.id > seen:
                found.append(
                    f"{sku}: {write.operation} {write.key!r} (#{write.id}) decided from #{seen}, applied"
                    f" after {changed.operation} {changed.key!r} (#{changed.id}) changed on hand by"
                    f" {changed.on_hand_delta:+d}"
                )
            if write.on_hand_delta:
                changed = write
    return found


def _keys_applied_twice(facts: Facts) -> list[str]:
    return [f"{sku}: key {key!r} applied {n} times by {op}" for key, sku, op, n in facts.applied_again]


def _missing_outcomes(facts: Facts) -> list[str]:
    return sorted(key for key in facts.sent if key not in facts.outcomes)


def _unexpected_outcomes(facts: Facts) -> list[str]:
    return sorted(key for key in facts.outcomes if key not in facts.sent)


def _outcomes_contradicted(facts: Facts) -> list[str]:
    found = []
    for key, request in sorted(facts.sent.items()):
        outcome = facts.outcomes.get(key)
        said = _contradiction(facts, request, outcome) if outcome is not None else None
        if said:
            found.append(f"{key}: {said}")
    return found


def _contradiction(facts: Facts, request: Sent, outcome: Outcome) -> str | None:
    """What the database says against a request's final outcome, or None when it agrees: a success wrote
    under the request's key (or replays a write that did), anything else wrote nothing under it."""
    status, wrote = outcome.status, request.key in facts.wrote
    succeeded = status == SUCCEEDED.get(request.operation)
    if succeeded and not wrote:
        return f"outcome {status}, but nothing in the history was written under the key"
    if not succeeded and wrote:
        return f"outcome {status}, but the history has a write under the key"
    if request.operation == "reserve":
        reported = list(outcome.detail.get("reservation_ids") or []) if succeeded else []
        actual = [facts.created[request.key]] if request.key in facts.created else []
        if reported != actual:
            return f"outcome {status} with reservations {reported}, the key created {actual}"
    if succeeded and request.operation in ("confirm", "release"):
        now = facts.statuses.get(str(request.kwargs["reservation_id"]))
        if now != status:
            return f"outcome {status}, but the reservation is {now}"
    return None


# The checker's own rules, each adding its sentences to the rule of that name (after the audit's).
CHECKS: tuple[tuple[str, Callable[[Facts], list[str]]], ...] = (
    ("oversells", _oversells),
    ("conservation", _conservation),
    ("lost_updates", _lost_updates),
    ("keys_applied_twice", _keys_applied_twice),
    ("missing_outcomes", _missing_outcomes),
    ("unexpected_outcomes", _unexpected_outcomes),
    ("outcomes_contradicted", _outcomes_contradicted),
)


def check(database_url: str, initial: Mapping[str, int], sent: Mapping[str, Sent]) -> dict[str, list[str]]:
    """Audit the database on its own terms: every broken rule as a sentence, grouped by rule."""
    found: dict[str, list[str]] = {name: [] for name in RULES}
    with Inventory.from_url(database_url) as inventory:
        for violation in inventory.invariant_violations():
            found[AUDITED[violation.rule]].append(str(violation))
    facts = read_facts(database_url, initial, sent)
    for name, rule in CHECKS:
        found[name] += rule(facts)
    return found
