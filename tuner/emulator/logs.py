"""Log lines in vLLM's shape: `INFO 12-02 10:15:00 [gpu_worker.py:241] Available KV cache memory: 4.74 GiB`.

Launchers parse these lines exactly as they parse a real vLLM log, so the shape (level, date, source) matters.
The last lines are also kept in memory for in-process users.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from typing import TextIO


class VllmLog:
    def __init__(self, stream: TextIO | None = None, keep: int = 2000) -> None:
        self._stream = stream
        self.lines: deque[str] = deque(maxlen=keep)

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stdout

    def _write(self, line: str) -> None:
        self.lines.append(line)
        stream = self.stream
        try:
            stream.write(line + "\n")
            stream.flush()
        except (OSError, ValueError):  # a closed pipe must not take the server down
            pass

    def log(self, level: str, source: str, message: str) -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        for part in message.split("\n"):
            self._write(f"{level} {stamp} [{source}] {part}")

    def info(self, source: str, message: str) -> None:
        self.log("INFO", source, message)

    def warning(self, source: str, message: str) -> None:
        self.log("WARNING", source, message)

    def error(self, source: str, message: str) -> None:
        self.log("ERROR", source, message)

    def uvicorn(self, message: str) -> None:
        """Uvicorn's own format, as it appears in a vLLM log."""
        self._write(f"INFO:     {message}")

    def text(self) -> str:
        return "\n".join(self.lines)
