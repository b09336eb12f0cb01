"""The process launcher on real vLLM (the pinned CPU build): the facts of a good start, each refused start and a
crash under load, classified as the study needs them, read from the session's shared starts (tests/real_vllm.py):
the good one, and the refused ones started side by side.

The logs these produce are kept in tests/launch/fixtures/, where fast tests read them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.real_vllm import KV_BYTES_FLAGS, LaunchedVllm, Refusals
from tuner.errors import LaunchError
from tuner.launch.failures import (
    CRASHED_UNDER_LOAD,
    INVALID_FLAGS,
    KV_CACHE_TOO_SMALL,
    MODEL_NOT_FOUND,
    classify_startup_exit,
)

pytestmark = pytest.mark.real_vllm

EXIT_LIMIT_S = 120.0

Recorded = Callable[[str], tuple[str, int | None]]


def read_refusal(refused_starts: Recorded, name: str) -> LaunchError:
    """The launchers' reading of real vLLM's refused start (the conformance recorder's, started once a session)."""
    log, code = refused_starts(name)
    assert code is not None and code != 0, log[-2000:]
    return classify_startup_exit(log, code)


def test_kv_cache_too_small_carries_vllms_estimate(refused_starts: Recorded) -> None:
    """16 CPU blocks of 128 tokens cannot hold one 4,096-token request; vLLM says 1,920 would fit."""
    error = read_refusal(refused_starts, "kv_cache_too_small")
    assert error.reason == KV_CACHE_TOO_SMALL
    assert error.estimated_max_model_len == 1920
    assert "To serve at least one request with the model's max seq len (4096)" in str(error)


def test_flag_combination_vllm_rejects(refused_starts: Recorded) -> None:
    error = read_refusal(refused_starts, "invalid_flags")  # max_num_seqs 64 with max_num_batched_tokens 32
    assert error.reason == INVALID_FLAGS
    assert str(error).endswith(": max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64).")


def test_unknown_flag(refused_starts: Recorded) -> None:
    error = read_refusal(refused_starts, "unknown_flag")
    assert error.reason == INVALID_FLAGS
    assert str(error).endswith("error: unrecognized arguments: --no-such-flag")


def test_missing_model_is_model_not_found(refusals: Refusals) -> None:
    """Through the launcher whole: the process started, its exit seen, its log read and classified."""
    error = refusals.model_not_found
    assert error.reason == MODEL_NOT_FOUND
    assert str(error).count(str(refusals.missing_model)) == 1


def test_a_good_starts_facts(launched_vllm: LaunchedVllm) -> None:
    server = launched_vllm.server
    facts = server.facts
    assert facts.vllm_version == "0.32.0"  # GET /version
    assert facts.kv_tokens == 524_288  # 1 GiB / (4 layers x 2 KV heads x 64 x 2 (K, V) x 2 bytes)
    assert facts.max_model_len == 1024
    assert facts.max_concurrency == pytest.approx(512.0)
    assert facts.available_kv_gib == pytest.approx(1.0)
    assert facts.engine_init_seconds is not None and facts.startup_seconds is not None
    assert server.model == "tiny" and server.failure() is None


# tests/real_vllm.py runs it after every other test of `launched_vllm`: it kills that server's engine core.
async def test_the_engine_core_killed_under_load(launched_vllm: LaunchedVllm) -> None:
    """A crash under load read by Server.failure()."""
    server = launched_vllm.server
    assert server.failure() is None, "the server died before the test killed it"
    (record,) = launched_vllm.launcher.registry.records()
    engine = _engine_core(record.pgid)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120.0, trust_env=False) as client:
        answered = asyncio.Event()
        load = [asyncio.create_task(_long_stream(client, i, answered)) for i in range(16)]
        await asyncio.wait_for(answered.wait(), EXIT_LIMIT_S)  # the engine is generating for the load
        # How far the engine is ahead of what its API server has streamed is unknowable from outside (a starved
        # API server drained whole replies after the kill), so the engine is frozen first: a request sent after
        # that can only end whole if the signals missed the engine core.
        os.kill(engine, signal.SIGSTOP)
        accepted = asyncio.Event()
        late = asyncio.create_task(_long_stream(client, 16, accepted, at_headers=True))
        await asyncio.wait_for(accepted.wait(), EXIT_LIMIT_S)  # the API server has taken it
        os.kill(engine, signal.SIGKILL)
        endings = await asyncio.gather(*load)
        late_ending = await late
    assert late_ending != "whole", endings

    deadline = time.monotonic() + EXIT_LIMIT_S
    while server.exit_code is None and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    error = server.failure()
    assert error is not None, "the API server outlived its engine core"
    assert error.reason == CRASHED_UNDER_LOAD
    assert "after it was ready (" in str(error) and "engine core exited unexpectedly" in str(error)


async def _long_stream(client: httpx.AsyncClient, i: int, started: asyncio.Event, *, at_headers: bool = False) -> str:
    """How one streamed 800-token reply ended: "whole" (a finish_reason), "cut", "error event" or the client's error.

    `started` is set at the first token, or `at_headers` at the 200 answer's headers (vLLM sends them before it hands
    the request to the engine core, so they come from a frozen engine too)."""
    body = {"model": "tiny", "prompt": f"alpha beta gamma {i}", "max_tokens": 800, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}"
            if at_headers:
                started.set()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                started.set()
                event = json.loads(line.removeprefix("data: "))
                if "error" in event:  # vLLM ends a failed stream with an error event, then [DONE]
                    return "error event"
                if event["choices"][0].get("finish_reason"):
                    return "whole"
    except httpx.HTTPError as e:
        return type(e).__name__
    return "cut"


def _engine_core(pgid: int) -> int:
    """The engine core process of the server's group (vLLM names it VLLM::EngineCore)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
            fields = (entry / "stat").read_text().rsplit(")", 1)[-1].split()
        except OSError:
            continue
        if comm.startswith("VLLM::EngineCor") and fields[2] == str(pgid):
            return int(entry.name)
    pytest.fail(f"no VLLM::EngineCore process in group {pgid}")


def test_kv_cache_memory_bytes_and_the_null_block_as_the_arithmetic_predicts(
    refusals: Refusals, tiny_model: Path
) -> None:
    """8 MiB given outright (KV_BYTES_FLAGS, through the launcher whole) is 32 blocks of 128 tokens of 2 KiB; one is
    the null block, so real vLLM estimates 31 x 128 = 3,968 for a 4,096-token request, and the shared arithmetic
    predicts the same refusal and estimate before any start."""
    from tuner.capacity import plan_startup
    from tuner.catalog import cpu_profile, load_model
    from tuner.flags import resolve

    model, cpu = load_model(str(tiny_model)), cpu_profile({})
    predicted = plan_startup(model, cpu, resolve(KV_BYTES_FLAGS, cpu, model))
    assert predicted.reason == KV_CACHE_TOO_SMALL and predicted.estimated_max_model_len == 31 * 128
    error = refusals.kv_bytes
    assert error.reason == KV_CACHE_TOO_SMALL, str(error)
    assert error.estimated_max_model_len == predicted.estimated_max_model_len
