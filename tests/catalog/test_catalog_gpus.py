"""GPUs: the catalog as a lookup, `auto` through NVML (a fake `pynvml` handed in) or amd-smi / rocm-smi (a fake command
runner), an unknown name that is this machine's GPU, and a GPU given by its figures."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from tuner.catalog import GPUS, get_gpu, load_model, resolve_gpu
from tuner.catalog.gpus import UNKNOWN_BANDWIDTH_GBPS, catalog_key_for_device
from tuner.catalog.nvml import DeviceInfo, amd_devices, machine_devices, memory_in_use_gib, nvml_devices
from tuner.errors import CatalogError
from tuner.feasibility import FeasibilityModel
from tuner.flags import VllmFlags, resolve

GIB = 1024**3


@dataclass
class _Memory:
    total: int
    used: int
    reserved: int = 0


class FakeNvml:
    """The part of pynvml's API the probe uses, with the machine's GPUs as (name, total, used, reserved)."""

    nvmlMemory_v2 = 0x02000028

    def __init__(self, gpus: Sequence[tuple[str | bytes, int, int, int]], fail_init: bool = False) -> None:
        self.gpus = list(gpus)
        self.fail_init = fail_init
        self.shut = False

    def nvmlInit(self) -> None:
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self.gpus[handle][0]

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> _Memory:
        _, total, used, reserved = self.gpus[handle]
        return _Memory(total, used, reserved if version else 0)


A10G = ("NVIDIA A10G", 24 * GIB, int(0.4 * GIB), int(1.8 * GIB))


def test_nvml_reads_name_memory_count_and_use() -> None:
    nvml = FakeNvml([A10G, A10G])
    devices = nvml_devices(nvml)
    assert [d.name for d in devices] == ["NVIDIA A10G", "NVIDIA A10G"]
    assert devices[0].total_gib == pytest.approx(22.2)  # total less NVML's reserved: what CUDA can allocate
    assert memory_in_use_gib(devices) == pytest.approx(0.4)
    assert nvml.shut
    assert nvml_devices(FakeNvml([A10G], fail_init=True)) == []
    assert nvml_devices(FakeNvml([(b"Tesla T4", 15 * GIB, 0, 0)]))[0].name == "Tesla T4"  # old bindings: bytes


def test_auto_is_the_machines_gpu_with_the_catalogs_bandwidth() -> None:
    gpu = resolve_gpu("auto", probe=lambda: nvml_devices(FakeNvml([A10G, A10G])))
    assert gpu.key == "a10g" and gpu.count == 2
    assert gpu.memory_gib == pytest.approx(22.2)  # measured, not the catalog's
    assert gpu.bandwidth_gbps == GPUS["a10g"].bandwidth_gbps and "NVML" in gpu.source


def test_auto_with_a_gpu_the_catalog_does_not_know_uses_its_measured_memory() -> None:
    probe = lambda: [DeviceInfo(0, "NVIDIA RTX PRO 6000 Blackwell", int(94.97 * GIB), 0)]  # noqa: E731
    gpu = resolve_gpu("auto", probe=probe)
    assert gpu.device_name == "NVIDIA RTX PRO 6000 Blackwell" and gpu.memory_gib == pytest.approx(94.97)
    assert gpu.bandwidth_gbps == UNKNOWN_BANDWIDTH_GBPS
    # its name works too, when it is the GPU in this machine
    assert resolve_gpu("rtx-pro-6000", probe=probe).memory_gib == pytest.approx(94.97)
    fm = FeasibilityModel(gpu, load_model("llama-3.1-8b"))
    assert fm.predict(VllmFlags(max_model_len=8192)).ok
    # one GPU measured: tensor parallelism over two cannot start
    two = fm.predict(VllmFlags(max_model_len=8192, tensor_parallel_size=2))
    assert two.reason == "invalid_flags" and two.message is not None and "the 1 NVIDIA RTX PRO 6000" in two.message


def test_auto_without_a_gpu_and_unknown_names_say_what_is_allowed() -> None:
    with pytest.raises(CatalogError, match="gpu auto: no GPU found through NVML"):
        resolve_gpu("auto", probe=lambda: [])
    with pytest.raises(CatalogError, match="unknown GPU 'tpu-v5'; this machine has NVIDIA A10G; known GPUs: rtx4090"):
        resolve_gpu("tpu-v5", probe=lambda: nvml_devices(FakeNvml([A10G])))


def test_a_gpu_given_by_its_figures() -> None:
    own = resolve_gpu({"name": "my-card", "memory_gib": 40, "bandwidth_gbps": 1200, "bf16_tflops": 200})
    assert (own.memory_gib, own.bandwidth_gbps, own.bf16_tflops, own.device_name) == (40, 1200, 200, "my-card")
    # a catalog name fills in what is left out
    l40s = resolve_gpu({"name": "l40s", "memory_gib": 44})
    assert l40s.memory_gib == 44 and l40s.bandwidth_gbps == GPUS["l40s"].bandwidth_gbps
    with pytest.raises(CatalogError, match="memory_gib is required for a GPU the catalog does not know"):
        resolve_gpu({"name": "mystery"})
    with pytest.raises(CatalogError, match="memory_gib must be a positive number, not 'lots'"):
        resolve_gpu({"name": "mystery", "memory_gib": "lots"})
    with pytest.raises(CatalogError, match="unknown field memory; allowed: name, memory_gib"):
        resolve_gpu({"name": "mystery", "memory": 24})


@pytest.mark.parametrize(
    ("device", "key"),
    [
        ("NVIDIA A10G", "a10g"),
        ("NVIDIA L40S", "l40s"),
        ("NVIDIA L4", "l4"),
        ("Tesla T4", "t4"),
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("NVIDIA GeForce RTX 3090", "rtx3090"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA B200", "b200"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA L40", None),
        ("NVIDIA A10", None),
    ],
)
def test_driver_names_map_to_the_catalog(device: str, key: str | None) -> None:
    assert catalog_key_for_device(device) == key


def test_the_issue_s_cards_are_in_the_catalog_with_a_source() -> None:
    for key in ("a10g", "l40s", "l4", "t4", "rtx-a6000", "rtx3090", "a100-80gb", "h100-80gb", "h200", "b200", "mi300x"):
        assert GPUS[key].source, key
        assert get_gpu(key.upper()) is GPUS[key]
    assert GPUS["mi300x"].vendor == "amd"
    assert get_gpu("NVIDIA A10G") is GPUS["a10g"]  # nvidia-smi's name


def test_largest_gpus_get_vllm_s_largest_defaults() -> None:
    llama = load_model("llama-3.1-8b")
    for key in ("b200", "mi300x"):
        r = resolve(VllmFlags(), get_gpu(key), llama)
        assert (r.max_num_seqs, r.max_num_batched_tokens) == (1024, 16384), key
    h200 = resolve(VllmFlags(), get_gpu("h200"), llama)
    assert (h200.max_num_seqs, h200.max_num_batched_tokens) == (1024, 8192)


AMD_STATIC = [
    {"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X"}, "vram": {"size": {"value": 196592, "unit": "MB"}}},
    {"gpu": 1, "asic": {"market_name": "AMD Instinct MI300X"}, "vram": {"size": {"value": 196592, "unit": "MB"}}},
]
AMD_USAGE = [
    {"gpu": 0, "mem_usage": {"used_vram": {"value": 283, "unit": "MB"}}},
    {"gpu": 1, "mem_usage": {"used_vram": {"value": 2048, "unit": "MB"}}},
]


def test_amd_smi_json_gives_the_devices() -> None:
    def run(argv: Sequence[str]) -> str | None:
        if argv[:2] == ["amd-smi", "static"]:
            return json.dumps(AMD_STATIC)
        if argv[:2] == ["amd-smi", "metric"]:
            return json.dumps(AMD_USAGE)
        return None

    devices = amd_devices(run)
    assert [(d.name, d.vendor) for d in devices] == [("AMD Instinct MI300X", "amd")] * 2
    assert devices[0].total_gib == pytest.approx(191.98, abs=0.01)
    assert memory_in_use_gib(devices) == pytest.approx(2.0)
    gpu = resolve_gpu("auto", probe=lambda: machine_devices(FakeNvml([], fail_init=True), run))
    assert gpu.key == "mi300x" and gpu.vendor == "amd" and gpu.count == 2


def test_rocm_smi_json_when_amd_smi_is_missing() -> None:
    rocm: dict[str, Any] = {
        "card0": {
            "Card Series": "AMD Instinct MI300X",
            "VRAM Total Memory (B)": str(206141652992),
            "VRAM Total Used Memory (B)": str(300 * 2**20),
        },
        "system": {"Driver version": "6.8.5"},
    }

    def run(argv: Sequence[str]) -> str | None:
        return json.dumps(rocm) if argv[0] == "rocm-smi" else None

    devices = amd_devices(run)
    assert len(devices) == 1 and devices[0].name == "AMD Instinct MI300X"
    assert devices[0].total_gib == pytest.approx(191.98, abs=0.01)
    assert amd_devices(lambda argv: None) == []


def test_a_mistyped_gpu_name_gets_the_closest_catalog_name() -> None:
    none = lambda: []  # noqa: E731
    for typed, meant in (("h100-80g", "h100-80gb"), ("a100-40", "a100-40gb"), ("L40", "l40s"), ("rtx-4090", "rtx4090")):
        with pytest.raises(CatalogError, match=re.escape(f"unknown GPU {typed!r} (did you mean {meant}?); known GPUs")):
            resolve_gpu(typed, probe=none)
    with pytest.raises(CatalogError, match=re.escape("unknown GPU 'v100'; known GPUs")):  # a V100 is no H100
        resolve_gpu("v100", probe=none)
