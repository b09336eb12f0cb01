"""The process launcher against a tiny HTTP server (`python -c`): its command line, its process group, secrets,
the pidfile registry; and the pieces it is built from (redaction, owners, GPU idle wait)."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from launch_contract import assert_nothing_left, new_marker, processes_with

import tuner.launch.process as process
from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch import EmulatorLauncher, GpuIdleWaiter, ProcessLauncher
from tuner.launch.owner import owner_alive, owner_token, process_start_ticks
from tuner.launch.process import port_taken
from tuner.launch.redact import MASK, Redactor
from tuner.launch.registry import ProcessRecord, ProcessRegistry

SECRET = "hf_process-secret-0123456789"

# A vLLM stand-in: prints start-up lines (and the secret, as a careless server might), starts a child in its
# group (as vLLM starts its engine core), then serves /health on the port it was given, and /version when
# TINY_VERSION is set (older vLLM and other servers have no such route). No braces: the launcher formats the command.
TINY_SERVER = """
import http.server, json, os, subprocess, sys
port = int(sys.argv[1])
print("INFO vLLM API server version 0.10.2", flush=True)
print("INFO GPU KV cache size: 1,234 tokens", flush=True)
print("token is", os.environ.get("TUNER_TEST_PROCESS_SECRET"), flush=True)
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "child-of-" + sys.argv[2]])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        version = os.environ.get("TINY_VERSION")
        body = json.dumps(dict(version=version)).encode() if self.path == "/version" and version else b""
        self.send_response(200 if self.path == "/health" or body else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def tiny(marker: str, tmp_path: Path, **kwargs: object) -> ProcessLauncher:
    return ProcessLauncher(
        [sys.executable, "-c", TINY_SERVER, "{port}", marker],
        "tiny",
        secret_env=("TUNER_TEST_PROCESS_SECRET",),
        state_dir=tmp_path / "state",
        stop_grace_s=2.0,
        **kwargs,  # type: ignore[arg-type]
    )


def test_command_line_templating_and_appending() -> None:
    flags = VllmFlags(max_num_seqs=64, enable_prefix_caching=False)
    default = ProcessLauncher(model="org/m", extra_args=("--load-format", "dummy"))
    assert default.argv(flags, 8123) == [
        "vllm",
        "serve",
        "org/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--max-num-seqs",
        "64",
        "--no-enable-prefix-caching",
        "--load-format",
        "dummy",
    ]
    custom = ProcessLauncher(["srv", "--listen", "{host}:{port}"], "m", served_model_name="alias")
    assert custom.argv(VllmFlags(), 9) == [
        "srv",
        "--listen",
        "127.0.0.1:9",
        "--model",
        "m",
        "--served-model-name",
        "alias",
    ]


async def test_group_is_killed_and_secrets_are_masked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNER_TEST_PROCESS_SECRET", SECRET)
    marker = new_marker()
    launcher = tiny(marker, tmp_path)
    async with launcher.start(VllmFlags(), study="s", trial=1) as server:
        assert server.facts.kv_tokens == 1234
        assert server.facts.vllm_version == "0.10.2"  # no /version: the banner's
        assert server.model == "tiny"  # no /v1/models: the configured name
        deadline = time.monotonic() + 5
        while len(processes_with(marker)) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(processes_with(marker)) == 2, "the server and its child"
        assert f"token is {MASK}" in server.logs()
        assert SECRET not in server.logs()
        assert len(ProcessRegistry(tmp_path / "state").records()) == 1
    # SIGKILLed, the child may still be exiting when the stop returns (it waits for the leader only): not forever
    assert_nothing_left(marker, study="-")
    assert ProcessRegistry(tmp_path / "state").records() == []
    assert f"token is {MASK}" in server.logs()  # kept after the stop, still masked
    assert not list((tmp_path / "state" / "logs").iterdir())


async def test_version_route_wins_over_the_banner(tmp_path: Path) -> None:
    launcher = tiny(new_marker(), tmp_path, env={"TINY_VERSION": "0.32.0"})
    async with launcher.start(VllmFlags()) as server:
        assert server.facts.vllm_version == "0.32.0"


async def test_secret_is_masked_in_a_failed_starts_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TUNER_TEST_PROCESS_SECRET", SECRET)
    launcher = ProcessLauncher(
        [
            sys.executable,
            "-c",
            "import os, sys; print('ERROR bad token', os.environ['TUNER_TEST_PROCESS_SECRET']); sys.exit(3)",
        ],
        "m",
        secret_env=("TUNER_TEST_PROCESS_SECRET",),
        state_dir=tmp_path,
    )
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(VllmFlags()):
            pytest.fail("started")
    assert raised.value.reason == "unknown"
    assert "exited with code 3" in str(raised.value)
    assert SECRET not in str(raised.value) and SECRET not in raised.value.log_tail
    assert f"bad token {MASK}" in str(raised.value)


async def test_a_refused_start_ends_at_its_error_line(tmp_path: Path) -> None:
    """vLLM prints its refusal, then takes seconds to shut its processes down: the launcher classifies the line and
    kills the group then. This stand-in never exits nor serves, so only the line can end its start."""
    marker = new_marker()
    refuses = (
        "import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)', 'child-of-' + sys.argv[1]])\n"
        "print('ValueError: max_num_batched_tokens (32) must be greater than or equal to max_num_seqs (64).')\n"
        "print('still shutting down', flush=True)\n"
        "time.sleep(600)\n"
    )
    launcher = ProcessLauncher(
        [sys.executable, "-c", refuses, marker], "m", state_dir=tmp_path, stop_grace_s=30, startup_timeout_s=120
    )
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(VllmFlags()):
            pytest.fail("started")
    assert raised.value.reason == "invalid_flags"
    assert str(raised.value).endswith("must be greater than or equal to max_num_seqs (64).")
    assert_nothing_left(marker, study="-")
    assert ProcessRegistry(tmp_path).records() == []


async def test_missing_executable_is_a_clear_launch_error(tmp_path: Path) -> None:
    launcher = ProcessLauncher(["no-such-vllm-binary", "serve"], state_dir=tmp_path)
    with pytest.raises(LaunchError, match="cannot run 'no-such-vllm-binary'") as raised:
        async with launcher.start(VllmFlags()):
            pytest.fail("started")
    assert raised.value.reason == "cannot_launch"  # fatal for a study: no flag set can start
    assert ProcessRegistry(tmp_path).records() == []


async def test_body_exception_still_stops_the_server(tmp_path: Path) -> None:
    marker = new_marker()
    with pytest.raises(RuntimeError, match="trial code failed"):
        async with tiny(marker, tmp_path).start(VllmFlags()) as server:
            async with httpx.AsyncClient(trust_env=False) as client:
                assert (await client.get(f"{server.base_url}/health")).status_code == 200
            raise RuntimeError("trial code failed")
    assert_nothing_left(marker, study="-")


def test_a_reused_pid_is_not_killed(tmp_path: Path) -> None:
    """A record whose pid now belongs to another process (other start time) is dropped, the process spared."""
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], start_new_session=True)
    try:
        registry = ProcessRegistry(tmp_path)
        registry.add(
            ProcessRecord(
                pid=bystander.pid,
                pgid=bystander.pid,
                start_ticks="1",  # not its start time
                cmdline=["vllm", "serve"],
                study="s",
                trial=0,
                owner=f"{owner_token().split(':')[0]}:999999999:1",  # its owner is gone
            )
        )
        assert ProcessLauncher(state_dir=tmp_path).cleanup_leftovers("s") == []
        assert bystander.poll() is None
        assert registry.records() == []
    finally:
        bystander.kill()
        bystander.wait()


