"""``python -m bench.relay_backlog [N]``: the relay under a backlog of N requests (default 10,000) that
nobody consumes, on a private redis-server and a SQLite inventory file.

Prints how many copies the relay published while every record came due (a backlog must get none: each
message is still queued), and what looking cost: the relay's passes over all N records, against the
physical reference measured in the same run, one raw redis-py scan of the same queue (LRANGE in chunks,
each message's JSON parsed for its task id), which is what telling "queued" from "lost" cannot do
without.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import redis

from reservations import schema
from tasks import ReservationClient, Settings, create_app
from tasks.relay import CHUNK, Action, relay_of
from testing.redis_servers import redis_server


def _raw_scan(client: redis.Redis) -> int:
    found, start = 0, 0
    while True:
        chunk = client.lrange("celery", start, start + CHUNK - 1)
        found += sum(1 for payload in chunk if json.loads(payload)["headers"]["id"])
        if len(chunk) < CHUNK:
            return found
        start += CHUNK


def main(backlog: int) -> None:
    with tempfile.TemporaryDirectory() as folder, redis_server(Path(folder) / "broker") as server:
        database = f"sqlite:///{Path(folder) / 'inventory.sqlite3'}"
        schema.upgrade(database)
        settings = Settings(
            broker_url=server.url(0),
            result_backend=server.url(1),
            database_url=database,
            republish_after=0.05,
        )
        began = time.perf_counter()
        with ReservationClient(create_app(settings)) as client:
            for n in range(backlog):
                client.enqueue_reservation_sync("W", 1, idempotency_key=f"backlog-{n}")
        enqueued = time.perf_counter() - began
        time.sleep(0.1)  # every record's first look is due (republish_after 0.05 s)
        relay = relay_of(settings)
        looked, copies, passes, relaying = 0, 0, 0, 0.0
        try:
            while looked < backlog:
                began = time.perf_counter()
                counts = relay.run_once().counts
                relaying += time.perf_counter() - began
                passes += 1
                looked += sum(counts.values())
                copies += counts[Action.REPUBLISH]
        finally:
            relay.close()
        with redis.Redis.from_url(server.url(0)) as raw:
            began = time.perf_counter()
            scanned = _raw_scan(raw)
            scan = time.perf_counter() - began
            depth = raw.llen("celery")
    print(f"backlog: {backlog} requests recorded and published in {enqueued:.1f} s; queue depth {depth}")
    print(f"copies published while all {looked} records came due: {copies}")
    per_pass = relaying / passes
    print(f"relay: {passes} passes, {relaying:.2f} s in all, {per_pass * 1000:.0f} ms per pass")
    print(f"reference: one raw scan of the {scanned}-message queue, {scan * 1000:.0f} ms")
    print(f"a relay pass / the raw scan: {per_pass / scan:.2f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000)
