"""The HTTP section's baseline server: the same stack as the front door (FastAPI on uvicorn with uvloop and
httptools, one process) whose one route takes the same JSON body and answers once a Celery no-op round
trip is done, with nothing of the project's in between.

``POST /noop`` publishes the project worker's ``reservations.noop`` through a plain Celery app (send_task
on the broker, from one publishing thread, as the front door publishes from one) and awaits the task's
result without blocking the loop: the worker's Redis result backend publishes every result on a channel
named after its key, and one pattern subscription, made before the server takes its first request, hands
each result to the future its handler awaits. That is the least a handler can do to await a Celery task
from asyncio: no polling, one subscription for every task. The Celery app has no result backend of its own,
so ``send_task`` subscribes to nothing and Celery's own result consumer never runs.

``POST /raw`` is the same handler around the physical reference for a reservation task
(:mod:`bench.raw_tasks`: a plain lock and one raw statement writing a reservation's rows, no fence and no
idempotency), published to that task's own worker on :data:`RAW_BROKER_ENV`, keyed by the request's
``Idempotency-Key``: a front door that does strictly less than the service, so its ratio shows what this
machine allows a front door whose worker writes a reservation.

Run as ``uvicorn bench.http_baseline:create_app --factory`` with :data:`BROKER_ENV`, :data:`BACKEND_ENV`
and :data:`RAW_BROKER_ENV` set.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, suppress
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from celery import Celery
from fastapi import FastAPI, Header
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from bench.raw_tasks import RAW_RESERVE

BROKER_ENV = "BENCH_HTTP_BROKER_URL"
BACKEND_ENV = "BENCH_HTTP_RESULT_BACKEND"
RAW_BROKER_ENV = "BENCH_HTTP_RAW_BROKER_URL"
NOOP = "reservations.noop"
# Celery's Redis result backend stores a result under this prefix and the task id, and publishes it on a
# channel of the same name.
RESULT_PREFIX = "celery-task-meta-"
RESULT_TIMEOUT = 60.0


class NoopBody(BaseModel):
    """The front door's reservation body, parsed the same way (the SKU is carried, not used)."""

    model_config = ConfigDict(extra="forbid")
    sku: str
    quantity: int = Field(gt=0)
    hold_for: float | None = None


class Results:
    """Every task result the worker publishes, handed to the future awaiting its task id."""

    def __init__(self, url: str) -> None:
        self.redis = aioredis.Redis.from_url(url)
        self.waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}

    async def subscribe(self) -> Any:
        pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
        await pubsub.psubscribe(f"{RESULT_PREFIX}*")
        return pubsub

    async def run(self, pubsub: Any) -> None:
        skip = len(RESULT_PREFIX)
        async for message in pubsub.listen():
            if message.get("type") != "pmessage":
                continue
            future = self.waiting.pop(message["channel"][skip:].decode(), None)
            if future is not None and not future.done():
                future.set_result(json.loads(message["data"]))

    async def close(self) -> None:
        await self.redis.aclose()


def create_app() -> FastAPI:
    broker_url = os.environ[BROKER_ENV]
    backend_url = os.environ[BACKEND_ENV]
    celery = Celery("bench-http-baseline", broker=broker_url)
    celery.conf.update(task_serializer="json", accept_content=["json"])
    raw = Celery("bench-http-raw", broker=os.environ[RAW_BROKER_ENV])
    raw.conf.update(task_serializer="json", accept_content=["json"])
    publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
    results = Results(backend_url)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        pubsub = await results.subscribe()  # before the first request: no result can come unheard
        listener = asyncio.create_task(results.run(pubsub), name="results")
        try:
            yield
        finally:
            listener.cancel()
            with suppress(asyncio.CancelledError):
                await listener
            await pubsub.aclose()
            await results.close()
            publisher.shutdown(wait=True)
            celery.close()
            raw.close()

    app = FastAPI(title="bench baseline", lifespan=lifespan)

    async def round_trip(send: partial[Any], task_id: str) -> JSONResponse:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[dict[str, Any]] = loop.create_future()
        results.waiting[task_id] = done
        try:
            await loop.run_in_executor(publisher, send)
            meta = await asyncio.wait_for(done, RESULT_TIMEOUT)
        finally:
            results.waiting.pop(task_id, None)
        return JSONResponse({"task_id": task_id, "status": meta["status"], "result": meta["result"]}, 201)

    @app.post("/noop", status_code=201)
    async def noop(body: NoopBody) -> JSONResponse:
        task_id = str(uuid.uuid4())
        return await round_trip(
            partial(celery.send_task, NOOP, args=[body.quantity], task_id=task_id), task_id
        )

    @app.post("/raw", status_code=201)
    async def raw_reserve(body: NoopBody, idempotency_key: str = Header()) -> JSONResponse:
        task_id = str(uuid.uuid4())
        args = [body.sku, body.quantity, idempotency_key]
        return await round_trip(partial(raw.send_task, RAW_RESERVE, args=args, task_id=task_id), task_id)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return app
