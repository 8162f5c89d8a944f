"""A worker's liveness as a file: its consumer touches ``RESERVATIONS_HEARTBEAT_FILE`` every few seconds
from its own event loop, so a health check reads the file's age instead of starting a Celery client.
"""

from __future__ import annotations

from contextlib import suppress
from pathlib import Path
from typing import Any

from celery import bootsteps

from tasks.settings import settings_of

# A check may call the worker dead once the file is several intervals old (compose.yaml allows 60 s).
INTERVAL = 5.0


class HeartbeatFile(bootsteps.StartStopStep):  # type: ignore[misc]
    """Touches the file while the consumer runs: a blocked event loop, or a consumer restarting after
    losing its broker, stops the touches."""

    def __init__(self, consumer: Any, **kwargs: Any) -> None:
        path = settings_of(consumer.app).heartbeat_file
        self.path = Path(path or ".")
        self.enabled = bool(path)  # unset: the step is left out of the worker
        self.timer_entry: Any = None
        super().__init__(consumer, **kwargs)

    def start(self, consumer: Any) -> None:
        self.touch()
        self.timer_entry = consumer.timer.call_repeatedly(INTERVAL, self.touch)

    def touch(self) -> None:
        with suppress(OSError):  # a full or read-only disk must not stop the consumer
            self.path.touch()

    def stop(self, consumer: Any) -> None:
        if self.timer_entry is not None:
            self.timer_entry.cancel()
            self.timer_entry = None

    shutdown = stop
