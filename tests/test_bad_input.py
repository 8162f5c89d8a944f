"""Bad input at every public entry point of the inventory and the lease managers: a typed error
(InvalidRequest or InvalidLeaseRequest), raised before any statement is sent, and nothing written.

One table of (call, expected error) per shell, run against SQLite and PostgreSQL for the inventory and
against Redis, SQLite and PostgreSQL for the lease managers. The cases share one world per backend and
each compares the whole backend before and after, so a case that writes anything fails.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from fencing import AsyncLeaseManager, InvalidLeaseRequest, Lease, LeaseManager, StaleToken
from fencing.engines import make_engine
from fencing.lease import new_lease_id
from reservations import AsyncInventory, InvalidRequest, Inventory, scope_of
from reservations import schema as inventory_schema
from reservations.inventory import lock_order
from testing.stock import TABLES, table_rows
from testing.stores import POSTGRES_URL, REDIS_URL

W = "WIDGET"
NUL, NEWLINE, SURROGATE = "a\x00b", "a\nb", "a\ud800b"
NAN, INF = math.nan, math.inf


@contextmanager
def database(kind: str, directory: Path) -> Iterator[str]:
    """A database of its own for one module's world: a SQLite file or a fresh PostgreSQL schema."""
    if kind == "sqlite":
        yield f"sqlite:///{directory / 'bad-input.sqlite3'}"
        return
    name = f"t_{uuid.uuid4().hex[:12]}"
    admin = make_engine(POSTGRES_URL)
    with admin.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{name}"'))
    try:
        yield f"{POSTGRES_URL}?options=-csearch_path%3D{name}"
    finally:
        with admin.begin() as conn:
            conn.execute(sa.text(f'DROP SCHEMA "{name}" CASCADE'))
        admin.dispose()


class StatementCounter:
    """Counts the statements an engine sends: a refusal must come before the first one."""

    def __init__(self, engine: sa.Engine) -> None:
        self.count = 0
        sa.event.listen(engine, "before_cursor_execute", self._seen)

    def _seen(self, *args: Any) -> None:
        self.count += 1


# -- the inventory ---------------------------------------------------------------------------------


@dataclass
class World:
    url: str
    inventory: Inventory
    manager: LeaseManager
    lease: Lease
    reservation_id: str
    statements: StatementCounter

    def state(self) -> dict[str, list[Any]]:
        return table_rows(self.url, TABLES)


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """A SKU with stock, a held reservation, a recorded outcome and attempt, a queued request."""
    with database(request.param, tmp_path_factory.mktemp("inventory")) as url:
        inventory_schema.upgrade(url)
        with Inventory.from_url(url) as inventory, LeaseManager.from_url(url) as manager:
            inventory.add_sku(W, on_hand=10)
            lease = manager.acquire(scope_of(W), ttl=3600, holder="w1")
            held = inventory.reserve(lease, W, 2, key="held")
            inventory.record_outcome("held", "reserve", "reserved", {})
            inventory.record_attempt("held", "reserve", "applied", token=lease.token, worker="h:1")
            inventory.hand_off(W, 1, key="queued")
            yield World(
                url,
                inventory,
                manager,
                lease,
                held.reservation_id or "",
                StatementCounter(inventory.executor.engine),
            )


def enter(cm: Any) -> None:
    with cm:
        pass


def case(name: str, call: Callable[[World], Any], error: type[Exception] = InvalidRequest) -> Any:
    return pytest.param(call, error, id=name)


