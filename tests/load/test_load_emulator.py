"""The load phase against the real in-process emulator (uvicorn on loopback), with a scaled clock."""

from __future__ import annotations

import asyncio
import io
import itertools
from pathlib import Path

import httpx
import pytest

from tuner.clock import Clock
from tuner.emulator import Emulator
from tuner.load import Arrival, Workload, run_load
from tuner.load.conversation import ConversationSpec
from tuner.load.server_metrics import WANTED_SAMPLES, scrape_metrics
from tuner.load.trace_replay import reusable_tokens

SCALE = 20.0


def emulator(*extra: str) -> Emulator:
    args = ["--model", "llama-3.1-8b", "--gpu", "h100-80gb", "--max-model-len", "8192", "--time-scale", str(SCALE)]
    return Emulator.from_args([*args, *extra], log_stream=io.StringIO())


async def test_exact_lengths_and_figures_in_gpu_seconds() -> None:
    emu = emulator()
    async with emu.serve_http(host="127.0.0.1", port=0) as url:
        result = await run_load(
            url, "llama-3.1-8b", Workload(input_len=300, output_len=40), Arrival(concurrency=4, requests=16),
            clock=Clock(SCALE),
        )  # fmt: skip
    s = result.summary
    assert s.requests_succeeded == 16 and s.usage_from_server
    assert all(r.prompt_tokens == 300 and r.completion_tokens == 40 for r in result.records)
    # Llama-3.1-8B on an H100 decodes a small batch in ~6-12 ms a token: read in GPU seconds, not the 20x shorter
    # wall seconds (0.3-0.6 ms). Only a floor: a busy machine lengthens what the client sees, never shortens it.
    assert s.tpot.p50 > 0.004
    assert result.server is not None and result.server.running_max is not None


async def test_chat_prompt_lengths_are_exact_with_the_template_counted() -> None:
    emu = emulator()
    async with emu.serve_http(host="127.0.0.1", port=0) as url:
        result = await run_load(
            url, "llama-3.1-8b", Workload(input_len=200, output_len=8, api="chat"), Arrival(concurrency=2, requests=4),
            clock=Clock(SCALE),
        )  # fmt: skip
    assert result.summary.requests_succeeded == 4
    # Fitted through the emulator's /tokenize: its Llama-3-shaped template's 10 tokens are part of the 200.
    assert [r.prompt_tokens for r in result.records] == [200] * 4


async def test_small_max_num_seqs_is_diagnosed() -> None:
    emu = emulator("--max-num-seqs", "4")
    async with emu.serve_http(host="127.0.0.1", port=0) as url:
        result = await run_load(
            url, "llama-3.1-8b", Workload(input_len=64, output_len=200), Arrival(concurrency=12, requests=24),
            clock=Clock(SCALE), max_num_seqs=4,
        )  # fmt: skip
    assert result.server is not None and result.server.running_max == 4
    assert result.diagnosis.startswith("capped by max_num_seqs: 4 running")


async def test_too_long_a_prompt_is_http_4xx_with_vllm_message() -> None:
    emu = emulator()
    async with emu.serve_http(host="127.0.0.1", port=0) as url:
        result = await run_load(
            url, "llama-3.1-8b", Workload(input_len=8200, output_len=500), Arrival(concurrency=1, requests=2),
            clock=Clock(SCALE), scrape_metrics=False,
        )  # fmt: skip
    assert result.summary.failures == {"http_4xx": 2}
    assert "maximum context length" in result.summary.failure_examples["http_4xx"]


async def test_a_prompt_and_output_over_the_limit_come_back_short() -> None:
    """vLLM 0.32 shortens the output to fit max_model_len and answers 200: the client counts it short."""
    emu = emulator()
    async with emu.serve_http(host="127.0.0.1", port=0) as url:
        result = await run_load(
            url, "llama-3.1-8b", Workload(input_len=8000, output_len=500), Arrival(concurrency=1, requests=2),
            clock=Clock(SCALE), scrape_metrics=False,
        )  # fmt: skip
    assert result.summary.failures == {"short_output": 2}


async def test_the_scrape_gets_the_filtered_page_below_metrics_as_from_vllm() -> None:
    emu = emulator()
    async with emu.serve_http(host="127.0.0.1", port=0) as url, httpx.AsyncClient(base_url=url) as client:
        whole = (await client.get("/metrics")).text
        part = (await client.get("/metrics/", params={"name[]": list(WANTED_SAMPLES)})).text
        async with scrape_metrics(client, url, clock=Clock(SCALE), model="llama-3.1-8b") as scraper:
            while not scraper.samples and not scraper.failures:
                await asyncio.sleep(0.01)
    assert "vllm:e2e_request_latency_seconds_bucket" in whole and "vllm:e2e_request_latency" not in part
    assert "vllm:num_requests_running{" in part and "vllm:inter_token_latency_seconds_bucket{" in part
    assert scraper.filtered and scraper.error is None
    assert all(s.running == 0.0 and s.itl is not None for s in scraper.samples)


async def test_a_mooncake_trace_s_shared_blocks_are_the_emulator_s_prefix_cache_hits() -> None:
    trace = Path(__file__).parent.parent / "data" / "traces" / "mooncake.jsonl"
    emu = emulator("--enable-prefix-caching")
    async with emu.serve_http(host="127.0.0.1", port=0) as url:
        result = await run_load(
            url, "llama-3.1-8b", Workload(seed=2), Arrival(trace=trace, speedup=0.5), clock=Clock(SCALE),
        )  # fmt: skip
    assert [r.prompt_tokens for r in result.records] == [1200, 700, 1100, 300]
    # hash id 0 (512 tokens) again in the 2nd request, 0 and 1 (1024) in the 3rd: 1536 of 3300 prompt tokens
    requests = Arrival(trace=trace).trace_requests()
    assert sum(reusable_tokens(requests, 512)) == 1536
    assert result.server is not None and result.server.prefix_cache_hit_rate == pytest.approx(1536 / 3300)


async def test_a_conversations_later_turns_hit_the_emulators_prefix_cache() -> None:
    wl = Workload(conversations=ConversationSpec(turns=4, input_len=64, output_len=32, system_len=100), seed=2)
    rates = {}
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        emu = emulator(caching)
        async with emu.serve_http(host="127.0.0.1", port=0) as url:
            result = await run_load(
                url, "llama-3.1-8b", wl, Arrival(concurrency=2, requests=16), clock=Clock(SCALE)
            )  # fmt: skip
        assert result.summary.requests_succeeded == 16
        assert result.server is not None and result.turns is not None
        # Two users share the 16 requests: who sends more depends on the answers' timing, not the turns' count.
        assert result.turns.first_turns + result.turns.later_turns == 16 and result.turns.first_turns >= 4
        # Each turn's prompt holds the one before: it grows by an answer and a message at every turn.
        by_turn = [b for t in range(4) if (b := [r.prompt_tokens for r in result.records if r.turn == t])]
        assert all(min(later) > max(earlier) for earlier, later in itertools.pairwise(by_turn))
        rates[caching] = result.server.prefix_cache_hit_rate
    # With the cache, a later turn finds its whole history (the previous prompt's full blocks) in it: well over
    # half of all prompt tokens; without it, none.
    hit = rates["--enable-prefix-caching"]
    assert hit is not None and hit > 0.5
    assert not rates["--no-enable-prefix-caching"]
