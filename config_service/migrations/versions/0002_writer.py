"""The writer's address: the replica holding the writer lock records where it takes writes, so
that a standby can forward the writes it is sent there.

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "config_writer",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("url", sa.String(1024), nullable=False),
        sa.Column("router_id", sa.String(256), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("config_writer")
