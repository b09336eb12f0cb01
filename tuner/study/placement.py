"""Where a trial's servers run, and the GPU memory other processes hold there, read as vLLM's start-up reads it.

vLLM takes a snapshot of each rank's GPU at start and refuses when its free memory is below `gpu_memory_utilization`
x total ("Free memory on device ... is less than desired"); what another process holds is not its to give. So the
study's prediction reads that memory on the trial's own GPUs just before the trial: the set a `--parallel` worker
borrowed (held from the prediction through every start of the server), else the first world-size GPUs the launcher's
servers see. The launcher's own idle wait runs first, so the memory of the server before, still being given back, is
not counted as another process's.

The emulator imitates a GPU it does not have: its memory in use is the job's figure, never the machine's.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from tuner.catalog.nvml import DeviceInfo, machine_devices, memory_in_use_gib
from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.launch import DockerLauncher, Launcher
from tuner.launch.gpu_idle import GpuIdleWaiter
from tuner.launch.gpu_pool import visible_ids
from tuner.launch.pooled import OnDevices, PooledLauncher

__all__ = ["DeviceRead", "Placement", "idle_waiter", "in_use_gib", "placed"]

DeviceRead = Callable[[], Sequence[DeviceInfo]]


@dataclass(frozen=True)
class Placement:
    """A trial's launcher and its GPUs (None: the ones the launcher gives every server)."""

    launcher: Launcher
    devices: tuple[str, ...] | None = None


@contextmanager
def placed(launcher: Launcher, flags: VllmFlags, trial: int | None = None) -> Iterator[Placement]:
    """The trial's GPUs, held until the block ends when they are borrowed from the box's pool."""
    if isinstance(launcher, PooledLauncher):
        with launcher.hold(flags, trial) as (on_devices, devices):
            yield Placement(on_devices, devices)
    else:
        yield Placement(launcher)


def in_use_gib(
    job: Job,
    placement: Placement,
    flags: VllmFlags,
    read: DeviceRead = machine_devices,
    environ: Mapping[str, str] | None = None,
) -> float:
    """GiB other processes hold on the fullest of the GPUs the trial's server will have (vLLM checks each rank)."""
    if job.target.launcher == "emulator":
        return job.target.emulator.memory_in_use_gib
    if job.gpu_profile().is_cpu:
        return 0.0
    waiter = idle_waiter(placement.launcher)
    if waiter is not None:
        asyncio.run(waiter.wait())
    devices = list(read())
    by_id = {str(d.index): d for d in devices}
    ids = _server_ids(placement, [d.index for d in devices], flags.world_size, environ)
    # An id NVML does not number (a UUID in CUDA_VISIBLE_DEVICES) cannot be read: it counts as free.
    return memory_in_use_gib([by_id[i] for i in ids if i in by_id])


def idle_waiter(launcher: Launcher) -> GpuIdleWaiter | None:
    """The launcher's wait for its GPUs' memory (None: a launcher without one, a test's fake)."""
    inner = launcher.launcher if isinstance(launcher, OnDevices) else launcher
    waiter = getattr(inner, "gpu_idle", None)
    return waiter if isinstance(waiter, GpuIdleWaiter) else None


def _server_ids(
    placement: Placement, indices: Sequence[int], world: int, environ: Mapping[str, str] | None
) -> list[str]:
    """The GPUs the server's ranks take: vLLM's rank i runs on the i-th GPU it is shown."""
    if placement.devices is not None:
        return list(placement.devices)
    launcher = placement.launcher
    if isinstance(launcher, DockerLauncher):
        # The container is shown the GPUs Docker gives it, whatever the tuner's own CUDA_VISIBLE_DEVICES says.
        gpus = launcher.gpus
        if gpus is None or gpus == "none":
            return []
        shown = [str(i) for i in indices] if gpus == "all" else [gpus] if isinstance(gpus, str) else list(gpus)
    else:
        shown = list(visible_ids(indices, dict(os.environ if environ is None else environ)))
    return shown[:world]
