"""A launcher whose every server gets GPUs of its own, borrowed from the box's pool for as long as it runs.

`tuner tune --parallel N` gives each worker one: the trial's flags say how many GPUs it needs (tensor x pipeline
parallel size), the pool lends that many, and the job's own launcher kind is built for them (CUDA_VISIBLE_DEVICES
for a process, Docker device_ids for a container, the emulator's imitation of the same variable).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from tuner.flags import VllmFlags
from tuner.launch.base import Launcher, Server
from tuner.launch.gpu_pool import GpuPool

__all__ = ["PooledLauncher", "gpus_needed"]

Build = Callable[[tuple[str, ...]], Launcher]


def gpus_needed(flags: VllmFlags) -> int:
    """A server's GPUs: vLLM's world size."""
    return flags.world_size


class PooledLauncher:
    """Borrows `gpus_needed(flags)` GPUs from `pool` (its `home` ones first), starts the job's launcher on them."""

    def __init__(
        self,
        build: Build,
        pool: GpuPool,
        *,
        home: Sequence[str] = (),
        name: str | None = None,
        on_borrow: Callable[[int | None, tuple[str, ...]], None] | None = None,
    ) -> None:
        self._build = build
        self._on_borrow = on_borrow or (lambda _trial, _devices: None)
        self._cache: dict[tuple[str, ...], Launcher] = {}
        self.pool = pool
        self.home = tuple(home)
        self.name = name or self._launcher(self.home or pool.ids[:1]).name

    def _launcher(self, devices: tuple[str, ...]) -> Launcher:
        # One launcher per device set: a docker client or an idle-memory baseline is kept across trials.
        if devices not in self._cache:
            self._cache[devices] = self._build(devices)
        return self._cache[devices]

    def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> AbstractAsyncContextManager[Server]:
        return self._start(flags, study, trial)

    @asynccontextmanager
    async def _start(self, flags: VllmFlags, study: str | None, trial: int | None) -> AsyncIterator[Server]:
        async with self.pool.borrow(gpus_needed(flags), prefer=self.home) as devices:
            self._on_borrow(trial, devices)
            async with self._launcher(devices).start(flags, study=study, trial=trial) as server:
                server.devices = devices
                yield server

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return self._launcher(self.home or self.pool.ids[:1]).cleanup_leftovers(study)

    def close(self) -> None:
        for launcher in self._cache.values():
            close = getattr(launcher, "close", None)
            if callable(close):
                close()
