"""The ``reservations`` admin command line: inspect token history, leases, stock and rejections; enqueue
and operate. Reads go straight to the database and the lease coordinator; writes either go through the
Celery workers (enqueued by task name, so this module never imports them) or say plainly that they write.

Exit codes: 0 success, 1 a check failed, 2 bad usage or input, 3 not found, 4 a backend is unreachable
(or reachable without its schema: ``reservations db upgrade`` creates it).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from fencing import BackendUnavailable, FencingError, InvalidLeaseRequest, LeaseManager, mask_url
from reservations import validation as valid
from reservations.errors import InvalidRequest, ReservationError, UnknownReservation, UnknownSku
from reservations.inventory import Inventory
from reservations.requests import request_id
from reservations.timeline import epochs

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_NOT_FOUND, EXIT_UNREACHABLE = 0, 1, 2, 3, 4

app = typer.Typer(
    help=(
        "Fenced inventory reservations: inspect token history, leases, stock and rejections; operate.\n\n"
        "Exit codes: 0 ok, 1 check failed, 2 bad usage or input, 3 not found, 4 backend unreachable "
        "(or without its schema)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
db_app = typer.Typer(
    help="Database schema (Alembic migrations shipped with the package).", no_args_is_help=True
)
app.add_typer(db_app, name="db")

out = Console(soft_wrap=False)
err = Console(stderr=True, soft_wrap=True)


class Config:
    """Where the CLI reads and writes: the same environment variables the workers use."""

    database_url: str = "sqlite:///var/reservations.sqlite3"
    lease_url: str | None = None
    lease_prefix: str = "fencing"
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = "redis://127.0.0.1:6379/1"


config = Config()


@app.callback()
def _root(
    database_url: Annotated[
        str, typer.Option(envvar="RESERVATIONS_DATABASE_URL", help="Inventory database URL.")
    ] = Config.database_url,
    lease_url: Annotated[
        str | None,
        typer.Option(envvar="RESERVATIONS_LEASE_URL", help="Lease backend URL (default: the database)."),
    ] = None,
    lease_prefix: Annotated[
        str, typer.Option(envvar="RESERVATIONS_LEASE_PREFIX", help="Redis key prefix of leases.")
    ] = Config.lease_prefix,
    broker_url: Annotated[
        str, typer.Option(envvar="RESERVATIONS_BROKER_URL", help="Celery broker, for enqueue commands.")
    ] = Config.broker_url,
    result_backend: Annotated[
        str,
        typer.Option(
            envvar="RESERVATIONS_RESULT_BACKEND", help="Celery result backend (demo --use-configured)."
        ),
    ] = Config.result_backend,
) -> None:
    config.database_url = database_url
    config.lease_url = lease_url or None
    config.lease_prefix = lease_prefix
    config.broker_url = broker_url
    config.result_backend = result_backend


# -- plumbing -------------------------------------------------------------------------------------------


def _fail(code: int, message: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@contextmanager
def _errors() -> Iterator[None]:
    """One clear line and a documented exit code instead of a traceback."""
    import redis
    from sqlalchemy.exc import DBAPIError

    from reservations.schema import RevisionNotFound

    try:
        yield
    except (UnknownSku, UnknownReservation) as exc:
        _fail(EXIT_NOT_FOUND, str(exc))
    except (InvalidRequest, InvalidLeaseRequest, RevisionNotFound) as exc:
        _fail(EXIT_USAGE, str(exc))
    except BackendUnavailable as exc:
        # The SQL lease backend reports every OperationalError as unreachable, and SQLite's "no such
        # table" is one: a database that answers but was never migrated needs an upgrade, not a network.
        _fail_if_schema_missing(exc)
        _fail(EXIT_UNREACHABLE, f"{exc} ({mask_url(config.database_url)}, leases {_lease_url_shown()})")
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        _fail(EXIT_UNREACHABLE, f"Redis unreachable at {_lease_url_shown()}: {exc}")
    except DBAPIError as exc:
        _fail_if_schema_missing(exc)
        first = str(exc.orig).strip().splitlines()[0] if exc.orig else type(exc).__name__
        _fail(EXIT_UNREACHABLE, f"database error at {mask_url(config.database_url)}: {first}")
    except (ReservationError, FencingError) as exc:
        _fail(EXIT_FAILED, str(exc))


# A table or column the migrations create, as PostgreSQL (SQLSTATE) and SQLite (message) report it.
_SCHEMA_STATES = {"42P01": "missing", "42703": "out of date"}
_SCHEMA_MESSAGES = {
    "no such table": "missing",
    "no such column": "out of date",
    "has no column": "out of date",
}


def _fail_if_schema_missing(exc: BaseException) -> None:
    """Exit with one line naming the upgrade when the database error in ``exc``'s chain is a table or
    column the migrations create; return for any other error."""
    from sqlalchemy.exc import DBAPIError

    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, DBAPIError):
        seen = seen.__cause__ or seen.__context__
    if seen is None or seen.orig is None:
        return
    first = str(seen.orig).strip().splitlines()[0]
    state = getattr(seen.orig, "sqlstate", None)
    if state is not None:
        problem = _SCHEMA_STATES.get(state)
    else:
        problem = next((v for k, v in _SCHEMA_MESSAGES.items() if k in first), None)
    if problem is None:
        return
    # The lease tables may live in a database of their own (RESERVATIONS_LEASE_URL): name the one to upgrade.
    if config.lease_url and "fencing_lease" in first:
        where = f" on the lease database {mask_url(config.lease_url)}"
    else:
        where = f" on {mask_url(config.database_url)}"
    _fail(EXIT_UNREACHABLE, f"schema {problem}: run `reservations db upgrade`{where} ({first})")


def _lease_url_shown() -> str:
    return mask_url(config.lease_url or config.database_url)


def _inventory() -> Inventory:
    return Inventory.from_url(config.database_url)


def _leases() -> LeaseManager:
    return LeaseManager.from_url(config.lease_url or config.database_url, prefix=config.lease_prefix)


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


_RELATIVE = re.compile(r"([0-9]+(?:\.[0-9]+)?)([smhd])")


def parse_since(text: str | None) -> float | None:
    """``30m``, ``2h``, ``1d`` ago, or an ISO 8601 time (UTC when it has no zone) -> epoch seconds."""
    if text is None:
        return None
    match = _RELATIVE.fullmatch(text)
    if match:
        unit = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
        return time.time() - float(match.group(1)) * unit
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise InvalidRequest(f"--since {text!r}: use 30m, 2h, 1d or an ISO time", field="since") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.timestamp()


def _when(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def _short_time(seconds: float | None) -> str:
    return _when(seconds)[11:] if seconds is not None else ""


# Python's int() and float() also take " 3", "1_000", non-ASCII digits, "1e3" and "nan", and typer's
# int type takes "3.0": none of those is how a person writes a count, so numbers are matched first.
_WHOLE = re.compile(r"[0-9]+")
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]+)?")


def whole(name: str, low: int = 0, high: int | None = None) -> Callable[[str | int], int]:
    """A typer parser for a whole number written with the digits 0-9 only, within [low, high]."""

    def parse(text: str | int) -> int:
        if isinstance(text, int):  # a default, already typed
            return text
        if not _WHOLE.fullmatch(text):
            _fail(EXIT_USAGE, f"{name} {text!r}: write a whole number with the digits 0-9 only")
        return _within(name, int(text), low, high)

    return parse


def decimal(name: str, low: float, high: float) -> Callable[[str | float], float]:
    """A typer parser for a number written as digits 0-9 with an optional fraction (``2``, ``0.5``)."""

    def parse(text: str | float) -> float:
        if isinstance(text, int | float):  # a default, already typed
            return float(text)
        if not _DECIMAL.fullmatch(text):
            _fail(EXIT_USAGE, f"{name} {text!r}: write a number with the digits 0-9, like 2 or 0.5")
        return _within(name, float(text), low, high)

    return parse


Number = TypeVar("Number", int, float)


def _within(name: str, value: Number, low: Number, high: Number | None) -> Number:
    if value < low or (high is not None and value > high):
        span = f"at least {low:g}" if high is None else f"between {low:g} and {high:g}"
        _fail(EXIT_USAGE, f"{name} must be {span}, got {value:g}")
    return value


def _count(name: str, low: int, high: int, help: str) -> Any:
    return typer.Option(name, parser=whole(name, low, high), help=f"{help} [{low}-{high}]")


def _seconds(name: str, low: float, high: float, help: str) -> Any:
    return typer.Option(name, parser=decimal(name, low, high), help=f"{help} [{low:g}-{high:g}]")


JsonFlag = Annotated[bool, typer.Option("--json", help="Machine-readable output (stable field names).")]
Limit = Annotated[int, _count("--limit", 1, 10_000, "At most this many entries.")]
Since = Annotated[str | None, typer.Option(help="Only entries since: 30m, 2h, 1d or an ISO time.")]


# -- read commands --------------------------------------------------------------------------------------


@app.command("tokens")
def tokens(sku: str, limit: Limit = 1000, since: Since = None, as_json: JsonFlag = False) -> None:
    """The SKU's token history: each token with its holder, when it was acquired, how it ended, the
    writes accepted under it and the stale writes refused (presented token, highest token, holder).

    JSON: {"sku", "epochs": [{"token", "holder", "acquired_at", "ended", "writes": [{"at", "operation",
    "quantity", "idempotency_key"}], "rejections": [{"at", "operation", "quantity", "presented_token",
    "highest_token", "holder", "idempotency_key"}]}]}  (times are epoch seconds)

    Example: reservations tokens WIDGET --since 1h
    """
    with _errors():
        valid.sku(sku)
        starting = parse_since(since)
        with _inventory() as inventory, _leases() as leases:
            inventory.stock(sku)  # unknown SKU -> exit 3
            timeline = inventory.timeline(sku, leases, limit=limit)
        if starting is not None:
            timeline = [e for e in timeline if e.at >= starting]
        grouped = epochs(timeline)
    if as_json:
        _emit_json(
            {
                "sku": sku,
                "epochs": [
                    {
                        "token": e.token,
                        "holder": e.holder,
                        "acquired_at": e.acquired_at,
                        "ended": e.ended,
                        "writes": [
                            {
                                "at": w.at,
                                "operation": w.operation,
                                "quantity": w.quantity,
                                "idempotency_key": w.idempotency_key,
                            }
                            for w in e.writes
                        ],
                        "rejections": [
                            {
                                "at": r.at,
                                "operation": r.operation,
                                "quantity": r.quantity,
                                "presented_token": r.token,
                                "highest_token": r.highest_token,
                                "holder": r.holder,
                                "idempotency_key": r.idempotency_key,
                            }
                            for r in e.rejections
                        ],
                    }
                    for e in grouped
                ],
            }
        )
        return
    table = Table(title=f"Tokens of {sku}", title_justify="left", expand=False)
    table.add_column("token", justify="right")
    table.add_column("holder", overflow="fold", max_width=22)
    table.add_column("acquired (UTC)")
    table.add_column("ended")
    table.add_column("writes / rejected", overflow="fold", max_width=24)
    for e in grouped:
        lines = [f"+ {w.operation} {w.quantity if w.quantity is not None else ''}".rstrip() for w in e.writes]
        lines += [f"x {r.operation}: stale vs {r.highest_token}" for r in e.rejections]
        table.add_row(
            str(e.token),
            e.holder or "",
            _short_time(e.acquired_at),
            e.ended or "current",
            "\n".join(lines) or "-",
        )
    out.print(table)
    rejected = sum(len(e.rejections) for e in grouped)
    out.print(f"{len(grouped)} tokens, {rejected} stale writes rejected")


@app.command("leases")
def leases_command(sku: Annotated[str | None, typer.Argument()] = None, as_json: JsonFlag = False) -> None:
    """Current leases with holder, token and time left (of one SKU, or of every SKU in stock).

    JSON: [{"sku", "token", "holder", "time_left"}]

    Example: reservations leases WIDGET
    """
    with _errors(), _inventory() as inventory, _leases() as leases:
        skus = [valid.sku(sku)] if sku is not None else [s.sku for s in inventory.all_stock()]
        rows: list[dict[str, Any]] = []
        for name in skus:
            info = leases.current(valid.scope_of(name))
            if info is not None:
                rows.append(
                    {
                        "sku": name,
                        "token": info.token,
                        "holder": info.holder,
                        "time_left": round(info.time_left, 3),
                    }
                )
    if as_json:
        _emit_json(rows)
        return
    table = Table(title=f"Current leases ({_lease_url_shown()})", title_justify="left")
    for column in ("sku", "token", "holder", "time left"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["sku"], str(row["token"]), row["holder"], f"{row['time_left']:.1f}s")
    out.print(table if rows else "no SKU is leased right now")


@app.command("stock")
def stock_command(sku: Annotated[str | None, typer.Argument()] = None, as_json: JsonFlag = False) -> None:
    """On hand, reserved, available, the highest accepted token and the requests waiting for the SKU's
    lease holder to serve them in a batch, of one SKU or all.

    JSON: [{"sku", "on_hand", "reserved", "available", "fence_token", "waiting"}]

    Example: reservations stock --json
    """
    with _errors(), _inventory() as inventory:
        levels = [inventory.stock(valid.sku(sku))] if sku is not None else inventory.all_stock()
        waiting = inventory.waiting_by_sku()
    if as_json:
        _emit_json([{**asdict(level), "waiting": waiting.get(level.sku, 0)} for level in levels])
        return
    table = Table(title="Stock", title_justify="left")
    for column in ("sku", "on hand", "reserved", "available", "token", "waiting"):
        table.add_column(column, justify="left" if column == "sku" else "right")
    for level in levels:
        table.add_row(
            level.sku,
            str(level.on_hand),
            str(level.reserved),
            str(level.available),
            str(level.fence_token),
            str(waiting.get(level.sku, 0)),
        )
    out.print(table)


@app.command("rejections")
def rejections(
    sku: Annotated[str | None, typer.Option(help="Only this SKU.")] = None,
    since: Since = None,
    limit: Limit = 100,
    as_json: JsonFlag = False,
) -> None:
    """Stale writes the database refused, with counts per SKU.

    JSON: {"counts": {sku: n}, "rejections": [{"sku", "at", "operation", "quantity", "presented_token",
    "highest_token", "holder", "idempotency_key"}]}  (the list only with --sku)

    Example: reservations rejections --since 1d
    """
    with _errors(), _inventory() as inventory:
        starting = parse_since(since)
        counts = inventory.rejection_counts(since=starting)
        entries = []
        if sku is not None:
            valid.sku(sku)
            counts = {k: v for k, v in counts.items() if k == sku}
            entries = [h for h in inventory.history(sku, limit=limit, since=starting) if h.kind == "rejected"]
    if as_json:
        _emit_json(
            {
                "counts": counts,
                "rejections": [
                    {
                        "sku": h.sku,
                        "at": h.at,
                        "operation": h.operation,
                        "quantity": h.quantity,
                        "presented_token": h.token,
                        "highest_token": h.highest_token,
                        "holder": h.holder,
                        "idempotency_key": h.idempotency_key,
                    }
                    for h in entries
                ],
            }
        )
        return
    table = Table(title="Rejected", title_justify="left")
    table.add_column("sku")
    table.add_column("count", justify="right")
    for name, count in counts.items():
        table.add_row(name, str(count))
    out.print(table if counts else "no stale write was rejected")
    if entries:
        detail = Table(title=f"Rejections of {sku}", title_justify="left")
        for column in ("time (UTC)", "operation", "token", "highest", "holder"):
            detail.add_column(column, overflow="fold")
        for h in entries:
            detail.add_row(_short_time(h.at), h.operation, str(h.token), str(h.highest_token), h.holder or "")
        out.print(detail)


@app.command("show")
def show(key_or_id: str, as_json: JsonFlag = False) -> None:
    """One request or reservation: its reservation, final outcome and attempts.

    JSON: {"reservation": {...} | null, "outcome": {...} | null, "attempts": [...]}

    Example: reservations show order-1042
    """
    with _errors(), _inventory() as inventory:
        try:
            found = inventory.reservation(key_or_id)
        except UnknownReservation:
            found = None
        key = found.idempotency_key if found is not None else key_or_id
        outcome = inventory.request_outcome(key) if _is_key(key) else None
        attempts = inventory.attempts(key)
        if found is None and outcome is None and not attempts:
            raise UnknownReservation(key_or_id)
    if as_json:
        _emit_json(
            {
                "reservation": asdict(found) if found else None,
                "outcome": asdict(outcome) if outcome else None,
                "attempts": [asdict(a) for a in attempts],
            }
        )
        return
    if found is not None:
        out.print(
            f"reservation {found.id}: {found.status}, {found.quantity} x {found.sku} "
            f"(token {found.token}, key {found.idempotency_key})"
        )
    if outcome is not None:
        out.print(
            f"outcome: {outcome.status} after {outcome.epochs} lost epoch(s) "
            f"{json.dumps(outcome.detail, sort_keys=True)}"
        )
    for a in attempts:
        out.print(f"  attempt {_short_time(a.at)} {a.result} token={a.token} worker={a.worker}")


def _is_key(text: str) -> bool:
    try:
        valid.idempotency_key(text)
        return True
    except InvalidRequest:
        return False


# -- operating commands ---------------------------------------------------------------------------------


def _enqueue(operation: str, key: str, kwargs: dict[str, Any], wait: bool, timeout: float) -> None:
    """Hand the request to the workers by task name; with --wait, poll its final outcome."""
    from reservations.messages import SHAPES, request_fingerprint
    from tasks.producer import Producer

    valid.idempotency_key(key)
    try:
        with Producer(config.broker_url) as producer:
            producer.send(operation, key, kwargs)
    except Exception as exc:  # kombu raises its own and socket errors; all mean the broker is unusable
        _fail(EXIT_UNREACHABLE, f"broker unreachable at {mask_url(config.broker_url)}: {exc}")
    out.print(f"enqueued {operation} {key} (request {request_id(key)}) on {mask_url(config.broker_url)}")
    if not wait:
        return
    deadline = time.monotonic() + timeout
    with _inventory() as inventory:
        while (outcome := inventory.request_outcome(key)) is None:
            if time.monotonic() > deadline:
                _fail(EXIT_FAILED, f"no outcome for {key} within {timeout:g}s (is a worker running?)")
            time.sleep(0.1)
    if not outcome.belongs_to(SHAPES[operation].operation, request_fingerprint(operation, kwargs)):
        _fail(EXIT_FAILED, f"idempotency key {key!r} already names a different {outcome.operation} request")
    out.print(f"outcome: {outcome.status} {json.dumps(outcome.detail, sort_keys=True)}")
    if outcome.status not in ("reserved", "confirmed", "released", "restocked"):
        raise typer.Exit(EXIT_FAILED)


Key = Annotated[str, typer.Option("--key", help="Idempotency key: the same key never applies twice.")]
Wait = Annotated[bool, typer.Option("--wait", help="Wait for the final outcome and print it.")]
Timeout = Annotated[float, _seconds("--timeout", 0.1, 3600, "Seconds to wait with --wait.")]
# The range of a quantity is the domain's (validation.quantity), checked with the other fields.
Quantity = Annotated[int, typer.Argument(parser=whole("quantity"))]


def _operating(
    operation: str, build: Callable[[], dict[str, Any]], key: str, wait: bool, timeout: float
) -> None:
    with _errors():
        _enqueue(operation, key, build(), wait, timeout)


@app.command("reserve")
def reserve(sku: str, quantity: Quantity, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): reserve QUANTITY units of SKU.

    Example: reservations reserve WIDGET 2 --key order-1042 --wait
    """
    _operating(
        "reserve", lambda: {"sku": valid.sku(sku), "quantity": valid.quantity(quantity)}, key, wait, timeout
    )


