"""Request messages as a queue carries them: their task names, every argument and retry counter checked
before anything else, and the fingerprint that names the request independent of its key.

This is the transport's vocabulary, kept out of the domain (:mod:`reservations` knows operations and
their arguments, not tasks or messages): the fingerprint a message names is the one its operation stores
with its idempotency record, which :mod:`reservations.operations` and :mod:`reservations.counting`
compute; this module only maps a message's arguments onto them.

Workers parse each message here; producers compute the same fingerprint before publishing, so a caller
whose key already belongs to a different request learns that instead of receiving that request's outcome.
A message names its format in a header (:data:`FORMAT`): a worker serves those in :data:`FORMATS`, and
dead-letters any other, unread (:class:`UnknownFormat`; docs/operations.md, "Message formats").
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from reservations import counting
from reservations import validation as valid
from reservations.errors import InvalidRequest
from reservations.operations import fingerprint, hold_ms_of
from reservations.redrives import carried_request
from reservations.statuses import RequestStatus
from tasks import tracing

log = logging.getLogger("tasks.messages")

# Retry counters travel with the message (see Attempt.again in tasks.attempt); a producer never sets them.
COUNTERS = ("epoch", "busy", "transient")
MAX_COUNTER = 1_000_000

# What a refusal carries of its message stays well under what an outcome's detail may hold
# (valid.MAX_DETAIL_JSON_CHARS, as JSON) whatever the message held: a refusal that cannot be recorded would
# leave its request without an outcome.
MAX_CARRIED_CHARS = 20_000  # a dead letter's request arguments, as JSON; larger ones are described instead
CARRIED_PREFIX_CHARS = 500  # how much of the JSON of arguments too large to carry is kept
MAX_MESSAGE_CHARS = 2_000  # a refusal's message text
MAX_QUOTED_CHARS = 100  # a value of the message that the refusal names (an unknown format)
# Whole numbers beyond this are not exact as a double, which is all many JSON readers have: kept as text.
MAX_EXACT_INT = 2**53

# The headers of a request message (tasks.producer sets them, and a retry keeps its message's): its format,
# a whole number; its deadline (:func:`late`) and when its request was first enqueued (the latency
# metrics' start), in seconds since the epoch; the W3C traceparent of its sender's span (tasks.tracing),
# which a worker that does not know it ignores, as any header; and the SKU of the reservation a confirm or
# release names, when its sender knows it (:func:`sku_hint`). Bump CURRENT_FORMAT as docs/operations.md
# says.
FORMAT = "reservations_format"
DEADLINE = "reservations_deadline"
ENQUEUED_AT = "reservations_enqueued_at"
TRACE = tracing.HEADER
SKU_HINT = "reservations_sku"
CURRENT_FORMAT = 2
UNMARKED_FORMAT = 1  # a message without the header
FORMATS = (1, 2)


# A request's deadline travels as a header, not as an argument: the arguments make the request's
# fingerprint, and the same request sent again with another deadline is still the same request; a worker
# that does not know the header ignores it, so workers can be upgraded one by one. A request taken up
# after it ends ``expired`` (tasks.attempt; README.md, "Running it", ``deadline=``).


@dataclass(frozen=True, slots=True)
class Late:
    """A request taken up ``late_by`` seconds after its ``deadline`` (seconds since the epoch)."""

    deadline: float
    late_by: float

    def detail(self, attempts: int = 0) -> dict[str, Any]:
        """The ``expired`` outcome's detail; ``attempts``: the retries of every kind made at it before."""
        return {"deadline": self.deadline, "late_by": round(self.late_by, 3), "attempts": attempts}

    def describe(self) -> str:
        return f"taken up {self.late_by:.3f}s after its deadline {self.deadline:.3f}"


def deadline_header(deadline: float | None) -> dict[str, float]:
    """The headers a message carries for ``deadline`` (checked; none for None)."""
    checked = valid.deadline(deadline)
    return {} if checked is None else {DEADLINE: checked}


def deadline_of(value: object, *, key: object = None) -> float | None:
    """The deadline a message's header ``value`` names; None without one, and for a malformed one, which
    is logged (naming ``key``) and ignored: a sender's bad header must not cost the request its outcome."""
    try:
        return valid.deadline(value)
    except InvalidRequest as exc:
        log.warning(
            "ignoring the malformed %s header %r of request %s: %s", DEADLINE, value, key, exc,
            extra={"event": "malformed_deadline", "key": key},
        )  # fmt: skip
        return None


