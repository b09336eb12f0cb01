"""The KV arithmetic per architecture, on published config.json files (tests/catalog/data/SOURCES.md), against the
formula in vLLM 0.32's source for each. The expected figures are written out by hand from that formula.

| architecture | per layer, per token (bf16) | vLLM source |
|---|---|---|
| dense GQA | kv_heads x (head_dim K + head_dim V) x 2 | AttentionSpec.state_content_size_bytes; FullAttentionSpec |
| no sliding_window (null) | every layer full attention | FullAttentionSpec (Attention's per-layer window None) |
| explicit head_dim | the config's head_dim, not hidden / heads | ModelArchConfigConvertor.get_head_size |
| MoE | as dense: experts change the weights, not the KV | (no MoE term in any KVCacheSpec) |
| MLA | 1 x (kv_lora_rank + qk_rope_head_dim) x 2, no V, every rank | MLAAttentionSpec; get_num_kv_heads |
| FP8 weights | the KV in the model dtype (kv_cache_dtype auto) | CacheConfig.cache_dtype "auto" |
| sliding window | as dense, but a request holds cdiv(min(w-1+in-flight, len), 16)+1 blocks | SlidingWindowSpec |
| hybrid groups | group size = the smaller kind's layer count; a block = group size layers | get_kv_cache_groups |
| fp8 KV | 1 byte instead of 2 | --kv-cache-dtype fp8 |
| multimodal | the language model's text_config | ModelConfig.hf_text_config |
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from tuner.capacity import kv_pool
from tuner.catalog.architectures import LayerGroup, read_architecture
from tuner.catalog.models import ModelProfile
from tuner.flags import ResolvedFlags

GIB = 1024**3
DATA = Path(__file__).parent / "data"


def config(name: str) -> dict[str, Any]:
    data = json.loads((DATA / "configs" / f"{name}.json").read_text())
    assert isinstance(data, dict)
    return data


def model(name: str) -> ModelProfile:
    return ModelProfile.from_config(name, config(name))


def flags(max_model_len: int = 8192, tp: int = 1, batched: int = 2048, kv: str = "auto") -> ResolvedFlags:
    return ResolvedFlags(
        max_num_seqs=256,
        max_model_len=max_model_len,
        gpu_memory_utilization=0.9,
        max_num_batched_tokens=batched,
        tensor_parallel_size=tp,
        kv_cache_dtype=kv,
        block_size=16,
        enable_chunked_prefill=True,
        enable_prefix_caching=True,
        enforce_eager=False,
    )


def tokens_per_gib(m: ModelProfile, f: ResolvedFlags) -> int:
    pool = kv_pool(m, f)
    return pool.tokens(GIB // pool.block_bytes, f.max_model_len)


# name, KV bytes a token (all layers, one GPU, bf16), KV tokens in 1 GiB at max_model_len 8192, the formula
TABLE = [
    ("meta-llama--Llama-3.1-8B", 2 * 32 * 8 * 128 * 2, 512 * 16, "dense GQA: 2 x 32 layers x 8 heads x 128"),
    (
        "Qwen--Qwen2.5-7B",
        2 * 28 * 4 * 128 * 2,
        1170 * 16,
        "dense GQA; its sliding_window is unused",
    ),
    ("Qwen--Qwen3-8B", 2 * 36 * 8 * 128 * 2, 455 * 16, "explicit head_dim 128"),
    ("Qwen--Qwen3-30B-A3B", 2 * 48 * 4 * 128 * 2, 682 * 16, "MoE: 128 experts, the KV of 48 layers x 4 heads"),
    ("moonshotai--Kimi-K2-Instruct", 61 * (512 + 64) * 2, 954 * 16, "MLA: one 576-wide latent a layer"),
    ("Qwen--Qwen3-VL-235B-A22B-Thinking", 2 * 94 * 4 * 128 * 2, 348 * 16, "multimodal: text_config's 94 layers"),
    (
        "mistralai--Mistral-7B-Instruct-v0.3",
        2 * 32 * 8 * 128 * 2,
        512 * 16,
        "dense GQA; sliding_window null, so every layer is full attention",
    ),
    ("mistralai--Mixtral-8x7B-v0.1", 2 * 32 * 8 * 128 * 2, 512 * 16, "MoE: 8 experts, the KV of 32 layers x 8 heads"),
    ("deepseek-ai--DeepSeek-V2-Lite", 27 * (512 + 64) * 2, 2157 * 16, "MLA: one 576-wide latent a layer, no q LoRA"),
    ("deepseek-ai--DeepSeek-V3", 61 * (512 + 64) * 2, 954 * 16, "MLA; FP8 weights, the KV in bf16 (dtype auto)"),
]


@pytest.mark.parametrize(("name", "per_token", "per_gib", "why"), TABLE, ids=[t[0] for t in TABLE])
def test_kv_bytes_and_tokens_per_gib_follow_vllms_formula(name: str, per_token: int, per_gib: int, why: str) -> None:
    m = model(name)
    assert m.predictable, why
    assert m.kv_bytes_per_token_per_gpu(None, 1) == per_token, why
    # whole 16-token blocks of the whole model's layers
    assert GIB // (16 * per_token) * 16 == per_gib
    assert tokens_per_gib(m, flags()) == per_gib, why


def test_explicit_head_dim_wins_over_hidden_over_heads() -> None:
    gemma = read_architecture(config("google--gemma-2-2b-it"))
    assert gemma.head_dim == 256 and 2304 // 8 == 288  # hidden / heads would say 288


def test_mla_latent_is_one_per_layer_and_the_same_on_every_rank() -> None:
    kimi = model("moonshotai--Kimi-K2-Instruct")
    assert kimi.mla is not None
    assert kimi.layer_groups == (LayerGroup(61, 1, 576, 0, None, latent=True),)
    # MQA-like: tensor parallelism does not split it (get_num_kv_heads returns 1 under MLA)
    assert kimi.kv_bytes_per_token_per_gpu(None, 8) == 61 * 576 * 2
    # not the plain-attention reading of the same config: 64 KV heads of hidden / heads = 112, K and V
    assert kimi.kv_bytes_per_token() * 20 < 2 * 61 * 64 * 112 * 2


def test_gqa_heads_split_over_ranks_but_never_below_one() -> None:
    llama = model("meta-llama--Llama-3.1-8B")
    assert llama.kv_bytes_per_token_per_gpu(None, 2) == 2 * 32 * 4 * 128 * 2
    qwen = model("Qwen--Qwen2.5-7B")  # 4 KV heads over 8 ranks: each keeps one (replicated)
    assert qwen.kv_bytes_per_token_per_gpu(None, 8) == 2 * 28 * 1 * 128 * 2


def test_fp8_kv_cache_halves_the_bytes() -> None:
    llama = model("meta-llama--Llama-3.1-8B")
    assert llama.kv_bytes_per_token_per_gpu(1, 1) == 65536
    assert tokens_per_gib(llama, flags(kv="fp8")) == 1024 * 16
    kimi = model("moonshotai--Kimi-K2-Instruct")
    assert kimi.kv_bytes_per_token_per_gpu(1, 1) == 61 * 576


def test_gemma2_sliding_window_layers_group_as_vllm_groups_them() -> None:
    """26 layers: even ones slide over 4096 tokens, odd ones are global (Gemma2Config.layer_types)."""
    gemma = model("google--gemma-2-2b-it")
    assert gemma.layer_groups == (LayerGroup(13, 4, 256, 256, None), LayerGroup(13, 4, 256, 256, 4096))
    f = flags(max_model_len=8192, batched=512)
    pool = kv_pool(gemma, f)
    layer_page = 16 * 4 * (256 + 256) * 2  # one layer's block: 16 tokens x 4 heads x (K+V) x bf16
    assert pool.block_bytes == 13 * layer_page  # 13 full + 13 sliding: group size 13, one group each
    assert pool.windows == (None, 4096)
    blocks = GIB // (13 * layer_page)
    assert blocks == 1260
    # a request of 8192: 512 blocks in the full group; in the sliding one the window and two batches in flight
    # (async scheduling): cdiv(min(4095 + 2 x 512, 8192), 16) + 1 = 321
    assert pool.blocks_per_request(8192) == 512 + 321
    assert pool.tokens(blocks, 8192) == int(1260 / 833 * 8192) == 12391
    # more than the 10,080 a full-attention reading of the same layers would promise
    assert pool.tokens(blocks, 8192) > GIB // (16 * gemma.kv_bytes_per_token()) * 16
    # --no-async-scheduling: one batch in flight (VllmConfig.max_concurrent_batches), cdiv(4095 + 512, 16) + 1 = 289
    synchronous = kv_pool(gemma, dataclasses.replace(f, async_scheduling=False))
    assert synchronous.blocks_per_request(8192) == 512 + 289


def test_sliding_window_is_cached_whole_on_the_cpu_build() -> None:
    """vLLM's CPU platform has no hybrid KV manager: sliding layers become full ones (unify_hybrid_kv_cache_specs)."""
    gemma = model("google--gemma-2-2b-it")
    pool = kv_pool(gemma, flags(), cpu=True)
    assert pool.windows == (None,)
    assert pool.block_bytes == 16 * 26 * 4 * 512 * 2


