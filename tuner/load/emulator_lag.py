"""What the load phase asks the emulator about its clock (`/emulator/stats`) and how it starts a run again cold
(`/emulator/reset_prefix_cache`): the emulator's own routes, which vLLM answers with 404 (then: not an emulator)."""

from __future__ import annotations

import httpx

__all__ = ["read_emulator_lag", "reset_emulator_prefix_cache"]


async def read_emulator_lag(
    base_url: str, *, timeout_s: float = 5.0, transport: httpx.AsyncBaseTransport | None = None
) -> float | None:
    """How far the emulator has fallen behind its clock so far (emulated seconds, `/emulator/stats`'s `behind_s`:
    its engine's slips and its HTTP front's late answers); None for a server that is not the emulator (vLLM answers
    404) or did not answer. `transport`: the client's (a test's httpx.MockTransport)."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
            response = await client.get(f"{base_url.rstrip('/')}/emulator/stats")
        if response.status_code != 200:
            return None
        value = response.json().get("behind_s")
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def reset_emulator_prefix_cache(
    base_url: str, *, timeout_s: float = 5.0, transport: httpx.AsyncBaseTransport | None = None
) -> None:
    """The emulator's prefix cache emptied before a run is measured again on the same server (its prompts would
    otherwise hit what the lagged run left); nothing for a server that is not the emulator."""
    try:
        async with httpx.AsyncClient(timeout=timeout_s, transport=transport) as client:
            await client.post(f"{base_url.rstrip('/')}/emulator/reset_prefix_cache")
    except httpx.HTTPError:
        return
