"""The plain samplers as a job names them: TPE's options, what the baseline and the pre-launch filter tell every
sampler (the constraints Optuna's samplers read), and the joint model over the job's whole space, which the
baseline's missing flag no longer shrinks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from sampler_fakes import random_trials_before_the_model, require_gp
from study_fakes import JOB, FakeLauncher, fake_measure, job
from typer.testing import CliRunner

from tuner.cli import app
from tuner.config import parse_job
from tuner.errors import ConfigError
from tuner.flags import VllmFlags
from tuner.study import TuningRun
from tuner.study.samplers import make_sampler

# The fake job's L4 serves Llama-3.1-8B: vLLM's default of 256 sequences is not among these choices, so the
# baseline trial holds no max_num_seqs; a 131,072-token max_model_len cannot start (the pre-launch filter skips it).
SPACE: dict[str, Any] = {
    "max_num_seqs": {"choices": [8, 16, 32, 64]},
    "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
    "max_model_len": {"choices": [4096, 131072]},
}


def run_study(tmp_path: Path, sampler: dict[str, Any], n_trials: int = 8) -> optuna.Study:
    j = job(space=SPACE, sampler={"seed": 1, **sampler}, budget={"n_trials": n_trials})
    tuning = TuningRun(j, FakeLauncher(), storage_url=f"sqlite:///{tmp_path / 's.db'}", measure=fake_measure())
    try:
        tuning.run()
        return tuning.study
    finally:
        tuning.close()


def test_the_baseline_and_the_filters_skips_reach_the_sampler_as_recorded_trials(tmp_path: Path) -> None:
    study = run_study(tmp_path, {"name": "random"}, n_trials=12)
    trials = study.get_trials(deepcopy=False)
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    baseline = trials[0]
    # The baseline's constraints are those of any trial, its parameters what of vLLM's defaults the space can hold.
    assert baseline.user_attrs["baseline"] and "max_num_seqs" not in baseline.params
    assert set(baseline.constraints) == {"startup", "slo:e2e_p95<=2s", "slo:success_rate>=0.9"}
    skipped = [t for t in trials if t.user_attrs.get("outcome") == "skipped_infeasible"]
    assert skipped, "the space has flag sets the pre-launch filter skips"
    for t in skipped:
        # The worst values and a positive start-up constraint: infeasible to TPE (its total violation), NSGA-II
        # (constrained domination) and GP (its constraint model), graded above any SLO miss.
        assert t.params["max_model_len"] == 131072 and t.values == [0.0, 30.0]
        assert 10.0 < t.constraints["startup"] <= 11.0 and t.user_attrs["reason"] == "kv_cache_too_small"
        assert all(v == 0.0 for k, v in t.constraints.items() if k != "startup")
    assert not {t.number for t in skipped} & {t.number for t in study.best_trials}


def test_tpe_models_the_flag_the_baseline_lacks_in_a_group_of_its_own(tmp_path: Path) -> None:
    """Optuna's plain multivariate TPE models the intersection of the trials' parameters; with the baseline in the
    study that leaves max_num_seqs, the flag that matters most, out of the joint model for good."""
    study = run_study(tmp_path, {"name": "tpe", "n_startup_trials": 3}, n_trials=6)
    j = job(space=SPACE, sampler={"name": "tpe", "seed": 1, "n_startup_trials": 3})
    ours = make_sampler(j, j.search_space())
    trial = study.trials[-1]
    assert set(ours.infer_relative_search_space(study, trial)) == set(SPACE)
    optunas = optuna.samplers.TPESampler(multivariate=True)
    assert "max_num_seqs" not in optunas.infer_relative_search_space(study, trial)
    # and it proposes from the model: every flag a relative (not an independent) draw
    plain = optuna.load_study(study_name=study.study_name, storage=f"sqlite:///{tmp_path / 's.db'}")  # no heartbeat
    running = plain._storage.get_trial(plain.ask()._trial_id)
    proposed = ours.sample_relative(plain, running, ours.infer_relative_search_space(plain, running))
    assert set(proposed) == set(SPACE)


def test_tpe_options_choose_the_model(tmp_path: Path) -> None:
    study = run_study(tmp_path, {"name": "random"}, n_trials=4)
    trial = study.trials[-1]

    def relative(**options: Any) -> set[str]:
        j = job(space=SPACE, sampler={"name": "tpe", **options})
        return set(make_sampler(j, j.search_space()).infer_relative_search_space(study, trial))

    assert relative(multivariate=False) == set()  # one flag at a time
    assert relative(group=False) == set(SPACE) - {"max_num_seqs"}  # Optuna's intersection: the baseline's flags
    assert relative() == set(SPACE)  # the groups: the baseline's flags, and max_num_seqs


def test_the_twins_fallback_is_tpe_with_the_jobs_options() -> None:
    j = job(space=SPACE, sampler={"name": "twin", "seed": 1, "multivariate": False})
    made = make_sampler(j, j.search_space())
    fallback = made.fallback  # type: ignore[attr-defined]
    assert isinstance(fallback, optuna.samplers.TPESampler) and not fallback._multivariate


@pytest.mark.parametrize(
    ("sampler", "expected"),
    [
        ({"name": "gp", "multivariate": True}, "sampler.multivariate: only tpe and twin (its TPE fallback) take it"),
        ({"name": "random", "group": True}, "sampler.group: only tpe and twin (its TPE fallback) take it"),
        ({"name": "tpe", "group": True, "multivariate": False}, "sampler.group: needs multivariate"),
        ({"name": "tpe", "multivariate": "yes please"}, "sampler.multivariate"),
    ],
)
def test_a_sampler_option_the_sampler_does_not_take_is_one_line(sampler: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_job({**JOB, "sampler": sampler})
    message = str(info.value)
    assert expected in message and len(message.splitlines()) == 1


def test_the_default_sampler_takes_the_tpe_options() -> None:
    j = parse_job({**JOB, "sampler": {"group": True}})  # twin here (the L4 and Llama are known), else tpe
    assert j.sampler.group is True


def test_gp_draws_the_flag_the_baseline_lacks_with_tpe_not_at_random(tmp_path: Path) -> None:
    require_gp()
    study = run_study(tmp_path, {"name": "gp", "n_startup_trials": 2}, n_trials=4)  # two of them GP's
    gp = study.sampler
    assert isinstance(gp, optuna.samplers.GPSampler)
    # GP's joint model is the intersection of the trials' parameters, which the baseline cuts short; the flag it
    # lacks goes to the independent sampler: univariate TPE (which models it from the trials that hold it)
    assert "max_num_seqs" not in gp.infer_relative_search_space(study, study.trials[-1])
    independent = gp._independent_sampler
    assert isinstance(independent, optuna.samplers.TPESampler) and not independent._multivariate
    assert len({t.params.get("max_num_seqs") for t in study.trials}) > 1


def seqs_throughput(flags: VllmFlags) -> float:
    return float(flags.max_num_seqs or 256)


@pytest.mark.parametrize(
    ("n_trials", "options", "random_trials"),
    [
        (8, {}, 2),  # Optuna's 10 would be the whole budget: random search
        (20, {}, 5),  # a quarter of the budget
        (100, {}, 10),  # Optuna's default, from a budget of 40 on
        (8, {"n_startup_trials": 6}, 6),  # the job's own count wins
        (8, {"n_startup_trials": 0}, 1),  # TPE's model needs one trial to model
    ],
)
def test_tpes_start_up_trials_follow_the_budget(n_trials: int, options: dict[str, Any], random_trials: int) -> None:
    j = job(space=SPACE, sampler={"name": "tpe", "seed": 1, **options}, budget={"n_trials": n_trials})
    tpe = make_sampler(j, j.search_space())
    assert random_trials_before_the_model(tpe, j.search_space(), seqs_throughput, 12) == random_trials


def test_gps_start_up_trials_and_nsga2s_population_follow_the_budget() -> None:
    require_gp()
    j = job(space=SPACE, sampler={"name": "gp", "seed": 1}, budget={"n_trials": 12})
    assert random_trials_before_the_model(make_sampler(j, j.search_space()), j.search_space(), seqs_throughput, 6) == 3

    def population(n_trials: int, **options: Any) -> int | None:
        j = job(space=SPACE, sampler={"name": "nsga2", **options}, budget={"n_trials": n_trials})
        nsga2 = make_sampler(j, j.search_space())
        assert isinstance(nsga2, optuna.samplers.NSGAIISampler)
        return nsga2.population_size

    # The first generation is random: a quarter of the budget, at least the two parents its crossover takes.
    assert (population(8), population(20), population(200), population(8, population_size=6)) == (2, 5, 8, 6)


def test_tuner_tune_shows_the_samplers_options_and_refuses_a_wrong_one_in_one_line(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({**JOB, "sampler": {"name": "tpe", "group": True}}))
    result = CliRunner().invoke(app, ["tune", str(good), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "sampler: tpe, group: true" in " ".join(result.stdout.split())
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({**JOB, "sampler": {"name": "nsga2", "multivariate": False}}))
    # as a user runs it (the command's own error handling): one line, exit 2
    ran = subprocess.run([sys.executable, "-m", "tuner", "tune", str(bad)], capture_output=True, text=True)
    assert ran.returncode == 2 and "Traceback" not in ran.stderr
    assert ran.stderr.strip().endswith(
        "bad.yaml: sampler.multivariate: only tpe and twin (its TPE fallback) take it; sampler.name is nsga2"
    )
    assert len(ran.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "fake.db").exists()  # nothing written


def test_tuner_tune_help_names_the_sampler_options() -> None:
    result = CliRunner().invoke(app, ["tune", "--help"])
    assert result.exit_code == 0 and "multivariate: false" in " ".join(result.stdout.split())
