"""The commands that write, each saying so in its help: requests handed to the Celery workers by task
name (this package never imports the tasks), with --wait polling their outcome and --deadline bounding
when they may still be carried out; add-sku, direct; and redrive, which records each re-drive in the
database and publishes it through tasks.producer.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

import typer

from admin.cli import context, render
from admin.cli.context import config
from admin.cli.failures import EXIT_FAILED, EXIT_UNREACHABLE, EXIT_USAGE, complain, errors, fail
from admin.cli.options import Key, Quantity, Timeout, Wait, decimal, parse_since, whole
from admin.cli.render import out
from fencing import BackendUnavailable
from fencing.urls import mask_url
from reservations import Inventory, ReservationError, counting
from reservations import validation as valid
from reservations.redrives import Redrive

# The final statuses of a request that did what it asked; any other (insufficient_stock, invalid,
# dead_lettered, expired) ends the command with exit 1.
_DONE = ("reserved", "confirmed", "released", "restocked", "counted", "replenished")

Deadline = Annotated[
    float | None,
    typer.Option(
        "--deadline",
        metavar="SECONDS",
        parser=decimal("--deadline", 0.1, valid.MAX_HOLD_SECONDS),
        help=(
            "Carry the request out only within SECONDS from now: a worker that takes it up later ends it "
            "expired, touching no stock (with --wait: exit 1, as for insufficient_stock or "
            f"dead_lettered). [0.1-{valid.MAX_HOLD_SECONDS}]"
        ),
        show_default=False,
    ),
]


def _enqueue(
    operation: str, key: str, kwargs: dict[str, Any], wait: bool, timeout: float, within: float | None
) -> None:
    """Hand the request to the workers by task name, with a deadline ``within`` seconds from now if
    given; with --wait, poll its final outcome."""
    from tasks.producer import Producer, request_of

    valid.idempotency_key(key)
    deadline = None if within is None else valid.deadline(time.time() + within)
    request = request_of(operation, key, kwargs, deadline=deadline)
    # Recorded first, in the operator's space: the relay publishes it again if its message is lost.
    with context.inventory() as inventory:
        inventory.record_accepted([request], config.settings.republish_after)
    try:
        with Producer(config.broker_url) as producer:
            producer.publish(request)
    except Exception as exc:  # kombu raises its own and socket errors; all mean the broker is unusable
        fail(
            EXIT_UNREACHABLE,
            f"broker unreachable at {mask_url(config.broker_url)}: {exc} (the request is recorded in "
            f"{mask_url(config.database_url)}: a worker's relay publishes it once the broker answers)",
        )
    broker = mask_url(config.broker_url)
    out.print(f"recorded and enqueued {operation} {key} (request {request.task_id}) on {broker}")
    if wait:
        _await_outcome(operation, key, kwargs, timeout)


def _await_outcome(operation: str, key: str, kwargs: dict[str, Any], timeout: float) -> None:
    """Poll the request's final outcome until ``timeout``, print it, exit 1 unless it did what it asked."""
    from tasks.messages import SHAPES, request_fingerprint

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
    operation: str,
    build: Callable[[], dict[str, Any]],
    key: str,
    wait: bool,
    timeout: float,
    deadline: float | None,
) -> None:
    with errors():
        _enqueue(operation, key, build(), wait, timeout, deadline)


def reserve(
    sku: str,
    quantity: Quantity,
    key: Key,
    wait: Wait = False,
    timeout: Timeout = 30,
    deadline: Deadline = None,
) -> None:
    """WRITES (through the workers): reserve QUANTITY units of SKU.

    With --wait, exit 1 unless it ends reserved (insufficient_stock, invalid, dead_lettered, or expired
    when --deadline passed before it was carried out).

    Example: reservations reserve WIDGET 2 --key order-1042 --deadline 900 --wait
    """
    _operating(
        "reserve",
        lambda: {"sku": valid.sku(sku), "quantity": valid.quantity(quantity)},
        key,
        wait,
        timeout,
        deadline,
    )


