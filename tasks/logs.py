"""Structured logs: with ``RESERVATIONS_LOG_FORMAT=json`` every log line of a worker, beat or the command line
is one JSON object whose fields are its record's ``extra=``. A task binds its request (task id, worker, key,
epoch) once (:func:`bound`), and every record logged while it runs carries them, even one logged deep in
:mod:`fencing`.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from contextvars import ContextVar
from typing import IO, Any

from tasks.settings import json_logs

# Attributes every LogRecord has: whatever else a record carries came from ``extra=`` or a filter.
_STANDARD = frozenset(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}

_request: ContextVar[dict[str, Any] | None] = ContextVar("reservations_request", default=None)


@contextmanager
def bound(**fields: Any) -> Iterator[dict[str, Any]]:
    """Bind request fields to the records logged in this block (this thread or task); the dict yielded
    can be updated as more is known."""
    current = dict(fields)
    token = _request.set(current)
    try:
        yield current
    finally:
        _request.reset(token)


def note(**fields: Any) -> None:
    """Add to the bound request's fields (nothing bound: nothing to add to)."""
    current = _request.get()
    if current is not None:
        current.update(fields)


class RequestFields(logging.Filter):
    """Adds the bound request's fields to a record that does not carry them itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _request.get()
        if fields:
            for name, value in fields.items():
                if not hasattr(record, name):
                    setattr(record, name, value)
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (ISO 8601 UTC), level, logger, message, then every field."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update((k, v) for k, v in record.__dict__.items() if k not in _STANDARD and k not in entry)
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def use_json(handlers: Iterable[logging.Handler]) -> None:
    """Format ``handlers`` as JSON and give their records the bound request's fields."""
    for handler in handlers:
        handler.setFormatter(JsonFormatter())
        if not any(isinstance(f, RequestFields) for f in handler.filters):
            handler.addFilter(RequestFields())


def use_json_on_stderr() -> None:
    """For a process that configures no logging of its own (the command line): JSON lines on stderr."""
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    use_json([handler])
    root.addHandler(handler)
    if root.level == logging.NOTSET or root.level > logging.WARNING:
        root.setLevel(logging.WARNING)


def say(
    message: str,
    *,
    level: int = logging.INFO,
    logger: str = "tasks.worker",
    stream: IO[str] | None = None,
    **fields: Any,
) -> None:
    """One line on stderr whatever the log level (by default the process's real one, past Celery's
    redirection), as JSON with ``RESERVATIONS_LOG_FORMAT=json``: a worker's ready line, what it waits for,
    why it refuses to start, the command line's warnings and errors."""
    if json_logs():
        record = logging.LogRecord(logger, level, "", 0, message, None, None)
        record.__dict__.update(fields)
        message = JsonFormatter().format(record)
    print(message, file=stream or sys.__stderr__ or sys.stderr, flush=True)


def dict_config() -> dict[str, Any]:
    """A ``logging.config.dictConfig`` writing every record as JSON on stderr (uvicorn's ``log_config``)."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "filters": ["request"]}
    own = {"handlers": ["stderr"], "level": "INFO", "propagate": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "filters": {"request": {"()": RequestFields}},
        "handlers": {"stderr": {**handler, "stream": "ext://sys.stderr"}},
        "loggers": {"uvicorn": own, "uvicorn.access": own},
        "root": {"handlers": ["stderr"], "level": "INFO"},
    }


def celery_says_json() -> None:
    """The lines Celery's worker writes past logging from its signal handlers ("worker: Warm shutdown") as
    JSON too, with one ``os.write`` and no lock, as Celery writes them (a logging lock may be held)."""
    import celery.apps.worker

    def safe_say(message: str, f: IO[str] | None = sys.__stderr__) -> None:
        stream = f or sys.__stderr__
        record = logging.LogRecord("celery.worker", logging.WARNING, "", 0, message, None, None)
        line = JsonFormatter().format(record) + "\n"
        if stream is not None and stream.fileno() is not None:
            with suppress(OSError):
                os.write(stream.fileno(), line.encode())

    celery.apps.worker.safe_say = safe_say


def warnings_as_json() -> None:
    """Python warnings (Celery warns of a worker run as root before its logging is set up) as JSON lines on
    stderr, once: not passed on to the root logger, whose handlers would print them again."""
    logging.captureWarnings(True)
    logger = logging.getLogger("py.warnings")
    if not any(isinstance(h.formatter, JsonFormatter) for h in logger.handlers):
        handler = logging.StreamHandler(sys.__stderr__ or sys.stderr)
        use_json([handler])
        logger.addHandler(handler)
        logger.propagate = False
