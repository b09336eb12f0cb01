"""The CPU plan of a `gpu: cpu` target: which cores vLLM's CPU worker gets and which the API server, the engine
core and the load client share, on machines of 1, 2, 4 and 16 cores and on a gappy affinity set; the job's
override of it (`target.cpu_affinity`) and `tuner launch --cpu-affinity`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tuner.config import load_job
from tuner.errors import ConfigError
from tuner.launch.affinity import ROLES, CpuPlan, format_cpu_list, parse_cpu_list, plan_cpus, plan_from_setting
from tuner.launch.factory import LaunchOptions, cpu_plan
from tuner.launch.pinning import usable_cpus
from tuner.launch.process import ProcessLauncher


@pytest.mark.parametrize(
    ("usable", "worker", "others"),
    [
        ({0, 1}, {1}, {0}),  # one each
        ({0, 1, 2, 3}, {1, 2, 3}, {0}),
        (set(range(16)), set(range(4, 16)), {0, 1, 2, 3}),
        ({0, 2, 5, 7}, {2, 5, 7}, {0}),  # a container's or taskset's gappy set: only its own cores are handed out
        ({3, 9}, {9}, {3}),
    ],
)
def test_the_worker_gets_most_cores_and_the_others_the_lowest(
    usable: set[int], worker: set[int], others: set[int]
) -> None:
    plan = plan_cpus(usable)
    assert plan.applies and plan.worker == worker and plan.others == others
    assert plan.worker | plan.others == usable and not plan.worker & plan.others
    assert {role: plan.cores(role) for role in ROLES} == {
        "worker": worker,
        "api_server": others,
        "engine_core": others,
        "client": others,
    }
    assert plan.env() == {"VLLM_CPU_OMP_THREADS_BIND": format_cpu_list(worker)}


def test_what_people_and_vllm_are_told() -> None:
    assert plan_cpus(set(range(16))).env() == {"VLLM_CPU_OMP_THREADS_BIND": "4-15"}
    assert plan_cpus({0, 2, 5, 7}).env() == {"VLLM_CPU_OMP_THREADS_BIND": "2,5,7"}
    assert plan_cpus({0, 1}).describe() == (
        "CPU cores: vLLM's CPU worker on 1; the API server, the engine core and tuner's load client on 0"
    )


def test_one_core_cannot_be_split_and_nothing_is_bound() -> None:
    plan = plan_cpus({3})
    assert not plan.applies and plan.env() == {}
    assert (
        plan.describe() == "CPU cores: not split (one usable core (3) cannot be split; vLLM places its threads itself)"
    )


@pytest.mark.parametrize(("text", "cores"), [("1", {1}), ("2-7", set(range(2, 8))), ("0,2-3, 5", {0, 2, 3, 5})])
def test_cpu_lists_read_and_written_as_linux_writes_them(text: str, cores: set[int]) -> None:
    assert parse_cpu_list(text) == cores
    assert parse_cpu_list(format_cpu_list(cores)) == cores
    assert format_cpu_list({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


@pytest.mark.parametrize("text", ["", "a", "1-", "-3", "3-1", "1;2"])
def test_a_bad_cpu_list_says_what_is_allowed(text: str) -> None:
    with pytest.raises(ValueError, match=r"CPU list|backwards"):
        parse_cpu_list(text)


def test_settings_auto_off_cores_and_the_users_own_binding() -> None:
    usable = {0, 1, 2, 3}
    assert plan_from_setting("auto", usable) == plan_cpus(usable)
    assert not plan_from_setting("off", usable).applies
    given = plan_from_setting({"worker": "2-3", "others": "0"}, usable)
    assert (given.worker, given.others, given.source) == ({2, 3}, {0}, "job")
    assert "the job's target.cpu_affinity" in given.describe()
    kept = plan_from_setting("auto", usable, {"VLLM_CPU_OMP_THREADS_BIND": "0-3"})
    assert not kept.applies and "VLLM_CPU_OMP_THREADS_BIND=0-3 is set in the environment" in kept.describe()
    with pytest.raises(ValueError, match=r"core 4-5 is not usable here \(this process may use 0-3\)"):
        plan_from_setting({"worker": "4-5", "others": "0"}, usable)


CPU_JOB: dict[str, Any] = {
    "study": {"name": "cpu"},
    "target": {"launcher": "process", "model": "llama-3.1-8b", "gpu": "cpu"},
    "space": {"max_num_seqs": {"choices": [4, 8]}},
    "arrival": {"concurrency": 2, "requests": 4},
}


def _job_file(tmp_path: Path, affinity: Any = None, **target: Any) -> Path:
    job = yaml.safe_load(yaml.safe_dump(CPU_JOB))
    job["target"].update(target)
    if affinity is not None:
        job["target"]["cpu_affinity"] = affinity
    path = tmp_path / "job.yaml"
    # `off` written bare, as a user would: YAML reads it as false
    path.write_text(yaml.safe_dump(job).replace("cpu_affinity: 'off'", "cpu_affinity: off"))
    return path


def test_a_cpu_job_plans_its_cores_when_asked(tmp_path: Path) -> None:
    assert cpu_plan(load_job(_job_file(tmp_path, "auto"))) == plan_cpus(usable_cpus())
    off = cpu_plan(load_job(_job_file(tmp_path, "off")))  # written bare: YAML's false
    assert off is not None and off.describe() == "CPU cores: not split (target.cpu_affinity is off)"
    # off unless asked: on 2 cores the split starved the front end (benchmarks/README.md)
    assert cpu_plan(load_job(_job_file(tmp_path))) == off
    mine = sorted(usable_cpus())
    if len(mine) >= 2:
        job = load_job(_job_file(tmp_path, {"worker": mine[-1], "others": str(mine[0])}))
        assert cpu_plan(job) == CpuPlan(worker=frozenset(mine[-1:]), others=frozenset(mine[:1]), source="job")
    # a GPU target, or another launcher, is not placed
    assert cpu_plan(load_job(_job_file(tmp_path, launcher="docker"))) is None


@pytest.mark.parametrize(
    ("affinity", "message"),
    [
        ("sometimes", "'sometimes' is not allowed; use auto, off, or {worker: CORES, others: CORES}"),
        ({"worker": "1"}, "is not allowed; use auto, off, or {worker: CORES, others: CORES}"),
        ({"worker": "x", "others": "0"}, "worker: 'x' is not a CPU list"),
        ({"worker": "0-1", "others": "1"}, "worker and others share cores; give each its own"),
    ],
)
def test_a_bad_override_is_one_line_naming_the_field(tmp_path: Path, affinity: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(_job_file(tmp_path, affinity))
    text = str(info.value)
    assert len(text.splitlines()) == 1 and "target.cpu_affinity: " in text and message in text


def test_an_override_of_cores_this_machine_lacks_fails_where_the_launcher_is_built(tmp_path: Path) -> None:
    job = load_job(_job_file(tmp_path, {"worker": "4096", "others": "4095"}))  # valid on some machine
    with pytest.raises(ConfigError, match=r"^target.cpu_affinity: core 4095-4096 is not usable here"):
        cpu_plan(job)


def test_tuner_launch_plans_the_cpu_builds_cores_when_asked() -> None:
    from tuner.launch.factory import LAUNCHERS

    def plan_of(**options: Any) -> CpuPlan | None:
        launcher = LAUNCHERS["process"].from_options(LaunchOptions(**options))
        assert isinstance(launcher, ProcessLauncher)
        return launcher.cpu_plan

    assert plan_of() is None  # a GPU's vLLM: nothing moved
    assert plan_of(gpu="cpu") is None  # off unless asked (on 2 cores the split starved the front end)
    assert plan_of(gpu="cpu", cpu_affinity="auto") == plan_cpus(usable_cpus())
    assert plan_of(gpu="cpu", cpu_affinity="off") is None
    with pytest.raises(ConfigError, match=r"^--cpu-affinity: core 4096 is not usable here"):
        plan_of(cpu_affinity={"worker": "4096", "others": "0"})


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("1", "error: --cpu-affinity '1': use auto, off, or WORKER:OTHERS cores such as 1:0 or 2-7:0-1"),
        (
            "x:0",
            "error: --cpu-affinity: worker: 'x' is not a CPU list; use core numbers and ranges, e.g. 1 or 2-7 or 0,2,5",
        ),
    ],
)
def test_tuner_launch_refuses_a_bad_cpu_affinity_in_one_line(tmp_path: Path, value: str, line: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tuner", "launch", "--launcher", "process", "--gpu", "cpu", "--cpu-affinity", value],
        capture_output=True,
        text=True,
        env={**os.environ, "TUNER_STATE_DIR": str(tmp_path), "COLUMNS": "200"},
        timeout=60,
    )
    assert run.returncode == 2 and (run.stdout + run.stderr).strip().splitlines() == [line]


def test_the_dry_run_says_which_cores_go_where(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "tuner", "tune", str(_job_file(tmp_path, "auto")), "--dry-run"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200"},
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert plan_cpus(usable_cpus()).describe() in run.stdout.splitlines()
