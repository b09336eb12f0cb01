"""The engine without HTTP: step-time calibration, the V1 scheduler's preemptions, the KV pool, prefix caching."""

from __future__ import annotations

import pytest

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.emulator.engine import output_length
from tuner.emulator.kv_pool import KvBlockPool, block_hashes
from tuner.emulator.simulate import simulate_closed_loop
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import ConfigError
from tuner.flags import VllmFlags, resolve

LLAMA = load_model("llama-3.1-8b")
# The GPU targets below and their sources (published, derived from datasheets, or none): benchmarks/data/
# gpu_step_time_sources.json, checked against the model in test_gpu_step_time_sources.py.
H100 = get_gpu("h100-80gb")
RTX4090 = get_gpu("rtx4090")
FLAGS = VllmFlags(max_model_len=8192)


def _step_model(gpu_name: str, model_name: str = "llama-3.1-8b", **flags: object) -> StepTimeModel:
    gpu, model = get_gpu(gpu_name), load_model(model_name)
    return StepTimeModel.build(model, gpu, resolve(VllmFlags(max_model_len=8192, **flags), gpu, model))  # type: ignore[arg-type]


def test_decode_step_time_is_calibrated() -> None:
    h100 = _step_model("h100-80gb")
    assert 5e-3 <= h100.decode_step_seconds(1, 640) <= 8e-3
    assert 6.2e-3 <= h100.decode_step_seconds(16, 640) <= 13e-3  # AIC: 6.9-7.5 ms at 512-1k
    rtx = _step_model("rtx4090")
    assert 55 <= 1 / rtx.decode_step_seconds(1, 640) <= 60
    # memory-bound decode: 64x the batch costs far less than 64x the time
    assert h100.decode_step_seconds(64, 640) < 3 * h100.decode_step_seconds(1, 640)
    # compute-bound prefill: about linear in tokens
    assert h100.prefill_seconds(4096) > 6 * h100.prefill_seconds(512)


def test_step_time_shape_follows_hardware_and_flags() -> None:
    base = _step_model("h100-80gb").decode_step_seconds(1, 640)
    assert _step_model("h100-80gb", enforce_eager=True).decode_step_seconds(1, 640) > base * 1.2
    assert _step_model("h100-80gb", tensor_parallel_size=2).decode_step_seconds(1, 640) < base * 0.75
    awq = _step_model("h100-80gb", "llama-3.1-8b-awq")
    assert awq.decode_step_seconds(1, 640) < base * 0.75  # fewer weight bytes to stream
    assert awq.prefill_seconds(2048) > _step_model("h100-80gb").prefill_seconds(2048)  # dequantising costs
    assert _step_model("a100-40gb").decode_step_seconds(1, 640) > base * 1.5


def test_simulated_closed_loop_tpot_matches_the_targets() -> None:
    one = simulate_closed_loop(LLAMA, H100, FLAGS, concurrency=1, input_len=512, output_len=256, requests=2)
    assert 5e-3 <= one.tpot_mean_s <= 8e-3
    sixteen = simulate_closed_loop(LLAMA, H100, FLAGS, concurrency=16, input_len=512, output_len=256)
    assert 6.2e-3 <= sixteen.tpot_mean_s <= 13e-3
    assert sixteen.output_tok_s > 10 * one.output_tok_s  # batching pays
    rtx = simulate_closed_loop(LLAMA, RTX4090, FLAGS, concurrency=1, input_len=512, output_len=256, requests=2)
    assert 55 <= 1 / rtx.tpot_mean_s <= 60


def test_large_batch_peak_is_of_the_order_of_ten_thousand_tokens_per_second() -> None:
    peak = simulate_closed_loop(LLAMA, H100, FLAGS, concurrency=512, input_len=512, output_len=256, requests=512)
    assert 6_500 <= peak.output_tok_s <= 13_000
    assert peak.preemptions == 0


def test_oversubscribed_kv_cache_preempts_and_still_finishes() -> None:
    # ~3k tokens of KV (the CUDA graphs' 0.69 GiB taken out) for 16 requests that need 16 x 700 at their end
    flags = VllmFlags(max_model_len=2048, gpu_memory_utilization=0.74, max_num_batched_tokens=2048)
    assert plan_startup(LLAMA, RTX4090, resolve(flags, RTX4090, LLAMA)).kv_tokens < 16 * 700 / 2
    result = simulate_closed_loop(LLAMA, RTX4090, flags, concurrency=16, input_len=500, output_len=200, requests=32)
    assert result.requests == 32
    assert result.preemptions > 0
    roomy = simulate_closed_loop(LLAMA, H100, flags, concurrency=16, input_len=500, output_len=200, requests=32)
    assert roomy.preemptions == 0
    assert roomy.e2e_mean_s < result.e2e_mean_s


