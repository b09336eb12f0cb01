"""A study's progress where nobody watches it: with stdout a file or a pipe (`nohup tuner tune job.yaml >
night.log`), a plain line after each finished trial and every few minutes between them, in place of a bar whose
redraws a file keeps as fragments (`elapsed 0:00:… ETA 0:00:…`).

`tuner tune` picks it when its console is not a terminal; a terminal keeps Rich's bar."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import TaskID

__all__ = ["EVERY_S", "PlainProgress", "clock_text"]

# Between two finished trials (a long one runs for many minutes) a line this often says the study is alive.
EVERY_S = 300.0


def clock_text(seconds: float) -> str:
    """0:02:13, as Rich's bar shows time."""
    return str(dt.timedelta(seconds=max(int(seconds), 0)))


@dataclass
class _Task:
    description: str
    total: float | None
    completed: float
    fields: dict[str, Any] = field(default_factory=dict)


class PlainProgress:
    """The calls `tuner tune` makes on Rich's `Progress` (add_task, update, reset, the console, a `with` block),
    said as whole lines: `progress: 3/10 trials, best feasible: #2 341.0 tok/s, elapsed 0:02:13, ETA 0:05:00`.

    The study's row is the first task added; the others (`--parallel`'s worker rows) are said by their own event
    lines already. The ETA is this run's pace: the trials it finished over the time it took, none yet: unknown."""

    def __init__(
        self, console: Console, *, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.console = console
        self.every_s = every_s
        self._clock = clock
        self._tasks: list[_Task] = []
        self._started = clock()
        self._first_completed: float | None = None
        self._last_line = self._started
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PlainProgress:
        self._started = self._last_line = self._clock()
        self._stop.clear()
        self._thread = threading.Thread(target=self._every, name="progress-lines", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def add_task(self, description: str, total: float | None = None, completed: float = 0, **fields: Any) -> TaskID:
        self._tasks.append(_Task(description, total, completed, dict(fields)))
        if len(self._tasks) == 1:
            self._first_completed = completed
        return TaskID(len(self._tasks) - 1)

    def update(
        self, task_id: TaskID, *, description: str | None = None, completed: float | None = None, **fields: Any
    ) -> None:
        task = self._tasks[task_id]
        if description is not None:
            task.description = description
        task.fields.update(fields)
        if completed is not None and completed != task.completed:
            task.completed = completed
            if task_id == 0:
                self.say()

    def reset(self, task_id: TaskID, *, description: str | None = None, **fields: Any) -> None:
        self.update(task_id, description=description, **fields)

    def line(self) -> str:
        """The study's row as one line."""
        if not self._tasks:
            return f"progress: elapsed {clock_text(self._clock() - self._started)}"
        study = self._tasks[0]
        total = f"/{study.total:g}" if study.total is not None else ""
        elapsed = self._clock() - self._started
        parts = [f"progress: {study.completed:g}{total} trials"]
        if best := study.fields.get("best"):
            parts.append(str(best))
        parts += [f"elapsed {clock_text(elapsed)}", f"ETA {self._eta(study, elapsed)}"]
        return ", ".join(parts)

    def say(self) -> None:
        self._last_line = self._clock()
        self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)

    def tick(self) -> None:
        """The periodic line, when no line was said for `every_s`."""
        if self._clock() - self._last_line >= self.every_s:
            self.say()

    def _eta(self, study: _Task, elapsed: float) -> str:
        done = study.completed - (self._first_completed or 0)
        if study.total is None or done <= 0:
            return "unknown"
        left = max(study.total - study.completed, 0)
        return clock_text(elapsed / done * left)

    def _every(self) -> None:
        while not self._stop.wait(min(self.every_s, 30.0)):
            self.tick()
