"""A server as a local process (default `vllm serve MODEL`), in its own process group, killed as a group.

vLLM spawns engine-core and worker processes; killing only the parent leaves them holding the GPU. The group is
recorded in a pidfile registry so that a later run can remove what a killed tuner left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from tuner.errors import LaunchError
from tuner.flags import VllmFlags
from tuner.launch.affinity import CpuPlan
from tuner.launch.base import Server
from tuner.launch.failures import CANNOT_LAUNCH, START_TIMEOUT
from tuner.launch.gpu_idle import GpuIdleWaiter
from tuner.launch.owner import owner_alive, owner_token, pid_alive, process_start_ticks
from tuner.launch.pinning import group_members, place_server
from tuner.launch.ports import free_port
from tuner.launch.redact import Redactor
from tuner.launch.registry import ProcessRecord, ProcessRegistry
from tuner.launch.serving import ready_server

log = logging.getLogger(__name__)

DEFAULT_COMMAND = ("vllm", "serve", "{model}")
LOG_HEAD_BYTES = 1 << 20  # the start-up part of a log: the facts and the failure are there
LOG_TAIL_BYTES = 4 << 20  # the end of a long run's access log
PORT_TRIES = 3  # a port taken between the pick and the bind is picked again, this many times in all


def port_taken(error: LaunchError) -> bool:
    """The server exited because its port was taken (vLLM's and uvicorn's `[Errno 98] ... address already in use`)."""
    return "address already in use" in (str(error) + "\n" + error.log_tail).lower()


def _group_alive(pgid: int) -> bool:
    """A live (non-zombie) process is in the group. Zombies count as gone: no reaper may be around for them."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return bool(group_members(pgid))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """Stop a child started with `start_new_session` and its whole group: SIGTERM, then SIGKILL past `grace_s`
    (for the synchronous callers that start a real vLLM outside a study: tests, benchmarks, fixture recording)."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


class ProcessHandle:
    """One spawned server process group and its output.

    The server writes to a file, not a pipe: a server that outlives a killed tuner must not die of EPIPE on its
    next log line (it would hide the leftover it is), and a reader that falls behind cannot stall it.
    """

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path, registry: ProcessRegistry | None) -> None:
        self.proc = proc
        self.pgid = proc.pid  # start_new_session: the child leads its own group
        self.log_path = log_path
        self._registry = registry
        self._ready_offset: int | None = None
        self._final_logs: str | None = None
        self._after_ready = ""
        self._stopped_by_us = False

    @classmethod
    def spawn(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: Path | None,
        registry: ProcessRegistry,
        study: str | None,
        trial: int | None,
    ) -> ProcessHandle:
        log_dir = registry.dir / "logs"
        try:
            log_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="server-", suffix=".log", dir=log_dir)
        except OSError as e:
            raise LaunchError(f"cannot create a server log file in {log_dir}: {e}", CANNOT_LAUNCH) from None
        log_path = Path(name)
        try:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=fd,
                stderr=subprocess.STDOUT,
                env=dict(env),
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as e:
            log_path.unlink(missing_ok=True)
            raise LaunchError(f"cannot run {argv[0]!r}: {e.strerror or e}", CANNOT_LAUNCH) from None
        finally:
            os.close(fd)
        _register(
            registry,
            ProcessRecord(
                pid=proc.pid,
                pgid=proc.pid,
                start_ticks=process_start_ticks(proc.pid),
                cmdline=list(argv),
                study=study,
                trial=trial,
                owner=owner_token(),
                log_path=str(log_path),
            ),
        )
        return cls(proc, log_path, registry)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    @property
    def stopped_by_us(self) -> bool:
        return self._stopped_by_us

    def logs(self) -> str:
        if self._final_logs is not None:
            return self._final_logs
        return read_log(self.log_path)

    def logs_since_ready(self) -> str:
        if self._ready_offset is None:
            return self.logs()
        return read_log(self.log_path, start=self._ready_offset) if self._final_logs is None else self._after_ready

    def mark_ready(self) -> None:
        with contextlib.suppress(OSError):
            self._ready_offset = self.log_path.stat().st_size

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to the group, up to `grace_s` to exit, then SIGKILL; the whole group, whatever the leader did."""
        self._stopped_by_us = self._stopped_by_us or self.proc.poll() is None
        try:
            if self.proc.poll() is None:
                _signal_group(self.pgid, signal.SIGTERM)
                deadline = time.monotonic() + grace_s
                while self.proc.poll() is None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
        finally:
            # Also on a second cancellation: never leave the group behind.
            self._kill_and_reap()

    def _kill_and_reap(self) -> None:
        if _group_alive(self.pgid):
            _signal_group(self.pgid, signal.SIGKILL)
        self.proc.wait()
        if self._final_logs is None:
            self._after_ready = self.logs_since_ready()
            self._final_logs = read_log(self.log_path)
            self.log_path.unlink(missing_ok=True)
        if self._registry is not None:
            self._registry.remove(self.proc.pid)


def read_log(path: Path, *, start: int = 0) -> str:
    """The log from byte `start`; a very long one as its head (start-up) and its tail."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            if size - start <= LOG_HEAD_BYTES + LOG_TAIL_BYTES:
                f.seek(start)
                data = f.read()
            else:
                f.seek(start)
                head = f.read(LOG_HEAD_BYTES)
                f.seek(size - LOG_TAIL_BYTES)
                skipped = size - LOG_TAIL_BYTES - start - LOG_HEAD_BYTES
                data = head + f"\n[... {skipped} bytes not shown ...]\n".encode() + f.read()
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")


