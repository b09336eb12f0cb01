"""An SLO no flag set of the space is predicted to meet: which, the nearest flag sets, and by how much.

The twin measures the space's flag sets under the job's load in virtual time (tuner.twin.model); an SLO that every
one of them misses by more than the twin's own error (its prior spread: the catalog's step times against a
measured card's) is out of reach of the flags, whatever the search does: `e2e_p95 <= 1ms` under any load. The dry
run says so, and the study stops once the baseline and the nearest flag sets have measured it (tuner.study.unreachable).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from tuner.config import Job
from tuner.errors import ConfigError
from tuner.scoring import Slo, parse_slo
from tuner.twin.figures import chance_of_meeting, violation_of
from tuner.twin.model import PRIOR_SPREAD, SWEEP_SPREAD, Predicted, Simulate, Twin, candidates
from tuner.twin.simulate import simulate

__all__ = ["FEW", "Unreachable", "find_unreachable", "predict_unreachable", "show_value"]

FEW = 2  # the nearest flag sets measured, beside the baseline, before a study stops on an unreachable SLO
FIRST_LOOK = 4  # flag sets swept first; the rest only where none of them is likely to meet every SLO
MIN_CHANCE = 0.05  # an SLO with no flag set this likely to meet it, at the twin's prior error, is out of reach
_SPREAD = math.hypot(PRIOR_SPREAD, SWEEP_SPREAD)  # a swept prediction's error before any real trial


@dataclass(frozen=True)
class Unreachable:
    """The SLO out of reach (None: each is met by some flag set, never all together), the nearest flag sets
    (parameters and flags, nearest first) and the nearest's predicted figure of the SLO's metric."""

    slo: str | None
    metric: str | None
    threshold: float | None
    nearest: list[dict[str, Any]]  # {"params": {...}, "flags": {...}}
    figure: float | None
    candidates: int

    def line(self) -> str:
        flags = ", ".join(f"{k}={v}" for k, v in self.nearest[0]["params"].items()) if self.nearest else "-"
        if self.slo is None:
            return (
                f"no flag set is predicted to meet the SLOs together (the twin, {self.candidates} flag sets): "
                f"the nearest, {flags}, misses at least one"
            )
        return (
            f"no flag set is predicted to meet {self.slo} (the twin, {self.candidates} flag sets): the nearest, "
            f"{flags}, at {self.how_far(self.figure)}"
        )

    def how_far(self, value: float | None) -> str:
        """`605 ms against 1 ms (605x)`: a figure against the SLO's bound."""
        if value is None or self.metric is None or self.threshold is None:
            return "no figure"
        ratio = value / self.threshold if self.threshold else math.inf
        times = ratio if ratio >= 1 else (1 / ratio if ratio > 0 else math.inf)
        shown = f"{times:,.0f}x" if times >= 100 else f"{times:.2g}x"
        return f"{show_value(self.metric, value)} against {show_value(self.metric, self.threshold)} ({shown})"

    def as_attr(self) -> dict[str, Any]:
        return {
            "slo": self.slo,
            "metric": self.metric,
            "threshold": self.threshold,
            "nearest": self.nearest,
            "figure": self.figure,
            "candidates": self.candidates,
        }

    @classmethod
    def from_attr(cls, attr: dict[str, Any]) -> Unreachable:
        return cls(
            attr.get("slo"),
            attr.get("metric"),
            attr.get("threshold"),
            list(attr.get("nearest") or []),
            attr.get("figure"),
            int(attr.get("candidates") or 0),
        )


def predict_unreachable(
    job: Job, *, max_points: int = 80, seed: int | None = 0, simulate_fn: Simulate = simulate, few: int = FEW
) -> Unreachable | None:
    """The twin swept over (up to `max_points` of) the job's space, asked `find_unreachable`: first over a few
    flag sets, which answer the common case (one of them likely to meet every SLO) at a few simulations' cost."""
    space = job.search_space()
    for points in (min(FIRST_LOOK, max_points), max_points):
        twin = Twin(job, candidates(space, points, seed), simulate_fn)
        twin.sweep()
        found = find_unreachable(twin, few=few)
        if found is None or len(twin.pool) < points:
            return found  # within reach, or the whole space swept
    return found


def find_unreachable(twin: Twin, *, few: int = FEW) -> Unreachable | None:
    """The SLO the swept `twin` predicts no candidate meets (the one missed by the most, when several), with the
    `few` nearest candidates to it; where each SLO is within reach but no candidate meets them together, those
    nearest to all. None: some candidate is likely to meet them, or none is predicted to start (the pre-launch
    filter's matter, not the SLOs')."""
    ran = [p for p in (twin.predict(key) for key in twin.pool) if p.started and not p.crashed]
    if not ran:
        return None
    out_of_reach = [s for s in twin.slos if max(_chance(s, p) for p in ran) < MIN_CHANCE]
    if out_of_reach:
        slo = max(out_of_reach, key=lambda s: min(violation_of(s, p.figures) for p in ran))
        order = sorted(ran, key=lambda p: violation_of(slo, p.figures))
        return _found(twin, slo, order[:few], len(twin.pool))
    if any(p.chance >= MIN_CHANCE for p in ran):
        return None
    return _found(twin, None, sorted(ran, key=lambda p: p.violation)[:few], len(twin.pool))


def _chance(slo: Slo, p: Predicted) -> float:
    return chance_of_meeting([slo], p.figures, {slo.metric: _SPREAD})


def _found(twin: Twin, slo: Slo | None, nearest: list[Predicted], n: int) -> Unreachable:
    sets = [{"params": dict(twin.pool[p.key].params), "flags": twin.pool[p.key].flags.as_dict()} for p in nearest]
    if slo is None:
        return Unreachable(None, None, None, sets, None, n)
    figure = nearest[0].figures.get(slo.metric) if nearest else None
    return Unreachable(str(slo), slo.metric, float(slo.threshold), sets, figure, n)


def show_value(metric: str, value: float) -> str:
    """A figure as a person reads it: a latency in ms or s, a share or rate as a number."""
    try:
        latency = parse_slo(f"{metric} <= 1").is_latency
    except ConfigError:
        latency = False
    if not latency:
        return f"{value:.3g}"
    return f"{value * 1000:,.3g} ms" if value < 1 else f"{value:,.3g} s"
