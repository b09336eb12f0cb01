"""What a study meets around it, told from what the flags cause: a full disk under its database, an engine that
answers again. Each is one line to a person; the trial is not blamed on its flags."""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable, Iterator

from tuner.errors import StorageError
from tuner.store import safe_url

__all__ = ["disk_full", "full_disk_error", "wait_until"]

_FULL = ("database or disk is full", "no space left on device")


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        # SQLAlchemy keeps the driver's error as `orig`; Optuna re-raises it `from` the SQLAlchemy one.
        orig = getattr(e, "orig", None)
        todo += [e.__cause__, e.__context__, orig if isinstance(orig, BaseException) else None]


def disk_full(error: BaseException) -> bool:
    """SQLite's SQLITE_FULL ("database or disk is full") or an OSError ENOSPC anywhere in the error's chain."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if any(text in str(e).lower() for text in _FULL):
            return True
    return False


def full_disk_error(url: str, number: int | None = None) -> StorageError:
    """The one line a full disk under the study database gets (`number`: the trial whose result it cost)."""
    lost = f"trial {number}'s result was not stored (not its flags' doing); " if number is not None else ""
    return StorageError(
        f"the study database {safe_url(url)} is on a full disk (database or disk is full): {lost}every trial "
        "stored before is intact; free space, then run the same command again"
    )


def wait_until(answers: Callable[[], bool], bound_s: float, poll_s: float, stop: threading.Event) -> float | None:
    """Seconds until `answers()` is true, asked every `poll_s`; None past `bound_s` or once `stop` is set."""
    started = time.monotonic()
    while not stop.is_set():
        if answers():
            return time.monotonic() - started
        if time.monotonic() - started >= bound_s:
            return None
        stop.wait(poll_s)
    return None
