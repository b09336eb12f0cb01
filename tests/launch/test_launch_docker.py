"""What only the Docker launcher does: images that are not there, GPUs the engine cannot give."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from launch_contract import MODEL, containers_of, emulator_image_ref, new_marker

from tuner.errors import EngineGone, LaunchError
from tuner.flags import VllmFlags
from tuner.launch import DockerLauncher
from tuner.launch.docker import ROCM_IMAGE, _device_requests, gpu_create_kwargs, gpu_environment

__all__ = ["emulator_image_ref"]  # a fixture, used by name


def test_gpu_requests() -> None:
    (everything,) = _device_requests("all")
    assert everything["Count"] == -1 and everything["Capabilities"] == [["gpu"]]
    (some,) = _device_requests(["0", "2"])
    assert some["DeviceIDs"] == ["0", "2"]
    assert _device_requests(None) == [] and _device_requests("none") == []


def test_amd_gpus_are_devices_not_device_requests() -> None:
    amd = gpu_create_kwargs("all", "amd")
    assert amd["devices"] == ["/dev/kfd:/dev/kfd:rwm", "/dev/dri:/dev/dri:rwm"]
    assert amd["group_add"] == ["video"] and amd["security_opt"] == ["seccomp=unconfined"]
    assert "device_requests" not in amd
    assert gpu_environment(["0", "3"], "amd") == {"HIP_VISIBLE_DEVICES": "0,3"}
    assert gpu_environment("all", "amd") == {} and gpu_environment(["0"], "nvidia") == {}
    assert gpu_create_kwargs(None, "amd") == {}
    assert list(gpu_create_kwargs("all")) == ["device_requests"]
    launcher = DockerLauncher(model=MODEL, vendor="amd", client=object())
    assert launcher.image == ROCM_IMAGE
    assert DockerLauncher("my/rocm:1", MODEL, vendor="amd", client=object()).image == "my/rocm:1"


@pytest.mark.docker
async def test_absent_image_without_pulling_is_image_missing(docker_client: Any) -> None:
    launcher = DockerLauncher("tuner-test/not-here:0", MODEL, client=docker_client, pull=False, gpus=None)
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(VllmFlags()):
            pytest.fail("started")
    assert raised.value.reason == "image_missing"
    assert "tuner-test/not-here:0" in str(raised.value) and "pulling is off" in str(raised.value)


@pytest.mark.docker
async def test_absent_image_that_cannot_be_pulled_is_image_missing(docker_client: Any) -> None:
    launcher = DockerLauncher("tuner-test/not-here:0", MODEL, client=docker_client, pull_stall_s=20, gpus=None)
    started = time.monotonic()
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(VllmFlags()):
            pytest.fail("started")
    assert raised.value.reason == "image_missing"
    assert "cannot be pulled" in str(raised.value) or "no progress" in str(raised.value)
    assert time.monotonic() - started < 300  # given up after the stall, not waited on for ever


@pytest.mark.docker
async def test_gpus_without_the_nvidia_runtime_is_a_clear_error(
    docker_client: Any, emulator_image_ref: str, tmp_path: Path
) -> None:
    if "nvidia" in (docker_client.info().get("Runtimes") or {}):
        pytest.skip("this engine has the NVIDIA runtime: a GPU request would be granted")
    study = f"gpu-{new_marker()}"
    launcher = DockerLauncher.for_emulator(emulator_image_ref, client=docker_client, gpus="all", time_scale=100)
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(VllmFlags(max_model_len=8192), study=study):
            pytest.fail("started")
    assert "cannot give the container GPUs" in str(raised.value)
    assert "`tuner launch --gpus none`" in str(raised.value)
    assert raised.value.reason == "cannot_launch"
    assert containers_of(docker_client, study) == []


class _GoneEngine:
    """A Docker client whose engine went away: every call is refused, as requests refuses a dead socket."""

    def __init__(self) -> None:
        self.containers = self
        self.images = self

    def _refused(self, *args: Any, **kwargs: Any) -> Any:
        import requests

        raise requests.exceptions.ConnectionError("('Connection aborted.', ConnectionRefusedError(111))")

    ping = list = get = create = _refused


async def test_an_engine_that_stopped_answering_is_engine_gone_not_a_failed_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/no-engine.sock")
    launcher = DockerLauncher(MODEL, client=_GoneEngine(), gpus=None)
    with pytest.raises(EngineGone) as e:
        launcher.cleanup_leftovers("study")
    assert str(e.value).startswith("the Docker engine at unix:///tmp/no-engine.sock stopped answering (")
    assert e.value.reason == "engine_gone" and not e.value.answers()
    for study in ("study", None):  # the leftovers' sweep or the image's check: either meets the engine first
        with pytest.raises(EngineGone):
            async with launcher.start(VllmFlags(), study=study):
                pass
