"""The feasible Pareto front (most throughput, least P95 latency), one point picked from it, and the winner's
ratios against the baseline (vLLM's defaults)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from tuner.errors import ConfigError, TunerError
from tuner.intervals import NOT_SEPARABLE
from tuner.report.views import StudyView, TrialView

__all__ = ["BEST_CHOICES", "NoFeasibleTrial", "Ratios", "choose", "pareto_front", "ratios", "separability_line"]

BEST_CHOICES = ("throughput", "latency", "balanced")


class NoFeasibleTrial(TunerError):
    """No measured trial met the SLOs: nothing to pick or export."""


@dataclass(frozen=True)
class Ratios:
    throughput: float | None  # winner / baseline: > 1 is better
    latency_p95: float | None  # winner / baseline: < 1 is better


def pareto_front(trials: Sequence[TrialView]) -> list[TrialView]:
    """Feasible, measured trials no other feasible one dominates; most throughput first. A duplicate (the same
    flags, its values copied from the trial that ran them) is not a point of its own."""
    pool = [t for t in trials if t.feasible and t.measured and t.duplicate_of is None]
    front = [t for t in pool if not any(_dominates(o, t) for o in pool)]
    return sorted(front, key=lambda t: (-_t(t), _l(t), t.number))


def _t(t: TrialView) -> float:
    assert t.throughput is not None
    return t.throughput


def _l(t: TrialView) -> float:
    assert t.objective_latency_s is not None
    return t.objective_latency_s


def _dominates(a: TrialView, b: TrialView) -> bool:
    return _t(a) >= _t(b) and _l(a) <= _l(b) and (_t(a) > _t(b) or _l(a) < _l(b))


def choose(front: Sequence[TrialView], how: str, *, study: str = "") -> TrialView:
    """`throughput`: the most; `latency`: the lowest P95; `balanced`: the front point nearest the ideal corner
    once both axes are scaled to the front's own range (the knee)."""
    if how not in BEST_CHOICES:
        raise ConfigError(f"unknown choice {how!r} for --best; allowed: {', '.join(BEST_CHOICES)}")
    if not front:
        where = f" in study {study!r}" if study else ""
        raise NoFeasibleTrial(f"no feasible trial{where}: none was measured within the SLOs (see `tuner trials`)")
    if how == "throughput":
        return min(front, key=lambda t: (-_t(t), _l(t), t.number))
    if how == "latency":
        return min(front, key=lambda t: (_l(t), -_t(t), t.number))
    t_lo, t_hi = min(map(_t, front)), max(map(_t, front))
    l_lo, l_hi = min(map(_l, front)), max(map(_l, front))

    def distance(t: TrialView) -> float:
        dt_ = (t_hi - _t(t)) / (t_hi - t_lo) if t_hi > t_lo else 0.0
        dl = (_l(t) - l_lo) / (l_hi - l_lo) if l_hi > l_lo else 0.0
        return math.hypot(dt_, dl)

    return min(front, key=lambda t: (distance(t), -_t(t), t.number))


def ratios(winner: TrialView, baseline: TrialView | None) -> Ratios:
    if baseline is None or not baseline.measured:
        return Ratios(None, None)
    bt, bl = baseline.throughput, baseline.objective_latency_s
    assert bt is not None and bl is not None
    return Ratios(
        throughput=_t(winner) / bt if bt > 0 else None,
        latency_p95=_l(winner) / bl if bl > 0 else None,
    )


def separability_line(view: StudyView, front: Sequence[TrialView]) -> str | None:
    """Under the front: which of its points the study's confirmation could not tell from its leader, and whether
    the leader was told from the baseline (the study's `confirm` attribute; None: a study that kept none, or
    nothing to say). A front's order is its point figures' and says nothing of their noise: this line does."""
    summary = view.record.confirm or {}
    leader = summary.get("leader")
    listed = summary.get("not_separable")
    on_front = {t.number for t in front}
    if not isinstance(leader, int) or not isinstance(listed, list):
        return None
    close = [n for n in listed if isinstance(n, int) and n in on_front and n != leader]
    parts = []
    if close:
        parts.append(f"#{leader} and {', '.join(f'#{n}' for n in close)} are {NOT_SEPARABLE}: either will do")
    if summary.get("beats_baseline") is False:
        parts.append(f"#{leader} and the baseline are {NOT_SEPARABLE}: the gain is within the noise")
    return "; ".join(parts) or None
