"""What the twin's terms cannot fit, learnt along the flags: a small Gaussian process over the trials' residuals.

A real trial's residual is its figures (logs: the throughput and each SLO metric) less what the fitted terms simulate
for it. Each figure's residual is a Gaussian process whose mean is 0 (the physics: the terms' simulation) and whose
covariance between two flag sets is the sum of
- a bias every flag set shares (the whole server gets a figure wrong),
- likeness: flag sets the twin simulates alike (its catalog figures within RESIDUAL_LENGTH) share their error,
- along the flags: one term per flag, so flag sets with the same value of a flag (or a near one, along an ordered
  flag) share an error: "flag sets with max_num_batched_tokens 512 are slower than simulated".

Which of two kernels holds is decided by leave-one-out error on the trials so far: `GLOBAL` (the terms take a miss
first; what they leave is shared by likeness and the bias, the twin before the residual along flags) or `ALONG` (the
flags' terms too, and the terms' fit sees the trials correlated by the kernel, so a miss the flags explain better
does not drag the global terms). Each trial is predicted from the others under both (the terms fitted to the others,
their residuals carried to it), and the kernel with the smaller error wins; below MIN_TRIALS the terms go first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
from optuna.distributions import BaseDistribution, CategoricalDistribution

from tuner.twin.terms import FIGURE_SIGMA, Anchor, fit_terms

__all__ = [
    "ALONG",
    "GLOBAL",
    "KERNELS",
    "Kernel",
    "Residual",
    "choose_kernel",
    "flag_positions",
    "flags_alike",
    "leave_one_out",
]

NOISE = FIGURE_SIGMA  # a figure's measurement spread, in logs: the process's noise, as the terms' fit reads it
FLAG_LENGTH = 0.25  # along an ordered flag, values this far apart (a fraction of its range) share 60% of an error
MIN_TRIALS = 3  # leave-one-out tells kernels apart from this many measured trials
ALONG_MARGIN = 0.8  # the flags' kernel wins only with a leave-one-out error this much below the global one's

Position = float | str  # a flag's place along its range (0..1), or its value where it has no order


@dataclass(frozen=True)
class Kernel:
    """The residual's prior: its amplitudes (logs) and whether the terms' fit sees trials correlated by it."""

    name: str
    bias: float
    like: float
    flag: float
    in_fit: bool


# GLOBAL nearly reproduces a measured flag set's figures (95% of its residual) and carries three quarters of a
# residual to every flag set as a bias, as the twin did before residuals along flags. ALONG gives each flag an error
# of its own larger than the terms' prior on one term (x0.64..x1.57 at one sigma) and almost no bias, so a miss
# that lives along a flag is that flag's, not every flag set's.
GLOBAL = Kernel("the global terms", bias=0.19, like=0.09, flag=0.0, in_fit=False)
ALONG = Kernel("along the flags", bias=0.19, like=0.09, flag=0.45, in_fit=True)
KERNELS = (GLOBAL, ALONG)

Likeness = Callable[[str, str], float]


def flag_positions(dists: Mapping[str, BaseDistribution], values: Mapping[str, Any]) -> dict[str, Position]:
    """Each varied flag's place: along its range (in logs where the range spans a factor of 4 or more) for a number
    of an ordered range, else the value itself (shares an error only with the same value)."""
    out: dict[str, Position] = {}
    for name, dist in dists.items():
        v = values.get(name)
        span = _span(dist)
        if span is None or not _number(v):
            out[name] = repr(v)
            continue
        low, high, log = span
        x = math.log(float(v)) if log and float(v) > 0 else float(v)
        out[name] = (x - low) / (high - low) if high > low else 0.0
    return out


def _number(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _span(dist: BaseDistribution) -> tuple[float, float, bool] | None:
    if isinstance(dist, CategoricalDistribution):
        numbers = [float(c) for c in dist.choices if _number(c)]
        if len(numbers) != len(dist.choices) or len(numbers) < 2:
            return None
        low, high = min(numbers), max(numbers)
    else:
        low, high = float(dist.low), float(dist.high)  # type: ignore[attr-defined]
    log = low > 0 and high / low >= 4
    return (math.log(low), math.log(high), True) if log else (low, high, False)


def _along(a: Mapping[str, Position], b: Mapping[str, Position]) -> float:
    total = 0.0
    for name, x in a.items():
        y = b.get(name)
        if isinstance(x, float) and isinstance(y, float):
            total += math.exp(-0.5 * ((x - y) / FLAG_LENGTH) ** 2)
        elif x == y:
            total += 1.0
    return total


def flags_alike(a: Mapping[str, Position], b: Mapping[str, Position], flag: str) -> float:
    """The share of an error along `flag` two flag sets have in common (1: the same value)."""
    return _along({flag: a[flag]}, {flag: b[flag]}) if flag in a and flag in b else 0.0


@dataclass(frozen=True)
class Covariance:
    """The kernel between two flag sets (by key), from their likeness and their flags' places."""

    kernel: Kernel
    likeness: Likeness
    positions: Callable[[str], Mapping[str, Position]]

    def __call__(self, a: str, b: str) -> float:
        k = self.kernel
        value = k.bias**2
        if k.like:
            value += k.like**2 * self.likeness(a, b)
        if k.flag:
            value += k.flag**2 * _along(self.positions(a), self.positions(b))
        return value

    def gram(self, keys: Sequence[str]) -> np.ndarray:
        return np.array([[self(a, b) for b in keys] for a in keys])


