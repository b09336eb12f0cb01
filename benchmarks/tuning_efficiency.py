"""How many real trials and server-minutes each sampler needs to reach 97% and 99% of the best feasible throughput
an exhaustive grid over the same space finds, on emulator scenarios; against the grid itself (vLLM's
benchmarks/auto_tune shape: every point launched in order).

The "server" is the emulator's own engine (tuner.emulator.engine: V1 scheduler, paged KV pool, step-time model,
runtime-OOM threshold) with its start-up arithmetic (tuner.capacity.plan_startup), driven in virtual time by the
job's clients (tuner.twin.simulate): the same dynamics the HTTP emulator serves, without sockets or sleeping, so a
trial costs milliseconds and every grid point can be measured. Start-up costs the emulator's own emulated start-up
time (weights load + profiling + CUDA-graph capture); a failed start costs the same (vLLM fails after loading and
profiling); a flag set the pre-launch filter skips, or a duplicate, costs nothing.

"Reality" scenarios measure a server whose hidden figures differ from the catalog's (step-time terms, scheduler
overhead, KV memory, the runtime-OOM headroom: `hidden`) while the twin sampler starts from the catalog: the
sim-to-real gap it must close from the real trials alone. The "outside" ones add effects the twin's model family
cannot express (`Reality`: a step mixing prefill and decode costing more, per-sequence work growing faster than
linearly with the batch, a cliff in a step's cost above a number of tokens): a twin that cannot fit them must still
find the best, or hand over to a sampler that does.

The samplers run through the real study (tuner.study.TuningRun on a SQLite file: baseline first, feasibility filter,
one launch per flag set, failures told as infeasible) with a launcher and load phase that replay the simulation.

    .venv/bin/python benchmarks/tuning_efficiency.py --seeds 3      # every scenario (see benchmarks/README.md)
    .venv/bin/python benchmarks/tuning_efficiency.py --seeds 5 --scenario l4-demo --sampler twin

The gp rows appear where torch and scipy are importable (they are not project dependencies).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.config import Job, parse_job
from tuner.emulator.config import parse_config
from tuner.emulator.emulator import Emulator
from tuner.emulator.step_time import StepTimeModel
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.load import LoadResult, RequestRecord
from tuner.load.slo_guard import SloGuard
from tuner.scoring import summarize
from tuner.store import flag_key
from tuner.study import Measurement, TuningRun
from tuner.twin.sampler import TwinSampler
from tuner.twin.simulate import Coefficients, SimPoint
from tuner.twin.simulate import simulate as twin_simulate

TARGETS = (0.97, 0.99)
CATALOG = Coefficients()
# GPSampler needs torch and scipy (not project dependencies): without them its rows are left out.
_GP = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("scipy") is not None
# A method: the job's `sampler` section (its name and options). The GP "before" row rebuilds the sampler as it was
# made before the baseline's missing flags were modelled (GP's random independent sampler): see run_sampler.
METHODS: dict[str, dict[str, Any]] = {
    "twin": {"name": "twin"},
    "random": {"name": "random"},
    "tpe": {"name": "tpe"},
    "tpe, group: false (before)": {"name": "tpe", "group": False},
    "tpe, multivariate: false": {"name": "tpe", "multivariate": False},
    "nsga2": {"name": "nsga2"},
    **({"gp": {"name": "gp"}, "gp, random independent (before)": {"name": "gp"}} if _GP else {}),
}
SAMPLERS = tuple(METHODS)

SCENARIOS: dict[str, dict[str, Any]] = {
    # The README demo: an L4 whose default batch overflows the KV cache under 40 users with long prompts.
    "l4-demo": {
        "target": {"model": "llama-3.1-8b", "gpu": "l4"},
        "space": {
            "max_num_seqs": {"choices": [16, 32, 48, 64, 96, 128]},
            "max_num_batched_tokens": {"choices": [512, 1024, 2048, 4096]},
            "gpu_memory_utilization": {"choices": [0.86, 0.9, 0.94, 0.98]},
            "max_model_len": 4096,
        },
        "workload": {"input_len": 1024, "output_len": 192, "seed": 1},
        "arrival": {"concurrency": 40, "requests": 96, "warmup_requests": 8},
        "slos": ["e2e_p95 <= 45s", "success_rate >= 0.99"],
    },
    # Chat on an H100: many users, a TPOT SLO that punishes too large a batch, a TTFT SLO that punishes queueing.
    "h100-chat": {
        "target": {"model": "llama-3.1-8b", "gpu": "h100-80gb"},
        "space": {
            "max_num_seqs": {"choices": [32, 64, 128, 256, 512]},
            "max_num_batched_tokens": {"choices": [1024, 2048, 4096, 8192]},
            "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
            "max_model_len": {"choices": [8192, 32768, 131072]},
        },
        "workload": {"input_len": 512, "output_len": 128, "seed": 2},
        "arrival": {"concurrency": 192, "requests": 384, "warmup_requests": 16},
        "slos": ["tpot_p95 <= 30ms", "ttft_p95 <= 4s", "success_rate >= 0.99"],
    },
    # Long prompts on a 24 GB card: most long max_model_len values cannot start, high utilization crashes.
    "rtx4090-long": {
        "target": {"model": "llama-3.1-8b", "gpu": "rtx4090"},
        "space": {
            "max_num_seqs": {"choices": [4, 8, 16, 32]},
            "gpu_memory_utilization": {"choices": [0.85, 0.88, 0.91, 0.94, 0.97]},
            "max_model_len": {"choices": [8192, 16384, 32768, 65536, 131072]},
            "max_num_batched_tokens": {"choices": [2048, 8192]},
        },
        "workload": {"input_len": {"dist": "uniform", "low": 1000, "high": 6000}, "output_len": 200, "seed": 3},
        "arrival": {"concurrency": 16, "requests": 64, "warmup_requests": 4},
        "slos": ["e2e_p95 <= 40s", "success_rate >= 0.99"],
    },
}


# The reality scenarios: what the real server does differently from the catalog (Coefficients' fields).
SCENARIOS.update(
    {
        # The demo's space on an L4 that is slower in memory, faster in compute, with more overhead and less KV.
        "l4-demo-reality": {
            **SCENARIOS["l4-demo"],
            "hidden": {
                "memory_scale": 1.3,
                "compute_scale": 0.8,
                "overhead_scale": 1.6,
                "kv_scale": 0.95,
                "headroom_gib": -0.4,
            },
        },
        # Qwen2.5-7B chat on an A100: memory faster than the catalog's, compute slower, twice the overhead; a narrow
        # optimum between a TTFT SLO (too few sequences queue) and a TPOT SLO (too many slow every step).
        "a100-qwen-reality": {
            "target": {"model": "qwen2.5-7b", "gpu": "a100-80gb"},
            "space": {
                "max_num_seqs": {"choices": [32, 64, 96, 128, 160, 256]},
                "max_num_batched_tokens": {"choices": [512, 1024, 2048, 4096, 8192]},
                "gpu_memory_utilization": {"choices": [0.8, 0.9, 0.95]},
                "max_model_len": 8192,
            },
            "workload": {"input_len": 384, "output_len": 256, "seed": 4},
            "arrival": {"concurrency": 160, "requests": 320, "warmup_requests": 16},
            "slos": ["tpot_p95 <= 40ms", "ttft_p95 <= 11s", "success_rate >= 0.99"],
            "hidden": {"memory_scale": 0.75, "compute_scale": 1.35, "overhead_scale": 2.0, "kv_scale": 0.95},
        },
        # Llama-3.1-8B AWQ on an L40S: a flat optimum (every batch of 32 or more within 10% of the best), a memory
        # path 40% slower and the runtime OOM a GiB sooner (every flag set at 0.98 utilization crashes under load).
        "l40s-awq-reality": {
            "target": {"model": "llama-3.1-8b-awq", "gpu": "l40s"},
            "space": {
                "max_num_seqs": {"choices": [16, 32, 64, 128, 256]},
                "max_num_batched_tokens": {"choices": [2048, 4096, 8192]},
                "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95, 0.98]},
                "max_model_len": {"choices": [8192, 16384]},
            },
            "workload": {"input_len": {"dist": "uniform", "low": 500, "high": 3000}, "output_len": 256, "seed": 5},
            "arrival": {"concurrency": 64, "requests": 128, "warmup_requests": 8},
            "slos": ["e2e_p95 <= 50s", "success_rate >= 0.99"],
            "hidden": {"memory_scale": 1.4, "compute_scale": 1.2, "kv_scale": 0.95, "headroom_gib": -1.0},
        },
    }
)

# Chat scenarios whose binding SLOs are latencies, written with a budget of 8 real trials in mind: a real server
# several figures off the catalog ("reality"), and the same with effects outside the twin's model family
# ("outside": Reality's fields).
_L4_AWQ_CHAT: dict[str, Any] = {
    "target": {"model": "llama-3.1-8b-awq", "gpu": "l4"},
    "space": {
        "max_num_seqs": {"choices": [8, 16, 24, 32, 48, 64, 96, 128]},
        "max_num_batched_tokens": {"choices": [512, 1024, 2048, 4096]},
        "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
        "max_model_len": 8192,
    },
    "workload": {"input_len": {"dist": "uniform", "low": 200, "high": 1000}, "output_len": 256, "seed": 6},
    "arrival": {"concurrency": 64, "requests": 160, "warmup_requests": 8},
}
_H100_CHAT: dict[str, Any] = {
    "target": {"model": "qwen2.5-7b", "gpu": "h100-80gb"},
    "space": {
        "max_num_seqs": {"choices": [16, 32, 64, 96, 128, 192, 256, 384]},
        "max_num_batched_tokens": {"choices": [1024, 2048, 4096, 8192, 16384]},
        "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
        "max_model_len": 16384,
    },
    "workload": {"input_len": {"dist": "uniform", "low": 200, "high": 1800}, "output_len": 200, "seed": 7},
    "arrival": {"concurrency": 256, "requests": 512, "warmup_requests": 16},
}
_SEVERAL_OFF = {"memory_scale": 0.9, "compute_scale": 1.45, "overhead_scale": 1.3, "kv_scale": 0.92}
_H100_OFF = {"memory_scale": 1.25, "compute_scale": 1.3, "overhead_scale": 0.7, "kv_scale": 0.95}
_OUTSIDE = {"mixed_step": 0.25, "seq_power": 1.25, "cliff_tokens": 2048, "cliff_factor": 1.3}
# Each one's SLOs put its best at a latency's edge on its own real server (more sequences: less queueing, so a
# shorter TTFT, but a slower step, so a longer TPOT and E2E), with the vLLM defaults' flags missing them.
SCENARIOS.update(
    {
        "l4-awq-chat-reality": {
            **_L4_AWQ_CHAT,
            "slos": ["ttft_p95 <= 34s", "e2e_p95 <= 51s", "success_rate >= 0.99"],
            "hidden": _SEVERAL_OFF,
        },
        "l4-awq-chat-outside": {
            **_L4_AWQ_CHAT,
            "slos": ["ttft_p95 <= 40s", "e2e_p95 <= 64s", "success_rate >= 0.99"],
            "hidden": _SEVERAL_OFF,
            "outside": _OUTSIDE,
        },
        "h100-chat-reality": {
            **_H100_CHAT,
            "slos": ["tpot_p95 <= 25ms", "ttft_p95 <= 10s", "success_rate >= 0.99"],
            "hidden": _H100_OFF,
        },
        "h100-chat-outside": {
            **_H100_CHAT,
            "slos": ["tpot_p95 <= 35ms", "ttft_p95 <= 11s", "success_rate >= 0.99"],
            "hidden": _H100_OFF,
            "outside": {**_OUTSIDE, "cliff_tokens": 4096},
        },
    }
)


@dataclass(frozen=True)
class Reality(Coefficients):
    """A real server with effects outside the twin's model family (the twin's Coefficients cannot fit them)."""

    mixed_step: float = 0.0  # a step that mixes prefill and decode costs this fraction more
    seq_power: float = 1.0  # per-sequence work grows as batch ** seq_power (1: linearly, as the twin has it)
    cliff_tokens: int = 0  # a step of more tokens than this costs cliff_factor times as much (0: no cliff)
    cliff_factor: float = 1.0

    def step_model(self, base: StepTimeModel) -> StepTimeModel:
        scaled = super().step_model(base)
        return RealityStepModel(**{f.name: getattr(scaled, f.name) for f in fields(scaled)}, effects=self)


@dataclass(frozen=True)
class RealityStepModel(StepTimeModel):
    effects: Reality = Reality()

    def forward_seconds(self, num_tokens: int, num_decode: int, kv_tokens_read: int, attn_pairs: int) -> float:
        t = super().forward_seconds(num_tokens, num_decode, kv_tokens_read, attn_pairs)
        e = self.effects
        if e.seq_power != 1.0 and num_decode > 1:
            t += self.per_seq_s * num_decode * (num_decode ** (e.seq_power - 1.0) - 1.0)
        if 0 < num_decode < num_tokens:
            t *= 1.0 + e.mixed_step
        if e.cliff_tokens and num_tokens > e.cliff_tokens:
            t *= e.cliff_factor
        return t


class PerFlagSet(Protocol):
    """A real server whose hidden figures depend on the flag set it was started with (benchmarks/realities.py draws
    them: a step-time term along a flag, a KV capacity off by a flag-dependent amount, a crash region)."""

    def at(self, flags: VllmFlags) -> Coefficients: ...


Hidden = Coefficients | PerFlagSet


def hidden_of(name: str) -> Coefficients:
    """The scenario's real server: its hidden figures (the catalog's where it gives none)."""
    hidden = SCENARIOS[name].get("hidden", {})
    outside = SCENARIOS[name].get("outside")
    return Reality(**hidden, **outside) if outside else Coefficients(**hidden)


def scenario_job(name: str, sampler: str, seed: int, n_trials: int) -> Job:
    s = SCENARIOS[name]
    data = {
        "study": {"name": f"{name}-{sampler}-{seed}"},
        "target": {"launcher": "emulator", **s["target"]},
        "space": s["space"],
        "workload": s["workload"],
        "arrival": s["arrival"],
        "slos": s["slos"],
        "request_timeout": 120,
        "budget": {"n_trials": n_trials},
        "sampler": {**METHODS.get(sampler, {"name": sampler}), "seed": seed},
    }
    return parse_job(data, where=f"scenario {name}")


# -- the emulator's engine in virtual time -----------------------------------------------------------------------


class CatalogTwin:
    """The twin's simulations of one scenario, shared by its seeds (the twin is deterministic given the fit)."""

    def __init__(self) -> None:
        self.memo: dict[tuple[str, Coefficients], SimPoint] = {}

    def __call__(self, job: Job, flags: VllmFlags, coefficients: Coefficients) -> SimPoint:
        key = (flag_key(flags.as_dict()), coefficients)
        if key not in self.memo:
            self.memo[key] = twin_simulate(job, flags, coefficients)
        return self.memo[key]


