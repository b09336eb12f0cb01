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
result until that order settles.

A request that arrives while a step runs joins the engine at that step's end: exactly, its wait is the steps that
passed, which makes the latency worth nothing (to a fit, invisible) until an arrival crosses a step's end. With
`smooth`, a request's own times count that wait instead as its latency and the part of the step it waited
through: the same value under the guess, but a longer latency now means a longer wait, as on average it does.
That is how a fit finds the latency of a busy server; the exact rounds after it settle the schedule.
"""

from __future__ import annotations

import dataclasses
import io
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from tuner.capacity import StartupPlan, plan_startup
from tuner.catalog import GpuProfile, ModelProfile
from tuner.clock import Clock
from tuner.emulator.engine import Engine, EngineRequest
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError
from tuner.flags import ResolvedFlags, VllmFlags, resolve
from tuner.step_profile import StepCoefficients

__all__ = ["COEFFICIENTS", "EngineShape", "Features", "Load", "Request", "engine_shape", "replay", "with_seconds"]

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


def engine_shape(
    model: ModelProfile, device: GpuProfile, flags: VllmFlags, num_gpu_blocks: int | None = None
) -> EngineShape:
    """The measured server as the engine imitates it: vLLM's defaults for the device, the flags it was started
    with, and its own KV block count when it told us (vllm:cache_config_info, or its start-up log), else the
    start-up arithmetic's."""
    resolved = resolve(flags, device, model)
    plan = plan_startup(model, device, resolved)
    if num_gpu_blocks is None and not plan.ok:
        raise ConfigError(f"the server's KV blocks are unknown (no vllm:cache_config_info) and {plan.message}")
    if num_gpu_blocks is not None:
        plan = dataclasses.replace(
            plan, num_gpu_blocks=num_gpu_blocks, kv_tokens=num_gpu_blocks * resolved.block_size, reason=None
        )
    if resolved.auto_max_model_len and plan.max_model_len:  # `--max-model-len auto`: the length the start fitted
        resolved = dataclasses.replace(resolved, max_model_len=plan.max_model_len)
    return EngineShape(model=model, device=device, flags=resolved, plan=plan)


@dataclass(frozen=True)
class Request:
    """One request of a load: its lengths as the server counted them, whether it was a warm-up one (left out of
    the figures), and for an open loop when its client sent it (seconds from the load's start)."""

    prompt_len: int
    output_len: int
    warmup: bool = False
    send_s: float | None = None
    # a trace's request: its prompt's blocks as token ids, shared with the requests that share its hash ids, so the
    # prefix cache serves them as it served the server (None: a prompt of its own but the load's shared prefix)
    prompt_ids: tuple[int, ...] | None = None


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
    each_ttft: np.ndarray | None = None  # a row per measured request, in the load's order
    each_tpot: np.ndarray | None = None  # zeros for a request of one token


@dataclass(frozen=True)
class _VirtualClock(Clock):
    at: list[float] = dataclasses.field(default_factory=lambda: [0.0])

    def now(self) -> float:
        return self.at[0]


class _Sink:
    """A request's times, each a vector (see the module's docstring): the shared clock's instant, plus `delta`, a
    vector worth 0 under the guess that says how the request's own wait for the engine was made (see _arrive)."""

    __slots__ = ("delta", "ended", "first", "last", "n", "now", "start")

    def __init__(self, now: list[np.ndarray], start: np.ndarray, ended: list[_Sink]) -> None:
        self.now = now  # the loop's current time, shared
        self.ended = ended  # where a finished request reports itself
        self.start = start
        self.first = self.last = start
        self.delta = np.zeros(_WIDTH)
        self.n = 0

    def on_token(self, index: int, finish_reason: str | None) -> None:
        if index == 0:
            self.first = self.now[0] + self.delta
        self.last = self.now[0] + self.delta
        self.n = index + 1
        if finish_reason is not None:
            self.ended.append(self)

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


