"""How many trials and server-minutes each sampler needs to reach 95% of the best feasible throughput an exhaustive
grid over the same space finds, on three emulator scenarios; against the grid itself (vLLM's benchmarks/auto_tune
shape: every point launched in order) and random search.

The "server" is the emulator's own engine (tuner.emulator.engine: V1 scheduler, paged KV pool, step-time model,
runtime-OOM threshold) with its start-up arithmetic (tuner.capacity.plan_startup), driven in virtual time by a
closed-loop client: the same dynamics the HTTP emulator serves, without sockets or sleeping, so a trial costs
milliseconds and every grid point can be measured. Start-up costs the emulator's own emulated start-up time (weights
load + profiling + CUDA-graph capture); a failed start costs the same (vLLM fails after loading and profiling); a
flag set the pre-launch filter skips, or a duplicate, costs nothing.

The samplers run through the real study (tuner.study.TuningRun on a SQLite file: baseline first, feasibility filter,
one launch per flag set, failures told as infeasible) with a launcher and load phase that replay the simulation.

    .venv/bin/python benchmarks/tuning_efficiency.py                 # all scenarios, 5 seeds (~10 min on 2 cores)
    .venv/bin/python benchmarks/tuning_efficiency.py --seeds 3 --scenario l4-demo

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
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from tuner.config import Job, parse_job
from tuner.emulator.config import parse_config
from tuner.emulator.emulator import Emulator, EmulatorStartupError
from tuner.emulator.engine import EngineRequest
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch import StartupFacts
from tuner.load import LoadResult, RequestRecord
from tuner.load.slo_guard import SloGuard
from tuner.scoring import summarize
from tuner.store import flag_key
from tuner.study import Measurement, TuningRun

TARGET = 0.95
# GPSampler needs torch and scipy (not project dependencies): without them its rows are left out.
SAMPLERS = ("random", "tpe", "nsga2") + (("gp",) if importlib.util.find_spec("torch") else ())

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
        "sampler": {"name": sampler, "seed": seed},
    }
    return parse_job(data, where=f"scenario {name}")


# -- the emulator's engine in virtual time -----------------------------------------------------------------------


class VirtualClock:
    """The engine's clock, advanced by the simulation rather than by the wall."""

    scale = 1.0

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


class _Sink:
    def __init__(self, clock: VirtualClock, start: float) -> None:
        self.clock = clock
        self.start = start
        self.times: list[float] = []
        self.done = False
        self.cut = False

    def on_token(self, index: int, finish_reason: str | None) -> None:
        self.times.append(self.clock.t)
        if finish_reason is not None:
            self.done = True

    def on_cut(self) -> None:
        self.cut = True


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


def simulate(job: Job, flags: VllmFlags) -> Point:
    argv = ["--model", job.target.model, "--gpu", job.target.gpu, *flags.to_args(), "--disable-log-stats"]
    emu = Emulator(parse_config(argv), log_stream=io.StringIO())
    startup_s = emu.startup_seconds()
    try:
        emu.check_startup()
    except EmulatorStartupError as e:
        return Point(flags.as_dict(), e.reason, e.message, e.estimated_max_model_len, False, [], 0.0, None, startup_s)
    engine = emu.engine
    clock = VirtualClock()
    engine.clock = clock  # type: ignore[assignment]
    max_len = emu.resolved.max_model_len
    arrival = job.arrival
    total = (arrival.requests or 100) + arrival.warmup_requests
    prompts: Iterator[Any] = job.workload.prompts()
    timeout = job.request_timeout
    records: list[RequestRecord] = []
    in_flight: dict[int, tuple[Any, _Sink, Any]] = {}
    sent = 0

    def send() -> None:
        nonlocal sent
        spec = next(prompts)
        index = sent
        sent += 1
        ids = spec.prompt if isinstance(spec.prompt, list) else [1] * spec.prompt_len
        sink = _Sink(clock, clock.t)
        if len(ids) + spec.output_len > max_len:
            records.append(
                _record(index, sink, spec, ok=False, error="http_4xx", warmup=index < arrival.warmup_requests)
            )
            return
        req = EngineRequest(
            f"r{index}",
            ids,
            spec.output_len,
            "length",
            sink,
            emu.resolved.block_size,
            emu.resolved.enable_prefix_caching,
        )
        engine.submit(req)
        in_flight[index] = (req, sink, spec)

    for _ in range(min(arrival.concurrency or 1, total)):
        send()
    crashed = False
    while in_flight or sent < total:
        while len(in_flight) < (arrival.concurrency or 1) and sent < total:
            send()
        items, num_decode, kv_read, attn = engine.schedule()
        if not items:
            break  # nothing schedulable: every request that is left cannot fit (cannot happen after a good start)
        if len(engine.running) >= engine.oom_running_threshold:
            crashed = True
            break
        dt = engine.step_model.step_seconds(sum(n for _, n in items), num_decode, kv_read, attn)
        clock.t += dt
        engine.complete(items, clock.t)
        for index in list(in_flight):
            req, sink, spec = in_flight[index]
            warm = index < arrival.warmup_requests
            if sink.done:
                records.append(_record(index, sink, spec, ok=True, warmup=warm))
                del in_flight[index]
            elif clock.t - sink.start > timeout:
                engine.abort(req)
                records.append(_record(index, sink, spec, ok=False, error="timeout", warmup=warm))
                del in_flight[index]
    for index, (_req, sink, spec) in in_flight.items():  # a crash cuts every open stream
        records.append(_record(index, sink, spec, ok=False, error="stream_cut", warmup=index < arrival.warmup_requests))
    measured = [r for r in records if not r.warmup]
    begin = min((r.start_s for r in measured), default=0.0)
    end = max((r.end_s for r in measured), default=0.0)
    return Point(
        flags.as_dict(), None, None, None, crashed, records, max(end - begin, 1e-6), emu.plan.kv_tokens, startup_s
    )


