"""Operators see fencing at work, through real ``celery worker`` processes, a private Redis broker and
leases, and PostgreSQL: task events whose states name each outcome (a request whose write was refused as
stale shows LOST_OWNERSHIP, then its final state with epochs >= 1), while ``AsyncResult.get()`` still
returns the outcome dict; JSON log lines whose fields carry each fencing event's facts; Prometheus metrics
served by each worker and, from the database, by ``reservations metrics``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa
from celery.events.state import State

from fencing import LeaseManager
from reservations import Inventory, schema
from reservations.models import sku_history
from reservations.request_outcomes import request_id
from tasks.logs import use_json_on_stderr
from tasks.producer import request_of
from testing.celery_processes import worker_env
from testing.compose import resolved
from testing.harness import free_port, wait_until
from testing.observed import (
    TIMEOUT,
    TTL,
    Cluster,
    cluster,
    sample,
    samples_of,
    scraped,
    stale_write,
)
from testing.redis_servers import RedisServer, redis_server
from testing.service_process import front_door
from testing.stores import migrate_pg_schema, schema_of
from testing.support import run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module")
def running(server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("observed"), server) as started:
        yield started


# -- Celery states ---------------------------------------------------------------------------------------


def test_each_outcome_has_its_own_state_and_get_still_returns_the_outcome(running: Cluster) -> None:
    run = running
    run.inventory.add_sku("OBS-P", on_hand=10)
    run.inventory.add_sku("OBS-S", on_hand=1)
    run.inventory.add_sku("OBS-D", on_hand=1)
    handles = {
        "RESERVED": run.client.enqueue_reservation_sync("OBS-P", 1, idempotency_key="obs-reserved"),
        "INSUFFICIENT_STOCK": run.client.enqueue_reservation_sync("OBS-S", 5, idempotency_key="obs-short"),
        "INVALID": run.client.enqueue_reservation_sync("OBS-NONE", 1, idempotency_key="obs-invalid"),
    }
    # A restock that finds its SKU's lease held (by this test) is dead-lettered: no busy retries allowed.
    with run.leases.hold("sku:OBS-D", ttl=30, holder="test:holder"):
        handles["DEAD_LETTERED"] = run.client.enqueue_sync(
            "restock", idempotency_key="obs-dead", sku="OBS-D", quantity=1
        )
        assert run.result(handles["DEAD_LETTERED"]).status == "dead_lettered"

    for state, handle in handles.items():
        outcome = run.result(handle)
        assert outcome.status == state.lower()
        assert run.events.final_state(handle.task_id, state) == state
        (final,) = [e for e in run.events.of(handle.task_id) if e["type"] == f"task-{outcome.status}"]
        assert (final["outcome"], final["epochs"]) == (outcome.status, 0)
        assert f"'status': '{outcome.status}'" in final["result"]
        assert final["runtime"] > 0
        # Celery's own success event is replaced by the named one, never sent beside it.
        assert "task-succeeded" not in [e["type"] for e in run.events.of(handle.task_id)]
        # The result backend still says SUCCESS with the outcome dict: get() returns it.
        result = run.app.AsyncResult(handle.task_id)
        got = result.get(timeout=TIMEOUT)
        assert result.state == "SUCCESS" and result.ready()
        assert (got["status"], got["key"], got["epochs"]) == (outcome.status, outcome.key, 0)


def test_a_stale_write_shows_lost_ownership_then_the_redriven_outcome(running: Cluster) -> None:
    run = running
    stale = stale_write(run, "OBS-Q")
    assert stale.late.status == "reserved" and stale.late.epochs == 1
    task_id = request_id("OBS-Q-late")

    assert run.events.final_state(task_id, "RESERVED") == "RESERVED"
    kinds = [e["type"] for e in run.events.of(task_id)]
    assert "task-lost_ownership" in kinds and kinds[-1] == "task-reserved", kinds
    assert kinds.index("task-lost_ownership") < kinds.index("task-reserved")
    (lost,) = [e for e in run.events.of(task_id) if e["type"] == "task-lost_ownership"]
    assert {k: lost[k] for k in ("scope", "token", "highest", "lost_by", "epoch", "key")} == {
        "scope": "sku:OBS-Q",
        "token": stale.paused_token,
        "highest": stale.winner.detail["token"],
        "lost_by": "StaleToken",
        "epoch": 0,
        "key": "OBS-Q-late",
    }
    assert lost["holder"] == f"{socket.gethostname()}:{stale.paused_child}:{task_id}"
    assert lost["lease_id"] and "driven again in epoch 1" in lost["exception"]
    (final,) = [e for e in run.events.of(task_id) if e["type"] == "task-reserved"]
    assert final["epochs"] == 1

    # Between the two, Flower's state machine shows LOST_OWNERSHIP: replay the events up to the retry.
    state = State()
    for event in run.events.copy():
        state.event(event)
        if event.get("uuid") == task_id and event["type"] == "task-lost_ownership":
            break
    assert state.tasks[task_id].state == "LOST_OWNERSHIP"

    got = run.app.AsyncResult(task_id).get(timeout=TIMEOUT)
    assert (got["status"], got["epochs"]) == ("reserved", 1)


def paused_writes(results: redis.Redis) -> int:
    """How many clients wait for ``CLIENT PAUSE ... WRITE`` to end with a write of the result backend."""
    return sum(1 for c in results.client_list() if "b" in c["flags"] and c["cmd"] == "setex")


def test_the_attempt_that_lost_never_replaces_the_redriven_result(tmp_path: Path) -> None:
    """The attempt that lost ownership publishes its retry before it has ended, and another worker may run
    the retry to its end before it does. Whatever the losing attempt stores once its retry is out can land
    after the final SUCCESS and replace it for good (the result backend's look for SUCCESS and its write
    are two commands), and AsyncResult.get() then never returns. Scripted: the losing attempt stops just
    after publishing its retry; the retry stops after its write; the result backend holds writes (CLIENT
    PAUSE WRITE lets reads through and replays held writes in arrival order) while the retry stores its
    SUCCESS first and the losing attempt ends second."""
    spec = "in_write=stop,once;retry_published=stop,once;after_write=stop,once"
    with (
        redis_server(tmp_path / "redis") as server,
        redis_server(tmp_path / "results") as backend,
        cluster(
            tmp_path / "cluster",
            server,
            RESERVATIONS_RESULT_BACKEND=backend.url(0),
            RESERVATIONS_FAILPOINTS=spec,
        ) as run,
        redis.Redis.from_url(backend.url(0)) as results,
    ):
        run.inventory.add_sku("OBS-R", on_hand=10)
        task_id = request_id("OBS-R-late")
        run.arm("in_write")
        late = run.client.enqueue_reservation_sync("OBS-R", 2, idempotency_key="OBS-R-late")
        lost = wait_until(run.stopped_child, timeout=TIMEOUT, what="a worker to stop inside its write")
        stopped = [lost]
        try:
            wait_until(
                lambda: run.leases.current("sku:OBS-R") is None,
                timeout=TIMEOUT,
                what="the stopped holder's lease to run out",
            )
            winner = run.client.enqueue_reservation_sync("OBS-R", 3, idempotency_key="OBS-R-winner")
            assert run.result(winner).status == "reserved"
            run.arm("retry_published")
            run.arm("after_write")
            os.kill(lost, signal.SIGCONT)

            def both_stopped() -> int | None:
                # The losing attempt stops after publishing its retry, the retry after its write.
                children = {w.stopped_child() for w in run.workers}
                others = children - {lost, None}
                return others.pop() if lost in children and others else None

            retry = wait_until(both_stopped, timeout=TIMEOUT, what="both attempts to stop")
            stopped.append(retry)
            results.execute_command("CLIENT", "PAUSE", int(TIMEOUT * 1000), "WRITE")
            try:
                os.kill(retry, signal.SIGCONT)
                wait_until(lambda: paused_writes(results) == 1, timeout=TIMEOUT, what="the retry's SUCCESS")
                os.kill(lost, signal.SIGCONT)

                def lost_attempt_ended() -> bool:
                    # Celery logs a retry once it has handled it, after whatever it stores for it.
                    return paused_writes(results) == 2 or any(
                        r["logger"] == "celery.app.trace"
                        and r.get("data", {}).get("id") == task_id
                        and " retry: " in r["message"]
                        for r in run.log_records()
                    )

                wait_until(lost_attempt_ended, timeout=TIMEOUT, what="the losing attempt to end")
            finally:
                results.execute_command("CLIENT", "UNPAUSE")
        finally:
            for pid in stopped:
                os.kill(pid, signal.SIGCONT)

        outcome = run.result(late)
        assert (outcome.status, outcome.epochs) == ("reserved", 1)
        wait_until(lambda: paused_writes(results) == 0, timeout=TIMEOUT, what="the held writes to land")
        # Read past the backend's cache, which keeps a SUCCESS once it has read one.
        meta = run.app.backend.get_task_meta(task_id, cache=False)
        assert meta["status"] == "SUCCESS", meta
        got = run.app.AsyncResult(task_id).get(timeout=TIMEOUT)
        assert (got["status"], got["epochs"]) == ("reserved", 1)


# -- structured logs -------------------------------------------------------------------------------------


def test_fencing_events_are_json_lines_with_their_facts_as_fields(running: Cluster) -> None:
    run = running
    stale = stale_write(run, "OBS-J")
    task_id = request_id("OBS-J-late")

    # Lost ownership: the late write refused at the stock row.
    (lost,) = wait_until(
        lambda: run.logged("lost_ownership", key="OBS-J-late"), timeout=TIMEOUT, what="the lost line"
    )
    assert lost["level"] == "WARNING" and lost["logger"] == "tasks"
    assert lost["message"].startswith("lost ownership of sku:OBS-J (token ")
    assert {k: lost[k] for k in ("scope", "sku", "token", "highest", "task_id", "epoch", "lost_by")} == {
        "scope": "sku:OBS-J",
        "sku": "OBS-J",
        "token": stale.paused_token,
        "highest": stale.winner.detail["token"],
        "task_id": task_id,
        "epoch": 0,
        "lost_by": "StaleToken",
    }
    assert lost["holder"] == f"{socket.gethostname()}:{stale.paused_child}:{task_id}"
    assert lost["lease_id"] and lost["worker"] == f"{socket.gethostname()}:{stale.paused_child}"
    # Every other line of that task carries its request's fields too (bound once per task).
    mine = [r for r in run.log_records() if r.get("task_id") == task_id]
    assert all(r["key"] == "OBS-J-late" for r in mine if r["logger"] == "tasks")

    # A dead letter: a restock that finds its SKU's lease held (no busy retries allowed).
    run.inventory.add_sku("OBS-K", on_hand=1)
    with run.leases.hold("sku:OBS-K", ttl=30, holder="test:holder") as held:
        handle = run.client.enqueue_sync("restock", idempotency_key="obs-k-dead", sku="OBS-K", quantity=1)
        assert run.result(handle).status == "dead_lettered"
    (dead,) = run.logged("dead_lettered", key="obs-k-dead")
    assert {k: dead[k] for k in ("scope", "sku", "token", "holder", "task_id", "epoch", "reason")} == {
        "scope": "sku:OBS-K",
        "sku": "OBS-K",
        "token": held.token,
        "holder": "test:holder",
        "task_id": request_id("obs-k-dead"),
        "epoch": 0,
        "reason": "lease busy",
    }
    assert {"highest", "lease_id"} <= set(dead)


def test_a_token_regression_repair_is_a_json_line_naming_both_tokens_and_the_task(
    running: Cluster, server: RedisServer
) -> None:
    """The lease Redis loses its data: the next holder gets a reissued token, its write is refused while
    it is still the current holder, and the worker raises the counter and says so."""
    run = running
    run.inventory.add_sku("OBS-G", on_hand=10)
    for n in range(3):
        done = run.result(run.client.enqueue_reservation_sync("OBS-G", 1, idempotency_key=f"obs-g-{n}"))
        assert done.status == "reserved"
    highest = done.detail["token"]
    wiped = redis.Redis.from_url(server.url(2))
    wiped.flushdb()
    wiped.close()

    repairs = sample(run.scrape(), "reservations_token_regressions_repaired_total")
    after = run.result(run.client.enqueue_reservation_sync("OBS-G", 1, idempotency_key="obs-g-after"))
    assert after.status == "reserved" and after.epochs == 1 and after.detail["token"] > highest
    task_id = request_id("obs-g-after")
    (repaired,) = run.logged("token_regression_repaired", scope="sku:OBS-G")
    assert repaired["logger"] == "fencing" and "regression" in repaired["message"]
    assert repaired["token"] == 1 and repaired["highest"] == highest
    assert repaired["counter_to"] >= highest  # the next token issued is above it
    assert (repaired["task_id"], repaired["epoch"], repaired["key"]) == (task_id, 0, "obs-g-after")
    assert repaired["holder"].endswith(f":{task_id}") and repaired["lease_id"]
    (lost,) = run.logged("lost_ownership", key="obs-g-after")
    assert (lost["token"], lost["highest"], lost["lease_id"]) == (1, highest, repaired["lease_id"])
    # The worker counted the repair (from the fencing package's log record: it knows no metrics).
    assert sample(run.scrape(), "reservations_token_regressions_repaired_total") == repairs + 1


def test_the_command_line_setting_writes_warnings_as_json_on_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the command line installs with RESERVATIONS_LOG_FORMAT=json, on a real lease broken by an
    operator (a warning of the fencing package)."""
    root = logging.getLogger()
    before = list(root.handlers), root.level
    use_json_on_stderr()
    try:
        url = f"sqlite:///{tmp_path / 'cli.sqlite3'}"
        schema.upgrade(url)
        with LeaseManager.from_url(url) as manager:
            held = manager.acquire("sku:CLI", ttl=30, holder="someone")
            manager.break_lease("sku:CLI", reason="operator")
    finally:
        root.handlers[:], _ = before
        root.setLevel(before[1])
    (line,) = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert (line["event"], line["scope"], line["token"], line["holder"]) == (
        "lease_broken",
        "sku:CLI",
        held.token,
        "someone",
    )
    assert line["level"] == "WARNING" and line["logger"] == "fencing" and "broken" in line["message"]


