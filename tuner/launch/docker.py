"""A server as a Docker container (the official vllm/vllm-openai image by default), through the Docker SDK.

Every container is labelled with its study, trial and owner (host:pid:start-time of this tuner) so a later run
can remove what a killed tuner left behind, and never a live sibling worker's container. Environment variables
are passed by name: their values are read from the tuner's environment at start and never logged or returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tuner.errors import EngineGone, LaunchError
from tuner.flags import VllmFlags
from tuner.launch.base import Server
from tuner.launch.emulator import emulator_args
from tuner.launch.engine_watch import EngineWatch
from tuner.launch.failures import CANNOT_LAUNCH, IMAGE_MISSING, UNKNOWN
from tuner.launch.gpu_idle import GpuIdleWaiter
from tuner.launch.owner import owner_alive, owner_token
from tuner.launch.ports import free_port
from tuner.launch.redact import Redactor
from tuner.launch.serving import ready_server
from tuner.vllm_pin import PINNED_VLLM

log = logging.getLogger(__name__)

DEFAULT_IMAGE = f"vllm/vllm-openai:v{PINNED_VLLM}"  # the vLLM the tuner is tested against (tuner.vllm_pin)
CONTAINER_PORT = 8000
LABEL_LAUNCHER = "tuner.launcher"
LABEL_STUDY = "tuner.study"
LABEL_TRIAL = "tuner.trial"
LABEL_OWNER = "tuner.owner"
_PORT_TAKEN = ("port is already allocated", "address already in use")
# Where a container without GPUs can be had: a job's docker target always asks for them (its GPUs are the study's).
_NO_GPU_IMAGE = " (an image that needs no GPU, such as the emulator's, runs under `tuner launch --gpus none`)"
_NO_GPU_RUNTIME = ("could not select device driver", "nvidia-container-cli", "unknown or invalid runtime")

Gpus = str | Sequence[str] | None  # "all", device ids ("0", "1" or UUIDs), or None for no GPU


def docker_sdk() -> Any:
    """The `docker` package, imported when first needed (the repository's docker/ directory shadows it for mypy)."""
    return importlib.import_module("docker")


def engine_errors() -> tuple[type[BaseException], ...]:
    """What the SDK raises when the engine does not answer: requests' connection errors (requests has no stubs) and
    the SDK's own; whether the engine is gone is then asked of the engine itself (`DockerLauncher.engine_answers`)."""
    return importlib.import_module("requests").exceptions.RequestException, docker_sdk().errors.DockerException


# AMD GPUs (ROCm): vLLM's ROCm image and the devices, group and seccomp profile its docs' `docker run` gives. The
# ROCm image is tagged as the CUDA one (v<release>), so an AMD study runs the vLLM the tuner is tested against too.
ROCM_IMAGE = f"vllm/vllm-openai-rocm:v{PINNED_VLLM}"
_AMD_DEVICES = ("/dev/kfd", "/dev/dri")
_NO_AMD_DEVICES = ("/dev/kfd", "/dev/dri")


def image_for(image: str, vendor: str) -> str:
    """The image a server runs: AMD GPUs need vLLM's ROCm build, so the CUDA default is swapped for it (an image
    the job chose is kept)."""
    return ROCM_IMAGE if vendor == "amd" and image == DEFAULT_IMAGE else image


def gpu_create_kwargs(gpus: Gpus, vendor: str = "nvidia") -> dict[str, Any]:
    """Docker's create() arguments that give a container its GPUs: NVIDIA's device requests, or AMD's devices."""
    if gpus is None or gpus == "none":
        return {}
    if vendor == "amd":
        return {
            "devices": [f"{d}:{d}:rwm" for d in _AMD_DEVICES],
            "group_add": ["video"],
            "security_opt": ["seccomp=unconfined"],
        }
    return {"device_requests": _device_requests(gpus)}


def gpu_environment(gpus: Gpus, vendor: str = "nvidia") -> dict[str, str]:
    """AMD containers see every GPU through /dev/dri; a subset is chosen by HIP_VISIBLE_DEVICES."""
    if vendor != "amd" or gpus is None or isinstance(gpus, str):
        return {}
    return {"HIP_VISIBLE_DEVICES": ",".join(gpus)}


def _device_requests(gpus: Gpus) -> list[Any]:
    if gpus is None or gpus == "none":
        return []
    if gpus == "all":
        return [docker_sdk().types.DeviceRequest(count=-1, capabilities=[["gpu"]])]
    ids = [gpus] if isinstance(gpus, str) else list(gpus)
    return [docker_sdk().types.DeviceRequest(device_ids=ids, capabilities=[["gpu"]])]


def _slug(text: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_.-]+", "-", text).strip("-.")[:40] or "x"


class ContainerHandle:
    """One container: its status, its logs (kept after removal), its stop. `died_with_engine(code)`: the
    EngineGone to raise for a container that died (or vanished) without our stop, when the engine restarted under
    it; None when it died on its own."""

    def __init__(self, container: Any, died_with_engine: Callable[[int], EngineGone | None] | None = None) -> None:
        self.container = container
        self._died_with_engine = died_with_engine
        self._final_logs: str | None = None
        self._final_exit: int | None = None
        self._ready_offset: int | None = None
        self._stopped_by_us = False
        self._lock = threading.Lock()
        self.orphaned = False  # not removed: the engine did not answer

    @property
    def stopped_by_us(self) -> bool:
        return self._stopped_by_us

    def state(self) -> dict[str, Any]:
        if self._final_logs is not None:
            return {"Status": "removed", "ExitCode": self._final_exit}
        try:
            self.container.reload()
        except docker_sdk().errors.NotFound:
            return {"Status": "removed", "ExitCode": self._final_exit}
        state: dict[str, Any] = self.container.attrs.get("State", {})
        return state

    def root_pid(self) -> int | None:
        """The container's first process as this host numbers it (None: not running, or not readable): its tree
        is the server's CPU, not another process's (tuner.load.host_contention)."""
        try:
            pid = self.state().get("Pid")
        except Exception:  # the engine away: the host's figures go on without it
            return None
        return pid if isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 else None

    def exit_code(self) -> int | None:
        """None while it runs; its exit code once dead. A container the engine's restart killed (or removed) raises
        EngineGone: the trial is the environment's, not the flags' crash."""
        code = self._exit_code()
        if code is not None and not self._stopped_by_us and self._died_with_engine is not None:
            gone = self._died_with_engine(code)
            if gone is not None:
                raise gone
        return code

    def _exit_code(self) -> int | None:
        state = self.state()
        if state.get("Status") in ("exited", "dead", "removed"):
            code = state.get("ExitCode")
            return int(code) if code is not None else -1
        return None

    def logs(self) -> str:
        if self._final_logs is not None:
            return self._final_logs
        try:
            raw: bytes = self.container.logs(stdout=True, stderr=True)
        except docker_sdk().errors.NotFound:
            return self._final_logs or ""
        return raw.decode("utf-8", errors="replace")

    def logs_since_ready(self) -> str:
        return self.logs()[self._ready_offset or 0 :]

    def mark_ready(self) -> None:
        self._ready_offset = len(self.logs())

    def _stop_sync(self, grace_s: float) -> None:
        with contextlib.suppress(*engine_errors()):  # NotFound and APIError too: both are DockerException
            if self._exit_code() is None:
                self._stopped_by_us = True
                # SIGTERM, then SIGKILL after the grace (Docker's own stop).
                self.container.stop(timeout=max(1, round(grace_s)))

    def remove(self) -> None:
        with self._lock:
            if self._final_logs is not None:
                return
            logs, code = "", None
            try:
                logs = self.logs()
                with contextlib.suppress(docker_sdk().errors.NotFound, docker_sdk().errors.APIError):
                    code = self._exit_code()
                with contextlib.suppress(docker_sdk().errors.NotFound):
                    self.container.remove(force=True)
            except engine_errors():
                # The engine went away: the container (or what the engine kept of it) is removed once it is back.
                self.orphaned = True
            self._final_exit = code
            self._final_logs = logs

    async def stop(self, grace_s: float) -> None:
        try:
            await asyncio.to_thread(self._stop_sync, grace_s)
        finally:
            # Also when cancelled mid-stop: a forced remove kills whatever is left.
            self.remove()


class DockerLauncher:
    """Runs `image` with `--model MODEL [flags] [extra_args]` appended to its entrypoint (vllm/vllm-openai's shape).

    `gpus`: "all", a list of device ids, or None (the emulator image needs none). `env`: names of variables whose
    values are read from the tuner's environment at each start. `volumes`: host path -> container path
    (append ":ro" for read-only). `startup_timeout_s` is in wall seconds from the container's start.
    """

    name = "docker"
    emulator = False  # the image is the tuner's emulator (`for_emulator`): its servers are marked so

    def __init__(
        self,
        image: str = DEFAULT_IMAGE,
        model: str = "meta-llama/Llama-3.1-8B-Instruct",
        *,
        served_model_name: str | None = None,
        gpus: Gpus = "all",
        hf_cache: str | Path | None = "~/.cache/huggingface",
        volumes: Mapping[str, str] | None = None,
        env: Sequence[str] = ("HF_TOKEN",),
        extra_args: Sequence[str] = (),
        startup_timeout_s: float = 900.0,
        stop_grace_s: float = 30.0,
        time_scale: float = 1.0,
        pull: bool = True,
        pull_stall_s: float = 120.0,
        shm_size: str | None = None,
        client: Any = None,
        gpu_idle: GpuIdleWaiter | None = None,
        vendor: str = "nvidia",
    ) -> None:
        if vendor not in ("nvidia", "amd"):
            raise ValueError(f"vendor must be nvidia or amd, not {vendor!r}")
        self.vendor = vendor
        self.image = image_for(image, vendor)
        self.model = model
        self.served_model_name = served_model_name
        self.gpus = gpus
        self.hf_cache = Path(hf_cache).expanduser() if hf_cache is not None else None
        self.volumes = dict(volumes or {})
        self.env = tuple(env)
        self.extra_args = tuple(extra_args)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.time_scale = time_scale
        self.pull = pull
        self.pull_stall_s = pull_stall_s
        self.shm_size = shm_size
        self._client = client
        self.gpu_idle = gpu_idle if gpu_idle is not None else GpuIdleWaiter()
        self._orphans: list[Any] = []  # containers left when the engine went away: removed once it is back
        # An engine that restarted and answers again before a dead container is looked at: told by this watch.
        self._watch = EngineWatch(lambda: self.client().events(decode=True, filters={"type": "daemon"}))

    @classmethod
    def for_emulator(
        cls,
        image: str,
        model: str = "llama-3.1-8b",
        gpu: str = "h100-80gb",
        time_scale: float = 1.0,
        memory_in_use_gib: float = 0.0,
        extra_args: Sequence[str] = (),
        **kwargs: Any,
    ) -> DockerLauncher:
        """The emulator image (docker/Dockerfile): no GPU, no HF cache, the emulator's own flags appended."""
        kwargs.setdefault("gpus", None)
        kwargs.setdefault("env", ())
        kwargs.setdefault("hf_cache", None)
        kwargs.setdefault("startup_timeout_s", 120.0)
        kwargs.setdefault("stop_grace_s", 5.0)
        kwargs.setdefault("gpu_idle", GpuIdleWaiter(probe=lambda: None))
        args = [*emulator_args(gpu, time_scale, memory_in_use_gib), *extra_args]
        launcher = cls(image, model, extra_args=args, time_scale=time_scale, **kwargs)
        launcher.emulator = True
        return launcher

    def client(self) -> Any:
        if self._client is None:
            try:
                self._client = docker_sdk().from_env()
            except docker_sdk().errors.DockerException as e:
                raise LaunchError(f"cannot reach the Docker engine: {e}", UNKNOWN) from None
        return self._client

    def engine_answers(self) -> bool:
        """The engine answers a ping (a restarted engine does again; a stopped or unreachable one does not)."""
        unreachable: tuple[type[BaseException], ...] = (LaunchError, *engine_errors())
        try:
            return bool(self.client().ping())
        except unreachable:
            return False

    def engine(self) -> str:
        return f"the Docker engine at {os.environ.get('DOCKER_HOST') or 'unix:///var/run/docker.sock'}"

    def _died_with_engine(self, mark: int | None) -> Callable[[int], EngineGone | None]:
        """For a container created at `mark` of the watch: EngineGone if the engine went away since."""

        def check(code: int) -> EngineGone | None:
            if not self._watch.restarted_since(mark):
                return None
            died = "is gone" if code == -1 else f"exited with code {code}"
            message = f"{self.engine()} restarted while the trial's container ran (the container {died})"
            return EngineGone(message, self.engine(), self.engine_answers)

        return check

    def _gone(self, error: BaseException) -> EngineGone:
        said = str(getattr(error, "explanation", None) or error).strip().splitlines()
        cause = f" ({said[0][:200]})" if said else ""
        return EngineGone(f"{self.engine()} stopped answering{cause}", self.engine(), self.engine_answers)

    def _remove_orphans(self) -> None:
        """What an engine that went away kept of this launcher's containers (stopped ones, after a restart)."""
        for container in list(self._orphans):
            with contextlib.suppress(docker_sdk().errors.NotFound):
                container.remove(force=True)
            self._orphans.remove(container)

    def _settle(self, handle: ContainerHandle) -> None:
        if handle.orphaned:
            self._orphans.append(handle.container)

    def close(self) -> None:
        self._watch.close()
        if self._client is not None:
            self._client.close()
            self._client = None

    def command(self, flags: VllmFlags) -> list[str]:
        args = ["--model", self.model]
        if self.served_model_name:
            args += ["--served-model-name", self.served_model_name]
        return args + flags.to_args() + list(self.extra_args)

    def _environment(self) -> dict[str, str]:
        missing = [n for n in self.env if n not in os.environ]
        if missing:
            log.warning("not passed to the container (not set in the tuner's environment): %s", ", ".join(missing))
        return {n: os.environ[n] for n in self.env if n in os.environ} | gpu_environment(self.gpus, self.vendor)

    def _volumes(self) -> dict[str, dict[str, str]]:
        binds: dict[str, dict[str, str]] = {}
        if self.hf_cache is not None:
            binds[str(self.hf_cache)] = {"bind": "/root/.cache/huggingface", "mode": "rw"}
        for host, target in self.volumes.items():
            path, _, mode = target.partition(":")
            binds[str(Path(host).expanduser())] = {"bind": path, "mode": mode or "rw"}
        return binds

    # --- image ---------------------------------------------------------------------------------------------

    async def _ensure_image(self) -> None:
        client = self.client()
        try:
            await asyncio.to_thread(client.images.get, self.image)
            return
        except docker_sdk().errors.ImageNotFound:
            pass
        except docker_sdk().errors.APIError as e:
            raise LaunchError(f"cannot inspect image {self.image}: {e.explanation or e}", IMAGE_MISSING) from None
        if not self.pull:
            raise LaunchError(f"image {self.image} is not on this Docker engine (pulling is off)", IMAGE_MISSING)
        await self._pull()

    async def _pull(self) -> None:
        """Pull in a daemon thread, giving up when no progress arrives for `pull_stall_s` (no registry, no DNS)."""
        client = self.client()
        progress = _PullProgress(time.monotonic())

        def pull() -> None:
            try:
                for event in client.api.pull(self.image, stream=True, decode=True):
                    progress.at = time.monotonic()
                    if isinstance(event, dict) and event.get("error"):
                        progress.error = str(event["error"])
                        return
            except Exception as e:
                progress.error = str(getattr(e, "explanation", None) or e)
            finally:
                progress.done = True

        log.info("pulling %s", self.image)
        threading.Thread(target=pull, name="docker-pull", daemon=True).start()
        while not progress.done:
            if time.monotonic() - progress.at > self.pull_stall_s:
                raise LaunchError(
                    f"image {self.image} is not on this Docker engine and its pull made no progress for "
                    f"{self.pull_stall_s:g} s",
                    IMAGE_MISSING,
                )
            await asyncio.sleep(0.1)
        if progress.error:
            raise LaunchError(
                f"image {self.image} is not on this Docker engine and cannot be pulled: {progress.error}",
                IMAGE_MISSING,
            )

    # --- start / stop -------------------------------------------------------------------------------------------

    def _create(
        self, flags: VllmFlags, study: str | None, trial: int | None, port: int, environment: dict[str, str]
    ) -> ContainerHandle:
        labels = {
            LABEL_LAUNCHER: "docker",
            LABEL_STUDY: study or "",
            LABEL_TRIAL: "" if trial is None else str(trial),
            LABEL_OWNER: owner_token(),
        }
        name = f"tuner-{_slug(study or 'adhoc')}-{'x' if trial is None else trial}-{secrets.token_hex(3)}"
        kwargs: dict[str, Any] = {
            "command": self.command(flags),
            "name": name,
            "labels": labels,
            "detach": True,
            "ports": {f"{CONTAINER_PORT}/tcp": ("127.0.0.1", port)},
            "environment": environment,
            "volumes": self._volumes(),
            "ipc_mode": "host",
            "init": True,  # tini as PID 1: SIGTERM reaches the server even before it installs handlers
        }
        kwargs.update(gpu_create_kwargs(self.gpus, self.vendor))
        if self.shm_size:
            kwargs["shm_size"] = self.shm_size
        mark = self._watch.mark()
        try:
            container = self.client().containers.create(self.image, **kwargs)
        except docker_sdk().errors.ImageNotFound:
            raise LaunchError(f"image {self.image} is not on this Docker engine", IMAGE_MISSING) from None
        except docker_sdk().errors.APIError as e:
            raise LaunchError(f"Docker refused to create the container: {e.explanation or e}", UNKNOWN) from None
        return ContainerHandle(container, self._died_with_engine(mark))

    def _start_container(self, handle: ContainerHandle) -> None:
        try:
            handle.container.start()
        except docker_sdk().errors.APIError as e:
            text = str(e.explanation or e)
            if self.vendor == "amd" and any(s in text for s in _NO_AMD_DEVICES):
                raise LaunchError(
                    f"Docker cannot give the container AMD GPUs ({', '.join(_AMD_DEVICES)}): {text}. Install the "
                    f"ROCm driver (amdgpu) on the host{_NO_GPU_IMAGE}",
                    CANNOT_LAUNCH,
                ) from None
            if any(s in text for s in _NO_GPU_RUNTIME):
                raise LaunchError(
                    f"Docker cannot give the container GPUs (gpus={self.gpus!r}): {text}. Install the NVIDIA "
                    f"container toolkit{_NO_GPU_IMAGE}",
                    CANNOT_LAUNCH,
                ) from None
            if any(s in text for s in _PORT_TAKEN):
                raise _PortTaken(text) from None
            raise LaunchError(f"Docker could not start the container: {text}", UNKNOWN) from None

    async def _create_started(
        self, flags: VllmFlags, study: str | None, trial: int | None, environment: dict[str, str]
    ) -> tuple[ContainerHandle, int]:
        for attempt in range(3):
            port = free_port()
            # The thread cannot be interrupted: when cancelled, wait for it and remove what it made.
            creating = asyncio.ensure_future(asyncio.to_thread(self._create, flags, study, trial, port, environment))
            try:
                handle = await asyncio.shield(creating)
            except asyncio.CancelledError:
                with contextlib.suppress(Exception):
                    (await creating).remove()
                raise
            try:
                await asyncio.shield(asyncio.ensure_future(asyncio.to_thread(self._start_container, handle)))
            except _PortTaken:
                handle.remove()
                self._settle(handle)
                if attempt == 2:
                    raise LaunchError(
                        f"no free host port for the container after {attempt + 1} tries", UNKNOWN
                    ) from None
                continue
            except BaseException:
                handle.remove()
                self._settle(handle)
                raise
            return handle, port
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> AsyncIterator[Server]:
        """As every launcher's; whatever the SDK raised, an engine that no longer answers is `EngineGone`."""
        try:
            async with self._start(flags, study, trial) as server:
                yield server
        except Exception as e:
            if isinstance(e, EngineGone) or await asyncio.to_thread(self.engine_answers):
                raise
            log.debug("the Docker engine stopped answering", exc_info=True)  # the details, for a log only
            raise self._gone(e) from None

    @asynccontextmanager
    async def _start(self, flags: VllmFlags, study: str | None, trial: int | None) -> AsyncIterator[Server]:
        await asyncio.to_thread(self._remove_orphans)
        if study is not None:
            # Owner-aware, so safe beside live sibling workers: only a dead run's servers go (and are logged).
            await asyncio.to_thread(self.cleanup_leftovers, study)
        await self.gpu_idle.wait()
        await self._ensure_image()
        environment = self._environment()
        redact = Redactor(environment.values())
        handle, port = await self._create_started(flags, study, trial, environment)
        what = f"the container of {self.image}"
        try:
            base_url = f"http://127.0.0.1:{port}"

            async def exit_code() -> int | None:
                return await asyncio.to_thread(handle.exit_code)

            async def exit_logs() -> str:
                logs = handle.logs()
                if (await asyncio.to_thread(handle.state)).get("OOMKilled"):
                    logs += "\n[tuner] the kernel OOM killer stopped the container: host memory ran out\n"
                return logs

            server = await ready_server(
                handle, base_url, exit_code=exit_code, timeout_s=self.startup_timeout_s, what=what, redact=redact,
                launcher=self.name, time_scale=self.time_scale, default_model=self.served_model_name or self.model,
                exit_logs=exit_logs,
            )  # fmt: skip
            server.emulator = self.emulator
            yield server
        finally:
            await handle.stop(self.stop_grace_s)
            self._settle(handle)

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        try:
            containers = self.client().containers.list(all=True, filters={"label": f"{LABEL_LAUNCHER}=docker"})
        except engine_errors() as e:
            if self.engine_answers():
                raise
            raise self._gone(e) from None
        removed = []
        for container in containers:
            labels = container.labels or {}
            if labels.get(LABEL_STUDY, "") != (study or ""):
                continue
            owner = labels.get(LABEL_OWNER, "")
            alive = owner_alive(owner)
            if alive:
                continue  # a live run (this one, or a sibling worker) owns it
            if alive is None:
                log.info("leaving container %s alone: started from another host (%s)", container.name, owner)
                continue
            with contextlib.suppress(docker_sdk().errors.NotFound):
                container.remove(force=True)
            trial = labels.get(LABEL_TRIAL)
            line = (
                f"removed leftover container {container.name} ({container.status}; "
                f"{f'trial {trial}' if trial else 'no trial'} of study {study!r}; owner {owner} is gone)"
            )
            log.warning("%s", line)
            removed.append(line)
        return removed


class _PortTaken(Exception):
    pass


@dataclass
class _PullProgress:
    at: float
    error: str | None = None
    done: bool = False
