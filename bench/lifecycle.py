"""The later steps on PostgreSQL, one statement against the multi-statement plan: a confirm, a release, a
restock, a count and a replenishment, and a confirm, a restock and a count as queued requests with their
attempt and outcome (what a worker records today in transactions of their own). The five steps are also
timed against raw psycopg writing the same rows in one statement (bench.lifecycle_raw), the physical
reference. All paths write the same rows on one migrated schema; round trips and transactions are read
off the wire from a libpq trace.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, nullcontext
from typing import Any, cast

import psycopg
import sqlalchemy as sa

from bench import lifecycle_raw
from bench.env import Scratch
from bench.leases import UnexpectedReply
from bench.lifecycle_raw import RAW
from bench.reserve import conninfo, leased_skus
from bench.timing import Case, Op, Progress, Results, measure
from bench.wire import Trips, transactions_in, wire_trace
from fencing import Lease
from reservations import Inventory
from reservations.audit import Rule
from reservations.counting import StockSeen
from reservations.models import idempotency_keys
from reservations.values import Outcome

SKUS = 64
ON_HAND = 10**6
WHO: dict[str, Any] = {"task_id": "bench-task", "worker": "bench-worker", "epochs": 0}

ONE, SEVERAL = "one statement", "several statements"
STEPS = ("confirm", "release", "restock", "count", "replenish", "confirm request", "restock request",
         "count request")  # fmt: skip
# The steps that end a hold: each call takes a reservation held beforehand.
ENDING = ("confirm", "release", "confirm request")


def case(step: str, path: str) -> str:
    return f"{step}, {path}"


class Steps:
    """One inventory's later steps as timed operations, SKUs taken in rotation, every key fresh."""

    def __init__(self, inventory: Inventory, leases: dict[str, Lease], seen: dict[str, StockSeen]) -> None:
        self.inventory = inventory
        self.leases = leases
        self.seen = seen
        self.held: dict[str, Iterator[tuple[str, str]]] = {}
        self._skus = itertools.cycle(sorted(leases))
        self._keys = itertools.count()

    def hold(self, step: str, prefix: str, count: int) -> None:
        """Reservations for ``count`` calls of ``step``, made before any is timed."""
        made = []
        for n in range(count):
            sku = next(self._skus)
            key = f"{prefix}hold:{step.replace(' ', '-')}:{n}"
            outcome = self.inventory.reserve(self.leases[sku], sku, 1, key=key)
            made.append((sku, outcome.reservation_id or ""))
        self.held[step] = iter(made)

    def op(self, step: str, prefix: str, raw: psycopg.Connection[Any] | None = None) -> Op:
        """The library's ``step``, or with ``raw`` (an autocommit connection) raw psycopg's."""
        inv = self.inventory
        keys, skus = self._keys, self._skus

        def key() -> str:
            return f"{prefix}{step.replace(' ', '-')}:{next(keys)}"

        def ends(finish: Callable[[Lease, str, str], Any]) -> Op:
            def op() -> None:
                sku, rid = next(self.held[step])
                finish(self.leases[sku], rid, key())

            return op

        def on_stock(write: Callable[[Lease, str, StockSeen, str], Any]) -> Op:
            def op() -> None:
                sku = next(skus)
                write(self.leases[sku], sku, self.seen[sku], key())

            return op

        if raw is not None:
            ending, stocking = lifecycle_raw.writes(raw, counted=ON_HAND, par=2 * ON_HAND)
            return ends(ending[step]) if step in ending else on_stock(stocking[step])
        ops: dict[str, Op] = {
            "confirm": ends(lambda lease, rid, k: inv.confirm(lease, rid, key=k)),
            "release": ends(lambda lease, rid, k: inv.release(lease, rid, key=k)),
            "confirm request": ends(lambda lease, rid, k: inv.confirm_request(lease, rid, key=k, **WHO)),
            "restock": on_stock(lambda lease, sku, seen, k: inv.restock(lease, sku, 1, key=k)),
            "count": on_stock(lambda lease, sku, seen, k: inv.count(lease, sku, ON_HAND, key=k, seen=seen)),
            "replenish": on_stock(
                lambda lease, sku, seen, k: inv.replenish(lease, sku, 2 * ON_HAND, key=k, seen=seen)
            ),
            "restock request": on_stock(
                lambda lease, sku, seen, k: inv.restock_request(lease, sku, 1, key=k, **WHO)
            ),
            "count request": on_stock(
                lambda lease, sku, seen, k: inv.count_request(lease, sku, ON_HAND, key=k, **WHO, seen=seen)
            ),
        }
        return ops[step]