def _record(index: int, sink: _Sink, spec: Any, *, ok: bool, error: str | None = None, warmup: bool) -> RequestRecord:
    times = sink.times
    end = times[-1] if (ok and times) else sink.clock.t
    return RequestRecord(
        index=index,
        start_s=sink.start,
        ttft_s=(times[0] - sink.start) if times else None,
        itl_s=[b - a for a, b in itertools.pairwise(times)],
        e2e_s=end - sink.start,
        prompt_tokens=spec.prompt_len,
        completion_tokens=len(times),
        ok=ok,
        error_class=error,  # type: ignore[arg-type]
        error_message=None if ok else error,
        warmup=warmup,
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

    def __init__(self, job: Job, cache: dict[str, Point]) -> None:
        self.job = job
        self.cache = cache
        self.launched: list[str] = []

    def point(self, flags: VllmFlags) -> Point:
        key = flag_key(flags.as_dict())
        if key not in self.cache:
            self.cache[key] = simulate(self.job, flags)
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
    trials: int | None  # trials until 95% of the grid's best (None: not within the budget)
    server_minutes: float | None
    total_trials: int
    total_server_minutes: float
    total_server_minutes_stop_early: float


def reach_of(sequence: list[tuple[float | None, float, float]], best: float) -> Reach:
    """sequence: per trial (feasible tok/s or None, server seconds spent on it, the same with stop_early)."""
    spent = early = 0.0
    hit: tuple[int, float] | None = None
    for i, (tput, seconds, early_seconds) in enumerate(sequence, start=1):
        spent += seconds
        early += early_seconds
        if hit is None and tput is not None and tput >= TARGET * best:
            hit = (i, spent / 60)
    return Reach(hit[0] if hit else None, hit[1] if hit else None, len(sequence), spent / 60, early / 60)


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


def run_sampler(
    name: str, scenario: str, sampler: str, seed: int, n_trials: int, cache: dict[str, Point], folder: Path
) -> list[tuple[float | None, float, float]]:
    job = scenario_job(scenario, sampler, seed, n_trials)
    launcher = ReplayLauncher(job, cache)
    url = f"sqlite:///{folder / f'{job.study.name}.db'}"
    run = TuningRun(job, launcher, storage_url=url, measure=replay_measure)  # type: ignore[arg-type]
    try:
        run.run()
        trials = sorted(run.study.get_trials(deepcopy=False), key=lambda t: t.number)
    finally:
        run.close()
    return [_trial_cost(t, job, cache) for t in trials if t.state == TrialState.COMPLETE]


def _trial_cost(t: FrozenTrial, job: Job, cache: dict[str, Point]) -> tuple[float | None, float, float]:
    a = t.user_attrs
    tput = float(t.values[0]) if a.get("feasible") and t.values else None
    if a.get("duplicate_of") is not None or a.get("outcome") == "skipped_infeasible":
        return tput, 0.0, 0.0
    p = cache[flag_key(a["flags"])]
    attempts = max(1, int(a.get("attempts") or 1))
    return tput, cost(p, job, stop_early=False) * attempts, cost(p, job, stop_early=True) * attempts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=40, help="trials per sampler run (at most the grid's size)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--table-from", type=Path, help="print the table of a --json file written before, and stop")
    args = parser.parse_args()
    if args.table_from:
        print(table(json.loads(args.table_from.read_text()), args.seeds, args.budget))
        return
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    results: dict[str, Any] = {}
    for scenario in args.scenario or list(SCENARIOS):
        t0 = time.monotonic()
        job = scenario_job(scenario, "grid", 0, 1)
        cache: dict[str, Point] = {}  # every distinct grid point, in auto_tune order; the samplers replay from it
        for flags in grid_points(job):
            key = flag_key(flags.as_dict())
            if key not in cache:
                cache[key] = simulate(job, flags)
        order = list(cache.values())
        tputs = [feasible_tput(p, job) for p in order]
        best = max((x for x in tputs if x is not None), default=0.0)
        base = simulate(job, job.search_space().baseline())
        base_tput = feasible_tput(base, job)
        grid = reach_of(
            [
                (x, cost(p, job, stop_early=False), cost(p, job, stop_early=True))
                for x, p in zip(tputs, order, strict=True)
            ],
            best,
        )
        row: dict[str, Any] = {
            "grid_points": len(order),
            "cannot_start": sum(p.reason is not None for p in order),
            "feasible": sum(x is not None for x in tputs),
            "near_best": sum(x is not None and x >= TARGET * best for x in tputs),
            "best_tok_s": round(best, 1),
            "baseline_tok_s": None if base_tput is None else round(base_tput, 1),
            "baseline_outcome": base.reason or ("crashed" if base.crashed else "measured"),
            "grid (auto_tune order)": grid.__dict__,
        }
        budget = min(args.budget, len(order))
        with tempfile.TemporaryDirectory() as folder:
            for sampler in SAMPLERS:
                reaches = [
                    reach_of(run_sampler(scenario, scenario, sampler, seed, budget, cache, Path(folder)), best)
                    for seed in range(args.seeds)
                ]
                row[sampler] = _summary(reaches)
        row["seconds"] = round(time.monotonic() - t0, 1)
        results[scenario] = row
        print(json.dumps({scenario: row}, indent=1), file=sys.stderr)
    print(table(results, args.seeds, args.budget))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


