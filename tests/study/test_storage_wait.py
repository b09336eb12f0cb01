"""A database that goes away: waited out for the job's bound, then a measured result kept in a journal beside the
job and written, once, by the next run. The storage is SQLite made to fail through SQLAlchemy's own event seam with
the error a dropped PostgreSQL connection raises (OperationalError, its driver's error inside). The wait's own rules
(which errors are a lost connection, the bound) are tests/store/test_store_waiting.py's."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy as sa
from optuna.trial import TrialState
from sqlalchemy.engine import Engine
from study_fakes import FakeLauncher, fake_measure, job

from tuner.store.waiting import StorageGone, StorageWait
from tuner.study import TuningRun
from tuner.study.journal import JOURNAL_DIR


class Dropped(Exception):
    """What a driver raises for a connection the server closed (psycopg's OperationalError, say)."""


def dropped() -> sa.exc.OperationalError:
    return sa.exc.OperationalError("SELECT 1", {}, Dropped("server closed the connection unexpectedly"))


class Blip:
    """The next `n` statements on any engine fail as on a dropped connection (`n` None: every one, until healed)."""

    def __init__(self) -> None:
        self.left: int | None = 0
        self.failed = 0

    def arm(self, n: int | None) -> None:
        self.left = n

    def heal(self) -> None:
        self.left = 0

    def __call__(self, *_args: Any) -> None:
        if self.left is None or self.left > 0:
            if self.left is not None:
                self.left -= 1
            self.failed += 1
            raise dropped()


@pytest.fixture
def blip() -> Iterator[Blip]:
    b = Blip()
    sa.event.listen(Engine, "before_cursor_execute", b)
    try:
        yield b
    finally:
        sa.event.remove(Engine, "before_cursor_execute", b)


def arming(blip: Blip, n: int | None, at_trial: int) -> Callable[..., Any]:
    """The fake load, which arms `blip` once while trial `at_trial`'s load runs (the database goes away mid-trial)."""
    measure = fake_measure()
    calls = {"n": 0}

    async def measure_and_blip(server: Any, j: Any, flags: Any) -> Any:
        result = await measure(server, j, flags)
        if calls["n"] == at_trial:
            blip.arm(n)
        calls["n"] += 1
        return result

    return measure_and_blip


# -- a study through it --------------------------------------------------------------------------------------------


def run(
    url: str, measure: Callable[..., Any], lines: list[str], launcher: FakeLauncher | None = None, **changes: Any
) -> TuningRun:
    launcher = launcher or FakeLauncher()
    tuning = TuningRun(job(**changes), launcher, storage_url=url, measure=measure, poll_s=0.1, on_event=lines.append)
    try:
        tuning.run()
    finally:
        tuning.close()
    return tuning


def stored(url: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="fake", storage=url).get_trials(deepcopy=False)


def all_complete_to_budget(trials: list[optuna.trial.FrozenTrial]) -> bool:
    """Every trial COMPLETE (none FAIL) and the budget's 4 flag sets of their own among them."""
    own = [t for t in trials if t.user_attrs.get("duplicate_of") is None]
    return {t.state for t in trials} == {TrialState.COMPLETE} and len(own) == 4


def test_a_study_waits_out_a_lost_connection_mid_trial_and_loses_nothing(
    tmp_path: Path, blip: Blip, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    lines: list[str] = []
    run(url, arming(blip, 3, at_trial=1), lines)
    assert blip.failed == 3
    assert all_complete_to_budget(stored(url))
    assert sum("lost the connection" in line for line in lines) == 1
    assert sum("answers again" in line for line in lines) == 1
    assert not any("failed in the tuner itself" in line for line in lines)


def test_past_the_bound_the_result_is_kept_and_the_next_run_stores_it_once(
    tmp_path: Path, blip: Blip, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    lines: list[str] = []
    with pytest.raises(StorageGone) as gone:
        run(url, arming(blip, None, at_trial=1), lines, study={"name": "fake", "storage_wait_s": 0})
    blip.heal()
    journal = tmp_path / JOURNAL_DIR / "fake.jsonl"
    message = str(gone.value)
    assert "\n" not in message and str(journal) in message and "trial 1" in message
    assert len(journal.read_text().splitlines()) == 1
    assert [t.state for t in stored(url)] == [TrialState.COMPLETE, TrialState.RUNNING]

    later: list[str] = []
    launcher = FakeLauncher()
    run(url, fake_measure(), later, launcher)
    trials = stored(url)
    assert all_complete_to_budget(trials)
    assert trials[1].user_attrs["outcome"] == "measured" and trials[1].values
    assert 1 not in [x["trial"] for x in launcher.launches]  # told from the journal, not run again
    assert sum("trial 1: its result, kept in" in line for line in later) == 1
    assert not journal.exists()
    run(url, fake_measure(), [])  # a third run has nothing kept to write again
    assert len(stored(url)) == len(trials)


def test_a_tell_whose_answer_was_lost_after_its_commit_is_not_an_error(tmp_path: Path) -> None:
    """The commit went through and the connection dropped before its answer: the retry finds the trial told."""
    from sqlalchemy.orm import Session

    from tuner.study.storage import make_storage

    lines: list[str] = []
    storage = make_storage(f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=10, grace_period=60)
    storage.waiting = StorageWait("sqlite:///study.db", 300, lines.append, sleep=lambda _s: None)
    study = optuna.create_study(study_name="s", storage=storage)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used")
        trial = study.ask()
    drops = {"left": 1}

    def answer_lost(_session: Session) -> None:
        if drops["left"]:
            drops["left"] -= 1
            raise dropped()

    sa.event.listen(Session, "after_commit", answer_lost)
    try:  # the storage's call itself, as study.tell makes it: its one session, one commit
        assert storage.set_trial_state_values(trial._trial_id, TrialState.COMPLETE, [1.5])
    finally:
        sa.event.remove(Session, "after_commit", answer_lost)
        storage.engine.dispose()
    assert drops["left"] == 0
    told = study.get_trials(deepcopy=False)
    assert [(t.state, t.values) for t in told] == [(TrialState.COMPLETE, [1.5])]
    assert len(lines) == 2  # waited, and back


def test_a_trial_another_worker_took_for_dead_meanwhile_keeps_its_result_as_a_trial_of_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker cut off from the database while the others reach it: their stale check fails its running trial
    (and queues it again). Its measured result is stored, not lost, and the queued copy is not launched again."""
    from optuna.storages import RetryHeartbeatStaleTrialCallback

    monkeypatch.chdir(tmp_path)
    url = f"sqlite:///{tmp_path / 'study.db'}"
    measure = fake_measure()
    calls = {"n": 0}

    async def measure_then_taken_for_dead(server: Any, j: Any, flags: Any) -> Any:
        result = await measure(server, j, flags)
        if calls["n"] == 1:  # what another worker's fail_stale_trials does to trial 1
            other = optuna.load_study(study_name="fake", storage=url)
            running = [t for t in other.get_trials(deepcopy=False) if t.state == TrialState.RUNNING]
            other._storage.set_trial_state_values(running[0]._trial_id, TrialState.FAIL)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                RetryHeartbeatStaleTrialCallback(max_retry=1)(other, other._storage.get_trial(running[0]._trial_id))
        calls["n"] += 1
        return result

    lines: list[str] = []
    launcher = FakeLauncher()
    run(url, measure_then_taken_for_dead, lines, launcher)
    trials = stored(url)
    assert [t.number for t in trials if t.state == TrialState.FAIL] == [1]
    said = [line for line in lines if "taken for dead" in line]
    assert len(said) == 1
    kept = trials[int(said[0].rsplit(" ", 1)[1])]
    assert kept.state == TrialState.COMPLETE and kept.user_attrs["outcome"] == "measured"
    assert kept.user_attrs["flags"] == trials[1].user_attrs["flags"]
    launched = [str(sorted(x["flags"].items())) for x in launcher.launches]
    assert len(launched) == len(set(launched))  # the queued copy of trial 1 answered from the kept result
    own = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None]
    assert len(own) == 4 and not any("failed in the tuner itself" in line for line in lines)