class Residual:
    """Each figure's residual process, conditioned on the trials' residuals (logs, per flag set and figure)."""

    def __init__(self, covariance: Covariance, residuals: Mapping[str, Mapping[str, float]]) -> None:
        self.covariance = covariance
        self.kernel = covariance.kernel
        self._fits: dict[str, tuple[list[str], np.ndarray]] = {}
        for figure in sorted({f for r in residuals.values() for f in r}):
            keys = [k for k, r in residuals.items() if figure in r]
            y = np.array([residuals[k][figure] for k in keys])
            gram = covariance.gram(keys) + NOISE**2 * np.eye(len(keys))
            self._fits[figure] = (keys, np.linalg.solve(gram, y))

    def mean(self, key: str) -> dict[str, float]:
        """The residual expected at flag set `key`, per figure (logs; 0 where no trial measured the figure)."""
        out: dict[str, float] = {}
        for figure, (keys, alpha) in self._fits.items():
            out[figure] = float(np.array([self.covariance(key, k) for k in keys]) @ alpha)
        return out

    def along(self, flag: str, key: str, figure: str) -> float:
        """The part of `figure`'s residual at `key` that its value of `flag` carries (logs)."""
        fit = self._fits.get(figure)
        if fit is None or not self.kernel.flag:
            return 0.0
        keys, alpha = fit
        at = self.covariance.positions(key)
        shares = [flags_alike(at, self.covariance.positions(k), flag) for k in keys]
        return float(self.kernel.flag**2 * np.array(shares) @ alpha)


def leave_one_out(anchors: Sequence[Anchor], gram: np.ndarray, in_fit: bool) -> tuple[float, list[dict[str, float]]]:
    """Each trial's figures (logs) predicted from the others': the terms fitted to them (correlated by `gram` when
    `in_fit`), plus their residuals carried to it; and the mean squared error of those predictions."""
    squares: list[float] = []
    predictions: list[dict[str, float]] = []
    n = len(anchors)
    for i, a in enumerate(anchors):
        rest = [j for j in range(n) if j != i]
        theta = fit_terms([anchors[j] for j in rest], gram[np.ix_(rest, rest)] if in_fit else None)
        predicted: dict[str, float] = {}
        for f in a.figures():
            physics = a.predicted[f] + float(a.slopes[f] @ (theta - a.at))
            seen = [j for j in rest if f in anchors[j].figures()]
            carried = 0.0
            if seen:
                r = np.array([_residual(anchors[j], f, theta) for j in seen])
                k = gram[np.ix_(seen, seen)] + NOISE**2 * np.eye(len(seen))
                carried = float(gram[i, seen] @ np.linalg.solve(k, r))
            predicted[f] = physics + carried
            squares.append((a.measured[f] - predicted[f]) ** 2)
        predictions.append(predicted)
    return (float(np.mean(squares)) if squares else 0.0), predictions


def _residual(a: Anchor, figure: str, theta: np.ndarray) -> float:
    return a.measured[figure] - a.predicted[figure] - float(a.slopes[figure] @ (theta - a.at))


@dataclass(frozen=True)
class Choice:
    kernel: Kernel
    errors: dict[str, float]  # kernel name -> leave-one-out RMS error (logs); empty below MIN_TRIALS
    predictions: dict[str, dict[str, float]]  # trial key -> its figures (logs) predicted from the other trials


def choose_kernel(keys: Sequence[str], anchors: Sequence[Anchor], covariance: Callable[[Kernel], Covariance]) -> Choice:
    """The kernel whose leave-one-out error on the trials is the smaller (the flags' by a margin), and each trial's
    figures as the chosen kernel predicts them from the others (what a verdict the residual explains is read from)."""
    if len(anchors) < 2:
        return Choice(GLOBAL, {}, {})
    results = {}
    for kernel in KERNELS:
        gram = covariance(kernel).gram(keys)
        results[kernel.name] = leave_one_out(anchors, gram, kernel.in_fit)
    chosen = GLOBAL
    g, a = results[GLOBAL.name][0], results[ALONG.name][0]
    if len(anchors) >= MIN_TRIALS and a < ALONG_MARGIN * g:
        chosen = ALONG
    errors = {name: math.sqrt(e) for name, (e, _) in results.items()} if len(anchors) >= MIN_TRIALS else {}
    predictions = dict(zip(keys, results[chosen.name][1], strict=True))
    return Choice(chosen, errors, predictions)
