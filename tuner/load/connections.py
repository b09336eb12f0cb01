"""The load client's transport: httpx's API over aiohttp's connections (`httpx-aiohttp`).

Measured against real vLLM (the CPU build, 2 cores; benchmarks/README.md): with httpx's own transport (httpcore
on anyio) the same client code got about half the output tok/s `vllm bench serve` gets from the same server, a TTFT
two to eight times higher, and replies read in bursts (a TPOT near 0 in some runs); with aiohttp's connections
under the same httpx client and request code, the figures match vLLM's client, which uses aiohttp too. The code
that builds requests and reads the stream stays on httpx (and `httpx.MockTransport` fakes keep working); only the
connections change.

aiohttp's connector is unbounded here (`limit=0`): the load's arrival schedule, not a pool, decides how many
requests are in flight. `httpx-aiohttp` maps aiohttp's errors to httpx's, but maps every connection error -- a
refused connect, a reset, a server that hung up -- to `ConnectTimeout`; the load client needs those apart (a
refused connection is a server that is not there, a hang-up one that died, a timeout one that is slow), so they are
mapped again from their cause.

The clock of a request starts when aiohttp has written its headers to the socket (`on_wire`), not when the
request was handed to the transport: at 64 users in one event loop the hand-over waits behind the other requests'
work for up to 23 ms at p95 before anything is on the wire (measured against a loopback capture,
benchmarks/README.md, GuideLLM section), time the server never saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
from httpx_aiohttp import AiohttpTransport

__all__ = ["load_transport", "on_wire"]

# Called (in the request's own task, so its context) when the request's headers are on the wire.
_ON_WIRE: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("tuner_on_wire", default=None)


@contextlib.contextmanager
def on_wire(callback: Callable[[], None]) -> Iterator[None]:
    """Call `callback` when a request sent in this block is on the wire (the load transport's requests only; a
    transport that cannot tell, such as httpx.MockTransport, never calls it)."""
    token = _ON_WIRE.set(callback)
    try:
        yield
    finally:
        _ON_WIRE.reset(token)


async def _headers_sent(_session: aiohttp.ClientSession, _ctx: SimpleNamespace, _params: Any) -> None:
    callback = _ON_WIRE.get()
    if callback is not None:
        callback()


def load_transport() -> httpx.AsyncBaseTransport:
    """A transport for the load: aiohttp connections, no cap on how many, no proxies from the environment."""
    ssl = httpx.create_ssl_context(trust_env=False)

    def session() -> aiohttp.ClientSession:
        # Built at the first request, inside the running event loop, as aiohttp requires.
        connector = aiohttp.TCPConnector(limit=0, ssl=ssl)
        trace = aiohttp.TraceConfig()
        trace.on_request_headers_sent.append(_headers_sent)
        return aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None),
            trust_env=False,
            trace_configs=[trace],
        )

    return _Remapped(AiohttpTransport(client=session, trust_env=False))


class _Remapped(httpx.AsyncBaseTransport):
    def __init__(self, inner: AiohttpTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._inner.handle_async_request(request)
        except httpx.TransportError as e:
            raise _remapped(e) from e.__cause__
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _RemappedStream(response.stream)
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


class _RemappedStream(httpx.AsyncByteStream):
    def __init__(self, stream: httpx.AsyncByteStream) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for part in self._stream:
                yield part
        except httpx.TransportError as e:
            raise _remapped(e) from e.__cause__

    async def aclose(self) -> None:
        await self._stream.aclose()


def _remapped(e: httpx.TransportError) -> httpx.TransportError:
    """The httpx error an aiohttp error stands for, by its cause."""
    cause = e.__cause__
    if isinstance(cause, aiohttp.ServerTimeoutError | asyncio.TimeoutError):
        return e
    if isinstance(cause, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(cause))
    if isinstance(cause, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        return httpx.RemoteProtocolError(str(cause) or type(cause).__name__)
    if isinstance(cause, aiohttp.ClientConnectionError):  # a reset or a broken pipe
        return httpx.ReadError(str(cause) or type(cause).__name__)
    return e
