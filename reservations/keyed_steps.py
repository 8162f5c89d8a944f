"""The writes under an idempotency key (a reservation, confirm, release, restock, replenish, count), each
written both ways: as the multi-statement plan in the ledger's envelope (the reference, and SQLite's path)
and as one statement (PostgreSQL, :attr:`Ledger.single_statement`). A :class:`Step` carries both;
:func:`alone` runs it as an operation, :func:`request` as a queued request run to its final outcome.

A lease already known lost, or one of another scope than the write's, is refused before any write; which
refusal, and whether the key's record or the request's outcome answers first, the multi-statement plan
decides, so those rare steps take it on every database.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import sqlalchemy as sa

from fencing import Fence, LeaseLost, StaleToken
from fencing.plan import Atomic, Plan
from reservations import keyed_statement as keyed
from reservations.collisions import KeptColliding, rounds
from reservations.errors import InsufficientStock, KeyTaken
from reservations.ledger import Ledger, one, reservation_conflict
from reservations.request_outcomes import (
    RequestReply,
    RequestResult,
    record_attempt,
    record_outcome,
    request_outcome,
)
from reservations.reserve_statement import Applied, Ended, Replay, Reply, Short, Speaker
from reservations.statuses import AttemptResult, RequestStatus
from reservations.values import Outcome


@dataclass(slots=True)  # not frozen: one is made per write, on the hot path
class Step:
    """One checked write under its key, both ways it can be sent. ``scope``: the lease scope the write
    needs, or None when the statement judges it (a reservation's SKU is read by the statement)."""

    written: keyed.Written
    scope: str | None
    several: Callable[[], Plan[Outcome]]  # the multi-statement plan
    send: Callable[[Fence, Speaker | None], Plan[Reply]]  # the one statement, sent and its row read
    rejection: Callable[[StaleToken], sa.Executable]  # the history row of a stale token refused

    def in_one(self, ledger: Ledger) -> bool:
        """Whether this step goes as one statement on ``ledger``'s database."""
        lease = self.written.lease
        return ledger.single_statement and not lease.lost and self.scope in (None, lease.scope)


def _sent(ledger: Ledger, step: Step, speaker: Speaker | None) -> Plan[Reply | None]:
    """The step's statement, or None when it takes the multi-statement plan (see :meth:`Step.in_one`)."""
    if not step.in_one(ledger):
        return None
    written = step.written
    try:
        ledger.fence.prepare(written.lease, step.scope or written.lease.scope)
    except LeaseLost:
        return None  # lost since it was looked at (a failed renewal): as for any lost lease
    clashed = False

    def clash(taken: KeyTaken) -> None:
        # The statement reads the key on its starting snapshot, so a copy of the request (or another
        # request under the key) committed while it waited on the row lock shows up here, as whichever of
        # the key's rows the database inserted first: look again. Only a reservation that still clashes
        # when the key has neither record nor outcome is one whose record was purged.
        nonlocal clashed
        if taken.where == "reservation":
            if clashed:
                raise reservation_conflict(written.key, written.operation) from None
            clashed = True

    try:
        for round_ in rounds(on_taken=clash):
            with round_:
                return (yield from step.send(ledger.fence, speaker))
    except StaleToken as stale:
        yield Atomic(one(step.rejection(stale)))
        raise
    raise KeptColliding(f"the {written.operation} under {written.key!r}")


def alone(ledger: Ledger, step: Step) -> Plan[Outcome]:
    """The step as an operation: its outcome, applied now or replayed from the key's record."""
    written = step.written
    reply = yield from _sent(ledger, step, None)
    match reply:
        case None:
            return (yield from step.several())
        case Applied(outcome):
            return outcome
        case Short(refused):
            raise refused
        case Replay(prior):
            return ledger.replay(prior, written.operation, written.fingerprint)
        case Ended():  # pragma: no cover - only a statement with a speaker ends
            raise RuntimeError(f"the {written.operation} statement answered an ended request")


def request(ledger: Ledger, step: Step, speaker: Speaker) -> Plan[RequestReply]:
    """The step as a queued request run to its final outcome: the write, its attempt and its outcome row
    (one statement on PostgreSQL; elsewhere, or to replay a key whose outcome was never written, the same
    steps one after another). A request that already ended is answered from its outcome. Raises what the
    step raises as an operation, but never :class:`InsufficientStock`: that is an outcome."""
    written = step.written
    replayed: Outcome | InsufficientStock
    reply = yield from _sent(ledger, step, speaker)
    match reply:
        case None:
            done: RequestResult | None = yield Atomic(request_outcome(written.key))
            if done is not None:
                return RequestReply(done, None)
            try:
                replayed = yield from step.several()
            except InsufficientStock as short:
                replayed = short
        case Ended(ended):
            return RequestReply(ended, None)
        case Applied(outcome, told) if told is not None:
            return RequestReply(told, outcome)
        case Short(_, told) if told is not None:
            return RequestReply(told, None)
        case Replay(prior):
            try:
                replayed = ledger.replay(prior, written.operation, written.fingerprint)
            except InsufficientStock as short:  # a key whose first request was refused
                replayed = short
        case _:  # pragma: no cover - a statement with a speaker tells what it did
            raise RuntimeError(f"the {written.operation} statement told nothing for {written.key!r}")
    return (yield from recorded(written.key, written.operation, written.fingerprint, written.status,
                                speaker, replayed))  # fmt: skip


def recorded(
    key: str,
    operation: str,
    print_: str,
    status: str,
    speaker: Speaker,
    replayed: Outcome | InsufficientStock,
) -> Plan[RequestReply]:
    """A request's attempt and final outcome written after its write (or its refusal for lack of units),
    each in a transaction of its own: what the one statement writes with the change."""
    who = {"task_id": speaker.task_id, "worker": speaker.worker}
    if isinstance(replayed, InsufficientStock):
        stored = yield from record_outcome(
            key, operation, RequestStatus.INSUFFICIENT_STOCK, replayed.summary(),
            epochs=speaker.epochs, fingerprint=print_, **who,
        )  # fmt: skip
        return RequestReply(stored, None)
    result = AttemptResult.REPLAYED if replayed.replayed else AttemptResult.APPLIED
    yield from record_attempt(key, operation, result, token=replayed.token, **who)
    stored = yield from record_outcome(
        key, operation, status, replayed.summary(), epochs=speaker.epochs, fingerprint=print_, **who
    )
    return RequestReply(stored, replayed)
