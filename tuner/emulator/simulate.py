"""The engine in virtual time: the same scheduler, KV pool and step-time model, no sleeping, no HTTP.

A closed loop of `concurrency` requests runs to completion in milliseconds of CPU, which makes calibration
checks (TPOT, throughput, preemptions) exact and fast, and lets a planner predict a flag set's speed shape.
"""

from __future__ import annotations

import io
import statistics
from dataclasses import dataclass, field, replace

from tuner.capacity import StartupPlan, plan_startup
from tuner.catalog import GpuProfile, ModelProfile
from tuner.clock import Clock
from tuner.emulator.engine import Engine, EngineRequest
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError
from tuner.flags import ResolvedFlags, VllmFlags, resolve


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


class _ClosedLoop:
    """One engine in virtual time and the clients feeding it: each finished request is replaced at once."""

    def __init__(
        self,
        model: ModelProfile,
        gpu: GpuProfile,
        resolved: ResolvedFlags,
        plan: StartupPlan,
        *,
        input_len: int,
        output_len: int,
        shared_prefix_len: int,
    ) -> None:
        self.resolved = resolved
        self.input_len = input_len
        self.output_len = output_len
        self.shared_prefix_len = shared_prefix_len
        self.clock = _VirtualClock()
        self.step_model = StepTimeModel.build(model, gpu, resolved)
        metrics = EmulatorMetrics(model.name, resolved.max_model_len, {})
        self.fatal: list[str] = []
        self.engine = Engine(
            model,
            resolved,
            plan,
            self.step_model,
            self.clock,
            metrics,
            VllmLog(io.StringIO()),
            lambda reason, _lines: self.fatal.append(reason),
            log_stats=False,
        )
        self.recorders: list[_Recorder] = []
        self.submitted = 0
        self.finished_now: list[_Recorder] = []

    def submit(self) -> None:
        # a shared prefix of token ids 0.. and a per-request tail no other request has, so only the prefix can hit
        rec = _Recorder(self.clock, self.finished_now)
        prefix = list(range(self.shared_prefix_len))
        tail_len = self.input_len - self.shared_prefix_len
        prompt = prefix + [100_000 + self.submitted * 7919 + i for i in range(tail_len)]
        resolved = self.resolved
        req = EngineRequest(
            f"sim-{self.submitted}",
            prompt,
            self.output_len,
            "length",
            rec,
            resolved.block_size,
            resolved.enable_prefix_caching,
        )
        self.engine.submit(req)
        self.recorders.append(rec)
        self.submitted += 1

    def run(self, concurrency: int, total: int) -> None:
        """Step until `total` requests finished; ConfigError if the server would have crashed."""
        for _ in range(min(concurrency, total)):
            self.submit()
        done = 0
        while done < total:
            if not self._step():
                break
            for _rec in self.finished_now:
                done += 1
                if self.submitted < total:
                    self.submit()
            self.finished_now.clear()
        if self.fatal:
            raise ConfigError(f"the simulated server crashed: {self.fatal[0]}")

    def _step(self) -> bool:
        """One scheduler pass and its step time on the clock; False if the batch would hit CUDA OOM."""
        engine = self.engine
        batch = engine.begin_step()
        if not batch.items:
            raise RuntimeError("the simulated engine stalled")  # cannot happen for a flag set that starts
        if len(engine.running) >= engine.oom_running_threshold:
            self.fatal.append("cuda_oom")
            return False
        self.clock.t[0] += batch.seconds(self.step_model)
        engine.complete(batch.items, self.clock.t[0])
        return True

    def result(self) -> SimulationResult:
        recs = [r for r in self.recorders if r.done]
        tpots = [(r.last - r.first) / (r.n - 1) for r in recs if r.n > 1]
        duration = self.clock.t[0]
        return SimulationResult(
            requests=len(recs),
            duration_s=duration,
            output_tok_s=sum(r.n for r in recs) / duration if duration else 0.0,
            tpot_mean_s=statistics.fmean(tpots) if tpots else 0.0,
            tpot_median_s=statistics.median(tpots) if tpots else 0.0,
            ttft_mean_s=statistics.fmean(r.first - r.start for r in recs),
            e2e_mean_s=statistics.fmean(r.last - r.start for r in recs),
            preemptions=self.engine.stats.preemptions,
            steps=self.engine.stats.steps,
        )


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
    if resolved.auto_max_model_len:  # `--max-model-len auto`: the length the start fitted
        resolved = replace(resolved, max_model_len=plan.max_model_len)
    if input_len + output_len > resolved.max_model_len:
        raise ConfigError(f"input_len + output_len exceeds max_model_len ({resolved.max_model_len})")
    total = requests if requests is not None else 4 * concurrency
    loop = _ClosedLoop(
        model, gpu, resolved, plan, input_len=input_len, output_len=output_len, shared_prefix_len=shared_prefix_len
    )
    loop.run(concurrency, total)
    return loop.result()
