"""A trace as the load of a capacity search: each rate it tries is the trace played faster or slower, its send
times divided alike (exact on fake time), its lengths and shared blocks kept, its prompts written afresh a step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from load_fakes import FakeVllm, LoopClock, fake_time

from tuner.errors import ConfigError
from tuner.load import Arrival, Workload, find_max_rate
from tuner.load.capacity_search import trace_probe
from tuner.load.results import CapacitySearchResult
from tuner.scoring import parse_slo

TRACES = Path(__file__).parent.parent / "data" / "traces"
MOONCAKE = TRACES / "mooncake.jsonl"  # sent at 0, 0.25, 1.5 and 4 s: 3 gaps over 4 s, 0.75 req/s
TIMES = [0.0, 0.25, 1.5, 4.0]
LENGTHS = [40, 12, 80, 5]


def _steps(values: list[float], size: int) -> list[list[float]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


def test_the_slice_s_own_rate_and_a_rate_s_speed_up() -> None:
    trace = Arrival(trace=MOONCAKE)
    assert trace.trace_rate() == pytest.approx(0.75)
    # the own rate is the slice's whatever speed-up the job gives
    assert Arrival(trace=MOONCAKE, speedup=4).trace_rate() == pytest.approx(0.75)
    fast = trace.at_rate(3.0, seed=5)
    assert fast.speedup == pytest.approx(4.0) and fast.seed == 5
    assert [r.send_s for r in fast.trace_requests()] == pytest.approx([t / 4 for t in TIMES])


@fake_time
async def test_each_step_sends_the_trace_s_times_divided_by_its_speed_up() -> None:
    fake = FakeVllm(token_s=0.001)
    result = await _search(fake, "e2e_p95<=10s", max_steps=3, trace=Arrival(trace=MOONCAKE, speedup=2))
    # speedup 2 is where it starts (no probe): 1.5 req/s, then up by half each step as every one meets the SLO
    assert [s.rate for s in result.steps] == pytest.approx([1.5, 2.25, 3.375])
    assert [s.speedup for s in result.steps] == pytest.approx([2.0, 3.0, 4.5])
    assert result.probe is None and result.trace_rate == pytest.approx(0.75)
    assert result.best_rate == pytest.approx(3.375) and result.best_speedup == pytest.approx(4.5)
    sent = _steps(fake.arrivals, 4)
    assert len(sent) == 3
    for step, times in zip(result.steps, sent, strict=True):
        assert [t - times[0] for t in times] == pytest.approx([t / step.speedup for t in TIMES], abs=1e-6)
    # every step the trace's lengths; its shared blocks shared within a step, written afresh the next
    bodies = _steps(fake.bodies, 4)  # type: ignore[arg-type]
    assert all([b["max_tokens"] for b in step] == LENGTHS for step in bodies)
    first, second = bodies[0], bodies[1]
    assert first[0]["prompt"][:512] == first[1]["prompt"][:512]  # type: ignore[index]
    assert first[0]["prompt"][:512] != second[0]["prompt"][:512]  # type: ignore[index]


@fake_time
async def test_the_probe_is_the_trace_s_requests_at_most_n_in_flight_and_the_first_step_its_rate() -> None:
    fake = FakeVllm(token_s=0.01)
    result = await _search(fake, "e2e_p95<=10s", max_steps=1, probe_concurrency=2, trace=Arrival(trace=MOONCAKE))
    probe = trace_probe(Arrival(trace=MOONCAKE), 2)
    assert probe.max_in_flight == 2 and probe.warmup_requests == 1 and probe.requests == 3
    assert result.probe is not None and result.probe.requests_sent == 3
    # the probe's 4 requests went out as slots freed, not at the trace's times; then the step at its throughput
    assert fake.arrivals[1] - fake.arrivals[0] == 0 and fake.arrivals[2] > fake.arrivals[0]
    assert result.steps[0].rate == pytest.approx(result.estimate_rate)
    assert result.steps[0].speedup == pytest.approx(result.steps[0].rate / 0.75)


@fake_time
async def test_the_search_finds_the_highest_speed_up_that_meets_the_slo() -> None:
    # one request at a time, 0.5 s each: played too fast, the trace's requests queue and e2e grows
    fake = FakeVllm(ttft_s=0.5, slots=1)
    result = await _search(fake, "e2e_max<=1s", max_steps=6, trace=Arrival(trace=MOONCAKE, speedup=1.5))
    met = [s.rate for s in result.steps if s.meets_slos]
    missed = [s.rate for s in result.steps if not s.meets_slos]
    assert met and missed and result.best_rate == max(met) < min(missed)
    # the first two end at 1 s whatever the speed-up; the third, sent at 1.5 s / x, then takes 1 s at most while
    # 1 + 0.5 - 1.5 / x <= 1: up to x3, and every step judged so
    assert result.best_speedup is not None and result.best_speedup <= 3.0
    assert all(s.speedup is not None and s.speedup > 3.0 for s in result.steps if not s.meets_slos)


@fake_time
async def test_a_slice_of_one_instant_cannot_be_sped_up(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"t": 3, "input_len": 5, "output_len": 1}\n')
    with pytest.raises(ConfigError, match="its slice needs at least two requests at different times"):
        await find_max_rate("http://fake", "m", Workload(), [parse_slo("e2e_p95<=1s")], trace=Arrival(trace=trace))


async def _search(fake: FakeVllm, slo: str, **options: Any) -> CapacitySearchResult:
    """The capacity search against the fake server on the test loop's clock, judged by one SLO."""
    async with fake.client() as client:
        return await find_max_rate(
            "http://fake", "m", Workload(), [parse_slo(slo)], client=client, clock=LoopClock(), **options
        )
