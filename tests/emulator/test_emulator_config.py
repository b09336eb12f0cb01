"""The emulator's command line and its start-up verdicts, in-process."""

from __future__ import annotations

import io
import re

import pytest

from tuner.capacity import CUDA_OOM, INSUFFICIENT_FREE_MEMORY, INVALID_FLAGS, KV_CACHE_TOO_SMALL, NO_KV_MEMORY
from tuner.emulator import Emulator, EmulatorStartupError, parse_config
from tuner.emulator.config import VllmRefusal
from tuner.errors import CatalogError, ConfigError, LaunchError


def test_vllm_flag_names_and_defaults() -> None:
    c = parse_config(["--model", "llama-3.1-8b", "--max-model-len", "8K", "-tp", "2", "--no-enable-prefix-caching"])
    assert c.flags.max_model_len == 8192 and c.flags.tensor_parallel_size == 2
    assert c.flags.enable_prefix_caching is False and c.flags.enable_chunked_prefill is None
    assert (c.host, c.port, c.gpu.key, c.time_scale) == ("0.0.0.0", 8000, "h100-80gb", 1.0)
    assert c.served_model_names == ("llama-3.1-8b",)
    assert parse_config(["--model", "llama-3.1-8b", "--max-model-len", "8k"]).flags.max_model_len == 8000
    named = parse_config(["llama-3.1-8b", "--served-model-name", "a", "b"])  # `vllm serve MODEL` form
    assert named.model_arg == "llama-3.1-8b" and named.served_model_names == ("a", "b")


def test_unknown_vllm_flags_are_kept_for_a_warning() -> None:
    c = parse_config(["--model", "llama-3.1-8b", "--max-logprobs", "4", "--trust-remote-code", "--dtype=auto"])
    assert c.ignored_args == ("--max-logprobs", "4", "--trust-remote-code", "--dtype=auto")
    emu = Emulator(c, log_stream=io.StringIO())
    assert emu.plan.reason == KV_CACHE_TOO_SMALL or emu.plan.ok


@pytest.mark.parametrize(
    ("args", "error", "pattern"),
    [
        (["--model", "llama-3.1-8b", "--gpu", "v100"], CatalogError, r"known GPUs: rtx4090, .*h200"),
        (["--model", "nope"], CatalogError, r"not a built-in profile \(llama-3.1-8b, llama-3.1-8b-awq"),
        (["--model", "llama-3.1-8b", "--block-size", "7"], ConfigError, r"--block-size: invalid choice"),
        (["--model", "llama-3.1-8b", "--time-scale", "-1"], ConfigError, r"--time-scale: must be > 0"),
        (["--model", "llama-3.1-8b", "stray"], ConfigError, r"unrecognized argument 'stray'"),
        # options vLLM 0.32 lacks, as its argparse names them (the word after one goes to its model_tag positional)
        (
            ["--model", "llama-3.1-8b", "--swap-space", "4", "--no-such-flag"],
            ConfigError,
            r"^unrecognized arguments: --swap-space --no-such-flag$",
        ),
        (["--model", "/nonexistent/model"], VllmRefusal, r"^Repo id must be in the form 'repo_name' or 'namespace/"),
        ([], ConfigError, r"--model is required"),
    ],
)
def test_bad_arguments_are_config_errors(args: list[str], error: type[Exception], pattern: str) -> None:
    with pytest.raises(error, match=pattern):
        parse_config(args)


@pytest.mark.parametrize(
    ("args", "reason", "pattern"),
    [
        (["--gpu", "rtx4090"], KV_CACHE_TOO_SMALL, r"estimated maximum model length is \d+"),
        (["--max-num-seqs", "512", "--max-num-batched-tokens", "256"], INVALID_FLAGS, r"must be greater than or equal"),
        (["--max-model-len", "200000"], INVALID_FLAGS, r"User-specified max_model_len \(200000\)"),
        (["--gpu", "rtx4090", "--max-model-len", "8192", "--gpu-memory-in-use-gib", "4"], INSUFFICIENT_FREE_MEMORY,
         r"^Free memory on device \(19\.64/23\.64 GiB\) on startup is less than desired GPU memory utilization"),
        (["--gpu", "rtx4090", "--max-model-len", "8192", "--gpu-memory-utilization", "0.6"], NO_KV_MEMORY,
         r"^No available memory for the cache blocks"),
        (["--gpu", "rtx4090", "--max-model-len", "8192", "--gpu-memory-utilization", "1.0"], CUDA_OOM,
         r"CUDA out of memory"),
    ],
)  # fmt: skip
async def test_refused_starts(args: list[str], reason: str, pattern: str) -> None:
    argv = ["--model", "llama-3.1-8b", *args]
    with pytest.raises(EmulatorStartupError) as info:
        Emulator.from_args(argv, log_stream=io.StringIO())
    assert isinstance(info.value, LaunchError) and info.value.reason == reason
    assert re.search(pattern, info.value.message)
    # the same start in the process form's sequence logs vLLM's message as an ERROR line and says "failed"
    emu = Emulator(parse_config(argv), log_stream=io.StringIO())
    assert await emu.startup(delays=False) is False
    assert any(" ERROR " in line and info.value.message in line for line in emu.log.lines)
    assert not any("GPU KV cache size" in line for line in emu.log.lines) or reason == CUDA_OOM


def test_seventy_b_needs_tensor_parallelism_on_h100() -> None:
    with pytest.raises(EmulatorStartupError) as info:
        Emulator.from_args(["--model", "llama-3.1-70b", "--max-model-len", "8192"], log_stream=io.StringIO())
    assert info.value.reason == CUDA_OOM
    emu = Emulator.from_args(
        ["--model", "llama-3.1-70b", "--max-model-len", "8192", "-tp", "4"], log_stream=io.StringIO()
    )
    assert emu.plan.kv_tokens > 8192


@pytest.mark.parametrize(("gpu", "low", "high"), [("rtx4090", 30_000, 42_000), ("h100-80gb", 400_000, 480_000)])
async def test_kv_tokens_at_090_follow_the_formula(gpu: str, low: int, high: int) -> None:
    emu = Emulator.from_args(
        ["--model", "llama-3.1-8b", "--gpu", gpu, "--max-model-len", "8192"], log_stream=io.StringIO()
    )
    assert await emu.startup(delays=False)
    text = emu.log.text()
    m_gib = float(re.search(r"Available KV cache memory: (\d+\.\d\d) GiB", text).group(1))  # type: ignore[union-attr]
    n = int(re.search(r"GPU KV cache size: ([\d,]+) tokens", text).group(1).replace(",", ""))  # type: ignore[union-attr]
    assert n == emu.plan.kv_tokens
    # N = floor(M GiB / 128 KiB) down to whole 16-token blocks, exactly with unrounded M...
    assert n == emu.plan.available_kv_bytes // (16 * 131072) * 16
    # ...and within the printed M's rounding (+-0.005 GiB) with the logged figure
    assert abs(n - int(m_gib * 2**30 / 131072) // 16 * 16) <= 0.005 * 8192 + 16
    assert low <= n <= high
    concurrency = float(re.search(r"Maximum concurrency for 8,192 tokens per request: (\d+\.\d\d)x", text).group(1))  # type: ignore[union-attr]
    assert concurrency == pytest.approx(n / 8192, abs=0.006)
