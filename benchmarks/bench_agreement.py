"""Agreement with an established load tester: the same workload against the same server, measured by
`tuner bench` and by NVIDIA AIPerf, side by side (throughput and P95s, difference in percent).

The server is the emulator as a process at time scale 1 (real-time figures for both tools), prefix caching off
(both tools send the same prompts: the second would find them cached). The workload is
one JSONL file both tools read (AIPerf's single_turn format: {"text", "output_length"}): prompts of 512
one-token words, 128 output tokens pinned with ignore_eos + min_tokens, token counts from the server's usage.
AIPerf needs a tokenizer even then; a local word-level one is built, so nothing is downloaded.

AIPerf stays out of the project's dependencies; install it in its own venv first:

    python -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python benchmarks/bench_agreement.py --aiperf /tmp/aiperf-venv/bin/aiperf
    .venv/bin/python benchmarks/bench_agreement.py --repeats 3 --concurrency 16 --requests 200
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
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tuner.load.workload import Workload  # noqa: E402

_TOKENIZER_SCRIPT = """
import sys
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
words = sys.argv[2].split()
vocab = {"[UNK]": 0, "</s>": 1}
for w in words:
    vocab.setdefault(w, len(vocab))
tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok.decoder = decoders.WordPiece(prefix="##")
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="</s>").save_pretrained(sys.argv[1])
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the emulator exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/v1/models", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the emulator did not become ready")


def _tuner(base: str, dataset: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [
        sys.executable, "-m", "tuner", "bench", "--url", base, "--model", "llama-3.1-8b", "--dataset", str(dataset),
        "--concurrency", str(args.concurrency), "--requests", str(args.requests), "--json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "160"})
    s = json.loads(out.read_text())["result"]["summary"]
    return {
        "request_throughput": s["request_throughput"],
        "output_throughput": s["output_throughput"],
        "ttft_p95": s["ttft"]["p95"] * 1000,
        "tpot_p95": s["tpot"]["p95"] * 1000,
        "e2e_p95": s["e2e"]["p95"] * 1000,
        "e2e_p50": s["e2e"]["p50"] * 1000,
        "output_tokens_mean": s["completion_tokens"] / max(1, s["requests_succeeded"]),
    }


def _aiperf(base: str, dataset: Path, tokenizer: Path, args: argparse.Namespace, out: Path) -> dict[str, float]:
    cmd = [
        args.aiperf, "profile", "--model", "llama-3.1-8b", "--url", base, "--endpoint-type", "completions",
        "--streaming", "--input-file", str(dataset), "--custom-dataset-type", "single_turn",
        "--concurrency", str(args.concurrency), "--request-count", str(args.requests), "--use-server-token-count",
        "--tokenizer", str(tokenizer), "--extra-inputs", "ignore_eos:true", "--extra-inputs", "min_tokens:128",
        "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    d: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "request_throughput": d["request_throughput"]["avg"],
        "output_throughput": d["output_token_throughput"]["avg"],
        "ttft_p95": d["time_to_first_token"]["p95"],
        # AIPerf's inter_token_latency is per request (e2e - ttft) / (tokens - 1): vLLM's TPOT.
        "tpot_p95": d["inter_token_latency"]["p95"],
        "e2e_p95": d["request_latency"]["p95"],
        "e2e_p50": d["request_latency"]["p50"],
        "output_tokens_mean": d["output_sequence_length"]["avg"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--aiperf", default="/tmp/aiperf-venv/bin/aiperf", help="the aiperf executable")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--gpu", default="h100-80gb")
    args = ap.parse_args()
    aiperf_python = str(Path(args.aiperf).with_name("python"))

    with tempfile.TemporaryDirectory(prefix="bench-agree-") as tmp_s:
        tmp = Path(tmp_s)
        # tuner's own synthetic chat prompts (one-token words), so the tokenizer's vocabulary is their words.
        synthetic = Workload(api="chat", input_len=512, output_len=128, seed=7).prompts()
        texts = [str(next(synthetic).prompt) for _ in range(args.requests)]
        dataset = tmp / "prompts.jsonl"
        with dataset.open("w") as f:
            for text in texts:
                f.write(json.dumps({"text": text, "output_length": 128}) + "\n")
        words = " ".join(sorted({w for text in texts for w in text.split()}))
        tokenizer = tmp / "tokenizer"
        subprocess.run([aiperf_python, "-c", _TOKENIZER_SCRIPT, str(tokenizer), words], check=True,
                       stderr=subprocess.DEVNULL)  # fmt: skip

        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        emu = subprocess.Popen(
            [sys.executable, "-m", "tuner.emulator", "--model", "llama-3.1-8b", "--gpu", args.gpu,
             "--max-model-len", "8192", "--host", "127.0.0.1", "--port", str(port), "--time-scale", "1",
             "--seed", "0", "--no-enable-prefix-caching"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_ready(base, emu)
            runs: dict[str, list[dict[str, float]]] = {"tuner": [], "aiperf": []}
            for rep in range(args.repeats):
                # Alternate which tool goes first, so a drift of the machine does not favour one.
                order = ["tuner", "aiperf"] if rep % 2 == 0 else ["aiperf", "tuner"]
                for tool in order:
                    if tool == "tuner":
                        r = _tuner(base, dataset, args, tmp / f"tuner-{rep}.json")
                    else:
                        r = _aiperf(base, dataset, tokenizer, args, tmp / f"aiperf-{rep}")
                    runs[tool].append(r)
                    print(f"repeat {rep + 1} {tool}: " + ", ".join(f"{k} {v:,.2f}" for k, v in r.items()), flush=True)
        finally:
            emu.terminate()
            emu.wait(10)

    print()
    print(f"emulator llama-3.1-8b on {args.gpu}, time scale 1; {args.concurrency} users, {args.requests} requests, "
          f"512 in / 128 out; medians of {args.repeats} runs")  # fmt: skip
    print("| figure | tuner bench | AIPerf | difference |")
    print("|---|---|---|---|")
    labels = {
        "request_throughput": "request throughput (req/s)",
        "output_throughput": "output throughput (tok/s)",
        "ttft_p95": "TTFT P95 (ms)",
        "tpot_p95": "TPOT P95 (ms)",
        "e2e_p95": "E2E P95 (ms)",
        "e2e_p50": "E2E P50 (ms)",
        "output_tokens_mean": "output tokens per request",
    }
    for key, label in labels.items():
        ours = statistics.median(r[key] for r in runs["tuner"])
        theirs = statistics.median(r[key] for r in runs["aiperf"])
        diff = (ours - theirs) / theirs * 100 if theirs else float("nan")
        print(f"| {label} | {ours:,.2f} | {theirs:,.2f} | {diff:+.1f}% |")


if __name__ == "__main__":
    main()