def test_the_estimated_longest_request_fits_and_one_more_token_does_not() -> None:
    gemma = model("google--gemma-2-2b-it")
    pool = kv_pool(gemma, flags(max_model_len=8192, batched=512))
    available = 300 * pool.block_bytes
    longest = pool.longest_fitting(available, 8192)
    assert pool.needed_bytes(longest) <= available < pool.needed_bytes(longest + 1)


def test_moe_weights_count_every_expert() -> None:
    qwen = model("Qwen--Qwen3-30B-A3B")
    assert qwen.moe is not None and qwen.moe.num_experts == 128 and qwen.moe.moe_layers == 48
    assert 30.0e9 < qwen.num_params < 31.0e9  # published: 30.5B total
    assert 3.0e9 < qwen.active_params < 3.6e9  # published: 3.3B activated
    kimi = model("moonshotai--Kimi-K2-Instruct")
    assert kimi.num_params == pytest.approx(1.04e12, rel=0.03)  # published: 1T total, 32B activated
    assert kimi.active_params == pytest.approx(32e9, rel=0.05)


def test_multimodal_reads_the_language_model() -> None:
    vl = model("Qwen--Qwen3-VL-235B-A22B-Thinking")
    assert vl.multimodal and vl.num_layers == 94 and vl.max_position_embeddings == 262144
    assert vl.dtype == "bfloat16"


