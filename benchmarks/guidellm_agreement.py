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

With `--capture`, each measured run is also captured on loopback (tcpdump, the mock's port, nanosecond kernel
timestamps) and read back by `wire_capture.py` (dpkt): per request, its first byte on the wire and each content
event's, matched to each client's own per-request records by the prompt (unique in a run; tuner's records name
their prompt by index in the workload's seeded order, GuideLLM's carry the request body). Beside each client's
TTFT/ITL it prints the wire's, the client's send lag (its clock start to its first byte on the wire: tuner's
start_s placed on the wall clock by the result's origin_unix_s, GuideLLM's request_start) and receive lag (content
on the wire to the client's timestamp of it), and every run's CPU time: the client's (its whole process tree,
start-up included), the mock's, tcpdump's.

GuideLLM stays out of the project's dependencies: it is installed here into its own venv, cached under
~/.cache/tuner (about 6 GB: it brings torch); with `--capture`, dpkt goes there too. tcpdump: apt-get install tcpdump.

    .venv/bin/python benchmarks/guidellm_agreement.py                      # concurrency 1, 8, 64; 3 repeats
    .venv/bin/python benchmarks/guidellm_agreement.py --concurrency 8 --repeats 5
    .venv/bin/python benchmarks/guidellm_agreement.py --capture --out runs.json    # and the wire beside (root)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.load import Workload

ROOT = Path(__file__).resolve().parent.parent
GUIDELLM = "0.8.1"
DPKT = "1.9.8"
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


@dataclass
class Req:
    """One request as a client recorded it; `start`/`first` in Unix seconds, to set beside the wire's."""

    prompt: str
    ttft_ms: float
    itl_ms: float
    start: float
    first: float


def _guidellm(exe: Path, base: str, data: Path, users: int, requests: int, out: Path) -> list[Req]:
    cmd = [
        str(exe), "run", "--backend", f"kind=openai_http,target={base},model={MODEL}",
        "--profile", f"kind=concurrent,streams={users}", "--constraint", f"kind=max_requests,count={requests}",
        "--data", f"kind=json_file,path={data}", "--output", f"kind=json,path={out}", "--disable-console",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    reqs = _guidellm_requests(json.loads(out.read_text()))
    if len(reqs) != requests:
        raise SystemExit(f"guidellm: {len(reqs)} of {requests} requests succeeded")
    return reqs


def _guidellm_requests(report: dict[str, Any]) -> list[Req]:
    """Every successful request, from the report's per-request statistics (its timings are Unix seconds)."""
    out = []
    for r in report["benchmarks"][0]["requests"]["successful"]:
        t = r["info"]["timings"]
        body = json.loads(r["request_args"])["body"]
        out.append(
            Req(
                prompt=_prompt_of(body),
                ttft_ms=r["time_to_first_token_ms"],
                itl_ms=r["inter_token_latency_ms"],
                start=t["request_start"],
                first=t["first_token_iteration"],
            )
        )
    return out


def _prompt_of(body: dict[str, Any]) -> str:
    content = body["messages"][0]["content"]  # GuideLLM sends a list of text parts, tuner a string
    return "".join(p["text"] for p in content) if isinstance(content, list) else str(content)


def _tuner(base: str, data: Path, users: int, requests: int, out: Path) -> list[Req]:
    cmd = [
        sys.executable, "-m", "tuner", "bench", "--url", base, "--model", MODEL, "--api", "chat",
        "--dataset", str(data), "--concurrency", str(users), "--requests", str(requests),
        "--no-server-metrics", "--json", str(out),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "COLUMNS": "160"})
    payload = json.loads(out.read_text())
    result = payload["result"]
    # Request i carried the workload's i-th prompt (its own seeded order): the key to the wire's requests.
    prompts = Workload.model_validate(payload["workload"]).prompts()
    texts = [str(next(prompts).prompt) for _ in range(len(result["records"]))]
    origin = result["origin_unix_s"]
    reqs = []
    for r in result["records"]:
        if not r["ok"] or r["warmup"]:
            continue
        start = origin + r["start_s"]
        reqs.append(
            Req(
                prompt=texts[r["index"]],
                ttft_ms=r["ttft_s"] * 1000,
                # GuideLLM's inter-token latency: (last chunk - first chunk) / (tokens - 1), i.e. tuner's TPOT.
                itl_ms=sum(r["itl_s"]) * 1000 / len(r["itl_s"]),
                start=start,
                first=start + r["ttft_s"],
            )
        )
    if len(reqs) != requests:
        raise SystemExit(f"tuner bench: {len(reqs)} of {requests} requests succeeded")
    return reqs


