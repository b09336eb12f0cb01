"""The demo job alone and beside busy loops: does the study close with the same winner and a ratio inside its
stated interval, and what did it record about its machine (other processes' CPU, the emulator's lag)?

Each round runs `tuner tune` on a copy of the job (its own SQLite file in a temporary folder) twice: on the machine as
it is, then with `--busy` processes `python -c 'while True: pass'` started beside it (and killed after). For each it
records the winner, its throughput ratio to the baseline with the closing line's interval, the most lag any trial's
emulator recorded, the trials marked lagged, the other processes' mean CPU, and the exit line when the study stopped
(a machine that cannot hold the job's time_scale stops it, naming the time_scale it can).

Run it on an otherwise idle machine: the figures measure this machine, not the tool.

    .venv/bin/python benchmarks/busy_machine.py                      # the demo, 2 busy loops, 1 round
    .venv/bin/python benchmarks/busy_machine.py --trials 2 --confirm 0 --requests 16   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import yaml

from tuner.load.contention import Contention
from tuner.record import TrialRecord
from tuner.report.front import choose, pareto_front, ratios
from tuner.report.views import study_view

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "search_spaces" / "emulator-demo.yaml"
_BEATS = re.compile(r"beats the baseline by ([+-]\d+)% \(95% CI ([+-]\d+)\.\.([+-]\d+)%")


def job_copy(source: Path, folder: Path, args: argparse.Namespace) -> Path:
    job = yaml.safe_load(source.read_text())
    job["study"]["name"] = "busy"
    if args.trials is not None:
        job["budget"]["n_trials"] = args.trials
    if args.confirm is not None:
        job["budget"]["confirm"] = args.confirm
    if args.requests is not None:
        job["arrival"]["requests"] = args.requests
        job["arrival"]["warmup_requests"] = min(job["arrival"].get("warmup_requests", 0), args.requests // 4)
    if args.time_scale is not None:
        job["target"].setdefault("emulator", {})["time_scale"] = args.time_scale
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def busy_loops(n: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def stop(loops: list[subprocess.Popen[bytes]]) -> None:
    for p in loops:
        p.kill()
    for p in loops:
        p.wait()


def one_study(source: Path, busy: int, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"busy{busy}-", dir=tmp))
    job = job_copy(source, folder, args)
    loops = busy_loops(busy)
    started = time.monotonic()
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tuner", "tune", str(job)], cwd=ROOT, capture_output=True, text=True, check=False
        )
    finally:
        stop(loops)
    out = {"busy_loops": busy, "wall_s": round(time.monotonic() - started, 1), "exit": done.returncode}
    if done.returncode != 0:
        out["last_line"] = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:]
    db = folder / "busy.db"
    if not db.exists():
        return out
    return out | figures(optuna.load_study(study_name="busy", storage=f"sqlite:///{db}"))


def figures(study: optuna.Study) -> dict[str, Any]:
    view = study_view(study)
    front = pareto_front(view.trials)
    winner = choose(front, "throughput") if front else None
    ratio = ratios(winner, view.baseline).throughput if winner is not None else None
    closing = (study.user_attrs.get("confirm") or {}).get("lines") or []
    beats = next((m for line in closing if (m := _BEATS.search(line))), None)
    contention = [Contention.of(TrialRecord.from_attrs(t.user_attrs).contention) for t in study.trials]
    known = [c for c in contention if c is not None]
    shares = [c.emulator_lag_share for c in known if c.emulator_lag_share is not None]
    others = [c.other_cores for c in known if c.other_cores is not None]
    return {
        "winner": winner.number if winner is not None else None,
        "winner_flags": winner.flags if winner is not None else None,
        "ratio": round(ratio, 3) if ratio is not None else None,
        "gain_ci_pct": [int(beats.group(2)), int(beats.group(3))] if beats else None,
        "closing": closing,
        "max_lag_share": round(max(shares), 4) if shares else None,
        "lagged_trials": sum(c.lagged for c in known),
        "measured_again": sum(c.measured_again for c in known),
        "other_cores_mean": round(statistics.fmean(others), 2) if others else None,
    }


def row(r: dict[str, Any]) -> str:
    ci = r.get("gain_ci_pct")
    return (
        f"{r['busy_loops']:>4} {r.get('winner')!s:>6} {r.get('ratio')!s:>6} "
        f"{(f'{ci[0]:+d}..{ci[1]:+d}%' if ci else '—'):>12} {r.get('max_lag_share')!s:>8} "
        f"{r.get('lagged_trials')!s:>6} {r.get('other_cores_mean')!s:>6} {r['wall_s']:>7}  "
        + (" ".join(r.get("last_line", [])) if r["exit"] else "")
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", type=Path, default=DEMO)
    parser.add_argument("--busy", type=int, default=2, help="busy loops beside the second study of each round")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--trials", type=int, help="the job's budget.n_trials instead of its own")
    parser.add_argument("--confirm", type=int, help="the job's budget.confirm instead of its own")
    parser.add_argument("--requests", type=int, help="the job's arrival.requests instead of its own")
    parser.add_argument("--time-scale", type=float, help="the emulator's time_scale instead of the job's")
    parser.add_argument("--json", type=Path, help="write every study's figures here")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="busy-machine-") as tmp:
        for _ in range(args.rounds):
            for busy in (0, args.busy):
                results.append(one_study(args.job, busy, Path(tmp), args))
    print("busy winner  ratio  gain 95% CI  max lag lagged others  wall s")
    for r in results:
        print(row(r))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
