"""The box's best shape (replicas x tensor parallel) for Llama-3.1-8B and -70B on an emulated 8 x H100 node: the
twin's pick before any trial against an exhaustive grid on the emulator (the reference), the cost of each at a
GPU-hour price given on the command line, and the trials each sampler needs to reach 97% of the grid's best box
throughput (median over seeds).

Every trial is one replica of its shape under 1/replicas of the job's users (`target.gpus: 8`, tuner.box), run in the
emulator's own engine in virtual time (tuner.twin.simulate: its scheduler, KV pool, start-up arithmetic and step
time with the tensor-parallel all-reduce), so a grid point costs a fraction of a second and no figure here is a
wall-clock timing. The samplers run through the real study (TuningRun: baseline first, feasibility filter, the
box's figure as the objective) replaying those simulations (benchmarks/tuning_efficiency.py's launcher).

Two servers per model: the emulator as the catalog has it, where the twin is the same model as the "real" server
(its pick can only differ through its sample of the space), and one whose all-reduce takes `--allreduce-scale` times
the catalog's (an NVLink reaching half its bandwidth, say), which the twin does not know: there its pick is a
guess its real trials must correct, and TP-heavy shapes are worth less than the catalog says.

    nice -n 10 .venv/bin/python benchmarks/box_shapes.py --gpu-hour-usd 2.50 --seeds 3 --budget 10 \\
        --json benchmarks/fixtures/box_shapes.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import TrialState
from tuning_efficiency import CatalogTwin, Point, ReplayLauncher, feasible_tput, grid_points, simulate

from tuner.box import box_figures, replicas
from tuner.config import Job, parse_job
from tuner.emulator.step_time import StepTimeModel
from tuner.flags import VllmFlags
from tuner.load import LoadResult
from tuner.scoring import summarize
from tuner.store import flag_key
from tuner.study import Measurement, TuningRun
from tuner.twin.model import Twin, candidates
from tuner.twin.sampler import TwinSampler, _rank
from tuner.twin.simulate import Coefficients

BOX_GPUS = 8
TARGET = 0.97
SAMPLERS = ("twin", "tpe", "random")
SPACE: dict[str, Any] = {
    "tensor_parallel_size": {"choices": [1, 2, 4, 8]},
    "max_num_seqs": {"choices": [32, 64, 128, 256]},
    "max_num_batched_tokens": {"choices": [2048, 8192]},
    "max_model_len": 8192,
}
# Chat traffic heavy enough to fill the node: each replica gets its share of the users.
MODELS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": {"arrival": {"concurrency": 256, "requests": 320, "warmup_requests": 8}},
    "llama-3.1-70b": {"arrival": {"concurrency": 128, "requests": 192, "warmup_requests": 8}},
}
SLOS = ["tpot_p95 <= 50ms", "ttft_p95 <= 8s", "success_rate >= 0.99"]


@dataclass(frozen=True)
class SlowAllReduce(Coefficients):
    """A node whose tensor-parallel all-reduce takes `allreduce_scale` times the catalog's (the twin assumes 1)."""

    allreduce_scale: float = 1.0

    def step_model(self, base: StepTimeModel) -> StepTimeModel:
        scaled = super().step_model(base)
        return dataclasses.replace(
            scaled,
            allreduce_fixed_s=scaled.allreduce_fixed_s * self.allreduce_scale,
            allreduce_s_per_token=scaled.allreduce_s_per_token * self.allreduce_scale,
        )


def box_job(model: str, sampler: str, seed: int, n_trials: int, price: float) -> Job:
    data = {
        "study": {"name": f"{model}-{sampler}-{seed}"},
        "target": {"launcher": "emulator", "model": model, "gpu": "h100-80gb", "gpus": BOX_GPUS, "gpu_hour_usd": price},
        "space": SPACE,
        "workload": {"input_len": 1024, "output_len": 128, "seed": 1},
        **MODELS[model],
        "slos": SLOS,
        "request_timeout": 300,
        "budget": {"n_trials": n_trials, "confirm": 0},
        "sampler": {"name": sampler, "seed": seed},
    }
    return parse_job(data, where=f"box {model}")


def box_tok_s(point: Point, job: Job, flags: VllmFlags) -> float | None:
    """The box's output tok/s at this flag set if its replica meets every SLO, else None."""
    replica = feasible_tput(point, job)
    return None if replica is None else replica * replicas(BOX_GPUS, flags.world_size)


