"""Optuna's RDB storage whose every database call waits out a lost connection (tuner.store.waiting), for the
study's run: a PostgreSQL restart during a trial is a pause, not a failed trial."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import RDBStorage
from optuna.trial import TrialState

from tuner.store.waiting import StorageWait

__all__ = ["WaitingRDBStorage"]

# Every method that reaches the database, as Optuna's own cache in front of the storage calls them. The heartbeat
# is not among them: a missed beat is retried next interval, and the grace period absorbs it.
_WAITED = (
    "create_new_study",
    "delete_study",
    "set_study_user_attr",
    "set_study_system_attr",
    "get_study_id_from_name",
    "get_study_name_from_id",
    "get_study_directions",
    "get_study_user_attrs",
    "get_study_system_attrs",
    "get_trial_user_attrs",
    "get_trial_system_attrs",
    "get_all_studies",
    "create_new_trial",
    "_create_new_trial",
    "set_trial_param",
    "_set_trial_param",
    "get_trial_param",
    "set_trial_intermediate_value",
    "set_trial_user_attr",
    "set_trial_system_attr",
    "get_trial_id_from_study_id_trial_number",
    "get_trial",
    "get_all_trials",
    "_get_trials",
    "get_best_trial",
    "_get_best_trial_id",
    "_get_stale_trial_ids",
)


class WaitingRDBStorage(RDBStorage):
    """RDBStorage with `waiting` around every database call (None: calls run once, as RDBStorage's)."""

    waiting: StorageWait | None = None

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Sequence[float] | None = None) -> bool:
        """A trial told; a retry finding it told already by the attempt whose answer the lost connection swallowed
        (its commit went through) is that attempt's success, not an error."""
        attempts = 0

        def tell() -> bool:
            nonlocal attempts
            attempts += 1
            try:
                return RDBStorage.set_trial_state_values(self, trial_id, state, values)
            except UpdateFinishedTrialError:
                if attempts > 1 and RDBStorage.get_trial(self, trial_id).state == state:
                    return True
                raise

        return self.waiting.call(tell) if self.waiting is not None else tell()


def _waited(name: str) -> Callable[..., Any]:
    plain = getattr(RDBStorage, name)

    @functools.wraps(plain)
    def call(self: WaitingRDBStorage, *args: Any, **kwargs: Any) -> Any:
        if self.waiting is None:
            return plain(self, *args, **kwargs)
        return self.waiting.call(lambda: plain(self, *args, **kwargs))

    return call


for _name in _WAITED:
    setattr(WaitingRDBStorage, _name, _waited(_name))
