"""Device profiles: the memory torch reports, memory bandwidth and dense bf16 throughput; GPUs and the CPU.

`memory_gib` is what `torch.cuda.mem_get_info()` calls total (a little below the marketing figure), because
vLLM's arithmetic and its error messages use that number. For the CPU (`gpu: cpu`, vLLM's CPU build) it is the
host's memory, and the KV cache is the fixed space `VLLM_CPU_KVCACHE_SPACE` gives when it is set.

The catalog is a lookup, never a gate: `resolve_gpu` takes a catalog name, `auto` (the machine's GPUs through NVML or
amd-smi: their measured memory, plus the catalog's bandwidth and FLOP/s when it knows the name), an unknown name of the
GPU that is in the machine, or the figures themselves ({name, memory_gib, bandwidth_gbps?, bf16_tflops?}).
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from tuner.catalog.nvml import DeviceInfo, machine_devices
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
    vendor: str = "nvidia"  # or "amd": the ROCm image and devices
    count: int | None = None  # GPUs of this kind in the machine when measured or given: the most TP can use
    source: str = ""  # where the figures come from: a datasheet, NVML, or the job file
    # One GPU-hour, in USD, and where that price is listed and when it was read (`target.gpu_hour_usd` overrides it
    # for a study, `--gpu-hour-usd` for `tuner plan`): a default with its source, never a quote for the user's cloud.
    usd_per_hour: float | None = None
    price_source: str = ""

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


# memory_gib: torch's total for the first seven (measured); for the others the datasheet capacity less what ECC and the
# driver keep, as PyTorch's out-of-memory messages report it ("N GiB total capacity") - an estimate that NVML's
# measured total replaces under `gpu: auto`. Bandwidth and FLOP/s (dense, no sparsity) are the vendors' datasheets'.
GPUS: dict[str, GpuProfile] = {
    g.key: g
    for g in (
        GpuProfile(
            "rtx4090", "NVIDIA GeForce RTX 4090", 23.64, 1008, 165.2, source="NVIDIA Ada GPU architecture whitepaper"
        ),
        GpuProfile(
            "rtx5090",
            "NVIDIA GeForce RTX 5090",
            31.36,
            1792,
            209.5,
            source="NVIDIA RTX Blackwell GPU architecture whitepaper",
        ),
        GpuProfile("l4", "NVIDIA L4", 22.05, 300, 121.0, source="NVIDIA L4 Tensor Core GPU datasheet"),
        GpuProfile(
            "a100-40gb", "NVIDIA A100-SXM4-40GB", 39.38, 1555, 312.0, source="NVIDIA A100 Tensor Core GPU datasheet"
        ),
        GpuProfile(
            "a100-80gb", "NVIDIA A100-SXM4-80GB", 79.15, 2039, 312.0, source="NVIDIA A100 Tensor Core GPU datasheet"
        ),
        GpuProfile(
            "h100-80gb",
            "NVIDIA H100 80GB HBM3",
            79.19,
            3350,
            989.0,
            source="NVIDIA H100 Tensor Core GPU datasheet (SXM)",
        ),
        GpuProfile("h200", "NVIDIA H200", 139.8, 4800, 989.0, source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
        # AWS's A10G has no NVIDIA datasheet: 24 GB and 600 GB/s as AWS's EC2 G5 page gives them; 70 TFLOPS is the
        # commonly quoted dense bf16 figure (the A10's datasheet gives 125) - an estimate.
        GpuProfile("a10g", "NVIDIA A10G", 22.19, 600, 70.0, source="AWS EC2 G5 instance page (A10G); FLOP/s estimate"),
        GpuProfile("l40s", "NVIDIA L40S", 44.52, 864, 362.05, source="NVIDIA L40S GPU datasheet"),
        # Turing has no bf16: vLLM serves fp16 there; the figure is fp16 tensor throughput.
        GpuProfile("t4", "Tesla T4", 14.75, 320, 65.0, source="NVIDIA T4 Tensor Core GPU datasheet (fp16)"),
        GpuProfile("rtx-a6000", "NVIDIA RTX A6000", 47.54, 768, 154.8, source="NVIDIA RTX A6000 datasheet"),
        GpuProfile(
            "rtx3090",
            "NVIDIA GeForce RTX 3090",
            23.69,
            936,
            71.0,
            source="NVIDIA Ampere GA102 GPU architecture whitepaper",
        ),
        GpuProfile(
            "a100-80gb-pcie",
            "NVIDIA A100 80GB PCIe",
            79.15,
            1935,
            312.0,
            source="NVIDIA A100 Tensor Core GPU datasheet (PCIe)",
        ),
        GpuProfile(
            "h100-pcie", "NVIDIA H100 PCIe", 79.18, 2000, 756.0, source="NVIDIA H100 Tensor Core GPU datasheet (PCIe)"
        ),
        GpuProfile(
            "b200",
            "NVIDIA B200",
            178.35,
            8000,
            2250.0,
            source="NVIDIA DGX B200 datasheet (per GPU: 1,440 GB and 64 TB/s over 8)",
        ),
        GpuProfile(
            "mi300x", "AMD Instinct MI300X", 191.98, 5300, 1307.4, vendor="amd", source="AMD Instinct MI300X data sheet"
        ),
    )
}

# Default prices: one provider's public list price for each card it names unambiguously, read on one day, the same
# basis for every card so that `tuner plan --compare-gpus` ranks them on one footing. Runpod's Serverless page lists
# a per-second price per card; an "active" worker is the always-running one a served model is (the "flex" worker
# scales to zero). Cards it does not list (A10G, T4, MI300X, the A100 40GB, the PCIe H100) have no default. Cloud
# prices differ by several times for one card (AWS, Azure, neoclouds): give yours in the job.
PRICE_SOURCE = (
    "Runpod Serverless, an always-on worker's list price (docs.runpod.io/serverless/pricing, read 2026-12-05)"
)
_ACTIVE_USD_PER_S = {  # card: (Runpod's name for it, USD per second of an active worker)
    "l4": ("L4", 0.00013),
    "rtx3090": ("3090", 0.00013),
    "rtx4090": ("4090 PRO", 0.00021),
    "rtx-a6000": ("A6000", 0.00024),
    "l40s": ("L40S", 0.00037),
    "a100-80gb": ("A100 80 GB", 0.00060),
    "h100-80gb": ("H100 PRO 80 GB", 0.00093),
    "h200": ("H200 PRO", 0.00124),
    "b200": ("B200", 0.00190),
}


def _priced(g: GpuProfile) -> GpuProfile:
    listed = _ACTIVE_USD_PER_S.get(g.key)
    if listed is None:
        return g
    _, per_s = listed
    return replace(g, usd_per_hour=round(per_s * 3600, 4), price_source=PRICE_SOURCE)


GPUS = {k: _priced(g) for k, g in GPUS.items()}

# Other ways people and drivers name the catalog's cards.
_ALIASES = {
    "a10": "a10g",
    "a6000": "rtx-a6000",
    "rtxa6000": "rtx-a6000",
    "3090": "rtx3090",
    "4090": "rtx4090",
    "5090": "rtx5090",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
}

# A device name (NVML's, amd-smi's) to a catalog key: the first pattern (a regex) found in the lower-cased name wins.
_DEVICE_PATTERNS: tuple[tuple[str, str], ...] = (
    (r"\ba10g\b", "a10g"),
    (r"\bl40s\b", "l40s"),
    (r"\bl4\b", "l4"),
    (r"\bt4\b", "t4"),
    (r"\brtx a6000\b", "rtx-a6000"),
    (r"\brtx 3090\b", "rtx3090"),
    (r"\brtx 4090\b", "rtx4090"),
    (r"\brtx 5090\b", "rtx5090"),
    (r"\ba100 80gb pcie\b", "a100-80gb-pcie"),
    (r"\ba100-sxm4-80gb\b", "a100-80gb"),
    (r"\ba100\b", "a100-40gb"),
    (r"\bh100 pcie\b", "h100-pcie"),
    (r"\bh100\b", "h100-80gb"),
    (r"\bh200\b", "h200"),
    (r"\bb200\b", "b200"),
    (r"\bmi300x\b", "mi300x"),
)

# Figures for a GPU the catalog does not know and the job does not give: only the emulator's step time reads them.
UNKNOWN_BANDWIDTH_GBPS = 300.0
UNKNOWN_BF16_TFLOPS = 100.0


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


def catalog_key_for_device(device_name: str) -> str | None:
    """The catalog's key for a device name as the driver reports it, or None."""
    name = device_name.strip().lower()
    for pattern, key in _DEVICE_PATTERNS:
        if re.search(pattern, name):
            return key
    return None


