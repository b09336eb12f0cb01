"""`tuner plan --measure` on a throughput study: the winner's capacity searched now on a server the study's own
launcher starts (the emulator here), instead of the floor the fixed load gave."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.ship.conftest import JOB, LOOSE_SLOS
from tuner.launch.owner import pid_alive
from tuner.launch.registry import ProcessRegistry


@pytest.fixture(scope="module")
def throughput_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    """The Ship-it job with objective throughput (a fixed load of 2 req/s), tuned on the emulator."""
    d = tmp_path_factory.mktemp("measure")
    doc = yaml.safe_load(JOB.read_text())
    doc["study"]["name"] = "fixed-load"
    doc["objective"] = "throughput"
    doc.pop("capacity_search")
    doc["slos"] = LOOSE_SLOS
    job = d / "fixed-load.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_STORAGE_URL", "TUNER_STORAGE")}
    env |= {"TUNER_STATE_DIR": str(d / "state"), "COLUMNS": "200"}
    done = subprocess.run([sys.executable, "-m", "tuner", "tune", str(job)], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    yield job, env
    for record in ProcessRegistry(d / "state" / "processes").records():
        assert not pid_alive(record.pid), "a server outlived its command"


def plan(job: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "tuner", "plan", "--job", str(job), "--rate", "40", "--json", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)


def test_measure_plans_on_the_capacity_searched_now(throughput_job: tuple[Path, dict[str, str]]) -> None:
    job, env = throughput_job
    floor = json.loads(plan(job, env).stdout)
    assert "a floor of its capacity" in floor["basis"] and "--measure" in floor["basis"]
    done = plan(job, env, "--measure")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["objective"] == "throughput" and got["trial"] == floor["trial"]
    assert got["basis"].startswith("its highest SLO-meeting rate, measured now by a capacity search of ")
    assert got["capacity_rps"] > 0 and got["capacity_rps"] != floor["capacity_rps"]
    assert got["replicas"] == math.ceil(40 / (got["capacity_rps"] * 0.7))
    assert ProcessRegistry(Path(env["TUNER_STATE_DIR"]) / "processes").records() == []


def test_measure_says_so_when_no_rate_meets_the_slos(
    throughput_job: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    job, env = throughput_job
    doc = yaml.safe_load(job.read_text())
    doc["slos"] = ["ttft_p95 <= 0.1ms"]  # no server answers that fast
    strict = tmp_path / "fixed-load.yaml"
    strict.write_text(yaml.safe_dump(doc))
    shutil.copy(job.with_suffix(".db"), strict.with_suffix(".db"))
    done = plan(strict, env, "--measure")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()[-1:]
    assert line.startswith("error: --measure: trial ") and "met the SLOs (ttft_p95 <= 0.1ms) at no rate" in line