@app.command("restock")
def restock(sku: str, quantity: Quantity, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): add QUANTITY units to SKU's stock on hand.

    Example: reservations restock WIDGET 100 --key delivery-77 --wait
    """
    _operating(
        "restock", lambda: {"sku": valid.sku(sku), "quantity": valid.quantity(quantity)}, key, wait, timeout
    )


@app.command("confirm")
def confirm(reservation_id: str, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): turn a held reservation into a committed deduction.

    Example: reservations confirm r_0123... --key confirm-1042 --wait
    """
    _operating(
        "confirm", lambda: {"reservation_id": valid.reservation_id(reservation_id)}, key, wait, timeout
    )


@app.command("release")
def release(reservation_id: str, key: Key, wait: Wait = False, timeout: Timeout = 30) -> None:
    """WRITES (through the workers): cancel a held reservation; its units become available again.

    Example: reservations release r_0123... --key cancel-1042 --wait
    """
    _operating(
        "release", lambda: {"reservation_id": valid.reservation_id(reservation_id)}, key, wait, timeout
    )


@app.command("add-sku")
def add_sku(
    sku: str,
    on_hand: Annotated[
        int, typer.Option(parser=whole("--on-hand"), help="Units on hand (0, or a valid quantity).")
    ] = 0,
) -> None:
    """WRITES (directly to the database): create a SKU's stock row with ON_HAND units.

    Example: reservations add-sku WIDGET --on-hand 100
    """
    with _errors(), _inventory() as inventory:
        level = inventory.add_sku(sku, on_hand=on_hand)
    out.print(f"created {level.sku} with {level.on_hand} on hand in {mask_url(config.database_url)}")


