"""A delaying TCP proxy for chaos runs: forwards to PostgreSQL and holds some of the chunks a client sends
for a while before passing them on, as a congested network would. Server-to-client traffic and the order
of each connection's bytes are left alone; only timing changes.
"""

from __future__ import annotations

import queue
import random
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress

CHUNK = 65536


class DelayProxy:
    """Listen on ``listen``:``port`` (127.0.0.1 and a free port unless told); delay client chunks by
    ``delay`` s when ``delaying()`` says so. With ``fraction=0`` it only forwards (to PostgreSQL from a
    host of :mod:`testing.netns`, which reaches nothing but the service address it listens on).

    A chunk is delayed with probability ``fraction``, within the first ``active`` of every ``period``
    seconds (1.0: always), on the connections chosen with probability ``connections`` when accepted; with
    ``match``, only chunks containing those bytes are candidates (e.g. one kind of statement).
    ``observe``, called once per accepted connection, returns what is handed every chunk that client sends
    (a protocol reader, for counting round trips); with ``fraction=0`` nothing is delayed.
    """

    def __init__(
        self,
        target: tuple[str, int],
        *,
        delay: float,
        fraction: float = 0.3,
        period: float = 4.0,
        active: float = 1.0,
        connections: float = 1.0,
        match: bytes | None = None,
        seed: int = 1,
        observe: Callable[[], Callable[[bytes], None]] | None = None,
        listen: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.target = target
        self.delay = delay
        self.fraction = fraction
        self.period = period
        self.active = active
        self.connections = connections
        self.match = match
        self.observe = observe
        self.random = random.Random(seed)
        self.delayed_chunks = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server((listen, port))
        self.host = listen
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, name="delay-proxy", daemon=True)

    def start(self) -> DelayProxy:
        self._thread.start()
        return self

    def delaying(self) -> bool:
        in_period = (time.monotonic() - self.started) % self.period < self.period * self.active
        with self._lock:
            return in_period and self.random.random() < self.fraction

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.update((client, server))
                chosen = self.random.random() < self.connections
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            due: queue.Queue[tuple[float, bytes]] = queue.Queue()
            seen = None if self.observe is None else self.observe()
            for target, args in (
                (self._read_client, (client, server, due, chosen, seen)),
                (self._send_due, (server, client, due)),
                (self._pump, (server, client)),
            ):
                threading.Thread(target=target, args=args, daemon=True).start()

    def _read_client(
        self,
        client: socket.socket,
        server: socket.socket,
        due: queue.Queue[tuple[float, bytes]],
        chosen: bool,
        seen: Callable[[bytes], None] | None,
    ) -> None:
        last = 0.0
        while True:
            try:
                data = client.recv(CHUNK)
            except OSError:
                data = b""
            if seen is not None and data:
                seen(data)
            now = time.monotonic()
            candidate = chosen and bool(data) and (self.match is None or self.match in data)
            hold = self.delay if candidate and self.delaying() else 0.0  # EOF is never held back
            if hold:
                with self._lock:
                    self.delayed_chunks += 1
            # Never overtake an earlier chunk of the same connection: bytes keep their order.
            last = max(last, now + hold)
            due.put((last, data))
            if not data:
                return

    def _send_due(
        self, server: socket.socket, client: socket.socket, due: queue.Queue[tuple[float, bytes]]
    ) -> None:
        while True:
            at, data = due.get()
            wait = at - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if not data:
                break
            try:
                server.sendall(data)
            except OSError:
                break
        self._close(server, client)

    def _pump(self, server: socket.socket, client: socket.socket) -> None:
        while True:
            try:
                data = server.recv(CHUNK)
                if not data:
                    break
                client.sendall(data)
            except OSError:
                break
        self._close(server, client)

    def _close(self, *socks: socket.socket) -> None:
        for sock in socks:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with suppress(OSError):
                sock.close()
            with self._lock:
                self._sockets.discard(sock)

    def cut(self) -> None:
        """Close every connection open now, as a dropped link or a restarted server would; later ones are
        accepted as before."""
        with self._lock:
            open_sockets = list(self._sockets)
        self._close(*open_sockets)

    def close(self) -> None:
        self._closed.set()
        with suppress(OSError):
            self._listener.close()
        with self._lock:
            open_sockets = list(self._sockets)
        self._close(*open_sockets)