def test_quantization_configs_as_published() -> None:
    blocks = json.loads((DATA / "quantization_configs.json").read_text())
    llama = config("meta-llama--Llama-3.1-8B")
    awq = ModelProfile.from_config("awq", {**llama, "quantization_config": blocks["TheBloke/zephyr-7B-alpha-AWQ"]})
    assert (awq.quantization, awq.quant_bits) == ("awq", 4)
    fp8 = ModelProfile.from_config(
        "fp8", {**llama, "quantization_config": blocks["nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf"]}
    )
    assert (fp8.quantization, fp8.quant_bits) == ("compressed-tensors", 8)
    # transformers' guide measured that checkpoint's parameters at 8.4575 GiB: fp8 linears, bf16 embeddings
    assert fp8.weight_bytes / GIB == pytest.approx(8.4575, abs=0.001)
    assert awq.weight_bytes < fp8.weight_bytes < ModelProfile.from_config("bf16", llama).weight_bytes


def test_float32_checkpoints_are_served_in_16_bits() -> None:
    qwen = config("Qwen--Qwen3-8B")
    as_fp32 = ModelProfile.from_config("fp32", {**qwen, "torch_dtype": "float32"}, checkpoint_bytes=2 * 16381470720)
    assert as_fp32.dtype_bytes == 2 and as_fp32.weight_bytes == 16381470720


def test_linear_attention_is_not_predicted_but_loads() -> None:
    nxt = model("Qwen--Qwen3-Next-80B-A3B-Thinking")
    assert not nxt.predictable
    assert nxt.unknown_reason is not None and "qwen3_next" in nxt.unknown_reason
    assert nxt.max_position_embeddings == 262144 and nxt.context_from_config


