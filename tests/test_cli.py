"""The ``reservations`` command line after a scripted race on PostgreSQL with Redis leases: the token
history shows both owners, the accepted write and the refused stale one; bad input and unreachable
backends get one line and a documented exit code, and write nothing. The installed console script runs
as a subprocess once, end to end; every other case runs the command line in this process
(``testing.support.run``), on one race per module unless the test adds to it.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fencing import LeaseManager, StaleToken
from reservations import Inventory, schema, scope_of
from testing.stores import REDIS_URL, own_pg_schema, own_redis_prefix
from testing.support import cli, run


def _stage_race(pg_url: str, redis_prefix: str) -> dict[str, Any]:
    """On a migrated database: A acquires, its lease expires (broken, as an expiry would), B acquires and
    writes, A's late write is rejected."""
    with (
        Inventory.from_url(pg_url) as inventory,
        LeaseManager.from_url(REDIS_URL, prefix=redis_prefix) as leases,
    ):
        inventory.add_sku("WIDGET", on_hand=10)
        a = leases.acquire(scope_of("WIDGET"), ttl=30, holder="host-a:101:task-a")
        leases.break_lease(scope_of("WIDGET"), reason="A paused past its lease")
        b = leases.acquire(scope_of("WIDGET"), ttl=30, holder="host-b:202:task-b")
        inventory.reserve(b, "WIDGET", 2, key="order-b")
        with pytest.raises(StaleToken):
            inventory.reserve(a, "WIDGET", 5, key="order-a")
    env = {
        "RESERVATIONS_DATABASE_URL": pg_url,
        "RESERVATIONS_LEASE_URL": REDIS_URL,
        "RESERVATIONS_LEASE_PREFIX": redis_prefix,
    }
    return {"env": env, "a": a.token, "b": b.token}


@pytest.fixture(scope="module")
def race() -> Iterator[dict[str, Any]]:
    """The race, staged once for the tests that only read it (and for those that must write nothing)."""
    with own_pg_schema() as url, own_redis_prefix() as prefix:
        schema.upgrade(url)
        yield _stage_race(url, prefix)


@pytest.fixture
def own_race(pg_url: str, redis_prefix: str) -> dict[str, Any]:
    """The race in a database and key prefix of the test's own, for a test that adds to it."""
    schema.upgrade(pg_url)
    return _stage_race(pg_url, redis_prefix)


def test_tokens_json_shows_both_owners_the_write_and_the_rejection(race: dict[str, Any]) -> None:
    """The installed console script, end to end: its own process reads PostgreSQL and the Redis leases."""
    done = cli("tokens", "WIDGET", "--json", env=race["env"])
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    by_token = {e["token"]: e for e in data["epochs"]}
    a, b = by_token[race["a"]], by_token[race["b"]]
    assert (a["holder"], a["ended"], a["writes"]) == ("host-a:101:task-a", "broken", [])
    assert [(w["operation"], w["quantity"], w["idempotency_key"]) for w in b["writes"]] == [
        ("reserve", 2, "order-b")
    ]
    assert [
        (r["presented_token"], r["highest_token"], r["holder"], r["operation"]) for r in a["rejections"]
    ] == [(race["a"], race["b"], "host-a:101:task-a", "reserve")]


def test_human_output_fits_80_columns(race: dict[str, Any]) -> None:
    for args in (
        ("tokens", "WIDGET"),
        ("stock",),
        ("rejections", "--sku", "WIDGET"),
        ("leases",),
        ("show", "order-b"),
        ("--help",),
        ("tokens", "--help"),
    ):
        done = run(*args, env=race["env"], columns=80)
        assert done.returncode == 0, (args, done.stderr)
        assert max(len(line) for line in done.stdout.splitlines()) <= 80, args
    assert "stale" in run("tokens", "WIDGET", env=race["env"]).stdout


