"""Counts that add up after a Ctrl-C and a resume: interrupted trials, a sampler's repeats and the confirmation's
starts counted apart in `status`, `studies`, `trials` and the front; never above 100% of the budget, never more
feasible than measured; an interrupted baseline runs again as the baseline. A fake launcher throughout."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from study_fakes import FakeLauncher, fake_measure, job

from tests.conftest import run_main
from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.report.overview import counts, listing, status
from tuner.report.views import study_view
from tuner.study import TuningRun


def _run(j: Job, url: str, launcher: FakeLauncher, events: list[str] | None = None) -> None:
    on_event = events.append if events is not None else None
    tuning = TuningRun(j, launcher, storage_url=url, measure=fake_measure(), poll_s=0.1, on_event=on_event)
    try:
        tuning.run()
    finally:
        tuning.close()


def _interrupted_at(n: int) -> FakeLauncher:
    """A launcher whose n-th start (from 1) is stopped by a Ctrl-C."""
    starts: list[int] = []

    def fail(flags: VllmFlags, attempt: int) -> None:
        starts.append(1)
        if len(starts) == n:
            raise KeyboardInterrupt

    return FakeLauncher(fail=fail)


def _cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> str:
    """`tuner ARGS` through the real entry point (tests/conftest.run_main), its output at a wide terminal."""
    monkeypatch.setenv("COLUMNS", "220")
    capsys.readouterr()
    return run_main(list(args), capsys, monkeypatch)[1]


def _view(url: str) -> Any:
    return study_view(optuna.load_study(study_name="fake", storage=url))


def _adds_up(url: str, budget: int) -> None:
    view = _view(url)
    st, row, c = status(view), listing(view), counts(view)
    assert st.finished <= budget and row.trials <= budget
    assert st.feasible <= st.measured <= st.finished and row.feasible <= row.trials
    interrupted = sum(t.outcome == "interrupted" and t.state == "FAIL" for t in view.trials)
    repeats = sum(t.duplicate_of is not None and t.repeat_of is None for t in view.trials)
    assert (c.interrupted, c.repeats) == (interrupted, repeats)
    assert c.finished + c.interrupted + c.repeats + c.confirmation_starts == len(view.trials)


def test_a_baseline_interrupted_twice_runs_again_as_the_baseline_and_the_counts_add_up(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    j = job(budget={"n_trials": 3})
    for _ in range(2):  # Ctrl-C on the baseline, then again on its retry (which Optuna would not retry again)
        with pytest.raises(KeyboardInterrupt):
            _run(j, url, _interrupted_at(1))
        _adds_up(url, 3)
    after_ctrl_c = _cli(capsys, monkeypatch, "status", "fake", "--storage", url)
    assert "0/3 trials finished (0%)" in after_ctrl_c and "stopped" in after_ctrl_c
    assert "interrupted: 2, not counted" in after_ctrl_c
    events: list[str] = []
    _run(j, url, FakeLauncher(), events)
    assert any("the baseline, was interrupted; it will run again" in e for e in events)
    view = _view(url)
    assert view.baseline is not None and view.baseline.measured and view.baseline.number == 2
    _adds_up(url, 3)
    shown = _cli(capsys, monkeypatch, "status", "fake", "--storage", url)
    assert "3/3 trials finished (100%)" in shown and "done" in shown
    front = _cli(capsys, monkeypatch, "pareto", "fake", "--storage", url)
    assert "interrupted" not in front and "of 3 measured trials" in front
    trials = _cli(capsys, monkeypatch, "trials", "fake", "--storage", url)
    assert "counted: 3 trials (3 measured, " in trials and "2 interrupted (not counted" in trials
    assert "interrupted: interrupted" not in trials


def test_a_ctrl_c_in_the_confirmation_and_a_resume_count_its_starts_apart(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    j = job(budget={"n_trials": 3, "confirm": 2})
    with pytest.raises(KeyboardInterrupt):
        _run(j, url, _interrupted_at(4))  # the first confirmation start
    _adds_up(url, 3)
    _run(j, url, FakeLauncher())
    _adds_up(url, 3)
    c = counts(_view(url))
    assert c.finished == 3 and c.interrupted == 1 and c.confirmation_starts == 2


def test_a_space_of_three_flag_sets_counts_its_repeats_apart(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    # the baseline and two more: a budget of 4 is never spent, the sampler repeats them until REPEAT_CAP
    space = {"max_num_seqs": {"choices": [8, 16]}, "max_model_len": 4096}
    _run(job(space=space, budget={"n_trials": 4}), url, FakeLauncher())
    _adds_up(url, 4)
    c = counts(_view(url))
    assert c.finished == 3 and c.repeats > 0
    shown = _cli(capsys, monkeypatch, "status", "fake", "--storage", url)
    assert "3/4 trials finished (75%)" in shown and f"repeats: {c.repeats} proposals" in shown
    studies = _cli(capsys, monkeypatch, "studies", "--storage", url, "--json")
    assert '"trials": 3' in studies and f'"repeats": {c.repeats}' in studies
