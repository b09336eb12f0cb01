"""The prediction takes out what other processes hold on the trial's own GPUs, read just before it, as vLLM's start-up
check sees it ("Free memory on device ... is less than desired"): through the stand-in pynvml of tests/study/fake_nvml
(4 L4s of 23 GiB, $FAKE_NVML_USED_GIB in use)."""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from optuna.trial import FixedTrial
from study_fakes import JOB, FakeLauncher, fake_measure

from tuner.catalog.nvml import DeviceInfo, nvml_devices
from tuner.config import Job, parse_job
from tuner.flags import VllmFlags
from tuner.launch import DockerLauncher
from tuner.launch.gpu_idle import GpuIdleWaiter
from tuner.launch.gpu_pool import GpuPool
from tuner.launch.pooled import PooledLauncher
from tuner.study import Objective
from tuner.study.placement import DeviceRead, Placement, in_use_gib

GIB = 1024**3
FLAGS = {"max_num_seqs": 16, "gpu_memory_utilization": 0.9}  # vLLM asks 0.9 x 22.05 GiB free of each GPU


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The stand-in pynvml, loaded as a module of its own (whatever real pynvml this process may hold)."""
    spec = importlib.util.spec_from_file_location("fake_pynvml", Path(__file__).parent / "fake_nvml" / "pynvml.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    yield module


def read(nvml: ModuleType) -> DeviceRead:
    return lambda: nvml_devices(nvml)


def process_job(**target: Any) -> Job:
    return parse_job({**JOB, "target": {**JOB["target"], "launcher": "process", **target}})


def run(objective: Objective) -> dict[str, Any]:
    trial = FixedTrial(FLAGS)
    objective(trial)
    return trial.user_attrs


@pytest.mark.parametrize(("home", "outcome"), [("2", "skipped_infeasible"), ("1", "measured")])
def test_a_parallel_trial_reads_the_gpus_it_borrowed(
    nvml: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, home: str, outcome: str
) -> None:
    monkeypatch.setenv("FAKE_NVML_USED_GIB", "0,0,6,0")  # another process holds 6 GiB of GPU 2
    built: list[tuple[str, ...]] = []
    fake = FakeLauncher()

    def build(devices: tuple[str, ...]) -> FakeLauncher:
        built.append(devices)
        return fake

    pool = GpuPool(["0", "1", "2", "3"], tmp_path / "gpus", poll_s=0.01)
    pooled = PooledLauncher(build, pool, home=(home,))
    attrs = run(Objective(process_job(), pooled, measure=fake_measure(), read_devices=read(nvml)))
    assert attrs["outcome"] == outcome
    if outcome == "skipped_infeasible":
        # 22.05 - 6 GiB free against 0.9 x 22.05 asked: vLLM's refusal, predicted, nothing launched
        assert attrs["reason"] == "insufficient_free_memory"
        assert "Free memory on device (16.05/22.05 GiB)" in attrs["message"]
        assert fake.launches == []
    else:
        assert len(fake.launches) == 1
    assert built[-1] == (home,) and pool.busy() == []  # held for the trial, given back after it


def test_a_serial_trial_reads_the_first_gpus_its_server_is_shown(
    nvml: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_NVML_USED_GIB", "0,0,6,0")
    fake = FakeLauncher()
    objective = Objective(process_job(), fake, measure=fake_measure(), read_devices=read(nvml))
    assert run(objective)["outcome"] == "measured"  # GPU 0: idle
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    objective = Objective(process_job(), fake, measure=fake_measure(), read_devices=read(nvml))
    assert run(objective)["reason"] == "insufficient_free_memory"  # vLLM's rank 0 is GPU 2
    assert len(fake.launches) == 1


def test_a_container_reads_the_gpus_docker_gives_it(nvml: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NVML_USED_GIB", "1,3,6,0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # the tuner's own: not what a container is shown
    job = process_job(launcher="docker")
    idle = GpuIdleWaiter(probe=lambda: None)

    def docker(gpus: Any) -> Placement:
        return Placement(DockerLauncher(model="m", gpus=gpus, client=object(), gpu_idle=idle))

    one, two = VllmFlags(), VllmFlags(tensor_parallel_size=2)
    assert in_use_gib(job, docker("all"), one, read(nvml)) == pytest.approx(1)
    assert in_use_gib(job, docker("all"), two, read(nvml)) == pytest.approx(3)  # the fuller of GPUs 0 and 1
    assert in_use_gib(job, docker(["2", "3"]), one, read(nvml)) == pytest.approx(6)
    assert in_use_gib(job, docker(None), two, read(nvml)) == 0.0
    # A borrowed set is read whole, whatever the launcher.
    assert in_use_gib(job, Placement(FakeLauncher(), ("1", "3")), two, read(nvml)) == pytest.approx(3)


def test_the_emulator_imitates_its_figure_and_reads_no_gpu() -> None:
    job = parse_job({**JOB, "target": {**JOB["target"], "emulator": {"memory_in_use_gib": 4}}})

    def no_read() -> list[DeviceInfo]:
        raise AssertionError("the emulator's memory in use is the job's, not the machine's")

    assert in_use_gib(job, Placement(FakeLauncher()), VllmFlags(), no_read) == 4.0


class Box:
    """One GPU whose memory in use each reading takes from `levels` in turn (the last one stays)."""

    def __init__(self, *levels_gib: float) -> None:
        self.levels = [int(g * GIB) for g in levels_gib]
        self.reads = 0

    def probe(self) -> list[int]:
        self.reads += 1
        return [self.levels.pop(0) if len(self.levels) > 1 else self.levels[0]]

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(0, "NVIDIA L4", 23 * GIB, self.levels[0])]


def test_the_server_before_is_waited_out_not_counted_as_another_process() -> None:
    # Idle at 0.5 GiB; the trial before's server still holds 20 GiB for two readings while the driver lets go.
    box = Box(0.5, 20.5, 20.5, 0.5)
    waiter = GpuIdleWaiter(probe=box.probe, poll_s=0.0)
    launcher = FakeLauncher()
    launcher.gpu_idle = waiter  # type: ignore[attr-defined]
    asyncio.run(waiter.wait())  # the first start saw the GPU idle
    assert in_use_gib(process_job(), Placement(launcher), VllmFlags(), box.devices) == pytest.approx(0.5)
    assert box.reads == 4
