from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState
from study_fakes import FakeLauncher, fake_measure, job

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.report.overview import status
from tuner.report.views import study_view
from tuner.store import flag_key, open_store
from tuner.study import TuningRun
from tuner.study.run import REPEAT_CAP, seed_offset

STUDY_ATTRS = {
    "tuner_version",
    "gpu",
    "gpu_profile",
    "image_pinned",
    "model",
    "launcher",
    "image",
    "workload_hash",
    "slos",
    "objective",
    "n_trials",
    "job",
    "confirm",  # what the confirmation decided (tuner.study.confirm), written when a run ends
}


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'study.db'}"


def run_job(j: Job, url: str, launcher: FakeLauncher | None = None, **kwargs: Any) -> optuna.Study:
    tuning = TuningRun(j, launcher or FakeLauncher(), storage_url=url, measure=fake_measure(), poll_s=0.1, **kwargs)
    try:
        tuning.run()
        return tuning.study
    finally:
        tuning.close()


def states(study: optuna.Study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False)]


def distinct(trials: list[FrozenTrial]) -> int:
    """Finished trials of a flag set of their own: what the budget counts (a sampler's repeat is not a trial)."""
    return sum(t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None for t in trials)


def test_study_runs_to_budget_with_the_baseline_first_and_continues(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    launcher = FakeLauncher()
    study = run_job(job(), url, launcher)
    trials = study.get_trials(deepcopy=False)
    assert set(states(study)) == {TrialState.COMPLETE} and distinct(trials) == 4
    t0 = trials[0]
    assert t0.user_attrs["baseline"] is True and not any(t.user_attrs["baseline"] for t in trials[1:])
    assert t0.user_attrs["flags"]["max_num_seqs"] == 256 and launcher.launches[0]["trial"] == 0
    assert set(study.user_attrs) == STUDY_ATTRS
    assert study.user_attrs["n_trials"] == 4 and study.user_attrs["launcher"] == "emulator"
    assert study.user_attrs["job"]["study"]["name"] == "fake"
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
    assert study.best_trials and all(t.user_attrs["feasible"] for t in study.best_trials)
    # Never the same flags twice: duplicates are answered from the store.
    launched = [flag_key(x["flags"]) for x in launcher.launches]
    assert len(launched) == len(set(launched))
    with open_store(url) as store:
        for t in trials:
            detail = store.trial_detail("fake", t.number)
            assert detail is not None and detail.outcome == t.user_attrs["outcome"]
            if t.user_attrs.get("duplicate_of") is None:
                assert detail.load_summary is not None and len(store.request_records("fake", t.number)) == 10
    # The same command again, with a bigger budget, continues the study; the baseline is not enqueued again.
    bigger = job(budget={"n_trials": 6})
    study = run_job(bigger, url)
    assert set(states(study)) == {TrialState.COMPLETE} and distinct(study.trials) == 6
    assert sum(bool(t.user_attrs["baseline"]) for t in study.trials) == 1
    assert study.user_attrs["n_trials"] == 6
    # ... and at its budget, runs nothing.
    assert len(run_job(bigger, url).trials) == len(study.trials)


def test_ctrl_c_records_interrupted_and_the_next_run_retries_it(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)

    def interrupt_trial_1(flags: VllmFlags, attempt: int) -> None:
        if len(calls) == 1:
            raise KeyboardInterrupt
        calls.append(flags)

    calls: list[VllmFlags] = []
    launcher = FakeLauncher(fail=lambda flags, attempt: interrupt_trial_1(flags, attempt))
    with pytest.raises(KeyboardInterrupt):
        run_job(job(), url, launcher)
    study = run_job(job(), url)
    trials = study.get_trials(deepcopy=False)
    assert distinct(trials) == 4
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].number == 1 and failed[0].user_attrs["outcome"] == "interrupted"
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == 1]
    assert len(retry) == 1 and retry[0].params == failed[0].params and retry[0].state == TrialState.COMPLETE


