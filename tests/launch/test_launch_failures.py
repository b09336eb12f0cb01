"""The log reader on log texts: vLLM's refusals (as tuner.capacity and vLLM word them), start-up facts, exits."""

from __future__ import annotations

import pytest

from tuner.capacity import plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.flags import VllmFlags, resolve
from tuner.launch import find_cause, parse_startup_facts
from tuner.launch.failures import (
    CRASHED_UNDER_LOAD,
    describe_exit,
    refusal_in,
    start_timeout_error,
)
from tuner.launch.failures import classify_runtime_exit as runtime_exit
from tuner.launch.failures import classify_startup_exit as startup_exit


def vllm_error(message: str) -> str:
    """How vLLM's engine core reports a start-up refusal: the root cause, then the front-end's summary."""
    return (
        "INFO 12-02 10:15:00 [gpu_worker.py:241] Available KV cache memory: 4.74 GiB\n"
        "ERROR 12-02 10:15:01 [core.py:708] EngineCore failed to start.\n"
        "ERROR 12-02 10:15:01 [core.py:708] Traceback (most recent call last):\n"
        f"ERROR 12-02 10:15:01 [core.py:708] ValueError: {message}\n"
        "ERROR 12-02 10:15:01 [api_server.py:1920] RuntimeError: Engine core initialization failed. "
        "See root cause above. Failed core proc(s): {}\n"
    )


def plan(gpu: str, memory_in_use_gib: float = 0.0, **flags: object) -> tuple[str, str, int | None]:
    model, profile = load_model("llama-3.1-8b"), get_gpu(gpu)
    p = plan_startup(model, profile, resolve(VllmFlags(**flags), profile, model), memory_in_use_gib)  # type: ignore[arg-type]
    assert p.reason is not None and p.message is not None
    return p.reason, p.message, p.estimated_max_model_len


@pytest.mark.parametrize(
    ("gpu", "memory_in_use", "flags"),
    [
        ("rtx4090", 0.0, {}),  # default max_model_len 131072 does not fit next to 8B weights
        ("h100-80gb", 30.0, {"gpu_memory_utilization": 0.9}),
        ("rtx4090", 0.0, {"gpu_memory_utilization": 0.62, "max_model_len": 4096}),
        ("h100-80gb", 0.0, {"max_num_seqs": 512, "max_num_batched_tokens": 256}),
        ("h100-80gb", 0.0, {"max_model_len": 200_000}),
        ("h100-80gb", 0.0, {"gpu_memory_utilization": 1.5}),
        ("h100-80gb", 0.0, {"enable_chunked_prefill": False, "max_model_len": 16384, "max_num_batched_tokens": 8192}),
        ("h100-80gb", 0.0, {"tensor_parallel_size": 3}),
        ("h100-80gb", 0.0, {"gpu_memory_utilization": 1.0, "max_model_len": 8192}),  # no headroom for capture
    ],
)
def test_every_refusal_of_the_shared_arithmetic_is_recognised(
    gpu: str, memory_in_use: float, flags: dict[str, object]
) -> None:
    reason, message, estimate = plan(gpu, memory_in_use, **flags)
    error = startup_exit(vllm_error(message), 1)
    assert error.reason == reason
    assert message.split(".")[0] in str(error)
    assert error.estimated_max_model_len == estimate
    assert "Engine core initialization failed" in error.log_tail


