"""A stand-in for nvidia-ml-py's `pynvml`: a box of $FAKE_NVML_GPUS (default 4) L4s, idle unless
$FAKE_NVML_USED_GIB gives what other processes hold on each, in device order ("0,0,6,0").

Put this directory first on PYTHONPATH (or sys.path) and every NVML reading of the tuner, in this process and in the
worker processes it spawns, sees that box; the real library is not needed.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

_GIB = 1024**3


def _count() -> int:
    return int(os.environ.get("FAKE_NVML_GPUS", "4"))


def nvmlInit() -> None:
    pass


def nvmlShutdown() -> None:
    pass


def nvmlDeviceGetCount() -> int:
    return _count()


def nvmlDeviceGetHandleByIndex(i: int) -> int:
    if not 0 <= i < _count():
        raise ValueError(f"no GPU {i}")
    return i


def nvmlDeviceGetName(handle: int) -> str:
    return "NVIDIA L4"


def _used(i: int) -> int:
    given = [float(x) for x in os.environ.get("FAKE_NVML_USED_GIB", "").split(",") if x.strip()]
    return int(given[i] * _GIB) if i < len(given) else 0


def nvmlDeviceGetMemoryInfo(handle: int, version: object = None) -> SimpleNamespace:
    used = _used(handle)
    return SimpleNamespace(total=23 * _GIB, used=used, free=23 * _GIB - used, reserved=0)