def _traced(url: str, leases: dict[str, Lease], seen: dict[str, StockSeen], path: str) -> dict[str, str]:
    """Each step's round trips on the wire, on a pool of one connection (raw psycopg: a connection of its
    own, the holds made on the pool's): the last of enough calls to get past psycopg preparing its
    statements."""
    with ExitStack() as stack:
        counter = stack.enter_context(
            Inventory.from_url(url, single_statement=path != SEVERAL, pool_size=1, max_overflow=0)
        )
        with counter.executor.engine.connect() as first:  # the pool's one connection, now set up
            pooled = cast(psycopg.Connection[Any], first.connection.dbapi_connection)
        raw = stack.enter_context(psycopg.connect(conninfo(url), autocommit=True)) if path == RAW else None
        conn = raw or pooled
        calls = max(pooled.prepare_threshold or 0, conn.prepare_threshold or 0) + 2
        steps = Steps(counter, leases, seen)
        prefix = f"trace-{path.split()[0]}:"
        found: dict[str, str] = {}
        known = Trips()  # one connection: a statement prepared for an earlier step is still named
        for step in lifecycle_raw.STEPS if raw else STEPS:
            if step in ENDING:
                # traced on the pool's connection, so the statements the holds prepare are named later
                with nullcontext() if raw else wire_trace(pooled, known):
                    steps.hold(step, prefix, calls)
            op = steps.op(step, prefix, raw)
            for _ in range(calls):
                with wire_trace(conn, known) as trips:
                    op()
            steady = [trip for trip in trips if not trip.startswith("prepare ")]
            found[step] = f"{len(steady)} ({transactions_in(steady)} transactions): {', '.join(steady)}"
    return found


def _check(inventory: Inventory) -> str:
    """Every path wrote what it should: the inventory's invariants hold, and for each step the first
    idempotency record raw psycopg wrote reads back as the library's Outcome, with the same fields as the
    library's own record of that step. Replenishments past par are counted, not refused: each orders from
    the read made before the run, so one on a SKU whose on hand has grown since passes par."""
    violations = inventory.invariant_violations()
    past_par = sum(violation.rule is Rule.PAST_PAR for violation in violations)
    problems = [str(violation) for violation in violations if violation.rule is not Rule.PAST_PAR]
    with inventory.executor.engine.connect() as conn:
        for step in lifecycle_raw.STEPS:
            texts = [
                conn.execute(
                    sa.select(idempotency_keys.c.outcome)
                    .where(idempotency_keys.c.key.startswith(f"{path}:{step}:"))
                    .limit(1)
                ).scalar_one()
                for path in ("one", "raw")
            ]
            ours, raw = (json.loads(text) for text in texts)
            again = json.loads(Outcome.from_json(texts[1], replayed=False).to_json())
            fields = [sorted(record) + sorted(record["detail"]) for record in (ours, raw)]
            if again != raw or fields[0] != fields[1] or raw["operation"] != step:
                problems.append(f"raw {step} record {texts[1]} is not of the library's shape {texts[0]}")
    if problems:
        raise UnexpectedReply(f"after the run: {len(problems)} problems, {problems[:3]}")
    return (
        f"no invariant violations but {past_par} replenishments past par (each orders from the read made "
        "before the run); raw psycopg's idempotency record of each step parses as the library's Outcome, "
        "with the fields of the library's own record"
    )


