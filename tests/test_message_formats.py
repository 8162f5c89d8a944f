"""Old messages are still served: every recorded request message of every released format
(tests/fixtures/messages/v<N>/, recorded by tests/record_messages.py from the code of that release) is
put as it was recorded onto the broker queue of a real ``celery worker`` of this code, with only what
names one request replaced by fresh values (its key and the task id derived from it, its SKUs, the
reservation it confirms or releases, a deadline that would have passed, the broker's delivery tag), and
must end with the outcome and the stock change it asked for, on SQLite and on PostgreSQL.

The raw message goes onto the queue as the broker carries it (an LPUSH of the JSON payload onto the
Redis list, as kombu's producer does): nothing of this code's producers takes part, so a producer that
changed its layout cannot hide a worker that no longer reads the old one.

Then the format header: this code's producers send the current format, a format-2 fixture names its
format (its worker's retry too), and a message of a format the worker does not know (a newer one, or
not a format at all) ends dead-lettered, touching no stock and taking no lease, its detail naming the
formats, and is served once driven again.
"""

from __future__ import annotations

import base64
import json
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from celery.utils.saferepr import saferepr

from fencing import LeaseManager
from reservations import Inventory
from reservations import validation as valid
from reservations.request_outcomes import RequestResult, request_id
from reservations.statuses import RequestStatus
from tasks import ReservationClient
from tasks.messages import (
    COUNTERS,
    CURRENT_FORMAT,
    DEADLINE,
    FORMAT,
    FORMATS,
    SKU_HINT,
    UNMARKED_FORMAT,
    UnknownFormat,
    format_of,
    parse,
    request_fingerprint,
    sku_hint,
)
from tasks.producer import Producer
from testing.harness import wait_until
from testing.redis_servers import RedisServer, redis_server
from testing.workers import Cluster, one_worker

pytestmark = pytest.mark.slow

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "messages"
ALL = sorted(FIXTURES.glob("v*/*.json"))
OUTCOME_TIMEOUT = 30.0
ON_HAND = 10

# What each recorded case asks for, by the letter of the SKU (the recorder's FIXSKU-A and FIXSKU-B):
# its final status, and the SKUs' (on hand, reserved) afterwards, each SKU starting with ON_HAND units.
# Written here, not read from the fixtures: a fixture whose arguments changed fails instead of
# bringing its own expectation along.
EXPECTED: dict[str, tuple[str, dict[str, tuple[int, int]]]] = {
    "reserve": ("reserved", {"A": (10, 2)}),
    "reserve_held": ("reserved", {"A": (10, 2)}),
    "reserve_async": ("reserved", {"A": (10, 2)}),
    "reserve_order": ("reserved", {"A": (10, 1), "B": (10, 2)}),
    "redrive": ("reserved", {"A": (10, 1), "B": (10, 2)}),
    "confirm": ("confirmed", {"A": (8, 0)}),
    "release": ("released", {"A": (10, 0)}),
    "restock": ("restocked", {"A": (15, 0)}),
    "restock_retry": ("restocked", {"B": (15, 0)}),
    "count": ("counted", {"A": (7, 0)}),
    "count_shrinkage": ("counted", {"A": (8, 0)}),
    "replenish": ("replenished", {"A": (20, 0)}),
}


def fixture_id(path: Path) -> str:
    return f"{path.parent.name}/{path.stem}"


def load(path: Path) -> dict[str, Any]:
    fixture: dict[str, Any] = json.loads(path.read_text())
    return fixture


def test_every_released_format_has_fixtures_of_every_request_type() -> None:
    """Each format's folder covers every request task a producer publishes, and names itself."""
    formats = sorted({path.parent.name for path in ALL})
    assert "v1" in formats
    for version in formats:
        fixtures = [load(path) for path in ALL if path.parent.name == version]
        tasks = {fixture["task"] for fixture in fixtures}
        assert tasks == {f"reservations.{name}" for name in REQUEST_TASKS}, version
        assert {fixture["format"] for fixture in fixtures} == {int(version.removeprefix("v"))}
        assert {fixture["case"] for fixture in fixtures} <= set(EXPECTED), version


