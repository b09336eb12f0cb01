"""Spend no GPU time on what cannot start: predict a start from the model's config and the GPU, before launching.

The prediction is `tuner.capacity.plan_startup` (vLLM's own start-up arithmetic). Our activation and non-torch
figures are estimates, so once real starts have been seen the predicted KV memory is scaled by what the servers
logged (`observed KV tokens / predicted KV tokens`, median over the starts seen): a GPU whose driver keeps more or less
memory than we assume corrects the filter after one start. Refusals that do not depend on the KV estimate (bad flags,
not enough free memory, weights that do not fit) are taken as they are.

A small margin lets borderline flag sets through: a wrong "cannot start" loses a candidate for the whole night, a
wrong "can start" costs one failed launch.

A model whose architecture the arithmetic does not know (`ModelProfile.predictable` False) gets no prediction: its
flag sets are checked for vLLM's argument rules only and launched, so the servers measure what the arithmetic cannot.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, replace
from typing import Any

from tuner.capacity import (
    CUDA_OOM,
    INVALID_FLAGS,
    KV_CACHE_TOO_SMALL,
    NO_KV_MEMORY,
    StartupPlan,
    cuda_oom_message,
    plan_startup,
    startup_headroom_short,
)
from tuner.catalog.gpus import GpuProfile
from tuner.catalog.models import ModelProfile
from tuner.flags import VllmFlags, resolve, validate

DEFAULT_MARGIN = 0.03
NO_PREDICTION = "no prediction: launched to measure"


@dataclass(frozen=True)
class Prediction:
    """Whether a flag set is predicted to start, with vLLM's reason and message when not."""

    ok: bool
    reason: str | None
    message: str | None
    kv_tokens: int  # calibrated
    raw_kv_tokens: int  # plan_startup's own figure, before calibration
    max_concurrency: float
    kv_scale: float
    estimated_max_model_len: int | None = None
    predicted: bool = True  # False: the arithmetic does not know the model; `message` says so
    memory_in_use_gib: float = 0.0  # what other processes held on the server's GPUs, taken out of their free memory

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """One line for people: the verdict and its figures, or why there is none."""
        if not self.predicted:
            return self.message or NO_PREDICTION
        if self.ok:
            return f"starts, {self.kv_tokens:,} KV tokens"
        return f"predicted not to start: {self.reason}"


class FeasibilityModel:
    """plan_startup, calibrated by the start-up facts of the servers seen so far."""

    def __init__(
        self, gpu: GpuProfile, model: ModelProfile, *, memory_in_use_gib: float = 0.0, margin: float = DEFAULT_MARGIN
    ) -> None:
        self.gpu = gpu
        self.model = model
        self.memory_in_use_gib = memory_in_use_gib
        self.margin = margin
        self._ratios: list[float] = []

    @property
    def kv_scale(self) -> float:
        """Observed / predicted KV tokens, median of the starts seen (1.0 before any)."""
        return statistics.median(self._ratios) if self._ratios else 1.0

    @property
    def observations(self) -> int:
        return len(self._ratios)

    def reset(self) -> None:
        self._ratios.clear()

    def observe(self, predicted_raw_kv_tokens: int | None, observed_kv_tokens: int | None) -> None:
        """Learn from one start: the KV tokens the server logged against plan_startup's raw figure."""
        if predicted_raw_kv_tokens and observed_kv_tokens and predicted_raw_kv_tokens > 0 and observed_kv_tokens > 0:
            self._ratios.append(observed_kv_tokens / predicted_raw_kv_tokens)

    def plan(self, flags: VllmFlags) -> StartupPlan:
        return plan_startup(self.model, self.gpu, resolve(flags, self.gpu, self.model), self.memory_in_use_gib)

    def predict(self, flags: VllmFlags, *, memory_in_use_gib: float | None = None) -> Prediction:
        """Whether `flags` start; `memory_in_use_gib`: what other processes hold on the GPUs the server will have
        (read just before its start), else the figure the model was made with."""
        in_use = self.memory_in_use_gib if memory_in_use_gib is None else memory_in_use_gib
        return replace(self._predict(flags, in_use), memory_in_use_gib=in_use)

    def _predict(self, flags: VllmFlags, in_use: float) -> Prediction:
        resolved = resolve(flags, self.gpu, self.model)
        count = self.gpu.count
        if count is not None and resolved.tensor_parallel_size > count:
            message = (
                f"tensor_parallel_size ({resolved.tensor_parallel_size}) needs more GPUs than the {count} "
                f"{self.gpu.device_name} this machine has"
            )
            return Prediction(False, INVALID_FLAGS, message, 0, 0, 0.0, self.kv_scale)
        if not self.model.predictable:
            invalid = validate(resolved, self.model)
            if invalid:
                return Prediction(False, INVALID_FLAGS, invalid, 0, 0, 0.0, 1.0)
            why = f" ({self.model.unknown_reason})" if self.model.unknown_reason else ""
            return Prediction(True, None, NO_PREDICTION + why, 0, 0, 0.0, 1.0, predicted=False)
        plan = plan_startup(self.model, self.gpu, resolved, in_use)
        scale = self.kv_scale
        block = resolved.block_size
        raw = plan.kv_tokens
        calibrated = int(raw * scale) // block * block
        need = plan.max_model_len or resolved.max_model_len  # `auto`: what the start fits
        concurrency = calibrated / need if need > 0 else 0.0

        def verdict(reason: str | None, message: str | None, est: int | None = None) -> Prediction:
            return Prediction(reason is None, reason, message, calibrated, raw, concurrency, scale, est)

        if plan.reason not in (None, KV_CACHE_TOO_SMALL):
            return verdict(plan.reason, plan.message, plan.estimated_max_model_len)
        if plan.available_kv_bytes * scale <= 0:
            return verdict(NO_KV_MEMORY, plan.message or "No available memory for the cache blocks.")
        if calibrated * (1 + self.margin) < need:
            if plan.reason == KV_CACHE_TOO_SMALL and not self._ratios:
                return verdict(plan.reason, plan.message, plan.estimated_max_model_len)
            return verdict(
                KV_CACHE_TOO_SMALL,
                f"predicted: the KV cache holds about {calibrated} tokens (x{scale:.3f} calibration from "
                f"{self.observations} start(s)), fewer than max_model_len {need}; vLLM would refuse to start. "
                f"Estimated maximum model length: {calibrated}.",
                calibrated,
            )
        if plan.reason == KV_CACHE_TOO_SMALL and startup_headroom_short(plan):
            # plan_startup stopped at the KV check; the headroom check after it still applies.
            return verdict(CUDA_OOM, cuda_oom_message(0, plan.total_bytes, max(0, plan.headroom_bytes)))
        return verdict(None, None)


__all__ = ["DEFAULT_MARGIN", "NO_PREDICTION", "FeasibilityModel", "Prediction"]
