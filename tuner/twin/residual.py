"""What the twin's terms cannot fit, learnt along the flags: a small Gaussian process over the trials' residuals.

A real trial's residual is its figures (logs: the throughput and each SLO metric) less what the fitted terms simulate
for it. Each figure's residual is a Gaussian process whose mean is 0 (the physics: the terms' simulation) and whose
covariance between two flag sets is the sum of
- a bias every flag set shares (the whole server gets a figure wrong),
- likeness: flag sets the twin simulates alike (its catalog figures within RESIDUAL_LENGTH) share their error,
- along the flags: one term per flag, so flag sets with the same value of a flag (or a near one, along an ordered
  flag) share an error: "flag sets with max_num_batched_tokens 512 are slower than simulated".

Which kernel holds is decided by leave-one-out error on the trials so far: `GLOBAL` (the terms take a miss first;
what they leave is shared by likeness and the bias, the twin before the residual along flags), `ALONG` (the flags'
terms too, and the terms' fit sees the trials correlated by the kernel, so a miss the flags explain better does not
drag the global terms) or a step along one flag (`along_one`: flag sets with the same value of that flag share an
error in full, its neighbours half of it along an ordered flag: a piecewise effect, a cliff at one value). Each
trial is predicted from the others under every kernel (the terms fitted to the others, their residuals carried to
it), and the kernel with the smallest error wins (one other than the global terms only by a margin); below
MIN_TRIALS the terms go first.
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
    "along_one",
    "choose_kernel",
    "flag_positions",
    "flags_alike",
    "kernels_for",
    "leave_one_out",
]

NOISE = FIGURE_SIGMA  # a figure's measurement spread, in logs: the process's noise, as the terms' fit reads it
FLAG_LENGTH = 0.25  # along an ordered flag, values this far apart (a fraction of its range) share 60% of an error
MIN_TRIALS = 3  # leave-one-out tells kernels apart from this many measured trials
ALONG_MARGIN = 0.8  # the flags' kernel wins only with a leave-one-out error this much below the global one's

Position = float | str  # a flag's place along its range (0..1), or its value where it has no order


@dataclass(frozen=True)
class Kernel:
    """The residual's prior: its amplitudes (logs), whether the terms' fit sees trials correlated by it, and (`only`)
    the one flag its term along the flags runs along, as a step (None: every flag, smoothly)."""

    name: str
    bias: float
    like: float
    flag: float
    in_fit: bool
    only: str | None = None


# GLOBAL nearly reproduces a measured flag set's figures (95% of its residual) and carries three quarters of a
# residual to every flag set as a bias, as the twin did before residuals along flags. ALONG gives each flag an error
# of its own larger than the terms' prior on one term (x0.64..x1.57 at one sigma) and almost no bias, so a miss
# that lives along a flag is that flag's, not every flag set's. A step along one flag (`along_one`) gives that flag
# all of it: the piecewise levels a real server shows along one flag (x1.15..x1.6 a piece) are within its amplitude.
GLOBAL = Kernel("the global terms", bias=0.19, like=0.09, flag=0.0, in_fit=False)
ALONG = Kernel("along the flags", bias=0.19, like=0.09, flag=0.45, in_fit=True)
KERNELS = (GLOBAL, ALONG)
STEP_AMPLITUDE = 0.7  # logs: a step along one flag of x0.5..x2 at one sigma
STEP_NEAR = 0.5  # along an ordered flag, the share of a step's error a neighbouring value has (by FLAG_LENGTH)


def along_one(flag: str) -> Kernel:
    """A step along `flag`: flag sets with its value share an error in full, near values (ordered) half of it."""
    return Kernel(f"a step along {flag}", bias=0.19, like=0.09, flag=STEP_AMPLITUDE, in_fit=True, only=flag)


def kernels_for(flags: Sequence[str]) -> tuple[Kernel, ...]:
    """The kernels leave-one-out chooses among for a space varying `flags`."""
    return (*KERNELS, *(along_one(name) for name in flags))


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


def _along(a: Mapping[str, Position], b: Mapping[str, Position], only: str | None = None) -> float:
    if only is not None:
        return _step(a.get(only), b.get(only))
    total = 0.0
    for name, x in a.items():
        y = b.get(name)
        if isinstance(x, float) and isinstance(y, float):
            total += math.exp(-0.5 * ((x - y) / FLAG_LENGTH) ** 2)
        elif x == y:
            total += 1.0
    return total


def _step(x: Position | None, y: Position | None) -> float:
    """The share of a step's error two values of one flag have: 1 the same value, a part of it near (ordered)."""
    if x is None or y is None:
        return 0.0
    if x == y:
        return 1.0
    if isinstance(x, float) and isinstance(y, float):
        return STEP_NEAR * math.exp(-0.5 * ((x - y) / FLAG_LENGTH) ** 2)
    return 0.0


def flags_alike(a: Mapping[str, Position], b: Mapping[str, Position], flag: str, step: bool = False) -> float:
    """The share of an error along `flag` two flag sets have in common (1: the same value); `step`: as a step."""
    if flag not in a or flag not in b:
        return 0.0
    return _step(a[flag], b[flag]) if step else _along({flag: a[flag]}, {flag: b[flag]})


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
            value += k.flag**2 * _along(self.positions(a), self.positions(b), k.only)
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
        only = self.kernel.only
        if fit is None or not self.kernel.flag or only not in (None, flag):
            return 0.0
        keys, alpha = fit
        at = self.covariance.positions(key)
        shares = [flags_alike(at, self.covariance.positions(k), flag, only is not None) for k in keys]
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


def choose_kernel(
    keys: Sequence[str],
    anchors: Sequence[Anchor],
    covariance: Callable[[Kernel], Covariance],
    kernels: Sequence[Kernel] = KERNELS,
) -> Choice:
    """The kernel whose leave-one-out error on the trials is the smallest (one other than the global terms' by a
    margin), and each trial's figures as the chosen kernel predicts them from the others (what a verdict the
    residual explains is read from)."""
    if len(anchors) < 2:
        return Choice(GLOBAL, {}, {})
    results: dict[str, tuple[Kernel, float, list[dict[str, float]]]] = {}
    for kernel in kernels:
        gram = covariance(kernel).gram(keys)
        results[kernel.name] = (kernel, *leave_one_out(anchors, gram, kernel.in_fit))
    chosen = GLOBAL
    g = results[GLOBAL.name][1]
    if len(anchors) >= MIN_TRIALS:
        kernel, error, _ = min((r for r in results.values() if r[0] is not GLOBAL), key=lambda r: r[1])
        if error < ALONG_MARGIN * g:
            chosen = kernel
    errors = {name: math.sqrt(e) for name, (_, e, _) in results.items()} if len(anchors) >= MIN_TRIALS else {}
    predictions = dict(zip(keys, results[chosen.name][2], strict=True))
    return Choice(chosen, errors, predictions)
