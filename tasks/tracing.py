"""W3C trace context (https://www.w3.org/TR/trace-context/): one request followed across processes.

A request's ``traceparent`` (``00-<trace id>-<span id>-<flags>``) comes in with its HTTP request (or is
started there), goes out in its Celery message's headers, and is taken up by the worker; each process
makes a span of its own under the one it was handed (:meth:`Trace.child`), so every log line of the
request, in every process, names one trace id (``trace_id``) and the span that wrote it (``span_id``).
A worker's statements may carry it too, as a sqlcommenter comment (:func:`comment_statements`).

Parsing never refuses a request: a malformed ``traceparent`` is ignored and a new trace started, as the
specification says. :data:`current` is the trace of what this thread or task is doing: the HTTP service
sets it for the request it serves, the client puts it into the messages it publishes, the worker sets it
for the request it carries out. What ``RESERVATIONS_TRACING`` adds (the SQL comment, OpenTelemetry spans)
is read here too (:func:`modes`); the OpenTelemetry side lives in :mod:`tasks.otel`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine

__all__ = [
    "HEADER",
    "MODES",
    "Trace",
    "comment_statements",
    "continued",
    "current",
    "hop",
    "modes",
    "parse",
    "started",
    "within",
]

# The name of the HTTP header and of the Celery message header: the same, as the specification names it.
HEADER = "traceparent"
VERSION = "00"
SAMPLED = 0x01
# What RESERVATIONS_TRACING may name, beside the trace carried and logged, which is always on.
SQL, OTEL = "sql", "otel"
MODES = (SQL, OTEL)

# version-traceid-parentid-flags; a later version may append fields after a dash (read no further).
_FIELDS = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?\Z", re.DOTALL)
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16
MAX_HEADER_CHARS = 512  # a traceparent is 55; anything far longer is no traceparent worth reading


def random_hex(chars: int) -> str:
    return os.urandom(chars // 2).hex()


@dataclass(frozen=True, slots=True)
class Trace:
    """A span of one trace: its trace id (32 lower-hex digits), its own span id (16) and its flags."""

    trace_id: str
    span_id: str
    flags: int = SAMPLED

    @property
    def traceparent(self) -> str:
        """The ``traceparent`` that makes this span the parent of the next hop's."""
        return f"{VERSION}-{self.trace_id}-{self.span_id}-{self.flags:02x}"

    def child(self, ids: Callable[[int], str] = random_hex) -> Trace:
        """A span of this process under this one: same trace and sampling, a new span id."""
        return Trace(self.trace_id, _nonzero(ids, 16), self.flags)

    def fields(self) -> dict[str, str]:
        """What each log line of the span carries."""
        return {"trace_id": self.trace_id, "span_id": self.span_id}

    def comment(self) -> str:
        """The span as a sqlcommenter comment (its values need no URL-quoting: hex digits and dashes)."""
        return f"/*{HEADER}='{self.traceparent}'*/"


def _nonzero(ids: Callable[[int], str], chars: int) -> str:
    # An id of only zeros is invalid: drawn again (a chance of 2**-64 per draw).
    while True:
        drawn = ids(chars)
        if drawn.strip("0"):
            return drawn


def parse(value: object) -> Trace | None:
    """The span a ``traceparent`` value names, or None for anything malformed: not a string, upper-case
    hex, a wrong length, an id of zeros, version ``ff``, a version-00 value with anything after its
    flags. A later version is read by its first four fields, as the specification asks."""
    if not isinstance(value, str) or len(value) > MAX_HEADER_CHARS:
        return None
    found = _FIELDS.match(value.strip(" \t"))
    if found is None:
        return None
    version, trace_id, span_id, flags, rest = found.groups()
    if version == "ff" or (version == VERSION and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    # Of the flags only "sampled" is passed on: the others a version-00 sender may not set.
    return Trace(trace_id, span_id, int(flags, 16) & SAMPLED)


def started(ids: Callable[[int], str] = random_hex) -> Trace:
    """The first span of a new trace (sampled: its log lines are written whatever samples spans)."""
    return Trace(_nonzero(ids, 32), _nonzero(ids, 16))


def continued(value: object, ids: Callable[[int], str] = random_hex) -> Trace:
    """This process's span under the ``traceparent`` ``value``, or of a new trace when it is missing or
    malformed."""
    parent = parse(value)
    return started(ids) if parent is None else parent.child(ids)


current: ContextVar[Trace | None] = ContextVar("reservations_trace", default=None)


@contextmanager
def within(trace: Trace) -> Iterator[Trace]:
    """``trace`` is :data:`current` in this block."""
    token = current.set(trace)
    try:
        yield trace
    finally:
        current.reset(token)


# Makes this process's span of a hop (its name, its parent or None, its kind), as a context manager: None
# for ids of our own, OpenTelemetry's spans once :func:`tasks.otel.switch_on` set them.
Spans = Callable[[str, Trace | None, str], AbstractContextManager[Trace]]
spans: Spans | None = None


@contextmanager
def hop(name: str, traceparent: object, *, kind: str) -> Iterator[Trace]:
    """This process's span ``name`` of a request handed ``traceparent`` (a header's value: maybe missing or
    malformed, then a new trace), :data:`current` in the block; ``kind``: ``server`` (the HTTP service)
    or ``consumer`` (a worker)."""
    made = nullcontext(continued(traceparent)) if spans is None else spans(name, parse(traceparent), kind)
    with made as trace, within(trace):
        yield trace


def modes(value: str) -> frozenset[str]:
    """The words of a ``RESERVATIONS_TRACING`` value (comma-separated, any of :data:`MODES`; ``off`` or
    empty: none); ValueError naming what is not one."""
    words = {word.strip().lower() for word in value.split(",")} - {"", "off"}
    unknown = sorted(words - set(MODES))
    if unknown:
        raise ValueError(f"{', '.join(map(repr, unknown))} is not one of {', '.join(MODES)}")
    return frozenset(words)


def _commented(
    conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
) -> tuple[str, Any]:
    trace = current.get()
    return (statement, parameters) if trace is None else (f"{statement} {trace.comment()}", parameters)


def comment_statements(engine: Engine) -> None:
    """Every statement ``engine`` sends while a trace is :data:`current` ends with its sqlcommenter
    comment, as pg_stat_activity and the PostgreSQL log show it. A comment differs per request, so no
    statement's text repeats: psycopg prepares none of them (nor would PgBouncer), and an engine with a
    listener runs the one-statement writes through SQLAlchemy (:func:`fencing.sql.watched`): it costs,
    so it is on only with ``RESERVATIONS_TRACING=sql`` (docs/operations.md, "Tracing")."""
    if not event.contains(engine, "before_cursor_execute", _commented):
        event.listen(engine, "before_cursor_execute", _commented, retval=True)
