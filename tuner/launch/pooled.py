"""A launcher whose every server gets GPUs of its own, borrowed from the box's pool for as long as it runs.

`tuner tune --parallel N` gives each worker one: the trial's flags say how many GPUs it needs (tensor x pipeline
parallel size), the pool lends that many, and the job's own launcher kind is built for them (CUDA_VISIBLE_DEVICES
for a process, Docker device_ids for a container, the emulator's imitation of the same variable).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager

from tuner.errors import GpuLost
from tuner.flags import VllmFlags
from tuner.launch.base import Launcher, Server
from tuner.launch.gpu_pool import GpuPool

__all__ = ["OnDevices", "PooledLauncher", "gpus_needed"]

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
            async with OnDevices(self._launcher(devices), devices).start(flags, study=study, trial=trial) as server:
                yield server

    @contextmanager
    def hold(self, flags: VllmFlags, trial: int | None = None) -> Iterator[tuple[Launcher, tuple[str, ...]]]:
        """A trial's GPUs held across its prediction and every start of its server: the launcher that starts it
        on them (its servers name them), and the GPUs."""
        with self.pool.hold(gpus_needed(flags), prefer=self.home) as devices:
            self._on_borrow(trial, devices)
            try:
                yield OnDevices(self._launcher(devices), devices), devices
            except GpuLost as e:
                # Out of the pool for the rest of the run: another worker would borrow it next and stop too.
                named = [d for d in devices if d in {str(i) for i in e.indices}]
                self.pool.mark_lost(named or devices)  # ids NVML does not number (UUIDs): the trial's set
                raise

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return self._launcher(self.home or self.pool.ids[:1]).cleanup_leftovers(study)

    def close(self) -> None:
        for launcher in self._cache.values():
            close = getattr(launcher, "close", None)
            if callable(close):
                close()


class OnDevices:
    """The job's launcher built for `devices`, whose servers say which GPUs they ran on (the trial's record)."""

    def __init__(self, launcher: Launcher, devices: tuple[str, ...]) -> None:
        self.launcher = launcher
        self.devices = devices
        self.name = launcher.name

    @asynccontextmanager
    async def _start(self, flags: VllmFlags, study: str | None, trial: int | None) -> AsyncIterator[Server]:
        async with self.launcher.start(flags, study=study, trial=trial) as server:
            server.devices = self.devices
            yield server

    def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> AbstractAsyncContextManager[Server]:
        return self._start(flags, study, trial)

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return self.launcher.cleanup_leftovers(study)
