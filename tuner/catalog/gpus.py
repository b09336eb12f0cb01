"""Device profiles: the memory torch reports, memory bandwidth and dense bf16 throughput; GPUs and the CPU.

`memory_gib` is what `torch.cuda.mem_get_info()` calls total (a little below the marketing figure), because
vLLM's arithmetic and its error messages use that number. For the CPU (`gpu: cpu`, vLLM's CPU build) it is the
host's memory, and the KV cache is the fixed space `VLLM_CPU_KVCACHE_SPACE` gives when it is set.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from tuner.errors import CatalogError

GIB = 1024**3
CPU = "cpu"
CPU_KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"


@dataclass(frozen=True)
class GpuProfile:
    key: str
    device_name: str
    memory_gib: float
    bandwidth_gbps: float  # HBM/GDDR bandwidth, GB/s (10^9 bytes)
    bf16_tflops: float  # dense, no sparsity
    kind: str = "gpu"  # or CPU: vLLM's CPU platform, with its own defaults and KV-space rule
    kv_space_gib: int | None = None  # CPU: VLLM_CPU_KVCACHE_SPACE, the KV cache's fixed size when set

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def is_cpu(self) -> bool:
        return self.kind == CPU

    @property
    def is_high_end(self) -> bool:
        """vLLM's rule for its larger defaults: >= 70 GiB and not an A100 (EngineArgs._set_default_args)."""
        return not self.is_cpu and self.memory_gib >= 70 and "a100" not in self.device_name.lower()

    @property
    def is_largest(self) -> bool:
        """vLLM 0.32's rule for its largest defaults: >= 160 GiB of device memory (B200, MI300X)."""
        return not self.is_cpu and self.memory_gib >= 160


GPUS: dict[str, GpuProfile] = {
    g.key: g
    for g in (
        GpuProfile("rtx4090", "NVIDIA GeForce RTX 4090", 23.64, 1008, 165.2),
        GpuProfile("rtx5090", "NVIDIA GeForce RTX 5090", 31.36, 1792, 209.5),
        GpuProfile("l4", "NVIDIA L4", 22.05, 300, 121.0),
        GpuProfile("a100-40gb", "NVIDIA A100-SXM4-40GB", 39.38, 1555, 312.0),
        GpuProfile("a100-80gb", "NVIDIA A100-SXM4-80GB", 79.15, 2039, 312.0),
        GpuProfile("h100-80gb", "NVIDIA H100 80GB HBM3", 79.19, 3350, 989.0),
        GpuProfile("h200", "NVIDIA H200", 139.8, 4800, 989.0),
    )
}


def _host_memory_gib() -> float:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / GIB
    except (ValueError, OSError):
        return 16.0  # a platform without sysconf: the figure only matters when VLLM_CPU_KVCACHE_SPACE is unset


def cpu_profile(environ: Mapping[str, str] | None = None) -> GpuProfile:
    """This host as vLLM's CPU build sees it. The KV space is read as vLLM reads it: `int()` of the variable."""
    env = os.environ if environ is None else environ
    raw = env.get(CPU_KV_SPACE_ENV, "")
    space: int | None = None
    if raw != "":
        try:
            space = int(raw)
        except ValueError:
            raise CatalogError(
                f"{CPU_KV_SPACE_ENV}={raw!r} is not a whole number of GiB (vLLM reads it with int(), so 0.5 fails)"
            ) from None
        if space < 0:
            raise CatalogError(f"{CPU_KV_SPACE_ENV}={raw!r}: the KV space must be >= 0 GiB")
    # Bandwidth and FLOP/s are rough figures of a server socket: only the emulator's step time reads them.
    return GpuProfile(CPU, "CPU", round(_host_memory_gib(), 2), 100.0, 2.0, kind=CPU, kv_space_gib=space)


def get_gpu(name: str) -> GpuProfile:
    key = name.strip().lower()
    if key == CPU:
        return cpu_profile()
    if key not in GPUS:
        raise CatalogError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)}; or cpu for vLLM's CPU build")
    return GPUS[key]