def test_stock_rejections_and_show(race: dict[str, Any]) -> None:
    stock = json.loads(run("stock", "--json", env=race["env"]).stdout)
    assert stock == [
        {
            "sku": "WIDGET",
            "on_hand": 10,
            "reserved": 2,
            "available": 8,
            "fence_token": race["b"],
            "waiting": 0,
        }
    ]
    rejections = json.loads(run("rejections", "--sku", "WIDGET", "--json", env=race["env"]).stdout)
    assert rejections["counts"] == {"WIDGET": 1}
    assert rejections["rejections"][0]["presented_token"] == race["a"]
    shown = json.loads(run("show", "order-b", "--json", env=race["env"]).stdout)
    assert shown["reservation"]["quantity"] == 2 and shown["reservation"]["status"] == "held"


def test_rejections_json_lists_every_skus_rejections_without_a_sku(race: dict[str, Any]) -> None:
    everything = json.loads(run("rejections", "--json", env=race["env"]).stdout)
    assert everything["counts"] == {"WIDGET": 1}
    assert [(r["sku"], r["presented_token"]) for r in everything["rejections"]] == [("WIDGET", race["a"])]


def test_a_sku_is_the_argument_or_sku_on_every_read_command(race: dict[str, Any]) -> None:
    for command in ("tokens", "stock", "rejections", "leases", "audit"):
        positional = run(command, "WIDGET", "--json", env=race["env"])
        option = run(command, "--sku", "WIDGET", "--json", env=race["env"])
        assert positional.returncode == option.returncode == 0, (command, positional.stderr, option.stderr)
        if command != "leases":  # time left moves between the two reads
            assert json.loads(positional.stdout) == json.loads(option.stdout), command
        both = run(command, "WIDGET", "--sku", "OTHER", env=race["env"])
        assert both.returncode == 2 and "two SKUs given" in both.stderr, command


def test_json_times_are_iso_8601_in_utc(race: dict[str, Any]) -> None:
    tokens = json.loads(run("tokens", "WIDGET", "--json", env=race["env"]).stdout)
    shown = json.loads(run("show", "order-b", "--json", env=race["env"]).stdout)
    times = [e["acquired_at"] for e in tokens["epochs"]]
    times += [r["at"] for e in tokens["epochs"] for r in e["rejections"] + e["writes"]]
    times += [shown["reservation"]["created_at"]] + [a["at"] for a in shown["attempts"]]
    assert times and all(isinstance(t, str) and t.endswith("Z") for t in times), times
    assert all(dt.datetime.fromisoformat(t).tzinfo == dt.UTC for t in times)


def test_a_workers_holder_takes_one_line_in_the_tokens_table(own_race: dict[str, Any]) -> None:
    holder = "worker-host-17.warehouse.example.internal:48213:5f0c8a1e-2b7d-4c1e-9a55-0b8e3c2d1f00"
    with LeaseManager.from_url(REDIS_URL, prefix=own_race["env"]["RESERVATIONS_LEASE_PREFIX"]) as leases:
        leases.break_lease(scope_of("WIDGET"), reason="the next holder's turn")
        leases.acquire(scope_of("WIDGET"), ttl=30, holder=holder)
    for columns in (80, 160):
        table = run("tokens", "WIDGET", env=own_race["env"], columns=columns).stdout
        assert "worker-host-17:48213 " in table, table
        assert max(len(line) for line in table.splitlines()) <= columns


def _stock_of(env: dict[str, str]) -> Any:
    return json.loads(run("stock", "--json", env=env).stdout)


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (("tokens", "NOPE"), 3, "unknown SKU"),
        (("stock", "NOPE"), 3, "unknown SKU"),
        (("show", "no-such-key"), 3, "unknown reservation"),
        (("tokens", "WID GET"), 2, "SKU"),
        (("tokens", "x" * 300), 2, "SKU"),
        (("tokens", "WIDGET", "--since", "yesterday"), 2, "--since"),
        (("reserve", "WIDGET", "0", "--key", "k"), 2, "quantity"),
        (("reserve", "WIDGET", "two", "--key", "k"), 2, "quantity 'two'"),
        (("reserve", "WIDGET", "3.0", "--key", "k"), 2, "quantity '3.0'"),
        (("stock", ""), 2, "SKU ''"),
        (("reserve", "WIDGET", "1", "--key", "has space"), 2, "idempotency key"),
        (("restock", "WIDGET", "99999999", "--key", "k"), 2, "quantity"),
        (("confirm", "not-an-id", "--key", "k"), 2, "reservation id"),
        (("add-sku", "WIDGET", "--on-hand", "1"), 2, "already exists"),
    ],
)
def test_bad_input_gets_one_line_and_writes_nothing(
    race: dict[str, Any], args: tuple[str, ...], code: int, message: str
) -> None:
    before = _stock_of(race["env"])
    done = run(*args, env=race["env"])
    assert done.returncode == code, (done.stdout, done.stderr)
    assert message in done.stderr and "Traceback" not in done.stderr
    assert _stock_of(race["env"]) == before


