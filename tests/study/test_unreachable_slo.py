"""An SLO nothing meets: the dry run says which, the nearest flag set and by how much; the study stops once the
baseline and the twin's nearest flag sets measured missing it (tuner.twin.reachability, tuner.study.unreachable)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from study_fakes import JOB, FakeLauncher, fake_measure, job

from tests.conftest import run_main
from tuner.config import Job
from tuner.study import TuningRun
from tuner.study.run import RunReport
from tuner.study.unreachable import UNREACHABLE_ATTR, UnreachableWatch
from tuner.twin.reachability import Unreachable, predict_unreachable

IMPOSSIBLE = ["e2e_p95 <= 1ms", "success_rate >= 0.9"]


def test_the_twin_names_the_slo_nothing_meets_and_the_nearest_flag_sets() -> None:
    found = predict_unreachable(job(slos=IMPOSSIBLE))
    assert found is not None and found.slo == "e2e_p95<=1ms" and len(found.nearest) == 2
    # The fewest sequences are the fastest in the emulator's engine: the nearest to a latency bound.
    assert found.nearest[0]["params"]["max_num_seqs"] == 8
    line = found.line()
    assert "e2e_p95<=1ms" in line and "max_num_seqs=8" in line and "against 1 ms" in line
    assert predict_unreachable(job()) is None  # the fake job's own SLOs are within reach


def run(j: Job, url: str, watch: UnreachableWatch | None = None) -> tuple[RunReport, list[str]]:
    events: list[str] = []
    tuning = TuningRun(j, FakeLauncher(), storage_url=url, measure=fake_measure(), poll_s=0.1, on_event=events.append)
    if watch is not None:
        tuning.unreachable = watch
    try:
        return tuning.run(), events
    finally:
        tuning.close()


def test_the_study_stops_once_the_baseline_and_the_nearest_miss_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    report, events = run(job(slos=IMPOSSIBLE, budget={"n_trials": 8}), url)
    assert report.stopped_by == "unreachable" and report.distinct == 3
    trials = report.study.trials
    assert trials[0].user_attrs["baseline"] and {t.user_attrs["flags"]["max_num_seqs"] for t in trials[1:]} == {8}
    assert any(e.startswith("no flag set is predicted to meet e2e_p95<=1ms") for e in events)
    closing = report.closing[-1]
    # The fake's 8 sequences answer in 0.75 s: the closest measured figure.
    assert closing.startswith("stopped: no flag set meets e2e_p95<=1ms") and "750 ms against 1 ms" in closing
    assert report.study.user_attrs[UNREACHABLE_ATTR]["found"]["slo"] == "e2e_p95<=1ms"
    # The same command again stops at once, running nothing.
    again, _ = run(job(slos=IMPOSSIBLE, budget={"n_trials": 8}), url)
    assert again.stopped_by == "unreachable" and again.trials_run == 0


def test_a_job_that_says_go_on_spends_its_budget(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    go_on = job(slos=IMPOSSIBLE, budget={"n_trials": 6, "stop_when_unreachable": False})
    report, _ = run(go_on, url)
    assert report.stopped_by in ("budget", "repeats") and report.distinct >= 5
    assert UNREACHABLE_ATTR not in report.study.user_attrs


def test_a_trial_that_meets_the_slo_ends_the_watch(tmp_path: Path) -> None:
    """The twin wrong: it called an SLO the flags meet unreachable; the first trial that meets it keeps the study
    going to its budget."""
    url = f"sqlite:///{tmp_path / 'study.db'}"
    j = job(budget={"n_trials": 5})
    params = {"max_num_seqs": 8, "gpu_memory_utilization": 0.85}
    nearest = [{"params": params, "flags": j.search_space().repair(params).flags.as_dict()}]
    wrong = Unreachable("e2e_p95<=2s", "e2e_p95", 2.0, nearest, 3.0, 4)
    report, _ = run(j, url, UnreachableWatch(j, lambda _m: None, predict=lambda _job: wrong))
    assert report.stopped_by in ("budget", "repeats") and report.distinct == 5


def test_the_dry_run_says_which_slo_and_the_nearest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({**JOB, "slos": IMPOSSIBLE}), encoding="utf-8")
    code, out, _ = run_main(["tune", path, "--dry-run"], capsys, monkeypatch, columns=250)
    assert code == 0
    said = next(line for line in out.splitlines() if line.startswith("unreachable:"))
    assert "e2e_p95<=1ms" in said and "the nearest, max_num_seqs=8" in said and "against 1 ms" in said
    assert "the study stops once the baseline" in said
    assert not list(tmp_path.glob("*.db"))  # the dry run created no storage


def test_status_says_which_slo_stopped_the_study(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    report, _ = run(job(slos=IMPOSSIBLE, budget={"n_trials": 6}), url)
    assert report.stopped_by == "unreachable"
    code, out, _ = run_main(["status", "fake", "--storage", url], capsys, monkeypatch, columns=250)
    assert code == 0
    assert "unreachable: no flag set is predicted to meet e2e_p95<=1ms" in out and "SLOs: e2e_p95 <= 1ms" in out
