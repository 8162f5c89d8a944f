"""One attempt at a checked request message, as one object whose methods are its steps
(:meth:`Attempt.carry_out`) and its ways out, where the table of :mod:`tasks.policy` says: a final
outcome, written once by idempotency key with the request's fingerprint, a retry under one of the
counters that travel with the message, or the holder of a busy lease (tasks.hot_sku).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext, suppress
from functools import partial
from typing import Any

from celery import Task

from fencing import BackendUnavailable, Lease, LeaseBusy, LostOwnership
from reservations import InsufficientStock, InvalidTransition, Outcome
from reservations.counting import counted_units, short_count
from reservations.redrives import carried_request
from reservations.request_outcomes import AlreadyApplied, RequestReply, RequestResult
from reservations.statuses import SUCCEEDED, AttemptResult, RequestStatus
from tasks import failpoints, messages, metrics, policy
from tasks.answers import Redriven, announce_lost, answer
from tasks.failpoints import failpoint
from tasks.hot_sku import Server, beside_local_server, serve_quietly, wait_for_holder
from tasks.messages import DEADLINE, Message
from tasks.worker import Resources, worker_identity

log = logging.getLogger("tasks")

# The write a request makes under its leases, bound to its arguments: the request run to its outcome
# (every type but an order: one statement on PostgreSQL with its attempt and outcome, answering a request
# that already ended), or an order's operation, whose attempt and outcome the task then records.
Write = Callable[[], RequestReply | Outcome]


class Attempt:
    """The task, its checked message, this process's clients and, once taken, the request's leases.

    ``sent``: the message's keyword arguments as sent, which a retry sends again with one counter
    raised; ``who``: the task id and worker every record of the attempt names.
    """

    def __init__(self, task: Task, res: Resources, message: Message, sent: dict[str, Any]) -> None:
        self.task = task
        self.res = res
        self.message = message
        self.sent = sent
        self.who: dict[str, Any] = {"task_id": task.request.id, "worker": worker_identity()}
        self.epoch = message.counts["epoch"]
        self.limits = policy.Limits.of(res.settings)
        # Only a single-SKU reservation can wait for its lease's holder, and only with batching on.
        self.can_wait = message.name == "reserve" and res.settings.batching
        self.leases: dict[str, Lease] = {}
        self.lease_token: int | None = None
        # The SKU whose lease a confirm or release takes without reading its reservation first, when the
        # message names it (tasks.messages.sku_hint); ``sku_known``: the reservation named it (a read, or
        # a write's refusal), where a hint is its sender's word.
        self.sku_hint: str | None = None
        self.sku_known = False
        if message.name in ("confirm", "release"):
            self.sku_hint = messages.sku_hint(getattr(task.request, messages.SKU_HINT, None), key=message.key)

    def carry_out(self) -> dict[str, Any]:
        """The request's final outcome, or "queued" for its SKU's lease holder; raises Celery's Retry.

        Past its transient budget it gives up; past its deadline it ends expired, unattempted (a
        reservation queued for its SKU's lease holder is later served without this check). Otherwise it
        takes the leases and writes, and each error of that leads where tasks.policy says. A reservation
        whose SKU a thread of this process serves is handed to it instead (tasks.hot_sku)."""
        if self.message.counts["transient"] > self.limits.transient:
            return self.give_up({"reason": "backend unavailable", "error": "the backend stayed unreachable"})
        expired = self.past_deadline()
        if expired is not None:
            return expired
        res, message = self.res, self.message
        try:
            if self.can_wait:
                handed = beside_local_server(self.task, res, message, self.who)
                if handed is not None:
                    return handed
            if message.name == "reserve_order":  # the others' writes, run as requests, answer an ended one
                done = res.inventory.request_outcome(message.key)
                if done is not None:
                    return answer(self.task, message, done)
            with (
                res.inventory.hold_many(
                    res.leases,
                    self.skus(),
                    ttl=res.settings.lease_ttl,
                    holder=f"{self.who['worker']}:{self.who['task_id']}",
                    renew_every=failpoints.renew_every(res.settings.lease_renew_every),
                ) as leases,
                self.server() as server,
            ):
                self.leases = leases
                self.lease_token = max((lease.token for lease in leases.values()), default=None)
                metrics.current.lease("acquired", len(leases))
                # The write is decided under the leases (a count or a replenishment reads first), so a
                # worker paused at the failpoint writes a figure decided before its pause. A backend that
                # stops answering once the leases are lost is the lease's loss, not an outage.
                try:
                    decided = self.decide(leases)
                    failpoint("before_write")
                    written = decided()
                except BackendUnavailable as exc:
                    lost = policy.lost_with_the_lease(leases, exc)
                    if lost is None:
                        raise
                    raise lost from exc
                failpoint("after_write")
                if server is not None:  # requests of this process that found the lease held meanwhile
                    server.drain_joined(*leases.values())
        except (InvalidTransition, LeaseBusy) as exc:
            if self.hint_was_wrong(exc):
                return self.carry_out()
            return self.after(exc)
        except (InsufficientStock, LostOwnership, *policy.INVALID) as exc:
            return self.after(exc)
        return self.served(self.succeeded(written))

    def past_deadline(self) -> dict[str, Any] | None:
        """End a request taken up after its deadline ``expired``, taking no lease and touching no stock;
        the answer is the key's stored outcome (a copy may have decided it first). None: carry it out."""
        message, inventory = self.message, self.res.inventory
        late = messages.late(getattr(self.task.request, DEADLINE, None), key=message.key)
        if late is None:
            return None
        try:
            stored = self.record(RequestStatus.EXPIRED, late.detail(sum(message.counts.values())))
        except AlreadyApplied:  # a copy applied it and stopped before its outcome: the attempt replays it
            return None
        if stored.status == RequestStatus.EXPIRED and stored.belongs_to(
            message.operation, message.fingerprint
        ):
            inventory.record_attempt(
                message.key, message.operation, AttemptResult.EXPIRED, detail=late.describe(), **self.who
            )
        return answer(self.task, message, stored)

    def after(self, error: Exception) -> dict[str, Any]:
        """What an error of the attempt leads to, as :func:`tasks.policy.decide` says, with the I/O it
        needs: a busy lease's outcome looked for, a lost lease's attempt recorded, an outage's retry
        recorded where the database still answers, a dead letter logged."""
        message, facts = self.message, {}
        if isinstance(error, LeaseBusy):
            metrics.current.lease("busy")
            facts = {"scope": error.scope, "token": error.token, "holder": error.holder}
            if not self.can_wait and message.name != "reserve_order":
                # It did not look before taking the lease: a copy may have ended it.
                done = self.res.inventory.request_outcome(message.key)
                if done is not None:
                    return answer(self.task, message, done)
        redriven = self.lost(error) if isinstance(error, LostOwnership) else None
        if redriven is not None:
            facts = {k: redriven.fields[k] for k in ("scope", "token", "highest", "holder", "lease_id")}
        decision = policy.decide(error, message.counts, self.limits, can_wait=self.can_wait)
        if isinstance(decision, policy.HandOff):
            return wait_for_holder(self.task, self.res, message, self.who)
        if isinstance(decision, policy.Again):
            if redriven is not None:
                announce_lost(self.task, redriven)
            if isinstance(error, BackendUnavailable):
                metrics.current.transient(error.backend)
                # Nothing is final until it is recorded. The attempt is recorded where the database still
                # answers (a lease Redis that is down), so `reservations show KEY` counts an outage's retries.
                if error.backend != "database":
                    with suppress(BackendUnavailable):
                        self.res.inventory.record_attempt(
                            message.key, message.operation, AttemptResult.TRANSIENT,
                            detail=policy.printable(error), **self.who,
                        )  # fmt: skip
            raise self.again(decision.counter, decision.delay, redriven) from None
        if decision.status != RequestStatus.DEAD_LETTERED:
            ended = self.final(decision.status, decision.detail)
            # Stock found short under the leases: what queued up for them meanwhile is served still.
            return self.served(ended) if isinstance(error, InsufficientStock) else ended
        if not isinstance(error, BackendUnavailable):
            return self.give_up(decision.detail, **facts)
        transient = message.counts["transient"]
        log.error("giving up on %s after %d transient failures: %s", message.key, transient, error)
        try:
            return self.give_up(decision.detail)
        except BackendUnavailable:
            # Not even the dead letter can be written: keep coming back at the slowest pace until it can,
            # so the request still ends with an outcome once the database answers.
            self.sent["transient"] = self.limits.transient + 1
            raise self.task.retry(kwargs=self.sent, countdown=policy.rng.uniform(15.0, 30.0)) from None

    def skus(self) -> list[str]:
        args = self.message.args
        if self.message.name == "reserve_order":
            return [sku for sku, _ in args["lines"]]
        if self.message.name in ("confirm", "release"):
            sku = self.sku_hint
            if sku is None:
                sku = self.res.inventory.reservation(args["reservation_id"]).sku
                self.found(sku)
            return [sku]
        return [args["sku"]]

    def hint_was_wrong(self, error: InvalidTransition | LeaseBusy) -> bool:
        """Whether a confirm's or release's SKU hint named another SKU than its reservation's, which the
        attempt now takes the lease of. Nothing was written under the hint's lease, which is released. A
        write refused under it names the reservation's SKU. A lease of it found held has the SKU read, as
        without a hint: a retry would come back to that lease until the busy budget ran out."""
        if self.sku_hint is None or self.sku_known:
            return False
        if isinstance(error, InvalidTransition):
            if error.belongs_to is None or error.belongs_to == self.sku_hint:
                return False
            self.found(error.belongs_to)
            return True
        hinted, self.sku_hint = self.sku_hint, None
        try:
            (sku,) = self.skus()
        except policy.INVALID:  # carried out again without a hint, it meets this where it is answered
            return True
        return sku != hinted

    def found(self, sku: str) -> None:
        """The SKU of a confirm's or release's reservation, as the reservation named it. A retry of the
        message carries it (tasks.producer keeps the request's hint), so that it needs no read."""
        self.sku_hint, self.sku_known = sku, True
        setattr(self.task.request, messages.SKU_HINT, sku)

    def decide(self, leases: dict[str, Lease]) -> Write:
        """The write to make under ``leases``, read for and decided now: a count or a replenishment reads
        its SKU's stock and decides its write from the read."""
        inv, name, args, key = self.res.inventory, self.message.name, self.message.args, self.message.key
        if name == "reserve_order":
            return partial(inv.reserve_many, leases, args["lines"], key=key, hold_for=args["hold_for"])
        asked: dict[str, Any] = {"key": key, "epochs": self.epoch, **self.who}
        if name in ("confirm", "release"):
            (lease,) = leases.values()
            finish = inv.confirm_request if name == "confirm" else inv.release_request
            return partial(finish, lease, args["reservation_id"], **asked)
        sku = args["sku"]
        lease = leases[sku]
        if name == "reserve":
            return partial(
                inv.reserve_request, lease, sku, args["quantity"], hold_for=args["hold_for"], **asked
            )
        if name == "restock":
            return partial(inv.restock_request, lease, sku, args["quantity"], **asked)
        seen = inv.look(lease, sku)
        if name == "replenish":
            return partial(inv.replenish_request, lease, sku, args["par"], seen=seen, **asked)
        # A count sets on hand to the figure sent, or to the figure read now less the shrinkage sent.
        shrinkage = args["shrinkage"]
        figure = counted_units(args["counted"]) if shrinkage is None else short_count(seen, shrinkage)
        return partial(inv.count_request, lease, sku, figure, seen=seen, shrinkage=shrinkage, **asked)

    def server(self) -> AbstractContextManager[Server | None]:
        """For a reservation that may wait for its lease's holder: this thread serving its SKU while it
        holds the lease, so that requests of this process join it in memory (tasks.hot_sku.Server)."""
        if not self.can_wait:
            return nullcontext()
        return Server(self.res, self.message.args["sku"], self.who["task_id"], self.who["worker"])

    def succeeded(self, done: RequestReply | Outcome) -> dict[str, Any]:
        """The answer to a write made: the reservation statement stored its outcome itself; any other write
        has its attempt and outcome recorded now."""
        if isinstance(done, RequestReply):
            return answer(self.task, self.message, done.result)
        message = self.message
        applied = AttemptResult.REPLAYED if done.replayed else AttemptResult.APPLIED
        self.res.inventory.record_attempt(
            message.key, message.operation, applied, token=done.token, **self.who
        )
        return self.final(SUCCEEDED[message.operation], done.summary())

    def served(self, result: dict[str, Any]) -> dict[str, Any]:
        """``result``, after serving whatever queued up for the lease meanwhile. A release that reports
        nobody turned away (``contended`` False) means nobody queued behind it (a request queues only after
        finding the lease busy, then tries it once more): the look, a round trip per task, is skipped."""
        leases = self.leases.values()
        if self.can_wait and (not leases or any(lease.contended is not False for lease in leases)):
            serve_quietly(self.res, self.message.args["sku"], **self.who)
        return result

    def lost(self, lost: LostOwnership) -> Redriven:
        """Terminal for this attempt and its lease: nothing more happens under it. The request itself goes
        back to coordination (a new task run takes a new lease, and the idempotency key keeps an effect
        that already landed from being applied twice), unless its epochs are spent."""
        message, epoch = self.message, self.epoch
        fields = metrics.lost_ownership(lost, self.lease_token, message, **self.who)
        self.res.inventory.record_attempt(
            message.key, message.operation, AttemptResult.LOST_OWNERSHIP,
            token=lost.token or self.lease_token, detail=policy.printable(lost), **self.who,
        )  # fmt: skip
        return Redriven(f"{policy.printable(lost)}; driven again in epoch {epoch + 1}", fields)

    def record(self, status: str, detail: dict[str, Any]) -> RequestResult:
        """Record the request's final outcome (once per key); returns the outcome stored under its key."""
        message = self.message
        return self.res.inventory.record_outcome(
            message.key, message.operation, status, detail,
            epochs=self.epoch, fingerprint=message.fingerprint, **self.who,
        )  # fmt: skip

    def final(self, status: str, detail: dict[str, Any]) -> dict[str, Any]:
        """Record the request's final outcome; the answer is the outcome stored under its key."""
        return answer(self.task, self.message, self.record(status, detail))

    def again(self, counter: str, countdown: float, reason: Exception | None = None) -> Exception:
        """The retry of this message with ``counter`` raised by one, to be raised."""
        kwargs = {**self.sent, counter: self.message.counts[counter] + 1}
        return self.task.retry(kwargs=kwargs, countdown=countdown, exc=reason)  # type: ignore[no-any-return]

    def give_up(self, detail: dict[str, Any], **facts: Any) -> dict[str, Any]:
        """Dead-letter a request that cannot be carried out now, logged with ``facts`` (the lease's)."""
        error = f": {detail['error'][:200]}" if "error" in detail else ""
        metrics.dead_lettered(self.message, detail["reason"] + error, self.who, **facts)
        return self.final(RequestStatus.DEAD_LETTERED, self.dead_letter(detail))

    def failed(self, exc: Exception) -> None:
        """A bug or an unforeseen input: the request still ends, dead-lettered, or its caller waits
        forever. Best effort: the error itself is what the task raises."""
        with suppress(Exception):
            dead = self.dead_letter({"reason": "unexpected error", "error": repr(exc)[:500]})
            self.record(RequestStatus.DEAD_LETTERED, dead)

    def dead_letter(self, detail: dict[str, Any]) -> dict[str, Any]:
        """A dead letter's detail: why, and the request it carried (its type and checked arguments), so an
        operator can drive it again once the cause is gone (reservations.redrives)."""
        return {**detail, "request": carried_request(self.message.name, self.message.args)}
