"""What the front door decides without I/O: the caller's key space and the key its header names, how long
to wait (RFC 7240 ``Prefer``), the request's deadline, the answer of each final outcome and the problem
documents (service.answers), each caller's requests in flight (service.routes), and the queue's
backpressure (service.backlog) on a clock of our own.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import kombu
import pytest
from kombu.exceptions import ChannelError

from reservations import validation as valid
from reservations.redrives import is_redrive_key, redrive_key
from reservations.request_outcomes import Redriven, RequestResult
from reservations.statuses import RequestStatus
from reservations.validation import MAX_KEY_CHARS
from service.answers import (
    ANONYMOUS,
    CALLER_NAME,
    MAX_DEADLINE,
    PROBLEM_MEDIA_TYPE,
    TYPES,
    Problem,
    answer_of,
    caller_key,
    caller_space,
    deadline_of,
    new_key,
    outcome_body,
    pending,
    problem,
    scoped_key,
    unfit_name,
    wait_of,
)
from service.backlog import DEFAULT_RETRY_AFTER, MAX_RETRY_AFTER, Backlog, retry_after
from service.routes import RESPONSES, InFlight
from testing.stores import REDIS_URL

NOW = 1_800_000_000.0
AT = 1_800_000_000.25  # 2027-01-15T08:00:00.250Z


def refused(call: Callable[[], object], name: str) -> Problem:
    """The problem ``call`` raises, checked to be of type ``name``."""
    with pytest.raises(Problem) as raised:
        call()
    assert raised.value.type is TYPES[name], raised.value
    return raised.value


# -- the caller and the key -----------------------------------------------------------------------------


def test_a_named_caller_s_space_is_its_name_and_an_anonymous_caller_s_is_its_own() -> None:
    assert caller_space("shop.eu_1-a") == "shop.eu_1-a"
    assert caller_space("s" * 64) == "s" * 64
    assert caller_space(None) == ANONYMOUS == "*"


@pytest.mark.parametrize("name", ["", "alice@example.com", "has:colon", "has space", "ünï", "x" * 65, "*", 7])
def test_a_caller_named_outside_the_rule_is_refused_403(name: object) -> None:
    """Whatever the deployment's dependency returns that is not a name of the rule (nor None) is the
    caller's problem document, not a server error; ``*`` above all, which would be the anonymous space."""
    found = refused(lambda: caller_space(name), "invalid-caller")
    assert found.type.status == 403
    assert "[A-Za-z0-9._-]{1,64}" in found.detail
    assert str(name) not in found.detail or name == ""  # the name stays with the deployment


def test_the_problem_types_say_the_rules_the_door_keeps() -> None:
    assert CALLER_NAME.pattern in TYPES["invalid-caller"].about
    assert f"{MAX_KEY_CHARS} less" in TYPES["idempotency-key-missing"].about
    assert (
        f"({MAX_KEY_CHARS - len(ANONYMOUS) - 1} for an anonymous caller)"
        in TYPES["idempotency-key-missing"].about
    )


def test_a_refused_name_is_described_for_the_log_without_itself() -> None:
    assert unfit_name("alice@example.com") == "a name of 17 characters, with '@' outside the rule"
    assert unfit_name("b: c") == "a name of 4 characters, with ' :' outside the rule"
    assert unfit_name("x" * 65) == "a name of 65 characters"
    assert unfit_name(7) == "a int"


def test_the_space_comes_first_and_is_taken_off_again() -> None:
    stored = scoped_key("shop.eu_1-a", "order-1")
    assert stored == "shop.eu_1-a:order-1"
    assert caller_key("shop.eu_1-a", stored) == "order-1"
    assert scoped_key(ANONYMOUS, "order-1") == "*:order-1"
    assert caller_key(ANONYMOUS, "*:order-1") == "order-1"
    # Two callers' keys never meet; a name holds no colon, so a key may.
    assert scoped_key("a", "k") != scoped_key("b", "k")
    assert caller_key("a", scoped_key("a", "b:c")) == "b:c"


@pytest.mark.parametrize("key", ["alice:order-1", "*:order-1", "order-1", "a:b:c", ":", "*"])
def test_no_anonymous_key_is_a_named_caller_s_or_a_raw_one(key: str) -> None:
    """An anonymous caller that sends ``alice:K`` names its own ``*:alice:K``, never alice's ``alice:K``
    nor a key stored as sent (the library client's, the command line's)."""
    stored = scoped_key(ANONYMOUS, key)
    assert stored.startswith("*:") and stored != key
    assert stored.split(":", 1)[0] == ANONYMOUS  # not a name of the rule: no named caller's key
    assert scoped_key("alice", key) != stored


