"""A running trial's heartbeat, recorded by a thread: what Optuna's optimize() does for its trials, for our loop."""

from __future__ import annotations

import contextlib
import threading

import optuna
from optuna.storages import RDBStorage

__all__ = ["Heartbeat"]


class Heartbeat:
    """Records the trial's heartbeat every interval while it runs (a storage without one: nothing)."""

    def __init__(self, storage: optuna.storages.BaseStorage, trial_id: int) -> None:
        self._storage = storage
        self._trial_id = trial_id
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        interval = self._storage.get_heartbeat_interval() if isinstance(self._storage, RDBStorage) else None
        if interval:
            assert isinstance(self._storage, RDBStorage)
            storage = self._storage
            self._storage.record_heartbeat(self._trial_id)

            def beat() -> None:
                delay: float = interval
                while not self._stop.wait(delay):
                    # A missed beat (the database away) is tried again every second, so the trial beats again the
                    # moment the database is back, before another worker's stale check can take it for dead.
                    delay = min(1.0, interval)
                    with contextlib.suppress(Exception):
                        storage.record_heartbeat(self._trial_id)
                        delay = interval

            self._thread = threading.Thread(target=beat, name="tuner-heartbeat", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
