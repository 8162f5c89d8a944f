"""The app factory: :func:`create_app` builds the FastAPI app of the reservation front door, which
``reservations serve`` runs under uvicorn (``service:create_app``, one app per worker process)."""

from __future__ import annotations

import asyncio
import gc
import signal
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from functools import cache
from types import FrameType
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fencing import AsyncLeaseManager
from reservations import AsyncInventory, InvalidRequest
from service import console, routes
from service.answers import PROBLEM_MEDIA_TYPE, TYPES, Answer, Problem, problem
from service.backlog import Backlog
from service.door import UNANSWERED, Door, unavailable
from service.metrics import HttpMetrics
from tasks import ReservationClient, logs, otel, tracing
from tasks import create_app as create_tasks_app
from tasks.settings import Settings, SettingsError, read_password_file, variable
from tasks.worker import leave_start_out_of_collections

Caller = Callable[..., Any]  # a FastAPI dependency returning the caller's name (str) or None (anonymous)
# A request holds a database connection while it is admitted or looked up, dozens at once: SQLAlchemy's
# default pool closes its 10 overflow connections when returned (a PostgreSQL connection opened per request
# under load). Keep all 15, the default's peak; a request beyond them waits for one (pool_timeout, 30 s).
DOOR_POOL: dict[str, Any] = {"pool_size": 15, "max_overflow": 0}
# The problem types of the statuses the framework or a caller dependency raises.
_BY_STATUS = {401: "unauthorized", 403: "forbidden", 404: "not-found", 405: "method-not-allowed"}


