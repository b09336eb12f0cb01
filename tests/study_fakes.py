"""A fake Launcher (the contract's shape, no process) and a fake load phase whose results follow the flags."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from tuner.config import Job, parse_job
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.launch.affinity import CpuPlan
from tuner.load import LoadResult, RequestRecord
from tuner.scoring import summarize
from tuner.study import Measurement

JOB: dict[str, Any] = {
    "study": {"name": "fake", "heartbeat_interval": 1, "grace_period": 2},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "l4"},
    "space": {
        "max_num_seqs": {"choices": [8, 16, 32, 64]},
        "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
        "max_model_len": 4096,
    },
    "workload": {"input_len": 256, "output_len": 32},
    "arrival": {"concurrency": 4, "requests": 10},
    "slos": ["e2e_p95 <= 2s", "success_rate >= 0.9"],
    "request_timeout": 30,
    "budget": {"n_trials": 4, "confirm": 0},  # the search alone; the confirmation has its own tests
    "sampler": {"name": "random", "seed": 1},
}


def job(**changes: Any) -> Job:
    """The fake job with `changes`; a budget given without `confirm` runs the search alone, as JOB's does."""
    if isinstance(changes.get("budget"), dict):
        changes["budget"] = {"confirm": 0, **changes["budget"]}
    data = {**JOB, **changes}
    return parse_job(data)


@dataclass
class FakeServer:
    base_url: str
    model: str
    facts: StartupFacts
    time_scale: float = 1.0
    exit_code: int | None = None
    crash: LaunchError | None = None
    log_text: str = "INFO fake server\nINFO Application startup complete.\n"
    cpu_plan: CpuPlan | None = None  # a CPU target's cores (tuner.launch.affinity): none here

    def logs(self) -> str:
        return self.log_text

    def failure(self) -> LaunchError | None:
        return self.crash


Behaviour = Callable[[VllmFlags, int], LaunchError | None]


@dataclass
class FakeLauncher:
    """Starts nothing; `fail(flags, attempt)` may return a LaunchError to raise, `crash` one the server dies with."""

    fail: Behaviour | None = None
    crash: Behaviour | None = None
    kv_tokens: Callable[[VllmFlags], int] = lambda flags: 40_000
    name: str = "fake"
    launches: list[dict[str, Any]] = field(default_factory=list)

    @contextlib.asynccontextmanager
    async def _start(self, flags: VllmFlags, study: str | None, trial: int | None) -> AsyncIterator[FakeServer]:
        attempt = sum(1 for launch in self.launches if launch["flags"] == flags.as_dict())
        self.launches.append({"flags": flags.as_dict(), "study": study, "trial": trial})
        error = self.fail(flags, attempt) if self.fail else None
        if error is not None:
            raise error
        crash = self.crash(flags, attempt) if self.crash else None
        yield FakeServer("http://127.0.0.1:9", "fake-model", StartupFacts(kv_tokens=self.kv_tokens(flags)), crash=crash)

    def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> contextlib.AbstractAsyncContextManager[FakeServer]:
        return self._start(flags, study, trial)

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return []


def records_for(flags: VllmFlags, *, failures: int = 0) -> list[RequestRecord]:
    """More sequences: more throughput and more latency. `failures` requests error out (with tokens streamed)."""
    seqs = flags.max_num_seqs or 256
    e2e = 0.5 + seqs / 32
    out = []
    for i in range(10):
        ok = i >= failures
        out.append(
            RequestRecord(
                index=i,
                start_s=i * 0.1,
                ttft_s=0.05,
                itl_s=[0.01] * 31,
                e2e_s=e2e,
                prompt_tokens=256,
                completion_tokens=32 if ok else 7,
                ok=ok,
                error_class=None if ok else "stream_cut",
                error_message=None if ok else "stream ended early",
            )
        )
    return out


def fake_measure(failures: int = 0) -> Callable[..., Any]:
    async def measure(server: FakeServer, job: Job, flags: VllmFlags) -> Measurement:
        records = records_for(flags, failures=failures)
        duration = 10.0 / (flags.max_num_seqs or 256)
        summary = summarize(records, duration_s=duration, slos=job.parsed_slos())
        result = LoadResult(summary=summary, records=records, diagnosis=f"fake: {flags.max_num_seqs} seqs")
        return Measurement(result, rate=summary.request_throughput)

    return measure


class IdleHandle:
    """A running server's handle where nothing runs behind it (a Server built by hand, the in-process emulator):
    nothing to stop, no log to read."""

    stopped_by_us = False

    def exit_code(self) -> int | None:
        return None

    def logs(self) -> str:
        return ""

    def logs_since_ready(self) -> str:
        return ""

    def mark_ready(self) -> None:
        return None
