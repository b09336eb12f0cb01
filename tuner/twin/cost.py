"""The twin for the cost objective (tuner.cost): a flag set simulated as the study measures it, one replica at its
capacity within the SLOs, and ranked by what serving the job's load with such replicas costs.

`capacity_simulate` wraps the twin's simulation in the capacity search's steps (a saturating probe, then open-loop
rates bracketed and bisected, `tuner.load.capacity_search`'s rule) and returns the step at the highest rate that met
every SLO, or the one nearest to meeting them: its throughput is what a cost trial records (`output_tok_s` at its
`request_rate`), so the twin's refit compares like with like. `CostScore` turns a prediction into the study's value,
million output tokens per $ (per GPU-hour without a price), weighted by the chance of meeting the SLOs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from tuner.config import Job
from tuner.cost import cost_figures, tokens_per_request
from tuner.flags import VllmFlags
from tuner.load import Arrival
from tuner.twin.model import Predicted, Simulate, Twin
from tuner.twin.simulate import Coefficients, SimPoint

__all__ = ["CapacitySimulate", "CostScore", "capacity_simulate"]

_PROBE_USERS = 32  # the capacity search's saturating closed loop
_TOLERANCE = 0.1  # its bisection's stop: bounds within 10% of each other


class CapacitySimulate:
    """A `Simulate` of one replica at its capacity within the job's SLOs, as the cost objective's trial measures it;
    `rate_of(point)` is the rate of the step it returns (the trial's `request_rate`)."""

    def __init__(self, simulate_fn: Simulate) -> None:
        self.simulate_fn = simulate_fn

    def __call__(self, job: Job, flags: VllmFlags, coefficients: Coefficients = Coefficients()) -> SimPoint:
        # One server of the shape, whatever the node (`target.gpus`) holds: the search loads a lone replica.
        one = job.model_copy(update={"target": job.target.model_copy(update={"gpus": flags.world_size})})
        per_step = job.capacity_search.requests_per_step
        probe = _at(one, Arrival(concurrency=_PROBE_USERS, requests=max(2 * _PROBE_USERS, per_step // 2)))
        point = self.simulate_fn(probe, flags, coefficients)
        summary = point.summary(probe)
        if summary is None or summary.request_throughput <= 0:
            return point
        rate, best = _search(one, flags, coefficients, self.simulate_fn, summary.request_throughput)
        return replace(best, rate=rate)  # the point's `rate`, as a trace's search keeps it (tuner.twin.simulate)

    @staticmethod
    def rate_of(point: SimPoint) -> float | None:
        """The rate the point was simulated at, where it met the SLOs (None: it met them at no rate)."""
        return point.rate


def capacity_simulate(simulate_fn: Simulate) -> CapacitySimulate:
    return CapacitySimulate(simulate_fn)


def _at(job: Job, arrival: Arrival) -> Job:
    return job.model_copy(update={"arrival": arrival})


def _search(
    job: Job, flags: VllmFlags, c: Coefficients, simulate_fn: Simulate, estimate: float
) -> tuple[float | None, SimPoint]:
    """The capacity search's steps in virtual time: the best step that met the SLOs and its rate, else the nearest
    miss (no rate)."""
    slos = job.parsed_slos()
    per_step = job.capacity_search.requests_per_step
    lo: float | None = None
    hi: float | None = None
    best: SimPoint | None = None
    nearest: tuple[float, SimPoint] | None = None
    rate: float | None = estimate
    for step in range(job.capacity_search.max_steps):
        if rate is None:
            break
        arrival = Arrival(rate=rate, requests=per_step, warmup_requests=max(1, per_step // 10), seed=step)
        point = simulate_fn(_at(job, arrival), flags, c)
        summary = point.summary(job)
        worst = max((s.violation(summary) for s in slos), default=0.0) if summary is not None else float("inf")
        if summary is not None and worst <= 0:
            lo, best = (rate, point) if lo is None or rate > lo else (lo, best)
        else:
            hi = rate if hi is None or rate < hi else hi
            if nearest is None or worst < nearest[0]:
                nearest = (worst, point)
        rate = _next_rate(rate, lo, hi)
    if best is not None:
        return lo, best
    assert nearest is not None
    return None, nearest[1]


def _next_rate(rate: float, lo: float | None, hi: float | None) -> float | None:
    if lo is not None and hi is not None:
        return None if (hi - lo) <= _TOLERANCE * lo else (lo + hi) / 2
    return rate / 2 if lo is None else rate * 1.5


@dataclass
class CostScore:
    """A prediction as the cost objective scores it; `twin` gives the twin whose points hold the rates."""

    job: Job
    twin: Callable[[], Twin | None]
    simulated: CapacitySimulate

    def optimistic(self, p: Predicted) -> float:
        """Million output tokens per $ (or GPU-hour) if the prediction holds; 0 for a start or load that fails."""
        twin = self.twin()
        load = self.job.cost_load()
        if twin is None or load is None or not p.started or p.crashed or p.output_tok_s <= 0:
            return 0.0
        point = twin.exact.get(p.key) or twin.point(p.key)
        rate = self.simulated.rate_of(point)
        summary = point.summary(twin.job)
        if rate is None or summary is None or summary.output_throughput <= 0:
            return 0.0
        # The fit moves the throughput, and the capacity with it; a request's tokens stay the workload's.
        moved = p.output_tok_s / summary.output_throughput
        cost = cost_figures(
            rate * moved,
            tokens_per_request(summary),
            world_size=twin.known[p.key].world_size,
            load=load,
            in_flight=summary.concurrency,
            gpu_hour_usd=self.job.gpu_hour_usd(),
        )
        return cost.value if cost is not None else 0.0

    def expected(self, p: Predicted) -> float:
        """What a trial of it is expected to add as feasible: its value times its chance of meeting the SLOs."""
        return self.optimistic(p) * p.chance
