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
so that a 5 ms TPOT weighs as much as a 5 s duration; where each request's figures were kept (a study's records),
every request is a row, relative to its load's mean. numpy's lstsq does the solving; with five coefficients the
non-negative solution is found exactly by trying each subset of them (31 solves), which saves a scipy dependency
for one function.

The schedule itself depends on the coefficients (which step an arrival joins), so the fit replays the loads under
its own result and fits again, keeping whichever coefficients reproduce their own replay best. A probe's points
(one at concurrency 1, where the engine idles and every latency shows) settle in a few exact rounds; a study's
trials, whose engines are mostly busy, start with smoothed rounds (replay's `smooth`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

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
from tuner.step_profile import StepCoefficients

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
    """A load's means as the load client measured them (seconds), and when its records were kept each measured
    request's TTFT and TPOT (0 for one token) in the load's order: the fit then weighs every request, which tells
    the coefficients apart far better than three means can (a study's trials all ran one workload)."""

    ttft_mean_s: float
    tpot_mean_s: float
    duration_s: float
    output_tokens: int
    each_ttft_s: tuple[float, ...] = ()
    each_tpot_s: tuple[float, ...] = ()

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
    relative_rms_error: float  # of every load's mean TTFT, mean TPOT and duration, replayed under the coefficients
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


def _rows(feats: Features, m: Measured) -> Iterator[tuple[np.ndarray, float, float, float]]:
    """(features, measured value, the value its error is relative to, weight) of each figure of one load: its
    duration, and its TTFT and TPOT, each request's when they were kept (together weighing as much as one mean),
    else the means.

    A request's error is relative to its load's mean, not to its own value: on a real server a request joins a
    step or two off the replay's (the schedule is not the replay's to the step), and a request that happened to
    join at once, its TTFT one step, would read that as an error of several times its own value and pull the
    whole fit toward that one request."""
    yield feats.duration, m.duration_s, m.duration_s, 1.0
    if m.each_ttft_s and feats.each_ttft is not None and feats.each_tpot is not None:
        w = 1.0 / np.sqrt(len(m.each_ttft_s))
        for vecs, values, mean in (
            (feats.each_ttft, m.each_ttft_s, m.ttft_mean_s),
            (feats.each_tpot, m.each_tpot_s, m.tpot_mean_s),
        ):
            yield from ((vec, value, mean, w) for vec, value in zip(vecs, values, strict=True) if value > 0)
    else:
        yield feats.ttft, m.ttft_mean_s, m.ttft_mean_s, 1.0
        yield feats.tpot, m.tpot_mean_s, m.tpot_mean_s, 1.0


@dataclass(frozen=True)
class _System:
    """The fit's rows, each relative to its measured value and weighted. A figure's plain seconds (an open loop's
    send times) are known: they move to the right-hand side."""

    a: np.ndarray
    b: np.ndarray
    weight: float  # the rows' squared weights, summed: the error is an rms over them

    @classmethod
    def of(cls, features: Sequence[Features], measured: Sequence[Measured]) -> _System:
        a_rows: list[np.ndarray] = []
        b_rows: list[float] = []
        weight = 0.0
        for feats, m in zip(features, measured, strict=True):
            for vec, value, scale, w in _rows(feats, m):
                if scale > 0 and np.any(vec[:COEFFICIENTS]):
                    a_rows.append(w * vec[:COEFFICIENTS] / scale)
                    b_rows.append(w * (value - vec[COEFFICIENTS]) / scale)
                    weight += w * w
        if len(a_rows) < COEFFICIENTS:
            raise ConfigError(
                f"{len(a_rows)} measured figures cannot fix {COEFFICIENTS} coefficients: probe more points"
            )
        return cls(np.vstack(a_rows), np.array(b_rows), weight)

    def error(self, c: StepCoefficients) -> float:
        """The weighted rms relative error of the rows under `c` (the rows counted under `c` itself: the fit's
        real error, not the one under another schedule)."""
        residual = self.a @ np.array(c.as_vector()) - self.b
        return float(np.sqrt(np.sum(residual**2) / self.weight))

    def solve(self) -> StepCoefficients:
        """Non-negative least squares of the step coefficients."""
        # columns of very different size (1 a step against thousands of context tokens) condition lstsq badly
        scale = np.maximum(np.abs(self.a).max(axis=0), 1e-300)
        rank = int(np.linalg.matrix_rank(self.a / scale))
        if rank < COEFFICIENTS:
            # loads whose steps are all alike (one batch size, one prompt length) fit any split of their cost
            raise ConfigError(
                f"the measured loads tell only {rank} of the {COEFFICIENTS} coefficients apart (their steps are too "
                "alike): measure loads that differ in concurrency, prompt length or max_num_seqs"
            )
        x = _nnls(self.a / scale, self.b) / scale
        return StepCoefficients.from_vector([float(v) for v in x])


def _means(x: Measured | Prediction) -> tuple[float, float, float]:
    return (x.ttft_mean_s, x.tpot_mean_s, x.duration_s)


def error_figures(measured: Sequence[Measured]) -> int:
    """How many measured means the fit's reported error is over: a zero mean (no TPOT where every reply came in one
    piece or had one token) has nothing to be relative to, and is left out."""
    return sum(m > 0 for meas in measured for m in _means(meas))


def _mean_error(predictions: Sequence[Prediction], measured: Sequence[Measured]) -> float:
    rel = [
        p / m - 1.0
        for pred, meas in zip(predictions, measured, strict=True)
        for p, m in zip(_means(pred), _means(meas), strict=True)
        if m > 0
    ]
    return float(np.sqrt(np.mean(np.square(rel)))) if rel else 0.0


# Where the fit starts: of the order of a small GPU model's step; the schedule it implies is refined from there.
_FIRST_GUESS = StepCoefficients(
    step_overhead_s=1e-3, prefill_token_s=1e-5, decode_seq_s=1e-4, context_token_s=1e-8, request_latency_s=1e-3
)
_MAX_ROUNDS = 8


class _Fitter:
    """The loads, replayed under one guess after another; the best guess so far by its own replay's error."""

    def __init__(
        self, measured: Sequence[tuple[EngineShape, Load, Measured]], on_round: Callable[[int, float], None] | None
    ) -> None:
        if not measured:
            raise ConfigError("no load was measured: nothing to fit")
        self.measured = measured
        self.on_round = on_round
        self.figures = [m for *_, m in measured]
        self.best: tuple[float, StepCoefficients, list[Features]] | None = None
        self.rounds = 0

    def evaluate(self, c: StepCoefficients, *, smooth: bool) -> tuple[_System, float]:
        self.rounds += 1
        features = [replay(shape, load, c, smooth=smooth) for shape, load, _ in self.measured]
        system = _System.of(features, self.figures)
        error = system.error(c)
        if self.best is None or error < self.best[0]:
            self.best = (error, c, features)
        if self.on_round is not None:
            self.on_round(self.rounds, self.best[0])
        return system, error

    def smoothed(self, guess: StepCoefficients, rounds: int) -> StepCoefficients:
        """Half-steps toward each smoothed fit (a full step overshoots: the latency and the per-sequence cost
        trade places from one round to the next); the best guess seen."""
        for _ in range(rounds):
            system, _ = self.evaluate(guess, smooth=True)
            guess = _towards(guess, system.solve(), 0.5)
        self.evaluate(guess, smooth=True)
        assert self.best is not None
        return self.best[1]

    def exact(self, guess: StepCoefficients) -> None:
        """Steps toward each exact fit while they lower the error (a full one, else a half or a quarter): in the
        schedule's own piece the fit is exact in one step, and a step into a worse schedule is not taken."""
        system, error = self.evaluate(guess, smooth=False)
        for _ in range(_MAX_ROUNDS):
            target = system.solve()
            for t in (1.0, 0.5, 0.25):
                c = _towards(guess, target, t)
                trial, trial_error = self.evaluate(c, smooth=False)
                if trial_error < error:
                    guess, system, error = c, trial, trial_error
                    break
            else:
                return

    def result(self) -> FitResult:
        assert self.best is not None
        _, c, features = self.best
        predictions = [predict(f, c) for f in features]  # a replay's values are the same, smoothed or not
        return FitResult(c, _mean_error(predictions, self.figures), predictions)


def _towards(a: StepCoefficients, b: StepCoefficients, t: float) -> StepCoefficients:
    return StepCoefficients.from_vector([x + t * (y - x) for x, y in zip(a.as_vector(), b.as_vector(), strict=True)])


def fit_loads(
    measured: Sequence[tuple[EngineShape, Load, Measured]],
    guess: StepCoefficients = _FIRST_GUESS,
    *,
    smooth_rounds: int = 0,
    on_round: Callable[[int, float], None] | None = None,
) -> tuple[FitResult, int]:
    """Fit, replay every load under the fit, fit again, while the error of the fit's own replay falls; the
    coefficients that replay best, and the replays it took. The first `smooth_rounds` count each request's wait
    for the engine as its latency (replay's `smooth`): far from the answer, that finds it where the exact
    schedule hides it (a busy engine); the exact rounds then settle it. `on_round(replays, best error)` after
    each replay (a large study takes minutes)."""
    fitter = _Fitter(measured, on_round)
    if smooth_rounds:
        guess = fitter.smoothed(guess, smooth_rounds)
    fitter.exact(guess)
    return fitter.result(), fitter.rounds


def fit_coefficients(
    shape: EngineShape, measured: list[tuple[LoadPoint, Measured]], guess: StepCoefficients = _FIRST_GUESS
) -> tuple[FitResult, int]:
    """`fit_loads` over a probe's load points, all on one server."""
    return fit_loads([(shape, p.load(), m) for p, m in measured], guess)
