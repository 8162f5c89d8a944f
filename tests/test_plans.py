"""The decisions of the fencing plans, stepped through with scripted answers.

A plan (:mod:`fencing.plan`) yields each statement, script call or pause it needs and decides from what it
gets back; both shells only carry the operations out. Here the answers are scripted: each stands for what
the database, Redis or the nested step would have replied, and each test checks what the plan does with
them: which operations it asks for, what it returns or raises, and what it records on the lease. The same
plans run against real databases and Redis in tests/test_fence.py and tests/test_leases.py; these tests
reach the replies those rarely give on demand (a lost race at each step, a counter at its limit).
"""

from __future__ import annotations

import random
from collections.abc import Generator
from functools import partial
from typing import Any, cast

import pytest

from fencing import BackendUnavailable, Fence, LeaseBusy, LeaseLost, LeaseManager, StaleToken
from fencing.errors import ScopeMismatch, TokenOverflow
from fencing.etcd_backend import REGRANTS, EtcdLeaseCore, etcd_lease_id
from fencing.etcd_gateway import EtcdRefused
from fencing.fence import FenceOutcome
from fencing.lease import MAX_TOKEN, Lease, new_lease_id
from fencing.plan import Alone, Atomic
from fencing.redis_backend import RedisLeaseCore, Reply
from fencing.sql import Rows as SqlRows
from fencing.sql_backend import SqlLeaseCore
from reservations import reads
from reservations.errors import UnknownReservation, UnknownSku
from testing.scripted import Clock, Raises, Script, kinds, rows, sql_params, sql_text
from testing.support import items

SCOPE = "sku:A-1"


def lease(token: int = 5, *, scope: str = SCOPE, clock: Clock | None = None) -> Lease:
    return Lease(scope, token, new_lease_id(), "host:1", 10.0, 100.0, clock=clock or Clock())


def guarded_write(fence: Fence, held: Lease, scope: str = SCOPE) -> Generator[Any, Any, Any]:
    """The fence's plan for the write testing/support.py's Resource makes: take 3 units if 3 are left."""
    return fence.plan(
        held,
        scope=scope,
        where=[items.c.scope == scope],
        values={"quantity": items.c.quantity - 3},
        condition=items.c.quantity - 3 >= 0,
        returning=[items.c.quantity],
        operation="take 3",
    )


# -- the fence's guarded write (fencing/fence.py) --------------------------------------------------------


def test_a_write_the_row_accepts_is_applied_in_one_statement() -> None:
    script = Script([rows((5, 97))])
    result = script.run(guarded_write(Fence(items), lease(5)))
    assert result.outcome is FenceOutcome.APPLIED and result.row == (97,)
    assert kinds(script.ops) == ["update fenced_items"]  # no fence read after an accepted write


@pytest.mark.parametrize(("highest", "writer"), [(7, "other"), (5, "other")], ids=["newer", "same token"])
def test_a_refused_write_under_a_newer_fence_is_stale_and_loses_the_lease(highest: int, writer: str) -> None:
    """The UPDATE matched no row and the fence read shows a newer token, or the same token written by
    another lease (a coordinator that handed one number out twice): the write is stale, not merely
    refused by its condition, and the lease is lost for good."""
    held = lease(5)
    owner = new_lease_id() if writer == "other" else held.lease_id
    script = Script([rows(), rows((highest, owner))])
    with pytest.raises(StaleToken) as stale:
        script.run(guarded_write(Fence(items), held))
    assert (stale.value.scope, stale.value.presented, stale.value.highest) == (SCOPE, 5, highest)
    assert stale.value.lease_id == held.lease_id and stale.value.holder == held.holder
    assert held.lost and held.lost_reason == f"take 3 rejected: resource accepted token {highest}"
    assert kinds(script.ops) == ["update fenced_items", "select fenced_items"]


@pytest.mark.parametrize("highest", [3, 5], ids=["older fence", "own fence"])
def test_a_refused_write_under_its_own_or_an_older_fence_is_its_condition_failing(highest: int) -> None:
    """The fence admits the lease (its own earlier write, or an older epoch's): what refused the UPDATE
    was the caller's condition (too few units), and the lease stays held."""
    held = lease(5)
    owner = held.lease_id if highest == 5 else new_lease_id()
    script = Script([rows(), rows((highest, owner))])
    result = script.run(guarded_write(Fence(items), held))
    assert result.outcome is FenceOutcome.CONDITION_FAILED and result.row is None
    assert not held.lost


def test_a_write_on_no_row_says_so_and_keeps_the_lease() -> None:
    held = lease(5)
    script = Script([rows(), rows()])
    assert script.run(guarded_write(Fence(items), held)).outcome is FenceOutcome.NO_ROW
    assert not held.lost


