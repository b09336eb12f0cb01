"""The README's demo job (search_spaces/emulator-demo.yaml, what scripts/demo runs) through `tuner tune`, as shipped
but for the emulator's time scale: twin-first, predicted against measured in the study log for every real trial, as
many distinct flag sets measured as its budget.

The job file holds no option for the time scale (`tuner tune` overrides only n_trials), so the test runs a copy in
which it is changed, the emulator 50x faster than the L4 instead of 10x, and the budget a third (4 servers, not 12:
the twin's sweep before the first, and a refit after each of three more; 96 requests each, the twin's sweep of 80
flag sets in virtual time, as shipped). A busy machine stretches emulated
durations (and may make a trial miss its SLOs or the twin hand over to TPE), which changes none of the assertions.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest

from tuner.config import load_job
from tuner.record import MEASURED, TrialRecord
from tuner.store import flag_key
from tuner.study.samplers import sampler_name
from tuner.twin.sampler import PREDICTED_ATTR

pytestmark = pytest.mark.slow

DEMO = Path(__file__).resolve().parents[2] / "search_spaces" / "emulator-demo.yaml"
SHIPPED_SCALE = "emulator: {time_scale: 10}"
TEST_SCALE = "emulator: {time_scale: 50}"
SHIPPED_BUDGET = "budget: {n_trials: 12}"
TEST_BUDGET = "budget: {n_trials: 4}"
# A line of the study log per real trial: the twin's prediction, then the measurement.
TRIAL_LINE = re.compile(
    r"trial (\d+): twin (?:predicted [\d,]+ tok/s, (?:meets the SLOs(?:, uncertain \(\d+% chance\))?"
    r"|misses an SLO by \d+%)|predicted not to start"
    r"|predicted to crash under load); measured[ :]"
)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    """(the job copy, the study log, stdout) of the demo tuned to its budget."""
    folder = tmp_path_factory.mktemp("demo")
    text = DEMO.read_text(encoding="utf-8")
    assert text.count(SHIPPED_SCALE) == 1, "the demo's time scale moved: update SHIPPED_SCALE"
    assert text.count(SHIPPED_BUDGET) == 1, "the demo's budget moved: update SHIPPED_BUDGET"
    job = folder / DEMO.name
    job.write_text(text.replace(SHIPPED_SCALE, TEST_SCALE).replace(SHIPPED_BUDGET, TEST_BUDGET), encoding="utf-8")
    log = folder / "study.log"
    done = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", str(job), "--log-file", str(log)],
        capture_output=True,
        text=True,
        # Environment: the study's storage is the job's own (beside the copy), whatever the caller's shell says.
        env={k: v for k, v in os.environ.items() if not k.startswith("TUNER_STORAGE")} | {"COLUMNS": "200"},
        check=False,
        timeout=3600,  # not a bound on its speed: a hang must end the run rather than block CI
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return job, log.read_text(encoding="utf-8"), done.stdout


def test_the_demo_runs_twin_first_by_default(demo_run: tuple[Path, str, str]) -> None:
    job_file, log, _ = demo_run
    job = load_job(job_file)
    assert job.sampler.name is None and sampler_name(job) == "twin"  # the default, not a name in the file
    sweep = next(i for i, line in enumerate(log.splitlines()) if "flag sets measured in the emulator's engine" in line)
    first_trial = next(i for i, line in enumerate(log.splitlines()) if TRIAL_LINE.search(line))
    assert sweep < first_trial  # the twin measured the space before the first launch


def test_every_real_trial_shows_predicted_against_measured(demo_run: tuple[Path, str, str]) -> None:
    job_file, log, _ = demo_run
    job = load_job(job_file)
    study = optuna.load_study(study_name=job.study.name, storage=job.storage_url())
    real = [t for t in study.trials if not TrialRecord.from_attrs(t.user_attrs).is_duplicate]
    logged = {int(m.group(1)) for m in TRIAL_LINE.finditer(log)}
    assert logged == {t.number for t in real}
    for t in real:
        record = TrialRecord.from_attrs(t.user_attrs)
        assert isinstance(t.user_attrs.get(PREDICTED_ATTR), float | int), t.number
        assert record.twin_predicted_tok_s is not None
        assert record.outcome != MEASURED or record.output_tok_s is not None


def test_the_demo_measures_as_many_distinct_flag_sets_as_its_budget(demo_run: tuple[Path, str, str]) -> None:
    job_file, log, out = demo_run
    job = load_job(job_file)
    n = job.budget.n_trials
    study = optuna.load_study(study_name=job.study.name, storage=job.storage_url())
    records = [TrialRecord.from_attrs(t.user_attrs) for t in study.trials]
    measured = {flag_key(r.flags) for r in records if r.outcome == MEASURED and not r.is_duplicate}
    assert len(measured) == n == 4
    closing = f"{n} distinct flag sets tried ({n} measured)"
    assert closing in log and closing in " ".join(out.split())  # the terminal wraps long lines
