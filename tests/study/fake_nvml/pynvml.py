"""A stand-in for nvidia-ml-py's `pynvml`: a box of $FAKE_NVML_GPUS (default 4) idle L4s.

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


def nvmlDeviceGetMemoryInfo(handle: int, version: object = None) -> SimpleNamespace:
    return SimpleNamespace(total=23 * _GIB, used=0, free=23 * _GIB, reserved=0)
