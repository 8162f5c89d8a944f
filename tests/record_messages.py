"""Record the request messages this code publishes, exactly as the broker's queue carries them, as the
fixtures of its message format: ``tests/fixtures/messages/v<N>/<producer>.<case>.json``.

Every producer publishes onto a private ``redis-server`` that no worker reads, and the raw payloads are
read back from the queue with redis-py (Celery protocol 2: headers, properties, and the body, decoded
from its base64 to the JSON list ``[args, kwargs, embed]``; a fixture stores nothing else of its own
but which values stand in for a request's key, SKUs and reservation id, so a test can substitute fresh
ones). The producers are the real ones:

- ``client``: :class:`tasks.ReservationClient`, every enqueue (sync, and the async publishing thread),
  with a deadline and a hold, and a re-drive of a dead letter (``redrive_sync``: a new request under
  ``<key>~redrive-1`` carrying the arguments its dead letter recorded, as a worker records them);
- ``cli``: the ``reservations`` command line (in process): reserve (with ``--deadline``), restock,
  count, replenish, confirm, release;
- ``service``: ``reservations serve`` as a process, driven over HTTP with ``Prefer: respond-async``:
  POST /reservations, /reservations/{key}/confirm and /release, /skus/{sku}/count (it sends its
  default deadline);
- ``worker``: a real ``celery worker`` retrying a restock whose SKU's lease is busy: the message it
  publishes with its retry counter (``busy``: 1), taken from the queue or, once the worker fetched it,
  from the broker's unacknowledged messages (the retry failpoint stops the worker's pool process right
  after it published).

The format number is :data:`tasks.messages.CURRENT_FORMAT` (1 before messages carried one). Recording
again overwrites that format's folder only: the fixtures of released formats stay as they were
recorded, and tests/test_message_formats.py serves every one of them on a real worker. Record a new
folder whenever the format changes; never edit a released one.

    .venv/bin/python -m tests.record_messages            # needs redis-server; SQLite only
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import redis

from reservations import Inventory, schema
from reservations.request_outcomes import request_id
from testing.celery_processes import worker_env
from testing.harness import free_port, tls, wait_until
from testing.redis_servers import RedisServer, redis_server

ROOT = Path(__file__).resolve().parent
FIXTURES = ROOT / "fixtures" / "messages"
QUEUE = "celery"  # Celery's default queue; on Redis a list the producer LPUSHes onto
UNACKED = "unacked"  # kombu's Redis hash of the messages a consumer fetched and has not acknowledged

# The stand-ins a test replaces with fresh values (text-wide, so the repr headers follow too).
SKU_A, SKU_B = "FIXSKU-A", "FIXSKU-B"
RESERVATION = "r_0f1e2d3c4b5a69788796a5b4c3d2e1f0"


def messages_module() -> Any:
    """The module that parses request messages (in reservations before it moved to tasks)."""
    try:
        return importlib.import_module("tasks.messages")
    except ImportError:
        return importlib.import_module("reservations.messages")


def current_format() -> int:
    """The format this code's producers send: 1 for a release before messages named theirs."""
    return int(getattr(messages_module(), "CURRENT_FORMAT", 1))


def key_of(producer: str, case: str) -> str:
    return f"msgfix-{producer}-{case}"


def decoded(payload: bytes | str) -> dict[str, Any]:
    """A raw queue payload with its body decoded to JSON (checked to encode back to the same body)."""
    message = json.loads(payload)
    assert message["properties"]["body_encoding"] == "base64", message["properties"]
    body = json.loads(base64.b64decode(message["body"]))
    return {**message, "body": body}


def queued(broker: redis.Redis) -> list[dict[str, Any]]:
    """The messages in the queue and the unacknowledged ones, decoded."""
    found = [decoded(raw) for raw in broker.lrange(QUEUE, 0, -1)]
    found += [decoded(json.dumps(json.loads(raw)[0])) for raw in broker.hvals(UNACKED)]
    return found


