"""Cutting and slowing the link of one host (:mod:`testing.netns`), then healing it.

A cut drops, on the veth end the packets leave by, those of one direction (or both) to or from one port
of the service address, or all of them: a tc htb class whose queue holds nothing, chosen by a u32 filter,
so the sender is told nothing, as on a real network. A slow link sends every packet of the host, both
ways, through an NFQUEUE rule in the host's namespace to :mod:`testing.linkem`, which delays, jitters,
reorders and loses them (the legacy iptables: this kernel has xtables' NFQUEUE target but not nftables'
queue). Only the run's own veths and namespaces are touched; both go with the host.
"""

from __future__ import annotations

import json
import selectors
import shutil
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

from testing.linkem import Impairment
from testing.netns import Host, NetnsError, run, run_all

__all__ = ["Impairment", "Link", "LinkError", "slow_link_unavailable"]

BLACKHOLE = "1:20"  # the class whose queue (pfifo, limit 0) drops every packet put in it
READY_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
CLASS_RATE = ("htb", "rate", "10gbit", "quantum", "60000")
GRACE = 5.0
IPTABLES = "iptables-legacy"  # linkem ends on its own this long after a slow link should have been healed


class LinkError(NetnsError):
    """A cut or slow link could not be put in place (the link is left healed)."""


def slow_link_unavailable() -> str | None:
    """Why a slow link cannot be made here, or None (cuts need only what hosts need)."""
    if shutil.which(IPTABLES) is None:
        return f"{IPTABLES} not found (Debian package iptables): the slow link queues packets through it"
    return None


class Link:
    """The controls of one host's link; :meth:`heal` undoes whatever is in place."""

    def __init__(self, host: Host, log: Path | None = None) -> None:
        self.host = host
        self.log = log
        self.cuts: list[str] = []  # what is cut, as said in the report ("outbound to :6379", ...)
        self._trees: set[str] = set()  # "root" / "inner": the ends that carry the cut classes
        self._slow: subprocess.Popen[str] | None = None

    def _tc(self, end: str, *args: str) -> list[str]:
        """A tc command for one end of the veth: "root" (what the host receives leaves by it) or "inner"
        (what the host sends)."""
        if end == "root":
            return ["tc", *args[:2], "dev", self.host.root_link, *args[2:]]
        return ["tc", "-n", self.host.namespace, *args[:2], "dev", self.host.inner_link, *args[2:]]

    def prepare(self) -> None:
        """Put the blackhole class on both ends ahead of time, so that a cut is one filter per end."""
        for end in ("inner", "root"):
            if end in self._trees:
                continue
            self._trees.add(end)
            run(self._tc(end, "qdisc", "add", "root", "handle", "1:", "htb", "default", "10"))
            for klass in ("1:10", BLACKHOLE):  # the rate only bounds: nothing here shapes the traffic
                run(self._tc(end, "class", "add", "parent", "1:", "classid", klass, *CLASS_RATE))
            run(self._tc(end, "qdisc", "add", "parent", BLACKHOLE, "handle", "20:", "pfifo", "limit", "0"))

    def cut(self, port: int | None = None, *, outbound: bool = True, inbound: bool = True) -> None:
        """Drop what the host sends to (``outbound``) and receives from (``inbound``) ``port`` of the
        service address, or every port of it with None, until :meth:`heal`. Both ends at once."""
        service = f"{self.host.service}/32"
        commands, cuts = [], []
        for end, wanted, side, way in (("inner", outbound, "dst", "d"), ("root", inbound, "src", "s")):
            if not wanted:
                continue
            match = ["match", "ip", side, service]
            if port is not None:
                match += ["match", "ip", f"{way}port", str(port), "0xffff"]
            commands.append(
                self._tc(end, "filter", "add", "parent", "1:", "protocol", "ip", "prio", "1", "u32", *match,
                         "flowid", BLACKHOLE)
            )  # fmt: skip
            cuts.append(f"{'outbound to' if end == 'inner' else 'inbound from'} :{port or '*'}")
        try:
            self.prepare()
            self.cuts += cuts  # before they exist: a half-made cut is healed too
            run_all(commands)
        except NetnsError as exc:
            self.heal()
            raise LinkError(f"cutting {self.host.name}'s link: {exc}") from exc

    def slow(self, impairment: Impairment, *, seconds: float, seed: int = 1) -> None:
        """Queue every packet between the host and the service address through linkem for at most
        ``seconds`` (plus a grace), or until :meth:`heal`."""
        command = [sys.executable, "-m", "testing.linkem", "--queue", "0", *impairment.args()]
        command += ["--seconds", f"{seconds + GRACE:g}", "--seed", str(seed)]
        log = self.log.open("a") if self.log is not None else subprocess.DEVNULL
        try:
            self._slow = subprocess.Popen(
                self.host.wrap(command), stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True
            )
        finally:
            if self.log is not None and not isinstance(log, int):
                log.close()
        try:
            self._await_ready(self._slow)
            for rule in _queue_rules(self.host.service):
                run(self.host.wrap([IPTABLES, "-w", "5", "-A", *rule]))
        except NetnsError as exc:
            self.heal()
            raise LinkError(f"slowing {self.host.name}'s link: {exc}") from exc

    def _await_ready(self, process: subprocess.Popen[str]) -> None:
        assert process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(process.stdout, selectors.EVENT_READ)
            if not selector.select(READY_TIMEOUT):
                raise NetnsError(f"linkem did not bind its queue within {READY_TIMEOUT:g}s")
        if process.stdout.readline().strip() != "ready":
            process.wait(STOP_TIMEOUT)
            where = f" (see {self.log})" if self.log else ""
            raise NetnsError(f"linkem exited with {process.returncode}{where}")

    @property
    def slowed(self) -> bool:
        return self._slow is not None

    def heal(self) -> dict[str, int]:
        """Undo every cut and the slow link; the slow link's counts (packets, held, at_once, dropped)."""
        if self.cuts:
            # Every filter of the ends at once; the classes stay for the next cut (they go with the host).
            with suppress(NetnsError):
                run_all([self._tc(end, "filter", "del", "parent", "1:") for end in sorted(self._trees)])
            self.cuts.clear()
        counts: dict[str, int] = {}
        if self._slow is not None:
            process, self._slow = self._slow, None
            for rule in _queue_rules(self.host.service):
                run(self.host.wrap([IPTABLES, "-w", "5", "-D", *rule]), check=False)
            counts = _stop(process)
        return counts


def _queue_rules(service: str) -> list[list[str]]:
    """Both directions between the host and the service address to queue 0, in the host's own tables;
    ``--queue-bypass``: should linkem be gone, packets pass instead of being dropped."""
    queue = ["-j", "NFQUEUE", "--queue-num", "0", "--queue-bypass"]
    return [["OUTPUT", "-d", service, *queue], ["INPUT", "-s", service, *queue]]


def _stop(process: subprocess.Popen[str]) -> dict[str, int]:
    """SIGTERM linkem (it lets its held packets go), SIGKILL if it does not end; its counts."""
    with suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    try:
        out, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        out, _ = process.communicate()
    for line in reversed((out or "").splitlines()):
        with suppress(ValueError):
            found = json.loads(line)
            if isinstance(found, dict):
                return {str(k): int(v) for k, v in found.items()}
    return {}
