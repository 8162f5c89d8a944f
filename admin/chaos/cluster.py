"""The processes of one chaos run, started from the process harness and stopped together: a fresh schema,
two private redis-servers (broker; leases), workers in their roles, celery beat, and the delaying proxy.
With the lease-failover nemesis, the leases are on a Redis Sentinel topology instead (a primary, a
replica, three sentinels); with the etcd-leader nemesis, on a private 3-member etcd cluster.
With network nemeses, each worker runs on a host of its own (testing/netns.py) and reaches the servers on
the hosts' service address: the redis-servers listen there too, PostgreSQL through a forwarder.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from admin.chaos.options import BEAT_EVERY, MAX_EPOCHS, ChaosFailed, Options
from fencing.engines import make_engine
from tasks.settings import Settings
from testing.celery_processes import CeleryProcess, start_all, stop_all, worker_env
from testing.etcd_cluster import EtcdCluster, etcd_unavailable
from testing.harness import HarnessError
from testing.netns import Host, Hosts, NetnsError
from testing.pg_schemas import pg_schema
from testing.proxy import DelayProxy
from testing.redis_servers import RedisServer
from testing.redis_topologies import SentinelTopology
from testing.service_process import ServiceProcess, front_door


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
    settings: Settings  # the workers' settings (the one behind the proxy, and hosts' workers, differ)
    lease_redis: RedisServer | None  # None: the leases are on ``sentinel`` or ``etcd``
    workers: list[ChaosWorker]  # beat among them, last
    proxy: DelayProxy | None
    # With network nemeses: each worker's host (beat runs in the root namespace), and the ports a host
    # reaches on the service address: "lease", "broker", "database" (the forwarder), "delayed" (the proxy).
    hosts: dict[str, Host] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    folder: Path | None = None  # the run's folder (worker logs, the slow link's log)
    sentinel: SentinelTopology | None = None  # with the lease-failover nemesis: the lease coordinator
    etcd: EtcdCluster | None = None  # with the etcd-leader nemesis: the lease coordinator
    broker: RedisServer | None = None
    service: ServiceProcess | None = None  # the HTTP run's front door

    def database_port(self, worker: ChaosWorker) -> int:
        """The port a worker's host reaches PostgreSQL on."""
        return self.ports["delayed" if worker.role == "delay" else "database"]


@contextmanager
def harness_failures() -> Iterator[None]:
    """A process of the harness that did not start (or a wait for one that timed out), or a host that
    could not be made, fails the run."""
    try:
        yield
    except (HarnessError, NetnsError) as exc:
        raise ChaosFailed(str(exc)) from exc


