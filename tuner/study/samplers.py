"""The samplers a job can name, by name: `make_sampler` looks the job's up in `SAMPLERS`.

A new sampler is one factory registered here (`@sampler("name")`, it may live in its own module imported below)
and its name in `tuner.config.SamplerName`. Multi-objective everywhere; constraints come from each trial's
`set_constraint` (Optuna 5 reads `FrozenTrial.constraints` in TPE, GP and NSGA-II; their `constraints_func` is
deprecated there): SLO misses as their relative violation, failed and skipped starts as a positive "startup".

The baseline (trial 0, vLLM's defaults) often gives no value for a flag: a categorical whose choices lack vLLM's
default (`max_num_seqs: {choices: [16, ..., 128]}` against vLLM's 256). Optuna's multivariate TPE and GP model the
intersection of the trials' parameters, so that flag dropped out of the joint model for the whole study and was
drawn one at a time (TPE) or at random (GP). TPE here decomposes the space into groups (the baseline's flags, the
rest), each modelled jointly; GP draws such a flag with univariate TPE.

Budget-aware: a model-based sampler's random start (TPE's and GP's start-up trials, NSGA-II's first generation) is
a share of the job's budget unless the job names it (`startup_trials`), so a budget of 8 is not random search.
"""

from __future__ import annotations

import hashlib
import importlib.util
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.exceptions import ExperimentalWarning
from optuna.trial import FrozenTrial, TrialState

from tuner.config import SAMPLER_NAMES, Job, SamplerSection
from tuner.errors import ConfigError
from tuner.space import SearchSpace
from tuner.twin.sampler import TwinSampler, twin_unsupported

__all__ = [
    "SAMPLERS",
    "AskTellGridSampler",
    "SamplerFactory",
    "make_sampler",
    "mixed_seed",
    "population_size",
    "sampler",
    "sampler_name",
    "startup_trials",
]

SamplerFactory = Callable[[SamplerSection, SearchSpace, "int | None", int], optuna.samplers.BaseSampler]
"""(the job's sampler section, its search space, the seed for this worker, the job's budget in trials) -> the
sampler."""

SAMPLERS: dict[str, SamplerFactory] = {}


def sampler(name: str) -> Callable[[SamplerFactory], SamplerFactory]:
    """Register a sampler factory under the name a job's `sampler.name` gives."""

    def register(factory: SamplerFactory) -> SamplerFactory:
        SAMPLERS[name] = factory
        return factory

    return register


def sampler_name(job: Job) -> str:
    """The job's sampler; without one named, the twin where it can imitate the target (a GPU and a model the
    capacity arithmetic knows, a throughput objective), else TPE."""
    if job.sampler.name is not None:
        return job.sampler.name
    return "twin" if twin_unsupported(job) is None else "tpe"


