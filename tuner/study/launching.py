"""Launch a flag set and measure it, retrying once what says nothing about the flags.

A failed start and a crash under load become the trial's verdict (the sampler learns from them); a transient one
(a start time-out, an unknown failure, a crash that is not an out-of-memory) is retried once within the trial; a
fatal one (no image, nothing can launch) stops the run. Before any failure becomes a verdict or a retry, the trial's
GPUs are read again: a GPU lost under it (GpuLost) is the environment's doing, not the flags'.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuner.config import Job
from tuner.errors import EngineGone, LaunchError
from tuner.feasibility import Prediction
from tuner.flags import VllmFlags
from tuner.launch import Launcher
from tuner.launch.failures import MODEL_NOT_FOUND
from tuner.record import CRASHED, LAUNCH_FAILED, MEASURED
from tuner.study.measure import Measure, Measurement
from tuner.study.placement import idle_waiter
from tuner.study.preflight import Preflight
from tuner.study.trial import TrialResult

__all__ = ["FATAL_REASONS", "LOG_TAIL_LINES", "TRANSIENT_REASONS", "Attempt", "launch_and_measure"]

LOG_TAIL_LINES = 40
# Failures that say nothing about the flags: retried once within the trial.
TRANSIENT_REASONS = ("start_timeout", "unknown")
# Stops the whole run: no flag set can start (a model no server can read fails every trial the same way).
FATAL_REASONS = ("image_missing", "cannot_launch", MODEL_NOT_FOUND)


@dataclass(frozen=True)
class Attempt:
    """Where and how one trial's flags are launched and measured."""

    launcher: Launcher
    job: Job
    measure: Measure
    study_name: str
    number: int
    on_event: Callable[[str], None]
    preflight: Preflight | None = None


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def is_transient(error: LaunchError) -> bool:
    if error.reason in TRANSIENT_REASONS:
        return True
    if error.reason == "crashed_under_load":
        # A runtime CUDA OOM is the flags' doing (headroom at high utilization); another crash (Xid, NCCL, a
        # segfault) says nothing about them.
        text = (str(error) + "\n" + (error.log_tail or "")).lower()
        return "out of memory" not in text and "outofmemory" not in text
    return False


def launch_and_measure(attempt: Attempt, flags: VllmFlags, prediction: Prediction) -> TrialResult:
    """Start the server, run the load, stop it: the verdict, after at most one retry of a transient failure."""
    attempts = 0
    server_seconds = 0.0
    while True:
        attempts += 1
        started = time.monotonic()
        crash: LaunchError | None = None
        try:
            measurement, facts, log_tail, crash = asyncio.run(_one_start(attempt, flags))
        except LaunchError as e:
            server_seconds += time.monotonic() - started
            if isinstance(e, EngineGone):
                raise  # the run records the trial as interrupted and waits for the engine
            # First, as a lost GPU also fails a start the fatal way ("nvidia-container-cli: ... GPU is lost"): its
            # advice (install the container toolkit) would not follow from what was seen.
            _gpus_answer(attempt)
            if e.reason in FATAL_REASONS:
                raise
            if is_transient(e) and attempts < 2:
                attempt.on_event(f"trial {attempt.number}: {e.reason} (transient), retrying once")
                continue
            return TrialResult(
                LAUNCH_FAILED,
                flags,
                e.reason,
                str(e),
                prediction,
                facts=_failed_start_facts(e),
                log_tail=tail(e.log_tail or ""),
                attempts=attempts,
                server_seconds=server_seconds,
            )
        server_seconds += time.monotonic() - started
        if crash is not None:
            _gpus_answer(attempt)
            if is_transient(crash) and attempts < 2:
                attempt.on_event(f"trial {attempt.number}: server crashed, not from the flags; retrying once")
                continue
            log = log_tail or tail(crash.log_tail or "")
            return TrialResult(
                CRASHED, flags, crash.reason, str(crash), prediction, measurement, facts, log, attempts, server_seconds
            )
        return TrialResult(
            MEASURED, flags, None, None, prediction, measurement, facts, log_tail, attempts, server_seconds
        )


def _gpus_answer(attempt: Attempt) -> None:
    """Raises GpuLost when a GPU of the trial's launcher no longer answers NVML: the failure is not the flags'."""
    waiter = idle_waiter(attempt.launcher)
    if waiter is not None:
        waiter.check()


async def _one_start(attempt: Attempt, flags: VllmFlags) -> tuple[Measurement, dict[str, Any], str, LaunchError | None]:
    async with attempt.launcher.start(flags, study=attempt.study_name, trial=attempt.number) as server:
        # The facts whole, as the launcher reports them: a field it learns to read flows through to the record.
        facts = server.facts.model_dump()
        devices = getattr(server, "devices", ())  # a Server has them; a test's fake server may not
        if devices:
            facts["devices"] = list(devices)  # which GPUs measured it (a --parallel worker's borrowed set)
        if attempt.preflight is not None:
            # On this trial's own server, before its load: a workload the server refuses stops the study here.
            await attempt.preflight.run(server, attempt.job, flags, attempt.number)
        measurement = await attempt.measure(server, attempt.job, flags)
        crash = server.failure()
        log_tail = tail(server.logs())
    return measurement, facts, log_tail, crash


def _failed_start_facts(error: LaunchError) -> dict[str, Any] | None:
    facts: dict[str, Any] = {}
    if error.vllm_version:
        facts["vllm_version"] = error.vllm_version
    est = error.estimated_max_model_len
    if error.reason == "kv_cache_too_small" and est:
        # vLLM's "estimated maximum model length" is the KV tokens the start would have had.
        facts["kv_tokens"] = int(est)
    return facts or None
