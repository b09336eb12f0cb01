"""One exception base for everything the CLI reports as a domain error (no traceback)."""

from __future__ import annotations


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