def test_kv_cache_too_small_carries_vllms_estimate() -> None:
    reason, message, estimate = plan("rtx4090")
    assert reason == "kv_cache_too_small" and estimate
    error = startup_exit(vllm_error(message), 1)
    assert error.estimated_max_model_len == estimate
    assert f"estimated maximum model length is {estimate}" in str(error)


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        # vLLM's own wording (vllm-behaviour.md), including the pydantic-wrapped form of newer releases.
        (
            "Free memory on device (70.1/79.19 GiB) on startup is less than desired GPU memory utilization "
            "(0.95, 75.23 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
            "insufficient_free_memory",
        ),
        (
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
            "initializing the engine.",
            "no_kv_memory",
        ),
        (  # 0.32 (kv_cache_utils.py _check_enough_kv_cache_memory), as the emulator prints it
            "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the "
            "engine (this flag also controls CPU memory reservation on the CPU backend, despite its name). See "
            "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details.",
            "no_kv_memory",
        ),
        (
            "CUDA out of memory occurred when warming up sampler with 1024 dummy requests. Please try lowering "
            "`max_num_seqs` or `gpu_memory_utilization` when initializing the engine.",
            "cuda_oom",
        ),
        (
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total "
            "capacity of 23.53 GiB of which 512.00 MiB is free.",
            "cuda_oom",
        ),
        (
            "1 validation error for SchedulerConfig\n  Value error, max_num_batched_tokens (2048) must be greater "
            "than or equal to max_num_seqs (4096). [type=value_error, input_value=ArgsKwargs((), {}), "
            "input_type=ArgsKwargs]",
            "invalid_flags",
        ),
    ],
)
def test_vllm_wording(text: str, reason: str) -> None:
    cause = find_cause(vllm_error(text))
    assert cause is not None and cause.reason == reason
    assert "[type=" not in cause.message
    assert not cause.message.startswith("ERROR")


def test_argparse_exit_is_invalid_flags_with_its_line() -> None:
    log = "usage: vllm serve [-h] ...\nvllm serve: error: argument --max-num-seqs: invalid int value: 'lots'\n"
    error = startup_exit(log, 2)
    assert error.reason == "invalid_flags"
    assert "invalid int value: 'lots'" in str(error)


def test_unexplained_exit_is_unknown_with_the_last_error_line() -> None:
    log = "INFO loading\nERROR something nobody has seen before\nINFO shutting down\n"
    error = startup_exit(log, 1)
    assert error.reason == "unknown"
    assert "something nobody has seen before" in str(error)
    assert error.log_tail.endswith("INFO shutting down")


def test_exit_by_signal_is_named() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL (exit code -9)"
    assert describe_exit(137) == "was killed by SIGKILL (exit code 137)"
    assert describe_exit(1) == "exited with code 1"


def test_death_after_ready_is_crashed_under_load_with_its_cause() -> None:
    after = (
        'INFO:     127.0.0.1:5000 - "POST /v1/completions HTTP/1.1" 200 OK\n'
        "ERROR 12-02 10:16:00 [core.py:900] RuntimeError: CUDA error: an illegal memory access was encountered\n"
    )
    error = runtime_exit(after, 1)
    assert error.reason == CRASHED_UNDER_LOAD
    assert "illegal memory access" in str(error)
    assert "after it was ready" in str(error)


def test_start_timeout_names_the_timeout_and_the_last_line() -> None:
    error = start_timeout_error("INFO Starting to load model llama-3.1-8b...\n", 3)
    assert error.reason == "start_timeout"
    assert "within 3 s" in str(error) and "Starting to load model" in str(error)


def test_startup_facts_from_vllm_lines() -> None:
    log = (
        "INFO 12-02 10:15:00 [gpu_model_runner.py:2007] Model loading took 14.99 GiB memory and 6.72 seconds\n"
        "INFO 12-02 10:15:20 [gpu_worker.py:298] Available KV cache memory: 19.28 GiB\n"
        "INFO 12-02 10:15:20 [kv_cache_utils.py:1087] GPU KV cache size: 157,936 tokens\n"
        "INFO 12-02 10:15:20 [kv_cache_utils.py:1091] Maximum concurrency for 131,072 tokens per request: 1.20x\n"
    )
    facts = parse_startup_facts(log, startup_seconds=42.0)
    assert facts.kv_tokens == 157_936
    assert facts.max_concurrency == pytest.approx(1.20)
    assert facts.max_model_len == 131_072
    assert facts.weights_gib == pytest.approx(14.99)
    assert facts.weights_load_seconds == pytest.approx(6.72)
    assert facts.available_kv_gib == pytest.approx(19.28)
    assert facts.startup_seconds == 42.0


def test_startup_facts_older_wording_and_absent_lines() -> None:
    facts = parse_startup_facts("INFO Model loading took 14.9888 GiB and 33.5 seconds\n")
    assert facts.weights_gib == pytest.approx(14.9888)
    assert facts.weights_load_seconds == pytest.approx(33.5)
    assert facts.kv_tokens is None and facts.max_concurrency is None