@dataclass(frozen=True)
class Point:
    """One flag set, measured: what a real trial would have seen, and the emulated server seconds it cost."""

    flags: dict[str, Any]
    reason: str | None  # None: started (and perhaps crashed under load: see `crashed`)
    message: str | None
    estimated_max_model_len: int | None
    crashed: bool
    records: list[RequestRecord]
    duration_s: float
    kv_tokens: int | None
    startup_s: float

    @property
    def server_seconds(self) -> float:
        return self.startup_s + self.duration_s


def simulate(job: Job, flags: VllmFlags, hidden: Hidden = CATALOG, twin: CatalogTwin | None = None) -> Point:
    """The flag set on the scenario's "real" server: the emulator's engine with the scenario's hidden figures (a
    server with the catalog's is the twin's own simulation: `twin` keeps it, so the twin does not redo it)."""
    p = twin_simulate(job, flags, hidden if isinstance(hidden, Coefficients) else hidden.at(flags))
    if twin is not None and hidden == CATALOG:
        twin.memo[(flag_key(flags.as_dict()), CATALOG)] = p
    argv = ["--model", job.target.model, "--gpu", job.target.gpu, *flags.to_args(), "--disable-log-stats"]
    startup_s = Emulator(parse_config(argv), log_stream=io.StringIO()).startup_seconds()
    return Point(
        flags.as_dict(),
        p.reason,
        p.message,
        p.estimated_max_model_len,
        p.crashed,
        p.records,
        p.duration_s,
        p.kv_tokens,
        startup_s,
    )