def test_a_lease_already_lost_is_refused_before_any_statement() -> None:
    held = lease(5)
    held.mark_lost("renewal failed")
    script = Script([])
    with pytest.raises(LeaseLost, match="renewal failed"):
        script.run(guarded_write(Fence(items), held))
    assert script.ops == []


def test_a_lease_of_another_scope_is_refused_before_any_statement() -> None:
    script = Script([])
    with pytest.raises(ScopeMismatch):
        script.run(guarded_write(Fence(items), lease(5, scope="sku:B-2")))
    assert script.ops == []


def test_an_unenforced_fence_neither_guards_the_update_nor_refuses_a_stale_token() -> None:
    """``enforce=False`` (lease-only protection, for measuring what the fence prevents): the UPDATE
    carries no token condition, and a refusal under a newer fence is read as the condition failing."""
    held = lease(5)
    script = Script([rows(), rows((7, new_lease_id()))])
    result = script.run(guarded_write(Fence(items, enforce=False), held))
    assert result.outcome is FenceOutcome.CONDITION_FAILED and not held.lost
    enforced = Script([rows((5, 97))])
    enforced.run(guarded_write(Fence(items), lease(5)))
    assert "fence_token <" in sql_text(enforced.ops[0]) and "fence_token <" not in sql_text(script.ops[0])


# -- what both lease managers decide (fencing/manager.py) --------------------------------------------


class plans:
    """The decisions of the lease managers' operations over the SQL core, as the plans they run; the
    core's own plans are answered whole here (``Atomic``)."""

    def __init__(self, clock: Clock) -> None:
        self.shell = LeaseManager(SqlLeaseCore(dialect="sqlite", clock=clock), cast(Any, None), clock=clock)
        self.shell.rng = random.Random(7)

    def __getattr__(self, name: str) -> Any:
        return partial(getattr(LeaseManager, name).__wrapped__, self.shell)


def busy(retry_after: float) -> LeaseBusy:
    return LeaseBusy(scope=SCOPE, holder="host:2", token=4, retry_after=retry_after)


def test_an_acquire_that_may_not_wait_raises_the_busy_answer_without_pausing() -> None:
    script = Script([refusal := busy(1.0)])
    with pytest.raises(LeaseBusy) as raised:
        script.run(plans(script.clock).acquire(SCOPE, ttl=10.0, holder="host:1", wait=0))
    assert raised.value is refusal and script.sleeps == []


def test_an_acquire_that_may_wait_pauses_then_takes_the_lease_once_free() -> None:
    script = Script([busy(0.2), busy(0.2)])
    granted = lease(5, clock=script.clock)
    script.replies.append(granted)
    assert script.run(plans(script.clock).acquire(SCOPE, ttl=10.0, holder="host:1", wait=5)) is granted
    assert [type(op).__name__ for op in script.ops] == ["Atomic", "Sleep", "Atomic", "Sleep", "Atomic"]
    # Each pause is a jittered backoff, never past the time the holder's lease has left.
    assert all(0 < pause <= 0.2 for pause in script.sleeps)


def test_an_acquire_kept_busy_gives_up_at_its_deadline_and_never_pauses_past_it() -> None:
    """However long the holder's lease has left (30 s here), the acquirer pauses in short jittered steps
    and stops asking once its own wait (0.25 s) is spent."""
    script = Script([busy(30.0) for _ in range(1000)])
    with pytest.raises(LeaseBusy):
        script.run(plans(script.clock).acquire(SCOPE, ttl=10.0, holder="host:1", wait=0.25))
    assert len(script.sleeps) > 1 and max(script.sleeps) <= 0.25
    assert script.clock.now == pytest.approx(100.25) and sum(script.sleeps) == pytest.approx(0.25)


def test_a_renewal_never_resurrects_a_lost_lease() -> None:
    held = lease(5)
    held.mark_lost("stale: resource accepted token 6")
    script = Script([])
    with pytest.raises(LeaseLost):
        script.run(plans(script.clock).renew(held))
    assert script.ops == []


@pytest.mark.parametrize("contended", [True, False])
def test_a_release_ends_the_lease_s_authority_and_reports_contention(contended: bool) -> None:
    held = lease(5)
    script = Script([contended])
    script.run(plans(script.clock).release(held))
    assert held.lost and held.lost_reason == "released by its holder"
    assert held.contended is contended


def test_a_stale_rejection_of_another_lease_repairs_nothing() -> None:
    held = lease(5)
    other = StaleToken(scope=SCOPE, presented=4, highest=6)
    script = Script([])
    assert script.run(plans(script.clock).handle_stale(held, other)) is False
    assert script.ops == [] and not held.lost


