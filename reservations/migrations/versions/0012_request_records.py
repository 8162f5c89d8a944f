"""Requests are durable before they travel: ``accepted_requests`` becomes the record of every request a
producer hands to the broker (the HTTP front door, ``ReservationClient``, the command line, re-drives),
with what it takes to publish it again: its caller's space, request type, arguments, task id and message
format, how often it was published (``publishes``) and when the relay looks at it next
(``next_look_ms``; NULL once it has an outcome, or for a row that holds no arguments to publish).

Rows of 0011 keep ``next_look_ms`` NULL: they hold no arguments, and their messages went out already.
A 0011 row under ``<caller>:<key>`` (the front door's scoped key) gets that caller in ``caller``.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from __future__ import annotations

import re

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# New nullable columns: workers never read this table, and a front door of 0011 inserts its five columns
# as before (its rows are left alone by the relay). Workers of 0009 keep serving.
oldest_compatible_code = "0009"

_CALLER = re.compile(r"([A-Za-z0-9._-]{1,64}):")


def upgrade() -> None:
    with op.batch_alter_table("accepted_requests") as table:
        table.add_column(sa.Column("caller", sa.String(64), nullable=True))
        table.add_column(sa.Column("request_type", sa.String(32), nullable=True))
        table.add_column(sa.Column("arguments", sa.Text, nullable=True))
        table.add_column(sa.Column("task_id", sa.String(64), nullable=True))
        table.add_column(sa.Column("message_format", sa.Integer, nullable=True))
        table.add_column(sa.Column("publishes", sa.Integer, nullable=False, server_default="0"))
        table.add_column(sa.Column("next_look_ms", sa.BigInteger, nullable=True))
    op.create_index("ix_accepted_requests_next_look_ms", "accepted_requests", ["next_look_ms"])
    bind = op.get_bind()
    if bind.dialect.name == "postgresql":
        bind.execute(
            sa.text(
                "UPDATE accepted_requests SET caller = split_part(key, ':', 1) "
                "WHERE key ~ '^[A-Za-z0-9._-]{1,64}:'"
            )
        )
        return
    keys = bind.execute(sa.text("SELECT key FROM accepted_requests WHERE key LIKE '%:%'")).scalars()
    callers = [{"k": key, "c": m.group(1)} for key in keys if (m := _CALLER.match(key))]
    if callers:
        bind.execute(sa.text("UPDATE accepted_requests SET caller = :c WHERE key = :k"), callers)


def downgrade() -> None:
    op.drop_index("ix_accepted_requests_next_look_ms", table_name="accepted_requests")
    with op.batch_alter_table("accepted_requests") as table:
        for column in (
            "next_look_ms", "publishes", "message_format", "task_id", "arguments", "request_type", "caller"
        ):  # fmt: skip
            table.drop_column(column)
