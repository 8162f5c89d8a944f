"""``python -m bench.frames``: how many of the project's own frames lie between a Celery request task and
the database driver, at the statement that writes each operation's stock row.

Each operation runs as its task does in a worker (Celery's ``apply``: the task's own code, in this
process), on a migrated SQLite file with its SQL leases there (no services), or on PostgreSQL with
``--postgres URL``. At every statement the stack is taken; the table shows, for the statement that writes
the stock row (an UPDATE or INSERT of ``stock``, or the reservation's one statement on PostgreSQL), the
project frames (fencing, reservations, tasks) from the task's function down to the driver, and the
modules they pass through. It counts the house's hops, not time: what a newcomer reads to follow a write.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import sqlalchemy as sa

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("fencing", "reservations", "tasks")
SKU = "FRAMES"


def _stack() -> list[tuple[str, str]]:
    """(file, function) of every frame on this thread's stack, outermost first, with the plans each
    ``fencing.plan.run_sync`` drives inserted after it: a plan suspended at its statement is no frame on
    the stack, but the chain of ``yield from`` it waits in is a chain of calls all the same."""
    frames = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    found = []
    for frame in reversed(frames):
        found.append((frame.f_code.co_filename, frame.f_code.co_name))
        if frame.f_code.co_name == "run_sync" and frame.f_code.co_filename.endswith("fencing/plan.py"):
            plan = frame.f_locals.get("plan")
            while isinstance(plan, Generator):
                found.append((plan.gi_code.co_filename, plan.gi_code.co_name))
                plan = plan.gi_yieldfrom
    return found


def _library_frames(stack: list[tuple[str, str]]) -> list[str]:
    """The project's frames of ``stack`` from the task's function on, as ``module.function``."""
    found = []
    for filename, function in stack:
        path = Path(filename)
        if not path.is_relative_to(ROOT) or path.relative_to(ROOT).parts[0] not in LIBRARY:
            continue
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        found.append(f"{module}.{function}")
    start = next((i for i, name in enumerate(found) if name.startswith("tasks.request_tasks.")), 0)
    return found[start:]


@contextmanager
def _statements() -> Iterator[list[tuple[str, list[str]]]]:
    seen: list[tuple[str, list[str]]] = []

    def taken(conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        seen.append((statement, _library_frames(_stack())))

    sa.event.listen(sa.Engine, "before_cursor_execute", taken)
    try:
        yield seen
    finally:
        sa.event.remove(sa.Engine, "before_cursor_execute", taken)


def _writes_stock(statement: str) -> bool:
    text = " ".join(statement.split()).upper()
    return "UPDATE STOCK" in text or "INSERT INTO STOCK" in text or ("WITH" in text and " STOCK" in text)


def measure(database_url: str, folder: Path) -> dict[str, list[str]]:
    """Each operation's frames at its stock write, run as its task on ``database_url`` (the broker and
    results, which ``apply`` does not reach, are SQLite files in ``folder``)."""
    os.environ.update(
        RESERVATIONS_DATABASE_URL=database_url,
        RESERVATIONS_BROKER_URL=f"sqla+sqlite:///{folder}/broker.sqlite3",
        RESERVATIONS_RESULT_BACKEND=f"db+sqlite:///{folder}/results.sqlite3",
    )
    from reservations import Inventory, schema
    from tasks import request_tasks  # noqa: F401  (registers the request tasks on the app)
    from tasks.app import app

    schema.upgrade(database_url)
    with Inventory.from_url(database_url) as inventory:
        inventory.add_sku(SKU, on_hand=100)
    found: dict[str, list[str]] = {}
    operations: list[tuple[str, dict[str, Any]]] = [
        ("reserve", {"sku": SKU, "quantity": 2, "idempotency_key": "frames-reserve"}),
        ("restock", {"sku": SKU, "quantity": 3, "idempotency_key": "frames-restock"}),
    ]
    for name, kwargs in operations:
        with _statements() as seen:
            result = app.tasks[f"reservations.{name}"].apply(kwargs=kwargs, task_id=f"frames-{name}").get()
        writes = [frames for statement, frames in seen if _writes_stock(statement)]
        if not writes:
            raise SystemExit(f"{name}: no statement wrote the stock row ({result})")
        found[name] = writes[0]
        if name == "reserve":
            made = result["detail"]["reservation_ids"][0]
            operations.append(("confirm", {"reservation_id": made, "idempotency_key": "frames-confirm"}))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--postgres", help="a PostgreSQL URL (a schema of its own in its search_path)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        url = args.postgres or f"sqlite:///{folder}/frames.sqlite3"
        found = measure(url, Path(folder))
    print(f"project frames from the Celery task to the driver, at the stock write ({url.split(':')[0]}):")
    for name, frames in found.items():
        modules = sorted({frame.rsplit(".", 1)[0] for frame in frames})
        print(f"  {name:8} {len(frames):3} frames in {len(modules):2} modules: {' > '.join(frames)}")


if __name__ == "__main__":
    main()
