"""The /metrics scrape against real vLLM (the shared session server): every figure the summary reports is read."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.real_vllm import RealVllm
from tuner.clock import REAL_TIME
from tuner.load.server_metrics import MetricsScraper, parse_metrics, scrape_metrics

pytestmark = pytest.mark.real_vllm

WAVE = 24
MAX_WAVES = 20
OUTPUT_TOKENS = 256  # long enough (seconds) for several scrapes to find requests running
# A shared prefix of two of the CPU build's 128-token blocks (only full blocks are cached), so the prefix cache
# has something to hit once the first request has filled it.
PREFIX = "alpha beta gamma delta " * 64


async def test_scrape_during_load_reads_every_figure(real_vllm: RealVllm) -> None:
    async with httpx.AsyncClient(base_url=real_vllm.base_url, timeout=120.0, trust_env=False) as client:
        async with scrape_metrics(
            client, real_vllm.base_url, clock=REAL_TIME, model=real_vllm.model, interval_s=0.25
        ) as scraper:
            codes = await _load_until_a_scrape_sees_it(client, real_vllm.model, scraper)
        page = (await client.get("/metrics")).text
    requests = len(codes)
    assert codes == [200] * requests
    # A scrape the loaded server did not answer within its timeout is a failure the run goes on without: most read.
    assert scraper.failures < len(scraper.samples), scraper.error

    summary = scraper.summary()
    assert summary is not None and summary.samples >= 2
    assert summary.running_max is not None and summary.running_max >= 1
    assert summary.kv_usage_max is not None and summary.kv_usage_max > 0
    assert summary.waiting_max is not None and summary.preemptions == 0
    assert summary.generation_tokens is not None and 0 < summary.generation_tokens <= requests * OUTPUT_TOKENS
    assert summary.prefix_cache_hit_rate is not None and 0 < summary.prefix_cache_hit_rate < 1
    assert summary.queue_time_mean_s is not None and summary.queue_time_p95_bound_s is not None
    assert summary.itl_mean_s is not None and summary.itl_mean_s > 0

    idle = parse_metrics(page, model=real_vllm.model)
    assert (idle.running, idle.waiting, idle.kv_usage) == (0.0, 0.0, 0.0)
    assert idle.queue_time is not None and idle.queue_time.count >= requests


async def _load_until_a_scrape_sees_it(client: httpx.AsyncClient, model: str, scraper: MetricsScraper) -> list[int]:
    """The first request alone (it fills the prefix cache), then waves of WAVE at once until one of the scraper's
    samples caught requests running in the KV cache: on a busy machine a wave can fall between two scrapes."""
    codes = [await _completion(client, model, 0)]
    for _ in range(MAX_WAVES):
        start = len(codes)
        codes += await asyncio.gather(*(_completion(client, model, start + j) for j in range(WAVE)))
        if any((s.running or 0) >= 1 and (s.kv_usage or 0) > 0 for s in scraper.samples):
            break
    return codes


async def _completion(client: httpx.AsyncClient, model: str, i: int) -> int:
    body = {"model": model, "prompt": f"{PREFIX}{i}", "max_tokens": OUTPUT_TOKENS, "min_tokens": OUTPUT_TOKENS}
    response = await client.post("/v1/completions", json={**body, "ignore_eos": True})
    return response.status_code
