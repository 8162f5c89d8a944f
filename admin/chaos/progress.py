"""What a chaos run is doing while it runs: a status line on a terminal (updated in place, gone at the
end), one line per phase in a pipe or a log, so a run of a minute never sits silent.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from types import TracebackType

from rich.console import Console
from rich.status import Status

# A status line is redrawn at most this often; a pipe gets phases only.
EVERY = 0.5


class Progress(AbstractContextManager["Progress"]):
    def __init__(self, console: Console, mode: str) -> None:
        self.console = console
        self.mode = mode
        self._status: Status | None = None
        self._shown_at = 0.0

    def __enter__(self) -> Progress:
        if self.console.is_terminal:
            self._status = self.console.status(f"{self.mode}: starting")
            self._status.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._status is not None:
            self._status.stop()

    def phase(self, text: str) -> None:
        """A new phase: shown on the status line, or printed as its own line in a pipe."""
        if self._status is not None:
            self._status.update(f"{self.mode}: {text}")
        else:
            self.console.print(f"  {self.mode}: {text}", highlight=False)

    def tick(self, text: str) -> None:
        """How far the phase has come: on the status line only, at most every EVERY seconds."""
        now = time.monotonic()
        if self._status is not None and now - self._shown_at >= EVERY:
            self._shown_at = now
            self._status.update(f"{self.mode}: {text}")