def test_a_config_without_a_model_type_or_geometry_is_refused_in_one_line() -> None:
    from tuner.errors import CatalogError

    with pytest.raises(CatalogError, match="lacks the field 'num_attention_heads'"):
        ModelProfile.from_config("x", {"hidden_size": 10})
    odd = ModelProfile.from_config("y", {"model_type": "some_new_arch", "hidden_size": 10})
    assert not odd.predictable and not odd.context_from_config


def test_a_model_sliding_on_every_layer_is_one_group_of_windowed_requests() -> None:
    """Mistral v0.1's shape (sliding_window 4096 on all 32 layers; vLLM falls back to cache_config.sliding_window):
    geometry written out here, as no published config was at hand (SOURCES.md)."""
    mistral = ModelProfile(
        "mistral-v0.1-shape", 32, 32, 8, 128, 4096, 14336, 32000, 32768,
        kv_groups=(LayerGroup(32, 8, 128, 128, 4096),),
    )  # fmt: skip
    f = flags(max_model_len=32768, batched=2048)
    pool = kv_pool(mistral, f)
    assert pool.windows == (4096,) and pool.block_bytes == 16 * 131072
    # a request holds cdiv(min(4095 + 2 x 2048, 32768), 16) + 1 = 513 blocks, not 2048
    assert pool.blocks_per_request(32768) == 513
    assert pool.tokens(512, 32768) == int(512 / 513 * 32768)


def test_five_to_one_hybrid_groups_pad_to_the_smaller_kind() -> None:
    """vLLM's own example (kv_cache_utils._get_kv_cache_groups_uniform_page_size): Gemma 3's 5 sliding : 1 full over
    34 layers is 29 sliding and 5 full layers, group size 5: one full group and cdiv(29, 5) = 6 sliding ones."""
    gemma3 = ModelProfile(
        "gemma-3-4b-shape", 34, 8, 4, 256, 2560, 10240, 262208, 131072,
        kv_groups=(LayerGroup(5, 4, 256, 256, None), LayerGroup(29, 4, 256, 256, 1024)),
    )  # fmt: skip
    pool = kv_pool(gemma3, flags(max_model_len=131072))
    assert pool.windows == (None,) + (1024,) * 6
    assert pool.block_bytes == 5 * 16 * 4 * 512 * 2


def test_a_hybrid_model_too_long_for_its_kv_memory_gets_vllms_estimate() -> None:
    from tuner.capacity import KV_CACHE_TOO_SMALL, plan_startup
    from tuner.catalog import resolve_gpu
    from tuner.flags import VllmFlags, resolve

    gemma = model("google--gemma-2-2b-it")
    # 8 GiB: what is left once the CUDA graphs' estimate (vLLM 0.32) is out of the budget holds a few thousand tokens
    small = resolve_gpu({"name": "small-card", "memory_gib": 8.0})
    f = resolve(VllmFlags(max_model_len=8192, gpu_memory_utilization=0.9), small, gemma)
    plan = plan_startup(gemma, small, f)
    assert plan.reason == KV_CACHE_TOO_SMALL and plan.estimated_max_model_len is not None
    pool = kv_pool(gemma, f)
    est = plan.estimated_max_model_len
    usable = plan.available_kv_bytes - pool.block_bytes  # the null block is not the requests'
    assert pool.needed_bytes(est) <= usable < pool.needed_bytes(est + 1)
    assert f"the estimated maximum model length is {est}." in (plan.message or "")