def test_owner_tokens() -> None:
    assert owner_alive(owner_token()) is True
    host = owner_token().split(":")[0]
    assert owner_alive(f"{host}:{os.getpid()}:{int(process_start_ticks(os.getpid()) or 0) + 1}") is False
    assert owner_alive(f"{host}:999999999:1") is False
    assert owner_alive("some-other-host:1:1") is None


def test_redactor_masks_long_values_only() -> None:
    redact = Redactor.for_env(["A", "B", "C"], {"A": "abcdefgh-secret", "B": "1", "C": "abcdefgh"})
    assert redact("a=abcdefgh-secret b=1 c=abcdefgh") == f"a={MASK} b=1 c={MASK}"


async def test_gpu_idle_wait_until_memory_is_back() -> None:
    readings = iter([[1000], [5000], [4000], [1100]])
    waiter = GpuIdleWaiter(lambda: next(readings), tolerance_bytes=200, timeout_s=5, poll_s=0.01)
    assert await waiter.wait() is True  # the first reading is the idle level
    assert await waiter.wait() is True  # 5000, 4000, then 1100: within tolerance
    assert waiter.idle == [1000]


async def test_gpu_idle_wait_gives_up_at_its_timeout() -> None:
    readings = iter([[1000], *([[9000]] * 1000)])
    waiter = GpuIdleWaiter(lambda: next(readings), tolerance_bytes=200, timeout_s=0.05, poll_s=0.01)
    assert await waiter.wait() is True
    assert await waiter.wait() is False