def _key(name: str) -> str:
    return re.sub(r"[\s_]+", "-", name.strip().lower())


def _lookup(name: str) -> GpuProfile | None:
    """A catalog entry by key, alias or exact device name (what nvidia-smi prints)."""
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    return next((g for g in GPUS.values() if _key(g.device_name) == key), None)


def _known_list() -> str:
    return f"known GPUs: {', '.join(GPUS)}; or cpu for vLLM's CPU build, or auto for this machine's GPUs"


def from_devices(devices: Sequence[DeviceInfo], label: str | None = None) -> GpuProfile:
    """A profile of the machine's first GPU kind: its measured memory, the catalog's bandwidth and FLOP/s when the
    catalog knows the name. Memory is the smallest of the same-named GPUs (vLLM's ranks each need their share)."""
    first = devices[0]
    same = [d for d in devices if d.name == first.name]
    memory = round(min(d.total_gib for d in same), 2)
    by_device = catalog_key_for_device(first.name)
    known = GPUS[by_device] if by_device else None
    source = "NVML" if first.vendor == "nvidia" else "amd-smi/rocm-smi"
    if known is not None:
        return replace(
            known,
            memory_gib=memory or known.memory_gib,
            count=len(same),
            source=f"{source} (memory), {known.source} (bandwidth, FLOP/s)",
        )
    return GpuProfile(
        key=label or _key(first.name),
        device_name=first.name,
        memory_gib=memory,
        bandwidth_gbps=UNKNOWN_BANDWIDTH_GBPS,
        bf16_tflops=UNKNOWN_BF16_TFLOPS,
        vendor=first.vendor,
        count=len(same),
        source=f"{source} (memory); bandwidth and FLOP/s unknown, stand-ins for the emulator",
    )