# -- replaying the simulation through the real study --------------------------------------------------------------


class ReplayServer:
    def __init__(self, point: Point) -> None:
        self.point = point
        self.base_url = "http://127.0.0.1:9"
        self.model = "replay"
        self.facts = StartupFacts(kv_tokens=point.kv_tokens)
        self.time_scale = 1.0
        self.exit_code: int | None = None
        self.cpu_plan = None

    def logs(self) -> str:
        return ""

    def failure(self) -> LaunchError | None:
        if self.point.crashed:
            return LaunchError(
                "CUDA out of memory under load", "crashed_under_load", "torch.OutOfMemoryError: CUDA out of memory"
            )
        return None


class ReplayLauncher:
    name = "replay"

    def __init__(self, job: Job, cache: dict[str, Point], hidden: Hidden) -> None:
        self.job = job
        self.cache = cache
        self.hidden = hidden
        self.launched: list[str] = []

    def point(self, flags: VllmFlags) -> Point:
        key = flag_key(flags.as_dict())
        if key not in self.cache:
            self.cache[key] = simulate(self.job, flags, self.hidden)
        return self.cache[key]

    @contextlib.asynccontextmanager
    async def _start(self, flags: VllmFlags) -> AsyncIterator[ReplayServer]:
        p = self.point(flags)
        self.launched.append(flag_key(flags.as_dict()))
        if p.reason is not None:
            e = LaunchError(p.message or p.reason, p.reason, p.message or "")
            e.estimated_max_model_len = p.estimated_max_model_len
            raise e
        yield ReplayServer(p)

    def start(self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None) -> Any:
        return self._start(flags)

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return []


