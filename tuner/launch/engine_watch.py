"""Whether the container engine restarted while a container ran, even when it answers again before anyone looks.

An engine restart (an upgrade, a crash, `systemctl restart docker`) kills its containers and ends every connection
to it; a container found dead afterwards looks like the flags' crash. So one long-lived connection is kept open (the
engine's event stream, which carries nothing we read): each time it ends, the engine was away, and a container that
died across such an end died with the engine, not of its flags.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["EngineWatch"]


class EngineWatch:
    """Counts the ends of a long-lived connection to the engine. `open_stream()` opens it (an iterable that ends or
    raises when the connection does; `close()` ends it from our side); it is reopened as soon as the engine answers.
    """

    def __init__(self, open_stream: Callable[[], Iterable[Any]], *, retry_s: float = 1.0) -> None:
        self._open = open_stream
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._ends = 0
        self._stream: Iterable[Any] | None = None
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()

    def mark(self) -> int | None:
        """The count now, to compare with later (the connection opened first if it is not); None when the engine
        does not give one (then nothing is told apart: a dead container stays the flags' crash)."""
        with self._lock:
            if self._thread is None:
                try:
                    self._stream = self._open()
                except Exception:
                    return None
                self._thread = threading.Thread(target=self._follow, name="engine-watch", daemon=True)
                self._thread.start()
            return self._ends

    def restarted_since(self, mark: int | None) -> bool:
        """Whether the connection ended (the engine went away) since `mark`."""
        with self._lock:
            return mark is not None and self._ends != mark

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            stream = self._stream
        close = getattr(stream, "close", None)
        if callable(close):
            with contextlib.suppress(Exception):
                close()

    def _follow(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                stream = self._stream
            if stream is not None:
                with contextlib.suppress(Exception):  # a cut connection raises as often as it just ends
                    for _ in stream:
                        pass
            if self._closed.is_set():
                return
            with self._lock:
                self._ends += 1 if stream is not None else 0
                self._stream = None
            try:
                opened = self._open()
            except Exception:  # the engine is still away: asked again shortly
                self._closed.wait(self._retry_s)
                continue
            with self._lock:
                self._stream = opened
