"""What `tuner studies` and `tuner status` say: per study, and for one study's progress."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tuner.load.contention import Contention
from tuner.report.front import choose, pareto_front
from tuner.report.views import StudyView, TrialView

__all__ = ["StudyListing", "StudyStatus", "TrialCounts", "counts", "listing", "machine_line", "status"]

_FAILED = ("launch_failed", "crashed")
_LAUNCHED = ("measured", "launch_failed", "crashed", "interrupted")


@dataclass(frozen=True)
class StudyListing:
    name: str
    trials: int
    finished: int
    running: int
    feasible: int
    best_throughput: float | None
    best_trial: int | None
    state: str  # empty | running | done | stopped
    gpu: str | None
    model: str | None
    started: dt.datetime | None
    best_cost: str | None = None  # a cost study's: its best's cost per million output tokens (`best_throughput`: 1/it)
    # Counted apart from `trials` (the budget's finished trials): tuner.report.overview.TrialCounts
    interrupted: int = 0
    repeats: int = 0
    confirmation_starts: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["started"] = self.started.isoformat(timespec="seconds") if self.started else None
        return d


@dataclass(frozen=True)
class StudyStatus:
    name: str
    budget: int | None
    finished: int
    running: list[TrialView]
    measured: int
    feasible: int
    best: TrialView | None
    failures: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    server_minutes: float = 0.0
    server_minutes_saved: float | None = None
    state: str = "empty"
    stopped: str | None = None  # the server refused the workload: the run's message (StudyView.stopped)
    # The twin sampler's prediction against the measurement, per real trial: (trial, predicted, measured tok/s)
    twin: list[tuple[int, float, float | None]] = field(default_factory=list)
    twin_fallback: str | None = None  # where the twin handed over to TPE (StudyView.twin_fallback)
    twin_verdicts: dict[int, str] = field(default_factory=dict)  # trial -> the SLO verdict the twin got wrong
    # The confirmation's starts of flag sets the search had tried (tuner.study.confirm), apart from its trials:
    # finished, of them measured, and their server time
    confirmation_starts: int = 0
    confirmation_measured: int = 0
    confirmation_minutes: float = 0.0
    interrupted: int = 0  # trials interrupted (Ctrl-C, the engine gone): not counted, run again on resume
    repeats: int = 0  # the sampler's repeats of a flag set already tried: answered from it, not counted

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": self.state,
            "budget": self.budget,
            "finished": self.finished,
            "running": [t.number for t in self.running],
            "measured": self.measured,
            "feasible": self.feasible,
            "best": self.best.as_dict() if self.best else None,
            "failures": self.failures,
            "skipped": self.skipped,
            "skipped_total": self.skipped_total,
            "server_minutes": self.server_minutes,
            "server_minutes_saved": self.server_minutes_saved,
            "stopped": self.stopped,
            "twin": [
                {"trial": n, "predicted_tok_s": p, "measured_tok_s": m, "verdict_missed": self.twin_verdicts.get(n)}
                for n, p, m in self.twin
            ],
            "twin_fallback": self.twin_fallback,
            "confirmation_starts": self.confirmation_starts,
            "confirmation_measured": self.confirmation_measured,
            "confirmation_minutes": self.confirmation_minutes,
            "interrupted": self.interrupted,
            "repeats": self.repeats,
        }


def _finished(view: StudyView) -> list[TrialView]:
    """The search's finished trials: the confirmation's starts, the interrupted ones (run again on resume, not
    spent) and a sampler's repeats of a flag set already tried (answered from it) are counted apart, as the run
    counts its budget."""
    return [
        t
        for t in view.search_trials
        if t.state not in ("RUNNING", "WAITING") and not _interrupted(t) and t.duplicate_of is None
    ]


def _interrupted(t: TrialView) -> bool:
    return t.outcome == "interrupted" and t.state != "COMPLETE"


@dataclass(frozen=True)
class TrialCounts:
    """A study's trials counted apart, each once: the budget's finished trials (of them measured, of those
    feasible), the sampler's repeats, the interrupted ones, the confirmation's starts (of them measured)."""

    finished: int
    measured: int
    feasible: int
    repeats: int
    interrupted: int
    confirmation_starts: int
    confirmation_measured: int

    def text(self) -> str:
        """'3 trials (3 measured, 2 feasible); 1 interrupted, run again; 1 repeat; 2 confirmation starts'."""
        parts = [f"{self.finished} trial{_s(self.finished)} ({self.measured} measured, {self.feasible} feasible)"]
        if self.interrupted:
            parts.append(f"{self.interrupted} interrupted (not counted; run again on resume)")
        if self.repeats:
            parts.append(f"{self.repeats} repeat{_s(self.repeats)} of a flag set already tried")
        if self.confirmation_starts:
            parts.append(f"{self.confirmation_starts} confirmation start{_s(self.confirmation_starts)}")
        return "; ".join(parts)


def _s(n: int) -> str:
    return "" if n == 1 else "s"


def counts(view: StudyView) -> TrialCounts:
    finished = _finished(view)
    done = [t for t in view.trials if t.state not in ("RUNNING", "WAITING")]
    confirming = [t for t in done if t.repeat_of is not None and not _interrupted(t)]
    return TrialCounts(
        finished=len(finished),
        measured=sum(t.measured for t in finished),
        feasible=sum(t.feasible for t in finished),
        repeats=sum(t.duplicate_of is not None and t.repeat_of is None for t in done),
        interrupted=sum(_interrupted(t) for t in done),
        confirmation_starts=len(confirming),
        confirmation_measured=sum(t.measured for t in confirming),
    )


def _state(view: StudyView) -> str:
    if not view.trials:
        return "empty"
    if any(t.state == "RUNNING" for t in view.trials):
        return "running"
    if view.stopped:
        return "stopped"
    budget = view.budget
    return "done" if budget is None or len(_finished(view)) >= budget else "stopped"


def _best(view: StudyView) -> TrialView | None:
    front = pareto_front(view.trials)
    return choose(front, "throughput") if front else None


def listing(view: StudyView) -> StudyListing:
    best = _best(view)
    starts = [t.started for t in view.trials if t.started]
    c = counts(view)
    return StudyListing(
        name=view.name,
        # The budget's trials, finished or running: the interrupted, repeats and confirmation starts apart.
        trials=c.finished + sum(t.state == "RUNNING" for t in view.search_trials),
        finished=c.finished,
        running=sum(t.state == "RUNNING" for t in view.trials),
        feasible=c.feasible,
        best_throughput=best.throughput if best else None,
        best_trial=best.number if best else None,
        best_cost=best.cost_text + "/M" if best is not None and best.costed else None,
        state=_state(view),
        gpu=_opt_str(view.record.gpu),
        model=_opt_str(view.record.model),
        started=min(starts) if starts else None,
        interrupted=c.interrupted,
        repeats=c.repeats,
        confirmation_starts=c.confirmation_starts,
    )


def status(view: StudyView) -> StudyStatus:
    finished = _finished(view)
    c = counts(view)
    failures = Counter(t.reason or t.outcome or t.state.lower() for t in finished if t.outcome in _FAILED)
    failures.update(t.state.lower() for t in finished if t.outcome is None and t.state != "COMPLETE")
    skipped = Counter(t.reason or "infeasible" for t in finished if t.outcome == "skipped_infeasible")
    # An interrupted trial's server started too: its time is in the mean.
    numbers = {t.number for t in finished}
    tried = [t for t in view.search_trials if t.number in numbers or _interrupted(t)]
    launched = [t.server_seconds for t in tried if t.outcome in _LAUNCHED and t.server_seconds > 0]
    # What a skipped trial would have cost: the mean server time of the trials that did start a server.
    saved = (sum(launched) / len(launched)) * sum(skipped.values()) / 60 if launched else None
    return StudyStatus(
        name=view.name,
        budget=view.budget,
        finished=len(finished),
        running=[t for t in view.trials if t.state == "RUNNING"],  # a confirmation start's server runs too
        measured=sum(t.measured for t in finished),
        feasible=sum(t.feasible for t in finished),
        best=_best(view),
        failures=dict(failures.most_common()),
        skipped=dict(skipped.most_common()),
        server_minutes=sum(t.server_seconds for t in view.trials) / 60,
        server_minutes_saved=saved if skipped else 0.0,
        state=_state(view),
        stopped=view.stopped,
        twin=[
            (t.number, t.twin_predicted_tok_s, t.output_tok_s if t.slo_stop is None else None)
            for t in finished
            if t.twin_predicted_tok_s is not None and t.duplicate_of is None
        ],
        twin_fallback=view.twin_fallback,
        twin_verdicts={t.number: t.twin_verdict_missed for t in finished if t.twin_verdict_missed is not None},
        confirmation_starts=c.confirmation_starts,
        confirmation_measured=c.confirmation_measured,
        confirmation_minutes=sum(t.server_seconds for t in view.confirmation_starts) / 60,
        interrupted=c.interrupted,
        repeats=c.repeats,
    )


def _opt_str(v: Any) -> str | None:
    return str(v) if v is not None else None


def machine_line(view: StudyView) -> str | None:
    """What the machine was doing over the study's load phases, in one line: other processes' CPU (least and
    most), steal, the emulator's largest lag and the lagged trials; None when no trial recorded it."""
    known = [c for t in view.trials if (c := Contention.of(t.contention)) is not None]
    if not known:
        return None
    parts = []
    others = [c.other_cores for c in known if c.other_cores is not None]
    if others:
        parts.append(f"other processes {min(others):.1f}-{max(others):.1f} cores")
    steals = [c.steal for c in known if c.steal is not None]
    if steals:
        parts.append(f"steal up to {max(steals):.0%}")
    lags = [c.emulator_lag_share for c in known if c.emulator_lag_share is not None]
    if lags:
        lagged = sum(c.lagged for c in known)
        again = sum(c.measured_again for c in known)
        parts.append(
            f"emulator lag up to {max(lags):.1%} of a run, {lagged} trial{_s(lagged)} lagged, "
            f"{again} run{_s(again)} measured again"
        )
    return f"machine over {len(known)} load phase{_s(len(known))}: " + ", ".join(parts) if parts else None