REQUEST_TASKS = ("reserve", "reserve_order", "confirm", "release", "restock", "count", "replenish")


def test_a_format_from_2_on_is_named_by_its_every_message() -> None:
    """A fixture of format 2 or later names its format in its header, a worker's retry included;
    format 1 is the one without it."""
    for path in ALL:
        fixture = load(path)
        headers = fixture["message"]["headers"]
        if fixture["format"] == UNMARKED_FORMAT:
            assert FORMAT not in headers, path
        else:
            assert headers[FORMAT] == fixture["format"], path
    assert f"v{CURRENT_FORMAT}" in {path.parent.name for path in ALL}, "record the current format's fixtures"
    assert {int(path.parent.name.removeprefix("v")) for path in ALL} <= set(FORMATS)


# -- the format, without services ----------------------------------------------------------------------------


class Delivered:
    """A delivered message's request, holding its headers as attributes as Celery's does."""

    def __init__(self, **headers: object) -> None:
        self.__dict__.update(headers)


def test_a_message_without_the_header_is_format_1() -> None:
    assert format_of(Delivered()) == UNMARKED_FORMAT == 1
    assert format_of(Delivered(**{FORMAT: 2})) == 2
    assert format_of(Delivered(**{FORMAT: "7"})) == "7"  # as sent: parse refuses it


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sku": "A-1", "quantity": 2, "hold_for": 90.5, "idempotency_key": "k-1"},
        {"lines": [["A", 1], ["B", 2]], "hold_for": None, "idempotency_key": "o"},
        {"sku": 'it\'s "q"', "counted": None, "shrinkage": 3, "idempotency_key": "c"},
        {"lines": [[f"SKU-{n}", n] for n in range(200)], "idempotency_key": "long"},  # past Celery's cut
    ],
)
def test_a_producers_kwargsrepr_header_is_the_one_celery_makes(kwargs: dict[str, Any]) -> None:
    """The producer makes the header with repr, not Celery's slower saferepr: the same text, cut where
    Celery cuts it (the transport reads a poison message's key from it)."""
    producer = Producer("redis://127.0.0.1:1/0")
    try:
        amqp = producer.app.amqp
        message = amqp.create_task_message("t", "reservations.reserve", (), kwargs)
        assert message.headers["kwargsrepr"] == saferepr(kwargs, amqp.kwargsrepr_maxsize, maxlevels=3)
        assert message.headers["argsrepr"] == "()"
    finally:
        producer.close()


