"""A study carried into its job's edited space: Optuna's stored parameters rewritten under the new distributions.

Optuna keeps one distribution per parameter name in a study: a parameter whose `choices` changed (or whose range
turned into choices, or whose log scale flipped) is refused when the next trial suggests it ("CategoricalDistribution
does not support dynamic value space"), after the trial was created, so the trial fails and the run stops. And a
sampler's joint model (TPE's groups, GP's intersection) keeps only the parameters every trial drew from one
distribution, so even a widened range, which Optuna allows, drops the flag from it.

So before the first trial of the edited space, each stored trial's parameter is moved onto the new distribution
where its value lies in it; where it does not, the parameter is removed from the trial (its flags, in the trial's
record, stay: the trial is history, measured outside the space, and no sampler draws it again). A queued trial keeps
only the fixed values that lie in the space. Only Optuna's `trial_params` rows and queued trials' `fixed_params`
change: the values, the records and the per-request figures stay as measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from optuna.distributions import BaseDistribution, distribution_to_json, json_to_distribution
from optuna.storages import RDBStorage
from optuna.trial import FrozenTrial, TrialState

from tuner.record import TrialRecord
from tuner.space import SearchSpace

__all__ = ["SpaceCarry", "carry_space", "in_space"]

_ROWS = sa.text(
    "SELECT p.param_id, p.param_name, p.param_value, p.distribution_json, t.number FROM trial_params p "
    "JOIN trials t ON t.trial_id = p.trial_id JOIN studies s ON s.study_id = t.study_id "
    "WHERE s.study_name = :study"
)  # every state: a trial a killed worker left RUNNING is failed later, its parameters still read by the next suggest
_MOVE = sa.text("UPDATE trial_params SET param_value = :value, distribution_json = :dist WHERE param_id = :id")
_DROP = sa.text("DELETE FROM trial_params WHERE param_id = :id")


@dataclass
class SpaceCarry:
    """What carrying the stored trials into the space did (or, not written, would do)."""

    moved: int = 0  # parameters moved onto the new distribution
    outside: set[int] = field(default_factory=set)  # trials with a value outside the new space: history
    queued: int = 0  # queued trials' fixed values dropped

    def line(self) -> str:
        outside = ", ".join(f"#{n}" for n in sorted(self.outside)) or "none"
        queued = f"; {self.queued} queued values outside it dropped" if self.queued else ""
        return (
            f"space: {self.moved} stored values carried into the new space; trials outside it, kept as history and "
            f"not drawn again: {outside}{queued}"
        )


def carry_space(storage: RDBStorage, study: str, space: SearchSpace, *, write: bool = True) -> SpaceCarry:
    """Rewrite study `study`'s stored parameters under `space`'s distributions (see the module); `write=False`
    says what it would do. Call it before the study is read through Optuna's cache (`optuna.load_study` caches
    finished trials) in this process."""
    carry = SpaceCarry()
    with storage.engine.begin() as conn:
        for param_id, name, value, dist_json, number in conn.execute(_ROWS, {"study": study}).all():
            new = space.distributions.get(name)
            if new is None:
                continue  # a flag no longer searched: the trial keeps what it drew
            old = json_to_distribution(dist_json)
            if old == new:
                continue
            internal = _internal(new, old.to_external_repr(value))
            if internal is None:
                carry.outside.add(int(number))
                if write:
                    conn.execute(_DROP, {"id": param_id})
                continue
            carry.moved += 1
            if write:
                conn.execute(_MOVE, {"value": internal, "dist": distribution_to_json(new), "id": param_id})
    carry.queued = _queued(storage, study, space, write=write)
    return carry


def _internal(dist: BaseDistribution, value: Any) -> float | None:
    """`value` in `dist`'s internal form; None when `dist` cannot hold it."""
    try:
        internal = dist.to_internal_repr(value)
    except (ValueError, TypeError):
        return None
    return float(internal) if dist._contains(internal) else None


def _queued(storage: RDBStorage, study: str, space: SearchSpace, *, write: bool) -> int:
    """Queued trials' fixed values outside the space, dropped: Optuna would refuse a categorical one when the trial
    runs (a value outside a range it warns of and takes; it is dropped too, so no trial runs outside the space)."""
    dropped = 0
    study_id = storage.get_study_id_from_name(study)
    for t in storage.get_all_trials(study_id, deepcopy=False, states=(TrialState.WAITING,)):
        fixed = t.system_attrs.get("fixed_params")
        if not isinstance(fixed, dict):
            continue
        kept = {k: v for k, v in fixed.items() if k not in space.distributions or _fits(space, k, v)}
        if len(kept) < len(fixed):
            dropped += len(fixed) - len(kept)
            if write:
                storage.set_trial_system_attr(t._trial_id, "fixed_params", kept)
    return dropped


def _fits(space: SearchSpace, name: str, value: Any) -> bool:
    return _internal(space.distributions[name], value) is not None


def in_space(space: SearchSpace, trial: FrozenTrial) -> bool:
    """Whether the trial's flag set is one `space` can propose (the baseline always is): every searched flag drawn
    from the space, and no other flag than the space gives (a flag dropped from the space ran at a value of its
    own). A confirmation starts only these again: a flag set outside cannot be asked of the space's trials."""
    record = TrialRecord.from_attrs(trial.user_attrs)
    if record.baseline:
        return True
    params = trial.params
    if any(name not in params or not _fits(space, name, params[name]) for name in space.distributions):
        return False
    flags = space.repair({name: params[name] for name in space.distributions}).flags.as_dict()
    return json.loads(json.dumps(flags)) == record.flags or not record.flags
