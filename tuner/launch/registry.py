"""A small pidfile registry of the server processes this tuner started, so a later run can find leftovers.

One JSON file a process under the state directory (default ~/.cache/tuner/processes, or $TUNER_STATE_DIR/processes).
A record is trusted only while the pid still has the start time it was recorded with: pids are reused.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path


def default_state_dir() -> Path:
    base = os.environ.get("TUNER_STATE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "tuner") / "processes"


@dataclass(frozen=True)
class ProcessRecord:
    pid: int
    pgid: int
    start_ticks: str | None
    cmdline: list[str]
    study: str | None
    trial: int | None
    owner: str
    log_path: str | None = None


class ProcessRegistry:
    def __init__(self, state_dir: Path | str | None = None) -> None:
        self.dir = Path(state_dir) if state_dir is not None else default_state_dir()

    def _path(self, pid: int) -> Path:
        return self.dir / f"{pid}.json"

    def add(self, record: ProcessRecord) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self._path(record.pid).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record)), encoding="utf-8")
        tmp.replace(self._path(record.pid))

    def remove(self, pid: int) -> None:
        self._path(pid).unlink(missing_ok=True)

    def records(self) -> list[ProcessRecord]:
        if not self.dir.is_dir():
            return []
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                out.append(ProcessRecord(**json.loads(path.read_text(encoding="utf-8"))))
            except (OSError, ValueError, TypeError):
                path.unlink(missing_ok=True)  # a torn or foreign file: nothing to trust in it
        return out
