"""The service's errors as RFC 9457 problem documents, each type written once with its status and title.

Every route answers an error with the same document for the same problem (``type``, ``title``,
``status``, ``detail``, ``instance``, plus members of its own such as ``key`` or ``available``), served as
``application/problem+json``. ``GET /problems/{name}`` describes each type, so a ``type`` resolves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

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
    ProblemType(
        "insufficient-stock", 409, "Not enough stock",
        "The SKU had fewer units available than requested when a worker held its lease. Final for the "
        "key: the same key answers the same; send a new key to try again.",
    ),
    ProblemType(
        "invalid-request", 400, "Invalid request",
        "The request is malformed or can never succeed (body, path or headers; or an unknown SKU or "
        "reservation found by the worker, then final for the key).",
    ),
    ProblemType(
        "invalid-transition", 409, "The reservation is not in a state that allows this",
        "Confirming or releasing a reservation that is no longer held (released, expired or confirmed "
        "already). Final for the key.",
    ),
    ProblemType(
        "idempotency-key-missing", 400, "Idempotency-Key header required",
        "Every request that changes stock needs an Idempotency-Key header: printable ASCII characters "
        "without spaces, at most 200 less the caller's name and a colon (198 for an anonymous caller), "
        "not ending in ~redrive-<n>, which names an operator's re-drive of the key before it.",
    ),
    ProblemType(
        "idempotency-key-reused", 422, "Idempotency-Key used for a different request",
        "The key was first used for a request with another operation or other arguments; that "
        "request's answer belongs to it. Send this request under a new key.",
    ),
    ProblemType(
        "not-found", 404, "Not found",
        "No request was ever accepted under this key (for this caller), or the SKU does not exist.",
    ),
    ProblemType(
        "method-not-allowed", 405, "Method not allowed",
        "The path exists but does not take this method (its Allow header lists those it takes).",
    ),
    ProblemType(
        "unauthorized", 401, "Not authenticated",
        "The deployment's caller dependency did not recognise the caller.",
    ),
    ProblemType(
        "forbidden", 403, "Forbidden",
        "The deployment's caller dependency refused the caller.",
    ),
    # 403, not 400: the request is well formed, and sending it again in any other form does not help; the
    # refusal is of who the caller is, as the deployment's dependency named it from its credentials.
    # (Nor 500: the service itself is well, and every other caller is served.)
    ProblemType(
        "invalid-caller", 403, "The caller's name cannot hold keys",
        "The deployment's caller dependency named this caller with a name outside [A-Za-z0-9._-]{1,64} "
        "(an e-mail address, say), which cannot scope idempotency keys; nothing was read or written. Every "
        "request of this caller is refused alike until the deployment maps it to such a name.",
    ),
    ProblemType(
        "not-reserved", 409, "No reservation under this key",
        "The key's request did not reserve (its outcome is another), or has no outcome yet "
        "(then Retry-After says when to look again).",
    ),
    ProblemType(
        "unavailable", 503, "Service unavailable",
        "The broker or the database did not answer. Retry the same request under the same key after "
        "Retry-After: a request that went out before the failure is found (in flight or ended), one that "
        "did not is sent anew. Not stored: the key never answers this again by itself.",
    ),
    ProblemType(
        "overloaded", 503, "Too many requests waiting",
        "The queue of requests is deeper than this deployment's bound; the request was not enqueued. "
        "Retry the same request with the same key after Retry-After.",
    ),
    ProblemType(
        "too-many-requests", 429, "Too many requests of this caller in flight",
        "This caller (without a name: the anonymous callers together) has as many requests in flight in "
        "this process as the deployment allows one caller, so that no caller takes every other's room; "
        "nothing was read or written. Retry the same request with the same key after Retry-After.",
    ),
    ProblemType(
        "dead-lettered", 503, "The request was dead-lettered",
        "Workers could not carry the request out (a backend stayed unreachable, or it lost its lease "
        "too often); nothing was reserved by it. Final until an operator drives it again "
        "(reservations redrive), after which the key reports that outcome.",
    ),
    ProblemType(
        "expired", 504, "The request's deadline passed before it was carried out",
        "A worker reached the request after its deadline (Request-Deadline) and ended it without "
        "touching stock. Final for the key; send a new key if it is still wanted.",
    ),
)}  # fmt: skip


@dataclass(eq=False)
class Problem(Exception):
    """A problem answer, raised anywhere under a route and rendered by the app's handler."""

    type: ProblemType
    detail: str
    extra: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)

    def document(self, instance: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "type": self.type.uri,
            "title": self.type.title,
            "status": self.type.status,
            "detail": self.detail,
        }
        if instance is not None:
            body["instance"] = instance
        return {**body, **self.extra}


def problem(name: str, detail: str, *, headers: dict[str, str] | None = None, **extra: Any) -> Problem:
    return Problem(TYPES[name], detail, extra, headers or {})
