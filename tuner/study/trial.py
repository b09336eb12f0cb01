"""What the study uses of a trial, live (`optuna.Trial`) or fixed (`optuna.trial.FixedTrial`), and a trial's verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tuner.feasibility import Prediction
from tuner.flags import VllmFlags
from tuner.study.measure import Measurement

__all__ = ["TrialLike", "TrialResult"]


class TrialLike(Protocol):
    """What the objective uses of optuna.Trial and optuna.trial.FixedTrial."""

    @property
    def number(self) -> int: ...

    @property
    def user_attrs(self) -> dict[str, Any]: ...

    def set_user_attr(self, key: str, value: Any) -> None: ...

    def set_constraint(self, key: str, value: float) -> None: ...

    def suggest_int(self, name: str, low: int, high: int, *, step: int = 1, log: bool = False) -> int: ...

    def suggest_float(
        self, name: str, low: float, high: float, *, step: float | None = None, log: bool = False
    ) -> float: ...

    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


@dataclass
class TrialResult:
    """One trial's verdict, before it is told to Optuna and stored."""

    outcome: str
    flags: VllmFlags
    reason: str | None = None
    message: str | None = None
    prediction: Prediction | None = None
    measurement: Measurement | None = None
    facts: dict[str, Any] | None = None
    log_tail: str | None = None
    attempts: int = 0
    server_seconds: float = 0.0
