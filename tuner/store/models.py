"""The project's own tables, beside Optuna's in the same database, keyed by (study name, Optuna trial number).

Optuna's tables hold what the sampler needs (params, values, user_attrs); these hold the big data a person or a
re-scoring needs later: the load summary, every request, the server's metrics and diagnosis, the start-up facts, the
prediction and the failure's log tail. Table names start with `tuner_` so they never collide with Optuna's.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

STUDY_NAME_LENGTH = 512


def _now() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    pass


class TrialRow(Base):
    """One Optuna trial's detail."""

    __tablename__ = "tuner_trial"

    study_name: Mapped[str] = mapped_column(sa.String(STUDY_NAME_LENGTH), primary_key=True)
    trial_number: Mapped[int] = mapped_column(primary_key=True)
    flags: Mapped[dict[str, Any]] = mapped_column(sa.JSON)
    baseline: Mapped[bool] = mapped_column(default=False)
    outcome: Mapped[str] = mapped_column(sa.String(32))
    reason: Mapped[str | None] = mapped_column(sa.String(64))
    message: Mapped[str | None] = mapped_column(sa.Text)
    prediction: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    startup_facts: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    load_summary: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    capacity_steps: Mapped[list[Any] | None] = mapped_column(sa.JSON)
    scored_step: Mapped[int | None]
    server_metrics: Mapped[dict[str, Any] | None] = mapped_column(sa.JSON)
    diagnosis: Mapped[str | None] = mapped_column(sa.Text)
    log_tail: Mapped[str | None] = mapped_column(sa.Text)
    attempts: Mapped[int] = mapped_column(default=1)
    server_seconds: Mapped[float] = mapped_column(default=0.0)
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=_now)
    updated_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=_now, onupdate=_now)


class RequestRow(Base):
    """One request of a trial's load phase, as the client saw it (times in emulated seconds)."""

    __tablename__ = "tuner_request"
    __table_args__ = (sa.Index("ix_tuner_request_trial", "study_name", "trial_number", "step"),)

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    study_name: Mapped[str] = mapped_column(sa.String(STUDY_NAME_LENGTH))
    trial_number: Mapped[int]
    step: Mapped[int] = mapped_column(default=0)  # capacity-search step; 0 for a fixed load
    index: Mapped[int]
    start_s: Mapped[float]
    ttft_s: Mapped[float | None]
    itl_s: Mapped[list[Any]] = mapped_column(sa.JSON)
    e2e_s: Mapped[float]
    prompt_tokens: Mapped[int]
    completion_tokens: Mapped[int]
    ok: Mapped[bool]
    error_class: Mapped[str | None] = mapped_column(sa.String(32))
    error_message: Mapped[str | None] = mapped_column(sa.Text)
    warmup: Mapped[bool] = mapped_column(default=False)
    usage_from_server: Mapped[bool] = mapped_column(default=True)


class FlagClaimRow(Base):
    """Which trial launched (or is launching) a flag set: the primary key makes "launch it once" hold across workers."""

    __tablename__ = "tuner_flag_claim"

    study_name: Mapped[str] = mapped_column(sa.String(STUDY_NAME_LENGTH), primary_key=True)
    flag_key: Mapped[str] = mapped_column(sa.String(64), primary_key=True)
    trial_number: Mapped[int]
    created_at: Mapped[datetime] = mapped_column(sa.DateTime(timezone=True), default=_now)


__all__ = ["Base", "FlagClaimRow", "RequestRow", "TrialRow"]
