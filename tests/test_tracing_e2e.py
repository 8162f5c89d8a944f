"""One request followed across processes: ``reservations serve`` and a real ``celery worker`` with JSON logs
and ``RESERVATIONS_TRACING=sql``, on SQLite and PostgreSQL. A request sent with a known ``traceparent`` is
answered with the service's span of that trace; the service's log line and the worker's event lines of
that request name the trace, each with its own span; and on PostgreSQL the statement that wrote the stock
row carried the worker's span as its sqlcommenter comment, as the server saw it (a trigger keeps
``current_query()``: the text the server received, comment included). A malformed ``traceparent``, or
none, starts a new trace instead. And a worker asked for OpenTelemetry spans it cannot export refuses to
start.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from fencing import LeaseManager
from fencing.engines import make_engine
from reservations import Inventory
from reservations import validation as valid
from tasks.tracing import parse
from testing.celery_processes import worker_env
from testing.harness import free_port, tls, wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.service_process import ServiceProcess
from testing.support import refused_worker
from testing.workers import Cluster, cluster, migrated_database

pytestmark = pytest.mark.slow

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
WAIT = {"Prefer": "wait=20"}

# Every statement that changes stock rows, as PostgreSQL received it.
_NOTE_STATEMENTS = """
CREATE TABLE traced_statements (query text NOT NULL);
CREATE FUNCTION note_statement() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO traced_statements VALUES (current_query());
    RETURN NULL;
END $$;
CREATE TRIGGER note_stock_writes AFTER UPDATE ON stock FOR EACH STATEMENT EXECUTE FUNCTION note_statement();
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@dataclass
class Traced:
    kind: str
    url: str
    service: ServiceProcess
    cluster: Cluster
    inventory: Inventory

    def worker_lines(self, key: str) -> list[dict[str, Any]]:
        """The worker's lines naming the caller's ``key`` (stored in the anonymous caller's space)."""
        lines = _json_lines(self.cluster.workers[0].log_path)
        return [line for line in lines if str(line.get("key")).endswith(f":{key}")]

    def service_lines(self, span_id: str) -> list[dict[str, Any]]:
        return [line for line in _json_lines(self.service.log_path) if line.get("span_id") == span_id]

    def statements(self) -> list[str]:
        engine = make_engine(self.url)
        try:
            with engine.connect() as conn:
                return list(conn.execute(sa.text("SELECT query FROM traced_statements")).scalars())
        finally:
            engine.dispose()