def shape(flags: VllmFlags) -> str:
    tp = flags.tensor_parallel_size
    return f"{replicas(BOX_GPUS, tp)} x TP{tp}"


def usd_per_m(tok_s: float | None, price: float) -> float | None:
    if not tok_s:
        return None
    figures = box_figures(tok_s, None, n_replicas=1, box_gpus=BOX_GPUS, gpu_hour_usd=price)
    return figures.usd_per_m_tokens


@dataclass
class Scenario:
    model: str
    hidden: Coefficients
    price: float
    twin: CatalogTwin
    cache: dict[str, Point]
    folder: Path

    def measure(self) -> Any:
        async def replay(server: Any, job: Job, flags: VllmFlags) -> Measurement:
            p: Point = server.point
            summary = summarize(p.records, duration_s=p.duration_s, slos=job.parsed_slos())
            n = max(1, replicas(job.box_gpus(), flags.world_size))
            return Measurement(
                LoadResult(summary=summary, records=p.records), rate=summary.request_throughput, replicas=n
            )

        return replay


def measure_grid(sc: Scenario) -> dict[str, Any]:
    """Every grid point on the scenario's server; the grid's best box and the twin's pick before any trial."""
    job = box_job(sc.model, "grid", 0, 1, sc.price)
    flags_of: dict[str, VllmFlags] = {}
    for flags in grid_points(job):
        key = flag_key(flags.as_dict())
        if key not in sc.cache:
            sc.cache[key] = simulate(job, flags, sc.hidden, sc.twin)
            flags_of[key] = flags
    figures = {k: box_tok_s(sc.cache[k], job, f) for k, f in flags_of.items()}
    feasible = [k for k in figures if figures[k] is not None]
    if not feasible:
        return {"grid_points": len(flags_of), "feasible": 0, "_best": None}
    best_key = max(feasible, key=lambda k: figures[k] or 0.0)
    best = figures[best_key] or 0.0
    twin = Twin(job, candidates(job.search_space(), 400, 0), sc.twin)
    twin.sweep()
    pick = min((twin.predict(c.key) for c in twin.pool.values()), key=_rank)
    pick_flags = twin.known[pick.key]
    pick_real = box_tok_s(sc.cache[pick.key], job, pick_flags) if pick.key in sc.cache else None
    by_shape: dict[str, float] = {}
    for k, f in flags_of.items():
        if figures[k] is not None:
            by_shape[shape(f)] = max(by_shape.get(shape(f), 0.0), figures[k] or 0.0)
    return {
        "grid_points": len(flags_of),
        "cannot_start": sum(sc.cache[k].reason is not None for k in flags_of),
        "feasible": sum(x is not None for x in figures.values()),
        "best_by_shape_tok_s": {s: round(v, 1) for s, v in sorted(by_shape.items())},
        "grid_best": _pick(flags_of[best_key], best, sc.price),
        "twin_pick": {
            **_pick(pick_flags, pick_real, sc.price),
            "predicted_box_tok_s": round(pick.box_tok_s, 1),
            "share_of_grid_best": None if pick_real is None else round(pick_real / best, 3),
        },
        "_best": best,
    }


def _pick(flags: VllmFlags, tok_s: float | None, price: float) -> dict[str, Any]:
    usd = usd_per_m(tok_s, price)
    return {
        "shape": shape(flags),
        "max_num_seqs": flags.max_num_seqs,
        "max_num_batched_tokens": flags.max_num_batched_tokens,
        "box_tok_s": None if tok_s is None else round(tok_s, 1),
        "usd_per_m_tokens": None if usd is None else round(usd, 3),
    }


