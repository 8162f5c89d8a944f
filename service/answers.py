"""What the front door answers, decided without I/O: the caller's key space and the key a caller's header
names, how long to wait, the request's deadline, and each final outcome's answer, alike on every route (a
reservation is 201 where a POST made it, 200 where it is read; a refusal an RFC 9457 problem document of a
type written once below with its status and title, which ``GET /problems/{name}`` shows)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from reservations.redrives import REDRIVE_MARK, is_redrive_key
from reservations.request_outcomes import RequestResult
from reservations.statuses import RequestStatus
from reservations.validation import MAX_KEY_CHARS

KEY_HEADER = "Idempotency-Key"
DEADLINE_HEADER = "Request-Deadline"
# A caller's name comes first in the stored key, before the first colon, so it can hold none.
_NAME_CHAR = "[A-Za-z0-9._-]"
CALLER_NAME = re.compile(_NAME_CHAR + "{1,64}")
# The key space of every caller the deployment's dependency leaves unnamed (None), or of every caller
# when the deployment has no dependency: not a name, so no named caller's keys can meet its keys.
ANONYMOUS = "*"
_KEY = re.compile(r"[!-~]+")  # printable ASCII, no spaces (reservations.validation's rule, length apart)
# RFC 7240: ``Prefer: wait=10``, ``Prefer: respond-async``, several preferences comma separated.
_PREFERENCE = re.compile(r"\s*([A-Za-z0-9!#$%&'*+.^_`|~-]+)\s*(?:=\s*(\"[^\"]*\"|[^;,\s]*))?[^,]*")
MAX_DEADLINE = 7 * 86400.0
PENDING_RETRY_AFTER = 1


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = "application/json"


PROBLEM_MEDIA_TYPE = "application/problem+json"


@dataclass(frozen=True, slots=True)
class ProblemType:
    name: str
    status: int
    title: str
    about: str

    @property
    def uri(self) -> str:
        return f"/problems/{self.name}"


TYPES = {t.name: t for t in (
    ProblemType("insufficient-stock", 409, "Not enough stock",
        "The SKU had fewer units available than requested when a worker held its lease. Final for the "
        "key: the same key answers the same; send a new key to try again."),
    ProblemType("invalid-request", 400, "Invalid request",
        "The request is malformed or can never succeed (body, path or headers; or an unknown SKU or "
        "reservation found by the worker, then final for the key)."),
    ProblemType("invalid-transition", 409, "The reservation is not in a state that allows this",
        "Confirming or releasing a reservation that is no longer held (released, expired or confirmed "
        "already). Final for the key."),
    ProblemType("idempotency-key-missing", 400, "Idempotency-Key header required",
        "Every request that changes stock needs an Idempotency-Key header: printable ASCII characters "
        "without spaces, at most 200 less the caller's name and a colon (198 for an anonymous caller), "
        "not ending in ~redrive-<n>, which names an operator's re-drive of the key before it."),
    ProblemType("idempotency-key-reused", 422, "Idempotency-Key used for a different request",
        "The key was first used for a request with another operation or other arguments; that "
        "request's answer belongs to it. Send this request under a new key."),
    ProblemType("not-found", 404, "Not found",
        "No request was ever accepted under this key (for this caller), or the SKU does not exist."),
    ProblemType("method-not-allowed", 405, "Method not allowed",
        "The path exists but does not take this method (its Allow header lists those it takes)."),
    ProblemType("unauthorized", 401, "Not authenticated",
        "The deployment's caller dependency did not recognise the caller."),
    ProblemType("forbidden", 403, "Forbidden", "The deployment's caller dependency refused the caller."),
    # 403, not 400 (nor 500): the request is well formed and the service well, every other caller served; the
    # refusal is of who the caller is, as the deployment's dependency named it from its credentials.
    ProblemType("invalid-caller", 403, "The caller's name cannot hold keys",
        "The deployment's caller dependency named this caller with a name outside [A-Za-z0-9._-]{1,64} "
        "(an e-mail address, say), which cannot scope idempotency keys; nothing was read or written. Every "
        "request of this caller is refused alike until the deployment maps it to such a name."),
    ProblemType("not-reserved", 409, "No reservation under this key",
        "The key's request did not reserve (its outcome is another), or has no outcome yet "
        "(then Retry-After says when to look again)."),
    ProblemType("unavailable", 503, "Service unavailable",
        "The broker or the database did not answer. Retry the same request under the same key after "
        "Retry-After: a request that went out before the failure is found (in flight or ended), one that "
        "did not is sent anew. Not stored: the key never answers this again by itself."),
    ProblemType("overloaded", 503, "Too many requests waiting",
        "The queue of requests is deeper than this deployment's bound; the request was not enqueued. "
        "Retry the same request with the same key after Retry-After."),
    ProblemType("too-many-requests", 429, "Too many requests of this caller in flight",
        "This caller (without a name: the anonymous callers together) has as many requests in flight in "
        "this process as the deployment allows one caller, so that no caller takes every other's room; "
        "nothing was read or written. Retry the same request with the same key after Retry-After."),
    ProblemType("dead-lettered", 503, "The request was dead-lettered",
        "Workers could not carry the request out (a backend stayed unreachable, or it lost its lease "
        "too often); nothing was reserved by it. Final until an operator drives it again "
        "(reservations redrive), after which the key reports that outcome."),
    ProblemType("expired", 504, "The request's deadline passed before it was carried out",
        "A worker reached the request after its deadline (Request-Deadline) and ended it without "
        "touching stock. Final for the key; send a new key if it is still wanted."),
    ProblemType("cancelled", 409, "The request was cancelled by an operator",
        "An operator cancelled the request before a worker carried it out; nothing was reserved by it. "
        "Final for the key; send a new key if it is still wanted."),
)}  # fmt: skip


@dataclass(eq=False)
class Problem(Exception):
    """A problem answer, raised anywhere under a route and rendered by the app's handler."""

    type: ProblemType
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def answer(self, instance: str | None) -> Answer:
        return Answer(self.type.status, self.document(instance), dict(self.headers), PROBLEM_MEDIA_TYPE)

    def document(self, instance: str | None) -> dict[str, Any]:
        kind = self.type
        body = {"type": kind.uri, "title": kind.title, "status": kind.status, "detail": self.detail}
        return {**body, **({} if instance is None else {"instance": instance}), **self.extra}


