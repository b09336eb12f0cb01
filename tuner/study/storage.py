"""Optuna's storage for a study, and the study-level attributes a run writes once."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import sqlalchemy as sa
from optuna.exceptions import ExperimentalWarning
from optuna.storages import RetryHeartbeatStaleTrialCallback

from tuner import __version__
from tuner.config import Job
from tuner.errors import StorageError
from tuner.launch.docker import image_for
from tuner.store import safe_url
from tuner.study.storage_retry import WaitingRDBStorage

__all__ = ["make_storage", "sqlite_wal", "study_attrs"]


def sqlite_wal(url: str) -> None:
    """Put a SQLite study file in WAL mode (it stays so): the `--parallel` workers' readers no longer block the one
    writer, nor it them. The mode is the file's, so every later connection, Optuna's and the store's, has it."""
    engine = sa.create_engine(url, connect_args={"timeout": 60})
    try:
        if engine.dialect.name == "sqlite" and engine.url.database not in (None, "", ":memory:"):
            with engine.connect() as conn:
                conn.exec_driver_sql("PRAGMA journal_mode=WAL")
    except sa.exc.SQLAlchemyError as e:
        cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
        raise StorageError(f"cannot put {safe_url(url)!r} in WAL mode: {cause}") from None
    finally:
        engine.dispose()


def make_storage(url: str, *, heartbeat_interval: int, grace_period: int) -> WaitingRDBStorage:
    """Optuna's RDB storage with a heartbeat: a trial left RUNNING by a dead worker is failed and retried once. Its
    calls wait out a lost connection once the run gives it a StorageWait (`.waiting`)."""
    # A pooled connection the database dropped (a restart, a failover) is found and replaced before use: Optuna
    # sets pool_pre_ping only for MySQL.
    engine_kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith("sqlite"):
        engine_kwargs["connect_args"] = {"timeout": 60}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        try:
            return WaitingRDBStorage(
                url,
                heartbeat_interval=heartbeat_interval,
                grace_period=grace_period,
                heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1),
                engine_kwargs=engine_kwargs,
            )
        except Exception as e:  # SQLAlchemy and Optuna raise several kinds for a bad URL or a refused connection
            cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
            raise StorageError(f"cannot open the Optuna storage {safe_url(url)!r}: {cause}") from None


def study_attrs(job: Job) -> dict[str, Any]:
    launcher = job.target.launcher
    return {
        "tuner_version": __version__,
        "gpu": job.target.gpu,
        # What the GPU resolved to (auto, a name, figures): the morning reports must not probe their own machine.
        "gpu_profile": dataclasses.asdict(job.gpu_profile()),
        "model": job.target.model,
        "launcher": launcher,
        # What the launcher runs: on AMD GPUs the ROCm image in place of the CUDA default.
        "image": image_for(job.target.docker.image, job.gpu_profile().vendor) if launcher == "docker" else None,
        # An image the job chose stays in exports; else they follow the vLLM version each trial measured.
        "image_pinned": "image" in job.target.docker.model_fields_set,
        "workload_hash": job.workload.fingerprint(),
        "slos": list(job.slos),
        "objective": job.objective,
        "n_trials": job.budget.n_trials,
        "job": job.as_record(),
    }