def _wait_quiet(limit: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) for the 1-minute load average to fall below `limit`; the load measured at."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


class Capture:
    """tcpdump on loopback for one run: the mock's port, whole packets, nanosecond timestamps (kernel, wall clock)."""

    def __init__(self, port: int, path: Path) -> None:
        self.port = port
        self.path = path
        cmd = [
            "tcpdump", "-i", "lo", "-s", "0", "-B", "32768", "--time-stamp-precision=nano", "-Z", "root",
            "-w", str(path), "tcp", "port", str(port),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()  # "listening on lo, ...": the socket is open
        if b"listening on" not in line:
            self.proc.kill()
            raise SystemExit(f"tcpdump did not start: {line.decode(errors='replace').strip()}")

    def stop(self) -> dict[str, float]:
        """Stop it once the last packets are written; its CPU time and what the kernel dropped."""
        # libpcap hands a ring block over when it fills or after a 1 s timeout: wait for the last one.
        time.sleep(1.5)
        cpu = _cpu_s(self.proc.pid)
        self.proc.send_signal(signal.SIGINT)
        _, err = self.proc.communicate(timeout=30)
        found = re.search(rb"(\d+) packets dropped by kernel", err)
        return {"capture_cpu_s": cpu, "dropped": float(found.group(1)) if found else -1.0}

    def requests(self, parser: Path) -> list[dict[str, Any]]:
        """The capture's requests, read by wire_capture.py with the Python that has dpkt."""
        cmd = [str(parser), str(Path(__file__).with_name("wire_capture.py")), str(self.path), "--port", str(self.port)]
        wire: list[dict[str, Any]] = json.loads(subprocess.run(cmd, check=True, capture_output=True).stdout)
        return wire


def _tcpdump_ready() -> None:
    if shutil.which("tcpdump") is None:
        raise SystemExit("--capture needs tcpdump (Debian: apt-get install tcpdump) and root")
    py = VENV / "bin" / "python"
    if subprocess.run([str(py), "-c", "import dpkt"], capture_output=True).returncode != 0:
        print(f"installing dpkt=={DPKT} into {VENV}", flush=True)
        subprocess.run([str(py), "-m", "pip", "install", "-q", f"dpkt=={DPKT}"], check=True)


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _join(reqs: list[Req], wire: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per request, by its prompt (unique in a run): the client's reading beside the wire's.

    wire TTFT: the request's first byte on the wire to the first content event's last byte; wire ITL: (last content
    event - first) / (events - 1). send lag: the client's clock start to its first byte on the wire; receive lag:
    the first content on the wire to the client's timestamp of it. body: the request's first to last byte.
    """
    by_prompt = {w["prompt"]: w for w in wire}
    if len(by_prompt) != len(wire):
        raise SystemExit("the capture holds a prompt twice: the requests cannot be told apart")
    keys = ("ttft", "itl", "wire_ttft", "wire_itl", "send", "receive", "body", "d_ttft")
    out: dict[str, list[float]] = {k: [] for k in keys}
    found = [r for r in reqs if r.prompt in by_prompt and len(by_prompt[r.prompt]["content_ns"]) >= 2]
    if len(found) < 0.95 * len(reqs):  # one the capture holds torn (a lost packet) is left out and counted
        raise SystemExit(f"only {len(found)} of the client's {len(reqs)} requests are whole in the capture")
    for r in found:
        w = by_prompt[r.prompt]
        c = w["content_ns"]
        out["ttft"].append(r.ttft_ms)
        out["itl"].append(r.itl_ms)
        out["wire_ttft"].append((c[0] - w["sent_ns"]) / 1e6)
        out["wire_itl"].append((c[-1] - c[0]) / 1e6 / (len(c) - 1))
        out["send"].append((w["sent_ns"] / 1e9 - r.start) * 1000)
        out["receive"].append((r.first - c[0] / 1e9) * 1000)
        out["body"].append((w["sent_end_ns"] - w["sent_ns"]) / 1e6)
        out["d_ttft"].append(r.ttft_ms - out["wire_ttft"][-1])
    out["conns"] = [float(len({w["conn"] for w in wire}))]
    out["missed"] = [float(len(reqs) - len(found))]
    return out


def _run(tool: str, exe: Path, base: str, data: Path, users: int, n: int, out: Path) -> list[Req]:
    if tool == "guidellm":
        return _guidellm(exe, base, data, users, n, out)
    return _tuner(base, data, users, n, out)


def _measure(tool: str, users: int, n: int, ctx: dict[str, Any], out: Path) -> dict[str, float]:
    """One run of one client, with its CPU time, the mock's, and (with a capture) the wire's figures."""
    cap = Capture(ctx["port"], out.with_suffix(".pcap")) if ctx["capture"] else None
    cpu0, mock0 = _children_cpu_s(), _cpu_s(ctx["mock_pid"])
    try:
        reqs = _run(tool, ctx["exe"], ctx["base"], ctx["data"], users, n, out)
    finally:
        cpu, mock = _children_cpu_s() - cpu0, _cpu_s(ctx["mock_pid"]) - mock0
        stats = cap.stop() if cap is not None else {}
    m = _figures([r.ttft_ms for r in reqs], [r.itl_ms for r in reqs])
    m.update(stats, cpu_s=cpu, mock_cpu_s=mock)
    if cap is not None:
        try:
            j = _join(reqs, cap.requests(VENV / "bin" / "python"))
        except SystemExit as e:
            kept = Path(tempfile.gettempdir()) / cap.path.name
            shutil.copy(cap.path, kept)
            raise SystemExit(f"{tool}, {users} users: {e} (the capture: {kept})") from None
        # Client beside wire over the same requests: those the capture holds whole.
        m.update({f"m_{k}": v for k, v in _figures(j["ttft"], j["itl"]).items()})
        m.update({f"w_{k}": v for k, v in _figures(j["wire_ttft"], j["wire_itl"]).items()})
        for key in ("send", "receive", "d_ttft", "body"):
            m[f"{key}_p50"], m[f"{key}_p95"] = _percentile(j[key], 0.5), _percentile(j[key], 0.95)
        m["conns"], m["missed"] = j["conns"][0], j["missed"][0]
        cap.path.unlink()
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--requests", type=int, nargs="+", help="per concurrency (default: 256 each)")
    ap.add_argument("--ttft-ms", type=float, default=80)
    ap.add_argument("--itl-ms", type=float, default=12)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--prompt-words", type=int, default=128)
    ap.add_argument("--capture", action="store_true", help="capture each run on loopback and set the wire beside it")
    ap.add_argument("--out", type=Path, help="write every run's figures here (JSON)")
    ap.add_argument("--quiet-load", type=float, default=1.5, help="wait before each run for a lower load average")
    ap.add_argument("--max-wait", type=float, default=600, help="seconds to wait for it at most; then run anyway")
    args = ap.parse_args()
    counts = args.requests or [256] * len(args.concurrency)
    exe = _guidellm_bin()
    if args.capture:
        _tcpdump_ready()
    port = _free_port()
    rows: list[tuple[int, int, str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="guidellm-agree-") as tmp_s:
        tmp = Path(tmp_s)
        data = tmp / "data.jsonl"
        _dataset(data, max(counts), args.prompt_words, args.output_tokens)
        proc = _start_mock(exe, port, args, tmp / "mock.log")
        ctx = {"exe": exe, "base": f"http://127.0.0.1:{port}", "data": data, "port": port, "mock_pid": proc.pid}
        try:
            # One discarded run of each warms the server and the clients' imports.
            ctx["capture"] = False
            _measure("guidellm", 8, 16, ctx, tmp / "warm.json")
            _measure("tuner", 8, 16, ctx, tmp / "warm-tuner.json")
            ctx["capture"] = args.capture
            for users, n in zip(args.concurrency, counts, strict=True):
                for i in range(args.repeats):
                    for tool in TOOLS if i % 2 == 0 else TOOLS[::-1]:
                        load = _wait_quiet(args.quiet_load, args.max_wait)
                        m = _measure(tool, users, n, ctx, tmp / f"{tool}-{users}-{i}.json")
                        m["load"] = load
                        rows.append((users, i, tool, m))
                        _progress(users, i, tool, m)
        finally:
            _stop(proc)
    if args.out is not None:
        args.out.write_text(json.dumps([{"users": u, "repeat": i, "tool": t, **m} for u, i, t, m in rows], indent=1))
    _table(rows, args, counts)
    if args.capture:
        _wire_table(rows, args)


def _progress(users: int, i: int, tool: str, m: dict[str, float]) -> None:
    line = (
        f"concurrency {users:3} run {i + 1} {tool:8}  TTFT p50 {m['ttft_p50']:7.2f} p95 {m['ttft_p95']:7.2f} ms  "
        f"ITL p50 {m['itl_p50']:6.2f} p95 {m['itl_p95']:6.2f} ms  CPU {m['cpu_s']:5.1f} s  load {m['load']:.2f}"
    )
    if "w_ttft_p50" in m:
        line += (
            f"\n{'':27}wire TTFT p50 {m['w_ttft_p50']:7.2f} p95 {m['w_ttft_p95']:7.2f} ms  ITL p50 "
            f"{m['w_itl_p50']:6.2f} p95 {m['w_itl_p95']:6.2f} ms  send {m['send_p50']:.2f} receive "
            f"{m['receive_p50']:.2f}/{m['receive_p95']:.2f} ms  {m['conns']:.0f} conns  dropped "
            f"{m['dropped']:.0f}  missed {m['missed']:.0f}"
        )
    print(line, flush=True)


def _med(rows: list[tuple[int, int, str, dict[str, float]]], users: int, tool: str, key: str) -> float:
    return statistics.median(m[key] for u, _, t, m in rows if u == users and t == tool)


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
            g, t = _med(rows, users, "guidellm", key), _med(rows, users, "tuner", key)
            ratio = statistics.median(by[(i, "tuner")] / by[(i, "guidellm")] for i in range(args.repeats))
            print(f"| {users} | {n} | {LABELS[key]} | {g:.2f} | {t:.2f} | {ratio:.3f} |")


def _wire_table(rows: list[tuple[int, int, str, dict[str, float]]], args: argparse.Namespace) -> None:
    """Each client beside the wire: what it read, what the wire shows, the difference, where it lies, its CPU."""
    print(
        "\n| concurrency | client | TTFT p50 client / wire | TTFT p95 client / wire | ITL p50 client / wire "
        "| ITL p95 client / wire | client - wire TTFT, a request: p50 / p95 | send lag p50 / p95 "
        "| receive lag p50 / p95 | request on the wire p50 | connections | client CPU (s) | mock CPU (s) |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for users in args.concurrency:
        for tool in TOOLS:

            def f(key: str, u: int = users, t: str = tool) -> float:
                return _med(rows, u, t, key)

            print(
                f"| {users} | {tool} | {f('m_ttft_p50'):.2f} / {f('w_ttft_p50'):.2f} | {f('m_ttft_p95'):.2f} / "
                f"{f('w_ttft_p95'):.2f} | {f('m_itl_p50'):.2f} / {f('w_itl_p50'):.2f} | {f('m_itl_p95'):.2f} / "
                f"{f('w_itl_p95'):.2f} | {f('d_ttft_p50'):.2f} / {f('d_ttft_p95'):.2f} | {f('send_p50'):.2f} / "
                f"{f('send_p95'):.2f} | {f('receive_p50'):.2f} / {f('receive_p95'):.2f} "
                f"| {f('body_p50'):.2f} | {f('conns'):.0f} | {f('cpu_s'):.1f} | {f('mock_cpu_s'):.1f} |"
            )
    caps = [m["capture_cpu_s"] for *_, m in rows]
    dropped = sum(m["dropped"] for *_, m in rows)
    missed = sum(m["missed"] for *_, m in rows)
    print(
        f"\ntcpdump CPU a run {min(caps):.2f}-{max(caps):.2f} s; packets dropped by the kernel: {dropped:.0f}; "
        f"requests not whole in the capture (left out of this table): {missed:.0f}"
    )


if __name__ == "__main__":
    main()
