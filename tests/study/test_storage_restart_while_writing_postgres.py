"""The real PostgreSQL cluster restarted at the moment a trial's measured result is being written (not while it is
measured): the statement that meets the restart is chosen by tests/study/pg_restart_driver.py, so the restart lands
in the write every run. The one command still runs the study to its budget, every trial stored once, none FAIL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from optuna.trial import TrialState
from test_storage_outage_postgres import _cluster, cluster, state_dir  # the cluster these tests may restart
from test_study_e2e import JOB, assert_complete_and_stored, finish, trials_of, write_job

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.exclusive]  # it restarts the shared cluster
__all__ = ["cluster", "state_dir"]  # fixtures, used by name

DRIVER = Path(__file__).parent / "pg_restart_driver.py"
STUDY = {**JOB["study"], "grace_period": 60}  # type: ignore[dict-item]


@pytest.mark.parametrize(
    "moment",
    [
        "ATTR:outcome",  # the trial's record, its first attribute
        "SQL:INSERT INTO tuner_request",  # its requests, in the transaction that replaced the old ones
        "SQL:INSERT INTO trial_values",  # Optuna's tell: the values, in the transaction that finishes the trial
    ],
)
def test_a_restart_while_a_result_is_written_is_waited_out_and_the_result_stored_once(
    moment: str, tmp_path: Path, state_dir: Path, postgres_url: str, cluster: None
) -> None:
    version, name = _cluster()
    job = write_job(tmp_path, study=STUDY, budget={"n_trials": 2, "confirm": 0})
    log = tmp_path / "tune.log"
    env = {
        **os.environ,
        "TUNER_STATE_DIR": str(state_dir),
        "COLUMNS": "200",
        "TUNER_TEST_RESTART_AT": moment,
        "TUNER_TEST_CLUSTER": f"{version} {name}",
        "PYTHONPATH": os.pathsep.join([str(Path.cwd()), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, str(DRIVER), "tune", str(job), "--storage", postgres_url, "--log-file", str(log)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    code, out = finish(proc, 600)
    assert code == 0, out
    assert "Traceback" not in out and "failed in the tuner itself" not in out, out
    assert out.count("[test] PostgreSQL restarted before:") == 1, out  # at the moment chosen, once
    # The restart was met (said once each way), inside this one command.
    assert out.count("lost the connection to storage") == 1 and out.count("answers again") == 1, out
    trials = trials_of(postgres_url)
    assert {t.state for t in trials} == {TrialState.COMPLETE}, [(t.number, t.state) for t in trials]
    assert_complete_and_stored(postgres_url, trials, 2)  # the budget, each flag set measured and stored once
    assert [t.number for t in trials] == list(range(len(trials)))
    assert all(len(t.values) == 2 for t in trials)
    # The terminal said it in one line; the log file has that line and the lost connection's details.
    text = log.read_text()
    assert "lost the connection to storage" in text and "***" in text
    assert "debug tuner.store.waiting: the storage call that found the database gone" in text
    assert "Traceback" in text and "OperationalError" in text
