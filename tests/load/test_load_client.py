"""One streamed request: measurements and every failure class, through MockTransport and a real broken server."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from load_fakes import DONE, BrokenServer, LoopClock, chunk, fake_time, sse, usage_chunk

from tests.servers import free_port
from tuner.clock import Clock
from tuner.load import RequestRecord
from tuner.load.client import send_request
from tuner.load.runner import new_client

BODY = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stream": True}


async def one(handler: Any, *, timeout_s: float = 5.0, chat: bool = False, clock: Clock = Clock()) -> RequestRecord:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await send_request(
            client, "http://fake/v1/completions", BODY, clock=clock, timeout_s=timeout_s, index=7, origin=0.0, chat=chat
        )


def streaming(parts: list[bytes], gap_s: float = 0.0, status: int = 200) -> Any:
    async def handler(request: httpx.Request) -> httpx.Response:
        async def body() -> AsyncIterator[bytes]:
            for p in parts:
                if gap_s:
                    await asyncio.sleep(gap_s)
                yield p

        return httpx.Response(status, content=body(), headers={"content-type": "text/event-stream"})

    return handler


@fake_time
async def test_success_measures_ttft_gaps_and_usage() -> None:
    parts = [chunk(), chunk(), chunk(), usage_chunk(3, 3), DONE]
    r = await one(streaming(parts, gap_s=0.02), clock=LoopClock())
    assert r.ok and r.error_class is None
    assert r.index == 7
    assert (r.prompt_tokens, r.completion_tokens, r.usage_from_server) == (3, 3, True)
    # Every part 20 ms after the one before it (fake time: what the server did, not the machine's load).
    assert r.ttft_s == pytest.approx(0.02, abs=1e-5)
    assert r.itl_s == pytest.approx([0.02, 0.02], abs=1e-5)
    assert r.e2e_s == pytest.approx(0.1, abs=1e-5)


@fake_time
async def test_clock_scale_multiplies_every_figure() -> None:
    r = await one(streaming([chunk(), chunk(), DONE], gap_s=0.02), clock=LoopClock(100.0))
    assert r.ttft_s == pytest.approx(2.0, abs=1e-3)  # 0.02 wall s read as 2 emulated s
    assert r.itl_s == pytest.approx([2.0], abs=1e-3)


async def test_without_usage_counts_chunks_and_says_so() -> None:
    r = await one(streaming([sse(5, usage=False)]))
    assert r.ok and r.completion_tokens == 5 and r.usage_from_server is False


async def test_chat_role_chunk_is_not_the_first_token() -> None:
    role = b"data: " + json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}).encode() + b"\n\n"
    r = await one(streaming([role, chunk(chat=True), chunk(chat=True), DONE], gap_s=0.02), chat=True)
    assert r.ok and r.completion_tokens == 2 and len(r.itl_s) == 1
    assert r.ttft_s > 0.03  # the role chunk came at ~0.02 s, the first token at ~0.04 s


async def test_crlf_and_split_events_are_decoded() -> None:
    raw = sse(3).replace(b"\n", b"\r\n")
    parts = [raw[i : i + 7] for i in range(0, len(raw), 7)]
    r = await one(streaming(parts))
    assert r.ok and r.completion_tokens == 3


@pytest.mark.parametrize(
    ("status", "body", "cls", "message"),
    [
        (500, {"error": {"message": "engine dead", "code": 500}}, "http_5xx", "HTTP 500: engine dead"),
        (503, {"object": "error", "message": "overloaded"}, "http_5xx", "HTTP 503: overloaded"),
        (400, {"error": {"message": "maximum context length is 8192 tokens", "code": 400}}, "http_4xx", "8192"),
        (404, {"detail": "Not Found"}, "http_4xx", "HTTP 404: Not Found"),
    ],
)
async def test_http_errors_keep_the_server_message(status: int, body: object, cls: str, message: str) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json=body)

    r = await one(handler)
    assert not r.ok and r.error_class == cls and message in r.error_message


async def test_plain_text_error_body() -> None:
    r = await one(lambda request: httpx.Response(502, text="Bad Gateway"))
    assert (r.error_class, r.error_message) == ("http_5xx", "HTTP 502: Bad Gateway")


async def test_stream_without_done_is_cut() -> None:
    r = await one(streaming([sse(3, done=False)]))
    assert r.error_class == "stream_cut" and r.completion_tokens == 3
    assert "without data: [DONE]" in r.error_message


@pytest.mark.parametrize(
    "parts",
    [
        [b"<html>oops</html>\n\n"],
        [b"data: {not json\n\n"],
        [b"data: [1, 2]\n\n"],
        [chunk(), b'data: {"choices": [3]}\n\n'],
    ],
)
async def test_garbage_is_malformed_sse(parts: list[bytes]) -> None:
    r = await one(streaming(parts))
    assert r.error_class == "malformed_sse" and r.error_message


async def test_error_event_mid_stream_takes_its_code() -> None:
    err = b"data: " + json.dumps({"error": {"message": "CUDA error", "code": 500}}).encode() + b"\n\n"
    r = await one(streaming([chunk(), err]))
    assert r.error_class == "http_5xx" and "CUDA error" in r.error_message


@fake_time
async def test_timeout_bounds_the_whole_request_in_emulated_seconds() -> None:
    # 10 chunks 0.05 wall s apart: each read is quick, the whole takes 0.5 wall s = 5 emulated s at scale 10.
    r = await one(streaming([chunk()] * 10 + [DONE], gap_s=0.05), timeout_s=2.0, clock=LoopClock(10.0))
    assert r.error_class == "timeout" and "within 2s" in r.error_message
    assert r.e2e_s == pytest.approx(2.0, abs=1e-3)  # cut at the deadline, not at the next chunk


async def test_transport_errors_are_classified() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    def reset(request: httpx.Request) -> httpx.Response:
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)

    def weird(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("transport bug")

    assert (await one(refuse)).error_class == "connection_refused"
    assert (await one(reset)).error_class == "connection_reset"
    r = await one(weird)
    assert (r.error_class, r.error_message) == ("other", "RuntimeError: transport bug")


@pytest.mark.parametrize("wire", ["httpx", "load client"])
async def test_real_broken_server_every_class(wire: str) -> None:
    # The same classes through httpx's own transport and through the load client's (aiohttp's connections).
    modes = ["ok", "http_500", "http_400", "cut", "garbage", "reset", "stall"]
    server = BrokenServer(modes, stall_s=30.0)
    async with server.serve() as base, httpx.AsyncClient() if wire == "httpx" else new_client() as client:
        got = []
        for i in range(len(modes)):
            r = await send_request(
                # 3 s: the stall's timeout, and ample for the others' few bytes on a machine with both cores busy
                client,
                base + "/v1/completions",
                BODY,
                clock=Clock(),
                timeout_s=3.0,
                index=i,
                origin=0.0,
            )
            got.append(r.error_class)
        url = f"http://127.0.0.1:{free_port()}/v1/completions"
        refused = await send_request(client, url, BODY, clock=Clock(), timeout_s=1.0, index=9, origin=0.0)
    assert got == [None, "http_5xx", "http_4xx", "stream_cut", "malformed_sse", "connection_reset", "timeout"]
    assert refused.error_class == "connection_refused" and str(free_port) not in refused.error_message


async def test_a_reply_shorter_than_pinned_is_short_output_with_asked_and_got() -> None:
    # vLLM 0.32 shortens the output to fit max_model_len and answers 200: the client must notice it.
    end = b'data: {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}\n\n'
    handler = streaming([chunk(), chunk(), end, usage_chunk(1000, 2), DONE])
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        r = await send_request(
            client, "http://fake/v1/completions", BODY, clock=Clock(), timeout_s=5, index=0, origin=0.0,
            expect_output=100,
        )  # fmt: skip
    assert not r.ok and r.error_class == "short_output"
    assert r.error_message == "asked 100 output tokens, got 2 (finish_reason length)"
    assert (r.prompt_tokens, r.completion_tokens) == (1000, 2)
    full = await one(streaming([sse(4)]))  # BODY asks 4, no expect_output: trusted as before
    assert full.ok
