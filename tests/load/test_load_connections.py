"""Connections of the load client (aiohttp's, under httpx): kept alive across requests, one per request in flight,
and its errors told apart (refused, cut, timed out)."""

from __future__ import annotations

import asyncio
import time

import httpx
from load_fakes import BrokenServer

from tests.servers import free_port
from tuner.clock import Clock
from tuner.load import RequestRecord
from tuner.load.client import send_request
from tuner.load.connections import on_wire
from tuner.load.runner import new_client

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}


async def _send(client: object, base: str, index: int = 0) -> RequestRecord:
    return await send_request(
        client,  # type: ignore[arg-type]
        base + "/v1/completions",
        BODY,
        clock=Clock(),
        timeout_s=5.0,
        index=index,
        origin=0.0,
    )


async def test_sequential_requests_reuse_one_connection() -> None:
    # vLLM's replies are chunked: the terminator after [DONE] must be read, or each request reconnects.
    server = BrokenServer(["ok"])
    async with server.serve() as base, new_client() as client:
        records = [await _send(client, base, i) for i in range(5)]
        assert all(r.ok for r in records)
        assert server.connections == 1


async def test_concurrent_requests_get_one_connection_each_and_keep_them() -> None:
    server = BrokenServer(["ok"])
    async with server.serve() as base, new_client() as client:
        for _ in range(3):
            records = await asyncio.gather(*(_send(client, base, i) for i in range(6)))
            assert all(r.ok for r in records)
        assert 1 <= server.connections <= 6  # three rounds of six: kept alive, not reconnected


async def test_a_stream_held_open_after_done_is_a_success_timed_at_done() -> None:
    server = BrokenServer(["linger", "ok"], stall_s=60.0)
    async with server.serve() as base, new_client() as client:
        t0 = time.perf_counter()
        first = await _send(client, base)
        waited = time.perf_counter() - t0
        assert first.ok and first.completion_tokens == 4
        assert first.e2e_s < 30  # the end is [DONE], not the close that never came (60 s later)
        assert waited < 30  # the drain after [DONE] is bounded, not the server's 60 s
        second = await _send(client, base, 1)
        assert second.ok
        assert server.connections == 2  # the held connection was dropped, not reused


async def test_a_refused_connection_is_told_from_a_timeout() -> None:
    # httpx-aiohttp maps every aiohttp connection error to ConnectTimeout; tuner.load.connections maps them again.
    async with new_client() as client:
        base = f"http://127.0.0.1:{free_port()}"
        records = [await _send(client, base, i) for i in range(4)]
        assert [r.error_class for r in records] == ["connection_refused"] * 4
        assert all("Connect call failed" in (r.error_message or "") or "refused" in (r.error_message or "")
                   for r in records), records[0].error_message  # fmt: skip


async def test_a_cut_or_reset_connection_is_dropped_and_the_next_request_gets_a_new_one() -> None:
    server = BrokenServer(["cut", "ok", "reset", "ok"])
    async with server.serve() as base, new_client() as client:
        records = [await _send(client, base, i) for i in range(4)]
    assert [r.error_class for r in records] == ["stream_cut", None, "connection_reset", None]
    assert server.connections == 3  # cut | ok, then reset on the kept connection | ok


async def test_the_clock_starts_when_the_request_is_on_the_wire() -> None:
    """The load transport says when a request's headers are written (on_wire); a request handed over while the event
    loop is busy elsewhere starts its clock then, not at the hand-over. A MockTransport never says: its clock starts
    at the hand-over, as before."""
    server = BrokenServer(["ok"])
    async with server.serve() as base, new_client() as client:
        seen: list[str] = []
        with on_wire(lambda: seen.append("wire")):
            seen.append("handed over")
            response = await client.post(base + "/v1/completions", json=BODY)
            seen.append("answered")
        assert response.status_code == 200 and seen == ["handed over", "wire", "answered"]

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"data: [DONE]\n\n")

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as mock:
        with on_wire(lambda: seen.append("never")):
            await mock.get("http://fake/")
    assert "never" not in seen


async def test_time_queued_in_the_client_is_not_the_servers() -> None:
    # The loop blocked for 2 s between the hand-over and the write: the record's TTFT leaves it out.
    server = BrokenServer(["ok"])
    blocked: list[bool] = []

    def block_once() -> None:
        if not blocked:
            blocked.append(True)
            time.sleep(2.0)  # the event loop held by other work, as a busy client's is

    async with server.serve() as base, new_client() as client:
        asyncio.get_running_loop().call_soon(block_once)
        record = await _send(client, base)
    assert record.ok and blocked
    assert record.ttft_s is not None and record.ttft_s < 2.0
