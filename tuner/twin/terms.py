"""The twin's step-time terms fit to the real trials' figures, with the catalog as the prior.

A real server differs from the catalog in several terms at once: its memory path (decode), its compute (prefill),
its per-step overhead, and everything alike. They move the figures differently: a slower prefill lengthens TTFT and
E2E far more than it lowers the throughput, which is why a single step-time scale fitted to the throughput predicts
the SLO verdict wrong. Each real trial's figures (its throughput and each SLO metric, in logs) are linear enough in
the logs of the terms near the point where the trial was first simulated: there the twin simulates it once more per
term with that term moved (`Anchor`), and the fit is a regularised least squares over every trial's figures (a
Gauss-Newton step on frozen slopes, repeated from the trials simulated again at the new terms). The prior keeps a
term the trials cannot see at the catalog's figure, so one trial moves the fit sensibly and not wildly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from tuner.twin.figures import THROUGHPUT
from tuner.twin.simulate import Coefficients

__all__ = ["FIGURE_SIGMA", "PRIOR_SIGMA", "STEP", "TERMS", "Anchor", "fit_terms", "term_logs", "with_terms"]

TERMS = ("memory_scale", "compute_scale", "overhead_scale", "step_scale")
STEP = 0.15  # the log step of a term's slope
PRIOR_SIGMA = 0.3  # the prior's spread of each term, in logs: about x0.74..x1.35 at one sigma
FIGURE_SIGMA = 0.05  # a figure's measurement spread, in logs: one trial's figures outweigh the prior on what they see
LIMIT = math.log(4.0)  # no term is fit beyond x4 or /4 of the catalog's


def term_logs(c: Coefficients) -> np.ndarray:
    return np.array([math.log(getattr(c, t)) for t in TERMS])


def with_terms(c: Coefficients, logs: np.ndarray) -> Coefficients:
    # Rounded, so a fit that barely moved reuses the simulations made under the last one.
    values = {t: round(math.exp(float(x)), 3) for t, x in zip(TERMS, logs, strict=True)}
    return replace(c, **values)


@dataclass(frozen=True)
class Anchor:
    """One real trial's figures (logs) against the twin's at `at` (the terms' logs), and their slopes per term."""

    measured: dict[str, float]
    at: np.ndarray
    predicted: dict[str, float]
    slopes: dict[str, np.ndarray]

    def figures(self) -> list[str]:
        return [f for f in self.measured if f in self.predicted and f in self.slopes]

    def moved(self, at: np.ndarray, predicted: Mapping[str, float]) -> Anchor:
        """The same trial simulated again at `at`: the slopes are kept (frozen), the point moves."""
        return replace(self, at=at, predicted={f: math.log(v) for f, v in predicted.items() if v > 0})


def slopes_of(base: Mapping[str, float], moved: Sequence[Mapping[str, float]]) -> dict[str, np.ndarray]:
    """d log(figure) / d log(term) for each figure, from the figures with each simulated term moved by STEP; the
    step-time scale moves every duration alike (latency +1, throughput -1), so its slope is known."""
    out: dict[str, np.ndarray] = {}
    for name, value in base.items():
        if value <= 0 or any(m.get(name, 0.0) <= 0 for m in moved):
            continue
        row = [(math.log(m[name]) - math.log(value)) / STEP for m in moved]
        row.append(-1.0 if name == THROUGHPUT else 1.0)
        out[name] = np.array(row)
    return out


def fit_terms(anchors: Sequence[Anchor], correlation: np.ndarray | None = None) -> np.ndarray:
    """The terms' logs that best agree with every anchor's figures under the prior (0: the catalog). With
    `correlation` (anchor by anchor, in logs squared: tuner.twin.residual) the anchors' errors in one figure are
    correlated as it says, so trials that share an error outside the terms count as less than independent evidence
    against them (a generalised least squares)."""
    rows: list[np.ndarray] = []
    targets: list[float] = []
    for f in sorted({f for a in anchors for f in a.figures()}):
        held = [i for i, a in enumerate(anchors) if f in a.figures()]
        # predicted(x) ~ predicted(at) + slope . (x - at)  ->  slope . x = measured - predicted(at) + slope . at
        slopes = np.array([anchors[i].slopes[f] for i in held])
        wanted = np.array(
            [
                anchors[i].measured[f] - anchors[i].predicted[f] + float(anchors[i].slopes[f] @ anchors[i].at)
                for i in held
            ]
        )
        if correlation is None:
            rows.extend(slopes / FIGURE_SIGMA)
            targets.extend(wanted / FIGURE_SIGMA)
            continue
        covariance = correlation[np.ix_(held, held)] + FIGURE_SIGMA**2 * np.eye(len(held))
        lower = np.linalg.cholesky(covariance)
        rows.extend(np.linalg.solve(lower, slopes))
        targets.extend(np.linalg.solve(lower, wanted))
    n = len(TERMS)
    rows.extend(np.eye(n) / PRIOR_SIGMA)
    targets.extend([0.0] * n)
    solution, *_ = np.linalg.lstsq(np.array(rows), np.array(targets), rcond=None)
    clipped: np.ndarray = np.clip(solution, -LIMIT, LIMIT)
    return clipped