INVENTORY_CASES = [
    # every operation that takes a lease
    case("reserve lease=None", lambda w: w.inventory.reserve(None, W, 1, key="k")),
    case("reserve lease=scope", lambda w: w.inventory.reserve("sku:WIDGET", W, 1, key="k")),
    case("restock lease=None", lambda w: w.inventory.restock(None, W, 1, key="k")),
    case("adjust lease=None", lambda w: w.inventory.adjust(None, W, 1, key="k")),
    case("confirm lease=None", lambda w: w.inventory.confirm(None, w.reservation_id, key="k")),
    case("release lease=None", lambda w: w.inventory.release(None, w.reservation_id, key="k")),
    case("cancel lease=None", lambda w: w.inventory.cancel(None, w.reservation_id, key="k")),
    case("expire_due lease=None", lambda w: w.inventory.expire_due(None, W)),
    case("serve_pending lease=None", lambda w: w.inventory.serve_pending(None, W)),
    case("reserve_many leases=None", lambda w: w.inventory.reserve_many(None, [(W, 1)], key="k")),
    case("reserve_many leases=list", lambda w: w.inventory.reserve_many([w.lease], [(W, 1)], key="k")),
    case("reserve_many lease=None", lambda w: w.inventory.reserve_many({W: None}, [(W, 1)], key="k")),
    case(
        "reserve_many extra non-lease",
        lambda w: w.inventory.reserve_many({W: w.lease, "X": "lease"}, [(W, 1)], key="k"),
    ),
    case("reserve_many key not a str", lambda w: w.inventory.reserve_many({1: w.lease}, [(W, 1)], key="k")),
    # free text
    case("adjust reason NUL", lambda w: w.inventory.adjust(w.lease, W, 1, key="k", reason=NUL)),
    case("adjust reason newline", lambda w: w.inventory.adjust(w.lease, W, 1, key="k", reason=NEWLINE)),
    case("adjust reason surrogate", lambda w: w.inventory.adjust(w.lease, W, 1, key="k", reason=SURROGATE)),
    case("adjust reason too long", lambda w: w.inventory.adjust(w.lease, W, 1, key="k", reason="r" * 501)),
    case("adjust reason not text", lambda w: w.inventory.adjust(w.lease, W, 1, key="k", reason=5)),
    # counts
    case("add_sku on_hand=False", lambda w: w.inventory.add_sku("NEW", on_hand=False)),
    case("add_sku on_hand=0.0", lambda w: w.inventory.add_sku("NEW", on_hand=0.0)),
    case("add_sku on_hand=None", lambda w: w.inventory.add_sku("NEW", on_hand=None)),
    case("add_sku on_hand huge", lambda w: w.inventory.add_sku("NEW", on_hand=10**12)),
    # reads
    case("history since=nan", lambda w: w.inventory.history(W, since=NAN)),
    case("history since=inf", lambda w: w.inventory.history(W, since=INF)),
    case("history since=-inf", lambda w: w.inventory.history(W, since=-INF)),
    case("history since=1e300", lambda w: w.inventory.history(W, since=1e300)),
    case("history since=-1e300", lambda w: w.inventory.history(W, since=-1e300)),
    case("history since ms", lambda w: w.inventory.history(W, since=time.time() * 1e6)),
    case("history since=str", lambda w: w.inventory.history(W, since="1h")),
    case("history since=True", lambda w: w.inventory.history(W, since=True)),
    case("history limit=-1", lambda w: w.inventory.history(W, limit=-1)),
    case("history limit=0", lambda w: w.inventory.history(W, limit=0)),
    case("history limit=True", lambda w: w.inventory.history(W, limit=True)),
    case("history limit huge", lambda w: w.inventory.history(W, limit=2**70)),
    case("history limit=1.5", lambda w: w.inventory.history(W, limit=1.5)),
    case("history limit=None", lambda w: w.inventory.history(W, limit=None)),
    case("reservations limit=-1", lambda w: w.inventory.reservations(limit=-1)),
    case("reservations limit huge", lambda w: w.inventory.reservations(W, limit=10**9)),
    case("reservations status", lambda w: w.inventory.reservations(status=5)),
    case("rejection_counts since=nan", lambda w: w.inventory.rejection_counts(since=NAN)),
    case("rejection_counts since=inf", lambda w: w.inventory.rejection_counts(since=INF)),
    case("rejection_counts since=str", lambda w: w.inventory.rejection_counts(since="yesterday")),
    case("reservation NUL", lambda w: w.inventory.reservation(NUL)),
    case("reservation non-ASCII", lambda w: w.inventory.reservation("ключ")),
    case("reservation None", lambda w: w.inventory.reservation(None)),
    case("reservation empty", lambda w: w.inventory.reservation("")),
    case("reservation too long", lambda w: w.inventory.reservation("x" * 300)),
    case("stock None", lambda w: w.inventory.stock(None)),
    # retention
    case("purge_idempotency nan", lambda w: w.inventory.purge_idempotency(older_than=NAN)),
    case("purge_idempotency inf", lambda w: w.inventory.purge_idempotency(older_than=INF)),
    case("purge_idempotency 1e300", lambda w: w.inventory.purge_idempotency(older_than=1e300)),
    case("purge_idempotency str", lambda w: w.inventory.purge_idempotency(older_than="60")),
    case("purge_idempotency True", lambda w: w.inventory.purge_idempotency(older_than=True)),
    case("purge_requests nan", lambda w: w.inventory.purge_requests(older_than=NAN)),
    case("purge_requests inf", lambda w: w.inventory.purge_requests(older_than=INF)),
    case("purge_requests -inf", lambda w: w.inventory.purge_requests(older_than=-INF)),
    case("purge_requests 1e300", lambda w: w.inventory.purge_requests(older_than=1e300)),
    # request records
    case("record_attempt key NUL", lambda w: w.inventory.record_attempt("k\x00", "reserve", "applied")),
    case("record_attempt key None", lambda w: w.inventory.record_attempt(None, "reserve", "applied")),
    case("record_attempt key empty", lambda w: w.inventory.record_attempt("", "reserve", "applied")),
    case("record_attempt key space", lambda w: w.inventory.record_attempt("a b", "reserve", "applied")),
    case("record_attempt key long", lambda w: w.inventory.record_attempt("k" * 201, "reserve", "applied")),
    case("record_attempt operation None", lambda w: w.inventory.record_attempt("k", None, "applied")),
    case("record_attempt operation NUL", lambda w: w.inventory.record_attempt("k", "re\x00", "applied")),
    case("record_attempt operation long", lambda w: w.inventory.record_attempt("k", "x" * 33, "applied")),
    case("record_attempt result", lambda w: w.inventory.record_attempt("k", "reserve", "bogus")),
    case(
        "record_attempt worker NUL",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", worker=NUL),
    ),
    case(
        "record_attempt worker long",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", worker="w" * 201),
    ),
    case(
        "record_attempt worker empty",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", worker=""),
    ),
    case(
        "record_attempt worker int",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", worker=5),
    ),
    case(
        "record_attempt task_id long",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", task_id="t" * 65),
    ),
    case(
        "record_attempt task_id NUL",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", task_id=NUL),
    ),
    case(
        "record_attempt detail NUL",
        lambda w: w.inventory.record_attempt("k", "reserve", "transient", detail=NUL),
    ),
    case(
        "record_attempt detail long",
        lambda w: w.inventory.record_attempt("k", "reserve", "transient", detail="d" * 10_001),
    ),
    case(
        "record_attempt detail int",
        lambda w: w.inventory.record_attempt("k", "reserve", "transient", detail=5),
    ),
    case("record_attempt token=0", lambda w: w.inventory.record_attempt("k", "reserve", "applied", token=0)),
    case(
        "record_attempt token huge",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", token=2**63),
    ),
    case(
        "record_attempt token str",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", token="1"),
    ),
    case(
        "record_attempt unknown field",
        lambda w: w.inventory.record_attempt("k", "reserve", "applied", spam=1),
    ),
    case("record_outcome key NUL", lambda w: w.inventory.record_outcome(NUL, "reserve", "reserved", {})),
    case("record_outcome operation None", lambda w: w.inventory.record_outcome("k", None, "reserved", {})),
    case("record_outcome status", lambda w: w.inventory.record_outcome("k", "reserve", "bogus", {})),
    case(
        "record_outcome detail nan",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {"x": NAN}),
    ),
    case(
        "record_outcome detail object",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {"x": object()}),
    ),
    case(
        "record_outcome detail mixed keys",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {1: "a", "b": 2}),
    ),
    case("record_outcome detail str", lambda w: w.inventory.record_outcome("k", "reserve", "reserved", "x")),
    case(
        "record_outcome worker NUL",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {}, worker=NUL),
    ),
    case(
        "record_outcome task_id long",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {}, task_id="t" * 65),
    ),
    case(
        "record_outcome epochs=-1",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {}, epochs=-1),
    ),
    case(
        "record_outcome epochs huge",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {}, epochs=2**40),
    ),
    case(
        "record_outcome fingerprint",
        lambda w: w.inventory.record_outcome("k", "reserve", "reserved", {}, fingerprint="xyz"),
    ),
    case("attempts NUL", lambda w: w.inventory.attempts("k\x00")),
    case("attempts None", lambda w: w.inventory.attempts(None)),
    case("request_outcome NUL", lambda w: w.inventory.request_outcome("k\x00")),
    case("skus_with_due_holds limit=-1", lambda w: w.inventory.skus_with_due_holds(-1)),
    case("skus_with_due_holds limit=0", lambda w: w.inventory.skus_with_due_holds(0)),
    case("skus_with_due_holds limit huge", lambda w: w.inventory.skus_with_due_holds(10**9)),
    case("skus_with_due_holds limit=nan", lambda w: w.inventory.skus_with_due_holds(NAN)),
    # the queue of a hot SKU
    case("hand_off task_id NUL", lambda w: w.inventory.hand_off(W, 1, key="q2", task_id=NUL)),
    case("hand_off task_id long", lambda w: w.inventory.hand_off(W, 1, key="q2", task_id="t" * 65)),
    case("hand_off epochs=-1", lambda w: w.inventory.hand_off(W, 1, key="q2", epochs=-1)),
    case("hand_off epochs str", lambda w: w.inventory.hand_off(W, 1, key="q2", epochs="1")),
    case("hand_off key NUL", lambda w: w.inventory.hand_off(W, 1, key=NUL)),
    case("serve_pending task_id NUL", lambda w: w.inventory.serve_pending(w.lease, W, task_id=NUL)),
    case("serve_pending worker long", lambda w: w.inventory.serve_pending(w.lease, W, worker="w" * 201)),
    case("serve_pending limit=-1", lambda w: w.inventory.serve_pending(w.lease, W, limit=-1)),
    case("pending_count sku NUL", lambda w: w.inventory.pending_count(NUL)),
    case("skus_waiting nan", lambda w: w.inventory.skus_waiting(older_than=NAN)),
    # timelines and holds
    case("timeline manager=None", lambda w: w.inventory.timeline(W, None)),
    case("timeline manager=url", lambda w: w.inventory.timeline(W, "redis://")),
    case("timeline limit=-1", lambda w: w.inventory.timeline(W, w.manager, limit=-1)),
    case("hold_many manager=None", lambda w: enter(w.inventory.hold_many(None, [W], ttl=5))),
    case("hold_many skus=str", lambda w: enter(w.inventory.hold_many(w.manager, "WIDGET", ttl=5))),
    case("hold_many skus=None", lambda w: enter(w.inventory.hold_many(w.manager, None, ttl=5))),
    case("hold_many sku None", lambda w: enter(w.inventory.hold_many(w.manager, [W, None], ttl=5))),
    case(
        "hold_many renew_every=0",
        lambda w: enter(w.inventory.hold_many(w.manager, ["OTHER"], ttl=5, renew_every=0)),
        InvalidLeaseRequest,
    ),
    case(
        "hold_many renew_every=nan",
        lambda w: enter(w.inventory.hold_many(w.manager, ["OTHER"], ttl=5, renew_every=NAN)),
        InvalidLeaseRequest,
    ),
    case("lock_order str", lambda w: lock_order("WIDGET")),
    case("lock_order None", lambda w: lock_order(None)),
]


