"""One exception base for everything the CLI reports as a domain error (no traceback)."""

from __future__ import annotations

from collections.abc import Callable


class TunerError(Exception):
    """Base of every error `tuner` reports to a person as one clear message."""


class ConfigError(TunerError):
    """A job file, a flag or a command-line value is not what is allowed."""


class CatalogError(ConfigError):
    """An unknown GPU or model name, or an unreadable model config."""


class LaunchError(TunerError):
    """A server could not be started or died; `reason` is one of the launcher's failure classes."""

    def __init__(
        self,
        message: str,
        reason: str = "unknown",
        log_tail: str = "",
        estimated_max_model_len: int | None = None,
        vllm_version: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.log_tail = log_tail
        # vLLM's own estimate when reason is kv_cache_too_small: the longest max_model_len that would have started.
        self.estimated_max_model_len = estimated_max_model_len
        # What the failed server's banner said it was: a refused start is still a fact about that vLLM.
        self.vllm_version = vllm_version


class StorageError(TunerError):
    """A storage URL is bad or the database refused an operation."""


class StudyNotFound(StorageError):
    """No study of that name in the storage."""


ENGINE_GONE = "engine_gone"


class EngineGone(LaunchError):
    """The container engine stopped answering under a trial: the trial says nothing about its flags.

    `engine` names it for a person ("the Docker engine at unix:///var/run/docker.sock"); `answers()` says whether
    it answers again (the study waits on it, then runs the trial again)."""

    def __init__(self, message: str, engine: str, answers: Callable[[], bool], reason: str = ENGINE_GONE) -> None:
        super().__init__(message, reason)
        self.engine = engine
        self.answers = answers


GPU_LOST = "gpu_lost"


class GpuLost(EngineGone):
    """A GPU NVML saw earlier in the run no longer answers it (an Xid error, a fallen-off-the-bus GPU, a driver
    reset): what ran on it says nothing about its flags. Unlike an engine, a lost GPU rarely comes back without a
    reset: the worker that owns it stops (its trial kept as interrupted, run again by the next run), not waits."""

    def __init__(self, message: str, gpu: str, answers: Callable[[], bool], indices: tuple[int, ...] = ()) -> None:
        super().__init__(message, gpu, answers, GPU_LOST)
        self.indices = indices  # the NVML indices of the GPUs lost