def one_vs_several(
    scratch: Scratch,
    results: Results,
    *,
    iterations: int,
    warmup: int,
    repeats: int,
    progress: Progress | None = None,
) -> None:
    """Needs PostgreSQL; the caller checks it. Works in a migrated schema of its own."""
    section = "Later steps: one statement vs the multi-statement plan and raw psycopg, PostgreSQL"
    url = scratch.postgres_url("lifecycle")
    if progress:
        progress(f"  migrating a fresh schema, adding {SKUS} SKUs, taking their leases")
    per_case = warmup + iterations * repeats
    with ExitStack() as stack:
        skus, leases = leased_skus(stack, url, "L", SKUS)
        paths = {
            ONE: stack.enter_context(Inventory.from_url(url)),
            SEVERAL: stack.enter_context(Inventory.from_url(url, single_statement=False)),
        }
        for sku in skus:
            paths[ONE].add_sku(sku, on_hand=ON_HAND)
        seen = {sku: paths[ONE].look(leases[sku], sku) for sku in skus}
        trips: dict[str, dict[str, str]] = {}
        if sys.platform == "linux":
            if progress:
                progress("  counting round trips (libpq trace)")
            trips = {path: _traced(url, leases, seen, path) for path in (*paths, RAW)}
        raw = stack.enter_context(psycopg.connect(conninfo(url), autocommit=True))
        # raw psycopg's reservations are held by the library, as the library's own are
        runs = [(ONE, paths[ONE], STEPS, None), (RAW, paths[ONE], lifecycle_raw.STEPS, raw),
                (SEVERAL, paths[SEVERAL], STEPS, None)]  # fmt: skip
        ending = sum(step in ENDING for _, _, steps_of, _ in runs for step in steps_of)
        if progress:
            progress(f"  holding {per_case} reservations for each of {ending} cases")
        cases = []
        for path, inventory, steps_of, conn in runs:
            steps = Steps(inventory, leases, seen)
            prefix = f"{path.split()[0]}:"
            for step in steps_of:
                if step in ENDING:
                    steps.hold(step, prefix, per_case)
                cases.append(Case(case(step, path), steps.op(step, prefix, conn)))
        stats = measure(cases, iterations=iterations, warmup=warmup, repeats=repeats, progress=progress)
        checked = _check(paths[ONE])
    for step in STEPS:
        results.add(section, stats, case(step, ONE), case(step, SEVERAL))
        if step in lifecycle_raw.STEPS:
            results.add(section, stats, case(step, ONE), case(step, RAW))
        for path, _, steps_of, _ in runs:
            name = case(step, path)
            if step in steps_of:
                results.cost(section, name, {
                    "round trips": trips.get(path, {}).get(step, "?"),
                    "p50": f"{stats[name].p50 * 1e3:.2f} ms",
                })  # fmt: skip
    results.notes.append(
        f"Later steps: {SKUS} SKUs taken in rotation, one SQL lease each on the same database, one process "
        "and a pooled engine per path; a count and a replenishment are decided from one read made before "
        "the run, every key is fresh, each confirm or release ends a reservation held before the run. A "
        "request is the step with its attempt and outcome rows (one statement), against the outcome "
        "check, the step and the two records one after another (several)."
    )
    results.notes.append(
        "Later steps, raw psycopg: one connection in autocommit, each step ONE data-modifying CTE writing "
        "the rows the library's statement writes (the reservation's status, the stock counts and "
        "updated_ms, a history row, an idempotency record with the same outcome JSON); it skips the fence "
        "predicate and fence columns, the stock row lock, the idempotency lookup and the check that a "
        f"reservation is of the lease's SKU. Checked after the run: {checked}."
    )
