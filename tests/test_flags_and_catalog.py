"""vLLM's defaults per GPU, flag rendering, model configs and the catalog's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tuner.catalog import get_gpu, load_model
from tuner.errors import CatalogError
from tuner.flags import VllmFlags, default_flags, parse_model_len, resolve


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


@pytest.mark.parametrize(("text", "value"), [("8192", 8192), ("8k", 8000), ("8K", 8192), ("1M", 2**20)])
def test_model_len_accepts_vllms_suffixes(text: str, value: int) -> None:
    assert parse_model_len(text) == value


def test_bad_model_len_names_what_is_allowed() -> None:
    with pytest.raises(ValueError, match="k/K/m/M"):
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