def trials_to_target(sc: Scenario, sampler: str, seed: int, budget: int, best: float) -> int | None:
    """Real trials (the baseline included, repeats not) until one meets the SLOs at TARGET x the grid's best."""
    job = box_job(sc.model, sampler, seed, budget, sc.price)
    launcher = ReplayLauncher(job, sc.cache, sc.hidden)
    url = f"sqlite:///{sc.folder / f'{job.study.name}-{id(sc.hidden)}.db'}"
    run = TuningRun(job, launcher, storage_url=url, measure=sc.measure())  # type: ignore[arg-type]
    if sampler == "twin":  # the scenario's shared simulations: the seeds do not redo the sweep
        made = run.study.sampler
        assert isinstance(made, TwinSampler)
        twin = TwinSampler(job.search_space(), seed, made.fallback, simulate_fn=sc.twin)
        twin.bind(job)
        run.study.sampler = twin
    try:
        run.run()
        trials = sorted(run.study.get_trials(deepcopy=False), key=lambda t: t.number)
    finally:
        run.close()
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None]
    for i, t in enumerate(done, start=1):
        if t.user_attrs.get("feasible") and t.values and t.values[0] >= TARGET * best:
            return i
    return None


def run_scenario(model: str, label: str, hidden: Coefficients, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        sc = Scenario(model, hidden, args.gpu_hour_usd, CatalogTwin(), {}, Path(folder))
        row = measure_grid(sc)
        best = row.pop("_best")
        if best is None:  # no grid point meets the SLOs: nothing to reach
            return {**row, "server": label}
        budget = min(args.budget, row["grid_points"])
        for sampler in SAMPLERS:
            reached = [trials_to_target(sc, sampler, seed, budget, best) for seed in range(args.seeds)]
            hit = [r for r in reached if r is not None]
            row[sampler] = {
                "trials": reached,
                "reached": f"{len(hit)}/{len(reached)}",
                "median_trials": statistics.median(hit) if hit else None,
            }
    row["server"] = label
    return row


def table(results: dict[str, Any], price: float, budget: int) -> str:
    lines = [
        f"8 x H100 (emulated), ${price:.2f} a GPU-hour (an assumption: the catalog has no citable price); box tok/s "
        f"meeting the SLOs; trials to {TARGET:.0%} of the grid's best box figure, median over seeds (reached/seeds), "
        f"budget {budget}",
        "",
        "| model, server | grid best: shape | box tok/s | $/M tok | twin's pick | of best | twin | tpe | random |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in results.items():
        if not row["feasible"]:
            lines.append(f"| {name} | no grid point meets the SLOs | | | | | | | |")
            continue
        g, t = row["grid_best"], row["twin_pick"]
        share = "-" if t["share_of_grid_best"] is None else f"{t['share_of_grid_best']:.0%}"
        cells = [f"{_n(row[s]['median_trials'])} ({row[s]['reached']})" for s in SAMPLERS]
        lines.append(
            f"| {name} | {g['shape']} | {g['box_tok_s']:,.0f} | {g['usd_per_m_tokens']:.3f} | {t['shape']} | {share} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def _n(x: Any) -> str:
    return "-" if x is None else f"{x:g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--gpu-hour-usd", type=float, default=2.50, help="the price of one H100 an hour (an assumption)"
    )
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--budget", type=int, default=20, help="trials per sampler run")
    parser.add_argument("--allreduce-scale", type=float, default=2.0, help="the second server's all-reduce factor")
    parser.add_argument("--model", action="append", choices=list(MODELS), help="default: both")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--table-from", type=Path, help="print the table of a --json file written before, and stop")
    args = parser.parse_args()
    if args.table_from:
        data = json.loads(args.table_from.read_text())
        price, budget = data.pop("gpu_hour_usd"), data.pop("budget")
        data.pop("seeds", None)
        print(table(data, price, budget))
        return
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    results: dict[str, Any] = {}
    slow = SlowAllReduce(allreduce_scale=args.allreduce_scale)
    servers: list[tuple[str, Coefficients]] = [
        ("emulator", Coefficients()),
        (f"all-reduce x{args.allreduce_scale:g}", slow),
    ]
    for model in args.model or list(MODELS):
        for label, hidden in servers:
            t0 = time.monotonic()
            row = run_scenario(model, label, hidden, args)
            row["seconds"] = round(time.monotonic() - t0, 1)
            results[f"{model.removeprefix('llama-3.1-')}, {label}"] = row
            print(json.dumps(row, indent=1), file=sys.stderr)
    print(table(results, args.gpu_hour_usd, args.budget))
    if args.json:
        args.json.write_text(
            json.dumps(
                {"gpu_hour_usd": args.gpu_hour_usd, "budget": args.budget, "seeds": args.seeds, **results}, indent=1
            )
        )


if __name__ == "__main__":
    main()
