"""Log lines in vLLM 0.32's shape: `(EngineCore pid=41) INFO 12-02 10:15:00 [gpu_worker.py:241] ...`.

Launchers parse these lines exactly as they parse a real vLLM log, so the shape (process, level, date, source)
matters. vLLM prefixes each line with the process that wrote it (set_process_title + decorate_logs): `APIServer`,
`EngineCore` (`EngineCore_DP<n>` only with data parallelism, vllm/v1/engine/core.py run_engine_core), and the
workers (WorkerProc.setup_proc_title_and_log_prefix in vllm/v1/executor/multiproc_executor.py): with one GPU the
executor is in-process ("uni") and the worker lines come from the engine core; with tensor parallelism above 1,
one `Worker_TP<rank>` per GPU, each printing its own copy of the worker lines (model loading, memory profiling, KV
cache memory); the CPU build always runs its worker apart, as `Worker`. The emulator is one process, so every
prefix carries its one real pid. The last lines are also kept in memory for in-process users.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Literal, TextIO

Writer = Literal["api", "engine", "worker"]


class VllmLog:
    def __init__(
        self,
        stream: TextIO | None = None,
        keep: int = 2000,
        *,
        tensor_parallel_size: int = 1,
        separate_worker: bool = False,
    ) -> None:
        self._stream = stream
        self.lines: deque[str] = deque(maxlen=keep)
        pid = os.getpid()
        engine = f"(EngineCore pid={pid}) "
        self._prefixes: dict[Writer, tuple[str, ...]] = {
            "api": (f"(APIServer pid={pid}) ",),
            "engine": (engine,),
            # With one GPU the worker runs inside the engine-core process and its lines say so.
            "worker": (
                tuple(f"(Worker_TP{rank} pid={pid}) " for rank in range(tensor_parallel_size))
                if tensor_parallel_size > 1
                else (f"(Worker pid={pid}) ",)
                if separate_worker
                else (engine,)
            ),
        }

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

    def log(self, level: str, source: str, message: str, by: Writer = "api") -> None:
        stamp = time.strftime("%m-%d %H:%M:%S")
        for prefix in self._prefixes[by]:
            for part in message.split("\n"):
                self._write(f"{prefix}{level} {stamp} [{source}] {part}")

    def info(self, source: str, message: str, by: Writer = "api") -> None:
        self.log("INFO", source, message, by)

    def warning(self, source: str, message: str, by: Writer = "api") -> None:
        self.log("WARNING", source, message, by)

    def error(self, source: str, message: str, by: Writer = "api") -> None:
        self.log("ERROR", source, message, by)

    def uvicorn(self, message: str) -> None:
        """Uvicorn's own format, as it appears in a vLLM log (written by the API server)."""
        self._write(f"{self._prefixes['api'][0]}INFO:     {message}")

    def text(self) -> str:
        return "\n".join(self.lines)
