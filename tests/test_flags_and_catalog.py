"""vLLM's defaults per GPU, flag rendering, model configs and the catalog's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.catalog import get_gpu, load_model
from tuner.errors import CatalogError
from tuner.flags import VllmFlags, default_flags, parse_human_int, parse_model_len, resolve

LLAMA = load_model("llama-3.1-8b")


def test_high_end_defaults_follow_vllms_rule() -> None:
    llama = load_model("llama-3.1-8b")
    h100 = resolve(VllmFlags(), get_gpu("h100-80gb"), llama)
    assert (h100.max_num_seqs, h100.max_num_batched_tokens) == (1024, 8192)
    a100 = resolve(VllmFlags(), get_gpu("a100-80gb"), llama)  # >= 70 GiB but an A100: the smaller defaults
    assert (a100.max_num_seqs, a100.max_num_batched_tokens) == (256, 2048)
    assert a100.max_model_len == 131072 and a100.gpu_memory_utilization == 0.9
    # max_num_seqs is capped at the token budget when only the budget is given
    capped = resolve(VllmFlags(max_num_batched_tokens=128), get_gpu("rtx4090"), llama)
    assert capped.max_num_seqs == 128


def test_default_flags_are_written_out() -> None:
    d = default_flags(get_gpu("l4"), load_model("qwen2.5-7b"))
    assert d.as_dict() == {
        "max_num_seqs": 256,
        "max_model_len": 32768,
        "gpu_memory_utilization": 0.9,
        "max_num_batched_tokens": 2048,
    }


def test_flags_render_as_vllm_args_and_round_trip() -> None:
    flags = VllmFlags(
        max_num_seqs=64, gpu_memory_utilization=0.92, enable_prefix_caching=False, extra={"swap_space": 8}
    )
    assert flags.to_args() == [
        "--max-num-seqs",
        "64",
        "--gpu-memory-utilization",
        "0.92",
        "--no-enable-prefix-caching",
        "--swap-space",
        "8",
    ]
    assert VllmFlags.from_dict(flags.as_dict()) == flags


@pytest.mark.parametrize(
    ("text", "value"),
    [("8192", 8192), ("8k", 8000), ("8K", 8192), ("1M", 2**20), ("25.6k", 25600), ("2g", 2 * 10**9),
     ("4G", 4 * 2**30), ("1t", 10**12), ("1T", 2**40), ("auto", -1), ("-1", -1)],
)  # fmt: skip
def test_model_len_accepts_vllms_suffixes_and_auto(text: str, value: int) -> None:
    # human_readable_int_or_auto, vllm/utils/argparse_utils.py (0.32.0)
    assert parse_model_len(text) == value


def test_binary_suffixes_refuse_decimals_as_vllm_does() -> None:
    with pytest.raises(ValueError, match=r"did you mean 1\.5k"):
        parse_human_int("1.5K")
    assert parse_human_int("1.5k") == 1500


def test_defaults_with_chunked_prefill_off_give_a_whole_prompt_one_step() -> None:
    # EngineArgs._set_default_args (0.32.0): batched = max(max_model_len, 2048), then min(seqs x max_model_len, .)
    g = get_gpu("rtx4090")
    off = resolve(VllmFlags(max_model_len=8192, enable_chunked_prefill=False), g, LLAMA)
    assert (off.max_num_batched_tokens, off.max_num_seqs) == (8192, 256)
    short = resolve(VllmFlags(max_model_len=1024, enable_chunked_prefill=False), g, LLAMA)
    assert short.max_num_batched_tokens == 2048
    few = resolve(VllmFlags(max_model_len=512, max_num_seqs=2), g, LLAMA)
    assert few.max_num_batched_tokens == 1024  # 2 sequences x 512 tokens caps the default 2048
    assert resolve(VllmFlags(max_model_len=8192), g, LLAMA).max_num_batched_tokens == 2048


@pytest.mark.parametrize(
    ("gpu", "batched", "seqs"),
    [("rtx4090", 2048, 256), ("a100-80gb", 2048, 256), ("h100-80gb", 8192, 1024), ("b200", 16384, 1024)],
)
def test_gpu_defaults_follow_get_batch_defaults(gpu: str, batched: int, seqs: int) -> None:
    # EngineArgs.get_batch_defaults (0.32.0), OPENAI_API_SERVER: >= 160 GiB; >= 70 GiB and not an A100; others
    r = resolve(VllmFlags(max_model_len=8192), get_gpu(gpu), LLAMA)
    assert (r.max_num_batched_tokens, r.max_num_seqs) == (batched, seqs)


def test_auto_max_model_len_resolves_to_the_models_limit_until_the_start_fits_it() -> None:
    r = resolve(VllmFlags(max_model_len=-1), get_gpu("rtx4090"), LLAMA)
    assert r.auto_max_model_len and r.max_model_len == LLAMA.max_position_embeddings


def test_kv_cache_memory_bytes_is_a_flag_vllm_reads() -> None:
    flags = VllmFlags(kv_cache_memory_bytes=4 * 2**30)
    assert flags.to_args() == ["--kv-cache-memory-bytes", str(4 * 2**30)]
    assert VllmFlags.from_dict(flags.as_dict()) == flags


def test_bad_model_len_names_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="k/m/g/t"):
        parse_model_len("lots")


def test_model_profile_from_a_config_json(tmp_path: Path) -> None:
    config = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(str(tmp_path))
    assert model.kv_bytes_per_token() == 57344
    assert model.head_dim == 128
    assert model.max_position_embeddings == 32768


def test_awq_weights_are_a_third_of_bf16() -> None:
    assert load_model("llama-3.1-8b-awq").weight_bytes < load_model("llama-3.1-8b").weight_bytes / 2.5


def test_unknown_names_list_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="known GPUs: rtx4090, rtx5090, l4, a100-40gb"):
        get_gpu("tpu-v5")
    with pytest.raises(CatalogError, match=r"llama-3\.1-8b, llama-3\.1-8b-awq, llama-3\.1-70b, qwen2\.5-7b"):
        load_model("gpt-17")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 10}))
    with pytest.raises(CatalogError, match="lacks the field 'num_attention_heads'"):
        load_model(str(tmp_path))


def test_catalog_prices_are_one_providers_list_with_its_source_and_date() -> None:
    from tuner.catalog import GPUS

    priced = {k: g for k, g in GPUS.items() if g.usd_per_hour is not None}
    assert {"l4", "l40s", "a100-80gb", "h100-80gb", "h200", "b200"} <= set(priced)
    assert not {"a10g", "t4", "mi300x", "h100-pcie", "a100-40gb"} & set(priced)  # the page does not name them
    for g in priced.values():
        assert "docs.runpod.io/serverless/pricing" in g.price_source and "read 2026-12-05" in g.price_source
    assert GPUS["h100-80gb"].usd_per_hour == pytest.approx(3.348)  # $0.00093/s, an always-on worker
    assert all(not g.price_source for g in GPUS.values() if g.usd_per_hour is None)
