"""Broker and result backend URLs: their scheme, and the kombu transport options each takes. Pure: the
app, the producers and the relay read them here, so none of them imports another for it.
"""

from __future__ import annotations

from typing import Any

from tasks.settings import Settings

REDIS = ("redis", "rediss", "sentinel")
REDELIVERING = (*REDIS, "sqs")
AMQP = ("amqp", "amqps", "pyamqp")


def scheme_of(url: str) -> str:
    return url.partition("://")[0].partition("+")[0].lower()


def transport_options(url: str, settings: Settings, *, broker: bool) -> dict[str, Any]:
    """The kombu transport options a broker or result backend URL takes, and only those.

    visibility_timeout is how Redis (and SQS) redeliver unacknowledged messages; other transports must
    not receive it (py-amqp and the SQLAlchemy transport pass their options on as connection arguments).
    RabbitMQ redelivers when the consumer's channel closes instead, and bounds how long a delivery may
    stay unacknowledged by the server's consumer_timeout (docs/operations.md, "Brokers"). Publisher
    confirms make a publish to RabbitMQ return once the broker has the message, as a Redis LPUSH does.
    A sentinel:// URL names the sentinels only: kombu and Celery ask them for the master of the service
    master_name, and again after a failover.
    """
    scheme = scheme_of(url)
    if scheme in REDELIVERING:
        master = {"master_name": settings.sentinel_master} if scheme == "sentinel" else {}
        return {"visibility_timeout": settings.visibility_timeout, **master}
    if broker and scheme in AMQP:
        return {"confirm_publish": True}
    return {}
