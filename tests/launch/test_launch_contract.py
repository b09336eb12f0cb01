"""One contract, three launchers (the emulator, a generic process, a Docker container of the emulator image):
each start-up outcome is produced for real by emulator flags, and nothing outlives the `async with`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from launch_contract import (
    KINDS,
    MODEL,
    SCALE,
    assert_nothing_left,
    containers_of,
    emulator_image_ref,
    make_launcher,
    new_marker,
    processes_with,
)

from tuner.capacity import GIB, StartupPlan, plan_startup
from tuner.catalog import get_gpu, load_model
from tuner.emulator.server import VLLM_VERSION as EMULATED_VLLM
from tuner.errors import LaunchError
from tuner.flags import VllmFlags, resolve
from tuner.launch import Launcher

__all__ = ["emulator_image_ref"]  # a fixture, used by name

SECRET_NAME = "TUNER_TEST_LAUNCH_SECRET"
SECRET = "hf_s3cr3t-launch-value-0123456789"
GOOD = VllmFlags(max_model_len=8192)


@dataclass
class Case:
    kind: str
    study: str
    marker: str
    state_dir: Path
    docker_client: Any
    image: str | None

    def launcher(self, **kwargs: Any) -> Launcher:
        return make_launcher(
            self.kind,
            marker=self.marker,
            state_dir=self.state_dir,
            docker_client=self.docker_client,
            image=self.image,
            **kwargs,
        )

    def assert_nothing_left(self) -> None:
        assert_nothing_left(self.marker, study=self.study, docker_client=self.docker_client)


@pytest.fixture(params=[pytest.param(k, marks=[pytest.mark.docker] if k == "docker" else []) for k in KINDS])
def case(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Case]:
    client = image = None
    if request.param == "docker":
        client = request.getfixturevalue("docker_client")
        image = request.getfixturevalue("emulator_image_ref")
    c = Case(request.param, f"contract-{new_marker()}", new_marker(), tmp_path / "state", client, image)
    yield c
    # A failing test must not leak servers into the next one.
    for pid in processes_with(c.marker):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if client is not None:
        for container in containers_of(client, c.study):
            container.remove(force=True)


def expected_plan(gpu: str, flags: VllmFlags, memory_in_use_gib: float = 0.0) -> StartupPlan:
    model, profile = load_model(MODEL), get_gpu(gpu)
    return plan_startup(model, profile, resolve(flags, profile, model), memory_in_use_gib)


async def test_good_start_reports_the_servers_capacity(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SECRET_NAME, SECRET)
    launcher = case.launcher(secret_env=(SECRET_NAME,))
    plan = expected_plan("h100-80gb", GOOD)
    async with launcher.start(GOOD, study=case.study, trial=7) as server:
        assert server.exit_code is None and server.failure() is None
        assert server.model == MODEL and server.time_scale == SCALE
        assert server.base_url.startswith("http://127.0.0.1:")
        facts = server.facts
        assert facts.kv_tokens == plan.kv_tokens
        assert facts.max_concurrency == pytest.approx(plan.max_concurrency, abs=0.01)
        assert facts.max_model_len == 8192
        assert facts.available_kv_gib == pytest.approx(plan.available_kv_bytes / GIB, abs=0.01)
        assert facts.weights_gib is not None and facts.weights_gib > 14
        assert facts.startup_seconds is not None and facts.startup_seconds > 0
        assert facts.vllm_version == EMULATED_VLLM  # its GET /version
        async with httpx.AsyncClient(base_url=server.base_url, trust_env=False) as client:
            models = (await client.get("/v1/models")).json()
        assert models["data"][0]["id"] == MODEL
        # This run is alive: its server is not a leftover, even for a cleanup of the same study.
        assert launcher.cleanup_leftovers(case.study) == []
        assert server.exit_code is None
        if case.docker_client is not None:
            (container,) = containers_of(case.docker_client, case.study)
            assert container.labels["tuner.trial"] == "7"
            assert container.attrs["HostConfig"]["IpcMode"] == "host"
            mounts = {m["Destination"]: m["Source"] for m in container.attrs["Mounts"]}
            assert mounts["/root/.cache/huggingface"] == str(case.state_dir / "hf-cache")
            assert f"{SECRET_NAME}={SECRET}" in container.attrs["Config"]["Env"]  # passed by name, for real
        for text in (server.logs(), repr(server), facts.model_dump_json()):
            assert SECRET not in text
        assert "GPU KV cache size" in server.logs()
    case.assert_nothing_left()
    assert server.exit_code is not None
    assert server.failure() is None  # we stopped it: not a crash


async def test_crash_under_load_is_reported_by_failure(case: Case) -> None:
    launcher = case.launcher(extra_args=("--fault-crash-after-requests", "2"))
    async with launcher.start(GOOD, study=case.study) as server:
        body = {"model": server.model, "prompt": "Hello", "max_tokens": 4}
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10, trust_env=False) as client:
            assert (await client.post("/v1/completions", json=body)).status_code == 200
            assert server.failure() is None
            with contextlib.suppress(httpx.HTTPError):  # the server may die while answering
                await client.post("/v1/completions", json=body)
        deadline = time.monotonic() + 120  # not forever
        while server.exit_code is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failure = server.failure()
        assert failure is not None, "the server did not die after its second request"
        assert failure.reason == "crashed_under_load"
        assert "after it was ready" in str(failure)
        assert "CUDA" in str(failure)
    case.assert_nothing_left()


# (gpu, memory held by others in GiB, flags, vLLM's reason). Started side by side: on Docker with vfs storage
# each container's creation copies the image, and three in parallel take about as long as one.
REFUSALS = [
    ("rtx4090", 0.0, VllmFlags(max_model_len=131072), "kv_cache_too_small"),
    ("h100-80gb", 20.0, VllmFlags(gpu_memory_utilization=0.9), "insufficient_free_memory"),
    ("h100-80gb", 0.0, VllmFlags(max_num_seqs=512, max_num_batched_tokens=256), "invalid_flags"),
]


async def test_refused_starts_give_vllms_reasons(case: Case) -> None:
    async def attempt(gpu: str, memory_in_use_gib: float, flags: VllmFlags) -> LaunchError:
        launcher = case.launcher(gpu=gpu, memory_in_use_gib=memory_in_use_gib)
        with pytest.raises(LaunchError) as raised:
            async with launcher.start(flags, study=case.study):
                pytest.fail(f"the server started with {flags} on {gpu}")
        return raised.value

    errors = await asyncio.gather(*(attempt(gpu, mem, flags) for gpu, mem, flags, _ in REFUSALS))
    for (gpu, mem, flags, reason), error in zip(REFUSALS, errors, strict=True):
        plan = expected_plan(gpu, flags, mem)
        assert plan.reason == reason and plan.message is not None
        assert error.reason == reason
        assert plan.message in str(error)
        assert error.estimated_max_model_len == plan.estimated_max_model_len
        assert plan.message[:60] in error.log_tail
    assert errors[0].estimated_max_model_len  # kv_cache_too_small carries vLLM's estimate
    case.assert_nothing_left()


async def test_hung_start_is_killed_at_the_timeout(case: Case) -> None:
    launcher = case.launcher(extra_args=("--fault-hang-on-start",), startup_timeout_s=1.5)
    started = time.monotonic()
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(GOOD, study=case.study):
            pytest.fail("the server started")
    assert raised.value.reason == "start_timeout"
    assert "within 1.5 s" in str(raised.value)
    assert time.monotonic() - started < 300  # killed at the timeout, not waited on (the fault hangs for ever)
    case.assert_nothing_left()


async def test_stop_during_start_leaves_nothing(case: Case) -> None:
    launcher = case.launcher(extra_args=("--fault-hang-on-start",))

    async def start() -> None:
        async with launcher.start(GOOD, study=case.study):
            pytest.fail("the server started")

    task = asyncio.create_task(start())
    deadline = time.monotonic() + 300  # not forever: a container's first start copies its image on vfs
    while not processes_with(case.marker) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert processes_with(case.marker), "the server never started"
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    case.assert_nothing_left()


@pytest.mark.parametrize("kind", ["emulator", "process"])
async def test_unparsable_flag_is_invalid_flags(kind: str, tmp_path: Path) -> None:
    marker = new_marker()
    launcher = make_launcher(kind, marker=marker, state_dir=tmp_path, extra_args=("--max-num-seqs", "lots"))
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(GOOD):
            pytest.fail("the server started")
    assert raised.value.reason == "invalid_flags"
    assert "--max-num-seqs" in str(raised.value) and "lots" in str(raised.value)
    assert_nothing_left(marker, study="")
