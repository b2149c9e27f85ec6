"""Initial schema: models, the epoch row, idempotency keys.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "models",
        sa.Column("model_id", sa.String(512), primary_key=True),
        sa.Column("raw_yaml", sa.Text(), nullable=False),
        sa.Column("pool", sa.String(128), nullable=False),
        sa.Column("created_epoch", sa.BigInteger(), nullable=False),
        sa.Column("updated_epoch", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    state = op.create_table(
        "config_state",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.bulk_insert(state, [{"id": 1, "epoch": 0, "updated_at": None}])
    op.create_table(
        "idempotency_keys",
        sa.Column("key", sa.String(256), primary_key=True),
        sa.Column("body_sha256", sa.String(64), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("response_json", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_idempotency_keys_created_at", "idempotency_keys", ["created_at"])


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_created_at", "idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_table("config_state")
    op.drop_table("models")
