"""A tuner killed (SIGKILL) while its server runs leaves the server behind; the next run's cleanup removes it,
and only it: not another study's, not a live run's."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from launch_contract import (
    KINDS,
    REPO,
    assert_nothing_left,
    containers_of,
    emulator_image_ref,
    make_launcher,
    new_marker,
    processes_with,
)

from tuner.flags import VllmFlags

__all__ = ["emulator_image_ref"]  # a fixture, used by name

# The "tuner": starts one server through the launcher and waits; the test kills it with SIGKILL.
TUNER = """
import asyncio, sys
sys.path[:0] = [sys.argv[6], sys.argv[7]]
from pathlib import Path
from launch_contract import make_launcher
from tuner.flags import VllmFlags

kind, marker, state_dir, study, image = sys.argv[1:6]
client = None
if kind == "docker":
    import docker
    client = docker.from_env()

async def main():
    launcher = make_launcher(kind, marker=marker, state_dir=Path(state_dir), docker_client=client, image=image)
    async with launcher.start(VllmFlags(max_model_len=8192), study=study, trial=3) as server:
        print("READY", server.base_url, flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.fixture(params=[pytest.param(k, marks=[pytest.mark.docker] if k == "docker" else []) for k in KINDS])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_killed_tuners_server_is_removed_by_the_next_run(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    client: Any = request.getfixturevalue("docker_client") if kind == "docker" else None
    image = request.getfixturevalue("emulator_image_ref") if kind == "docker" else ""
    marker, study, state_dir = new_marker(), f"leftover-{new_marker()}", tmp_path / "state"
    tuner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        TUNER,
        kind,
        marker,
        str(state_dir),
        study,
        image,
        str(REPO),
        str(Path(__file__).parent),
        stdout=asyncio.subprocess.PIPE,
    )
    assert tuner.stdout is not None
    try:
        line = (await asyncio.wait_for(tuner.stdout.readline(), 300)).decode()  # not forever
    finally:
        tuner.kill()
        await tuner.wait()
    assert line.startswith("READY "), f"the tuner did not start its server: {line!r}"
    base_url = line.split()[1]

    async with httpx.AsyncClient(base_url=base_url, trust_env=False) as http:
        assert (await http.get("/health")).status_code == 200, "the server should outlive its killed tuner"
    next_marker = new_marker()
    launcher = make_launcher(kind, marker=next_marker, state_dir=state_dir, docker_client=client, image=image)
    assert launcher.cleanup_leftovers(f"other-{study}") == []  # another study's cleanup leaves it alone
    assert processes_with(marker)

    # The next run of the study: its first start removes the leftover, saying so.
    with caplog.at_level(logging.WARNING, logger="tuner.launch"):
        async with launcher.start(VllmFlags(max_model_len=8192), study=study, trial=4) as server:
            assert_nothing_left(marker, study="-", docker_client=None)
            assert server.exit_code is None
            if client is not None:
                (container,) = containers_of(client, study)
                assert container.labels["tuner.trial"] == "4"
    said = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
    assert len(said) == 1, said
    assert study in said[0] and "trial 3" in said[0]
    assert_nothing_left(next_marker, study=study, docker_client=client)
    assert launcher.cleanup_leftovers(study) == []
    if kind != "docker":
        assert list(state_dir.glob("*.json")) == [] and list((state_dir / "logs").iterdir()) == []