async def test_gpu_idle_wait_is_a_no_op_without_nvml() -> None:
    assert await GpuIdleWaiter(lambda: None).wait() is True
    assert await GpuIdleWaiter().wait() is True  # no GPU on this machine, or no nvidia-ml-py


async def test_sigterm_ignoring_server_is_killed(tmp_path: Path) -> None:
    """Grace then SIGKILL: a server that ignores SIGTERM still goes."""
    marker = new_marker()
    script = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
        "time.sleep(600)"
    )
    launcher = ProcessLauncher(
        # 5 s: long enough for a fresh interpreter to print 'up' on a busy machine, short next to its 600 s sleep
        [sys.executable, "-c", script, marker],
        state_dir=tmp_path,
        startup_timeout_s=5.0,
        stop_grace_s=0.3,
    )

    started = time.monotonic()
    with pytest.raises(LaunchError) as raised:
        async with launcher.start(VllmFlags()):
            pytest.fail("started")
    assert raised.value.reason == "start_timeout"
    assert "last log line: up" in str(raised.value)
    assert time.monotonic() - started < 300  # killed, not waited out
    assert processes_with(marker) == []


async def test_a_port_taken_before_the_server_binds_it_is_replaced_by_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)  # another program listens there: the emulator's bind fails with EADDRINUSE
    held = taken.getsockname()[1]
    picks: list[int] = []

    def pick(host: str = "127.0.0.1") -> int:
        picks.append(held if not picks else free_port(host))
        return picks[-1]

    free_port = process.free_port
    monkeypatch.setattr(process, "free_port", pick)
    launcher = EmulatorLauncher("llama-3.1-8b", "h100-80gb", time_scale=100, state_dir=tmp_path)
    try:
        async with launcher.start(VllmFlags()) as server:
            assert server.base_url.endswith(f":{picks[-1]}") and picks[-1] != held
            async with httpx.AsyncClient() as client:
                assert (await client.get(server.base_url + "/health")).status_code == 200
    finally:
        taken.close()
    assert picks[0] == held and len(picks) == 2


async def test_a_server_that_fails_for_another_reason_is_not_started_again_on_another_port(tmp_path: Path) -> None:
    launcher = ProcessLauncher(
        [sys.executable, "-c", "import sys; print('ERROR no such model'); sys.exit(3)"], state_dir=tmp_path
    )
    with pytest.raises(LaunchError) as e:
        async with launcher.start(VllmFlags()):
            pass
    assert "no such model" in str(e.value)
    assert not port_taken(e.value)


@pytest.mark.parametrize("ignores_term", [False, True])
def test_stop_group_ends_the_child_and_what_it_spawned(ignores_term: bool) -> None:
    """vLLM's API server spawns its engine core: stopping the parent alone would leave the child; a group that
    ignores SIGTERM is killed once the grace is over."""
    marker = new_marker()
    trap = "trap '' TERM; " if ignores_term else ""
    child = f"{sys.executable} -c 'import time; time.sleep(300)' {marker}"
    proc = subprocess.Popen(["sh", "-c", f"{trap}{child} & {child}"], start_new_session=True)
    while len(processes_with(marker)) < 2:
        time.sleep(0.05)
    process.stop_group(proc, grace_s=0.5)
    assert proc.poll() is not None
    assert_nothing_left(marker, study="")
