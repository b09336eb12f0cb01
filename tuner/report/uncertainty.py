"""How sure each of a trial's figures is, as the morning commands show it: the run's own interval (a bootstrap over
its requests, kept in the trial's `ci_run`) and, where its flag set was started more than once, the interval over
its starts, with the between-start spread the study has seen on every flag set it started again.

The pooling is `tuner.intervals.pool`, the confirmation's own arithmetic, here for every figure the run kept (the
confirmation pools only throughput and the SLOs' figures); a view, it decides nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tuner.intervals import RUN_PERCENTILES, Interval, Noise, format_with_ci, interval_metrics, learn_noise, pool
from tuner.report.views import StudyView, TrialView
from tuner.scoring import Figure

__all__ = ["FigureCI", "figure_text", "interval_figures", "trial_intervals"]


def interval_figures(named: Sequence[Figure] = ()) -> tuple[tuple[str, str, str], ...]:
    """(record name, label, unit) of each figure a run keeps an interval of, in the order they are shown: the
    metric registry's, read when called (`tuner.intervals.interval_metrics`), so a latency added there is shown,
    each at p50/p95/p99 and at the percentiles `named` names of it (the study's SLOs': a `ttft_p90` SLO's P90)."""
    latencies = []
    for m in interval_metrics():
        extra = {round(f.quantile * 100) for f in named if f.metric == m.name and f.quantile is not None}
        latencies += [(f"{m.name}_p{q}_s", f"{m.label} P{q}", m.unit) for q in sorted({*RUN_PERCENTILES, *extra})]
    return (("output_tok_s", "output tok/s", "tok/s"), ("success_rate", "success rate", "fraction"), *latencies)


@dataclass(frozen=True)
class FigureCI:
    name: str
    label: str
    unit: str
    run: Interval | None  # this trial's run, within-run (None: the run kept no interval and no figure)
    starts: Interval | None  # its flag set over every start (None: started once)
    n_starts: int


def figure_text(ci: Interval | None, unit: str) -> str:
    return "—" if ci is None else format_with_ci(ci.value, ci.low, ci.high, unit)


def _run_figure(t: TrialView, name: str) -> Interval | None:
    """The run's figure with its interval; a trial from before the intervals: its figure as a point."""
    kept = t.run_intervals.get(name)
    if kept is not None:
        return Interval(*kept)
    if name == "output_tok_s":
        value = t.output_tok_s
    elif name == "success_rate":
        value = t.success_rate
    else:
        value = t.latency(name.removesuffix("_s"))
    return None if value is None else Interval(value, value, value)


def _groups(view: StudyView) -> dict[int, list[TrialView]]:
    """Measured starts by their flag set's first trial."""
    out: dict[int, list[TrialView]] = {}
    for t in view.trials:
        if t.measured and (t.duplicate_of is None or t.repeat_of is not None):
            out.setdefault(t.repeat_of if t.repeat_of is not None else t.number, []).append(t)
    return out


def _pooled(starts: Sequence[Interval], noise: Noise, unit: str) -> Interval | None:
    if len(starts) < 2 or not any(s.value > 0 for s in starts):
        return None
    ci = pool(starts, noise).interval
    if unit == "fraction":  # pooled on a log scale: a rate near 100% must not reach past it
        return Interval(min(ci.value, 1.0), max(ci.low, 0.0), min(ci.high, 1.0))
    return ci


def trial_intervals(view: StudyView, number: int) -> list[FigureCI]:
    """Each figure of trial `number` with its run's interval and its flag set's over starts."""
    t = view.trial(number)
    if t is None:
        return []
    groups = _groups(view)
    first = t.repeat_of if t.repeat_of is not None else t.number
    mine = groups.get(first, [])
    out = []
    for name, label, unit in interval_figures(view.named_figures):
        run = _run_figure(t, name)
        per_group = [[f for s in g if (f := _run_figure(s, name)) is not None] for g in groups.values()]
        noise = learn_noise([[f.value for f in g] for g in per_group])
        starts = [f for s in mine if (f := _run_figure(s, name)) is not None]
        over = _pooled(starts, noise, unit)
        first_view = view.trial(first)
        if name == "output_tok_s" and first_view is not None and first_view.starts > 1 and first_view.throughput_ci:
            over = Interval(*first_view.throughput_ci)  # the confirmation's own, as the tables show it
        if run is not None or over is not None:
            out.append(FigureCI(name, label, unit, run, over, len(starts)))
    return out