@pytest.mark.parametrize(("call", "error"), INVENTORY_CASES)
def test_the_inventory_refuses_bad_input_before_any_statement(
    world: World, call: Callable[[World], Any], error: type[Exception]
) -> None:
    before, sent = world.state(), world.statements.count
    with pytest.raises(error):
        call(world)
    assert world.statements.count == sent
    assert world.state() == before


ASYNC_INVENTORY_CASES = [
    pytest.param(lambda i, w: i.reserve(None, W, 1, key="k"), id="reserve lease=None"),
    pytest.param(lambda i, w: i.restock(None, W, 1, key="k"), id="restock lease=None"),
    pytest.param(lambda i, w: i.adjust(None, W, 1, key="k"), id="adjust lease=None"),
    pytest.param(lambda i, w: i.confirm(None, w.reservation_id, key="k"), id="confirm lease=None"),
    pytest.param(lambda i, w: i.release(None, w.reservation_id, key="k"), id="release lease=None"),
    pytest.param(lambda i, w: i.expire_due(None, W), id="expire_due lease=None"),
    pytest.param(lambda i, w: i.serve_pending(None, W), id="serve_pending lease=None"),
    pytest.param(lambda i, w: i.reserve_many(None, [(W, 1)], key="k"), id="reserve_many leases=None"),
    pytest.param(lambda i, w: i.reserve_many({W: 1}, [(W, 1)], key="k"), id="reserve_many lease=1"),
    pytest.param(lambda i, w: i.adjust(w.lease, W, 1, key="k", reason=NUL), id="adjust reason NUL"),
    pytest.param(lambda i, w: i.history(W, since=NAN), id="history since=nan"),
    pytest.param(lambda i, w: i.history(W, limit=-1), id="history limit=-1"),
    pytest.param(lambda i, w: i.rejection_counts(since=INF), id="rejection_counts since=inf"),
    pytest.param(lambda i, w: i.purge_idempotency(older_than=NAN), id="purge_idempotency nan"),
    pytest.param(lambda i, w: i.reservation(NUL), id="reservation NUL"),
    pytest.param(
        lambda i, w: i.record_outcome("k", "reserve", "reserved", {}, worker=NUL), id="record_outcome worker"
    ),
    pytest.param(
        lambda i, w: i.record_outcome("k", "reserve", "reserved", {"x": INF}), id="record_outcome detail inf"
    ),
    pytest.param(lambda i, w: i.attempts(NUL), id="attempts NUL"),
    pytest.param(lambda i, w: i.hand_off(W, 1, key="q2", epochs=-1), id="hand_off epochs=-1"),
    pytest.param(lambda i, w: i.serve_pending(w.lease, W, worker=NUL), id="serve_pending worker NUL"),
    pytest.param(lambda i, w: i.timeline(W, None), id="timeline manager=None"),
    pytest.param(lambda i, w: i.timeline(W, w.manager), id="timeline sync manager"),
    pytest.param(lambda i, w: i.reservations(limit=0), id="reservations limit=0"),
]


