"""The real Docker engine made unreachable under a trial of the Docker launcher (a proxy of its socket cut, the
shared dockerd left running): the trial is recorded as interrupted and run again once the engine answers."""

from __future__ import annotations

import os
import secrets
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_proxy import EngineProxy
from optuna.trial import FrozenTrial, TrialState
from study_fakes import JOB, fake_measure, job

from tuner.config import Job
from tuner.flags import VllmFlags
from tuner.launch import DockerLauncher
from tuner.study import TuningRun
from tuner.study.measure import Measurement

pytestmark = pytest.mark.docker


@pytest.fixture
def proxy(monkeypatch: pytest.MonkeyPatch) -> Iterator[EngineProxy]:
    # A short path: a unix socket's name is at most 107 bytes, and pytest's tmp_path can be longer.
    directory = Path(tempfile.mkdtemp(prefix="engine-", dir="/tmp"))
    p = EngineProxy(directory / "docker.sock")
    monkeypatch.setenv("DOCKER_HOST", p.url)
    yield p
    p.close()
    (directory / "docker.sock").unlink(missing_ok=True)
    directory.rmdir()


@pytest.fixture
def image(docker_client: Any) -> str:
    name = os.environ.get("TUNER_TEST_EMULATOR_IMAGE")
    if not name:
        pytest.skip("TUNER_TEST_EMULATOR_IMAGE is not set (source /tmp/services.env, or scripts/test builds it)")
    return name


def test_a_trial_whose_engine_went_away_runs_again_once_it_answers(
    proxy: EngineProxy, image: str, docker_client: Any
) -> None:
    study_name = f"engine-gone-{secrets.token_hex(3)}"
    j = job(study={**JOB["study"], "name": study_name}, budget={"n_trials": 2})
    measured = fake_measure()
    cut: list[int] = []

    async def measure(server: Any, job_: Job, flags: VllmFlags) -> Measurement:
        if not cut and flags.as_dict() != j.search_space().baseline().as_dict():
            # Under trial 1's load the engine goes away: its calls are refused until a few pings have failed.
            proxy.cut(refuse=8)
            cut.append(1)
        return await measured(server, job_, flags)

    trials, events = _tune_on_docker(j, image, measure)
    assert cut, "the engine was never cut: no trial but the baseline ran"
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["reason"] == "engine_gone", events
    assert proxy.url in failed[0].user_attrs["message"]
    again = [t for t in trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE and again[0].params == failed[0].params
    assert again[0].user_attrs["outcome"] == "measured"
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2
    assert sum("waiting up to" in e for e in events) == 1 and sum("answers again" in e for e in events) == 1
    # The container the engine kept while it was away was removed once it answered.
    assert docker_client.containers.list(all=True, filters={"label": f"tuner.study={study_name}"}) == []


def test_a_container_killed_by_an_engine_restart_done_before_we_look_runs_again(
    proxy: EngineProxy, image: str, docker_client: Any
) -> None:
    """Under trial 1's load every connection to the engine drops (the proxy cut, as a restart cuts them), the engine
    answers again at once, and the trial's container is dead when it is looked at (killed, as a restart kills it):
    nothing fails when the launcher asks, yet the trial is the engine's, not its flags' crash."""
    study_name = f"engine-restart-{secrets.token_hex(3)}"
    j = job(study={**JOB["study"], "name": study_name}, budget={"n_trials": 2})
    measured = fake_measure()
    killed: list[str] = []

    async def measure(server: Any, job_: Job, flags: VllmFlags) -> Measurement:
        if not killed and flags.as_dict() != j.search_space().baseline().as_dict():
            before = proxy.accepted
            proxy.cut(refuse=0)
            deadline = time.monotonic() + 60  # a bound on a broken test, not a timing assertion
            while proxy.accepted == before and time.monotonic() < deadline:
                time.sleep(0.05)  # until the launcher's long-lived connection is open again: the engine answers
            (container,) = docker_client.containers.list(filters={"label": f"tuner.study={study_name}"})
            container.kill()
            container.wait()
            killed.append(container.name)
        return await measured(server, job_, flags)

    trials, events = _tune_on_docker(j, image, measure)
    assert killed, "no trial but the baseline ran"
    failed = [t for t in trials if t.state == TrialState.FAIL]
    assert len(failed) == 1 and failed[0].user_attrs["reason"] == "engine_gone", events
    assert "restarted while the trial's container ran" in failed[0].user_attrs["message"]
    assert "exited with code 137" in failed[0].user_attrs["message"]
    again = [t for t in trials if t.system_attrs.get("failed_trial") == failed[0].number]
    assert len(again) == 1 and again[0].state == TrialState.COMPLETE and again[0].user_attrs["outcome"] == "measured"
    assert not {t.user_attrs.get("outcome") for t in trials} & {"crashed", "launch_failed"}
    assert sum("answers again" in e for e in events) == 1
    assert docker_client.containers.list(all=True, filters={"label": f"tuner.study={study_name}"}) == []


def _tune_on_docker(j: Job, image: str, measure: Any) -> tuple[list[FrozenTrial], list[str]]:
    """The study run whole on the emulator image through the Docker launcher (its engine behind the test's proxy):
    its trials and the events it said."""
    launcher = DockerLauncher.for_emulator(image, "llama-3.1-8b", "l4", time_scale=50)
    events: list[str] = []
    tuning = TuningRun(j, launcher, storage_url="sqlite://", measure=measure, poll_s=0.05, on_event=events.append)
    try:
        tuning.run()
        return tuning.study.get_trials(deepcopy=False), events
    finally:
        tuning.close()
        launcher.close()
