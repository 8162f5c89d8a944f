"""The operator's console under ``/console/``: server-rendered pages (Jinja2, every value escaped) over
the same reads as ``reservations requests``, ``show``, ``dead-letters``, ``stock``, ``tokens`` and
``leases``, and the actions an operator takes by hand: re-drive a dead letter (one or many), have the relay
republish a request without an outcome, cancel one, break a SKU's lease. Each action asks for a reason and
is written to the operator action log (reservations.actions) once it took effect, which the console and
``reservations actions`` both show.

It is served only when ``RESERVATIONS_CONSOLE_PASSWORD_FILE`` names a password: HTTP Basic, any user name,
which is recorded as the operator's. A browser sends Basic credentials with every request to the origin,
so each form carries a token derived from the password and the operator's name (a page of another origin
cannot read it), and a write whose token is wrong is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Depends, Form, HTTPException, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPBasic, HTTPBasicCredentials
from starlette.templating import Jinja2Templates

from fencing import AsyncLeaseManager, LeaseInfo
from fencing.manager import MAX_SCOPES_READ
from reservations import AsyncInventory, InvalidRequest
from reservations import validation as valid
from reservations.acceptance import VIEWS
from reservations.actions import checked
from reservations.errors import ReservationError, UnknownReservation, UnknownSku
from reservations.redrives import RedriveLink
from reservations.request_outcomes import AlreadyApplied
from reservations.statuses import RequestStatus
from reservations.timeline import Epoch, epochs
from service.backlog import Backlog
from tasks import ReservationClient

PREFIX = "/console"
REALM = 'Basic realm="reservations console", charset="UTF-8"'
PAGE = 50  # rows per list page: a page answers in one statement whatever the tables hold
_templates = Jinja2Templates(directory=Path(__file__).with_name("templates"))


@dataclass
class Console:
    """What the pages read and act on, built by the app's lifespan."""

    password: str
    inventory: AsyncInventory
    leases: AsyncLeaseManager
    client: ReservationClient
    backlog: Backlog

    def form_token(self, operator: str) -> str:
        return hmac.new(
            self.password.encode(), b"console-form:" + operator.encode(), hashlib.sha256
        ).hexdigest()


def when(at: float | None) -> str:
    """A time as the pages show it: UTC, to the millisecond."""
    if at is None:
        return ""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def ago(at: float | None, now: float | None = None) -> str:
    """How long before ``now`` (this moment by default) ``at`` was, in the largest unit that fits."""
    if at is None:
        return ""
    seconds = max(0.0, (time.time() if now is None else now) - at)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit} ago"
    return f"{seconds:.1f}s ago"


_templates.env.globals.update(when=when, ago=ago)


@dataclass(frozen=True)
class Mark:
    """One shape of a SKU's token timeline, placed on a 0-1000 wide axis."""

    kind: str  # epoch, write, rejected, broken
    x: float
    width: float
    lane: int
    title: str


def timeline_marks(grouped: Sequence[Epoch], now: float) -> tuple[list[Mark], float, float]:
    """Where each epoch, write, refusal and break of a SKU's timeline goes (no I/O: a pure layout the
    template draws as SVG). An epoch runs from its acquire (or first write) to the next epoch's start, or
    to ``now`` while it is the last; lanes alternate so that adjacent epochs stay apart."""
    starts = [e.acquired_at if e.acquired_at is not None else _first_at(e) for e in grouped]
    known = [s for s in starts if s is not None]
    if not known:
        return [], now, now
    start = min(known)
    end = max([now, *known, *(w.at for e in grouped for w in (*e.writes, *e.rejections))])
    span = max(end - start, 1e-3)

    def x(at: float) -> float:
        return round(1000 * (at - start) / span, 1)

    marks: list[Mark] = []
    for n, epoch in enumerate(grouped):
        began = starts[n]
        began = start if began is None else began
        ended = next((s for s in starts[n + 1 :] if s is not None), end)
        label = f"token {epoch.token} · {epoch.holder or 'holder unknown'} · {epoch.ended or 'current'}"
        marks.append(Mark("epoch", x(began), max(x(ended) - x(began), 1.0), n % 2, label))
        if epoch.ended == "broken":
            marks.append(Mark("broken", x(ended), 0, n % 2, f"token {epoch.token}: lease broken"))
        for w in epoch.writes:
            marks.append(Mark("write", x(w.at), 0, n % 2, f"{w.operation} {w.quantity} with token {w.token}"))
        for r in epoch.rejections:
            title = f"{r.operation} with token {r.token} refused: the row had {r.highest_token}"
            marks.append(Mark("rejected", x(r.at), 0, n % 2, title))
    return marks, start, end


