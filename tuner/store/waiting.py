"""Waiting out a database that went away: which errors are a lost connection, and the bounded retry around a call.

A restart, a failover or a network blip drops every connection for seconds; a call that failed on one is run again
with backoff until the database answers or the job's `study.storage_wait_s` has passed since it stopped answering.
Integrity and data errors are never retried: running them again cannot help.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from sqlalchemy import exc as sa_exc

from tuner.errors import StorageError

__all__ = ["StorageGone", "StorageWait", "connection_lost"]

T = TypeVar("T")
log = logging.getLogger(__name__)

_FIRST_DELAY_S = 0.5
_MOST_DELAY_S = 10.0


class StorageGone(StorageError):
    """The database did not answer again within the wait the job allows."""


def _chain(e: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    link: BaseException | None = e
    while link is not None and link not in seen and len(seen) < 20:
        seen.append(link)
        link = link.__cause__ or link.__context__
    return seen


def connection_lost(e: BaseException) -> bool:
    """Whether `e` (or what it wraps: Optuna's StorageInternalError, our StorageError) is a lost or refused
    connection, not an error in the statement or its data. SQLite's own errors (a locked or full file) are not: a
    local file does not come back by waiting, and its locks already have a busy timeout."""
    chain = _chain(e)
    if any(isinstance(x, sa_exc.IntegrityError | sa_exc.DataError | sa_exc.ProgrammingError) for x in chain):
        return False
    for x in chain:
        if isinstance(x, sa_exc.DisconnectionError):
            return True
        if isinstance(x, sa_exc.DBAPIError):
            if x.connection_invalidated:
                return True
            if isinstance(x, sa_exc.OperationalError | sa_exc.InterfaceError):
                return not type(x.orig).__module__.startswith("sqlite3")
    return False


class StorageWait:
    """Runs storage calls, waiting out a lost connection for at most `bound_s` per outage (shared by every call
    and thread: a second call during one outage does not start a wait of its own). Says once that it waits and once
    that the database is back."""

    def __init__(
        self,
        where: str,
        bound_s: float,
        on_event: Callable[[str], None],
        *,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`where`: the storage as a person may read it (its password hidden)."""
        self.where = where
        self.bound_s = bound_s
        self.on_event = on_event
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # when the database stopped answering; None while it answers
        self._back_at: float | None = None  # when it last answered again after an outage

    @property
    def gone(self) -> bool:
        """The database stopped answering and the wait is over: calls fail at once until one succeeds."""
        with self._lock:
            return self._since is not None and self._clock() - self._since >= self.bound_s

    def back_within(self, seconds: float) -> bool:
        """Whether the database answered again after an outage less than `seconds` ago."""
        with self._lock:
            return self._back_at is not None and self._clock() - self._back_at < seconds

    def call(self, fn: Callable[[], T]) -> T:
        delay = _FIRST_DELAY_S
        while True:
            try:
                result = fn()
            except Exception as e:
                if not connection_lost(e):
                    raise
                left = self._lost(e)
                if left <= 0:
                    raise StorageGone(
                        f"storage {self.where} did not answer for {self.bound_s:g} s (study.storage_wait_s)"
                    ) from e
                self._sleep(min(delay, left))
                delay = min(delay * 2, _MOST_DELAY_S)
                continue
            self._back()
            return result

    def _lost(self, e: BaseException) -> float:
        """Seconds left of the wait; the first failure of an outage says what it waits for."""
        with self._lock:
            now = self._clock()
            if self._since is None:
                self._since = now
                cause = str(getattr(e, "orig", None) or e).strip().splitlines()[0] if str(e).strip() else ""
                self.on_event(
                    f"lost the connection to storage {self.where} ({cause or type(e).__name__}); waiting up to "
                    f"{self.bound_s:g} s for it to answer"
                )
                log.debug("the storage call that found the database gone", exc_info=e)  # for the log file only
            return self._since + self.bound_s - now

    def _back(self) -> None:
        with self._lock:
            if self._since is None:
                return
            self._back_at = self._clock()
            away = self._back_at - self._since
            self._since = None
        self.on_event(f"storage {self.where} answers again (it was away {away:.0f} s); carrying on")