@pytest.mark.parametrize(("repaired", "expected"), [((5, 9), True), (None, False)], ids=["raised", "gone"])
def test_a_stale_rejection_of_the_current_lease_loses_it_and_asks_for_a_repair(
    repaired: tuple[int, int] | None, expected: bool
) -> None:
    """The resource accepted token 9 while the coordinator still holds this lease at 5: the coordinator's
    counter went backwards. The lease is lost first, then the counter is raised in one atomic step;
    None is the coordinator no longer holding the lease (nothing to repair)."""
    held = lease(5)
    script = Script([repaired])
    stale = StaleToken(scope=SCOPE, presented=5, highest=9, lease_id=held.lease_id)
    assert script.run(plans(script.clock).handle_stale(held, stale)) is expected
    assert held.lost and held.lost_reason == "stale: resource accepted token 9"
    assert [type(op) for op in script.ops] == [Atomic]


# -- the SQL lease backend's statements (fencing/sql_backend.py) -----------------------------------------


def sql(clock: Clock | None = None) -> SqlLeaseCore:
    return SqlLeaseCore(dialect="sqlite", clock=clock or Clock())


def test_a_sql_acquire_on_a_free_scope_starts_the_next_epoch_and_records_how_the_last_ended() -> None:
    lease_id = new_lease_id()
    script = Script([rows(), rows((8, "expired")), rows()])
    got = script.run(sql(script.clock).acquire(SCOPE, 2.0, "host:1", lease_id))
    assert isinstance(got, Lease) and (got.token, got.lease_id, got.acquired_at) == (8, lease_id, 100.0)
    assert kinds(script.ops) == [
        "insert fencing_leases",
        "update fencing_leases",
        "insert fencing_lease_events",
    ]
    event = sql_params(script.ops[2])
    assert (event["event"], event["token"], event["previous_token"], event["previous_end"]) == (
        "acquired",
        8,
        7,
        "expired",
    )


def test_a_sql_acquire_on_a_live_lease_marks_it_contended_and_returns_who_holds_it() -> None:
    script = Script([rows(), rows(), rows(("host:2", 7, 1500))])
    got = script.run(sql().acquire(SCOPE, 2.0, "host:1", new_lease_id()))
    assert isinstance(got, LeaseBusy)
    assert (got.holder, got.token, got.retry_after) == ("host:2", 7, 1.5)
    assert kinds(script.ops) == ["insert fencing_leases", "update fencing_leases", "update fencing_leases"]
    assert "SET contended" in sql_text(script.ops[2])


def test_a_sql_acquire_that_keeps_losing_the_race_is_told_busy_not_left_looping() -> None:
    """Each time the lease it found live has ended before it could mark it contended (the holder released
    in between): it tries again, three times, then answers busy with no holder and no wait."""
    raced = [rows(), rows(), rows((7,))]
    script = Script([rows(), *raced, *raced, *raced])
    got = script.run(sql().acquire(SCOPE, 2.0, "host:1", new_lease_id()))
    assert isinstance(got, LeaseBusy) and (got.holder, got.token, got.retry_after) == (None, None, 0.0)


def test_a_sql_acquire_at_the_counter_s_limit_is_refused_as_an_overflow() -> None:
    script = Script([rows(), rows(), rows(), rows((MAX_TOKEN,))])
    with pytest.raises(TokenOverflow) as refused:
        script.run(sql().acquire(SCOPE, 2.0, "host:1", new_lease_id()))
    assert refused.value.token == MAX_TOKEN and refused.value.scope == SCOPE


@pytest.mark.parametrize(
    ("token", "own", "reason"),
    [
        (9, False, "superseded by token 9"),
        (5, True, "expired or released at the coordinator"),
        (5, False, "the coordinator does not know this lease"),
    ],
    ids=["superseded", "expired", "unknown"],
)
def test_a_sql_renewal_of_a_lease_no_longer_held_says_why_and_loses_it(
    token: int, own: bool, reason: str
) -> None:
    """The extending UPDATE matched no live row of this lease; the scope's row, read next, says why."""
    held = lease(5)
    script = Script([rows(), rows((token, held.lease_id if own else new_lease_id()))])
    with pytest.raises(LeaseLost) as lost:
        script.run(sql().renew(held))
    assert lost.value.reason == reason and held.lost_reason == reason
    assert kinds(script.ops) == ["update fencing_leases", "select fencing_leases"]


# -- the Redis lease backend's replies (fencing/redis_backend.py) ----------------------------------------


def redis_core(clock: Clock | None = None) -> RedisLeaseCore:
    return RedisLeaseCore(prefix="t", history_cap=4, history_retention_ms=60_000, clock=clock or Clock())


