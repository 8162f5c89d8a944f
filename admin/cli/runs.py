"""The commands that run a whole scenario: the warehouse demo, the fault-injection chaos run and the
in-process fence demo. Each imports its (large) module only when it runs, so other commands start fast.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import typer

from admin.cli.context import config, given_urls
from admin.cli.failures import EXIT_FAILED, EXIT_USAGE, errors, fail
from admin.cli.options import count, decimal, seconds, whole
from admin.cli.render import err, narrative, out


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
        given = [name for name, value in given_urls().items() if value]
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
    with errors() if use_configured else nullcontext():
        try:
            ok = demo.run(folder, narrative(), backends)
        except demo.DemoFailed as exc:
            fail(EXIT_FAILED, str(exc))
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def chaos_command(
    workers: Annotated[int, count("--workers", 2, 16, "Celery worker processes.")] = 3,
    skus: Annotated[int, count("--skus", 1, 50, "SKUs the requests spread over.")] = 3,
    requests: Annotated[int, count("--requests", 1, 5000, "Requests per run (replays included).")] = 120,
    duration: Annotated[
        float, seconds("--duration", 2, 600, "Seconds of request stream and faults, per run.")
    ] = 20.0,
    drain: Annotated[float, seconds("--drain", 1, 600, "Longest wait for the last outcomes.")] = 40.0,
    seed: Annotated[int, typer.Option(parser=whole("--seed"), help="Seed of the request stream.")] = 1,
    lease_redis_restart: Annotated[
        bool, typer.Option(help="Restart the lease Redis mid-run, losing its data (token counters).")
    ] = True,
    proxy_delay: Annotated[
        float,
        seconds(
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
    partitions: Annotated[
        bool,
        typer.Option(
            "--partitions",
            help="All network nemeses, in order (needs root and ip netns; skipped with one line without).",
        ),
    ] = False,
    nemesis: Annotated[
        list[str] | None,
        typer.Option(
            "--nemesis",
            help="A network nemesis, repeatable (in order; twice runs it twice): lease-partition, "
            "db-partition, isolate-holder, slow-link. Or lease-failover (no root needed; not with network "
            "nemeses; once however often given): leases on Redis Sentinel, the primary failed over twice.",
        ),
    ] = None,
    http: Annotated[
        bool,
        typer.Option(
            "--http",
            help="Send the stream through a real front door (reservations serve), follow each 202 by GET "
            "alone; workers SIGKILLed every 2-3 s, lease Redis wiped twice, broker restarted empty.",
        ),
    ] = False,
    clients: Annotated[int, count("--clients", 1, 200, "HTTP callers, with --http.")] = 40,
    respond_async: Annotated[
        float,
        typer.Option(
            parser=decimal("--respond-async", 0, 1),
            help="With --http: share of the POSTs sent with Prefer: respond-async (202 at once) [0-1]",
        ),
    ] = 0.25,
    relay: Annotated[
        bool,
        typer.Option(help="The workers' relay (--no-relay: what the broker loses stays lost, to compare)."),
    ] = True,
) -> None:
    """WRITES (own schemas, dropped afterwards): the fault-injection run, twice, fenced and lease-only.

    Real workers (and celery beat) on PostgreSQL and two private redis-servers (broker; leases) take a
    stream of requests, a share of them a flash sale of one hot SKU served in batches, while workers
    freeze past their lease (batch servers among them), one is SIGKILLed and restarted and the lease
    Redis loses its data; a checker then audits the database. Exit 1 when the fenced run has any
    violation.

    With --partitions (or --nemesis NAME) each worker runs on a host of its own (a network namespace
    with an address from 192.0.2.0/24, removed afterwards) and one nemesis at a time hits one worker's
    host: lease-partition cuts it off from the lease Redis only, db-partition drops its packets to
    PostgreSQL with a write in flight, isolate-holder cuts the hot SKU's holder off from everything
    mid-batch, slow-link delays, jitters, loses and reorders its packets past the lease ttl. Each gets a
    table (requests, outcomes, stale writes refused, violations). Without root or ip netns they are
    skipped with one line and the rest of the run goes on.

    With --nemesis lease-failover the leases are on a private Redis Sentinel topology instead of the lease
    Redis (a primary, a replica, three sentinels; the workers' RESERVATIONS_LEASE_URL is its
    redis+sentinel:// URL, and the lease Redis restart is left out) and its primary is failed over twice
    during the stream: SENTINEL FAILOVER, then kill -9 (the killed node comes back as a replica). Each
    failover gets a table (requests in flight across it, the longest wait for an outcome, stale writes
    refused, token regressions repaired, violations and business harm). It needs neither root nor ip
    netns, and runs on loopback, so not together with the network nemeses.

    With --nemesis etcd-leader the leases are on a private 3-member etcd cluster instead (the workers'
    RESERVATIONS_LEASE_URL is its etcd:// URL, the lease ttl 2 s: etcd keeps whole seconds, 2 at least;
    freezes and redelivery scale with it) and its leader is SIGKILLed three times during the stream, each
    time restarted on its data once a new leader is elected. Each kill gets a table like a failover's;
    etcd hands out no token twice, so its repairs stay 0. Loopback only, like lease-failover, and not
    together with it.

    With --http the stream goes through a real front door (reservations serve, at its default HTTP wait)
    from CLIENTS concurrent callers (a share of them, --respond-async, asking for 202 at once), and it
    is what the door takes: reservations, and confirms and
    releases of the reservations made. A normal worker is SIGKILLed and restarted every 2-3 s, the lease
    Redis loses its data at 30% and 70% of the stream and the broker Redis is restarted empty at 50%, on
    top of the workers that freeze past their lease. Nobody sends a request again: after the stream,
    every key answered 202 is followed by GET on its Location alone, for up to --drain seconds after the
    last fault. The relay runs at its defaults. Exit 1 also when a key answered 202 is still without an
    outcome then.

    JSON fields per run (fenced, lease_only): enqueued, replayed, resent, faults, statuses,
    rejected_stale_writes, lost_ownership_by_worker_role, lost_ownership_serving_batches_by_worker_role,
    batching_on, hot_sku, hot_stock, flash_sale {requests, statuses}, batching {batches, requests,
    for_others, largest, stale_refused, writes_behind_newer_token, left_pending, watches, swept,
    longest_wait}, violations, checks (rule -> sentences), picture, nemeses [{name, fault, target, caught,
    cuts, seconds, link, skipped, requests, outcomes, stale_refused, repairs, attempts, longest_wait,
    violations, business_harm}], http {clients, posts (status -> count), recorded, answered_202,
    reached_outcome_by_get, unresolved (key -> last status), last_outcome_after_last_fault_s} or null.

    Example: reservations chaos --workers 3 --skus 3 --requests 120 --duration 20

    Example: reservations chaos --workers 4 --duration 30 --partitions

    Example: reservations chaos --duration 30 --nemesis lease-failover

    Example: reservations chaos --duration 30 --nemesis etcd-leader

    Example: reservations chaos --http --workers 4 --requests 2400 --duration 60 --drain 60
    """
    from admin import chaos
    from admin.chaos.options import COORDINATOR_NEMESES, NEMESES, nemeses_problem

    known = (*NEMESES, *COORDINATOR_NEMESES)
    unknown = sorted(set(nemesis or ()) - set(known))
    if unknown:
        fail(EXIT_USAGE, f"--nemesis {unknown[0]!r}: one of {', '.join(known)}")
    chosen = NEMESES if partitions else tuple(nemesis or ())  # a name given twice runs twice
    problem = nemeses_problem((*chosen, *(nemesis or ())), http=http)
    if problem is not None:
        fail(EXIT_USAGE, f"--nemesis {problem}")
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
        nemeses=chosen,
        http=http,
        clients=clients,
        respond_async=respond_async,
        relay=relay,
    )
    try:
        ok = chaos.run(options, None if as_json else narrative(), as_json=as_json)
    except chaos.ChaosFailed as exc:
        fail(EXIT_FAILED, str(exc))
    except KeyboardInterrupt:
        err.print("interrupted: workers, redis-servers, hosts and schemas cleaned up")
        raise typer.Exit(130) from None
    if not ok:
        raise typer.Exit(EXIT_FAILED)


def fence_demo_command(
    database: Annotated[Path, typer.Option(help="SQLite file to (re)create for the demo.")] = Path(
        "var/fence-demo.sqlite3"
    ),
    ttl: Annotated[float, seconds("--ttl", 0.05, 10, "Lease ttl of worker A, in seconds.")] = 0.5,
) -> None:
    """Replay the seed timeline in-process: A's lease expires, B writes, A's late write is rejected.

    Runs on an embedded SQLite database with no services.

    Example: reservations fence-demo --ttl 0.3
    """
    from admin import fence_demo

    try:
        ok = fence_demo.run(database, ttl=ttl)
    except ValueError as exc:
        fail(EXIT_USAGE, str(exc))
    if not ok:
        raise typer.Exit(EXIT_FAILED)
