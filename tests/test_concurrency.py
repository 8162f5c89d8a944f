"""Several OS processes contend for one scope with short leases and injected pauses longer than the ttl.

Afterwards the database is the judge: with the fence, accepted tokens only ever increase and stale writes
were rejected; with the same run lease-only (``enforce=False``), a stale epoch's write lands late.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from fencing import LeaseManager
from testing.stores import REDIS_URL
from testing.support import Gated, Resource

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCOPE = "sku-contended"
TTL = 0.1
WORKERS = 4  # one sleeper, three mixed
SLEEPER_ITERATIONS = 4
MIXED_ITERATIONS = 8
START_TIMEOUT = 30.0
RUN_TIMEOUT = 60.0
INITIAL_QUANTITY = 1000


@dataclass(frozen=True)
class Outcome:
    reports: list[dict[str, Any]]
    log: list[tuple[int, str, int]]
    row: tuple[int, int, str | None]

    def total(self, key: str) -> int:
        return sum(int(report[key]) for report in self.reports)

    @property
    def tokens(self) -> list[int]:
        return [token for token, _, _ in self.log]


def _urls(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str]:
    """(lease url, url of the database holding the protected row) for one lease backend."""
    if backend == "sqlite":
        url = f"sqlite:///{tmp_path / 'contended.sqlite3'}"
        return url, url
    pg_url: str = request.getfixturevalue("pg_url")
    return (REDIS_URL if backend == "redis" else pg_url), pg_url


def contend(lease_url: str, db_url: str, prefix: str, logs: Path, *, enforce: bool) -> Outcome:
    lease_manager = LeaseManager.from_url(lease_url, prefix=prefix)
    lease_manager.create_schema()  # before the workers start, so they never race on DDL
    lease_manager.close()
    resource = Resource(db_url).create(SCOPE, quantity=INITIAL_QUANTITY)

    gate = Gated(logs)
    try:
        for seed in range(WORKERS):
            role, iterations = ("sleeper", SLEEPER_ITERATIONS) if seed == 0 else ("mixed", MIXED_ITERATIONS)
            gate.start([
                sys.executable, "-m", "tests.contender",
                "--lease-url", lease_url, "--db-url", db_url, "--prefix", prefix,
                "--scope", SCOPE, "--ttl", str(TTL), "--iterations", str(iterations),
                "--seed", str(seed), "--role", role,
                *([] if enforce else ["--no-enforce"]),
            ], cwd=ROOT)  # fmt: skip
        gate.await_ready(START_TIMEOUT)
        gate.go()
        gate.wait(time.monotonic() + RUN_TIMEOUT)
        reports = []
        for process in gate.processes:
            assert process.stdout is not None
            # The report is one short line, far below a pipe's buffer, so waiting first is safe.
            reports.append(json.loads(process.stdout.read().decode().strip().splitlines()[-1]))
        return Outcome(reports=reports, log=resource.log(SCOPE), row=resource.row(SCOPE))
    finally:
        gate.kill()
        resource.close()


@pytest.mark.parametrize("backend", ["redis", "postgresql", "sqlite"])
def test_fenced_writes_never_go_backwards(
    backend: str, request: pytest.FixtureRequest, redis_prefix: str, tmp_path: Path
) -> None:
    lease_url, db_url = _urls(backend, request, tmp_path)
    outcome = contend(lease_url, db_url, redis_prefix, tmp_path, enforce=True)

    accepted, stale = outcome.total("accepted"), outcome.total("stale")
    assert outcome.total("long_pauses") > 0, "the fault was never injected"
    assert accepted > 0
    assert stale > 0, f"no stale write was rejected: {outcome.reports}"
    # Every cycle ends in exactly one of these: no write is lost or counted twice.
    assert outcome.total("cycles") == accepted + stale + outcome.total("busy")
    # The log is what the database committed; each lease writes at most once, so strictly rising.
    assert len(outcome.log) == accepted
    assert all(a < b for a, b in pairwise(outcome.tokens)), outcome.tokens
    assert outcome.row == (INITIAL_QUANTITY + accepted, *outcome.log[-1][:2])
    # No coordinator fault here, so every rejection was an ordinary lost race.
    assert outcome.total("repaired") == 0


def test_lease_only_lets_a_stale_epoch_write_after_a_newer_one(
    request: pytest.FixtureRequest, redis_prefix: str, tmp_path: Path
) -> None:
    lease_url, db_url = _urls("redis", request, tmp_path)
    outcome = contend(lease_url, db_url, redis_prefix, tmp_path, enforce=False)

    assert outcome.total("stale") == 0  # nothing refuses a write any more
    assert len(outcome.log) == outcome.total("accepted") > 0
    regressions = [(a, b) for a, b in pairwise(outcome.tokens) if b < a]
    assert regressions, f"no stale epoch wrote after a newer one: {outcome.tokens}"
