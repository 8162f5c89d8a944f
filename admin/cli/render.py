"""How the read commands print: the two consoles, JSON on stdout with stable field names, UTC times,
and one Rich table (or JSON shape) per kind of record.
"""

from __future__ import annotations

import datetime as dt
import json
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from reservations.acceptance import Accepted, Listed
from reservations.audit import Violation
from reservations.redrives import DeadLetter, RedriveLink
from reservations.request_outcomes import Attempt, RequestResult
from reservations.timeline import Epoch, TimelineEntry
from reservations.values import ArchivedHistory, HistoryEntry, ReservationView, StockLevel

out = Console(soft_wrap=False)
err = Console(stderr=True, soft_wrap=True)


def narrative() -> Console:
    """For a run told line by line (the demo): a terminal wraps each line at its width, a pipe keeps
    each line whole, so nothing breaks mid-sentence in a log or a grep."""
    return Console(soft_wrap=not sys.stdout.isatty())


@contextmanager
def progress(description: str, total: int | None, *, quiet: bool = False) -> Iterator[Callable[[int], None]]:
    """A progress bar on stderr while a long command works (a spinner when ``total`` is unknown), drawn
    only when both stdout and stderr are terminals: piped, logged or ``quiet`` (--json), the command says
    nothing more than its result. Yields the function that counts ``n`` more done.

    Rich decides what a terminal is, so ``TTY_COMPATIBLE=1`` (or ``FORCE_COLOR``) draws it anywhere and
    ``TTY_COMPATIBLE=0`` never."""
    if quiet or not (out.is_terminal and err.is_terminal):
        yield lambda n: None
        return
    if total is None:
        columns: tuple[Any, ...] = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    else:
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


def emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


def when(seconds: float | None) -> str:
    if seconds is None:
        return ""
    return dt.datetime.fromtimestamp(seconds, dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]


def short_time(seconds: float | None) -> str:
    return when(seconds)[11:] if seconds is not None else ""


