"""Dead letters an operator can act on: listing them, and driving them again under a key of their own.

The link logic runs on SQLite and PostgreSQL without workers (a dead letter written as the workers write
it, a re-drive's outcome as the workers record it); the command line's listing, dry run and refusals
too. Then real workers on PostgreSQL: the lease Redis goes away, requests dead-letter, it comes back,
``reservations redrive --since`` gives each exactly one final outcome, which its original key reports,
and nothing is applied twice.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from kombu.exceptions import OperationalError

from fencing.engines import make_engine
from reservations import Inventory, schema
from reservations.acceptance import accepted
from reservations.errors import RedriveRefused, UnknownRequest
from reservations.models import schema_compatibility
from reservations.redrives import carried_request, redrive_key
from reservations.request_outcomes import RequestResult
from reservations.validation import MAX_KEY_CHARS, idempotency_key
from tasks import ReservationClient, Settings, create_app
from tasks.messages import request_fingerprint
from testing.harness import free_port, wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.support import run
from testing.workers import cluster, pg_schema

RESERVE = {"sku": "WIDGET", "quantity": 2}


def dead_letter(
    inventory: Inventory,
    key: str,
    *,
    arguments: dict[str, Any] | None = RESERVE,
    reason: str = "backend unavailable",
) -> RequestResult:
    """A dead letter as tasks.request_tasks writes it: reason, error and (unless written by older code) the
    request it carried."""
    detail: dict[str, Any] = {"reason": reason, "error": "redis unavailable: connection refused"}
    if arguments is not None:
        detail["request"] = carried_request("reserve", arguments)
    return inventory.record_outcome(
        key,
        "reserve",
        "dead_lettered",
        detail,
        worker="host:1",
        task_id="t-1",
        fingerprint=request_fingerprint("reserve", arguments or RESERVE),
    )


def ended(inventory: Inventory, key: str, status: str = "reserved") -> None:
    """The outcome a worker records for a re-drive's request (the same operation and fingerprint)."""
    inventory.record_outcome(
        key,
        "reserve",
        status,
        {"reservation_ids": ["r_" + "0" * 32]},
        fingerprint=request_fingerprint("reserve", RESERVE),
    )


# -- the link, without workers (SQLite and PostgreSQL) ------------------------------------------------------


def test_a_redrive_is_linked_and_its_outcome_is_what_the_key_reports(inventory: Inventory) -> None:
    dead = dead_letter(inventory, "order-7")
    (listed,) = inventory.dead_letters()
    assert (listed.key, listed.request_type, listed.arguments, listed.reason) == (
        "order-7",
        "reserve",
        RESERVE,
        "backend unavailable",
    )
    assert listed.redrivable and listed.redrive is None

    planned = inventory.claim_redrive("order-7", by="ops@host", dry_run=True)
    assert (planned.key, planned.number, planned.arguments) == ("order-7~redrive-1", 1, RESERVE)
    assert inventory.redrives_of("order-7") == []  # a dry run records nothing

    claimed = inventory.claim_redrive("order-7", by="ops@host")
    assert claimed == planned
    # Running: the key still reports its dead letter, marked as being driven again.
    running = inventory.request_outcome("order-7")
    assert running is not None and running.status == "dead_lettered"
    assert running.redrive is not None and (running.redrive.key, running.redrive.final) == (
        claimed.key,
        False,
    )
    with pytest.raises(RedriveRefused, match="has no final outcome yet"):
        inventory.claim_redrive("order-7")

    ended(inventory, claimed.key)
    reported = inventory.request_outcome("order-7")
    assert reported is not None and reported.status == "reserved"
    assert (reported.key, reported.fingerprint) == ("order-7", dead.fingerprint)
    assert reported.redrive is not None
    assert (reported.redrive.key, reported.redrive.number, reported.redrive.by) == (
        claimed.key,
        1,
        "ops@host",
    )
    assert reported.redrive.final
    assert inventory.request_outcomes(["order-7"]) == {"order-7": reported}
    # Outcomes are written once: the dead letter's own row is as it was.
    assert inventory.own_outcome("order-7") == dead
    with pytest.raises(RedriveRefused, match="re-driven already: order-7~redrive-1 ended reserved"):
        inventory.claim_redrive("order-7")
    (link,) = inventory.redrives_of("order-7")
    assert (link.key, link.status) == (claimed.key, "reserved")
    assert inventory.dead_letters()[0].redrive == link