async def replay_measure(server: Any, job: Job, flags: VllmFlags) -> Measurement:
    p: Point = server.point
    summary = summarize(p.records, duration_s=p.duration_s, slos=job.parsed_slos())
    return Measurement(LoadResult(summary=summary, records=p.records), rate=summary.request_throughput)


# -- scoring a search ---------------------------------------------------------------------------------------------


def feasible_tput(point: Point, job: Job) -> float | None:
    """The point's output tok/s if it meets every SLO, else None."""
    if point.reason is not None or point.crashed:
        return None
    summary = summarize(point.records, duration_s=point.duration_s, slos=job.parsed_slos())
    if all(s.violation(summary) <= 0 for s in job.parsed_slos()):
        return float(summary.output_throughput)
    return None


@dataclass
class Reach:
    trials: dict[float, int | None]  # per target: trials until that share of the grid's best (None: not reached)
    server_minutes: dict[float, float | None]
    total_trials: int
    total_server_minutes: float
    total_server_minutes_stop_early: float


def reach_of(sequence: list[tuple[float | None, float, float]], best: float) -> Reach:
    """sequence: per trial (feasible tok/s or None, server seconds spent on it, the same with stop_early)."""
    spent = early = 0.0
    hit: dict[float, tuple[int, float]] = {}
    for i, (tput, seconds, early_seconds) in enumerate(sequence, start=1):
        spent += seconds
        early += early_seconds
        for target in TARGETS:
            if target not in hit and tput is not None and tput >= target * best:
                hit[target] = (i, spent / 60)
    return Reach(
        {t: hit[t][0] if t in hit else None for t in TARGETS},
        {t: hit[t][1] if t in hit else None for t in TARGETS},
        len(sequence),
        spent / 60,
        early / 60,
    )


