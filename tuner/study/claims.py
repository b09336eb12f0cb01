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

from tuner.errors import StorageError
from tuner.record import MEASURED, RECORD_VERSION, TrialRecord
from tuner.store import Store
from tuner.study.trial import TrialLike
from tuner.twin.sampler import SAME_AS_ATTR

__all__ = ["Claims"]

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
