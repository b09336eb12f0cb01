"""The machine's GPUs as NVML (NVIDIA, `nvidia-ml-py`) or amd-smi / rocm-smi (AMD) report them: name, memory, count.

Every probe takes its source as an argument (the `pynvml` module, a command runner), so tests hand in a fake and no
GPU is needed; the default is the real library or command, and "no GPU here" is an empty list, never an exception.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1024**3


@dataclass(frozen=True)
class DeviceInfo:
    """One GPU as the driver sees it. `total_bytes` is what CUDA calls total (NVML's total less its reserved
    memory, when the driver reports that), `used_bytes` what other processes hold now."""

    index: int
    name: str
    total_bytes: int
    used_bytes: int
    vendor: str = "nvidia"

    @property
    def total_gib(self) -> float:
        return self.total_bytes / GIB

    @property
    def used_gib(self) -> float:
        return self.used_bytes / GIB


def _load_pynvml() -> Any | None:
    try:
        import pynvml  # nvidia-ml-py: the `gpu` extra
    except ImportError:
        return None
    return pynvml


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_devices(nvml: Any | None = None) -> list[DeviceInfo]:
    """The NVIDIA GPUs NVML sees (the `CUDA_VISIBLE_DEVICES` a container gets are the ones it sees); [] when NVML or
    its driver is missing."""
    lib = nvml if nvml is not None else _load_pynvml()
    if lib is None:
        return []
    try:
        lib.nvmlInit()
    except Exception:  # no driver, no device: the library raises its own NVMLError subclasses
        return []
    try:
        devices = []
        for i in range(int(lib.nvmlDeviceGetCount())):
            handle = lib.nvmlDeviceGetHandleByIndex(i)
            name = _text(lib.nvmlDeviceGetName(handle))
            info = _memory_info(lib, handle)
            reserved = int(getattr(info, "reserved", 0) or 0)
            devices.append(DeviceInfo(i, name, int(info.total) - reserved, int(info.used), "nvidia"))
        return devices
    except Exception:
        return []
    finally:
        with contextlib.suppress(Exception):
            lib.nvmlShutdown()


def _memory_info(lib: Any, handle: Any) -> Any:
    """The v2 structure when the driver has it: its `reserved` is memory CUDA cannot allocate."""
    v2 = getattr(lib, "nvmlMemory_v2", None)
    if v2 is not None:
        try:
            return lib.nvmlDeviceGetMemoryInfo(handle, version=v2)
        except Exception:
            pass
    return lib.nvmlDeviceGetMemoryInfo(handle)


def _said(error: BaseException) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def unreachable(lib: Any, indices: Sequence[int]) -> dict[int, str]:
    """The GPUs of these NVML indices that NVML (initialised) cannot read now, each with NVML's words ("GPU is
    lost", "Unknown Error"): an Xid error, a GPU fallen off the bus, a driver reset. {} when every one answers."""
    try:
        count = int(lib.nvmlDeviceGetCount())
    except Exception as e:
        return {i: _said(e) for i in indices}
    lost = {}
    for i in indices:
        if i >= count:
            lost[i] = f"NVML counts {count} GPUs now"
            continue
        try:
            lib.nvmlDeviceGetMemoryInfo(lib.nvmlDeviceGetHandleByIndex(i))
        except Exception as e:  # pynvml's NVMLError subclasses: GpuIsLost, Unknown, NotFound...
            lost[i] = _said(e)
    return lost


Runner = Callable[[Sequence[str]], str | None]


def _run(argv: Sequence[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _number(value: Any) -> int:
    """amd-smi writes sizes as {"value": N, "unit": "MB"} or plain numbers; rocm-smi as strings of bytes."""
    if isinstance(value, dict):
        n = float(value.get("value", 0))
        unit = str(value.get("unit", "B")).upper()
        scale = {"B": 1, "KB": 1024, "MB": 1024**2, "GB": 1024**3}.get(unit, 1)
        return int(n * scale)
    try:
        return int(float(str(value).split()[0]))
    except (ValueError, IndexError):
        return 0


def amd_devices(run: Runner = _run) -> list[DeviceInfo]:
    """The AMD GPUs amd-smi (ROCm 6+) or rocm-smi report, in their JSON forms; [] when neither answers."""
    out = run(["amd-smi", "static", "--asic", "--vram", "--json"])
    usage = run(["amd-smi", "metric", "--mem-usage", "--json"])
    if out:
        try:
            static = json.loads(out)
            used = {int(d.get("gpu", i)): d for i, d in enumerate(json.loads(usage))} if usage else {}
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            static = []
            used = {}
        devices = []
        for i, d in enumerate(static if isinstance(static, list) else []):
            index = int(d.get("gpu", i))
            name = str((d.get("asic") or {}).get("market_name") or "AMD GPU")
            total = _number((d.get("vram") or {}).get("size"))
            mem = (used.get(index) or {}).get("mem_usage") or {}
            devices.append(DeviceInfo(index, name, total, _number(mem.get("used_vram")), "amd"))
        if devices:
            return devices
    out = run(["rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json"])
    if not out:
        return []
    try:
        cards = json.loads(out)
    except json.JSONDecodeError:
        return []
    devices = []
    for i, (card, d) in enumerate(sorted(cards.items()) if isinstance(cards, dict) else []):
        if not card.startswith("card") or not isinstance(d, dict):
            continue
        name = str(d.get("Card Series") or d.get("Card series") or d.get("Card model") or "AMD GPU")
        total = _number(d.get("VRAM Total Memory (B)", 0))
        in_use = _number(d.get("VRAM Total Used Memory (B)", 0))
        devices.append(DeviceInfo(i, name, total, in_use, "amd"))
    return devices


def machine_devices(nvml: Any | None = None, run: Runner = _run) -> list[DeviceInfo]:
    """NVIDIA GPUs through NVML, else AMD GPUs through amd-smi / rocm-smi."""
    return nvml_devices(nvml) or amd_devices(run)


def memory_in_use_gib(devices: Sequence[DeviceInfo]) -> float:
    """Memory other processes hold on the busiest of the GPUs a server would use: vLLM checks each rank's free
    memory against its share, so the fullest GPU decides."""
    return max((d.used_gib for d in devices), default=0.0)


__all__ = ["DeviceInfo", "amd_devices", "machine_devices", "memory_in_use_gib", "nvml_devices", "unreachable"]