def take(broker: redis.Redis, key: str, *, retried: bool = False, timeout: float = 30.0) -> dict[str, Any]:
    """The one message of ``key``'s request (its retry when ``retried``), waited for."""
    task_id = request_id(key)

    def found() -> dict[str, Any] | None:
        mine = [m for m in queued(broker) if m["headers"]["id"] == task_id]
        mine = [m for m in mine if (m["headers"]["retries"] > 0) == retried]
        assert len(mine) <= 1, mine
        return mine[0] if mine else None

    message: dict[str, Any] = wait_until(found, timeout=timeout, what=f"the message of {key}")
    return message


def store(
    folder: Path, producer: str, case: str, how: str, message: dict[str, Any], **stand_ins: Any
) -> None:
    fixture = {
        "format": int(folder.name.removeprefix("v")),
        "task": message["headers"]["task"],
        "producer": producer,
        "case": case,
        "how": how,
        "stand_ins": {"key": key_of(producer, case), **stand_ins},
        "message": message,
    }
    path = folder / f"{producer}.{case}.json"
    path.write_text(json.dumps(fixture, indent=2, sort_keys=True) + "\n")
    print(f"recorded {path.relative_to(ROOT.parent)}")


def settings_env(server: RedisServer, db: int, database_url: str) -> dict[str, str]:
    return {
        "RESERVATIONS_BROKER_URL": server.url(db),
        "RESERVATIONS_RESULT_BACKEND": server.url(db + 1),
        "RESERVATIONS_DATABASE_URL": database_url,
    }


# -- the client ----------------------------------------------------------------------------------------


def record_client(folder: Path, server: RedisServer, database_url: str) -> None:
    from reservations.redrives import carried_request
    from reservations.statuses import RequestStatus
    from tasks import ReservationClient, Settings, create_app

    parse = messages_module().parse
    env = settings_env(server, 0, database_url)
    client = ReservationClient(create_app(Settings.from_env(env)))
    broker = redis.Redis.from_url(env["RESERVATIONS_BROKER_URL"])
    k = partial(key_of, "client")
    deadline = time.time() + 3600
    sync: list[tuple[str, str, Callable[[], Any], dict[str, Any]]] = [
        ("reserve", "enqueue_reservation_sync(SKU_A, 2)",
         lambda: client.enqueue_reservation_sync(SKU_A, 2, idempotency_key=k("reserve")), {"skus": [SKU_A]}),
        ("reserve_held", "enqueue_reservation_sync(SKU_A, 2, hold_for=300.0, deadline=<in an hour>)",
         lambda: client.enqueue_reservation_sync(
             SKU_A, 2, idempotency_key=k("reserve_held"), hold_for=300.0, deadline=deadline
         ), {"skus": [SKU_A]}),
        ("confirm", "enqueue_sync('confirm', reservation_id=RESERVATION)",
         lambda: client.enqueue_sync("confirm", idempotency_key=k("confirm"), reservation_id=RESERVATION),
         {"reservation_id": RESERVATION}),
        ("release", "enqueue_sync('release', reservation_id=RESERVATION)",
         lambda: client.enqueue_sync("release", idempotency_key=k("release"), reservation_id=RESERVATION),
         {"reservation_id": RESERVATION}),
        ("restock", "enqueue_sync('restock', sku=SKU_A, quantity=5)",
         lambda: client.enqueue_sync("restock", idempotency_key=k("restock"), sku=SKU_A, quantity=5),
         {"skus": [SKU_A]}),
        ("count", "enqueue_count_sync(SKU_A, 7)",
         lambda: client.enqueue_count_sync(SKU_A, 7, idempotency_key=k("count")), {"skus": [SKU_A]}),
        ("count_shrinkage", "enqueue_sync('count', sku=SKU_A, shrinkage=2)",
         lambda: client.enqueue_sync("count", idempotency_key=k("count_shrinkage"), sku=SKU_A, shrinkage=2),
         {"skus": [SKU_A]}),
        ("replenish", "enqueue_replenish_sync(SKU_A, par=20)",
         lambda: client.enqueue_replenish_sync(SKU_A, par=20, idempotency_key=k("replenish")),
         {"skus": [SKU_A]}),
    ]  # fmt: skip
    try:
        for case, how, send, stand_ins in sync:
            send()
            store(folder, "client", case, f"ReservationClient.{how}", take(broker, k(case)), **stand_ins)

        async def through_the_publishing_thread() -> None:
            await client.enqueue_reservation(SKU_A, 2, idempotency_key=k("reserve_async"))
            await client.enqueue_order([(SKU_A, 1), (SKU_B, 2)], idempotency_key=k("reserve_order"))

        asyncio.run(through_the_publishing_thread())
        store(folder, "client", "reserve_async", "await ReservationClient.enqueue_reservation(SKU_A, 2)",
              take(broker, k("reserve_async")), skus=[SKU_A])  # fmt: skip
        store(folder, "client", "reserve_order",
              "await ReservationClient.enqueue_order([(SKU_A, 1), (SKU_B, 2)])",
              take(broker, k("reserve_order")), skus=[SKU_A, SKU_B])  # fmt: skip

        # A dead letter as a worker writes it (the request it carried: its type and checked arguments),
        # driven again by the client: the re-drive is a new request, <key>~redrive-1.
        origin = k("redrive")
        checked = parse("reserve_order", [], {"lines": [[SKU_A, 1], [SKU_B, 2]], "hold_for": 120.0,
                                              "idempotency_key": origin})  # fmt: skip
        with Inventory.from_url(database_url) as inventory:
            inventory.record_outcome(
                origin, checked.operation, RequestStatus.DEAD_LETTERED,
                {"reason": "lease busy", "holder": "recorder",
                 "request": carried_request(checked.name, checked.args)},
                fingerprint=checked.fingerprint,
            )  # fmt: skip
        redriven = client.redrive_sync(origin, by="recorder")
        message = take(broker, redriven.key)
        store(folder, "client", "redrive",
              "ReservationClient.redrive_sync(<a dead-lettered reserve_order of (SKU_A, 1), (SKU_B, 2), "
              "hold_for 120.0>): the re-drive under <key>~redrive-1",
              message, key=redriven.key, skus=[SKU_A, SKU_B])  # fmt: skip
    finally:
        client.close()
        client.app.close()
        broker.close()


