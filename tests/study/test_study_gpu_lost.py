"""A GPU lost under the study (an Xid error, a driver reset: NVML then fails to read it, as `nvidia-smi` does): the
worker that owns it stops with one line naming the GPU, the trial is kept as interrupted (not its flags' crash, not
told to the sampler as infeasible) and runs again in the next run. Through the NVML seam (`nvml_probe(nvml=...)`)
with a stand-in library; no GPU is needed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState
from study_fakes import JOB, FakeLauncher, fake_measure, job

from tuner.cli.trial_lines import TextLog
from tuner.errors import GpuLost, LaunchError, TunerError
from tuner.flags import VllmFlags
from tuner.launch.gpu_idle import GpuIdleWaiter, nvml_probe
from tuner.study import TuningRun

GIB = 1024**3


class GpuIsLost(Exception):
    """pynvml's NVMLError_GpuIsLost, as it prints."""

    def __str__(self) -> str:
        return "GPU is lost"


class FakeNvml:
    """Two L4s; `lose(i)` makes GPU i fail every reading as NVML does after an Xid 79, `back()` heals them."""

    def __init__(self) -> None:
        self.lost: set[int] = set()
        self.inits = 0

    def lose(self, i: int) -> None:
        self.lost.add(i)

    def back(self) -> None:
        self.lost.clear()

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        if i in self.lost:
            raise GpuIsLost()
        return i

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        return b"NVIDIA L4"

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
        return type("Memory", (), {"used": GIB, "total": 23 * GIB})()


def test_a_gpu_read_once_and_lost_later_is_gpu_lost_naming_it() -> None:
    nvml = FakeNvml()
    probe = nvml_probe(nvml=nvml)
    assert probe() == [GIB, GIB]
    nvml.lose(1)
    with pytest.raises(GpuLost) as lost:
        probe()
    assert str(lost.value) == "NVML no longer reads GPU 1 (NVIDIA L4): GPU is lost"
    assert lost.value.engine == "GPU 1 (NVIDIA L4)" and lost.value.reason == "gpu_lost"
    assert not lost.value.answers()
    nvml.back()
    assert lost.value.answers() and probe() == [GIB, GIB]


def test_a_gpu_nvml_counts_but_cannot_read_at_the_first_look_is_lost_already() -> None:
    nvml = FakeNvml()
    nvml.lose(0)
    with pytest.raises(GpuLost) as lost:
        nvml_probe(nvml=nvml)()
    assert str(lost.value) == "NVML no longer reads GPU 0 (its name unread): GPU is lost"


def test_a_gpu_whose_memory_nvml_cannot_read_from_the_start_is_not_lost_but_unread() -> None:
    class NotSupported(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, handle: int) -> Any:
            raise RuntimeError("Not Supported")  # pynvml's NVMLError_NotSupported, as it prints

    probe = nvml_probe(nvml=NotSupported())
    assert probe() is None and probe() is None  # nothing to wait for, as before: not a reason to stop


def test_a_machine_where_nvml_never_read_a_gpu_has_nothing_to_lose() -> None:
    class NoDriver(FakeNvml):
        def nvmlInit(self) -> None:
            raise GpuIsLost()  # any NVMLError: no driver here

    probe = nvml_probe(nvml=NoDriver())
    assert probe() is None and probe() is None
    GpuIdleWaiter(probe).check()  # says nothing


def tune(url: str, launcher: FakeLauncher) -> TuningRun:
    tuning = TuningRun(job(), launcher, storage_url=url, measure=fake_measure(), poll_s=0.01)
    try:
        tuning.run()
    finally:
        tuning.close()
    return tuning


# What the start meets on a GPU just lost: vLLM's CUDA error, or Docker's GPU hook failing (a fatal reason whose
# advice, install the NVIDIA container toolkit, would not follow from it).
STARTS_ON_A_LOST_GPU = [
    LaunchError("the server exited with code 1 before it was ready; CUDA error: unknown error"),
    LaunchError(
        "Docker cannot give the container GPUs: nvidia-container-cli: detection error: GPU is lost", "cannot_launch"
    ),
]