@pytest.mark.parametrize(
    ("override", "args"),
    [
        ({"RESERVATIONS_DATABASE_URL": "postgresql://app:s3cret@127.0.0.1:1/inv"}, ("stock",)),
        ({"RESERVATIONS_LEASE_URL": "redis://:s3cret@127.0.0.1:1/0"}, ("leases",)),
        (
            {"RESERVATIONS_BROKER_URL": "redis://:s3cret@127.0.0.1:1/0"},
            ("reserve", "WIDGET", "1", "--key", "k1"),
        ),
    ],
)
def test_unreachable_backend_is_exit_4_with_a_masked_url(
    race: dict[str, Any], override: dict[str, str], args: tuple[str, ...]
) -> None:
    done = run(*args, env={**race["env"], **override})
    assert done.returncode == 4, done.stderr
    assert "s3cret" not in done.stderr + done.stdout and "***" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_reserve_enqueues_on_the_broker(race: dict[str, Any], redis_prefix: str) -> None:
    """Without workers the request waits in the queue: the CLI wrote nothing to the stock itself."""
    broker = f"redis://127.0.0.1:6379/{9}"
    client = redis.Redis.from_url(broker)
    queue = f"{redis_prefix}-queue"
    before = _stock_of(race["env"])
    try:
        done = run(
            "reserve",
            "WIDGET",
            "1",
            "--key",
            "cli-1",
            env={**race["env"], "RESERVATIONS_BROKER_URL": broker, "CELERY_DEFAULT_QUEUE": queue},
        )
        assert done.returncode == 0, done.stderr
        assert "enqueued reserve cli-1" in done.stdout
        assert client.llen("celery") >= 1
    finally:
        for raw in client.lrange("celery", 0, -1):
            if b"cli-1" in raw:
                client.lrem("celery", 0, raw)
        client.close()
    assert _stock_of(race["env"]) == before


def test_reserve_wait_on_a_key_of_a_different_request_reports_the_conflict(
    own_race: dict[str, Any], pg_url: str
) -> None:
    """The key already ended as another request (order-b reserved 2 units): waiting on it with a request
    for 1 unit must not print the other request's outcome as this one's."""
    from tasks.messages import request_fingerprint

    with Inventory.from_url(pg_url) as inventory:
        inventory.record_outcome(
            "cli-taken",
            "reserve",
            "reserved",
            {"quantity": 2},
            fingerprint=request_fingerprint("reserve", {"sku": "WIDGET", "quantity": 2}),
        )
    broker = "redis://127.0.0.1:6379/9"
    client = redis.Redis.from_url(broker)
    try:
        done = run(
            "reserve", "WIDGET", "1", "--key", "cli-taken", "--wait", "--timeout", "5",
            env={**own_race["env"], "RESERVATIONS_BROKER_URL": broker},
        )  # fmt: skip
    finally:
        for raw in client.lrange("celery", 0, -1):
            if b"cli-taken" in raw:
                client.lrem("celery", 0, raw)
        client.close()
    assert done.returncode == 1, done.stdout + done.stderr
    assert "already names a different reserve request" in done.stderr
    assert "outcome: reserved" not in done.stdout


def test_writing_commands_say_so_in_their_help(race: dict[str, Any]) -> None:
    for command in ("reserve", "restock", "confirm", "release", "add-sku", "demo"):
        assert "WRITES" in run(command, "--help", env=race["env"]).stdout
    assert "WRITES" in run("db", "upgrade", "--help", env=race["env"]).stdout
