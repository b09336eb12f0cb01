"""A study that stops on an SLO nothing meets, once its measurements agree with the twin's prediction.

Only once every trial measured so far missed the SLOs, the baseline among them, does the study ask the twin
(tuner.twin.reachability: a sweep of the space in virtual time, once per study and SLOs, kept in the study's
`unreachable` attribute). Where it predicts an SLO out of reach, its nearest flag sets are queued (those not tried);
once they are measured and miss it too, the study stops with one line naming the SLO and the closest measured figure
(`budget.stop_when_unreachable: false` spends the budget anyway). A trial that meets it ends the watch.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from tuner.config import Job
from tuner.record import MEASURED, TrialRecord
from tuner.scoring import parse_slo
from tuner.store import flag_key
from tuner.study.confirm import is_repeat
from tuner.twin.figures import measured_slo_values
from tuner.twin.reachability import Unreachable, predict_unreachable
from tuner.twin.sampler import twin_unsupported

__all__ = ["UNREACHABLE_ATTR", "UnreachableWatch"]

UNREACHABLE_ATTR = "unreachable"
"""The study's attribute: {"slos": [...], "space": {...}, "found": Unreachable.as_attr() or None}, the twin's answer
for those SLOs and that space."""

Predict = Callable[[Job], "Unreachable | None"]


class UnreachableWatch:
    """`check(study)` before each trial (under the workers' lock): the closing line once the study should stop."""

    def __init__(self, job: Job, on_event: Callable[[str], None], predict: Predict = predict_unreachable) -> None:
        self.job = job
        self.on_event = on_event
        self.predict = predict
        self.on = job.budget.stop_when_unreachable and twin_unsupported(job) is None
        self._key = {"slos": list(job.slos), "space": job.as_record()["space"]}
        self._reachable = False

    def check(self, study: optuna.Study) -> str | None:
        """Asks the twin when the measurements first call for it (and queues its nearest flag sets)."""
        return self._verdict(study, predict=True)

    def said(self, study: optuna.Study) -> str | None:
        """The closing line, if the study stopped on an unreachable SLO (nothing predicted or queued here)."""
        return self._verdict(study, predict=False)

    def _verdict(self, study: optuna.Study, *, predict: bool) -> str | None:
        if not self.on:
            return None
        records = _first_starts(study)
        if any(r.feasible for r in records) or not any(r.baseline and r.outcome == MEASURED for r in records):
            return None
        found = self._found(study, predict=predict)
        if found is None:
            return None
        tried = {flag_key(r.flags) for r in records}
        if any(flag_key(s["flags"]) not in tried for s in found.nearest):
            return None  # queued when predicted: they run next
        return self._closing(found, records)

    def _found(self, study: optuna.Study, *, predict: bool) -> Unreachable | None:
        held = study.user_attrs.get(UNREACHABLE_ATTR)
        if isinstance(held, dict) and {k: held.get(k) for k in self._key} == self._key:
            found = held.get("found")
            return Unreachable.from_attr(found) if isinstance(found, dict) else None
        if not predict or self._reachable:
            return None
        answer = self.predict(self.job)
        # Kept in the study only when found (its workers and later runs read it); within reach, this run asks no more.
        self._reachable = answer is None
        if answer is not None:
            study.set_user_attr(UNREACHABLE_ATTR, self._key | {"found": answer.as_attr()})
            self.on_event(
                f"{answer.line()}; the baseline missed it too: the {len(answer.nearest)} nearest are measured next, "
                "and the study stops if they miss it (budget.stop_when_unreachable)"
            )
            tried = {flag_key(r.flags) for r in _first_starts(study)}
            for s in answer.nearest:
                if flag_key(s["flags"]) not in tried:
                    study.enqueue_trial(s["params"], skip_if_exists=True)
        return answer

    def _closing(self, found: Unreachable, records: list[TrialRecord]) -> str:
        measured = [r for r in records if r.outcome == MEASURED]
        if found.slo is None or found.metric is None:
            return (
                f"stopped: no flag set meets the SLOs together, as the twin predicted; the baseline and its "
                f"{len(found.nearest)} nearest flag sets measured missing them (budget.stop_when_unreachable: false "
                "spends the budget anyway)"
            )
        slo = parse_slo(found.slo)
        values = [
            v
            for r in measured
            if (v := measured_slo_values([slo], r.constraint_names or [], r.constraints or []).get(slo.metric))
            is not None
        ]
        closest = (min if slo.op in ("<=", "<") else max)(values, default=None)
        return (
            f"stopped: no flag set meets {found.slo}, as the twin predicted: all {len(measured)} measured, the "
            f"baseline and the twin's nearest among them, missed it, the closest at {found.how_far(closest)}; loosen "
            "it, or set "
            "budget.stop_when_unreachable: false to spend the budget anyway"
        )


def _first_starts(study: optuna.Study) -> list[TrialRecord]:
    """The search's finished trials of a flag set of their own (no sampler repeat, no confirmation start)."""
    out = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        r = TrialRecord.from_attrs(t.user_attrs)
        if not is_repeat(t) and not r.is_duplicate:
            out.append(r)
    return out