@pytest.mark.parametrize("failed_start", STARTS_ON_A_LOST_GPU, ids=["cuda-error", "docker-gpu-hook"])
def test_a_gpu_lost_under_a_trial_stops_the_worker_and_the_trial_runs_again_next_run(
    tmp_path: Path, failed_start: LaunchError
) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    nvml = FakeNvml()
    starts = {"n": 0}

    def xid_at_trial_1(flags: VllmFlags, attempt: int) -> LaunchError | None:
        waiter.check()  # as a real launcher's start reads its GPUs (their idle memory) first
        starts["n"] += 1
        if starts["n"] == 2:  # the GPU falls off the bus: the server's start fails as vLLM's would
            nvml.lose(1)
            return failed_start
        return None

    waiter = GpuIdleWaiter(nvml_probe(nvml=nvml), poll_s=0.0)
    launcher = FakeLauncher(fail=xid_at_trial_1)
    launcher.gpu_idle = waiter  # type: ignore[attr-defined]
    with pytest.raises(TunerError) as stopped:
        tune(url, launcher)
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith("NVML no longer reads GPU 1 (NVIDIA L4): GPU is lost: this worker stops")
    assert "trial 1 is kept as interrupted" in line and "same command" in line
    assert starts["n"] == 2  # not retried on the lost GPU, nor another trial started
    # The terminal gets the one line; `--log-file` the details behind it, NVML's own error among them.
    log = TextLog(tmp_path / "tune.log")
    log.details(stopped.value)
    log.close()
    details = (tmp_path / "tune.log").read_text()
    assert "Traceback" in details and "GpuIsLost: GPU is lost" in details and "tuner.errors.GpuLost" in details
    trials = optuna.load_study(study_name="fake", storage=url).get_trials(deepcopy=False)
    lost = trials[1]
    assert lost.state == TrialState.FAIL and lost.user_attrs["outcome"] == "interrupted"
    assert lost.user_attrs["reason"] == "gpu_lost" and "GPU 1 (NVIDIA L4)" in lost.user_attrs["message"]
    assert not any(k.startswith("constraints") for k in lost.system_attrs)  # nothing told to a sampler

    nvml.back()  # the machine was reset: the same command runs trial 1's flags again and reaches the budget
    later = FakeLauncher()
    later.gpu_idle = GpuIdleWaiter(nvml_probe(nvml=nvml), poll_s=0.0)  # type: ignore[attr-defined]
    study = tune(url, later).study
    trials = study.get_trials(deepcopy=False)
    again = [t for t in trials if t.system_attrs.get("failed_trial") == 1]
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE and again[0].params == lost.params
    done = [t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get("duplicate_of") is None]
    assert len(done) == JOB["budget"]["n_trials"]
    assert not {t.user_attrs.get("outcome") for t in trials} & {"crashed", "launch_failed"}


def test_a_crash_on_a_gpu_that_still_answers_is_the_flags_verdict_as_before(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'study.db'}"
    nvml = FakeNvml()

    starts = {"n": 0}

    def oom(flags: VllmFlags, attempt: int) -> LaunchError | None:
        starts["n"] += 1
        return LaunchError("CUDA out of memory", "cuda_oom") if starts["n"] == 2 else None

    launcher = FakeLauncher(fail=oom)
    launcher.gpu_idle = GpuIdleWaiter(nvml_probe(nvml=nvml), poll_s=0.0)  # type: ignore[attr-defined]
    trials = tune(url, launcher).study.get_trials(deepcopy=False)
    assert trials[1].state == TrialState.COMPLETE and trials[1].user_attrs["outcome"] == "launch_failed"
    assert trials[1].user_attrs["reason"] == "cuda_oom"
    assert not any(t.user_attrs.get("reason") == "gpu_lost" for t in trials)
