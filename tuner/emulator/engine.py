"""The engine: vLLM V1's scheduler over a paged KV pool, stepping in emulated time.

One asyncio task. Each step schedules running requests first (one token a decode, a chunk a partial prefill)
within the `max_num_batched_tokens` budget, then admits waiting ones FCFS while budget remains, the batch is
below `max_num_seqs`, nothing was preempted and the free blocks hold the whole prompt (vLLM 0.32's
`scheduler_reserve_full_isl`, on by default); blocks are allocated lazily; when a block cannot be had the
newest running request is preempted by recompute. The step's duration comes from the step-time model, times a
seeded jitter factor when the engine has one (tuner.emulator.jitter: a real server's steps spread); the task
sleeps until an absolute deadline (previous deadline + step time) so Python overhead does not accumulate, then
emits one token to every request that finished its prompt.

With asynchronous scheduling (vLLM 0.32's default on a GPU) the scheduler runs one step ahead, as vLLM's
AsyncScheduler under EngineCore.step_with_batch_queue does: step N+1 is scheduled when step N starts, before N's
tokens exist, counting them as placeholders (`in_flight`, `pending`). So what N finishes (a request's last token,
its seat, its blocks) and what arrives while N runs are seen by step N+2's scheduling, not N+1's; a request whose
last token is known in advance (max_tokens, max_model_len) gets no step beyond it, one that stops at EOS gets one
wasted decode. The step-time model gives the period that overlap allows (StepTimeModel.overlap_host).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from tuner.capacity import StartupPlan, cuda_oom_message, runtime_need_bytes
from tuner.catalog import ModelProfile
from tuner.clock import Clock
from tuner.emulator.jitter import StepJitter
from tuner.emulator.kv_pool import BlockHash, KvBlockPool, block_hashes
from tuner.emulator.logs import VllmLog
from tuner.emulator.metrics import EmulatorMetrics
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import ResolvedFlags

WAITING, RUNNING, FINISHED, ABORTED = 0, 1, 2, 3
_MAX_LAG_WALL_S = 0.1  # behind schedule by more than this (machine contention): stop catching up, count a late step
_STATS_INTERVAL_S = 10.0  # emulated seconds between "Avg generation throughput" lines, as vLLM's loggers


class TokenSink(Protocol):
    """Where a request's tokens go (the HTTP stream)."""

    def on_token(self, index: int, finish_reason: str | None) -> None: ...

    def on_cut(self) -> None: ...


class EngineRequest:
    __slots__ = (
        "arrival",
        "blocks",
        "finish_reason",
        "first_scheduled",
        "first_token",
        "hashes",
        "in_flight",
        "last_token",
        "num_computed",
        "num_output",
        "pending",
        "prompt_len",
        "request_id",
        "sink",
        "state",
        "target_output",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        target_output: int,
        finish_reason: str,
        sink: TokenSink,
        block_size: int,
        caching: bool,
    ) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt_ids)
        self.hashes: list[BlockHash] = block_hashes(prompt_ids, block_size) if caching else []
        self.target_output = target_output
        self.finish_reason = finish_reason
        self.sink = sink
        self.state = WAITING
        self.num_computed = 0
        self.num_output = 0
        # scheduled but not completed (asynchronous scheduling only): tokens being computed, tokens to be sampled
        self.in_flight = 0
        self.pending = 0
        self.blocks: list[int] = []
        self.arrival = 0.0
        self.first_scheduled: float | None = None
        self.first_token = 0.0
        self.last_token = 0.0


def output_length(
    seed: int, prompt_ids: list[int], max_tokens: int, min_tokens: int, ignore_eos: bool, request_seed: int | None
) -> tuple[int, str]:
    """How many tokens a request generates and why it stops: exactly max_tokens with ignore_eos, otherwise a
    seeded 'natural' length where the model would emit EOS (log-normal, median ~180 tokens)."""
    if ignore_eos:
        return max_tokens, "length"
    # ints only: hash(None) differs between processes, and lengths must repeat run to run
    rseed = -1 if request_seed is None else request_seed
    key = hash((seed, rseed, len(prompt_ids), tuple(prompt_ids[:64]), tuple(prompt_ids[-16:])))
    natural = max(1, int(random.Random(key).lognormvariate(math.log(180.0), 0.9)))
    if natural >= max_tokens:
        return max_tokens, "length"
    return max(natural, min_tokens, 1), "stop"