def test_death_after_ready_names_the_root_exception_not_the_wrappers() -> None:
    after = (
        "(EngineCore_DP0 pid=77) ERROR 12-02 10:16:00 [core.py:710] EngineCore encountered a fatal error.\n"
        "(EngineCore_DP0 pid=77) ERROR 12-02 10:16:00 [core.py:710] Traceback (most recent call last):\n"
        "(EngineCore_DP0 pid=77) ERROR 12-02 10:16:00 [core.py:710] RuntimeError: CUDA error: an illegal memory "
        "access was encountered\n"
        "ERROR 12-02 10:16:00 [async_llm.py:480] vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered "
        "an issue. See stack trace (above) for the root cause.\n"
        "ERROR 12-02 10:16:00 [launcher.py:101] Engine failed, terminating server.\n"
    )
    message = str(runtime_exit(after, 1))
    assert message.endswith("(RuntimeError: CUDA error: an illegal memory access was encountered)")


@pytest.mark.parametrize(
    ("log", "kv_tokens", "concurrency", "max_model_len"),
    [
        # Two lines (older releases), one line, the device's name in front (0.32), a hybrid pool.
        (
            "INFO [kv_cache_utils.py:2146] GPU KV cache size: 5,760 tokens\n"
            "INFO [kv_cache_utils.py:2147] Maximum concurrency for 128 tokens per request: 45.00x\n",
            5760,
            45.0,
            128,
        ),
        (
            "(EngineCore_DP0 pid=1) INFO [kv_cache_utils.py:1879] GPU KV cache size: 29,056 tokens, "
            "Maximum concurrency for 2,048 tokens per request: 14.19x\n",
            29056,
            14.19,
            2048,
        ),
        (
            "(EngineCore pid=1) INFO [kv_cache_utils.py:2327] XPU KV cache size: 1,000 tokens, "
            "Maximum concurrency for 100 tokens per request: 10.00x\n",
            1000,
            10.0,
            100,
        ),
        (
            "INFO [kv_cache_utils.py:2327] GPU + host KV cache size: 65,536 tokens, "
            "Maximum concurrency for 8,192 tokens per request: 8.00x\n",
            65536,
            8.0,
            8192,
        ),
    ],
)
def test_kv_capacity_in_every_wording(log: str, kv_tokens: int, concurrency: float, max_model_len: int) -> None:
    facts = parse_startup_facts(log)
    assert (facts.kv_tokens, facts.max_concurrency, facts.max_model_len) == (kv_tokens, concurrency, max_model_len)


def test_cpu_kv_memory_explicit_and_auto() -> None:
    explicit = "(Worker pid=2) INFO [cpu_worker.py:260] Explicitly set (1.0/17.21) GiB for KV cache on node 0.\n"
    auto = (
        "(Worker pid=3) INFO [cpu_worker.py:235] Auto set (1.48/18.0) GiB for KV cache on node 0, with 5.4 GiB "
        "requested memory for the worker. 3.92 GiB memory was consumed by non-kv usages.\n"
    )
    assert parse_startup_facts(explicit).available_kv_gib == pytest.approx(1.0)
    assert parse_startup_facts(auto).available_kv_gib == pytest.approx(1.48)


def test_engine_init_seconds_with_and_without_compilation() -> None:
    plain = "INFO [core.py:402] init engine (profile, create kv cache, warmup model) took 36.43 s\n"
    compiled = (
        "INFO [core.py:390] init engine (profile, create kv cache, warmup model) took 61.20 s (compilation: 20.1 s)\n"
    )
    assert parse_startup_facts(plain).engine_init_seconds == pytest.approx(36.43)
    assert parse_startup_facts(compiled).engine_init_seconds == pytest.approx(61.2)


