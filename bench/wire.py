"""PostgreSQL round trips counted off the wire, never estimated from the code: a libpq trace for this
process's own connections, and a forwarding proxy that reads the protocol of another process's (a Celery
worker's). Both name each round trip by its statements and count the transactions they ran.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import pq

from testing.proxy import DelayProxy

# A libpq trace line starts a message with direction, length and type; anything else continues the
# previous message (statement text keeps its newlines).
_MESSAGE = re.compile(r"^(?P<dir>[FB])\t\d+\t(?P<type>\w+)\t?(?P<rest>.*)$")
_QUOTED = re.compile(r'"((?:[^"]|"")*)"')
_WRITE = re.compile(r"(?<!FOR )(?<!DO )\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+(\w+)", re.IGNORECASE)


def label(text: str) -> str:
    """A short name for a statement: verb, table, and FOR UPDATE when it locks; a CTE lists its writes."""
    words = text.split()
    verb = words[0].upper() if words else "?"
    if verb == "WITH":
        writes = [f"{m[1].split()[0].upper()} {m[2]}" for m in _WRITE.finditer(text)]
        return f"CTE ({', '.join(writes)})"
    upper = [w.upper() for w in words]
    table = ""
    # The table follows the verb's own keyword; a FROM inside EXTRACT(EPOCH FROM ...) is not it.
    marker = {"SELECT": "FROM", "INSERT": "INTO", "UPDATE": "UPDATE", "DELETE": "FROM"}.get(verb)
    if marker in upper and upper.index(marker) + 1 < len(words):
        table = words[upper.index(marker) + 1].strip('"')
    lock = " FOR UPDATE" if "FOR UPDATE" in " ".join(upper) else ""
    return f"{verb} {table}{lock}".strip()


class Trips:
    """The round trips of one connection, from its client messages in order: a simple Query, or a Sync
    ending an extended-protocol group (a pipelined group names each statement, joined by '; '). A Sync
    after a lone Parse is psycopg preparing a statement, a round trip of its own. Prepared statement
    names are remembered, so a statement prepared earlier is still named when it is bound."""

    def __init__(self) -> None:
        self.trips: list[str] = []
        self._prepared: dict[str, str] = {}
        self._group: list[tuple[str, str]] = []  # (message type, statement) since the last Sync

    def query(self, text: str) -> None:
        self.trips.append(label(text))

    def parse(self, name: str, text: str) -> None:
        self._prepared[name] = text
        self._group.append(("Parse", text))

    def bind(self, statement: str) -> None:
        self._group.append(("Bind", self._prepared.get(statement, "?")))

    def sync(self) -> None:
        binds = [stmt for kind, stmt in self._group if kind == "Bind"]
        parses = [stmt for kind, stmt in self._group if kind == "Parse"]
        if binds:
            self.trips.append("; ".join(label(stmt) for stmt in binds))
        elif parses:
            self.trips.append(f"prepare {label(parses[-1])}")
        self._group = []


def _read_trace(trace: str, into: Trips) -> None:
    messages: list[list[str]] = []
    for line in trace.splitlines():
        match = _MESSAGE.match(line)
        if match:
            messages.append([match["dir"], match["type"], match["rest"]])
        elif messages:
            messages[-1][2] += "\n" + line
    for direction, kind, rest in messages:
        if direction != "F":
            continue
        quoted = [q.replace('""', '"') for q in _QUOTED.findall(rest)]
        if kind == "Query":
            into.query(quoted[0] if quoted else "?")
        elif kind == "Parse" and len(quoted) >= 2:
            into.parse(quoted[0], quoted[1])
        elif kind == "Bind" and len(quoted) >= 2:
            into.bind(quoted[1])
        elif kind == "Sync":
            into.sync()


@contextmanager
def wire_trace(conn: psycopg.Connection[Any], trips: Trips | None = None) -> Iterator[list[str]]:
    """Collect the round trips ``conn`` makes inside the block (filled in when the block ends). Pass the
    same ``trips`` to successive traces of one connection so a statement prepared in an earlier one is
    still named."""
    seen = Trips() if trips is None else trips
    start = len(seen.trips)
    block: list[str] = []
    fd, path = tempfile.mkstemp(prefix="fencing-bench-trace-")
    try:
        conn.pgconn.trace(fd)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)
        try:
            yield block
        finally:
            conn.pgconn.untrace()  # flushes the stream libpq writes to
        with open(path, encoding="utf-8", errors="replace") as f:
            _read_trace(f.read(), seen)
        block.extend(seen.trips[start:])
    finally:
        os.close(fd)  # libpq's FILE on this fd is never used again after untrace
        os.unlink(path)


def transactions_in(trips: list[str]) -> int:
    """Transactions the server ran for one connection's round trips: each BEGIN ... COMMIT block is one,
    and so is every statement sent outside a block (autocommit). Preparing a statement runs none."""
    count, open_block = 0, False
    for trip in trips:
        if trip.startswith("prepare "):
            continue
        for statement in trip.split("; "):
            word = statement.split(" ", 1)[0].upper()
            if word in ("BEGIN", "START"):
                count, open_block = count + 1, True
            elif word in ("COMMIT", "ROLLBACK", "END"):
                open_block = False
            elif not open_block and word:
                count += 1
    return count


def statements_in(trips: list[str]) -> int:
    """Statements other than transaction control in one connection's round trips, preparing aside."""
    statements = [
        statement for trip in trips if not trip.startswith("prepare ") for statement in trip.split("; ")
    ]
    control = ("BEGIN", "START", "COMMIT", "ROLLBACK", "END")
    return sum(1 for statement in statements if statement.split(" ", 1)[0].upper() not in control)


