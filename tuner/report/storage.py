"""Opening a study for reading: which storage, and every way that can fail as one StorageError line.

Reading never creates anything: a SQLite URL whose file does not exist is an error here (Optuna itself would
silently create an empty database and report "no such study").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import optuna
from sqlalchemy.engine import make_url

from tuner.errors import StorageError, StudyNotFound
from tuner.store.engine import ALLOWED, safe_url

__all__ = [
    "DEFAULT_STORAGE",
    "STORAGE_ENV",
    "job_study_name",
    "opened_study",
    "resolve_storage",
    "sole_study",
    "study_names",
]

STORAGE_ENV = "TUNER_STORAGE_URL"  # as `tuner tune` reads it
_STORAGE_ENV_ALIASES = (STORAGE_ENV, "TUNER_STORAGE")
DEFAULT_STORAGE = "sqlite:///tuner.db"


def resolve_storage(storage: str | None, job: Path | None = None) -> str:
    """--storage wins, then the job file's storage (a SQLite file beside it by default), then $TUNER_STORAGE_URL
    (or $TUNER_STORAGE), then ./tuner.db."""
    if storage:
        return storage
    if job is not None:
        from tuner.config import load_job

        return load_job(job).storage_url()
    return next((os.environ[v] for v in _STORAGE_ENV_ALIASES if os.environ.get(v)), DEFAULT_STORAGE)


def job_study_name(job: Path) -> str:
    from tuner.config import load_job

    return load_job(job).study.name


def _storage(url: str) -> optuna.storages.RDBStorage:
    try:
        parsed = make_url(url)
    except Exception:
        raise StorageError(f"storage URL {url!r} is not a database URL; use {ALLOWED}") from None
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database
        if not db or db == ":memory:":
            raise StorageError(f"storage URL {url!r} names no database file; use {ALLOWED}")
        if not Path(db).is_file():
            raise StorageError(
                f"no study storage at {db} (give --storage URL, --job FILE or set {STORAGE_ENV}; "
                f"the default is {DEFAULT_STORAGE})"
            )
    try:
        # A pooled connection the database dropped is replaced before use (Optuna pings only MySQL's).
        return optuna.storages.RDBStorage(url, skip_compatibility_check=False, engine_kwargs={"pool_pre_ping": True})
    except Exception as e:
        cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise StorageError(f"cannot open storage {safe_url(url)!r}: {cause}") from None


def study_names(url: str) -> list[str]:
    storage = _storage(url)
    try:
        return [s.study_name for s in storage.get_all_studies()]
    finally:
        _dispose(storage)


def sole_study(url: str) -> str:
    """The study a command reads when none is named: the storage's only one; several are listed, never guessed."""
    names = study_names(url)
    if len(names) == 1:
        return names[0]
    if not names:
        raise StudyNotFound(f"no study in {safe_url(url)}")
    raise StudyNotFound(
        f"{safe_url(url)} holds {len(names)} studies ({', '.join(names)}); name one (STUDY) or give --job FILE"
    )


@contextlib.contextmanager
def opened_study(url: str, name: str) -> Iterator[optuna.Study]:
    """The study, or StudyNotFound naming the studies there are; its connections closed on leaving."""
    storage = _storage(url)
    try:
        try:
            storage.get_study_id_from_name(name)
        except KeyError:
            names = [s.study_name for s in storage.get_all_studies()]
            known = f"studies there: {', '.join(names)}" if names else "that storage holds no study"
            raise StudyNotFound(f"no study {name!r} in {safe_url(url)}; {known}") from None
        yield optuna.load_study(study_name=name, storage=storage)
    finally:
        _dispose(storage)


def _dispose(storage: optuna.storages.RDBStorage) -> None:
    storage.engine.dispose()