def roles(options: Options) -> list[str]:
    # About a third of the workers freeze before each write; at least one, and one always stays normal
    # (the one that is killed and restarted).
    freezers = max(1, min(options.workers - 1, options.workers // 3))
    delayed = 1 if options.proxy_delay > 0 and options.workers - freezers >= 2 else 0
    return ["freeze"] * freezers + ["delay"] * delayed + ["normal"] * (options.workers - freezers - delayed)


def worker_names(options: Options, *, fenced: bool) -> list[str]:
    prefix = "f" if fenced else "l"
    return [f"{prefix}{n + 1}" for n in range(len(roles(options)))]


@contextmanager
def cluster(options: Options, *, fenced: bool, folder: Path) -> Iterator[Cluster]:
    """Everything up and ready (workers and beat started together: their imports overlap); on exit, a warm
    shutdown for all at once, then the servers killed, the hosts removed and the schema dropped."""
    folder.mkdir(parents=True, exist_ok=True)
    # The trigger alone would refuse a lowered token: lease-only means both guards are off.
    drop_trigger = None if fenced else partial(_drop_fence_trigger, options.postgres_url)
    with ExitStack() as stack:
        database_url = stack.enter_context(
            pg_schema(options.postgres_url, prefix="chaos", after_upgrade=drop_trigger)
        )
        hosts = (
            stack.enter_context(Hosts(worker_names(options, fenced=fenced)))
            if options.network_nemeses
            else None
        )
        listen = hosts.service if hosts is not None else "127.0.0.1"
        binds = (listen,) if hosts is not None else ()
        broker = RedisServer(folder / "redis-broker", binds=binds)
        leases = _leases(options, folder, binds)
        lease_redis = leases if isinstance(leases, RedisServer) else None
        sentinel = leases if isinstance(leases, SentinelTopology) else None
        etcd = leases if isinstance(leases, EtcdCluster) else None
        workers: list[ChaosWorker] = []
        proxies: list[DelayProxy] = []
        service: ServiceProcess | None = None
        try:
            proxy = _proxy(options, database_url, listen) if "delay" in roles(options) else None
            proxies += [proxy] if proxy is not None else []
            broker.start()
            leases.start()
            lease_url = leases.url("chaos") if isinstance(leases, EtcdCluster) else leases.url(0)
            settings = _settings(options, fenced, database_url, broker, lease_url)
            up = Cluster(
                database_url,
                settings,
                lease_redis,
                workers,
                proxy,
                folder=folder,
                sentinel=sentinel,
                etcd=etcd,
                broker=broker,
            )
            if hosts is not None and lease_redis is not None:
                proxies.append(_forwarder(database_url, hosts.service))
                up.hosts = {host.name: host for host in hosts}
                up.ports = {"lease": lease_redis.port, "broker": broker.port, "database": proxies[-1].port}
                up.ports.update({"delayed": proxy.port} if proxy is not None else {})
            workers += _workers(options, fenced, folder, settings, up)
            if options.http:
                # The front door is started with the workers, and stopped first: what it still waits
                # for is answered (202) before the workers go.
                service = up.service = front_door(worker_env(settings), folder / "service.log")
                service.start()
            start_all(workers)
            if service is not None:
                service.wait_ready()
            yield up
        finally:
            if service is not None:
                service.stop()
            stop_all(workers)
            broker.kill()
            if lease_redis is not None:
                lease_redis.kill()
            else:
                leases.stop()  # every node of the topology, or every member of the cluster
            for opened in proxies:
                opened.close()


def _leases(
    options: Options, folder: Path, binds: tuple[str, ...]
) -> RedisServer | SentinelTopology | EtcdCluster:
    """The run's lease coordinator, not started yet."""
    if options.lease_failover:
        return SentinelTopology(folder / "sentinel-leases")
    if options.etcd_leader:
        missing = etcd_unavailable()
        if missing is not None:
            raise ChaosFailed(f"the etcd-leader nemesis needs etcd here: {missing}")
        (folder / "etcd-leases").mkdir(exist_ok=True)
        return EtcdCluster(folder / "etcd-leases")
    return RedisServer(folder / "redis-leases", binds=binds)


def _drop_fence_trigger(admin_url: str, schema_name: str) -> None:
    engine = make_engine(admin_url)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(f'DROP TRIGGER stock_fence_never_lowers ON "{schema_name}".stock'))
    finally:
        engine.dispose()


def _target(database_url: str) -> tuple[str, int]:
    url = sa.engine.make_url(database_url)
    return (url.host or "127.0.0.1", url.port or 5432)


def _proxy(options: Options, database_url: str, listen: str) -> DelayProxy:
    # The statement that opens a stock write (it locks the row) is the one whose delay lets a newer epoch
    # write first; a delay after the lock only blocks the others.
    return DelayProxy(
        _target(database_url),
        delay=options.proxy_delay,
        fraction=0.5,
        match=b"FOR UPDATE",
        seed=options.seed,
        listen=listen,
    ).start()


def _forwarder(database_url: str, service: str) -> DelayProxy:
    """PostgreSQL for the hosts: it listens on loopback only, they reach the service address only."""
    return DelayProxy(_target(database_url), delay=0.0, fraction=0.0, listen=service).start()


def _via(url: str, host: str, port: int) -> str:
    return sa.engine.make_url(url).set(host=host, port=port).render_as_string(hide_password=False)


def _settings(
    options: Options, fenced: bool, database_url: str, broker: RedisServer, lease_url: str
) -> Settings:
    settings = Settings(
        database_url=database_url,
        broker_url=broker.url(0),
        result_backend=broker.url(1),
        lease_url=lease_url,
        lease_ttl=options.lease_ttl,
        max_epochs=MAX_EPOCHS,
        visibility_timeout=options.visibility_timeout,
        enforce_fence=fenced,
        batching=options.batching,
        expiry_interval=BEAT_EVERY,
    )
    return settings if options.relay else settings.with_(relay_every=0.0)


def _workers(
    options: Options, fenced: bool, folder: Path, settings: Settings, up: Cluster
) -> list[ChaosWorker]:
    workers = []
    for name, role in zip(worker_names(options, fenced=fenced), roles(options), strict=True):
        host = up.hosts.get(name)
        seen, proxied = _seen_from(host, settings, up)
        env = _env(seen, folder, name, role, proxied)
        workers.append(ChaosWorker(name, env, folder / f"worker-{name}.log", role=role, host=host))
    beat = f"{'f' if fenced else 'l'}-beat"
    env = _env(settings, folder, beat, "beat", "")
    workers.append(ChaosWorker(beat, env, folder / "beat.log", kind="beat", role="beat"))
    return workers


def _seen_from(host: Host | None, settings: Settings, up: Cluster) -> tuple[Settings, str]:
    """The settings, and the URL of PostgreSQL behind the delaying proxy, as a worker uses them: on a host
    of its own (``host``), every server is at the service address."""
    if host is None:
        proxied = _via(up.database_url, "127.0.0.1", up.proxy.port) if up.proxy is not None else ""
        return settings, proxied
    service, ports = host.service, up.ports
    seen = settings.with_(
        broker_url=f"redis://{service}:{ports['broker']}/0",
        result_backend=f"redis://{service}:{ports['broker']}/1",
        lease_url=f"redis://{service}:{ports['lease']}/0",
        database_url=_via(up.database_url, service, ports["database"]),
    )
    proxied = _via(up.database_url, service, ports["delayed"]) if "delayed" in ports else ""
    return seen, proxied


def _env(settings: Settings, folder: Path, name: str, role: str, proxied_url: str) -> dict[str, str]:
    extra: dict[str, Any] = {"failpoint_dir": str(folder / f"failpoints-{name}")}
    if role in ("freeze", "delay"):
        # No renewal arrives, as for a request stuck in the network: nothing but the fence stands between
        # the late write and the stock row.
        extra["failpoints"] = "renew=skip"
    if role == "freeze":
        extra["failpoints"] = "before_write=stop;renew=skip"  # every write, not ``once``
    if role == "delay":
        extra["database_url"] = proxied_url
    return worker_env(settings.with_(**extra))
