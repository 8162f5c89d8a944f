"""No message a worker takes from its Redis broker stops it, and neither does a broker at ``maxmemory``
(tasks.transport).

Without services: which transport each broker URL gets, and what names a dropped message in its log line.
Then one real ``celery worker`` on a private redis-server: messages no task can be made of are pushed onto
its queue as anyone who can LPUSH could push them (a payload that is no JSON, a body that is not the
base64 its properties claim, no properties, a body or headers Celery cannot read); each is dropped with
one log line and counted in ``reservations_messages_dropped_total``, and the request sent after it is
served by the same worker. A message delivered while the broker refuses to grow (maxmemory 1, policy
noeviction) still runs, and the worker goes on once the broker has room; a worker started while the broker
is full waits for room instead of exiting.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from kombu.entity import Queue
from kombu.transport import pyamqp
from prometheus_client.parser import text_string_to_metric_families

from reservations import Inventory
from reservations.request_outcomes import RequestResult, request_id
from tasks import ReservationClient, Settings, create_app
from tasks import transport as screening
from tasks.producer import Producer
from testing.celery_processes import CeleryProcess, stop_all, worker_env
from testing.harness import free_port, wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.workers import Cluster, cluster, migrated_database

TIMEOUT = 20.0
DROPPED = "reservations_messages_dropped_total"

# -- without services -------------------------------------------------------------------------------------


def transport_of(url: str, **variables: str) -> type:
    app = create_app(Settings.from_env({"RESERVATIONS_BROKER_URL": url, **variables}))
    try:
        return type(app.connection_for_read().transport)
    finally:
        app.close()


def test_every_redis_broker_url_is_consumed_through_the_screening_transports() -> None:
    assert transport_of("redis://127.0.0.1:9/0") is screening.Transport
    assert transport_of("rediss://127.0.0.1:9/0") is screening.Transport
    sentinels = "sentinel://127.0.0.1:9/0;sentinel://127.0.0.1:10/0"
    assert transport_of(sentinels, RESERVATIONS_SENTINEL_MASTER="broker") is screening.SentinelTransport
    assert transport_of("amqp://guest:guest@127.0.0.1:9//") is pyamqp.Transport


def test_the_transport_survives_what_kombu_takes_from_the_scheme() -> None:
    """kombu gives rediss:// its TLS default by the transport's name, and takes the transport from the
    scheme again on failover to the next URL: both keep working with the transports installed."""
    app = create_app(Settings.from_env({"RESERVATIONS_BROKER_URL": "rediss://127.0.0.1:9/0"}))
    try:
        assert app.connection_for_read().ssl  # kombu's default for rediss: TLS, not a plain socket
    finally:
        app.close()
    sentinels = "sentinel://127.0.0.1:9/0;sentinel://127.0.0.1:10/0"
    app = create_app(
        Settings.from_env({"RESERVATIONS_BROKER_URL": sentinels, "RESERVATIONS_SENTINEL_MASTER": "broker"})
    )
    try:
        connection = app.connection_for_read()
        connection.switch(connection.alt[1])
        assert type(connection.transport) is screening.SentinelTransport
    finally:
        app.close()


def test_a_dropped_message_is_named_by_what_its_headers_show() -> None:
    key = "order-1042:WIDGET"
    headers = {
        "id": request_id(key),
        "task": "reservations.reserve",
        "kwargsrepr": f"{{'sku': 'WIDGET', 'quantity': 2, 'idempotency_key': '{key}'}}",
    }
    assert screening.identity({"headers": headers}) == {
        "task_id": request_id(key),
        "task": "reservations.reserve",
        "key": key,
    }
    # Nothing readable: nothing named. A sender's long or unprintable value is shown bounded and printable.
    assert screening.identity([1, 2]) == {"task_id": None, "task": None, "key": None}
    assert screening.identity({"headers": "x"}) == {"task_id": None, "task": None, "key": None}
    shown = screening.identity({"headers": {"id": "a\nb" * 1000, "kwargsrepr": "{'idempotency_key': 'a b'}"}})
    assert shown["task_id"] is not None and "\n" not in shown["task_id"]
    assert len(shown["task_id"]) <= screening.SHOWN_CHARS + 3 and shown["key"] is None


def test_a_full_broker_is_logged_at_most_once_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    throttled = screening._Throttled(10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="tasks.transport"):
        for at in (0.0, 1.0, 2.0, 9.0, 10.5, 11.0):
            now[0] = at
            throttled.warn("broker at maxmemory: %s", "full")
    assert [r.getMessage() for r in caplog.records] == [
        "broker at maxmemory: full",
        "broker at maxmemory: full (3 more since the last such line)",
    ]


# -- a worker on a private redis-server ------------------------------------------------------------------


def raw(body: str, headers: object = None, properties: object = None) -> bytes:
    """A payload as kombu's Redis producer pushes it, with ``body`` as given (base64 as its properties say,
    or not) and the headers and properties given in place of a request's."""
    key = f"poison-{uuid.uuid4().hex[:12]}"
    default_headers = {
        "lang": "py",
        "task": "reservations.reserve",
        "id": request_id(key),
        "argsrepr": "()",
        "kwargsrepr": f"{{'sku': 'W', 'quantity': 1, 'idempotency_key': '{key}'}}",
    }
    default_properties = {
        "correlation_id": request_id(key),
        "delivery_mode": 2,
        "delivery_info": {"exchange": "", "routing_key": "celery"},
        "priority": 0,
        "body_encoding": "base64",
        "delivery_tag": str(uuid.uuid4()),
    }
    payload = {
        "body": body,
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": default_headers if headers is None else headers,
        "properties": default_properties if properties is None else properties,
    }
    return json.dumps(payload).encode()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


