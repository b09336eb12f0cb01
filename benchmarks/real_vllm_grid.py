"""Real vLLM (the pinned CPU build, the tiny local model): a grid of flag sets, each started `--rounds` times, kept
as a fixture, and the samplers' paths replayed against it.

`measure` runs the real study (`TuningRun`, the process launcher, the load phase) with the grid sampler over a
grid's space (`GRIDS`): the baseline (vLLM's CPU defaults) and every grid point, once a round, each round a study of
its own in a new order. It writes the fixture: the vLLM version each server reported, the workload, arrival and
SLOs, the machine's load average before and after, and per flag set every start's outcome, output tok/s, latency
P95s, KV tokens, server seconds and place in its round, with their medians.

`calibrate` starts a real server with the baseline's flags and runs `tuner calibrate` against it (a probe of the
grid's workload kind): the profile (named after the fixture, with the vLLM version it probed) with which the twin
imitates this CPU target.

`replay` runs each sampler the job may name, the twin among them (`target.profile` the calibrated one), through
Optuna's ask-and-tell with the job's own sampler (`tuner.study.samplers.make_sampler`, the baseline enqueued first
as the study does), answering every proposal from the fixture with the record the study would have written (the
median of its starts; judged by the fixture's `replay_slos`; so the twin refits to it): trials to 97% and 99% of
the grid's best, and to the noise band (within the spread between starts of the same flags). A repeat of a flag set
is answered from the fixture and not counted (as the study answers it from the first trial). It prints each flag
set's starts and the signal against the noise, and for the twin each trial's prediction against the measurement,
the Spearman correlation of its predicted ranking with the measured one, and its figures (TTFT under load among
them) against the measured medians.

    eval "$(scripts/real-vllm)"
    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/real_vllm_grid.py measure --rounds 3  # ~40 s a start
    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/real_vllm_grid.py calibrate           # ~1 min
    .venv/bin/python benchmarks/real_vllm_grid.py replay --seeds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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
from tuner.study.verdict import STARTUP_CONSTRAINT
from tuner.twin.model import Twin
from tuner.twin.sampler import PREDICTED_ATTR, TwinSampler

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
FIXTURE = HERE / "fixtures" / "real_vllm_grid.json"
PROFILE = HERE / "fixtures" / "real_vllm_cpu_profile.json"  # tuner calibrate's, against the same build and model
TARGETS = (0.97, 0.99)
PORTS = range(18510, 18600)  # this benchmark's own, away from the OS's ephemeral range other servers draw from

# Each grid's space, load and SLOs; a fixture keeps its own copy, which is what `replay` reads.
GRIDS: dict[str, dict[str, Any]] = {
    # 2026-12-04, measured once per flag set on a shared machine: the flags' effect was inside the noise.
    "once": {
        "space": {
            "max_model_len": 1024,
            "max_num_seqs": {"choices": [4, 8, 16, 32]},
            "max_num_batched_tokens": {"choices": [256, 512, 1024]},
        },
        "workload": {"input_len": 128, "output_len": 32, "seed": 1},
        "arrival": {"concurrency": 16, "requests": 64, "warmup_requests": 4},
        "slos": ["e2e_p95 <= 30s", "success_rate >= 0.99"],
    },
    # Many more users than sequences and prompts that a small token budget must chunk: the flags move throughput
    # and latency by several times, the noise between starts (14% on a quiet 2-core machine) does not.
    "repeated": {
        "space": {
            "max_model_len": 1024,
            "max_num_seqs": {"choices": [1, 4, 16, 64]},
            "max_num_batched_tokens": {"choices": [256, 2048]},
        },
        "workload": {"input_len": 512, "output_len": 64, "seed": 1},
        "arrival": {"concurrency": 32, "requests": 96, "warmup_requests": 4},
        # Loose on purpose while measuring (every figure is kept whole); `replay` judges with the fixture's
        # "replay_slos".
        "slos": ["e2e_p95 <= 120s", "success_rate >= 0.99"],
    },
}
# A check of the script itself (two flag sets, a few requests), not a measurement.
GRIDS["smoke"] = {
    **GRIDS["repeated"],
    "space": {"max_model_len": 1024, "max_num_seqs": {"choices": [4, 8]}},
    "arrival": {"concurrency": 4, "requests": 8, "warmup_requests": 1},
}
FIXTURES = {
    "smoke": Path(tempfile.gettempdir()) / "real_vllm_grid_smoke.json",
    "once": FIXTURE,
    "repeated": HERE / "fixtures" / "real_vllm_grid_repeated.json",
}
# The CPU build's working entry point (its `vllm` console script dies: the distribution is `vllm-cpu`).
SERVE = ["-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", "{host}", "--port", "{port}"]


def job_data(
    sampler: str,
    *,
    vllm_python: str,
    model: str,
    seed: int = 0,
    n_trials: int = 13,
    grid: dict[str, Any] | None = None,
) -> dict[str, Any]:
    grid = grid or GRIDS["once"]
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
        "space": grid["space"],
        "workload": grid["workload"],
        "arrival": grid["arrival"],
        "slos": grid["slos"],
        "request_timeout": "120s",
        "budget": {"n_trials": n_trials, "confirm": 0},
        "stop_early": False,
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


def measure(name: str, rounds: int, out: Path) -> None:
    """Every flag set of the grid started `rounds` times: each round is a real study (the grid sampler, its own
    order per round, the baseline first) and every start keeps its own figures, so the spread between starts is
    measured beside the flags' effect."""
    vllm_python, model = _real_paths()
    grid = GRIDS[name]
    n_points = _grid_size(grid["space"]) + 1
    setattr(tuner.launch.process, "free_port", _own_port)  # noqa: B010  (this benchmark's own ports)
    load_before = os.getloadavg()
    started = time.time()
    starts: list[dict[str, Any]] = []
    for r in range(rounds):
        job = parse_job(
            job_data("grid", vllm_python=vllm_python, model=model, seed=r, n_trials=n_points, grid=grid),
            where="real grid",
        )
        starts += [{**s, "round": r} for s in _round(job)]
        _say(f"round {r + 1} of {rounds} done; load average {os.getloadavg()[0]:.2f}")
    fixture = {
        "grid": name,
        "vllm_versions": sorted({str(s["vllm_version"]) for s in starts if s["vllm_version"]}),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "wall_minutes": round((time.time() - started) / 60, 1),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "env": {"VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"]},
        "rounds": rounds,
        **grid,
        "points": _points(starts),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    print(f"{len(fixture['points'])} flag sets x {rounds} starts measured; written to {out}", file=sys.stderr)


