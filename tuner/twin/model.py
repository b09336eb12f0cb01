"""The twin: every candidate flag set measured in the emulator's engine, refit to the real trials, ranked.

Before the first launch `sweep()` simulates every candidate (the space's grid, or a seeded sample of it) with the
catalog's figures. After each real trial `refit()` moves the hidden figures to agree with every real trial so far:
the KV tokens each server logged against plan_startup's (`kv_scale`), the throughput against the twin's
(`step_scale`, a geometric mean: one scale moves every duration alike, so latencies scale with it), and a runtime
OOM the twin did not predict (`headroom_gib`). A candidate is then predicted from its sweep scaled by the fit, and the
leaders are simulated again under the fit itself (`exact`), so the next real trial goes where the refit twin puts
the best.
"""

from __future__ import annotations

import functools
import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from tuner.capacity import runtime_need_bytes
from tuner.config import Job
from tuner.flags import VllmFlags, resolve
from tuner.scoring import LoadSummary, Slo
from tuner.space import SearchSpace
from tuner.store import flag_key
from tuner.twin.simulate import GIB, Coefficients, SimPoint, simulate

__all__ = ["Candidate", "Observation", "Predicted", "Twin", "candidates"]

Simulate = Callable[[Job, VllmFlags, Coefficients], SimPoint]

VALUES_PER_RANGE = 9  # a continuous (or long) range is measured at this many evenly spaced values
RERANK = 6  # leaders simulated again under the fit before one is proposed


@dataclass(frozen=True)
class Candidate:
    key: str
    params: dict[str, Any]  # the trial parameters that give these flags
    flags: VllmFlags


@dataclass(frozen=True)
class Observation:
    """One real trial, as the twin learns from it."""

    key: str
    flags: VllmFlags
    started: bool
    crashed: bool
    output_tok_s: float | None  # over the whole load (None: not measured, or the load stopped at a certain SLO miss)
    kv_tokens: int | None


@dataclass(frozen=True)
class Predicted:
    key: str
    started: bool
    crashed: bool
    output_tok_s: float
    violation: float  # the largest SLO violation (<= 0: every SLO met)
    exact: bool  # simulated under the current fit (else the sweep, scaled)

    @property
    def feasible(self) -> bool:
        return self.started and not self.crashed and self.violation <= 0


@functools.lru_cache(maxsize=64)
def _scaled(slos: tuple[Slo, ...], scale: float) -> tuple[Slo, ...]:
    """SLOs that judge an unscaled summary as the original ones judge it with every duration times `scale`:
    a latency's bound divided by it, a rate's multiplied (the relative violation comes out the same)."""
    out = []
    for slo in slos:
        if slo.is_latency:
            out.append(slo.model_copy(update={"threshold": slo.threshold / scale}))
        elif slo.metric == "success_rate":
            out.append(slo)
        else:
            out.append(slo.model_copy(update={"threshold": slo.threshold * scale}))
    return tuple(out)


def _scaled_slos(job: Job, scale: float) -> tuple[Slo, ...]:
    return _scaled(tuple(job.parsed_slos()), scale)


def _values(dist: BaseDistribution) -> list[Any]:
    if isinstance(dist, CategoricalDistribution):
        return list(dist.choices)
    if isinstance(dist, IntDistribution):
        if not dist.log:
            all_values = list(range(dist.low, dist.high + 1, dist.step))
            if len(all_values) <= 2 * VALUES_PER_RANGE:
                return all_values
            picks = [all_values[round(i * (len(all_values) - 1) / (VALUES_PER_RANGE - 1))] for i in range(9)]
            return sorted(set(picks))
        return sorted({round(dist.low * (dist.high / dist.low) ** (i / 8)) for i in range(VALUES_PER_RANGE)})
    assert isinstance(dist, FloatDistribution)
    if dist.step is not None:
        n = round((dist.high - dist.low) / dist.step)
        if n + 1 <= 2 * VALUES_PER_RANGE:
            return [round(dist.low + i * dist.step, 10) for i in range(n + 1)]
        return sorted({round(dist.low + round(i * n / 8) * dist.step, 10) for i in range(VALUES_PER_RANGE)})
    if dist.log:
        return [dist.low * (dist.high / dist.low) ** (i / 8) for i in range(VALUES_PER_RANGE)]
    return [dist.low + (dist.high - dist.low) * i / 8 for i in range(VALUES_PER_RANGE)]


def candidates(space: SearchSpace, max_points: int, seed: int | None) -> list[Candidate]:
    """The flag sets the twin measures: the space's grid, or `max_points` of it drawn with `seed`; one per flag set."""
    names = list(space.distributions)
    axes = [_values(space.distributions[n]) for n in names]
    total = math.prod(len(a) for a in axes)
    rng = random.Random(seed)
    if total <= max_points:
        indices: Iterable[int] = range(total)
    else:
        indices = sorted(rng.sample(range(total), max_points))
    out: dict[str, Candidate] = {}
    for index in indices:
        params: dict[str, Any] = {}
        for name, axis in zip(reversed(names), reversed(axes), strict=True):
            index, i = divmod(index, len(axis))
            params[name] = axis[i]
        params = {n: params[n] for n in names}
        flags = space.repair(params).flags
        key = flag_key(flags.as_dict())
        out.setdefault(key, Candidate(key, params, flags))
    return list(out.values())