@dataclass(frozen=True)
class Poison:
    payload: bytes
    reason: str  # the label it is counted under
    named: tuple[str, ...] = ()  # what its log line must name beside the queue


def poisons() -> dict[str, Poison]:
    not_base64 = raw("!!!not-base64")
    headers = json.loads(not_base64)["headers"]
    key = headers["kwargsrepr"].rpartition("'idempotency_key': '")[2].partition("'")[0]
    return {
        # The task id and key of a request whose body cannot be read are in its headers.
        "body not base64": Poison(not_base64, "malformed", (headers["id"], key, "binascii.Error")),
        "payload not JSON": Poison(b"this is not json{", "undecodable", ("JSONDecodeError",)),
        "payload not UTF-8": Poison(b"\xff\xfe\x00\x01", "undecodable"),
        "payload nested too deep": Poison(
            b"[" * 100_000 + b"]" * 100_000, "undecodable", ("RecursionError",)
        ),
        "number too long": Poison(b'{"a": ' + b"9" * 5000 + b"}", "undecodable"),
        "payload a list": Poison(b"[1, 2, 3]", "malformed"),
        "no properties": Poison(b'{"body": "e30="}', "malformed", ("KeyError",)),
        "properties null": Poison(
            json.dumps({**json.loads(raw("e30=")), "properties": None}).encode(), "malformed"
        ),
        "unknown body encoding": Poison(
            raw("e30=", properties={"body_encoding": "rot13", "delivery_tag": "t"}), "malformed"
        ),
        # Celery reads these in the consumer, after kombu put them on its unacked record.
        "body not a task's": Poison(raw(b64(b'"x"')), "malformed", ("ValueError",)),
        "headers not an object": Poison(raw(b64(b"[[], {}, {}]"), headers=[1]), "malformed"),
        "no task id": Poison(
            raw(b64(b"[[], {}, {}]"), headers={"task": "reservations.reserve"}), "malformed"
        ),
    }


POISONS = poisons()


@dataclass(frozen=True)
class Consuming:
    cluster: Cluster
    worker: CeleryProcess
    broker: redis.Redis
    client: ReservationClient
    inventory: Inventory
    metrics_port: int

    def reserved(self) -> RequestResult:
        """A reservation through the worker, with its outcome."""
        sku = f"CS{uuid.uuid4().hex[:10]}"
        self.inventory.add_sku(sku, on_hand=5)
        handle = self.client.enqueue_reservation_sync(sku, 1, idempotency_key=f"ok-{uuid.uuid4().hex}")
        try:
            return handle.result_sync(timeout=TIMEOUT)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.worker.tail()}") from None

    def dropped(self, reason: str) -> float:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == DROPPED and sample.labels == {"reason": reason}:
                    return float(sample.value)
        raise AssertionError(f"no {DROPPED}{{reason={reason!r}}} served")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


def test_a_channel_sends_its_commands_through_one_client_per_pool(server: RedisServer) -> None:
    """kombu made a redis-py client for every command on the channel's pool (each ack, each unacked
    record, each publish): the channel keeps one per pool, and a pool kombu drops on a reconnect takes its
    client with it."""
    app = create_app(Settings.from_env({"RESERVATIONS_BROKER_URL": server.url(3)}))
    try:
        with app.connection_for_write() as connection:
            channel = connection.default_channel
            with channel.conn_or_acquire() as first, channel.conn_or_acquire() as second:
                assert first is second
                assert first.ping()
            channel._disconnect_pools()  # what kombu does when the broker connection is lost
            with channel.conn_or_acquire() as third:
                assert third is not first
                assert third.connection_pool is channel.pool and third.ping()
            assert channel.client is not third  # the BRPOP client keeps its own pool and reply parser
    finally:
        app.close()


