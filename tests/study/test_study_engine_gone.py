"""The container engine going away under a trial: the trial is recorded as interrupted (not the flags' crash, not
infeasible), the run waits for the engine within `target.engine_wait`, and the trial's flags run again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial, TrialState
from study_fakes import JOB, FakeLauncher, fake_measure, job

from tuner.errors import EngineGone, TunerError
from tuner.flags import VllmFlags
from tuner.study import TuningRun

ENGINE = "the Docker engine at unix:///test.sock"


class Engine:
    """Goes away at the launch numbered `gone_at` (0-based) and answers again after `down_for` pings."""

    def __init__(self, gone_at: int, down_for: int) -> None:
        self.gone_at, self.down_for = gone_at, down_for
        self.launches = 0
        self.pings = 0

    def answers(self) -> bool:
        self.pings += 1
        return self.pings > self.down_for

    def fail(self, flags: VllmFlags, attempt: int) -> EngineGone | None:
        self.launches += 1
        if self.launches - 1 == self.gone_at:
            return EngineGone(f"{ENGINE} stopped answering (Connection refused)", ENGINE, self.answers)
        return None


def distinct(trials: list[FrozenTrial]) -> int:
    """Finished trials of a flag set of their own (what the budget counts; a sampler's repeat is not one)."""
    return sum(t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None for t in trials)


def tune(url: str, engine: Engine, events: list[str], **changes: Any) -> optuna.Study:
    launcher = FakeLauncher(fail=engine.fail)
    tuning = TuningRun(
        job(**changes), launcher, storage_url=url, measure=fake_measure(), poll_s=0.01, on_event=events.append
    )
    try:
        tuning.run()
        return tuning.study
    finally:
        tuning.close()


def test_a_trial_the_engine_interrupted_is_recorded_as_such_and_run_again_once_it_answers(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    engine, events = Engine(gone_at=1, down_for=2), []
    study = tune(url, engine, events)
    trials = study.get_trials(deepcopy=False)
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].number == 1
    attrs = failed[0].user_attrs
    assert attrs["outcome"] == "interrupted" and attrs["reason"] == "engine_gone" and ENGINE in attrs["message"]
    assert "constraints" not in failed[0].system_attrs  # nothing told to a sampler: not infeasible, not crashed
    again = [t for t in trials if t.system_attrs.get("failed_trial") == 1]
    assert len(again) == 1 and again[0].params == failed[0].params and again[0].state == TrialState.COMPLETE
    assert again[0].user_attrs["outcome"] == "measured" and "message" not in again[0].user_attrs
    # The budget was reached in this one run, and no crash or launch failure was recorded.
    assert distinct(trials) == JOB["budget"]["n_trials"]
    assert not {t.user_attrs.get("outcome") for t in trials} & {"crashed", "launch_failed"}
    waits = [e for e in events if "waiting up to 300 s (target.engine_wait)" in e]
    backs = [e for e in events if "answers again" in e]
    assert len(waits) == 1 and len(backs) == 1 and "trial 1 runs again" in backs[0]
    assert all("\n" not in e and "Traceback" not in e for e in events)
    assert engine.pings == 3  # asked until it answered, not again


def test_an_engine_away_past_the_bound_stops_the_study_with_one_line_and_the_next_run_retries(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    events: list[str] = []
    target = {**JOB["target"], "engine_wait": 0.05}
    with pytest.raises(TunerError) as e:
        tune(url, Engine(gone_at=1, down_for=10**9), events, target=target)
    assert str(e.value) == (
        f"{ENGINE} did not answer within 0.05 s (target.engine_wait); trial 1 is kept as interrupted and runs again "
        "when the same command is run"
    )
    events.clear()
    study = tune(url, Engine(gone_at=-1, down_for=0), events)
    assert "trial 1 was interrupted; it will be run again" in events
    trials = study.get_trials(deepcopy=False)
    again = [t for t in trials if t.system_attrs.get("failed_trial") == 1]
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE
    # A third run retries nothing more: the interrupted trial has its retry.
    events.clear()
    tune(url, Engine(gone_at=-1, down_for=0), events)
    assert not any("will be run again" in e for e in events)


def test_a_retry_the_engine_interrupted_too_is_run_again_as_well(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    engine, events = Engine(gone_at=1, down_for=0), []

    def twice(flags: VllmFlags, attempt: int) -> EngineGone | None:
        engine.launches += 1
        if engine.launches in (2, 3):  # trial 1 and its first retry
            return EngineGone(f"{ENGINE} stopped answering", ENGINE, engine.answers)
        return None

    launcher = FakeLauncher(fail=twice)
    tuning = TuningRun(job(), launcher, storage_url=url, measure=fake_measure(), poll_s=0.01, on_event=events.append)
    try:
        tuning.run()
        trials = tuning.study.get_trials(deepcopy=False)
    finally:
        tuning.close()
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 2 and all(t.user_attrs["reason"] == "engine_gone" for t in failed)
    assert distinct(trials) == JOB["budget"]["n_trials"]
    assert len({str(t.params) for t in failed}) == 1  # the same flags, run until the engine stayed
