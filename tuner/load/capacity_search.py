"""The highest request rate that still meets the SLOs, in few steps: a throughput probe, then bracket and bisect.

The steps are a Poisson (or constant) open loop at each rate, or a trace replayed faster or slower: each rate is its
slice's own mean rate times a speed-up, every send time divided alike, so the bursts, the lengths and the shared
prompt blocks stay the trace's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import httpx

from tuner.clock import REAL_TIME, Clock
from tuner.errors import ConfigError
from tuner.load.arrival import Arrival
from tuner.load.results import CapacitySearchResult, CapacityStep, LoadResult
from tuner.load.runner import LoadProgress, new_client, run_load
from tuner.load.workload import Workload
from tuner.scoring import Slo

R = TypeVar("R")

__all__ = ["RateBracket", "find_max_rate", "judge_step", "next_rate", "trace_probe"]


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
    trace: Arrival | None = None,
) -> CapacitySearchResult:
    """Probe the saturated throughput with a closed loop, then run open-loop steps at chosen rates.

    The first step runs at the probe's request throughput (a server cannot sustain more); a step that meets
    every SLO raises the lower bound, one that misses lowers the upper bound; then bisection until the bounds
    are within `tolerance` of each other or `max_steps` steps ran. Every step is reported, in order.

    A step is judged by `judge` where given, by `slos` otherwise: the goodput search judges by `good_share >= t`
    alone, each request counted good against `slos` (DistServe's goodput), not by the SLOs' percentiles.
    With `trace`, each step replays the trace at the rate (`_Loads` says how, and where it starts).
    """
    _check_search(slos, max_steps, requests_per_step, trace)
    own = client is None
    http = new_client() if client is None else client
    load = functools.partial(run_load, base_url, model, workload, client=http, clock=clock, should_stop=should_stop)
    load = functools.partial(load, request_timeout_s=request_timeout_s, on_progress=on_progress)
    judged = list(slos if judge is None else judge)
    loads = _Loads(trace, process, requests_per_step, seed, probe_concurrency)
    step = functools.partial(
        load, slos=slos, judge=judged, max_num_seqs=max_num_seqs, stop_on_slo_miss=stop_on_slo_miss
    )
    try:
        probe = await load(first, scrape_metrics=False) if (first := loads.probe()) is not None else None
        estimate = probe.summary.request_throughput if probe is not None else loads.start_rate()
        probed = probe.summary if probe is not None else None
        if estimate <= 0:
            return CapacitySearchResult(best_rate=None, best=None, steps=[], estimate_rate=None, probe=probed)
        bracket: RateBracket[LoadResult] = RateBracket(on_step)
        rate: float | None = estimate
        while rate is not None and len(bracket.steps) < max_steps and not (should_stop and should_stop()):
            result = await step(loads.step(rate, len(bracket.steps)))  # stopped at a certain SLO miss: a miss
            bracket.record(judge_step(rate, result, judged, loads.trace_rate), result)
            rate = next_rate(rate, bracket.lo, bracket.hi, tolerance)
    finally:
        if own:
            await http.aclose()
    found = CapacitySearchResult(best_rate=bracket.lo, best=bracket.best, steps=bracket.steps, estimate_rate=estimate)
    return found.model_copy(update={"probe": probed, "trace_rate": loads.trace_rate})


def _check_search(slos: Sequence[Slo], max_steps: int, requests_per_step: int, trace: Arrival | None) -> None:
    if not slos:
        raise ConfigError("the capacity search needs at least one SLO, e.g. 'e2e_p95<=5s'")
    if max_steps < 1 or requests_per_step < 1:
        raise ConfigError("the capacity search needs max_steps >= 1 and requests_per_step >= 1")
    if trace is not None and (trace.trace is None or trace.trace_rate() is None):
        raise ConfigError(
            "the capacity search scales a trace's time: its slice needs at least two requests at different times"
        )


@dataclass
class RateBracket(Generic[R]):
    """The steps run so far and the bounds they set: the highest rate that met every SLO (and its result: a load's,
    or the twin's simulated one), the lowest that missed one. `on_step` hears of each step as it is recorded."""

    on_step: Callable[[CapacityStep], None] | None = None
    steps: list[CapacityStep] = field(default_factory=list)
    lo: float | None = None
    hi: float | None = None
    best: R | None = None

    def record(self, step: CapacityStep, result: R) -> None:
        self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
        if step.meets_slos:
            if self.lo is None or step.rate > self.lo:
                self.lo, self.best = step.rate, result
        elif self.hi is None or step.rate < self.hi:
            self.hi = step.rate


@dataclass(frozen=True)
class _Loads:
    """What the search sends: a rate's open loop (Poisson or constant) or a trace's slice replayed at the rate
    (`Arrival.at_rate`), its prompts written afresh a step. A trace's probe is its slice's requests at most
    `probe_concurrency` in flight; where the trace gives a speed-up other than 1 there is none: the first step
    plays the trace at that speed-up."""

    trace: Arrival | None
    process: str
    requests_per_step: int
    seed: int
    probe_concurrency: int

    @property
    def trace_rate(self) -> float | None:
        return self.trace.trace_rate() if self.trace is not None else None

    def probe(self) -> Arrival | None:
        """The saturating probe; None where the trace's own speed-up is the start."""
        if self.trace is None:
            return _probe_arrival(self.probe_concurrency, self.requests_per_step)
        return trace_probe(self.trace, self.probe_concurrency) if self.trace.speedup == 1 else None

    def start_rate(self) -> float:
        """The first step's rate without a probe: the trace played at the job's speed-up."""
        assert self.trace is not None
        return self.trace.speedup * (self.trace_rate or 0.0)

    def step(self, rate: float, index: int) -> Arrival:
        if self.trace is not None:
            return self.trace.at_rate(rate, self.trace.seed + index + 1)
        return _step_arrival(rate, self.process, self.requests_per_step, self.seed + index)


def _probe_arrival(concurrency: int, requests_per_step: int) -> Arrival:
    """The saturating closed loop the search starts from: long enough to fill the server, short beside a step."""
    return Arrival(
        concurrency=concurrency,
        requests=max(concurrency * 2, requests_per_step // 2),
        warmup_requests=min(concurrency, requests_per_step // 4),
    )


def trace_probe(trace: Arrival, concurrency: int) -> Arrival:
    """The saturating probe of a trace: its slice's requests, in order, all due at once and at most `concurrency`
    in flight (a closed loop of its own prompts), cut as a rate's probe is; a short slice whole."""
    n = len(trace.trace_requests())
    warmup = min(concurrency, n // 4)
    requests = min(n - warmup, max(concurrency * 2, n // 2))
    return trace.model_copy(
        update={"speedup": _ALL_AT_ONCE, "max_in_flight": concurrency, "warmup_requests": warmup, "requests": requests}
    )


# A speed-up that sends a day's slice within a millisecond: the in-flight cap alone paces the probe.
_ALL_AT_ONCE = 1e9


def _step_arrival(rate: float, process: str, requests: int, seed: int) -> Arrival:
    return Arrival(
        rate=rate,
        process="constant" if process == "constant" else "poisson",
        requests=requests,
        warmup_requests=max(1, requests // 10),
        seed=seed,
    )


def judge_step(rate: float, result: LoadResult, slos: Sequence[Slo], trace_rate: float | None = None) -> CapacityStep:
    """One step judged: met when every SLO of `slos` is and the load ran to its end; a trace's speed-up beside."""
    violations = [s.violation(result.summary) for s in slos]
    return CapacityStep(
        rate=rate,
        speedup=rate / trace_rate if trace_rate else None,
        summary=result.summary,
        meets_slos=all(v <= 0 for v in violations) and not result.stopped_early,
        violations=violations,
        diagnosis=result.diagnosis,
        slo_stop=result.slo_stop,
    )


def next_rate(rate: float, lo: float | None, hi: float | None, tolerance: float) -> float | None:
    """The next step's rate; None once the bounds are within `tolerance` of each other."""
    if lo is not None and hi is not None:
        return None if (hi - lo) <= tolerance * lo else (lo + hi) / 2
    if lo is None:
        return rate / 2  # even the first rate misses: halve until one meets
    return rate * 1.5  # the probe under-estimated: step up until one misses