def cost(point: Point, job: Job, *, stop_early: bool) -> float:
    """Server seconds a point costs: its start-up, and its load phase whole or up to a certain SLO miss (the
    runner's SloGuard fed the records in completion order, as run_load feeds it)."""
    if point.reason is not None:
        return point.startup_s
    if not stop_early or point.crashed or not job.arrival.requests:
        return point.server_seconds
    guard = SloGuard(job.parsed_slos(), job.arrival.requests)
    measured = sorted((r for r in point.records if not r.warmup), key=lambda r: r.end_s)
    begin = min(r.start_s for r in measured)
    for r in measured:
        if guard.add(r) is not None:
            return point.startup_s + max(r.end_s - begin, 0.0)
    return point.server_seconds


def grid_points(job: Job) -> list[VllmFlags]:
    space = job.search_space()
    grid = space.grid()
    names = list(grid)
    return [space.repair(dict(zip(names, values, strict=True))).flags for values in itertools.product(*grid.values())]


@dataclass
class Scenario:
    name: str
    cache: dict[str, Point]  # the real server's answer per flag set
    hidden: Hidden
    twin: CatalogTwin
    folder: Path
    log: list[str]
    log_every_seed: bool = False  # the study log of every seed, not only seed 0's


def run_sampler(sc: Scenario, sampler: str, seed: int, n_trials: int) -> list[tuple[float | None, float, float]]:
    job = scenario_job(sc.name, sampler, seed, n_trials)
    launcher = ReplayLauncher(job, sc.cache, sc.hidden)
    url = f"sqlite:///{sc.folder / f'{job.study.name}.db'}"
    log = sc.log if seed == 0 or sc.log_every_seed else []
    run = TuningRun(job, launcher, storage_url=url, measure=replay_measure, on_event=log.append)  # type: ignore[arg-type]
    if sampler == "twin":
        # The same sampler the study made, with the scenario's shared simulations: the seeds do not redo the sweep.
        made = run.study.sampler
        assert isinstance(made, TwinSampler)
        twin = TwinSampler(job.search_space(), seed, made.fallback, simulate_fn=sc.twin)
        twin.bind(job, log.append)
        run.study.sampler = twin
    elif sampler == "gp, random independent (before)":
        run.study.sampler = optuna.samplers.GPSampler(seed=seed)
    try:
        run.run()
        trials = sorted(run.study.get_trials(deepcopy=False), key=lambda t: t.number)
    finally:
        run.close()
    # A sampler's repeat of a flag set is answered from the first trial and is not a trial of the budget (the study
    # counts distinct flag sets), so it is not counted here either: the trials are the budget's.
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None]
    return [_trial_cost(t, job, sc.cache) for t in done]


