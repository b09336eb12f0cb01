"""Reading and writing the project's tables. One Store per storage URL; short transactions, safe across workers."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Concatenate, ParamSpec, TypedDict, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker
from typing_extensions import Unpack

from tuner.errors import StorageError
from tuner.load.results import RequestRecord
from tuner.store.engine import make_engine, safe_url
from tuner.store.migrate import upgrade
from tuner.store.models import FlagClaimRow, RequestRow, TrialRow
from tuner.store.waiting import StorageWait, connection_lost

_P = ParamSpec("_P")
_R = TypeVar("_R")

# A request's columns that are RequestRecord's fields: all but the row's id and where it belongs.
_REQUEST_FIELDS = tuple(
    c.name for c in RequestRow.__table__.columns if c.name not in ("id", "study_name", "trial_number", "step")
)


@dataclass(frozen=True)
class TrialDetail:
    """Everything stored about one trial beyond Optuna's own record. JSON fields are kept as stored."""

    study: str
    number: int
    flags: dict[str, Any]
    baseline: bool
    outcome: str
    reason: str | None
    message: str | None
    prediction: dict[str, Any] | None
    startup_facts: dict[str, Any] | None
    load_summary: dict[str, Any] | None
    capacity_steps: list[Any] | None
    scored_step: int | None
    server_metrics: dict[str, Any] | None
    diagnosis: str | None
    log_tail: str | None
    attempts: int
    server_seconds: float
    created_at: datetime
    updated_at: datetime

    @classmethod
    def _of(cls, row: TrialRow) -> TrialDetail:
        # The row's columns carry TrialDetail's names (TrialFields lists the written ones).
        columns = (*TrialFields.__annotations__, "created_at", "updated_at")
        return cls(study=row.study_name, number=row.trial_number, **{name: getattr(row, name) for name in columns})


class TrialFields(TypedDict, total=False):
    """What a study writes of one trial's detail (TrialDetail's own fields), each optional in an update."""

    flags: dict[str, Any]
    baseline: bool
    outcome: str
    reason: str | None
    message: str | None
    prediction: dict[str, Any] | None
    startup_facts: dict[str, Any] | None  # the launcher's StartupFacts whole, whatever fields it has
    load_summary: dict[str, Any] | None
    capacity_steps: list[Any] | None
    scored_step: int | None
    server_metrics: dict[str, Any] | None
    diagnosis: str | None
    log_tail: str | None
    attempts: int
    server_seconds: float