def startup_trials(s: SamplerSection, n_trials: int) -> int:
    """Random trials before TPE's or GP's model: the job's `n_startup_trials`, else a quarter of the budget, 2 to 10.

    Optuna's default of 10 is sized for its own recommended budgets (TPE 100 to 1000 trials, GP 10 to 100, the
    start-up trials included: the samplers table of its reference), where it is a tenth or less; against a budget
    of 8 it is the whole budget and the model never runs (Optuna's own issue 6723). A quarter keeps three quarters
    of a small budget for the model; 2 is the least TPE splits into a good and a bad trial; 10 is Optuna's default,
    kept from a budget of 40 on. The baseline and the flag sets the pre-launch filter skips count among them.
    """
    if s.n_startup_trials is not None:
        return s.n_startup_trials
    return max(2, min(10, n_trials // 4))


def population_size(s: SamplerSection, n_trials: int) -> int:
    """NSGA-II's population: the job's `population_size`, else a quarter of the budget, 2 to 8.

    Its first generation is drawn at random: Optuna's default population of 50, or our 8 against a budget of 8, is
    random search. A quarter leaves three quarters of the budget to bred generations, as TPE's start-up share
    does; 2 is the least its crossover takes (two parents); 8, the default before, from a budget of 32 on."""
    if s.population_size is not None:
        return s.population_size
    return max(2, min(8, n_trials // 4))


def mixed_seed(seed: int, offset: int) -> int:
    """The job's seed for a worker at `offset`: the seed itself at 0 (one worker, a fresh study: the job's own
    draws), else both hashed together. Not their sum: workers given their own seeds (0, 1) whose offsets differ by
    one would sum to one seed, and two samplers drawing alike propose every flag set twice."""
    if offset == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}/{offset}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "big")


def make_sampler(
    job: Job, space: SearchSpace, *, seed_offset: int = 0, on_event: Callable[[str], None] | None = None
) -> optuna.samplers.BaseSampler:
    """The job's sampler, seeded (a worker's `seed_offset` keeps workers of one study from proposing alike)."""
    s = job.sampler
    name = sampler_name(job)
    seed = None if s.seed is None else mixed_seed(s.seed, seed_offset)
    factory = SAMPLERS.get(name)
    if factory is None:
        raise ConfigError(f"sampler.name: unknown sampler {name!r}; use {', '.join(SAMPLERS)}")
    if name == "twin":
        why = twin_unsupported(job)
        if why is not None:
            raise ConfigError(f"sampler.name: twin cannot imitate this job: {why}; use tpe, gp, nsga2, random or grid")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ExperimentalWarning)
        made = factory(s, space, seed, job.budget.n_trials)
    if isinstance(made, TwinSampler):
        made.bind(job, on_event)
    return made


@sampler("tpe")
def _tpe(s: SamplerSection, space: SearchSpace, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    kwargs: dict[str, Any] = {"seed": seed, "constant_liar": True, "n_startup_trials": startup_trials(s, n_trials)}
    if s.multivariate is False:
        return optuna.samplers.TPESampler(multivariate=False, **kwargs)
    # Group decomposition by default: the flags the baseline holds are one group, the ones it lacks another, each
    # modelled jointly; Optuna's plain multivariate TPE (`group: false`) models only the flags every trial holds.
    # Measured side by side (benchmarks/README.md): never worse here, and on rtx4090-long 16 trials to 97% of the
    # best against 18; a model of the job's whole space that leaves the baseline out was worse (19 and 13 vs 11).
    return optuna.samplers.TPESampler(multivariate=True, group=s.group is not False, **kwargs)


@sampler("nsga2")
def _nsga2(s: SamplerSection, space: SearchSpace, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.NSGAIISampler(seed=seed, population_size=population_size(s, n_trials))


@sampler("random")
def _random(s: SamplerSection, space: SearchSpace, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
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
def _grid(s: SamplerSection, space: SearchSpace, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    return AskTellGridSampler(space.grid(), seed=seed)


@sampler("gp")
def _gp(s: SamplerSection, space: SearchSpace, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("scipy") is None:
        raise ConfigError(
            "sampler.name: gp needs torch and scipy, which are not installed (pip install 'tuner[gp]'); "
            "use tpe, nsga2, random or grid"
        ) from None
    startup = startup_trials(s, n_trials)
    # GP models the intersection of the trials' parameters; a flag the baseline lacks falls to the independent
    # sampler for the whole study: univariate TPE models it from the trials that hold it, where Optuna's default
    # (random) would draw it blind. Within the start-up trials TPE is random too.
    independent = optuna.samplers.TPESampler(seed=seed, multivariate=False, n_startup_trials=startup)
    return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup, independent_sampler=independent)


@sampler("twin")
def _twin(s: SamplerSection, space: SearchSpace, seed: int | None, n_trials: int) -> optuna.samplers.BaseSampler:
    # The fallback models the trials measured so far at once: they are its start-up trials.
    fallback = _tpe(s.model_copy(update={"n_startup_trials": s.n_startup_trials or 0}), space, seed, n_trials)
    return TwinSampler(space, seed, fallback)


# Every name a job may give has a factory (a test-time check would come too late for a user's overnight run).
assert set(SAMPLERS) == set(SAMPLER_NAMES), "tuner.config.SamplerName and tuner.study.samplers disagree"