def _first_at(epoch: Epoch) -> float | None:
    return min((w.at for w in (*epoch.writes, *epoch.rejections)), default=None)


def _console(request: Request) -> Console:
    """The app's console, which its lifespan built (service.app)."""
    found: Console = request.app.state.console
    return found


Con = Annotated[Console, Depends(_console)]
_basic = HTTPBasic(realm="reservations console", auto_error=False)


def _operator(c: Con, credentials: Annotated[HTTPBasicCredentials | None, Depends(_basic)]) -> str:
    """The operator's name, from HTTP Basic credentials that carry the console's password."""
    if credentials is None or not hmac.compare_digest(credentials.password.encode(), c.password.encode()):
        raise HTTPException(401, "the console's password is asked for", headers={"WWW-Authenticate": REALM})
    name = credentials.username.strip()
    try:
        valid.name(name or None, field="user", max_chars=valid.MAX_WORKER_CHARS)
    except InvalidRequest:
        name = ""
    if not name:
        raise HTTPException(401, "give your name as the user name", headers={"WWW-Authenticate": REALM})
    return name


Operator = Annotated[str, Depends(_operator)]
Reason = Annotated[str, Form()]
FormToken = Annotated[str, Form()]
router = APIRouter(prefix=PREFIX, include_in_schema=False)


def _page(request: Request, c: Console, who: str, template: str, **values: Any) -> HTMLResponse:
    values |= {
        "who": who,
        "form_token": c.form_token(who),
        "done": request.query_params.get("done"),
        "failed": request.query_params.get("failed"),
    }
    return _templates.TemplateResponse(request, template, values)


def _back(path: str, **said: str) -> RedirectResponse:
    """After a write, the page to show (303: the browser asks for it with GET, and a reload does not send
    the form again), with what happened."""
    return RedirectResponse(
        f"{PREFIX}{quote(path)}" + (f"?{urlencode(said)}" if said else ""), status_code=303
    )


def _checked_form(c: Console, who: str, token: str, reason: str) -> str:
    if not hmac.compare_digest(token.encode(), c.form_token(who).encode()):
        raise HTTPException(403, "the form's token is not this operator's: load the page again")
    if not reason.strip():
        raise InvalidRequest("an action needs a reason", field="reason")
    return reason.strip()


@router.get("/")
async def home(who: Operator) -> Response:
    return _back("/requests")


@router.get("/requests")
async def requests(
    request: Request,
    c: Con,
    who: Operator,
    state: str = "",
    operation: str = "",
    since: str = "",
    after: str = "",
    stuck_after: float = 600.0,
) -> HTMLResponse:
    found = await c.inventory.accepted_requests(
        state=state or None,
        operation=operation or None,
        since_ms=_since_ms(since),
        stuck_after=stuck_after,
        after=after or None,
        limit=PAGE,
    )
    filters = {"state": state, "operation": operation, "since": since, "stuck_after": stuck_after}
    following = {**filters, "after": found[-1].key} if len(found) == PAGE else None
    states = [*VIEWS, *sorted(RequestStatus)]
    return _page(
        request, c, who, "requests.html", rows=found, filters=filters, states=states, following=following
    )


@router.get("/requests/{key:path}")
async def one_request(request: Request, c: Con, who: Operator, key: str) -> HTMLResponse:
    inventory = c.inventory
    valid.idempotency_key(key)
    outcome = await inventory.request_outcome(key)
    attempts = await inventory.attempts(key)
    recorded = await inventory.accepted(key)
    try:
        reservation = await inventory.reservation(key)
    except UnknownReservation:
        reservation = None
    if outcome is None and recorded is None and not attempts and reservation is None:
        raise HTTPException(404, f"no request is recorded under {key!r}")
    dead = await inventory.own_outcome(key) if outcome is not None and outcome.redrive else None
    links = await inventory.redrives_of(key) if outcome is not None else []
    own = dead or outcome
    return _page(
        request,
        c,
        who,
        "request.html",
        key=key,
        outcome=outcome,
        dead=dead,
        attempts=attempts,
        recorded=recorded,
        reservation=reservation,
        links=links,
        actions=await inventory.operator_actions(target=key, limit=PAGE),
        can_redrive=own is not None and own.status == "dead_lettered" and _redrivable(links),
        can_republish=outcome is None and recorded is not None and recorded.arguments is not None,
        can_cancel=outcome is None and recorded is not None,
    )


