"""Every per-request figure's interval comes from the metric registry: a latency registered there (here a fake one,
whose name holds an underscore) gets its within-run interval, its SLO's figure and its line in `tuner show`'s
uncertainty table, with nothing else edited."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tuner.intervals import figure_of, interval_metrics, run_intervals
from tuner.load import RequestRecord
from tuner.report.uncertainty import figure_text, interval_figures, trial_intervals
from tuner.report.views import StudyView, TrialView
from tuner.scoring import METRICS, Metric


@pytest.fixture
def queue_wait() -> Iterator[Metric]:
    """A per-request latency the registry did not have: the time before the first token beyond 20 ms."""
    metric = Metric(
        "queue_wait",
        "s",
        "QWAIT",
        lambda r: () if r.ttft_s is None else (max(0.0, r.ttft_s - 0.02),),
        lambda r, _: None if r.ttft_s is None else max(0.0, r.ttft_s - 0.02),
        per_request=True,
    )
    METRICS[metric.name] = metric
    try:
        yield metric
    finally:
        del METRICS[metric.name]


def records() -> list[RequestRecord]:
    return [
        RequestRecord(
            index=i, start_s=i * 0.01, ttft_s=0.02 + 0.001 * (i % 17), itl_s=[0.01] * 7, e2e_s=0.2 + 0.01 * (i % 5),
            prompt_tokens=64, completion_tokens=8, ok=True,
        )
        for i in range(60)
    ]  # fmt: skip


def test_a_registered_latency_gets_its_interval_its_slo_figure_and_its_line(queue_wait: Metric) -> None:
    assert queue_wait in interval_metrics()
    cis = run_intervals(records(), 6.0)
    ci = cis["queue_wait_p95_s"]
    waits = sorted(max(0.0, 0.001 * (i % 17)) for i in range(60))
    assert ci.low <= ci.value <= ci.high and ci.high > ci.low
    assert ci.value == pytest.approx(_p95(waits))
    # The SLO's figure is found by the registry, not by splitting the name at its first underscore.
    assert figure_of("queue_wait_p95") == "queue_wait_p95_s"
    assert figure_of("queue_wait_p90") is None  # no interval is kept for p90
    assert ("queue_wait_p95_s", "QWAIT P95", "s") in interval_figures()
    # `tuner show`'s uncertainty table: the run's interval of the new figure, as kept in the trial's `ci_run`.
    trial = TrialView(
        number=0, state="COMPLETE", baseline=True, outcome="measured", reason=None, flags={},
        throughput=10.0, objective_latency_s=0.2,
        run_intervals={k: (v.value, v.low, v.high) for k, v in cis.items()},
    )  # fmt: skip
    shown = {f.name: f for f in trial_intervals(StudyView("s", {}, [trial]), 0)}
    assert shown["queue_wait_p95_s"].label == "QWAIT P95"
    assert "±" in figure_text(shown["queue_wait_p95_s"].run, "s")


def test_without_it_registered_nothing_of_it_is_kept() -> None:
    assert "queue_wait_p95_s" not in run_intervals(records(), 6.0)
    assert figure_of("queue_wait_p95") is None
    assert all(not name.startswith("queue_wait") for name, _, _ in interval_figures())
    # The registry's own latencies, one value per request: ITL (every gap of a request) keeps none.
    assert {m.name for m in interval_metrics()} == {"ttft", "tpot", "e2e"}


def _p95(values: list[float]) -> float:
    pos = (len(values) - 1) * 0.95
    lo = int(pos)
    return values[lo] + (values[min(lo + 1, len(values) - 1)] - values[lo]) * (pos - lo)