# -- metrics ---------------------------------------------------------------------------------------------


def test_workers_count_the_refused_stale_write_and_its_request(running: Cluster) -> None:
    run = running
    before = run.scrape()
    stale = stale_write(run, "OBS-M")
    reserved = sample(before, "reservations_outcomes_total", status="reserved") + 2

    # The outcome is counted as the task returns, a moment after its row is written: poll the scrape.
    after = wait_until(
        lambda: (
            (got := run.scrape())
            and sample(got, "reservations_outcomes_total", status="reserved") >= reserved
            and got
        ),
        timeout=TIMEOUT,
        what="both outcomes to be counted",
    )

    def grew(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert grew("reservations_stale_writes_refused_total", operation="reserve") == 1
    assert grew("reservations_leases_total", result="lost") == 1
    assert grew("reservations_leases_total", result="acquired") >= 3  # late, winner, late again
    assert grew("reservations_outcomes_total", status="reserved") == 2
    # Epochs: the winner none, the late request one.
    assert grew("reservations_request_epochs_count") == 2
    assert grew("reservations_request_epochs_bucket", le="0.0") == 1
    assert grew("reservations_request_epochs_bucket", le="1.0") == 2
    # Enqueue to outcome: the late request waited out at least its stopped holder's lease.
    assert grew("reservations_request_latency_seconds_count") == 2
    assert grew("reservations_request_latency_seconds_sum") > TTL
    assert stale.late.epochs == 1


def test_the_exporter_reads_refusals_outcomes_and_queues_from_the_database(running: Cluster) -> None:
    run = running
    stale_write(run, "OBS-E")
    env = {**os.environ, **run.settings.to_env()}
    done = subprocess.run(
        [sys.executable, "-m", "admin", "metrics", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    samples = samples_of(done.stdout)
    assert sample(samples, "reservations_db_up") == 1
    assert sample(samples, "reservations_db_stale_writes_refused_total", sku="OBS-E") == 1
    outcomes = run.inventory.request_outcomes(["OBS-E-late", "OBS-E-winner"])
    assert [o.status for o in outcomes.values()] == ["reserved", "reserved"]
    assert sample(samples, "reservations_db_outcomes", status="reserved") >= 2
    assert sample(samples, "reservations_db_waiting_requests_all") == 0

    # Served over HTTP, as Prometheus scrapes it.
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "admin", "metrics", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:

        def served() -> list[Any] | None:
            if server.poll() is not None:
                raise AssertionError(f"the exporter exited: {server.stderr.read() if server.stderr else ''}")
            try:
                return scraped(port)
            except OSError:
                return None

        http = wait_until(served, timeout=TIMEOUT, what="the exporter to answer")
        assert ("reservations_db_stale_writes_refused_total", (("sku", "OBS-E"),), 1.0) in http
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_the_exporter_counts_requests_without_an_outcome_default_rows_and_asks_the_backends(
    pg_url: str,
) -> None:
    """What an operator's alerts on stuck requests, stray history and the backends read: a request
    recorded and never published, a history row dated where no day partition is (DEFAULT), the lease
    backend (the database's SQL leases) answering and a broker that does not."""
    migrate_pg_schema(schema_of(pg_url))
    with Inventory.from_url(pg_url) as inventory:
        inventory.add_sku("OBS-U", on_hand=3)
        unfinished = request_of("reserve", "obs-unfinished", {"sku": "OBS-U", "quantity": 1})
        inventory.record_accepted([unfinished], 10)
        with inventory.executor.engine.begin() as conn:  # 2100-01-01: no day partition, so DEFAULT
            conn.execute(
                sa.insert(sku_history).values(
                    sku="OBS-U", at_ms=4_102_444_800_000, kind="rejected", operation="reserve", token=1,
                    on_hand_delta=0, reserved_delta=0, highest_token=2,
                )
            )  # fmt: skip
    env = {"RESERVATIONS_DATABASE_URL": pg_url, "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:9/0"}
    done = run("metrics", "--once", env=env)
    assert done.returncode == 0, done.stderr
    samples = samples_of(done.stdout)
    assert sample(samples, "reservations_db_up") == 1
    assert sample(samples, "reservations_db_unfinished_requests") == 1
    assert sample(samples, "reservations_db_oldest_unfinished_request_age_seconds") > 0
    assert sample(samples, "reservations_db_default_partition_rows", table="sku_history") == 1
    assert sample(samples, "reservations_db_default_partition_rows", table="task_attempts") == 0
    assert sample(samples, "reservations_db_lease_backend_up") == 1
    assert sample(samples, "reservations_db_broker_up") == 0
    # Its outcome recorded, the request is finished, whether or not the relay closed its record yet.
    with Inventory.from_url(pg_url) as inventory:
        inventory.record_outcome("obs-unfinished", "reserve", "invalid", {"error": "test"}, epochs=0)
    again = run("metrics", "--once", env=env)
    assert "reservations_db_unfinished_requests 0.0" in again.stdout, again.stdout


def test_the_front_door_and_the_exporter_write_only_json_lines_when_asked(
    tmp_path: Path, migrated_sqlite: Path
) -> None:
    """With RESERVATIONS_LOG_FORMAT=json, ``serve`` (uvicorn's lines and the command's own) and
    ``metrics`` write one JSON object per line, from start to stop, as the workers do."""
    database = tmp_path / "inventory.sqlite3"
    shutil.copyfile(migrated_sqlite, database)
    env = worker_env(
        {
            "RESERVATIONS_DATABASE_URL": f"sqlite:///{database}",
            "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:9/0",
            "RESERVATIONS_LOG_FORMAT": "json",
        }
    )
    door = front_door(env, tmp_path / "service.log")
    door.start()
    try:
        door.wait_ready()
    finally:
        door.stop()
    port = free_port()
    exporter = subprocess.Popen(
        [sys.executable, "-m", "admin", "metrics", "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        def answers() -> bool:
            try:
                return bool(scraped(port))
            except OSError:
                return False

        wait_until(answers, timeout=TIMEOUT, what="the exporter to answer")
    finally:
        exporter.terminate()
        _, exporter_err = exporter.communicate(timeout=10)
    for name, text in (("serve", (tmp_path / "service.log").read_text()), ("metrics", exporter_err)):
        lines = [line for line in text.splitlines() if line.strip()]
        entries = [json.loads(line) for line in lines]  # a line that is not JSON fails here
        assert entries and all({"time", "level", "logger", "message"} <= set(e) for e in entries), name
    served = [e["message"] for e in map(json.loads, (tmp_path / "service.log").read_text().splitlines())]
    assert any("Application startup complete" in message for message in served), served
    assert any("serving database metrics" in line for line in exporter_err.splitlines())


# -- compose ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is missing")
def test_compose_serves_metrics_and_offers_flower_as_a_profile() -> None:

    services = resolved()["services"]
    worker = services["worker"]
    assert "-E" in worker["entrypoint"]
    port = worker["environment"]["RESERVATIONS_METRICS_PORT"]
    assert port == "9808" and port in [str(p) for p in worker["expose"]]
    assert services["metrics"]["command"][:1] == ["metrics"] and "9809" in services["metrics"]["command"]
    assert "9809" in " ".join(services["metrics"]["healthcheck"]["test"])
    assert services["flower"]["profiles"] == ["flower"]
    assert "flower" in services["flower"]["command"]
