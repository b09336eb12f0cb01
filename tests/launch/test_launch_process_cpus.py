"""The process launcher puts a `gpu: cpu` server's processes on the plan's cores, and the load client keeps to its
own: against a stand-in for vLLM's CPU build (an API server that starts an engine core that starts a worker whose
"OpenMP" thread binds itself to VLLM_CPU_OMP_THREADS_BIND), read back from /proc as the real-vLLM test reads it."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner.flags import VllmFlags
from tuner.launch.affinity import CpuPlan, parse_cpu_list, plan_cpus
from tuner.launch.pinning import keep_to, usable_cpus
from tuner.launch.process import ProcessLauncher

# No braces: the launcher formats the command. The worker binds one thread (as vLLM's OpenMP threads bind
# themselves) and keeps an unbound one (as its other threads are); /health answers once it has bound, as vLLM's
# does after the model is loaded and warmed up.
FAKE_VLLM = """
import http.server, os, subprocess, sys, threading, time
role, ready = sys.argv[1], os.environ["FAKE_VLLM_READY"]
def sleeper():
    threading.Thread(target=time.sleep, args=(600,), daemon=True).start()
if role == "worker":
    sleeper()
    given = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    def omp():
        if given and not os.environ.get("FAKE_VLLM_IGNORE_BIND"):
            cores = set()
            for part in given.split(","):
                low, _, high = part.partition("-")
                cores.update(range(int(low), int(high or low) + 1))
            os.sched_setaffinity(0, cores)
        open(ready, "w").close()
        time.sleep(600)
    threading.Thread(target=omp, daemon=True).start()
    time.sleep(600)
elif role == "engine":
    subprocess.Popen([sys.executable, __file__, "worker"])
    sleeper()
    time.sleep(600)
else:
    subprocess.Popen([sys.executable, __file__, "engine"])
    sleeper()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" and os.path.exists(ready) else 503)
            self.send_header("Content-Length", "0")
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
"""


def cpus_allowed(pid: int) -> dict[int, frozenset[int]]:
    """Each thread of `pid` and its Cpus_allowed_list, as /proc says."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                out[int(task.name)] = parse_cpu_list(line.split(":", 1)[1].strip())
    return out


def fake_roles(script: Path) -> dict[str, int]:
    """The stand-in's processes by role (their command line names it)."""
    roles = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if str(script) in argv:
            roles[argv[argv.index(str(script)) + 1]] = int(entry.name)
    return roles


@pytest.fixture
def two_cores() -> Iterator[CpuPlan]:
    usable = usable_cpus()
    if len(usable) < 2 or not Path("/proc/self/task").is_dir():
        pytest.skip(f"needs Linux and two usable cores to split (this process may use {sorted(usable)})")
    yield plan_cpus(usable)


def fake_launcher(tmp_path: Path, plan: CpuPlan, monkeypatch: pytest.MonkeyPatch) -> tuple[ProcessLauncher, Path]:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    monkeypatch.setenv("FAKE_VLLM_READY", str(tmp_path / "bound"))
    launcher = ProcessLauncher(
        [sys.executable, str(script), "api", "{port}"],
        "tiny",
        state_dir=tmp_path / "state",
        stop_grace_s=2.0,
        startup_timeout_s=120.0,
        cpu_plan=plan,
    )
    return launcher, script


async def test_the_worker_runs_on_its_cores_and_the_rest_on_the_others(
    tmp_path: Path, two_cores: CpuPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = two_cores
    launcher, script = fake_launcher(tmp_path, plan, monkeypatch)
    async with launcher.start(VllmFlags()) as server:
        assert server.cpu_plan == plan
        roles = fake_roles(script)
        assert set(roles) == {"api", "engine", "worker"}
        for role in ("api", "engine"):
            assert set(cpus_allowed(roles[role]).values()) == {plan.others}, role
        worker = cpus_allowed(roles["worker"])
        assert len(worker) >= 3 and set(worker.values()) == {plan.worker}  # the bound thread and the rest


async def test_a_server_that_ignores_the_binding_is_left_where_it_was(
    tmp_path: Path, two_cores: CpuPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    launcher, script = fake_launcher(tmp_path, two_cores, monkeypatch)
    monkeypatch.setenv("FAKE_VLLM_IGNORE_BIND", "1")
    async with launcher.start(VllmFlags()) as server:
        assert server.cpu_plan is None  # so the load client is not narrowed either
        for pid in fake_roles(script).values():
            assert set(cpus_allowed(pid).values()) == {usable_cpus()}


async def test_nothing_is_moved_where_the_plan_binds_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    launcher, script = fake_launcher(tmp_path, plan_cpus({0}), monkeypatch)
    async with launcher.start(VllmFlags()) as server:
        assert server.cpu_plan is None
        assert "VLLM_CPU_OMP_THREADS_BIND" not in launcher._environment()
        for pid in fake_roles(script).values():
            assert set(cpus_allowed(pid).values()) == {usable_cpus()}


def test_the_load_client_keeps_to_its_cores_and_gets_its_own_back(two_cores: CpuPlan) -> None:
    plan, me = two_cores, os.getpid()
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)  # a thread that was there before, as the heartbeat's is
    helper.start()
    try:
        before = cpus_allowed(me)
        with keep_to(plan.cores("client")):
            assert set(cpus_allowed(me).values()) == {plan.others}
        assert cpus_allowed(me) == before
    finally:
        stop.set()
        helper.join()


async def test_the_measure_step_runs_the_load_on_the_clients_cores(
    two_cores: CpuPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tuner.study import measure

    seen: list[frozenset[int]] = []

    async def load_phase(*args: object) -> measure.Measurement:
        seen.append(frozenset(os.sched_getaffinity(0)))
        return measure.Measurement(None)

    monkeypatch.setattr(measure, "_measure", load_phase)
    # a server nobody answers at (port 9, discard): the emulator's clock is asked there and says nothing
    server = type("S", (), {"cpu_plan": two_cores, "base_url": "http://127.0.0.1:9", "time_scale": 1.0})()
    await measure.measure_load(server, None, VllmFlags())  # type: ignore[arg-type]
    server.cpu_plan = None
    await measure.measure_load(server, None, VllmFlags())  # type: ignore[arg-type]
    assert seen == [two_cores.others, frozenset(os.sched_getaffinity(0))]
