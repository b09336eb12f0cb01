"""Why a server did not start, or died: read from its log, in vLLM's own words.

The patterns are vLLM's start-up refusals (`gpu_worker.py`, `cpu_worker.py`, `kv_cache_utils.py`, `SchedulerConfig`,
argparse) in the wordings of v0.9 through 0.32 (GPU and CPU builds), which the emulator prints verbatim
(tuner/capacity.py, tuner/flags.py); real logs of each are kept in tests/launch/fixtures/. The most specific cause
wins: a log that ends in "Engine core initialization failed" still has the root cause above it.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass

from tuner.capacity import CUDA_OOM, INSUFFICIENT_FREE_MEMORY, INVALID_FLAGS, KV_CACHE_TOO_SMALL, NO_KV_MEMORY
from tuner.errors import LaunchError

IMAGE_MISSING = "image_missing"
# This machine cannot start any server: the executable is missing, the log directory is not writable, Docker has
# no GPU runtime. No flag set would fare better, so a study stops rather than failing every trial.
CANNOT_LAUNCH = "cannot_launch"
# The model named is neither a directory with a config nor a repository the server can read (no such repo, gated,
# offline without a cached copy). Every flag set would fail the same way, so a study should stop on it too.
MODEL_NOT_FOUND = "model_not_found"
START_TIMEOUT = "start_timeout"
CRASHED_UNDER_LOAD = "crashed_under_load"
UNKNOWN = "unknown"

REASONS = (
    KV_CACHE_TOO_SMALL,
    NO_KV_MEMORY,
    INSUFFICIENT_FREE_MEMORY,
    CUDA_OOM,
    INVALID_FLAGS,
    IMAGE_MISSING,
    CANNOT_LAUNCH,
    MODEL_NOT_FOUND,
    START_TIMEOUT,
    CRASHED_UNDER_LOAD,
    UNKNOWN,
)

TAIL_LINES = 40

_SUMMARY = {
    KV_CACHE_TOO_SMALL: "the KV cache cannot hold one request of max_model_len",
    NO_KV_MEMORY: "no device memory is left for the KV cache",
    INSUFFICIENT_FREE_MEMORY: "the device has less free memory than gpu_memory_utilization (or the KV space) asks for",
    CUDA_OOM: "CUDA out of memory",
    INVALID_FLAGS: "vLLM rejected the flags",
    MODEL_NOT_FOUND: "the model is not a local directory with a config nor a repository the server can read",
}

# (reason, pattern); each pattern captures vLLM's sentence from its start to the end of the line.
_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (reason, re.compile(pattern, re.MULTILINE))
    for reason, pattern in (
        (KV_CACHE_TOO_SMALL, r"(To serve at least one request with the models?'?s? max seq len \(\d+\).*)$"),
        (NO_KV_MEMORY, r"(No available memory for the cache blocks.*)$"),
        (INSUFFICIENT_FREE_MEMORY, r"(Free memory on device .*is less than desired GPU memory utilization.*)$"),
        (INSUFFICIENT_FREE_MEMORY, r"(Free memory on device .*is less than the engine's budget.*)$"),
        # The CPU build: the memory fraction ("on startup") or VLLM_CPU_KVCACHE_SPACE ("on kv cache allocation").
        (INSUFFICIENT_FREE_MEMORY, r"(Available memory on node \d+ .*is less than (?:desired|requested) .*)$"),
        (CUDA_OOM, r"((?:torch\.)?(?:cuda\.)?OutOfMemoryError:.*|CUDA out of memory.*)$"),
        (INVALID_FLAGS, r"(GPU memory utilization must be .*)$"),
        (INVALID_FLAGS, r"(User-specified max_model_len \(\d+\) is greater than the derived max_model_len.*)$"),
        (INVALID_FLAGS, r"(max_num_batched_tokens \(\d+\) must be greater than or equal to max_num_seqs.*)$"),
        (INVALID_FLAGS, r"(max_num_batched_tokens \(\d+\) is smaller than max_model_len.*)$"),
        (INVALID_FLAGS, r"(max_model_len, max_num_seqs and max_num_batched_tokens must be positive.*)$"),
        (INVALID_FLAGS, r"(Total number of attention heads \(\d+\) must be divisible by tensor parallel size.*)$"),
        # argparse's line, with its "prog: error: " when it has one (vLLM's is "api_server.py" or "vllm serve").
        (INVALID_FLAGS, r"((?:\S+(?: serve)?: error: )?argument -[\w-]+: .*)$"),
        (INVALID_FLAGS, r"((?:\S+(?: serve)?: error: )?unrecognized arguments: .*)$"),
        (INVALID_FLAGS, r"((?:\S+(?: serve)?: error: )?the following arguments are required: .*)$"),
        (MODEL_NOT_FOUND, r"(Invalid repository ID or local directory specified: .*)$"),
        (MODEL_NOT_FOUND, r"(\S+ is not a local folder and is not a valid model identifier .*)$"),
        (MODEL_NOT_FOUND, r"(\S+ is not a local folder or a valid repository name .*)$"),
        (MODEL_NOT_FOUND, r"(Repo id must .*|Cannot have -- or \.\. in repo_id.*|Repo_id cannot end by .*)$"),
        (MODEL_NOT_FOUND, r"(Repository Not Found for url: .*)$"),
        (MODEL_NOT_FOUND, r"(You are trying to access a gated repo.*|Cannot access gated repo for url .*)$"),
        (MODEL_NOT_FOUND, r"(\S+ is a gated repository.*)$"),
        (MODEL_NOT_FOUND, r"(Cannot find an appropriate cached snapshot folder .*traffic has been disabled.*)$"),
    )
)
_ESTIMATE = re.compile(r"estimated maximum model length is (\d+)")
_PYDANTIC_SUFFIX = re.compile(r"\s*\[type=\w+.*$")
_PYDANTIC_HEADER = re.compile(r"\d+ validation errors? for \w*(?:Config|Args)\b")
_FIELD = re.compile(r"^[\w.\[\]]+$")
_ERROR_LINE = re.compile(r"(error|exception|traceback|fatal|killed)", re.IGNORECASE)
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception): \S")
_WRAPPER = re.compile(r"^(?:[\w.]+\.)?(?:EngineDeadError|EngineGenerateError):")
# 0.32: "[shutdown] MPClient: engine core exited unexpectedly; starting cleanup"; v0.9-0.11: "Engine core proc
# EngineCore_DP0 died unexpectedly, shutting down client."
_ENGINE_DIED = re.compile(r"engine core exited unexpectedly|Engine core proc \S+ died unexpectedly", re.IGNORECASE)
# vLLM's log prefix, "(EngineCore_DP0 pid=12) ERROR 12-02 10:15:00 [core.py:708] " (or "(VllmWorker-0 pid=9)"),
# and uvicorn's "ERROR:    ".
_LOG_PREFIX = re.compile(
    r"^(?:\([\w-]+ pid=\d+\)\s*)?(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d [\d:.]+ \[[^\]]*\]\s*"
    r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL):\s+)"
)


@dataclass(frozen=True)
class Diagnosis:
    """A known cause found in a log: its reason class and vLLM's sentence."""

    reason: str
    message: str
    estimated_max_model_len: int | None = None


