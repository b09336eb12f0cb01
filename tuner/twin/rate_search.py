"""The capacity search of a `max_rate` or `goodput` job on a trace, in virtual time: the study's probe and steps
(tuner.load.capacity_search), each a replay of the trace's slice sped up to the rate it tries, simulated.

What the twin predicts for such a job is what the study scores: the step at the highest rate that met the judge
(every SLO for max_rate, the good share for goodput), or where none met, the step that came closest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from tuner.config import Job
from tuner.load import CapacityStep
from tuner.load.capacity_search import RateBracket, next_rate, trace_probe
from tuner.scoring import LoadSummary, closest

__all__ = ["PROBE_CONCURRENCY", "RateSearch", "searches_trace_rate", "trace_rate_search"]

PROBE_CONCURRENCY = 32  # the study's probe (find_max_rate's default)
TOLERANCE = 0.1  # and its bisection's

P = TypeVar("P")


def searches_trace_rate(job: Job) -> bool:
    """Whether the job's trials search a rate by playing its trace faster or slower."""
    return job.objective in ("max_rate", "goodput") and job.arrival.trace is not None


@dataclass
class RateSearch(Generic[P]):
    """The point the search ends on (the best step's, the closest step's, or the run that did not get that far:
    a refused start, a crash), the rate found (None: none met) and every step."""

    point: P
    rate: float | None = None
    steps: list[CapacityStep] = field(default_factory=list)


def trace_rate_search(
    job: Job, run: Callable[[Job], P], summary: Callable[[Job, P], LoadSummary | None]
) -> RateSearch[P]:
    """The search on `run(job at a rate)`; `summary(job, point)` is None for a run that did not measure."""
    a = job.arrival
    own = a.trace_rate()
    assert own is not None, "checked with the job: a slice of requests at two times at least"
    judged = [job.goodput_slo()] if job.objective == "goodput" else job.parsed_slos()
    if a.speedup != 1:
        rate: float | None = a.speedup * own  # the job's own speed-up is where the search starts
    else:
        probe_job = job.model_copy(update={"arrival": trace_probe(a, PROBE_CONCURRENCY)})
        probe = run(probe_job)
        probed = summary(probe_job, probe)
        if probed is None or probed.request_throughput <= 0:
            return RateSearch(probe)
        rate = probed.request_throughput
    bracket: RateBracket[P] = RateBracket()
    points: list[P] = []
    while rate is not None and len(bracket.steps) < job.capacity_search.max_steps:
        step_job = job.model_copy(update={"arrival": a.at_rate(rate, a.seed + len(bracket.steps) + 1)})
        point = run(step_job)
        s = summary(step_job, point)
        if s is None:
            return RateSearch(point, None, bracket.steps)  # a crash under this load ends the trial as it would
        violations = [slo.violation(s) for slo in judged]
        met = all(v <= 0 for v in violations)
        bracket.record(
            CapacityStep(rate=rate, speedup=rate / own, summary=s, meets_slos=met, violations=violations), point
        )
        points.append(point)
        rate = next_rate(rate, bracket.lo, bracket.hi, TOLERANCE)
    if bracket.best is not None:
        return RateSearch(bracket.best, bracket.lo, bracket.steps)
    return RateSearch(points[closest([s.violations for s in bracket.steps])], None, bracket.steps)