def _trial_cost(t: FrozenTrial, job: Job, cache: dict[str, Point]) -> tuple[float | None, float, float]:
    a = t.user_attrs
    tput = float(t.values[0]) if a.get("feasible") and t.values else None
    if a.get("outcome") == "skipped_infeasible":
        return tput, 0.0, 0.0
    p = cache[flag_key(a["flags"])]
    attempts = max(1, int(a.get("attempts") or 1))
    return tput, cost(p, job, stop_early=False) * attempts, cost(p, job, stop_early=True) * attempts


def measure_grid(name: str, twin: CatalogTwin) -> tuple[dict[str, Point], dict[str, Any], float]:
    """Every grid point on the scenario's real server: the cache the samplers replay, the row's head, the best."""
    job = scenario_job(name, "grid", 0, 1)
    hidden = hidden_of(name)
    cache: dict[str, Point] = {}  # every distinct grid point, in auto_tune order
    for flags in grid_points(job):
        key = flag_key(flags.as_dict())
        if key not in cache:
            cache[key] = simulate(job, flags, hidden, twin)
    order = list(cache.values())
    tputs = [feasible_tput(p, job) for p in order]
    best = max((x for x in tputs if x is not None), default=0.0)
    base = simulate(job, job.search_space().baseline(), hidden)
    base_tput = feasible_tput(base, job)
    costs = [
        (x, cost(p, job, stop_early=False), cost(p, job, stop_early=True)) for x, p in zip(tputs, order, strict=True)
    ]
    row: dict[str, Any] = {
        "hidden": {k: v for k, v in hidden.__dict__.items() if v != getattr(CATALOG, k, None)},
        "grid_points": len(order),
        "cannot_start": sum(p.reason is not None for p in order),
        "feasible": sum(x is not None for x in tputs),
        "near_best": sum(x is not None and x >= TARGETS[0] * best for x in tputs),
        "best_tok_s": round(best, 1),
        "baseline_tok_s": None if base_tput is None else round(base_tput, 1),
        "baseline_outcome": base.reason or ("crashed" if base.crashed else "measured"),
        "grid (auto_tune order)": _summary([reach_of(costs, best)]),
    }
    return cache, row, best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all")
    parser.add_argument("--list", action="store_true", help="print the method names (for --sampler) and stop")
    parser.add_argument("--sampler", action="append", choices=list(SAMPLERS), help="default: all")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--other-seeds", type=int, help="seeds of the samplers other than twin (default: --seeds)")
    parser.add_argument("--budget", type=int, default=40, help="trials per sampler run (at most the grid's size)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--log", type=Path, help="write the twin's study log (seed 0) of every scenario here")
    parser.add_argument("--table-from", type=Path, help="print the table of a --json file written before, and stop")
    args = parser.parse_args()
    if args.list:
        print("\n".join(SAMPLERS))
        return
    if args.table_from:
        print(table(json.loads(args.table_from.read_text()), args.seeds, args.budget))
        return
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    results: dict[str, Any] = {}
    logs: list[str] = []
    for name in args.scenario or list(SCENARIOS):
        t0 = time.monotonic()
        twin = CatalogTwin()
        cache, row, best = measure_grid(name, twin)
        budget = min(args.budget, row["grid_points"])
        with tempfile.TemporaryDirectory() as folder:
            sc = Scenario(name, cache, hidden_of(name), twin, Path(folder), [])
            for sampler in args.sampler or list(SAMPLERS):
                seeds = args.seeds if sampler == "twin" or args.other_seeds is None else args.other_seeds
                reaches = [reach_of(run_sampler(sc, sampler, seed, budget), best) for seed in range(seeds)]
                row[sampler] = _summary(reaches)
            logs += [f"== {name}", *sc.log]
        row["seconds"] = round(time.monotonic() - t0, 1)
        results[name] = row
        print(json.dumps({name: row}, indent=1), file=sys.stderr)
    print(table(results, args.seeds, args.budget))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    if args.log:
        args.log.write_text("\n".join(logs) + "\n")


