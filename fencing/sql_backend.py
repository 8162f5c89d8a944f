"""SQL lease backend: one row per scope, expiry judged by the database's clock, tokens durable.

Each operation is one transaction whose first statement is a write, so concurrent acquirers queue on the
row (PostgreSQL) or the database (SQLite) instead of racing a read against a write.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from fencing.errors import LeaseBusy, LeaseLost, TokenOverflow
from fencing.lease import (
    MAX_HOLDER_CHARS,
    MAX_SCOPE_CHARS,
    MAX_TOKEN,
    Clock,
    Lease,
    LeaseEvent,
    LeaseInfo,
    parse_token,
    ttl_ms,
    validate_token,
)
from fencing.plan import Plan
from fencing.sql import Rows, db_now_ms

metadata = sa.MetaData()

# ``state``: free (never held), held, released, broken; a held row past ``expires_ms`` has expired.
# ``previous_end`` is written by the same UPDATE that starts an epoch, so RETURNING can report how the
# previous epoch ended without a second read.
leases = sa.Table(
    "fencing_leases",
    metadata,
    sa.Column("scope", sa.String(MAX_SCOPE_CHARS), primary_key=True),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("lease_id", sa.String(32)),
    sa.Column("holder", sa.String(MAX_HOLDER_CHARS)),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("acquired_ms", sa.BigInteger),
    sa.Column("expires_ms", sa.BigInteger, nullable=False),
    sa.Column("previous_end", sa.String(16)),
    # Set by an acquirer that found the lease busy; reset when an epoch starts, reported by the release.
    sa.Column("contended", sa.Boolean, nullable=False, server_default=sa.true()),
    sa.CheckConstraint("token >= 0", name="ck_fencing_leases_token"),
)

lease_events = sa.Table(
    "fencing_lease_events",
    metadata,
    sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"), primary_key=True, autoincrement=True),
    sa.Column("scope", sa.String(MAX_SCOPE_CHARS), nullable=False),
    sa.Column("event", sa.String(16), nullable=False),
    sa.Column("token", sa.BigInteger, nullable=False),
    sa.Column("lease_id", sa.String(32)),
    sa.Column("holder", sa.String(MAX_HOLDER_CHARS)),
    sa.Column("at_ms", sa.BigInteger, nullable=False),
    sa.Column("previous_token", sa.BigInteger),
    sa.Column("previous_end", sa.String(16)),
    sa.Column("detail", sa.Text),
    sa.Index("ix_fencing_lease_events_scope_id", "scope", "id"),
)

_live = sa.and_(leases.c.state == "held", leases.c.expires_ms > db_now_ms())
# Times an acquire looks again when the lease it found live ended before it could mark it contended.
_BUSY_RACES = 3

log = logging.getLogger("fencing")


@dataclass(frozen=True, slots=True)
class SqlLeaseCore:
    """Statements and parsing for the SQL backend; no I/O."""

    backend: ClassVar[str] = "sql"

    dialect: str
    clock: Clock

    def _event(self, **values: object) -> sa.Executable:
        return sa.insert(lease_events).values(at_ms=db_now_ms(), **values)

    def acquire(self, scope: str, ttl: float, holder: str, lease_id: str) -> Plan[Lease | LeaseBusy]:
        sent_at = self.clock()
        insert = postgresql.insert if self.dialect == "postgresql" else sqlite.insert
        yield insert(leases).values(scope=scope, token=0, state="free", expires_ms=0).on_conflict_do_nothing()
        for _ in range(_BUSY_RACES):
            now = db_now_ms()
            started: Rows = yield (
                sa.update(leases)
                # A counter at MAX_TOKEN issues nothing more (see MAX_TOKEN for why the limit is below
                # BIGINT's).
                .where(leases.c.scope == scope, sa.not_(_live), leases.c.token < MAX_TOKEN)
                .values(
                    token=leases.c.token + 1,
                    lease_id=lease_id,
                    holder=holder,
                    state="held",
                    acquired_ms=now,
                    expires_ms=now + ttl_ms(ttl),
                    previous_end=sa.case((leases.c.state == "held", "expired"), else_=leases.c.state),
                    contended=False,
                )
                .returning(leases.c.token, leases.c.previous_end)
            )
            row = started.first()
            if row is not None:
                break
            busy = yield from self._turned_away(scope)
            if busy is not None:
                return busy
            # The lease ended between the two statements (a statement sees what committed before it
            # began): the mark would have fallen on an ended epoch, where its holder never reads it.
        else:
            return LeaseBusy(scope=scope, holder=None, token=None, retry_after=0.0)
        token, previous_end = int(row[0]), row[1]
        yield self._event(
            scope=scope,
            event="acquired",
            token=token,
            lease_id=lease_id,
            holder=holder,
            previous_token=token - 1 if previous_end != "free" else None,
            previous_end=previous_end if previous_end != "free" else None,
            detail=f"ttl_ms={ttl_ms(ttl)}",
        )
        return Lease(scope, token, lease_id, holder, ttl, sent_at, clock=self.clock)

    def _turned_away(self, scope: str) -> Plan[LeaseBusy | None]:
        """The refusal of an acquirer, marking the live lease contended as it reads who holds it; None
        when no lease is live any more (try again). A counter at the limit refuses every acquirer."""
        busy: Rows = yield (
            sa.update(leases)
            .where(leases.c.scope == scope, _live)
            .values(contended=True)
            .returning(leases.c.holder, leases.c.token, leases.c.expires_ms - db_now_ms())
        )
        if busy.rows:
            holder_now, token_now, left_ms = busy.rows[0]
        else:
            counter: Rows = yield sa.select(leases.c.token).where(leases.c.scope == scope)
            holder_now, token_now, left_ms = None, counter.rows[0][0], None
        if token_now >= MAX_TOKEN:
            raise TokenOverflow.exhausted(scope, token_now, MAX_TOKEN)
        if left_ms is None:
            return None
        return LeaseBusy(scope=scope, holder=holder_now, token=token_now, retry_after=max(left_ms, 0) / 1000)

    def _end_or_extend(self, lease: Lease, values: dict[str, object]) -> Plan[tuple[int, bool] | None]:
        """The lease's token and whether it was contended, or None when it is no longer held."""
        changed: Rows = yield (
            sa.update(leases)
            .where(
                leases.c.scope == lease.scope,
                leases.c.lease_id == lease.lease_id,
                leases.c.token == lease.token,
                _live,
            )
            .values(**values)
            .returning(leases.c.token, leases.c.contended)
        )
        row = changed.first()
        return None if row is None else (int(row[0]), bool(row[1]))

    def _lost(self, lease: Lease) -> Plan[LeaseLost]:
        found: Rows = yield sa.select(leases.c.token, leases.c.lease_id).where(leases.c.scope == lease.scope)
        row = found.first()
        if row is not None and row[0] > lease.token:
            reason = f"superseded by token {row[0]}"
        elif row is not None and row[1] == lease.lease_id:
            reason = "expired or released at the coordinator"
        else:
            reason = "the coordinator does not know this lease"
        return lease.lose(reason)

    def renew(self, lease: Lease) -> Plan[Lease]:
        sent_at = self.clock()
        # No event row: a renewal changes no owner, and a row each would grow the log with the lease's age.
        extended = yield from self._end_or_extend(lease, {"expires_ms": db_now_ms() + ttl_ms(lease.ttl)})
        if extended is None:
            raise (yield from self._lost(lease))
        lease._renewed(sent_at)
        return lease

    def release(self, lease: Lease) -> Plan[bool]:
        ended = yield from self._end_or_extend(lease, {"state": "released", "expires_ms": db_now_ms()})
        if ended is None:
            raise (yield from self._lost(lease))
        yield self._event(
            scope=lease.scope,
            event="released",
            token=lease.token,
            lease_id=lease.lease_id,
            holder=lease.holder,
        )
        return ended[1]

    def break_lease(self, scope: str, reason: str) -> Plan[LeaseInfo | None]:
        ended: Rows = yield (
            sa.update(leases)
            .where(leases.c.scope == scope, _live)
            .values(state="broken", expires_ms=db_now_ms())
            .returning(leases.c.token, leases.c.holder, leases.c.lease_id)
        )
        row = ended.first()
        if row is None:
            return None
        yield self._event(
            scope=scope, event="broken", token=row[0], lease_id=row[2], holder=row[1], detail=reason
        )
        return LeaseInfo(scope=scope, token=int(row[0]), holder=row[1], time_left=0.0)

    def repair(self, lease: Lease, highest: int) -> Plan[tuple[int, int] | None]:
        validate_token(highest, scope=lease.scope)
        raised = sa.case((leases.c.token < highest, highest), else_=leases.c.token)
        ended = yield from self._end_or_extend(
            lease, {"token": raised, "state": "broken", "expires_ms": db_now_ms()}
        )
        if ended is None:
            return None
        new = ended[0]
        yield self._event(
            scope=lease.scope,
            event="repaired",
            token=new,
            lease_id=lease.lease_id,
            holder=lease.holder,
            previous_token=lease.token,
            detail=f"counter raised past the resource's highest token {highest}",
        )
        return lease.token, new

    def current_many(self, scopes: list[str]) -> Plan[list[LeaseInfo | None]]:
        found: Rows = yield sa.select(
            leases.c.scope, leases.c.token, leases.c.holder, leases.c.expires_ms - db_now_ms()
        ).where(leases.c.scope.in_(scopes), _live)
        live = {row[0]: row for row in found.rows}
        return [
            LeaseInfo(scope=scope, token=int(row[1]), holder=row[2], time_left=row[3] / 1000)
            if (row := live.get(scope)) is not None
            else None
            for scope in scopes
        ]

    def purge_history(self, older_than_ms: int) -> Plan[int]:
        gone: Rows = yield (
            sa.delete(lease_events)
            .where(lease_events.c.at_ms < db_now_ms() - older_than_ms)
            .returning(lease_events.c.id)
        )
        return len(gone.rows)

    def history(self, scope: str, limit: int) -> Plan[list[LeaseEvent]]:
        found: Rows = yield (
            sa.select(lease_events)
            .where(lease_events.c.scope == scope)
            .order_by(lease_events.c.id.desc())
            .limit(limit)
        )
        events = []
        for r in reversed(found.rows):
            token = parse_token(r.token)
            if token is None:
                # Not written by this backend (a row inserted by hand or restored from elsewhere): one
                # unreadable row must not hide the rest of the scope's history.
                log.warning("lease history of %r: skipped event %s with token %r", scope, r.id, r.token)
                continue
            events.append(
                LeaseEvent(
                    scope=r.scope,
                    event=r.event,
                    token=token,
                    holder=r.holder,
                    lease_id=r.lease_id,
                    at=r.at_ms / 1000,
                    previous_token=parse_token(r.previous_token),
                    previous_end=r.previous_end,
                    detail=r.detail,
                )
            )
        return events