def iso(seconds: float | None) -> str | None:
    """A time as JSON gives it: ISO 8601 in UTC with milliseconds (``2026-12-03T14:49:04.555Z``)."""
    if seconds is None:
        return None
    moment = dt.datetime.fromtimestamp(seconds, dt.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _iso_times(record: Mapping[str, Any]) -> dict[str, Any]:
    """A record with its times (``at`` and ``*_at`` fields, epoch seconds) in ISO 8601."""
    return {k: iso(v) if (k == "at" or k.endswith("_at")) and v is not None else v for k, v in record.items()}


def folded(table: Table) -> Table:
    """``table`` with every cell wrapped, whole, when its column is narrower than the value: on a narrow
    terminal Rich would otherwise cut names and values with an ellipsis, and a cut key or SKU cannot be
    typed back."""
    for column in table.columns:
        column.overflow, column.no_wrap = "fold", False
    return table


def holder_shown(holder: str | None) -> str:
    """A holder as a table shows it: a worker's ``host:pid:task id`` shortened to the host's first label
    and the pid (the process that held it), so it fits one line; JSON and ``show`` keep the whole."""
    if not holder:
        return ""
    host, pid, task = [*holder.split(":", 2), "", ""][:3]
    if pid.isdigit() and task:
        return f"{host.split('.')[0]}:{pid}"
    return holder


# -- tokens ---------------------------------------------------------------------------------------------


def _write_json(w: TimelineEntry) -> dict[str, Any]:
    return {
        "at": iso(w.at),
        "operation": w.operation,
        "quantity": w.quantity,
        "idempotency_key": w.idempotency_key,
    }


def _rejection_json(r: TimelineEntry | HistoryEntry) -> dict[str, Any]:
    return {
        "at": iso(r.at),
        "operation": r.operation,
        "quantity": r.quantity,
        "presented_token": r.token,
        "highest_token": r.highest_token,
        "holder": r.holder,
        "idempotency_key": r.idempotency_key,
    }


def holder_task(holder: str | None) -> str | None:
    """The task a worker's holder (``host:pid:task id``) names, or None for any other holder."""
    host, pid, task = [*(holder or "").split(":", 2), "", ""][:3]
    return task if host and pid.isdigit() and task else None


def outcome_brief(outcome: RequestResult) -> dict[str, Any]:
    return {
        "key": outcome.key,
        "status": outcome.status,
        "worker": outcome.worker,
        "task_id": outcome.task_id,
        "at": iso(outcome.at),
    }


def epochs_json(
    sku: str, grouped: Sequence[Epoch], outcome_of: Mapping[int, RequestResult] | None = None
) -> dict[str, Any]:
    told = outcome_of or {}
    return {
        "sku": sku,
        "epochs": [
            {
                "token": e.token,
                "holder": e.holder,
                "acquired_at": iso(e.acquired_at),
                "ended": e.ended,
                "writes": [_write_json(w) for w in e.writes],
                "rejections": [_rejection_json(r) for r in e.rejections],
                "outcome": outcome_brief(told[e.token]) if e.token in told else None,
            }
            for e in grouped
        ],
    }


def tokens_issued(
    grouped: Sequence[Epoch], archived: ArchivedHistory | None, tokenless: Sequence[RequestResult]
) -> dict[str, int]:
    """Every token issued after the archived ones up to the newest known (tokens count up from 1 per
    SKU), by what records it: a write or a refusal in the history, the lease history alone, or nothing in
    the database (a holder that wrote nothing with its token)."""
    after = archived.highest_token if archived is not None else 0
    live = [e for e in grouped if e.token > after]
    highest = max((e.token for e in live), default=after)
    recorded = sum(1 for e in live if e.writes or e.rejections)
    return {
        "highest_token": highest,
        "after_token": after,
        "with_records": recorded,
        "lease_history_only": len(live) - recorded,
        "without_records": highest - after - len(live),
    }


def issued_line(issued: Mapping[str, int], tokenless: Sequence[RequestResult]) -> str:
    span = issued["highest_token"] - issued["after_token"]
    since = f" after token {issued['after_token']}" if issued["after_token"] else ""
    line = (
        f"{span} token(s) issued{since} up to {issued['highest_token']}: {issued['with_records']} wrote or "
        f"were refused, {issued['lease_history_only']} known to the lease history alone, "
        f"{issued['without_records']} issued without reaching the database"
    )
    if tokenless:
        counts: dict[str, int] = {}
        for outcome in tokenless:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        listed = ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
        line += f"; request outcomes of the SKU recorded without a token: {listed}"
    return line


def archived_json(archived: ArchivedHistory | None) -> dict[str, Any] | None:
    if archived is None:
        return None
    return {
        "highest_token": archived.highest_token,
        "before": iso(archived.through),
        "archived_at": iso(archived.archived_at),
        "archive": archived.archive,
        "on_hand": archived.on_hand,
        "reserved": archived.reserved,
    }


def archived_line(archived: ArchivedHistory) -> str:
    return (
        f"tokens up to {archived.highest_token} archived: history before {iso(archived.through)}"
        f" (to {archived.archive}, at {iso(archived.archived_at)}; it left {archived.on_hand} on hand,"
        f" {archived.reserved} reserved)"
    )


def epochs_table(
    sku: str, grouped: Sequence[Epoch], outcome_of: Mapping[int, RequestResult] | None = None
) -> Table:
    told = outcome_of or {}
    table = Table(title=f"Tokens of {sku}", title_justify="left", expand=False)
    table.add_column("token", justify="right")
    # A worker's holder (host:pid) is kept on one line on a terminal of 80 columns or more; on a narrower
    # one, or when longer, it folds, whole, as every cell does.
    widest = max((len(holder_shown(e.holder)) for e in grouped), default=6)
    keep = min(widest, 24) if out.width >= 80 else None
    table.add_column("holder", overflow="fold", min_width=keep, max_width=24)
    table.add_column("acquired (UTC)", overflow="fold")
    table.add_column("ended", overflow="fold")
    table.add_column("did", overflow="fold", max_width=30)
    for e in grouped:
        lines = [f"+ {w.operation} {w.quantity if w.quantity is not None else ''}".rstrip() for w in e.writes]
        lines += [f"x {r.operation}: stale vs {r.highest_token}" for r in e.rejections]
        if not lines and e.token in told:
            lines.append(f"= {told[e.token].status} ({told[e.token].key})")
        table.add_row(
            str(e.token),
            holder_shown(e.holder),
            short_time(e.acquired_at),
            e.ended or "current",
            "\n".join(lines) or "-",
        )
    return folded(table)


# -- leases, stock, rejections --------------------------------------------------------------------------


def leases_table(rows: Iterable[Mapping[str, Any]], where: str) -> Table:
    table = Table(title=f"Current leases ({where})", title_justify="left")
    for column in ("sku", "token", "holder", "time left"):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(row["sku"], str(row["token"]), holder_shown(row["holder"]), f"{row['time_left']:.1f}s")
    return folded(table)


def stock_json(levels: Iterable[StockLevel], waiting: Mapping[str, int]) -> list[dict[str, Any]]:
    return [{**asdict(level), "waiting": waiting.get(level.sku, 0)} for level in levels]


def stock_table(levels: Iterable[StockLevel], waiting: Mapping[str, int]) -> Table:
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
    return folded(table)


def rejections_json(counts: Mapping[str, int], entries: Iterable[HistoryEntry]) -> dict[str, Any]:
    return {"counts": counts, "rejections": [{"sku": h.sku, **_rejection_json(h)} for h in entries]}


def rejection_counts_table(counts: Mapping[str, int]) -> Table:
    table = Table(title="Rejected", title_justify="left")
    table.add_column("sku")
    table.add_column("count", justify="right")
    for name, count in counts.items():
        table.add_row(name, str(count))
    return folded(table)


def rejections_table(sku: str, entries: Iterable[HistoryEntry]) -> Table:
    detail = Table(title=f"Rejections of {sku}", title_justify="left")
    for column in ("time (UTC)", "operation", "token", "highest", "holder"):
        detail.add_column(column, overflow="fold")
    for h in entries:
        holder = holder_shown(h.holder)
        detail.add_row(short_time(h.at), h.operation, str(h.token), str(h.highest_token), holder)
    return folded(detail)


# -- show, audit ----------------------------------------------------------------------------------------


def _outcome_json(outcome: RequestResult | None) -> dict[str, Any] | None:
    if outcome is None:
        return None
    shown = _iso_times(asdict(outcome))
    if outcome.redrive is not None:
        shown["redrive"] = _iso_times(asdict(outcome.redrive))
    return shown


def pending_state(recorded: Accepted, attempts: Sequence[Attempt]) -> str:
    """A recorded request without an outcome: "retrying" once a worker has made an attempt at it, else
    "pending" (queued, or lost and about to be published again by the relay)."""
    return "retrying" if attempts else "pending"


def recorded_json(recorded: Accepted | None, attempts: Sequence[Attempt]) -> dict[str, Any] | None:
    if recorded is None:
        return None
    return {
        "state": pending_state(recorded, attempts),
        "caller": recorded.caller,
        "type": recorded.request_type,
        "arguments": recorded.arguments,
        "task_id": recorded.task_id,
        "publishes": recorded.publishes,
        "accepted_at": iso(recorded.at),
        "deadline": iso(recorded.deadline),
        "next_look": iso(recorded.next_look),
    }


def recorded_line(recorded: Accepted, attempts: Sequence[Attempt]) -> str:
    """The line of a request accepted and recorded that has no outcome yet."""
    deadline = "" if recorded.deadline is None else f", deadline {when(recorded.deadline)}"
    kind = recorded.request_type or recorded.operation
    return (
        f"request {recorded.key}: {pending_state(recorded, attempts)}, {kind} "
        f"{json.dumps(recorded.arguments, sort_keys=True)} accepted {when(recorded.at)}{deadline}, "
        f"published {recorded.publishes} time(s), {len(attempts)} attempt(s) so far"
    )


def request_json(
    found: ReservationView | None,
    outcome: RequestResult | None,
    attempts: Iterable[Attempt],
    dead_letter: RequestResult | None = None,
    redrives: Sequence[RedriveLink] = (),
) -> dict[str, Any]:
    """``outcome`` is what the key reports (a re-drive's, with ``redrive`` naming it); ``dead_letter``
    the key's own dead-lettered outcome when it was driven again, ``redrives`` every re-drive of it."""
    return {
        "reservation": _iso_times(asdict(found)) if found else None,
        "outcome": _outcome_json(outcome),
        "attempts": [_iso_times(asdict(a)) for a in attempts],
        "dead_letter": _outcome_json(dead_letter),
        "redrives": [redrive_json(link) for link in redrives],
    }


def request_lines(
    found: ReservationView | None,
    outcome: RequestResult | None,
    attempts: Iterable[Attempt],
    dead_letter: RequestResult | None = None,
    redrives: Sequence[RedriveLink] = (),
) -> list[str]:
    lines = []
    if found is not None:
        lines.append(
            f"reservation {found.id}: {found.status}, {found.quantity} x {found.sku} "
            f"(token {found.token}, key {found.idempotency_key})"
        )
    if outcome is not None:
        via = outcome.redrive
        came = ""
        if via is not None:
            came = (
                f" (from re-drive #{via.number} {via.key})" if via.final else f" (re-drive {via.key} running)"
            )
        lines.append(
            f"outcome: {outcome.status}{came} after {outcome.epochs} lost epoch(s) "
            f"{json.dumps(outcome.detail, sort_keys=True)}"
        )
    if dead_letter is not None and (outcome is None or outcome.redrive is not None):
        lines.append(
            f"dead-lettered {when(dead_letter.at)} UTC by {dead_letter.worker}: "
            f"{json.dumps(dead_letter.detail, sort_keys=True)}"
        )
    for link in redrives:
        lines.append(
            f"re-drive #{link.number} {link.key} of {link.origin}, {when(link.at)} UTC by {link.by or '?'}: "
            f"{link.status or 'no outcome yet'}"
        )
    lines += [f"  attempt {short_time(a.at)} {a.result} token={a.token} worker={a.worker}" for a in attempts]
    return lines


# -- dead letters ---------------------------------------------------------------------------------------


def redrive_json(link: RedriveLink | None) -> dict[str, Any] | None:
    return None if link is None else _iso_times(asdict(link))


def dead_letters_json(found: Iterable[DeadLetter]) -> list[dict[str, Any]]:
    return [
        {
            "key": d.key,
            "operation": d.operation,
            "request_type": d.request_type,
            "arguments": d.arguments,
            "reason": d.reason,
            "error": d.error,
            "at": iso(d.at),
            "worker": d.worker,
            "task_id": d.task_id,
            "redrive": redrive_json(d.redrive),
            "redrivable": d.redrivable,
        }
        for d in found
    ]


def _redriven_cell(d: DeadLetter) -> str:
    if d.arguments is None:
        return "cannot: no arguments"
    if d.redrive is None:
        return "-"
    return f"#{d.redrive.number} {d.redrive.status or 'running'}"


def dead_letters_table(found: Iterable[DeadLetter]) -> Table:
    table = Table(title="Dead-lettered requests", title_justify="left")
    table.add_column("key", overflow="fold", max_width=28)
    table.add_column("operation")
    table.add_column("arguments", overflow="fold", max_width=30)
    table.add_column("reason", overflow="fold", max_width=24)
    table.add_column("when (UTC)")
    table.add_column("worker", max_width=16)
    table.add_column("re-driven", overflow="fold", max_width=22)
    for d in found:
        arguments = (
            "-" if d.arguments is None else json.dumps(d.arguments, sort_keys=True, separators=(",", ":"))
        )
        table.add_row(
            d.key, d.operation, arguments, d.reason, when(d.at), holder_shown(d.worker), _redriven_cell(d)
        )
    return folded(table)


def requests_json(found: Iterable[Listed]) -> list[dict[str, Any]]:
    return [
        {
            "key": r.key,
            "operation": r.operation,
            "caller": r.caller,
            "state": r.state,
            "accepted_at": iso(r.accepted_at),
            "ended_at": iso(r.ended_at),
            "attempts": r.attempts,
            "publishes": r.publishes,
            "deadline": iso(r.deadline),
        }
        for r in found
    ]


def requests_table(found: Iterable[Listed]) -> Table:
    table = Table(title="Requests, newest accepted first", title_justify="left")
    table.add_column("key", overflow="fold", max_width=32)
    table.add_column("operation")
    table.add_column("state", overflow="fold")
    table.add_column("accepted (UTC)")
    table.add_column("ended (UTC)")
    table.add_column("attempts", justify="right")
    table.add_column("published", justify="right")
    for r in found:
        ended = when(r.ended_at) if r.ended_at is not None else "-"
        table.add_row(
            r.key, r.operation, r.state, when(r.accepted_at), ended, str(r.attempts), str(r.publishes)
        )
    return folded(table)


def violations_json(found: Iterable[Violation]) -> list[dict[str, str]]:
    return [{"rule": str(v.rule), "sku": v.sku, "message": v.message} for v in found]


def violations_table(found: Iterable[Violation]) -> Table:
    table = Table(title="Invariant violations", title_justify="left")
    table.add_column("rule")
    table.add_column("sku", overflow="fold", max_width=24)
    table.add_column("message", overflow="fold")
    for v in found:
        table.add_row(str(v.rule), v.sku, v.message)
    return folded(table)