@pytest.mark.parametrize("space", ["", "has:colon", "x" * 65, "**"])
def test_a_space_that_is_neither_a_name_nor_anonymous_is_a_programming_error(space: str) -> None:
    with pytest.raises(ValueError, match="caller's space"):
        scoped_key(space, "order-1")


@pytest.mark.parametrize("key", [None, ""])
def test_a_missing_key_is_its_own_problem(key: str | None) -> None:
    found = refused(lambda: scoped_key(ANONYMOUS, key), "idempotency-key-missing")
    assert found.type.status == 400
    refused(lambda: scoped_key("shop", key), "idempotency-key-missing")


@pytest.mark.parametrize("space", [ANONYMOUS, "s", "s" * 64])
def test_the_key_and_its_space_fit_the_stored_key_s_length_together(space: str) -> None:
    room = MAX_KEY_CHARS - len(space) - 1
    longest = "k" * room
    stored = scoped_key(space, longest)
    assert len(stored) <= MAX_KEY_CHARS and valid.idempotency_key(stored) == stored
    assert caller_key(space, stored) == longest
    found = refused(lambda: scoped_key(space, longest + "k"), "invalid-request")
    assert found.extra == {"field": "Idempotency-Key"}
    assert f"1-{room} printable ASCII" in found.detail


@pytest.mark.parametrize("key", ["has space", "tab\there", "ünicode", "new\nline", "\x7f"])
def test_a_key_of_other_characters_is_invalid(key: str) -> None:
    refused(lambda: scoped_key(ANONYMOUS, key), "invalid-request")


@pytest.mark.parametrize("space", [ANONYMOUS, "alice"])
@pytest.mark.parametrize("key", ["k~redrive-1", "k~redrive-12", "~redrive-0", "a:b~redrive-3"])
def test_a_new_request_cannot_take_a_re_drive_s_name(space: str, key: str) -> None:
    found = refused(lambda: new_key(space, key), "invalid-request")
    assert found.extra == {"field": "Idempotency-Key"} and "~redrive-<n>" in found.detail
    assert scoped_key(space, key) == f"{space}:{key}"  # read, it names the re-drive as ever


@pytest.mark.parametrize("key", ["k~redrive-", "k~redrive-1x", "k~redrive", "k-redrive-1", "redrive-1", "k"])
def test_other_keys_are_new_requests_names(key: str) -> None:
    assert new_key("alice", key) == f"alice:{key}"


def test_the_re_drive_rule_is_what_re_drive_keys_are_made_of() -> None:
    long_key = "a" * MAX_KEY_CHARS
    made = [redrive_key("k", 1), redrive_key("k", 1000), redrive_key("*:k", 2), redrive_key(long_key, 7)]
    assert all(is_redrive_key(k) for k in made), made
    others = ("k", "k~redrive-", "k~redrive-x", "k~redrive-1 ", "k~REDRIVE-1", "k~redrive-1~x")
    assert not any(is_redrive_key(k) for k in others)


# -- the wait (RFC 7240) ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefer", "expected"),
    [
        (None, 5.0),
        ("", 5.0),
        ("wait=10", 10.0),
        ("wait=0", 0.0),
        ("WAIT=4", 4.0),
        ("wait = 7", 7.0),
        ('wait="3"', 3.0),
        ("wait=100", 30.0),  # within the deployment's longest
        ("wait=99999999999999999999999", 30.0),
        ("respond-async", 0.0),
        ("Respond-Async", 0.0),
        ("respond-async, wait=8", 8.0),  # both: wait as long as asked, then 202
        ("wait=8, respond-async", 8.0),
        ("return=minimal; foo=bar, wait=3", 3.0),
        ("handling=lenient, wait=2", 2.0),
        ("wait=9, wait=2", 9.0),  # a preference given twice counts the first time
        ("respond-async; wait=10", 0.0),  # a parameter of respond-async, not the wait preference
        ("handling=strict", 5.0),
        # What cannot be read is ignored: fractions, signs, words, non-ASCII digits.
        ("wait=1.5", 5.0),
        ("wait=-1", 5.0),
        ("wait=soon", 5.0),
        ("wait=", 5.0),
        ("wait=\u00b2", 5.0),
        ("wait=\u0663", 5.0),
        ("wait=\u00b2, respond-async", 0.0),
    ],
)
def test_the_wait_is_what_the_caller_prefers_within_the_longest(prefer: str | None, expected: float) -> None:
    assert wait_of(prefer, 5.0, 30.0) == expected