def restock(
    sku: str,
    quantity: Quantity,
    key: Key,
    wait: Wait = False,
    timeout: Timeout = 30,
    deadline: Deadline = None,
) -> None:
    """WRITES (through the workers): add QUANTITY units to SKU's stock on hand.

    Example: reservations restock WIDGET 100 --key delivery-77 --wait
    """
    _operating(
        "restock",
        lambda: {"sku": valid.sku(sku), "quantity": valid.quantity(quantity)},
        key,
        wait,
        timeout,
        deadline,
    )


def count(
    sku: str,
    counted: Annotated[int, typer.Argument(parser=whole("counted"), help="The units counted on the shelf.")],
    key: Key,
    wait: Wait = False,
    timeout: Timeout = 30,
    deadline: Deadline = None,
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
        deadline,
    )


def replenish(
    sku: str,
    par: Annotated[
        int, typer.Option("--par", parser=whole("--par"), help="The on-hand level to order up to.")
    ],
    key: Key,
    wait: Wait = False,
    timeout: Timeout = 30,
    deadline: Deadline = None,
) -> None:
    """WRITES (through the workers): replenish SKU to its par level.

    The worker reads on hand under the SKU's lease and books PAR minus it as a restock (nothing at or
    above par).

    Example: reservations replenish WIDGET --par 120 --key reorder-0501-WIDGET --wait
    """
    _operating(
        "replenish",
        lambda: {"sku": valid.sku(sku), "par": counting.par_units(par)},
        key,
        wait,
        timeout,
        deadline,
    )


def confirm(
    reservation_id: str, key: Key, wait: Wait = False, timeout: Timeout = 30, deadline: Deadline = None
) -> None:
    """WRITES (through the workers): turn a held reservation into a committed deduction.

    Example: reservations confirm r_0123... --key confirm-1042 --wait
    """
    _operating(
        "confirm",
        lambda: {"reservation_id": valid.reservation_id(reservation_id)},
        key,
        wait,
        timeout,
        deadline,
    )


