"""``python -m bench.operator_scale``: the operator's reads at a warehouse's scale, timed.

A migrated PostgreSQL schema of its own gets ``--skus`` SKUs (20,000) and ``--requests`` recorded requests
(100,000: nine in ten with an outcome, some dead-lettered, the rest pending), one attempt each, and 200
live SQL leases. Then the front door (``reservations serve``, with its console) answers each console list
page, and the command line answers ``leases`` and ``stock --limit 100``; each is timed five times. Beside
each page, its physical reference: the same rows read with one raw SQL statement on the same database.
The schema is dropped at exit.

    python -m bench.operator_scale --postgres postgresql+psycopg://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import sqlalchemy as sa

from fencing import LeaseManager
from fencing.engines import make_engine
from testing.pg_schemas import pg_schema
from testing.service_process import front_door
from testing.support import run

PASSWORD = "bench-console"
RUNS = 5
GOAL = 1.0  # seconds, for every page and command


_STOCK = """
INSERT INTO stock (sku, on_hand, reserved, available, fence_token, updated_ms)
SELECT 'SKU-' || lpad(n::text, 6, '0'), 100, 0, 100, 0, :now FROM generate_series(1, :n) n"""
# Accepted over the last day, the newest last; every tenth without an outcome (pending, its relay's look
# an hour away), every fiftieth dead-lettered.
_ACCEPTED = """
INSERT INTO accepted_requests (key, operation, fingerprint, at_ms, caller, request_type, arguments, task_id,
                               message_format, publishes, next_look_ms)
SELECT 'req-' || n, 'reserve', md5(n::text), :now - (:n - n) * 800, '*', 'reserve',
       json_build_object('sku', 'SKU-' || lpad((n % :skus + 1)::text, 6, '0'), 'quantity', 1)::text,
       md5('t' || n), 2, 1, CASE WHEN n % 10 = 0 THEN :now + 3600000 END
FROM generate_series(1, :n) n"""
_DEAD = (
    '{"reason": "backend unavailable", "request": {"type": "reserve", '
    '"arguments": {"sku": "SKU-000001", "quantity": 1}}}'
)
_OUTCOMES = """
INSERT INTO request_outcomes (key, operation, status, detail, task_id, worker, epochs, at_ms, fingerprint)
SELECT 'req-' || n, 'reserve', CASE WHEN n % 50 = 1 THEN 'dead_lettered' ELSE 'reserved' END,
       CASE WHEN n % 50 = 1 THEN :dead ELSE '{}' END, md5('t' || n), 'host:1', 0,
       :now - (:n - n) * 800 + 40, md5(n::text)
