"""`tuner plan` on a throughput study (the morning demo): the rate it held is a floor, and the plan says how to
measure the real capacity."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.morning_demo import build_demo_study


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_demo_study(tmp_path_factory.mktemp("plan") / "demo.db")


def plan(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TUNER_STORAGE_URL", "TUNER_STORAGE")}
    cmd = [sys.executable, "-m", "tuner", "plan", "demo", "--storage", url, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**env, "COLUMNS": "200"})


def test_a_throughput_study_plans_on_its_floor_and_names_the_measurement(demo: str) -> None:
    run = plan(demo, "--rate", "5", "--json")
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout)
    assert got["objective"] == "throughput" and got["capacity_rps"] == pytest.approx(2.0)  # 20 requests in 10 s
    assert got["replicas"] == math.ceil(5 / (2.0 * 0.7))
    assert "tuner bench --url URL --slo 'e2e_p95<=5s'" in got["basis"] and "--find-max-rate" in got["basis"]


def test_a_negative_price_is_one_line(demo: str) -> None:
    run = plan(demo, "--rate", "5", "--price-per-gpu-hour", "-1")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1 and "price" in run.stderr
