"""Client CPU per streamed request, by client library: what a load client takes from the machine it shares.

A local server (its own process, pinned to core 0) answers every request the way vLLM streams a completion:
`--tokens` token events `--gap-ms` apart, then usage and [DONE], chunked. Each client (its own process, pinned to
core 1) runs `--requests` requests with `--users` in flight after a warm-up of as many, and reports the CPU time it
used (user + system) per request. Clients: bare aiohttp and bare httpx (read the bytes, nothing else); tuner's
`send_request` (SSE decoding, JSON per event, timing) over httpx's own transport (httpcore on anyio) and over the
load client's (`tuner.load.runner.new_client`: aiohttp's wire). Medians of `--repeats`, alternating.

    .venv/bin/python benchmarks/client_cpu.py
    strace -f -c .venv/bin/python benchmarks/client_cpu.py --client httpx     # system calls of one client
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CLIENTS = ("aiohttp", "httpx", "tuner-on-httpcore", "tuner")
_EVENT = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m"}


_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _serve(port: int, tokens: int, gap_s: float) -> None:
    token = _chunk(b"data: %s\n\n" % json.dumps({**_EVENT, "choices": [{"index": 0, "text": " w"}]}).encode())
    usage = {"prompt_tokens": 128, "completion_tokens": tokens, "total_tokens": 128 + tokens}
    end = _chunk(b"data: %s\n\ndata: [DONE]\n\n" % json.dumps({**_EVENT, "choices": [], "usage": usage}).encode())

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-l"))
                await reader.readexactly(length)
                writer.write(_HEAD)
                for _ in range(tokens):
                    await asyncio.sleep(gap_s)
                    writer.write(token)
                writer.write(end + b"0\r\n\r\n")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def _measure(client: str, url: str, requests: int, users: int, tokens: int) -> float:
    import aiohttp
    import httpx

    from tuner.clock import Clock
    from tuner.load.client import send_request
    from tuner.load.runner import new_client

    body = {"model": "m", "prompt": list(range(128)), "max_tokens": tokens, "stream": True}
    close: object
    if client == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def one() -> None:
            async with session.post(url, json=body) as r:
                async for _ in r.content.iter_any():
                    pass

        close = session.close
    else:
        http = new_client() if client == "tuner" else httpx.AsyncClient(limits=httpx.Limits(max_connections=None))
        close = http.aclose
        if client == "httpx":

            async def one() -> None:
                async with http.stream("POST", url, json=body) as r:
                    async for _ in r.aiter_bytes():
                        pass
        else:

            async def one() -> None:
                record = await send_request(http, url, body, clock=Clock(), timeout_s=30, index=0, origin=0.0)
                assert record.ok, record.error_message

    async def run() -> None:
        left = iter(range(requests))

        async def user() -> None:
            for _ in left:
                await one()

        await asyncio.gather(*(user() for _ in range(users)))

    await run()  # warm-up: connections, imports, caches
    t0 = time.process_time()
    await run()
    used = time.process_time() - t0
    await close()  # type: ignore[operator]
    return used / requests * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--client", choices=CLIENTS, help="run one client once against --port (used by the driver)")
    ap.add_argument("--port", type=int)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--gap-ms", type=float, default=1.0)
    args = ap.parse_args()
    if args.serve:
        os.sched_setaffinity(0, {0})
        asyncio.run(_serve(args.port, args.tokens, args.gap_ms / 1000))
        return
    port = args.port
    server = None
    if port is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        cmd = [sys.executable, __file__, "--serve", "--port", str(port), "--tokens", str(args.tokens)]
        server = subprocess.Popen([*cmd, "--gap-ms", str(args.gap_ms)])
        time.sleep(1.0)
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        if args.client:
            if os.cpu_count() and os.cpu_count() > 1:  # type: ignore[operator]
                os.sched_setaffinity(0, {1})
            ms = asyncio.run(_measure(args.client, url, args.requests, args.users, args.tokens))
            print(json.dumps({"client": args.client, "cpu_ms_per_request": ms}))
            return
        results: dict[str, list[float]] = {c: [] for c in CLIENTS}
        for i in range(args.repeats):
            for client in CLIENTS if i % 2 == 0 else CLIENTS[::-1]:
                cmd = [sys.executable, __file__, "--client", client, "--port", str(port)]
                cmd += ["--requests", str(args.requests), "--users", str(args.users), "--tokens", str(args.tokens)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                results[client].append(json.loads(out)["cpu_ms_per_request"])
        print(f"{args.requests} requests, {args.users} in flight, {args.tokens} tokens {args.gap_ms:g} ms apart")
        print("| client | CPU ms per request (median) | runs |\n|---|---:|---|")
        for client, values in results.items():
            runs = ", ".join(f"{v:.2f}" for v in values)
            print(f"| {client} | {statistics.median(values):.2f} | {runs} |")
    finally:
        if server is not None:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()
