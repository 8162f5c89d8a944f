"""The commands that write, each saying so in its help: requests handed to the Celery workers by task
name (this package never imports the tasks), with --wait polling their outcome; and add-sku, direct.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer

from admin.cli import context
from admin.cli.context import config
from admin.cli.failures import EXIT_FAILED, EXIT_UNREACHABLE, errors, fail
from admin.cli.options import Key, Quantity, Timeout, Wait, whole
from admin.cli.render import out
from fencing import mask_url
from reservations import counting
from reservations import validation as valid
from reservations.requests import request_id

# The final statuses of a request that did what it asked; any other ends the command with exit 1.
_DONE = ("reserved", "confirmed", "released", "restocked", "counted", "replenished")


def _enqueue(operation: str, key: str, kwargs: dict[str, Any], wait: bool, timeout: float) -> None:
    """Hand the request to the workers by task name; with --wait, poll its final outcome."""
    from tasks.producer import Producer

    valid.idempotency_key(key)
    try:
        with Producer(config.broker_url) as producer:
            producer.send(operation, key, kwargs)
    except Exception as exc:  # kombu raises its own and socket errors; all mean the broker is unusable
        fail(EXIT_UNREACHABLE, f"broker unreachable at {mask_url(config.broker_url)}: {exc}")
    out.print(f"enqueued {operation} {key} (request {request_id(key)}) on {mask_url(config.broker_url)}")
    if wait:
        _await_outcome(operation, key, kwargs, timeout)


def _await_outcome(operation: str, key: str, kwargs: dict[str, Any], timeout: float) -> None:
    """Poll the request's final outcome until ``timeout``, print it, exit 1 unless it did what it asked."""
    from reservations.messages import SHAPES, request_fingerprint

    deadline = time.monotonic() + timeout
    with context.inventory() as inventory:
        while (outcome := inventory.request_outcome(key)) is None:
            if time.monotonic() > deadline:
                fail(EXIT_FAILED, f"no outcome for {key} within {timeout:g}s (is a worker running?)")
            time.sleep(0.1)
    if not outcome.belongs_to(SHAPES[operation].operation, request_fingerprint(operation, kwargs)):
        fail(EXIT_FAILED, f"idempotency key {key!r} already names a different {outcome.operation} request")
    out.print(f"outcome: {outcome.status} {json.dumps(outcome.detail, sort_keys=True)}")
    if outcome.status not in _DONE:
        raise typer.Exit(EXIT_FAILED)


def _operating(
    operation: str, build: Callable[[], dict[str, Any]], key: str, wait: bool, timeout: float
) -> None:
    with errors():
        _enqueue(operation, key, build(), wait, timeout)


def reserve(sku: str, quantity: Quantity, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): reserve QUANTITY units of SKU.

    Example: reservations reserve WIDGET 2 --key order-1042 --wait
    """
    _operating(
        "reserve", lambda: {"sku": valid.sku(sku), "quantity": valid.quantity(quantity)}, key, wait, timeout
    )


def restock(sku: str, quantity: Quantity, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): add QUANTITY units to SKU's stock on hand.

    Example: reservations restock WIDGET 100 --key delivery-77 --wait
    """
    _operating(
        "restock", lambda: {"sku": valid.sku(sku), "quantity": valid.quantity(quantity)}, key, wait, timeout
    )


def count(
    sku: str,
    counted: Annotated[int, typer.Argument(parser=whole("counted"), help="The units counted on the shelf.")],
    key: Key,
    wait: Wait = False,
    timeout: Timeout = 30,
) -> None:
    """WRITES (through the workers): a cycle count; SKU's stock on hand becomes COUNTED.

    The worker reads the stock under the SKU's lease, then writes the figure; a count below the units
    held for reservations is refused.

    Example: reservations count WIDGET 97 --key count-0501-WIDGET --wait
    """
    _operating(
        "count",
        lambda: {"sku": valid.sku(sku), "counted": counting.counted_units(counted)},
        key,
        wait,
        timeout,
    )


def replenish(
    sku: str,
    par: Annotated[
        int, typer.Option("--par", parser=whole("--par"), help="The on-hand level to order up to.")
    ],
    key: Key,
    wait: Wait = False,
    timeout: Timeout = 30,
) -> None:
    """WRITES (through the workers): replenish SKU to its par level.

    The worker reads on hand under the SKU's lease and books PAR minus it as a restock (nothing at or
    above par).

    Example: reservations replenish WIDGET --par 120 --key reorder-0501-WIDGET --wait
    """
    _operating(
        "replenish", lambda: {"sku": valid.sku(sku), "par": counting.par_units(par)}, key, wait, timeout
    )


def confirm(reservation_id: str, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): turn a held reservation into a committed deduction.

    Example: reservations confirm r_0123... --key confirm-1042 --wait
    """
    _operating(
        "confirm", lambda: {"reservation_id": valid.reservation_id(reservation_id)}, key, wait, timeout
    )


def release(reservation_id: str, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): cancel a held reservation; its units become available again.

    Example: reservations release r_0123... --key cancel-1042 --wait
    """
    _operating(
        "release", lambda: {"reservation_id": valid.reservation_id(reservation_id)}, key, wait, timeout
    )


def add_sku(
    sku: str,
    on_hand: Annotated[
        int, typer.Option(parser=whole("--on-hand"), help="Units on hand (0, or a valid quantity).")
    ] = 0,
) -> None:
    """WRITES (directly to the database): create a SKU's stock row with ON_HAND units.

    Example: reservations add-sku WIDGET --on-hand 100
    """
    with errors(), context.inventory() as inventory:
        level = inventory.add_sku(sku, on_hand=on_hand)
    out.print(f"created {level.sku} with {level.on_hand} on hand in {mask_url(config.database_url)}")