def _json_lines(path: Path) -> list[dict[str, Any]]:
    lines = []
    for text in path.read_text(errors="replace").splitlines():
        if text.startswith("{"):
            lines.append(json.loads(text))
    return lines


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def traced(
    request: pytest.FixtureRequest,
    server: RedisServer,
    migrated_sqlite: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Traced]:
    kind: str = request.param
    workdir = tmp_path_factory.mktemp(f"tracing_{kind}")
    db = 0 if kind == "sqlite" else 2
    with migrated_database(kind, workdir, migrated_sqlite) as url, ExitStack() as stack:
        if kind == "postgresql":
            engine = make_engine(url)
            with engine.begin() as conn:
                conn.exec_driver_sql(_NOTE_STATEMENTS)
            engine.dispose()
        settings = {
            "RESERVATIONS_BROKER_URL": server.url(db),
            "RESERVATIONS_RESULT_BACKEND": server.url(db + 1),
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_LOG_FORMAT": "json",
            "RESERVATIONS_TRACING": "sql",
            # A request finding its SKU's lease busy is dead-lettered at once: a logged request event.
            "RESERVATIONS_MAX_RETRIES": "0",
            "RESERVATIONS_BATCHING": "0",
        }
        reservations = str(Path(sys.executable).parent / "reservations")
        port = free_port()
        command = [reservations, "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
        service = ServiceProcess("service", command, worker_env(settings), workdir / "service.log", port)
        stack.callback(service.stop)
        service.start()  # its imports overlap the worker's start
        running = stack.enter_context(cluster(workdir, settings, count=1, prefix=f"tr{kind[:2]}"))
        service.wait_ready("/readyz")
        inventory = stack.enter_context(Inventory.from_url(url))
        yield Traced(kind, url, service, running, inventory)


def _key(stem: str) -> str:
    return f"{stem}-{random.randrange(1 << 40):x}"


def _sku(traced: Traced, stem: str) -> str:
    sku = _key(stem)
    traced.inventory.add_sku(sku, on_hand=10)
    return sku


def _reserve(traced: Traced, sku: str, key: str, traceparent: str | None) -> httpx.Response:
    headers = {
        "Idempotency-Key": key,
        **WAIT,
        **({} if traceparent is None else {"traceparent": traceparent}),
    }
    body = {"sku": sku, "quantity": 2}
    return httpx.post(
        f"{traced.service.url}/reservations", json=body, headers=headers, timeout=30, verify=tls()
    )


def test_a_request_is_followed_from_the_caller_through_the_service_to_the_worker_and_its_statement(
    traced: Traced,
) -> None:
    key = _key("traced")
    answer = _reserve(traced, _sku(traced, "T"), key, CALLER)
    assert answer.status_code == 201, answer.text
    served = parse(answer.headers["traceparent"])
    assert served is not None and served.trace_id == TRACE_ID and served.span_id != CALLER.split("-")[2]
    # The service's own line of the request (uvicorn's access line) names the trace and its span.
    (line,) = wait_until(
        lambda: traced.service_lines(served.span_id), timeout=10, what="the service's line of the request"
    )
    assert line["trace_id"] == TRACE_ID and line["logger"] == "uvicorn.access"
    if traced.kind == "postgresql":
        # The worker's statement that reserved the units carried its span, under the service's.
        # (A trigger's own update of the row is noted under the statement that fired it: the same text.)
        (statement,) = {s for s in traced.statements() if TRACE_ID in s}
        comment = statement[statement.index("/*traceparent=") :]
        worker = parse(comment.removeprefix("/*traceparent='").removesuffix("'*/"))
        assert worker is not None and worker.trace_id == TRACE_ID
        assert worker.span_id not in (served.span_id, CALLER.split("-")[2])


def test_a_worker_s_event_lines_of_a_request_name_its_trace(traced: Traced) -> None:
    """A reservation whose SKU's lease is held elsewhere is dead-lettered (no retries here): its worker's
    event line carries the trace the service handed on, with the worker's own span."""
    sku, key = _sku(traced, "H"), _key("held")
    with (
        LeaseManager.from_url(traced.cluster.lease_url) as leases,
        leases.hold(valid.scope_of(sku), ttl=30, holder="test:holder"),
    ):
        answer = _reserve(traced, sku, key, CALLER)
    assert answer.status_code == 503, answer.text
    served = parse(answer.headers["traceparent"])
    assert served is not None
    lines = wait_until(lambda: traced.worker_lines(key), timeout=10, what="the worker's lines of the request")
    assert {line["event"] for line in lines} == {"dead_lettered"}
    assert {(line["trace_id"], len(line["span_id"])) for line in lines} == {(TRACE_ID, 16)}
    assert served.span_id not in {line["span_id"] for line in lines}


def test_a_malformed_or_missing_traceparent_starts_a_new_trace(traced: Traced) -> None:
    for sent in ("00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01", "garbage", None):
        answer = _reserve(traced, _sku(traced, "N"), _key("new"), sent)
        assert answer.status_code == 201, answer.text
        new = parse(answer.headers["traceparent"])
        assert new is not None and new.trace_id != TRACE_ID
        if traced.kind == "postgresql":
            assert any(new.trace_id in statement for statement in traced.statements())


def test_a_worker_asked_for_spans_it_cannot_export_refuses_to_start(
    migrated_sqlite: Path, tmp_path: Path
) -> None:
    """Exit 2 and one line naming the exporter, before the pool forks (the otel extra missing altogether
    says what to install: tests/test_tracing.py)."""
    database = tmp_path / "inventory.sqlite3"
    database.write_bytes(migrated_sqlite.read_bytes())
    settings = {
        "RESERVATIONS_DATABASE_URL": f"sqlite:///{database}",
        "RESERVATIONS_BROKER_URL": f"sqla+sqlite:///{tmp_path / 'broker.sqlite3'}",
        "RESERVATIONS_RESULT_BACKEND": f"db+sqlite:///{tmp_path / 'results.sqlite3'}",
        "RESERVATIONS_TRACING": "otel",
    }
    done = refused_worker({**worker_env(settings), "OTEL_TRACES_EXPORTER": "no-such-exporter"})
    assert done.returncode == 2, done.stderr + done.stdout
    assert "Traceback" not in done.stderr + done.stdout
    (line,) = [line for line in done.stderr.splitlines() if line.startswith("reservations:")]
    assert "OTEL_TRACES_EXPORTER names 'no-such-exporter', which no installed package provides" in line