def sku_hint(value: object, *, key: object = None) -> str | None:
    """The SKU a confirm's or release's header ``value`` names as its reservation's: the lease the worker
    takes without reading the reservation first. It is no part of the request (its fingerprint, its
    record): a wrong one costs the worker a lease on that SKU, then it takes the right one, which the
    refusal names. None without one, and for a malformed one, which is logged (naming ``key``)."""
    if value is None:
        return None
    try:
        return valid.sku(value)
    except InvalidRequest as exc:
        log.warning(
            "ignoring the malformed %s header of request %s: %s", SKU_HINT, key, exc,
            extra={"event": "malformed_sku_hint", "key": key},
        )  # fmt: skip
        return None


def late(value: object, *, clock: Callable[[], float] = time.time, key: object = None) -> Late | None:
    """Whether a request whose deadline header held ``value`` is taken up too late at ``clock()``: None
    without a deadline, before it, and for a malformed one."""
    deadline = deadline_of(value, key=key)
    now = clock()
    return Late(deadline, now - deadline) if deadline is not None and now > deadline else None


def request_arguments(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A message's arguments as its request has them: without the idempotency key and the retry counters,
    which no producer sends."""
    return {k: v for k, v in kwargs.items() if k != "idempotency_key" and k not in COUNTERS}


@dataclass(frozen=True, slots=True)
class Shape:
    """One request type: its domain operation and its message parameters in positional order."""

    operation: str
    params: tuple[str, ...]
    optional: frozenset[str] = frozenset()


def task_name(name: str) -> str:
    """The Celery task of request type (or other task) ``name``: ``reservations.<name>``. Task names are
    plain strings, so producers (the CLI too) need not import the workers."""
    return f"reservations.{name}"


# Keyed by the request type, the task name's suffix (:func:`task_name`); an order is the ``reserve_many``
# operation.
SHAPES = {
    "reserve": Shape("reserve", ("sku", "quantity", "idempotency_key", "hold_for"), frozenset({"hold_for"})),
    "reserve_order": Shape("reserve_many", ("lines", "idempotency_key", "hold_for"), frozenset({"hold_for"})),
    "confirm": Shape("confirm", ("reservation_id", "idempotency_key")),
    "release": Shape("release", ("reservation_id", "idempotency_key")),
    "restock": Shape("restock", ("sku", "quantity", "idempotency_key")),
    # A count is sent as its figure, or as the shrinkage the worker subtracts from what it reads.
    "count": Shape(
        "count", ("sku", "counted", "idempotency_key", "shrinkage"), frozenset({"counted", "shrinkage"})
    ),
    "replenish": Shape("replenish", ("sku", "par", "idempotency_key")),
}


@dataclass(frozen=True, slots=True)
class Message:
    """A request message that passed every check: normalized arguments, its fingerprint, its counters."""

    name: str
    operation: str
    key: str
    args: dict[str, Any]
    fingerprint: str
    counts: dict[str, int]


class InvalidMessage(InvalidRequest):
    """A message that can never succeed. ``key`` and ``fingerprint`` are set when its idempotency key itself
    was usable, so the refusal can be recorded as that request's outcome: :attr:`status` with
    :meth:`detail`."""

    status: str = RequestStatus.INVALID

    def __init__(
        self, message: str, *, key: str | None, fingerprint: str | None = None, field: str | None = None
    ) -> None:
        self.key = key
        self.fingerprint = fingerprint
        # The text may quote whatever the message held (an argument's name, a value): bounded, so that
        # the refusal's detail and its log line stay small.
        super().__init__(clipped(message, MAX_MESSAGE_CHARS), field=field)

    def detail(self) -> dict[str, Any]:
        """The refused request's outcome detail."""
        return {"error": "InvalidRequest", "message": str(self)}


class UnknownFormat(InvalidMessage):
    """A message whose format header names none of :data:`FORMATS` (docs/operations.md, "Message
    formats"). Whatever the message held, its detail can be recorded: the format is quoted in a bounded
    form (:func:`quoted`), and the arguments are carried for a re-drive only when their JSON fits
    :data:`MAX_CARRIED_CHARS` (:func:`_carried`)."""

    status = RequestStatus.DEAD_LETTERED

    def __init__(self, name: str, value: object, args: Any, kwargs: Any) -> None:
        self.format = value
        sent = dict(kwargs) if isinstance(kwargs, Mapping) else {}
        try:
            key = valid.idempotency_key(sent.get("idempotency_key"))
        except InvalidRequest:
            key = None
        # Its arguments as sent, for a re-drive; the retry counters are no part of the request. A message
        # with positional arguments cannot be read without its format: it carries none.
        claimed = request_arguments(sent)
        self.carried = {} if args else _carried(name, claimed)
        self.request = self.carried.get("request")
        known = " and ".join(map(str, FORMATS))
        super().__init__(
            f"{name} message of format {clipped(repr(value), MAX_QUOTED_CHARS)}: this worker serves formats "
            f"{known} (a message without {FORMAT} is format {UNMARKED_FORMAT}); drive it again once every "
            "worker serves its format",
            key=key,
            fingerprint=_raw_fingerprint(f"{name} of format {value!r}", claimed),
            field=FORMAT,
        )

    def detail(self) -> dict[str, Any]:
        return {
            "reason": "unknown message format",
            "error": str(self),
            "format": quoted(self.format),
            "formats": list(FORMATS),
            **self.carried,
        }


def clipped(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how long it was."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def quoted(value: object) -> Any:
    """A value of a message as a refusal's detail names it: a finite number or a short string as it is,
    anything else as bounded text (a number that is not finite as its JSON text, ``NaN``)."""
    if isinstance(value, bool) or (isinstance(value, int) and -MAX_EXACT_INT <= value <= MAX_EXACT_INT):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else json.dumps(value)
    if isinstance(value, int):
        return clipped(str(value), MAX_QUOTED_CHARS)
    return clipped(value if isinstance(value, str) else repr(value), MAX_QUOTED_CHARS)


def storable(value: Any) -> tuple[Any, str] | None:
    """``value`` as an outcome's detail can store it, and its JSON: numbers that are not finite (which the
    JSON of a message may hold, and a database refuses) as their JSON text, ``"NaN"``. None when it
    cannot be written as JSON at all (nested deeper than the encoder goes)."""
    try:
        # The tokens NaN, Infinity and -Infinity are read back as strings.
        stored = json.loads(json.dumps(value, default=repr), parse_constant=str)
        return stored, json.dumps(stored, sort_keys=True, allow_nan=False)
    except (RecursionError, ValueError):
        return None


def _carried(name: str, claimed: Mapping[str, Any]) -> dict[str, Any]:
    """The ``request`` a dead letter carries to be driven again, when it fits :data:`MAX_CARRIED_CHARS`;
    else what it says instead, ``request_too_large``: the arguments' size and the start of their JSON."""
    written = storable(carried_request(name, dict(claimed)))
    if written is not None and len(written[1]) <= MAX_CARRIED_CHARS:
        return {"request": written[0]}
    if written is None:
        why = "nested too deeply to write as JSON"
        return {"request_too_large": {"type": name, "arguments_chars": None, "why": why}}
    arguments = storable(written[0]["arguments"])
    text = written[1] if arguments is None else arguments[1]
    return {
        "request_too_large": {
            "type": name,
            "arguments_chars": len(text),
            "arguments_start": text[:CARRIED_PREFIX_CHARS],
            "why": f"its arguments are over {MAX_CARRIED_CHARS} characters as JSON",
        }
    }


def format_of(request: object) -> object:
    """The format a delivered message names (``request``: the task's request, which holds its headers):
    :data:`UNMARKED_FORMAT` without the header, else the header's value as sent, checked by :func:`parse`."""
    value = getattr(request, FORMAT, None)
    return UNMARKED_FORMAT if value is None else value


def normalized(name: str, args: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """Checked arguments and the fingerprint the operation stores in its idempotency record (the client
    checks a payload here before publishing it)."""
    if name == "reserve":
        sku, quantity = valid.sku(args["sku"]), valid.quantity(args["quantity"])
        hold_for = valid.hold_seconds(args.get("hold_for"))
        checked = {"sku": sku, "quantity": quantity, "hold_for": hold_for}
        return checked, fingerprint("reserve", sku=sku, quantity=quantity, hold_ms=hold_ms_of(hold_for))
    if name == "reserve_order":
        order = valid.order_lines(args["lines"])
        hold_for = valid.hold_seconds(args.get("hold_for"))
        checked = {"lines": order, "hold_for": hold_for}
        return checked, fingerprint("reserve_many", lines=order, hold_ms=hold_ms_of(hold_for))
    if name in ("confirm", "release"):
        reservation = valid.reservation_id(args["reservation_id"])
        return {"reservation_id": reservation}, fingerprint(name, reservation_id=reservation)
    if name == "restock":
        sku, quantity = valid.sku(args["sku"]), valid.quantity(args["quantity"])
        print_ = fingerprint("restock", sku=sku, delta=quantity, reason=None)
        return {"sku": sku, "quantity": quantity}, print_
    # The requests whose write is decided from what the worker reads under the lease.
    if name == "count":
        sku = valid.sku(args["sku"])
        counted, shrinkage = args.get("counted"), counting.shrinkage_units(args.get("shrinkage"))
        if (counted is None) == (shrinkage is None):
            raise InvalidRequest("a count takes either counted or shrinkage", field="counted")
        if counted is not None:
            counted = counting.counted_units(counted)
        checked = {"sku": sku, "counted": counted, "shrinkage": shrinkage}
        return checked, counting.count_fingerprint(sku, counted, shrinkage)
    if name == "replenish":
        sku, par = valid.sku(args["sku"]), counting.par_units(args["par"])
        return {"sku": sku, "par": par}, counting.replenish_fingerprint(sku, par)
    raise InvalidRequest(f"unknown request type {name!r}", field="task")  # pragma: no cover


def _raw_fingerprint(name: str, args: Mapping[str, Any]) -> str:
    # A request that can never succeed still names one request: the same malformed arguments replay
    # its refusal, different ones conflict with it. JSON first, as the broker would carry them.
    carried = json.loads(json.dumps(dict(args), sort_keys=True, default=repr))
    return fingerprint(f"malformed {name}", arguments=carried)


def _checked(name: str, claimed: Mapping[str, Any]) -> tuple[dict[str, Any], str]:
    """:func:`normalized` for arguments that first fit the request type's parameters."""
    shape = SHAPES[name]
    unknown = sorted(set(claimed) - set(shape.params))
    if unknown:
        raise InvalidRequest(f"{name} does not take {', '.join(map(repr, unknown))}")
    needed = set(shape.params) - shape.optional - {"idempotency_key"}
    missing = [p for p in shape.params if p in needed and p not in claimed]
    if missing:
        raise InvalidRequest(f"{name} needs {', '.join(map(repr, missing))}")
    return normalized(name, claimed)


def request_fingerprint(name: str, args: Mapping[str, Any]) -> str:
    """The fingerprint a worker will record for this request (``args`` without the idempotency key)."""
    claimed = {k: v for k, v in args.items() if k != "idempotency_key"}
    try:
        return _checked(name, claimed)[1]
    except InvalidRequest:
        return _raw_fingerprint(name, claimed)


def parse(
    name: str, args: Sequence[Any], kwargs: Mapping[str, Any], *, message_format: object = CURRENT_FORMAT
) -> Message:
    """Check a message of task ``name`` (positional ``args`` map onto its parameters in order) sent in
    ``message_format`` (:func:`format_of` a delivered message).

    Raises :class:`UnknownFormat` for a format not in :data:`FORMATS`, before reading anything else, and
    :class:`InvalidMessage` for anything a producer could not have meant: unknown or missing arguments,
    malformed values, retry counters that are not small non-negative whole numbers.
    """
    if isinstance(message_format, bool) or message_format not in FORMATS:
        raise UnknownFormat(name, message_format, args, kwargs)
    shape = SHAPES[name]
    if not isinstance(args, list | tuple) or not isinstance(kwargs, Mapping):
        raise InvalidMessage("message arguments must be a list and a mapping", key=None)
    if len(args) > len(shape.params):
        raise InvalidMessage(f"{name} takes at most {len(shape.params)} positional arguments", key=None)
    given: dict[str, Any] = dict(zip(shape.params, args, strict=False))
    for param, value in kwargs.items():
        if param in given:
            raise InvalidMessage(f"{name} got {param!r} twice", key=None)
        given[param] = value
    try:
        key = valid.idempotency_key(given.pop("idempotency_key", None))
    except InvalidRequest as exc:
        raise InvalidMessage(str(exc), key=None, field="idempotency_key") from None
    claimed = {k: v for k, v in given.items() if k not in COUNTERS}
    checked: dict[str, Any] = {}
    problem: InvalidRequest | None = None
    try:
        checked, print_ = _checked(name, claimed)
    except InvalidRequest as exc:
        problem, print_ = exc, _raw_fingerprint(name, claimed)
    counts: dict[str, int] = {}
    for counter in COUNTERS:
        value = given.get(counter, 0)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_COUNTER:
            refusal = f"retry counter {counter} must be a whole number from 0 to {MAX_COUNTER}"
            raise InvalidMessage(refusal, key=key, fingerprint=print_, field=counter)
        counts[counter] = value
    if problem is not None:
        raise InvalidMessage(str(problem), key=key, fingerprint=print_, field=problem.field) from None
    return Message(
        name=name, operation=shape.operation, key=key, args=checked, fingerprint=print_, counts=counts
    )