@pytest.mark.parametrize("call", ASYNC_INVENTORY_CASES)
async def test_the_async_inventory_refuses_the_same_input(world: World, call: Callable[..., Any]) -> None:
    before = world.state()
    async with AsyncInventory.from_url(world.url) as inventory:
        sent = StatementCounter(inventory.executor.engine.sync_engine)
        with pytest.raises(InvalidRequest):
            await call(inventory, world)
        with pytest.raises(InvalidRequest):
            async with inventory.hold_many(None, [W], ttl=5):  # type: ignore[arg-type]
                pass
    assert sent.count == 0
    assert world.state() == before


# -- the lease managers ----------------------------------------------------------------------------


@dataclass
class LeaseWorld:
    name: str
    url: str
    prefix: str
    manager: LeaseManager
    lease: Lease

    def state(self) -> Any:
        if self.name != "redis":
            return table_rows(self.url, ("fencing_leases", "fencing_lease_events"))
        client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
        found = {}
        for key in sorted(client.scan_iter(match=f"{self.prefix}:*", count=1000)):
            kind = client.type(key)
            found[key] = {
                "string": client.get,
                "hash": client.hgetall,
                "list": lambda k: client.lrange(k, 0, -1),
            }[kind](key)
        client.close()
        return found

    def manager_for(self, cls: Any) -> Any:
        return cls.from_url(self.url, prefix=self.prefix)


