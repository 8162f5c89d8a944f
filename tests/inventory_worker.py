"""A worker process for tests/test_inventory_concurrency.py: fenced stock operations with injected pauses.

Run as ``python -m tests.inventory_worker --phases hot,multi ... --report FILE``. Before each phase it prints
``ready`` and waits for ``go`` on stdin, so all workers contend together; at the end it writes a JSON report
of every answer it got.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from fencing import Lease, LeaseBusy, LeaseLost, LeaseManager, StaleToken
from reservations import InsufficientStock, InvalidTransition, Inventory, Outcome, scope_of
from testing.support import start_gate

ACQUIRE_WAIT = 10.0
ORDER_TTL = 0.3  # hold_many renews in the background, so this only bounds a crashed holder
SUPERSEDED_WITHIN = 6  # ttls a sleeper's pause waits for a newer epoch to write its SKU


@dataclass(frozen=True)
class Workload:
    skus: tuple[str, ...]
    on_hand: int
    reserve_keys: int  # per SKU
    restock_keys: int  # per SKU
    orders: int


# Key pools are small on purpose: every key is drawn again and again, by every worker, so redeliveries
# of the same request (including by a holder whose lease has meanwhile expired) are the normal case.
WORKLOADS = {
    "hot": Workload(skus=("HOT",), on_hand=30, reserve_keys=30, restock_keys=8, orders=0),
    "multi": Workload(
        skus=tuple(f"SKU-{i}" for i in range(8)), on_hand=10, reserve_keys=8, restock_keys=3, orders=16
    ),
}


def sku_weights(skus: tuple[str, ...]) -> list[float]:
    """Skewed popularity, as in a real catalogue: a paused holder's SKU is then likely to be taken over
    and written by someone else before its late write arrives, even with eight SKUs to spread over."""
    return [1 / (rank + 1) for rank in range(len(skus))]


@dataclass(frozen=True)
class Request:
    """A request is a pure function of its key, so a redelivered key is always the identical request."""

    op: str
    key: str
    lines: tuple[tuple[str, int], ...]
    reservation_id: str | None = None


def reserve_request(sku: str, i: int) -> Request:
    return Request("reserve", f"rsv.{sku}.{i}", ((sku, 1 + i % 3),))


def restock_request(sku: str, i: int) -> Request:
    return Request("restock", f"rst.{sku}.{i}", ((sku, 2 + i % 3),))


def order_request(workload: Workload, i: int) -> Request:
    rng = random.Random(i)
    skus = rng.sample(workload.skus, rng.choice((2, 3)))
    return Request("reserve_many", f"ord.{i}", tuple(sorted((s, rng.randint(1, 2)) for s in skus)))


def finish_request(op: str, reservation_id: str, sku: str, quantity: int) -> Request:
    return Request(op, f"{op}.{reservation_id}", ((sku, quantity),), reservation_id)


@dataclass
class Report:
    worker: int
    role: str
    cycles: int = 0
    busy: int = 0
    stale: int = 0
    lost: int = 0
    repaired: int = 0
    long_pauses: int = 0
    late_replays: int = 0
    invalid_transition: int = 0
    expired_before_release: int = 0
    # [key, op, kind, reservation ids, token, [[sku, on_hand delta, reserved delta], ...]]
    answers: list[list[object]] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--lease-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--phases", required=True, help="comma-separated workloads, run in this order")
    parser.add_argument("--worker", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--role", choices=["sleeper", "mixed"], required=True)
    parser.add_argument("--ops", type=int, required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--long-pause-share", type=float, default=0.2)
    parser.add_argument("--no-enforce", dest="enforce", action="store_false")
    return parser.parse_args(argv)


def choose_pause(ttl: float, rng: random.Random, long_share: float) -> float:
    """The injected fault of a mixed worker: time lost between acquire and write, like a GC or VM pause;
    mostly short, sometimes past the lease's expiry."""
    if rng.random() < long_share:
        return rng.uniform(1.5, 2.5) * ttl
    return rng.uniform(0.0, 0.2) * ttl


