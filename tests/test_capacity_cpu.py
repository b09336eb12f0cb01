"""vLLM's CPU build as a target (`gpu: cpu`): its defaults, its KV space rule and its refusals, per vLLM 0.32's
source (CpuPlatform.check_and_update_config, CPUWorker.determine_available_memory, EngineArgs.get_batch_defaults)
and the start-up lines real vLLM printed here (../shared/docs/real-vllm.md)."""

from __future__ import annotations

import pytest

from tuner.capacity import INSUFFICIENT_FREE_MEMORY, KV_CACHE_TOO_SMALL, NO_KV_MEMORY, plan_startup
from tuner.catalog import CPU, cpu_profile, get_gpu, load_model
from tuner.catalog.models import ModelProfile
from tuner.errors import CatalogError
from tuner.feasibility import FeasibilityModel
from tuner.flags import VllmFlags, default_flags, resolve

GIB = 1024**3
# The real tier's tiny model (scripts/make-tiny-model): 4 layers, 2 KV heads of 64, bf16 = 2,048 bytes a token.
TINY = ModelProfile("tiny", 4, 4, 2, 64, 256, 512, 2006, 4096)
LLAMA = load_model("llama-3.1-8b")


def test_cpu_is_a_target_with_vllms_cpu_defaults() -> None:
    cpu = cpu_profile({})
    assert cpu.is_cpu and cpu.key == CPU and not cpu.is_high_end
    r = resolve(VllmFlags(), cpu, TINY)
    assert (r.max_num_seqs, r.max_num_batched_tokens, r.block_size) == (128, 2048, 128)
    # per tensor-parallel rank, as vLLM multiplies by the world size
    r2 = resolve(VllmFlags(tensor_parallel_size=2), cpu, TINY)
    assert (r2.max_num_seqs, r2.max_num_batched_tokens) == (256, 4096)
    # a block size the user sets is kept
    assert resolve(VllmFlags(block_size=32), cpu, TINY).block_size == 32
    assert default_flags(cpu, TINY).max_num_seqs == 128


def test_kv_space_from_the_environment_matches_real_vllm() -> None:
    # Real vLLM 0.32 with VLLM_CPU_KVCACHE_SPACE=1 and --max-model-len 1024 on the tiny model logged
    # "CPU KV cache size: 524,288 tokens, Maximum concurrency for 1,024 tokens per request: 512.00x".
    cpu = cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "1"})
    p = plan_startup(TINY, cpu, resolve(VllmFlags(max_model_len=1024), cpu, TINY))
    assert p.ok
    assert p.available_kv_bytes == 1 * GIB
    assert p.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert p.kv_tokens == 524_288
    assert p.max_concurrency == 512.0
    assert p.cuda_graph_bytes == 0


def test_unset_kv_space_takes_the_utilization_share_of_host_memory() -> None:
    cpu = cpu_profile({})
    r = resolve(VllmFlags(max_model_len=1024, gpu_memory_utilization=0.5), cpu, TINY)
    p = plan_startup(TINY, cpu, r)
    assert p.available_kv_bytes == int(cpu.memory_bytes * 0.5) - p.weights_bytes - p.non_torch_bytes
    assert p.kv_tokens == p.available_kv_bytes // (128 * 2048) * 128


def test_kv_too_small_on_a_cpu_uses_vllms_cpu_wording_and_estimate() -> None:
    cpu = cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "1"})
    # Llama-3.1-8B: 128 KiB a token; 1 GiB holds 64 blocks of 128, of which the null block is not the requests'
    # (check_enough_kv_cache_memory, 0.32): 63 x 128 = 8,064 tokens. Real vLLM-CPU 0.32 with 16 blocks of 128
    # estimated 1,920 = 15 x 128 (docs/real-vllm.md).
    p = plan_startup(LLAMA, cpu, resolve(VllmFlags(max_model_len=16384), cpu, LLAMA))
    assert p.reason == KV_CACHE_TOO_SMALL
    assert p.estimated_max_model_len == 63 * 128
    assert "the estimated maximum model length is 8064" in p.message  # type: ignore[operator]
    assert "(which also controls CPU memory on the CPU backend)" in p.message  # type: ignore[operator]


def test_cpu_refusals_for_memory() -> None:
    cpu = cpu_profile({})
    over = plan_startup(TINY, cpu, resolve(VllmFlags(gpu_memory_utilization=0.9), cpu, TINY), cpu.memory_gib * 0.5)
    assert over.reason == INSUFFICIENT_FREE_MEMORY
    assert "controls the fraction of CPU memory reserved" in over.message  # type: ignore[operator]
    empty = plan_startup(TINY, cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "0"}), resolve(VllmFlags(), cpu, TINY))
    # a space of 0 passes the worker and meets the KV cache's own check, as the real CPU build refused it
    # (tests/emulator/fixtures/vllm-0.32.0/startup.json, no_kv_memory)
    assert empty.reason == NO_KV_MEMORY
    assert empty.message is not None and empty.message.startswith("No available memory for the cache blocks.")


@pytest.mark.parametrize("value", ["0.5", "one", "-1"])
def test_a_kv_space_vllm_would_not_read_is_one_clear_error(value: str) -> None:
    with pytest.raises(CatalogError, match="VLLM_CPU_KVCACHE_SPACE"):
        cpu_profile({"VLLM_CPU_KVCACHE_SPACE": value})


def test_get_gpu_cpu_reads_the_workers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    assert get_gpu("CPU").kv_space_gib == 2
    prediction = FeasibilityModel(get_gpu("cpu"), TINY).predict(VllmFlags(max_model_len=1024))
    assert prediction.ok and prediction.kv_tokens == 2 * 524_288


def test_kv_cache_memory_bytes_sizes_a_cpu_cache_unless_the_environment_does() -> None:
    # CPUWorker.determine_available_memory takes kv_cache_memory_bytes as given; CpuPlatform overwrites it with
    # VLLM_CPU_KVCACHE_SPACE when that is set (vllm/platforms/cpu.py, 0.32.0)
    given = VllmFlags(max_model_len=1024, kv_cache_memory_bytes=2 * GIB)
    cpu = cpu_profile({})
    assert plan_startup(TINY, cpu, resolve(given, cpu, TINY)).available_kv_bytes == 2 * GIB
    env = cpu_profile({"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert plan_startup(TINY, env, resolve(given, env, TINY)).available_kv_bytes == GIB
