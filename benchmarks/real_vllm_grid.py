"""Real vLLM (the pinned CPU build, the tiny local model): a grid of flag sets measured once, kept as a fixture, and
the samplers' paths replayed against it.

`measure` runs the real study (`TuningRun`, the process launcher, the load phase) with the grid sampler over the
space below: the baseline (vLLM's CPU defaults) and every grid point, each launched once. It writes the fixture:
the vLLM version each server reported, the workload, arrival and SLOs, the machine's load average before and after,
and per flag set its outcome, output tok/s, latency P95s, KV tokens and server seconds.

`calibrate` starts a real server with the baseline's flags and runs `tuner calibrate` against it (a probe of the
workload's kind): the profile (benchmarks/fixtures/real_vllm_cpu_profile.json, with the vLLM version it probed)
with which the twin imitates this CPU target.

`replay` runs each sampler the job may name, the twin among them (`target.profile` the calibrated one), through
Optuna's ask-and-tell with the job's own sampler (`tuner.study.samplers.make_sampler`, the baseline enqueued first
as the study does), answering every proposal from the fixture with the record the study would have written (so the
twin refits to it): trials to 97% and 99% of the grid's best, and to the noise band (within the factor the same
flags measured apart between two starts, from `repeat`). A repeat of a flag set is answered from the fixture and not
counted (as the study answers it from the first trial). For the twin: each trial's prediction against the
measurement, and the Spearman correlation of its predicted ranking of the grid with the measured one.

    eval "$(scripts/real-vllm)"
    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/real_vllm_grid.py measure   # ~1 min a flag set
    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/real_vllm_grid.py calibrate # ~1 min
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
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from servers import start_server, stop_server

import tuner.launch.process
from tuner.catalog.gpus import CPU_KV_SPACE_ENV
from tuner.cli.trial_lines import short_flags
from tuner.config import Job, parse_job
from tuner.flags import VllmFlags
from tuner.launch.factory import build_launcher
from tuner.record import TrialRecord
from tuner.store import flag_key
from tuner.study import DIRECTIONS, TuningRun, measure_load
from tuner.study.samplers import make_sampler
from tuner.twin.model import Twin
from tuner.twin.sampler import PREDICTED_ATTR, TwinSampler

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURE = HERE / "fixtures" / "real_vllm_grid.json"
PROFILE = HERE / "fixtures" / "real_vllm_cpu_profile.json"  # tuner calibrate's, against the same build and model
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
                "e2e_p95_s": r.latencies.get("e2e_p95"),
                "ttft_p95_s": r.latencies.get("ttft_p95"),
                "tpot_p95_s": r.latencies.get("tpot_p95"),
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


# The probe of the grid's workload kind (twin_fidelity's run 2: probing up to the workload's concurrency is what put
# the flag sets in the right order): its output length, concurrency 1, 4 and its 16, its prompt and a quarter of it.
PROBE = ["--concurrency", "1,4,16", "--input-len", "32,128", "--output-len", "32"]


def calibrate(path: Path, out: Path) -> None:
    """`tuner calibrate` against a real server with the grid's baseline flags (vLLM's CPU defaults): the profile the
    twin predicts the grid with. Written to `out`; the grid's fixture records how and when ("calibration")."""
    vllm_python, model = _real_paths()
    fixture = json.loads(path.read_text())
    port = _own_port()
    host = "127.0.0.1"
    serve = [a.format(model=model, host=host, port=port) for a in SERVE]
    cmd = [vllm_python, *serve, "--max-model-len", str(SPACE["max_model_len"]), "--enforce-eager"]
    cmd += ["--served-model-name", "tiny"]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    probe = [sys.executable, "-m", "tuner", "calibrate", "--url", f"http://{host}:{port}", "--device", "cpu"]
    probe += ["--model-config", model, "-o", str(out), *PROBE]
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        server = start_server(cmd, port, Path(folder) / "server.log", env)
        try:
            subprocess.run(probe, check=True)
        finally:
            stop_server(server)
    fixture["calibration"] = {
        "profile": out.name,
        "command": ["tuner", "calibrate", "--device", "cpu", *PROBE],
        "server": ["--max-model-len", str(SPACE["max_model_len"]), "--enforce-eager"],
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    path.write_text(json.dumps(fixture, indent=1) + "\n")


def _real_paths() -> tuple[str, str]:
    vllm_python = os.environ.get("TUNER_TEST_VLLM_PYTHON")
    model = os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not vllm_python or not model or "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        raise SystemExit('set up first: eval "$(scripts/real-vllm)"; and VLLM_CPU_KVCACHE_SPACE=1')
    return vllm_python, model


def _say(message: str) -> None:
    print(time.strftime("%H:%M:%S ") + message, file=sys.stderr, flush=True)


# -- replay ------------------------------------------------------------------------------------------------------


# The replayed methods: the job's `sampler` section (search_spaces/cpu-tiny.yaml gives TPE 3 start-up trials). The
# twin predicts with the profile `calibrate` fitted (the fixture's "calibration").
METHODS: dict[str, dict[str, Any]] = {
    "twin (calibrated profile)": {"name": "twin"},
    "tpe": {"name": "tpe"},
    "tpe, n_startup_trials 3": {"name": "tpe", "n_startup_trials": 3},
    "random": {"name": "random"},
}


@dataclass
class Replayed:
    """One sampler's path: per distinct flag set launched, in order."""

    keys: list[str] = field(default_factory=list)
    tok_s: list[float | None] = field(default_factory=list)  # the fixture's output tok/s (None: infeasible)
    predicted: list[float | None] = field(default_factory=list)  # the twin's prediction before it ran
    log: list[str] = field(default_factory=list)  # the twin's lines, as a study's log has them
    twin: Twin | None = None  # the twin after its last refit


def _model() -> str:
    """The tiny model's directory: its config is what the baseline's (vLLM's CPU defaults) arithmetic reads."""
    return os.environ.get("TUNER_TEST_VLLM_MODEL") or str(ROOT / ".tuner-cache" / "tiny-llama")


def replay_job(fixture: dict[str, Any], sampler: dict[str, Any], seed: int) -> Job:
    data = job_data(sampler["name"], vllm_python=sys.executable, model=_model(), seed=seed)
    data["sampler"] = {**sampler, "seed": seed}
    if "calibration" in fixture:
        data["target"]["profile"] = str(HERE / "fixtures" / fixture["calibration"]["profile"])
    return parse_job(data, where="replay")


def _record(point: dict[str, Any], baseline: bool, duplicate_of: int | None) -> TrialRecord:
    """The trial's record as the study would have written it, from the fixture (what the twin refits to)."""
    return TrialRecord(
        flags=point["flags"],
        baseline=baseline,
        outcome=point["outcome"],
        reason=point["reason"],
        output_tok_s=point["output_tok_s"],
        latencies={"e2e_p95": point["e2e_p95_s"]} if point["e2e_p95_s"] is not None else {},
        success_rate=point["success_rate"],
        kv_tokens=point["kv_tokens"],
        feasible=point["feasible"],
        server_seconds=point["server_seconds"],
        duplicate_of=duplicate_of,
    )


def replay_one(fixture: dict[str, Any], method: str, seed: int, budget: int) -> Replayed:
    """The sampler's path through the fixture: every proposal answered from the flag set's measurement; a repeat is
    answered from its first trial and not counted, as the study does."""
    job = replay_job(fixture, METHODS[method], seed)
    space = job.search_space()
    by_key = {flag_key(p["flags"]): p for p in fixture["points"]}
    out = Replayed()
    first: dict[str, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sampler = make_sampler(job, space, on_event=out.log.append)
        study = optuna.create_study(directions=DIRECTIONS, sampler=sampler)
        study.enqueue_trial(space.baseline_params(), user_attrs={"baseline": True})
        repeats = 0
        while len(out.keys) < min(budget, len(by_key)) and repeats < 200:
            trial = study.ask()
            baseline = bool(trial.user_attrs.get("baseline"))
            flags = space.suggest(trial, baseline=baseline).flags
            key = flag_key(flags.as_dict())
            point = by_key.get(key)
            if point is None:
                raise SystemExit(f"the sampler proposed {flags.as_dict()}, which the fixture does not hold")
            for name, value in point["constraints"].items():
                trial.set_constraint(name, value)
            for name, value in _record(point, baseline, first.get(key)).to_attrs().items():
                trial.set_user_attr(name, value)
            study.tell(trial, point["values"])
            if key in first:
                repeats += 1
                continue
            first[key] = trial.number
            out.keys.append(key)
            out.tok_s.append(point["output_tok_s"] if point["feasible"] else None)
            out.predicted.append(study.trials[trial.number].user_attrs.get(PREDICTED_ATTR))
    out.twin = sampler.twin if isinstance(sampler, TwinSampler) else None
    return out


def noise_ratio(fixture: dict[str, Any]) -> float:
    """The smallest factor between a flag set's grid measurement and its first load on a new start (`repeat`): two
    measurements of one start each within it of each other cannot be told apart on this machine."""
    grid = {p["trial"]: p["output_tok_s"] for p in fixture["points"]}
    ratios: list[float] = [
        max(grid[r["trial"]], r["output_tok_s"][0]) / min(grid[r["trial"]], r["output_tok_s"][0])
        for r in fixture["repeats"]["points"]
    ]
    return min(ratios)


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for i in order:
            tied = [j for j in order if x[j] == x[i]]
            r[i] = statistics.fmean(order.index(j) for j in tied)
        return r

    return statistics.correlation(ranks(a), ranks(b))


def twin_ranking(fixture: dict[str, Any], refit: Twin | None) -> str:
    """Spearman of the measured grid against the twin's predictions: from the profile alone (before any real trial),
    and after the replay's last refit (fitted to the trials it ran, so partly in-sample)."""
    job = replay_job(fixture, {"name": "twin"}, 0)
    points = [p for p in fixture["points"] if p["feasible"]]
    keys = [flag_key(p["flags"]) for p in points]
    fresh = Twin(job, [])
    for key, p in zip(keys, points, strict=True):
        fresh.known[key] = VllmFlags.from_dict(p["flags"])
    measured = [p["output_tok_s"] for p in points]
    before = [fresh.predict(k).output_tok_s for k in keys]
    text = f"Spearman of the twin's predicted ranking against the measured one, {len(points)} flag sets: "
    text += f"{spearman(before, measured):.2f} from the profile alone"
    if refit is not None:
        for key, p in zip(keys, points, strict=True):
            refit.known.setdefault(key, VllmFlags.from_dict(p["flags"]))
        after = [refit.predict(k).output_tok_s for k in keys]
        text += f", {spearman(after, measured):.2f} after the last refit"
    return text + f"; its best from the profile alone: {short_flags(points[before.index(max(before))]['flags'])}"


def _hits(runs: list[list[float | None]], threshold: float) -> tuple[str, float | None]:
    """Runs that launched a flag set measured at `threshold` or more, and the median trials to the first."""
    hits = [next((i + 1 for i, x in enumerate(r) if x is not None and x >= threshold), None) for r in runs]
    got = [h for h in hits if h is not None]
    return f"{len(got)}/{len(runs)}", statistics.median(got) if got else None


def replay(path: Path, seeds: int, budget: int) -> None:
    fixture = json.loads(path.read_text())
    # The twin's KV cache is the one the servers had: vLLM's CPU build reads it from the environment, as tuner does.
    os.environ[CPU_KV_SPACE_ENV] = fixture["env"][CPU_KV_SPACE_ENV]
    feasible = [p["output_tok_s"] for p in fixture["points"] if p["feasible"]]
    best = max(feasible)
    base = next(p for p in fixture["points"] if p["baseline"])
    noise = noise_ratio(fixture)
    thresholds = [TARGETS[0] * best, TARGETS[1] * best, best / noise]
    print(
        f"{len(fixture['points'])} flag sets (vLLM {', '.join(fixture['vllm_versions'])}), best {best:,.1f} tok/s, "
        f"baseline {base['output_tok_s']:,.1f}, spread of the feasible {(best - min(feasible)) / best:.1%}; "
        + "; ".join(f"{sum(x >= t for x in feasible)} at {t:,.1f} tok/s or more" for t in thresholds)
        + f" (the last: the best over the noise between starts, x{noise:.2f})"
    )
    heads = ["reached 97%", "reached 99%", "trials to 97%", "trials to 99%", "trials to the band", "past the baseline"]
    print("| method | " + " | ".join(heads) + " |")
    print("|---|---|---|---|---|---|---|")
    grid_order = Replayed(tok_s=[p["output_tok_s"] if p["feasible"] else None for p in fixture["points"]])
    twin_runs: list[Replayed] = []
    for label, runs in [("grid, in order", [grid_order])] + [
        (name, [replay_one(fixture, name, seed, budget) for seed in range(seeds)]) for name in METHODS
    ]:
        if METHODS.get(label, {}).get("name") == "twin":
            twin_runs = runs
        cells = [_hits([r.tok_s for r in runs], t) for t in thresholds]
        # The baseline is trial 1 of every run: past it, the first other flag set within the band (and in how many).
        reached, past = _hits([[None, *r.tok_s[1:]] for r in runs], thresholds[2])
        row = [cells[0][0], cells[1][0], cells[0][1], cells[1][1], cells[2][1], f"{past} ({reached})"]
        print(f"| {label} | " + " | ".join(str(c) for c in row) + " |")
    for seed, run in enumerate(twin_runs):
        trials = ", ".join(
            f"{short_flags(fixture_flags(fixture, k))}: {p or 0:,.0f} predicted, {m or 0:,.0f} measured"
            for k, p, m in zip(run.keys, run.predicted, run.tok_s, strict=True)
        )
        fell = next((line for line in run.log if "falling back" in line), "no fallback")
        print(f"twin, seed {seed}: {trials}; {fell}")
    if twin_runs:
        print(twin_ranking(fixture, twin_runs[0].twin))


def fixture_flags(fixture: dict[str, Any], key: str) -> dict[str, Any]:
    return next(p["flags"] for p in fixture["points"] if flag_key(p["flags"]) == key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="launch real vLLM for every grid point (writes the fixture)")
    m.add_argument("--out", type=Path, default=FIXTURE)
    rep = sub.add_parser("repeat", help="start the baseline and the best again, run the load --runs times on each")
    rep.add_argument("fixture", type=Path, nargs="?", default=FIXTURE)
    rep.add_argument("--runs", type=int, default=3)
    cal = sub.add_parser("calibrate", help="tuner calibrate against a real server with the baseline's flags")
    cal.add_argument("fixture", type=Path, nargs="?", default=FIXTURE)
    cal.add_argument("--out", type=Path, default=PROFILE)
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
    elif args.command == "calibrate":
        calibrate(args.fixture, args.out)
    else:
        replay(args.fixture, args.seeds, args.budget)


if __name__ == "__main__":
    main()
