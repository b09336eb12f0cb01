"""Confirming a winner before it ships: its flags launched again, the study's load run several times on that one
server, every run judged against the SLOs, and the median against what the study recorded.

A study measures each flag set once; on a shared or noisy machine one lucky run can top the front. Confirmed
means: every run meets every SLO, and the median output tok/s is within `tolerance` of the recorded figure (a
drop beyond it is a miss; a gain is not). The spread across runs (max - min over the median) says how far one
run can be trusted at all.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.launch import Launcher, Server
from tuner.scoring import LoadSummary, Slo
from tuner.study.measure import Measure, measure_load

__all__ = ["Verification", "VerifyRun", "verify_flags"]


@dataclass(frozen=True)
class VerifyRun:
    output_tok_s: float
    latency_p95_s: float
    success_rate: float
    missed: tuple[str, ...]  # the SLOs this run missed
    diagnosis: str = ""

    @property
    def meets(self) -> bool:
        return not self.missed


@dataclass(frozen=True)
class Verification:
    recorded_tok_s: float | None
    latency_metric: str
    tolerance: float
    runs: list[VerifyRun] = field(default_factory=list)

    @property
    def median_tok_s(self) -> float:
        return statistics.median(r.output_tok_s for r in self.runs) if self.runs else 0.0

    @property
    def median_latency_s(self) -> float:
        return statistics.median(r.latency_p95_s for r in self.runs) if self.runs else 0.0

    @property
    def spread(self) -> float:
        """(max - min) / median of output tok/s: how much one run varies from the next."""
        values = [r.output_tok_s for r in self.runs]
        median = self.median_tok_s
        return (max(values) - min(values)) / median if values and median > 0 else 0.0

    @property
    def change(self) -> float | None:
        """Median output tok/s against the recorded figure, as a fraction (-0.08: 8% lower)."""
        if not self.recorded_tok_s:
            return None
        return self.median_tok_s / self.recorded_tok_s - 1.0

    @property
    def confirmed(self) -> bool:
        if not self.runs or not all(r.meets for r in self.runs):
            return False
        change = self.change
        return change is None or change >= -self.tolerance

    def verdict(self) -> str:
        if not self.runs:
            return "not confirmed: no run finished"
        misses = [r for r in self.runs if not r.meets]
        if misses:
            names = sorted({m for r in misses for m in r.missed})
            return f"not confirmed: {len(misses)} of {len(self.runs)} runs missed {', '.join(names)}"
        change = self.change
        if change is not None and change < -self.tolerance:
            return (
                f"not confirmed: median {self.median_tok_s:,.1f} tok/s is {-change:.0%} below the recorded "
                f"{self.recorded_tok_s:,.1f} (tolerance {self.tolerance:.0%})"
            )
        against = f", {change:+.1%} against the recorded {self.recorded_tok_s:,.1f}" if change is not None else ""
        return (
            f"confirmed: {len(self.runs)} of {len(self.runs)} runs meet every SLO; median "
            f"{self.median_tok_s:,.1f} tok/s{against}; spread {self.spread:.1%}"
        )


def verify_flags(
    job: Job,
    launcher: Launcher,
    flags: VllmFlags,
    *,
    runs: int,
    recorded_tok_s: float | None,
    latency_metric: str,
    tolerance: float = 0.10,
    study: str | None = None,
    measure: Measure = measure_load,
    on_run: Callable[[int, VerifyRun | None], None] | None = None,
) -> Verification:
    """Launch `flags` once and run the job's load `runs` times on it (never stopped early: every run is whole;
    run 0 with the study's requests, each later one with the next workload seed).

    `on_run(i, run)` is called before run i (run None) and after it. LaunchError propagates: a winner that no
    longer starts is not confirmed, and the caller says why.
    """
    whole = job.model_copy(update={"stop_early": False})
    slos = job.parsed_slos()
    result = Verification(recorded_tok_s, latency_metric, tolerance)

    async def go() -> None:
        async with launcher.start(flags, study=study) as server:
            for i in range(runs):
                if on_run is not None:
                    on_run(i, None)
                run = await _one(server, _nth_run(whole, i), flags, measure, slos, latency_metric)
                result.runs.append(run)
                if on_run is not None:
                    on_run(i, run)

    asyncio.run(go())
    return result


def _nth_run(job: Job, i: int) -> Job:
    """Run 0 replays the study's own requests; later runs draw fresh ones from the same distributions (the next
    seeds), so prefix-cache hits on the previous run's prompts do not flatter them."""
    if i == 0:
        return job
    workload = job.workload.model_copy(update={"seed": (job.workload.seed or 0) + i})
    return job.model_copy(update={"workload": workload})


async def _one(
    server: Server, job: Job, flags: VllmFlags, measure: Measure, slos: Sequence[Slo], latency_metric: str
) -> VerifyRun:
    m = await measure(server, job, flags)
    summary: LoadSummary | None = m.result.summary if m.result is not None else None
    if summary is None:
        return VerifyRun(0.0, 0.0, 0.0, tuple(str(s) for s in slos))
    missed = tuple(str(s) for s in slos if not s.met(summary))
    latency = float(summary.metric(latency_metric)) if summary.requests_succeeded else float("inf")
    return VerifyRun(
        output_tok_s=float(summary.output_throughput),
        latency_p95_s=latency,
        success_rate=float(summary.success_rate),
        missed=missed,
        diagnosis=m.result.diagnosis if m.result is not None else "",
    )
