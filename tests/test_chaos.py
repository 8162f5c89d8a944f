"""``reservations chaos`` as an operator runs it: the console script in a subprocess, small and short, with
JSON output. The fenced run must come out clean with stale writes refused; the lease-only run of the same
workload must show what the fence prevents; nothing the run created may be left behind.

The run includes the flash sale (half the requests reserve one hot SKU, in bursts) with batching on, so
the same run also shows that requests served in batches under faults keep every rule: one final outcome
each, that the database agrees with, no key applied twice, nothing written behind a newer token. The
HTTP run (``--http``) is here too, short: its long run's figures are in docs/architecture.md.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa
from rich.console import Console

from admin.chaos import (
    ETCD_LEADER,
    ETCD_LEADER_KILLED,
    KILLED,
    LEASE_FAILED_OVER,
    LEASE_FAILOVER,
    REDIS_RESTARTED,
    SERVER_FROZEN,
    SERVER_KILLED,
    SERVER_PAUSED,
    Options,
    Sent,
    batching_figures,
    check,
    run_once,
)
from admin.chaos.options import BROKER_RESTARTED
from fencing import LeaseManager, StaleToken
from fencing.engines import make_engine
from reservations import Inventory, scope_of
from testing import support
from testing.etcd_cluster import etcd_unavailable
from testing.proxy import DelayProxy
from testing.stores import POSTGRES_URL

pytestmark = pytest.mark.slow

SCRIPT = shutil.which("reservations", path=str(Path(sys.executable).parent)) or "reservations"


def _chaos_schemas() -> set[str]:
    engine = make_engine(POSTGRES_URL)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT schema_name FROM information_schema.schemata WHERE schema_name LIKE :p"),
                {"p": "chaos_%"},
            )
            return {row[0] for row in rows}
    finally:
        engine.dispose()


def test_fenced_run_is_clean_and_lease_only_run_is_not_with_a_batched_flash_sale(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESERVATIONS_")}
    schemas_before = _chaos_schemas()
    done = subprocess.run(
        [
            *(SCRIPT, "chaos", "--workers", "3", "--skus", "3", "--requests", "50", "--duration", "10"),
            *("--drain", "30", "--proxy-delay", "1.5", "--hot", "0.5", "--batching"),
            *("--postgres-url", POSTGRES_URL),
            *("--folder", str(tmp_path / "logs"), "--pictures", str(tmp_path / "pictures"), "--json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    fenced, lease_only = report["fenced"], report["lease_only"]
    # The run says what it is doing as it goes (on stderr beside the JSON; one line per phase in a pipe).
    for mode in ("fenced", "lease-only"):
        for phase in ("sending 50 requests", "waiting for every request's outcome", "checking the database"):
            assert f"{mode}: {phase}" in done.stderr, done.stderr

    assert fenced["violations"] == 0, fenced["checks"]
    assert fenced["rejected_stale_writes"] >= 1, fenced
    # Every request exactly one final outcome (one row per key), and the database agrees with each. A
    # request still queued when the run re-sends what has no outcome is not re-sent: the batching alone
    # has to serve it.
    assert fenced["checks"]["missing_outcomes"] == []
    assert fenced["checks"]["unexpected_outcomes"] == []
    assert sum(fenced["statuses"].values()) == fenced["enqueued"]
    assert fenced["checks"]["outcomes_contradicted"] == []
    assert fenced["checks"]["keys_applied_twice"] == []
    assert fenced["checks"]["writes_after_newer_token"] == []

    # The flash sale happened and was batched: requests found the hot SKU's lease busy, waited, and were
    # served in fenced batches, some by another task than their own; none of them without an outcome.
    flash, batching = fenced["flash_sale"], fenced["batching"]
    assert fenced["hot_sku"] == "HOT" and fenced["batching_on"] is True
    assert flash["requests"] >= 10, flash
    assert "no outcome" not in flash["statuses"], flash
    assert batching["batches"] >= 1 and batching["requests"] >= 2, batching
    assert batching["for_others"] >= 1, batching
    assert 1 <= batching["largest"] <= batching["requests"], batching
    assert batching["writes_behind_newer_token"] == 0, batching
    # The faults reached holders serving batches: frozen, paused or killed while serving one, a batch
    # holder that lost ownership, or a whole batch refused at the stock row (a paused holder's, or one
    # under a token the restarted lease Redis handed out again).
    hit = (
        sum(fenced["faults"].get(fault, 0) for fault in (SERVER_FROZEN, SERVER_PAUSED, SERVER_KILLED))
        + sum(fenced["lost_ownership_serving_batches_by_worker_role"].values())
        + batching["stale_refused"]
    )
    assert hit >= 1, (fenced["faults"], batching)
    # The faults really happened, in both runs alike.
    for run in (fenced, lease_only):
        assert run["faults"]["pool child frozen past its lease"] >= 1, run["faults"]
        assert run["faults"]["worker SIGKILL + restart"] == 1
        assert run["faults"]["lease Redis restart (data lost)"] == 1
        assert run["faults"]["client->postgres chunks delayed"] >= 1

    assert lease_only["violations"] >= 1, lease_only
    assert lease_only["checks"]["writes_after_newer_token"], lease_only["checks"]
    assert lease_only["rejected_stale_writes"] == 0  # nothing refuses a stale write without the fence
    assert lease_only["batching"]["stale_refused"] == 0
    assert lease_only["batching"]["batches"] >= 1, lease_only["batching"]
    # The pictures show what the numbers say: refused stale writes only in the fenced run, writes
    # behind a newer token only in the lease-only one.
    fenced_svg = Path(fenced["picture"]).read_text()
    lease_only_svg = Path(lease_only["picture"]).read_text()
    assert "refused, highest" in fenced_svg and "<polygon" not in fenced_svg
    assert "<polygon" in lease_only_svg and "refused, highest" not in lease_only_svg

    # Nothing is left behind: no new chaos schema, no worker or redis-server started for the run (the
    # workers carry the run's folder in their environment; the redis-servers run in it).
    assert _chaos_schemas() <= schemas_before
    assert _processes_mentioning(str(tmp_path)) == []


def test_lease_failover_nemesis_fails_the_sentinel_primary_over_under_a_clean_fenced_run(
    tmp_path: Path,
) -> None:
    """--nemesis lease-failover, kept short: the fenced run alone, in this process, a few requests over
    6 s (no flash sale), so only the first failover (SENTINEL FAILOVER, due a fifth into the stream) has
    its turn. The leases are on a private Sentinel topology, failed over under the stream; no violation,
    and nothing of the run is left running."""
    schemas_before = _chaos_schemas()
    options = Options(
        workers=2,
        skus=2,
        requests=16,
        duration=6,
        drain=30,
        hot=0,
        postgres_url=POSTGRES_URL,
        pictures=tmp_path / "pictures",
        nemeses=(LEASE_FAILOVER,),
    )
    folder = tmp_path / "fenced"
    report = run_once(options, fenced=True, folder=folder, console=Console(file=io.StringIO()))

    assert report.violations == 0, report.checks
    assert sum(report.statuses.values()) == report.enqueued
    assert report.faults[LEASE_FAILED_OVER] == 1, report.faults
    assert REDIS_RESTARTED not in report.faults  # on a Sentinel topology the kill -9 is the data loss
    failover = report.nemeses[0]
    assert (failover.name, failover.fault, failover.skipped) == (LEASE_FAILOVER, LEASE_FAILED_OVER, "")
    assert failover.target.startswith("lease primary 127.0.0.1:"), failover.target
    assert "SENTINEL FAILOVER" in failover.cuts[0] and "demoted by the sentinels" in failover.cuts[1]
    assert failover.requests >= 1 and failover.violations == 0
    # The workers' lease URL was the topology's: their logs say so at start, password masked.
    log = (folder / "worker-f1.log").read_text()
    assert "redis+sentinel://:***@127.0.0.1:" in log, log[:2000]
    assert _chaos_schemas() <= schemas_before
    assert _processes_mentioning(str(tmp_path)) == []  # redis-servers and sentinels stopped with the run


@pytest.mark.skipif(etcd_unavailable() is not None, reason=str(etcd_unavailable()))
def test_etcd_leader_nemesis_kills_the_leader_under_a_clean_fenced_run_with_no_repair(tmp_path: Path) -> None:
    """--nemesis etcd-leader, kept short: the fenced run alone, in this process, a few requests over 10 s
    (no flash sale), so the first two leader kills have their turn. The leases are on a private 3-member
    etcd cluster whose leader is SIGKILLed and restarted under the stream; no violation, and no token
    regression to repair: a revision a majority committed is never handed out again."""
    schemas_before = _chaos_schemas()
    options = Options(
        workers=2,
        skus=2,
        requests=16,
        duration=10,
        drain=30,
        hot=0,
        postgres_url=POSTGRES_URL,
        pictures=tmp_path / "pictures",
        nemeses=(ETCD_LEADER,),
    )
    folder = tmp_path / "fenced"
    report = run_once(options, fenced=True, folder=folder, console=Console(file=io.StringIO()))

    assert report.violations == 0, report.checks
    assert sum(report.statuses.values()) == report.enqueued
    assert report.faults[ETCD_LEADER_KILLED] >= 2, (report.faults, report.nemeses)
    assert REDIS_RESTARTED not in report.faults
    kills = [run for run in report.nemeses if not run.skipped]
    assert len(kills) >= 2, report.nemeses
    for kill in kills:
        assert (kill.name, kill.fault) == (ETCD_LEADER, ETCD_LEADER_KILLED)
        assert kill.target.startswith("etcd leader m"), kill.target
        assert "kill -9 of the leader" in kill.cuts[0] and "restarted on its data" in kill.cuts[1], kill.cuts
        assert kill.violations == 0 and kill.repairs == 0
    assert sum(kill.requests for kill in kills) >= 1
    # The workers' lease URL was the cluster's, with the run's 2 s ttl (etcd keeps whole seconds).
    log = (folder / "worker-f1.log").read_text()
    assert "etcd://127.0.0.1:" in log and "lease ttl 2s" in log, log[:2000]
    assert _chaos_schemas() <= schemas_before
    assert _processes_mentioning(str(tmp_path)) == []  # every etcd member stopped with the run


def test_every_key_answered_202_reaches_its_outcome_by_get_alone_through_kills_and_wipes(
    tmp_path: Path,
) -> None:
    """--http, kept short: real callers POST through a real front door while workers are SIGKILLed every
    2-3 s and freeze past their lease, the lease Redis is wiped twice and the broker Redis restarted
    empty. Nobody sends a request again: every key answered 202 is followed by GET alone, and each reaches
    its outcome (with the relay off, a key the broker restart lost stays 202); the history stays clean
    and nothing of the run is left behind."""
    schemas_before = _chaos_schemas()
    options = Options(
        workers=4,
        skus=2,
        requests=120,
        duration=10,
        drain=60,
        hot=0.4,
        postgres_url=POSTGRES_URL,
        pictures=tmp_path / "pictures",
        http=True,
        clients=12,
        respond_async=0.5,
    )
    report = run_once(options, fenced=True, folder=tmp_path / "fenced", console=Console(file=io.StringIO()))
    http = report.http
    assert http is not None

    # The faults happened: kills every 2-3 s over 10 s, two lease wipes, the broker restarted empty.
    assert report.faults[KILLED] >= 3, report.faults
    assert report.faults[REDIS_RESTARTED] == 2 and report.faults[BROKER_RESTARTED] == 1, report.faults
    # Callers were answered 202 (half asked for it), and every such key reached its outcome by GET alone.
    assert http.answered_later >= 20, http
    assert http.unresolved == {}, http
    assert http.followed_to_outcome == http.answered_later
    # Every request the door recorded ended in exactly one outcome, consistent with the stock.
    assert report.enqueued == http.recorded >= 100, http
    assert sum(report.statuses.values()) == report.enqueued, report.statuses
    assert report.violations == 0, report.checks
    assert _chaos_schemas() <= schemas_before
    assert _processes_mentioning(str(tmp_path)) == []


def test_lease_failover_does_not_go_with_the_network_nemeses() -> None:
    """The sentinels name the primary by its loopback address, which a worker on a host of its own cannot
    reach: asked together, the command refuses at once, before it starts anything. The etcd members
    listen on loopback too, and each of the two puts the leases on a coordinator of its own."""
    done = support.run("chaos", "--nemesis", "lease-failover", "--partitions", env={})
    assert done.returncode == 2, done.stderr
    assert "lease-failover runs on loopback, not together with the network nemeses" in done.stderr
    done = support.run("chaos", "--nemesis", "etcd-leader", "--nemesis", "lease-partition", env={})
    assert done.returncode == 2, done.stderr
    assert "etcd-leader runs on loopback, not together with the network nemeses" in done.stderr
    done = support.run("chaos", "--nemesis", "etcd-leader", "--nemesis", "lease-failover", env={})
    assert done.returncode == 2, done.stderr
    assert "each put the leases on a coordinator of their own" in done.stderr


def test_checker_counts_batches_and_refusals_and_catches_an_outcome_the_database_contradicts(
    inventory_url: str, inventory: Inventory, leases: LeaseManager
) -> None:
    """The figures the chaos report prints about batching, and its outcome check, on a known history."""
    inventory.add_sku("HOT", on_hand=3)
    sent = {f"flash-{i}": Sent(f"flash-{i}", "reserve", {"sku": "HOT", "quantity": 1}) for i in range(5)}
    old = leases.acquire(scope_of("HOT"), ttl=30, holder="A")
    for i in range(4):
        inventory.hand_off("HOT", 1, key=f"flash-{i}", task_id=f"task-{i}")
    leases.break_lease(scope_of("HOT"), reason="A paused past its lease")
    new = leases.acquire(scope_of("HOT"), ttl=30, holder="B")
    served = inventory.serve_pending(new, "HOT", limit=100, task_id="task-B", worker="w")
    assert sorted(r.status for r in served) == ["insufficient_stock", *["reserved"] * 3]
    inventory.hand_off("HOT", 1, key="flash-4", task_id="task-4")
    with pytest.raises(StaleToken):  # A wakes up and serves what arrived since: refused whole
        inventory.serve_pending(old, "HOT", limit=100, task_id="task-A", worker="w")
    inventory.serve_pending(new, "HOT", limit=100, task_id="task-4", worker="w")  # by its own task

    figures = batching_figures(inventory_url)
    assert (figures.batches, figures.requests, figures.for_others, figures.largest) == (2, 5, 4, 4)
    assert (figures.stale_refused, figures.writes_behind_newer_token, figures.left_pending) == (1, 0, 0)
    assert sum(len(found) for found in check(inventory_url, {"HOT": 3}, sent).values()) == 0

    # Outcomes that say something the database does not: a reservation that was never made, and a
    # refusal for a key that did reserve.
    inventory.record_outcome("made-up", "reserve", "reserved", {"reservation_ids": ["r_none"]})
    inventory.restock(new, "HOT", 1, key="more")
    inventory.reserve(new, "HOT", 1, key="quiet")
    inventory.record_outcome("quiet", "reserve", "insufficient_stock", {"sku": "HOT"})
    for key in ("made-up", "quiet"):
        sent[key] = Sent(key, "reserve", {"sku": "HOT", "quantity": 1})
    assert check(inventory_url, {"HOT": 3}, sent)["outcomes_contradicted"] == [
        "made-up: outcome reserved, but nothing in the history was written under the key",
        "quiet: outcome insufficient_stock, but the history has a write under the key",
    ]


def test_delay_proxy_holds_client_chunks_and_keeps_the_conversation_intact() -> None:
    url = sa.engine.make_url(POSTGRES_URL)
    # Every chunk is held (fraction 1.0), and a connection's start-up is a dozen of them: a short delay
    # keeps the test short, and is still a hundred times a loopback query's own time.
    delay = 0.1
    proxy = DelayProxy((url.host or "127.0.0.1", url.port or 5432), delay=delay, fraction=1.0).start()
    engine = make_engine(url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False))
    try:
        with engine.connect() as conn:
            started = time.monotonic()
            assert conn.execute(sa.text("SELECT 41 + 1")).scalar() == 42
            assert time.monotonic() - started >= delay
        assert proxy.delayed_chunks >= 2  # the connection's startup and the query, each held back
    finally:
        engine.dispose()
        proxy.close()


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            blob = (proc / "environ").read_bytes() + (proc / "cmdline").read_bytes()
            cwd = str((proc / "cwd").resolve())
        except OSError:
            continue
        if text.encode() in blob or cwd.startswith(text):
            found.append(int(proc.name))
    return found
