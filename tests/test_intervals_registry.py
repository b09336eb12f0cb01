"""Every per-request figure's interval comes from the metric registry: a latency registered there (here a fake one,
whose name holds an underscore) gets its within-run interval, its SLO's figure and its line in `tuner show`'s
uncertainty table, with nothing else edited."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import tuner.intervals
import tuner.report.uncertainty
from tuner.intervals import figure_of, interval_metrics, run_intervals
from tuner.load import RequestRecord
from tuner.report.uncertainty import figure_text, interval_figures, trial_intervals
from tuner.report.views import StudyView, TrialView
from tuner.scoring import METRICS, Figure, Metric


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


def registry_gaps(metric: Metric) -> list[str]:
    """Where a registered per-request latency is missing: its within-run interval, its SLO's figure (found by the
    registry, not by splitting the name at its first underscore), `tuner show`'s uncertainty line, and the same for
    a statistic only its study's SLO names (p90). Empty: it is everywhere."""
    name, label = metric.name, metric.label
    gaps = []
    cis = run_intervals(records(), 6.0, named=[Figure(name, "p90")])
    for key in (f"{name}_p95_s", f"{name}_p90_s"):
        if key not in cis:
            gaps.append(f"run_intervals keeps no {key}")
    for slo in (f"{name}_p95", f"{name}_p90"):
        if figure_of(slo) != f"{slo}_s":
            gaps.append(f"figure_of({slo!r}) is {figure_of(slo)!r}")
    # `tuner show`'s uncertainty table of a study whose SLO names its P90: the run's intervals, as kept in `ci_run`
    trial = TrialView(
        number=0, state="COMPLETE", baseline=True, outcome="measured", reason=None, flags={},
        throughput=10.0, objective_latency_s=0.2,
        run_intervals={k: (v.value, v.low, v.high) for k, v in cis.items()},
    )  # fmt: skip
    view = StudyView("s", {"slos": [f"{name}_p90<=1s"]}, [trial])
    shown = {f.name: f for f in trial_intervals(view, 0)}
    for key, stat in ((f"{name}_p95_s", "P95"), (f"{name}_p90_s", "P90")):
        if key not in shown or shown[key].label != f"{label} {stat}" or "±" not in figure_text(shown[key].run, "s"):
            gaps.append(f"the uncertainty table has no {label} {stat} with its interval")
    return gaps


def test_a_registered_latency_gets_its_interval_its_slo_figure_and_its_line(queue_wait: Metric) -> None:
    assert queue_wait in interval_metrics()
    assert registry_gaps(queue_wait) == []
    ci = run_intervals(records(), 6.0)["queue_wait_p95_s"]
    waits = sorted(max(0.0, 0.001 * (i % 17)) for i in range(60))
    assert ci.low <= ci.value <= ci.high and ci.high > ci.low
    assert ci.value == pytest.approx(_p95(waits))
    assert ("queue_wait_p95_s", "QWAIT P95", "s") in interval_figures()
    assert "queue_wait_p90_s" not in run_intervals(records(), 6.0)  # a P90 only where a study names it


def test_the_rule_fails_on_a_reader_that_lists_the_latencies_by_hand(
    queue_wait: Metric, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above on a broken fixture: the interval readers' list of latencies written by hand, as
    `intervals.py` and `report/uncertainty.py` had it, leaves the registered latency out everywhere."""
    by_hand = [METRICS[name] for name in ("ttft", "tpot", "e2e")]
    monkeypatch.setattr(tuner.intervals, "interval_metrics", lambda: by_hand)
    monkeypatch.setattr(tuner.report.uncertainty, "interval_metrics", lambda: by_hand)
    assert registry_gaps(queue_wait) == [
        "run_intervals keeps no queue_wait_p95_s",
        "run_intervals keeps no queue_wait_p90_s",
        "figure_of('queue_wait_p95') is None",
        "figure_of('queue_wait_p90') is None",
        "the uncertainty table has no QWAIT P95 with its interval",
        "the uncertainty table has no QWAIT P90 with its interval",
    ]


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