@pytest.mark.parametrize(
    ("line", "version"),
    [
        ("INFO 12-02 10:15:00 [api_server.py:1896] vLLM API server version 0.11.0", "0.11.0"),
        ("(APIServer pid=1) INFO [api_utils.py:327] vLLM server version 0.32.0, serving model tiny", "0.32.0"),
        ("(APIServer pid=1) INFO [api_utils.py:347]  ▄▄ ▄█ █     █     █ ▀▄▀ █  version 0.32.0", "0.32.0"),
        # The logo on a terminal: the version in bold.
        ("INFO [api_utils.py:347]  \x1b[93m▄▄\x1b[0m █ ▀▄▀ █\x1b[0m  version \x1b[1m0.13.0rc2\x1b[0m", "0.13.0rc2"),
        ("INFO [api_server.py:1896] vLLM API server version 0.11.0 (tuner emulator)", "0.11.0"),
        ("INFO nothing about versions here; transformers version 4.57", None),
    ],
)
def test_version_from_the_banner(line: str, version: str | None) -> None:
    assert parse_startup_facts(line + "\n").vllm_version == version


@pytest.mark.parametrize(
    ("text", "reason", "message_start"),
    [
        # The CPU build's own memory refusals (cpu_worker.py).
        (
            "ValueError: Available memory on node 0 (30.78/32.72 GiB) on startup is less than desired CPU memory "
            "utilization (0.95, 31.08 GiB). On the CPU backend, the `--gpu-memory-utilization` flag controls ...",
            "insufficient_free_memory",
            "Available memory on node 0 (30.78/32.72 GiB) on startup",
        ),
        (
            "ValueError: Available memory on node 0 (0.5/8.0 GiB) on kv cache allocation is less than requested "
            "memory for kv (4.0 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or ...",
            "insufficient_free_memory",
            "Available memory on node 0 (0.5/8.0 GiB) on kv cache allocation",
        ),
        (
            "ValueError: Free memory on device cuda:0 (20.1/79.19 GiB) on startup is less than desired GPU memory "
            "utilization (0.9, 71.27 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
            "processes.",
            "insufficient_free_memory",
            "Free memory on device cuda:0",
        ),
        # A pydantic bound on a config field: the field and pydantic's sentence.
        (
            "pydantic_core._pydantic_core.ValidationError: 1 validation error for CacheConfig\n"
            "gpu_memory_utilization\n"
            "  Input should be less than or equal to 1 [type=less_than_equal, input_value=1.5, input_type=float]",
            "invalid_flags",
            "gpu_memory_utilization: Input should be less than or equal to 1",
        ),
        # Models that cannot be had: transformers' and vLLM's words for them.
        (
            "OSError: org/no-such-model is not a local folder and is not a valid model identifier listed on "
            "'https://huggingface.co/models'",
            "model_not_found",
            "org/no-such-model is not a local folder",
        ),
        (
            "ValueError: Invalid repository ID or local directory specified: '/models/gone'.",
            "model_not_found",
            "Invalid repository ID or local directory specified: '/models/gone'.",
        ),
        (
            "OSError: You are trying to access a gated repo.\nMake sure to have access to it at "
            "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct.",
            "model_not_found",
            "You are trying to access a gated repo.",
        ),
    ],
)
def test_more_vllm_wordings(text: str, reason: str, message_start: str) -> None:
    cause = find_cause(vllm_error(text))
    assert cause is not None and cause.reason == reason
    assert cause.message.startswith(message_start)
    assert "[type=" not in cause.message


def test_an_unreachable_hub_is_not_a_missing_model() -> None:
    """A network failure may pass; only a definite answer (no such repo, gated, offline without a copy) is fatal."""
    log = vllm_error(
        "OSError: We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the "
        "cached files."
    )
    assert startup_exit(log, 1).reason == "unknown"


def test_a_refusal_is_read_from_whole_lines_before_the_exit() -> None:
    """The launcher reads the log while the server shuts down: the classified refusal is the one its exit gives, and
    a sentence still being written is not read yet."""
    message = "max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64)."
    log = vllm_error(message)
    cut = log.index(message) + 20
    assert refusal_in(log[:cut]) is None
    early = refusal_in(log)
    assert early is not None
    assert (str(early), early.reason) == (str(startup_exit(log, 1)), startup_exit(log, 1).reason)
    assert refusal_in("INFO 12-02 10:15:00 [gpu_worker.py:241] Available KV cache memory: 4.74 GiB\n") is None
