"""The one exception tree of the fencing package.

Every error a caller can see is a :class:`FencingError`; third-party errors are mapped at the boundary
(``raise ... from exc``) so callers never catch ``redis`` or ``sqlalchemy`` types::

    FencingError
    ├── InvalidLeaseRequest      bad scope, holder, ttl, token or lease (also a ValueError); nothing written
    │   ├── ScopeMismatch        a lease of one scope presented for another scope
    │   └── TokenOverflow        a token past MAX_TOKEN, or a scope whose counter has reached it
    ├── LeaseBusy                someone else holds the scope (holder, token, retry_after)
    ├── LostOwnership            authority is gone: stop all work under this lease, never retry with it
    │   ├── StaleToken           the resource has accepted a newer token (presented, highest)
    │   └── LeaseLost            the coordinator no longer holds this lease (expired, released, broken)
    └── BackendUnavailable       the coordinator or database could not be reached; the outcome is unknown
        └── SchemaMissing        the database answers but lacks a table or column the migrations create
"""

from __future__ import annotations


class FencingError(Exception):
    """Base of every error raised by :mod:`fencing`."""


class InvalidLeaseRequest(FencingError, ValueError):
    """A malformed argument: empty or oversized scope, control characters, absurd ttl, bad token."""


class ScopeMismatch(InvalidLeaseRequest):
    """A lease was presented for a scope it does not cover (a token never fences another scope)."""

    def __init__(self, *, lease_scope: str, target_scope: str) -> None:
        self.lease_scope = lease_scope
        self.target_scope = target_scope
        super().__init__(f"lease for scope {lease_scope!r} cannot guard scope {target_scope!r}")


class TokenOverflow(InvalidLeaseRequest):
    """A token beyond :data:`fencing.lease.MAX_TOKEN` was presented, or the scope's counter has reached it
    and cannot issue another. Refused before anything is written.

    Only a forged token (a hand-built lease, a corrupted coordinator) gets near the limit: at a million
    acquisitions a second a scope would need centuries to count that far.
    """

    def __init__(self, *, token: object, limit: int, scope: str | None = None, detail: str = "") -> None:
        self.scope = scope
        self.token = token
        self.limit = limit
        where = f" for scope {scope!r}" if scope is not None else ""
        suffix = f": {detail}" if detail else ""
        super().__init__(f"token {token!r}{where} is beyond the limit {limit}{suffix}")

    @classmethod
    def exhausted(cls, scope: str, counter: object, limit: int) -> TokenOverflow:
        """The refusal of every acquirer of ``scope`` once its counter, as stored, has reached ``limit``."""
        if isinstance(counter, str) and counter.isascii() and counter.isdigit():
            counter = int(counter)  # a Redis counter is text
        detail = "the coordinator's counter cannot issue another token"
        return cls(token=counter, limit=limit, scope=scope, detail=detail)


class LeaseBusy(FencingError):
    """The scope is held by another owner; try again after ``retry_after`` seconds."""

    def __init__(self, *, scope: str, holder: str | None, token: int | None, retry_after: float) -> None:
        self.scope = scope
        self.holder = holder
        self.token = token
        self.retry_after = retry_after
        super().__init__(
            f"scope {scope!r} is held by {holder!r} (token {token}); retry in {retry_after:.3f}s"
        )


class LostOwnership(FencingError):
    """The lease no longer grants authority. Terminal for everything bound to that lease.

    Recovery goes back to coordination (a new acquisition, a new epoch); never retry the same
    mutation with the same token, and never ask for a newer token just to push the old one through.
    """

    def __init__(self, message: str, *, scope: str, token: int, lease_id: str | None = None) -> None:
        self.scope = scope
        self.token = token
        self.lease_id = lease_id
        super().__init__(message)


class StaleToken(LostOwnership):
    """The protected resource has already accepted a newer epoch than the presented token."""

    def __init__(
        self,
        *,
        scope: str,
        presented: int,
        highest: int,
        lease_id: str | None = None,
        holder: str | None = None,
    ) -> None:
        self.presented = presented
        self.highest = highest
        self.holder = holder
        super().__init__(
            f"stale token {presented} for scope {scope!r}: the resource has accepted token {highest}",
            scope=scope,
            token=presented,
            lease_id=lease_id,
        )


class LeaseLost(LostOwnership):
    """The coordinator no longer holds this lease (it expired, was released, broken or never existed)."""

    def __init__(self, *, scope: str, token: int, lease_id: str | None = None, reason: str) -> None:
        self.reason = reason
        super().__init__(
            f"lease on {scope!r} (token {token}) is lost: {reason}",
            scope=scope,
            token=token,
            lease_id=lease_id,
        )


class BackendUnavailable(FencingError):
    """Redis or the database did not answer. Whether the operation took effect is unknown."""

    def __init__(self, *, backend: str, operation: str, detail: str) -> None:
        self.backend = backend
        self.operation = operation
        self.detail = detail
        super().__init__(f"{backend} unavailable during {operation}: {detail}")


class SchemaMissing(BackendUnavailable):
    """The database answers, but a table or column the migrations create is missing: unusable until it is
    upgraded. A kind of unavailability, so a worker retries it as one while the upgrade runs."""

    def __init__(self, *, operation: str, problem: str, detail: str) -> None:
        self.problem = problem  # "missing" (a table) or "out of date" (a column)
        self.reason = detail  # the database's own words
        super().__init__(backend="database", operation=operation, detail=f"schema {problem}: {detail}")
