"""The launcher kinds by name: the one place a job's target (`tuner tune`, `tuner verify`) or `tuner launch`'s
options become a Launcher.

The kinds and their options are registered in the job's schema (tuner.config.target: one field of `TargetSection`
each), which sits below the launchers; here each registered kind gets its builders. A new kind is its launcher
module, its options model and field there, and one `_BUILDERS` entry here.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tuner.config import LAUNCHER_KINDS, Job
from tuner.errors import ConfigError
from tuner.launch.affinity import CpuPlan, plan_from_setting
from tuner.launch.base import Launcher
from tuner.launch.docker import DockerLauncher
from tuner.launch.emulator import EmulatorLauncher
from tuner.launch.gpu_idle import GpuIdleWaiter, nvml_probe
from tuner.launch.gpu_pool import visible_ids
from tuner.launch.pinning import usable_cpus
from tuner.launch.process import ProcessLauncher

__all__ = [
    "EMULATOR_MODEL",
    "LAUNCHERS",
    "VLLM_MODEL",
    "Devices",
    "LaunchOptions",
    "LauncherKind",
    "build_launcher",
    "cpu_plan",
    "visible_devices_env",
]

Devices = tuple[str, ...] | None
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
    cpu_affinity: str | dict[str, str] | None = None  # process: auto, off, {worker, others}; None: auto on gpu cpu

    @property
    def timeout(self) -> dict[str, Any]:
        return {} if self.startup_timeout is None else {"startup_timeout_s": self.startup_timeout}


@dataclass(frozen=True)
class LauncherKind:
    """One kind of launcher: built from a job's target, or from `tuner launch`'s options.

    `launcher` is its class and `set_by_job` the keyword arguments `from_job` gives it from the job's own fields:
    the rest are what `target.<kind>.options` may give (the kind's registered keywords; tests/launch hold them to
    the class's signature)."""

    name: str
    from_job: Callable[[Job, Devices], Launcher]
    from_options: Callable[[LaunchOptions], Launcher]
    launcher: type[Launcher]
    set_by_job: frozenset[str] = frozenset()

    @property
    def help(self) -> str:
        return LAUNCHER_KINDS[self.name].summary


def build_launcher(job: Job, devices: Devices = None) -> Launcher:
    """The job's launcher with its settings (secrets by name: values are read from the environment at start).

    `devices`: the GPUs its servers get (a `--parallel` worker's borrowed set); None leaves them to the launcher's
    default (every GPU the machine shows it)."""
    kind = LAUNCHERS.get(job.target.launcher)
    if kind is None:
        raise ConfigError(f"target.launcher: unknown launcher {job.target.launcher!r}; use {', '.join(LAUNCHERS)}")
    return kind.from_job(job, devices)


def visible_devices_env(devices: Devices, vendor: str = "nvidia") -> dict[str, str]:
    """What a process is told of its GPUs: CUDA_VISIBLE_DEVICES (vLLM's ROCm build reads HIP_VISIBLE_DEVICES).

    The ids are NVML's, which count in PCI bus order; CUDA counts fastest first unless told otherwise, so on a box
    of mixed cards index 1 would be another GPU than the one borrowed. CUDA_DEVICE_ORDER=PCI_BUS_ID makes them one
    (a user's own choice of order is kept)."""
    if devices is None:
        return {}
    ids = ",".join(devices)
    order = {"CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
    return {"CUDA_VISIBLE_DEVICES": ids} | order | ({"HIP_VISIBLE_DEVICES": ids} if vendor == "amd" else {})


def _idle_waiter(devices: Devices) -> dict[str, Any]:
    # Other workers' servers hold the other GPUs: only this set's memory must be back to idle before a start.
    if devices is None or not all(d.isdigit() for d in devices):
        return {}
    return {"gpu_idle": GpuIdleWaiter(nvml_probe([int(d) for d in devices]))}


def _emulator_from_job(job: Job, devices: Devices) -> Launcher:
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
        # The emulator holds no GPU; it is told its set as vLLM would be, and refuses a world size beyond it.
        env=visible_devices_env(devices) or None,
    )


def _docker_from_job(job: Job, devices: Devices) -> Launcher:
    t, d = job.target, job.target.docker
    options = dict(d.options)
    if devices is not None:
        options["gpus"] = list(devices)  # Docker's device_ids (AMD: HIP_VISIBLE_DEVICES, tuner.launch.docker)
        options.update(_idle_waiter(devices))
    return DockerLauncher(
        image=d.image,
        model=d.model_id or job.model_profile().name,
        env=tuple(d.env),
        volumes=d.volumes,
        extra_args=d.extra_args,
        startup_timeout_s=t.startup_timeout,
        **({"vendor": job.gpu_profile().vendor} | options),
    )


def cpu_plan(job: Job) -> CpuPlan | None:
    """The cores of a `gpu: cpu` job's server and load client on this machine (target.cpu_affinity); None where
    the launcher does not place them (a GPU, the docker launcher, the emulator)."""
    if job.target.launcher != "process" or not job.gpu_profile().is_cpu:
        return None
    return cpu_plan_from(job.target.cpu_affinity, "target.cpu_affinity")


def cpu_plan_from(setting: Any, what: str) -> CpuPlan:
    """`auto`, `off`, or the {worker, others} cores (a mapping or a model of one) planned on this machine."""
    given = setting if isinstance(setting, str | dict) else {"worker": setting.worker, "others": setting.others}
    try:
        return plan_from_setting(given, usable_cpus(), os.environ)
    except ValueError as e:
        raise ConfigError(f"{what}: {e}") from None


def _process_from_job(job: Job, devices: Devices) -> Launcher:
    t, p = job.target, job.target.process
    options = dict(p.options)
    if devices is not None:
        options["env"] = {**options.get("env", {}), **visible_devices_env(devices, job.gpu_profile().vendor)}
        options.update(_idle_waiter(devices))
    elif os.environ.get("CUDA_VISIBLE_DEVICES", "").strip():
        # The server inherits the tuner's CUDA_VISIBLE_DEVICES: only those GPUs are its to wait on and to lose (one
        # lost elsewhere on the box says nothing of this study's trials).
        options.update(_idle_waiter(visible_ids(())))
    return ProcessLauncher(
        command=p.command,
        model=p.model_id or job.model_profile().name,
        extra_args=p.extra_args,
        secret_env=tuple(dict.fromkeys([*p.env, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"])),
        startup_timeout_s=t.startup_timeout,
        cpu_plan=cpu_plan(job),
        **options,
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
    setting = o.cpu_affinity if o.cpu_affinity is not None else "off"  # auto on request: see TargetSection
    plan = cpu_plan_from(setting, "--cpu-affinity") if setting != "off" else None
    return ProcessLauncher(
        argv, o.model or VLLM_MODEL, extra_args=o.extra_args, secret_env=_secrets(o), cpu_plan=plan, **o.timeout
    )


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


# How each kind registered in the job's schema is built (tests/study/test_study_record.py: every one is).
LAUNCHERS: dict[str, LauncherKind] = {
    k.name: k
    for k in (
        LauncherKind("emulator", _emulator_from_job, _emulator_from_options, EmulatorLauncher),
        LauncherKind(
            "process",
            _process_from_job,
            _process_from_options,
            ProcessLauncher,
            frozenset({"command", "model", "extra_args", "secret_env", "startup_timeout_s", "cpu_plan"}),
        ),
        LauncherKind(
            "docker",
            _docker_from_job,
            _docker_from_options,
            DockerLauncher,
            frozenset(
                {"image", "model", "env", "volumes", "extra_args", "startup_timeout_s", "vendor", "gpus", "client"}
            ),
        ),
    )
}