# -- the deadline ---------------------------------------------------------------------------------------


def test_without_a_header_the_deadline_is_the_deployment_s() -> None:
    assert deadline_of(None, 300.0, NOW) == NOW + 300
    assert deadline_of(None, 0.0, NOW) is None  # 0: none


@pytest.mark.parametrize(("header", "seconds"), [("5", 5.0), ("0.5", 0.5), (" 60 ", 60.0), ("1e3", 1000.0)])
def test_a_header_gives_seconds_from_now(header: str, seconds: float) -> None:
    assert deadline_of(header, 300.0, NOW) == NOW + seconds


def test_a_week_is_the_longest_deadline() -> None:
    assert deadline_of(str(MAX_DEADLINE), 0.0, NOW) == NOW + MAX_DEADLINE
    refused(lambda: deadline_of(str(MAX_DEADLINE + 1), 0.0, NOW), "invalid-request")


@pytest.mark.parametrize("header", ["0", "-1", "nan", "inf", "-inf", "soon", "", "5s", "\u00b2"])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_invalid(header: str) -> None:
    found = refused(lambda: deadline_of(header, 300.0, NOW), "invalid-request")
    assert found.extra == {"field": "Request-Deadline"}


# -- the answer of each outcome -----------------------------------------------------------------------------


def result(status: str, detail: dict[str, Any] | None = None, **more: Any) -> RequestResult:
    fields: dict[str, Any] = {
        "key": "k-1",
        "operation": "reserve",
        "status": status,
        "detail": detail or {},
        "task_id": "t-1",
        "worker": "w@host",
        "epochs": 1,
        "at": AT,
        **more,
    }
    return RequestResult(**fields)


RESERVED = result("reserved", {"reservation_ids": ["r_1"], "token": 7, "sku": "W", "quantity": 2})


def test_a_reservation_made_by_the_post_is_201_and_read_back_200() -> None:
    made = answer_of("mine", RESERVED, instance="/reservations/mine", created=True)
    assert (made.status, made.media_type, made.headers) == (201, "application/json", {})
    assert made.body == {
        "key": "mine",  # the caller's key, not the stored one
        "operation": "reserve",
        "status": "reserved",
        "reservation_id": "r_1",
        "token": 7,
        "at": "2027-01-15T08:00:00.250Z",
        "detail": RESERVED.detail,
    }
    read = answer_of("mine", RESERVED, instance="/reservations/mine", created=False)
    assert (read.status, read.body) == (200, made.body)


@pytest.mark.parametrize(
    "status", ["confirmed", "released", "counted", "restocked", "adjusted", "replenished"]
)
def test_every_other_success_is_200_even_where_a_post_made_it(status: str) -> None:
    for created in (True, False):
        found = answer_of("k", result(status, {"token": 3}), instance="/requests/k", created=created)
        assert (found.status, found.body["status"], found.body["token"]) == (200, status, 3)
        assert "reservation_id" not in found.body


def test_an_outcome_shows_every_reservation_of_an_order_and_its_redrive() -> None:
    redriven = Redriven(key="k-1~redrive-1", number=1, at=AT, by="ops", final=True)
    body = outcome_body("k-1", result("reserved", {"reservation_ids": ["r_1", "r_2"]}, redrive=redriven))
    assert (body["reservation_id"], body["reservation_ids"]) == ("r_1", ["r_1", "r_2"])
    assert body["redrive"] == {"key": "k-1~redrive-1", "number": 1}
    assert "token" not in body


def problem_body(status: str, detail: dict[str, Any], name: str, code: int) -> dict[str, Any]:
    found = answer_of("k-9", result(status, detail), instance="/reservations/k-9", created=True)
    assert (found.status, found.media_type) == (code, PROBLEM_MEDIA_TYPE)
    assert found.body["type"] == f"/problems/{name}" and found.body["status"] == code
    assert found.body["instance"] == "/reservations/k-9" and found.body["key"] == "k-9"
    assert found.headers == {}  # a stored outcome: retrying does not change it, so no Retry-After
    # The same outcome gives the same answer, on a POST or a GET.
    again = answer_of("k-9", result(status, detail), instance="/reservations/k-9", created=False)
    assert again == found
    return found.body


