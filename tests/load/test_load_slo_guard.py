"""Stopping a run once an SLO is missed for certain: the exact bounds, hand-computed, and the runner's use of them."""

from __future__ import annotations

import random

import pytest
from load_fakes import BrokenServer

from tuner.clock import Clock
from tuner.load import Arrival, RequestRecord, Workload, run_load
from tuner.load.slo_guard import SloGuard
from tuner.scoring import parse_slo, summarize


def rec(i: int, e2e: float = 0.5, *, ok: bool = True, warmup: bool = False, ttft: float = 0.1) -> RequestRecord:
    return RequestRecord(
        index=i,
        start_s=float(i),
        ttft_s=ttft if ok else None,
        itl_s=[0.01] * 9 if ok else [],
        e2e_s=e2e,
        prompt_tokens=10,
        completion_tokens=10 if ok else 0,
        ok=ok,
        error_class=None if ok else "http_5xx",
        error_message=None if ok else "HTTP 500",
        warmup=warmup,
    )


def test_success_rate_is_lost_at_the_first_failure_beyond_the_allowance() -> None:
    # 100 requests at >= 0.99: one failure may happen (99/100 meets it), the second cannot be made up.
    guard = SloGuard([parse_slo("success_rate>=0.99")], 100)
    assert guard.add(rec(0, ok=False)) is None
    assert guard.add(rec(1)) is None
    reason = guard.add(rec(2, ok=False))
    assert reason == "success_rate>=0.99 cannot be met: 2 of the 100 measured requests failed (at most 1 may)"


def test_p95_is_lost_when_the_rank_above_it_is_filled_even_if_all_others_are_fast() -> None:
    # N = 96: p95 sits at rank 0.95 * 95 = 90.25, so it exceeds 1 s for sure once 96 - 90 = 6 values do.
    guard = SloGuard([parse_slo("e2e_p95<=1s")], 96)
    for i in range(5):
        assert guard.add(rec(i, e2e=2.0)) is None
    reason = guard.add(rec(5, e2e=2.0))
    assert reason is not None and "6 of the 96 measured requests are already over 1s (at most 5 may be)" in reason


def test_the_bound_is_exact_against_the_scoring_percentile() -> None:
    rng = random.Random(5)
    slo = parse_slo("e2e_p90<=1s")
    for n in (10, 37, 96, 200):
        # Tight: with one value fewer than the guard needs, the best case for the rest still meets the SLO...
        needed = next(k for k in range(1, n + 1) if _fires(slo, n, k))
        best_case = [rec(i, 2.0) for i in range(needed - 1)] + [rec(i, 0.0) for i in range(needed - 1, n)]
        assert slo.met(summarize(best_case, duration_s=1.0))
        # ...and sound: once it fires, any completion of the run misses it, as does the part seen.
        seen = [rec(i, 2.0) for i in range(needed)]
        assert not slo.met(summarize(seen, duration_s=1.0))
        for _ in range(20):
            rest = [rec(i, rng.uniform(0, 1.0)) for i in range(needed, rng.randint(needed, n))]
            assert not slo.met(summarize(seen + rest, duration_s=1.0))


def _fires(slo: object, n: int, k: int) -> bool:
    guard = SloGuard([slo], n)  # type: ignore[list-item]
    return any(guard.add(rec(i, 2.0)) is not None for i in range(k))


def test_max_and_mean_and_what_never_stops() -> None:
    assert SloGuard([parse_slo("ttft_max<=500ms")], 50).add(rec(0, ttft=0.6)) is not None
    mean = SloGuard([parse_slo("e2e_mean<=1s")], 4)
    assert [mean.add(rec(i, 1.5)) is not None for i in range(3)] == [False, False, True]  # 4.5 > 4 x 1 s
    # Warm-up requests do not count; failures are not latency samples; ITL and throughput have no bound.
    guard = SloGuard([parse_slo("e2e_max<=1s"), parse_slo("success_rate>=0.5")], 10)
    assert guard.add(rec(0, 9.0, warmup=True)) is None and guard.add(rec(1, 9.0, ok=False)) is None
    assert not SloGuard([parse_slo("itl_p95<=10ms"), parse_slo("output_throughput>=100")], 10).active


@pytest.mark.parametrize("stop", [True, False])
async def test_the_runner_stops_once_the_success_rate_is_lost_and_says_why(stop: bool) -> None:
    server = BrokenServer(["ok", "http_500"])  # every other request fails
    async with server.serve() as base:
        result = await run_load(
            base,
            "m",
            Workload(input_len=8, output_len=4, seed=1),
            Arrival(concurrency=2, requests=60),
            slos=[parse_slo("success_rate>=0.95")],
            clock=Clock(),
            scrape_metrics=False,
            stop_on_slo_miss=stop,
        )
    measured = [r for r in result.records if not r.warmup]
    if stop:
        assert result.stopped_early and result.slo_stop is not None
        assert result.slo_stop.startswith("success_rate>=0.95 cannot be met: 4 of the 60 measured requests failed")
        assert len(measured) < 20  # stopped after the 4th failure, not after 60 requests
        assert not parse_slo("success_rate>=0.95").met(result.summary)
    else:
        assert not result.stopped_early and result.slo_stop is None and len(measured) == 60


def test_good_share_is_lost_once_too_many_requests_are_not_good() -> None:
    # The goodput search's bound: 20 requests at >= 0.9 may hold 2 that are not good; the third cannot be made up.
    # Its requests are judged by the job's latency SLOs (`bounds`), not stopped on their percentiles.
    bounds = [parse_slo("e2e_p50<=1s"), parse_slo("ttft_p95<=200ms")]
    guard = SloGuard([parse_slo("good_share>=0.9")], 20, bounds=bounds)
    assert guard.active
    assert guard.add(rec(0, e2e=1.5)) is None  # over the e2e bound: not good (it would end an e2e_p50 guard later)
    assert guard.add(rec(1, ok=False)) is None  # failed: not good
    assert guard.add(rec(2, e2e=0.2, warmup=True, ok=False)) is None  # warm-up: not counted
    assert guard.add(rec(3, ttft=0.1)) is None
    reason = guard.add(rec(4, ttft=0.3))  # meets e2e, misses TTFT: not good either
    assert reason == (
        "good_share>=0.9 cannot be met: 3 of the 20 measured requests are not good (failed or over a latency bound) "
        "(at most 2 may)"
    )
    assert guard.not_good == 3 and guard.failed == 1
