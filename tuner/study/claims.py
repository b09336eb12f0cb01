"""Never the same flags twice: a flag set is claimed by the first trial that proposes it, across every worker of a
study; a later trial with the same flags takes the original's result instead of launching again."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.storages import fail_stale_trials
from optuna.trial import FrozenTrial, TrialState

from tuner.errors import ConfigError, StorageError
from tuner.record import MEASURED, RECORD_VERSION, TrialRecord
from tuner.space import SearchSpace
from tuner.store import Store
from tuner.study.trial import TrialLike
from tuner.twin.sampler import SAME_AS_ATTR

__all__ = ["Claims", "repeats_stop_line"]

Values = tuple[float, float]


@dataclass
class Claims:
    """The claims of one study: in its store when the trial is an `optuna.Trial`, else in memory (a FixedTrial)."""

    store: Store | None
    study_name: str
    on_event: Callable[[str], None]
    poll_s: float = 1.0
    # flag key -> (trial number, values, user attributes, constraints) of the trial that ran it, for FixedTrials
    local: dict[str, tuple[int, Values, dict[str, Any], dict[str, float]]] = field(default_factory=dict)

    def duplicate(self, trial: TrialLike, key: str) -> Values | None:
        """The stored result when this flag set was launched before (or is being launched by another worker)."""
        same = self._same_as(trial)
        if same is not None:
            return same
        if self.store is None or not isinstance(trial, optuna.Trial):
            local = self.local.get(key)
            return None if local is None else self._copy(trial, *local)
        study = trial.study
        while True:
            owner = self.store.claim(self.study_name, key, trial.number)
            if owner == trial.number:
                return None
            previous = _trial_by_number(study, owner)
            if previous is None or previous.state in (TrialState.FAIL, TrialState.PRUNED):
                # The launch of this flag set died with its worker or was interrupted: this trial launches it.
                if self.store.take_over_claim(self.study_name, key, owner, trial.number):
                    return None
                continue
            if previous.state == TrialState.COMPLETE:
                assert previous.values is not None
                values = (float(previous.values[0]), float(previous.values[1]))
                return self._copy(trial, owner, values, previous.user_attrs, previous.constraints)
            # RUNNING or WAITING: another worker is measuring it now; wait for its result rather than launch again.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ExperimentalWarning)
                fail_stale_trials(study)
            time.sleep(self.poll_s)

    def _same_as(self, trial: TrialLike) -> Values | None:
        """The result of the measured trial the twin simulates these flags as (its SAME_AS_ATTR): a known answer,
        given as a repeat is, without a launch."""
        owner = trial.user_attrs.get(SAME_AS_ATTR)
        if not isinstance(trial, optuna.Trial) or not isinstance(owner, int):
            return None
        previous = _trial_by_number(trial.study, owner)
        if previous is None or previous.state != TrialState.COMPLETE or previous.values is None:
            return None
        values = (float(previous.values[0]), float(previous.values[1]))
        note = f"the twin simulates these flags as trial {owner}'s (the same batch, the same steps)"
        return self._copy(trial, owner, values, previous.user_attrs, previous.constraints, note)

    def remember(self, key: str, number: int, values: Values, attrs: dict[str, Any], cons: dict[str, float]) -> None:
        self.local[key] = (number, values, dict(attrs), cons)

    def release(self, trial: TrialLike, key: str) -> None:
        if self.store is not None and isinstance(trial, optuna.Trial):
            with contextlib.suppress(StorageError):
                self.store.release_claim(self.study_name, key, trial.number)

    def _copy(
        self,
        trial: TrialLike,
        owner: int,
        values: Values,
        attrs: dict[str, Any],
        constraints: dict[str, float],
        note: str | None = None,
    ) -> Values:
        own = TrialRecord.from_attrs(trial.user_attrs)
        copied = TrialRecord.from_attrs(attrs).model_copy(
            update={
                "record_version": RECORD_VERSION,
                "flags": own.flags,
                "baseline": own.baseline,
                "repairs": own.repairs,
                "warnings": own.warnings,
                "duplicate_of": owner,
                # Not a confirmation start, and no run of its own: the owner's intervals are the owner's.
                "repeat_of": None,
                "ci_run": None,
                "server_seconds": 0.0,
                "attempts": 0,
            }
        )
        for name, value in copied.to_attrs().items():
            trial.set_user_attr(name, value)
        for name, value in constraints.items():
            trial.set_constraint(name, value)
        said = note or f"same flags as trial {owner}"
        self.on_event(f"trial {trial.number}: {said}; its result is reused, nothing launched")
        if self.store is not None and isinstance(trial, optuna.Trial):
            self.store.save_trial(
                self.study_name,
                trial.number,
                flags=copied.flags,
                baseline=copied.baseline,
                outcome=copied.outcome or MEASURED,
                reason=copied.reason,
                message=f"{note}: not launched" if note else f"duplicate of trial {owner}: not launched again",
                attempts=0,
                server_seconds=0.0,
            )
        return values


def _trial_by_number(study: optuna.Study, number: int) -> FrozenTrial | None:
    for t in study.get_trials(deepcopy=False):
        if t.number == number:
            return t
    return None


def repeats_stop_line(finished: list[FrozenTrial], space: SearchSpace, cap: int, budget: int) -> str:
    """Why a run ended at the repeat cap short of its budget, from its finished search trials: the twin answered its
    proposals from a measured trial it simulates them as (SAME_AS_ATTR: every proposal alike at this load), or the
    sampler kept proposing flag sets already tried (a small space, every point seen, or a sampler drawing tried
    ones). Each says what happened, then what would let the run measure more."""
    answered = [t for t in finished if t.user_attrs.get("duplicate_of") is not None]
    done = len(finished) - len(answered)
    by_owner: dict[int, list[FrozenTrial]] = {}
    for t in answered:
        owner = t.user_attrs.get(SAME_AS_ATTR)
        if isinstance(owner, int) and not isinstance(owner, bool):
            by_owner.setdefault(owner, []).append(t)
    simulated = sum(len(ts) for ts in by_owner.values())
    repeats = len(answered) - simulated
    stop = f"stopping at {done} distinct flag set{'s' if done != 1 else ''} tried of the budget's {budget}"
    if not simulated:
        return (
            f"the sampler proposed flag sets already tried {repeats} times ({cap}x the budget in all): "
            f"{_space_seen(finished, space)}; {stop}"
        )
    owners = {t.number: t for t in finished if t.number in by_owner}
    alike = " and ".join(f"#{n}" + (f" ({len(ts)})" if len(by_owner) > 1 else "") for n, ts in sorted(by_owner.items()))
    twins = [t for ts in by_owner.values() for t in ts]
    differ = _differing([owners[n] if n in owners else ts[0] for n, ts in by_owner.items()] + twins)
    how = f"they differ from it only in {_flag_ranges(differ)}, which change nothing at this load" if differ else ""
    also = f"; the sampler also proposed flag sets already tried {repeats} times" if repeats else ""
    kinds = len({repr(sorted((t.user_attrs.get("flags") or {}).items())) for t in twins})
    proposed = f"{kinds} proposed flag set{'s' if kinds != 1 else ''}" + (
        f" ({simulated} proposals)" if kinds != simulated else ""
    )
    source = "it" if len(by_owner) == 1 else "them"
    return (
        f"the twin simulates {proposed} as behaving like trial {alike} (the same fullest batch, the same steps"
        f"{': ' + how if how else ''}) and answered them from {source} without a launch{also}; {stop}: for flag sets "
        "that tell apart, widen the space where the batch or the steps change (e.g. a max_num_seqs below the load's "
        "concurrency, a gpu_memory_utilization that holds fewer requests' KV) or raise the load (arrival)"
    )


def _space_seen(finished: list[FrozenTrial], space: SearchSpace) -> str:
    """How much of a finite space the trials tried ('all 4 points of the space tried'); for a continuous one, that it
    may hold no other flag set the sampler would propose."""
    try:
        grid = space.grid()
    except ConfigError:
        return "the space may hold no other flag set the sampler would propose"
    names = sorted(grid)
    points = 1
    for values in grid.values():
        points *= len(values)
    seen = {
        tuple(repr(t.params[n]) for n in names)
        for t in finished
        if all(n in t.params and t.params[n] in grid[n] for n in names)
    }
    if len(seen) >= points:
        return f"all {points} points of the space are tried; widen it (more choices, a wider range) to measure more"
    return (
        f"{len(seen)} of the space's {points} points tried, the sampler drawing tried ones again; a larger budget "
        "or another sampler (twin, tpe) reaches the rest"
    )


def _differing(trials: list[FrozenTrial]) -> dict[str, list[Any]]:
    """The flags whose values differ among `trials` (their stored flags), each with the values seen."""
    values: dict[str, list[Any]] = {}
    flags = [t.user_attrs.get("flags") or {} for t in trials]
    for name in sorted({n for f in flags for n in f}):
        seen = [f.get(name) for f in flags]
        if any(v != seen[0] for v in seen):
            values[name] = seen
    return values


def _flag_ranges(differ: dict[str, list[Any]]) -> str:
    """'max_num_seqs 8..64 and gpu_memory_utilization 0.85..0.95': each differing flag with the span of its values."""
    parts = []
    for name, seen in differ.items():
        known = sorted({v for v in seen if isinstance(v, int | float) and not isinstance(v, bool)})
        parts.append(f"{name} {known[0]:g}..{known[-1]:g}" if len(known) > 1 else name)
    return " and ".join(parts) if len(parts) < 3 else ", ".join(parts[:-1]) + " and " + parts[-1]
