"""What the sampler tests share: GP's optional packages, and a study told by hand."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import optuna
import pytest

from tuner.flags import VllmFlags
from tuner.space import SearchSpace
from tuner.study.verdict import DIRECTIONS


def require_gp() -> None:
    """GPSampler's torch and scipy, which scripts/test installs (tuner[test]): a skip without them, a failure in CI."""
    missing = [name for name in ("torch", "scipy") if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = f"GPSampler needs {' and '.join(missing)}, not installed (pip install -e '.[test]')"
    if os.environ.get("TUNER_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{message} (TUNER_REQUIRE_SERVICES=1 requires it)", pytrace=False)
    pytest.skip(message)


def random_trials_before_the_model(
    sampler: optuna.samplers.BaseSampler, space: SearchSpace, value: Callable[[VllmFlags], float], up_to: int
) -> int:
    """Trials asked and told in turn until the sampler proposes one from its model (Optuna's relative sample) rather
    than at random; `up_to` when it never does."""
    study = optuna.create_study(directions=DIRECTIONS, sampler=sampler)
    for n in range(up_to):
        trial = study.ask()
        if trial.relative_params:
            return n
        flags = space.suggest(trial).flags
        study.tell(trial, [value(flags), 1.0])
    return up_to
