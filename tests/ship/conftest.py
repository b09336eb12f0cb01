"""Fixtures of the ship commands: a short max_rate study run by `tuner tune` on the emulator, and promtool."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.conftest import missing_service
from tuner.launch.owner import pid_alive
from tuner.launch.registry import ProcessRegistry

JOB = Path(__file__).resolve().parents[2] / "search_spaces" / "emulator-demo-max-rate.yaml"
# At time scale 40 the job's ttft_p95 <= 2s is 50 ms of wall time, which a machine with both cores busy misses at every
# rate (no feasible trial, nothing to plan); SLOs ten times looser keep the ship tests about the ship commands.
LOOSE_SLOS = ["e2e_p95 <= 100s", "ttft_p95 <= 20s", "success_rate >= 0.99"]


@pytest.fixture(scope="session")
def max_rate_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The README's max_rate job (its SLOs loosened), run whole (two trials, seconds on the emulator) in a directory."""
    yield from _tuned(tmp_path_factory.mktemp("ship"), {})


@pytest.fixture(scope="session")
def box_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The same job on a box of 2 GPUs (target.gpus): its one-GPU shape runs as 2 replicas, one trial."""
    yield from _tuned(tmp_path_factory.mktemp("box"), {"gpus": 2}, n_trials=1)


def _tuned(d: Path, target: dict[str, object], n_trials: int | None = None) -> Iterator[Path]:
    job = d / JOB.name
    doc = yaml.safe_load(JOB.read_text())
    doc["slos"] = LOOSE_SLOS
    doc["target"].update(target)
    if n_trials is not None:
        doc["budget"]["n_trials"] = n_trials
    job.write_text(yaml.safe_dump(doc))
    state = d / "state"
    env = {**os.environ, "TUNER_STATE_DIR": str(state), "COLUMNS": "200"}
    env.pop("TUNER_STORAGE_URL", None)
    env.pop("TUNER_STORAGE", None)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "tuner", "tune", str(job)], capture_output=True, text=True, env=env, timeout=600
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield job
    finally:
        # Whatever happened, no emulator of ours outlives the study.
        for record in ProcessRegistry(state / "processes").records():
            if pid_alive(record.pid):
                os.killpg(record.pgid, signal.SIGKILL)


@pytest.fixture(scope="session")
def promtool() -> str:
    """promtool, from Debian's prometheus package (TUNER_TEST_PROMTOOL, else on PATH)."""
    path = os.environ.get("TUNER_TEST_PROMTOOL") or shutil.which("promtool")
    if not path:
        missing_service("promtool", "TUNER_TEST_PROMTOOL is not set and no promtool is on PATH (scripts/services)")
    assert path is not None
    return path
