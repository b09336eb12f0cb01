"""The start-up log's shape per process, as vLLM 0.32 prints it, and what the launchers read back from it."""

from __future__ import annotations

import io

from tuner.capacity import GIB
from tuner.emulator.config import parse_config
from tuner.emulator.emulator import Emulator
from tuner.launch.startup_log import parse_startup_facts


def _writer(line: str) -> str:
    return line.split(" pid=", 1)[0].lstrip("(")


async def test_one_gpu_the_worker_lines_come_from_the_engine_core() -> None:
    argv = ["--model", "llama-3.1-8b", "--gpu", "l4", "--max-model-len", "4096"]
    emu = Emulator(parse_config(argv), log_stream=io.StringIO())
    assert await emu.startup(delays=False)
    lines = list(emu.log.lines)
    assert {_writer(line) for line in lines} == {"APIServer", "EngineCore"}
    assert _writer(next(line for line in lines if "Model loading took" in line)) == "EngineCore"
    assert _writer(next(line for line in lines if " version " in line and "█" in line)) == "APIServer"


async def test_tensor_parallel_workers_each_print_the_worker_lines_and_facts_read_the_same() -> None:
    argv = ["--model", "llama-3.1-70b", "--gpu", "h100-80gb", "--tensor-parallel-size", "2", "--max-model-len", "4096",
            "--gpu-memory-utilization", "0.95"]  # fmt: skip
    emu = Emulator(parse_config(argv), log_stream=io.StringIO())
    assert await emu.startup(delays=False)
    lines = list(emu.log.lines)
    for worker_line in ("Model loading took", "Available KV cache memory", "Memory profiling takes"):
        writers = [_writer(line) for line in lines if worker_line in line]
        assert writers == ["Worker_TP0", "Worker_TP1"], worker_line
    for engine_line in ("GPU KV cache size", "Maximum concurrency", "init engine"):
        assert [_writer(line) for line in lines if engine_line in line] == ["EngineCore"], engine_line
    facts = parse_startup_facts("\n".join(lines))
    assert facts.kv_tokens == emu.plan.kv_tokens
    assert facts.weights_gib == round(emu.plan.weights_bytes / GIB, 2)  # per GPU: half the 70B weights
    assert 60 < (facts.weights_gib or 0) < 70


async def test_a_refused_start_names_the_engine_core_as_the_failed_process() -> None:
    emu = Emulator(parse_config(["--model", "llama-3.1-8b", "--gpu", "rtx4090"]), log_stream=io.StringIO())
    assert await emu.startup(delays=False) is False
    errors = [line for line in emu.log.lines if " ERROR " in line]
    assert _writer(errors[0]) == "EngineCore" and "EngineCore failed to start." in errors[0]
    assert any("estimated maximum model length" in line and _writer(line) == "EngineCore" for line in errors)
    assert _writer(errors[-1]) == "APIServer" and "Engine core initialization failed" in errors[-1]


def test_the_emulator_imitates_the_pinned_vllm_and_the_default_image_is_its() -> None:
    # One pin (tuner.vllm_pin): the emulator's /version and banner, and a job's default image.
    from tuner.config import DockerOptions
    from tuner.emulator.server import VLLM_VERSION
    from tuner.launch.startup_log import log_version
    from tuner.vllm_pin import PINNED_VLLM

    assert VLLM_VERSION == PINNED_VLLM
    assert DockerOptions().image == f"vllm/vllm-openai:v{PINNED_VLLM}"
    emu = Emulator(parse_config(["--model", "llama-3.1-8b", "--max-model-len", "4096"]), log_stream=io.StringIO())
    emu._log_launch()
    assert log_version("\n".join(emu.log.lines)) == PINNED_VLLM


async def test_max_model_len_auto_fits_the_kv_cache_and_the_api_serves_that_length() -> None:
    emu = Emulator(parse_config(["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--max-model-len", "auto"]),
                   log_stream=io.StringIO())  # fmt: skip
    assert await emu.startup(delays=False)
    fitted = emu.plan.max_model_len
    # every block but the null one, in whole blocks, below the model's 131,072 (_auto_fit_max_model_len)
    assert fitted == (emu.plan.available_kv_bytes // (16 * 128 * 1024) - 1) * 16 < 131072
    assert emu.resolved.max_model_len == fitted
    assert f"Auto-fit max_model_len: reduced from 131072 to {fitted} to fit in available KV cache memory" in (
        emu.log.text()
    )
    assert parse_startup_facts(emu.log.text()).max_model_len == fitted


async def test_kv_cache_memory_bytes_replaces_the_profile() -> None:
    argv = ["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--max-model-len", "8192", "--kv-cache-memory-bytes", "2G"]
    emu = Emulator(parse_config(argv), log_stream=io.StringIO())
    assert await emu.startup(delays=False)
    assert emu.plan.available_kv_bytes == 2 * GIB
    assert emu.plan.kv_tokens == 2 * GIB // (16 * 128 * 1024) * 16  # 16,384 tokens whatever the utilization
    log = emu.log.text()
    assert "reserved 2.00 GiB memory for KV Cache as specified by kv_cache_memory_bytes config" in log
    assert "Estimated CUDA graph memory" not in log


async def test_a_cpu_build_worker_writes_as_worker() -> None:
    from tuner.emulator.logs import VllmLog

    log = VllmLog(io.StringIO(), separate_worker=True)
    log.info("cpu_worker.py:260", "Explicitly set (1.0/17.21) GiB for KV cache on node 0.", "worker")
    log.info("kv_cache_utils.py:2327", "CPU KV cache size: 8,192 tokens", "engine")
    assert [_writer(line) for line in log.lines] == ["Worker", "EngineCore"]
