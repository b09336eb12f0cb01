"""The box's GPUs as a pool the parallel workers borrow from: a trial takes as many as its flags need, gives them
back when its server is stopped.

A borrowed GPU is an exclusive `flock` on a file of its own under the state directory, so the pool holds across
worker processes (and across two studies tuned on one box at once) without a coordinator, and a worker killed with
SIGKILL gives its GPUs back as the kernel closes its files. A borrower waits at the head of a queue (one more lock)
while it holds none: a trial of 4 GPUs is not starved by trials of 1 that keep taking whichever GPU frees first, and
nobody holds some GPUs while waiting for others, so no two borrowers can deadlock.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import IO

from tuner.launch.registry import default_state_dir

__all__ = ["GpuPool", "default_pool_dir", "visible_ids"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_pool_dir() -> Path:
    """Beside the process registry: one pool per box (or per $TUNER_STATE_DIR), whatever study borrows."""
    return default_state_dir().parent / "gpus"


class GpuPool:
    """`ids`: the device ids a server can be given (NVML indices, or the entries of CUDA_VISIBLE_DEVICES)."""

    def __init__(self, ids: Sequence[str], lock_dir: Path | None = None, *, poll_s: float = 0.2) -> None:
        if not ids:
            raise ValueError("a GPU pool needs at least one device")
        self.ids = tuple(str(i) for i in ids)
        self.dir = lock_dir if lock_dir is not None else default_pool_dir()
        self.poll_s = poll_s

    @property
    def size(self) -> int:
        return len(self.ids)

    def _open(self, name: str) -> IO[str]:
        self.dir.mkdir(parents=True, exist_ok=True)
        return (self.dir / f"{_SAFE.sub('_', name)}.lock").open("a+")

    @contextlib.asynccontextmanager
    async def borrow(self, n: int, prefer: Sequence[str] = ()) -> AsyncIterator[tuple[str, ...]]:
        """`n` GPUs held until the block ends; the `prefer`red ones first (a worker's own, so that a study of
        one-GPU trials keeps each worker on one GPU), then the lowest free ids."""
        if not 1 <= n <= self.size:
            raise ValueError(f"cannot borrow {n} of {self.size} GPUs")
        order = [i for i in prefer if i in self.ids] + [i for i in self.ids if i not in prefer]
        held: list[tuple[str, IO[str]]] = []
        try:
            with self._open(".queue") as queue:
                await self._lock(queue)
                try:
                    while True:
                        for device in order:
                            if len(held) == n:
                                break
                            f = self._open(f"gpu-{device}")
                            if _try_lock(f):
                                held.append((device, f))
                            else:
                                f.close()
                        if len(held) == n:
                            break
                        # Not enough free: give back what was taken, so others' trials can end and free theirs.
                        _release(held)
                        held = []
                        await asyncio.sleep(self.poll_s)
                finally:
                    fcntl.flock(queue, fcntl.LOCK_UN)
            yield tuple(sorted((d for d, _ in held), key=self.ids.index))
        finally:
            _release(held)

    async def _lock(self, f: IO[str]) -> None:
        while not _try_lock(f):
            await asyncio.sleep(self.poll_s)

    def busy(self) -> list[str]:
        """The ids some borrower holds now (for a progress line; a snapshot, stale at once)."""
        out = []
        for device in self.ids:
            with self._open(f"gpu-{device}") as f:
                if _try_lock(f):
                    fcntl.flock(f, fcntl.LOCK_UN)
                else:
                    out.append(device)
        return out


def _try_lock(f: IO[str]) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _release(held: list[tuple[str, IO[str]]]) -> None:
    for _, f in held:
        with contextlib.suppress(OSError):
            fcntl.flock(f, fcntl.LOCK_UN)
        f.close()


def visible_ids(indices: Sequence[int], environ: dict[str, str] | None = None) -> tuple[str, ...]:
    """The ids a server may be given: CUDA_VISIBLE_DEVICES when the tuner itself was given some (it is the user
    saying which GPUs are the study's), else every GPU NVML counts."""
    env = os.environ if environ is None else environ
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None and given.strip():
        return tuple(d.strip() for d in given.split(",") if d.strip())
    return tuple(str(i) for i in indices)
