"""What the front door answers, decided without I/O: the key a caller's header names, how long to wait,
the request's deadline, and the HTTP answer each final outcome is.

Each outcome status has one answer everywhere: a reservation is 201 where a POST made it and 200 where it
is read; a refusal is a problem document (service.problems) whose type is the same on every route.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from reservations.requests import RequestResult
from reservations.statuses import RequestStatus
from reservations.validation import MAX_KEY_CHARS
from service.problems import PROBLEM_MEDIA_TYPE, Problem, problem

KEY_HEADER = "Idempotency-Key"
DEADLINE_HEADER = "Request-Deadline"
# A caller's scope comes first in the stored key, before the first colon, so it can hold none.
_SCOPE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_KEY = re.compile(r"[!-~]+")  # printable ASCII, no spaces (reservations.validation's rule, length apart)
# RFC 7240: ``Prefer: wait=10``, ``Prefer: respond-async``, several preferences comma separated.
_PREFERENCE = re.compile(r"\s*([A-Za-z0-9!#$%&'*+.^_`|~-]+)\s*(?:=\s*(\"[^\"]*\"|[^;,\s]*))?[^,]*")
_SECONDS = re.compile(r"[0-9]+")
MAX_DEADLINE = 7 * 86400.0
PENDING_RETRY_AFTER = 1


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    media_type: str = "application/json"


def scoped_key(scope: str | None, key: str | None) -> str:
    """The key stored for a caller's ``Idempotency-Key``: the key itself, or ``<scope>:<key>`` when the
    deployment names callers, so two callers' keys never meet."""
    if scope is not None and not _SCOPE.fullmatch(scope):
        raise ValueError(f"a caller's scope must match {_SCOPE.pattern}, got {scope!r}")
    if key is None or key == "":
        raise problem("idempotency-key-missing", f"send an {KEY_HEADER} header with this request")
    room = MAX_KEY_CHARS - (0 if scope is None else len(scope) + 1)
    if len(key) > room or not _KEY.fullmatch(key):
        raise problem(
            "invalid-request",
            f"{KEY_HEADER} must be 1-{room} printable ASCII characters without spaces",
            field="Idempotency-Key",
        )
    return key if scope is None else f"{scope}:{key}"


def caller_key(scope: str | None, stored: str) -> str:
    """The caller's own key for a stored one (the scope taken off)."""
    return stored if scope is None else stored[len(scope) + 1 :]


def wait_of(prefer: str | None, default: float, maximum: float) -> float:
    """Seconds to wait for the outcome: ``Prefer: wait=N`` (RFC 7240) within ``maximum``, 0 for
    ``respond-async`` alone, else ``default``. A preference the service cannot read is ignored, as the RFC
    asks."""
    if not prefer:
        return default
    asked: float | None = None
    async_ = False
    for match in _PREFERENCE.finditer(prefer):
        name, value = match.group(1).lower(), (match.group(2) or "").strip('"')
        # delta-seconds are ASCII digits (str.isdigit also takes a Latin-1 "²", which float refuses);
        # a preference given twice counts once, the first time (RFC 7240, section 2).
        if name == "wait" and asked is None and _SECONDS.fullmatch(value):
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


def _iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
    body["at"] = _iso(result.at)
    body["detail"] = result.detail
    if result.redrive is not None:
        body["redrive"] = {"key": result.redrive.key, "number": result.redrive.number}
    return body


def answer_of(key: str, result: RequestResult, *, instance: str, created: bool) -> Answer:
    """The answer for the key's final outcome: 201 (``created``: a POST that reserved) or 200 for a
    success, else the problem of its status. The same outcome always gives the same answer."""
    status = result.status
    if status == RequestStatus.INSUFFICIENT_STOCK:
        stock = _stock(result)
        said = "SKU {sku!r}: requested {requested}, available {available}".format_map(
            {"sku": None, "requested": None, "available": None, **stock}
        )
        found = problem("insufficient-stock", said, key=key, **stock)
    elif status == RequestStatus.INVALID:
        error = str(result.detail.get("error", ""))
        name = "invalid-transition" if error == "InvalidTransition" else "invalid-request"
        found = problem(name, _message(result, "the request can never succeed"), key=key, error=error)
    elif status == RequestStatus.DEAD_LETTERED:
        reason = str(result.detail.get("reason", "it could not be carried out"))
        found = problem("dead-lettered", f"dead-lettered: {reason}", key=key)
    elif status == RequestStatus.EXPIRED:
        found = problem("expired", "the deadline passed before a worker took the request up", key=key)
    else:
        return Answer(201 if created and status == RequestStatus.RESERVED else 200, outcome_body(key, result))
    return problem_answer(found, instance)


def _message(result: RequestResult, fallback: str) -> str:
    message = result.detail.get("message")
    return str(message) if message else fallback


def _stock(result: RequestResult) -> dict[str, Any]:
    return {k: result.detail[k] for k in ("sku", "requested", "available") if k in result.detail}


def problem_answer(found: Problem, instance: str | None) -> Answer:
    return Answer(found.type.status, found.document(instance), dict(found.headers), PROBLEM_MEDIA_TYPE)


def pending(key: str, location: str) -> Answer:
    """202: accepted, no outcome yet; the caller looks at ``location`` (or sends the same key again)."""
    return Answer(
        202,
        {"key": key, "status": "pending", "location": location},
        {"Location": location, "Retry-After": str(PENDING_RETRY_AFTER)},
    )