@dataclass
class Batch:
    """One step's scheduled work: (request, tokens) pairs, and the counts the step-time model reads."""

    items: list[tuple[EngineRequest, int]]
    num_decode: int = 0
    kv_read: int = 0
    attn: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def num_requests(self) -> int:
        return len(self.items)

    def seconds(self, model: StepTimeModel) -> float:
        """The step's period under `model`."""
        return model.step_seconds(self.num_tokens, self.num_decode, self.kv_read, self.attn, self.num_requests)


@dataclass
class EngineStats:
    steps: int = 0
    model_busy_s: float = 0.0  # sum of modelled step times
    actual_busy_s: float = 0.0  # emulated time those steps really took
    late_steps: int = 0
    max_lag_s: float = 0.0
    # Emulated seconds the virtual clock slipped: a step later than _MAX_LAG_WALL_S is not caught up, so the run
    # lost that much of the time its time_scale promised (what `tuner.load.host_contention` reads as its lag).
    lag_s: float = 0.0
    preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def behind_s(self) -> float:
        """Emulated seconds the busy stretches took beyond their modelled steps: the slips (`lag_s`) and the lateness
        a stretch ended with (not caught up before the engine idled). What its time_scale promised and did not keep."""
        return max(0.0, self.actual_busy_s - self.model_busy_s)

    @property
    def timing_error(self) -> float:
        """Relative excess of real over modelled step time (0.0 = every step on time)."""
        return self.actual_busy_s / self.model_busy_s - 1.0 if self.model_busy_s else 0.0