def find_cause(log: str) -> Diagnosis | None:
    """The most specific known failure in the log, or None.

    The first time vLLM says it: later copies are wrappers quoting it ("RuntimeError: Worker failed with error
    '...', please check the stack trace above") whose line runs on past the sentence.
    """
    for reason, pattern in _PATTERNS:
        match = pattern.search(log)
        if match is None:
            continue
        message = _PYDANTIC_SUFFIX.sub("", match.group(1)).strip()
        estimate = None
        if reason == KV_CACHE_TOO_SMALL:
            m = _ESTIMATE.search(message)
            estimate = int(m.group(1)) if m else None
        return Diagnosis(reason, message, estimate)
    config_error = pydantic_config_error(log)
    return Diagnosis(INVALID_FLAGS, config_error) if config_error else None


def pydantic_config_error(log: str) -> str | None:
    """vLLM's configs are pydantic classes: a value they refuse is a flag vLLM rejects, whichever check it failed.

    pydantic prints "1 validation error for CacheConfig", then the field and the error on the next lines
    ("gpu_memory_utilization" / "  Input should be less than or equal to 1 [type=...]"), or a model check's
    "  Value error, ..." alone. Returns "field: error" or the value error's sentence.
    """
    lines = _messages(log)
    for i, line in enumerate(lines):
        if not _PYDANTIC_HEADER.search(line):
            continue
        first, second = [*lines[i + 1 : i + 3], "", ""][:2]
        if first.startswith("Value error, "):
            return _PYDANTIC_SUFFIX.sub("", first.removeprefix("Value error, ")).strip()
        if _FIELD.match(first) and second:
            return f"{first}: {_PYDANTIC_SUFFIX.sub('', second).strip()}"
    return None


