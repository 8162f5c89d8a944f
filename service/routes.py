"""The routes, each with every answer it can give declared once: the OpenAPI document lists them, and the
metrics create each route's series for them at 0."""

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, Header, Path, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from reservations import UnknownSku
from reservations.validation import MAX_QUANTITY
from service.answers import (
    ANONYMOUS,
    DEADLINE_HEADER,
    KEY_HEADER,
    PROBLEM_MEDIA_TYPE,
    TYPES,
    Answer,
    Problem,
    caller_space,
    deadline_of,
    location_of,
    new_key,
    problem,
    scoped_key,
    unfit_name,
    wait_of,
)
from service.door import UNANSWERED, Door
from service.metrics import HttpMetrics
from tasks.settings import Settings

log = logging.getLogger("service")
Handler = TypeVar("Handler", bound=Callable[..., Any])
# Readiness: the broker answered a queue sample within this many of the sampler's intervals.
BROKER_SILENT_AFTER = 4
READINESS_KEY = "readiness:probe"
# Retry-After of a caller at its bound of requests in flight: a slot is free as soon as any of its requests
# is answered, which the caller cannot see; a second is how often it looks at a pending request too.
TOO_MANY_RETRY_AFTER = 1
# Strict: JSON's true is no quantity (lax pydantic reads it as 1, false as 0), nor are "2" or 2.0; a
# number of seconds takes an integer still. A wrong type is the 400 of every malformed request.
_BODY = ConfigDict(extra="forbid", strict=True)


class ReservationBody(BaseModel):
    model_config = _BODY
    sku: str = Field(description="the SKU to reserve from", examples=["SKU-1"])
    quantity: int = Field(description="units to reserve", gt=0, le=MAX_QUANTITY, examples=[2])
    hold_for: float | None = Field(
        default=None, description="seconds the hold lasts unconfirmed (the deployment's default: none)"
    )


class CountBody(BaseModel):
    model_config = _BODY
    counted: int = Field(description="units found on hand by the count", ge=0, examples=[40])


class OutcomeModel(BaseModel):
    key: str
    operation: str
    status: str = Field(examples=["reserved"])
    reservation_id: str | None = None
    token: int | None = Field(default=None, description="the fencing token the write was accepted under")
    at: str = Field(description="when the outcome was written (ISO 8601, UTC)")
    detail: dict[str, Any]


class PendingModel(BaseModel):
    key: str
    status: str = Field(examples=["pending"])
    location: str


