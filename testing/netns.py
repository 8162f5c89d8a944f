"""Hosts on one machine: each a network namespace with its own address on a veth pair to the root
namespace, so that a process of the harness runs on a host of its own and can be cut off from one server
while it still reaches the others (:mod:`testing.links` cuts and slows the links).

Addresses come from the documentation range 192.0.2.0/24 only. The servers of the root namespace listen
for the hosts on one service address, which every root-side veth end carries; a host has a route to that
address and to nothing else. Everything is named ``PREFIX`` + the owning process's pid, removed on exit
(Ctrl-C and SIGTERM included), and swept at the next start once its owner is gone.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

PREFIX = "fres"
RANGE = ipaddress.IPv4Network("192.0.2.0/24")
# The upper half of the range only, and none of its addresses the machine already uses anywhere (an
# interface, a route, a neighbour: the machine's own uplink may sit in the range, as 192.0.2.2/24 here).
POOL = tuple(RANGE[n] for n in range(128, 255))
MAX_HOSTS = 60  # two addresses short of the pool: one for the service address, one spare
COMMAND_TIMEOUT = 15.0
REMOVE_TRIES = 3
LOCK_TIMEOUT = 60.0  # another run sweeps and makes its hosts meanwhile: seconds, bounded by its commands
PROBE_INDEX = 99  # the namespace ``unavailable`` makes and removes at once; hosts are numbered below it

_NAMESPACE = re.compile(rf"{PREFIX}-(\d+)-(\d+)")
_LINK = re.compile(rf"{PREFIX}(\d+)[rh](\d+)")
_LINK_NAME = re.compile(r"\d+:\s+([^:@\s]+)")


class NetnsError(RuntimeError):
    """A command that builds, changes or removes the run's hosts failed; names the command."""


def run(command: Sequence[str], *, check: bool = True, stdin: str | None = None) -> str:
    """Run one ``ip``/``tc``/``nft`` command, bounded in time; its output, or :class:`NetnsError`."""
    try:
        done = subprocess.run(
            list(command), input=stdin, capture_output=True, text=True, timeout=COMMAND_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(command)}: {exc}") from exc
    if check and done.returncode != 0:
        detail = (done.stderr or done.stdout).strip().splitlines()
        raise NetnsError(f"{' '.join(command)}: {detail[0] if detail else f'exit {done.returncode}'}")
    return done.stdout