class ProcessLauncher:
    """Starts `command` (items may use {model}, {host}, {port}) with the flags appended.

    `--host`/`--port` are appended unless the command has `{port}`; `--model` is appended unless it has `{model}`.
    The server inherits the tuner's environment; values of `secret_env` names are masked in everything returned.
    `startup_timeout_s` is in wall seconds. `cpu_plan` (vLLM's CPU build): the worker is told its cores, and the
    ready server's processes are moved onto the plan's (`Server.cpu_plan` says it was done).
    """

    name = "process"

    def __init__(
        self,
        command: Sequence[str] = DEFAULT_COMMAND,
        model: str = "meta-llama/Llama-3.1-8B-Instruct",
        *,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        secret_env: Sequence[str] = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"),
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 30.0,
        time_scale: float = 1.0,
        state_dir: Path | str | None = None,
        cwd: Path | None = None,
        gpu_idle: GpuIdleWaiter | None = None,
        cpu_plan: CpuPlan | None = None,
    ) -> None:
        if not command:
            raise ValueError("command must not be empty")
        self.command = tuple(command)
        self.model = model
        self.served_model_name = served_model_name
        self.host = host
        self.extra_args = tuple(extra_args)
        self.env = dict(env or {})
        self.secret_env = tuple(secret_env)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.time_scale = time_scale
        self.registry = ProcessRegistry(state_dir)
        self.cwd = cwd
        self.gpu_idle = gpu_idle if gpu_idle is not None else GpuIdleWaiter()
        self.cpu_plan = cpu_plan

    def argv(self, flags: VllmFlags, port: int) -> list[str]:
        values = {"model": self.model, "host": self.host, "port": str(port)}
        argv = [part.format(**values) for part in self.command]
        joined = " ".join(self.command)
        if "{model}" not in joined:
            argv += ["--model", self.model]
        if "{port}" not in joined:
            argv += ["--host", self.host, "--port", str(port)]
        if self.served_model_name:
            argv += ["--served-model-name", self.served_model_name]
        return argv + flags.to_args() + list(self.extra_args)

    def _environment(self) -> dict[str, str]:
        # Unbuffered: the start-up lines must reach the pipe before the port opens, not at exit.
        plan = self.cpu_plan.env() if self.cpu_plan is not None else {}
        return {**os.environ, "PYTHONUNBUFFERED": "1", **plan, **self.env}

    @asynccontextmanager
    async def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> AsyncIterator[Server]:
        if study is not None:
            # Owner-aware, so safe beside live sibling workers: only a dead run's servers go (and are logged).
            await asyncio.to_thread(self.cleanup_leftovers, study)
        await self.gpu_idle.wait()
        environment = self._environment()
        redact = Redactor.for_env(self.secret_env, environment)
        for tries in range(1, PORT_TRIES + 1):
            handle = ProcessHandle.spawn(
                self.argv(flags, port := free_port(self.host)),
                env=environment, cwd=self.cwd, registry=self.registry, study=study, trial=trial,
            )  # fmt: skip
            try:
                server = await self._ready(handle, port, redact)
            except LaunchError as e:
                # A refusal read from the log while the server still shuts down: its error line is the end of it.
                await handle.stop(0.0 if refused_early(e, handle) else self.stop_grace_s)
                if tries == PORT_TRIES or not port_taken(e):
                    raise
                # Another program bound the port between our pick and the server's bind: not the flags' doing.
                log.warning("port %d was taken before the server bound it; starting it on another port", port)
                continue
            except BaseException:
                await handle.stop(self.stop_grace_s)
                raise
            break
        try:
            await self._place_on_cores(handle, server)
            yield server
        finally:
            await handle.stop(self.stop_grace_s)

    async def _ready(self, handle: ProcessHandle, port: int, redact: Redactor) -> Server:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host

        async def exit_code() -> int | None:
            return handle.exit_code()

        return await ready_server(
            handle, f"http://{host}:{port}", exit_code=exit_code, timeout_s=self.startup_timeout_s,
            what=f"the {self.name} server", redact=redact, launcher=self.name, time_scale=self.time_scale,
            default_model=self.served_model_name or self.model, read_refusals=True,
        )  # fmt: skip

    async def _place_on_cores(self, handle: ProcessHandle, server: Server) -> None:
        """The ready server's processes onto the plan's cores (its worker's OpenMP threads bound themselves)."""
        plan = self.cpu_plan
        if plan is None or not plan.applies:
            return
        if await asyncio.to_thread(place_server, handle.pgid, plan.worker, plan.others):
            server.cpu_plan = plan
            return
        log.warning(
            "no thread of the server runs on the worker's cores (%s=%s): it did not bind its worker there, so "
            "its processes and the load client were left where they were",
            *next(iter(plan.env().items())),
        )

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        removed = []
        for record in self.registry.records():
            if record.study != study:
                continue
            alive = owner_alive(record.owner)
            if alive:
                continue  # a live run (this one, or a sibling worker) owns it
            if alive is None:
                log.info("leaving process %d alone: started from another host (%s)", record.pid, record.owner)
                continue
            if _is_same_process(record):
                _signal_group(record.pgid, signal.SIGTERM)
                _wait_group_gone(record.pgid, self.stop_grace_s)
                if _group_alive(record.pgid):
                    _signal_group(record.pgid, signal.SIGKILL)
                    _wait_group_gone(record.pgid, 5.0)
                what = f"trial {record.trial}" if record.trial is not None else "no trial"
                line = (
                    f"killed leftover server process group {record.pgid} ({what} of study {study!r}, owner "
                    f"{record.owner} is gone): {' '.join(record.cmdline)}"
                )
                log.warning("%s", line)
                removed.append(line)
            self.registry.remove(record.pid)
            if record.log_path:
                Path(record.log_path).unlink(missing_ok=True)
        return removed


def refused_early(error: LaunchError, handle: ProcessHandle) -> bool:
    """The start failed on a refusal read from the log while the server was still shutting itself down."""
    return error.reason != START_TIMEOUT and handle.exit_code() is None


def _register(registry: ProcessRegistry, record: ProcessRecord) -> None:
    try:
        registry.add(record)
    except OSError as e:
        log.warning(
            "cannot record server process %d in %s (%s): a killed run will leave it", record.pid, registry.dir, e
        )


def _is_same_process(record: ProcessRecord) -> bool:
    """The recorded group still exists and its leader (if alive) is the process we started, not a reused pid."""
    if pid_alive(record.pid):
        ticks = process_start_ticks(record.pid)
        if record.start_ticks is not None and ticks is not None:
            return ticks == record.start_ticks
        return _cmdline(record.pid) == record.cmdline
    # The leader is gone but its children may still hold the GPU; Linux does not hand out a pid
    # that is still some group's id, so a live group of this id is ours.
    return _group_alive(record.pgid)


def _cmdline(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.decode(errors="replace").rstrip("\0").split("\0")


def _wait_group_gone(pgid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
