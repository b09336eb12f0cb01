"""Real vLLM (the pinned CPU build, the tiny local model): a grid of flag sets measured once, kept as a fixture, and
the samplers' paths replayed against it.

`measure` runs the real study (`TuningRun`, the process launcher, the load phase) with the grid sampler over the
space below: the baseline (vLLM's CPU defaults) and every grid point, each launched once. It writes the fixture:
the vLLM version each server reported, the workload, arrival and SLOs, the machine's load average before and after,
and per flag set its outcome, output tok/s, latency P95s, KV tokens and server seconds.

`replay` runs each sampler the job may name, through Optuna's ask-and-tell with the job's own sampler
(`tuner.study.samplers.make_sampler`, the baseline enqueued first as the study does), answering every proposal from
the fixture: trials to 97% and 99% of the grid's best. A repeat of a flag set is answered from the fixture and not
counted (as the study answers it from the first trial). The twin cannot imitate a CPU target
(`tuner.twin.sampler.twin_unsupported`): its row says so.

    eval "$(scripts/real-vllm)"
    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/real_vllm_grid.py measure   # ~1 min a flag set
    .venv/bin/python benchmarks/real_vllm_grid.py replay --seeds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import optuna

import tuner.launch.process
from tuner.config import parse_job
from tuner.flags import VllmFlags
from tuner.launch.factory import build_launcher
from tuner.record import TrialRecord
from tuner.store import flag_key
from tuner.study import DIRECTIONS, TuningRun, measure_load
from tuner.study.samplers import make_sampler
from tuner.twin.sampler import twin_unsupported

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURE = HERE / "fixtures" / "real_vllm_grid.json"
TARGETS = (0.97, 0.99)
PORTS = range(18510, 18600)  # this benchmark's own, away from the OS's ephemeral range other servers draw from

SPACE: dict[str, Any] = {
    "max_model_len": 1024,
    "max_num_seqs": {"choices": [4, 8, 16, 32]},
    "max_num_batched_tokens": {"choices": [256, 512, 1024]},
}
WORKLOAD: dict[str, Any] = {"input_len": 128, "output_len": 32, "seed": 1}
ARRIVAL: dict[str, Any] = {"concurrency": 16, "requests": 64, "warmup_requests": 4}
SLOS = ["e2e_p95 <= 30s", "success_rate >= 0.99"]
# The CPU build's working entry point (its `vllm` console script dies: the distribution is `vllm-cpu`).
SERVE = ["-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", "{host}", "--port", "{port}"]


def job_data(sampler: str, *, vllm_python: str, model: str, seed: int = 0, n_trials: int = 13) -> dict[str, Any]:
    return {
        "study": {"name": f"real-grid-{sampler}-{seed}"},
        "target": {
            "launcher": "process",
            "model": model,
            "gpu": "cpu",
            "startup_timeout": "15m",
            "process": {
                "command": [vllm_python, *SERVE],
                "extra_args": ["--enforce-eager"],
                "env": ["VLLM_CPU_KVCACHE_SPACE"],
                "options": {"served_model_name": "tiny"},
            },
        },
        "space": SPACE,
        "workload": WORKLOAD,
        "arrival": ARRIVAL,
        "slos": SLOS,
        "request_timeout": "60s",
        "budget": {"n_trials": n_trials},
        "sampler": {"name": sampler, "seed": seed},
    }


def _own_port(host: str = "127.0.0.1") -> int:
    for port in PORTS:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise SystemExit(f"no free port in {PORTS.start}-{PORTS.stop - 1}")


def measure(out: Path) -> None:
    vllm_python = os.environ.get("TUNER_TEST_VLLM_PYTHON")
    model = os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not vllm_python or not model or "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        raise SystemExit('set up first: eval "$(scripts/real-vllm)"; and VLLM_CPU_KVCACHE_SPACE=1')
    job = parse_job(job_data("grid", vllm_python=vllm_python, model=model), where="real grid")
    setattr(tuner.launch.process, "free_port", _own_port)  # noqa: B010  (this benchmark's own ports)
    load_before = os.getloadavg()
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        run = TuningRun(job, build_launcher(job), storage_url=f"sqlite:///{folder}/grid.db", on_event=_say)
        try:
            run.run()
            trials = sorted(run.study.get_trials(deepcopy=False), key=lambda t: t.number)
        finally:
            run.close()
    points = []
    for t in trials:
        r = TrialRecord.from_attrs(t.user_attrs)
        if r.is_duplicate or not r.flags:
            continue
        points.append(
            {
                "trial": t.number,
                "baseline": r.baseline,
                "params": dict(t.params),
                "flags": r.flags,
                "outcome": r.outcome,
                "reason": r.reason,
                "output_tok_s": r.output_tok_s,
                "e2e_p95_s": r.e2e_p95_s,
                "ttft_p95_s": r.ttft_p95_s,
                "tpot_p95_s": r.tpot_p95_s,
                "success_rate": r.success_rate,
                "feasible": r.feasible,
                "values": list(t.values) if t.values else None,
                "constraints": dict(t.constraints),
                "kv_tokens": r.kv_tokens,
                "server_seconds": r.server_seconds,
                "vllm_version": r.vllm_version,
            }
        )
    fixture = {
        "vllm_versions": sorted({str(p["vllm_version"]) for p in points if p["vllm_version"]}),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_minutes": round((time.time() - started) / 60, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "env": {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]},
        "space": SPACE,
        "workload": WORKLOAD,
        "arrival": ARRIVAL,
        "slos": SLOS,
        "points": points,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"{len(points)} flag sets measured; written to {out}", file=sys.stderr)


def repeat(path: Path, runs: int) -> None:
    """The noise floor: the baseline's and the best flag set's servers started again, the load run `runs` times on
    each (the first replays the grid's requests; a prefix cache could flatter the others, which vLLM's CPU build
    leaves on: reported as measured). Written into the fixture under "repeats"."""
    vllm_python = os.environ.get("TUNER_TEST_VLLM_PYTHON")
    model = os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not vllm_python or not model or "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        raise SystemExit('set up first: eval "$(scripts/real-vllm)"; and VLLM_CPU_KVCACHE_SPACE=1')
    fixture = json.loads(path.read_text())
    job = parse_job(job_data("grid", vllm_python=vllm_python, model=model), where="real grid")
    setattr(tuner.launch.process, "free_port", _own_port)  # noqa: B010  (this benchmark's own ports)
    launcher = build_launcher(job)
    feasible = [p for p in fixture["points"] if p["feasible"]]
    best = max(feasible, key=lambda p: p["output_tok_s"])
    base = next(p for p in fixture["points"] if p["baseline"])

    async def measure_runs(flags: VllmFlags) -> list[float | None]:
        async with launcher.start(flags) as server:
            out: list[float | None] = []
            for _ in range(runs):
                m = await measure_load(server, job, flags)
                out.append(m.result.summary.output_throughput if m.result is not None else None)
            return out

    points: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "load_average_before": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "points": points,
    }
    for point in (base, best):
        tok_s = asyncio.run(measure_runs(VllmFlags.from_dict(point["flags"])))
        _say(f"{point['flags']}: {tok_s} tok/s")
        points.append({"trial": point["trial"], "flags": point["flags"], "output_tok_s": tok_s})
    out["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    fixture["repeats"] = out
    path.write_text(json.dumps(fixture, indent=1) + "\n")


def _say(message: str) -> None:
    print(time.strftime("%H:%M:%S ") + message, file=sys.stderr, flush=True)


# -- replay ------------------------------------------------------------------------------------------------------


# The replayed methods: the job's `sampler` section (search_spaces/cpu-tiny.yaml gives TPE 3 start-up trials).
METHODS: dict[str, dict[str, Any]] = {
    "tpe": {"name": "tpe"},
    "tpe, n_startup_trials 3": {"name": "tpe", "n_startup_trials": 3},
    "random": {"name": "random"},
}


def _model() -> str:
    """The tiny model's directory: its config is what the baseline's (vLLM's CPU defaults) arithmetic reads."""
    return os.environ.get("TUNER_TEST_VLLM_MODEL") or str(ROOT / ".tuner-cache" / "tiny-llama")


def replay_one(fixture: dict[str, Any], method: str, seed: int, budget: int) -> list[float | None]:
    """The feasible output tok/s of each distinct flag set the sampler launches, in order (None: infeasible)."""
    data = job_data("tpe", vllm_python=sys.executable, model=_model(), seed=seed)
    data["sampler"] = {**METHODS[method], "seed": seed}
    job = parse_job(data, where="replay")
    space = job.search_space()
    by_key = {flag_key(p["flags"]): p for p in fixture["points"]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        study = optuna.create_study(directions=DIRECTIONS, sampler=make_sampler(job, space))
        study.enqueue_trial(space.baseline_params(), user_attrs={"baseline": True})
        seen: list[str] = []
        out: list[float | None] = []
        repeats = 0
        while len(seen) < min(budget, len(by_key)) and repeats < 200:
            trial = study.ask()
            baseline = bool(trial.user_attrs.get("baseline"))
            flags = space.suggest(trial, baseline=baseline).flags
            key = flag_key(flags.as_dict())
            point = by_key.get(key)
            if point is None:
                raise SystemExit(f"the sampler proposed {flags.as_dict()}, which the fixture does not hold")
            for name, value in point["constraints"].items():
                trial.set_constraint(name, value)
            trial.set_user_attr("flags", point["flags"])
            study.tell(trial, point["values"])
            if key in seen:
                repeats += 1
                continue
            seen.append(key)
            out.append(point["output_tok_s"] if point["feasible"] else None)
    return out


def replay(path: Path, seeds: int, budget: int) -> None:
    fixture = json.loads(path.read_text())
    feasible = [p["output_tok_s"] for p in fixture["points"] if p["feasible"]]
    best = max(feasible)
    base = next(p for p in fixture["points"] if p["baseline"])
    spread = (max(feasible) - min(feasible)) / best
    print(
        f"{len(fixture['points'])} flag sets (vLLM {', '.join(fixture['vllm_versions'])}), best {best:,.1f} tok/s, "
        f"baseline {base['output_tok_s']:,.1f}, spread of the feasible {spread:.1%}; "
        f"{sum(x >= TARGETS[0] * best for x in feasible)} within 97% of the best, "
        f"{sum(x >= TARGETS[1] * best for x in feasible)} within 99%"
    )
    print("| method | reached 97% | reached 99% | trials to 97% | trials to 99% |")
    print("|---|---|---|---|---|")
    job = parse_job(job_data("tpe", vllm_python=sys.executable, model=_model()), where="replay")
    print(f"| twin | - | - | - | - (cannot imitate it: {twin_unsupported(job)}) |")
    grid_order = [p["output_tok_s"] if p["feasible"] else None for p in fixture["points"]]
    for label, runs in [("grid, in order", [grid_order])] + [
        (name, [replay_one(fixture, name, seed, budget) for seed in range(seeds)]) for name in METHODS
    ]:
        cells = []
        for t in TARGETS:
            hits = [next((i + 1 for i, x in enumerate(r) if x is not None and x >= t * best), None) for r in runs]
            got = [h for h in hits if h is not None]
            cells.append((f"{len(got)}/{len(runs)}", statistics.median(got) if got else None))
        print(f"| {label} | {cells[0][0]} | {cells[1][0]} | {cells[0][1]} | {cells[1][1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="launch real vLLM for every grid point (writes the fixture)")
    m.add_argument("--out", type=Path, default=FIXTURE)
    rep = sub.add_parser("repeat", help="start the baseline and the best again, run the load --runs times on each")
    rep.add_argument("fixture", type=Path, nargs="?", default=FIXTURE)
    rep.add_argument("--runs", type=int, default=3)
    r = sub.add_parser("replay", help="the samplers' paths against the fixture")
    r.add_argument("fixture", type=Path, nargs="?", default=FIXTURE)
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--budget", type=int, default=13)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if args.command == "measure":
        measure(args.out)
    elif args.command == "repeat":
        repeat(args.fixture, args.runs)
    else:
        replay(args.fixture, args.seeds, args.budget)


if __name__ == "__main__":
    main()
