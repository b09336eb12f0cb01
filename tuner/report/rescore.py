"""Re-scoring a finished study under new SLOs from its stored per-request records: no server, no GPU time.

Each measured trial's records are summarised again (`tuner.scoring.summarize`) and checked against the new SLOs
(`Slo.violation`, Optuna's constraint shape). A trial whose objective was the highest SLO-meeting rate is re-decided
over its stored capacity-search steps: under a tighter SLO a lower step may be the one that still meets it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tuner.load.results import RequestRecord
from tuner.report.front import pareto_front
from tuner.report.views import StudyView, TrialView
from tuner.scoring import LoadSummary, Slo, summarize

__all__ = ["RecordSource", "RescoreResult", "RescoredTrial", "rescore"]


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


def rescore(view: StudyView, source: RecordSource, slos: Sequence[Slo]) -> RescoreResult:
    latency_metric = view.latency_metric
    max_rate = view.attrs.get("objective") == "max_rate"
    out = [_rescore_trial(view.name, t, source, slos, latency_metric, max_rate) for t in view.trials]
    return RescoreResult(
        study=view.name,
        slos=[str(s) for s in slos],
        latency_metric=latency_metric,
        trials=out,
        front=pareto_front([t.after for t in out]),
    )


def _rescore_trial(
    study: str, t: TrialView, source: RecordSource, slos: Sequence[Slo], latency_metric: str, max_rate: bool
) -> RescoredTrial:
    if not t.measured:
        return RescoredTrial(t, t, None, note="no measurement")
    detail = source.trial_detail(study, t.number)
    steps = source.request_steps(study, t.number)
    if not steps:
        return RescoredTrial(t, dataclasses.replace(t, feasible=False), None, note="no stored requests")
    if max_rate and len(steps) > 1:
        candidates = steps
    else:
        scored = detail.scored_step if detail is not None and detail.scored_step is not None else None
        candidates = [scored if scored is not None and scored in steps else steps[-1]]
    scored_runs: list[tuple[int, LoadSummary, list[float]]] = []
    for step in candidates:
        records = source.request_records(study, t.number, step)
        summary = summarize(records, duration_s=_duration(detail, step, records), slos=slos)
        scored_runs.append((step, summary, [s.violation(summary) for s in slos]))
    meeting = [r for r in scored_runs if all(v <= 0 for v in r[2])]
    # The highest-throughput step that meets the SLOs; if none does, the scored (or last) one, infeasible.
    step, summary, violations = max(meeting, key=lambda r: r[1].output_throughput) if meeting else scored_runs[-1]
    after = dataclasses.replace(
        t,
        throughput=summary.output_throughput,
        latency_p95_s=summary.metric(latency_metric),
        output_tok_s=summary.output_throughput,
        request_rate=summary.request_throughput,
        success_rate=summary.success_rate,
        ttft_p95_s=summary.ttft.p95,
        e2e_p95_s=summary.e2e.p95,
        tpot_p95_s=summary.tpot.p95,
        goodput=summary.goodput,
        feasible=all(v <= 0 for v in violations),
        constraints=tuple(violations),
        violated=tuple(str(s) for s, v in zip(slos, violations, strict=True) if v > 0),
    )
    return RescoredTrial(t, after, summary, step=step)


def _duration(detail: _Detail | None, step: int, records: Sequence[RequestRecord]) -> float:
    """The measured phase's length as the load run measured it; the records' own span if it was not stored."""
    if detail is not None:
        stored: Any = None
        steps = detail.capacity_steps or []
        if 0 <= step < len(steps) and isinstance(steps[step], dict):
            stored = (steps[step].get("summary") or {}).get("duration_s")
        if stored is None and detail.load_summary and (detail.scored_step or 0) == step:
            stored = detail.load_summary.get("duration_s")
        if isinstance(stored, int | float) and stored > 0:
            return float(stored)
    measured = [r for r in records if not r.warmup]
    if not measured:
        return 0.0
    return max(r.end_s for r in measured) - min(r.start_s for r in measured)