def test_not_enough_stock_is_409_with_what_was_asked_and_available() -> None:
    body = problem_body(
        "insufficient_stock", {"sku": "W", "requested": 5, "available": 2}, "insufficient-stock", 409
    )
    assert (body["sku"], body["requested"], body["available"]) == ("W", 5, 2)
    assert body["detail"] == "SKU 'W': requested 5, available 2"
    # An older outcome without the figures still reads.
    bare = problem_body("insufficient_stock", {}, "insufficient-stock", 409)
    assert bare["detail"] == "SKU None: requested None, available None"
    assert "sku" not in bare


def test_an_invalid_outcome_is_400_or_409_for_a_transition() -> None:
    unknown = problem_body(
        "invalid", {"error": "UnknownSku", "message": "no SKU 'X'"}, "invalid-request", 400
    )
    assert (unknown["error"], unknown["detail"]) == ("UnknownSku", "no SKU 'X'")
    unsaid = problem_body("invalid", {}, "invalid-request", 400)
    assert unsaid["detail"] == "the request can never succeed" and unsaid["error"] == ""
    transition = problem_body(
        "invalid", {"error": "InvalidTransition", "message": "already confirmed"}, "invalid-transition", 409
    )
    assert transition["detail"] == "already confirmed"


def test_a_dead_letter_is_a_stored_503_and_an_expiry_504() -> None:
    dead = problem_body("dead_lettered", {"reason": "lease busy"}, "dead-lettered", 503)
    assert dead["detail"] == "dead-lettered: lease busy"
    assert problem_body("dead_lettered", {}, "dead-lettered", 503)["detail"].endswith(
        "could not be carried out"
    )
    problem_body("expired", {"deadline": NOW, "late_by": 1.5}, "expired", 504)


def test_a_cancelled_request_is_a_stored_409_with_the_operators_reason() -> None:
    said = problem_body("cancelled", {"reason": "order withdrawn", "by": "ann"}, "cancelled", 409)
    assert said["detail"] == "cancelled: order withdrawn"
    assert problem_body("cancelled", {}, "cancelled", 409)["detail"] == "cancelled: by an operator"


def test_an_expiry_says_whether_the_request_was_ever_taken_up() -> None:
    never = problem_body("expired", {"deadline": NOW, "late_by": 1.5, "attempts": 0}, "expired", 504)
    assert never["detail"] == "the deadline passed before a worker took the request up"
    retried = problem_body("expired", {"deadline": NOW, "late_by": 1.5, "attempts": 12}, "expired", 504)
    assert retried["detail"].startswith("the deadline passed after 12 attempt(s) at the request")
    relayed = {"deadline": NOW, "late_by": 0.2, "reason": "no outcome by its deadline; published 3 time(s)"}
    assert "published 3 time(s)" in problem_body("expired", relayed, "expired", 504)["detail"]


def test_every_outcome_s_answer_is_declared_on_the_routes_that_read_it() -> None:
    """Each final status's answer, read back, is one GET /requests/{key} declares (so the OpenAPI
    document and the metrics' zero series hold it)."""
    declared = RESPONSES[("/requests/{key}", "GET")]
    for status in RequestStatus:
        detail = {"error": "InvalidTransition"} if status == RequestStatus.INVALID else {}
        found = answer_of("k", result(status, detail), instance="/requests/k", created=False)
        assert found.status in declared, status
    for ended in ("reserved", "insufficient_stock", "invalid", "dead_lettered", "expired", "cancelled"):
        made = answer_of("k", result(ended), instance="/reservations/k", created=True)
        assert made.status in RESPONSES[("/reservations", "POST")], ended


def test_pending_is_202_with_where_to_look_and_when() -> None:
    found = pending("k-2", "/reservations/k-2")
    assert (found.status, found.media_type) == (202, "application/json")
    assert found.body == {"key": "k-2", "status": "pending", "location": "/reservations/k-2"}
    assert found.headers == {"Location": "/reservations/k-2", "Retry-After": "1"}


# -- problem documents --------------------------------------------------------------------------------------


