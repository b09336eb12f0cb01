"""Percentiles, summary, goodput and SLOs against hand-computed cases."""

from __future__ import annotations

import pytest

from tuner.errors import ConfigError
from tuner.load import RequestRecord
from tuner.scoring import NO_DATA_VIOLATION, Percentiles, is_good, parse_slo, percentile, summarize


def rec(
    i: int, *, ttft: float | None = 0.1, e2e: float = 1.0, out: int = 10, ok: bool = True, **kw: object
) -> RequestRecord:
    return RequestRecord(
        index=i,
        start_s=float(i),
        ttft_s=ttft,
        itl_s=kw.pop("itl", []),  # type: ignore[arg-type]
        e2e_s=e2e,
        prompt_tokens=kw.pop("prompt", 100),  # type: ignore[arg-type]
        completion_tokens=out,
        ok=ok,
        **kw,  # type: ignore[arg-type]
    )


def test_percentile_interpolates_like_numpy_linear() -> None:
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    # rank (n-1)*q: p50 -> 4.5 -> 5.5; p90 -> 8.1 -> 9.1; p95 -> 8.55 -> 9.55; p99 -> 8.91 -> 9.91
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 95) == pytest.approx(9.55)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0  # unsorted input
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 95) == 0.0


def test_percentiles_model() -> None:
    p = Percentiles.of([0.2, 0.4, 0.6, 0.8])
    assert (p.count, p.mean, p.max) == (4, pytest.approx(0.5), 0.8)
    assert p.p50 == pytest.approx(0.5)
    assert p.p95 == pytest.approx(0.77)  # rank 3 x 0.95 = 2.85 -> 0.6 + 0.85 x 0.2
    assert Percentiles.of([]).count == 0


def test_summarize_counts_throughput_and_tpot() -> None:
    records = [
        rec(0, ttft=0.5, e2e=2.5, out=5, itl=[0.5, 0.5, 0.5, 0.5]),  # tpot (2.5-0.5)/4 = 0.5
        rec(1, ttft=0.2, e2e=1.2, out=11, itl=[0.1] * 10),  # tpot 1.0/10 = 0.1
        rec(2, ttft=None, e2e=3.0, out=0, ok=False, error_class="timeout", error_message="slow"),
        rec(3, ttft=None, e2e=0.1, out=0, ok=False, error_class="http_5xx", error_message="HTTP 500: boom"),
        rec(4, ttft=None, e2e=0.1, out=0, ok=False, error_class="http_5xx", error_message="HTTP 500: again"),
        rec(5, ttft=9.0, e2e=9.0, out=1, warmup=True),
    ]
    s = summarize(records, duration_s=4.0)
    assert (s.requests_sent, s.requests_succeeded, s.requests_failed) == (5, 2, 3)
    assert s.failures == {"http_5xx": 2, "timeout": 1}
    assert list(s.failures) == ["http_5xx", "timeout"]  # most frequent first
    assert s.failure_examples == {"timeout": "slow", "http_5xx": "HTTP 500: boom"}
    assert s.success_rate == pytest.approx(0.4)
    assert s.request_throughput == pytest.approx(2 / 4.0)
    assert s.output_throughput == pytest.approx(16 / 4.0)
    assert s.total_throughput == pytest.approx((16 + 200) / 4.0)
    assert s.tpot.mean == pytest.approx(0.3)
    assert s.ttft.max == 0.5  # the warm-up's 9 s is excluded
    assert s.itl.count == 14
    assert s.e2e.p50 == pytest.approx(1.85)
    # busy time of every measured request (failures too) over the duration: (2.5+1.2+3+0.1+0.1)/4
    assert s.concurrency == pytest.approx(6.9 / 4.0)
    assert s.usage_from_server


def test_goodput_counts_requests_meeting_every_latency_slo() -> None:
    records = [
        rec(0, ttft=0.1, e2e=1.0),
        rec(1, ttft=0.6, e2e=1.0),  # misses ttft
        rec(2, ttft=0.1, e2e=6.0),  # misses e2e
        rec(3, ttft=0.2, e2e=4.9),
        rec(4, ttft=None, e2e=0.1, ok=False, error_class="http_5xx"),
    ]
    slos = [parse_slo("ttft_p95<=500ms"), parse_slo("e2e_p95<=5s"), parse_slo("success_rate>=0.5")]
    s = summarize(records, duration_s=2.0, slos=slos)
    assert s.goodput == pytest.approx(2 / 2.0)
    assert summarize(records, duration_s=2.0).goodput == pytest.approx(4 / 2.0)


