"""The engine in virtual time: the same scheduler, KV pool and step-time model, no sleeping, no HTTP.

A closed loop of `concurrency` requests runs to completion in milliseconds of CPU, which makes calibration
checks (TPOT, throughput, preemptions) exact and fast, and lets a planner predict a flag set's speed shape.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass, field

from tuner.capacity import plan_startup
from tuner.catalog import GpuProfile, ModelProfile
from tuner.clock import Clock
from tuner.emulator.engine import Engine, EngineRequest
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError
from tuner.flags import VllmFlags, resolve


@dataclass(frozen=True)
class _VirtualClock(Clock):
    t: list[float] = field(default_factory=lambda: [0.0])

    def now(self) -> float:
        return self.t[0]


@dataclass(frozen=True)
class SimulationResult:
    requests: int
    duration_s: float
    output_tok_s: float
    tpot_mean_s: float
    tpot_median_s: float
    ttft_mean_s: float
    e2e_mean_s: float
    preemptions: int
    steps: int


class _Recorder:
    __slots__ = ("clock", "done", "finished", "first", "last", "n", "start")

    def __init__(self, clock: _VirtualClock, finished: list[_Recorder]) -> None:
        self.clock = clock
        self.finished = finished
        self.start = clock.t[0]
        self.first = self.last = 0.0
        self.n = 0
        self.done = False

    def on_token(self, index: int, finish_reason: str | None) -> None:
        t = self.clock.t[0]
        if index == 0:
            self.first = t
        self.last = t
        self.n = index + 1
        if finish_reason is not None:
            self.done = True
            self.finished.append(self)

    def on_cut(self) -> None:
        self.done = True


def simulate_closed_loop(
    model: ModelProfile,
    gpu: GpuProfile,
    flags: VllmFlags,
    *,
    concurrency: int,
    input_len: int,
    output_len: int,
    requests: int | None = None,
    memory_in_use_gib: float = 0.0,
    shared_prefix_len: int = 0,
) -> SimulationResult:
    """`concurrency` clients each send a request (input_len token ids, exactly output_len tokens out) and send
    the next one as soon as the previous finishes, until `requests` (default 4 x concurrency) finished."""
    resolved = resolve(flags, gpu, model)
    plan = plan_startup(model, gpu, resolved, memory_in_use_gib)
    if not plan.ok:
        raise ConfigError(f"this flag set does not start: {plan.message}")
    if input_len + output_len > resolved.max_model_len:
        raise ConfigError(f"input_len + output_len exceeds max_model_len ({resolved.max_model_len})")
    total = requests if requests is not None else 4 * concurrency
    clock = _VirtualClock()
    step_model = StepTimeModel.build(model, gpu, resolved)
    metrics = EmulatorMetrics(model.name, resolved.max_model_len, {})
    fatal: list[str] = []
    engine = Engine(
        model,
        resolved,
        plan,
        step_model,
        clock,
        metrics,
        VllmLog(io.StringIO()),
        lambda reason, _lines: fatal.append(reason),
        log_stats=False,
    )
    recorders: list[_Recorder] = []
    submitted = 0
    finished_now: list[_Recorder] = []

    def submit() -> None:
        nonlocal submitted
        rec = _Recorder(clock, finished_now)
        prefix = list(range(shared_prefix_len))
        prompt = prefix + [100_000 + submitted * 7919 + i for i in range(input_len - shared_prefix_len)]
        req = EngineRequest(
            f"sim-{submitted}", prompt, output_len, "length", rec, resolved.block_size, resolved.enable_prefix_caching
        )
        engine.submit(req)
        recorders.append(rec)
        submitted += 1

    for _ in range(min(concurrency, total)):
        submit()
    done = 0
    while done < total:
        items, num_decode, kv_read, attn = engine.schedule()
        if not items:
            raise RuntimeError("the simulated engine stalled")  # cannot happen for a flag set that starts
        if len(engine.running) >= engine.oom_running_threshold:
            fatal.append("cuda_oom")
            break
        clock.t[0] += step_model.step_seconds(sum(n for _, n in items), num_decode, kv_read, attn)
        engine.complete(items, clock.t[0])
        for _rec in finished_now:
            done += 1
            if submitted < total:
                submit()
        finished_now.clear()
    if fatal:
        raise ConfigError(f"the simulated server crashed: {fatal[0]}")
    recs = [r for r in recorders if r.done]
    tpots = [(r.last - r.first) / (r.n - 1) for r in recs if r.n > 1]
    duration = clock.t[0]
    return SimulationResult(
        requests=len(recs),
        duration_s=duration,
        output_tok_s=sum(r.n for r in recs) / duration if duration else 0.0,
        tpot_mean_s=statistics.fmean(tpots) if tpots else 0.0,
        tpot_median_s=statistics.median(tpots) if tpots else 0.0,
        ttft_mean_s=statistics.fmean(r.first - r.start for r in recs),
        e2e_mean_s=statistics.fmean(r.last - r.start for r in recs),
        preemptions=engine.stats.preemptions,
        steps=engine.stats.steps,
    )
