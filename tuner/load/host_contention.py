"""Reading what the host was doing around a load phase: its load, the CPU other processes used, steal time.

"Other processes" are those outside the study's own process trees: this process and its descendants (a process
launcher's server, the emulator), and a Docker server's container, whose first process the engine starts (its host
pid from `docker inspect`, `Server.root_pids`).
Where /proc is not there (macOS), the CPU figures are None and only the load average is read.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from tuner.load.contention import Contention

__all__ = ["HostReading", "HostSampler", "between"]

_STEAL_FIELD = 7  # user nice system idle iowait irq softirq steal (guest, guest_nice are within user, nice)


@dataclass(frozen=True)
class HostReading:
    """One reading: /proc/stat's jiffies (all CPUs), the study's own tree's, the load average and the wall time."""

    wall_s: float
    load: float | None
    total: int | None = None
    idle: int | None = None
    steal: int | None = None
    own: int | None = None
    cpus: int | None = None


def between(before: HostReading, after: HostReading) -> Contention:
    """What the host did between two readings (pure)."""
    out = Contention(
        seconds=round(after.wall_s - before.wall_s, 3),
        cpus=after.cpus,
        load_before=before.load,
        load_after=after.load,
    )
    if None in (before.total, after.total, before.idle, after.idle, before.own, after.own, after.cpus):
        return out
    assert before.total is not None and after.total is not None and after.cpus  # for mypy: checked above
    total = after.total - before.total
    if total <= 0:
        return out
    steal = (after.steal or 0) - (before.steal or 0)
    # Stolen time ran no process of this machine's: not the others' either.
    busy = total - ((after.idle or 0) - (before.idle or 0)) - steal
    own = (after.own or 0) - (before.own or 0)
    # A descendant that ended and was reaped outside the tree takes its time with it: never below zero.
    other = max(0.0, busy - own)
    per_cpu = total / after.cpus  # jiffies one CPU had over the span
    return out.model_copy(update={"other_cores": round(other / per_cpu, 3), "steal": round(max(0, steal) / total, 4)})


class HostSampler:
    """Reads the host (`proc`: where /proc is, for a test's fake tree; `pid`: the root of the study's own tree;
    `also`: roots of trees that count as its own too, a container's first process)."""

    def __init__(self, proc: Path = Path("/proc"), pid: int | None = None, also: tuple[int, ...] = ()) -> None:
        self.proc = proc
        self.pid = pid if pid is not None else os.getpid()
        self.also = also

    def read(self) -> HostReading:
        try:
            load: float | None = os.getloadavg()[0]
        except OSError:
            load = None
        reading = HostReading(wall_s=time.monotonic(), load=load)
        stat = self._stat()
        if stat is None:
            return reading
        total, idle, steal, cpus = stat
        return HostReading(reading.wall_s, load, total, idle, steal, self._own(), cpus)

    def _stat(self) -> tuple[int, int, int, int] | None:
        try:
            lines = (self.proc / "stat").read_text().splitlines()
        except OSError:
            return None
        fields = [int(x) for x in lines[0].split()[1:]] if lines and lines[0].startswith("cpu ") else []
        if len(fields) < 5:
            return None
        cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
        total = sum(fields[: _STEAL_FIELD + 1])
        steal = fields[_STEAL_FIELD] if len(fields) > _STEAL_FIELD else 0
        return total, fields[3] + fields[4], steal, cpus or (os.cpu_count() or 1)

    def _own(self) -> int:
        """Jiffies of the study's tree: each live process's own and its reaped children's (utime stime cutime
        cstime), so a child that ended and was waited for still counts, in its parent's."""
        parents: dict[int, int] = {}
        times: dict[int, int] = {}
        for entry in self.proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                text = (entry / "stat").read_text()
            except OSError:
                continue  # ended meanwhile
            # The command name may hold spaces and parentheses: the fields start after its last ")".
            rest = text[text.rfind(")") + 2 :].split()
            if len(rest) < 15:
                continue
            parents[int(entry.name)] = int(rest[1])
            times[int(entry.name)] = sum(int(x) for x in rest[11:15])
        tree = {self.pid, *self.also}
        grew = True
        while grew:
            more = {pid for pid, ppid in parents.items() if ppid in tree and pid not in tree}
            tree |= more
            grew = bool(more)
        return sum(times.get(pid, 0) for pid in tree)
