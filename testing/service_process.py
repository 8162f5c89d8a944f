"""A uvicorn process of the HTTP front door (``reservations serve``), or of any app factory, in its own
session (its process group is its CPU), logging to a file: what the chaos run's HTTP callers and the HTTP
benchmark talk to.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import httpx

from testing.harness import HarnessError, free_port, spawn, tls

START_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0


@dataclass
class ServiceProcess:
    name: str
    command: list[str]
    env: Mapping[str, str]
    log_path: Path
    port: int
    cwd: Path | None = None
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self.process is None:
            raise HarnessError(f"{self.name} was never started")
        return self.process.pid

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.process = spawn(
            self.command, self.log_path, env={**self.env, "PYTHONUNBUFFERED": "1"}, cwd=self.cwd
        )

    def tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last lines of {self.name}'s log ---\n" + "\n".join(text)

    def wait_ready(self, path: str = "/healthz", timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, verify=tls()) as client:
            while True:
                if self.process is None or self.process.poll() is not None:
                    raise HarnessError(f"{self.name} exited\n{self.tail()}")
                with suppress(httpx.HTTPError):
                    if client.get(self.url + path).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise HarnessError(f"{self.name} not ready after {timeout:.0f} s\n{self.tail()}")
                time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM to the group (the service answers its waiting requests at once and exits), SIGKILL
        after :data:`STOP_TIMEOUT`."""
        if self.process is None:
            return
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=STOP_TIMEOUT)
        with suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def front_door(env: Mapping[str, str], log_path: Path) -> ServiceProcess:
    """``reservations serve`` on a free loopback port, one process, no access log; ``env`` carries its
    settings (the workers' environment)."""
    port = free_port()
    reservations = Path(sys.executable).parent / "reservations"
    command = [str(reservations), "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
               "--no-access-log"]  # fmt: skip
    return ServiceProcess("service", command, env, log_path, port)
