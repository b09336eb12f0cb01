"""Putting processes on the cores a `CpuPlan` gives them: every thread of a process, since Linux keeps an affinity
mask per thread and `sched_setaffinity(pid)` moves only the thread whose id is `pid`."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Set
from pathlib import Path

log = logging.getLogger(__name__)

__all__ = ["group_members", "keep_to", "pin_process", "place_server", "thread_cores", "thread_ids", "usable_cpus"]


def usable_cpus() -> frozenset[int]:
    """The cores this process may run on (its affinity mask, which a container or `taskset` narrows)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def thread_ids(pid: int) -> list[int]:
    """The threads of `pid` (Linux); just `pid` where /proc does not list them."""
    try:
        return sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if t.name.isdigit())
    except OSError:
        return [pid]


def pin_process(pid: int, cores: Set[int]) -> bool:
    """Every thread of `pid` onto `cores`; threads it starts later inherit them. False when the process is gone or
    the kernel refused (the caller carries on unpinned: a measurement is noisier, not wrong)."""
    done = False
    for tid in thread_ids(pid):
        try:
            os.sched_setaffinity(tid, cores)
            done = True
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as e:
            log.warning("cannot move thread %d of process %d to cores %s: %s", tid, pid, sorted(cores), e)
            return False
    return done


@contextlib.contextmanager
def keep_to(cores: Set[int]) -> Iterator[None]:
    """This process (every thread of it) on `cores` inside the block, each thread's own mask back after it.
    Threads started inside the block get the mask the main thread had before."""
    pid = os.getpid()
    before: dict[int, frozenset[int]] = {}
    for tid in thread_ids(pid):
        with contextlib.suppress(OSError):
            before[tid] = frozenset(os.sched_getaffinity(tid))
    default = before.get(pid, usable_cpus())
    pin_process(pid, cores)
    try:
        yield
    finally:
        for tid in thread_ids(pid):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(tid, before.get(tid, default))


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (Linux /proc; empty elsewhere)."""
    members = []
    try:
        entries = list(Path("/proc").iterdir())
    except OSError:
        return []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()  # state, ppid, pgrp, ...
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            members.append(int(entry.name))
    return sorted(members)


def thread_cores(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of `pid` and the cores it may run on."""
    out = {}
    for tid in thread_ids(pid):
        with contextlib.suppress(OSError):
            out[tid] = frozenset(os.sched_getaffinity(tid))
    return out


def place_server(pgid: int, worker: Set[int], others: Set[int]) -> list[int]:
    """A started vLLM CPU server's processes onto their cores; the pids found to be the worker's (none: nothing was
    moved, the worker's threads were not found bound).

    The worker cannot be started on `worker` directly: vLLM 0.32 hands its OpenMP threads their cores through
    OMP_PLACES, and libgomp drops places outside the mask the process inherited, so a server started on `others`
    would leave its worker unbound. It starts on every core instead, and once it is ready (its OpenMP threads have
    bound themselves) the process with threads inside `worker` is the worker: its other threads join them there;
    every other process of the group (the API server, the engine core) moves to `others`."""
    threads = {pid: thread_cores(pid) for pid in group_members(pgid)}
    workers = [pid for pid, ts in threads.items() if any(cores and cores <= worker for cores in ts.values())]
    if not workers:
        return []
    for pid, ts in threads.items():
        if pid not in workers:
            pin_process(pid, others)
            continue
        for tid, cores in ts.items():
            if not cores <= worker:
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(tid, worker)
    return workers
