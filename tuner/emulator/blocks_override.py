"""`--num-gpu-blocks-override N`: vLLM sizes the KV cache at N blocks whatever the memory says, then checks that one
request of max_model_len fits (vllm/v1/core/kv_cache_utils.py: may_override_num_blocks, and get_kv_cache_configs,
which hands the overridden size to _check_enough_kv_cache_memory). The way to make a small KV cache, and
preemption, on any machine."""

from __future__ import annotations

import dataclasses

from tuner.capacity import KV_CACHE_TOO_SMALL, StartupPlan, kv_too_small_message
from tuner.flags import ResolvedFlags

__all__ = ["override_blocks"]


def override_blocks(plan: StartupPlan, blocks: int | None, flags: ResolvedFlags) -> StartupPlan:
    if blocks is None or not plan.ok:
        return plan
    tokens = blocks * flags.block_size
    available = blocks * flags.block_size * plan.kv_bytes_per_token
    out = dataclasses.replace(
        plan,
        num_gpu_blocks=blocks,
        kv_tokens=tokens,
        available_kv_bytes=available,
        max_concurrency=tokens / flags.max_model_len,
    )
    if tokens >= flags.max_model_len:
        return out
    # vLLM estimates the longest length that fits a block short of the whole pool (its binary search over lengths
    # whose blocks, rounded up, fit)
    est = max(0, (blocks - 1) * flags.block_size)
    needed = flags.max_model_len * plan.kv_bytes_per_token
    message = kv_too_small_message(flags.max_model_len, needed, available, est)
    return dataclasses.replace(out, reason=KV_CACHE_TOO_SMALL, message=message, estimated_max_model_len=est)