def test_a_redrive_that_dead_letters_again_is_followed_by_the_next_number(inventory: Inventory) -> None:
    dead_letter(inventory, "chain")
    first = inventory.claim_redrive("chain")
    dead_letter(inventory, first.key)  # the outage was not over yet
    # One entry per chain, under the original key, which may be driven again.
    (listed,) = inventory.dead_letters()
    assert (listed.key, listed.redrive and listed.redrive.status, listed.redrivable) == (
        "chain",
        "dead_lettered",
        True,
    )
    # Naming the re-drive drives the original request again.
    second = inventory.claim_redrive(first.key)
    assert (second.origin, second.key, second.number) == ("chain", "chain~redrive-2", 2)
    ended(inventory, second.key, "insufficient_stock")
    reported = inventory.request_outcome("chain")
    assert reported is not None and reported.status == "insufficient_stock"
    assert reported.redrive is not None and reported.redrive.number == 2
    assert [link.status for link in inventory.redrives_of("chain")] == ["dead_lettered", "insufficient_stock"]


def test_what_may_not_be_driven_again_is_refused_and_nothing_is_written(inventory: Inventory) -> None:
    dead_letter(inventory, "old-code", arguments=None)
    (listed,) = inventory.dead_letters()
    assert listed.arguments is None and not listed.redrivable
    with pytest.raises(RedriveRefused, match="does not record the request's arguments"):
        inventory.claim_redrive("old-code")
    with pytest.raises(UnknownRequest):
        inventory.claim_redrive("never-sent")
    ended(inventory, "went-fine")
    with pytest.raises(RedriveRefused, match="ended reserved, not dead_lettered"):
        inventory.claim_redrive("went-fine")
    assert inventory.redrives_of("old-code") == inventory.redrives_of("went-fine") == []
    # A claim that could not be sent is taken back: the next one takes the same number.
    dead_letter(inventory, "unsent")
    claimed = inventory.claim_redrive("unsent")
    assert inventory.drop_redrive(claimed.key)
    assert inventory.claim_redrive("unsent").key == claimed.key
    # A re-drive that ran keeps its link.
    ended(inventory, claimed.key)
    assert not inventory.drop_redrive(claimed.key)
    assert [link.key for link in inventory.redrives_of("unsent")] == [claimed.key]


def test_dead_letters_are_chosen_by_time_and_reason(inventory: Inventory) -> None:
    dead_letter(inventory, "busy-1", reason="lease busy")
    dead_letter(inventory, "down-1")
    assert {d.key for d in inventory.dead_letters(reason="backend")} == {"down-1"}
    assert [d.key for d in inventory.dead_letters(limit=1)] in (["busy-1"], ["down-1"])
    assert inventory.dead_letters(since=4_000_000_000.0) == []


def test_a_redrive_key_fits_the_key_rules_however_long_the_original() -> None:
    long_a, long_b = "a" * MAX_KEY_CHARS, "a" * (MAX_KEY_CHARS - 1) + "b"
    keys = {redrive_key(long_a, 1), redrive_key(long_b, 1), redrive_key(long_a, 12)}
    assert len(keys) == 3
    assert all(idempotency_key(k) == k and k.endswith(("~redrive-1", "~redrive-12")) for k in keys)
    assert redrive_key("short", 3) == "short~redrive-3"


def test_0009_runs_on_an_existing_database_and_lets_0008_workers_on(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'existing.sqlite3'}"
    schema.upgrade(url, "0008")
    with Inventory.from_url(url) as inv:
        # Written by code of 0008: the dead letter records no arguments.
        inv.record_outcome("before-0009", "reserve", "dead_lettered", {"reason": "backend unavailable"})
    schema.upgrade(url, "0009")
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            assert [tuple(row) for row in conn.execute(sa.select(schema_compatibility))] == [("0009", "0008")]
    finally:
        engine.dispose()
    # A worker of 0008 still starts on it: the new table is one it never reads.
    known = schema.revisions()
    assert schema.judge("0009", "0008", known[: known.index("0008") + 1]).ok
    with Inventory.from_url(url) as inv:
        (listed,) = inv.dead_letters()
        assert (listed.key, listed.arguments, listed.redrivable) == ("before-0009", None, False)


