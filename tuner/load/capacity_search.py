"""The highest request rate that still meets the SLOs, in few steps: a throughput probe, then bracket and bisect."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from tuner.clock import REAL_TIME, Clock
from tuner.errors import ConfigError
from tuner.load.arrival import Arrival
from tuner.load.results import CapacitySearchResult, CapacityStep, LoadResult
from tuner.load.runner import LoadProgress, new_client, run_load
from tuner.load.workload import Workload
from tuner.scoring import Slo

__all__ = ["find_max_rate"]


async def find_max_rate(
    base_url: str,
    model: str,
    workload: Workload,
    slos: Sequence[Slo],
    *,
    client: httpx.AsyncClient | None = None,
    clock: Clock = REAL_TIME,
    requests_per_step: int = 100,
    max_steps: int = 6,
    probe_concurrency: int = 32,
    tolerance: float = 0.1,
    request_timeout_s: float = 60.0,
    process: str = "poisson",
    seed: int = 0,
    max_num_seqs: int | None = None,
    on_step: Callable[[CapacityStep], None] | None = None,
    on_progress: Callable[[LoadProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    stop_on_slo_miss: bool = False,
    judge: Sequence[Slo] | None = None,
) -> CapacitySearchResult:
    """Probe the saturated throughput with a closed loop, then run open-loop steps at chosen rates.

    The first step runs at the probe's request throughput (a server cannot sustain more); a step that meets
    every SLO raises the lower bound, one that misses lowers the upper bound; then bisection until the bounds
    are within `tolerance` of each other or `max_steps` steps ran. Every step is reported, in order.

    A step is judged by `judge` where given, by `slos` otherwise: the goodput search judges by `good_share >= t`
    alone, each request counted good against `slos` (DistServe's goodput), not by the SLOs' percentiles.
    """
    _check_search(slos, max_steps, requests_per_step)
    own = client is None
    http = new_client() if client is None else client
    load = functools.partial(run_load, base_url, model, workload, client=http, clock=clock)
    load = functools.partial(
        load, request_timeout_s=request_timeout_s, on_progress=on_progress, should_stop=should_stop
    )
    judged = list(slos if judge is None else judge)
    bracket = _Bracket(on_step)
    try:
        probe = await load(_probe_arrival(probe_concurrency, requests_per_step), scrape_metrics=False)
        estimate = probe.summary.request_throughput
        if estimate <= 0:
            return CapacitySearchResult(best_rate=None, best=None, steps=[], estimate_rate=None, probe=probe.summary)
        rate: float | None = estimate
        while rate is not None and len(bracket.steps) < max_steps and not (should_stop and should_stop()):
            arrival = _step_arrival(rate, process, requests_per_step, seed + len(bracket.steps))
            # A step stopped at a certain SLO miss is a miss, as it would have been.
            result = await load(
                arrival, slos=slos, judge=judged, max_num_seqs=max_num_seqs, stop_on_slo_miss=stop_on_slo_miss
            )
            bracket.record(_step(rate, result, judged), result)
            rate = _next_rate(rate, bracket.lo, bracket.hi, tolerance)
    finally:
        if own:
            await http.aclose()
    return CapacitySearchResult(
        best_rate=bracket.lo, best=bracket.best, steps=bracket.steps, estimate_rate=estimate, probe=probe.summary
    )


def _check_search(slos: Sequence[Slo], max_steps: int, requests_per_step: int) -> None:
    if not slos:
        raise ConfigError("the capacity search needs at least one SLO, e.g. 'e2e_p95<=5s'")
    if max_steps < 1 or requests_per_step < 1:
        raise ConfigError("the capacity search needs max_steps >= 1 and requests_per_step >= 1")


@dataclass
class _Bracket:
    """The steps run so far and the bounds they set: the highest rate that met every SLO (and its result), the
    lowest that missed one. `on_step` hears of each step as it is recorded."""

    on_step: Callable[[CapacityStep], None] | None = None
    steps: list[CapacityStep] = field(default_factory=list)
    lo: float | None = None
    hi: float | None = None
    best: LoadResult | None = None

    def record(self, step: CapacityStep, result: LoadResult) -> None:
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
        if step.meets_slos:
            if self.lo is None or step.rate > self.lo:
                self.lo, self.best = step.rate, result
        elif self.hi is None or step.rate < self.hi:
            self.hi = step.rate


def _probe_arrival(concurrency: int, requests_per_step: int) -> Arrival:
    """The saturating closed loop the search starts from: long enough to fill the server, short beside a step."""
    return Arrival(
        concurrency=concurrency,
        requests=max(concurrency * 2, requests_per_step // 2),
        warmup_requests=min(concurrency, requests_per_step // 4),
    )


def _step_arrival(rate: float, process: str, requests: int, seed: int) -> Arrival:
    return Arrival(
        rate=rate,
        process="constant" if process == "constant" else "poisson",
        requests=requests,
        warmup_requests=max(1, requests // 10),
        seed=seed,
    )


def _step(rate: float, result: LoadResult, slos: Sequence[Slo]) -> CapacityStep:
    violations = [s.violation(result.summary) for s in slos]
    return CapacityStep(
        rate=rate,
        summary=result.summary,
        meets_slos=all(v <= 0 for v in violations) and not result.stopped_early,
        violations=violations,
        diagnosis=result.diagnosis,
        slo_stop=result.slo_stop,
    )


def _next_rate(rate: float, lo: float | None, hi: float | None, tolerance: float) -> float | None:
    """The next step's rate; None once the bounds are within `tolerance` of each other."""
    if lo is not None and hi is not None:
        return None if (hi - lo) <= tolerance * lo else (lo + hi) / 2
    if lo is None:
        return rate / 2  # even the first rate misses: halve until one meets
    return rate * 1.5  # the probe under-estimated: step up until one misses
