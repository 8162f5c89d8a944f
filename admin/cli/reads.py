"""The read commands: token history, leases, stock, rejections, one request, the invariant audit and
the configuration. They go straight to the database and the lease coordinator and never write.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.table import Table

from admin.cli import context, render
from admin.cli.context import lease_url_shown
from admin.cli.failures import EXIT_FAILED, errors
from admin.cli.options import (
    JsonFlag,
    Limit,
    OneSku,
    Since,
    SkuOption,
    one_sku,
    parse_since,
    seconds,
    the_sku,
)
from admin.cli.render import out
from fencing.manager import MAX_SCOPES_READ
from reservations import validation as valid
from reservations.errors import InvalidRequest, UnknownReservation
from reservations.redrives import REDRIVE_MARK
from reservations.request_outcomes import MAX_TASKS_READ
from reservations.timeline import epochs


def tokens(
    sku_argument: OneSku = None,
    sku_option: SkuOption = None,
    limit: Limit = 1000,
    since: Since = None,
    as_json: JsonFlag = False,
) -> None:
    """The SKU's token history: each token with its holder, when it was acquired, how it ended, the
    writes accepted under it, the stale writes refused (presented token, highest token, holder) and, for
    a holder that wrote nothing, the final outcome of its request (insufficient_stock, ...), found by the
    task its lease holder names.

    A last line accounts for every token issued up to the newest: how many wrote or were refused, how
    many only the lease history knows (Redis keeps a SKU's last 4 epochs), how many were issued without
    reaching the database, and the SKU's request outcomes recorded without a token (a reservation short
    of units writes only its outcome). Workers are named host:pid, as their records name them.

    History archived by `reservations archive` shows as one line: tokens up to N archived, with the span.

    JSON: {"sku", "epochs": [{"token", "holder", "acquired_at", "ended", "writes": [{"at", "operation",
    "quantity", "idempotency_key"}], "rejections": [{"at", "operation", "quantity", "presented_token",
    "highest_token", "holder", "idempotency_key"}], "outcome": null or {"key", "status", "worker",
    "task_id", "at"}}], "archived": null or {"highest_token", "before", "archived_at", "archive",
    "on_hand", "reserved"}, "issued": {"highest_token", "after_token", "with_records",
    "lease_history_only", "without_records"}, "tokenless_outcomes": [{"key", "status", "worker",
    "task_id", "at"}]}  (times in ISO 8601, UTC)

    Example: reservations tokens WIDGET --since 1h
    """
    sku = the_sku(sku_argument, sku_option)
    with errors():
        valid.sku(sku)
        starting = parse_since(since)
        with context.inventory() as inventory, context.leases() as leases:
            inventory.stock(sku)  # unknown SKU -> exit 3
            timeline = inventory.timeline(sku, leases, limit=limit)
            archived = inventory.archived(sku)
            if starting is not None:
                timeline = [e for e in timeline if e.at >= starting]
            grouped = epochs(timeline)
            # What a holder that wrote nothing did: its request's outcome, by the task its holder names.
            tasks = {e.token: task for e in grouped if (task := render.holder_task(e.holder)) is not None}
            newest_tasks = sorted(set(tasks.values()))[-MAX_TASKS_READ:]
            told = inventory.outcomes_for_tokens(sku, newest_tasks, since=starting, limit=limit)
    by_task = {o.task_id: o for o in told if o.task_id is not None}
    outcome_of = {token: by_task[task] for token, task in tasks.items() if task in by_task}
    explained = {o.key for o in outcome_of.values()}
    tokenless = [o for o in told if o.detail.get("sku") == sku and o.key not in explained]
    issued = render.tokens_issued(grouped, archived, tokenless)
    if as_json:
        shown = render.epochs_json(sku, grouped, outcome_of)
        render.emit_json(
            shown
            | {
                "archived": render.archived_json(archived),
                "issued": issued,
                "tokenless_outcomes": [render.outcome_brief(o) for o in tokenless],
            }
        )
        return
    if archived is not None:
        # The tokens of the archived days are in the archive files; the checkpoint keeps the highest.
        out.print(render.archived_line(archived), soft_wrap=True)
    out.print(render.epochs_table(sku, grouped, outcome_of))
    rejected = sum(len(e.rejections) for e in grouped)
    out.print(f"{len(grouped)} tokens, {rejected} stale writes rejected")
    out.print(render.issued_line(issued, tokenless))


def leases(sku_argument: OneSku = None, sku_option: SkuOption = None, as_json: JsonFlag = False) -> None:
    """Current leases with holder, token and time left (of one SKU, or of every SKU in stock).

    JSON: [{"sku", "token", "holder", "time_left"}]

    Example: reservations leases WIDGET
    """
    sku = one_sku(sku_argument, sku_option)
    with errors(), context.inventory() as inventory, context.leases() as coordinator:
        skus = [valid.sku(sku)] if sku is not None else [s.sku for s in inventory.all_stock()]
        rows: list[dict[str, Any]] = []
        # A round trip per MAX_SCOPES_READ SKUs (one pipeline, or one statement), not one per SKU.
        for start in range(0, len(skus), MAX_SCOPES_READ):
            scopes = {valid.scope_of(name): name for name in skus[start : start + MAX_SCOPES_READ]}
            found = coordinator.current_many(list(scopes))
            for scope, name in scopes.items():
                info = found.get(scope)
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
        render.emit_json(rows)
        return
    out.print(render.leases_table(rows, lease_url_shown()) if rows else "no SKU is leased right now")


def stock(
    sku_argument: OneSku = None,
    sku_option: SkuOption = None,
    prefix: Annotated[str | None, typer.Option(help="Only SKUs starting with this.")] = None,
    after: Annotated[
        str | None, typer.Option(help="The next page: the SKU of the previous page's last row.")
    ] = None,
    limit: Limit = 1000,
    as_json: JsonFlag = False,
) -> None:
    """On hand, reserved, available, the highest accepted token and the requests waiting for the SKU's
    lease holder to serve them in a batch, of one SKU or all: at most --limit SKUs in SKU order (1000 by
    default), --after the previous page's last SKU for the next, --prefix to narrow them.

    JSON: [{"sku", "on_hand", "reserved", "available", "fence_token", "waiting"}]

    Example: reservations stock --prefix WID --limit 100
    """
    sku = one_sku(sku_argument, sku_option)
    with errors(), context.inventory() as inventory:
        if sku is not None:
            levels = [inventory.stock(valid.sku(sku))]
        else:
            levels = inventory.all_stock(after=after, limit=limit, prefix=prefix)
        waiting = inventory.waiting_by_sku()
    if as_json:
        render.emit_json(render.stock_json(levels, waiting))
        return
    out.print(render.stock_table(levels, waiting))
    if sku is None and len(levels) == limit:
        out.print(f"{limit} SKUs shown; next page: --after {levels[-1].sku}", soft_wrap=True)


def rejections(
    sku_argument: OneSku = None,
    sku_option: SkuOption = None,
    since: Since = None,
    limit: Limit = 100,
    as_json: JsonFlag = False,
) -> None:
    """Stale writes the database refused, with counts per SKU.

    JSON: {"counts": {sku: n}, "rejections": [{"sku", "at", "operation", "quantity", "presented_token",
    "highest_token", "holder", "idempotency_key"}]}  (the newest --limit per SKU; times in ISO 8601, UTC)

    Example: reservations rejections --since 1d
    """
    sku = one_sku(sku_argument, sku_option)
    with errors(), context.inventory() as inventory:
        starting = parse_since(since)
        counts = inventory.rejection_counts(since=starting)
        if sku is not None:
            valid.sku(sku)
            counts = {k: v for k, v in counts.items() if k == sku}
        entries = [
            h
            for name in counts
            for h in inventory.history(name, limit=limit, since=starting)
            if h.kind == "rejected"
        ]
    if as_json:
        render.emit_json(render.rejections_json(counts, entries))
        return
    out.print(render.rejection_counts_table(counts) if counts else "no stale write was rejected")
    if sku is not None and entries:
        out.print(render.rejections_table(sku, entries))


def show(key_or_id: str, as_json: JsonFlag = False) -> None:
    """One request or reservation: its reservation, final outcome and attempts. A dead-lettered request
    that was driven again reports its latest re-drive's outcome (its "redrive" names it) and shows its
    dead letter and every re-drive.

    A request accepted without an outcome yet is shown as pending (or retrying, once a worker made an
    attempt), with its arguments and how often it was published.

    JSON: {"request": {"state", "caller", "type", "arguments", "task_id", "publishes", "accepted_at",
    "deadline", "next_look"} | null (only without an outcome), "reservation": {...} | null,
    "outcome": {..., "redrive": {"key", "number", "at", "by", "final"} | null} | null,
    "attempts": [...], "dead_letter": {...} | null, "redrives": [{"origin",
    "key", "number", "at", "by", "status"}]}

    Example: reservations show order-1042
    """
    with errors(), context.inventory() as inventory:
        try:
            found = inventory.reservation(key_or_id)
        except UnknownReservation:
            found = None
        key = found.idempotency_key if found is not None else key_or_id
        is_key = _is_key(key)
        outcome = inventory.request_outcome(key) if is_key else None
        attempts = inventory.attempts(key)
        # Accepted and recorded, with no outcome yet: pending, or retrying once a worker made an attempt.
        recorded = inventory.accepted(key) if is_key and outcome is None else None
        if found is None and outcome is None and not attempts and recorded is None:
            raise UnknownReservation(key_or_id)
        # A dead letter driven again: its own row, and every re-drive (of it, or of the request that
        # this re-drive drove again).
        dead = inventory.own_outcome(key) if outcome is not None and outcome.redrive is not None else None
        redriven = is_key and outcome is not None and (outcome.redrive is not None or REDRIVE_MARK in key)
        links = inventory.redrives_of(key) if redriven else []
    if as_json:
        shown = render.request_json(found, outcome, attempts, dead, links)
        render.emit_json({**shown, "request": render.recorded_json(recorded, attempts)})
        return
    if recorded is not None:
        out.print(render.recorded_line(recorded, attempts))
    for line in render.request_lines(found, outcome, attempts, dead, links):
        out.print(line)


Reason = Annotated[
    str | None,
    typer.Option(
        "--reason", help="Only dead letters whose reason starts with this, e.g. 'backend unavailable'."
    ),
]


def dead_letters(
    since: Since = None, reason: Reason = None, limit: Limit = 1000, as_json: JsonFlag = False
) -> None:
    """Requests that ended dead_lettered, newest first: key, operation, the request's arguments, reason,
    when, worker, and whether it was driven again (reservations redrive) and how that ended. A re-drive
    that dead-lettered too is shown under the original key, which may then be driven again; --since
    counts from the latest dead letter of such a chain.

    JSON: [{"key", "operation", "request_type", "arguments", "reason", "error", "at", "worker",
    "task_id", "redrive": {"origin", "key", "number", "at", "by", "status"} | null, "redrivable"}]
    (times in ISO 8601, UTC; "arguments" null for a dead letter that did not record them)

    Example: reservations dead-letters --since 2h --reason 'backend unavailable'
    """
    with errors():
        starting = parse_since(since)
        with context.inventory() as inventory:
            found = inventory.dead_letters(since=starting, reason=reason, limit=limit)
    if as_json:
        render.emit_json(render.dead_letters_json(found))
        return
    if not found:
        out.print("no dead-lettered request" + (f" since {since}" if since else ""))
        return
    out.print(render.dead_letters_table(found))
    ready = sum(d.redrivable for d in found)
    out.print(f"{len(found)} dead-lettered request(s), {ready} can be re-driven (reservations redrive)")


def actions(
    target: Annotated[str | None, typer.Option(help="Only actions on this request key or SKU.")] = None,
    since: Since = None,
    limit: Limit = 100,
    as_json: JsonFlag = False,
) -> None:
    """The operator action log, newest first: each action taken by hand (re-drive, republish, break a
    lease) from the console at /console/, with who took it, when, on what and why.

    JSON: [{"id", "at", "action", "target", "by", "reason", "detail"}] (times in ISO 8601, UTC)

    Example: reservations actions --target WIDGET
    """
    with errors():
        starting = parse_since(since)
        with context.inventory() as inventory:
            found = inventory.operator_actions(target=target, since=starting, limit=limit)
    rows = [
        {"id": a.id, "at": render.iso(a.at), "action": a.action, "target": a.target, "by": a.by,
         "reason": a.reason, "detail": a.detail}
        for a in found
    ]  # fmt: skip
    if as_json:
        render.emit_json(rows)
        return
    if not found:
        out.print("no action was taken by hand" + (f" on {target}" if target else ""))
        return
    table = Table(title="Actions taken by hand", title_justify="left")
    for column in ("when (UTC)", "action", "target", "by", "reason", "detail"):
        table.add_column(column, overflow="fold")
    for a in found:
        detail = json.dumps(a.detail, sort_keys=True, separators=(",", ":")) if a.detail else "-"
        table.add_row(render.when(a.at), a.action, a.target, a.by, a.reason, detail)
    out.print(table)


def requests(
    state: Annotated[
        str | None,
        typer.Option(
            "--state",
            help="pending, retrying, in-flight (no outcome yet), stuck (no outcome past --stuck-after), or "
            "an outcome's status (reserved, dead_lettered, expired...).",
        ),
    ] = None,
    operation: Annotated[str | None, typer.Option(help="Only this operation (reserve, confirm...).")] = None,
    since: Since = None,
    stuck_after: Annotated[
        float, seconds("--stuck-after", 1, 30 * 24 * 3600, "With --state stuck: seconds without an outcome.")
    ] = 600.0,
    after: Annotated[
        str | None, typer.Option(help="The next page: the key of the previous page's last row.")
    ] = None,
    limit: Limit = 100,
    as_json: JsonFlag = False,
) -> None:
    """The recorded requests, newest accepted first: key, operation, state (an outcome's status, or
    pending / retrying while none), when accepted and ended, attempts and publications. --state stuck
    lists those without an outcome for longer than --stuck-after; --after KEY gives the next page.

    JSON: [{"key", "operation", "caller", "state", "accepted_at", "ended_at", "attempts", "publishes",
    "deadline"}] (times in ISO 8601, UTC)

    Example: reservations requests --state stuck

    Example: reservations requests --state dead_lettered --since 1d --limit 50
    """
    with errors():
        starting = parse_since(since)
        with context.inventory() as inventory:
            found = inventory.accepted_requests(
                state=state,
                operation=operation,
                since_ms=None if starting is None else round(starting * 1000),
                stuck_after=stuck_after,
                after=after,
                limit=limit,
            )
    if as_json:
        render.emit_json(render.requests_json(found))
        return
    if not found:
        out.print("no request" + (f" {state}" if state else "") + (f" since {since}" if since else ""))
        return
    out.print(render.requests_table(found))
    more = f"; next page: --after {found[-1].key}" if len(found) == limit else ""
    out.print(f"{len(found)} request(s){more}", soft_wrap=True)


def _is_key(text: str) -> bool:
    try:
        valid.idempotency_key(text)
        return True
    except InvalidRequest:
        return False


def audit(sku_argument: OneSku = None, sku_option: SkuOption = None, as_json: JsonFlag = False) -> None:
    """The inventory's invariants, checked from the database alone; exit 1 when any is broken.

    Rules: oversell (available < 0); conservation (on hand = available + reserved, reserved = held
    reservations, the history's deltas explain the stock); token_order (no accepted write carries a
    lower token than an earlier one); key_applied_twice (one idempotency key changed stock once);
    past_par (a replenishment ordered on hand past its par: on hand grew after the read it decided from).

    JSON: [{"rule", "sku", "message"}]  (empty when consistent)

    Example: reservations audit WIDGET
    """
    sku = one_sku(sku_argument, sku_option)
    with errors(), context.inventory() as inventory:
        if sku is not None:
            inventory.stock(valid.sku(sku))  # unknown SKU -> exit 3
        with render.progress("checking the invariants", None, quiet=as_json):
            found = [v for v in inventory.invariant_violations() if sku is None or v.sku == sku]
    if as_json:
        render.emit_json(render.violations_json(found))
    elif found:
        out.print(render.violations_table(found))
        out.print(f"{len(found)} invariant violation(s)")
    else:
        out.print("consistent: every invariant holds" + (f" for {sku}" if sku is not None else ""))
    if found:
        raise typer.Exit(EXIT_FAILED)


def show_config(as_json: JsonFlag = False) -> None:
    """Every setting in effect (passwords masked) and where it came from: environment, file (a password
    file's), option, default. The variables, their types, ranges and help: tasks.settings."""
    rows = context.config.settings.report()
    if as_json:
        render.emit_json(rows)
        return
    # A name is never cut (it is what a reader types back); a value wraps, whole, on a narrow terminal.
    table = Table(box=None, pad_edge=False)
    table.add_column("variable", no_wrap=True, min_width=max(len(row["name"]) for row in rows))
    table.add_column("value", overflow="fold")
    table.add_column("from", overflow="fold")
    for row in rows:
        source = row["source"] + (f" {row['password_file']}" if "password_file" in row else "")
        table.add_row(row["name"], row["value"], source)
    out.print(table)