def test_a_redis_acquire_reads_a_busy_reply_as_the_holder_and_its_time_left() -> None:
    script = Script([[Reply.BUSY, "host:2", "7", "250"]])
    got = script.run(redis_core().acquire(SCOPE, 2.0, "host:1", new_lease_id()))
    assert isinstance(got, LeaseBusy) and (got.holder, got.token, got.retry_after) == ("host:2", 7, 0.25)


def test_a_redis_acquire_at_the_counter_s_limit_is_refused_as_an_overflow() -> None:
    script = Script([[Reply.OUT_OF_RANGE, str(MAX_TOKEN)]])
    with pytest.raises(TokenOverflow) as refused:
        script.run(redis_core().acquire(SCOPE, 2.0, "host:1", new_lease_id()))
    assert refused.value.token == MAX_TOKEN


@pytest.mark.parametrize(
    ("counter", "reason"),
    [
        (9, "superseded by token 9"),
        (5, "expired or released at the coordinator"),
        (3, "the coordinator's counter is at 3, behind this lease (data loss?)"),
    ],
    ids=["superseded", "expired", "behind"],
)
def test_a_redis_renewal_refused_says_why_and_loses_the_lease(counter: int, reason: str) -> None:
    held = lease(5)
    script = Script([[Reply.NOT_HELD, counter]])
    with pytest.raises(LeaseLost) as lost:
        script.run(redis_core().renew(held))
    assert lost.value.reason == reason and held.lost_reason == reason


# -- etcd ------------------------------------------------------------------------------------------------

_FREE = {"header": {"revision": "7"}, "responses": [{"response_range": {}}] * 3}  # no key, no base, no epoch


def test_an_etcd_grant_that_expired_before_its_key_was_written_is_granted_again() -> None:
    """The cluster stalled past the granted ttl between the grant and the write (a leader lost, a member
    frozen): etcd refuses the write under a lease it no longer knows. Nothing was written, so the acquire
    grants again and writes, rather than raise an untyped error out of the lease manager."""
    core = EtcdLeaseCore(prefix="p", history_cap=4, clock=Clock())
    lease_id = new_lease_id()
    expired = EtcdRefused("kv/txn", 5, "etcdserver: requested lease not found")
    granted = {"ID": str(etcd_lease_id(lease_id)), "TTL": "5"}
    written = {"succeeded": True, "header": {"revision": "9"}}
    script = Script([_FREE, granted, Raises(expired), _FREE, granted, written])
    lease = script.run(core.acquire("sku:E", 5, "w1", lease_id))
    assert isinstance(lease, Lease) and lease.token == 9
    assert [op.path for op in script.ops] == [
        "kv/txn", "lease/grant", "kv/txn", "kv/txn", "lease/grant", "kv/txn"
    ]  # fmt: skip


def test_an_etcd_cluster_that_keeps_losing_the_grant_is_unavailable() -> None:
    """Granted again a few times (REGRANTS), then the acquire gives up with a typed, transient error."""
    core = EtcdLeaseCore(prefix="p", history_cap=4, clock=Clock())
    expired = Raises(EtcdRefused("kv/txn", 5, "etcdserver: requested lease not found"))
    script = Script([_FREE, {"TTL": "5"}, expired] * (REGRANTS + 1))
    with pytest.raises(BackendUnavailable, match="requested lease not found"):
        script.run(core.acquire("sku:E", 5, "w1", new_lease_id()))
    assert [op.path for op in script.ops].count("lease/grant") == REGRANTS + 1


def test_an_etcd_write_refused_for_another_reason_is_raised() -> None:
    core = EtcdLeaseCore(prefix="p", history_cap=4, clock=Clock())
    refused = EtcdRefused("kv/txn", 3, "etcdserver: too many operations in txn request")
    script = Script([_FREE, {"TTL": "5"}, Raises(refused)])
    with pytest.raises(EtcdRefused, match="too many operations"):
        script.run(core.acquire("sku:E", 5, "w1", new_lease_id()))


@pytest.mark.parametrize(
    "read",
    [
        partial(reads.stock_alone, "A"),
        reads.all_stock,
        partial(reads.existing_skus, ["A", "B"]),
        reads.sku_count,
        partial(reads.reservation, "r_1"),
        partial(reads.reservation_list, "A"),
        partial(reads.history, "A"),
        partial(reads.archived, "A"),
        reads.rejection_counts,
    ],
)
def test_every_inventory_read_is_one_statement_alone(read: Any) -> None:
    """A read the inventory offers asks for one statement sent alone (autocommit on PostgreSQL: one round
    trip, where a transaction around it adds its BEGIN and COMMIT), and nothing else."""
    plan = read()
    assert isinstance(next(plan), Alone)
    answer = SqlRows([(0,)]) if read is reads.sku_count else SqlRows([])
    with pytest.raises((StopIteration, UnknownSku, UnknownReservation)):
        plan.send(answer)