def test_each_problem_type_is_named_once_with_its_status() -> None:
    assert {name: t.status for name, t in TYPES.items()} == {
        "insufficient-stock": 409,
        "invalid-request": 400,
        "invalid-transition": 409,
        "idempotency-key-missing": 400,
        "idempotency-key-reused": 422,
        "not-found": 404,
        "method-not-allowed": 405,
        "unauthorized": 401,
        "forbidden": 403,
        "invalid-caller": 403,
        "not-reserved": 409,
        "too-many-requests": 429,
        "unavailable": 503,
        "overloaded": 503,
        "dead-lettered": 503,
        "expired": 504,
        "cancelled": 409,
    }
    assert all(
        t.name == name and t.uri == f"/problems/{name}" and t.title and t.about for name, t in TYPES.items()
    )
    # The answers a key's final outcome gives again (a success has no type); the others are of one try.
    finals = {
        answer_of("k", result(status, {"error": error}), instance="/k", created=False).body.get("type")
        for status in RequestStatus
        for error in ("", "InvalidTransition")
    }
    final_types = (
        "insufficient-stock", "invalid-request", "invalid-transition", "dead-lettered", "expired", "cancelled"
    )  # fmt: skip
    assert finals == {None} | {TYPES[name].uri for name in final_types}


def test_a_problem_document_carries_its_type_its_instance_and_its_own_members() -> None:
    found = problem("not-reserved", "not yet", headers={"Retry-After": "1"}, key="k-3")
    assert found.headers == {"Retry-After": "1"}
    assert found.document("/reservations/k-3/confirm") == {
        "type": "/problems/not-reserved",
        "title": "No reservation under this key",
        "status": 409,
        "detail": "not yet",
        "instance": "/reservations/k-3/confirm",
        "key": "k-3",
    }
    assert "instance" not in found.document(None)
    assert problem("expired", "late").headers == {}


def test_an_unknown_problem_name_is_a_programming_error() -> None:
    with pytest.raises(KeyError):
        problem("no-such-problem", "x")


# -- each caller's requests in flight ------------------------------------------------------------------------


def test_a_caller_at_its_bound_is_refused_and_others_are_not() -> None:
    flight = InFlight(2)
    assert flight.take("alice") and flight.take("alice")
    assert not flight.take("alice")  # a refusal is not counted
    assert flight._held == {"alice": 2}
    assert flight.take("bob") and flight.take(ANONYMOUS) and flight.take(ANONYMOUS)
    assert not flight.take(ANONYMOUS)  # the anonymous callers count together
    flight.give_back("alice")
    assert flight.take("alice") and not flight.take("alice")


def test_a_caller_with_nothing_in_flight_is_forgotten() -> None:
    flight = InFlight(3)
    for space in ("a", "b", "a"):
        assert flight.take(space)
    assert flight._held == {"a": 2, "b": 1}
    for space in ("a", "b", "a"):
        flight.give_back(space)
    assert flight._held == {}


def test_a_bound_of_0_lets_every_request_in() -> None:
    flight = InFlight(0)
    assert all(flight.take("alice") for _ in range(10_000))
    assert flight._held == {"alice": 10_000}


def test_giving_back_what_was_not_taken_is_a_programming_error() -> None:
    flight = InFlight(1)
    with pytest.raises(ValueError, match="in flight"):
        flight.give_back("alice")
    with pytest.raises(ValueError, match="0 \\(none\\) or more"):
        InFlight(-1)


# -- the queue's backpressure ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("depth", "bound", "rate", "after"),
    [
        (100, 10, None, DEFAULT_RETRY_AFTER),  # no rate known yet
        (100, 10, 0.0, DEFAULT_RETRY_AFTER),  # nothing drains
        (100, 10, -3.0, DEFAULT_RETRY_AFTER),
        (100, 10, 30.0, 3),  # 90 over the bound at 30 a second
        (100, 10, 29.0, 4),  # whole seconds, rounded up
        (11, 10, 1000.0, 1),  # at least a second
        (5, 10, 1.0, 1),  # under the bound already
        (100_000, 10, 1.0, MAX_RETRY_AFTER),  # at most a minute
    ],
)
def test_retry_after_is_when_the_queue_should_be_back_under_its_bound(
    depth: int, bound: int, rate: float | None, after: int
) -> None:
    assert retry_after(depth, bound, rate) == after


class Clock:
    def __init__(self, at: float = 100.0) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


def test_the_drain_rate_is_how_fast_the_depth_went_down_between_samples() -> None:
    clock = Clock()
    backlog = Backlog(lambda: None, "celery", clock=clock)
    assert (backlog.depth, backlog.drained_per_second, backlog.answered_within(60)) == (None, None, False)
    assert not backlog.over(1)

    backlog.sample(100, 100.0)
    assert (backlog.depth, backlog.sampled_at, backlog.drained_per_second) == (100, 100.0, None)
    backlog.sample(80, 102.0)
    assert backlog.drained_per_second == 10.0
    # A queue that grew keeps the last rate it drained at; so does a sample taken at the same moment.
    backlog.sample(90, 103.0)
    assert (backlog.depth, backlog.drained_per_second) == (90, 10.0)
    backlog.sample(0, 103.0)
    assert (backlog.depth, backlog.drained_per_second) == (0, 10.0)
    backlog.sample(60, 104.0)
    backlog.sample(30, 104.5)
    assert backlog.drained_per_second == 60.0
    assert retry_after(backlog.depth or 0, 10, backlog.drained_per_second) == 1

    clock.at = 105.0
    assert backlog.answered_within(0.5) and not backlog.answered_within(0.4)