def _summary(reaches: list[Reach]) -> dict[str, Any]:
    hit = [r for r in reaches if r.trials is not None]
    return {
        "reached": f"{len(hit)}/{len(reaches)}",
        "median_trials": statistics.median(r.trials for r in hit) if hit else None,  # type: ignore[misc]
        "median_server_min": round(statistics.median(r.server_minutes for r in hit), 1) if hit else None,  # type: ignore[misc]
        "median_total_server_min": round(statistics.median(r.total_server_minutes for r in reaches), 1),
        "median_total_server_min_stop_early": round(
            statistics.median(r.total_server_minutes_stop_early for r in reaches), 1
        ),
    }


def table(results: dict[str, Any], seeds: int, budget: int) -> str:
    lines = [
        f"Trials and server-minutes to reach {TARGET:.0%} of the grid's best feasible output tok/s "
        f"(medians over {seeds} seeds of the runs that reached it; budget {budget} trials)",
        "",
        "| scenario | grid points (cannot start / feasible / within 95% of best) | best tok/s (baseline) | method | "
        "reached | trials | "
        "server-min to 95% | server-min whole run | whole run with stop_early |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, row in results.items():
        outcome = row["baseline_outcome"]
        base = row["baseline_tok_s"] if row["baseline_tok_s"] is not None else _BASELINE.get(outcome, outcome)
        head = (
            f"| {scenario} | {row['grid_points']} ({row['cannot_start']} / {row['feasible']} / {row['near_best']}) | "
            f"{row['best_tok_s']} ({base}) |"
        )
        g = row["grid (auto_tune order)"]
        lines.append(
            f"{head} grid, auto_tune order | {'1/1' if g['trials'] else '0/1'} | {_fmt(g['trials'])} | "
            f"{_fmt(g['server_minutes'])} | "
            f"{_fmt(g['total_server_minutes'])} | {_fmt(g.get('total_server_minutes_stop_early'))} |"
        )
        for sampler in SAMPLERS:
            if sampler not in row:
                continue
            s = row[sampler]
            lines.append(
                f"| | | | {sampler} (+ filter, dedupe) | {s['reached']} | {_fmt(s['median_trials'])} | "
                f"{_fmt(s['median_server_min'])} | {_fmt(s['median_total_server_min'])} | "
                f"{_fmt(s.get('median_total_server_min_stop_early'))} |"
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
