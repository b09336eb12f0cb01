"""One flag set under a job's load in the emulator's engine, in virtual time: what a trial would measure.

The engine (V1 scheduler, paged KV pool), the start-up arithmetic (`plan_startup`) and the step-time model are the
emulator's own; the load is the job's (its workload's prompts, its closed or open loop, its warm-up, its request
timeout). `Coefficients` move the hidden figures away from the catalog's: the twin fits them to real trials, and the
efficiency benchmark perturbs them to build a "reality" the twin does not know.

Step times spread as the emulator's do (tuner.emulator.jitter), the generator seeded from the job's load alone, so
one question always gets one answer and every flag set of a job sees the same draws.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import io
import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from tuner.box import SHAPE_DOES_NOT_FIT, replica_arrival, replicas, shape_refusal
from tuner.capacity import KV_CACHE_TOO_SMALL, StartupPlan, plan_startup, runtime_need_bytes
from tuner.clock import Clock
from tuner.config import Job
from tuner.emulator.engine import WAITING, Engine, EngineRequest
from tuner.emulator.jitter import DEFAULT_STEP_JITTER, StepJitter
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import ResolvedFlags, VllmFlags, resolve
from tuner.load import CapacityStep, RequestRecord
from tuner.load.arrival import send_offsets
from tuner.load.trace_replay import trace_prompts
from tuner.scoring import LoadSummary, summarize
from tuner.twin.conversations import ConversationUsers
from tuner.twin.rate_search import searches_trace_rate, trace_rate_search

__all__ = ["Coefficients", "SimPoint", "simulate"]

GIB = 1024**3


@dataclass(frozen=True)
class Coefficients:
    """The hidden figures of a server, as factors on the catalog's (1.0 and 0.0: the catalog itself)."""

    step_scale: float = 1.0  # every step's time (a throughput error the twin fits)
    memory_scale: float = 1.0  # the memory-bound part of a step (weights and KV reads)
    compute_scale: float = 1.0  # the compute-bound part (prefill GEMMs)
    overhead_scale: float = 1.0  # the per-step overheads: the device's fixed cost and the host's scheduling work
    kv_scale: float = 1.0  # KV tokens the server gets against plan_startup's figure
    headroom_gib: float = 0.0  # memory outside vLLM's budget, added (negative: the runtime OOM comes sooner)
    step_jitter: float = DEFAULT_STEP_JITTER  # sigma of the steps' log-normal spread (0: every step the model's time)

    def step_model(self, base: StepTimeModel) -> StepTimeModel:
        return dataclasses.replace(
            base,
            overhead_s=base.overhead_s * self.overhead_scale,
            host_s=base.host_s * self.overhead_scale,
            host_per_request_s=base.host_per_request_s * self.overhead_scale,
            bytes_per_s=base.bytes_per_s / self.memory_scale,
            kv_bytes_per_s=base.kv_bytes_per_s / self.memory_scale,
            flop_per_s=base.flop_per_s / self.compute_scale,
        )

    def plan(self, base: StartupPlan, max_model_len: int) -> StartupPlan:
        if not base.ok or (self.kv_scale == 1.0 and self.headroom_gib == 0.0):
            return base
        blocks = int(base.num_gpu_blocks * self.kv_scale)
        tokens = int(base.kv_tokens * self.kv_scale)
        plan = dataclasses.replace(
            base,
            num_gpu_blocks=blocks,
            kv_tokens=tokens,
            available_kv_bytes=int(base.available_kv_bytes * self.kv_scale),
            headroom_bytes=base.headroom_bytes + int(self.headroom_gib * GIB),
        )
        if tokens < max_model_len:
            message = f"the KV cache holds {tokens} tokens, fewer than max_model_len ({max_model_len})"
            return dataclasses.replace(plan, reason=KV_CACHE_TOO_SMALL, message=message)
        return plan