# -- the command line ---------------------------------------------------------------------------------


def record_cli(folder: Path, server: RedisServer, database_url: str) -> None:
    from testing.support import run

    env = settings_env(server, 2, database_url)
    broker = redis.Redis.from_url(env["RESERVATIONS_BROKER_URL"])
    k = partial(key_of, "cli")
    commands: list[tuple[str, list[str], dict[str, Any]]] = [
        ("reserve", ["reserve", SKU_A, "2", "--key", k("reserve"), "--deadline", "3600"], {"skus": [SKU_A]}),
        ("restock", ["restock", SKU_A, "5", "--key", k("restock")], {"skus": [SKU_A]}),
        ("count", ["count", SKU_A, "7", "--key", k("count")], {"skus": [SKU_A]}),
        ("replenish", ["replenish", SKU_A, "--par", "20", "--key", k("replenish")], {"skus": [SKU_A]}),
        ("confirm", ["confirm", RESERVATION, "--key", k("confirm")], {"reservation_id": RESERVATION}),
        ("release", ["release", RESERVATION, "--key", k("release")], {"reservation_id": RESERVATION}),
    ]
    try:
        for case, args, stand_ins in commands:
            done = run(*args, env=env)
            assert done.returncode == 0, done.stderr
            store(folder, "cli", case, "reservations " + " ".join(args), take(broker, k(case)), **stand_ins)
    finally:
        broker.close()


# -- the HTTP service ------------------------------------------------------------------------------------


