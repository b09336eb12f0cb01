"""A load replayed through the emulator's engine in virtual time, every instant a vector of coefficient multipliers.

The engine's scheduler decides which steps a load runs (how many prompt tokens, decodes and context tokens each
has) from token counts alone; given that order, every time a client measures is a sum of step durations, each
linear in the coefficients (`StepCoefficients`), plus, for an open loop, the seconds at which its clients sent
(fixed by the schedule, not by the server). So an instant here is a vector: one multiplier per coefficient and a
last component in plain seconds:

    a step's end    = the previous instant + (1, prompt tokens, decodes, context tokens read, 0 | 0)
    a request sent  = a closed loop: the instant its user's last request ended; an open loop: (0, ..., 0 | send_s)
    its arrival     = its send + (0, 0, 0, 0, 1 | 0)     (request_latency_s: the front end, before the engine)
    an idle engine  = waits for the next arrival (the clock jumps to it)

The order of events (which requests a step holds, which arrival comes before which step's end) is decided by the
numbers under a guess of the coefficients; the fit (tuner.calibration.fit) re-runs the replay under its own
result until that order stops moving.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections import deque
from collections.abc import Callable, Sequence
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

__all__ = ["COEFFICIENTS", "EngineShape", "Features", "Load", "Request", "replay", "with_seconds"]

COEFFICIENTS = 5  # overhead, prefill tokens, decoding sequences, context tokens read, request latency
_WIDTH = COEFFICIENTS + 1  # and plain seconds (an open loop's send times)
_LATENCY = np.eye(_WIDTH)[4]
_SECOND = np.eye(_WIDTH)[COEFFICIENTS]


def with_seconds(c: StepCoefficients) -> np.ndarray:
    """The coefficients as the vector an instant is multiplied by (its seconds count as they are)."""
    return np.array([*c.as_vector(), 1.0])


@dataclass(frozen=True)
class EngineShape:
    """The server the engine imitates while the features are counted: its flags and its KV blocks."""

    model: ModelProfile
    device: GpuProfile
    flags: ResolvedFlags
    plan: StartupPlan


@dataclass(frozen=True)
class Request:
    """One request of a load: its lengths as the server counted them, whether it was a warm-up one (left out of
    the figures), and for an open loop when its client sent it (seconds from the load's start)."""

    prompt_len: int
    output_len: int
    warmup: bool = False
    send_s: float | None = None


@dataclass(frozen=True)
class Load:
    """Requests in the order they were sent: a closed loop of `concurrency` users (each sends its next request when
    its last one ends), or an open loop (`concurrency` None: each request at its `send_s`). The first `prefix_len`
    tokens of every prompt are the same (the workload's shared prefix: the prefix cache serves them)."""

    requests: tuple[Request, ...]
    concurrency: int | None
    prefix_len: int = 0


@dataclass(frozen=True)
class Features:
    """Each figure of one load as a vector of step features (the coefficients' multipliers, then seconds)."""

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
    """A request's times, each a vector (see the module's docstring)."""

    __slots__ = ("first", "last", "n", "now", "start")

    def __init__(self, now: list[np.ndarray], start: np.ndarray) -> None:
        self.now = now  # the loop's current time, shared
        self.start = start
        self.first = self.last = start
        self.n = 0

    def on_token(self, index: int, finish_reason: str | None) -> None:
        if index == 0:
            self.first = self.now[0]
        self.last = self.now[0]
        self.n = index + 1

    def on_cut(self) -> None:
        pass


def _engine(shape: EngineShape, clock: _VirtualClock) -> Engine:
    f = shape.flags
    return Engine(
        shape.model,
        f,
        shape.plan,
        StepTimeModel.build(shape.model, shape.device, f),  # unused: the replay times its steps itself
        clock,
        EmulatorMetrics(shape.model.name, f.max_model_len, {}),
        VllmLog(io.StringIO()),
        lambda _reason, _lines: None,
        log_stats=False,
    )


def replay(shape: EngineShape, load: Load, guess: StepCoefficients) -> Features:
    """Run `load` through the emulator's engine in virtual time, the order of events decided under `guess`, and
    return each measured figure as a vector (see the module's docstring). ConfigError if the load cannot run on
    this shape."""
    f = shape.flags
    longest = max(load.requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > f.max_model_len:
        raise ConfigError(
            f"a request of {longest.prompt_len}+{longest.output_len} tokens exceeds max_model_len ({f.max_model_len})"
        )
    clock = _VirtualClock()
    now = [np.zeros(_WIDTH)]
    arriving: deque[tuple[np.ndarray, EngineRequest]] = deque()  # (when it reaches the engine, request), in order
    sinks: dict[int, _Sink] = {}
    unique = itertools.count(1_000_000)
    prefix = list(range(load.prefix_len))

    def send(index: int, start: np.ndarray) -> None:
        spec = load.requests[index]
        shared = prefix[: max(0, spec.prompt_len - 1)]
        # a fresh tail for every prompt: the prefix cache serves the shared prefix and nothing else
        ids = shared + [next(unique) for _ in range(spec.prompt_len - len(shared))]
        sinks[index] = _Sink(now, start)
        req = EngineRequest(
            f"r{index}", ids, spec.output_len, "length", sinks[index], f.block_size, f.enable_prefix_caching
        )
        arriving.append((start + _LATENCY, req))

    total = len(load.requests)
    if load.concurrency is None:
        # every send is known beforehand; in time order (a client's clock may record two a hair out of order)
        for i in sorted(range(total), key=lambda i: load.requests[i].send_s or 0.0):
            send(i, _SECOND * (load.requests[i].send_s or 0.0))
    else:
        for i in range(min(load.concurrency, total)):
            send(i, now[0])

    def finished() -> None:
        if load.concurrency is not None and len(sinks) < total:
            send(len(sinks), now[0])  # the user whose request ended sends its next one at once

    engine = _engine(shape, clock)
    _run(engine, clock, now, arriving, with_seconds(guess), total, finished)
    measured = [sinks[i] for i, r in enumerate(load.requests) if not r.warmup]
    return _figures(measured, with_seconds(guess), engine.stats.preemptions)


def _run(
    engine: Engine,
    clock: _VirtualClock,
    now: list[np.ndarray],
    arriving: deque[tuple[np.ndarray, EngineRequest]],
    c: np.ndarray,
    total: int,
    finished: Callable[[], None],
) -> None:
    """Step the engine until `total` requests finished: each step's end a vector, the clock its value under `c`."""
    done = 0
    while done < total:
        t = float(now[0] @ c)
        while arriving and float(arriving[0][0] @ c) <= t + 1e-12:
            engine.submit(arriving.popleft()[1])
        batch = engine.begin_step() if (engine.running or engine.waiting) else None
        if batch is None or not batch.items:
            if not arriving:
                raise ConfigError("the load does not fit the server's KV cache (the engine stalled)")
            now[0] = arriving[0][0]  # idle until the next request arrives
            clock.at[0] = float(now[0] @ c)
            continue
        d = batch.num_decode
        # a profile's step (StepTimeModel.with_coefficients): its period, linear, whatever the scheduling mode
        now[0] = now[0] + np.array([1.0, batch.num_tokens - d, d, batch.kv_read, 0.0, 0.0])
        clock.at[0] = float(now[0] @ c)
        before = engine.stats.finished
        engine.complete(batch.items, clock.at[0])
        for _ in range(engine.stats.finished - before):
            done += 1
            finished()


def _figures(measured: Sequence[_Sink], c: np.ndarray, preemptions: int) -> Features:
    """The measured requests' means, each a vector (the first and last instants by their value under `c`)."""
    if not measured:
        raise ConfigError("the load has no measured request (every one was a warm-up)")
    ttft = sum((s.first - s.start for s in measured), np.zeros(_WIDTH)) / len(measured)
    multi = [s for s in measured if s.n > 1]
    tpot = (
        sum(((s.last - s.first) / (s.n - 1) for s in multi), np.zeros(_WIDTH)) / len(multi)
        if multi
        else np.zeros(_WIDTH)
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