def _measured(app: ASGIApp, metrics: HttpMetrics) -> ASGIApp:
    """Counts and times every answer by route template (never the path: a key or SKU is no label)."""

    async def measured(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        start = time.perf_counter()
        code = 500

        async def sent(message: Message) -> None:
            nonlocal code
            if message["type"] == "http.response.start":
                code = message["status"]
            await send(message)

        metrics.in_flight.inc()
        try:
            await app(scope, receive, sent)
        finally:
            metrics.in_flight.dec()
            # The template without converters ({key}, not {key:path}): the label RESPONSES declares.
            template = getattr(scope.get("route"), "path_format", None) or "unmatched"
            metrics.requests.labels(template, scope["method"], str(code)).inc()
            metrics.latency.labels(template, scope["method"]).observe(time.perf_counter() - start)

    return measured


def _traced(app: ASGIApp) -> ASGIApp:
    """Each request in a span of this service under the caller's ``traceparent`` (a malformed or missing
    one starts a new trace, never an error): current while it is served, so its message carries it to the
    worker and its log lines (uvicorn's access line too) name it; the answer's ``traceparent`` header
    names it to the caller."""

    async def traced(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        header = tracing.HEADER.encode()
        sent_by = next((v.decode("latin-1") for k, v in scope["headers"] if k.lower() == header), None)
        with (
            tracing.hop(scope["method"], sent_by, kind="server") as trace,
            logs.bound(**trace.fields()),
        ):
            answered = [(header, trace.traceparent.encode())]

            async def sent(message: Message) -> None:
                if message["type"] == "http.response.start":
                    message["headers"] = [*message.get("headers", ()), *answered]
                await send(message)

            await app(scope, receive, sent)

    return traced


async def _error(request: Request, exc: Exception) -> Response:
    """Every error under the app as a problem document; what the framework or a caller dependency raises
    (unknown paths and methods, 401, 403) keeps its headers (Allow, WWW-Authenticate)."""
    if isinstance(exc, Problem):
        found = exc
    elif isinstance(exc, RequestValidationError):
        errors = [
            {"where": ".".join(str(p) for p in error.get("loc", ())), "message": error.get("msg", "")}
            for error in exc.errors()
        ]
        found = problem("invalid-request", "the request is malformed", errors=errors)
    elif isinstance(exc, InvalidRequest):
        found = problem("invalid-request", str(exc), field=exc.field)
    elif isinstance(exc, HTTPException):
        name = _BY_STATUS.get(exc.status_code)
        headers = dict(exc.headers or {})
        if name is None:
            body = {"type": "about:blank", "title": exc.detail, "status": exc.status_code}
            return routes.respond(Answer(exc.status_code, body, headers, PROBLEM_MEDIA_TYPE))
        detail = exc.detail if isinstance(exc.detail, str) else TYPES[name].title
        found = problem(name, detail, headers=headers)
    else:
        return routes.respond(unavailable(exc))
    return routes.respond(found.answer(request.url.path))


def _drain_on_stop(door: Door, loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Chain a handler before the server's own for SIGINT and SIGTERM that drains the door: uvicorn stops
    accepting and waits for every request in flight, and a drained door answers its waiting ones at once
    instead of at the end of their waits. Returns what puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None  # signals reach the main thread only (an app served from another thread)
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def stopping(sig: int, frame: FrameType | None) -> None:
        loop.call_soon_threadsafe(door.drain)
        prior = previous[signal.Signals(sig)]
        if callable(prior):
            prior(sig, frame)

    for sig in previous:
        signal.signal(sig, stopping)

    def restore() -> None:
        for sig, prior in previous.items():
            if signal.getsignal(sig) is stopping:
                signal.signal(sig, prior)

    return restore


def create_app(settings: Settings | None = None, *, caller: Caller | None = None) -> FastAPI:
    """The front door's app, on ``settings`` (the environment's by default)."""
    settings = settings or Settings.from_env()
    if tracing.OTEL in settings.tracing_modes:
        otel.switch_on()  # TracingUnavailable without the otel extra: the service does not start
    metrics = HttpMetrics(routes.measured())
    state: dict[str, Door] = {}
    # Read at start: a console whose password cannot be read is a deployment's mistake to see at once.
    password = None
    if settings.console_password_file:
        name = variable("console_password_file").name
        password = read_password_file(name, settings.console_password_file).removesuffix("\n")
        if not password:
            raise SettingsError(f"{name}: {settings.console_password_file} holds no password")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks_app = create_tasks_app(settings)
        client = ReservationClient(tasks_app)
        inventory = AsyncInventory.from_url(
            settings.database_url, pooling=settings.database_pooling, **DOOR_POOL
        )
        backlog = Backlog(tasks_app.connection_for_read, tasks_app.conf.task_default_queue)
        sampler = asyncio.create_task(backlog.run(), name="backlog")
        state["door"] = found = Door(
            client, inventory, backlog, queue_bound=settings.queue_bound, overloaded=metrics.refused.inc
        )
        leases = None
        if password is not None:
            # The leases' own database pooling where they live in the inventory's database.
            options: dict[str, Any] = {}
            if settings.lease_url == settings.database_url:
                options["pooling"] = settings.database_pooling
            leases = AsyncLeaseManager.from_url(settings.lease_url, prefix=settings.lease_prefix, **options)
            app.state.console = console.Console(password, inventory, leases, client, backlog)
        restore = _drain_on_stop(found, asyncio.get_running_loop())
        leave_start_out_of_collections()
        try:
            yield
        finally:
            gc.unfreeze()
            restore()
            if leases is not None:
                await leases.close()
            # uvicorn calls this once every connection has had its answer: nothing is waiting to be
            # published (a handler returns only after its request went out, or was refused).
            sampler.cancel()
            with suppress(asyncio.CancelledError):
                await sampler
            backlog.close()
            await client.aclose()
            await inventory.close()

    app = FastAPI(
        title="Reservations",
        summary="Fenced inventory reservations over HTTP: idempotent, deadline-bound, honest about pending.",
        version="1",
        lifespan=lifespan,
    )

    def door() -> Door:
        return state["door"]

    for kind in (Problem, RequestValidationError, InvalidRequest, HTTPException, *UNANSWERED):
        app.add_exception_handler(kind, _error)

    app.include_router(routes.router(door, metrics, settings, caller))
    if password is not None:
        app.include_router(console.router)
    build = app.openapi
    app.openapi = cache(lambda: routes.as_declared(build()))  # type: ignore[method-assign]
    app.add_middleware(_measured, metrics=metrics)
    app.add_middleware(_traced)
    return app