def test_trial_left_running_by_a_dead_worker_is_failed_by_the_heartbeat_and_retried(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    j = job(budget={"n_trials": 3})
    tuning = TuningRun(j, FakeLauncher(), storage_url=url, measure=fake_measure(), poll_s=0.1)
    try:
        tuning._prepare()
        with pytest.warns(UserWarning, match="Heartbeat of storage"):
            dead = tuning.study.ask()  # the baseline, started by a worker that then died (no more heartbeats)
        started = time.monotonic()  # before its last heartbeat: the grace period runs from there, however slow the rest
        tuning.storage.record_heartbeat(dead._trial_id)
        dead.set_user_attr("flags", {"max_num_seqs": 256})
    finally:
        tuning.close()
    study = run_job(j, url)
    trials = study.get_trials(deepcopy=False)
    assert trials[0].state == TrialState.FAIL
    retry = [t for t in trials if t.system_attrs.get("failed_trial") == 0]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE and retry[0].user_attrs["baseline"] is True
    assert distinct(trials) == 3
    assert time.monotonic() - started >= 1.0  # it waited for the grace period rather than count the dead trial


def threaded_workers(url: str, n_workers: int, n_trials: int) -> tuple[list[FrozenTrial], list[FakeLauncher]]:
    # 15 points: workers' random proposals still coincide (the claims are exercised), and the budget's distinct flag
    # sets are found long before the repeat cap.
    seqs = {"choices": [8, 16, 32, 64, 128]}
    space = {"max_num_seqs": seqs, "gpu_memory_utilization": {"choices": [0.85, 0.9, 0.95]}, "max_model_len": 4096}
    launchers = [FakeLauncher() for _ in range(n_workers)]
    errors: list[BaseException] = []

    def worker(launcher: FakeLauncher, seed: int) -> None:
        # Threads share a pid, so the study's per-process seed offset does not part them: seeds of their own do.
        # Every worker lives: a grace period no busy machine's late heartbeat thread outlasts.
        study = {"name": "fake", "heartbeat_interval": 1, "grace_period": 60}
        j = job(space=space, budget={"n_trials": n_trials}, sampler={"name": "random", "seed": seed}, study=study)
        try:
            run_job(j, url, launcher)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(launcher, i)) for i, launcher in enumerate(launchers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    storage = optuna.storages.RDBStorage(url)
    try:
        return optuna.load_study(study_name="fake", storage=storage).get_trials(), launchers
    finally:
        storage.engine.dispose()


@pytest.mark.postgres
def test_two_workers_share_one_budget_and_never_launch_the_same_flags(postgres_url: str) -> None:
    trials, launchers = threaded_workers(postgres_url, 2, 6)
    assert {t.state for t in trials} == {TrialState.COMPLETE} and distinct(trials) == 6
    launched = [flag_key(x["flags"]) for launcher in launchers for x in launcher.launches]
    assert len(launched) == len(set(launched)) == 6  # every trial of the budget a launch of its own
    assert sum(bool(t.user_attrs["baseline"]) for t in trials) == 1


def test_a_flag_set_another_worker_is_measuring_is_waited_for_not_launched_again(tmp_path: Path) -> None:
    url = sqlite_url(tmp_path)
    j = job(space={"max_num_seqs": {"choices": [8, 16]}, "max_model_len": 4096}, budget={"n_trials": 2})
    launcher = FakeLauncher()
    tuning = TuningRun(j, launcher, storage_url=url, measure=fake_measure(), poll_s=0.05)
    try:
        tuning._prepare()
        # "Another worker" holds the claim of the only flag set and is running it.
        with pytest.warns(UserWarning, match="Heartbeat of storage"):
            other = tuning.study.ask()
        flags = tuning.space.repair({"max_num_seqs": 8}).flags
        key = flag_key(flags.as_dict())
        assert tuning.store.claim("fake", key, other.number) == other.number
        other.set_user_attr("flags", flags.as_dict())

        def finish_other() -> None:
            time.sleep(0.5)
            other.set_user_attr("outcome", "measured")
            other.set_constraint("startup", 0.0)
            tuning.study.tell(other, [123.0, 1.0])

        threading.Thread(target=finish_other).start()
        with pytest.warns(UserWarning, match="Heartbeat of storage"):
            mine = tuning.study.ask()
        values = tuning.objective._duplicate(mine, key)
        assert values == (123.0, 1.0) and mine.user_attrs["duplicate_of"] == other.number
        assert launcher.launches == []
    finally:
        tuning.close()


def test_a_grid_smaller_than_the_budget_ends_when_every_point_is_measured(tmp_path: Path) -> None:
    # Optuna's GridSampler stops optimize() with study.stop(), which raised out of our ask-and-tell loop at the
    # last grid point (a traceback after the whole grid had been measured).
    grid = job(
        space={"max_num_seqs": {"choices": [16, 32]}, "max_model_len": 4096},
        sampler={"name": "grid", "seed": 0},
        budget={"n_trials": 10},
    )
    launcher = FakeLauncher()
    tuning = TuningRun(grid, launcher, storage_url=sqlite_url(tmp_path), measure=fake_measure(), poll_s=0.1)
    try:
        report = tuning.run()
    finally:
        tuning.close()
    assert report.stopped_by == "grid done"
    assert states(report.study) == [TrialState.COMPLETE] * 3  # the baseline and the two grid points
    assert sorted(t.params["max_num_seqs"] for t in report.study.trials[1:]) == [16, 32]


def test_a_samplers_repeats_are_answered_from_the_store_and_not_counted_in_the_budget(tmp_path: Path) -> None:
    # Two points and the baseline: the random sampler repeats itself long before it has seen both.
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": 4096}
    launcher = FakeLauncher()
    tuning = TuningRun(job(space=space, budget={"n_trials": 3}), launcher, storage_url=sqlite_url(tmp_path),
                       measure=fake_measure())  # fmt: skip
    try:
        report = tuning.run()
    finally:
        tuning.close()
    trials = tuning.study.get_trials(deepcopy=False)
    assert report.stopped_by == "budget" and report.distinct == distinct(trials) == 3 == len(launcher.launches)
    assert report.repeats == len(trials) - 3 and report.repeats > 0
    assert {t.user_attrs["flags"]["max_num_seqs"] for t in trials} == {8, 16, 256}
    # The morning's state counts the budget as the run did: done, though more trials than the budget finished.
    assert status(study_view(tuning.study)).state == "done"


def test_a_sampler_that_only_repeats_ends_the_run_at_the_cap(tmp_path: Path) -> None:
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": 4096}
    launcher = FakeLauncher()
    events: list[str] = []
    tuning = TuningRun(job(space=space, budget={"n_trials": 5}), launcher, storage_url=sqlite_url(tmp_path),
                       measure=fake_measure(), on_event=events.append)  # fmt: skip
    try:
        report = tuning.run()
    finally:
        tuning.close()
    assert report.stopped_by == "repeats" and report.distinct == 3 == len(launcher.launches)
    assert len(tuning.study.trials) == REPEAT_CAP * 5
    assert "the sampler proposed flag sets already tried 7 times (2x the budget in all): all 2 points of the space " \
        "are tried; widen it (more choices, a wider range) to measure more; stopping at 3 distinct flag sets tried " \
        "of the budget's 5" in events  # fmt: skip
    assert status(study_view(tuning.study)).state == "stopped"  # 3 distinct flag sets of 5, though 10 trials ran


def test_workers_started_together_never_share_a_seed() -> None:
    # The CI failure's pair: two workers' pids p and p + 1, the later one opening the study before the baseline was
    # queued (0 trials held), the earlier after it (1 held). A sum of the two gave both one seed: their random
    # samplers drew the same flag sets in the same order and the repeats reached the cap one flag set short.
    p = 41_000
    assert seed_offset(p + 1, 0) != seed_offset(p, 1)
    offsets = {seed_offset(identity, held) for identity in range(p, p + 8) for held in range(200)}
    assert len(offsets) == 8 * 200
    assert [seed_offset(0, held) for held in range(3)] == [0, 1, 2]  # one SQLite worker resumes as it always did


def test_workers_with_seeds_of_their_own_never_draw_alike() -> None:
    # Threads of one process share a pid: two given seeds 0 and 1, opening the study 1 and 0 trials apart, summed to
    # one seed (test_two_workers_share_one_budget_and_never_launch_the_same_flags's 5 of 6 in CI).
    from tuner.study.samplers import mixed_seed

    p = 41_000
    assert mixed_seed(0, seed_offset(p, 1)) != mixed_seed(1, seed_offset(p, 0))
    seeds = {mixed_seed(seed, seed_offset(p, held)) for seed in range(8) for held in range(1, 200)}
    assert len(seeds) == 8 * 199
    assert [mixed_seed(seed, 0) for seed in (0, 7, 42)] == [0, 7, 42]  # one worker on a fresh study: the job's seed


def test_a_run_at_the_repeat_cap_with_points_left_says_how_many_the_sampler_tried() -> None:
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import create_trial

    from tuner.study.claims import repeats_stop_line

    space = job(space={"max_num_seqs": {"choices": [4, 8, 12, 16]}, "max_model_len": 4096}).search_space()
    dist = {"max_num_seqs": CategoricalDistribution([4, 8, 12, 16])}

    def trial(n: int, seqs: int, owner: int | None) -> FrozenTrial:
        attrs = {"flags": {"max_num_seqs": seqs}, "duplicate_of": owner}
        t = create_trial(params={"max_num_seqs": seqs}, distributions=dist, values=[1.0, 1.0], user_attrs=attrs)
        t.number = n
        return t

    finished = [trial(0, 4, None), trial(1, 8, None), trial(2, 4, 0), trial(3, 8, 1)]
    line = repeats_stop_line(finished, space, 2, 2)
    assert line == (
        "the sampler proposed flag sets already tried 2 times (2x the budget in all): 2 of the space's 4 points tried, "
        "the sampler drawing tried ones again; a larger budget or another sampler (twin, tpe) reaches the rest; "
        "stopping at 2 distinct flag sets tried of the budget's 2"
    )
