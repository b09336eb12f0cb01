"""A finished trial's verdict written again: its values, its SLO constraints and its record's figures.

Optuna has no call that changes a finished trial (`tell` once; attributes refused after), and the study's front,
its samplers and every reader read the verdict from those three places. A study judged under new SLOs
(`tuner.report.rejudge`) writes each re-judged trial's there, in one transaction per trial, in Optuna's own
tables: `trial_values`, `trial_system_attributes` (the `constraints:<name>` keys `set_constraint` writes) and
`trial_user_attributes`. Call it before the study is read through Optuna's cache in this process (`load_study`
caches finished trials).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from optuna.storages import RDBStorage

__all__ = ["rewrite_verdict"]

_CONSTRAINT = "constraints:"
_DELETE_CONSTRAINTS = sa.text(
    "DELETE FROM trial_system_attributes WHERE trial_id = :trial AND (key = 'constraints' OR key LIKE 'constraints:%')"
)
_ADD_SYSTEM = sa.text("INSERT INTO trial_system_attributes (trial_id, key, value_json) VALUES (:trial, :key, :value)")
_DELETE_USER = sa.text("DELETE FROM trial_user_attributes WHERE trial_id = :trial AND key = :key")
_ADD_USER = sa.text("INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (:trial, :key, :value)")
_SET_VALUE = sa.text("UPDATE trial_values SET value = :value WHERE trial_id = :trial AND objective = :objective")


def rewrite_verdict(
    storage: RDBStorage,
    trial_id: int,
    *,
    values: Sequence[float] | None,
    constraints: Mapping[str, float],
    user_attrs: Mapping[str, Any],
) -> None:
    """Trial `trial_id`'s values (None: kept), its constraints (all replaced: `{"startup": 0.0, "slo:...": v}`)
    and the user attributes given (None: removed)."""
    with storage.engine.begin() as conn:
        for objective, value in enumerate(values or ()):
            if math.isfinite(value):  # the study's values always are; an infinite one is left as it was
                conn.execute(_SET_VALUE, {"value": value, "trial": trial_id, "objective": objective})
        conn.execute(_DELETE_CONSTRAINTS, {"trial": trial_id})
        for name, value in constraints.items():
            conn.execute(_ADD_SYSTEM, {"trial": trial_id, "key": _CONSTRAINT + name, "value": json.dumps(value)})
        for key, value in user_attrs.items():
            conn.execute(_DELETE_USER, {"trial": trial_id, "key": key})
            if value is not None:
                conn.execute(_ADD_USER, {"trial": trial_id, "key": key, "value": json.dumps(value)})