def run_all(commands: Sequence[Sequence[str]]) -> None:
    """Run commands at once (each bounded in time): when several must take effect together, as both
    ends of a cut; :class:`NetnsError` naming the first that failed."""
    started = [
        (
            command,
            subprocess.Popen(list(command), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True),
        )
        for command in commands
    ]
    failed: list[str] = []
    for command, process in started:
        try:
            _, err = process.communicate(timeout=COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
            err = err or "timed out"
        if process.returncode != 0:
            detail = err.strip().splitlines()
            failed.append(f"{' '.join(command)}: {detail[0] if detail else f'exit {process.returncode}'}")
    if failed:
        raise NetnsError(failed[0])


def unavailable() -> str | None:
    """Why hosts cannot be made here (one line), or None: root, ``ip`` and ``tc``, and a namespace made
    and removed as a probe."""
    if os.geteuid() != 0:
        return "network namespaces need root (this process is not euid 0)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (Debian package iproute2)"
    probe = f"{PREFIX}-{os.getpid()}-{PROBE_INDEX}"
    try:
        run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot make a network namespace: {exc}"
    finally:
        run(["ip", "netns", "delete", probe], check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its own address, the service address it reaches the root namespace's
    servers on, and the two ends of its veth pair (``root_link`` in the root namespace)."""

    name: str
    namespace: str
    address: str
    service: str
    root_link: str
    inner_link: str

    def wrap(self, command: Sequence[str]) -> list[str]:
        """``command`` as run on this host (the same process: ``ip netns exec`` execs it)."""
        return ["ip", "netns", "exec", self.namespace, *command]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    """The run-made namespaces on the machine, any owner's."""
    listed = (line.split()[0] for line in run(["ip", "netns", "list"], check=False).splitlines() if line)
    return [name for name in listed if _NAMESPACE.fullmatch(name)]


def links() -> list[str]:
    """The run-made veth ends in the root namespace, any owner's."""
    found = (_LINK_NAME.match(line) for line in run(["ip", "-o", "link", "show"], check=False).splitlines())
    return [m.group(1) for m in found if m is not None and _LINK.fullmatch(m.group(1))]


def owner(name: str) -> int | None:
    """The pid that made a namespace or link of ours, from its name."""
    found = _NAMESPACE.fullmatch(name) or _LINK.fullmatch(name)
    return int(found.group(1)) if found else None


def leftovers(pid: int | None = None) -> list[str]:
    """What is left of ``pid``'s hosts (of every owner's, with None): namespaces and root-side links."""
    return [name for name in namespaces() + links() if pid is None or owner(name) == pid]


def _kill_inside(namespace: str) -> None:
    """SIGKILL what still runs in a namespace of ours (a worker whose run was killed itself)."""
    for pid in run(["ip", "netns", "pids", namespace], check=False).split():
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def _remove(namespace_names: Sequence[str], link_names: Sequence[str]) -> None:
    for link in link_names:  # the pair goes with either end
        run(["ip", "link", "delete", link], check=False)
    for namespace in namespace_names:
        _kill_inside(namespace)
        run(["ip", "netns", "delete", namespace], check=False)


def sweep_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (killed outright, say); returns
    their names."""
    stale = [name for name in namespaces() + links() if not _alive(owner(name) or 0)]
    _remove([n for n in stale if _NAMESPACE.fullmatch(n)], [n for n in stale if _LINK.fullmatch(n)])
    return stale


def _in_use() -> set[ipaddress.IPv4Address]:
    """Every address of the range that the machine's addresses, routes (all tables) and neighbours
    mention: those of other runs included."""
    text = " ".join(
        run(command, check=False)
        for command in (
            ["ip", "-4", "-o", "addr", "show"],
            ["ip", "-4", "route", "show", "table", "all"],
            ["ip", "-4", "neigh", "show"],
        )
    )
    used = set()
    for token in text.split():
        with suppress(ValueError):
            address = ipaddress.IPv4Address(token.partition("/")[0])
            if address in RANGE:
                used.add(address)
    return used


def _allocate(count: int) -> list[str]:
    used = _in_use()
    free = [str(a) for a in POOL if a not in used]
    if len(free) < count:
        raise NetnsError(f"only {len(free)} free addresses left in {RANGE} for {count}")
    return free[:count]


def _free_indexes(count: int, pid: int) -> list[int]:
    found = (_NAMESPACE.fullmatch(name) or _LINK.fullmatch(name) for name in leftovers(pid))
    taken = {int(m.group(2)) for m in found if m is not None}
    free = [n for n in range(PROBE_INDEX) if n not in taken]
    if len(free) < count:
        raise NetnsError(f"this process already has {len(taken)} hosts")
    return free[:count]


@contextmanager
def _machine_lock() -> Iterator[None]:
    """One run at a time sweeps and picks addresses, so two runs never take the same ones."""
    folder = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
    with (folder / f"{PREFIX}-netns.lock").open("a") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise NetnsError(f"another run held {lock.name} for {LOCK_TIMEOUT:g}s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _create(host: Host) -> None:
    ns, inner = host.namespace, host.inner_link
    run(["ip", "netns", "add", ns])
    run(["ip", "link", "add", host.root_link, "type", "veth", "peer", "name", inner, "netns", ns])
    run(["ip", "addr", "add", f"{host.service}/32", "peer", f"{host.address}/32", "dev", host.root_link])
    run(["ip", "link", "set", host.root_link, "up"])
    run(["ip", "-n", ns, "addr", "add", f"{host.address}/32", "peer", f"{host.service}/32", "dev", inner])
    run(["ip", "-n", ns, "link", "set", inner, "up"])
    run(["ip", "-n", ns, "link", "set", "lo", "up"])


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # SIGTERM removes the hosts as Ctrl-C does: the exits run


class Hosts:
    """One host per name, made on entering and removed on leaving (whatever the way out); ``service`` is
    the address the root namespace's servers listen on for them.

    While it is entered in the main thread and SIGTERM has no handler of its own, SIGTERM is turned into
    KeyboardInterrupt, so that a terminated process still removes what it made.
    """

    def __init__(self, names: Sequence[str]) -> None:
        if not 1 <= len(names) <= MAX_HOSTS or len(set(names)) != len(names):
            raise NetnsError(f"between 1 and {MAX_HOSTS} distinct host names, got {list(names)}")
        self.names = list(names)
        self.pid = os.getpid()
        self.service = ""
        self.hosts: dict[str, Host] = {}
        self.swept: list[str] = []
        self._previous: Any = None

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts.values())

    def made(self) -> list[str]:
        """The namespaces and root-side links these hosts are made of."""
        return [n for host in self for n in (host.namespace, host.root_link)]

    def __enter__(self) -> Hosts:
        self._catch_sigterm()
        try:
            with _machine_lock():
                self.swept = sweep_stale()
                service, *addresses = _allocate(len(self.names) + 1)
                self.service = service
                for index, name, address in zip(
                    _free_indexes(len(self.names), self.pid), self.names, addresses, strict=True
                ):
                    host = Host(
                        name=name,
                        namespace=f"{PREFIX}-{self.pid}-{index}",
                        address=address,
                        service=service,
                        root_link=f"{PREFIX}{self.pid}r{index}",
                        inner_link=f"{PREFIX}{self.pid}h{index}",
                    )
                    self.hosts[name] = host  # before it exists: a half-made host is removed too
                    _create(host)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        left = self.remove()
        if left and kind is None:
            raise NetnsError(f"could not remove {', '.join(left)}")

    def remove(self) -> list[str]:
        """Remove every host (SIGKILL for anything still running on one); returns what is left, if any."""
        try:
            mine = set(self.made())
            for _ in range(REMOVE_TRIES):
                left = [name for name in leftovers(self.pid) if name in mine]
                if not left:
                    return []
                _remove([n for n in left if _NAMESPACE.fullmatch(n)], [n for n in left if _LINK.fullmatch(n)])
            return [name for name in leftovers(self.pid) if name in mine]
        finally:
            self._restore_sigterm()

    def _catch_sigterm(self) -> None:
        main = threading.current_thread() is threading.main_thread()
        if main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._previous = signal.signal(signal.SIGTERM, _interrupt)

    def _restore_sigterm(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None