def replay(shape: EngineShape, load: Load, guess: StepCoefficients, *, smooth: bool = False) -> Features:
    """Run `load` through the emulator's engine in virtual time, the order of events decided under `guess`, and
    return each measured figure as a vector (see the module's docstring). ConfigError if the load cannot run on
    this shape."""
    f = shape.flags
    longest = max(load.requests, key=lambda r: r.prompt_len + r.output_len)
    if longest.prompt_len + longest.output_len > f.max_model_len:
        raise ConfigError(
            f"a request of {longest.prompt_len}+{longest.output_len} tokens exceeds max_model_len ({f.max_model_len})"
        )
    run = _Run(shape, with_seconds(guess), smooth)
    sinks: dict[int, _Sink] = {}
    unique = itertools.count(1_000_000)
    prefix = list(range(load.prefix_len))

    def send(index: int, start: np.ndarray) -> None:
        spec = load.requests[index]
        shared = list(spec.prompt_ids or ())[: spec.prompt_len] or prefix[: max(0, spec.prompt_len - 1)]
        # a fresh tail for every prompt: the prefix cache serves the shared prefix (or blocks) and nothing else
        ids = shared + [next(unique) for _ in range(spec.prompt_len - len(shared))]
        sinks[index] = sink = _Sink(run.now, start, run.ended)
        req = EngineRequest(f"r{index}", ids, spec.output_len, "length", sink, f.block_size, f.enable_prefix_caching)
        run.arriving.append((start + _LATENCY, req, sink))

    total = len(load.requests)
    if load.concurrency is None:
        # every send is known beforehand; in time order (a client's clock may record two a hair out of order)
        for i in sorted(range(total), key=lambda i: load.requests[i].send_s or 0.0):
            send(i, _SECOND * (load.requests[i].send_s or 0.0))
    else:
        for i in range(min(load.concurrency, total)):
            send(i, run.now[0])

    def finished(sink: _Sink) -> None:
        if load.concurrency is not None and len(sinks) < total:
            send(len(sinks), sink.last)  # its user sends the next request at once

    run.until(total, finished)
    measured = [sinks[i] for i, r in enumerate(load.requests) if not r.warmup]
    return _figures(measured, run.c, run.engine.stats.preemptions)


class _Run:
    """The engine stepped in virtual time: each step's end a vector, the clock its value under `c`."""

    def __init__(self, shape: EngineShape, c: np.ndarray, smooth: bool) -> None:
        self.clock = _VirtualClock()
        self.engine = _engine(shape, self.clock)
        self.c = c
        self.smooth = smooth
        self.now = [np.zeros(_WIDTH)]
        self.step = np.zeros(_WIDTH)  # the last step's features
        self.arriving: deque[tuple[np.ndarray, EngineRequest, _Sink]] = deque()  # (when it arrives, ...), in order
        self.ended: list[_Sink] = []

    def value(self, v: np.ndarray) -> float:
        return float(v @ self.c)

    def _jump(self, to: np.ndarray) -> None:
        self.now[0] = to
        self.clock.at[0] = self.value(to)

    def _arrive(self) -> None:
        """Hand the engine every request that has arrived by now; smoothed, one that came while the last step ran
        counts its wait as its latency and the part of that step it waited through (the module's docstring)."""
        t = self.value(self.now[0])
        while self.arriving and self.value(self.arriving[0][0]) <= t + 1e-12:
            at, req, sink = self.arriving.popleft()
            step = self.value(self.step)
            if self.smooth and step > 0:
                part = min(max((t - self.value(at)) / step, 0.0), 1.0)
                sink.delta = at + part * self.step - self.now[0]  # worth 0 under the guess
            self.engine.submit(req)

    def until(self, total: int, finished: Callable[[_Sink], None]) -> None:
        """Step until `total` requests finished, `finished` told of each."""
        engine, done = self.engine, 0
        while done < total:
            idle = not (engine.running or engine.waiting)
            if self.arriving and idle and self.value(self.arriving[0][0]) >= self.value(self.now[0]) - 1e-12:
                # wait for the next arrival, even one due this instant (a latency of 0 under this guess): the wait
                # stays in every later instant, so the fit sees what the latency costs
                self._jump(self.arriving[0][0])
            self._arrive()
            batch = engine.begin_step() if (engine.running or engine.waiting) else None
            if batch is None or not batch.items:
                if not self.arriving:
                    raise ConfigError("the load does not fit the server's KV cache (the engine stalled)")
                self._jump(self.arriving[0][0])  # idle until the next request arrives
                continue
            d = batch.num_decode
            # a profile's step (StepTimeModel.with_coefficients): its period, linear, whatever the scheduling mode
            self.step = np.array([1.0, batch.num_tokens - d, d, batch.kv_read, 0.0, 0.0])
            self._jump(self.now[0] + self.step)
            engine.complete(batch.items, self.value(self.now[0]))
            for sink in self.ended:
                done += 1
                finished(sink)
            self.ended.clear()


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
        each_ttft=np.array([s.first - s.start for s in measured]),
        each_tpot=np.array([(s.last - s.first) / (s.n - 1) if s.n > 1 else np.zeros(_WIDTH) for s in measured]),
    )