# -- a counting proxy --------------------------------------------------------------------------------

_PROTOCOL_3 = 196608  # the StartupMessage's version field; SSLRequest and friends carry other codes


class _Frontend:
    """Splits one connection's client byte stream into protocol messages and feeds them to ``trips``."""

    def __init__(self, trips: Trips, lock: threading.Lock) -> None:
        self.trips = trips
        self.lock = lock
        self.buffer = bytearray()
        self.started = False

    def feed(self, data: bytes) -> None:
        buf = self.buffer
        buf += data
        while True:
            if not self.started:  # untyped: length, then a code (startup, SSL or GSS request)
                if len(buf) < 8:
                    return
                size = int.from_bytes(buf[0:4], "big")
                if len(buf) < size:
                    return
                self.started = int.from_bytes(buf[4:8], "big") == _PROTOCOL_3
                del buf[:size]
                continue
            if len(buf) < 5:
                return
            size = int.from_bytes(buf[1:5], "big")
            if len(buf) < 1 + size:
                return
            kind, body = chr(buf[0]), bytes(buf[5 : 1 + size])
            del buf[: 1 + size]
            with self.lock:
                self._message(kind, body)

    def _message(self, kind: str, body: bytes) -> None:
        strings = body.split(b"\0")
        if kind == "Q":
            self.trips.query(strings[0].decode(errors="replace"))
        elif kind == "P" and len(strings) >= 2:
            self.trips.parse(strings[0].decode(errors="replace"), strings[1].decode(errors="replace"))
        elif kind == "B" and len(strings) >= 2:
            self.trips.bind(strings[1].decode(errors="replace"))
        elif kind == "S":
            self.trips.sync()


class CountingProxy:
    """Listen on 127.0.0.1:<port> and forward to PostgreSQL at ``target``, naming every round trip each
    client connection sends. Clients must connect with ``sslmode=disable``: an encrypted stream cannot
    be read. Forwarding in Python adds latency, so only untimed work goes through it. The forwarding is
    the chaos run's proxy, delaying nothing."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._connections: list[Trips] = []
        self._proxy = DelayProxy(target, delay=0.0, fraction=0.0, observe=self._connection)
        self.port: int = self._proxy.port

    def __enter__(self) -> CountingProxy:
        self._proxy.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mark(self) -> list[int]:
        """Where every connection's trips stand now; :meth:`since` returns what came after."""
        with self._lock:
            return [len(trips.trips) for trips in self._connections]

    def since(self, mark: list[int]) -> list[list[str]]:
        """Each connection's round trips since ``mark`` (connections opened since then in full)."""
        with self._lock:
            starts = mark + [0] * (len(self._connections) - len(mark))
            return [trips.trips[start:] for trips, start in zip(self._connections, starts, strict=True)]

    def _connection(self) -> Callable[[bytes], None]:
        trips = Trips()
        with self._lock:
            self._connections.append(trips)
        return _Frontend(trips, self._lock).feed

    def close(self) -> None:
        self._proxy.close()
