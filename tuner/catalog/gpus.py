"""GPU profiles: the memory torch reports, HBM bandwidth and dense bf16 throughput.

`memory_gib` is what `torch.cuda.mem_get_info()` calls total (a little below the marketing figure), because
vLLM's arithmetic and its error messages use that number.
"""

from __future__ import annotations

from dataclasses import dataclass

from tuner.errors import CatalogError

GIB = 1024**3


@dataclass(frozen=True)
class GpuProfile:
    key: str
    device_name: str
    memory_gib: float
    bandwidth_gbps: float  # HBM/GDDR bandwidth, GB/s (10^9 bytes)
    bf16_tflops: float  # dense, no sparsity

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def is_high_end(self) -> bool:
        """vLLM's rule for its larger defaults: >= 70 GiB and not an A100 (EngineArgs._set_default_args)."""
        return self.memory_gib >= 70 and "a100" not in self.device_name.lower()


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


def get_gpu(name: str) -> GpuProfile:
    key = name.strip().lower()
    if key not in GPUS:
        raise CatalogError(f"unknown GPU {name!r}; known GPUs: {', '.join(GPUS)}")
    return GPUS[key]
