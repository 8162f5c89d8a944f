"""One contending worker process for tests/test_concurrency.py: acquire, pause, write, release, repeat.

Run as ``python -m tests.contender --lease-url ... --db-url ...``. It prints ``ready``, waits for a line
on stdin so every worker starts contending at once, then prints one JSON line of outcome counts.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

from fencing import LeaseBusy, LeaseLost, LeaseManager, StaleToken
from testing.support import Resource, start_gate

ACQUIRE_WAIT = 10.0


@dataclass
class Report:
    role: str
    cycles: int = 0
    accepted: int = 0
    stale: int = 0
    repaired: int = 0
    busy: int = 0
    expired_before_release: int = 0
    long_pauses: int = 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lease-url", required=True)
    parser.add_argument("--db-url", required=True)
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--scope", required=True)
    parser.add_argument("--ttl", type=float, required=True)
    parser.add_argument("--iterations", type=int, required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--role", choices=["sleeper", "mixed"], required=True)
    parser.add_argument("--long-pause-share", type=float, default=0.25)
    parser.add_argument("--no-enforce", dest="enforce", action="store_false")
    return parser.parse_args(argv)


def choose_pause(role: str, ttl: float, rng: random.Random, long_share: float) -> float:
    """The injected fault: time lost between acquire and write, like a GC or VM pause.

    A sleeper always outlives its lease; a mixed worker usually writes promptly and sometimes stalls.
    """
    if role == "sleeper" or rng.random() < long_share:
        return rng.uniform(1.5, 2.5) * ttl
    return rng.uniform(0.0, 0.2) * ttl


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    report = Report(role=args.role)
    manager = LeaseManager.from_url(args.lease_url, prefix=args.prefix)
    resource = Resource(args.db_url, enforce=args.enforce)
    holder = f"contender-{args.seed}"
    try:
        # Connect before the gate, so the first cycles race each other rather than connection setup.
        manager.current(args.scope)
        resource.row(args.scope)
        if not start_gate():
            return 3
        for _ in range(args.iterations):
            report.cycles += 1
            try:
                lease = manager.acquire(args.scope, ttl=args.ttl, holder=holder, wait=ACQUIRE_WAIT)
            except LeaseBusy:
                report.busy += 1
                continue
            pause = choose_pause(args.role, args.ttl, rng, args.long_pause_share)
            report.long_pauses += pause > args.ttl
            # Plain acquire, no hold(): a real pause freezes the renewal thread too, so the lease
            # must be allowed to expire underneath the paused worker.
            time.sleep(pause)
            try:
                report.accepted += resource.write(lease, args.scope, 1).applied
            except StaleToken as exc:
                report.stale += 1
                # What a real worker does with a rejection; without a coordinator fault it must be a
                # lost race (the lease was superseded), never a repair.
                report.repaired += manager.handle_stale(lease, exc)
                continue
            try:
                manager.release(lease)
            except LeaseLost:
                report.expired_before_release += 1
    finally:
        resource.close()
        manager.close()
    print(json.dumps(asdict(report)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