@contextmanager
def service(env: dict[str, str], log: Path) -> Iterator[str]:
    from testing.support import SCRIPT

    port = free_port()
    with log.open("ab") as out:
        process = subprocess.Popen(
            [SCRIPT, "serve", "--port", str(port), "--no-access-log"],
            env=worker_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            assert process.poll() is None, log.read_text()
            try:
                return httpx.get(url + "/readyz", timeout=2, verify=tls()).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_until(ready, timeout=60, what="the service to answer /readyz", interval=0.1)
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def record_service(folder: Path, server: RedisServer, database_url: str, workdir: Path) -> None:
    from reservations.statuses import RequestStatus

    env = settings_env(server, 4, database_url)
    broker = redis.Redis.from_url(env["RESERVATIONS_BROKER_URL"])
    k = partial(key_of, "service")
    held = "msgfix-service-held"  # a reservation the lifecycle routes find under its key
    with Inventory.from_url(database_url) as inventory:
        inventory.record_outcome(held, "reserve", RequestStatus.RESERVED, {"reservation_ids": [RESERVATION]})
    async_ = {"Prefer": "respond-async"}
    posts: list[tuple[str, str, dict[str, Any] | None, dict[str, Any]]] = [
        ("reserve", "/reservations", {"sku": SKU_A, "quantity": 2}, {"skus": [SKU_A]}),
        ("confirm", f"/reservations/{held}/confirm", None, {"reservation_id": RESERVATION}),
        ("release", f"/reservations/{held}/release", None, {"reservation_id": RESERVATION}),
        ("count", f"/skus/{SKU_A}/count", {"counted": 7}, {"skus": [SKU_A]}),
    ]
    try:
        with (
            service(env, workdir / "service.log") as url,
            httpx.Client(base_url=url, timeout=30, verify=tls()) as http,
        ):
            for case, path, body, stand_ins in posts:
                answer = http.post(path, json=body, headers={**async_, "Idempotency-Key": k(case)})
                assert answer.status_code == 202, answer.text
                how = f"POST {path} {json.dumps(body)} (Prefer: respond-async)"
                store(folder, "service", case, how, take(broker, k(case)), **stand_ins)
    finally:
        broker.close()


# -- a worker's retry ----------------------------------------------------------------------------------


def record_retry(folder: Path, server: RedisServer, database_url: str, workdir: Path) -> None:
    from fencing import LeaseManager
    from reservations import validation as valid
    from testing.workers import cluster

    env = settings_env(server, 6, database_url)
    broker = redis.Redis.from_url(env["RESERVATIONS_BROKER_URL"])
    key = key_of("worker", "restock_retry")
    with Inventory.from_url(database_url) as inventory:
        inventory.add_sku(SKU_B, on_hand=10)
    # The SKU's lease is ours: the worker's restock finds it busy and publishes its retry, then its pool
    # process stops (the failpoint) so that no second attempt follows.
    with cluster(workdir / "worker", env, count=1, failpoint_spec="retry_published=stop,once") as running:
        leases = LeaseManager.from_url(running.lease_url)
        try:
            with leases.hold(valid.scope_of(SKU_B), ttl=60, holder="recorder"):
                client = running.client()
                try:
                    client.enqueue_sync("restock", idempotency_key=key, sku=SKU_B, quantity=5)
                    message = take(broker, key, retried=True)
                finally:
                    client.close()
                    client.app.close()
        finally:
            leases.close()
    broker.close()
    store(folder, "worker", "restock_retry",
          "celery worker: its retry of ReservationClient.enqueue_sync('restock', sku=SKU_B, quantity=5) "
          "after finding the SKU's lease busy", message, skus=[SKU_B])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", action="append", choices=["client", "cli", "service", "worker"])
    options = parser.parse_args(argv)
    folder = FIXTURES / f"v{current_format()}"
    folder.mkdir(parents=True, exist_ok=True)
    wanted = set(options.only or ["client", "cli", "service", "worker"])
    with tempfile.TemporaryDirectory(prefix="record_messages_") as tmp:
        workdir = Path(tmp)
        with redis_server(workdir / "redis") as server:
            for producer in ("client", "cli", "service", "worker"):
                if producer not in wanted:
                    continue
                database_url = f"sqlite:///{workdir / f'{producer}.sqlite3'}"
                schema.upgrade(database_url)
                if producer == "client":
                    record_client(folder, server, database_url)
                elif producer == "cli":
                    record_cli(folder, server, database_url)
                elif producer == "service":
                    record_service(folder, server, database_url, workdir)
                else:
                    record_retry(folder, server, database_url, workdir)
    return 0


if __name__ == "__main__":
    os.environ.pop("COLUMNS", None)
    sys.exit(main())