def _grid_size(space: dict[str, Any]) -> int:
    n = 1
    for value in space.values():
        if isinstance(value, dict) and "choices" in value:
            n *= len(value["choices"])
    return n


def _round(job: Job) -> list[dict[str, Any]]:
    """One real study over the grid: per start its flags, outcome and figures, in the order the servers started."""
    with tempfile.TemporaryDirectory() as folder:
        run = TuningRun(job, build_launcher(job), storage_url=f"sqlite:///{folder}/grid.db", on_event=_say)
        try:
            run.run()
            trials = sorted(run.study.get_trials(deepcopy=False), key=lambda t: t.number)
        finally:
            run.close()
    out = []
    for t in trials:
        r = TrialRecord.from_attrs(t.user_attrs)
        if r.is_duplicate or not r.flags:
            continue
        out.append(
            {
                "order": t.number,
                "baseline": r.baseline,
                "params": dict(t.params),
                "flags": r.flags,
                "outcome": r.outcome,
                "reason": r.reason,
                "output_tok_s": r.output_tok_s,
                "latencies": dict(r.latencies),
                "success_rate": r.success_rate,
                "kv_tokens": r.kv_tokens,
                "server_seconds": r.server_seconds,
                "vllm_version": r.vllm_version,
            }
        )
    return out