@router.post("/requests/{key:path}/redrive")
async def redrive(c: Con, who: Operator, key: str, reason: Reason, form_token: FormToken) -> Response:
    done = await _redrive(c, key, who, _checked_form(c, who, form_token, reason))
    return _back(f"/requests/{key}", done=done)


@router.post("/requests/{key:path}/republish")
async def republish(c: Con, who: Operator, key: str, reason: Reason, form_token: FormToken) -> Response:
    reason = _checked_form(c, who, form_token, reason)
    recorded = await c.inventory.accepted(valid.idempotency_key(key))
    if recorded is None or recorded.arguments is None:
        return _back(f"/requests/{key}", failed="no request recorded with its arguments: nothing to publish")
    if await c.inventory.request_outcome(key) is not None:
        return _back(f"/requests/{key}", failed="the request has its outcome: nothing to publish")
    checked("republish", key, who, reason)
    # The relay decides, as for every record whose look has come: published again if its message is lost,
    # left alone if the broker still carries it (no flood of copies on a backlog).
    await c.inventory.look_later([key], 0)
    detail = {"publishes": recorded.publishes}
    await c.inventory.record_action("republish", key, by=who, reason=reason, detail=detail)
    return _back(f"/requests/{key}", done="handed to the relay: published again now if its message is lost")


@router.post("/requests/{key:path}/cancel")
async def cancel(c: Con, who: Operator, key: str, reason: Reason, form_token: FormToken) -> Response:
    reason = _checked_form(c, who, form_token, reason)
    checked("cancel", key, who, reason)
    try:
        ended = await c.inventory.cancel_request(valid.idempotency_key(key), by=who, reason=reason)
    except AlreadyApplied:
        return _back(f"/requests/{key}", failed="a worker applied it first: its outcome follows")
    if ended.status != RequestStatus.CANCELLED or ended.detail != {"reason": reason, "by": who}:
        return _back(f"/requests/{key}", failed=f"it ended first: {ended.status}")
    await c.inventory.record_action("cancel", key, by=who, reason=reason)
    return _back(f"/requests/{key}", done="cancelled: a worker reaching it now touches no stock")


@router.get("/dead-letters")
async def dead_letters(
    request: Request, c: Con, who: Operator, since: str = "", reason: str = ""
) -> HTMLResponse:
    since_ms = _since_ms(since)
    found = await c.inventory.dead_letters(
        since=None if since_ms is None else since_ms / 1000, reason=reason or None, limit=PAGE
    )
    filters = {"since": since, "reason": reason}
    return _page(request, c, who, "dead_letters.html", rows=found, filters=filters)


@router.post("/dead-letters/redrive")
async def redrive_many(
    c: Con,
    who: Operator,
    reason: Reason,
    form_token: FormToken,
    key: Annotated[list[str] | None, Form()] = None,
) -> Response:
    reason = _checked_form(c, who, form_token, reason)
    if not key:
        return _back("/dead-letters", failed="no dead letter was chosen")
    said = []
    for one in key:
        try:
            said.append(await _redrive(c, one, who, reason))
        except ReservationError as exc:  # refused (re-driven meanwhile, not dead-lettered): the rest go on
            said.append(f"{one}: {exc}")
    return _back("/dead-letters", done="; ".join(said))


@router.get("/skus")
async def skus(request: Request, c: Con, who: Operator, prefix: str = "", after: str = "") -> HTMLResponse:
    levels = await c.inventory.all_stock(after=after or None, limit=PAGE, prefix=prefix or None)
    held = await _leases_of(c.leases, [level.sku for level in levels])
    following = {"prefix": prefix, "after": levels[-1].sku} if len(levels) == PAGE else None
    filters = {"prefix": prefix}
    return _page(request, c, who, "skus.html", rows=levels, held=held, filters=filters, following=following)