def test_a_sku_hint_header_is_followed_when_it_is_a_sku_and_ignored_otherwise(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The SKU hint is a header no format names, as the deadline is: a worker that does not know it ignores
    it, and one that does ignores a malformed one (logged) and reads the reservation instead."""
    assert sku_hint("A-1") == "A-1" and sku_hint(None) is None
    for malformed in ("two words", "", 7, ["A"], "x" * 1000):
        assert sku_hint(malformed, key="k") is None
    assert caplog.text.count(SKU_HINT) == 5 and "x" * 100 not in caplog.text


@pytest.mark.parametrize("message_format", FORMATS)
def test_every_known_format_is_parsed_alike(message_format: int) -> None:
    sent = {"sku": "W", "quantity": 2, "idempotency_key": "k-1"}
    parsed = parse("reserve", [], sent, message_format=message_format)
    assert parsed == parse("reserve", [], sent)  # the current format by default
    assert parsed.fingerprint == request_fingerprint("reserve", sent)


@pytest.mark.parametrize("message_format", [3, 0, -1, "2", 2.5, True, None, [2]])
def test_a_format_the_worker_does_not_know_is_refused_before_anything_else(message_format: object) -> None:
    # Arguments this worker would refuse as malformed: the format is checked first, and they are kept.
    sent = {"item": "W", "units": 2, "idempotency_key": "k-1", "busy": 4}
    with pytest.raises(UnknownFormat) as refused:
        parse("reserve", [], sent, message_format=message_format)
    exc = refused.value
    assert (exc.key, exc.status, exc.field) == ("k-1", RequestStatus.DEAD_LETTERED, FORMAT)
    detail = exc.detail()
    assert detail["reason"] == "unknown message format" and detail["formats"] == [1, 2]
    assert detail["request"] == {"type": "reserve", "arguments": {"item": "W", "units": 2}}
    assert f"format {message_format!r}:" in detail["error"] and "formats 1 and 2" in detail["error"]
    assert exc.fingerprint is not None and exc.fingerprint != request_fingerprint("reserve", sent)
    # Without a usable key it is refused all the same, with nowhere to record it.
    with pytest.raises(UnknownFormat) as keyless:
        parse("reserve", [], {"sku": "W"}, message_format=message_format)
    assert keyless.value.key is None


def test_a_positional_message_of_an_unknown_format_carries_nothing_to_drive_again() -> None:
    with pytest.raises(UnknownFormat) as refused:
        parse("reserve", ["W", 2], {"idempotency_key": "k-1"}, message_format=3)
    assert "request" not in refused.value.detail()


def test_this_codes_producer_sends_the_current_format(tmp_path: Path) -> None:
    with redis_server(tmp_path / "redis") as server, Producer(server.url(0)) as producer:
        producer.send("restock", "k-wire", {"sku": "W", "quantity": 1})
        producer.send("reserve", "k-late", {"sku": "W", "quantity": 1}, deadline=time.time() + 60)
        with redis.Redis.from_url(server.url(0)) as broker:
            sent = [json.loads(raw)["headers"] for raw in reversed(broker.lrange("celery", 0, -1))]
    assert [headers[FORMAT] for headers in sent] == [CURRENT_FORMAT, CURRENT_FORMAT]
    assert DEADLINE in sent[1]


# -- the substitution ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fresh:
    """The values naming one request of a fixture, this time."""

    key: str
    skus: dict[str, str]  # the fixture's SKU -> a fresh one
    reservation_id: str | None


def fresh_message(fixture: dict[str, Any], fresh: Fresh) -> tuple[dict[str, Any], bytes]:
    """The fixture's message with ``fresh``'s values in place of its stand-ins, and its raw payload as
    the broker's queue would hold it."""
    stand_ins = fixture["stand_ins"]
    text = json.dumps(fixture["message"])
    swaps = {stand_ins["key"]: fresh.key, request_id(stand_ins["key"]): request_id(fresh.key)}
    swaps.update({sku: fresh.skus[sku] for sku in stand_ins.get("skus", [])})
    if fresh.reservation_id is not None:
        swaps[stand_ins["reservation_id"]] = fresh.reservation_id
    for old, new in swaps.items():
        assert old in text, f"{old!r} is not in the recorded message"
        text = text.replace(old, new)
    message: dict[str, Any] = json.loads(text)
    headers, properties = message["headers"], message["properties"]
    if DEADLINE in headers:  # recorded as a deadline that has passed since: carried out, not expired
        headers[DEADLINE] = time.time() + 600
    properties["delivery_tag"] = str(uuid.uuid4())
    assert properties["body_encoding"] == "base64"
    raw = {**message, "body": base64.b64encode(json.dumps(message["body"]).encode()).decode()}
    return message, json.dumps(raw).encode()


# -- a worker of this code ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Running:
    cluster: Cluster
    broker: redis.Redis
    client: ReservationClient
    inventory: Inventory

    def publish(self, raw: bytes) -> None:
        """Onto the worker's queue as kombu's Redis producer puts it there (it consumes from the other
        end)."""
        self.broker.lpush("celery", raw)

    def outcome(self, key: str) -> RequestResult:
        try:
            found: RequestResult = wait_until(
                lambda: self.inventory.request_outcome(key),
                timeout=OUTCOME_TIMEOUT,
                what=f"the outcome of {key}",
            )
        except Exception as exc:
            raise AssertionError(f"{exc}\n{self.cluster.tails()}") from None
        return found

    def publish_fixture(self, path: Path, **headers: object) -> tuple[Fresh, dict[str, Any]]:
        """Put the recorded message at ``path`` on the queue with fresh values and ``headers`` set."""
        fixture = load(FIXTURES / path)
        fresh = fresh_for(self, fixture)
        message, _ = fresh_message(fixture, fresh)
        message["headers"].update(headers)
        raw = {**message, "body": base64.b64encode(json.dumps(message["body"]).encode()).decode()}
        self.publish(json.dumps(raw).encode())
        return fresh, message

    def held_reservation(self, sku: str) -> str:
        """A reservation of 2 units of ``sku`` held by a request through the worker: its id."""
        handle = self.client.enqueue_reservation_sync(sku, 2, idempotency_key=f"held-{uuid.uuid4().hex}")
        result = handle.result_sync(timeout=OUTCOME_TIMEOUT)
        assert result.status == "reserved", result
        (reservation,) = result.detail["reservation_ids"]
        return str(reservation)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    with redis_server(tmp_path_factory.mktemp("redis")) as running:
        yield running


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def running(
    request: pytest.FixtureRequest,
    server: RedisServer,
    migrated_sqlite: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Running]:
    """One worker of this code on the inventory database (its SQL leases there too), on a private Redis."""
    kind: str = request.param
    workdir = tmp_path_factory.mktemp(f"formats_{kind}")
    with one_worker(kind, workdir, server.url, migrated_sqlite, prefix="fmt") as (started, url):
        client = started.client()
        inventory = Inventory.from_url(url)
        broker = redis.Redis.from_url(started.settings["RESERVATIONS_BROKER_URL"])
        try:
            yield Running(started, broker, client, inventory)
        finally:
            broker.close()
            inventory.close()
            client.close()
            client.app.close()


def fresh_for(running: Running, fixture: dict[str, Any]) -> Fresh:
    """Fresh values for the fixture's stand-ins: the SKUs created with ON_HAND units each, and for a
    confirm or release a reservation held on its first SKU."""
    run = uuid.uuid4().hex[:10]
    stand_ins = fixture["stand_ins"]
    key = re.sub(r"^msgfix-", f"msgfix-{run}-", stand_ins["key"])
    assert key != stand_ins["key"]
    reservation = None
    if "reservation_id" in stand_ins:
        skus = {"FIXSKU-A": f"FMT{run}-A"}
        running.inventory.add_sku(skus["FIXSKU-A"], on_hand=ON_HAND)
        reservation = running.held_reservation(skus["FIXSKU-A"])
    else:
        skus = {sku: f"FMT{run}-{sku.rpartition('-')[2]}" for sku in stand_ins["skus"]}
        for sku in skus.values():
            running.inventory.add_sku(sku, on_hand=ON_HAND)
    return Fresh(key, skus, reservation)


@pytest.mark.parametrize("path", ALL, ids=fixture_id)
def test_a_recorded_message_is_served(running: Running, path: Path) -> None:
    fixture = load(path)
    fresh = fresh_for(running, fixture)
    message, raw = fresh_message(fixture, fresh)
    running.publish(raw)
    outcome = running.outcome(fresh.key)

    status, stock = EXPECTED[fixture["case"]]
    assert outcome.status == status, outcome
    name = fixture["task"].removeprefix("reservations.")
    kwargs = {k: v for k, v in message["body"][1].items() if k not in COUNTERS}
    # The worker recorded the request under the fingerprint a producer computes for it today: a copy of
    # the same request sent in any format names the same request.
    assert outcome.fingerprint == request_fingerprint(name, kwargs)
    for letter, (on_hand, reserved) in stock.items():
        level = running.inventory.stock(fresh.skus[f"FIXSKU-{letter}"])
        assert (level.on_hand, level.reserved) == (on_hand, reserved), (letter, level)
    assert [a.result for a in running.inventory.attempts(fresh.key)] == ["applied"]


# -- formats on a worker ---------------------------------------------------------------------------------


@pytest.mark.parametrize("message_format", [1, 2])
def test_a_known_format_named_in_the_header_is_served(running: Running, message_format: int) -> None:
    fresh, _ = running.publish_fixture(Path("v1/client.reserve.json"), **{FORMAT: message_format})
    assert running.outcome(fresh.key).status == "reserved"
    level = running.inventory.stock(fresh.skus["FIXSKU-A"])
    assert (level.on_hand, level.reserved) == (10, 2)


@pytest.mark.parametrize("message_format", [3, "two"])
def test_a_message_of_an_unknown_format_is_dead_lettered_untouched_and_driven_again(
    running: Running, message_format: object
) -> None:
    fresh, _ = running.publish_fixture(Path("v1/client.reserve_order.json"), **{FORMAT: message_format})
    ended = running.outcome(fresh.key)
    assert (ended.status, ended.operation) == ("dead_lettered", "reserve_many")
    assert ended.detail["reason"] == "unknown message format"
    assert f"reserve_order message of format {message_format!r}:" in ended.detail["error"]
    assert ended.detail["format"] == message_format and ended.detail["formats"] == [1, 2]
    assert ended.epochs == 0
    skus = [fresh.skus["FIXSKU-A"], fresh.skus["FIXSKU-B"]]
    for sku in skus:
        level = running.inventory.stock(sku)
        assert (level.on_hand, level.reserved) == (ON_HAND, 0)
        assert [(h.kind, h.operation) for h in running.inventory.history(sku)] == [("write", "create")]
    with LeaseManager.from_url(running.cluster.lease_url) as leases:
        assert all(leases.history(valid.scope_of(sku)) == [] for sku in skus)
    assert running.inventory.attempts(fresh.key) == []
    # Once a worker that knows it runs (here: driven again, by this code's producer, in its format) it is
    # served as the request it was, under the re-drive's key.
    redriven = running.client.redrive_sync(fresh.key, by="test")
    served = redriven.result_sync(timeout=OUTCOME_TIMEOUT)
    assert served.status == "reserved", served
    assert [running.inventory.stock(sku).reserved for sku in skus] == [1, 2]


# -- a dead letter whatever its message held -------------------------------------------------------------

HUGE = 5_000_000
UNWRITABLE = [
    pytest.param(float("nan"), "NaN", False, id="NaN format"),
    pytest.param(float("inf"), "Infinity", False, id="Infinity format"),
    pytest.param("9" * HUGE, None, False, id="huge format"),
    pytest.param(3, 3, True, id="huge argument"),
]


@pytest.mark.parametrize(("message_format", "shown", "huge_argument"), UNWRITABLE)
def test_a_message_of_an_unknown_format_is_dead_lettered_whatever_it_holds(
    running: Running, message_format: object, shown: object, huge_argument: bool
) -> None:
    """A format JSON cannot store (NaN, Infinity) or one of 5 MB, or an argument of 5 MB: the dead letter
    is recorded all the same, within the limit of an outcome's detail (tests/test_refusal_details.py)."""
    fixture = load(FIXTURES / "v1/client.reserve.json")
    fresh = fresh_for(running, fixture)
    message, _ = fresh_message(fixture, fresh)
    message["headers"][FORMAT] = message_format
    if huge_argument:
        message["body"][1]["note"] = "x" * HUGE
    body = base64.b64encode(json.dumps(message["body"]).encode()).decode()
    running.publish(json.dumps({**message, "body": body}).encode())

    ended = running.outcome(fresh.key)
    assert (ended.status, ended.operation) == ("dead_lettered", "reserve")
    assert ended.detail["reason"] == "unknown message format" and ended.detail["formats"] == [1, 2]
    if shown is None:
        assert ended.detail["format"].startswith("999") and f"({HUGE} characters)" in ended.detail["format"]
    else:
        assert ended.detail["format"] == shown
    if huge_argument:
        assert "request" not in ended.detail
        assert ended.detail["request_too_large"]["arguments_chars"] > HUGE
    else:
        assert ended.detail["request"]["arguments"]["sku"] == fresh.skus["FIXSKU-A"]
    level = running.inventory.stock(fresh.skus["FIXSKU-A"])
    assert (level.on_hand, level.reserved) == (ON_HAND, 0)
    assert running.inventory.attempts(fresh.key) == []
