"""The processes of one chaos run, started from the process harness and stopped together: a fresh schema,
two private redis-servers (broker; leases), workers in their roles, celery beat, and the delaying proxy.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import sqlalchemy as sa

from admin.chaos.options import (
    BEAT_EVERY,
    LEASE_TTL,
    MAX_EPOCHS,
    VISIBILITY_TIMEOUT,
    ChaosFailed,
    Options,
)
from admin.harness import CeleryProcess, HarnessError, RedisServer, pg_schema, start_all, stop_all, worker_env
from admin.proxy import DelayProxy
from fencing.sql import make_engine


@dataclass
class ChaosWorker(CeleryProcess):
    """A worker (or beat) with its part in the run, and what the run noticed about its pool children."""

    # "normal"; "freeze": stops before every write, resumed later; "delay": behind the proxy; "beat": not a
    # worker but celery beat, which schedules the periodic sweeps a deployment runs (no faults for it)
    role: str = "normal"
    stopped_since: dict[int, float] = field(default_factory=dict)
    # Frozen children seen holding the hot SKU's lease with requests waiting, counted once per freeze.
    frozen_holders: set[int] = field(default_factory=set)


@dataclass
class Cluster:
    database_url: str
    settings: dict[str, str]  # the workers' RESERVATIONS_* settings (the one behind the proxy differs)
    lease_redis: RedisServer
    workers: list[ChaosWorker]  # beat among them, last
    proxy: DelayProxy | None


@contextmanager
def harness_failures() -> Iterator[None]:
    """A process of the harness that did not start (or a wait for one that timed out) fails the run."""
    try:
        yield
    except HarnessError as exc:
        raise ChaosFailed(str(exc)) from exc


def roles(options: Options) -> list[str]:
    # About a third of the workers freeze before each write; at least one, and one always stays normal
    # (the one that is killed and restarted).
    freezers = max(1, min(options.workers - 1, options.workers // 3))
    delayed = 1 if options.proxy_delay > 0 and options.workers - freezers >= 2 else 0
    return ["freeze"] * freezers + ["delay"] * delayed + ["normal"] * (options.workers - freezers - delayed)


@contextmanager
def cluster(options: Options, *, fenced: bool, folder: Path) -> Iterator[Cluster]:
    """Everything up and ready (workers and beat started together: their imports overlap); on exit, a warm
    shutdown for all at once, then the servers killed and the schema dropped."""
    folder.mkdir(parents=True, exist_ok=True)
    # The trigger alone would refuse a lowered token: lease-only means both guards are off.
    drop_trigger = None if fenced else partial(_drop_fence_trigger, options.postgres_url)
    with pg_schema(options.postgres_url, prefix="chaos", after_upgrade=drop_trigger) as database_url:
        broker = RedisServer(folder / "redis-broker")
        lease_redis = RedisServer(folder / "redis-leases")
        workers: list[ChaosWorker] = []
        proxy: DelayProxy | None = None
        try:
            proxy = _proxy(options, database_url) if "delay" in roles(options) else None
            broker.start()
            lease_redis.start()
            settings = _settings(options, fenced, database_url, broker, lease_redis)
            proxied = _via(proxy, database_url) if proxy is not None else database_url
            workers += _workers(options, fenced, folder, settings, proxied)
            start_all(workers)
            yield Cluster(database_url, settings, lease_redis, workers, proxy)
        finally:
            stop_all(workers)
            broker.kill()
            lease_redis.kill()
            if proxy is not None:
                proxy.close()


def _drop_fence_trigger(admin_url: str, schema_name: str) -> None:
    engine = make_engine(admin_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP TRIGGER stock_fence_never_lowers ON "{schema_name}".stock'))
    finally:
        engine.dispose()


def _proxy(options: Options, database_url: str) -> DelayProxy:
    url = sa.engine.make_url(database_url)
    target = (url.host or "127.0.0.1", url.port or 5432)
    # The statement that opens a stock write (it locks the row) is the one whose delay lets a newer epoch
    # write first; a delay after the lock only blocks the others.
    return DelayProxy(
        target, delay=options.proxy_delay, fraction=0.5, match=b"FOR UPDATE", seed=options.seed
    ).start()


def _via(proxy: DelayProxy, url: str) -> str:
    return (
        sa.engine.make_url(url).set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    )


def _settings(
    options: Options, fenced: bool, database_url: str, broker: RedisServer, lease_redis: RedisServer
) -> dict[str, str]:
    return {
        "RESERVATIONS_DATABASE_URL": database_url,
        "RESERVATIONS_BROKER_URL": broker.url(0),
        "RESERVATIONS_RESULT_BACKEND": broker.url(1),
        "RESERVATIONS_LEASE_URL": lease_redis.url(0),
        "RESERVATIONS_LEASE_TTL": str(LEASE_TTL),
        "RESERVATIONS_MAX_EPOCHS": str(MAX_EPOCHS),
        "RESERVATIONS_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT),
        "RESERVATIONS_ENFORCE_FENCE": "1" if fenced else "0",
        "RESERVATIONS_BATCHING": "1" if options.batching else "0",
        "RESERVATIONS_EXPIRY_INTERVAL": str(BEAT_EVERY),
    }


def _workers(
    options: Options, fenced: bool, folder: Path, settings: dict[str, str], proxied_url: str
) -> list[ChaosWorker]:
    prefix = "f" if fenced else "l"
    workers = []
    for n, role in enumerate(roles(options)):
        name = f"{prefix}{n + 1}"
        env = _env(settings, folder, name, role, proxied_url)
        workers.append(ChaosWorker(name, env, folder / f"worker-{name}.log", role=role))
    beat = f"{prefix}-beat"
    env = _env(settings, folder, beat, "beat", proxied_url)
    workers.append(ChaosWorker(beat, env, folder / "beat.log", kind="beat", role="beat"))
    return workers


def _env(settings: dict[str, str], folder: Path, name: str, role: str, proxied_url: str) -> dict[str, str]:
    extra = {"RESERVATIONS_FAILPOINT_DIR": str(folder / f"failpoints-{name}")}
    if role in ("freeze", "delay"):
        # Renewal slower than the pause or the delay, as for a request stuck in the network: nothing but
        # the fence stands between the late write and the stock row.
        extra["RESERVATIONS_LEASE_RENEW_EVERY"] = "600"
    if role == "freeze":
        extra["RESERVATIONS_FAILPOINTS"] = "before_write=stop"  # every write, not ``once``
    if role == "delay":
        extra["RESERVATIONS_DATABASE_URL"] = proxied_url
    return worker_env({**settings, **extra})
