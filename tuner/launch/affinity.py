"""Which CPU cores vLLM's CPU build and tuner's own load client get, so that a measurement reads the flags and not
where the scheduler happened to put the processes.

vLLM's CPU worker runs the model in OpenMP threads bound to the cores `VLLM_CPU_OMP_THREADS_BIND` names (a Linux
CPU list, "1" or "2-7" or "0,2,5"; "|" would separate tensor-parallel ranks). 0.32 hands the list to the worker
process it spawns as OMP_PLACES and OMP_PROC_BIND (vllm/utils/ompmultiprocessing.py); left at `auto` on a one-node
x86 machine it takes every core but the last (VLLM_CPU_NUM_OF_RESERVED_CPU, 1 by default, counts only for auto).
Nothing keeps the API server, the engine core or a load client off the worker's cores: they float over all of them,
and how much of them lands on the worker's core, not the flags, sets the figure. The plan gives the worker cores of
its own and keeps everything else on the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Set
from dataclasses import dataclass
from typing import Literal

from tuner.config.fields import parse_cpu_list

__all__ = ["ROLES", "CpuPlan", "Role", "format_cpu_list", "parse_cpu_list", "plan_cpus", "plan_from_setting"]

Role = Literal["worker", "api_server", "engine_core", "client"]
ROLES: tuple[Role, ...] = ("worker", "api_server", "engine_core", "client")
_ROLE_NAMES: dict[Role, str] = {
    "worker": "vLLM's CPU worker",
    "api_server": "the API server",
    "engine_core": "the engine core",
    "client": "tuner's load client",
}
BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def format_cpu_list(cores: Iterable[int]) -> str:
    """A Linux CPU list, runs folded into ranges: {0, 1, 2, 5} -> "0-2,5"."""
    ordered = sorted(set(cores))
    runs: list[list[int]] = []
    for core in ordered:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


@dataclass(frozen=True)
class CpuPlan:
    """The cores of each role; empty sets (with `why`) when nothing is bound and vLLM places its threads itself.

    The API server, the engine core and the load client share `others`: they are light next to the worker, and
    splitting them further would starve one of them on a small machine.
    """

    worker: frozenset[int] = frozenset()
    others: frozenset[int] = frozenset()
    why: str = ""  # why nothing is bound (when it is not)
    source: Literal["auto", "job", "off"] = "auto"

    @property
    def applies(self) -> bool:
        return bool(self.worker) and bool(self.others)

    def cores(self, role: Role) -> frozenset[int]:
        return self.worker if role == "worker" else self.others

    def env(self) -> dict[str, str]:
        """What the vLLM process is told: its worker's OpenMP threads bound to the worker's cores."""
        return {BIND_ENV: format_cpu_list(self.worker)} if self.applies else {}

    def describe(self) -> str:
        if not self.applies:
            return f"CPU cores: not split ({self.why})"
        by = "" if self.source == "auto" else " (the job's target.cpu_affinity)"
        return (
            f"CPU cores{by}: {_ROLE_NAMES['worker']} on {format_cpu_list(self.worker)}; the API server, the "
            f"engine core and tuner's load client on {format_cpu_list(self.others)}"
        )


def plan_cpus(usable: Set[int]) -> CpuPlan:
    """The automatic split of the cores this process may use (os.sched_getaffinity(0)): a quarter of them, at
    least one, for the API server, the engine core and the load client, the rest for the worker. The lowest cores
    go to the others (core 0 also takes the machine's own housekeeping)."""
    ordered = sorted(usable)
    if len(ordered) < 2:
        only = format_cpu_list(ordered) or "none"
        return CpuPlan(why=f"one usable core ({only}) cannot be split; vLLM places its threads itself")
    n_others = max(1, len(ordered) // 4)
    return CpuPlan(worker=frozenset(ordered[n_others:]), others=frozenset(ordered[:n_others]))


def plan_from_setting(
    setting: str | Mapping[str, str], usable: Set[int], environ: Mapping[str, str] | None = None
) -> CpuPlan:
    """The plan a job's `target.cpu_affinity` asks for on this machine; ValueError when it names a core this process
    may not use (a job written on another machine). A VLLM_CPU_OMP_THREADS_BIND the user exported wins: their
    binding is kept and nothing else is moved."""
    if setting == "off":
        return CpuPlan(why="target.cpu_affinity is off", source="off")
    given = (environ or {}).get(BIND_ENV)
    if given is not None:
        return CpuPlan(why=f"{BIND_ENV}={given} is set in the environment and kept", source="off")
    if setting == "auto":
        return plan_cpus(usable)
    if isinstance(setting, str):
        raise ValueError(f"{setting!r} is not allowed; use auto, off, or worker and others cores")
    worker, others = _role_cores(setting, "worker"), _role_cores(setting, "others")
    missing = (worker | others) - set(usable)
    if missing:
        raise ValueError(
            f"core {format_cpu_list(missing)} is not usable here (this process may use "
            f"{format_cpu_list(usable)}); give cores of this machine, or auto"
        )
    return CpuPlan(worker=worker, others=others, source="job")


def _role_cores(setting: Mapping[str, str], role: str) -> frozenset[int]:
    try:
        return parse_cpu_list(setting[role])
    except ValueError as e:
        raise ValueError(f"{role}: {e}") from None