@pytest.fixture(scope="module", params=["redis", "sqlite", "postgresql"])
def lease_world(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LeaseWorld]:
    """A held lease and a released one on each lease backend."""
    kind = "sqlite" if request.param == "redis" else request.param
    with database(kind, tmp_path_factory.mktemp("leases")) as db_url:
        url = REDIS_URL if request.param == "redis" else db_url
        prefix = f"t{uuid.uuid4().hex[:12]}"
        with LeaseManager.from_url(url, prefix=prefix) as manager:
            manager.create_schema()
            manager.release(manager.acquire("sku:B", ttl=5, holder="w"))
            lease = manager.acquire("sku:A", ttl=3600, holder="w")
            yield LeaseWorld(request.param, url, prefix, manager, lease)
        if request.param == "redis":
            client = redis.Redis.from_url(REDIS_URL)
            keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
            if keys:
                client.delete(*keys)
            client.close()


def stale(lease: Lease) -> StaleToken:
    return StaleToken(scope=lease.scope, presented=lease.token, highest=lease.token + 1)


def lease_case(name: str, call: Callable[[LeaseWorld], Any]) -> Any:
    return pytest.param(call, id=name)


def _from_url(url: object, **options: Any) -> None:
    LeaseManager.from_url(url, **options).close()  # type: ignore[arg-type]


