"""Before a trial starts, wait until the GPU's memory is back to its idle level.

A stopped vLLM frees its memory a moment after its process is gone (the driver tears the context down); a start in
that moment fails with "Free memory on device ... is less than desired". NVML (nvidia-ml-py) reads the memory in
use; without a GPU or without the package this is a no-op.

The same reading finds a GPU lost under the study: once NVML has read a GPU, a later failure to read it (an Xid
error, a driver reset: `nvidia-smi` fails then too) raises `GpuLost` naming it, never "nothing to wait for".
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tuner.catalog.nvml import unreachable
from tuner.errors import GpuLost

log = logging.getLogger(__name__)

MIB = 1024**2

# Memory in use per device, in bytes, or None when it cannot be read.
MemoryProbe = Callable[[], list[int] | None]


class _NvmlProbe:
    def __init__(self, indices: Sequence[int] | None = None, nvml: Any | None = None) -> None:
        self._lib = nvml  # None: the real pynvml, imported when first read
        self._nvml: Any = None
        self._failed = False
        self._indices = None if indices is None else list(indices)
        self._names: dict[int, str] | None = None  # the GPUs read once: a later failure to read one is a loss

    def __call__(self) -> list[int] | None:
        if self._failed:
            return None
        try:
            if self._nvml is None:
                lib = self._lib if self._lib is not None else importlib.import_module("pynvml")
                lib.nvmlInit()
                self._nvml = lib
            nvml = self._nvml
            if self._names is None:
                return self._first(nvml)
            return _used(nvml, self._names)
        except Exception as e:
            if self._names is None:  # no package, no driver, no GPU: nothing to wait for, ever
                self._failed = True
                return None
            self._lost(e)
            return None

    def _first(self, nvml: Any) -> list[int]:
        """The first reading: from now on every GPU NVML counts is this probe's. One NVML counts but says is lost
        ("GPU is lost") is lost already; one it cannot read for another reason (a reading it does not support)
        leaves the probe saying nothing, as before."""
        indices = self._indices if self._indices is not None else range(nvml.nvmlDeviceGetCount())
        names = {i: _name(nvml, i) for i in indices}
        try:
            used = _used(nvml, names)
        except Exception as e:
            if "lost" in str(e).lower():
                self._names = names
            raise
        self._names = names
        return used

    def _lost(self, error: Exception) -> None:
        """The GPUs read before that NVML cannot read now, raised as GpuLost; nothing when a second look finds them."""
        assert self._names is not None and self._nvml is not None
        nvml, names = self._nvml, dict(self._names)
        lost = unreachable(nvml, list(names))
        if not lost:
            log.debug("an NVML reading failed, then every GPU answered", exc_info=error)
            return
        said = "; ".join(f"GPU {i} ({names[i]}): {why}" for i, why in lost.items())
        first = min(lost)

        def answers() -> bool:
            with contextlib.suppress(Exception):  # after a driver reset NVML must be started again
                nvml.nvmlInit()
            return not unreachable(nvml, list(lost))

        log.debug("NVML lost a GPU", exc_info=error)  # the details, for the log file only
        raise GpuLost(f"NVML no longer reads {said}", f"GPU {first} ({names[first]})", answers, tuple(sorted(lost)))


def _used(nvml: Any, indices: Iterable[int]) -> list[int]:
    return [int(nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(i)).used) for i in indices]


def _name(nvml: Any, index: int) -> str:
    try:
        value = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(index))
    except Exception:  # read again, and named lost, by the memory reading that follows
        return "its name unread"
    return value.decode() if isinstance(value, bytes) else str(value)


def nvml_probe(indices: Sequence[int] | None = None, nvml: Any | None = None) -> MemoryProbe:
    """The memory in use on the GPUs of these NVML indices (None: every GPU), through `nvml` (a test's stand-in;
    None: nvidia-ml-py's pynvml). Raises GpuLost for a GPU it read before and cannot read now."""
    return _NvmlProbe(indices, nvml)


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

    def check(self) -> None:
        """Raises GpuLost when a GPU read before no longer answers (a probe without GPUs says nothing)."""
        self._probe()

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