_FIGURES = ("name", "memory_gib", "bandwidth_gbps", "bf16_tflops", "vendor", "count")


def _from_figures(spec: Mapping[str, Any]) -> GpuProfile:
    unknown = sorted(set(spec) - set(_FIGURES))
    if unknown:
        raise CatalogError(f"gpu: unknown field {', '.join(unknown)}; allowed: {', '.join(_FIGURES)}")
    name = spec.get("name")
    if not isinstance(name, str) or not name.strip():
        raise CatalogError("gpu: a GPU given by its figures needs a name, e.g. {name: a10g, memory_gib: 22}")
    base = _lookup(name)

    def number(field: str, default: float | None) -> float:
        value = spec.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            if value is None:
                raise CatalogError(
                    f"gpu {name!r}: {field} is required for a GPU the catalog does not know (a positive number); "
                    f"{_known_list()}"
                )
            raise CatalogError(f"gpu {name!r}: {field} must be a positive number, not {value!r}")
        return float(value)

    memory = number("memory_gib", base.memory_gib if base else None)
    bandwidth = number("bandwidth_gbps", base.bandwidth_gbps if base else UNKNOWN_BANDWIDTH_GBPS)
    flops = number("bf16_tflops", base.bf16_tflops if base else UNKNOWN_BF16_TFLOPS)
    count = spec.get("count")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise CatalogError(f"gpu {name!r}: count must be a whole number >= 1, not {count!r}")
    vendor = spec.get("vendor", base.vendor if base else "nvidia")
    if vendor not in ("nvidia", "amd"):
        raise CatalogError(f"gpu {name!r}: vendor must be nvidia or amd, not {vendor!r}")
    return GpuProfile(
        key=base.key if base else _key(name),
        device_name=base.device_name if base else name,
        memory_gib=memory,
        bandwidth_gbps=bandwidth,
        bf16_tflops=flops,
        vendor=str(vendor),
        count=count,
        source="the job file" + (f", else {base.source}" if base else ""),
    )


DeviceProbe = Callable[[], Sequence[DeviceInfo]]


def resolve_gpu(spec: str | Mapping[str, Any], probe: DeviceProbe = machine_devices) -> GpuProfile:
    """A GPU from a job's `target.gpu`: a catalog name or alias, `cpu`, `auto` (the machine's GPUs), the name of the
    GPU in this machine when the catalog does not know it, or a mapping of figures. One clear line when none fits."""
    if isinstance(spec, Mapping):
        return _from_figures(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise CatalogError(f"gpu must be a name or {{name, memory_gib, ...}}, not {spec!r}; {_known_list()}")
    key = _key(spec)
    if key == CPU:
        return cpu_profile()
    if key == "auto":
        devices = list(probe())
        if not devices:
            raise CatalogError(
                "gpu auto: no GPU found through NVML (pip install 'tuner[gpu]') or amd-smi/rocm-smi on this machine; "
                f"name the GPU instead, or give its figures {{name, memory_gib}}; {_known_list()}"
            )
        return from_devices(devices)
    known = _lookup(spec)
    if known is not None:
        return known
    # A name the catalog does not know still works when it is the GPU in this machine: its measured memory.
    devices = list(probe())
    wanted = key.replace("-", "")
    here = [d for d in devices if wanted and wanted in _key(d.name).replace("-", "")]
    if here:
        return from_devices(here, label=key)
    seen = f"; this machine has {devices[0].name}" if devices else ""
    raise CatalogError(
        f"unknown GPU {spec!r}{_did_you_mean(key)}{seen}; {_known_list()}; or give its figures {{name, memory_gib, "
        "bandwidth_gbps, bf16_tflops}"
    )


def _did_you_mean(key: str) -> str:
    """The catalog name closest to a mistyped one (`h100-80g`, `a100-40`), through its aliases too."""
    names = {**{k: k for k in GPUS}, **_ALIASES}
    close = difflib.get_close_matches(key, list(names), n=1, cutoff=0.8)  # v100 is not an h100
    return f" (did you mean {names[close[0]]}?)" if close else ""


def get_gpu(name: str) -> GpuProfile:
    """`resolve_gpu` for a name (the job's `target.gpu` string, the emulator's --gpu)."""
    return resolve_gpu(name)