def test_max_num_seqs_caps_the_batch() -> None:
    wide = simulate_closed_loop(LLAMA, H100, FLAGS, concurrency=64, input_len=128, output_len=128, requests=64)
    narrow = simulate_closed_loop(
        LLAMA,
        H100,
        VllmFlags(max_model_len=8192, max_num_seqs=8),
        concurrency=64,
        input_len=128,
        output_len=128,
        requests=64,
    )
    assert narrow.output_tok_s < wide.output_tok_s / 3
    assert narrow.ttft_mean_s > wide.ttft_mean_s * 3  # the rest queue


def test_prefix_caching_saves_prefill() -> None:
    kwargs = dict(concurrency=4, input_len=2048, output_len=16, requests=16, shared_prefix_len=1536)
    cached = simulate_closed_loop(LLAMA, RTX4090, FLAGS, **kwargs)  # type: ignore[arg-type]
    uncached = simulate_closed_loop(
        LLAMA, RTX4090, VllmFlags(max_model_len=8192, enable_prefix_caching=False), **kwargs
    )  # type: ignore[arg-type]
    assert cached.ttft_mean_s < uncached.ttft_mean_s * 0.7


def test_flags_that_do_not_start_are_refused() -> None:
    with pytest.raises(ConfigError, match="estimated maximum model length"):
        simulate_closed_loop(LLAMA, RTX4090, VllmFlags(), concurrency=1, input_len=8, output_len=8)


def test_kv_pool_allocates_frees_and_shares_prefix_blocks() -> None:
    pool = KvBlockPool(num_blocks=4, block_size=16, enable_caching=True)
    blocks: list[int] = []
    assert pool.allocate(3, blocks) and pool.num_free == 1
    assert not pool.allocate(2, blocks) and len(blocks) == 3  # all or nothing
    hashes = block_hashes(list(range(48)), 16)
    for b, h in zip(blocks, hashes, strict=True):
        pool.register(b, h)
    pool.free_blocks(blocks)
    assert pool.num_free == 4 and pool.usage == 0.0
    hits = pool.lookup(block_hashes(list(range(40)), 16), max_blocks=3)  # same first two blocks
    assert len(hits) == 2
    assert pool.can_allocate(2, hits) and not pool.can_allocate(3, hits)
    pool.touch(hits)
    assert pool.num_free == 2
    assert block_hashes([1] * 16, 16) != block_hashes([2] * 16, 16)
    assert len(block_hashes(list(range(47)), 16)) == 2  # only full blocks


def test_output_lengths() -> None:
    assert output_length(0, [1, 2, 3], 50, 0, True, None) == (50, "length")
    lengths = [output_length(0, [i, 7, 9], 400, 20, False, None) for i in range(200)]
    assert all(20 <= n <= 400 for n, _ in lengths)
    assert {r for _, r in lengths} == {"stop", "length"}
    assert all(n == 400 for n, r in lengths if r == "length")
    assert len({n for n, _ in lengths}) > 50  # a spread, not one fixed value
    assert output_length(0, [5, 7, 9], 400, 0, False, None) == output_length(0, [5, 7, 9], 400, 0, False, None)
    assert output_length(3, [5, 7, 9], 400, 0, False, 11) == output_length(3, [5, 7, 9], 400, 0, False, 11)


def test_a_waiting_request_is_admitted_only_when_its_whole_prompt_fits() -> None:
    """vLLM 0.32 checks the blocks of the whole sequence before admitting (scheduler_reserve_full_isl, on by
    default): with 100 usable blocks, two 1,000-token prompts (63 blocks each) run one after the other instead of
    the second being let in on its first chunk and preempted when both have grown past the pool."""
    block = 16 * 128 * 1024  # 16 tokens of Llama-3.1-8B's 128 KiB
    flags = VllmFlags(max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=2,
                      kv_cache_memory_bytes=101 * block)  # fmt: skip
    assert plan_startup(LLAMA, H100, resolve(flags, H100, LLAMA)).num_gpu_blocks == 101  # one is the null block
    result = simulate_closed_loop(LLAMA, H100, flags, concurrency=2, input_len=1000, output_len=16, requests=4)
    assert result.requests == 4
    assert result.preemptions == 0
    # one at a time: the second's first token waits for the whole first request
    assert result.ttft_mean_s > 0.5 * result.e2e_mean_s