def test_goodput_judges_each_request_on_its_own_ttft_tpot_and_e2e() -> None:
    # TPOT of a request is (e2e - ttft) / (tokens - 1): its own mean gap after the first token.
    records = [
        rec(0, ttft=0.5, e2e=0.5 + 9 * 0.05),  # good: 0.5 s, 50 ms, 0.95 s
        rec(1, ttft=1.0, e2e=1.0 + 9 * 0.2),  # meets TTFT and e2e, misses TPOT (200 ms)
        rec(2, ttft=3.0, e2e=3.0 + 9 * 0.05),  # misses TTFT only
        rec(3, ttft=0.5, e2e=11.0, out=1000),  # TTFT and TPOT (10.5 ms) met, e2e missed
        rec(4, ttft=None, e2e=0.2, ok=False, error_class="http_5xx"),  # failed: never good
        rec(5, ttft=0.3, e2e=0.3, out=1),  # one token: no decode, so no TPOT to miss
        rec(6, ttft=2.0, e2e=2.0 + 9 * 0.1),  # on every bound: <= holds
        rec(7, ttft=0.1, e2e=0.2, warmup=True),  # warm-up: not counted either way
    ]
    slos = [parse_slo(s) for s in ("ttft_p95<=2s", "tpot_p95<=100ms", "e2e_p99<=10s", "success_rate>=0.9")]
    assert [is_good(r, slos) for r in records] == [True, False, False, False, False, True, True, True]
    s = summarize(records, duration_s=2.0, slos=slos)
    assert s.goodput == pytest.approx(3 / 2.0)
    assert s.good_share == pytest.approx(3 / 7)
    # Without a latency SLO every success is good: the share is the success rate.
    plain = summarize(records, duration_s=2.0, slos=[parse_slo("success_rate>=0.9")])
    assert plain.good_share == pytest.approx(6 / 7) == pytest.approx(plain.success_rate)


def test_good_share_is_a_fraction_an_slo_can_name() -> None:
    assert parse_slo("good_share >= 99%").threshold == pytest.approx(0.99)
    with pytest.raises(ConfigError, match="good_share is a fraction"):
        parse_slo("good_share>=1.5")


def test_parse_slo_units_and_spacing() -> None:
    assert parse_slo("e2e_p95<=5s").threshold == 5.0
    s = parse_slo("ttft_p95 <= 500ms")
    assert (s.metric, s.op, s.threshold) == ("ttft_p95", "<=", pytest.approx(0.5))
    assert parse_slo("itl_p99<200us").threshold == pytest.approx(2e-4)
    assert parse_slo("success_rate>=0.99").threshold == 0.99
    assert parse_slo("success_rate >= 99%").threshold == pytest.approx(0.99)
    assert parse_slo("tpot_mean<=0.05").threshold == 0.05
    assert str(parse_slo("ttft_p95<=500ms")) == "ttft_p95<=500ms"
    assert str(parse_slo("e2e_p95<=5s")) == "e2e_p95<=5s"


@pytest.mark.parametrize("bad", ["latency<=5s", "e2e_p42<=1s", "e2e_p95=5s", "e2e_p95<=fast", "success_rate>=2"])
def test_parse_slo_rejects_with_allowed_metrics(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"e2e_p95|success_rate"):
        parse_slo(bad)


def test_violation_is_relative_and_signed() -> None:
    s = summarize([rec(i, e2e=e) for i, e in enumerate([1.0, 2.0, 3.0, 4.0, 6.0])], duration_s=10.0)
    # e2e p95: rank 3.8 -> 4 + 0.8*2 = 5.6
    assert parse_slo("e2e_p95<=5s").violation(s) == pytest.approx(0.12)
    assert parse_slo("e2e_p95<=7s").violation(s) == pytest.approx((5.6 - 7) / 7)
    assert parse_slo("success_rate>=0.99").violation(s) == pytest.approx(-0.01 / 0.99)
    assert parse_slo("e2e_max<6s").violation(s) > 0  # exactly on a strict bound misses it
    assert parse_slo("e2e_max<6s").met(s) is False
    assert parse_slo("e2e_max<=6s").met(s) is True


def test_latency_slo_without_any_success_is_violated() -> None:
    s = summarize([rec(0, ttft=None, ok=False, error_class="timeout")], duration_s=1.0)
    assert parse_slo("e2e_p95<=5s").violation(s) == NO_DATA_VIOLATION
    assert parse_slo("success_rate>=0.5").violation(s) == pytest.approx(1.0)


def test_summarize_empty() -> None:
    s = summarize([], duration_s=0.0)
    assert (s.requests_sent, s.success_rate, s.request_throughput, s.goodput) == (0, 0.0, 0.0, 0.0)


def test_usage_from_server_false_when_any_success_counted_chunks() -> None:
    s = summarize([rec(0), rec(1, usage_from_server=False)], duration_s=1.0)
    assert s.usage_from_server is False
