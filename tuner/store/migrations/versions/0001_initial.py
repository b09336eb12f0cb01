"""The project's own tables: trial detail, per-request records, flag-set claims.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tuner_trial",
        sa.Column("study_name", sa.String(512), primary_key=True),
        sa.Column("trial_number", sa.Integer(), primary_key=True),
        sa.Column("flags", sa.JSON(), nullable=False),
        sa.Column("baseline", sa.Boolean(), nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("reason", sa.String(64), nullable=True),
        sa.Column("message", sa.Text(), nullable=True),
        sa.Column("prediction", sa.JSON(), nullable=True),
        sa.Column("startup_facts", sa.JSON(), nullable=True),
        sa.Column("load_summary", sa.JSON(), nullable=True),
        sa.Column("capacity_steps", sa.JSON(), nullable=True),
        sa.Column("scored_step", sa.Integer(), nullable=True),
        sa.Column("server_metrics", sa.JSON(), nullable=True),
        sa.Column("diagnosis", sa.Text(), nullable=True),
        sa.Column("log_tail", sa.Text(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("server_seconds", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "tuner_request",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("study_name", sa.String(512), nullable=False),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("index", sa.Integer(), nullable=False),
        sa.Column("start_s", sa.Float(), nullable=False),
        sa.Column("ttft_s", sa.Float(), nullable=True),
        sa.Column("itl_s", sa.JSON(), nullable=False),
        sa.Column("e2e_s", sa.Float(), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("ok", sa.Boolean(), nullable=False),
        sa.Column("error_class", sa.String(32), nullable=True),
        sa.Column("error_message", sa.Text(), nullable=True),
        sa.Column("warmup", sa.Boolean(), nullable=False),
        sa.Column("usage_from_server", sa.Boolean(), nullable=False),
    )
    op.create_index("ix_tuner_request_trial", "tuner_request", ["study_name", "trial_number", "step"])
    op.create_table(
        "tuner_flag_claim",
        sa.Column("study_name", sa.String(512), primary_key=True),
        sa.Column("flag_key", sa.String(64), primary_key=True),
        sa.Column("trial_number", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("tuner_flag_claim")
    op.drop_index("ix_tuner_request_trial", table_name="tuner_request")
    op.drop_table("tuner_request")
    op.drop_table("tuner_trial")
