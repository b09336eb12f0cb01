"""The contract every sampler a job may name keeps, as the study runs it (a fake launcher and load, a few trials).

In the spirit of Optuna's own sampler test suites, which every sampler inherits: trial 0 is vLLM's defaults; a
failed start and a pre-launch skip are told to the sampler like any trial (never failed, never launched again); a
flag set proposed again is answered from its first trial; the SLOs as constraints steer the samplers that read
them; and a study whose worker was killed resumes from its SQLite file with a new sampler that runs nothing twice.
The twin here is the real one (the emulator's engine on the fake job's L4), except where the case needs a twin that
knows the fake's reality.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState
from sampler_fakes import require_gp
from study_fakes import FakeLauncher, FakeServer, fake_measure, job

from tuner.config import Job
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.load import LoadResult, RequestRecord
from tuner.record import LAUNCH_FAILED, SKIPPED_INFEASIBLE, TrialRecord
from tuner.scoring import summarize
from tuner.store import flag_key
from tuner.study import Measurement, RunReport, TuningRun
from tuner.study.samplers import SAMPLERS, make_sampler
from tuner.study.verdict import DIRECTIONS
from tuner.twin.sampler import TwinSampler
from tuner.twin.simulate import Coefficients, SimPoint

# The fake job's L4 serves Llama-3.1-8B: a 131,072-token max_model_len cannot start (the pre-launch filter skips
# it), and vLLM's default of 256 sequences is not among the choices (the baseline holds no max_num_seqs).
SPACE: dict[str, Any] = {
    "max_num_seqs": {"choices": [8, 16, 32, 64]},
    "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
    "max_model_len": {"choices": [4096, 131072]},
}
STARTABLE = {**SPACE, "max_model_len": 4096}  # every flag set starts: every trial a launch
FAILS = {"max_num_seqs": 16, "gpu_memory_utilization": 0.95, "max_model_len": 4096}  # the fake server will not start
SKIPPED = {"max_num_seqs": 16, "gpu_memory_utilization": 0.9, "max_model_len": 131072}
DEDUPES = {"twin"}  # samplers that never propose a flag set already tried; the others' repeats are answered


@pytest.fixture(params=sorted(SAMPLERS))
def name(request: pytest.FixtureRequest) -> str:
    """Every sampler name a job may give (tuner.config.SamplerName: a test asserts they are SAMPLERS' keys)."""
    if request.param == "gp":
        require_gp()
    return str(request.param)


def contract_job(name: str, n_trials: int, **changes: Any) -> Job:
    return job(**{"space": SPACE, "sampler": {"name": name, "seed": 1}, "budget": {"n_trials": n_trials}, **changes})


def run(
    j: Job,
    url: str,
    launcher: FakeLauncher,
    *,
    measure: Callable[..., Any] | None = None,
    on_trial_end: Callable[[FrozenTrial, optuna.Study], None] | None = None,
    twin: Callable[[Job, VllmFlags, Coefficients], SimPoint] | None = None,
) -> RunReport:
    tuning = TuningRun(j, launcher, storage_url=url, measure=measure or fake_measure(), poll_s=0.05)
    made = tuning.study.sampler
    if twin is not None and isinstance(made, TwinSampler):  # the job's twin, with another simulation
        tuning.study.sampler = TwinSampler(tuning.space, 1, made.fallback, simulate_fn=twin)
        tuning.study.sampler.bind(j)
    if on_trial_end is not None:
        tuning.on_trial_end = lambda t: on_trial_end(t, tuning.study)
    try:
        return tuning.run()
    finally:
        tuning.close()


def test_trial_0_is_vllms_defaults(name: str, tmp_path: Path) -> None:
    j = contract_job(name, 2, space=STARTABLE)
    launcher = FakeLauncher()
    study = run(j, f"sqlite:///{tmp_path / 's.db'}", launcher).study
    first = study.trials[0]
    assert first.user_attrs["baseline"] is True and first.params == j.search_space().baseline_params()
    assert launcher.launches[0] == {"flags": j.search_space().baseline().as_dict(), "study": "fake", "trial": 0}
    assert not any(t.user_attrs["baseline"] for t in study.trials[1:])


def test_a_failed_start_and_a_skip_are_told_and_never_launched_again(name: str, tmp_path: Path) -> None:
    def refuse(flags: VllmFlags, attempt: int) -> LaunchError | None:
        if flags.gpu_memory_utilization == FAILS["gpu_memory_utilization"] and flags.max_num_seqs == 16:
            return LaunchError("vLLM refused", reason="kv_cache_too_small")
        return None

    def after_the_baseline(t: FrozenTrial, study: optuna.Study) -> None:
        if t.number == 0:  # every sampler meets both, whatever it would have proposed
            study.enqueue_trial(FAILS)
            study.enqueue_trial(SKIPPED)

    launcher = FakeLauncher(fail=refuse)
    # 5: the baseline, the two enqueued, and two past every model-based sampler's random start (2 for this budget)
    report = run(contract_job(name, 5), f"sqlite:///{tmp_path / 's.db'}", launcher, on_trial_end=after_the_baseline)
    trials = report.study.trials
    told = [TrialRecord.from_attrs(t.user_attrs) for t in trials]
    assert {t.state for t in trials} == {TrialState.COMPLETE} and report.distinct == 5
    failed, skipped = trials[1], trials[2]
    assert told[1].outcome == LAUNCH_FAILED and failed.constraints["startup"] > 0
    assert told[2].outcome == SKIPPED_INFEASIBLE and skipped.constraints["startup"] > 0
    keys = {flag_key(told[n].flags) for n in (1, 2)}
    assert [x["trial"] for x in launcher.launches if flag_key(x["flags"]) in keys] == [1]  # the failed start, once
    again = [(n, r.duplicate_of) for n, r in enumerate(told) if n > 2 and flag_key(r.flags) in keys]
    assert all(original in (1, 2) for _, original in again)  # a repeat is answered from the first trial
    if name in DEDUPES:
        assert again == []
    assert not {failed.number, skipped.number} & {t.number for t in report.study.best_trials}


def test_a_flag_set_proposed_again_is_answered_from_its_first_trial(name: str, tmp_path: Path) -> None:
    def repeat_trial_1(t: FrozenTrial, study: optuna.Study) -> None:
        if t.number == 1:
            study.enqueue_trial(t.params)

    launcher = FakeLauncher()
    j = contract_job(name, 3, space=STARTABLE)
    # the twin of this fake tells the flag sets apart (the real one, under 4 users, simulates them all alike)
    report = run(j, f"sqlite:///{tmp_path / 's.db'}", launcher, on_trial_end=repeat_trial_1, twin=twin_of_the_fake)
    trials = report.study.trials
    repeat = trials[2]
    assert repeat.user_attrs["duplicate_of"] == 1 and repeat.values == trials[1].values
    assert repeat.constraints == trials[1].constraints
    # not launched, not counted: the budget of 3 still ran 3 flag sets of their own
    assert [x["trial"] for x in launcher.launches] == [0, 1, 3] and report.distinct == 3


# A fake whose feasibility is known and at odds with the objective: throughput grows with max_num_seqs at a constant
# e2e latency (the objective's second value), and the TTFT SLO fails from 96 sequences on: every infeasible flag set
# dominates every feasible one on both values, so only the constraints keep a sampler away from them.
SEQS = [8, 16, 32, 48, 64, 96, 128, 192, 256]
FEASIBLE = {8, 16, 32, 48, 64}
CONSTRAINED: dict[str, Any] = {
    "space": {
        "max_num_seqs": {"choices": SEQS},
        "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]},
        "max_model_len": 4096,
    },
    "slos": ["ttft_p95 <= 0.1s", "success_rate >= 0.9"],
    "latency_metric": "e2e_p95",
}


def constrained_records(flags: VllmFlags) -> tuple[list[RequestRecord], float]:
    """Ten requests of 32 tokens in 10/seqs seconds (32 tok/s a sequence), TTFT 10 ms per 8 sequences, e2e 1 s."""
    seqs = flags.max_num_seqs or 256
    ttft = 0.01 * seqs / 8
    common = {"ttft_s": ttft, "itl_s": [0.01] * 31, "e2e_s": 1.0, "prompt_tokens": 256, "completion_tokens": 32}
    return [RequestRecord(index=i, start_s=i * 0.1, ok=True, **common) for i in range(10)], 10.0 / seqs


def twin_of_the_fake(j: Job, flags: VllmFlags, c: Coefficients) -> SimPoint:
    """A twin that knows the fake's reality exactly (the real twin imitates an L4, not this fake)."""
    recs, duration = constrained_records(flags)
    return SimPoint(flags.as_dict(), None, records=recs, duration_s=duration, kv_tokens=40_000, raw_kv_tokens=40_000)


def proposals_after(name: str, *, constrained: bool, n: int = 10) -> list[int]:
    """The sampler's next `n` max_num_seqs after 18 trials told as the study tells them: values, and the SLO's
    relative violation as a constraint (left out when not `constrained`). Its proposals are not told back."""
    j = job(**CONSTRAINED, sampler={"name": name, "seed": 1}, budget={"n_trials": 12})
    space = j.search_space()
    sampler = make_sampler(j, space)
    study = optuna.create_study(directions=DIRECTIONS, sampler=sampler)
    for i in range(18):
        study.enqueue_trial({"max_num_seqs": SEQS[i * 4 % 9], "gpu_memory_utilization": (0.85, 0.95)[i % 2]})
        trial = study.ask()
        if isinstance(sampler, optuna.samplers.NSGAIISampler):
            _ = trial.relative_params  # a generation, as its own proposals get (an enqueued trial gets none)
        seqs = space.suggest(trial).flags.max_num_seqs or 256
        if constrained:  # the fake's TTFT against the SLO's 0.1 s
            trial.set_constraint("slo:ttft_p95<=0.1s", max(0.0, 0.01 * seqs / 8 / 0.1 - 1))
        study.tell(trial, [32.0 * seqs, 1.0])
    proposed = []
    for _ in range(n):
        trial = study.ask()
        proposed.append(space.suggest(trial).flags.max_num_seqs or 256)
        study.tell(trial, state=TrialState.FAIL)  # nothing learnt: each proposal is drawn from the same history
    return proposed


def feasible(proposed: list[int]) -> int:
    return sum(seqs in FEASIBLE for seqs in proposed)


async def constrained_measure(server: FakeServer, j: Job, flags: VllmFlags) -> Measurement:
    recs, duration = constrained_records(flags)
    summary = summarize(recs, duration_s=duration, slos=j.parsed_slos())
    return Measurement(LoadResult(summary=summary, records=recs, diagnosis="fake"), rate=summary.request_throughput)


def constrained_run(name: str, tmp_path: Path) -> optuna.Study:
    j = job(**CONSTRAINED, sampler={"name": name, "seed": 1}, budget={"n_trials": 6})
    url = f"sqlite:///{tmp_path / 's.db'}"
    return run(j, url, FakeLauncher(), measure=constrained_measure, twin=twin_of_the_fake).study


def test_the_samplers_that_read_the_constraints_prefer_the_feasible_flag_sets(name: str, tmp_path: Path) -> None:
    if name == "twin":
        # It reads no constraints: its own prediction of the SLOs steers it. Knowing this fake, it proposes only
        # flag sets that meet them (the baseline, trial 0, is vLLM's defaults and does not).
        told = [TrialRecord.from_attrs(t.user_attrs) for t in constrained_run(name, tmp_path).trials]
        assert not told[0].feasible and all(r.feasible for r in told[1:])
        return
    # NSGA-II mutates each flag with probability 1/2 here (Optuna's 1/number of flags): more draws, same certainty;
    # GP fits its model at every proposal: fewer.
    n = {"nsga2": 20, "gp": 6}.get(name, 10)
    with_slos, without = proposals_after(name, constrained=True, n=n), proposals_after(name, constrained=False, n=n)
    if name in ("random", "grid"):
        assert with_slos == without  # they read no constraints: the study's front (the test below) is their part
        return
    # Without the constraints the proposals chase the infeasible flag sets, which dominate on both values.
    assert feasible(with_slos) >= 0.6 * n and feasible(with_slos) > feasible(without) + n / 4, (with_slos, without)


def test_the_front_holds_only_flag_sets_that_meet_the_slos(name: str, tmp_path: Path) -> None:
    best = [TrialRecord.from_attrs(t.user_attrs) for t in constrained_run(name, tmp_path).best_trials]
    assert best and all(r.feasible and r.flags["max_num_seqs"] in FEASIBLE for r in best)


def test_a_killed_workers_study_resumes_with_a_new_sampler_that_runs_nothing_twice(name: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = FakeLauncher()
    run(contract_job(name, 3, space=STARTABLE), url, first, twin=twin_of_the_fake)
    # A second worker proposes a trial, starts it, and is killed: its trial stays RUNNING without heartbeats.
    dying = TuningRun(contract_job(name, 5, space=STARTABLE), FakeLauncher(), storage_url=url, measure=fake_measure())
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
            dead = dying.study.ask()
        proposed = dying.space.suggest(dead).flags
        dying.storage.record_heartbeat(dead._trial_id)
    finally:
        dying.close()
    # The next run (a new process: a new sampler) fails the dead trial after the grace period and retries it.
    resumed = FakeLauncher()
    report = run(contract_job(name, 5, space=STARTABLE), url, resumed, twin=twin_of_the_fake)
    trials = report.study.trials
    assert trials[dead.number].state == TrialState.FAIL and report.distinct == 5
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retry) == 1 and TrialRecord.from_attrs(retry[0].user_attrs).flags == proposed.as_dict()
    launched = [flag_key(x["flags"]) for x in first.launches + resumed.launches]
    assert len(launched) == len(set(launched)) == 5  # no flag set of the first run launched again
    assert sum(bool(t.user_attrs.get("baseline")) for t in trials) == 1


@pytest.mark.parametrize("sampler", ["random", "nsga2"])
def test_a_resumed_seeded_sampler_goes_on_instead_of_drawing_its_first_runs_proposals_again(
    sampler: str, tmp_path: Path
) -> None:
    # The same seed in a new process replays the first run's draws: each would be a repeat of a tried flag set,
    # answered without a launch, and enough of them end the run short of its budget (REPEAT_CAP).
    url = f"sqlite:///{tmp_path / 's.db'}"
    first = run(contract_job(sampler, 3, space=STARTABLE), url, FakeLauncher())
    drawn = [flag_key(TrialRecord.from_attrs(t.user_attrs).flags) for t in first.study.trials[1:]]
    resumed = run(contract_job(sampler, 5, space=STARTABLE), url, FakeLauncher())
    again = [flag_key(TrialRecord.from_attrs(t.user_attrs).flags) for t in resumed.study.trials[3:5]]
    assert again != drawn and resumed.distinct == 5, (drawn, again)
