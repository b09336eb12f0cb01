"""Fit a device profile's step-time coefficients to loads measured on a real server: a probe's load points, or
the trials a study measured.

Replayed through the emulator's own engine in virtual time (tuner.calibration.replay), each figure a client
measures is a sum of step features, linear in the coefficients (`StepCoefficients`):

    mean TTFT  = mean over requests of the steps from its arrival to its first token
    mean TPOT  = mean over requests of (the steps after its first token to its last) / (tokens - 1)
    duration   = the steps from the first measured request's arrival to the last one's end (throughput's inverse)

(the engine's own step order: with asynchronous scheduling, a GPU server's default, each step is scheduled before
the previous one's results, Engine.begin_step; a profile's step period stays linear either way). The coefficients
are then ordinary non-negative least squares over every (load, figure) row, each row divided by its measured value
so that a 5 ms TPOT weighs as much as a 5 s duration. numpy's lstsq does the solving; with five coefficients the
non-negative solution is found exactly by trying each subset of them (31 solves), which saves a scipy dependency
for one function.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tuner.calibration.profile import StepCoefficients
from tuner.calibration.replay import (
    COEFFICIENTS,
    EngineShape,
    Features,
    Load,
    Request,
    replay,
    with_seconds,
)
from tuner.errors import ConfigError

__all__ = [
    "EngineShape",
    "FitResult",
    "LoadPoint",
    "Measured",
    "fit_coefficients",
    "fit_loads",
    "predict",
    "step_features",
]


@dataclass(frozen=True)
class LoadPoint:
    """A closed loop of `concurrency` clients, each request `input_len` tokens in and exactly `output_len` out;
    `warmup` requests first (left out of the figures), then `requests` measured ones."""

    concurrency: int
    input_len: int
    output_len: int
    requests: int
    warmup: int = 0

    def load(self) -> Load:
        one = Request(self.input_len, self.output_len)
        warm = Request(self.input_len, self.output_len, warmup=True)
        return Load((warm,) * self.warmup + (one,) * self.requests, self.concurrency)


@dataclass(frozen=True)
class Measured:
    """A load point's means as the load client measured them (seconds)."""

    ttft_mean_s: float
    tpot_mean_s: float
    duration_s: float
    output_tokens: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class Prediction:
    ttft_mean_s: float
    tpot_mean_s: float
    duration_s: float
    output_tokens: int
    preemptions: int

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else 0.0


def step_features(shape: EngineShape, point: LoadPoint, guess: StepCoefficients) -> Features:
    """A probe's load point replayed (tuner.calibration.replay), each figure a vector of multipliers."""
    return replay(shape, point.load(), guess)


def predict(features: Features, c: StepCoefficients) -> Prediction:
    v = with_seconds(c)
    return Prediction(
        ttft_mean_s=float(features.ttft @ v),
        tpot_mean_s=float(features.tpot @ v),
        duration_s=float(features.duration @ v),
        output_tokens=features.output_tokens,
        preemptions=features.preemptions,
    )


@dataclass(frozen=True)
class FitResult:
    coefficients: StepCoefficients
    relative_rms_error: float  # over every row
    predictions: list[Prediction]


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin |a x - b| over x >= 0: the best unconstrained solution on each subset of the columns that stays
    non-negative (the optimum is one of them: its zero coefficients are the active constraints)."""
    n = a.shape[1]
    best: tuple[float, np.ndarray] | None = None
    for k in range(n, 0, -1):
        for cols in itertools.combinations(range(n), k):
            sub = a[:, cols]
            x_sub, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(x_sub < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = x_sub
            r = float(np.sum((a @ x - b) ** 2))
            if best is None or r < best[0] - 1e-15:
                best = (r, x)
    return best[1] if best is not None else np.zeros(n)


def _solve(rows: Sequence[tuple[Features, Measured]]) -> FitResult:
    """Non-negative least squares of the step coefficients over each load's mean TTFT, mean TPOT and duration,
    every row relative to its measured value. A figure's plain seconds (an open loop's send times) are known: they
    move to the right-hand side."""
    if not rows:
        raise ConfigError("no load was measured: nothing to fit")
    a_rows: list[np.ndarray] = []
    b_rows: list[float] = []
    for feats, m in rows:
        for vec, value in ((feats.ttft, m.ttft_mean_s), (feats.tpot, m.tpot_mean_s), (feats.duration, m.duration_s)):
            if value > 0 and np.any(vec[:COEFFICIENTS]):
                a_rows.append(vec[:COEFFICIENTS] / value)
                b_rows.append(1.0 - vec[COEFFICIENTS] / value)
    if len(a_rows) < COEFFICIENTS:
        raise ConfigError(f"{len(a_rows)} measured figures cannot fix {COEFFICIENTS} coefficients: probe more points")
    a, b = np.vstack(a_rows), np.array(b_rows)
    # columns of very different size (1 a step against thousands of context tokens) condition lstsq badly
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    x = _nnls(a / scale, b) / scale
    c = StepCoefficients.from_vector([float(v) for v in x])
    residual = a @ x - b
    return FitResult(
        coefficients=c,
        relative_rms_error=float(np.sqrt(np.mean(residual**2))),
        predictions=[predict(feats, c) for feats, _ in rows],
    )


# Where the fit starts: of the order of a small GPU model's step; the schedule it implies is refined from there.
_FIRST_GUESS = StepCoefficients(
    step_overhead_s=1e-3, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=1e-8, request_latency_s=1e-3
)
_MAX_ROUNDS = 8


def fit_loads(
    measured: Sequence[tuple[EngineShape, Load, Measured]], guess: StepCoefficients = _FIRST_GUESS
) -> tuple[FitResult, int]:
    """Fit, replay every load under the fitted coefficients, fit again, until the coefficients stop moving (0.1%);
    the fit and the rounds it took. A closed loop without request latency needs one round."""
    fit: FitResult | None = None
    for rounds in range(1, _MAX_ROUNDS + 1):
        rows = [(replay(shape, load, guess), m) for shape, load, m in measured]
        fit = _solve(rows)
        old, new = np.array(guess.as_vector()), np.array(fit.coefficients.as_vector())
        guess = fit.coefficients
        if np.all(np.abs(new - old) <= 1e-3 * np.maximum(np.abs(new), 1e-12)):
            return fit, rounds
    assert fit is not None
    return fit, _MAX_ROUNDS


def fit_coefficients(
    shape: EngineShape, measured: list[tuple[LoadPoint, Measured]], guess: StepCoefficients = _FIRST_GUESS
) -> tuple[FitResult, int]:
    """`fit_loads` over a probe's load points, all on one server."""
    return fit_loads([(shape, p.load(), m) for p, m in measured], guess)
