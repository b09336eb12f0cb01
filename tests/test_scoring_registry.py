"""SLO names are read against the metric registry: a metric whose own name holds an underscore is one metric."""

from __future__ import annotations

import pytest

from tuner import scoring
from tuner.errors import ConfigError
from tuner.load import RequestRecord
from tuner.scoring import Metric, parse_slo
from tuner.ship.alerts import alert_rules

DECODE_TIME = Metric(
    "decode_time",
    "s",
    "decode",
    lambda r: (r.e2e_s - (r.ttft_s or 0.0),),
    lambda r, _: r.e2e_s - (r.ttft_s or 0.0),
    per_request=True,
    histogram="vllm:request_decode_time_seconds",
)


@pytest.fixture
def with_decode_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scoring, "METRICS", {**scoring.METRICS, DECODE_TIME.name: DECODE_TIME})


@pytest.mark.usefixtures("with_decode_time")
def test_a_metric_with_an_underscore_is_named_in_an_slo() -> None:
    slo = parse_slo("decode_time_p95 <= 1500ms")
    assert (slo.metric, slo.threshold, slo.is_latency) == ("decode_time_p95", 1.5, True)
    assert scoring.latency_of("decode_time_p99") == (DECODE_TIME, "p99")
    request = RequestRecord(index=0, start_s=0.0, ttft_s=0.5, itl_s=[0.1], e2e_s=1.8, completion_tokens=3, ok=True)
    assert slo.request_meets(request) and not parse_slo("decode_time_max<1s").request_meets(request)
    with pytest.raises(ConfigError, match="decode_time"):
        parse_slo("decode_p95<=1s")  # a prefix of a registered name is no metric


@pytest.mark.usefixtures("with_decode_time")
def test_its_alert_rule_asks_the_histogram_it_names() -> None:
    rule = next(
        r for r in alert_rules(["decode_time_p90<=2s"], queue_at_capacity=1) if r["alert"].startswith("VllmSlo")
    )
    assert rule["alert"] == "VllmSloDecodeTimeP90"
    assert rule["expr"].startswith("histogram_quantile(0.9, sum by (le) (rate(vllm:request_decode_time_seconds_bucket")


def test_the_registered_names_still_read() -> None:
    assert [parse_slo(s).metric for s in ("e2e_p95<=5s", "itl_mean<20ms", "success_rate>=99%")] == [
        "e2e_p95",
        "itl_mean",
        "success_rate",
    ]
    with pytest.raises(ConfigError, match="unknown metric 'decode_time_p95'"):
        parse_slo("decode_time_p95<=1s")
    assert scoring.latency_of("success_rate") is None and scoring.latency_of("ttft_p42") is None
