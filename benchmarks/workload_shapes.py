"""Do the traffic's shape and the objective change which flags win? On the emulator's engine in virtual time
(tuner.twin.simulate: the engine `tuner emulate` serves, its start-up arithmetic, the job's clients, no sockets), every
flag set of `search_spaces/emulator-trace.yaml`'s space is run under

- the shipped Mooncake trace as it is (bursts of 6 req/s over a calm 1 req/s, played at half speed), and
- the same requests (lengths and shared prompt blocks) at Poisson times of the same mean rate (seeded),

and judged by the job's SLOs. Per load, two winners: the throughput objective's (feasible, the most output tok/s;
an open loop that keeps up serves its offered load, so ties within 1% go to the lower TTFT P95, as the Pareto
front's balanced pick would) and the goodput one's at the job's own load (the most requests that each met every
SLO on their own, DistServe's goodput; ties within 1% the same way).

    .venv/bin/python benchmarks/workload_shapes.py            # about a minute of CPU
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.cli.trial_lines import short_flags
from tuner.config import Job, load_job
from tuner.flags import VllmFlags
from tuner.twin.simulate import simulate

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "search_spaces" / "emulator-trace.yaml"
GRID: dict[str, list[Any]] = {
    "max_num_seqs": [8, 16, 32, 64, 128],
    "max_num_batched_tokens": [1024, 2048, 4096],
    "enable_prefix_caching": [True, False],
}
FIXED = {"max_model_len": 4096, "gpu_memory_utilization": 0.9}
TIE = 0.01


@dataclass(frozen=True)
class Point:
    flags: dict[str, Any]
    started: bool
    tok_s: float = 0.0
    ttft_p95_s: float = float("inf")
    goodput: float = 0.0
    good_share: float = 0.0
    feasible: bool = False


def poisson_copy(trace: Path, out: Path, seed: int) -> float:
    """The trace's rows at Poisson times of its own mean rate; returns that rate (requests per second)."""
    rows = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
    span_s = (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000
    rate = (len(rows) - 1) / span_s
    rng = random.Random(seed)
    t = 0.0
    with out.open("w") as f:
        for row in rows:
            f.write(json.dumps({**row, "timestamp": round(t * 1000)}) + "\n")
            t += rng.expovariate(rate)
    return rate


def run(job: Job) -> list[Point]:
    points = []
    for values in itertools.product(*GRID.values()):
        flags = {**FIXED, **dict(zip(GRID, values, strict=True))}
        p = simulate(job, VllmFlags.from_dict(flags))
        summary = p.summary(job)
        if summary is None:
            points.append(Point(flags, False))
            continue
        feasible = all(slo.met(summary) for slo in job.parsed_slos())
        ttft = summary.ttft.p95 if summary.ttft.count else float("inf")
        points.append(
            Point(flags, True, summary.output_throughput, ttft, summary.goodput, summary.good_share, feasible)
        )
    return points


def best(points: list[Point], key: str) -> Point | None:
    """The most of `key` (feasible ones only for throughput), ties within `TIE` to the lowest TTFT P95."""
    pool = [p for p in points if p.started and (p.feasible or key == "goodput")]
    if not pool:
        return None
    top = max(getattr(p, key) for p in pool)
    tied = [p for p in pool if getattr(p, key) >= top * (1 - TIE)]
    return min(tied, key=lambda p: p.ttft_p95_s)


def describe(p: Point | None) -> str:
    if p is None:
        return "none feasible"
    return (
        f"{short_flags(p.flags)}: {p.tok_s:,.0f} tok/s, TTFT p95 {p.ttft_p95_s:.2f} s, goodput {p.goodput:.2f} req/s "
        f"({p.good_share:.0%} good)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=1, help="the Poisson times' seed")
    args = parser.parse_args()
    base = load_job(JOB)
    trace = base.arrival.trace
    assert trace is not None
    with tempfile.TemporaryDirectory() as folder:
        copy = Path(folder) / "poisson.jsonl"
        rate = poisson_copy(trace, copy, args.seed)
        poisson = base.model_copy(update={"arrival": base.arrival.model_copy(update={"trace": copy})})
        # Both played at the job's speed-up: the same mean rate reaches the server.
        played = rate * base.arrival.speedup
        loads = {"the trace's own times": base, f"Poisson at its mean rate ({played:.2f} req/s)": poisson}
        results = {name: run(job) for name, job in loads.items()}
    print(f"{JOB.relative_to(ROOT)}: SLOs {', '.join(base.slos)}; {len(next(iter(results.values())))} flag sets")
    print("| load | feasible | throughput's winner | goodput's winner |")
    print("|---|---|---|---|")
    for name, points in results.items():
        feasible = sum(p.feasible for p in points)
        print(f"| {name} | {feasible} | {describe(best(points, 'tok_s'))} | {describe(best(points, 'goodput'))} |")
    print("\nTTFT p95 by max_num_seqs (2,048 batched tokens, prefix caching on):")
    for name, points in results.items():
        row = {
            p.flags["max_num_seqs"]: p.ttft_p95_s
            for p in points
            if p.flags["max_num_batched_tokens"] == 2048 and p.flags["enable_prefix_caching"]
        }
        print(f"  {name}: " + ", ".join(f"{seqs}: {ttft:.2f} s" for seqs, ttft in row.items()))
    for name, points in results.items():
        ranked = sorted((p for p in points if p.started), key=lambda p: -p.goodput)
        shares = statistics.median(p.good_share for p in ranked)
        print(f"\n{name}: median good share {shares:.0%}; by goodput:")
        for p in ranked[:8]:
            print(f"  {'ok ' if p.feasible else 'MISS'} {describe(p)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
