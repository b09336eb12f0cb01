"""`tuner export` and `tuner plan` on a box study (target.gpus: 2): the winner written as the replicas it ran as."""

from __future__ import annotations

import json
import math
import shlex
from pathlib import Path

import pytest
import yaml

from tests.ship.test_plan import plan

pytestmark = pytest.mark.slow


def test_export_writes_the_box_replicas(box_job: Path) -> None:
    done = plan(box_job, "--format", "vllm-args", command="export")
    assert done.returncode == 0, done.stderr
    serves = [shlex.split(line) for line in done.stdout.splitlines() if "vllm serve" in line]
    assert [words[0] for words in serves] == ["CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"]
    assert [words[words.index("--port") + 1] for words in serves] == ["8000", "8001"]


def test_export_replicas_option_overrides_the_box(box_job: Path) -> None:
    done = plan(box_job, "--format", "kubernetes", "--replicas", "3", command="export")
    assert done.returncode == 0, done.stderr
    deployment = next(d for d in yaml.safe_load_all(done.stdout) if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    refused = plan(box_job, "--replicas", "0", command="export")
    assert refused.returncode == 2 and "--replicas" in refused.stderr and "Traceback" not in refused.stderr


def test_plan_counts_servers_of_the_shape_and_the_boxes_they_fill(box_job: Path) -> None:
    done = plan(box_job, "--rate", "40", "--json")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["box_gpus"] == 2 and got["gpus_per_replica"] == 1
    assert got["gpus"] == got["replicas"]
    assert got["boxes"] == math.ceil(got["replicas"] / 2)
    shown = plan(box_job, "--rate", "40")
    assert f"= {got['boxes']}" in next(line for line in shown.stdout.splitlines() if line.startswith("boxes of 2"))