def _summary(reaches: list[Reach]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for t in TARGETS:
        hit = [r for r in reaches if r.trials[t] is not None]
        out[f"reached_{t}"] = f"{len(hit)}/{len(reaches)}"
        out[f"median_trials_{t}"] = statistics.median(r.trials[t] for r in hit) if hit else None  # type: ignore[misc]
    hit = [r for r in reaches if r.trials[TARGETS[0]] is not None]
    minutes = [r.server_minutes[TARGETS[0]] for r in hit]
    out["median_server_min"] = round(statistics.median(minutes), 1) if hit else None  # type: ignore[type-var]
    out["median_total_server_min"] = round(statistics.median(r.total_server_minutes for r in reaches), 1)
    out["median_total_server_min_stop_early"] = round(
        statistics.median(r.total_server_minutes_stop_early for r in reaches), 1
    )
    return out


def table(results: dict[str, Any], seeds: int, budget: int) -> str:
    lo, hi = TARGETS
    lines = [
        f"Runs reaching {lo:.0%} and {hi:.0%} of the grid's best feasible output tok/s within the budget ({budget} "
        f"trials; the reached column counts the seeds), median trials to each and server-minutes to {lo:.0%} (over "
        "the runs that did)",
        "",
        "| scenario | grid points (cannot start / feasible / within 97% of best) | best tok/s (baseline) | method | "
        f"reached {lo:.0%} | reached {hi:.0%} | trials to {lo:.0%} | trials to {hi:.0%} | server-min to {lo:.0%} | "
        "server-min whole run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, row in results.items():
        outcome = row["baseline_outcome"]
        base = row["baseline_tok_s"] if row["baseline_tok_s"] is not None else _BASELINE.get(outcome, outcome)
        name = scenario + (" (reality)" if row.get("hidden") else "")
        head = (
            f"| {name} | {row['grid_points']} ({row['cannot_start']} / {row['feasible']} / {row['near_best']}) | "
            f"{row['best_tok_s']} ({base}) |"
        )
        methods = [("grid, auto_tune order", row["grid (auto_tune order)"])]
        methods += [(f"{m} (+ filter, dedupe)", row[m]) for m in SAMPLERS if m in row]
        for i, (label, s) in enumerate(methods):
            lines.append(
                f"{head if i == 0 else '| | | |'} {label} | {s[f'reached_{lo}']} | {s[f'reached_{hi}']} | "
                f"{_fmt(s[f'median_trials_{lo}'])} | {_fmt(s[f'median_trials_{hi}'])} | "
                f"{_fmt(s['median_server_min'])} | "
                f"{_fmt(s['median_total_server_min'])} |"
            )
    return "\n".join(lines)


_BASELINE = {"measured": "misses the SLOs", "crashed": "crashes under load"}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.1f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


if __name__ == "__main__":
    main()
