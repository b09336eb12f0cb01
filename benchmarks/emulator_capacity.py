"""How many streamed tokens/s the emulator serves in real time on one core, with its step timing on the model.

For each point (time scale S, concurrency C) an emulator process (H100-80GB + Llama-3.1-8B, max_model_len 8192,
one Python process = one core) serves a closed loop of C streams of 512-token prompts and 256 output tokens
(ignore_eos). A raw-socket client (cheaper than the server, so it is not the bottleneck) counts SSE chunks; the
emulator's /emulator/stats says how far its steps fell behind the step-time model. A point "keeps up" when the
real step time stays within 5% of the modelled one. Scale S > 1 asks for S times the tokens/s of the real GPU:
the highest S that keeps up gives the emulator's ceiling.

    .venv/bin/python benchmarks/emulator_capacity.py                      # the default sweep (~2 min)
    .venv/bin/python benchmarks/emulator_capacity.py --points 1x64 2x64 --seconds 10 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

PROMPT = list(range(1000, 1512))  # 512 token ids, distinct per request below so prefix caching does not help
TOLERANCE = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Point:
    scale: float
    concurrency: int
    wall_tok_s: float
    emulated_tok_s: float
    tpot_ms: float  # emulated, median over requests
    timing_error: float
    late_steps: int
    steps: int
    cpu_util: float  # emulator process CPU seconds per wall second

    @property
    def keeps_up(self) -> bool:
        return self.timing_error <= TOLERANCE


class _Client:
    def __init__(self, port: int) -> None:
        self.port = port
        self.tokens = 0
        self.tpots: list[float] = []
        self.counting = False
        self.stop = False
        self.seq = 0
        self.current: dict[int, tuple[int, float, float]] = {}  # slot -> (tokens, first, last) in flight

    def in_flight_tpots(self) -> list[float]:
        """Long requests may not finish inside the window: count their gaps so far too."""
        return [(last - first) / (n - 1) for n, first, last in self.current.values() if n > 1]

    async def worker(self, slot: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            while not self.stop:
                self.seq += 1
                body = json.dumps(
                    {
                        "model": "llama-3.1-8b",
                        "prompt": [self.seq % 100000, *PROMPT[1:]],
                        "max_tokens": 256,
                        "ignore_eos": True,
                        "stream": True,
                    }
                ).encode()
                writer.write(
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
                )
                n = 0
                first = last = 0.0
                self.current[slot] = (0, 0.0, 0.0)
                while True:
                    data = await reader.read(1 << 16)
                    if not data:
                        return
                    k = data.count(b'"text":')
                    if k:
                        now = time.perf_counter()
                        if n == 0:
                            first = now
                        last = now
                        n += k
                        self.current[slot] = (n, first, last)
                        if self.counting:
                            self.tokens += k
                    if data.endswith(b"data: [DONE]\n\n\r\n") or data.endswith(b"0\r\n\r\n"):
                        break
                self.current[slot] = (0, 0.0, 0.0)
                if n > 1 and self.counting:
                    self.tpots.append((last - first) / (n - 1))
        finally:
            writer.close()
            await writer.wait_closed()


async def _stats(port: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /emulator/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = await reader.read()
    writer.close()
    await writer.wait_closed()
    return dict(json.loads(raw.split(b"\r\n\r\n", 1)[1]))


async def _measure(port: int, pid: int, scale: float, concurrency: int, seconds: float) -> Point:
    client = _Client(port)
    tasks = [asyncio.create_task(client.worker(i)) for i in range(concurrency)]
    await asyncio.sleep(min(3.0, seconds / 3))  # warm-up: every stream past its first prefill
    s0 = await _stats(port)
    cpu0, t0 = _cpu_seconds(pid), time.perf_counter()
    client.counting = True
    await asyncio.sleep(seconds)
    client.counting = False
    client.tpots += client.in_flight_tpots()
    s1 = await _stats(port)
    cpu1, t1 = _cpu_seconds(pid), time.perf_counter()
    client.stop = True
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    model = s1["model_busy_s"] - s0["model_busy_s"]
    actual = s1["actual_busy_s"] - s0["actual_busy_s"]
    wall = t1 - t0
    return Point(
        scale=scale,
        concurrency=concurrency,
        wall_tok_s=client.tokens / wall,
        emulated_tok_s=client.tokens / wall / scale,
        tpot_ms=statistics.median(client.tpots) * scale * 1e3 if client.tpots else float("nan"),
        timing_error=actual / model - 1 if model else float("nan"),
        late_steps=int(s1["late_steps"] - s0["late_steps"]),
        steps=int(s1["steps"] - s0["steps"]),
        cpu_util=(cpu1 - cpu0) / wall,
    )


def run_point(scale: float, concurrency: int, seconds: float) -> Point:
    port = _free_port()
    cmd = [sys.executable, "-m", "tuner.emulator", "--model", "llama-3.1-8b", "--gpu", "h100-80gb"]
    cmd += ["--max-model-len", "8192", "--host", "127.0.0.1", "--port", str(port), "--disable-log-stats"]
    cmd += ["--time-scale", str(scale)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            if "Application startup complete" in line:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("emulator did not start")
        else:
            raise RuntimeError(f"emulator exited with {proc.wait()}")
        return asyncio.run(_measure(port, proc.pid, scale, concurrency, seconds))
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _median_point(points: list[Point]) -> Point:
    def med(attr: str) -> float:
        return float(statistics.median(getattr(p, attr) for p in points))

    p0 = points[0]
    return Point(
        p0.scale,
        p0.concurrency,
        med("wall_tok_s"),
        med("emulated_tok_s"),
        med("tpot_ms"),
        med("timing_error"),
        int(med("late_steps")),
        int(med("steps")),
        med("cpu_util"),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", nargs="+", default=["1x1", "1x16", "1x64", "1x128", "2x64", "3x64", "4x64"])
    ap.add_argument("--seconds", type=float, default=8.0, help="measured wall seconds a point")
    ap.add_argument("--repeats", type=int, default=1, help="runs a point (the table shows medians)")
    args = ap.parse_args()
    rows: list[Point] = []
    for spec in args.points:
        scale_s, conc_s = spec.lower().split("x")
        runs = [run_point(float(scale_s), int(conc_s), args.seconds) for _ in range(args.repeats)]
        p = _median_point(runs)
        rows.append(p)
        print(
            f"scale {p.scale:g} x {p.concurrency:4d} streams: {p.wall_tok_s:8.0f} tok/s wall, "
            f"{p.emulated_tok_s:7.0f} tok/s emulated, TPOT {p.tpot_ms:5.2f} ms, timing error "
            f"{p.timing_error * 100:+5.1f}%, late steps {p.late_steps}/{p.steps}, CPU {p.cpu_util * 100:3.0f}%",
            flush=True,
        )
    print()
    print("| time scale | streams | streamed tok/s (wall) | emulated tok/s | TPOT (emulated) | step timing vs model "
          "| emulator CPU | keeps up |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for p in rows:
        print(
            f"| {p.scale:g} | {p.concurrency} | {p.wall_tok_s:,.0f} | {p.emulated_tok_s:,.0f} | {p.tpot_ms:.2f} ms "
            f"| {p.timing_error * 100:+.1f}% | {p.cpu_util * 100:.0f}% | {'yes' if p.keeps_up else 'no'} |"
        )
    ok = [p for p in rows if p.keeps_up]
    if ok:
        best = max(ok, key=lambda p: p.wall_tok_s)
        print(
            f"\nhighest streamed rate within {TOLERANCE:.0%} of the step-time model: {best.wall_tok_s:,.0f} tok/s "
            f"(time scale {best.scale:g}, {best.concurrency} streams)"
        )


if __name__ == "__main__":
    main()
