"""`tuner tune` on PostgreSQL while the real cluster restarts (Debian's pg_ctlcluster): a short outage is waited
out inside the one command; one past the job's bound stops it with one line and a journal the next run writes.

The cluster is the one TUNER_TEST_POSTGRES_URL points at; these tests restart it, so they run only where that is
this machine's own Debian cluster (pg_lsclusters lists it) and the test may manage it (root or the postgres user).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from optuna.trial import TrialState
from test_study_e2e import (  # the end-to-end tests' job and helpers
    JOB,
    assert_complete_and_stored,
    finish,
    registry_of,
    trials_of,
    tuner,
    wait_for_server_of_trial,
    write_job,
)

from tuner.launch.owner import pid_alive

# exclusive: the cluster these tests restart is every other `postgres` test's too (tests/xdist_groups.py)
pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.exclusive]

# Trials long enough that the restart lands inside one (the emulator's time runs 8x, not 40x).
STUDY = {**JOB["study"], "grace_period": 60}  # type: ignore[dict-item]
SLOWER = {**JOB["target"], "emulator": {"time_scale": 8}}  # type: ignore[dict-item]


def _cluster() -> tuple[str, str]:
    """(version, name) of the one local cluster, or the test is skipped: it cannot restart what it cannot see."""
    if shutil.which("pg_lsclusters") is None or shutil.which("pg_ctlcluster") is None:
        pytest.skip("no Debian PostgreSQL cluster tools (pg_lsclusters, pg_ctlcluster) to restart the database with")
    listed = subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True).stdout
    rows = [r for r in (line.split() for line in listed.splitlines()) if len(r) >= 4]
    if len(rows) != 1 or os.geteuid() != 0:
        pytest.skip("these tests restart the machine's one PostgreSQL cluster: run them as root beside it")
    return rows[0][0], rows[0][1]


def _ctl(action: str) -> None:
    version, name = _cluster()
    subprocess.run(["pg_ctlcluster", version, name, action], check=True, capture_output=True, timeout=120)


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The launchers' state; no emulator of ours outlives the test."""
    d = tmp_path / "state"
    yield d
    for record in registry_of(d).records():
        if pid_alive(record.pid):
            os.killpg(record.pgid, signal.SIGKILL)


def _online() -> bool:
    return "online" in subprocess.run(["pg_lsclusters", "-h"], capture_output=True, text=True).stdout


@pytest.fixture
def cluster(request: pytest.FixtureRequest, postgres_url: str) -> Iterator[None]:
    """The cluster, left running whatever the test did to it. Only for a test marked `exclusive`, which the suite
    runs with no other beside it."""
    assert request.node.get_closest_marker("exclusive"), "a test that restarts the cluster must be marked exclusive"
    _cluster()
    try:
        yield
    finally:
        if not _online():
            _ctl("start")


def test_a_restart_mid_trial_is_waited_out_in_one_command(
    tmp_path: Path, state_dir: Path, postgres_url: str, cluster: None
) -> None:
    job = write_job(tmp_path, study=STUDY, target=SLOWER)
    proc = tuner(job, state_dir, "--storage", postgres_url)
    wait_for_server_of_trial(registry_of(state_dir), 1)
    _ctl("restart")  # every connection dropped while trial 1's server runs
    code, out = finish(proc, 600)
    assert code == 0, out
    assert "Traceback" not in out and "failed in the tuner itself" not in out, out
    trials = trials_of(postgres_url)
    assert {t.state for t in trials} == {TrialState.COMPLETE}, [(t.number, t.state) for t in trials]
    assert_complete_and_stored(postgres_url, trials, 4)  # the budget in one command, each trial stored once
    assert [t.number for t in trials] == list(range(len(trials)))


def test_an_outage_past_the_bound_stops_with_one_line_and_the_next_run_writes_the_result(
    tmp_path: Path, state_dir: Path, postgres_url: str, cluster: None
) -> None:
    job = write_job(tmp_path, study={**STUDY, "storage_wait_s": 1}, target=SLOWER)
    log = tmp_path / "tune.log"
    proc = tuner(job, state_dir, "--storage", postgres_url, "--log-file", str(log))
    servers = wait_for_server_of_trial(registry_of(state_dir), 1)
    _ctl("stop")
    try:
        code, out = finish(proc, 600)
    finally:
        _ctl("start")
    journal = tmp_path / ".tuner-journal" / "e2e.jsonl"
    assert code != 0 and "Traceback" not in out, out
    assert journal.is_file(), out
    said = [line for line in out.splitlines() if str(journal) in line]
    assert len(said) == 1 and "postgresql" in said[0] and "***" in said[0], out  # the storage, its password hidden
    assert not any(pid_alive(p) for p in servers)
    # The details are the log file's alone: the stop's line, then what lay behind it with its tracebacks.
    text = log.read_text()
    assert "error: " in text and str(journal) in text and "Traceback" in text and "OperationalError" in text

    code, out = finish(tuner(job, state_dir, "--storage", postgres_url), 600)
    assert code == 0, out
    assert "trial 1: its result, kept in" in out and not journal.exists()
    trials = trials_of(postgres_url)
    assert trials[1].state == TrialState.COMPLETE and trials[1].user_attrs["outcome"] == "measured"
    assert {t.state for t in trials} == {TrialState.COMPLETE}, [(t.number, t.state) for t in trials]
    assert_complete_and_stored(postgres_url, trials, 4)
