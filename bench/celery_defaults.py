"""A Celery app left at Celery's defaults, for the no-op baselines of the tasks benchmark: only the broker,
the result backend and JSON serialization are set, so its no-op measures Celery itself rather than the
project's settings (late acks, prefetch of one, extended results). Run as ``celery -A bench.celery_defaults``.
"""

from __future__ import annotations

import os

from celery import Celery

BROKER_ENV = "BENCH_CELERY_BROKER_URL"
BACKEND_ENV = "BENCH_CELERY_RESULT_BACKEND"
NOOP = "bench.noop"
NOOP_NO_RESULT = "bench.noop_no_result"


def create_app(broker_url: str | None, result_backend: str | None) -> Celery:
    app = Celery("bench")
    app.conf.update(
        broker_url=broker_url,
        result_backend=result_backend,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
    )
    return app


app = create_app(os.environ.get(BROKER_ENV), os.environ.get(BACKEND_ENV))


@app.task(name=NOOP)  # type: ignore[untyped-decorator]
def noop(value: int = 0) -> int:
    return value


@app.task(name=NOOP_NO_RESULT, ignore_result=True)  # type: ignore[untyped-decorator]
def noop_no_result(value: int = 0) -> int:
    return value
