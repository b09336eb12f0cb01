"""vLLM's start-up arithmetic (tuner.capacity) against the formula and vLLM's messages."""

from __future__ import annotations

import math

import pytest

from tuner.capacity import (
    CUDA_OOM,
    INSUFFICIENT_FREE_MEMORY,
    INVALID_FLAGS,
    KV_CACHE_TOO_SMALL,
    NO_KV_MEMORY,
    plan_startup,
    runtime_need_bytes,
)
from tuner.catalog import get_gpu, load_model
from tuner.flags import VllmFlags, resolve

GIB = 1024**3
LLAMA = load_model("llama-3.1-8b")


def plan(gpu: str, mem_in_use: float = 0.0, **flags: object):  # type: ignore[no-untyped-def]
    g = get_gpu(gpu)
    return plan_startup(LLAMA, g, resolve(VllmFlags(**flags), g, LLAMA), mem_in_use)  # type: ignore[arg-type]


@pytest.mark.parametrize("gpu", ["rtx4090", "h100-80gb"])
def test_kv_tokens_follow_the_formula(gpu: str) -> None:
    p = plan(gpu, max_model_len=8192)
    assert p.ok
    g = get_gpu(gpu)
    requested = math.ceil(g.memory_bytes * 0.9)  # request_memory (vllm/v1/worker/utils.py, 0.32) rounds up
    assert p.requested_bytes == requested
    # the CUDA-graph estimate comes out of the budget too (Worker.determine_available_memory, 0.32)
    assert p.cuda_graph_bytes > 0
    assert p.available_kv_bytes == (
        requested - p.weights_bytes - p.activation_bytes - p.non_torch_bytes - p.cuda_graph_bytes
    )
    assert p.kv_bytes_per_token == 128 * 1024
    # whole 16-token blocks of 128 KiB tokens
    assert p.kv_tokens == (p.available_kv_bytes // (16 * 128 * 1024)) * 16
    assert p.kv_tokens % 16 == 0
    assert p.max_concurrency == pytest.approx(p.kv_tokens / 8192)


def test_rtx4090_llama8b_kv_capacity_is_in_the_published_range() -> None:
    p = plan("rtx4090", max_model_len=8192)
    assert 30_000 <= p.kv_tokens <= 42_000
    assert 14.9 < p.weights_bytes / GIB < 15.1


def test_default_max_model_len_does_not_fit_an_rtx4090() -> None:
    p = plan("rtx4090")
    assert p.reason == KV_CACHE_TOO_SMALL
    # every block but the null one (check_enough_kv_cache_memory, 0.32): one block short of the KV tokens
    assert p.estimated_max_model_len == p.kv_tokens - 16
    assert p.message is not None
    assert "the model's max seq len (131072)" in p.message
    assert "16.0 GiB KV cache is needed" in p.message
    assert f"the estimated maximum model length is {p.kv_tokens - 16}." in p.message


def test_h100_serves_the_full_context() -> None:
    p = plan("h100-80gb")
    assert p.ok and p.kv_tokens > 131072


def test_more_batched_tokens_leave_less_kv() -> None:
    small = plan("h100-80gb", max_model_len=8192, max_num_batched_tokens=2048)
    big = plan("h100-80gb", max_model_len=8192, max_num_batched_tokens=16384)
    assert big.activation_bytes > small.activation_bytes
    assert big.kv_tokens < small.kv_tokens


def test_memory_in_use_by_others_refuses_the_start_with_vllms_message() -> None:
    p = plan("rtx4090", mem_in_use=4.0, max_model_len=8192)
    assert p.reason == INSUFFICIENT_FREE_MEMORY
    assert p.message is not None
    assert p.message.startswith("Free memory on device (19.64/23.64 GiB) on startup is less than desired")
    assert "(0.9, 21.28 GiB)" in p.message


def test_low_utilization_leaves_no_kv_memory() -> None:
    p = plan("rtx4090", gpu_memory_utilization=0.6, max_model_len=8192)
    assert p.reason == NO_KV_MEMORY


def test_invalid_flags_use_vllms_words() -> None:
    p = plan("h100-80gb", max_num_seqs=512, max_num_batched_tokens=256)
    assert p.reason == INVALID_FLAGS
    assert p.message == "max_num_batched_tokens (256) must be greater than or equal to max_num_seqs (512)."
    p = plan("h100-80gb", max_model_len=200_000)
    assert p.reason == INVALID_FLAGS and p.message is not None
    assert p.message.startswith("User-specified max_model_len (200000) is greater than the derived max_model_len")


def test_the_last_percent_of_utilization_runs_out_of_headroom_under_load() -> None:
    # The graphs are inside the budget (0.32): 0.99 starts, and only the sampler's buffers of many running
    # requests outgrow the 1% left; all of the memory leaves nothing for capture at all.
    assert plan("rtx4090", gpu_memory_utilization=1.0, max_model_len=8192).reason == CUDA_OOM
    risky = plan("rtx4090", gpu_memory_utilization=0.99, max_model_len=8192)
    assert risky.ok
    g = get_gpu("rtx4090")
    flags = resolve(VllmFlags(gpu_memory_utilization=0.99, max_model_len=8192), g, LLAMA)
    assert runtime_need_bytes(LLAMA, flags, 1) < risky.headroom_bytes < runtime_need_bytes(LLAMA, flags, 256)
    safe = plan("rtx4090", gpu_memory_utilization=0.98, max_model_len=8192)
    assert runtime_need_bytes(LLAMA, flags, 256) < safe.headroom_bytes


def test_tensor_parallel_splits_weights_and_kv() -> None:
    seventy = load_model("llama-3.1-70b")
    g = get_gpu("h100-80gb")
    one = plan_startup(seventy, g, resolve(VllmFlags(max_model_len=8192), g, seventy))
    assert one.reason in (NO_KV_MEMORY, CUDA_OOM)  # 131 GiB of weights on an 80 GB card
    tp2 = VllmFlags(max_model_len=8192, tensor_parallel_size=2, gpu_memory_utilization=0.95)
    two = plan_startup(seventy, g, resolve(tp2, g, seventy))
    assert two.ok
    assert two.kv_bytes_per_token == 320 * 1024 // 2
