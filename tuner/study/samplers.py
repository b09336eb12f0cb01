"""The samplers a job can name, by name: `make_sampler` looks the job's up in `SAMPLERS`.

A new sampler is one factory registered here (`@sampler("name")`, it may live in its own module imported below)
and its name in `tuner.config.SamplerName`. Multi-objective everywhere; constraints come from each trial's
`set_constraint`.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, TrialState

from tuner.config import SAMPLERS as SAMPLER_NAMES
from tuner.config import Job, SamplerSection
from tuner.errors import ConfigError
from tuner.space import SearchSpace

__all__ = ["SAMPLERS", "AskTellGridSampler", "SamplerFactory", "make_sampler", "sampler"]

SamplerFactory = Callable[[SamplerSection, SearchSpace, "int | None"], optuna.samplers.BaseSampler]
"""(the job's sampler section, its search space, the seed for this worker) -> the sampler."""

SAMPLERS: dict[str, SamplerFactory] = {}


def sampler(name: str) -> Callable[[SamplerFactory], SamplerFactory]:
    """Register a sampler factory under the name a job's `sampler.name` gives."""

    def register(factory: SamplerFactory) -> SamplerFactory:
        SAMPLERS[name] = factory
        return factory

    return register


def make_sampler(job: Job, space: SearchSpace, *, seed_offset: int = 0) -> optuna.samplers.BaseSampler:
    """The job's sampler, seeded (a worker's `seed_offset` keeps workers of one study from proposing alike)."""
    s = job.sampler
    seed = None if s.seed is None else s.seed + seed_offset
    factory = SAMPLERS.get(s.name)
    if factory is None:
        raise ConfigError(f"sampler.name: unknown sampler {s.name!r}; use {', '.join(SAMPLERS)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        return factory(s, space, seed)


@sampler("tpe")
def _tpe(s: SamplerSection, space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    kwargs: dict[str, Any] = {"seed": seed, "multivariate": True, "constant_liar": True}
    if s.n_startup_trials is not None:
        kwargs["n_startup_trials"] = s.n_startup_trials
    return optuna.samplers.TPESampler(**kwargs)


@sampler("nsga2")
def _nsga2(s: SamplerSection, space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed, population_size=s.population_size or 8)


@sampler("random")
def _random(s: SamplerSection, space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)


class AskTellGridSampler(optuna.samplers.GridSampler):
    """Optuna's grid in the study's ask-and-tell loop. Optuna ends `optimize()` on a finished grid by calling
    `study.stop()`, which raises outside `optimize()` (a crash at the last grid point); here a finished grid is
    remembered (`exhausted`) and the run loop ends there."""

    exhausted = False

    def after_trial(
        self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Sequence[float] | None
    ) -> None:
        def finished() -> None:
            self.exhausted = True

        study.stop = finished  # type: ignore[method-assign]
        try:
            super().after_trial(study, trial, state, values)
        finally:
            del study.stop


@sampler("grid")
def _grid(s: SamplerSection, space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    return AskTellGridSampler(space.grid(), seed=seed)


@sampler("gp")
def _gp(s: SamplerSection, space: SearchSpace, seed: int | None) -> optuna.samplers.BaseSampler:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("scipy") is None:
        raise ConfigError(
            "sampler.name: gp needs torch and scipy, which are not installed (pip install torch scipy); "
            "use tpe, nsga2, random or grid"
        ) from None
    kwargs: dict[str, Any] = {"seed": seed}
    if s.n_startup_trials is not None:
        kwargs["n_startup_trials"] = s.n_startup_trials
    return optuna.samplers.GPSampler(**kwargs)


# Every name a job may give has a factory (a test-time check would come too late for a user's overnight run).
assert set(SAMPLERS) == set(SAMPLER_NAMES), "tuner.config.SamplerName and tuner.study.samplers disagree"