LEASE_CASES = [
    lease_case("acquire holder NUL", lambda w: w.manager.acquire("sku:C", ttl=5, holder=NUL)),
    lease_case("acquire holder newline", lambda w: w.manager.acquire("sku:C", ttl=5, holder=NEWLINE)),
    lease_case("acquire holder surrogate", lambda w: w.manager.acquire("sku:C", ttl=5, holder=SURROGATE)),
    lease_case("acquire scope NUL", lambda w: w.manager.acquire("sku\x00", ttl=5, holder="w")),
    lease_case("acquire ttl nan", lambda w: w.manager.acquire("sku:C", ttl=NAN, holder="w")),
    lease_case("acquire wait nan", lambda w: w.manager.acquire("sku:C", ttl=5, holder="w", wait=NAN)),
    lease_case("acquire wait inf", lambda w: w.manager.acquire("sku:C", ttl=5, holder="w", wait=INF)),
    lease_case("acquire wait -1", lambda w: w.manager.acquire("sku:C", ttl=5, holder="w", wait=-1)),
    lease_case("renew None", lambda w: w.manager.renew(None)),
    lease_case("renew scope", lambda w: w.manager.renew("sku:A")),
    lease_case("release None", lambda w: w.manager.release(None)),
    lease_case("current None", lambda w: w.manager.current(None)),
    lease_case("history limit=-1", lambda w: w.manager.history("sku:A", limit=-1)),
    lease_case("history limit=0", lambda w: w.manager.history("sku:A", limit=0)),
    lease_case("history limit=True", lambda w: w.manager.history("sku:A", limit=True)),
    lease_case("history limit huge", lambda w: w.manager.history("sku:A", limit=10**9)),
    lease_case("history limit nan", lambda w: w.manager.history("sku:A", limit=NAN)),
    lease_case("history scope NUL", lambda w: w.manager.history(NUL)),
    lease_case("purge_history nan", lambda w: w.manager.purge_history(older_than=NAN)),
    lease_case("purge_history inf", lambda w: w.manager.purge_history(older_than=INF)),
    lease_case("purge_history -inf", lambda w: w.manager.purge_history(older_than=-INF)),
    lease_case("purge_history 1e300", lambda w: w.manager.purge_history(older_than=1e300)),
    lease_case("purge_history str", lambda w: w.manager.purge_history(older_than="60")),
    lease_case("purge_history True", lambda w: w.manager.purge_history(older_than=True)),
    lease_case("purge_history 59", lambda w: w.manager.purge_history(older_than=59)),
    lease_case("break reason NUL", lambda w: w.manager.break_lease("sku:A", reason=NUL)),
    lease_case("break reason newline", lambda w: w.manager.break_lease("sku:A", reason=NEWLINE)),
    lease_case("break reason surrogate", lambda w: w.manager.break_lease("sku:A", reason=SURROGATE)),
    lease_case("break reason empty", lambda w: w.manager.break_lease("sku:A", reason="")),
    lease_case("break reason long", lambda w: w.manager.break_lease("sku:A", reason="r" * 501)),
    lease_case("break scope None", lambda w: w.manager.break_lease(None, reason="r")),
    lease_case("handle_stale error=None", lambda w: w.manager.handle_stale(w.lease, None)),
    lease_case("handle_stale error=other", lambda w: w.manager.handle_stale(w.lease, ValueError("x"))),
    lease_case("handle_stale lease=None", lambda w: w.manager.handle_stale(None, stale(w.lease))),
    lease_case("hold renew_every=0", lambda w: enter(w.manager.hold("sku:C", ttl=5, renew_every=0))),
    lease_case("hold renew_every=-1", lambda w: enter(w.manager.hold("sku:C", ttl=5, renew_every=-1))),
    lease_case("hold renew_every=nan", lambda w: enter(w.manager.hold("sku:C", ttl=5, renew_every=NAN))),
    lease_case("hold renew_every=inf", lambda w: enter(w.manager.hold("sku:C", ttl=5, renew_every=INF))),
    lease_case("hold renew_every=str", lambda w: enter(w.manager.hold("sku:C", ttl=5, renew_every="1"))),
    lease_case("hold renew_every=True", lambda w: enter(w.manager.hold("sku:C", ttl=5, renew_every=True))),
    lease_case("from_url None", lambda w: _from_url(None)),
    lease_case("from_url int", lambda w: _from_url(5)),
    lease_case("from_url prefix int", lambda w: _from_url(w.url, prefix=5)),
    lease_case("from_url prefix empty", lambda w: _from_url(w.url, prefix="")),
    lease_case("from_url history_cap=0", lambda w: _from_url(w.url, prefix=w.prefix, history_cap=0)),
    lease_case("from_url history_cap=-1", lambda w: _from_url(w.url, prefix=w.prefix, history_cap=-1)),
    lease_case("from_url history_cap=True", lambda w: _from_url(w.url, prefix=w.prefix, history_cap=True)),
    lease_case("from_url history_cap str", lambda w: _from_url(w.url, prefix=w.prefix, history_cap="256")),
    lease_case("lease acquired_at nan", lambda w: Lease("sku:A", 1, new_lease_id(), "w", 5, NAN)),
    lease_case("lease acquired_at str", lambda w: Lease("sku:A", 1, new_lease_id(), "w", 5, "now")),
    lease_case("lease clock None", lambda w: Lease("sku:A", 1, new_lease_id(), "w", 5, 0.0, clock=None)),
]


