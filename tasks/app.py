"""The Celery application, configured so that redelivery is safe and nothing but JSON crosses the broker.

Late acks + reject-on-worker-loss: a message is acknowledged only after its task finished, so a worker
killed mid-task gives the request back to the queue; the idempotency key makes the second run harmless.
Prefetch of one: a worker holds no queue of other SKUs' requests while it waits on a lease. The broker
is Redis (alone or through Sentinel) or RabbitMQ (classic queues); each gets only the transport options
it understands.
"""

from __future__ import annotations

from celery import Celery

from tasks import producer as _producer  # noqa: F401  (stamps the headers of every message published)
from tasks import transport
from tasks.relay import RelayStep
from tasks.settings import REDIS, Settings, scheme_of
from tasks.worker import HeartbeatFile, loaded_by_celery_command, refuse_bad_settings

_SHORT_RETRIES = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2, "interval_max": 0.5}
SCHEDULED_RESULT_EXPIRES = 3600


def configure(app: Celery, settings: Settings) -> None:
    # Redis brokers through tasks.transport: neither a bad message nor a full broker stops a consumer.
    transport.install()
    app.conf.update(
        broker_url=settings.broker_url,
        result_backend=settings.result_backend,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # A task that raised still acks: its outcome is recorded; redelivering it would not change it.
        task_acks_on_failure_or_timeout=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=settings.transport_options(settings.broker_url, broker=True),
        # The Celery result is a convenience (outcomes live in the database): a result backend that is
        # down costs a worker a few hundred milliseconds per task, not Celery's default twenty retries.
        result_backend_transport_options={
            **settings.transport_options(settings.result_backend, broker=False),
            **({"retry_policy": _SHORT_RETRIES} if scheme_of(settings.result_backend) in REDIS else {}),
        },
        # Request tasks store a result only for RESERVATIONS_RESULT_EXPIRES seconds, none by default
        # (their outcome is the database row). The schedule's own tasks and the no-op keep theirs an hour
        # then: bounded by the schedule, not by the traffic.
        result_expires=settings.result_expires or SCHEDULED_RESULT_EXPIRES,
        # No name, arguments, worker or queue beside a result: the outcome row and the attempts hold them,
        # the task events carry them to Flower, and they would double every stored result.
        result_extended=False,
        # No STARTED state: it is a result-backend write before every task, which would make running a
        # request depend on the result backend (a task whose STARTED write fails never runs).
        task_track_started=False,
        broker_connection_retry_on_startup=True,
        # Beat writes its schedule file after every task it sends: the file's age is its health check.
        beat_sync_every=1,
        worker_hijack_root_logger=False,
        # Task events, as -E sends them; None leaves it to the command line (-E) as Celery does.
        worker_send_task_events=settings.task_events or None,
        beat_schedule={
            "expire-due-holds": {"task": "reservations.expire_holds", "schedule": settings.expiry_interval},
            # A safety net for hot-SKU batching: queued requests whose watch is stuck in a frozen
            # worker still get served within a sweep.
            "serve-waiting-requests": {
                "task": "reservations.serve_waiting",
                "schedule": settings.expiry_interval,
            },
            # Retention: idempotency records and SQL lease events older than their retention go.
            "purge-old-records": {"task": "reservations.purge", "schedule": 3600.0},
        },
    )
    app.conf.reservations_settings = settings


class _FromEnvironment(Celery):  # type: ignore[misc]
    """The default app, configured from the environment when first used rather than at import: importing
    ``tasks`` never fails on a setting, and whatever uses the app first (a client, a worker) gets the
    SettingsError."""

    def on_configure(self) -> None:
        configure(self, Settings.from_env())


def _with_steps(app: Celery) -> Celery:
    app.steps["consumer"].add(HeartbeatFile)
    app.steps["consumer"].add(RelayStep)
    return app


def create_app(settings: Settings | None = None) -> Celery:
    app = Celery("reservations", include=["tasks.request_tasks"])
    configure(app, settings or Settings.from_env())
    return _with_steps(app)


app = _with_steps(_FromEnvironment("reservations", include=["tasks.request_tasks"]))
if loaded_by_celery_command():
    refuse_bad_settings()
