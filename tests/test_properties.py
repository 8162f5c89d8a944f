"""Stateful property test of the fencing guarantee: simulated holders race for leases on two scopes,
any lease ever issued may write late, and the protected rows must never accept an older epoch.

The machine runs against every lease backend, and once with the fence bypassed to show it bites.
"""

from __future__ import annotations

import uuid
from contextlib import closing
from dataclasses import dataclass, field
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fencing import (
    FenceOutcome,
    Lease,
    LeaseBusy,
    LeaseLost,
    LeaseManager,
    ScopeMismatch,
    StaleToken,
)
from testing.stores import Stack
from testing.support import Resource

HOLDERS = ("h0", "h1", "h2")
SCOPES = (0, 1)
START_QUANTITY = 3  # small, so some writes fail their own condition and must not count as stale
DELTAS = st.integers(min_value=-3, max_value=2)
# Leases never run out on their own during a run: expiry is break_lease, so nothing waits on time.
TTL = 3600.0

FENCED = settings(
    max_examples=30,
    stateful_step_count=30,
    deadline=None,
    # Each step is several real round trips, so slow examples say nothing about the strategies.
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    # The explain phase traces every line run (sqlalchemy, redis-py included): minutes per failure.
    phases=[phase for phase in Phase if phase is not Phase.explain],
)
# A fixed seed, since the test asserts that a counterexample is found. Shrinking it would replay
# hundreds of examples against the database for nothing: the first violation is proof enough.
BYPASSED = settings(FENCED, max_examples=100, derandomize=True, phases=[Phase.generate])

live_scope = precondition(lambda self: any(scope.live for scope in self.scopes))
has_held = precondition(lambda self: bool(self.latest))


class FencingViolation(AssertionError):
    """A stale epoch or a lost lease got a write through, or a lease reached another scope."""


@dataclass
class ScopeModel:
    """What the test knows about one scope, independently of the library."""

    name: str
    issued: int = 0  # the latest token the coordinator handed out
    live: Lease | None = None  # the lease the coordinator holds right now
    accepted: tuple[int, str] | None = None  # (token, lease id) of the newest accepted write
    quantity: int = START_QUANTITY
    log: list[tuple[int, str, int]] = field(default_factory=list)

    def is_stale(self, lease: Lease) -> bool:
        """Once a token is accepted, only a newer token or the same lease may write again."""
        if self.accepted is None:
            return False
        token, lease_id = self.accepted
        return lease.token < token or (lease.token == token and lease.lease_id != lease_id)

    def row(self) -> tuple[int, int, str | None]:
        token, lease_id = self.accepted or (0, None)
        return self.quantity, token, lease_id


