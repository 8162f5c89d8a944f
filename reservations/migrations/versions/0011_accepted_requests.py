"""Requests a front door accepted: ``accepted_requests`` holds, per idempotency key, the request the HTTP
service published under it (operation, fingerprint, when, and its deadline), so the service can tell a
request still in flight from a key never seen and refuse a key reused for another request before it
publishes anything (reservations.acceptance). Purged with the outcomes.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

# A new table that workers never read or write: workers of 0010, and of 0009 (which 0010 serves), keep
# serving beside it.
oldest_compatible_code = "0009"


def upgrade() -> None:
    op.create_table(
        "accepted_requests",
        sa.Column("key", sa.String(200), primary_key=True),
        sa.Column("operation", sa.String(32), nullable=False),
        sa.Column("fingerprint", sa.String(64), nullable=False),
        sa.Column("at_ms", sa.BigInteger, nullable=False),
        sa.Column("deadline_ms", sa.BigInteger, nullable=True),
    )
    op.create_index("ix_accepted_requests_at_ms", "accepted_requests", ["at_ms"])


def downgrade() -> None:
    op.drop_index("ix_accepted_requests_at_ms", table_name="accepted_requests")
    op.drop_table("accepted_requests")