class Engine:
    def __init__(
        self,
        model: ModelProfile,
        flags: ResolvedFlags,
        plan: StartupPlan,
        step_model: StepTimeModel,
        clock: Clock,
        metrics: EmulatorMetrics,
        log: VllmLog,
        on_fatal: Callable[[str, list[str]], None],
        crash_after_requests: int | None = None,
        log_stats: bool = True,
        jitter: StepJitter | None = None,
    ) -> None:
        self.model = model
        self.flags = flags
        self.plan = plan
        self.step_model = step_model
        self.clock = clock
        self.metrics = metrics
        self.log = log
        self.on_fatal = on_fatal
        self.crash_after_requests = crash_after_requests
        self.log_stats = log_stats
        self.jitter = jitter
        self.block_size = flags.block_size
        self.caching = flags.enable_prefix_caching
        self.async_scheduling = flags.async_scheduling
        self._ahead: Batch | None = None  # asynchronous: the next step's batch, scheduled while this one runs
        # BlockPool keeps block 0 as the null block: the requests share the rest (vllm/v1/core/block_pool.py)
        self.pool = KvBlockPool(max(0, plan.num_gpu_blocks - 1), flags.block_size, self.caching)
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.stats = EngineStats()
        self.dead = False
        self._wakeup = asyncio.Event()
        self._has_aborted = False
        self._stopped = False
        self.oom_running_threshold = self._runtime_oom_threshold(model, flags, plan)
        self._stats_next = 0.0
        self._stats_mark = (0, 0, 0, 0, 0.0)
        metrics.bind_gauges(lambda: len(self.running), lambda: len(self.waiting), lambda: self.pool.usage)

    @staticmethod
    def _runtime_oom_threshold(model: ModelProfile, flags: ResolvedFlags, plan: StartupPlan) -> int:
        """The fewest running requests whose transient buffers no longer fit in the headroom."""
        for n in range(flags.max_num_seqs + 1):
            if runtime_need_bytes(model, flags, n) > plan.headroom_bytes:
                return n
        return flags.max_num_seqs + 1

    # -- requests ----------------------------------------------------------------------------------------------

    def submit(self, req: EngineRequest) -> None:
        req.arrival = self.clock.now()
        self.waiting.append(req)
        self._wakeup.set()

    def abort(self, req: EngineRequest) -> None:
        """The client went away: free its blocks at the next step (vLLM aborts on disconnect)."""
        if req.state in (WAITING, RUNNING):
            req.state = ABORTED
            self._has_aborted = True
            self._wakeup.set()

    def _drop_aborted(self) -> None:
        self._has_aborted = False
        pool = self.pool
        for r in self.running:
            if r.state == ABORTED:
                pool.free_blocks(r.blocks)
                self.metrics.success["abort"].inc()
        self.running = [r for r in self.running if r.state == RUNNING]
        if any(r.state == ABORTED for r in self.waiting):
            for r in self.waiting:
                if r.state == ABORTED:
                    pool.free_blocks(r.blocks)
                    self.metrics.success["abort"].inc()
            self.waiting = deque(r for r in self.waiting if r.state == WAITING)

    # -- scheduling ----------------------------------------------------------------------------------------------

    def _preempt(self, victim: EngineRequest) -> None:
        self.pool.free_blocks(victim.blocks)
        victim.num_computed = 0
        # a token it had in flight is recomputed rather than delivered (vLLM delivers it): one token of a recompute
        victim.in_flight = victim.pending = 0
        victim.state = WAITING
        self.waiting.appendleft(victim)
        self.stats.preemptions += 1
        self.metrics.preemptions.inc()

    def begin_step(self) -> Batch:
        """The batch the next step runs. Synchronous: scheduled now, from every result so far. Asynchronous: the
        one scheduled when the previous step started (unless every request in it has since finished), and the
        batch after it is scheduled now, before this step's results, as EngineCore.step_with_batch_queue keeps
        two batches in flight (vllm/v1/engine/core.py, 0.32.0)."""
        ahead, self._ahead = self._ahead, None
        live = ahead is not None and any(r.state == RUNNING for r, _ in ahead.items)
        batch = ahead if ahead is not None and live else self.schedule()
        if self.async_scheduling and batch.items:
            self._ahead = self.schedule()
        return batch

    def step_seconds(self, batch: Batch) -> float:
        """How long `batch` takes: the step-time model's period, times the jitter's next factor when there is one
        (every engine loop, real-time or virtual, draws one a step, so one seed gives one run)."""
        dt = batch.seconds(self.step_model)
        return dt * self.jitter.factor() if self.jitter is not None else dt

    def schedule(self) -> Batch:
        """One V1 scheduler pass."""
        if self._has_aborted:
            self._drop_aborted()
        items: list[tuple[EngineRequest, int]] = []
        budget, num_decode, kv_read, attn, preempted = self._schedule_running(items)
        if not preempted:
            # V1 admits no waiting request in a pass that had to preempt: the blocks are that short
            admitted_kv_read, admitted_attn = self._schedule_waiting(items, budget)
            kv_read += admitted_kv_read
            attn += admitted_attn
        return Batch(items, num_decode, kv_read, attn)

    def _ends_in_flight(self, req: EngineRequest) -> bool:
        """Whether the token `req` has in flight is its last and the scheduler knows it (max_tokens or max_model_len
        reached; an EOS is not known until it is sampled): AsyncScheduler gives it no further step (the
        `num_output_placeholders` check in Scheduler.schedule, vllm/v1/core/sched/scheduler.py)."""
        out = req.num_output + req.pending
        return (out >= req.target_output and req.finish_reason == "length") or (
            req.prompt_len + out >= self.flags.max_model_len
        )

    def _schedule_running(self, items: list[tuple[EngineRequest, int]]) -> tuple[int, int, int, int, bool]:
        """The running requests first, in order, each taking what it still needs of the token budget; the budget
        left, decode count, KV tokens read, attention pairs, and whether any request was preempted."""
        bs = self.block_size
        budget = self.flags.max_num_batched_tokens
        num_decode = kv_read = attn = 0
        running = self.running
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            if req.pending and self._ends_in_flight(req):
                i += 1
                continue
            # computed = done + in flight; known = prompt + outputs + the ones in flight (0 and 0 when synchronous)
            c = req.num_computed + req.in_flight
            known = req.prompt_len + req.num_output + req.pending
            n = known - c
            if n > budget:
                n = budget
            need = (c + n + bs - 1) // bs - len(req.blocks)
            if need > 0 and not self.pool.allocate(need, req.blocks):
                preempted = True
                if not self._preempt_until_allocated(req, need):
                    break
            items.append((req, n))
            req.in_flight += n
            req.pending += int(c + n == known)
            budget -= n
            kv_read += c + n
            if n == 1:
                num_decode += 1
                attn += c + 1
            else:
                attn += n * c + n * (n + 1) // 2
            i += 1
        return budget, num_decode, kv_read, attn, preempted

    def _preempt_until_allocated(self, req: EngineRequest, need: int) -> bool:
        """Preempt from the back of the running list (the last admitted, V1's FCFS order) until `req` gets its
        `need` blocks; False if `req` itself had to go."""
        while True:
            victim = self.running.pop()
            self._preempt(victim)
            if victim is req:
                return False
            if self.pool.allocate(need, req.blocks):
                return True

    def _schedule_waiting(self, items: list[tuple[EngineRequest, int]], budget: int) -> tuple[int, int]:
        """Admit waiting requests in arrival order while the budget, max_num_seqs and the free blocks allow (the
        first that does not fit blocks the rest, as in V1); the KV tokens read and attention pairs they add.

        A request is admitted only if the free blocks hold its whole sequence, not just the first chunk
        (KVCacheManager.allocate_slots with full_sequence_must_fit=scheduler_reserve_full_isl, True by default in
        vLLM 0.32's SchedulerConfig; vllm/v1/core/kv_cache_manager.py): a long prompt waits rather than being
        admitted into blocks it would have to take from the running requests. Only its first chunk's blocks are
        taken now."""
        bs = self.block_size
        pool = self.pool
        waiting = self.waiting
        running = self.running
        max_seqs = self.flags.max_num_seqs
        max_len = self.flags.max_model_len
        chunked = self.flags.enable_chunked_prefill
        now = self.clock.now()
        kv_read = attn = 0
        while waiting and budget > 0 and len(running) < max_seqs:
            req = waiting[0]
            num_tokens = req.prompt_len + req.num_output
            hits: list[int] = []
            if self.caching and req.hashes:
                hits = pool.lookup(req.hashes, (num_tokens - 1) // bs)
            c = len(hits) * bs
            n = num_tokens - c
            if n > budget:
                if not chunked:
                    break
                n = budget
            whole = (min(num_tokens, max_len) + bs - 1) // bs - len(hits)
            if not pool.can_allocate(whole, hits):
                break
            need = (c + n + bs - 1) // bs - len(hits)
            self._admit(req, hits, need, num_tokens, now)
            items.append((req, n))
            req.in_flight = n
            req.pending = int(c + n == num_tokens)
            budget -= n
            kv_read += c + n
            attn += n * c + n * (n + 1) // 2
        return kv_read, attn

    def _admit(self, req: EngineRequest, hits: list[int], need: int, num_tokens: int, now: float) -> None:
        """Move the head of the waiting queue to running, on its cached blocks plus `need` fresh ones."""
        pool = self.pool
        c = len(hits) * self.block_size
        pool.touch(hits)
        req.blocks = hits
        pool.allocate(need, req.blocks)
        req.num_computed = c
        if self.caching:
            self.stats.prefix_queries += num_tokens
            self.stats.prefix_hits += c
            self.metrics.prefix_queries.inc(num_tokens)
            if c:
                self.metrics.prefix_hits.inc(c)
        self.waiting.popleft()
        req.state = RUNNING
        if req.first_scheduled is None:
            req.first_scheduled = now
        self.running.append(req)

    def complete(self, items: list[tuple[EngineRequest, int]], now: float) -> None:
        """Apply a finished step: advance each request, emit the sampled tokens, retire finished requests."""
        bs = self.block_size
        pool = self.pool
        metrics = self.metrics
        stats = self.stats
        max_len = self.flags.max_model_len
        itl = metrics.itl
        generated = prompt_tokens = 0
        any_finished = False
        for req, n in items:
            if req.state != RUNNING:
                continue
            c = req.num_computed
            new = c + n
            req.num_computed = new
            req.in_flight -= n
            hashes = req.hashes
            if hashes and c < len(hashes) * bs:
                for k in range(c // bs, min(new // bs, len(hashes))):
                    pool.register(req.blocks[k], hashes[k])
            if new < req.prompt_len + req.num_output:
                continue  # a prefill chunk: nothing sampled yet
            req.pending -= 1
            idx = req.num_output
            req.num_output = idx + 1
            generated += 1
            if idx == 0:
                req.first_token = now
                prompt_tokens += req.prompt_len
                metrics.ttft.observe(now - req.arrival)
            else:
                itl.observe(now - req.last_token)
            req.last_token = now
            if req.num_output >= req.target_output or req.prompt_len + req.num_output >= max_len:
                reason = req.finish_reason if req.num_output >= req.target_output else "length"
                req.state = FINISHED
                any_finished = True
                pool.free_blocks(req.blocks)
                req.sink.on_token(idx, reason)
                out = req.num_output
                metrics.finished(
                    reason,
                    now - req.arrival,
                    (req.first_scheduled or now) - req.arrival,
                    (now - req.first_token) / (out - 1) if out > 1 else None,
                    req.prompt_len,
                    out,
                )
                stats.finished += 1
            else:
                req.sink.on_token(idx, None)
        if any_finished:
            self.running = [r for r in self.running if r.state == RUNNING]
        if generated:
            stats.generation_tokens += generated
            metrics.generation_tokens.inc(generated)
        if prompt_tokens:
            stats.prompt_tokens += prompt_tokens
            metrics.prompt_tokens.inc(prompt_tokens)

    # -- the loop ------------------------------------------------------------------------------------------------

    async def run(self) -> None:
        clock = self.clock
        scale = clock.scale
        max_lag = _MAX_LAG_WALL_S * scale
        stats = self.stats
        base = clock.now()
        busy_mark: float | None = None
        self._stats_next = base + _STATS_INTERVAL_S
        while not self._stopped:
            if not self.running and not self.waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
                base = clock.now()
                busy_mark = None
                continue
            batch = self.begin_step()
            items = batch.items
            if not items:
                self._wakeup.clear()  # nothing can run until a request leaves or arrives
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), 0.05)
                base = clock.now()
                busy_mark = None
                continue
            if len(self.running) >= self.oom_running_threshold:
                self._runtime_oom()
                return
            dt = self.step_seconds(batch)
            deadline = base + dt
            delay = (deadline - clock.now()) / scale
            await asyncio.sleep(delay if delay > 0 else 0)
            if self._stopped:
                return
            now = clock.now()
            lag = now - deadline
            stats.steps += 1
            stats.model_busy_s += dt
            # real time of a busy stretch, measured end to end: a late wake-up caught up by the next step's
            # shorter sleep costs nothing
            stats.actual_busy_s += now - (busy_mark if busy_mark is not None else base)
            busy_mark = now
            if lag > max_lag:
                stats.late_steps += 1
                stats.lag_s += lag
                base = now
            else:
                base = deadline
            if lag > stats.max_lag_s:
                stats.max_lag_s = lag
            self.complete(items, deadline if lag <= max_lag else now)
            if self.crash_after_requests is not None and stats.finished >= self.crash_after_requests:
                self._injected_crash()
                return
            if self.log_stats and now >= self._stats_next:
                self._log_stats(now)

    def stop(self) -> None:
        self._stopped = True
        self._wakeup.set()

    def cut_all(self) -> None:
        """A fatal error: every open stream ends without its closing chunk."""
        for r in [*self.running, *self.waiting]:
            if r.state in (WAITING, RUNNING):
                r.state = ABORTED
                r.sink.on_cut()
        self.running = []
        self.waiting.clear()

    def _runtime_oom(self) -> None:
        n = len(self.running)
        # the graphs sit inside the budget (profiled at start-up): the sampler's buffers meet the bare headroom
        need = runtime_need_bytes(self.model, self.flags, n)
        message = cuda_oom_message(need, self.plan.total_bytes, max(0, self.plan.headroom_bytes))
        self.dead = True
        self._stopped = True
        self.on_fatal(
            "cuda_oom",
            [
                f"EngineCore encountered a fatal error with {n} running requests.",
                "Traceback (most recent call last):",
                '  File "vllm/v1/engine/core.py", line 701, in run_engine_core',
                "    engine_core.run_busy_loop()",
                '  File "vllm/v1/worker/gpu_model_runner.py", line 1593, in execute_model',
                "    logits = self.model.compute_logits(sample_hidden_states, None)",
                message,
            ],
        )

    def _injected_crash(self) -> None:
        self.dead = True
        self._stopped = True
        self.on_fatal(
            "crash",
            [
                "EngineCore encountered a fatal error.",
                "Traceback (most recent call last):",
                '  File "vllm/v1/engine/core.py", line 701, in run_engine_core',
                "    engine_core.run_busy_loop()",
                "RuntimeError: CUDA error: an illegal memory access was encountered",
                "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                "below might be incorrect.",
            ],
        )

    def _log_stats(self, now: float) -> None:
        s = self.stats
        last_t = self._stats_mark[4] or (now - _STATS_INTERVAL_S)
        span = max(1e-9, now - last_t)
        prompt_rate = (s.prompt_tokens - self._stats_mark[0]) / span
        gen_rate = (s.generation_tokens - self._stats_mark[1]) / span
        dq = s.prefix_queries - self._stats_mark[2]
        dh = s.prefix_hits - self._stats_mark[3]
        self._stats_mark = (s.prompt_tokens, s.generation_tokens, s.prefix_queries, s.prefix_hits, now)
        self._stats_next = now + _STATS_INTERVAL_S
        self.log.info(
            "loggers.py:123",
            f"Engine 000: Avg prompt throughput: {prompt_rate:.1f} tokens/s, Avg generation throughput: "
            f"{gen_rate:.1f} tokens/s, Running: {len(self.running)} reqs, Waiting: {len(self.waiting)} reqs, "
            f"GPU KV cache usage: {self.pool.usage * 100:.1f}%, Prefix cache hit rate: "
            f"{(dh / dq * 100) if dq else 0.0:.1f}%",
        )