def test_a_producer_declares_its_queue_once_per_connection_and_again_once_the_connection_forgets(
    server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu bound a copy of the routed queue to the channel for every message before it found the queue
    in the connection's record of what it declared: a producer binds it once, and declares it again when
    kombu forgets its declarations (as on a reconnect)."""
    binds = []
    bind = Queue.bind
    monkeypatch.setattr(
        Queue, "bind", lambda queue, channel: binds.append(queue.name) or bind(queue, channel)
    )
    broker = redis.Redis.from_url(server.url(4))
    with Producer(server.url(4)) as producer, producer.batch() as publisher:
        for i in range(20):
            producer.send("reserve", f"declared-{i}", {"sku": "A", "quantity": 1}, producer=publisher)
        assert binds == ["celery"] and broker.llen("celery") == 20
        publisher.connection.declared_entities.clear()  # what kombu does on a reconnect
        producer.send("reserve", "declared-again", {"sku": "A", "quantity": 1}, producer=publisher)
        assert binds == ["celery", "celery"] and broker.llen("celery") == 21
    broker.flushdb()
    broker.close()


@pytest.fixture(scope="module")
def consuming(
    server: RedisServer, migrated_sqlite: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Consuming]:
    """One worker (its metrics served) on a SQLite inventory, its broker and results on the private Redis."""
    workdir = tmp_path_factory.mktemp("consumer")
    port = free_port()
    with migrated_database("sqlite", workdir, migrated_sqlite) as url:
        env = {
            "RESERVATIONS_BROKER_URL": server.url(0),
            "RESERVATIONS_RESULT_BACKEND": server.url(1),
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_METRICS_PORT": str(port),
        }
        with cluster(workdir, env, count=1, prefix="consumer") as started:
            client = started.client()
            inventory = Inventory.from_url(url)
            broker = redis.Redis.from_url(server.url(0))
            try:
                yield Consuming(started, started.workers[0], broker, client, inventory, port)
            finally:
                broker.config_set("maxmemory", 0)
                broker.close()
                inventory.close()
                client.close()
                client.app.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", POISONS)
def test_a_message_no_task_can_be_made_of_is_dropped_and_the_worker_goes_on(
    consuming: Consuming, name: str
) -> None:
    poison = POISONS[name]
    before = consuming.dropped(poison.reason)
    seen = len(consuming.worker.log())
    consuming.broker.lpush("celery", poison.payload)
    # The request sent after it is served by the same worker: the consumer took the poison first (the
    # queue is first in, first out) and lived on.
    assert consuming.reserved().status == "reserved"
    assert consuming.worker.alive(), consuming.worker.tail()
    lines = [line for line in consuming.worker.log()[seen:].splitlines() if "dropped a message" in line]
    assert len(lines) == 1, consuming.worker.tail()
    assert "from queue celery" in lines[0]
    for named in poison.named:
        assert named in lines[0], lines[0]
    assert consuming.dropped(poison.reason) == before + 1
    # Nothing of it is left on the broker's unacked record, to come back after the visibility timeout.
    wait_until(
        lambda: consuming.broker.hlen("unacked") == 0, timeout=TIMEOUT, what="no unacknowledged message left"
    )


@pytest.mark.slow
def test_a_message_delivered_while_the_broker_is_full_is_run_and_the_worker_goes_on(
    consuming: Consuming,
) -> None:
    sku = f"FULL{uuid.uuid4().hex[:10]}"
    consuming.inventory.add_sku(sku, on_hand=5)
    seen = len(consuming.worker.log())
    # Frozen, the worker reads its delivery only once the broker refuses every write that grows it: the
    # unacked record kombu writes on each delivery is refused.
    consuming.worker.freeze()
    try:
        handle = consuming.client.enqueue_reservation_sync(sku, 1, idempotency_key=f"full-{uuid.uuid4().hex}")
        consuming.broker.config_set("maxmemory", 1)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            consuming.broker.set("room", "none")
    finally:
        consuming.worker.thaw()
    try:
        assert handle.result_sync(timeout=TIMEOUT).status == "reserved"
        assert consuming.worker.alive(), consuming.worker.tail()
        assert "broker at maxmemory" in consuming.worker.log()[seen:]
    finally:
        consuming.broker.config_set("maxmemory", 0)
    assert consuming.reserved().status == "reserved"
    assert consuming.worker.alive()


@pytest.mark.slow
def test_a_message_acked_while_the_broker_is_full_comes_off_the_unacked_record(
    consuming: Consuming,
) -> None:
    sku = f"ACK{uuid.uuid4().hex[:10]}"
    consuming.inventory.add_sku(sku, on_hand=5)
    # Delivered with room (on the unacked record), it stops in its task before the write; the broker
    # fills up while it waits, and its ack comes after.
    consuming.cluster.arm("before_write")
    handle = consuming.client.enqueue_reservation_sync(sku, 1, idempotency_key=f"ack-{uuid.uuid4().hex}")
    _, stopped = wait_until(
        consuming.cluster.worker_with_stopped_child, timeout=TIMEOUT, what="the task to stop before its write"
    )
    assert consuming.broker.hlen("unacked") == 1
    consuming.broker.config_set("maxmemory", 1)
    try:
        os.kill(stopped, signal.SIGCONT)
        assert handle.result_sync(timeout=TIMEOUT).status == "reserved"
        # A full broker refuses kombu's ack (MULTI, ZREM, HDEL, EXEC): it is taken off all the same.
        wait_until(lambda: consuming.broker.hlen("unacked") == 0, timeout=TIMEOUT, what="the ack")
    finally:
        consuming.broker.config_set("maxmemory", 0)
    # Had its ack failed, the consumer would still count the message as held and take no other.
    assert consuming.reserved().status == "reserved"
    assert consuming.worker.alive()


@pytest.mark.slow
def test_a_worker_started_while_its_broker_is_full_waits_for_room(
    tmp_path: Path, migrated_sqlite: Path
) -> None:
    with (
        redis_server(tmp_path / "redis") as server,
        migrated_database("sqlite", tmp_path, migrated_sqlite) as url,
        redis.Redis.from_url(server.url(0)) as broker,
    ):
        broker.config_set("maxmemory", 1)
        env = {
            "RESERVATIONS_BROKER_URL": server.url(0),
            "RESERVATIONS_RESULT_BACKEND": server.url(1),
            "RESERVATIONS_DATABASE_URL": url,
        }
        worker = CeleryProcess("full", worker_env(env), tmp_path / "full.log")
        worker.start()
        try:
            # Its consumer declares its queue (a write) and is refused: it backs off and tries again.
            wait_until(
                lambda: "OutOfMemoryError" in worker.log() or not worker.alive(),
                timeout=TIMEOUT,
                what="the worker to meet the full broker",
            )
            assert worker.alive(), worker.tail()
            broker.config_set("maxmemory", 0)
            worker.wait_ready()
        finally:
            stop_all([worker])


def test_a_late_ack_after_the_broker_was_lost_leaves_the_message_to_the_broker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A task that ends after its consumer lost the broker (a restart): kombu has already let go of the
    channel's pool and its connection, and its ack, rejection or restore of the message would look for the
    broker's address on the connection that is gone, raise AttributeError and end the worker's main
    process. Each is instead left to the broker's unacked record (the visibility timeout brings the message
    back, and a copy of a request that ended replays its outcome), and the consumer forgets it."""
    from kombu import Connection, Queue

    screening.install()
    with redis_server(tmp_path / "redis") as server:
        connection = Connection(server.url(0))
        channel = connection.channel()
        assert isinstance(channel, screening.Channel)
        queue = Queue("late-ack", channel=channel)
        queue.declare()
        producer = connection.Producer(serializer="json")
        for n in range(3):
            producer.publish({"n": n}, routing_key="late-ack")
        taken = [queue.get(no_ack=False) for _ in range(3)]
        assert all(message is not None for message in taken)
        broker = redis.Redis.from_url(server.url(0))
        assert broker.hlen("unacked") == 3
        # As kombu leaves a consumer whose broker restarted: the connection closed (which detaches the
        # channel from it) without restoring anything, the broker it would restore to being gone, and the
        # channel's pools dropped on the lost connection.
        channel.qos.restore_at_shutdown = False
        connection.close()
        channel._disconnect_pools()
        assert channel.connection is None and channel._pool is None
        with caplog.at_level(logging.WARNING, logger="tasks.transport"):
            channel.qos.ack(taken[0].delivery_tag)
            channel.qos.reject(taken[1].delivery_tag, requeue=True)
            channel.qos.restore_unacked()
        channel.qos._flush()  # kombu forgets acked deliveries lazily
        assert list(channel.qos._delivered) == [taken[2].delivery_tag]
        assert [r.getMessage() for r in caplog.records if "left to the broker" in r.getMessage()] == [
            "broker connection closed: the ack of 1 message(s) left to the broker",
            "broker connection closed: the rejection of 1 message(s) left to the broker",
            "broker connection closed: the restore of 1 message(s) left to the broker",
        ]
        # Nothing was taken off the broker's record: the visibility timeout gives all three back.
        assert broker.hlen("unacked") == 3
        broker.close()
