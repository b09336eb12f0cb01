"""Capacity search: probe, bracket, bisect; bounded steps, every step reported, the best meets the SLOs.

In fake time (fake_time): the latencies the search bisects on are the fake server's, whatever the machine's load.
"""

from __future__ import annotations

import pytest
from load_fakes import FakeVllm, LoopClock, fake_time

from tuner.errors import ConfigError
from tuner.load import CapacityStep, Workload, find_max_rate
from tuner.scoring import parse_slo

WL = Workload(input_len=8, output_len=5)


@fake_time
async def test_finds_the_highest_rate_meeting_the_slo() -> None:
    # 4 slots x ~10 ms a request: ~400 req/s capacity; past it the queue (and e2e) grows.
    fake = FakeVllm(token_s=0.002, slots=4)
    seen: list[CapacityStep] = []
    slos = [parse_slo("e2e_p95<=40ms"), parse_slo("success_rate>=0.99")]
    async with fake.client() as client:
        result = await find_max_rate(
            "http://fake",
            "m",
            WL,
            slos,
            client=client,
            clock=LoopClock(),
            requests_per_step=60,
            max_steps=5,
            on_step=seen.append,
        )
    assert result.estimate_rate is not None and result.estimate_rate > 50
    assert 1 <= len(result.steps) <= 5 and seen == result.steps
    assert result.steps[0].rate == pytest.approx(result.estimate_rate)
    assert result.best_rate is not None and result.best is not None
    assert all(s.rate <= result.best_rate for s in result.steps if s.meets_slos)
    assert all(s.rate > result.best_rate for s in result.steps if not s.meets_slos)
    assert all(slo.met(result.best.summary) for slo in slos)
    assert result.best_rate == max(s.rate for s in result.steps if s.meets_slos)
    assert all(len(s.violations) == 2 for s in result.steps)


@fake_time
async def test_an_unreachable_slo_halves_and_reports_no_rate() -> None:
    fake = FakeVllm(token_s=0.001, ttft_s=0.001)  # fake time has no floor of its own: the first token takes 1 ms
    async with fake.client() as client:
        result = await find_max_rate(
            "http://fake",
            "m",
            WL,
            [parse_slo("ttft_p95<=1us")],
            client=client,
            clock=LoopClock(),
            requests_per_step=20,
            max_steps=3,
        )
    assert result.best_rate is None and result.best is None
    rates = [s.rate for s in result.steps]
    assert len(rates) == 3 and rates[1] == pytest.approx(rates[0] / 2) and rates[2] == pytest.approx(rates[0] / 4)


@fake_time
async def test_needs_an_slo() -> None:
    with pytest.raises(ConfigError, match="at least one SLO"):
        await find_max_rate("http://fake", "m", WL, [])