@pytest.mark.parametrize("call", LEASE_CASES)
def test_the_lease_manager_refuses_bad_input_and_writes_nothing(
    lease_world: LeaseWorld, call: Callable[[LeaseWorld], Any]
) -> None:
    before = lease_world.state()
    with pytest.raises(InvalidLeaseRequest):
        call(lease_world)
    assert lease_world.state() == before
    assert not lease_world.lease.lost
    info = lease_world.manager.current("sku:A")
    assert info is not None and info.token == lease_world.lease.token
    assert lease_world.manager.current("sku:C") is None


ASYNC_LEASE_CASES = [
    pytest.param(lambda m, w: m.acquire("sku:C", ttl=5, holder=NUL), id="acquire holder NUL"),
    pytest.param(lambda m, w: m.acquire("sku:C", ttl=5, holder="w", wait=NAN), id="acquire wait nan"),
    pytest.param(lambda m, w: m.renew(None), id="renew None"),
    pytest.param(lambda m, w: m.release(None), id="release None"),
    pytest.param(lambda m, w: m.history("sku:A", limit=-1), id="history limit=-1"),
    pytest.param(lambda m, w: m.purge_history(older_than=NAN), id="purge_history nan"),
    pytest.param(lambda m, w: m.purge_history(older_than=INF), id="purge_history inf"),
    pytest.param(lambda m, w: m.break_lease("sku:A", reason=NUL), id="break reason NUL"),
    pytest.param(lambda m, w: m.handle_stale(w.lease, None), id="handle_stale error=None"),
    pytest.param(lambda m, w: m.handle_stale(None, stale(w.lease)), id="handle_stale lease=None"),
]


@pytest.mark.parametrize("call", ASYNC_LEASE_CASES)
async def test_the_async_lease_manager_refuses_the_same_input(
    lease_world: LeaseWorld, call: Callable[..., Any]
) -> None:
    before = lease_world.state()
    manager = lease_world.manager_for(AsyncLeaseManager)
    try:
        with pytest.raises(InvalidLeaseRequest):
            await call(manager, lease_world)
        with pytest.raises(InvalidLeaseRequest):
            async with manager.hold("sku:C", ttl=5, renew_every=0):
                pass
        with pytest.raises(InvalidLeaseRequest):
            AsyncLeaseManager.from_url(lease_world.url, history_cap=0)
    finally:
        await manager.close()
    assert lease_world.state() == before


def test_a_refused_request_can_still_be_made_correctly(world: World) -> None:
    """The refusals leave nothing behind that blocks the same key used properly afterwards."""
    with pytest.raises(InvalidRequest):
        world.inventory.adjust(world.lease, W, 1, key="fixed-reason", reason=NUL)
    with pytest.raises(InvalidRequest):
        world.inventory.record_attempt("fixed-reason", "adjust", "applied", worker=NUL)
    done = world.inventory.adjust(world.lease, W, 1, key="fixed-reason", reason="a b")
    world.inventory.record_attempt("fixed-reason", "adjust", "applied", worker="h:1", token=done.token)
    assert [(a.result, a.worker) for a in world.inventory.attempts("fixed-reason")] == [("applied", "h:1")]
    assert world.inventory.history(W, since=time.time() - 3600)[-1].detail == "a b"
    assert world.inventory.history(W, since=-86400 * 60_000)[-1].detail == "a b"  # before the epoch: all
