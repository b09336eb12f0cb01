"""`--device cpu`: the emulator as vLLM's CPU build (its defaults, its KV space, its start-up lines), a fitted
profile's step times, and `--num-gpu-blocks-override`."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from tuner.capacity import GIB, KV_CACHE_TOO_SMALL
from tuner.emulator import Emulator, EmulatorStartupError, parse_config
from tuner.errors import ConfigError
from tuner.launch.startup_log import parse_startup_facts
from tuner.step_profile import FittedFrom, StepCoefficients, StepProfile

# Llama-3.1-8B: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes = 128 KiB a token
LLAMA_KV_BYTES = 131072


def _emulator(*args: str) -> Emulator:
    return Emulator(parse_config(["--device", "cpu", "--model", "llama-3.1-8b", *args]), log_stream=io.StringIO())


async def test_the_kv_space_is_vllm_cpu_kvcache_space_and_the_lines_are_the_cpu_builds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    emu = _emulator("--max-model-len", "4096")
    assert await emu.startup(delays=False)
    log = emu.log.text()
    tokens = 2 * GIB // LLAMA_KV_BYTES  # 16,384: 128 blocks of vLLM's CPU block size
    assert "Explicitly set (2.00/" in log and "GiB for KV cache on node 0." in log
    assert f"CPU KV cache size: {tokens:,} tokens, Maximum concurrency for 4,096 tokens per request: 4.00x" in log
    assert "GPU KV cache size" not in log and "CUDA" not in log and "Graph capturing" not in log
    facts = parse_startup_facts(log)
    assert (facts.kv_tokens, facts.available_kv_gib, facts.max_concurrency) == (tokens, 2.0, 4.0)
    r = emu.resolved  # the CPU platform's defaults (EngineArgs.get_batch_defaults, CpuPlatform's block size)
    assert (r.max_num_seqs, r.max_num_batched_tokens, r.block_size) == (128, 2048, 128)
    assert emu.plan.num_gpu_blocks == tokens // 128


async def test_without_the_variable_the_space_is_the_utilization_share_and_said_auto(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    emu = _emulator("--max-model-len", "4096", "--gpu-memory-utilization", "0.95")
    if not emu.plan.ok:
        pytest.skip(f"this host's memory cannot hold an 8B model: {emu.plan.message}")
    assert await emu.startup(delays=False)
    p = emu.plan
    assert p.available_kv_bytes == p.requested_bytes - p.weights_bytes - p.non_torch_bytes
    assert f"Auto set ({p.available_kv_bytes / GIB:.2f}/{p.total_bytes / GIB:.2f}) GiB for KV cache" in emu.log.text()


def test_device_cpu_and_a_gpu_name_contradict(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    with pytest.raises(ConfigError, match="--device cpu imitates vLLM's CPU build; drop --gpu rtx4090"):
        parse_config(["--device", "cpu", "--gpu", "rtx4090", "--model", "llama-3.1-8b"])
    assert parse_config(["--gpu", "cpu", "--model", "llama-3.1-8b"]).gpu.is_cpu  # --gpu cpu says the same


def test_a_non_integer_kv_space_is_refused_as_vllm_refuses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.5")
    with pytest.raises(ConfigError, match="not a whole number of GiB"):
        parse_config(["--device", "cpu", "--model", "llama-3.1-8b"])


async def test_blocks_override_sizes_the_cache_and_refuses_one_too_small(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4")
    emu = _emulator("--max-model-len", "1024", "--num-gpu-blocks-override", "24")
    assert (emu.plan.num_gpu_blocks, emu.plan.kv_tokens) == (24, 24 * 128)
    assert await emu.startup(delays=False)
    assert "Overriding num_gpu_blocks=256 with num_gpu_blocks_override=24" in emu.log.text()
    assert "CPU KV cache size: 3,072 tokens" in emu.log.text()
    assert emu.engine.pool.num_blocks == 24 - 1  # the null block is never handed out (BlockPool, 0.32)
    with pytest.raises(EmulatorStartupError) as e:
        argv = ["--device", "cpu", "--model", "llama-3.1-8b", "--max-model-len", "4096"]
        Emulator.from_args([*argv, "--num-gpu-blocks-override", "16"], log_stream=io.StringIO())
    assert e.value.reason == KV_CACHE_TOO_SMALL
    assert "the estimated maximum model length is 1920" in e.value.message  # what real vLLM-CPU answered here


def test_a_profile_replaces_the_roofline_with_its_linear_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    c = StepCoefficients(
        step_overhead_s=2e-3, prefill_token_s=1e-5, decode_seq_s=3e-4, context_token_s=1e-7, request_latency_s=0.01
    )
    path = tmp_path / "p.json"
    StepProfile(
        device="cpu",
        model="m",
        vllm_version="0.32.0",
        block_size=128,
        max_num_seqs=128,
        max_num_batched_tokens=2048,
        coefficients=c,
        fitted_from=FittedFrom(source="synthetic", created="2026-01-01T00:00:00Z", points=[], relative_rms_error=0),
    ).write(path)
    emu = _emulator("--max-model-len", "2048", "--profile", str(path))
    step = emu.step_model
    # 8 decodes over 100-token contexts and a 500-token prefill chunk, 1,308 context tokens read
    assert step.step_seconds(508, 8, 1308, 0, 9) == pytest.approx(2e-3 + 500 * 1e-5 + 8 * 3e-4 + 1308 * 1e-7)
    assert emu.engine.request_latency_s == 0.01


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("{not json", r"not JSON"),
        ('{"profile_version": 7}', r"profile_version 7 is not one this tuner reads \(allowed: 1\)"),
        ('{"profile_version": 1, "device": "cpu"}', r"model: Field required"),
        ("[1, 2]", r"not a profile"),
    ],
)
def test_a_bad_profile_is_one_line_naming_the_file(tmp_path: Path, text: str, pattern: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=pattern) as e:
        parse_config(["--model", "llama-3.1-8b", "--profile", str(path)])
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="cannot read it"):
        parse_config(["--model", "llama-3.1-8b", "--profile", str(tmp_path / "missing.json")])
