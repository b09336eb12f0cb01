"""What the launcher contract tests share: one factory for the three launchers around the emulator, and the
checks that nothing was left behind.

Every launch carries a unique marker (MARKER_FLAG's value: a vLLM option the emulator accepts and does not model,
with a warning; one vLLM lacks it refuses, as vLLM does), so a leftover server can be found among the host's
processes whatever launched it, containers included.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tuner.launch import DockerLauncher, EmulatorLauncher, Launcher, ProcessLauncher
from tuner.launch.emulator import emulator_args

KINDS = ("emulator", "process", "docker")
SCALE = 100.0  # the emulator's start-up (about 25 emulated seconds) takes a quarter of a second
MODEL = "llama-3.1-8b"
REPO = Path(__file__).resolve().parents[2]


def missing_service(what: str, why: str) -> None:
    """As tests/conftest.py: skip with the reason, or fail where CI requires the service."""
    message = f"{what} is not available: {why}"
    if os.environ.get("TUNER_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{message} (TUNER_REQUIRE_SERVICES=1 requires it)", pytrace=False)
    pytest.skip(message)


MARKER_FLAG = "--code-revision"


def new_marker() -> str:
    return f"m{uuid.uuid4().hex[:12]}"


def make_launcher(
    kind: str,
    *,
    marker: str,
    state_dir: Path,
    docker_client: Any = None,
    image: str | None = None,
    gpu: str = "h100-80gb",
    memory_in_use_gib: float = 0.0,
    extra_args: tuple[str, ...] = (),
    startup_timeout_s: float = 60.0,
    secret_env: tuple[str, ...] = (),
) -> Launcher:
    extra = (MARKER_FLAG, marker, *extra_args)
    if kind == "emulator":
        return EmulatorLauncher(
            MODEL,
            gpu,
            SCALE,
            memory_in_use_gib,
            extra,
            startup_timeout_s=startup_timeout_s,
            secret_env=secret_env,
            state_dir=state_dir,
        )
    if kind == "process":
        # The generic path: `--model`, `--host`, `--port` appended by the launcher, not templated.
        return ProcessLauncher(
            [sys.executable, "-m", "tuner.emulator", *emulator_args(gpu, SCALE, memory_in_use_gib)],
            MODEL,
            extra_args=extra,
            secret_env=secret_env,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=5.0,
            time_scale=SCALE,
            state_dir=state_dir,
        )
    assert kind == "docker" and image is not None
    return DockerLauncher.for_emulator(
        image,
        MODEL,
        gpu,
        SCALE,
        memory_in_use_gib,
        extra,
        env=secret_env,
        client=docker_client,
        startup_timeout_s=startup_timeout_s,
        hf_cache=state_dir / "hf-cache",
    )


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) processes on this host whose command line has the marker (containers' included)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker.encode() in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def containers_of(docker_client: Any, study: str) -> list[Any]:
    return list(docker_client.containers.list(all=True, filters={"label": f"tuner.study={study}"}))


def assert_nothing_left(marker: str, *, study: str, docker_client: Any = None, timeout_s: float = 30.0) -> None:
    """No process of `marker` (nor container of `study`): a SIGKILLed one may take a moment to exit, not forever."""
    deadline = time.monotonic() + timeout_s
    while processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_with(marker) == [], "a server process outlived its launcher"
    if docker_client is not None:
        assert containers_of(docker_client, study) == [], "a container outlived its launcher"


@functools.cache
def _build_image() -> tuple[str | None, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        [str(REPO / "scripts" / "build-emulator-image")], capture_output=True, text=True, env=env, timeout=900
    )
    if done.returncode != 0 or not done.stdout.strip():
        return None, done.stderr[-500:]
    return done.stdout.strip().splitlines()[-1], ""


def emulator_image(docker_client: Any) -> str:
    """The image scripts/test built (TUNER_TEST_EMULATOR_IMAGE), or built now (once a session; instant when the
    sources did not change since the last build)."""
    image = os.environ.get("TUNER_TEST_EMULATOR_IMAGE")
    if not image:
        image, why = _build_image()
        if image is None:
            missing_service("the emulator image", f"scripts/build-emulator-image failed: {why}")
    assert image is not None
    try:
        docker_client.images.get(image)
    except Exception as e:
        missing_service("the emulator image", f"{image}: {e}")
    return image


@pytest.fixture(scope="session")
def emulator_image_ref(docker_client: Any) -> str:
    return emulator_image(docker_client)
