"""Where an exploring trial goes: the flag set with the best chance of beating the leader, never one that cannot.

The leader is the best trial measured to meet the SLOs; its lower bound, its figure less a start's noise. A candidate
beats it when it meets the SLOs (its chance, the verdict's uncertainty) and its value is above that bound: the twin's
prediction is log-normal around its figure with the larger of the figure's spread and the twin's measured error. A
candidate whose prediction stays under the bound even if the twin were wrong by its measured error cannot change the
answer and is never explored, however unsure the twin is of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from tuner.twin.figures import THROUGHPUT
from tuner.twin.model import SPREAD_FLOOR, Predicted

__all__ = ["beat_chance", "expected_gain", "explore", "leader_bound"]

MIN_BEAT = 0.02  # below this chance of beating the leader a trial is not worth exploring


def leader_bound(leader: float) -> float:
    """The leader's lower bound: its measured figure less a start's noise."""
    return leader * math.exp(-SPREAD_FLOOR)


def beat_chance(p: Predicted, value: float, bound: float, error: float) -> float:
    """The chance that a trial of `p` (its value `value` to the study) meets the SLOs and beats `bound`; 0 when even
    a twin wrong by `error` (relative, its measured error) would put it under the bound."""
    if not p.started or p.crashed or value <= 0 or bound <= 0:
        return 0.0
    if value * (1.0 + error) < bound:
        return 0.0
    sigma = max(p.spread.get(THROUGHPUT, 0.0), math.log1p(error), SPREAD_FLOOR)
    above = 0.5 * (1.0 + math.erf(math.log(value / bound) / (sigma * math.sqrt(2.0))))
    return p.chance * above


def explore(
    predictions: Sequence[Predicted], value: Callable[[Predicted], float], leader: float | None, error: float
) -> tuple[Predicted, float] | None:
    """The prediction with the highest chance of beating the leader's lower bound (within a percent: the higher
    value), and that chance; None where none can beat it. Without a leader (no trial met the SLOs yet) any flag set
    that meets them beats it: the likeliest to."""
    bound = leader_bound(leader) if leader else 0.0
    best: tuple[float, float, Predicted, float] | None = None
    for p in predictions:
        v = value(p)
        chance = beat_chance(p, v, bound, error) if bound > 0 else (p.chance if v > 0 else 0.0)
        key = (round(chance, 2), v)
        if chance >= MIN_BEAT and (best is None or key > best[:2]):
            best = (key[0], key[1], p, chance)
    return None if best is None else (best[2], best[3])


def expected_gain(p: Predicted, value: float, leader: float) -> float:
    """What a trial of `p` (its value `value` to the study) is expected to add over the leader's measured value:
    its chance of meeting the SLOs times the expected excess of its value over the leader's, the value log-normal
    around the prediction with its figure's spread. A flag set predicted at the leader's level adds little however
    likely it meets the SLOs: the study has that figure already."""
    if not p.started or p.crashed or value <= 0 or leader <= 0:
        return 0.0
    s = max(p.spread.get(THROUGHPUT, 0.0), SPREAD_FLOOR)
    d = math.log(value / leader) / s
    excess = value * math.exp(s * s / 2) * _normal(d + s) - leader * _normal(d)
    return p.chance * max(excess, 0.0)


def _normal(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))
