"""Before a trial starts, wait until the GPU's memory is back to its idle level.

A stopped vLLM frees its memory a moment after its process is gone (the driver tears the context down); a start in
that moment fails with "Free memory on device ... is less than desired". NVML (nvidia-ml-py) reads the memory in
use; without a GPU or without the package this is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

MIB = 1024**2

# Memory in use per device, in bytes, or None when it cannot be read.
MemoryProbe = Callable[[], list[int] | None]


class _NvmlProbe:
    def __init__(self, indices: Sequence[int] | None = None) -> None:
        self._nvml: Any = None
        self._failed = False
        self._indices = None if indices is None else list(indices)

    def __call__(self) -> list[int] | None:
        if self._failed:
            return None
        try:
            if self._nvml is None:
                import pynvml

                pynvml.nvmlInit()
                self._nvml = pynvml
            nvml = self._nvml
            indices = self._indices if self._indices is not None else range(nvml.nvmlDeviceGetCount())
            return [int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used) for i in indices]
        except Exception:  # no package, no driver, no GPU: nothing to wait for, ever
            self._failed = True
            return None


def nvml_probe(indices: Sequence[int] | None = None) -> MemoryProbe:
    """The memory in use on the GPUs of these NVML indices (None: every GPU)."""
    return _NvmlProbe(indices)


class GpuIdleWaiter:
    """Waits until every GPU's memory in use is within `tolerance` of the lowest level seen (its idle level)."""

    def __init__(
        self,
        probe: MemoryProbe | None = None,
        *,
        tolerance_bytes: int = 512 * MIB,
        timeout_s: float = 120.0,
        poll_s: float = 0.5,
    ) -> None:
        self._probe = probe if probe is not None else nvml_probe()
        self.tolerance_bytes = tolerance_bytes
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self.idle: list[int] | None = None

    def _observe(self) -> list[int] | None:
        used = self._probe()
        if used is None:
            return None
        if self.idle is None or len(self.idle) != len(used):
            self.idle = list(used)
        else:
            self.idle = [min(a, b) for a, b in zip(self.idle, used, strict=True)]
        return used

    def _busy(self, used: list[int]) -> bool:
        assert self.idle is not None
        return any(u > i + self.tolerance_bytes for u, i in zip(used, self.idle, strict=True))

    async def wait(self) -> bool:
        """True when idle (or nothing to measure); False when the timeout passed with memory still in use."""
        used = self._observe()
        if used is None:
            return True
        deadline = time.monotonic() + self.timeout_s
        while self._busy(used):
            if time.monotonic() >= deadline:
                assert self.idle is not None
                extra = max(u - i for u, i in zip(used, self.idle, strict=True))
                log.warning(
                    "GPU memory is still %.0f MiB above its idle level after %.0f s; starting anyway",
                    extra / MIB,
                    self.timeout_s,
                )
                return False
            await asyncio.sleep(self.poll_s)
            used = self._observe()
            if used is None:
                return True
        return True