@app.command("config")
def show_config() -> None:
    """Where this command line reads and writes (passwords masked)."""
    out.print(f"database: {mask_url(config.database_url)}")
    out.print(f"leases:   {_lease_url_shown()} (prefix {config.lease_prefix})")
    out.print(f"broker:   {mask_url(config.broker_url)}")
    out.print(f"results:  {mask_url(config.result_backend)}")


# -- schema and demo ------------------------------------------------------------------------------------


@db_app.command("upgrade")
def db_upgrade(revision: Annotated[str, typer.Argument()] = "head") -> None:
    """WRITES: migrate the database schema to REVISION (default: the newest).

    Example: RESERVATIONS_DATABASE_URL=postgresql://app@db/inv reservations db upgrade
    """
    from reservations import schema

    with _errors():
        schema.upgrade(config.database_url, revision)
        out.print(f"{mask_url(config.database_url)} is at revision {schema.current(config.database_url)}")


@db_app.command("current")
def db_current() -> None:
    """Show the database's schema revision and the newest one this package ships.

    Example: reservations db current
    """
    from reservations import schema

    with _errors():
        out.print(f"database: {mask_url(config.database_url)}")
        out.print(f"current:  {schema.current(config.database_url) or 'none (empty database)'}")
        out.print(f"head:     {schema.head()}")