def problem(name: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any) -> Problem:
    return Problem(TYPES[name], detail, extra, headers or {})


def caller_space(name: object) -> str:
    """The key space of the caller the deployment's dependency named: its name, :data:`ANONYMOUS` for None.
    Any other name would let its keys leak into another space (a colon) or fail the stored key's rules."""
    if name is None:
        return ANONYMOUS
    if isinstance(name, str) and CALLER_NAME.fullmatch(name):
        return name
    raise problem(
        "invalid-caller",
        f"this service names its callers with {CALLER_NAME.pattern} only, and cannot keep keys for the "
        "name the deployment gave this caller",
    )


def unfit_name(name: object) -> str:
    """What a name :func:`caller_space` refused is, for the log: its type, length and the characters
    outside the rule, never the name itself (an e-mail address, say)."""
    if not isinstance(name, str):
        return f"a {type(name).__name__}"
    odd = "".join(sorted(set(re.sub(_NAME_CHAR, "", name))))
    return f"a name of {len(name)} characters" + (f", with {odd!r} outside the rule" if odd else "")


def scoped_key(space: str, key: str | None) -> str:
    """The key stored for a caller's ``Idempotency-Key`` (or the key of a path): ``<space>:<key>``, the
    space being the caller's (:func:`caller_space`), so two callers' keys never meet."""
    if space != ANONYMOUS and not CALLER_NAME.fullmatch(space):
        raise ValueError(
            f"a caller's space is {ANONYMOUS!r} or a name matching {CALLER_NAME.pattern}, got {space!r}"
        )
    if key is None or key == "":
        raise problem("idempotency-key-missing", f"send an {KEY_HEADER} header with this request")
    room = MAX_KEY_CHARS - len(space) - 1
    if len(key) > room or not _KEY.fullmatch(key):
        raise problem(
            "invalid-request",
            f"{KEY_HEADER} must be 1-{room} printable ASCII characters without spaces",
            field=KEY_HEADER,
        )
    return f"{space}:{key}"


def new_key(space: str, key: str | None) -> str:
    """The stored key of a request a caller sends (:func:`scoped_key`), which must not take a name an
    operator's re-drive of the caller's key before it will run under (``K~redrive-1`` for ``K``): the
    re-drive would find the caller's request there and report it as K's outcome."""
    stored = scoped_key(space, key)
    if is_redrive_key(stored):
        raise problem(
            "invalid-request",
            f"{KEY_HEADER} must not end in {REDRIVE_MARK}<n>: such keys are kept for re-drives of the key "
            "before it",
            field=KEY_HEADER,
        )
    return stored


def caller_key(space: str, stored: str) -> str:
    """The caller's own key for a stored one (its space taken off)."""
    return stored[len(space) + 1 :]