def log_tail(log: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(log.rstrip().splitlines()[-lines:])


def describe_exit(code: int) -> str:
    signo = -code if code < 0 else code - 128 if code > 128 else 0
    if signo:
        try:
            return f"was killed by {signal.Signals(signo).name} (exit code {code})"
        except ValueError:
            pass
    return f"exited with code {code}"


def _messages(log: str) -> list[str]:
    return [m for m in (_LOG_PREFIX.sub("", line).strip() for line in log.splitlines()) if m]


def last_error_line(log: str) -> str | None:
    lines = _messages(log)
    errors = [line for line in lines if _ERROR_LINE.search(line)]
    return (errors or lines)[-1] if lines else None


def root_exception(log: str) -> str | None:
    """The first exception raised (`RuntimeError: CUDA error: ...`): later ones only report it.

    vLLM's front-end wrappers ("EngineDeadError: EngineCore encountered an issue. See stack trace (above) ...") are
    not a cause: a log with nothing else (the engine core was killed) has no root exception.
    """
    lines = _messages(log)
    return next((line for line in lines if _EXCEPTION_LINE.match(line) and not _WRAPPER.match(line)), None)


def engine_death(log: str) -> str | None:
    """vLLM's line saying its engine core process is gone (killed by a signal, the OOM killer, a segfault)."""
    return next((line for line in _messages(log) if _ENGINE_DIED.search(line)), None)


def classify_startup_exit(log: str, code: int, *, what: str = "the server") -> LaunchError:
    """The server exited before it was ready: vLLM's reason if the log has one, `unknown` otherwise."""
    cause = find_cause(log)
    if cause is None and code == 2:
        # argparse's exit status: a flag the server does not accept or a value it cannot parse.
        cause = Diagnosis(INVALID_FLAGS, last_error_line(log) or "no message")
    if cause is None:
        line = last_error_line(log)
        message = f"{what} {describe_exit(code)} before it was ready" + (f"; last log line: {line}" if line else "")
        return LaunchError(message, UNKNOWN, log_tail(log))
    return _refused(cause, log, what)


def refusal_in(log: str, *, what: str = "the server") -> LaunchError | None:
    """A start-up refusal the server has already written, classified as its exit would be; None while it has not.

    vLLM takes seconds after its error line to shut its engine core and API server down: a launcher that reads the
    line need not wait for the exit. Only whole lines count, so a cause is never read from half a sentence."""
    written = log[: log.rfind("\n") + 1]
    cause = find_cause(written)
    return None if cause is None else _refused(cause, written, what)


def _refused(cause: Diagnosis, log: str, what: str) -> LaunchError:
    return LaunchError(
        f"{what} did not start ({cause.reason}: {_SUMMARY[cause.reason]}): {cause.message}",
        cause.reason,
        log_tail(log),
        estimated_max_model_len=cause.estimated_max_model_len,
    )


def classify_runtime_exit(log_since_ready: str, code: int, *, what: str = "the server") -> LaunchError:
    """The server died after it was ready: always crashed_under_load, with the cause found in its later log."""
    cause = find_cause(log_since_ready)
    detail = (
        f"{cause.reason}: {cause.message}"
        if cause
        else root_exception(log_since_ready) or engine_death(log_since_ready) or last_error_line(log_since_ready)
    )
    message = f"{what} {describe_exit(code)} after it was ready" + (f" ({detail})" if detail else "")
    return LaunchError(message, CRASHED_UNDER_LOAD, log_tail(log_since_ready))


def start_timeout_error(log: str, timeout_s: float, *, what: str = "the server") -> LaunchError:
    line = last_error_line(log)
    message = f"{what} was not ready within {timeout_s:g} s and was killed" + (
        f"; last log line: {line}" if line else "; it printed nothing"
    )
    return LaunchError(message, START_TIMEOUT, log_tail(log))
