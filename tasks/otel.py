"""OpenTelemetry spans for the trace each request carries (``RESERVATIONS_TRACING=otel``), from the
optional ``otel`` extra (opentelemetry-api and -sdk), imported only when asked for: without it the
project imports and works, and a process asked for spans refuses to start, saying what to install.

The HTTP service's span of a request is the parent of each worker's span of it (tasks.tracing carries
its traceparent in the message), so a tracing backend shows one trace across the processes. Spans go to
the process's OpenTelemetry tracer provider: one the deployment set up (``opentelemetry-instrument``, or
its own code) is used as it is; without one, an SDK provider is made whose exporters are those
``OTEL_TRACES_EXPORTER`` names (``console`` ships with the SDK, ``otlp`` with opentelemetry-exporter-otlp;
``none``: spans are made and sent nowhere), resource from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` as the SDK reads them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from importlib.metadata import entry_points
from typing import Any

from tasks import tracing
from tasks.errors import TasksError
from tasks.tracing import Trace

EXPORTERS = "OTEL_TRACES_EXPORTER"
_EXPORTER_GROUP = "opentelemetry_traces_exporter"  # where the SDK and exporter packages name theirs
SCOPE = "reservations"  # the instrumentation scope of our spans


class TracingUnavailable(TasksError):
    """OpenTelemetry spans were asked for and cannot be made here: a worker or the HTTP service refuses to
    start on it, as on a bad setting."""


def switch_on() -> None:
    """Make this process's spans OpenTelemetry's (:data:`tasks.tracing.spans`); TracingUnavailable when the
    otel extra is missing or an exporter ``OTEL_TRACES_EXPORTER`` names cannot be loaded."""
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
    except ImportError as exc:
        raise TracingUnavailable(
            "RESERVATIONS_TRACING=otel needs OpenTelemetry's API and SDK, which are not installed: pip "
            f"install 'fenced-reservations[otel]' ({exc})"
        ) from exc
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):  # nobody set one up: the API's proxy
        provider = _provider(os.environ.get(EXPORTERS, "otlp"))
        trace.set_tracer_provider(provider)
    tracing.spans = _spans(provider.get_tracer(SCOPE))


def flush() -> None:
    """Send the spans this process made: a pool child may end without running the exit hooks."""
    if tracing.spans is not None:
        from opentelemetry import trace

        flushing: Callable[[], object] | None = getattr(trace.get_tracer_provider(), "force_flush", None)
        if flushing is not None:
            flushing()


def _provider(names: str) -> Any:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    for name in (n.strip() for n in names.split(",")):
        if name in ("", "none"):
            continue
        found = entry_points(group=_EXPORTER_GROUP, name=name)
        if not found:
            known = sorted(e.name for e in entry_points(group=_EXPORTER_GROUP))
            raise TracingUnavailable(
                f"{EXPORTERS} names {name!r}, which no installed package provides (installed: "
                f"{', '.join(known) or 'none'}; otlp comes with opentelemetry-exporter-otlp; none for no "
                "exporter)"
            )
        try:
            exporter = next(iter(found)).load()()
        except Exception as exc:
            raise TracingUnavailable(f"the {name} span exporter cannot be made: {exc}") from exc
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _spans(tracer: Any) -> Callable[[str, Trace | None, str], AbstractContextManager[Trace]]:
    from opentelemetry import trace

    kinds = {"server": trace.SpanKind.SERVER, "consumer": trace.SpanKind.CONSUMER}

    @contextmanager
    def span(name: str, parent: Trace | None, kind: str) -> Iterator[Trace]:
        context = None
        if parent is not None:
            remote = trace.SpanContext(
                int(parent.trace_id, 16),
                int(parent.span_id, 16),
                is_remote=True,
                trace_flags=trace.TraceFlags(parent.flags),
            )
            context = trace.set_span_in_context(trace.NonRecordingSpan(remote))
        role = kinds.get(kind, trace.SpanKind.INTERNAL)
        with tracer.start_as_current_span(name, context=context, kind=role) as made:
            own = made.get_span_context()
            yield Trace(f"{own.trace_id:032x}", f"{own.span_id:016x}", int(own.trace_flags))

    return span
