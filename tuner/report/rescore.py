"""Re-scoring a finished study under new SLOs from what it stored: no server, no GPU time.

A measured trial's per-request records are summarised again (`tuner.scoring.summarize`) and checked against the new
SLOs (`Slo.violation`, Optuna's constraint shape). A trial whose objective was the highest SLO-meeting rate is
re-decided over its capacity-search steps: the records where they were kept (the scored step), each step's stored
summary elsewhere, so under a tighter SLO a lower step may be the one that still meets it, and under a looser one a
higher step may now count.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import ValidationError

from tuner.cost import JobLoad, cost_figures, scored_tok_s, tokens_per_request
from tuner.flags import VllmFlags
from tuner.load.results import RequestRecord
from tuner.report.front import pareto_front
from tuner.report.views import StudyView, TrialView, pooled_over_starts
from tuner.scoring import (
    Figure,
    LoadSummary,
    Slo,
    closest,
    goodput_bound,
    objective_latency,
    study_figures,
    summarize,
)

__all__ = ["RecordSource", "RescoreResult", "RescoredTrial", "rejudged", "rescore"]


class _Detail(Protocol):
    @property
    def load_summary(self) -> dict[str, Any] | None: ...
    @property
    def capacity_steps(self) -> list[Any] | None: ...
    @property
    def scored_step(self) -> int | None: ...


class RecordSource(Protocol):
    """What re-scoring reads: `tuner.store.Store` is one."""

    def trial_detail(self, study: str, number: int) -> _Detail | None: ...
    def request_records(self, study: str, number: int, step: int | None = None) -> list[RequestRecord]: ...
    def request_steps(self, study: str, number: int) -> list[int]: ...


@dataclass(frozen=True)
class RescoredTrial:
    before: TrialView
    after: TrialView
    summary: LoadSummary | None  # of the step now scored; None when nothing could be re-scored
    step: int | None = None
    source: str | None = None  # "records" or "stored summary"
    note: str | None = None  # why it was not re-scored

    @property
    def changed(self) -> bool:
        return self.before.feasible != self.after.feasible


@dataclass(frozen=True)
class RescoreResult:
    study: str
    slos: list[str]
    latency_metric: str
    trials: list[RescoredTrial]
    front: list[TrialView]

    @property
    def feasible_before(self) -> int:
        return sum(t.before.feasible for t in self.trials)

    @property
    def feasible_after(self) -> int:
        return sum(t.after.feasible for t in self.trials)

    @property
    def view_after(self) -> list[TrialView]:
        return [t.after for t in self.trials]


@dataclass(frozen=True)
class _Run:
    step: int
    rate: float | None
    summary: LoadSummary
    violations: list[float]
    source: str
    partial: bool = False  # its load stopped at a certain miss of the old SLOs

    @property
    def meets(self) -> bool:
        # A run cut short at a certain miss has seen only its worst part: no new SLO can be judged met on it.
        return not self.partial and all(v <= 0 for v in self.violations)


def rescore(view: StudyView, source: RecordSource, slos: Sequence[Slo]) -> RescoreResult:
    out, slos = rejudged(view, source, slos)
    pooled = pooled_over_starts([r.after for r in out])
    out = [dataclasses.replace(r, after=after) for r, after in zip(out, pooled, strict=True)]
    return RescoreResult(
        study=view.name,
        slos=[str(s) for s in slos],
        latency_metric=view.latency_metric,
        trials=out,
        front=pareto_front([t.after for t in out]),
    )


def rejudged(view: StudyView, source: RecordSource, slos: Sequence[Slo]) -> tuple[list[RescoredTrial], list[Slo]]:
    """Each trial judged under `slos` (and the view's objective and latency metric) on its own figures, before a
    flag set's starts are pooled (what a study writes back into its trials: `tuner.report.rejudge`); and the SLOs
    it was judged by (a goodput study's with its good-share bound)."""
    timeout = view.job.request_timeout
    worst_latency = float(timeout) if timeout is not None else 60.0
    if view.record.objective == "goodput" and not any(s.metric == "good_share" for s in slos):
        # A goodput study's steps are judged by their share of good requests, under the new SLOs' bounds.
        slos = [*slos, goodput_bound(slos)]
    rescorer = _Rescorer(view.name, source, list(slos), view.latency_metric, worst_latency, _stored_load(view))
    out = [rescorer.trial(t) for t in view.trials]
    # A duplicate ran nothing itself: it takes its original's new verdict. A confirmation start ran its flag set
    # again, so it is re-scored on its own records, and its flag set stands at the figure pooled over its starts.
    by_number = {r.after.number: r for r in out}
    for i, r in enumerate(out):
        ran_nothing = r.before.duplicate_of is not None and r.before.repeat_of is None
        owner = by_number.get(r.before.duplicate_of) if ran_nothing and r.before.duplicate_of is not None else None
        if owner is not None:
            copied = dataclasses.replace(
                owner.after, number=r.before.number, baseline=r.before.baseline, duplicate_of=r.before.duplicate_of
            )
            out[i] = RescoredTrial(r.before, copied, owner.summary, owner.step, owner.source, "duplicate")
    return out, list(slos)


@dataclass(frozen=True)
class _Rescorer:
    study: str
    source: RecordSource
    slos: list[Slo]
    latency_metric: str
    worst_latency: float
    cost_load: JobLoad | None = None  # a cost study's load: its trials are costed again at their new capacity

    @property
    def _figures(self) -> tuple[Figure, ...]:
        return study_figures([*(s.metric for s in self.slos), self.latency_metric])

    def trial(self, t: TrialView) -> RescoredTrial:
        if not t.measured:
            return RescoredTrial(t, t, None, note="no measurement")
        if t.duplicate_of is not None and t.repeat_of is None:
            return RescoredTrial(t, t, None, note="duplicate")
        detail = self.source.trial_detail(self.study, t.number)
        runs = self._runs(t.number, detail, partial=t.slo_stop is not None)
        if not runs:
            return RescoredTrial(t, dataclasses.replace(t, feasible=False), None, note="nothing stored to re-score")
        meeting = [r for r in runs if r.meets]
        if meeting:
            # The highest SLO-meeting rate (a fixed load has one run): what the study's objective rewards.
            run = max(meeting, key=lambda r: (r.rate or 0.0, r.summary.output_throughput))
        else:
            # None meets: the run that came closest, as the study scores it, so it stays comparable.
            run = runs[closest([r.violations for r in runs])]
        s = run.summary
        after = dataclasses.replace(
            t,
            # the box's, as the study scored it (a capacity step meeting the SLOs: the tokens its rate asks for)
            throughput=scored_tok_s(s, run.rate if run.meets else None) * (t.replicas or 1),
            objective_latency_s=objective_latency(s, self.latency_metric, self.worst_latency),
            output_tok_s=float(s.output_throughput),
            request_rate=run.rate if run.rate is not None else float(s.request_throughput),
            success_rate=float(s.success_rate),
            # the figures the new SLOs and the objective name too (a `ttft_p90` SLO's TTFT P90), beside the registry's
            latencies={f.name: value for f in self._figures if (value := f.of(s)) is not None},
            goodput=float(s.goodput),
            good_share=float(s.good_share),
            feasible=run.meets,
            constraints=tuple(run.violations),
            constraint_names=tuple(str(x) for x in self.slos),
            violated=tuple(str(x) for x, v in zip(self.slos, run.violations, strict=True) if v > 0),
        )
        if t.costed and self.cost_load is not None:
            after = recosted(after, self.cost_load, run.meets, float(s.concurrency), tokens_per_request(s))
        note = (
            "its load stopped at a certain miss of the old SLOs, so it is judged on part of a run: run it again"
            if run.partial and all(v <= 0 for v in run.violations)
            else None
        )
        return RescoredTrial(t, after, s, step=run.step, source=run.source, note=note)

    def _runs(self, number: int, detail: _Detail | None, *, partial: bool) -> list[_Run]:
        stored_steps = set(self.source.request_steps(self.study, number))
        steps = [s for s in (detail.capacity_steps or []) if isinstance(s, dict)] if detail is not None else []
        runs: list[_Run] = []
        if steps:
            for i, step in enumerate(steps):
                rate = step.get("rate")
                run = self._run(number, i, stored_steps, step.get("summary"))
                if run is not None:
                    rate_value = float(rate) if isinstance(rate, int | float) else None
                    runs.append(dataclasses.replace(run, rate=rate_value, partial=bool(step.get("slo_stop"))))
            return runs
        scored = detail.scored_step if detail is not None and detail.scored_step is not None else 0
        run = self._run(number, scored, stored_steps, detail.load_summary if detail is not None else None)
        return [dataclasses.replace(run, partial=partial)] if run is not None else []

    def _run(self, number: int, step: int, stored_steps: set[int], stored: Any) -> _Run | None:
        stored_summary = _summary(stored)
        if step in stored_steps:
            records = self.source.request_records(self.study, number, step)
            if records:
                duration = _duration(stored_summary, records)
                summary = summarize(records, duration_s=duration, slos=self.slos)
                return _Run(step, None, summary, [x.violation(summary) for x in self.slos], "records")
        if stored_summary is not None:
            # No records for this step (the study keeps the scored step's): its stored summary holds every
            # percentile an SLO can name; only goodput stays as it was measured under the old SLOs.
            return _Run(step, None, stored_summary, [x.violation(stored_summary) for x in self.slos], "stored summary")
        return None


def _stored_load(view: StudyView) -> JobLoad | None:
    """A cost study's load as its stored job gave it (None: another objective, or a job not stored)."""
    arrival = (view.record.job or {}).get("arrival")
    if not view.is_cost or not isinstance(arrival, dict):
        return None
    if isinstance(arrival.get("rate"), int | float):
        return JobLoad(rate=float(arrival["rate"]))
    if isinstance(arrival.get("concurrency"), int):
        return JobLoad(users=int(arrival["concurrency"]))
    return None


def recosted(t: TrialView, load: JobLoad, meets: bool, in_flight: float | None, tokens: float) -> TrialView:
    """A cost trial re-scored: the replicas its load needs at its new capacity (`t`'s rate, `in_flight` requests
    held there, `tokens` output tokens a request), at the price its record implies; no cost, and no value, where no
    step meets the new SLOs."""
    priced = t.cost_usd_per_hour is not None and t.box_gpus
    price = (t.cost_usd_per_hour or 0.0) / (t.box_gpus or 1) if priced else None
    summary_rate = t.request_rate or 0.0
    cost = None
    if meets:
        world = VllmFlags.from_dict(t.flags).world_size
        cost = cost_figures(summary_rate, tokens, world_size=world, load=load, in_flight=in_flight, gpu_hour_usd=price)
    if cost is None:
        return dataclasses.replace(
            t, throughput=0.0, cost_usd_per_hour=None, cost_usd_per_m_tokens=None, cost_gpu_hours_per_m_tokens=None
        )
    return dataclasses.replace(
        t,
        throughput=cost.value,
        replicas=cost.replicas,
        box_gpus=cost.gpus,
        box_output_tok_s=cost.box_tok_s,
        cost_load_rate=cost.load_rate,
        cost_usd_per_hour=cost.usd_per_hour,
        cost_usd_per_m_tokens=cost.usd_per_m_tokens,
        cost_gpu_hours_per_m_tokens=cost.gpu_hours_per_m_tokens,
    )


def _summary(data: Any) -> LoadSummary | None:
    if not isinstance(data, dict):
        return None
    try:
        return LoadSummary.model_validate(data)
    except ValidationError:
        return None


def _duration(stored: LoadSummary | None, records: Sequence[RequestRecord]) -> float:
    """The measured phase's length as the load run measured it; the records' own span if it was not stored."""
    if stored is not None and stored.duration_s > 0:
        return float(stored.duration_s)
    measured = [r for r in records if not r.warmup]
    if not measured:
        return 0.0
    return max(r.end_s for r in measured) - min(r.start_s for r in measured)
