"""The twin: every candidate flag set measured in the emulator's engine, refit to the real trials, ranked.

Before the first launch `sweep()` simulates every candidate (the space's grid, or a seeded sample of it) with the
catalog's figures. After each real trial `refit()` moves the hidden figures to agree with every real trial so far:
the KV tokens each server logged against plan_startup's (`kv_scale`), a runtime OOM the twin did not predict
(`headroom_gib`), and the step-time terms (memory, compute, per-step overhead, the whole step: tuner.twin.terms)
against each trial's throughput and SLO metrics, with the catalog as the prior. A candidate is then predicted from
its sweep moved by what the fit did to the trials' figures, and the leaders are simulated again under the fit itself
(`exact`). Every prediction carries the spread the refit's residuals show per figure, so its SLO verdict is a
chance (tuner.twin.figures), and the next real trial goes where the refit twin expects the most feasible throughput.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution, FloatDistribution, IntDistribution

from tuner.box import replicas
from tuner.capacity import runtime_need_bytes
from tuner.config import Job
from tuner.flags import VllmFlags, resolve
from tuner.scoring import LoadSummary
from tuner.space import SearchSpace
from tuner.store import flag_key
from tuner.twin.crashes import crash_risk, halo
from tuner.twin.figures import chance_of_meeting, figures_of, violation_of
from tuner.twin.residual import (
    GLOBAL,
    Choice,
    Covariance,
    Kernel,
    Position,
    Residual,
    choose_kernel,
    flag_positions,
    kernels_for,
)
from tuner.twin.simulate import GIB, Coefficients, SimPoint, simulate
from tuner.twin.terms import STEP, TERMS, Anchor, fit_terms, slopes_of, term_logs, with_terms

__all__ = ["Candidate", "Observation", "Predicted", "Twin", "candidates", "distance"]

Simulate = Callable[[Job, VllmFlags, Coefficients], SimPoint]

VALUES_PER_RANGE = 9  # a continuous (or long) range is measured at this many evenly spaced values
RERANK = 6  # leaders simulated again under the fit before one is proposed
# The spread of a figure (in logs) before any real trial: the catalog's step times are within about 10% of a
# measured card's (benchmarks/README.md); it counts as PRIOR_WEIGHT trials' worth of residuals.
PRIOR_SPREAD = 0.08
PRIOR_WEIGHT = 1.0
SPREAD_FLOOR = 0.03  # a real server's figures move a few percent between starts: no fit is surer than that
SWEEP_SPREAD = 0.05  # added (in quadrature) where a prediction is the sweep moved, not simulated under the fit
UNCERTAIN_BELOW = 0.84  # a chance of one sigma: a margin smaller than the spread
# What the terms cannot fit (an effect outside the twin's model family) is left in each trial's residuals; they carry
# to flag sets the twin simulates alike (figures within about this much, in logs: its own simulation is the measure
# of likeness, so 64 and 128 sequences under 64 users are neighbours and 32 is not), against a prior of no
# correction (tuner.twin.residual).
RESIDUAL_LENGTH = 0.08
# Two flag sets the twin simulates with the same batch and steps (every figure within this, in logs: well inside a
# start's noise on a GPU, a few percent) are one answer: once one is measured the other teaches nothing.
SAME_WITHIN = 0.01
# How far the runtime headroom may move to explain a real crash (GiB): what vLLM's memory profile plausibly misses
# (CUDA graphs, allocator fragmentation, a sampler's buffers: a GiB or two). A crash that needs more is no memory
# arithmetic error but a region of the space (tuner.twin.crashes); moving the headroom that far would predict a crash
# for most of the space, which the first survivor then contradicts.
HEADROOM_SHIFT_LIMIT_GIB = 2.0
# The KV tokens real starts logged against the arithmetic's, by flag set: a ratio that differs between them by more
# than this (a start's own KV figure is steady to a percent) is a KV capacity that depends on the flags (memory
# outside the KV cache that grows with one of them), taken from the nearest measured flag sets, not their median.
KV_APART = 0.03
KV_NEAR = 0.35  # how far along a flag's range a measured start's KV ratio carries (tuner.twin.crashes.halo)
KV_PRIOR = 0.05  # the weight of the median of every start's ratio, where no measured start is near


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
    # The throughput and each SLO metric measured over the whole load (tuner.twin.figures), for the terms' fit
    figures: dict[str, float] = field(default_factory=dict)
    # What the twin predicted of them before the trial ran: its honest error, where the refit's residuals flatter it
    predicted: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Predicted:
    key: str
    started: bool
    crashed: bool
    output_tok_s: float
    violation: float  # the largest SLO violation (<= 0: every SLO met)
    exact: bool  # simulated under the current fit (else the sweep, moved by the fit)
    figures: dict[str, float] = field(default_factory=dict)  # the throughput and each SLO metric
    chance: float = 0.0  # of meeting every SLO, under the twin's spread per figure
    replicas: int = 1  # of this shape on the job's box (tuner.box): the figures above are one replica's
    spread: dict[str, float] = field(default_factory=dict)  # each figure's spread (logs) the chance was taken under
    # of dying under load near a crash the twin did not foresee (tuner.twin.crashes): `chance` is already shrunk by it
    crash_risk: float = 0.0

    @property
    def box_tok_s(self) -> float:
        """The box's throughput, what the study maximises: every replica does what the one simulated does."""
        return self.output_tok_s * self.replicas

    @property
    def feasible(self) -> bool:
        return self.started and not self.crashed and self.violation <= 0

    @property
    def uncertain(self) -> bool:
        """Predicted to meet the SLOs by less than the twin's spread (within one sigma of an edge)."""
        return self.feasible and self.chance < UNCERTAIN_BELOW

    @property
    def expected_tok_s(self) -> float:
        """The box throughput a trial of it is expected to add as feasible: the box's figure times its chance (the
        replicas of a shape share the SLO verdict: each is the replica simulated)."""
        return self.box_tok_s * self.chance if self.started and not self.crashed else 0.0


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
        self.slos = tuple(job.parsed_slos())
        self.pool = {c.key: c for c in pool}
        self.known = {c.key: c.flags for c in pool}  # and every flag set a real trial ran
        self.simulate = simulate_fn
        self.coefficients = Coefficients()
        self.swept: dict[str, SimPoint] = {}
        self._memo: dict[tuple[str, Coefficients], SimPoint] = {}
        self._summaries: dict[int, tuple[SimPoint, LoadSummary | None]] = {}  # by id(point), the point kept
        self.exact: dict[str, SimPoint] = {}  # under `coefficients`
        self.anchors: dict[str, Anchor] = {}  # per real trial's flag set with figures: the terms' fit
        self.spread: dict[str, float] = {}  # per figure, in logs (PRIOR_SPREAD until a trial measured it)
        self.moved: dict[str, float] = {}  # per figure: what the fit does to the trials' figures (the sweep's factor)
        self.residuals: dict[str, dict[str, float]] = {}  # per real trial's flag set: log(measured / fit) per figure
        self._corrections: dict[str, dict[str, float]] = {}
        self._feature_memo: dict[str, dict[str, float]] = {}
        self._position_memo: dict[str, dict[str, Position]] = {}
        self._dists: dict[str, BaseDistribution] | None = None
        # the residual's kernel chosen by leave-one-out error, and each trial's figures predicted from the others
        self.choice = Choice(GLOBAL, {}, {})
        self.residual: Residual | None = None
        # what the trials say of the twin's likeness (`_vouch`): trials whose verdict it got wrong, trials that
        # measured other than one it simulates alike, and the flags alike trials showed inert
        self.wrong: set[str] = set()
        self.disproved: set[str] = set()
        self.inert: set[str] = set()
        self.met_any = False  # a real trial met the SLOs
        # each real start's KV tokens against the arithmetic's, while they differ by flag set (else empty: the median)
        self.kv_ratios: dict[str, float] = {}
        # real starts that died under load where the twin foresaw none, and starts that held their load
        self.crashed_at: list[str] = []
        self.held_at: list[str] = []

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
        exact = self.exact.get(key)
        if exact is not None:
            return self._judge(key, exact, True)
        return self._judge(key, self.point(key), False)

    def _judge(self, key: str, p: SimPoint, exact: bool) -> Predicted:
        c = self.coefficients
        started = p.started
        if started and not exact and p.kv_tokens is not None:
            max_len = resolve(self._flags(key), self.job.gpu_profile(), self.job.model_profile()).max_model_len
            started = p.kv_tokens * self.kv_at(key, c.kv_scale) >= max_len
        summary = self._summary(p) if started else None
        crashed = p.crashed or (started and not exact and self._would_crash(key, p))
        if summary is None or crashed:
            return Predicted(key, started, crashed, 0.0, math.inf, exact)
        if exact:  # simulated under the fit's terms: only the whole-step scale is left to apply
            figures = figures_of(summary, self.slos, c.step_scale)
        else:
            figures = {k: v * self.moved.get(k, 1.0) for k, v in figures_of(summary, self.slos).items()}
        correction = self._correction(key)
        figures = {k: v * correction.get(k, 1.0) for k, v in figures.items()}
        nearness = self._nearness(key)
        spread = {k: _near(self._spread(k, exact), nearness) for k in figures}
        violation = max((violation_of(slo, figures) for slo in self.slos), default=0.0)
        risk = self.crash_risk(key)
        chance = chance_of_meeting(self.slos, figures, spread) * (1.0 - risk)
        n = replicas(self.job.box_gpus(), self._flags(key).world_size)
        return Predicted(
            key, True, False, figures["output_tok_s"], violation, exact, figures, chance, n, spread, crash_risk=risk
        )

    def _correction(self, key: str) -> dict[str, float]:
        """Factors per figure: the residual process's mean at this flag set (tuner.twin.residual). At a measured
        flag set the twin then agrees with what was measured; where flag sets share an error (a bias, a likeness,
        a flag's value) it carries there, shrunk by the prior."""
        held = self._corrections.get(key)
        if held is not None:
            return held
        mean = self.residual.mean(key) if self.residual is not None else {}
        held = {f: math.exp(r) for f, r in mean.items()}
        self._corrections[key] = held
        return held

    def known_answer(self, key: str, measured: Iterable[str]) -> str | None:
        """The measured flag set (of `measured`) this one's simulation cannot tell apart from (`alike`), where the
        twin's likeness is to be trusted; None when it would teach something. Where the twin got a trial's verdict
        wrong its simulation missed something, perhaps in a flag it treats as inert: a flag set alike to it is a known
        answer only where they differ in flags two alike flag sets already showed inert (measured the same). So too
        while no trial has met the SLOs: the simulation's word that every flag set misses alike is the one thing the
        budget can still test, and a flag it holds inert is where the answer would hide."""
        alike = [
            other for other in measured if other != key and self.alike(key, other) and not self._parted(key, other)
        ]
        if not alike or any(other in self.disproved for other in alike):
            return None
        unvouched = not self.met_any or any(other in self.wrong for other in alike)
        if unvouched and not all(self._differing(key, other) <= self.inert for other in alike):
            return None
        return alike[0]

    def _parted(self, a: str, b: str) -> bool:
        """The residual along the flags tells them apart beyond a start's noise: a flag the simulation holds inert
        (the same batch, the same steps) that the trials showed to matter, such as a step learnt along it, parts
        two flag sets the physics cannot."""
        if self.residual is None or not self.residual.kernel.flag:
            return False
        figures = {f for r in self.residuals.values() for f in r}
        return any(
            abs(self.residual.along(flag, a, figure) - self.residual.along(flag, b, figure)) > SPREAD_FLOOR
            for flag in self._differing(a, b)
            for figure in figures
        )

    def _differing(self, a: str, b: str) -> set[str]:
        va, vb = self.flag_values(a), self.flag_values(b)
        return {name for name in va if va[name] != vb.get(name)}

    def alike(self, a: str, b: str) -> bool:
        """Both start and hold the load, admit the same batch at their fullest, and every figure the twin simulates
        for one is within SAME_WITHIN of the other's."""
        pa, pb = self.point(a), self.point(b)
        if not (pa.started and pb.started) or pa.crashed or pb.crashed or pa.peak_running != pb.peak_running:
            return False
        fa, fb = self._features(a), self._features(b)
        return fa.keys() == fb.keys() and all(abs(fa[f] - fb[f]) <= SAME_WITHIN for f in fa)

    def _vouch(self, observations: list[Observation]) -> None:
        """What the trials say of the twin's likeness: the flag sets whose verdict it predicted wrong before they ran
        (`wrong`), those that measured other than a flag set it simulates alike (`disproved`: beyond SPREAD_FLOOR in
        a figure), and the flags two alike flag sets differing in them showed inert (measured the same)."""
        loads = [o for o in observations if o.started and not o.crashed and o.figures]
        self.wrong = {o.key for o in loads if o.predicted and self._meets(o.predicted) != self._meets(o.figures)}
        self.met_any = any(self._meets(o.figures) for o in loads)
        self.disproved, self.inert = set(), set()
        for i, a in enumerate(loads):
            for b in loads[i + 1 :]:
                if a.key == b.key or not self.alike(a.key, b.key):
                    continue
                common = [f for f in a.figures if b.figures.get(f, 0.0) > 0 and a.figures[f] > 0]
                if all(abs(math.log(a.figures[f] / b.figures[f])) <= SPREAD_FLOOR for f in common):
                    self.inert |= self._differing(a.key, b.key)
                else:
                    self.disproved.update((a.key, b.key))

    def _meets(self, figures: dict[str, float]) -> bool:
        return all(violation_of(slo, figures) <= 0 for slo in self.slos)

    def positions(self, key: str) -> dict[str, Position]:
        """Each varied flag's place along its range (tuner.twin.residual), for the residual along the flags."""
        held = self._position_memo.get(key)
        if held is None:
            held = self._position_memo[key] = flag_positions(self._distributions(), self._flags(key).as_dict())
        return held

    def flag_values(self, key: str) -> dict[str, Any]:
        """The varied flags' values of flag set `key`."""
        values = self._flags(key).as_dict()
        return {name: values.get(name) for name in self._distributions()}

    def _distributions(self) -> dict[str, BaseDistribution]:
        if self._dists is None:
            self._dists = dict(self.job.search_space().distributions)
        return self._dists

    def covariance(self, kernel: Kernel) -> Covariance:
        return Covariance(kernel, self._likeness, self.positions)

    def explained(self, key: str) -> dict[str, float] | None:
        """A measured trial's figures as the twin predicts them from the other trials (terms and residual), or None
        (too few trials, or not measured): a miss it still predicts wrong there is one its residual cannot explain."""
        logs = self.choice.predictions.get(key)
        return None if logs is None else {f: math.exp(v) for f, v in logs.items()}

    def crash_risk(self, key: str) -> float:
        """The chance a start of `key` dies under load, learnt from the real crashes the twin did not foresee
        (tuner.twin.crashes); 0 before one."""
        if not self.crashed_at:
            return 0.0
        crashed = [self.positions(k) for k in self.crashed_at]
        return crash_risk(self.positions(key), crashed, [self.positions(k) for k in self.held_at])

    def _nearness(self, key: str) -> float:
        """1 at a flag set a real trial measured (or one the twin simulates alike), fading to 0 away from them."""
        return max((self._likeness(key, other) for other in self.residuals), default=0.0)

    def _likeness(self, a: str, b: str) -> float:
        """1 for two flag sets the twin simulates alike (its catalog figures), fading as they differ."""
        fa, fb = self._features(a), self._features(b)
        common = [f for f in fa if f in fb]
        if not common:
            return 0.0
        d = math.sqrt(sum((fa[f] - fb[f]) ** 2 for f in common) / len(common))
        return math.exp(-0.5 * (d / RESIDUAL_LENGTH) ** 2)

    def _features(self, key: str) -> dict[str, float]:
        held = self._feature_memo.get(key)
        if held is None:
            held = {f: math.log(v) for f, v in self._catalog_figures(key).items() if v > 0 and f != "success_rate"}
            self._feature_memo[key] = held
        return held

    def _spread(self, figure: str, exact: bool) -> float:
        s = self.spread.get(figure, PRIOR_SPREAD)
        return s if exact else math.hypot(s, SWEEP_SPREAD)

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
        self._vouch(observations)
        self.crashed_at = self._unexplained_crashes(observations)
        self.held_at = [o.key for o in observations if o.started and not o.crashed]
        ratios = {
            o.key: o.kv_tokens / raw
            for o in observations
            if o.kv_tokens and (raw := self.point(o.key).raw_kv_tokens) and raw > 0
        }
        # Rounded, so a fit that barely moved reuses the simulations made under the last one
        kv_scale = round(statistics.median(ratios.values()), 3) if ratios else 1.0
        apart = bool(ratios) and math.log(max(ratios.values()) / min(ratios.values())) > KV_APART
        kept = ratios if apart else {}
        kv_moved = kept != self.kv_ratios
        self.kv_ratios = kept
        explained = [o for o in observations if o.key not in self.crashed_at]
        headroom = round(self._headroom(explained) / 0.05) * 0.05
        base = replace(self.coefficients, kv_scale=kv_scale, headroom_gib=headroom)
        measured = [o for o in observations if o.started and not o.crashed and o.figures]
        for o in measured:
            if o.key not in self.anchors:
                self.anchors[o.key] = self._anchor(o, base)
        new = self._fit_terms(base, [o.key for o in measured if o.key in self.anchors])
        self.spread = _spreads(measured, self.residuals)
        if kv_moved or replace(new, step_scale=1.0) != replace(self.coefficients, step_scale=1.0):
            self.exact = {}
        self.coefficients = new
        return new

    def kv_at(self, key: str, median: float) -> float:
        """The KV ratio (real tokens to the arithmetic's) at flag set `key`: `median` (every start's) while the
        starts agree, else the measured starts' ratios weighed by how near their flags are, the median the prior."""
        if not self.kv_ratios:
            return median
        at = self.positions(key)
        weights = [(halo(at, self.positions(k), KV_NEAR, KV_NEAR), r) for k, r in self.kv_ratios.items()]
        total = KV_PRIOR + sum(w for w, _ in weights)
        log_ratio = (KV_PRIOR * math.log(median) + sum(w * math.log(r) for w, r in weights)) / total
        return round(math.exp(log_ratio), 3)

    def _figures_at(self, key: str, c: Coefficients) -> dict[str, float]:
        """The figures of flag set `key` simulated under `c` (its step scale applied to the summary)."""
        summary = self._simulate(key, replace(c, step_scale=1.0)).summary(self.job)
        return {} if summary is None else figures_of(summary, self.slos, c.step_scale)

    def _anchor(self, o: Observation, c: Coefficients) -> Anchor:
        base = self._figures_at(o.key, c)
        moved = [self._figures_at(o.key, replace(c, **{t: getattr(c, t) * math.exp(STEP)})) for t in TERMS[:-1]]
        measured = {k: math.log(v) for k, v in o.figures.items() if v > 0}
        predicted = {k: math.log(v) for k, v in base.items() if v > 0}
        return Anchor(measured, term_logs(c), predicted, slopes_of(base, moved))

    def _fit_terms(self, base: Coefficients, keys: list[str]) -> Coefficients:
        """A Gauss-Newton step from the current terms, each trial simulated again there; then the spread per
        figure from the residuals at the result, and what the result does to each trial's figures."""
        if not keys:
            return base
        at = term_logs(base)
        keys = list(dict.fromkeys(keys))
        anchors = [self.anchors[k].moved(at, self._figures_at(k, base)) for k in keys]
        self.choice = choose_kernel(keys, anchors, self.covariance, kernels_for(list(self._distributions())))
        kernel = self.choice.kernel
        gram = self.covariance(kernel).gram(keys) if kernel.in_fit else None
        fitted = with_terms(base, fit_terms(anchors, gram))
        residuals: dict[str, list[float]] = {}
        moved: dict[str, list[float]] = {}
        self.residuals, self._corrections = {}, {}
        for k in keys:
            now, catalog = self._figures_at(k, fitted), self._catalog_figures(k)
            for name, value in now.items():
                got = self.anchors[k].measured.get(name)
                if got is not None and value > 0:
                    residuals.setdefault(name, []).append(got - math.log(value))
                    self.residuals.setdefault(k, {})[name] = got - math.log(value)
                if value > 0 and catalog.get(name, 0.0) > 0:
                    moved.setdefault(name, []).append(math.log(value / catalog[name]))
        self.moved = {name: math.exp(float(np.mean(m))) for name, m in moved.items()}
        self.residual = Residual(self.covariance(kernel), self.residuals)
        return fitted

    def _catalog_figures(self, key: str) -> dict[str, float]:
        summary = self._summary(self.point(key))
        return {} if summary is None else figures_of(summary, self.slos)

    def _headroom(self, observations: list[Observation]) -> float:
        """The runtime headroom's shift (GiB) between what the real crashes and survivals bound it to.

        A candidate crashes when its fullest batch's transient need exceeds its headroom plus the shift: a real
        crash bounds the shift from above, a real load that held its fullest batch bounds it from below; the
        shift is the middle of the two (0 while no real server crashed)."""
        upper: float | None = None
        lower = -math.inf
        for o in observations:
            margin = self._margin(o)
            if margin is None:
                continue
            if o.crashed:
                upper = -margin if upper is None else min(upper, -margin)
            else:
                lower = max(lower, -margin)
        if upper is None:
            return 0.0
        if lower >= upper:
            return upper - 0.01
        return (max(lower, upper - 1.0) + upper) / 2

    def _margin(self, o: Observation) -> float | None:
        """The memory (GiB) the twin leaves a started flag set beyond its fullest batch's transient need; None where
        it has no fullest batch to judge."""
        p = self.point(o.key)
        if not (o.started and p.started and p.peak_running):
            return None
        r = resolve(self._flags(o.key), self.job.gpu_profile(), self.job.model_profile())
        return (p.headroom_bytes - runtime_need_bytes(self.job.model_profile(), r, p.peak_running)) / GIB

    def _unexplained_crashes(self, observations: list[Observation]) -> list[str]:
        """The real crashes the twin's memory arithmetic cannot explain: its simulation foresaw no crash and either
        it has no fullest batch to judge, or a start with no more memory to spare held its load, or it left more
        memory spare than the headroom plausibly moves (a crash region, not the runtime headroom the refit moves:
        tuner.twin.crashes)."""
        spare = [m for o in observations if o.started and not o.crashed and (m := self._margin(o)) is not None]
        out = []
        for o in observations:
            if not o.crashed or self.point(o.key).crashed:
                continue
            margin = self._margin(o)
            if margin is None or margin > HEADROOM_SHIFT_LIMIT_GIB or any(m <= margin for m in spare):
                out.append(o.key)
        return out

    def rerank(self, keys: Iterable[str]) -> None:
        """Simulate `keys` again under the current fit (their predictions become exact)."""
        for key in keys:
            if key not in self.exact:
                self.exact[key] = self._simulate(key, replace(self.coefficients, step_scale=1.0))

    def _simulate(self, key: str, coefficients: Coefficients) -> SimPoint:
        if self.kv_ratios:
            coefficients = replace(coefficients, kv_scale=self.kv_at(key, coefficients.kv_scale))
        if coefficients == Coefficients():
            return self.point(key)
        memo = (key, coefficients)
        if memo not in self._memo:
            self._memo[memo] = self.simulate(self.job, self._flags(key), coefficients)
        return self._memo[memo]