def flag_key(flags: dict[str, Any]) -> str:
    """A stable identity of a flag set (sorted, type-exact), for "never launch the same flags twice"."""
    text = repr(sorted((k, type(v).__name__, v) for k, v in flags.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _waited(fn: Callable[Concatenate[Store, _P], _R]) -> Callable[Concatenate[Store, _P], _R]:
    """The call run through the store's StorageWait, when it has one: a lost connection waited out, not fatal."""

    @functools.wraps(fn)
    def call(self: Store, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        if self.waiting is None:
            return fn(self, *args, **kwargs)
        return self.waiting.call(lambda: fn(self, *args, **kwargs))

    return call


class Store:
    """The project's tables in one database (the study's own). Open it with `open_store(url)`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._sessions = sessionmaker(engine, expire_on_commit=False)
        self._thread_lock = threading.Lock()
        self.waiting: StorageWait | None = None  # a study's run sets it: its calls then wait out a lost connection

    @property
    def url(self) -> str:
        return safe_url(self.engine.url.render_as_string(hide_password=False))

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _session(self) -> Iterator[Session]:
        try:
            with self._sessions.begin() as session:
                yield session
        except IntegrityError:
            raise
        except SQLAlchemyError as e:
            cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0]
            raise StorageError(f"storage {self.url}: {cause}") from None

    # -- trial detail ---------------------------------------------------------------------------------------------

    @_waited
    def save_trial(self, study: str, number: int, **fields: Unpack[TrialFields]) -> None:
        """Create or update the detail row of one trial; the fields given are set, the others kept."""
        unknown = set(fields) - set(TrialFields.__annotations__)
        if unknown:
            raise TypeError(f"unknown trial fields: {', '.join(sorted(unknown))}")
        with self._session() as s:
            row = s.get(TrialRow, (study, number))
            if row is None:
                row = TrialRow(study_name=study, trial_number=number, flags={}, outcome="measured")
                s.add(row)
            for name, value in fields.items():
                setattr(row, name, value)

    @_waited
    def trial_detail(self, study: str, number: int) -> TrialDetail | None:
        with self._session() as s:
            row = s.get(TrialRow, (study, number))
            return None if row is None else TrialDetail._of(row)

    @_waited
    def trial_details(self, study: str) -> list[TrialDetail]:
        with self._session() as s:
            rows = s.scalars(sa.select(TrialRow).where(TrialRow.study_name == study).order_by(TrialRow.trial_number))
            return [TrialDetail._of(r) for r in rows]

    # -- per-request records --------------------------------------------------------------------------------------

    @_waited
    def save_requests(self, study: str, number: int, records: Sequence[RequestRecord], *, step: int = 0) -> None:
        """Replace the records of one trial's load step (a retried trial keeps only its last attempt's)."""
        with self._session() as s:
            s.execute(
                sa.delete(RequestRow).where(
                    RequestRow.study_name == study, RequestRow.trial_number == number, RequestRow.step == step
                )
            )
            if records:
                rows = [
                    {
                        "study_name": study,
                        "trial_number": number,
                        "step": step,
                        **r.model_dump(include=set(_REQUEST_FIELDS)),
                    }
                    for r in records
                ]
                s.execute(sa.insert(RequestRow), rows)

    @_waited
    def request_records(self, study: str, number: int, step: int | None = None) -> list[RequestRecord]:
        """The records of a trial's scored load step (`step=None`), or of one capacity-search step."""
        with self._session() as s:
            if step is None:
                scored = s.scalar(
                    sa.select(TrialRow.scored_step).where(TrialRow.study_name == study, TrialRow.trial_number == number)
                )
                step = scored or 0
            rows = s.scalars(
                sa.select(RequestRow)
                .where(RequestRow.study_name == study, RequestRow.trial_number == number, RequestRow.step == step)
                .order_by(RequestRow.index)
            )
            return [RequestRecord.model_validate({f: getattr(r, f) for f in _REQUEST_FIELDS}) for r in rows]

    @_waited
    def request_steps(self, study: str, number: int) -> list[int]:
        with self._session() as s:
            q = (
                sa.select(RequestRow.step)
                .where(RequestRow.study_name == study, RequestRow.trial_number == number)
                .distinct()
                .order_by(RequestRow.step)
            )
            return list(s.scalars(q))

    # -- flag-set claims: one launch per flag set, across workers -------------------------------------------------

    @_waited
    def claim(self, study: str, key: str, number: int) -> int:
        """Claim a flag set for trial `number`; returns the owner (== number when this trial won the claim)."""
        try:
            with self._session() as s:
                s.add(FlagClaimRow(study_name=study, flag_key=key, trial_number=number))
            return number
        except IntegrityError:
            with self._session() as s:
                row = s.get(FlagClaimRow, (study, key))
                if row is None:  # released between our insert and this read: try once more
                    s.add(FlagClaimRow(study_name=study, flag_key=key, trial_number=number))
                    return number
                return row.trial_number

    @_waited
    def take_over_claim(self, study: str, key: str, old: int, new: int) -> bool:
        """Move a claim from a trial that died (`old`) to `new`; False when another worker moved it first."""
        with self._session() as s:
            result = s.execute(
                sa.update(FlagClaimRow)
                .where(FlagClaimRow.study_name == study, FlagClaimRow.flag_key == key, FlagClaimRow.trial_number == old)
                .values(trial_number=new)
            )
            return bool(getattr(result, "rowcount", 0))

    @_waited
    def release_claim(self, study: str, key: str, number: int) -> None:
        with self._session() as s:
            s.execute(
                sa.delete(FlagClaimRow).where(
                    FlagClaimRow.study_name == study, FlagClaimRow.flag_key == key, FlagClaimRow.trial_number == number
                )
            )

    # -- housekeeping ---------------------------------------------------------------------------------------------

    @_waited
    def delete_study(self, study: str) -> None:
        """Drop every row of a study (when a new study takes an old, deleted one's name)."""
        with self._session() as s:
            for table in (RequestRow, TrialRow, FlagClaimRow):
                s.execute(sa.delete(table).where(table.study_name == study))

    @contextlib.contextmanager
    def exclusive(self, study: str) -> Iterator[None]:
        """A lock across every worker of `study` on this database: held while one worker decides and creates its next
        trial, so a shared budget is never overrun. PostgreSQL: an advisory lock; SQLite: a lock file beside the
        database file (a lock inside the file would block Optuna's own writes)."""
        name = self.engine.dialect.name
        with self._thread_lock:
            if name == "postgresql":
                key = int.from_bytes(hashlib.sha256(study.encode()).digest()[:8], "big", signed=True)
                with self._locked_connection(key) as conn:
                    try:
                        yield
                    finally:
                        try:
                            conn.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": key})
                            conn.commit()
                        except SQLAlchemyError as e:
                            if not connection_lost(e):
                                raise
                            # The lock was the lost connection's: the database released it with the connection.
            elif name == "sqlite" and self.engine.url.database not in (None, "", ":memory:"):
                path = os.path.abspath(str(self.engine.url.database)) + ".lock"
                with open(path, "a+") as f:
                    fcntl.flock(f, fcntl.LOCK_EX)
                    try:
                        yield
                    finally:
                        fcntl.flock(f, fcntl.LOCK_UN)
            else:
                yield

    @contextlib.contextmanager
    def _locked_connection(self, key: int) -> Iterator[sa.Connection]:
        """A connection holding PostgreSQL's advisory lock `key`; taking it waits out a lost connection."""

        def take() -> sa.Connection:
            conn = self.engine.connect()
            try:
                conn.execute(sa.text("SELECT pg_advisory_lock(:k)"), {"k": key})
                conn.commit()
            except BaseException:
                conn.close()
                raise
            return conn

        conn = self.waiting.call(take) if self.waiting is not None else take()
        with conn:
            yield conn


def open_store(url: str, *, migrate: bool = True) -> Store:
    """The Store of a storage URL (the study's own), its tables migrated to the newest schema unless told not to."""
    engine = make_engine(url)
    if migrate:
        try:
            upgrade(engine)
        except BaseException:
            engine.dispose()
            raise
    return Store(engine)


__all__ = ["Store", "TrialDetail", "TrialFields", "flag_key", "open_store"]
