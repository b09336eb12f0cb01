"""The CPU-only vLLM look-alike as a server process: the process launcher's code path, with a GPU profile and a
time scale (the load phase then measures with Clock(time_scale))."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from tuner.flags import VllmFlags
from tuner.launch.base import Server
from tuner.launch.gpu_idle import GpuIdleWaiter
from tuner.launch.process import ProcessLauncher


def emulator_args(gpu: str, time_scale: float, memory_in_use_gib: float = 0.0) -> list[str]:
    """The emulator's own flags (after vLLM's): which GPU it imitates, how much faster than real time it runs."""
    args = ["--gpu", gpu, "--time-scale", f"{time_scale:g}"]
    if memory_in_use_gib:
        args += ["--gpu-memory-in-use-gib", f"{memory_in_use_gib:g}"]
    return args


class EmulatorLauncher:
    """`python -m tuner.emulator --model M --gpu G --time-scale S [vLLM flags]` on a free loopback port."""

    name = "emulator"

    def __init__(
        self,
        model: str = "llama-3.1-8b",
        gpu: str = "h100-80gb",
        time_scale: float = 1.0,
        memory_in_use_gib: float = 0.0,
        extra_args: Sequence[str] = (),
        *,
        startup_timeout_s: float = 120.0,
        stop_grace_s: float = 5.0,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        secret_env: Sequence[str] = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"),
        state_dir: Path | str | None = None,
        python: str = sys.executable,
    ) -> None:
        self.model = model
        self.gpu = gpu
        self.time_scale = time_scale
        self.memory_in_use_gib = memory_in_use_gib
        command = [python, "-m", "tuner.emulator", "--model", "{model}", "--host", "{host}", "--port", "{port}"]
        self._process = ProcessLauncher(
            [*command, *emulator_args(gpu, time_scale, memory_in_use_gib)],
            model,
            served_model_name=served_model_name,
            extra_args=extra_args,
            env=env,
            secret_env=secret_env,
            startup_timeout_s=startup_timeout_s,
            stop_grace_s=stop_grace_s,
            time_scale=time_scale,
            state_dir=state_dir,
            gpu_idle=GpuIdleWaiter(probe=lambda: None),  # it holds no GPU memory
        )
        self._process.name = self.name

    @property
    def startup_timeout_s(self) -> float:
        return self._process.startup_timeout_s

    def argv(self, flags: VllmFlags, port: int) -> list[str]:
        return self._process.argv(flags, port)

    def start(
        self, flags: VllmFlags, *, study: str | None = None, trial: int | None = None
    ) -> AbstractAsyncContextManager[Server]:
        return self._process.start(flags, study=study, trial=trial)

    def cleanup_leftovers(self, study: str | None) -> list[str]:
        return self._process.cleanup_leftovers(study)