class ProblemModel(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    title: str
    status: int
    detail: str
    instance: str | None = None


class StockModel(BaseModel):
    sku: str
    on_hand: int
    reserved: int
    available: int
    token: int = Field(description="the highest fencing token the SKU's rows accepted")


def _problems(*names: str) -> dict[int | str, dict[str, Any]]:
    by_status: dict[int, list[str]] = {}
    for name in names:
        by_status.setdefault(TYPES[name].status, []).append(name)
    return {
        status: {
            "model": ProblemModel,
            "content": {PROBLEM_MEDIA_TYPE: {}},
            "description": "; ".join(f"{TYPES[n].uri}: {TYPES[n].title}" for n in found),
        }
        for status, found in by_status.items()
    }


def _outcome(code: int, description: str, *problems: str) -> dict[int | str, dict[str, Any]]:
    """The answers of a route that answers a key's outcome: the outcome, 202 while it has none, problems."""
    return {
        code: {"model": OutcomeModel, "description": description},
        202: {"model": PendingModel, "description": "no outcome yet: look at Location, or send again"},
        **_problems(*problems),
    }


_WRITE = (
    "invalid-request",
    "idempotency-key-missing",
    "idempotency-key-reused",
    "invalid-caller",
    "too-many-requests",
    "unavailable",
    "overloaded",
)
_FINAL = ("invalid-request", "dead-lettered", "expired", "cancelled")
_STEP = ("not-found", "not-reserved", "invalid-transition")
_READ = ("not-found", "invalid-caller", "unavailable", *_FINAL, "insufficient-stock")
RESPONSES: dict[tuple[str, str], dict[int | str, dict[str, Any]]] = {
    ("/reservations", "POST"): _outcome(201, "reserved", *_WRITE, *_FINAL, "insufficient-stock"),
    ("/reservations/{key}", "GET"): _outcome(200, "the key's final outcome", *_READ),
    ("/reservations/{key}/confirm", "POST"): _outcome(200, "confirmed", *_WRITE, *_FINAL, *_STEP),
    ("/reservations/{key}/release", "POST"): _outcome(200, "released", *_WRITE, *_FINAL, *_STEP),
    ("/requests/{key}", "GET"): _outcome(200, "the key's final outcome", *_READ, "invalid-transition"),
    ("/skus/{sku}/count", "POST"): _outcome(200, "counted", *_WRITE, *_FINAL),
    ("/skus/{sku}", "GET"): {
        200: {"model": StockModel, "description": "the SKU's stock"},
        **_problems("not-found", "unavailable"),
    },
    ("/healthz", "GET"): {200: {"description": "the event loop answers"}},
    ("/readyz", "GET"): {
        200: {"description": "the database and the broker answer"},
        503: {"description": "the database or the broker does not answer"},
    },
    ("/metrics", "GET"): {200: {"description": "Prometheus text exposition"}},
    ("/problems/{name}", "GET"): {200: {"description": "a problem type"}, **_problems("not-found")},
}


def measured() -> Iterator[tuple[str, str, list[int]]]:
    """Every route, method and status code it can answer (500 too), for the metrics' zero series."""
    for (route, method), answers in RESPONSES.items():
        yield route, method, sorted({int(code) for code in answers} | {500})


def as_declared(document: dict[str, Any]) -> dict[str, Any]:
    """The OpenAPI document with each route's answers exactly as RESPONSES declares them: not FastAPI's 422
    "Validation Error" (a malformed request is 400, /problems/invalid-request), and a problem's schema under
    the media type it is served as."""
    paths = document.get("paths", {})
    for (route, method), answers in RESPONSES.items():
        operation = paths.get(route, {}).get(method.lower())
        if operation is None:
            continue
        declared = {str(code) for code in answers}
        operation["responses"] = {c: a for c, a in operation["responses"].items() if c in declared}
        for answer in operation["responses"].values():
            # FastAPI puts a response model's schema under the route's JSON media type; a problem is
            # served as application/problem+json only.
            content = answer.get("content", {})
            if PROBLEM_MEDIA_TYPE in content and "application/json" in content:
                content[PROBLEM_MEDIA_TYPE] = content.pop("application/json")
    if "#/components/schemas/HTTPValidationError" not in json.dumps(paths):
        schemas = document.get("components", {}).get("schemas", {})
        for unused in ("HTTPValidationError", "ValidationError"):
            schemas.pop(unused, None)
    return document


KeyHeader = Annotated[
    str | None,
    Header(
        alias=KEY_HEADER,
        description="required: names the request; the same key answers the same request's outcome",
    ),
]
Prefer = Annotated[
    str | None, Header(description="RFC 7240: wait=N seconds for the outcome, or respond-async")
]
Until = Annotated[
    str | None,
    Header(
        alias=DEADLINE_HEADER,
        description="seconds from now after which the request is no longer wanted (default: the "
        "deployment's RESERVATIONS_REQUEST_DEADLINE)",
    ),
]
KeyPath = Annotated[str, Path(description="the Idempotency-Key the request was sent under")]
SkuPath = Annotated[str, Path(description="a SKU")]


def respond(answer: Answer) -> Response:
    return JSONResponse(answer.body, answer.status, answer.headers, media_type=answer.media_type)


class InFlight:
    """Requests in flight per caller space, at most ``bound`` each (0: no bound), counted on the event loop's
    one thread. The door's backpressure bounds the broker's queue for everyone at once: one caller sending
    without pause would fill it; counted from admission to answer, that caller alone is refused (429)."""

    def __init__(self, bound: int) -> None:
        if bound < 0:
            raise ValueError(f"a bound of requests in flight is 0 (none) or more, got {bound}")
        self.bound = bound
        self._held: Counter[str] = Counter()  # only spaces with a request in flight: never grows with callers

    def take(self, space: str) -> bool:
        """Count one more request of ``space`` in flight; False (nothing counted) at ``bound`` already."""
        if self.bound and self._held[space] >= self.bound:
            return False
        self._held[space] += 1
        return True

    def give_back(self, space: str) -> None:
        if self._held[space] <= 0:
            raise ValueError(f"no request of {space!r} is in flight")
        self._held[space] -= 1
        if not self._held[space]:
            del self._held[space]


def _route(api: APIRouter, method: str, path: str, **options: Any) -> Callable[[Handler], Handler]:
    """The route of ``path`` as RESPONSES declares it, a key in it of any characters (``{key:path}``)."""
    served = path.replace("{key}", "{key:path}")
    return api.api_route(served, methods=[method], responses=RESPONSES[(path, method)], **options)


def _space_of(caller: Callable[..., Any] | None) -> Callable[..., Awaitable[str]]:
    """The dependency naming a request's key space: the deployment's caller dependency's name, checked;
    without one, every request's is the anonymous space, with nothing more to solve per request."""
    if caller is None:

        async def anonymous() -> str:
            return ANONYMOUS

        return anonymous

    async def space_of(name: Annotated[object, Depends(caller)]) -> str:
        try:
            return caller_space(name)
        except Problem:
            # The deployment's to fix, and its caller cannot: say what was wrong without the name itself.
            log.warning("403 invalid-caller: the caller dependency returned %s", unfit_name(name))
            raise

    return space_of


def router(
    door: Callable[[], Door], metrics: HttpMetrics, settings: Settings, caller: Callable[..., Any] | None
) -> APIRouter:
    Space = Annotated[str, Depends(_space_of(caller))]
    in_flight = InFlight(settings.http_caller_bound)
    api = APIRouter()

    async def write(
        sent: tuple[str, str | None, str | None, str | None],
        name: str,
        read_at: str,
        args: dict[str, Any],
        under: str | None = None,
    ) -> Response:
        """A route's request carried to its answer under its caller's space and headers (``sent``: the
        space, Idempotency-Key, Prefer and the deadline); ``under``: the key of the reservation a confirm
        or release names. The routes take the headers themselves: a dependency more to solve costs every
        write its share of the event loop."""
        space, own_key, prefer, deadline = sent
        stored, sku_hint = new_key(space, own_key), None
        if under is not None:  # a confirm or release: its own key first, then the reservation it names
            reservation, sku_hint = await door().reservation_under(scoped_key(space, under), shown_key=under)
            args = {"reservation_id": reservation}
        until = deadline_of(deadline, settings.request_deadline, time.time())
        wait = wait_of(prefer, settings.http_wait, settings.http_max_wait)
        if not in_flight.take(space):
            said = "this caller has as many requests in flight here as this service takes from one caller"
            retry = {"Retry-After": str(TOO_MANY_RETRY_AFTER)}
            raise problem("too-many-requests", f"{said} ({in_flight.bound})", headers=retry)
        try:
            answer = await door().submit(
                name,
                stored,
                args,
                caller=space,
                deadline=until,
                wait=wait,
                read_at=read_at,
                sku_hint=sku_hint,
            )
        finally:
            in_flight.give_back(space)
        return respond(answer)

    @_route(api, "POST", "/reservations", status_code=201, summary="Reserve units of a SKU")
    async def reserve(
        body: ReservationBody,
        space: Space,
        own_key: KeyHeader = None,
        prefer: Prefer = None,
        deadline: Until = None,
    ) -> Response:
        sent = (space, own_key, prefer, deadline)
        return await write(sent, "reserve", "/reservations", body.model_dump(exclude_none=True))

    def look(read_at: str, name: str, summary: str) -> None:
        @_route(api, "GET", f"{read_at}/{{key}}", summary=summary, name=name)
        async def outcome(key: KeyPath, space: Space) -> Response:
            stored = scoped_key(space, key)
            return respond(await door().look(stored, shown_key=key, location=location_of(read_at, key)))

    def lifecycle(step: str) -> None:
        summary = f"{step.capitalize()} the reservation made under a key"

        @_route(api, "POST", f"/reservations/{{key}}/{step}", summary=summary, name=step)
        async def change(
            key: KeyPath,
            space: Space,
            own_key: KeyHeader = None,
            prefer: Prefer = None,
            deadline: Until = None,
        ) -> Response:
            return await write((space, own_key, prefer, deadline), step, "/requests", {}, under=key)

    look("/reservations", "outcome", "The outcome of the reservation requested under a key")
    lifecycle("confirm")
    lifecycle("release")
    look("/requests", "request", "The outcome of any request (a confirm, release or count) by its key")

    @_route(api, "POST", "/skus/{sku}/count", summary="Set a SKU's on-hand units to a count, under its lease")
    async def count(
        sku: SkuPath,
        body: CountBody,
        space: Space,
        own_key: KeyHeader = None,
        prefer: Prefer = None,
        deadline: Until = None,
    ) -> Response:
        return await write(
            (space, own_key, prefer, deadline), "count", "/requests", {"sku": sku, "counted": body.counted}
        )

    _reads(api, door, metrics)
    return api


def _reads(api: APIRouter, door: Callable[[], Door], metrics: HttpMetrics) -> None:
    """The routes that change nothing: stock, health, metrics and the problem types."""

    @_route(api, "GET", "/skus/{sku}", summary="A SKU's stock")
    async def stock(sku: SkuPath) -> StockModel:
        try:
            level = asdict(await door().inventory.stock(sku))
        except UnknownSku:
            raise problem("not-found", f"no SKU {sku!r}") from None
        return StockModel(token=level.pop("fence_token"), **level)

    @_route(api, "GET", "/healthz", summary="Liveness")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @_route(api, "GET", "/readyz", summary="Readiness")
    async def readyz() -> Response:
        backlog = door().backlog
        problems = []
        try:
            # A read of the table the door writes first: the database answers and has the door's schema.
            await asyncio.wait_for(door().inventory.accepted(READINESS_KEY), 2.0)
        except UNANSWERED as exc:  # TimeoutError among them
            problems.append(f"database: {(str(exc).splitlines() or [type(exc).__name__])[0]}")
        if not backlog.answered_within(BROKER_SILENT_AFTER * backlog.every):
            problems.append(f"broker: {backlog.error or 'no answer yet'}")
        if problems:
            return respond(Answer(503, {"status": "unready", "problems": problems}, {"Retry-After": "1"}))
        return respond(Answer(200, {"status": "ready", "queue_depth": backlog.depth}))

    @_route(api, "GET", "/metrics", include_in_schema=False, name="metrics")
    async def exposition() -> Response:
        metrics.backlog.set(door().backlog.depth or 0)
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")

    @_route(api, "GET", "/problems/{name}", summary="A problem type")
    async def problem_type(name: str) -> dict[str, Any]:
        found = TYPES.get(name)
        if found is None:
            raise problem("not-found", f"no problem type {name!r}")
        return {"type": found.uri, "title": found.title, "status": found.status, "about": found.about}
