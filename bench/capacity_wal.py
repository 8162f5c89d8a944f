"""The WAL one schema's transactions wrote between two LSNs, read with ``pg_waldump`` where this process
can read the server's pg_wal (PostgreSQL on this host, run as root or as its owner).

The server-wide LSN difference counts every database's writes: with other test runs on a shared server
that is noise of the same size as what is measured (one run's idle sample said 1 MB/s, the next 16 KB/s).
Here a record counts when it belongs to a transaction that touched one of the schema's relations (its
commit record included), or, outside any transaction, when it touches one itself (pruning, the visibility
map, full-page images written for them).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import sqlalchemy as sa

WALDUMP_TIMEOUT = 60.0
RELATIONS = sa.text(
    """
    SELECT c.relfilenode FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname = :schema AND c.relfilenode <> 0
    UNION
    SELECT t.relfilenode FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    JOIN pg_class t ON t.oid = c.reltoastrelid WHERE n.nspname = :schema
    """
)
DATABASE = sa.text("SELECT oid FROM pg_database WHERE datname = current_database()")
RECORD = re.compile(r"len \(rec/tot\):\s*\d+/\s*(\d+), tx:\s*(\d+)")
BLOCK = re.compile(r"rel \d+/(\d+)/(\d+)")


def waldump(conn: sa.Connection) -> tuple[str, Path] | None:
    """``pg_waldump`` of the server's major version and its pg_wal folder, where both can be used here."""
    try:
        folder = Path(str(conn.execute(sa.text("SHOW data_directory")).scalar_one())) / "pg_wal"
        major = int(conn.execute(sa.text("SHOW server_version_num")).scalar_one()) // 10000
    except sa.exc.DBAPIError:  # not a superuser: the folder stays unknown
        conn.rollback()
        return None
    found = Path(f"/usr/lib/postgresql/{major}/bin/pg_waldump")
    binary = str(found) if found.exists() else shutil.which("pg_waldump")
    try:
        readable = binary is not None and any(folder.iterdir())
    except OSError:
        readable = False
    return (binary, folder) if readable and binary else None


def schema_wal(conn: sa.Connection, schema: str, start: str, end: str) -> int | None:
    """Bytes of WAL the transactions on ``schema``'s relations wrote from ``start`` to ``end`` (LSNs);
    None where pg_waldump cannot be run here."""
    tool = waldump(conn)
    if tool is None:
        return None
    binary, folder = tool
    database = str(conn.execute(DATABASE).scalar_one())
    ours = {str(node) for node in conn.execute(RELATIONS, {"schema": schema}).scalars()}
    try:
        dump = subprocess.run(
            [binary, "-p", str(folder), "-s", start, "-e", end],
            capture_output=True, text=True, timeout=WALDUMP_TIMEOUT, check=False,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    records: list[tuple[int, str, bool]] = []
    touching: set[str] = set()
    for line in dump.stdout.splitlines():
        record = RECORD.search(line)
        if record is None:
            continue
        size, xid = int(record.group(1)), record.group(2)
        mine = any(db == database and node in ours for db, node in BLOCK.findall(line))
        if mine and xid != "0":
            touching.add(xid)
        records.append((size, xid, mine))
    if not records:
        return None
    return sum(size for size, xid, mine in records if xid in touching or (xid == "0" and mine))


__all__ = ["schema_wal"]
