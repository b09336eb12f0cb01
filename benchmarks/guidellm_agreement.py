"""Agreement with GuideLLM's client: TTFT and ITL read by `guidellm run` and by `tuner bench` on one mock server.

GuideLLM's own mock server (`guidellm mock-server`: a Sanic app that sleeps `--ttft-ms` before the first chunk and
`--itl-ms` between chunks, `--output-tokens` chunks) is started here; on it, back to back with the order rotating
every repeat, GuideLLM's client and `tuner bench` send the same requests: one JSONL dataset both read (prompts of
`--prompt-words` made-up words, 64 output tokens), chat API, closed loop at each `--concurrency`. The server
answers after fixed sleeps, so what a client reads beyond them is the client's own timing (and the mock's own
work per request, the same for both clients).

Compared like for like: TTFT (request start to the first content chunk; GuideLLM starts its clock when httpcore
begins writing the request headers, tuner at the same moment or when a new connection is begun), and GuideLLM's
per-request "inter-token latency" ((last chunk - first chunk) / (tokens - 1)), which is tuner's TPOT. Medians and
P95s over the requests of a run; their medians over the repeats; ratios tuner / GuideLLM per repeat, then their
median.

GuideLLM stays out of the project's dependencies: it is installed here into its own venv, cached under
~/.cache/tuner (about 6 GB: it brings torch).

    .venv/bin/python benchmarks/guidellm_agreement.py                      # concurrency 1, 8, 64; 3 repeats
    .venv/bin/python benchmarks/guidellm_agreement.py --concurrency 8 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
GUIDELLM = "0.8.1"
VENV = Path.home() / ".cache" / "tuner" / f"guidellm-{GUIDELLM}-py3.11"
MODEL = "mock"
KEYS = ("ttft_p50", "ttft_p95", "itl_p50", "itl_p95")
LABELS = {"ttft_p50": "TTFT p50", "ttft_p95": "TTFT p95", "itl_p50": "ITL p50", "itl_p95": "ITL p95"}
TOOLS = ("guidellm", "tuner")


def _guidellm_bin() -> Path:
    exe = VENV / "bin" / "guidellm"
    if not exe.exists():
        print(f"installing guidellm=={GUIDELLM} into {VENV} (once; a few minutes)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        pip = [str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", f"guidellm=={GUIDELLM}"]
        subprocess.run(pip, check=True)
    return exe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_mock(exe: Path, port: int, args: argparse.Namespace, log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        str(exe), "mock-server", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
        "--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), "--output-tokens", str(args.output_tokens),
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the mock server exited with {proc.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    _stop(proc)
    raise SystemExit(f"the mock server was not ready within 120 s; its log: {log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _dataset(path: Path, n: int, words: int, output_tokens: int) -> None:
    rng = random.Random(0)
    vocab = [f"w{i}" for i in range(2000)]
    with open(path, "w") as f:
        for _ in range(n):
            prompt = " ".join(rng.choice(vocab) for _ in range(words))
            # `output_len` for tuner, `output_tokens_count` for GuideLLM: both send it as max_tokens.
            row = {"prompt": prompt, "output_len": output_tokens, "output_tokens_count": output_tokens}
            f.write(json.dumps(row) + "\n")


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _figures(ttft_ms: list[float], itl_ms: list[float]) -> dict[str, float]:
    return {
        "ttft_p50": _percentile(ttft_ms, 0.5),
        "ttft_p95": _percentile(ttft_ms, 0.95),
        "itl_p50": _percentile(itl_ms, 0.5),
        "itl_p95": _percentile(itl_ms, 0.95),
    }


def _guidellm(exe: Path, base: str, data: Path, users: int, requests: int, out: Path) -> dict[str, float]:
    cmd = [
        str(exe), "run", "--backend", f"kind=openai_http,target={base},model={MODEL}",
        "--profile", f"kind=concurrent,streams={users}", "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={out}", "--disable-console",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    ttft, itl = _guidellm_requests(json.loads(out.read_text()))
    if len(ttft) != requests:
        raise SystemExit(f"guidellm: {len(ttft)} of {requests} requests succeeded")
    return _figures(ttft, itl)


def _guidellm_requests(report: dict[str, Any]) -> tuple[list[float], list[float]]:
    """Every successful request's TTFT and ITL (ms), from the report's per-request statistics."""
    bench = report["benchmarks"][0]
    reqs = bench["requests"]["successful"]
    return [r["time_to_first_token_ms"] for r in reqs], [r["inter_token_latency_ms"] for r in reqs]


def _tuner(base: str, data: Path, users: int, requests: int, out: Path) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "tuner", "bench", "--url", base, "--model", MODEL, "--api", "chat",
        "--dataset", str(data), "--concurrency", str(users), "--requests", str(requests),
        "--no-server-metrics", "--json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "160"})
    records = [r for r in json.loads(out.read_text())["result"]["records"] if r["ok"] and not r["warmup"]]
    if len(records) != requests:
        raise SystemExit(f"tuner bench: {len(records)} of {requests} requests succeeded")
    ttft = [r["ttft_s"] * 1000 for r in records]
    # GuideLLM's inter-token latency of a request: (last chunk - first chunk) / (tokens - 1), i.e. tuner's TPOT.
    itl = [sum(r["itl_s"]) * 1000 / len(r["itl_s"]) for r in records]
    return _figures(ttft, itl)


def _wait_quiet(limit: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) for the 1-minute load average to fall below `limit`; the load measured at."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--requests", type=int, nargs="+", help="per concurrency (default: 32 at 1, else 8 x users)")
    ap.add_argument("--ttft-ms", type=float, default=80)
    ap.add_argument("--itl-ms", type=float, default=12)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=128)
    ap.add_argument("--quiet-load", type=float, default=1.5, help="wait before each run for a lower load average")
    ap.add_argument("--max-wait", type=float, default=600, help="seconds to wait for it at most; then run anyway")
    args = ap.parse_args()
    counts = args.requests or [32 if c == 1 else min(8 * c, 256) for c in args.concurrency]
    exe = _guidellm_bin()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    rows: list[tuple[int, int, str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="guidellm-agree-") as tmp_s:
        tmp = Path(tmp_s)
        data = tmp / "data.jsonl"
        _dataset(data, max(counts), args.prompt_words, args.output_tokens)
        proc = _start_mock(exe, port, args, tmp / "mock.log")
        try:
            # One discarded run of each warms the server and the clients' imports.
            _guidellm(exe, base, data, 8, 16, tmp / "warm.json")
            _tuner(base, data, 8, 16, tmp / "warm-tuner.json")
            for users, n in zip(args.concurrency, counts, strict=True):
                for i in range(args.repeats):
                    order = TOOLS if i % 2 == 0 else TOOLS[::-1]
                    for tool in order:
                        load = _wait_quiet(args.quiet_load, args.max_wait)
                        out = tmp / f"{tool}-{users}-{i}.json"
                        if tool == "guidellm":
                            m = _guidellm(exe, base, data, users, n, out)
                        else:
                            m = _tuner(base, data, users, n, out)
                        m["load"] = load
                        rows.append((users, i, tool, m))
                        print(
                            f"concurrency {users:3} run {i + 1} {tool:8}  TTFT p50 {m['ttft_p50']:7.2f} p95 "
                            f"{m['ttft_p95']:7.2f} ms  ITL p50 {m['itl_p50']:6.2f} p95 {m['itl_p95']:6.2f} ms  "
                            f"load {load:.2f}",
                            flush=True,
                        )
        finally:
            _stop(proc)
    _table(rows, args, counts)


def _table(rows: list[tuple[int, int, str, dict[str, float]]], args: argparse.Namespace, counts: list[int]) -> None:
    loads = [m["load"] for *_, m in rows]
    print(
        f"\nmock: TTFT {args.ttft_ms:g} ms, ITL {args.itl_ms:g} ms, {args.output_tokens} tokens; chat, "
        f"{args.prompt_words}-word prompts; {args.repeats} repeats, order alternating; load average "
        f"{min(loads):.2f}-{max(loads):.2f} at the runs' starts\n"
    )
    print("| concurrency | requests | figure | GuideLLM (ms) | tuner bench (ms) | tuner / GuideLLM |")
    print("|---:|---:|---|---:|---:|---:|")
    for users, n in zip(args.concurrency, counts, strict=True):
        for key in KEYS:
            by = {(i, t): m[key] for u, i, t, m in rows if u == users}
            med = {t: statistics.median(v for (_, tt), v in by.items() if tt == t) for t in TOOLS}
            ratio = statistics.median(by[(i, "tuner")] / by[(i, "guidellm")] for i in range(args.repeats))
            print(f"| {users} | {n} | {LABELS[key]} | {med['guidellm']:.2f} | {med['tuner']:.2f} | {ratio:.3f} |")


if __name__ == "__main__":
    main()
