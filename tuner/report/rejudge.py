"""A study judged again under its edited job's SLOs (or objective, or latency metric), written back into its trials.

What `tuner rescore` shows without writing (tuner.report.rescore: each measured trial's stored requests summarised
again, a capacity search re-decided over its stored steps, a trial whose load stopped at a certain miss never met),
the rerun of an edited job writes: each trial's values, constraints and figures (tuner.study.verdict_rewrite), so
the study's front, its samplers and every command read the new verdicts. A trial with no measurement keeps its
values; its SLO constraints are renamed to the new SLOs (0: it missed none, it never ran).
"""

from __future__ import annotations

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from tuner.config import Job
from tuner.report.rescore import RecordSource, RescoredTrial, rejudged
from tuner.report.views import StudyView, study_view
from tuner.scoring import figures
from tuner.study.verdict import STARTUP_CONSTRAINT
from tuner.study.verdict_rewrite import rewrite_verdict

__all__ = ["rejudge"]


def rejudge(storage: RDBStorage, store: RecordSource, job: Job, *, write: bool = True) -> str:
    """Judge `job`'s study again under `job`'s SLOs, objective and latency metric; write the verdicts unless
    `write` is False; the line that says how many verdicts moved."""
    study = optuna.load_study(study_name=job.study.name, storage=storage)
    stored = study_view(study)
    attrs = stored.attrs | {"objective": job.objective, "latency_metric": job.primary_latency(), "slos": job.slos}
    view = StudyView(name=stored.name, attrs=attrs, trials=stored.trials)
    out, slos = rejudged(view, store, job.parsed_slos())
    ids = {t.number: t._trial_id for t in study.get_trials(deepcopy=False)}
    names = [f"slo:{s}" for s in slos]
    judged = [r for r in out if r.before.state == TrialState.COMPLETE.name]
    if write:
        for r in judged:
            _write(storage, ids[r.after.number], r, names, job.primary_latency())
    # A sampler's repeat of a flag set measured nothing of its own: it is written its first trial's verdict, and
    # not counted again.
    own = [
        r for r in judged if r.summary is not None and (r.before.duplicate_of is None or r.before.repeat_of is not None)
    ]
    moved = [r for r in own if r.changed]
    said = "moved" if write else "would move"
    detail = "; ".join(f"#{r.after.number} now {'meets them' if r.after.feasible else _misses(r)}" for r in moved)
    return (
        f"judged again under {', '.join(str(s) for s in slos)} ({job.objective}, {job.primary_latency()}): "
        f"{len(own)} measured trials, {len(moved)} verdicts {said}"
        + (f" ({detail})" if detail else "")
        + f"; feasible {sum(r.before.feasible for r in judged)} -> {sum(r.after.feasible for r in judged)}"
    )


def _misses(r: RescoredTrial) -> str:
    return "misses " + (", ".join(r.after.violated) or "an SLO")


def _write(storage: RDBStorage, trial_id: int, r: RescoredTrial, names: list[str], latency_metric: str) -> None:
    a = r.after
    if r.summary is None:
        # No measurement re-scored (a start that failed, a skip): its values stand, its SLOs are the new ones, missed
        # by none (it never ran); a measurement with nothing stored to judge it by cannot be said to meet them.
        startup = dict(zip(a.constraint_names, a.constraints, strict=False)).get(STARTUP_CONSTRAINT, 0.0)
        unknown = 1.0 if r.before.measured else 0.0
        constraints = {STARTUP_CONSTRAINT: startup, **dict.fromkeys(names, unknown)}
        attrs: dict[str, object] = {"constraints": list(constraints.values()), "constraint_names": list(constraints)}
        if r.before.measured:
            attrs["feasible"] = False
        rewrite_verdict(storage, trial_id, values=None, constraints=constraints, user_attrs=attrs)
        return
    constraints = {STARTUP_CONSTRAINT: 0.0, **dict(zip(names, a.constraints, strict=True))}
    attrs = {
        "feasible": a.feasible,
        "constraints": list(constraints.values()),
        "constraint_names": list(constraints),
        "latency_metric": latency_metric,
        "output_tok_s": a.output_tok_s,
        "request_rate": a.request_rate,
        "success_rate": a.success_rate,
        "goodput": a.goodput,
        "good_share": a.good_share,
        **{f.attr: a.latencies.get(f.name) for f in figures()},
        **{f"{name}_s": value for name, value in a.latencies.items()},  # the SLOs' own figures too
    }
    if a.costed:
        attrs |= {
            "replicas": a.replicas,
            "box_gpus": a.box_gpus,
            "box_output_tok_s": a.box_output_tok_s,
            "cost_load_rate": a.cost_load_rate,
            "cost_usd_per_hour": a.cost_usd_per_hour,
            "cost_usd_per_m_tokens": a.cost_usd_per_m_tokens,
            "cost_gpu_hours_per_m_tokens": a.cost_gpu_hours_per_m_tokens,
        }
    if r.before.request_rate != a.request_rate:
        attrs["ci_run"] = None  # a capacity search now scored at another step: the intervals were the old step's
    values = [float(a.throughput or 0.0), float(a.objective_latency_s or 0.0)]
    rewrite_verdict(storage, trial_id, values=values, constraints=constraints, user_attrs=attrs)