def wait_of(prefer: str | None, default: float, maximum: float) -> float:
    """Seconds to wait for the outcome: ``Prefer: wait=N`` (RFC 7240) within ``maximum``, 0 for
    ``respond-async`` alone, else ``default``. A preference it cannot read is ignored, as the RFC asks."""
    asked: float | None = None
    async_ = False
    for match in _PREFERENCE.finditer(prefer or ""):
        name, value = match.group(1).lower(), (match.group(2) or "").strip('"')
        # delta-seconds are ASCII digits (str.isdigit also takes a Latin-1 "²", which float refuses);
        # a preference given twice counts once, the first time (RFC 7240, section 2).
        if name == "wait" and asked is None and re.fullmatch("[0-9]+", value):
            asked = float(value)
        elif name == "respond-async":
            async_ = True
    if asked is not None:
        return min(asked, maximum)
    return 0.0 if async_ else default


def deadline_of(header: str | None, default: float, now: float) -> float | None:
    """The request's deadline in seconds since the epoch: ``Request-Deadline: <seconds from now>``, else
    ``default`` seconds from now (0: none)."""
    if header is None:
        return now + default if default > 0 else None
    try:
        seconds = float(header)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_DEADLINE:
        raise problem(
            "invalid-request",
            f"{DEADLINE_HEADER} must be seconds from now, more than 0 and at most {MAX_DEADLINE:g}",
            field=DEADLINE_HEADER,
        )
    return now + seconds


def outcome_body(key: str, result: RequestResult) -> dict[str, Any]:
    """An outcome as the service shows it, under the caller's key."""
    body: dict[str, Any] = {"key": key, "operation": result.operation, "status": result.status}
    ids = result.detail.get("reservation_ids")
    if ids:
        body["reservation_id"] = ids[0]
        if len(ids) > 1:
            body["reservation_ids"] = ids
    if "token" in result.detail:
        body["token"] = result.detail["token"]
    at = datetime.fromtimestamp(result.at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    body.update(at=at, detail=result.detail)
    if result.redrive is not None:
        body["redrive"] = {"key": result.redrive.key, "number": result.redrive.number}
    return body


def answer_of(key: str, result: RequestResult, *, instance: str, created: bool) -> Answer:
    """The answer for the key's final outcome: 201 (``created``: a POST that reserved) or 200 for a
    success, else the problem of its status. The same outcome always gives the same answer."""
    status, detail = result.status, result.detail
    if status == RequestStatus.INSUFFICIENT_STOCK:
        stock: dict[str, Any] = {k: detail[k] for k in ("sku", "requested", "available") if k in detail}
        said = "SKU {sku!r}: requested {requested}, available {available}".format_map(
            {"sku": None, "requested": None, "available": None, **stock}
        )
        found = problem("insufficient-stock", said, key=key, **stock)
    elif status == RequestStatus.INVALID:
        error = str(detail.get("error", ""))
        name = "invalid-transition" if error == "InvalidTransition" else "invalid-request"
        message = str(detail.get("message") or "the request can never succeed")
        found = problem(name, message, key=key, error=error)
    elif status == RequestStatus.DEAD_LETTERED:
        reason = str(detail.get("reason", "it could not be carried out"))
        found = problem("dead-lettered", f"dead-lettered: {reason}", key=key)
    elif status == RequestStatus.EXPIRED:
        found = problem("expired", _expired(detail), key=key)
    elif status == RequestStatus.CANCELLED:
        found = problem("cancelled", f"cancelled: {detail.get('reason') or 'by an operator'}", key=key)
    else:
        return Answer(201 if created and status == RequestStatus.RESERVED else 200, outcome_body(key, result))
    return found.answer(instance)


def _expired(detail: dict[str, Any]) -> str:
    """What an expired outcome says happened: never taken up, taken up after retries, or ended by the
    relay with no outcome (its messages lost, or never taken up in time)."""
    if detail.get("reason"):
        return f"the deadline passed before the request was carried out: {detail['reason']}"
    attempts = detail.get("attempts")
    if isinstance(attempts, int) and not isinstance(attempts, bool) and attempts > 0:
        return f"the deadline passed after {attempts} attempt(s) at the request, before it was carried out"
    return "the deadline passed before a worker took the request up"


def location_of(route: str, key: str) -> str:
    """Where a key's outcome is read, the key one path segment: a key may hold ``?``, ``#`` or ``%``, which
    would otherwise lead a caller following the Location to another key or to none. The keys ``.`` and
    ``..`` are dot segments, which a client resolves away (RFC 3986, 5.2.4: ``/reservations/.`` is
    ``/reservations/``): their dots are sent as ``%2E``, which the server decodes back to the key."""
    segment = "%2E" * len(key) if key in (".", "..") else quote(key, safe="")
    return f"{route}/{segment}"


def pending(key: str, location: str) -> Answer:
    """202: accepted, no outcome yet; the caller looks at ``location`` (or sends the same key again)."""
    return Answer(
        202,
        {"key": key, "status": "pending", "location": location},
        {"Location": location, "Retry-After": str(PENDING_RETRY_AFTER)},
    )
