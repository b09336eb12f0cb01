"""Client capacity: how many streamed chunks/s one load-client process sustains on one core, and how much
TTFT error it adds at 10,000 chunks/s (half the 20,000 aim) and at half its own capacity.

The server answers instantly: a raw asyncio HTTP/1.1 server in its own process, on the other core, writing a
pre-built SSE reply (vLLM-shaped completion chunks, one token each, usage chunk, [DONE]) the moment a request
has been read. It notes, per request, when it had read the request and when it had written the reply; the
TTFT error is the client's TTFT minus that server-side time to first byte, matched by prompt.

    .venv/bin/python benchmarks/client_capacity.py              # 3 repeats, medians
    .venv/bin/python benchmarks/client_capacity.py --repeats 5 --requests 2000 --tokens 256 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

from tuner.clock import REAL_TIME
from tuner.load import Arrival, LoadResult, Workload, run_load
from tuner.load.arrival import interarrival_gaps
from tuner.scoring import percentile


def _chunk(i: int) -> bytes:
    body = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 0,
        "model": "m",
        "choices": [{"index": 0, "text": f" t{i % 100}", "logprobs": None, "finish_reason": None, "stop_reason": None}],
    }
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _reply(tokens: int) -> bytes:
    usage = {"id": "cmpl-bench", "choices": [], "usage": {"prompt_tokens": 16, "completion_tokens": tokens}}
    body = b"".join(_chunk(i) for i in range(tokens))
    body += b"data: " + json.dumps(usage).encode() + b"\n\n" + b"data: [DONE]\n\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
    return head + body


def _serve(port_q: Any, tokens: int, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    reply = _reply(tokens)
    stats: dict[str, tuple[float, float]] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                body = await reader.readexactly(length) if length else b""
                t_read = time.perf_counter()
                if head.startswith(b"GET /stats"):
                    out = json.dumps(stats).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(out), out))
                    stats.clear()
                    continue
                if head.startswith(b"GET "):
                    writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
                    continue
                writer.write(reply)
                t_written = time.perf_counter()
                prompt = json.loads(body)["prompt"]
                stats[",".join(map(str, prompt[:12]))] = (t_read, t_written)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
        port_q.put(server.sockets[0].getsockname()[1])
        await asyncio.sleep(3600)  # the parent terminates this process

    asyncio.run(main())


def _key(spec_prompt: object) -> str:
    assert isinstance(spec_prompt, list)
    return ",".join(map(str, spec_prompt[:12]))


async def _server_stats(base: str) -> dict[str, list[float]]:
    import httpx

    async with httpx.AsyncClient() as c:
        data: dict[str, list[float]] = (await c.get(base + "/stats")).json()
        return data


async def _capacity(base: str, requests: int, tokens: int, concurrency: int, seed: int) -> LoadResult:
    wl = Workload(input_len=16, output_len=tokens, seed=seed)
    arrival = Arrival(concurrency=concurrency, requests=requests, warmup_requests=concurrency)
    return await run_load(base, "m", wl, arrival, clock=REAL_TIME, scrape_metrics=False)


async def _ttft_error(base: str, rate: float, requests: int, tokens: int, seed: int) -> tuple[list[float], LoadResult]:
    wl = Workload(input_len=16, output_len=tokens, seed=seed)
    await _server_stats(base)  # clear
    result = await run_load(
        base, "m", wl, Arrival(rate=rate, requests=requests, warmup_requests=20, seed=seed), scrape_metrics=False
    )
    stats = await _server_stats(base)
    prompts = [s.prompt for s in itertools.islice(wl.prompts(), len(result.records))]
    errors = []
    for r in result.records:
        if r.warmup or not r.ok or r.ttft_s is None:
            continue
        t_read, t_written = stats[_key(prompts[r.index])]
        errors.append(r.ttft_s - (t_written - t_read))
    return errors, result


async def _raw_floor(port: int, rate: float, requests: int, tokens: int, seed: int) -> list[float]:
    """The same arrivals and prompts from a bare asyncio-streams client: what the machine's loopback and event
    loop cost without httpx, SSE decoding or scoring — the floor under any Python client here."""
    wl = Workload(input_len=16, output_len=tokens, seed=seed)
    prompts = [s.prompt for s in itertools.islice(wl.prompts(), requests)]
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    ttfts: dict[str, float] = {}

    async def one(prompt: object) -> None:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": tokens, "stream": True}).encode()
        request = b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        t0 = time.perf_counter()
        conn = idle.pop() if idle else await asyncio.open_connection("127.0.0.1", port)
        reader, writer = conn
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
        first = await reader.readuntil(b"\n\n")
        ttfts[_key(prompt)] = time.perf_counter() - t0
        await reader.readexactly(length - len(first))
        idle.append(conn)

    gaps = interarrival_gaps(Arrival(rate=rate, requests=1, seed=seed))
    tasks = []
    due = time.perf_counter()
    for prompt in prompts:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        tasks.append(asyncio.create_task(one(prompt)))
        due += next(gaps)
    await asyncio.gather(*tasks)
    for _, w in idle:
        w.close()
    stats = await _server_stats(f"http://127.0.0.1:{port}")
    return [ttft - (stats[k][1] - stats[k][0]) for k, ttft in list(ttfts.items())[20:]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=1500, help="requests per capacity run")
    ap.add_argument("--tokens", type=int, default=256, help="chunks (tokens) per reply")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--ttft-requests", type=int, default=600)
    ap.add_argument("--fixed-rate", type=float, default=10_000, help="chunks/s of the fixed-rate TTFT run")
    args = ap.parse_args()

    cpus = sorted(os.sched_getaffinity(0))
    client_cpu, server_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], None)
    os.sched_setaffinity(0, {client_cpu})  # the client: one process, one core
    ctx = mp.get_context("spawn")
    port_q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(port_q, args.tokens, server_cpu), daemon=True)
    proc.start()
    try:
        port = port_q.get(timeout=30)
        base = f"http://127.0.0.1:{port}"
        caps: list[float] = []
        at: dict[str, dict[str, list[float]]] = {}
        for rep in range(args.repeats):
            t0 = time.perf_counter()
            cap = asyncio.run(_capacity(base, args.requests, args.tokens, args.concurrency, seed=rep))
            wall = time.perf_counter() - t0
            chunks_s = cap.summary.output_throughput
            caps.append(chunks_s)
            print(
                f"repeat {rep + 1}: {chunks_s:,.0f} chunks/s ({cap.summary.request_throughput:,.1f} req/s, "
                f"{cap.summary.requests_failed} failed, {wall:.1f}s)",
                flush=True,
            )
            # The aim's rate (half of 20,000 chunks/s) and half of what this client just sustained.
            for label, chunk_rate in (
                (f"{args.fixed_rate:,.0f} chunks/s", args.fixed_rate),
                ("half capacity", chunks_s / 2),
            ):
                rate = chunk_rate / args.tokens
                errors, res = asyncio.run(_ttft_error(base, rate, args.ttft_requests, args.tokens, seed=100 + rep))
                floor = asyncio.run(_raw_floor(port, rate, args.ttft_requests, args.tokens, seed=100 + rep))
                row = at.setdefault(label, {k: [] for k in ("p50", "p99", "floor50", "floor99")})
                row["p50"].append(percentile(errors, 50) * 1000)
                row["p99"].append(percentile(errors, 99) * 1000)
                row["floor50"].append(percentile(floor, 50) * 1000)
                row["floor99"].append(percentile(floor, 99) * 1000)
                print(
                    f"  at {rate:.1f} req/s ({res.summary.output_throughput:,.0f} chunks/s): TTFT error "
                    f"p50 {row['p50'][-1]:.3f} ms, p99 {row['p99'][-1]:.3f} ms over {len(errors)} requests; "
                    f"bare asyncio client p50 {row['floor50'][-1]:.3f} ms, p99 {row['floor99'][-1]:.3f} ms",
                    flush=True,
                )
        print()
        print(f"python {sys.version.split()[0]}, client on cpu {client_cpu}, server on cpu {server_cpu}, "
              f"{args.tokens} chunks/reply, {args.concurrency} users")  # fmt: skip
        print("| figure | median | runs |")
        print("|---|---|---|")
        print(f"| client capacity, chunks/s (one core) | {statistics.median(caps):,.0f} | "
              + ", ".join(f"{c:,.0f}" for c in caps) + " |")  # fmt: skip
        names = {"p50": "TTFT error p50", "p99": "TTFT error p99", "floor50": "bare asyncio client: TTFT error p50",
                 "floor99": "bare asyncio client: TTFT error p99"}  # fmt: skip
        for label, row in at.items():
            for key, name in names.items():
                print(f"| {name} at {label}, ms | {statistics.median(row[key]):.3f} | "
                      + ", ".join(f"{v:.3f}" for v in row[key]) + " |")  # fmt: skip
        print(f"load average during the run: {os.getloadavg()[0]:.2f} (1 min)")
    finally:
        proc.terminate()
        with contextlib.suppress(Exception):
            proc.join(5)


if __name__ == "__main__":
    main()
