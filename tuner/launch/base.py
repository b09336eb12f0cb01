"""What every launcher promises: `start(flags)` yields a ready `Server`, leaving the context stops it.

A launcher never lets a server outlive the `async with` block: a failed start, a cancelled task, an exception in
the body and a normal exit all end in the same stop (SIGTERM, grace, SIGKILL, remove).
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict

from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch.affinity import CpuPlan
from tuner.launch.failures import classify_runtime_exit
from tuner.launch.redact import Redactor


class StartupFacts(BaseModel):
    """What the server's start-up log said about its capacity, and which vLLM it is (each None when unknown)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_tokens: int | None = None
    max_concurrency: float | None = None
    weights_gib: float | None = None
    available_kv_gib: float | None = None
    startup_seconds: float | None = None  # wall seconds from launch to a healthy /health
    weights_load_seconds: float | None = None  # "Model loading took X GiB memory and Y seconds"
    max_model_len: int | None = None  # the L of "Maximum concurrency for L tokens per request"
    engine_init_seconds: float | None = None  # "init engine (profile, create kv cache, warmup model) took X s"
    vllm_version: str | None = None  # GET /version, else the log banner's "version X"
    cuda_graph_gib: float | None = None  # "Estimated CUDA graph memory: X GiB total" (0.21+: out of the KV budget)


class ServerHandle(Protocol):
    """The running thing behind a Server: a process group or a container."""

    def exit_code(self) -> int | None: ...

    def logs(self) -> str: ...

    def logs_since_ready(self) -> str: ...

    def mark_ready(self) -> None: ...

    @property
    def stopped_by_us(self) -> bool: ...


class Server:
    """A ready vLLM-compatible server. `base_url` is the root ("http://127.0.0.1:PORT"), no /v1."""

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        facts: StartupFacts,
        time_scale: float,
        handle: ServerHandle,
        redactor: Redactor,
        launcher: str,
    ) -> None:
        self.base_url = base_url
        self.model = model
        self.facts = facts
        self.time_scale = time_scale
        self.launcher = launcher
        # The GPUs this server was given (CUDA_VISIBLE_DEVICES, Docker device_ids); () when it was not told.
        self.devices: tuple[str, ...] = ()
        # The cores its processes were put on, and the load client keeps to (vLLM's CPU build); None: not placed.
        self.cpu_plan: CpuPlan | None = None
        # The tuner's emulator, which answers its own routes (/emulator/stats): the load phase asks it how far it fell
        # behind its clock. Known from the launcher, so a real vLLM is never asked (it would log each 404).
        self.emulator = launcher == "emulator"
        self._handle = handle
        self._redactor = redactor

    @property
    def exit_code(self) -> int | None:
        """None while the server runs."""
        return self._handle.exit_code()

    def logs(self) -> str:
        """Everything the server printed so far (secret values replaced by ***)."""
        return self._redactor(self._handle.logs())

    def failure(self) -> LaunchError | None:
        """Why the server died after it was ready (reason crashed_under_load), or None while it runs."""
        code = self._handle.exit_code()
        if code is None or self._handle.stopped_by_us:
            return None
        return classify_runtime_exit(
            self._redactor(self._handle.logs_since_ready()), code, what=f"the {self.launcher} server"
        )

    def root_pids(self) -> tuple[int, ...]:
        """Host pids whose process trees are this server's though not the tuner's children (a container's first
        process); () for a server started as a child process, whose tree is the tuner's own already."""
        read = getattr(self._handle, "root_pid", None)
        pid = read() if callable(read) else None
        return (pid,) if isinstance(pid, int) else ()

    def __repr__(self) -> str:
        return f"Server({self.launcher}, {self.base_url}, model={self.model!r}, exit_code={self.exit_code})"


@runtime_checkable
class Launcher(Protocol):
    """Starts one server per flag set. `start` raises LaunchError (with `reason`) when the server does not start."""

    name: str

    def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> AbstractAsyncContextManager[Server]: ...

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        """Remove servers of `study` that an earlier, dead run of the tuner left behind; one line per removal."""
        ...
