"""The engine with vLLM's per-step and per-request-phase metrics (vllm/v1/metrics/stats.py: IterationStats,
FinishedRequestStats): tokens per engine step, the prefill/decode/inference split, preemptions and the cached part
of each prompt. Kept beside the engine, not in it, so the scheduler's hot loop stays what the twin runs."""

from __future__ import annotations

from typing import Any

from tuner.emulator.engine import FINISHED, Engine, EngineRequest
from tuner.emulator.metrics import EmulatorMetrics


class MeteredEngine(Engine):
    metrics: EmulatorMetrics

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._preempted: dict[str, int] = {}
        self._cached: dict[str, int] = {}

    def complete(self, items: list[tuple[EngineRequest, int]], now: float) -> None:
        cached = self._cached
        scheduled = 0
        for req, n in items:
            scheduled += n
            if req.num_output == 0 and req.request_id not in cached:
                cached[req.request_id] = req.num_computed  # at its first step: the prefix-cache hit
        metrics = self.metrics
        metrics.iteration_tokens.observe(scheduled)
        finished = self.stats.finished
        super().complete(items, now)
        if self.stats.finished == finished:
            return  # most steps finish nothing: no second pass over the batch
        for req, _ in items:
            # still cached: not reported yet (an EOS that finished a step earlier can be in this batch, its wasted
            # decode under asynchronous scheduling)
            if req.state == FINISHED and req.first_token is not None and req.request_id in cached:
                hit = cached.pop(req.request_id)
                start = req.first_scheduled if req.first_scheduled is not None else req.arrival
                metrics.phases(
                    req.first_token - start,
                    now - req.first_token,
                    self._preempted.pop(req.request_id, 0),
                    req.prompt_len - hit,
                    hit,
                )

    def _preempt(self, victim: EngineRequest) -> None:
        self._preempted[victim.request_id] = self._preempted.get(victim.request_id, 0) + 1
        super()._preempt(victim)

    def abort(self, req: EngineRequest) -> None:
        self._cached.pop(req.request_id, None)
        self._preempted.pop(req.request_id, None)
        super().abort(req)
