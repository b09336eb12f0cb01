"""The log reader on logs real vLLM printed (tests/launch/fixtures, recorded from the pinned CPU build).

Each fixture is what the server wrote to its stdout/stderr, cut to the lines that matter (fixtures/README.md says
what was cut); the lines kept are verbatim.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tuner.launch import parse_startup_facts
from tuner.launch.failures import (
    INVALID_FLAGS,
    KV_CACHE_TOO_SMALL,
    MODEL_NOT_FOUND,
    REASONS,
    classify_runtime_exit,
    classify_startup_exit,
)

FIXTURES = Path(__file__).parent / "fixtures"


def real_log(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_cpu_startup_facts() -> None:
    facts = parse_startup_facts(real_log("vllm-0.32.0-cpu-startup.log"), startup_seconds=71.5)
    # "CPU KV cache size: 524,288 tokens, Maximum concurrency for 1,024 tokens per request: 512.00x"
    assert facts.kv_tokens == 524_288
    assert facts.max_concurrency == pytest.approx(512.0)
    assert facts.max_model_len == 1024
    # "Explicitly set (1.0/10.46) GiB for KV cache on node 0." (VLLM_CPU_KVCACHE_SPACE=1)
    assert facts.available_kv_gib == pytest.approx(1.0)
    # The CPU build prints no weights memory, only "Loading weights took 0.06 seconds".
    assert facts.weights_gib is None
    assert facts.weights_load_seconds == pytest.approx(0.06)
    assert facts.engine_init_seconds == pytest.approx(26.33)
    assert facts.vllm_version == "0.32.0"
    assert facts.startup_seconds == 71.5


def test_kv_cache_too_small_with_vllms_estimate() -> None:
    """--num-gpu-blocks-override 16 --max-model-len 4096: 16 blocks of 128 tokens cannot hold 4,096 tokens."""
    error = classify_startup_exit(real_log("vllm-0.32.0-cpu-kv-too-small.log"), 1, what="the process server")
    assert error.reason == KV_CACHE_TOO_SMALL
    assert error.estimated_max_model_len == 1920
    assert str(error).startswith("the process server did not start (kv_cache_too_small: ")
    assert "To serve at least one request with the model's max seq len (4096)" in str(error)
    assert "Traceback" not in str(error) and "Engine core initialization failed" not in str(error)


def test_flag_combination_vllm_rejects() -> None:
    """--max-num-seqs 64 --max-num-batched-tokens 32: a pydantic ValidationError around vLLM's sentence."""
    error = classify_startup_exit(real_log("vllm-0.32.0-cpu-invalid-flags.log"), 1)
    assert error.reason == INVALID_FLAGS
    assert str(error).endswith(
        "(invalid_flags: vLLM rejected the flags): "
        "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64)."
    )


def test_cpu_kv_space_larger_than_free_memory() -> None:
    """VLLM_CPU_KVCACHE_SPACE=1000: the worker's refusal, quoted again by two RuntimeError wrappers below it."""
    error = classify_startup_exit(real_log("vllm-0.32.0-cpu-kv-space-too-big.log"), 1)
    assert error.reason == "insufficient_free_memory"
    assert str(error).endswith(
        "Available memory on node 0 (8.02/12.21 GiB) on kv cache allocation is less than requested memory for kv "
        "(1000.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other "
        "processes."
    )


def test_unknown_flag_names_argparses_line() -> None:
    error = classify_startup_exit(real_log("vllm-0.32.0-cpu-unknown-flag.log"), 2)
    assert error.reason == INVALID_FLAGS
    assert str(error).endswith(": api_server.py: error: unrecognized arguments: --no-such-flag")


def test_missing_model_is_model_not_found_naming_the_path() -> None:
    error = classify_startup_exit(real_log("vllm-0.32.0-cpu-model-missing.log"), 1)
    assert error.reason == MODEL_NOT_FOUND
    assert MODEL_NOT_FOUND in REASONS
    message = str(error)
    assert message.count("/nonexistent/models/llama-tiny") == 1
    assert "Repo id must be in the form" in message
    assert "Traceback" not in message


def test_engine_core_killed_under_load_is_crashed_under_load_in_vllms_words() -> None:
    """SIGKILL to the engine core while 32 requests ran: the API server answers 500s, then exits 0 on its own."""
    after = real_log("vllm-0.32.0-cpu-killed-under-load.log")
    error = classify_runtime_exit(after, 0, what="the process server")
    assert error.reason == "crashed_under_load"
    # vLLM's line, not its EngineDeadError wrapper ("See stack trace (above) for the root cause").
    assert str(error) == (
        "the process server exited with code 0 after it was ready "
        "([shutdown] MPClient: engine core exited unexpectedly; starting cleanup)"
    )


def test_the_cuda_graph_estimate_of_a_032_era_gpu_log() -> None:
    # lines of a real 0.2x GPU start (quoted in a public vLLM issue thread), in the order vLLM prints them
    log = (
        "(EngineCore pid=1497) INFO 06-05 07:28:52 [gpu_model_runner.py:6279] Profiling CUDA graph memory: "
        "PIECEWISE=35 (largest=256), FULL=19 (largest=128)\n"
        "(EngineCore pid=1497) INFO 06-05 07:28:57 [gpu_model_runner.py:6365] Estimated CUDA graph memory: "
        "0.40 GiB total\n"
        "(EngineCore pid=1497) INFO 06-05 07:28:57 [gpu_worker.py:466] Available KV cache memory: 12.85 GiB\n"
        "(EngineCore pid=1497) INFO 06-05 07:28:57 [kv_cache_utils.py:1733] GPU KV cache size: 163,225 tokens\n"
    )
    facts = parse_startup_facts(log)
    assert (facts.cuda_graph_gib, facts.available_kv_gib, facts.kv_tokens) == (0.40, 12.85, 163225)
    assert parse_startup_facts(log.split("\n", 2)[2]).cuda_graph_gib is None  # an eager or CPU start prints none
