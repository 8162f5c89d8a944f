"""A request task's status reaches the worker's main process as a field, not as text to parse: the tracer
Celery builds for a request task (in each pool child and in the main process) hands back an
:class:`Answered` read from the answer dict, where Celery would hand back the repr of the return value.
The events the main process sends from it are in tests/test_observability.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, Task
from celery.app.trace import build_tracer
from celery.utils.saferepr import saferepr

from tasks import Settings, create_app
from tasks.answers import Answered, RequestTask, reply


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Celery]:
    app = create_app(
        Settings.from_env(
            {
                "RESERVATIONS_BROKER_URL": "redis://127.0.0.1:9/0",  # never reached: nothing is published
                "RESERVATIONS_DATABASE_URL": f"sqlite:///{tmp_path / 'unused.sqlite3'}",
            }
        )
    )
    yield app
    app.close()


def traced(app: Celery, returns: Any) -> Any:
    """Run a request-class task returning ``returns`` through the tracer a worker builds for it."""

    @app.task(bind=True, base=RequestTask, name=f"test.states.{id(returns)}", shared=False)
    def answering(self: Task) -> Any:
        if isinstance(returns, Exception):
            raise returns
        return returns

    answering.__trace__ = build_tracer(answering.name, answering, app=app)  # as the worker does
    return answering.__trace__("task-1", (), {}, {"id": "task-1", "delivery_info": {}})


@pytest.mark.parametrize(
    ("status", "epochs"), [("reserved", 0), ("dead_lettered", 3), ("insufficient_stock", 1)]
)
def test_the_main_process_gets_the_status_and_epochs_with_celerys_repr(
    app: Celery, status: str, epochs: int
) -> None:
    answer = reply(status, epochs, "key-1", "reserve", {"note": "the status is not read from this text"})
    result = traced(app, answer)
    assert result.retval == answer
    assert result.retstr == Answered(status, epochs, saferepr(answer, RequestTask.resultrepr_maxsize))


def test_the_answer_is_read_by_its_fields_whatever_their_order(app: Celery) -> None:
    answer = {"detail": {}, "operation": "reserve", "key": "key-1", "epochs": 2, "status": "reserved"}
    assert traced(app, answer).retstr[:2] == ("reserved", 2)


@pytest.mark.parametrize("returns", [7, None, {"status": "reserved"}, {"status": 1, "epochs": 0}])
def test_a_return_value_that_is_no_answer_keeps_celerys_repr(app: Celery, returns: Any) -> None:
    result = traced(app, returns)
    assert isinstance(result.retstr, str) and result.retstr == saferepr(returns)


def test_a_task_that_raised_is_left_to_celery(app: Celery) -> None:
    result = traced(app, RuntimeError("boom"))
    assert result.info is not None and not isinstance(result.retstr, Answered)


def test_a_queued_request_calls_for_no_event_and_an_outcome_for_its_own() -> None:
    assert Answered("queued", 0, "{...}").event() is None
    assert Answered("reserved", 1, "{...}").event() == (
        "task-reserved",
        {"result": "{...}", "outcome": "reserved", "epochs": 1},
    )