def distance(dists: dict[str, BaseDistribution], a: dict[str, Any], b: dict[str, Any]) -> float:
    """The normalised distance (0..1) between two parameter sets of a space (a log range in logs; choices of
    numbers by their place in the ordered list, other choices 0 or 1)."""
    parts = []
    for name, dist in dists.items():
        x, y = a.get(name), b.get(name)
        if isinstance(dist, CategoricalDistribution):
            parts.append(_choice_distance(dist, x, y))
            continue
        if x is None or y is None:
            parts.append(0.0 if x == y else 1.0)
            continue
        low, high = float(dist.low), float(dist.high)  # type: ignore[attr-defined]
        if getattr(dist, "log", False) and low > 0:
            low, high, x, y = math.log(low), math.log(high), math.log(max(x, 1e-12)), math.log(max(y, 1e-12))
        parts.append(min(1.0, abs(float(x) - float(y)) / (high - low)) if high > low else 0.0)
    return math.sqrt(sum(p * p for p in parts) / max(len(parts), 1))


def _choice_distance(dist: CategoricalDistribution, x: Any, y: Any) -> float:
    if x == y:
        return 0.0
    numbers = [c for c in dist.choices if isinstance(c, int | float) and not isinstance(c, bool)]
    if len(numbers) != len(dist.choices) or x not in numbers or y not in numbers or len(numbers) < 2:
        return 1.0
    ordered = sorted(numbers)
    return abs(ordered.index(x) - ordered.index(y)) / (len(ordered) - 1)


def _near(spread: float, nearness: float) -> float:
    """The spread where a real trial measured what the twin simulates alike: its figures are known there, to the
    floor (a start's own noise); away from every trial, the twin's spread."""
    return math.sqrt(nearness * SPREAD_FLOOR**2 + (1.0 - nearness) * spread**2)


def _spreads(measured: list[Observation], residuals: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each figure's spread in logs: from the twin's errors before each trial ran (out of sample, as every proposal
    is), or the refit's residual where a trial has no prediction recorded."""
    errors: dict[str, list[float]] = {}
    for o in measured:
        for name, value in o.figures.items():
            before = o.predicted.get(name)
            if before is not None and before > 0 and value > 0:
                errors.setdefault(name, []).append(math.log(value / before))
            elif name in residuals.get(o.key, {}):
                errors.setdefault(name, []).append(residuals[o.key][name])
    return {name: _spread(e) for name, e in errors.items()}


def _spread(residuals: list[float]) -> float:
    """A figure's spread in logs: the errors' with the prior's weight, never below the floor."""
    total = PRIOR_WEIGHT * PRIOR_SPREAD**2 + sum(r * r for r in residuals)
    return max(math.sqrt(total / (PRIOR_WEIGHT + len(residuals))), SPREAD_FLOOR)