def test_a_bound_of_0_is_no_bound() -> None:
    backlog = Backlog(lambda: None, "celery", clock=Clock())
    backlog.sample(1_000_000, 1.0)
    assert not backlog.over(0)
    assert backlog.over(999_999) and not backlog.over(1_000_000)


class Declared:
    def __init__(self, count: int) -> None:
        self.message_count = count


class FakeConnection:
    """A kombu connection as the sampler uses it: connect once, declare the queue passively (a RabbitMQ
    connection, as its transport says: a missing queue closes its channel)."""

    def __init__(self, counts: list[int | Exception]) -> None:
        self.counts = counts
        self.released = False
        self.default_channel = self
        self.transport = SimpleNamespace(driver_type="amqp")

    def ensure_connection(self, max_retries: int) -> None:
        assert max_retries == 1  # never kombu's default of retrying forever

    def queue_declare(self, queue: str, passive: bool) -> Declared:
        assert (queue, passive) == ("celery", True)
        count = self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]
        if isinstance(count, Exception):
            raise count
        return Declared(count)

    def release(self) -> None:
        self.released = True


async def sampled(backlog: Backlog, check: Callable[[], bool], what: str) -> None:
    """Run the sampler until ``check`` holds (polled, with a deadline), then stop it."""
    running = asyncio.create_task(backlog.run())
    deadline = time.monotonic() + 5
    try:
        while not check():
            assert time.monotonic() < deadline, f"gave up waiting for {what}"
            assert not running.done(), running
            await asyncio.sleep(0.005)
    finally:
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running


async def test_the_sampler_reads_the_depth_the_broker_declares() -> None:
    connections: list[FakeConnection] = []

    def connect() -> FakeConnection:
        connections.append(FakeConnection([7, 4]))
        return connections[-1]

    backlog = Backlog(connect, "celery", every=0.001)
    await sampled(backlog, lambda: backlog.depth == 4, "the second sample")
    assert backlog.error is None and backlog.answered_within(5)
    assert len(connections) == 1  # one connection, kept between samples
    backlog.close()
    assert connections[0].released


async def test_a_queue_not_declared_yet_holds_nothing() -> None:
    connections: list[FakeConnection] = []

    def connect() -> FakeConnection:
        connections.append(FakeConnection([ChannelError("NOT_FOUND - no queue 'celery'")]))
        return connections[-1]

    backlog = Backlog(connect, "celery", every=0.001)
    await sampled(backlog, lambda: len(connections) >= 2, "a second connection")
    assert (backlog.depth, backlog.error) == (0, None)
    assert connections[0].released  # the channel was closed: a new connection next time


async def test_an_empty_redis_queue_holds_nothing_on_the_same_connection() -> None:
    """A Redis queue's list exists only while it holds messages, so a passive declaration of an empty one
    is refused as a missing queue: zero, and the connection serves the next sample (reconnecting at each
    cost about 4 ms of CPU, twice a second)."""
    connections: list[kombu.Connection] = []

    def connect() -> kombu.Connection:
        connections.append(kombu.Connection(REDIS_URL))
        return connections[-1]

    backlog = Backlog(connect, f"empty-{time.monotonic_ns()}", every=0.001)
    samples: list[float] = []
    await sampled(
        backlog, lambda: samples.append(backlog.sampled_at or 0) or len(set(samples)) > 3, "samples"
    )
    assert (backlog.depth, backlog.error) == (0, None)
    assert len(connections) == 1
    backlog.close()


async def test_a_broker_that_does_not_answer_is_an_error_readiness_reports() -> None:
    attempts: list[int] = []

    def connect() -> FakeConnection:
        attempts.append(1)
        raise ConnectionRefusedError(111, "Connection refused\nmore detail")

    backlog = Backlog(connect, "celery", every=0.001)
    await sampled(backlog, lambda: len(attempts) >= 2, "a second try")
    assert backlog.error == "[Errno 111] Connection refused"
    assert backlog.depth is None and not backlog.answered_within(math.inf)