def test_gemma3_five_sliding_layers_to_one_global_group_as_vllm_groups_them() -> None:
    """gemma-3-1b-it: 26 layers, every sixth global (Gemma3TextConfig.layer_types from sliding_window_pattern 6), the
    others slide over 512 tokens; one KV head of 256. vLLM groups 4 full and 22 sliding layers by the smaller count:
    one full group and cdiv(22, 4) = 6 sliding ones (kv_cache_utils._get_kv_cache_groups_uniform_page_size)."""
    gemma = model("google--gemma-3-1b-it")
    assert gemma.layer_groups == (LayerGroup(4, 1, 256, 256, None), LayerGroup(22, 1, 256, 256, 512))
    assert gemma.kv_bytes_per_token_per_gpu(None, 1) == 26 * 1 * (256 + 256) * 2
    f = flags(max_model_len=8192, batched=2048)
    pool = kv_pool(gemma, f)
    assert pool.windows == (None,) + (512,) * 6
    assert pool.block_bytes == 4 * 16 * 1 * 512 * 2  # one block: 16 tokens of a group's 4 layers
    blocks = GIB // pool.block_bytes
    assert blocks == 16384
    # a request of 8192: 512 blocks in the full group; in each sliding one the window and two batches in flight,
    # cdiv(min(511 + 2 x 2048, 8192), 16) + 1 = 289
    assert pool.blocks_per_request(8192) == 512 + 6 * 289
    assert pool.tokens(blocks, 8192) == int(16384 / 2246 * 8192) == 59758


def test_no_sliding_window_is_full_attention_on_every_layer() -> None:
    mistral = model("mistralai--Mistral-7B-Instruct-v0.3")
    assert mistral.layer_groups == (LayerGroup(32, 8, 128, 128, None),)
    assert kv_pool(mistral, flags(max_model_len=32768)).windows == (None,)
    assert mistral.max_position_embeddings == 32768


def test_published_parameter_counts() -> None:
    """The weights' arithmetic against the counts each model's publisher gives (model cards, release posts)."""
    assert model("mistralai--Mistral-7B-Instruct-v0.3").num_params == pytest.approx(7.25e9, rel=1e-3)
    mixtral = model("mistralai--Mixtral-8x7B-v0.1")
    assert mixtral.moe is not None and (mixtral.moe.num_experts, mixtral.moe.experts_per_token) == (8, 2)
    assert mixtral.num_params == pytest.approx(46.7e9, rel=2e-3)  # "46.7B total parameters"
    assert mixtral.active_params == pytest.approx(12.9e9, rel=2e-3)  # "12.9B parameters per token"
    lite = model("deepseek-ai--DeepSeek-V2-Lite")
    assert lite.mla is not None and lite.mla.q_lora_rank is None  # q projected whole, no low-rank q
    assert lite.moe is not None and lite.moe.moe_layers == 26  # first_k_dense_replace 1
    assert lite.num_params == pytest.approx(15.7e9, rel=1e-3)  # "15.7B parameters"
    v3 = model("deepseek-ai--DeepSeek-V3")
    assert v3.num_params == pytest.approx(671e9, rel=1e-3)  # 671B main model (the 14B MTP module is not served)
    assert v3.active_params == pytest.approx(37e9, rel=0.02)  # "37B activated"


def test_an_fp8_checkpoint_weighs_a_byte_a_decoder_weight() -> None:
    """DeepSeek-V3 ships FP8 (quant_method fp8, 128 x 128 blocks): vLLM loads its decoder weights as they are, one
    byte each, and its bf16 embeddings at two; no index here, so the arithmetic decides."""
    v3 = model("deepseek-ai--DeepSeek-V3")
    assert (v3.quantization, v3.quant_bits) == ("fp8", 8)
    assert v3.weight_bytes == v3.layer_params + 2 * v3.embedding_params
    assert v3.weight_bytes < 0.51 * 2 * v3.num_params  # half what the same model weighs in bf16
    from tuner.catalog import get_gpu
    from tuner.feasibility import FeasibilityModel
    from tuner.flags import VllmFlags

    # 673 GB over 8 GPUs: 84 GB each starts on H200s (141 GB); on H100s (80 GB) the weights load but leave the
    # 0.9 share no room for a KV cache. In bf16 (twice the bytes) even the H200s could not hold them.
    tp8 = VllmFlags(tensor_parallel_size=8, max_model_len=8192)
    assert FeasibilityModel(get_gpu("h200"), v3).predict(tp8).ok
    assert FeasibilityModel(get_gpu("h100-80gb"), v3).predict(tp8).reason == "no_kv_memory"
    bf16 = ModelProfile.from_config(
        "bf16", {k: v for k, v in config("deepseek-ai--DeepSeek-V3").items() if k != "quantization_config"}
    )
    assert FeasibilityModel(get_gpu("h200"), bf16).predict(tp8).reason == "cuda_oom"
