"""`--num-gpu-blocks-override N`: vLLM sizes the KV cache at N blocks whatever the memory says, then checks that one
request of max_model_len fits (vllm/v1/core/kv_cache_utils.py: may_override_num_blocks, and get_kv_cache_configs,
which hands the overridden size to _check_enough_kv_cache_memory). The way to make a small KV cache, and
preemption, on any machine."""

from __future__ import annotations

import dataclasses

from tuner.capacity import GIB, KV_CACHE_TOO_SMALL, StartupPlan
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
    message = (
        f"To serve at least one request with the model's max seq len ({flags.max_model_len}), "
        f"({needed / GIB:.2f} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({available / GIB:.2f} GiB). Based on the available memory, the estimated maximum model length is {est}. "
        "Try increasing `gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine. "
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )
    return dataclasses.replace(out, reason=KV_CACHE_TOO_SMALL, message=message, estimated_max_model_len=est)
