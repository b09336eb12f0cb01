"""The box's GPUs as a pool the parallel workers borrow from: a trial takes as many as its flags need, gives them
back when its server is stopped.

A borrowed GPU is an exclusive `flock` on a file of its own under the state directory, so the pool holds across
worker processes (and across two studies tuned on one box at once) without a coordinator, and a worker killed with
SIGKILL gives its GPUs back as the kernel closes its files. A borrower waits at the head of a queue (one more lock)
while it holds none: a trial of 4 GPUs is not starved by trials of 1 that keep taking whichever GPU frees first, and
nobody holds some GPUs while waiting for others, so no two borrowers can deadlock.

Behind the head, a narrower trial may start on GPUs that are free now (a backfill): a TP-4 trial waiting for the
last of its four would otherwise leave three idle for a whole trial. Backfills are counted per wait at the head
(at most `backfills`, by default the pool's size, the head announcing itself in a file of its own), so a stream
of narrow trials cannot starve it: past the count they queue behind it like everyone else.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from tuner.errors import GpuLost
from tuner.launch.registry import default_state_dir

__all__ = ["GpuPool", "default_pool_dir", "visible_ids"]

_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def default_pool_dir() -> Path:
    """Beside the process registry: one pool per box (or per $TUNER_STATE_DIR), whatever study borrows."""
    return default_state_dir().parent / "gpus"


class GpuPool:
    """`ids`: the device ids a server can be given (NVML indices, or the entries of CUDA_VISIBLE_DEVICES)."""

    def __init__(
        self, ids: Sequence[str], lock_dir: Path | None = None, *, poll_s: float = 0.2, backfills: int | None = None
    ) -> None:
        if not ids:
            raise ValueError("a GPU pool needs at least one device")
        self.ids = tuple(str(i) for i in ids)
        self.dir = lock_dir if lock_dir is not None else default_pool_dir()
        self.poll_s = poll_s
        self.backfills = len(self.ids) if backfills is None else backfills

    @property
    def size(self) -> int:
        return len(self.ids)

    def _open(self, name: str) -> IO[str]:
        self.dir.mkdir(parents=True, exist_ok=True)
        return self._path(name).open("a+")

    def _path(self, name: str) -> Path:
        return self.dir / f"{_SAFE.sub('_', name)}.lock"

    @contextlib.asynccontextmanager
    async def borrow(self, n: int, prefer: Sequence[str] = ()) -> AsyncIterator[tuple[str, ...]]:
        """`n` GPUs held until the block ends; the `prefer`red ones first (a worker's own, so that a study of
        one-GPU trials keeps each worker on one GPU), then the lowest free ids."""
        held: list[tuple[str, IO[str]]] = []
        try:
            with self._waiting(n, prefer) as attempt:
                while not (held := attempt()):
                    await asyncio.sleep(self.poll_s)
            yield self._sorted(held)
        finally:
            _release(held)

    @contextlib.contextmanager
    def hold(self, n: int, prefer: Sequence[str] = ()) -> Iterator[tuple[str, ...]]:
        """`borrow` for a caller outside an event loop: the study holds a trial's GPUs from its prediction (which
        reads their memory) through every start of its server, each start an event loop of its own."""
        held: list[tuple[str, IO[str]]] = []
        try:
            with self._waiting(n, prefer) as attempt:
                while not (held := attempt()):
                    time.sleep(self.poll_s)
            yield self._sorted(held)
        finally:
            _release(held)

    @contextlib.contextmanager
    def _waiting(self, n: int, prefer: Sequence[str]) -> Iterator[Callable[[], list[tuple[str, IO[str]]]]]:
        """One borrower's wait, as an attempt to call until it returns GPUs: first for the head of the queue
        (a backfill meanwhile where the head allows one), then, at the head, for `n` free at once."""
        order = self._order(n, prefer)
        head = False

        def attempt() -> list[tuple[str, IO[str]]]:
            nonlocal head
            lost = self._usable(n)
            if not head:
                if not _try_lock(queue):
                    return self._backfill(n, order, lost)
                head = True
                self._announce({"n": n, "backfills": 0})
            return self._take(n, order, lost)

        with self._open(".queue") as queue:
            try:
                yield attempt
            finally:
                if head:
                    self._announce(None)
                    fcntl.flock(queue, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def _head_file(self) -> Iterator[tuple[IO[str], dict[str, int] | None]]:
        """The head's announcement (its width and the backfills made past it), locked while read and written."""
        with self._open(".head") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            text = f.read().strip()
            yield f, json.loads(text) if text else None

    def _announce(self, head: dict[str, int] | None) -> None:
        with self._head_file() as (f, _):
            _rewrite(f, head)

    def _backfill(self, n: int, order: Sequence[str], lost: set[str]) -> list[tuple[str, IO[str]]]:
        """`n` GPUs taken past the head when it is wider and has not seen its count of backfills; else none."""
        with self._head_file() as (f, head):
            if head is None or n >= head["n"] or head["backfills"] >= self.backfills:
                return []
            held = self._take(n, order, lost)
            if held:
                _rewrite(f, {**head, "backfills": head["backfills"] + 1})
            return held

    def _order(self, n: int, prefer: Sequence[str]) -> list[str]:
        if not 1 <= n <= self.size:
            raise ValueError(f"cannot borrow {n} of {self.size} GPUs")
        return [i for i in prefer if i in self.ids] + [i for i in self.ids if i not in prefer]

    # -- GPUs lost (NVML stopped reading them): out of the pool until a run starts afresh ----------------------

    def mark_lost(self, ids: Sequence[str]) -> None:
        """No borrower is given these again (a worker that stopped on a lost GPU would hand it to the next)."""
        for device in ids:
            self._open(f"gpu-{device}.lost").close()

    def lost(self) -> list[str]:
        return [d for d in self.ids if self._path(f"gpu-{d}.lost").exists()]

    def clear_lost(self) -> None:
        """A new run reads the GPUs afresh (a lost GPU comes back after a reset): the marks of the last run go."""
        for device in self.ids:
            self._path(f"gpu-{device}.lost").unlink(missing_ok=True)

    def _usable(self, n: int) -> set[str]:
        """The GPUs marked lost; GpuLost when too few others are left for a server of `n`."""
        lost = self.lost()
        if len(self.ids) - len(lost) < n:
            raise GpuLost(
                f"a server needs {n} GPUs and {len(lost)} of the {self.size} given are lost ({', '.join(lost)})",
                f"GPU {lost[0]}",
                lambda: False,
            )
        return set(lost)

    def _take(self, n: int, order: Sequence[str], lost: set[str]) -> list[tuple[str, IO[str]]]:
        """`n` GPUs locked, in `order`'s preference, none of the `lost`; none when fewer are free (what was taken
        is given back, so others' trials can end and free theirs)."""
        held: list[tuple[str, IO[str]]] = []
        for device in order:
            if len(held) == n:
                break
            if device in lost:
                continue
            f = self._open(f"gpu-{device}")
            if _try_lock(f):
                held.append((device, f))
            else:
                f.close()
        if len(held) < n:
            _release(held)
            return []
        return held

    def _sorted(self, held: Sequence[tuple[str, IO[str]]]) -> tuple[str, ...]:
        return tuple(sorted((d for d, _ in held), key=self.ids.index))

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


def _rewrite(f: IO[str], head: dict[str, int] | None) -> None:
    f.seek(0)
    f.truncate()
    if head is not None:
        f.write(json.dumps(head))
    f.flush()


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