@router.get("/skus/{sku}")
async def one_sku(request: Request, c: Con, who: Operator, sku: str) -> HTMLResponse:
    try:
        level = await c.inventory.stock(valid.sku(sku))
    except UnknownSku:
        raise HTTPException(404, f"no SKU {sku!r}") from None
    grouped = epochs(await c.inventory.timeline(sku, c.leases, limit=1000))
    marks, start, end = timeline_marks(grouped, time.time())
    return _page(
        request,
        c,
        who,
        "sku.html",
        level=level,
        lease=await c.leases.current(valid.scope_of(sku)),
        epochs=list(reversed(grouped)),
        marks=marks,
        span=(start, end),
        actions=await c.inventory.operator_actions(target=sku, limit=PAGE),
    )


@router.post("/skus/{sku}/break-lease")
async def break_lease(c: Con, who: Operator, sku: str, reason: Reason, form_token: FormToken) -> Response:
    reason = _checked_form(c, who, form_token, reason)
    await c.inventory.stock(valid.sku(sku))
    # Checked before the lease is broken: a break whose log entry could not be written is not made.
    checked("break_lease", sku, who, reason)
    ended = await c.leases.break_lease(valid.scope_of(sku), reason=f"{reason} (by {who})")
    if ended is None:
        return _back(f"/skus/{sku}", failed="no lease was held: nothing to break")
    detail = {"token": ended.token, "holder": ended.holder}
    await c.inventory.record_action("break_lease", sku, by=who, reason=reason, detail=detail)
    return _back(f"/skus/{sku}", done=f"lease with token {ended.token} of {ended.holder} broken")


@router.get("/leases")
async def leases(request: Request, c: Con, who: Operator) -> HTMLResponse:
    levels = await c.inventory.all_stock(limit=valid.MAX_LIMIT)
    held = await _leases_of(c.leases, [level.sku for level in levels])
    by_worker: dict[str, list[tuple[str, LeaseInfo]]] = {}
    for sku, info in held.items():
        by_worker.setdefault(_worker_of(info.holder), []).append((sku, info))
    unfinished, oldest = await c.inventory.unfinished()
    return _page(
        request,
        c,
        who,
        "leases.html",
        held=held,
        by_worker=dict(sorted(by_worker.items())),
        depth=c.backlog.depth,
        broker_error=c.backlog.error,
        unfinished=unfinished,
        oldest_unfinished=oldest,
        waiting=await c.inventory.waiting_by_sku(),
        skus_read=len(levels),
    )


@router.get("/actions")
async def actions(
    request: Request, c: Con, who: Operator, target: str = "", before: int | None = None
) -> HTMLResponse:
    found = await c.inventory.operator_actions(target=target or None, before_id=before, limit=PAGE)
    following = {"target": target, "before": found[-1].id} if len(found) == PAGE else None
    filters = {"target": target}
    return _page(request, c, who, "actions.html", rows=found, filters=filters, following=following)


def _since_ms(text: str) -> int | None:
    moment = valid.since_text(text or None)
    return None if moment is None else round(moment * 1000)


def _redrivable(links: Sequence[RedriveLink]) -> bool:
    """A dead letter may be driven again unless its latest re-drive is running or ended otherwise."""
    return not links or links[-1].status == "dead_lettered"


def _worker_of(holder: str) -> str:
    """The worker of a holder named ``host:pid:task id`` (tasks.attempt), or the holder itself."""
    parts = holder.rsplit(":", 1)
    return parts[0] if len(parts) == 2 and parts[0].count(":") >= 1 else holder


async def _leases_of(leases: AsyncLeaseManager, skus: Sequence[str]) -> dict[str, LeaseInfo]:
    """The live leases of ``skus``, by SKU: a round trip per MAX_SCOPES_READ of them."""
    held: dict[str, LeaseInfo] = {}
    for start in range(0, len(skus), MAX_SCOPES_READ):
        scopes = {valid.scope_of(sku): sku for sku in skus[start : start + MAX_SCOPES_READ]}
        found = await leases.current_many(list(scopes))
        held.update({scopes[scope]: info for scope, info in found.items()})
    return held


async def _redrive(console: Console, key: str, who: str, reason: str) -> str:
    """Drive the dead letter ``key`` again (tasks.client: the link recorded, then published) and log it."""
    checked("redrive", key, who, reason)
    handle = await console.client.redrive(valid.idempotency_key(key), by=who)
    await console.inventory.record_action(
        "redrive", key, by=who, reason=reason, detail={"as": handle.key, "task_id": handle.task_id}
    )
    return f"{key} re-driven as {handle.key}"
