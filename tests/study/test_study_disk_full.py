"""A SQLite study on a disk that fills up under a trial: one line naming it, the trial not blamed on its flags, and
the file still opens with every trial stored before (a small tmpfs; skipped where this machine cannot mount one)."""

from __future__ import annotations

import errno
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState
from study_fakes import FakeLauncher, fake_measure, job

from tests.conftest import run_main
from tuner.config import Job
from tuner.errors import StorageError
from tuner.flags import VllmFlags
from tuner.study import TuningRun
from tuner.study.measure import Measurement
from tuner.study.surroundings import disk_full


@pytest.fixture
def small_disk() -> Iterator[Path]:
    where = Path(tempfile.mkdtemp(prefix="full-disk-", dir="/tmp"))
    mount = shutil.which("mount")
    done = (
        subprocess.run([mount, "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(where)], capture_output=True, text=True)
        if mount
        else None
    )
    if done is None or done.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip() if done else 'no mount command'}")
    try:
        yield where
    finally:
        # Lazily: a connection the run under test leaked must not leave the mount behind.
        subprocess.run(["umount", "-l", str(where)], check=False)
        where.rmdir()


def fill(directory: Path) -> Path:
    filler = directory / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    return filler


def test_a_full_disk_under_a_trial_is_one_line_and_the_study_keeps_what_it_stored(small_disk: Path) -> None:
    url = f"sqlite:///{small_disk / 'study.db'}"
    measured = fake_measure()
    calls: list[int] = []
    fillers: list[Path] = []

    async def measure(server: Any, job_: Job, flags: VllmFlags) -> Measurement:
        calls.append(1)
        if len(calls) == 3:  # trial 2: the disk fills up while it is measured
            fillers.append(fill(small_disk))
        return await measured(server, job_, flags)

    j = job()
    tuning = TuningRun(j, FakeLauncher(), storage_url=url, measure=measure, poll_s=0.05)
    try:
        with pytest.raises(StorageError) as e:
            tuning.run()
    finally:
        for filler in fillers:
            filler.unlink()  # room again, for what closing writes
        tuning.close()
    message = str(e.value)
    assert "\n" not in message and "is on a full disk (database or disk is full)" in message
    assert "trial 2's result was not stored (not its flags' doing)" in message and "study.db" in message
    # The file opens whole, with the trials stored before the disk filled.
    with sqlite3.connect(small_disk / "study.db") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    storage = optuna.storages.RDBStorage(url)
    try:
        trials = optuna.load_study(study_name=j.study.name, storage=storage).get_trials()
    finally:
        storage.engine.dispose()
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert [t.number for t in done] == [0, 1] and all(t.user_attrs["outcome"] == "measured" for t in done)
    assert not any(t.user_attrs.get("outcome") in ("crashed", "launch_failed") for t in trials)
    # With room again, the same run goes on to its budget.
    again = TuningRun(j, FakeLauncher(), storage_url=url, measure=fake_measure(), poll_s=0.05)
    try:
        again.run()
        finished = [t for t in again.study.get_trials(deepcopy=False) if t.state == TrialState.COMPLETE]
    finally:
        again.close()
    assert sum(t.user_attrs.get("duplicate_of") is None for t in finished) == 4


def test_a_full_disk_is_found_through_the_errors_that_wrap_it() -> None:
    try:
        try:
            raise sqlite3.OperationalError("database or disk is full")
        except sqlite3.OperationalError as inner:
            raise RuntimeError("An exception is raised during the commit.") from inner
    except RuntimeError as wrapped:
        assert disk_full(wrapped)
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert not disk_full(sqlite3.OperationalError("database is locked"))


EMULATED = {
    "study": {"name": "full"},
    "target": {"launcher": "emulator", "model": "llama-3.1-8b", "gpu": "h100-80gb", "emulator": {"time_scale": 40}},
    "space": {"max_num_seqs": {"choices": [4, 8, 16]}, "max_model_len": 4096},
    "workload": {"input_len": 256, "output_len": 16},
    "arrival": {"concurrency": 2, "requests": 4},
    "slos": ["e2e_p95 <= 30s"],
    "request_timeout": "600s",
    "budget": {"n_trials": 1, "confirm": 0},
    # 2 users fit every max_num_seqs here: the twin would answer each from the baseline, and this test needs launches
    "sampler": {"name": "random", "seed": 0},
}


def tune(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str]:
    """`tuner tune ARGS...` through run_main: the exit code, and stdout and stderr as one text."""
    code, out, err = run_main(["tune", *args], capsys, monkeypatch, columns=400)
    return code, out + err


@pytest.mark.slow
def test_tune_on_a_full_disk_says_one_line_without_a_traceback_and_resumes_with_room(
    small_disk: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TUNER_STATE_DIR", str(tmp_path / "state"))
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(EMULATED))
    url, log = f"sqlite:///{small_disk / 'study.db'}", small_disk / "tune.log"
    code, out = tune(capsys, monkeypatch, str(job_file), "--storage", url)
    assert code == 0, out
    job_file.write_text(yaml.safe_dump({**EMULATED, "budget": {"n_trials": 3, "confirm": 0}}))
    log.write_text("")
    filler = fill(small_disk)
    code, out = tune(capsys, monkeypatch, str(job_file), "--storage", url, "--log-file", str(log))
    assert code == 1 and "Traceback" not in out and "failed in the tuner itself" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "is on a full disk (database or disk is full)" in errors[0], out
    assert out.count(f"the log file {log} cannot be written") <= 1
    filler.unlink()
    code, out = tune(capsys, monkeypatch, str(job_file), "--storage", url)
    assert code == 0 and "Traceback" not in out, out
    storage = optuna.storages.RDBStorage(url)
    try:
        trials = optuna.load_study(study_name="full", storage=storage).get_trials()
    finally:
        storage.engine.dispose()
    assert trials[0].state == TrialState.COMPLETE and trials[0].user_attrs["baseline"]
    assert sum(t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None for t in trials) == 3