def _points(starts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per flag set: every start, and the medians over the starts that measured (what `replay` answers with)."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for s in starts:
        by_key.setdefault(flag_key(s["flags"]), []).append(s)
    points = []
    for group in by_key.values():
        measured = [s for s in group if s["output_tok_s"] is not None]
        names = sorted({k for s in measured for k in s["latencies"]})
        first = group[0]
        points.append(
            {
                "baseline": first["baseline"],
                "params": first["params"],
                "flags": first["flags"],
                "outcome": "measured" if measured else first["outcome"],
                "reason": None if measured else first["reason"],
                "output_tok_s": _median([s["output_tok_s"] for s in measured]),
                "latencies": {n: _median([s["latencies"].get(n) for s in measured]) for n in names},
                "success_rate": _median([s["success_rate"] for s in measured]),
                "kv_tokens": first["kv_tokens"],
                "server_seconds": _median([s["server_seconds"] for s in group]),
                "vllm_version": first["vllm_version"],
                "starts": group,
            }
        )
    return points


def _median(values: list[Any]) -> float | None:
    got = [float(v) for v in values if v is not None]
    return statistics.median(got) if got else None


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


def probe(fixture: dict[str, Any]) -> list[str]:
    """The probe of the grid's workload kind (twin_fidelity's run 2: probing up to the workload's concurrency is what
    put the flag sets in the right order): its output length, concurrency 1, a quarter of its own and its own, its
    prompt and a quarter of it."""
    users = int(fixture["arrival"]["concurrency"])
    prompt = int(fixture["workload"]["input_len"])
    return [
        "--concurrency",
        f"1,{max(2, users // 4)},{users}",
        "--input-len",
        f"{prompt // 4},{prompt}",
        "--output-len",
        str(fixture["workload"]["output_len"]),
    ]


def calibrate(path: Path, out: Path) -> None:
    """`tuner calibrate` against a real server with the grid's baseline flags (vLLM's CPU defaults): the profile the
    twin predicts the grid with. Written to `out`; the grid's fixture records how and when ("calibration")."""
    vllm_python, model = _real_paths()
    fixture = json.loads(path.read_text())
    port = _own_port()
    host = "127.0.0.1"
    serve = [a.format(model=model, host=host, port=port) for a in SERVE]
    max_model_len = str(fixture["space"]["max_model_len"])
    cmd = [vllm_python, *serve, "--max-model-len", max_model_len, "--enforce-eager"]
    cmd += ["--served-model-name", "tiny"]
    env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    probe_args = probe(fixture)
    command = [sys.executable, "-m", "tuner", "calibrate", "--url", f"http://{host}:{port}", "--device", "cpu"]
    command += ["--model-config", model, "-o", str(out), *probe_args]
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.time()
    with tempfile.TemporaryDirectory() as folder:
        server = start_server(cmd, port, Path(folder) / "server.log", env)
        try:
            subprocess.run(command, check=True)
        finally:
            stop_server(server)
    fixture["calibration"] = {
        "profile": out.name,
        "command": ["tuner", "calibrate", "--device", "cpu", *probe_args],
        "server": ["--max-model-len", max_model_len, "--enforce-eager"],
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
    grid = {k: fixture[k] for k in ("space", "workload", "arrival")} | {"slos": judged_slos(fixture)}
    data = job_data(sampler["name"], vllm_python=sys.executable, model=_model(), seed=seed, grid=grid)
    data["sampler"] = {**sampler, "seed": seed}
    if "calibration" in fixture:
        data["target"]["profile"] = str(HERE / "fixtures" / fixture["calibration"]["profile"])
    return parse_job(data, where="replay")


def judged_slos(fixture: dict[str, Any]) -> list[str]:
    """The SLOs the replay judges by: the fixture's "replay_slos" where the measurement ran with loose ones."""
    return list(fixture.get("replay_slos") or fixture["slos"])


def latencies(point: dict[str, Any]) -> dict[str, float]:
    """A point's latency P95s, from either fixture shape (the first kept `e2e_p95_s` and its kin)."""
    if "latencies" in point:
        return {k: v for k, v in point["latencies"].items() if v is not None}
    names = {"e2e_p95": "e2e_p95_s", "ttft_p95": "ttft_p95_s", "tpot_p95": "tpot_p95_s"}
    return {k: point[v] for k, v in names.items() if point.get(v) is not None}


@dataclass(frozen=True)
class Judged:
    """A point judged against the replay's SLOs the way the study's scorer judges a trial."""

    values: list[float]
    constraints: dict[str, float]
    feasible: bool


def judge(point: dict[str, Any], job: Job) -> Judged:
    slos = job.parsed_slos()
    if point["output_tok_s"] is None:
        worst = [0.0, job.request_timeout]
        return Judged(worst, {STARTUP_CONSTRAINT: 10.0, **{f"slo:{s}": 0.0 for s in slos}}, False)
    figures = {**latencies(point), "success_rate": point["success_rate"], "output_throughput": point["output_tok_s"]}
    constraints = {STARTUP_CONSTRAINT: 0.0}
    for slo in slos:
        value = figures[slo.metric]
        excess = value - slo.threshold if slo.op in ("<=", "<") else slo.threshold - value
        constraints[f"slo:{slo}"] = excess / (abs(slo.threshold) or 1.0)
    latency = figures.get(job.primary_latency(), job.request_timeout)
    return Judged([point["output_tok_s"], latency], constraints, all(v <= 0 for v in constraints.values()))


def _record(point: dict[str, Any], judged: Judged, baseline: bool, duplicate_of: int | None) -> TrialRecord:
    """The trial's record as the study would have written it, from the fixture (what the twin refits to)."""
    return TrialRecord(
        flags=point["flags"],
        baseline=baseline,
        outcome=point["outcome"],
        reason=point["reason"],
        output_tok_s=point["output_tok_s"],
        latencies=latencies(point),
        success_rate=point["success_rate"],
        kv_tokens=point["kv_tokens"],
        feasible=judged.feasible,
        server_seconds=point["server_seconds"],
        duplicate_of=duplicate_of,
    )


def replay_one(fixture: dict[str, Any], method: str, seed: int, budget: int) -> Replayed:
    """The sampler's path through the fixture: every proposal answered from the flag set's measurement (the median
    of its starts where it has several); a repeat is answered from its first trial and not counted, as the study
    does."""
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
            judged = judge(point, job)
            for name, value in judged.constraints.items():
                trial.set_constraint(name, value)
            for name, value in _record(point, judged, baseline, first.get(key)).to_attrs().items():
                trial.set_user_attr(name, value)
            study.tell(trial, judged.values)
            if key in first:
                repeats += 1
                continue
            first[key] = trial.number
            out.keys.append(key)
            out.tok_s.append(point["output_tok_s"] if judged.feasible else None)
            out.predicted.append(study.trials[trial.number].user_attrs.get(PREDICTED_ATTR))
    out.twin = sampler.twin if isinstance(sampler, TwinSampler) else None
    return out


def noise_ratio(fixture: dict[str, Any]) -> float:
    """The factor within which two measurements of one flag set cannot be told apart on this machine: with starts
    kept per point, 1 + the median spread between two starts; else the smallest factor between a flag set's grid
    measurement and its first load on a new start (`repeat`)."""
    if any(len(p.get("starts", [])) > 1 for p in fixture["points"]):
        return 1.0 + between_starts(fixture)
    grid = {p["trial"]: p["output_tok_s"] for p in fixture["points"]}
    ratios: list[float] = [
        max(grid[r["trial"]], r["output_tok_s"][0]) / min(grid[r["trial"]], r["output_tok_s"][0])
        for r in fixture["repeats"]["points"]
    ]
    return min(ratios)


def pair_spreads(values: list[float]) -> list[float]:
    """|a - b| / mean(a, b) over every pair of starts."""
    return [abs(a - b) / ((a + b) / 2) for i, a in enumerate(values) for b in values[i + 1 :] if a + b > 0]


def between_starts(fixture: dict[str, Any], figure: str = "output_tok_s") -> float:
    """The median over flag sets of the median spread between two of their starts (the noise)."""
    spreads = []
    for p in fixture["points"]:
        values = [v for v in (_figure(s, figure) for s in p.get("starts", [])) if v is not None]
        if len(values) > 1:
            spreads.append(statistics.median(pair_spreads(values)))
    return statistics.median(spreads) if spreads else 0.0


def _figure(start: dict[str, Any], figure: str) -> float | None:
    value = start.get(figure) if figure in start else start.get("latencies", {}).get(figure)
    return float(value) if value is not None else None


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties share their mean rank)."""

    def ranks(x: list[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        r = [0.0] * len(x)
        for i in order:
            tied = [j for j in order if x[j] == x[i]]
            r[i] = statistics.fmean(order.index(j) for j in tied)
        return r

    if len(set(a)) < 2 or len(set(b)) < 2:
        return math.nan  # a constant ranking says nothing either way
    return statistics.correlation(ranks(a), ranks(b))


def twin_ranking(fixture: dict[str, Any], refit: Twin | None) -> str:
    """Spearman of the measured grid against the twin's predictions: from the profile alone (before any real trial),
    and after the replay's last refit (fitted to the trials it ran, so partly in-sample)."""
    job = replay_job(fixture, {"name": "twin"}, 0)
    points = [p for p in fixture["points"] if p["output_tok_s"] is not None]
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


FIDELITY = ["output_tok_s", "ttft_p95", "tpot_p95", "e2e_p95"]


def twin_figures(fixture: dict[str, Any]) -> str:
    """The twin's figures from the profile alone (no real trial) against the measured medians, per flag set: the
    closed loop's throughput and latency P95s (TTFT under load among them), each figure's ratio and Spearman."""
    loose = {**fixture, "replay_slos": [f"{f} <= 1000s" for f in FIDELITY[1:]]}
    job = replay_job(loose, {"name": "twin"}, 0)
    twin = Twin(job, [])
    points = [p for p in fixture["points"] if p["output_tok_s"] is not None]
    rows, pairs = [], {f: ([], []) for f in FIDELITY}
    for p in points:
        key = flag_key(p["flags"])
        twin.known[key] = VllmFlags.from_dict(p["flags"])
        predicted = twin.predict(key).figures
        cells = []
        for f in FIDELITY:
            measured, guess = _point_figure(p, f), predicted.get(f)
            if measured and guess:
                pairs[f][0].append(guess)
                pairs[f][1].append(measured)
                cells.append(f"{_show(f, guess)} / {_show(f, measured)} ({guess / measured:.2f})")
            else:
                cells.append("—")
        rows.append(f"| {short_flags(p['flags'])} | " + " | ".join(cells) + " |")
    head = "| flags | " + " | ".join(f"{f}: twin / real (ratio)" for f in FIDELITY) + " |"
    ranks = "; ".join(f"{f} {spearman(*pairs[f]):.2f}" for f in FIDELITY if len(pairs[f][0]) > 2)
    return "\n".join([head, "|---" * (len(FIDELITY) + 1) + "|", *rows, f"Spearman, twin against real: {ranks}"])


def _show(figure: str, value: float) -> str:
    return f"{value:,.0f}" if figure == "output_tok_s" else f"{value * 1000:,.0f} ms"


def _hits(runs: list[list[float | None]], threshold: float) -> tuple[str, float | None]:
    """Runs that launched a flag set measured at `threshold` or more, and the median trials to the first."""
    hits = [next((i + 1 for i, x in enumerate(r) if x is not None and x >= threshold), None) for r in runs]
    got = [h for h in hits if h is not None]
    return f"{len(got)}/{len(runs)}", statistics.median(got) if got else None


def replay(path: Path, seeds: int, budget: int) -> None:
    fixture = json.loads(path.read_text())
    # The twin's KV cache is the one the servers had: vLLM's CPU build reads it from the environment, as tuner does.
    os.environ[CPU_KV_SPACE_ENV] = fixture["env"][CPU_KV_SPACE_ENV]
    judge_job = replay_job(fixture, {"name": "grid"}, 0)
    feasible = [p["output_tok_s"] for p in fixture["points"] if judge(p, judge_job).feasible]
    best = max(feasible)
    base = next(p for p in fixture["points"] if p["baseline"])
    noise = noise_ratio(fixture)
    if fixture.get("rounds", 1) > 1:
        print(signal_and_noise(fixture, judge_job))
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
    grid_order = Replayed(
        tok_s=[p["output_tok_s"] if judge(p, judge_job).feasible else None for p in fixture["points"]]
    )
    twin_runs: list[Replayed] = []
    # The twin imitates a CPU server only from a calibrated profile (`calibrate` writes it).
    methods = [m for m in METHODS if "calibration" in fixture or METHODS[m]["name"] != "twin"]
    for label, runs in [("grid, in order", [grid_order])] + [
        (name, [replay_one(fixture, name, seed, budget) for seed in range(seeds)]) for name in methods
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
        print(twin_figures(fixture))


def signal_and_noise(fixture: dict[str, Any], job: Job) -> str:
    """Per flag set its starts' output tok/s, median and spread, and the verdict; then the grid's signal (best
    median over worst) against the noise (median spread between starts), for throughput and each latency P95."""
    slos = ", ".join(judged_slos(fixture))
    lines = [f"| flags | output tok/s per start | median | spread | meets {slos} |", "|---|---|---|---|---|"]
    for p in sorted(fixture["points"], key=lambda p: -(p["output_tok_s"] or 0)):
        values = [s["output_tok_s"] for s in p["starts"]]
        cells = " / ".join(f"{v:,.0f}" if v is not None else "failed" for v in values)
        spread = statistics.median(pair_spreads([v for v in values if v is not None]) or [0.0])
        name = "baseline (vLLM's CPU defaults)" if p["baseline"] else short_flags(p["flags"])
        tok_s = f"{p['output_tok_s']:,.0f}" if p["output_tok_s"] is not None else "—"
        lines.append(f"| {name} | {cells} | {tok_s} | {spread:.1%} | {'yes' if judge(p, job).feasible else 'no'} |")
    lines += ["", "| figure | best median / worst | noise between starts | signal / noise |", "|---|---|---|---|"]
    for figure in ["output_tok_s", "ttft_p95", "tpot_p95", "e2e_p95"]:
        medians = [m for m in (_point_figure(p, figure) for p in fixture["points"]) if m]
        noise = between_starts(fixture, figure)
        ratio = max(medians) / min(medians)
        lines.append(
            f"| {figure} | x{ratio:.2f} | {noise:.1%} | {(ratio - 1) / noise if noise else float('inf'):.1f} |"
        )
    return "\n".join(lines)


def _point_figure(point: dict[str, Any], figure: str) -> float | None:
    return point["output_tok_s"] if figure == "output_tok_s" else latencies(point).get(figure)


def fixture_flags(fixture: dict[str, Any], key: str) -> dict[str, Any]:
    return next(p["flags"] for p in fixture["points"] if flag_key(p["flags"]) == key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="launch real vLLM for every grid point, --rounds times (writes the fixture)")
    m.add_argument("--grid", choices=sorted(GRIDS), default="repeated")
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--out", type=Path, default=None)
    rep = sub.add_parser("repeat", help="start the baseline and the best again, run the load --runs times on each")
    rep.add_argument("fixture", type=Path, nargs="?", default=FIXTURE)
    rep.add_argument("--runs", type=int, default=3)
    cal = sub.add_parser("calibrate", help="tuner calibrate against a real server with the baseline's flags")
    cal.add_argument("fixture", type=Path, nargs="?", default=FIXTURES["repeated"])
    cal.add_argument("--out", type=Path, default=None, help="default: the profile named after the fixture")
    r = sub.add_parser("replay", help="the samplers' paths against the fixture")
    r.add_argument("fixture", type=Path, nargs="?", default=FIXTURES["repeated"])
    r.add_argument("--seeds", type=int, default=5)
    r.add_argument("--budget", type=int, default=13)
    args = parser.parse_args()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    if args.command == "measure":
        measure(args.grid, args.rounds, args.out or FIXTURES[args.grid])
    elif args.command == "repeat":
        repeat(args.fixture, args.runs)
    elif args.command == "calibrate":
        default = args.fixture.with_name(args.fixture.name.replace("real_vllm_grid", "real_vllm_cpu_profile"))
        calibrate(args.fixture, args.out or default)
    else:
        replay(args.fixture, args.seeds, args.budget)


if __name__ == "__main__":
    main()
