"""Scheduling: closed loop keeps exactly N in flight, open loop keeps its rate, warm-up is excluded, stops stop."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from pathlib import Path

import httpx
import pytest
from load_fakes import BrokenServer, FakeVllm, LoopClock, WordServer, fake_time, made_up_words

from tests.servers import free_port
from tuner.clock import Clock
from tuner.load import Arrival, UniformLength, Workload, run_load
from tuner.load.arrival import interarrival_gaps
from tuner.load.runner import LoadProgress
from tuner.scoring import parse_slo

WL = Workload(input_len=16, output_len=5, seed=3)


@fake_time
async def test_closed_loop_keeps_exactly_n_in_flight() -> None:
    # Output lengths vary 1..20 tokens: a batch (gather) would idle users until the longest ends; a closed loop
    # replaces each finished request at once, so the server sees N in flight nearly all the time, never more.
    fake = FakeVllm(token_s=0.002)
    wl = Workload(input_len=16, output_len=UniformLength(low=1, high=20), seed=3)
    samples: list[int] = []

    async def sample() -> None:
        while True:
            samples.append(fake.in_flight)
            await asyncio.sleep(0.002)

    async with fake.client() as client:
        sampler = asyncio.create_task(sample())
        try:
            result = await run_load(
                "http://fake", "m", wl, Arrival(concurrency=8, requests=160), client=client, clock=LoopClock()
            )
        finally:
            sampler.cancel()
    assert fake.peak == 8 and result.peak_in_flight == 8
    assert max(samples) == 8
    middle = samples[len(samples) // 5 : -len(samples) // 5]
    assert statistics.fmean(middle) > 7.0
    assert result.summary.requests_sent == 160 and result.summary.requests_succeeded == 160
    assert result.summary.concurrency > 6.5
    assert result.mode == "closed loop, 8 users"
    assert [r.index for r in result.records] == list(range(160))


def test_poisson_gaps_have_the_rate_and_the_spread() -> None:
    gaps = interarrival_gaps(Arrival(rate=20.0, requests=1, seed=1))
    sample = [next(gaps) for _ in range(4000)]
    assert statistics.fmean(sample) == pytest.approx(1 / 20, rel=0.05)
    # Exponential: coefficient of variation 1.
    assert statistics.stdev(sample) / statistics.fmean(sample) == pytest.approx(1.0, rel=0.1)
    again = interarrival_gaps(Arrival(rate=20.0, requests=1, seed=1))
    assert [next(again) for _ in range(10)] == sample[:10]


def test_gamma_burstiness_keeps_the_mean_and_changes_the_spread() -> None:
    for shape in (0.25, 4.0):
        gaps = interarrival_gaps(Arrival(rate=10.0, requests=1, burstiness=shape, seed=2))
        sample = [next(gaps) for _ in range(4000)]
        assert statistics.fmean(sample) == pytest.approx(0.1, rel=0.1)
        cv = statistics.stdev(sample) / statistics.fmean(sample)
        assert cv == pytest.approx(shape**-0.5, rel=0.15)  # gamma CV = 1/sqrt(shape)
    constant = interarrival_gaps(Arrival(rate=4.0, requests=1, process="constant"))
    assert {next(constant) for _ in range(5)} == {0.25}


@fake_time
async def test_open_loop_sends_at_the_rate() -> None:
    # 40 arrivals at 50 emulated req/s on a clock scaled x0.5: 25 req/s of (fake) wall time.
    fake = FakeVllm(token_s=0.001)
    async with fake.client() as client:
        result = await run_load(
            "http://fake",
            "m",
            Workload(input_len=8, output_len=2),
            Arrival(rate=50.0, requests=40, process="constant"),
            client=client,
            clock=LoopClock(0.5),
        )
    starts = [r.start_s for r in result.records]
    assert result.summary.requests_succeeded == 40
    assert [b - a for a, b in itertools.pairwise(starts)] == pytest.approx([1 / 50] * 39)
    # The server saw them 1/25 wall second apart: the clock's scale is applied to the sleeps, not only the figures.
    arrivals = fake.arrivals
    assert [b - a for a, b in itertools.pairwise(arrivals)] == pytest.approx([1 / 25] * 39)
    assert result.mode == "open loop, constant 50 req/s"


@fake_time
async def test_open_loop_poisson_rate_seeded() -> None:
    fake = FakeVllm()
    async with fake.client() as client:
        result = await run_load(
            "http://fake",
            "m",
            Workload(input_len=8, output_len=1),
            Arrival(rate=150.0, requests=120, seed=5),
            client=client,
            clock=LoopClock(),
        )
    starts = [r.start_s for r in result.records]
    gaps = interarrival_gaps(Arrival(rate=150.0, requests=1, seed=5))
    # The seed's own gaps, each to its due time (looptime keeps time in microseconds).
    expected = [next(gaps) for _ in range(119)]
    assert [b - a for a, b in itertools.pairwise(starts)] == pytest.approx(expected, abs=2e-6)
    assert (len(starts) - 1) / (starts[-1] - starts[0]) == pytest.approx(150.0, rel=0.3)


async def test_open_loop_max_in_flight_caps() -> None:
    fake = FakeVllm(ttft_s=0.05)
    async with fake.client() as client:
        result = await run_load(
            "http://fake", "m", WL, Arrival(rate=500.0, requests=30, max_in_flight=3), client=client
        )
    assert fake.peak == 3 and result.summary.requests_succeeded == 30


async def test_warmup_requests_are_sent_but_excluded() -> None:
    fake = FakeVllm()
    async with fake.client() as client:
        result = await run_load(
            "http://fake", "m", WL, Arrival(concurrency=2, requests=10, warmup_requests=4), client=client
        )
    assert len(fake.bodies) == 14
    assert [r.warmup for r in result.records] == [True] * 4 + [False] * 10
    assert result.summary.requests_sent == 10


@fake_time
async def test_duration_stops_the_measured_phase() -> None:
    fake = FakeVllm(token_s=0.005)  # a request: 4 gaps of 5 ms
    async with fake.client() as client:
        result = await run_load(
            "http://fake", "m", WL, Arrival(concurrency=2, duration_s=0.3, warmup_s=0.1), client=client,
            clock=LoopClock(),
        )  # fmt: skip
    warm = [r for r in result.records if r.warmup]
    assert warm and all(r.start_s < 0.1 for r in warm)
    measured = [r for r in result.records if not r.warmup]
    assert measured and all(0.1 <= r.start_s < 0.4 for r in measured)
    # 2 users x 0.3 s / 20 ms a request, the last ones cut at the end of the phase or let finish.
    assert 28 <= len(measured) <= 32
    assert 0.3 <= result.summary.duration_s <= 0.3 + 0.02


@fake_time
async def test_should_stop_abandons_in_flight_requests() -> None:
    fake = FakeVllm(ttft_s=0.05, token_s=0.05)
    progress: list[LoadProgress] = []
    async with fake.client() as client:
        result = await run_load(
            "http://fake",
            "m",
            WL,
            Arrival(concurrency=4, requests=1000),
            client=client,
            on_progress=progress.append,
            should_stop=lambda: len(progress) >= 6,
            clock=LoopClock(),
        )
    assert result.stopped_early
    assert 6 <= len(result.records) < 20
    assert all(r.ok for r in result.records)
    assert fake.in_flight == 0


async def test_every_record_comes_back_from_a_broken_server() -> None:
    server = BrokenServer(["ok", "http_500", "cut", "garbage", "reset", "stall", "http_400"], stall_s=30.0, tokens=5)
    async with server.serve() as base:
        # 3 s: the stalls' timeout, and ample for the others' few bytes on a machine with both cores busy
        result = await run_load(
            base, "m", WL, Arrival(concurrency=3, requests=14), request_timeout_s=3.0, scrape_metrics=False
        )
    s = result.summary
    assert s.requests_sent == 14
    assert s.failures == {
        "connection_reset": 2,
        "http_4xx": 2,
        "http_5xx": 2,
        "malformed_sse": 2,
        "stream_cut": 2,
        "timeout": 2,
    }
    assert s.requests_succeeded == 2
    assert set(s.failure_examples) == set(s.failures)
    assert "server errors" in result.diagnosis


async def test_unreachable_target_stops_soon_with_every_request_refused() -> None:
    result = await run_load(
        f"http://127.0.0.1:{free_port()}", "m", WL, Arrival(concurrency=4, requests=10_000), scrape_metrics=False
    )
    assert result.stopped_early
    assert result.summary.requests_succeeded == 0
    assert set(result.summary.failures) == {"connection_refused"}
    assert result.summary.requests_sent < 100
    assert result.diagnosis.startswith("all requests failed: connection_refused")


async def test_request_bodies_are_reproducible_token_ids() -> None:
    bodies = []
    for _ in range(2):
        fake = FakeVllm()
        async with fake.client() as client:
            await run_load("http://fake", "m", WL, Arrival(concurrency=1, requests=3), client=client)
        bodies.append(fake.bodies)
    assert bodies[0] == bodies[1]
    b = bodies[0][0]
    assert b["model"] == "m" and b["max_tokens"] == 5 and "min_tokens" not in b and b["ignore_eos"] is True
    assert b["stream_options"] == {"include_usage": True}
    assert isinstance(b["prompt"], list) and len(b["prompt"]) == 16


async def test_short_replies_fail_as_short_output_against_the_success_rate() -> None:
    server = WordServer(made_up_words(100), short_by=2)
    async with server.client() as client:
        result = await run_load(
            "http://fake", "m", Workload(input_len=20, output_len=10), Arrival(concurrency=2, requests=6),
            slos=[parse_slo("success_rate>=0.99")], client=client,
        )  # fmt: skip
    s = result.summary
    assert s.failures == {"short_output": 6} and s.requests_succeeded == 0 and s.success_rate == 0
    assert s.failure_examples["short_output"] == "asked 10 output tokens, got 8 (finish_reason length)"
    assert not parse_slo("success_rate>=0.99").met(s)


async def test_records_line_up_with_the_wall_clock() -> None:
    # A packet capture stamps the wall clock; the records' starts, moved onto it by the run's anchor, fall within the
    # run and before the server sees each request (give or take the two clocks' drift: 1 ms). Clock(2): an emulated
    # second is half a wall second.
    fake = FakeVllm(token_s=0.001)
    arrivals: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            arrivals.append(time.time())
        return await fake.handler(request)

    before = time.time()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        arrival = Arrival(concurrency=1, requests=6)
        result = await run_load("http://fake", "m", WL, arrival, client=client, clock=Clock(2), scrape_metrics=False)
    after = time.time()
    assert result.origin_unix_s is not None and before <= result.origin_unix_s <= after
    starts = [result.origin_unix_s + r.start_s / 2 for r in result.records]
    assert len(arrivals) == len(starts) == 6
    for start, seen in zip(starts, arrivals, strict=True):
        assert before <= start <= seen + 1e-3 and seen <= after


TRACES = Path(__file__).parent.parent / "data" / "traces"


@fake_time
async def test_a_trace_is_sent_at_its_own_times_sliced_and_sped_up() -> None:
    fake = FakeVllm(token_s=0.001)
    trace = TRACES / "mooncake.jsonl"
    async with fake.client() as client:
        result = await run_load(
            "http://fake",
            "m",
            Workload(seed=3),
            Arrival(trace=trace, start_s=0.2, duration_s=4.0, speedup=2),
            client=client,
            clock=LoopClock(),
        )
    # the slice [0.2, 4.2) s holds the requests at 0.25, 1.5 and 4.0 s, each sent (t - 0.2) / 2 after the start
    assert [r.start_s for r in result.records] == pytest.approx([0.025, 0.65, 1.9], abs=2e-6)
    assert [b["max_tokens"] for b in fake.bodies] == [12, 80, 5]
    assert [len(b["prompt"]) for b in fake.bodies] == [700, 1100, 300]  # type: ignore[arg-type]
    assert result.summary.requests_succeeded == 3 and result.mode.startswith("trace mooncake.jsonl")


@fake_time
async def test_a_trace_with_an_in_flight_cap_waits_for_a_slot() -> None:
    fake = FakeVllm(ttft_s=1.0)
    async with fake.client() as client:
        await run_load(
            "http://fake",
            "m",
            Workload(),
            Arrival(trace=TRACES / "plain.jsonl", max_in_flight=1),
            client=client,
            clock=LoopClock(),
        )
    # 0.0 and 0.5 would overlap a 1 s request: the second waits for the first to end; the third is due at 2.25
    assert fake.peak == 1
    assert [a - fake.arrivals[0] for a in fake.arrivals] == pytest.approx([0.0, 1.0, 2.25], abs=0.01)


@fake_time
async def test_a_trace_stops_early_once_an_slo_is_missed_for_certain(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(f'{{"t": {i}, "input_len": 8, "output_len": 2}}\n' for i in range(20)))
    fake = FakeVllm(ttft_s=2.0)
    async with fake.client() as client:
        result = await run_load(
            "http://fake",
            "m",
            Workload(),
            Arrival(trace=trace),
            slos=[parse_slo("ttft_max<=1s")],
            client=client,
            clock=LoopClock(),
            stop_on_slo_miss=True,
        )
    # the slice's 20 requests are the count the guard judges: the first answer over the maximum decides
    assert result.slo_stop is not None and result.slo_stop.startswith("ttft_max<=1s cannot be met")
    assert len(fake.bodies) < 20