@app.command("demo")
def demo_command(
    folder: Annotated[
        Path, typer.Option(help="The demo's own folder, recreated on every run (databases, worker logs).")
    ] = Path("var/demo"),
    use_configured: Annotated[
        bool,
        typer.Option(
            "--use-configured",
            help="Run on the configured database, leases, broker and result backend, and WRITE there.",
        ),
    ] = False,
) -> None:
    """WRITES (to its own folder, or with --use-configured to the configured database): the warehouse
    case study with real Celery workers. A is frozen with SIGSTOP past its lease, B takes the next token
    and reserves, A resumes and its late write is rejected; A's request is driven again.

    By default it needs no services and writes only to FOLDER, which it recreates on every run (it wipes
    only a folder it made, or an empty one): the inventory and the SQL leases in a SQLite file, Celery's
    SQLAlchemy transport as broker and result store. The configured URLs are not used.

    --use-configured runs it on RESERVATIONS_DATABASE_URL, _LEASE_URL, _LEASE_PREFIX, _BROKER_URL and
    _RESULT_BACKEND (or the options before the command), e.g. PostgreSQL and Redis. It WRITES there: it
    migrates the database to the newest schema and creates a new SKU DEMO-XXXXXXXX on every run, whose
    held units and history stay. Give it a broker no other worker consumes: its two requests are for
    its own workers A and B.

    Example: reservations demo
    """
    from admin import demo

    if not use_configured:
        given = [name for name, value in _given_urls().items() if value]
        if given:
            out.print(
                f"not using the configured {', '.join(given)} (--use-configured would)", highlight=False
            )
        backends = None
    else:
        backends = demo.Backends(
            database_url=config.database_url,
            lease_url=config.lease_url or config.database_url,
            lease_prefix=config.lease_prefix,
            broker_url=config.broker_url,
            result_backend=config.result_backend,
        )
    # Errors name the configured URLs, which only a run on them should report.
    with _errors() if use_configured else nullcontext():
        try:
            ok = demo.run(folder, out, backends)
        except demo.DemoFailed as exc:
            _fail(EXIT_FAILED, str(exc))
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def _given_urls() -> dict[str, bool]:
    """Which URLs were given (by environment or option) rather than left at their defaults."""
    return {
        "database": config.database_url != Config.database_url,
        "leases": config.lease_url is not None,
        "broker": config.broker_url != Config.broker_url,
        "result backend": config.result_backend != Config.result_backend,
    }


