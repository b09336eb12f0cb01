"""Real vLLM (the pinned CPU build, the tiny local model): how much one flag set's figures move between starts, with
and without the CPU plan (`target.cpu_affinity`: vLLM's worker on cores of its own), and what the /metrics scrape
costs the server it observes.

The same flags (vLLM's CPU defaults, the grid's load of benchmarks/real_vllm_grid.py) are started `--starts` times
per setting, the settings alternated (off, auto, off, auto, ...) so the machine's drift falls on both alike; on each
start the load runs `--loads` times, alternately with tuner's /metrics scrape (as every trial runs) and without it.

Per setting: the median relative difference between two starts (each start's median over its scraped loads) in
output tok/s, TTFT p50/p95 and TPOT p50, and the median spread within a start. The observer effect: the median over
starts of (throughput without the scrape / with it - 1), loads paired in the order they ran.

    eval "$(scripts/real-vllm)"
    VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python benchmarks/real_vllm_noise.py --json noise.json   # ~12 min

Measure alone: nothing else may run on the machine meanwhile; the load average before and after is in the output.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from real_vllm_grid import _own_port, job_data

import tuner.launch.process
from tuner.config import Job, parse_job
from tuner.launch.factory import build_launcher
from tuner.launch.pinning import keep_to
from tuner.load import run_load
from tuner.scoring import LoadSummary

SETTINGS = ("off", "auto")
FIGURES = {
    "output_tok_s": lambda s: float(s.output_throughput),
    "ttft_p50_ms": lambda s: s.ttft.p50 * 1000,
    "ttft_p95_ms": lambda s: s.ttft.p95 * 1000,
    "tpot_p50_ms": lambda s: s.tpot.p50 * 1000,
}


def job_for(setting: str) -> Job:
    vllm_python = os.environ.get("TUNER_TEST_VLLM_PYTHON")
    model = os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not vllm_python or not model or "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        raise SystemExit('set up first: eval "$(scripts/real-vllm)"; and VLLM_CPU_KVCACHE_SPACE=1')
    data = job_data("grid", vllm_python=vllm_python, model=model)
    data["target"]["cpu_affinity"] = setting
    return parse_job(data, where=f"noise job, cpu_affinity {setting}")


@contextlib.contextmanager
def client_cores(server: Any) -> Iterator[None]:
    if server.cpu_plan is None:
        yield
        return
    with keep_to(server.cpu_plan.cores("client")):
        yield


async def one_start(job: Job, loads: int) -> dict[str, Any]:
    flags = job.search_space().baseline()
    launcher = build_launcher(job)
    runs: list[dict[str, Any]] = []
    async with launcher.start(flags) as server:
        plan = server.cpu_plan.describe() if server.cpu_plan is not None else "none"
        for i in range(loads):
            scrape = i % 2 == 0
            # Each load its own prompts: the same ones again would be served from vLLM's prefix cache (on by
            # default), which made a later load on one server read up to 1.5x the first (measured 2026-12-05).
            workload = job.workload.model_copy(update={"seed": job.workload.seed + i})
            with client_cores(server):
                result = await run_load(
                    server.base_url,
                    server.model,
                    workload,
                    job.arrival,
                    slos=job.parsed_slos(),
                    request_timeout_s=job.request_timeout,
                    scrape_metrics=scrape,
                )
            runs.append({"scrape": scrape, **_figures(result.summary)})
    return {"plan": plan, "runs": runs}


def _figures(s: LoadSummary) -> dict[str, float]:
    return {name: round(read(s), 3) for name, read in FIGURES.items()}


def _rel(a: float, b: float) -> float:
    return abs(a - b) / ((a + b) / 2) if a + b else 0.0


def summarise(starts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FIGURES:
        per_start = [statistics.median(r[name] for r in s["runs"] if r["scrape"]) for s in starts]
        between = [_rel(a, b) for a, b in itertools.combinations(per_start, 2)]
        within = [_rel(max(v), min(v)) for s in starts if len(v := [r[name] for r in s["runs"] if r["scrape"]]) > 1]
        out[name] = {
            "per_start": [round(x, 2) for x in per_start],
            "between_starts_median": round(statistics.median(between), 4) if between else None,
            "within_start_median": round(statistics.median(within), 4) if within else None,
        }
    effects = []
    for s in starts:
        for on, off in itertools.pairwise(s["runs"]):
            if on["scrape"] and not off["scrape"] and on["output_tok_s"]:
                effects.append(off["output_tok_s"] / on["output_tok_s"] - 1)
    out["scrape_cost_median"] = round(statistics.median(effects), 4) if effects else None
    out["scrape_pairs"] = len(effects)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=3, help="starts per setting")
    parser.add_argument("--loads", type=int, default=4, help="loads per start, alternately with and without scrape")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--settings", default=",".join(SETTINGS), help="cpu_affinity settings, e.g. off")
    args = parser.parse_args()
    settings = [s for s in args.settings.split(",") if s]
    if not set(settings) <= set(SETTINGS):
        parser.error(f"--settings: choose from {', '.join(SETTINGS)}")
    setattr(tuner.launch.process, "free_port", _own_port)  # noqa: B010  (the grid benchmark's own ports)
    results: dict[str, Any] = {"load_average_before": [round(x, 2) for x in os.getloadavg()]}
    starts: dict[str, list[dict[str, Any]]] = {s: [] for s in settings}
    for i in range(args.starts):
        for setting in settings:
            start = asyncio.run(one_start(job_for(setting), args.loads))
            starts[setting].append(start)
            tok_s = [r["output_tok_s"] for r in start["runs"]]
            print(f"start {i + 1} cpu_affinity {setting} ({start['plan']}): {tok_s} tok/s", file=sys.stderr)
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    for setting in settings:
        results[setting] = {"starts": starts[setting], "summary": summarise(starts[setting])}
    print(json.dumps({s: results[s]["summary"] for s in settings}, indent=1))
    print(f"load average before {results['load_average_before']}, after {results['load_average_after']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
