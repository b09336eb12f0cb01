"""One HTTP connection per request in flight, without httpcore's pool scan.

httpcore's pool walks every connection it holds — polling each idle socket — whenever a request is queued or
released, and counts the idle ones once per idle connection: work quadratic in the connections, on every
request. At a few dozen streams the scan costs more CPU than the streams (a load client measuring 32 users
against an instant server spent half its time there). Here each connection is its own one-connection transport,
lent to one request at a time from a free list, so the scan is always over one connection.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import httpx

__all__ = ["OneConnectionPerRequest"]


class OneConnectionPerRequest(httpx.AsyncBaseTransport):
    """An httpx transport lending one keep-alive connection to each request in flight; unbounded, as the
    load's arrival schedule (not a pool) decides how many requests are in flight."""

    def __init__(self) -> None:
        # One SSL context for all: building one per connection costs milliseconds (it loads the CA bundle).
        self._ssl = httpx.create_ssl_context(trust_env=False)
        self._free: list[httpx.AsyncHTTPTransport] = []
        self._all: list[httpx.AsyncHTTPTransport] = []

    @property
    def connections(self) -> int:
        return len(self._all)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        transport = self._free.pop() if self._free else self._new()
        try:
            response = await transport.handle_async_request(request)
        except BaseException:
            self._free.append(transport)
            raise
        assert isinstance(response.stream, httpx.AsyncByteStream)
        response.stream = _Returning(response.stream, lambda: self._free.append(transport))
        return response

    async def aclose(self) -> None:
        for transport in self._all:
            await transport.aclose()
        self._all.clear()
        self._free.clear()

    def _new(self) -> httpx.AsyncHTTPTransport:
        transport = httpx.AsyncHTTPTransport(verify=self._ssl, limits=httpx.Limits(max_connections=1))
        self._all.append(transport)
        return transport


class _Returning(httpx.AsyncByteStream):
    """A response body that gives its connection back to the free list once closed."""

    def __init__(self, stream: httpx.AsyncByteStream, give_back: Callable[[], None]) -> None:
        self._stream = stream
        self._give_back: Callable[[], None] | None = give_back

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        try:
            await self._stream.aclose()
        finally:
            if self._give_back is not None:
                give_back, self._give_back = self._give_back, None
                give_back()
