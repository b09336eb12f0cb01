"""Fit a device profile's step-time coefficients to load points measured on a real server.

The engine's scheduler decides which steps a closed loop runs (how many prompt tokens, decodes and context tokens
each has) from token counts alone: with every finished request replaced at once, no step's duration changes what
the next step holds. So each figure a probe measures is a sum of step durations, and each step's duration is
linear in the coefficients (`StepCoefficients`):

    mean TTFT  = mean over requests of the steps from its arrival to its first token
    mean TPOT  = mean over requests of (the steps after its first token to its last) / (tokens - 1)
    duration   = the steps from the first measured request's arrival to the last one's end (throughput's inverse)

Running the emulator's own engine in virtual time over the probe's load gives those sums of step features (the
engine's own step order: with asynchronous scheduling, a GPU server's default, each step is scheduled before the
previous one's results, Engine.begin_step; a profile's step period stays linear either way); the
coefficients are then ordinary non-negative least squares over every (point, figure) row, each row divided by its
measured value so that a 5 ms TPOT weighs as much as a 5 s duration. numpy's lstsq does the solving; with four
coefficients the non-negative solution is found exactly by trying each subset of them (16 solves), which saves a
scipy dependency for one function.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections import deque
from dataclasses import dataclass

import numpy as np

from tuner.calibration.profile import StepCoefficients
from tuner.capacity import StartupPlan
from tuner.catalog import GpuProfile, ModelProfile
from tuner.clock import Clock
from tuner.emulator.engine import Engine, EngineRequest
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError
from tuner.flags import ResolvedFlags

__all__ = ["EngineShape", "FitResult", "LoadPoint", "Measured", "fit_coefficients", "predict", "step_features"]

_FEATURES = 5  # overhead, prefill tokens, decoding sequences, context tokens read, request latency


@dataclass(frozen=True)
class LoadPoint:
    """A closed loop of `concurrency` clients, each request `input_len` tokens in and exactly `output_len` out;
    `warmup` requests first (left out of the figures), then `requests` measured ones."""

    concurrency: int
    input_len: int
    output_len: int
    requests: int
    warmup: int = 0


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
class EngineShape:
    """The server the engine imitates while the features are counted: its flags and its KV blocks."""

    model: ModelProfile
    device: GpuProfile
    flags: ResolvedFlags
    plan: StartupPlan


@dataclass(frozen=True)
class Features:
    """Each figure of one load point as a vector of step features (the coefficients' multipliers)."""

    ttft: np.ndarray
    tpot: np.ndarray
    duration: np.ndarray
    output_tokens: int
    preemptions: int


@dataclass(frozen=True)
class _VirtualClock(Clock):
    at: list[float] = dataclasses.field(default_factory=lambda: [0.0])

    def now(self) -> float:
        return self.at[0]


class _Sink:
    """A request's times, each a vector of coefficient multipliers (see step_features)."""

    __slots__ = ("first", "last", "n", "now", "start")

    def __init__(self, now: list[np.ndarray]) -> None:
        self.now = now  # the loop's current time, shared
        self.start = now[0]
        self.first = self.last = now[0]
        self.n = 0

    def on_token(self, index: int, finish_reason: str | None) -> None:
        if index == 0:
            self.first = self.now[0]
        self.last = self.now[0]
        self.n = index + 1

    def on_cut(self) -> None:
        pass


_LATENCY = np.eye(_FEATURES)[4]


def step_features(shape: EngineShape, point: LoadPoint, guess: StepCoefficients) -> Features:
    """Run the point's closed loop through the emulator's engine in virtual time and return each measured figure
    as a vector of coefficient multipliers.

    Every instant of the run is such a vector: a step's end is the previous instant plus the step's features
    (1, prompt tokens, decodes, context tokens, 0), a request reaches the engine `request_latency_s` after its
    client sent it (+ the unit vector of that coefficient), an idle engine waits for the next arrival. The order
    of events (which requests a step holds) is decided by the numbers under `guess`; given that order every
    figure is exact and linear. Raises ConfigError if the load cannot run on this shape."""
    f = shape.flags
    if point.input_len + point.output_len > f.max_model_len:
        raise ConfigError(
            f"load point {point.input_len}+{point.output_len} tokens exceeds max_model_len ({f.max_model_len})"
        )
    c = np.array(guess.as_vector())
    clock = _VirtualClock()
    engine = Engine(
        shape.model,
        f,
        shape.plan,
        StepTimeModel.build(shape.model, shape.device, f),  # unused: this loop times its steps itself
        clock,
        EmulatorMetrics(shape.model.name, f.max_model_len, {}),
        VllmLog(io.StringIO()),
        lambda _reason, _lines: None,
        log_stats=False,
    )
    now = [np.zeros(_FEATURES)]
    arriving: deque[tuple[np.ndarray, EngineRequest]] = deque()  # (when it reaches the engine, request), in order
    sinks: list[_Sink] = []
    total = point.warmup + point.requests
    unique = itertools.count(1000)

    def send() -> None:
        sink = _Sink(now)
        ids = [next(unique) for _ in range(point.input_len)]  # no two prompts share a block: the cache never hits
        req = EngineRequest(
            f"p{len(sinks)}", ids, point.output_len, "length", sink, f.block_size, f.enable_prefix_caching
        )
        arriving.append((now[0] + _LATENCY, req))
        sinks.append(sink)

    for _ in range(min(point.concurrency, total)):
        send()
    done = 0
    while done < total:
        t = float(now[0] @ c)
        while arriving and float(arriving[0][0] @ c) <= t + 1e-12:
            engine.submit(arriving.popleft()[1])
        batch = engine.begin_step() if (engine.running or engine.waiting) else None
        if batch is None or not batch.items:
            if not arriving:
                raise ConfigError("the probe's load does not fit the server's KV cache (the engine stalled)")
            now[0] = arriving[0][0]  # idle until the next request arrives
            continue
        d = batch.num_decode
        # a profile's step (StepTimeModel.with_coefficients): its period, linear, whatever the scheduling mode
        now[0] = now[0] + np.array([1.0, batch.num_tokens - d, d, batch.kv_read, 0.0])
        clock.at[0] = float(now[0] @ c)
        before = engine.stats.finished
        engine.complete(batch.items, clock.at[0])
        for _ in range(engine.stats.finished - before):
            done += 1
            if len(sinks) < total:
                send()
    return _figures(sinks[point.warmup :], c, engine.stats.preemptions)


def _figures(measured: list[_Sink], c: np.ndarray, preemptions: int) -> Features:
    """The measured requests' means, each a vector (the first and last instants by their value under `c`)."""
    ttft = sum((s.first - s.start for s in measured), np.zeros(_FEATURES)) / len(measured)
    multi = [s for s in measured if s.n > 1]
    tpot = (
        sum(((s.last - s.first) / (s.n - 1) for s in multi), np.zeros(_FEATURES)) / len(multi)
        if multi
        else np.zeros(_FEATURES)
    )
    begin = min(measured, key=lambda s: float(s.start @ c)).start
    end = max(measured, key=lambda s: float(s.last @ c)).last
    return Features(
        ttft=ttft,
        tpot=tpot,
        duration=end - begin,
        output_tokens=sum(s.n for s in measured),
        preemptions=preemptions,
    )


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


def predict(features: Features, c: StepCoefficients) -> Prediction:
    v = np.array(c.as_vector())
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


def _solve(rows: list[tuple[Features, Measured]]) -> FitResult:
    """Non-negative least squares of the step coefficients over each point's mean TTFT, mean TPOT and duration,
    every row relative to its measured value."""
    if not rows:
        raise ConfigError("no load point was measured: nothing to fit")
    a_rows: list[np.ndarray] = []
    b_rows: list[float] = []
    for feats, m in rows:
        for vec, value in ((feats.ttft, m.ttft_mean_s), (feats.tpot, m.tpot_mean_s), (feats.duration, m.duration_s)):
            if value > 0 and np.any(vec):
                a_rows.append(vec / value)
                b_rows.append(1.0)
    if len(a_rows) < _FEATURES:
        raise ConfigError(f"{len(a_rows)} measured figures cannot fix {_FEATURES} coefficients: probe more points")
    a = np.vstack(a_rows)
    # columns of very different size (1 a step against thousands of context tokens) condition lstsq badly
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    x = _nnls(a / scale, np.array(b_rows)) / scale
    c = StepCoefficients.from_vector([float(v) for v in x])
    residual = a @ x - 1.0
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


def fit_coefficients(
    shape: EngineShape, measured: list[tuple[LoadPoint, Measured]], guess: StepCoefficients = _FIRST_GUESS
) -> tuple[FitResult, int]:
    """Fit, re-simulate the schedule under the fitted coefficients, fit again, until the coefficients stop
    moving (0.1%); the fit and the rounds it took. A closed loop without request latency needs one round."""
    fit: FitResult | None = None
    for rounds in range(1, _MAX_ROUNDS + 1):
        rows = [(step_features(shape, p, guess), m) for p, m in measured]
        fit = _solve(rows)
        old, new = np.array(guess.as_vector()), np.array(fit.coefficients.as_vector())
        guess = fit.coefficients
        if np.all(np.abs(new - old) <= 1e-3 * np.maximum(np.abs(new), 1e-12)):
            return fit, rounds
    assert fit is not None
    return fit, _MAX_ROUNDS