@app.command("chaos")
def chaos_command(
    workers: Annotated[int, _count("--workers", 2, 16, "Celery worker processes.")] = 3,
    skus: Annotated[int, _count("--skus", 1, 50, "SKUs the requests spread over.")] = 3,
    requests: Annotated[int, _count("--requests", 1, 5000, "Requests per run (replays included).")] = 120,
    duration: Annotated[
        float, _seconds("--duration", 2, 600, "Seconds of request stream and faults, per run.")
    ] = 20.0,
    drain: Annotated[float, _seconds("--drain", 1, 600, "Longest wait for the last outcomes.")] = 40.0,
    seed: Annotated[int, typer.Option(parser=whole("--seed"), help="Seed of the request stream.")] = 1,
    lease_redis_restart: Annotated[
        bool, typer.Option(help="Restart the lease Redis mid-run, losing its data (token counters).")
    ] = True,
    proxy_delay: Annotated[
        float,
        _seconds(
            "--proxy-delay",
            0,
            30,
            "One worker reaches PostgreSQL through a proxy delaying its packets this long.",
        ),
    ] = 0.0,
    hot: Annotated[
        float,
        typer.Option(
            parser=decimal("--hot", 0, 0.9),
            help="Share of the requests that are a flash sale: bursts of reservations of one SKU (0: none) "
            "[0-0.9]",
        ),
    ] = 0.5,
    batching: Annotated[
        bool, typer.Option(help="A busy SKU's reservations wait for its holder to serve them in batches.")
    ] = True,
    postgres_url: Annotated[
        str, typer.Option(envvar="RESERVATIONS_CHAOS_POSTGRES_URL", help="PostgreSQL for the run schemas.")
    ] = "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    folder: Annotated[
        Path | None, typer.Option(help="Keep worker logs here (default: a temporary folder, removed).")
    ] = None,
    pictures: Annotated[
        Path, typer.Option(help="Folder for the SVG timeline of each run (token bands, writes, refusals).")
    ] = Path("var/chaos"),
    as_json: Annotated[bool, typer.Option("--json", help="Print both runs' metrics as JSON.")] = False,
) -> None:
    """WRITES (own schemas, dropped afterwards): the fault-injection run, twice, fenced and lease-only.

    Real workers (and celery beat) on PostgreSQL and two private redis-servers (broker; leases) take a
    stream of requests, a share of them a flash sale of one hot SKU served in batches, while workers
    freeze past their lease (batch servers among them), one is SIGKILLed and restarted and the lease
    Redis loses its data; a checker then audits the database. Exit 1 when the fenced run has any
    violation.

    JSON fields per run (fenced, lease_only): enqueued, replayed, resent, faults, statuses,
    rejected_stale_writes, lost_ownership_by_worker_role, lost_ownership_serving_batches_by_worker_role,
    batching_on, hot_sku, hot_stock, flash_sale {requests, statuses}, batching {batches, requests,
    for_others, largest, stale_refused, writes_behind_newer_token, left_pending, watches, swept,
    longest_wait}, violations, checks (rule -> sentences), picture.

    Example: reservations chaos --workers 3 --skus 3 --requests 120 --duration 20
    """
    from admin import chaos

    options = chaos.Options(
        workers=workers,
        skus=skus,
        requests=requests,
        duration=duration,
        drain=drain,
        seed=seed,
        restart_lease_redis=lease_redis_restart,
        proxy_delay=proxy_delay,
        hot=hot,
        batching=batching,
        postgres_url=postgres_url,
        folder=folder,
        pictures=pictures,
    )
    try:
        ok = chaos.run(options, None if as_json else out, as_json=as_json)
    except chaos.ChaosFailed as exc:
        _fail(EXIT_FAILED, str(exc))
    except KeyboardInterrupt:
        err.print("interrupted: workers, redis-servers and schemas cleaned up")
        raise typer.Exit(130) from None
    if not ok:
        raise typer.Exit(EXIT_FAILED)


@app.command("fence-demo")
def fence_demo(
    database: Annotated[Path, typer.Option(help="SQLite file to (re)create for the demo.")] = Path(
        "var/fence-demo.sqlite3"
    ),
    ttl: Annotated[float, _seconds("--ttl", 0.05, 10, "Lease ttl of worker A, in seconds.")] = 0.5,
) -> None:
    """Replay the seed timeline in-process: A's lease expires, B writes, A's late write is rejected.

    Runs on an embedded SQLite database with no services.

    Example: reservations fence-demo --ttl 0.3
    """
    from admin import fence_demo as demo

    try:
        ok = demo.run(database, ttl=ttl)
    except ValueError as exc:
        _fail(EXIT_USAGE, str(exc))
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def main() -> None:
    app()
