"""The W3C trace context (tasks.tracing) without services: parsing, every malformed form ignored, a span's
child, the setting; then the SQL comment on a real SQLite engine, the client refusing a malformed
traceparent before anything is recorded, the message's header on a private Redis, OpenTelemetry's spans
(the SDK's in-memory exporter) with the service's span the parent of the worker's, and a process without
OpenTelemetry.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from itertools import chain, repeat
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from reservations import InvalidRequest, Inventory
from tasks import ReservationClient, Settings, SettingsError, create_app, otel, tracing
from tasks.messages import TRACE
from tasks.producer import Producer
from tasks.tracing import Trace, comment_statements, continued, hop, modes, parse, started
from testing.redis_servers import redis_server
from testing.support import queued_messages

# The specification's own example.
EXAMPLE = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
TRACE_ID, SPAN_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
ROOT = Path(__file__).resolve().parent.parent


def test_a_traceparent_is_read_into_its_trace_and_written_back_the_same() -> None:
    found = parse(EXAMPLE)
    assert found == Trace(TRACE_ID, SPAN_ID, 1)
    assert found.traceparent == EXAMPLE
    assert parse(f" {EXAMPLE}\t") == found  # optional whitespace around a header's value
    assert parse(EXAMPLE[:-2] + "00") == Trace(TRACE_ID, SPAN_ID, 0)  # not sampled stays so


@pytest.mark.parametrize(
    "value",
    [
        None,
        7,
        b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "",
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01",  # upper case
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # trace id of zeros
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # span id of zeros
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # the forbidden version
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # a digit short
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-00",  # version 00 has four fields
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",
        "00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
        "0g-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01\n",
        "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x",  # a later version's extra needs its dash
        EXAMPLE + "-" + "0" * 600,
    ],
)
def test_a_malformed_traceparent_is_none(value: object) -> None:
    assert parse(value) is None


def test_a_later_version_is_read_by_its_first_four_fields_and_passed_on_as_version_00() -> None:
    found = parse("cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-what-comes-later")
    assert found == Trace(TRACE_ID, SPAN_ID, 1)  # of the flags only "sampled" is passed on
    assert found.traceparent == EXAMPLE


def ids(*drawn: str) -> Any:
    """Ids drawn in this order, then "ab" repeated, for :func:`started` and :meth:`Trace.child`."""
    source = chain(drawn, repeat(None))
    return lambda chars: next(source) or "ab" * (chars // 2)


def test_a_child_is_of_the_same_trace_with_a_span_of_its_own() -> None:
    parent = parse(EXAMPLE)
    assert parent is not None
    child = parent.child(ids("1" * 16))
    assert (child.trace_id, child.span_id, child.flags) == (TRACE_ID, "1" * 16, 1)
    assert child.fields() == {"trace_id": TRACE_ID, "span_id": "1" * 16}
    assert parent.child().span_id != parent.child().span_id != SPAN_ID


def test_an_id_drawn_all_zeros_is_drawn_again() -> None:
    new = started(ids("0" * 32, "2" * 32, "0" * 16, "3" * 16))
    assert new == Trace("2" * 32, "3" * 16, 1)
    assert parse(new.traceparent) == new


def test_a_missing_or_malformed_traceparent_starts_a_new_trace() -> None:
    assert continued(EXAMPLE, ids("4" * 16)) == Trace(TRACE_ID, "4" * 16, 1)
    for value in (None, "garbage", EXAMPLE.upper()):
        new = continued(value)
        assert new.trace_id != TRACE_ID and parse(new.traceparent) == new


def test_a_hop_is_current_in_its_block_only() -> None:
    assert tracing.current.get() is None
    with hop("POST", EXAMPLE, kind="server") as outer:
        assert tracing.current.get() == outer and outer.trace_id == TRACE_ID
        with hop("reservations.reserve", outer.traceparent, kind="consumer") as inner:
            assert tracing.current.get() == inner and inner.trace_id == TRACE_ID
        assert tracing.current.get() == outer
    assert tracing.current.get() is None


def test_the_comment_is_sqlcommenter_s() -> None:
    assert Trace(TRACE_ID, SPAN_ID).comment() == f"/*traceparent='{EXAMPLE}'*/"


def test_the_setting_names_what_tracing_adds() -> None:
    assert modes("") == modes("off") == frozenset()
    assert modes("SQL, otel") == {"sql", "otel"}
    assert Settings().tracing_modes == frozenset()
    assert Settings.from_env({"RESERVATIONS_TRACING": "sql"}).tracing_modes == {"sql"}
    with pytest.raises(SettingsError, match="RESERVATIONS_TRACING: 'logs' is not one of sql, otel"):
        Settings.from_env({"RESERVATIONS_TRACING": "sql,logs"})


# -- the SQL comment, on a real engine -----------------------------------------------------------------------


def test_statements_carry_the_current_trace_as_a_comment_and_only_then(migrated_sqlite: Path) -> None:
    engine = sa.create_engine(f"sqlite:///{migrated_sqlite}")
    sent: list[str] = []

    @sa.event.listens_for(engine, "after_cursor_execute")
    def seen(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        sent.append(statement)

    comment_statements(engine)
    comment_statements(engine)  # once is enough: a second call adds no second comment
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
        with hop("reservations.reserve", EXAMPLE, kind="consumer") as trace:
            conn.execute(sa.text("SELECT 2"))
    engine.dispose()
    assert sent == ["SELECT 1", f"SELECT 2 {trace.comment()}"]
    assert trace.trace_id == TRACE_ID


# -- the client ----------------------------------------------------------------------------------------------


def test_the_client_refuses_a_malformed_traceparent_before_recording_anything(
    migrated_sqlite: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'inventory.sqlite3'}"
    Path(tmp_path / "inventory.sqlite3").write_bytes(migrated_sqlite.read_bytes())
    # A broker nobody listens on: nothing may be published, and nothing is.
    settings = Settings(
        database_url=url, broker_url="redis://127.0.0.1:9/0", result_backend="redis://127.0.0.1:9/1"
    )
    with ReservationClient(create_app(settings)) as client, Inventory.from_url(url) as inventory:
        for bad in ("garbage", EXAMPLE.upper(), EXAMPLE + "-00"):
            with pytest.raises(InvalidRequest) as refused:
                client.enqueue_reservation_sync("W", 1, idempotency_key="k-trace", traceparent=bad)
            assert refused.value.field == "traceparent" and "W3C traceparent" in str(refused.value)
        assert inventory.accepted("k-trace") is None


def test_a_message_names_its_sender_s_span_in_its_header_and_only_then(tmp_path: Path) -> None:
    sender = Trace(TRACE_ID, SPAN_ID)
    with redis_server(tmp_path / "redis") as server, Producer(server.url(0)) as producer:
        producer.send("restock", "k-traced", {"sku": "W", "quantity": 1}, trace=sender)
        producer.send("restock", "k-untraced", {"sku": "W", "quantity": 1})
        with redis.Redis.from_url(server.url(0)) as broker:
            traced, untraced = (message["headers"] for message in queued_messages(broker))
    assert traced[TRACE] == EXAMPLE and TRACE not in untraced


# -- OpenTelemetry -------------------------------------------------------------------------------------------


@pytest.fixture
def exported() -> Iterator[Any]:
    """The spans this process makes, kept in memory (the SDK's provider is set once per process)."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    otel.switch_on()  # the provider set up already is used as it is
    try:
        yield exporter
    finally:
        tracing.spans = None
        exporter.shutdown()


def test_the_service_s_span_is_the_parent_of_the_worker_s(exported: Any) -> None:
    from opentelemetry.trace import SpanKind

    with hop("POST", EXAMPLE, kind="server") as served:
        message = served.traceparent  # what the message's header carries
    with hop("reservations.reserve", message, kind="consumer") as worked:
        pass
    server, consumer = exported.get_finished_spans()
    assert (server.name, server.kind, consumer.name, consumer.kind) == (
        "POST", SpanKind.SERVER, "reservations.reserve", SpanKind.CONSUMER
    )  # fmt: skip
    assert {server.context.trace_id, consumer.context.trace_id} == {int(TRACE_ID, 16)}
    assert server.parent.span_id == int(SPAN_ID, 16) and server.parent.is_remote
    assert consumer.parent.span_id == server.context.span_id
    # The ids the log lines and the SQL comment carry are the spans' own.
    assert (served.span_id, worked.span_id) == (
        f"{server.context.span_id:016x}", f"{consumer.context.span_id:016x}"
    )  # fmt: skip


def test_without_a_traceparent_the_span_starts_a_trace(exported: Any) -> None:
    with hop("POST", "malformed", kind="server") as served:
        pass
    (span,) = exported.get_finished_spans()
    assert span.parent is None and f"{span.context.trace_id:032x}" == served.trace_id


# Stands in for a machine without the otel extra: its packages cannot be imported.
_NO_OTEL = """
import sys
class NoOpenTelemetry:
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, NoOpenTelemetry())
import tasks, tasks.otel, tasks.request_tasks
from tasks.messages import TRACE
from tasks.producer import Producer
from tasks.tracing import hop
with hop("reservations.reserve", None, kind="consumer") as trace:
    print(trace.trace_id)
try:
    tasks.otel.switch_on()
except tasks.otel.TracingUnavailable as exc:
    print(exc)
"""


def test_without_opentelemetry_everything_imports_and_asking_for_it_is_a_clear_error() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NO_OTEL], capture_output=True, text=True, cwd=ROOT, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    trace_id, refusal = done.stdout.splitlines()
    assert len(trace_id) == 32
    assert refusal.startswith("RESERVATIONS_TRACING=otel needs OpenTelemetry's API and SDK, which are not")
    assert "pip install 'fenced-reservations[otel]'" in refusal


def test_an_exporter_nobody_installed_is_a_clear_error() -> None:
    from opentelemetry.sdk.trace import TracerProvider

    with pytest.raises(otel.TracingUnavailable, match="'no-such-exporter', which no installed package"):
        otel._provider("console,no-such-exporter")
    assert isinstance(otel._provider("none"), TracerProvider)
