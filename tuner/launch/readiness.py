"""Wait for a server's /health while watching whether it is still alive.

vLLM refuses connections while it loads and answers 200 on /health once the engine runs; a published Docker port
accepts connections at once (docker-proxy) and resets them, so only an HTTP 200 counts as ready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from tuner.launch.startup_log import has_capacity_lines

POLL_S = 0.1
# The log reader may lag the port by a moment; real vLLM prints the capacity lines long before it serves.
FACTS_GRACE_S = 1.0


class ServerExited(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"exited with code {code}")
        self.code = code


class StartTimedOut(Exception):
    pass


@dataclass(frozen=True)
class Ready:
    served_model: str | None  # the first id of /v1/models
    startup_seconds: float
    version: str | None = None  # GET /version's "version"; None where the route is missing


async def wait_until_ready(
    base_url: str,
    *,
    exit_code: Callable[[], Awaitable[int | None]],
    timeout_s: float,
    logs: Callable[[], str] | None = None,
    poll_s: float = POLL_S,
    refused: Callable[[], Exception | None] | None = None,
) -> Ready:
    """Return once GET /health answers 200; raise ServerExited or StartTimedOut, or what `refused` returns once it
    returns one (the server said it will not start and is still shutting down)."""
    started = time.monotonic()
    deadline = started + timeout_s
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(2.0), trust_env=False) as client:
        while True:
            code = await exit_code()
            if code is not None:
                raise ServerExited(code)
            if refused is not None and (error := refused()) is not None:
                raise error
            if await _healthy(client):
                break
            if time.monotonic() >= deadline:
                raise StartTimedOut()
            await asyncio.sleep(poll_s)
        startup_seconds = time.monotonic() - started
        served = await _served_model(client)
        version = await _server_version(client)
    if logs is not None:
        grace_end = time.monotonic() + FACTS_GRACE_S
        while not has_capacity_lines(logs()) and time.monotonic() < grace_end:
            await asyncio.sleep(0.02)
    return Ready(served, startup_seconds, version)


async def _healthy(client: httpx.AsyncClient) -> bool:
    try:
        response = await client.get("/health")
    except httpx.HTTPError:
        return False
    return response.status_code == 200


async def _served_model(client: httpx.AsyncClient) -> str | None:
    try:
        response = await client.get("/v1/models")
        data = response.json()["data"]
        model = data[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        return None
    return model if isinstance(model, str) else None


async def _server_version(client: httpx.AsyncClient) -> str | None:
    """vLLM's `GET /version` ({"version": "0.32.0"}); a server without the route (404) or not JSON gives None."""
    try:
        response = await client.get("/version")
        version = response.json()["version"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None
    return version if isinstance(version, str) and version else None