def deltas(request: Request, outcome: Outcome) -> list[list[object]]:
    """(sku, on_hand, reserved) changes an applied outcome made, as the worker understands the API."""
    if request.op == "restock":
        return [[sku, qty, 0] for sku, qty in request.lines]
    if request.op in ("reserve", "reserve_many"):
        return [[sku, 0, qty] for sku, qty in request.lines]
    ((sku, _),) = request.lines
    return [[sku, -outcome.quantity if request.op == "confirm" else 0, -outcome.quantity]]


class Worker:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workload = WORKLOADS[args.phases.split(",")[0]]
        self.rng = random.Random(args.seed)
        self.report = Report(worker=args.worker, role=args.role)
        self.holder = f"w{args.worker}"
        self.inventory = Inventory.from_url(args.db_url, enforce_fence=args.enforce)
        self.leases = LeaseManager.from_url(args.lease_url, prefix=args.prefix)
        self.finished: list[Request] = []  # confirm/release requests sent, for redelivery
        self.takeovers = 0

    def start(self, phase: str) -> None:
        self.workload = WORKLOADS[phase]
        self.finished = []

    def warm_up(self) -> None:
        # Connect before the gate, so the first cycles race each other rather than connection setup.
        sku = self.workload.skus[0]
        self.inventory.stock(sku)
        self.leases.current(scope_of(sku))

    def choose(self) -> Request:
        w, rng = self.workload, self.rng
        (sku,) = rng.choices(w.skus, weights=sku_weights(w.skus))
        roll = rng.random()
        # The sleeper's pause needs a lease that expires, and hold_many renews its leases.
        if w.orders and roll < 0.25 and self.args.role != "sleeper":
            return order_request(w, rng.randrange(w.orders))
        if roll < 0.5:
            return reserve_request(sku, rng.randrange(w.reserve_keys))
        if roll < 0.65:
            return restock_request(sku, rng.randrange(w.restock_keys))
        if self.finished and roll < 0.72:
            return rng.choice(self.finished)  # a broker redelivering a confirm or release
        held = self.inventory.reservations(sku, status="held", limit=200)
        if not held:
            return reserve_request(sku, rng.randrange(w.reserve_keys))
        # Other workers see the same held reservations, so two of them may finish the same one.
        view = rng.choice(held)
        request = finish_request("confirm" if roll < 0.86 else "release", view.id, view.sku, view.quantity)
        self.finished.append(request)
        return request

    def answer(self, request: Request, kind: str, outcome: Outcome | None = None) -> None:
        ids = list(outcome.reservation_ids) if outcome else []
        token = outcome.token if outcome else None
        changes = deltas(request, outcome) if outcome and kind == "applied" else []
        self.report.answers.append([request.key, request.op, kind, ids, token, changes])

    def outlive(self, lease: Lease, sku: str) -> None:
        """The sleeper's fault: a pause past its lease's expiry that lasts until a newer epoch has written
        the SKU, so its write arrives late, not merely after expiry. When no other worker took the SKU over
        within SUPERSEDED_WITHIN ttls (it drew a quiet SKU, or the others finished first on a slow
        machine), the sleeper makes that takeover itself, as a holder of its own."""
        deadline = time.monotonic() + SUPERSEDED_WITHIN * self.args.ttl
        time.sleep(1.2 * self.args.ttl)
        while self.inventory.stock(sku).fence_token <= lease.token:
            if time.monotonic() >= deadline:
                self.take_over(sku)
                return
            time.sleep(self.args.ttl / 5)

    def take_over(self, sku: str) -> None:
        """A restock of ``sku`` under a newer lease than the sleeper's, with a key of its own."""
        self.takeovers += 1
        request = Request("restock", f"rst.{sku}.{self.holder}.takeover.{self.takeovers}", ((sku, 1),))
        newer = self.leases.acquire(
            scope_of(sku), ttl=self.args.ttl, holder=f"{self.holder}-next", wait=ACQUIRE_WAIT
        )
        try:
            outcome = self.inventory.restock(newer, sku, 1, key=request.key)
            self.answer(request, "applied", outcome)
        finally:
            with contextlib.suppress(LeaseLost):
                self.leases.release(newer)

    def attempt(self, request: Request, pause: Callable[[], None], write: Callable[[], Outcome]) -> None:
        started = time.monotonic()
        pause()
        late = time.monotonic() - started > self.args.ttl
        self.report.long_pauses += late
        try:
            outcome = write()
        except InsufficientStock as exc:
            self.answer(request, "refused_replayed" if exc.replayed else "refused")
        except InvalidTransition:
            self.report.invalid_transition += 1
        else:
            self.answer(request, "replayed" if outcome.replayed else "applied", outcome)
            self.report.late_replays += outcome.replayed and late

    def single(self, request: Request, seconds: float) -> None:
        ((sku, qty),) = request.lines
        inv, key, rid = self.inventory, request.key, str(request.reservation_id)
        # Plain acquire, no hold(): a real pause freezes the renewal thread too, so the lease must be
        # allowed to expire underneath the paused worker.
        lease = self.leases.acquire(scope_of(sku), ttl=self.args.ttl, holder=self.holder, wait=ACQUIRE_WAIT)
        writes: dict[str, Callable[[], Outcome]] = {
            "reserve": lambda: inv.reserve(lease, sku, qty, key=key),
            "restock": lambda: inv.restock(lease, sku, qty, key=key),
            "confirm": lambda: inv.confirm(lease, rid, key=key),
            "release": lambda: inv.release(lease, rid, key=key),
        }
        sleeper = self.args.role == "sleeper"
        try:
            self.attempt(
                request,
                (lambda: self.outlive(lease, sku)) if sleeper else (lambda: time.sleep(seconds)),
                writes[request.op],
            )
        except StaleToken as exc:
            self.report.stale += 1
            # What a real worker does with a rejection; with no coordinator fault it is always a lost
            # race, never a repair.
            self.report.repaired += self.leases.handle_stale(lease, exc)
            return
        try:
            self.leases.release(lease)
        except LeaseLost:
            self.report.expired_before_release += 1

    def order(self, request: Request, seconds: float) -> None:
        skus = [sku for sku, _ in request.lines]
        try:
            with self.inventory.hold_many(
                self.leases, skus, ttl=ORDER_TTL, holder=self.holder, wait=ACQUIRE_WAIT
            ) as held:
                lines = list(request.lines)
                self.attempt(
                    request,
                    lambda: time.sleep(seconds),
                    lambda: self.inventory.reserve_many(held, lines, key=request.key),
                )
        except StaleToken:
            self.report.stale += 1  # hold() already ran the repair check on the way out

    def cycle(self) -> None:
        request = self.choose()
        seconds = choose_pause(self.args.ttl, self.rng, self.args.long_pause_share)
        try:
            if request.op == "reserve_many":
                self.order(request, seconds)
            else:
                self.single(request, seconds)
        except LeaseBusy:
            self.report.busy += 1
        except LeaseLost:
            self.report.lost += 1
        except Exception as exc:  # reported, not raised: the parent shows every one with its request
            first = str(exc).splitlines()[0] if str(exc) else ""
            self.report.unexpected.append(f"{request.op} {request.key}: {type(exc).__name__}: {first}")

    def close(self) -> None:
        self.inventory.close()
        self.leases.close()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    worker = Worker(args)
    try:
        worker.warm_up()
        for phase in args.phases.split(","):
            worker.start(phase)
            if not start_gate():
                return 3
            for _ in range(args.ops):
                worker.report.cycles += 1
                worker.cycle()
    finally:
        worker.close()
    args.report.write_text(json.dumps(asdict(worker.report)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
