"""The wall time of one study at `tuner tune --parallel 4` against `--parallel 1`, the same trials.

The study: the emulator imitating an L4 + Llama-3.1-8B at a slow time scale (a trial's wall time is then mostly the
server's emulated GPU time, waiting, as on a GPU); the grid sampler over 8 flag sets plus the baseline, so both
runs measure exactly the same 9 flag sets. The box's GPUs are CUDA_VISIBLE_DEVICES=0,1,2,3 (the emulator's box:
this machine has none). Rounds alternate 1 and 4 workers side by side; the table is the medians and their ratio,
with the CPU seconds the whole process tree spent (tuner, workers, servers) and the load average beside them.

    .venv/bin/python benchmarks/parallel_speedup.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import yaml

ROOT = Path(__file__).resolve().parent.parent


def job(time_scale: float) -> dict[str, Any]:
    return {
        "study": {"name": "speedup", "heartbeat_interval": 5, "grace_period": 60},
        "target": {
            "launcher": "emulator",
            "model": "llama-3.1-8b",
            "gpu": "l4",
            "emulator": {"time_scale": time_scale},
        },
        "space": {
            "max_num_seqs": {"choices": [8, 16, 32, 64]},
            "gpu_memory_utilization": {"choices": [0.86, 0.9]},
            "max_model_len": 2048,
        },
        "workload": {"input_len": 256, "output_len": 64, "seed": 1},
        "arrival": {"concurrency": 8, "requests": 24},
        "slos": ["e2e_p95 <= 60s", "success_rate >= 0.9"],
        "request_timeout": "120s",
        "budget": {"n_trials": 9},  # the baseline and the 8 grid points
        "sampler": {"name": "grid", "seed": 1},
    }


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_study(workers: int, time_scale: float, tmp: Path) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"p{workers}-", dir=tmp))
    job_file = folder / "job.yaml"
    job_file.write_text(yaml.safe_dump(job(time_scale)))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1,2,3", "TUNER_STATE_DIR": str(folder / "state")}
    load = os.getloadavg()[0]
    cpu = children_cpu()
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", str(job_file), "--parallel", str(workers)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.monotonic() - started
    if done.returncode != 0:
        raise SystemExit(f"--parallel {workers} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    study = optuna.load_study(study_name="speedup", storage=f"sqlite:///{folder / 'speedup.db'}")
    trials = study.get_trials(deepcopy=False)
    flags = sorted(json.dumps(t.user_attrs.get("flags"), sort_keys=True) for t in trials)
    states = {t.state.name for t in trials}
    if len(trials) != 9 or states != {"COMPLETE"}:
        raise SystemExit(f"--parallel {workers}: {len(trials)} trials, states {states}")
    per_trial = [(t.datetime_complete - t.datetime_start).total_seconds() for t in trials]  # type: ignore[operator]
    return {
        "wall": wall,
        "cpu": children_cpu() - cpu,
        "load": load,
        "flags": flags,
        "trial_wall": statistics.median(per_trial),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--time-scale", type=float, default=1.0, help="the emulator's (1: real time)")
    args = parser.parse_args()
    runs: dict[int, list[dict[str, Any]]] = {1: [], args.workers: []}
    with tempfile.TemporaryDirectory(prefix="parallel-speedup-") as tmp:
        for r in range(args.rounds):
            for workers in (1, args.workers) if r % 2 == 0 else (args.workers, 1):
                result = one_study(workers, args.time_scale, Path(tmp))
                runs[workers].append(result)
                print(
                    f"round {r + 1}, --parallel {workers}: {result['wall']:.1f} s wall, {result['cpu']:.1f} s CPU, "
                    f"median trial {result['trial_wall']:.1f} s, load {result['load']:.2f}",
                    flush=True,
                )
    one, many = runs[1], runs[args.workers]
    if any(run["flags"] != one[0]["flags"] for run in one + many):
        raise SystemExit("the runs measured different flag sets")

    def med(rs: list[dict[str, Any]], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    print()
    print(f"| figure | --parallel 1 | --parallel {args.workers} | ratio |")
    print("|---|---|---|---|")
    w1, wn = med(one, "wall"), med(many, "wall")
    print(f"| study wall time, s (median of {args.rounds}) | {w1:.1f} | {wn:.1f} | **{w1 / wn:.2f}x** faster |")
    c1, cn = med(one, "cpu"), med(many, "cpu")
    print(f"| CPU of the whole process tree, s | {c1:.1f} | {cn:.1f} | {cn / c1:.2f} |")
    t1, tn = med(one, "trial_wall"), med(many, "trial_wall")
    print(f"| median trial wall time, s | {t1:.1f} | {tn:.1f} | {tn / t1:.2f} |")
    walls = [", ".join(f"{r['wall']:.1f}" for r in rs) for rs in (one, many)]
    print(f"| wall times, s | {walls[0]} | {walls[1]} | |")
    print(f"| 1-min load average at the start | {med(one, 'load'):.2f} | {med(many, 'load'):.2f} | |")


if __name__ == "__main__":
    main()