FROM generate_series(1, :n) n WHERE n % 10 <> 0"""
_ATTEMPTS = """
INSERT INTO task_attempts (key, operation, task_id, worker, token, result, at_ms)
SELECT 'req-' || n, 'reserve', md5('t' || n), 'host:1', n, 'applied', :now - (:n - n) * 800 + 30
FROM generate_series(1, :n) n"""


def _seed(url: str, skus: int, requests: int) -> None:
    """The rows, written by the database itself (generate_series): seconds, not minutes."""
    engine = make_engine(url)
    values = {"n": requests, "now": int(time.time() * 1000), "skus": skus, "dead": _DEAD}
    with engine.begin() as conn:
        conn.execute(sa.text(_STOCK), {**values, "n": skus})
        for statement in (_ACCEPTED, _OUTCOMES, _ATTEMPTS):
            conn.execute(sa.text(statement), values)
        conn.execute(sa.text("ANALYZE"))
    engine.dispose()


def _timed(call: Callable[[], object]) -> list[float]:
    call()  # warm: connections, plans, imports
    times = []
    for _ in range(RUNS):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times


def _in_process(words: list[str], env: dict[str, str]) -> Callable[[], object]:
    def command() -> object:
        done = run(*words, env={k: v for k, v in env.items() if k.startswith("RESERVATIONS_")})
        if done.returncode != 0:
            raise RuntimeError(f"reservations {' '.join(words)}: {done.stderr}")
        return done

    return command


def _command(words: list[str], env: dict[str, str]) -> Callable[[], object]:
    return lambda: subprocess.run(words, env=env, capture_output=True, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--postgres", required=True, help="an admin URL of the PostgreSQL to use")
    parser.add_argument("--skus", type=int, default=20_000)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--broker", default="redis://127.0.0.1:6379/15", help="the front door's broker")
    args = parser.parse_args()

    with pg_schema(args.postgres, prefix="bench_operator") as url, tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        _seed(url, args.skus, args.requests)
        took = time.perf_counter() - started
        print(f"seeded {args.skus:,} SKUs and {args.requests:,} requests in {took:.1f} s")
        leases = LeaseManager.from_url(url)
        held = [
            leases.acquire(f"sku:SKU-{n:06d}", ttl=600, holder=f"host-{n % 4}:{n}:task")
            for n in range(1, 201)
        ]
        password = Path(folder, "password")
        password.write_text(PASSWORD)
        env = {
            **os.environ,
            "RESERVATIONS_DATABASE_URL": url,
            "RESERVATIONS_BROKER_URL": args.broker,
            "RESERVATIONS_RESULT_BACKEND": args.broker,
            "RESERVATIONS_CONSOLE_PASSWORD_FILE": str(password),
        }
        service = front_door(env, Path(folder, "service.log"))
        service.start()
        rows: list[tuple[str, list[float], list[float] | None]] = []
        try:
            service.wait_ready("/healthz")
            raw = make_engine(url)
            with (
                httpx.Client(base_url=service.url, auth=("bench", PASSWORD), timeout=60) as http,
                raw.connect() as conn,
            ):

                def page(path: str) -> Callable[[], object]:
                    def get() -> object:
                        answer = http.get(path)
                        answer.raise_for_status()
                        return answer

                    return get

                def sql(text: str) -> Callable[[], object]:
                    return lambda: conn.exec_driver_sql(text).all()

                cases = [
                    ("console: requests", "/console/requests",
                     "SELECT * FROM accepted_requests ORDER BY at_ms DESC, key DESC LIMIT 50"),
                    ("console: requests, stuck", "/console/requests?state=stuck",
                     "SELECT a.* FROM accepted_requests a LEFT JOIN request_outcomes o ON o.key = a.key "
                     "WHERE o.key IS NULL ORDER BY a.at_ms DESC LIMIT 50"),
                    ("console: requests, dead_lettered", "/console/requests?state=dead_lettered",
                     "SELECT a.* FROM accepted_requests a JOIN request_outcomes o ON o.key = a.key "
                     "WHERE o.status = 'dead_lettered' ORDER BY a.at_ms DESC LIMIT 50"),
                    ("console: a request", "/console/requests/req-99999",
                     "SELECT * FROM request_outcomes WHERE key = 'req-99999'"),
                    ("console: dead letters", "/console/dead-letters",
                     "SELECT * FROM request_outcomes WHERE status = 'dead_lettered' ORDER BY at_ms DESC"),
                    ("console: SKUs", "/console/skus",
                     "SELECT * FROM stock ORDER BY sku LIMIT 50"),
                    ("console: a SKU", "/console/skus/SKU-000001",
                     "SELECT * FROM stock WHERE sku = 'SKU-000001'"),
                    ("console: leases and queues", "/console/leases",
                     "SELECT * FROM fencing_leases WHERE state = 'held'"),
                    ("console: action log", "/console/actions",
                     "SELECT * FROM operator_actions ORDER BY id DESC LIMIT 50"),
                ]  # fmt: skip
                for name, path, reference in cases:
                    rows.append((name, _timed(page(path)), _timed(sql(reference))))
            raw.dispose()
            command = [str(Path(sys.executable).parent / "reservations")]
            for name, words in (
                ("cli: leases", ["leases"]),
                ("cli: stock --limit 100", ["stock", "--limit", "100"]),
            ):
                # The command's own time (its imports done), then the whole process, start-up included.
                rows.append((name, _timed(_in_process(words, env)), None))
                rows.append(
                    (
                        f"{name} (a process, start-up included)",
                        _timed(_command([*command, *words], env)),
                        None,
                    )
                )
            start_up = _timed(_command([*command, "--help"], env))
            rows.append(("cli: --help (the start-up alone)", start_up, None))
            bare = [
                sys.executable,
                "-c",
                "import sqlalchemy.orm, sqlalchemy.ext.asyncio, sqlmodel, typer, rich, psycopg, redis",
            ]
            rows.append(("reference: the libraries' imports alone", _timed(_command(bare, env)), None))
        finally:
            service.stop()
            for lease in held:
                leases.release(lease)
            leases.close()
    print(f"\n{'what':48} {'median s':>9} {'max s':>8} {'raw SQL median s':>17}  under {GOAL:g} s")
    for name, times, reference in rows:
        ref = f"{statistics.median(reference):17.4f}" if reference else f"{'':17}"
        ok = "yes" if max(times) < GOAL else "NO"
        print(f"{name:48} {statistics.median(times):9.3f} {max(times):8.3f} {ref}  {ok}")


if __name__ == "__main__":
    main()
