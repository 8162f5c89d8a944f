"""A private etcd cluster on loopback ports (Debian's etcd-server), for the etcd lease backend's tests and
the chaos run: members can be killed (SIGKILL, as in a crash), restarted on their data, or frozen
(SIGSTOP), and the leader is found from the members' own status."""

from __future__ import annotations

import base64
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from testing.harness import STOP_TIMEOUT, HarnessError, end_process, free_port, tls, wait_until

START_TIMEOUT = 20.0


def etcd_unavailable() -> str | None:
    """Why no cluster can be started here, or None."""
    if shutil.which("etcd") is None or shutil.which("etcdctl") is None:
        return "etcd and etcdctl are not both installed (Debian: etcd-server, etcd-client)"
    return None


@dataclass
class EtcdMember:
    name: str
    folder: Path
    client_port: int = field(default_factory=free_port)
    peer_port: int = field(default_factory=free_port)
    process: subprocess.Popen[bytes] | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, cluster: str, state: str) -> None:
        log = (self.folder / f"{self.name}.log").open("ab")
        self.process = subprocess.Popen(
            [
                "etcd",
                f"--name={self.name}",
                f"--data-dir={self.folder / self.name}",
                f"--listen-client-urls={self.client_url}",
                f"--advertise-client-urls={self.client_url}",
                f"--listen-peer-urls={self.peer_url}",
                f"--initial-advertise-peer-urls={self.peer_url}",
                f"--initial-cluster={cluster}",
                f"--initial-cluster-state={state}",
                "--initial-cluster-token=fencing-tests",
                "--log-level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()

    def kill(self) -> None:
        """SIGKILL, as in a crash; the data directory stays for a restart."""
        process, self.process = self.process, None
        if process is not None:
            with suppress(ProcessLookupError):
                process.send_signal(signal.SIGCONT)  # a frozen member dies too
            end_process(process, time.monotonic(), group=False)

    def freeze(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def status(self) -> dict[str, str] | None:
        """The member's /v3/maintenance/status, or None while it does not answer."""
        try:
            reply = httpx.post(f"{self.client_url}/v3/maintenance/status", json={}, timeout=0.5, verify=tls())
        except httpx.HTTPError:
            return None
        return reply.json() if reply.status_code == 200 else None


class EtcdCluster:
    """``size`` members under ``folder``, started together; :meth:`url` names them all."""

    def __init__(self, folder: Path, size: int = 3) -> None:
        self.members = [EtcdMember(f"m{i}", folder) for i in range(size)]
        self.initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)

    def url(self, prefix: str, scheme: str = "etcd") -> str:
        return f"{scheme}://" + ",".join(f"127.0.0.1:{m.client_port}" for m in self.members) + f"/{prefix}"

    def start(self) -> None:
        for member in self.members:
            member.start(self.initial, "new")
        self.wait_for_leader()

    def restart(self, member: EtcdMember) -> None:
        member.start(self.initial, "existing")

    def heal(self, timeout: float = START_TIMEOUT) -> None:
        """Every member running again on its data, answering, with a leader they all name."""
        for member in self.members:
            if member.process is None:
                self.restart(member)
        wait_until(
            lambda: self.leader() is not None and all(m.status() for m in self.members),
            timeout=timeout,
            what="every etcd member back in the cluster",
        )

    def leader(self) -> EtcdMember | None:
        """The member every answering member names as leader, once a majority answers."""
        statuses = [(m, m.status()) for m in self.members if m.process is not None]
        answered = [(m, s) for m, s in statuses if s is not None]
        if len(answered) * 2 <= len(self.members):
            return None
        leaders = {s.get("leader") for _, s in answered}
        if len(leaders) != 1 or not leaders <= {s["header"]["member_id"] for _, s in answered}:  # type: ignore[index]
            return None
        (leader,) = leaders
        return next(m for m, s in answered if s["header"]["member_id"] == leader)  # type: ignore[index]

    def wait_for_leader(self, timeout: float = START_TIMEOUT) -> EtcdMember:
        return wait_until(self.leader, timeout=timeout, what="an etcd leader")

    def put(self, key: str, value: str) -> None:
        """Write ``key`` through any answering member (a test's own setup, not the backend's code)."""
        body = {
            "key": base64.b64encode(key.encode()).decode(),
            "value": base64.b64encode(value.encode()).decode(),
        }
        for member in self.members:
            with suppress(httpx.HTTPError):
                if (
                    httpx.post(
                        f"{member.client_url}/v3/kv/put", json=body, timeout=2, verify=tls()
                    ).status_code
                    == 200
                ):
                    return
        raise HarnessError(f"no etcd member took the write of {key!r}")

    def stop(self) -> None:
        for member in self.members:
            process, member.process = member.process, None
            if process is not None:
                with suppress(ProcessLookupError):
                    process.send_signal(signal.SIGCONT)
                    process.terminate()
                end_process(process, time.monotonic() + STOP_TIMEOUT, group=False)


@contextmanager
def etcd_cluster(folder: Path, size: int = 3) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(folder, size)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
