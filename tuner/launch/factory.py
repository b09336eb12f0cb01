"""The launcher kinds by name: the one place a job's target (`tuner tune`, `tuner verify`) or `tuner launch`'s
options become a Launcher.

A new kind is its launcher module, one `LauncherKind` entry in `LAUNCHERS` here, and its name (with an options
section) in `tuner.config.TargetSection`.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tuner.config import Job
from tuner.errors import ConfigError
from tuner.launch.base import Launcher
from tuner.launch.docker import DockerLauncher
from tuner.launch.emulator import EmulatorLauncher
from tuner.launch.process import ProcessLauncher

__all__ = ["EMULATOR_MODEL", "LAUNCHERS", "VLLM_MODEL", "LaunchOptions", "LauncherKind", "build_launcher"]

EMULATOR_MODEL = "llama-3.1-8b"
VLLM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass(frozen=True)
class LaunchOptions:
    """`tuner launch`'s options, for every kind (each reads its own)."""

    model: str | None = None
    gpu: str = "h100-80gb"
    time_scale: float = 1.0
    memory_in_use_gib: float = 0.0
    extra_args: list[str] = field(default_factory=list)
    startup_timeout: float | None = None
    image: str = ""
    gpus: str | list[str] | None = "all"
    env: list[str] | None = None
    volumes: dict[str, str] = field(default_factory=dict)
    hf_cache: str | None = None
    command: str | None = None
    emulator_image: bool = False  # the docker image is the emulator's (its label says so)

    @property
    def timeout(self) -> dict[str, Any]:
        return {} if self.startup_timeout is None else {"startup_timeout_s": self.startup_timeout}


@dataclass(frozen=True)
class LauncherKind:
    """One kind of launcher: built from a job's target, or from `tuner launch`'s options."""

    name: str
    from_job: Callable[[Job], Launcher]
    from_options: Callable[[LaunchOptions], Launcher]
    help: str


def build_launcher(job: Job) -> Launcher:
    """The job's launcher with its settings (secrets by name: values are read from the environment at start)."""
    kind = LAUNCHERS.get(job.target.launcher)
    if kind is None:
        raise ConfigError(f"target.launcher: unknown launcher {job.target.launcher!r}; use {', '.join(LAUNCHERS)}")
    return kind.from_job(job)


def _emulator_from_job(job: Job) -> Launcher:
    t, e = job.target, job.target.emulator
    extra = [*e.extra_args, *(["--seed", str(e.seed)] if e.seed is not None else [])]
    if t.profile is not None:
        # the emulator serves with the step times the twin predicts with (target.profile, resolved by the job)
        path = t.profile if t.profile.is_absolute() or job.source is None else job.source.parent / t.profile
        extra += ["--profile", str(path)]
    return EmulatorLauncher(
        model=t.model,
        gpu=job.gpu_profile().key,  # a catalog name: the job refuses auto and figures for the emulator
        time_scale=e.time_scale,
        memory_in_use_gib=e.memory_in_use_gib,
        extra_args=extra,
        startup_timeout_s=t.startup_timeout,
    )


def _docker_from_job(job: Job) -> Launcher:
    t, d = job.target, job.target.docker
    return DockerLauncher(
        image=d.image,
        model=d.model_id or job.model_profile().name,
        env=tuple(d.env),
        volumes=d.volumes,
        extra_args=d.extra_args,
        startup_timeout_s=t.startup_timeout,
        **({"vendor": job.gpu_profile().vendor} | d.options),
    )


def _process_from_job(job: Job) -> Launcher:
    t, p = job.target, job.target.process
    return ProcessLauncher(
        command=p.command,
        model=p.model_id or job.model_profile().name,
        extra_args=p.extra_args,
        secret_env=tuple(dict.fromkeys([*p.env, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"])),
        startup_timeout_s=t.startup_timeout,
        **p.options,
    )


def _secrets(o: LaunchOptions) -> list[str]:
    return ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] if o.env is None else o.env  # masked in what is shown


def _emulator_from_options(o: LaunchOptions) -> Launcher:
    return EmulatorLauncher(
        o.model or EMULATOR_MODEL,
        o.gpu,
        o.time_scale,
        o.memory_in_use_gib,
        o.extra_args,
        secret_env=_secrets(o),
        **o.timeout,
    )


def _process_from_options(o: LaunchOptions) -> Launcher:
    argv = shlex.split(o.command) if o.command else ["vllm", "serve", "{model}"]
    return ProcessLauncher(argv, o.model or VLLM_MODEL, extra_args=o.extra_args, secret_env=_secrets(o), **o.timeout)


def _docker_from_options(o: LaunchOptions) -> Launcher:
    if o.emulator_image:
        return DockerLauncher.for_emulator(
            o.image,
            o.model or EMULATOR_MODEL,
            o.gpu,
            o.time_scale,
            o.memory_in_use_gib,
            o.extra_args,
            env=o.env or [],
            volumes=o.volumes,
            **o.timeout,
        )
    return DockerLauncher(
        o.image,
        o.model or VLLM_MODEL,
        gpus=o.gpus,
        hf_cache=o.hf_cache or None,
        volumes=o.volumes,
        env=["HF_TOKEN"] if o.env is None else o.env,
        extra_args=o.extra_args,
        time_scale=o.time_scale,
        **o.timeout,
    )


LAUNCHERS: dict[str, LauncherKind] = {
    k.name: k
    for k in (
        LauncherKind("emulator", _emulator_from_job, _emulator_from_options, "CPU-only look-alike"),
        LauncherKind("process", _process_from_job, _process_from_options, "a local vllm serve"),
        LauncherKind("docker", _docker_from_job, _docker_from_options, "the vLLM container"),
    )
}