class FencingMachine(RuleBasedStateMachine):
    """Holders acquire, renew, release, lose and write. Every lease ever issued stays in ``leases``
    and may write at any later step, as a worker paused past its ttl would."""

    leases = Bundle("leases")

    def __init__(self, manager: LeaseManager, resource: Resource) -> None:
        super().__init__()
        self.manager = manager
        self.resource = resource
        # The lease store and the resource tables outlive one example: fresh scope names keep one
        # example's epochs out of the next.
        run = uuid.uuid4().hex[:12]
        self.scopes = [ScopeModel(f"prop-{run}-{index}") for index in SCOPES]
        self.by_name = {scope.name: scope for scope in self.scopes}
        self.resource.create(*self.by_name, quantity=START_QUANTITY)
        self.latest: dict[tuple[str, int], Lease] = {}  # each holder's newest lease per scope
        self.lost: set[str] = set()  # ids of leases that raised LostOwnership: sticky from then on

    # Rules that need a live lease or a holder with a lease are guarded by preconditions: a no-op
    # step teaches nothing and crowds out the sequences that matter (expire, take over, write,
    # write late).

    @rule(target=leases, holder=st.sampled_from(HOLDERS), index=st.sampled_from(SCOPES))
    def acquire(self, holder: str, index: int) -> Lease | MultipleResults[Lease]:
        scope = self.scopes[index]
        live = scope.live
        try:
            lease = self.manager.acquire(scope.name, ttl=TTL, holder=holder)
        except LeaseBusy as busy:
            assert live is not None, f"{scope.name} is free, yet acquire said busy: {busy}"
            assert (busy.token, busy.holder) == (live.token, live.holder)
            self._check_coordinator()
            return multiple()
        assert live is None, f"{holder} acquired {scope.name} while token {live.token} holds it"
        assert lease.token > scope.issued, f"token {lease.token} after {scope.issued}: no new epoch"
        assert (lease.scope, lease.holder, lease.lost) == (scope.name, holder, False)
        scope.issued = lease.token
        scope.live = lease
        self.latest[holder, index] = lease
        self._check_coordinator()
        return lease

    @live_scope
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        self._expire(self._live_lease(data))

    @live_scope
    @rule(target=leases, data=st.data(), holder=st.sampled_from(HOLDERS), delta=DELTAS)
    def take_over(self, data: st.DataObject, holder: str, delta: int) -> Lease:
        """The common way an epoch ends: its ttl runs out, and a worker waiting for the scope gets
        it and writes at once, so the old holder's next write is already stale."""
        live = self._live_lease(data)
        self._expire(live)
        lease = self.acquire(holder, self.scopes.index(self.by_name[live.scope]))
        assert isinstance(lease, Lease)
        self._write(lease, delta)
        return lease

    # The live holder renewing or releasing is kept apart from a holder acting on a lease that
    # may have ended: that is the only way a lease learns of its loss before writing, and if it
    # happened on every renewal few ended leases would be left unaware to attempt a late write.
    @live_scope
    @rule(data=st.data())
    def renew(self, data: st.DataObject) -> None:
        self._renew(self._live_lease(data))

    @live_scope
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        self._release(self._live_lease(data))

    @has_held
    @rule(data=st.data(), action=st.sampled_from(["renew", "release"]))
    def renew_or_release_own(self, data: st.DataObject, action: str) -> None:
        lease = self._holders_lease(data)
        if action == "renew":
            self._renew(lease)
        else:
            self._release(lease)

    @live_scope
    @rule(data=st.data(), delta=DELTAS)
    def write_current(self, data: st.DataObject, delta: int) -> None:
        self._write(self._live_lease(data), delta)

    @has_held
    @rule(data=st.data(), delta=DELTAS)
    def write_own(self, data: st.DataObject, delta: int) -> None:
        self._write(self._holders_lease(data), delta)

    @rule(lease=leases, delta=DELTAS)
    def write_delayed(self, lease: Lease, delta: int) -> None:
        other = next(scope for scope in self.scopes if scope.name != lease.scope)
        try:
            self.resource.write(lease, other.name, delta)
        except ScopeMismatch:
            pass  # the other scope's row and log are compared with the model after the write
        else:
            raise FencingViolation(f"a lease of {lease.scope} wrote on {other.name}")
        self._write(lease, delta)

    # A lease operation can only change the coordinator and a write only the resource: each step
    # checks its own side, for both scopes, which halves the round trips of checking everything.

    def _check_resource(self) -> None:
        for scope in self.scopes:
            log = self.resource.log(scope.name)
            for (token, lease_id, _), (later, later_id, _) in pairwise(log):
                if later < token or (later == token and later_id != lease_id):
                    raise FencingViolation(f"{scope.name} accepted token {later} after {token}")
            assert log == scope.log, f"{scope.name}: accepted {log}, expected {scope.log}"
            assert self.resource.row(scope.name) == scope.row()

    def _check_coordinator(self) -> None:
        for scope in self.scopes:
            info = self.manager.current(scope.name)
            seen = None if info is None else (info.token, info.holder)
            expected = None if scope.live is None else (scope.live.token, scope.live.holder)
            assert seen == expected, f"{scope.name}: coordinator has {seen}, model {expected}"

    def _live_lease(self, data: st.DataObject) -> Lease:
        live = [scope.live for scope in self.scopes if scope.live is not None]
        return data.draw(st.sampled_from(live), label="live lease")

    def _holders_lease(self, data: st.DataObject) -> Lease:
        holding = data.draw(st.sampled_from(sorted(self.latest)), label="holder, scope")
        return self.latest[holding]

    def _is_live(self, lease: Lease) -> bool:
        live = self.by_name[lease.scope].live
        return live is not None and live.lease_id == lease.lease_id

    def _check_sticky(self, lease: Lease) -> None:
        assert lease.lost == (lease.lease_id in self.lost), f"token {lease.token}: sticky flag off"

    def _expire(self, live: Lease) -> None:
        # break_lease ends the epoch at the coordinator like a ttl running out and tells the holder
        # nothing: its Lease still looks valid to it, as to a worker paused past its ttl.
        scope = self.by_name[live.scope]
        info = self.manager.break_lease(scope.name, reason="property test: simulated expiry")
        assert info is not None, f"token {live.token} was live but nothing was broken"
        assert (info.token, info.holder) == (live.token, live.holder)
        scope.live = None
        assert self.manager.break_lease(scope.name, reason="property test: again") is None
        self._check_coordinator()

    def _renew(self, lease: Lease) -> None:
        held = self._is_live(lease)
        token = lease.token
        try:
            renewed = self.manager.renew(lease)
        except LeaseLost:
            assert not held, f"renewal of the live lease (token {token}) was refused"
            self.lost.add(lease.lease_id)
        else:
            assert held, f"renewed token {token}, which the coordinator no longer holds"
            assert (renewed.token, renewed.lease_id) == (token, lease.lease_id), "renewal moved"
        assert lease.token == token
        self._check_sticky(lease)
        self._check_coordinator()

    def _release(self, lease: Lease) -> None:
        held = self._is_live(lease)
        try:
            self.manager.release(lease)
        except LeaseLost:
            assert not held, f"release of the live lease (token {lease.token}) was refused"
            self.lost.add(lease.lease_id)
        else:
            assert held, f"released token {lease.token}, which the coordinator no longer holds"
            self.by_name[lease.scope].live = None
            self.lost.add(lease.lease_id)  # released leases refuse further writes locally
        self._check_sticky(lease)
        self._check_coordinator()

    def _write(self, lease: Lease, delta: int) -> None:
        scope = self.by_name[lease.scope]
        stale = scope.is_stale(lease)
        known_lost = lease.lease_id in self.lost
        what = f"token {lease.token} of {lease.holder} (accepted: {scope.accepted})"
        try:
            result = self.resource.write(lease, scope.name, delta)
        except StaleToken as exc:
            if known_lost:
                raise FencingViolation(f"{what}: lost lease went to the database: {exc}") from exc
            assert stale, f"{what}: current epoch refused as stale: {exc}"
            assert scope.accepted is not None
            assert (exc.presented, exc.highest) == (lease.token, scope.accepted[0])
            self.lost.add(lease.lease_id)
        except LeaseLost as exc:
            assert known_lost, f"{what}: LeaseLost from a lease never seen lost: {exc}"
        else:
            if known_lost:
                raise FencingViolation(f"{what}: lost lease wrote again ({result.outcome})")
            if stale:
                raise FencingViolation(f"{what}: stale epoch not refused ({result.outcome})")
            fits = scope.quantity + delta >= 0
            expected = FenceOutcome.APPLIED if fits else FenceOutcome.CONDITION_FAILED
            assert result.outcome is expected, f"{what}: {result.outcome}, expected {expected}"
            if result.applied:
                scope.accepted = (lease.token, lease.lease_id)
                scope.quantity += delta
                scope.log.append((lease.token, lease.lease_id, delta))
        self._check_sticky(lease)
        self._check_resource()


def bind(manager: LeaseManager, resource: Resource) -> type[FencingMachine]:
    """The machine class Hypothesis instantiates, closed over this test's manager and resource."""

    class Bound(FencingMachine):
        def __init__(self) -> None:
            super().__init__(manager, resource)

    return Bound


def test_stale_epochs_never_write(lease_stack: Stack) -> None:
    with lease_stack.manager() as manager, closing(Resource(lease_stack.db_url)) as resource:
        run_state_machine_as_test(bind(manager, resource), settings=FENCED)


@pytest.mark.parametrize("lease_stack", ["sqlite"], indirect=True)
def test_bypassed_fence_lets_a_stale_epoch_write(lease_stack: Stack) -> None:
    # Lease-only protection: the same write without the token condition. A holder whose lease ended
    # without its knowledge writes late, on top of what the newer epoch wrote.
    unfenced = Resource(lease_stack.db_url, enforce=False)
    with (
        lease_stack.manager() as manager,
        closing(unfenced) as resource,
        pytest.raises(FencingViolation, match="stale epoch not refused"),
    ):
        run_state_machine_as_test(bind(manager, resource), settings=BYPASSED)
