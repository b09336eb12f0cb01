"""`nohup tuner tune job.yaml > night.log`: with stdout not a terminal, no line of the log is broken inside a record
(a trial's line, the closing lines) and the progress bar is a plain line a finished trial, so that `grep` reads it."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pytest
import yaml
from study_fakes import JOB, FakeLauncher, fake_measure

from tests.conftest import run_main
from tuner.cli.progress_lines import PlainProgress, clock_text
from tuner.cli.trial_lines import trial_line
from tuner.report.storage import opened_study

# Flags with long names and a long study name: every trial's line is well over 80 columns, where a log wrapped.
LONG_JOB = {
    **JOB,
    "study": {**JOB["study"], "name": "overnight-study-with-a-long-name"},
    "space": {
        "max_num_seqs": {"choices": [8, 64]},
        "gpu_memory_utilization": {"choices": [0.85, 0.95]},
        "max_num_batched_tokens": {"choices": [2048, 8192]},
        "enable_chunked_prefill": {"choices": [True, False]},
        "max_model_len": 4096,
    },
    "slos": ["e2e_p95 <= 3s", "success_rate >= 0.9"],  # the baseline misses it, 64 sequences meet it
    "budget": {"n_trials": 4, "confirm": 0},
}


def test_a_piped_tune_log_keeps_every_record_on_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # a log file has no width: Rich assumed 80 and wrapped there
    monkeypatch.setenv("TUNER_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setattr("tuner.launch.factory.build_launcher", lambda job, *a, **k: FakeLauncher())
    monkeypatch.setattr("tuner.cli.tune.measure_load", fake_measure())
    job = tmp_path / "night.yaml"
    job.write_text(yaml.safe_dump(LONG_JOB))
    url = f"sqlite:///{tmp_path / 'night.db'}"

    code, out, err = run_main(["tune", str(job), "--storage", url], capsys, monkeypatch)

    assert code == 0, out + err
    lines = out.splitlines()
    with opened_study(url, "overnight-study-with-a-long-name") as study:
        records = [trial_line(t) for t in study.get_trials(deepcopy=False) if t.user_attrs]
    assert len(records) >= 4 and max(map(len, records)) > 100
    for record in records:  # each trial's record is a line of the log, whole
        assert record in lines, f"{record!r} is not a line of the log:\n{out}"
    trial_starts = [line for line in lines if re.match(r"#\d {3}", line)]  # `#3   seqs=...`, as trial_line starts
    assert len(trial_starts) == len(records) and all(" -> " in line for line in trial_starts), out
    finished = [line for line in lines if line.startswith("finished (")]
    assert len(finished) == 1 and finished[0].endswith("confirmation starts (budget.confirm)"), out
    # The bar's plain form: one line a finished trial, with the count, the best so far, elapsed and ETA together.
    progress = [line for line in lines if line.startswith("progress: ")]
    assert len(progress) == 4, out
    assert progress[-1].startswith("progress: 4/4 trials, best feasible: #")
    assert all(re.search(r", elapsed \d+:\d\d:\d\d, ETA (\d+:\d\d:\d\d|unknown)$", line) for line in progress), out
    # No fragment of a wrapped phrase or a redrawn bar.
    for line in lines:
        assert not re.match(r"\s*(elapsed|ETA|early\)|\(stopped)", line), line
        assert "\r" not in line and ("elapsed" not in line or line.startswith("progress: ")), line


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_plain_progress_line_says_the_pace_and_a_quiet_study_every_few_minutes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from rich.console import Console

    clock = Clock()
    progress = PlainProgress(Console(soft_wrap=True), every_s=300, clock=clock)
    task = progress.add_task("starting", total=10, completed=2, best="best feasible: none yet")
    clock.now = 60
    progress.update(task, description="trial #3")  # a trial started: no line
    progress.tick()  # a minute of quiet: no line yet
    assert capsys.readouterr().out == ""
    clock.now = 120
    progress.update(task, completed=3, best="best feasible: #2 341.0 tok/s")
    # 1 trial in 2 minutes, 7 left: 14 minutes
    assert (
        capsys.readouterr().out
        == "progress: 3/10 trials, best feasible: #2 341.0 tok/s, elapsed 0:02:00, ETA 0:14:00\n"
    )
    clock.now = 420
    progress.tick()
    assert capsys.readouterr().out.startswith("progress: 3/10 trials, best feasible: #2 341.0 tok/s, elapsed 0:07:00")
    assert clock_text(3725.9) == "1:02:05"


def test_before_any_trial_ends_the_eta_is_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.console import Console

    progress = PlainProgress(Console(), clock=Clock())
    progress.add_task("starting", total=4, completed=0, best="best feasible: none yet")
    progress.say()
    assert capsys.readouterr().out == "progress: 0/4 trials, best feasible: none yet, elapsed 0:00:00, ETA unknown\n"


optuna.logging.set_verbosity(optuna.logging.WARNING)


def test_the_closing_lines_say_the_baseline_is_not_separable_once() -> None:
    from tuner.cli.trial_lines import closing_once

    headline = (
        "#4 and the baseline are not separable (+2.1% ± 3.0%; 95% CI -1..+5%, 3 starts each): the gain is within "
        "the noise"
    )
    again = "#4 and the baseline (#0) are not separable (+2.1% ± 3.0%): either will do"
    other = "#4 and #7 are not separable (+0.5% ± 2.0%): either will do"
    noise = "between starts the same flags moved 1.2% in tok/s (4 repeats)"
    assert closing_once([headline, again, other, noise]) == [headline, other, noise]
    # Where the headline says the leader beats the baseline, a contender line is the only one to say it.
    beats = "#4 beats the baseline by +12% (95% CI +8..+16%, 3 starts each)"
    assert closing_once([beats, other, noise]) == [beats, other, noise]