@dataclass
class SimPoint:
    """What a trial of one flag set would have seen."""

    flags: dict[str, Any]
    reason: str | None  # None: started (it may still crash under load: `crashed`)
    message: str | None = None
    crashed: bool = False
    records: list[RequestRecord] = field(default_factory=list)
    duration_s: float = 0.0
    kv_tokens: int | None = None
    raw_kv_tokens: int | None = None  # plan_startup's figure, before any coefficient
    peak_running: int = 0
    headroom_bytes: int = 0  # plan_startup's memory outside vLLM's budget, before any coefficient
    estimated_max_model_len: int | None = None  # a start refused for KV: the longest that would fit
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache, and those it served (vLLM's counters)
    prefix_hits: int = 0
    rate: float | None = None  # a capacity search's: the highest rate that met its judge (None: none did)
    rate_steps: list[CapacityStep] = field(default_factory=list)

    @property
    def started(self) -> bool:
        return self.reason is None

    def summary(self, job: Job, time_scale: float = 1.0) -> LoadSummary | None:
        """The load's summary, every duration times `time_scale` (a step-time scale moves all of them alike)."""
        if not self.started or self.crashed:
            return None
        records = self.records
        if time_scale != 1.0:
            s = time_scale
            records = [
                r.model_copy(
                    update={
                        "start_s": r.start_s * s,
                        "ttft_s": None if r.ttft_s is None else r.ttft_s * s,
                        "itl_s": [x * s for x in r.itl_s],
                        "e2e_s": r.e2e_s * s,
                    }
                )
                for r in records
            ]
        return summarize(records, duration_s=self.duration_s * time_scale, slos=job.parsed_slos())


@dataclass(frozen=True)
class _VirtualClock(Clock):
    at: list[float] = field(default_factory=lambda: [0.0])

    @property
    def t(self) -> float:
        return self.at[0]

    def now(self) -> float:
        return self.at[0]


class _Sink:
    __slots__ = ("clock", "done", "start", "times")

    def __init__(self, clock: _VirtualClock) -> None:
        self.clock = clock
        self.start = clock.t
        self.times: list[float] = []
        self.done = False

    def on_token(self, index: int, finish_reason: str | None) -> None:
        self.times.append(self.clock.t)
        if finish_reason is not None:
            self.done = True

    def on_cut(self) -> None:
        self.done = True


def _oom_threshold(job: Job, flags: ResolvedFlags, plan: StartupPlan) -> int:
    """The fewest running requests whose transient buffers no longer fit in the headroom (the engine's rule)."""
    model = job.model_profile()
    for n in range(flags.max_num_seqs + 1):
        if runtime_need_bytes(model, flags, n) > plan.headroom_bytes:
            return n
    return flags.max_num_seqs + 1


def simulate(job: Job, flags: VllmFlags, coefficients: Coefficients = Coefficients()) -> SimPoint:
    """`flags` started and loaded with the job's workload and arrival, in virtual time: one replica of the box's
    under its share of the arrival (`tuner.box`), as the study measures it. A shape wider than the box does not
    start, as the study refuses it before launch. A max_rate or goodput job on a trace: the study's capacity search,
    its trace sped up to each rate (tuner.twin.rate_search), the best step's point."""
    refusal = shape_refusal(job.box_gpus(), flags.world_size)
    if refusal is not None:
        return SimPoint(flags.as_dict(), SHAPE_DOES_NOT_FIT, refusal)
    if not searches_trace_rate(job):
        return _simulate_load(job, flags, coefficients)
    # each rate the search tries is one replica's, as the study's search runs on one server
    found = trace_rate_search(
        job, lambda j: _simulate_load(j, flags, coefficients, share=False), lambda j, p: p.summary(j)
    )
    return replace(found.point, rate=found.rate, rate_steps=found.steps)


def _simulate_load(job: Job, flags: VllmFlags, coefficients: Coefficients, *, share: bool = True) -> SimPoint:
    """One fixed load: the job's arrival as it is, one replica's `share` of it on a box of several."""
    n = replicas(job.box_gpus(), flags.world_size)
    if n > 1 and share:
        job = job.model_copy(update={"arrival": replica_arrival(job.arrival, n)})
    model, gpu = job.model_profile(), job.gpu_profile()
    resolved = resolve(flags, gpu, model)
    memory_in_use = job.target.emulator.memory_in_use_gib if job.target.launcher == "emulator" else 0.0
    raw = plan_startup(model, gpu, resolved, memory_in_use)
    if resolved.auto_max_model_len and raw.max_model_len:  # `auto`: the engine runs with the fitted length
        resolved = replace(resolved, max_model_len=raw.max_model_len)
    plan = coefficients.plan(raw, resolved.max_model_len)
    point = SimPoint(
        flags.as_dict(), plan.reason, plan.message, raw_kv_tokens=raw.kv_tokens, headroom_bytes=raw.headroom_bytes
    )
    point.estimated_max_model_len = plan.estimated_max_model_len
    if not plan.ok:
        return point
    point.kv_tokens = plan.kv_tokens
    clock = _VirtualClock()
    engine = Engine(
        model,
        resolved,
        plan,
        coefficients.step_model(StepTimeModel.build(model, gpu, resolved, job.step_profile())),
        clock,
        EmulatorMetrics(model.name, resolved.max_model_len, {}),
        VllmLog(io.StringIO()),
        lambda _reason, _lines: None,
        log_stats=False,
        jitter=StepJitter(coefficients.step_jitter, _seed(job, flags, coefficients)),
    )
    profile = job.step_profile()
    latency = profile.coefficients.request_latency_s if profile is not None else 0.0
    load = _Load(job, engine, clock, resolved, _oom_threshold(job, resolved, plan), coefficients.step_scale, latency)
    load.run(point)
    point.prefix_queries, point.prefix_hits = engine.stats.prefix_queries, engine.stats.prefix_hits
    return point


def _seed(job: Job, flags: VllmFlags, coefficients: Coefficients) -> int:
    """The jitter's seed: a digest of the load (not Python's hash, which changes from process to process). Every
    flag set and every fit of one job draws the same spread (common random numbers): the twin's comparisons between
    flag sets, and its slopes between fits, then show what the flags and the terms do, not a different draw."""
    key = "\n".join((job.workload.model_dump_json(), job.arrival.model_dump_json()))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


class _Load:
    """The job's clients against one engine: a closed loop of `concurrency`, arrivals at `rate`, or a trace's."""

    def __init__(
        self,
        job: Job,
        engine: Engine,
        clock: _VirtualClock,
        resolved: ResolvedFlags,
        oom_at: int,
        step_scale: float,
        request_latency_s: float = 0.0,
    ) -> None:
        self.job = job
        self.engine = engine
        self.clock = clock
        self.resolved = resolved
        self.oom_at = oom_at
        self.step_scale = step_scale
        a = job.arrival
        self.warmup = a.warmup_requests
        self.total = (a.requests or 1_000_000) + a.warmup_requests
        self.duration = a.duration_s
        self.prompts: Iterator[Any] = job.workload.prompts()
        self.arrivals = _arrival_times(job) if a.rate is not None else None
        if a.trace is not None:  # its slice, at its times and lengths, its shared blocks as shared token ids
            sent = a.trace_requests()
            self.total, self.duration = len(sent), None
            self.prompts = trace_prompts(sent, block_tokens=a.block_tokens, seed=job.workload.seed + a.seed)
            self.arrivals = send_offsets(a)
        # A conversation workload's users, each holding its conversation (None: every request stands alone).
        self.users = ConversationUsers(job.workload, a.concurrency or 1) if job.workload.conversations else None
        self.user_of: dict[int, int] = {}
        self.records: list[RequestRecord] = []
        self.in_flight: dict[int, tuple[EngineRequest, _Sink, Any]] = {}
        self.sent = 0
        self.next_at = next(self.arrivals) if self.arrivals is not None else 0.0
        self.cap = a.concurrency or a.max_in_flight or 1_000_000
        self.unique = itertools.count(200_000)
        # a fitted profile's front-end latency: a request reaches the scheduler this long after it was sent, spread
        # as the steps are (the front end's work per request varies too), so requests sent together can reach the
        # scheduler in different steps; a heap, as a later send can arrive first
        self.latency = request_latency_s * step_scale
        self.arriving: list[tuple[float, int, EngineRequest]] = []

    def _send(self, user: int | None = None) -> None:
        spec = next(self.prompts) if self.users is None or user is None else self.users.next_turn(user)
        index = self.sent
        if user is not None:
            self.user_of[index] = user
        self.sent += 1
        ids = spec.prompt if isinstance(spec.prompt, list) else [next(self.unique) for _ in range(spec.prompt_len)]
        sink = _Sink(self.clock)
        if len(ids) + spec.output_len > self.resolved.max_model_len:
            self.records.append(self._record(index, sink, spec, ok=False, error="http_4xx"))
            self._answered(index, ok=False)
            return
        r = self.resolved
        req = EngineRequest(f"r{index}", ids, spec.output_len, "length", sink, r.block_size, r.enable_prefix_caching)
        if self.latency > 0:
            spread = self.engine.jitter.factor() if self.engine.jitter is not None else 1.0
            heapq.heappush(self.arriving, (self.clock.t + self.latency * spread, index, req))
        else:
            self.engine.submit(req)
        self.in_flight[index] = (req, sink, spec)

    def _arrive(self) -> bool:
        """Hand the scheduler the requests whose front-end latency has passed; False if the engine has nothing to
        do yet (the clock then moves to the next arrival)."""
        while self.arriving and self.arriving[0][0] <= self.clock.t + 1e-12:
            req = heapq.heappop(self.arriving)[2]
            if req.state == WAITING:
                self.engine.submit(req)
        if self.engine.running or self.engine.waiting or not self.arriving:
            return True
        wake = self.arriving[0][0]
        timed = self.arrivals is not None or self.users is not None
        if timed and self.sent < self.total and self.next_at > self.clock.t:
            wake = min(wake, self.next_at)  # an open loop's next send, or a user's next turn, comes first
        self.clock.at[0] = wake
        return False

    def _admit(self) -> None:
        if self.duration is not None and self.clock.t > self.duration + 1e-9 and self.sent >= self.warmup:
            self.total = self.sent
        if self.users is not None:
            for user in self.users.due(self.clock.t):
                if self.sent >= self.total:
                    break
                self._send(user)
            self.next_at = self.users.next_wake()
            return
        while self.sent < self.total and len(self.in_flight) < self.cap and self.next_at <= self.clock.t:
            self._send()
            if self.arrivals is not None:
                self.next_at = next(self.arrivals)

    def run(self, point: SimPoint) -> None:
        engine = self.engine
        while True:
            self._admit()
            if not self.in_flight:
                if self.sent >= self.total:
                    break
                self.clock.at[0] = max(self.clock.t, self.next_at)  # idle until the next arrival
                continue
            if not self._arrive():
                continue
            batch = engine.begin_step()
            if not batch.items:
                break  # nothing schedulable: cannot happen after a good start
            point.peak_running = max(point.peak_running, len(engine.running))
            if len(engine.running) >= self.oom_at:
                point.crashed = True
                break
            self.clock.at[0] += engine.step_seconds(batch) * self.step_scale
            engine.complete(batch.items, self.clock.t)
            self._collect()
        for index, (_req, sink, spec) in self.in_flight.items():  # a crash cuts every open stream
            self.records.append(self._record(index, sink, spec, ok=False, error="stream_cut"))
        measured = [r for r in self.records if not r.warmup]
        begin = min((r.start_s for r in measured), default=0.0)
        end = max((r.end_s for r in measured), default=0.0)
        point.records = self.records
        point.duration_s = max(end - begin, 1e-6)

    def _collect(self) -> None:
        timeout = float(self.job.request_timeout)
        for index in list(self.in_flight):
            req, sink, spec = self.in_flight[index]
            if sink.done:
                self.records.append(self._record(index, sink, spec, ok=True))
                del self.in_flight[index]
                self._answered(index, ok=True)
            elif self.clock.t - sink.start > timeout:
                self.engine.abort(req)
                self.records.append(self._record(index, sink, spec, ok=False, error="timeout"))
                del self.in_flight[index]
                self._answered(index, ok=False)

    def _answered(self, index: int, *, ok: bool) -> None:
        """A conversation's turn is over: its user thinks, then sends the next (or starts afresh after a failure)."""
        if self.users is not None:
            self.users.finished(self.user_of.pop(index), ok, self.clock.t)

    def _record(self, index: int, sink: _Sink, spec: Any, *, ok: bool, error: str | None = None) -> RequestRecord:
        times = sink.times
        end = times[-1] if (ok and times) else self.clock.t
        return RequestRecord(
            index=index,
            start_s=sink.start,
            ttft_s=(times[0] - sink.start) if times else None,
            itl_s=[b - a for a, b in itertools.pairwise(times)],
            e2e_s=end - sink.start,
            prompt_tokens=spec.prompt_len,
            completion_tokens=len(times),
            ok=ok,
            error_class=error,
            error_message=None if ok else error,
            warmup=index < self.warmup,
            turn=getattr(spec, "turn", None),
        )


def _arrival_times(job: Job) -> Iterator[float]:
    """Open-loop send times: gamma gaps of shape `burstiness` around 1/rate (Poisson at 1), or constant."""
    a = job.arrival
    assert a.rate is not None
    rng = random.Random(a.seed)
    t = 0.0
    while True:
        yield t
        gap = 1 / a.rate if a.process == "constant" else rng.gammavariate(a.burstiness, 1 / (a.rate * a.burstiness))
        t += gap