class Twin:
    """Predictions for every candidate under coefficients fit to the real trials."""

    def __init__(self, job: Job, pool: list[Candidate], simulate_fn: Simulate = simulate) -> None:
        self.job = job
        self.pool = {c.key: c for c in pool}
        self.known = {c.key: c.flags for c in pool}  # and every flag set a real trial ran
        self.simulate = simulate_fn
        self.coefficients = Coefficients()
        self.swept: dict[str, SimPoint] = {}
        self._memo: dict[tuple[str, Coefficients], SimPoint] = {}
        self._summaries: dict[int, tuple[SimPoint, LoadSummary | None]] = {}  # by id(point), the point kept
        self.exact: dict[str, SimPoint] = {}  # under `coefficients`

    def sweep(self) -> None:
        for key, c in self.pool.items():
            if key not in self.swept:
                self.swept[key] = self.simulate(self.job, c.flags, Coefficients())
        self.exact = dict(self.swept)

    def point(self, key: str) -> SimPoint:
        if key not in self.swept:
            self.swept[key] = self.simulate(self.job, self.known[key], Coefficients())
        return self.swept[key]

    def predict(self, key: str) -> Predicted:
        # The step-time scale moves every duration alike: applied to the summary, never simulated again.
        scale = self.coefficients.step_scale
        exact = self.exact.get(key)
        if exact is not None:
            return self._judge(key, exact, scale, True)
        return self._judge(key, self.point(key), scale, False)

    def _judge(self, key: str, p: SimPoint, scale: float, exact: bool) -> Predicted:
        c = self.coefficients
        started = p.started
        if started and not exact and p.kv_tokens is not None:
            max_len = resolve(self._flags(key), self.job.gpu_profile(), self.job.model_profile()).max_model_len
            started = p.kv_tokens * c.kv_scale >= max_len
        summary = self._summary(p) if started else None
        crashed = p.crashed or (started and not exact and self._would_crash(key, p))
        if summary is None or crashed:
            return Predicted(key, started, crashed, 0.0, math.inf, exact)
        violation = max((slo.violation(summary) for slo in _scaled_slos(self.job, scale)), default=0.0)
        return Predicted(key, True, False, float(summary.output_throughput) / scale, violation, exact)

    def _summary(self, p: SimPoint) -> LoadSummary | None:
        held = self._summaries.get(id(p))
        if held is None:
            held = self._summaries[id(p)] = (p, p.summary(self.job))
        return held[1]

    def _flags(self, key: str) -> VllmFlags:
        return self.known[key]

    def _would_crash(self, key: str, p: SimPoint) -> bool:
        """Under a headroom moved by a real crash: does this candidate's fullest batch still fit?"""
        shift = self.coefficients.headroom_gib
        if shift >= 0:
            return False
        r = resolve(self._flags(key), self.job.gpu_profile(), self.job.model_profile())
        need = runtime_need_bytes(self.job.model_profile(), r, p.peak_running)
        return need > p.headroom_bytes + shift * GIB

    # -- calibration -----------------------------------------------------------------------------------------

    def refit(self, observations: list[Observation]) -> Coefficients:
        """Coefficients that agree with every observation so far; the exact predictions are redone under them."""
        for o in observations:
            self.known.setdefault(o.key, o.flags)
        ratios = [
            o.kv_tokens / raw
            for o in observations
            if o.kv_tokens and (raw := self.point(o.key).raw_kv_tokens) and raw > 0
        ]
        # Rounded, so a fit that barely moved reuses the simulations made under the last one
        kv_scale = round(statistics.median(ratios), 3) if ratios else 1.0
        headroom = round(self._headroom(observations) / 0.05) * 0.05
        base = Coefficients(kv_scale=kv_scale, headroom_gib=headroom)
        logs = []
        for o in observations:
            if o.started and not o.crashed and o.output_tok_s:
                twin = self._simulate(o.key, Coefficients(kv_scale=kv_scale)).summary(self.job)
                if twin is not None and twin.output_throughput > 0:
                    logs.append(math.log(twin.output_throughput / o.output_tok_s))
        step = math.exp(statistics.fmean(logs)) if logs else 1.0
        new = replace(base, step_scale=step)
        if base != replace(self.coefficients, step_scale=1.0):
            self.exact = {}
        self.coefficients = new
        return new

    def _headroom(self, observations: list[Observation]) -> float:
        """The runtime headroom's shift (GiB) between what the real crashes and survivals bound it to.

        A candidate crashes when its fullest batch's transient need exceeds its headroom plus the shift: a real
        crash bounds the shift from above, a real load that held its fullest batch bounds it from below; the
        shift is the middle of the two (0 while no real server crashed)."""
        upper: float | None = None
        lower = -math.inf
        for o in observations:
            p = self.point(o.key)
            if not (o.started and p.started and p.peak_running):
                continue
            r = resolve(self._flags(o.key), self.job.gpu_profile(), self.job.model_profile())
            margin = (p.headroom_bytes - runtime_need_bytes(self.job.model_profile(), r, p.peak_running)) / GIB
            if o.crashed:
                upper = -margin if upper is None else min(upper, -margin)
            else:
                lower = max(lower, -margin)
        if upper is None:
            return 0.0
        if lower >= upper:
            return upper - 0.01
        return (max(lower, upper - 1.0) + upper) / 2

    def rerank(self, keys: Iterable[str]) -> None:
        """Simulate `keys` again under the current fit (their predictions become exact)."""
        for key in keys:
            if key not in self.exact:
                self.exact[key] = self._simulate(key, replace(self.coefficients, step_scale=1.0))

    def _simulate(self, key: str, coefficients: Coefficients) -> SimPoint:
        if coefficients == Coefficients():
            return self.point(key)
        memo = (key, coefficients)
        if memo not in self._memo:
            self._memo[memo] = self.simulate(self.job, self._flags(key), coefficients)
        return self._memo[memo]