def release(
    reservation_id: str, key: Key, wait: Wait = False, timeout: Timeout = 30, deadline: Deadline = None
) -> None:
    """WRITES (through the workers): cancel a held reservation; its units become available again.

    Example: reservations release r_0123... --key cancel-1042 --wait
    """
    _operating(
        "release",
        lambda: {"reservation_id": valid.reservation_id(reservation_id)},
        key,
        wait,
        timeout,
        deadline,
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


def _operator() -> str:
    """Who asks, as a re-drive records it: the user and the host."""
    import getpass
    import socket

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no user name in this environment (a container without one)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def redrive(
    keys: Annotated[
        list[str] | None,
        typer.Argument(
            metavar="[KEY]...", help="Dead-lettered request keys (or --since).", show_default=False
        ),
    ] = None,
    since: Annotated[
        str | None,
        typer.Option(help="Every dead letter since: 30m, 2h, 1d or an ISO time.", show_default=False),
    ] = None,
    reason: Annotated[
        str | None,
        typer.Option(
            help="With --since: only dead letters whose reason starts with this.", show_default=False
        ),
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Check and say what would be done; write nothing.")
    ] = False,
    by: Annotated[
        str | None, typer.Option("--by", help="Who asks, recorded with each re-drive (default: user@host).")
    ] = None,
) -> None:
    """WRITES (the database, then through the workers): drive dead-lettered requests again.

    Each KEY, or each dead letter since --since (and of --reason), becomes a new request under
    KEY~redrive-N with the same operation and arguments; the link is recorded first, so KEY reports that
    request's outcome once it has one (reservations show KEY). The dead letter's own outcome is never
    changed. Refused with nothing written (exit 2) for a key that is not dead-lettered, whose dead letter
    did not record its arguments, or whose last re-drive has no outcome yet or did not end dead-lettered;
    an unknown key exits 3. With KEYs, every one is checked before any is sent.

    Example: reservations redrive --since 2h --reason 'backend unavailable' --dry-run
    """
    if bool(keys) == (since is not None):
        fail(EXIT_USAGE, "give dead-lettered KEYs or --since, not both and not neither")
    if reason is not None and since is None:
        fail(EXIT_USAGE, "--reason selects among --since's dead letters; give --since")
    with errors(), context.inventory() as inventory:
        who = valid.name(by if by is not None else _operator(), field="by", max_chars=valid.MAX_WORKER_CHARS)
        if keys:
            chosen = _checked_keys(inventory, keys, who)
        else:
            chosen = _since(inventory, parse_since(since), reason, who)
        if dry_run:
            for claim in chosen:
                out.print(
                    f"would re-drive {claim.origin} as {claim.key} ({claim.request_type} {_args(claim)})"
                )
            out.print(f"dry run: {len(chosen)} request(s) would be re-driven; nothing written")
            return
        _send_redrives(inventory, chosen, who)


def _args(claim: Redrive) -> str:
    return json.dumps(claim.arguments, sort_keys=True, separators=(",", ":"))


def _checked_keys(inventory: Inventory, keys: list[str], who: str | None) -> list[Redrive]:
    """Every KEY checked as its re-drive would be (nothing recorded): one refused refuses them all."""
    chosen: dict[str, Redrive] = {}
    for key in keys:
        claim = inventory.claim_redrive(valid.idempotency_key(key), by=who, dry_run=True)
        chosen.setdefault(claim.origin, claim)  # a key given twice, or with one of its re-drives: once
    return list(chosen.values())


def _since(
    inventory: Inventory, starting: float | None, reason: str | None, who: str | None
) -> list[Redrive]:
    """The dead letters since ``starting`` that may be driven again; those that may not are said."""
    from reservations.errors import RedriveRefused

    found = inventory.dead_letters(since=starting, reason=reason, limit=valid.MAX_LIMIT)
    if len(found) == valid.MAX_LIMIT:
        complain(logging.WARNING, f"only the newest {valid.MAX_LIMIT} dead letters: run again for the rest")
    chosen = []
    with render.progress("checking dead letters", len(found)) as advance:
        for dead in found:
            advance(1)
            if dead.arguments is None:
                complain(
                    logging.WARNING, f"{dead.key}: its dead letter does not record the request's arguments"
                )
                continue
            if not dead.redrivable:
                continue  # its re-drive is running or ended otherwise: nothing to do for it
            try:
                chosen.append(inventory.claim_redrive(dead.key, by=who, dry_run=True))
            except RedriveRefused as refused:
                complain(logging.WARNING, str(refused))
    return chosen


def _send_redrives(inventory: Inventory, chosen: list[Redrive], who: str | None) -> None:
    """Claim and publish each; a refusal found now (someone else re-drove it meanwhile) is said and the
    rest go on; an unreachable broker stops the run (the claim it could not send is taken back)."""
    from reservations.errors import RedriveRefused
    from tasks.producer import Producer, Sender

    sent, refused = 0, 0
    try:
        producer = Producer.configured(config.settings)
    except Exception as exc:
        fail(EXIT_UNREACHABLE, f"broker unusable at {mask_url(config.broker_url)}: {exc}")
    sender = Sender(producer, lambda: inventory, config.settings.republish_after)
    with producer, render.progress("re-driving", len(chosen)) as advance:
        for claim in chosen:
            advance(1)
            try:
                done, task_id = sender.redrive(claim.origin, by=who)
            except RedriveRefused as exc:
                complain(logging.WARNING, str(exc))
                refused += 1
                continue
            except (ReservationError, BackendUnavailable):
                raise
            except Exception as exc:  # kombu's and socket errors: the broker is unusable
                fail(
                    EXIT_UNREACHABLE,
                    f"broker unreachable at {mask_url(config.broker_url)}: {exc} ({sent} re-driven before; "
                    f"{claim.origin} not re-driven)",
                )
            sent += 1
            out.print(f"re-driving {done.origin} as {done.key} (re-drive #{done.number}, request {task_id})")
    out.print(
        f"wrote {sent} re-drive(s) to {mask_url(config.database_url)} and enqueued them on "
        f"{mask_url(config.broker_url)}"
    )
    if refused:
        raise typer.Exit(EXIT_FAILED)
