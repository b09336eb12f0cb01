"""A study tuned against a server whose step times are known: `tuner tune`'s own study run (TuningRun: sampler,
trial records, the project's tables), each trial's server the emulator's engine with a given profile in virtual
time (the twin, its step times without spread: known exactly), measured as the load client would measure a real
one."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.config import Job, parse_job
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.load import LoadResult
from tuner.scoring import summarize
from tuner.study import Measurement, TuningRun
from tuner.twin.simulate import Coefficients, simulate

EXACT = Coefficients(step_jitter=0.0)  # every step the profile's time: a server whose step times are known

# A workload and a space that tell the five coefficients apart: prompts from tens to a thousand tokens (chunked
# by the small max_num_batched_tokens, whose chunks read the KV of the earlier ones), batches from 1 to 32.
JOB: dict[str, Any] = {
    "study": {"name": "fit"},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "cpu"},
    "space": {
        "max_num_seqs": {"choices": [1, 2, 4, 8, 16, 32]},
        "max_num_batched_tokens": {"choices": [128, 256, 512, 2048]},
        "max_model_len": 2048,
    },
    "workload": {
        "input_len": {"dist": "lognormal", "median": 256, "sigma": 0.8, "max": 1500},
        "output_len": {"dist": "uniform", "low": 4, "high": 64},
    },
    "arrival": {"concurrency": 16, "requests": 48, "warmup_requests": 4},
    "slos": ["e2e_p95 <= 600s"],
    "request_timeout": 600,
    "budget": {"n_trials": 10, "confirm": 0},
    "sampler": {"name": "random", "seed": 1},
}


@dataclass
class _Server:
    base_url: str
    model: str
    facts: StartupFacts
    time_scale: float = 1.0
    cpu_plan: None = None  # not placed on cores of its own (a CPU target's plan: tuner.launch.affinity)

    def logs(self) -> str:
        return ""

    def failure(self) -> LaunchError | None:
        return None


@dataclass
class TwinLauncher:
    """Starts the twin's server for a flag set: the KV tokens the engine gets, the vLLM version of the profile;
    `refuse` names max_num_seqs values whose start fails (a trial that is not measured)."""

    job: Job
    refuse: tuple[int, ...] = ()
    name: str = "twin"

    @contextlib.asynccontextmanager
    async def _start(self, flags: VllmFlags) -> AsyncIterator[_Server]:
        if flags.max_num_seqs in self.refuse:
            raise LaunchError("the server died at start-up", reason="unknown")
        point = simulate(self.job, flags, EXACT)
        yield _Server("http://twin", "m", StartupFacts(kv_tokens=point.kv_tokens, vllm_version="0.32.0"))

    def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> contextlib.AbstractAsyncContextManager[_Server]:
        return self._start(flags)

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return []


async def _measure(server: _Server, job: Job, flags: VllmFlags) -> Measurement:
    point = simulate(job, flags, EXACT)
    summary = summarize(point.records, duration_s=point.duration_s, slos=job.parsed_slos())
    return Measurement(LoadResult(summary=summary, records=point.records), rate=summary.request_throughput)


def twin_job(profile: Path, storage: str, **changes: Any) -> dict[str, Any]:
    """The job as a file would give it, its server the known profile, its study in `storage`."""
    data = {**JOB, **changes}
    data["budget"] = {**JOB["budget"], **changes.get("budget", {})}  # the search alone (confirm 0), unless asked
    data["target"] = {**JOB["target"], **changes.get("target", {}), "profile": str(profile)}
    data["study"] = {**JOB["study"], "storage": storage}
    return data


def tune_against_twin(data: dict[str, Any], refuse: tuple[int, ...] = ()) -> None:
    """Run the job's study to its budget (needs VLLM_CPU_KVCACHE_SPACE for the CPU device)."""
    job = parse_job(data)
    run = TuningRun(job, TwinLauncher(job, refuse), measure=_measure, poll_s=0.05)
    try:
        run.run()
    finally:
        run.close()