async def test_a_redrive_the_broker_did_not_take_stays_recorded_for_the_relay(inventory_url: str) -> None:
    """The re-drive is claimed and recorded before it is published: a broker that does not take it costs
    the caller an error, not the re-drive, which the relay publishes once the broker answers."""
    settings = Settings.from_env(
        {
            "RESERVATIONS_DATABASE_URL": inventory_url,
            "RESERVATIONS_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
        }
    )
    app = create_app(settings)
    try:
        with Inventory.from_url(inventory_url) as inv:
            dead_letter(inv, "client-1")
            dead_letter(inv, "client-2")
            async with ReservationClient(app) as client:
                with pytest.raises(OperationalError):
                    await client.redrive("client-1", by="test")
                with pytest.raises(OperationalError):
                    await asyncio.to_thread(client.redrive_sync, "client-2")
            for origin in ("client-1", "client-2"):
                assert [link.number for link in inv.redrives_of(origin)] == [1]
                recorded = inv.executor.run(accepted(redrive_key(origin, 1)))
                assert recorded is not None and recorded.next_look is not None
                assert recorded.request_type == "reserve" and recorded.arguments == RESERVE
    finally:
        app.close()


# -- the command line, without workers -------------------------------------------------------------------


def test_the_command_line_lists_dry_runs_and_refuses(inventory: Inventory, inventory_url: str) -> None:
    env = {
        "RESERVATIONS_DATABASE_URL": inventory_url,
        "RESERVATIONS_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    dead_letter(inventory, "cli-1")
    dead_letter(inventory, "cli-old", arguments=None)
    ended(inventory, "cli-done")

    listed = run("dead-letters", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    by_key = {d["key"]: d for d in json.loads(listed.stdout)}
    assert set(by_key) == {"cli-1", "cli-old"}
    assert by_key["cli-1"]["arguments"] == RESERVE and by_key["cli-1"]["redrivable"]
    assert by_key["cli-old"]["arguments"] is None and not by_key["cli-old"]["redrivable"]
    table = run("dead-letters", "--since", "1h", env=env, columns=200)
    assert "cli-1" in table.stdout and "cannot: no arguments" in table.stdout
    assert "2 dead-lettered request(s), 1 can be re-driven" in table.stdout

    planned = run("redrive", "--since", "1h", "--dry-run", env=env, columns=200)
    assert planned.returncode == 0, planned.stderr
    assert "would re-drive cli-1 as cli-1~redrive-1" in planned.stdout and "nothing written" in planned.stdout
    assert "cli-old" in planned.stderr  # said, and skipped
    assert "WRITES" in run("redrive", "--help", env=env).stdout

    for args, code, says in [
        (("redrive", "--since", "yesterday"), 2, "--since 'yesterday'"),
        (("redrive", "never-sent"), 3, "never-sent"),
        (("redrive", "cli-done"), 2, "ended reserved"),
        (("redrive", "cli-1", "cli-old"), 2, "does not record"),  # one refused refuses all
        (("redrive",), 2, "KEYs or --since"),
        (("dead-letters", "--since", "2x"), 2, "--since '2x'"),
    ]:
        done = run(*args, env=env)
        assert (done.returncode, done.stdout) == (code, ""), (args, done)
        assert says in done.stderr and len(done.stderr.strip().splitlines()) == 1, (args, done.stderr)
    # With the broker unreachable the re-drive is claimed and recorded all the same: the relay publishes
    # it once the broker answers.
    unsent = run("redrive", "cli-1", env=env)
    assert unsent.returncode == 4 and "broker unreachable" in unsent.stderr, unsent
    assert [link.number for link in inventory.redrives_of("cli-1")] == [1]
    assert inventory.executor.run(accepted("cli-1~redrive-1")) is not None


# -- real workers on PostgreSQL --------------------------------------------------------------------------


@pytest.fixture
def lease_redis(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "leases") as running:
        yield running


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[RedisServer]:
    with redis_server(tmp_path / "broker") as running:
        yield running


@pytest.mark.slow
def test_an_outage_dead_letters_and_redrive_gives_each_one_outcome(
    tmp_path: Path, lease_redis: RedisServer, broker: RedisServer
) -> None:
    with pg_schema() as db:
        settings = {
            "RESERVATIONS_BROKER_URL": broker.url(0),
            "RESERVATIONS_RESULT_BACKEND": broker.url(1),
            "RESERVATIONS_DATABASE_URL": db,
            "RESERVATIONS_LEASE_URL": lease_redis.url(0),
            # One retry while the lease Redis is away, then the dead letter.
            "RESERVATIONS_MAX_TRANSIENT_RETRIES": "1",
        }
        with cluster(tmp_path, settings, count=1, prefix="dl") as running, Inventory.from_url(db) as inv:
            client = running.client()
            try:
                outage(running.settings, client, inv, lease_redis)
            finally:
                client.close()
                client.app.close()


def outage(env: dict[str, str] | Any, client: Any, inv: Inventory, lease_redis: RedisServer) -> None:
    inv.add_sku("DL1", on_hand=10)
    inv.add_sku("DL2", on_hand=4)
    lease_redis.kill()
    handles = {
        "dl-a": client.enqueue_reservation_sync("DL1", 2, idempotency_key="dl-a"),
        "dl-b": client.enqueue_reservation_sync("DL1", 3, idempotency_key="dl-b"),
        "dl-c": client.enqueue_reservation_sync("DL2", 1, idempotency_key="dl-c"),
        "dl-d": client.enqueue_sync("restock", idempotency_key="dl-d", sku="DL2", quantity=5),
    }
    for key, handle in handles.items():
        dead = handle.result_sync(timeout=20)
        assert (dead.status, dead.detail["reason"]) == ("dead_lettered", "backend unavailable"), (key, dead)
        assert dead.detail["request"]["arguments"]["sku"] in ("DL1", "DL2")
    listed = run("dead-letters", "--json", env=env)
    assert {d["key"] for d in json.loads(listed.stdout) if d["redrivable"]} == set(handles)
    lease_redis.start()  # the backend is back (empty: the counter starts again, the fence does not care)

    # One through the client, the rest by the operator's command.
    first = client.redrive_sync("dl-a", by="test")
    assert first.key == "dl-a~redrive-1"
    done = run("redrive", "--since", "10m", env=env, columns=200)
    assert done.returncode == 0, done.stderr
    assert "wrote 3 re-drive(s)" in done.stdout and "dl-a" not in done.stdout, done.stdout
    for key in handles:
        # The re-drive's own outcome, then what the original key reports.
        client.wait_sync(f"{key}~redrive-1", timeout=20)
        reported = wait_until(
            lambda key=key: _final(inv, key), timeout=20, what=f"{key} to report its re-drive's outcome"
        )
        assert reported.status == ("restocked" if key == "dl-d" else "reserved"), reported
        assert reported.redrive is not None and reported.redrive.key == f"{key}~redrive-1"
        assert inv.own_outcome(key).status == "dead_lettered"  # type: ignore[union-attr]

    # Each applied once, under its re-drive's key; nothing under the dead letters' keys.
    writes = [
        (h.idempotency_key, h.operation)
        for sku in ("DL1", "DL2")
        for h in inv.history(sku)
        if h.kind == "write" and h.idempotency_key is not None  # add_sku's row has no key
    ]
    assert sorted(writes) == sorted(
        (f"{key}~redrive-1", op)
        for key, op in [("dl-a", "reserve"), ("dl-b", "reserve"), ("dl-c", "reserve"), ("dl-d", "restock")]
    )
    levels = {sku: (s.on_hand, s.reserved, s.available) for sku in ("DL1", "DL2") for s in [inv.stock(sku)]}
    assert levels == {"DL1": (10, 5, 5), "DL2": (9, 1, 8)}
    audit = run("audit", env=env)
    assert audit.returncode == 0 and "consistent" in audit.stdout, audit
    shown = run("show", "dl-b", env=env, columns=200)
    assert "outcome: reserved (from re-drive #1 dl-b~redrive-1)" in shown.stdout, shown.stdout
    assert "dead-lettered" in shown.stdout and "re-drive #1 dl-b~redrive-1 of dl-b" in shown.stdout

    # Driving them again is refused, and changes nothing.
    again = run("redrive", "dl-b", env=env)
    assert again.returncode == 2 and "re-driven already" in again.stderr, again
    assert "wrote 0 re-drive(s)" in run("redrive", "--since", "10m", env=env).stdout
    assert [len(inv.redrives_of(key)) for key in handles] == [1, 1, 1, 1]


def _final(inv: Inventory, key: str) -> RequestResult | None:
    reported = inv.request_outcome(key)
    return (
        reported if reported is not None and reported.redrive is not None and reported.redrive.final else None
    )
