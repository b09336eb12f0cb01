"""The target: what runs (the model, the GPU, how long it may take to start) and how, by one launcher kind.

Each launcher kind is registered once, as a field of `TargetSection`: the field's name is the kind a job names in
`target.launcher`, its type the options model `target.<kind>` holds (a `LauncherOptions`, which also says the kind
in a few words and the keyword arguments its `options:` may pass the launcher). `LAUNCHER_KINDS` is read from those
fields; the job's checks, `tuner.launch.factory` (which builds each kind) and `tuner launch --launcher` read it. The
launchers themselves sit above the job file (tuner.launch imports this, never the reverse): tests/launch check that
each kind's keywords are what its launcher takes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BeforeValidator, Field, model_validator

from tuner.config.fields import Duration, EnvNames, ExtraArgs, StrictModel, parse_cpu_list
from tuner.vllm_pin import PINNED_VLLM

__all__ = ["LAUNCHER_KINDS", "DockerOptions", "EmulatorOptions", "LauncherOptions", "ProcessOptions", "TargetSection"]


class LauncherOptions(StrictModel):
    """The options section of one launcher kind (`target.<kind>`)."""

    # What the kind is, in a few words (`tuner launch --help`).
    summary: ClassVar[str]
    # The keyword arguments `target.<kind>.options` may pass the launcher: those it takes that the job does not set
    # from its own fields.
    keywords: ClassVar[tuple[str, ...]] = ()


class EmulatorOptions(LauncherOptions):
    summary = "CPU-only look-alike"

    time_scale: float = Field(default=1.0, gt=0, description="the emulator runs this many times faster than the GPU")
    memory_in_use_gib: float = Field(default=0.0, ge=0, description="GPU memory other processes hold")
    seed: int | None = None
    extra_args: ExtraArgs = Field(default_factory=list)


class DockerOptions(LauncherOptions):
    summary = "the vLLM container"
    keywords = (
        "gpu_idle",
        "hf_cache",
        "pull",
        "pull_stall_s",
        "served_model_name",
        "shm_size",
        "stop_grace_s",
        "time_scale",
    )

    image: str = Field(default=f"vllm/vllm-openai:v{PINNED_VLLM}", description="the vLLM image to run")
    model_id: str | None = Field(default=None, description="Hugging Face id passed as --model (default: the model's)")
    env: EnvNames = Field(
        default_factory=list, description="names of environment variables passed through (HF_TOKEN, ...)"
    )
    volumes: dict[str, str] = Field(default_factory=dict, description="host path -> container path")
    extra_args: ExtraArgs = Field(default_factory=list, description="more vLLM arguments, e.g. [--load-format, dummy]")
    options: dict[str, Any] = Field(default_factory=dict, description="further DockerLauncher keyword arguments")


class ProcessOptions(LauncherOptions):
    summary = "a local vllm serve"
    keywords = ("cwd", "env", "gpu_idle", "host", "served_model_name", "state_dir", "stop_grace_s", "time_scale")

    command: list[str] = Field(
        default_factory=lambda: ["vllm", "serve", "{model}"],
        min_length=1,
        description="the server command; {model}, {host}, {port} are filled in",
    )
    model_id: str | None = None
    env: EnvNames = Field(default_factory=list)
    extra_args: ExtraArgs = Field(default_factory=list)
    options: dict[str, Any] = Field(default_factory=dict, description="further ProcessLauncher keyword arguments")


def _known_kind(value: Any) -> Any:
    # The kinds are TargetSection's own fields, read once the class exists: not a Literal that would spell them again.
    if not (isinstance(value, str) and value in LAUNCHER_KINDS):
        *first, last = (repr(k) for k in LAUNCHER_KINDS)
        raise ValueError(f"Input should be {', '.join(first)} or {last}")
    return value


def _kinds_schema(schema: dict[str, Any]) -> None:
    schema["enum"] = list(LAUNCHER_KINDS)


LauncherName = Annotated[str, BeforeValidator(_known_kind)]


# target.cpu_affinity: which cores vLLM's CPU build and the load client get (the plan is tuner.launch.affinity's)


class CpuAffinityCores(StrictModel):
    worker: str = Field(description="cores of vLLM's CPU worker (its OpenMP threads), a CPU list: 1, 2-7, 0,2,5")
    others: str = Field(description="cores of the API server, the engine core and tuner's load client")


def _cpu_affinity(value: Any) -> Any:
    """auto | off | {worker, others}, or one line saying what is allowed. YAML reads a bare `off` as false."""
    if value is False or (isinstance(value, str) and value.strip().lower() == "off"):
        return "off"
    if value is True or (isinstance(value, str) and value.strip().lower() == "auto"):
        return "auto"
    allowed = "use auto, off, or {worker: CORES, others: CORES} with CPU lists such as 1 or 2-7"
    if not isinstance(value, dict) or set(value) != {"worker", "others"}:
        raise ValueError(f"{value!r} is not allowed; {allowed}")
    cores = {}
    for role in ("worker", "others"):
        try:
            cores[role] = parse_cpu_list(str(value[role]))
        except ValueError as e:
            raise ValueError(f"{role}: {e}") from None
    if cores["worker"] & cores["others"]:
        raise ValueError("worker and others share cores; give each its own")
    return CpuAffinityCores(worker=str(value["worker"]), others=str(value["others"]))


CpuAffinity = Annotated[Literal["auto", "off"] | CpuAffinityCores, BeforeValidator(_cpu_affinity)]


class TargetSection(StrictModel):
    launcher: LauncherName = Field(default="emulator", json_schema_extra=_kinds_schema)
    model: str = Field(
        description="a Hugging Face id (Qwen/Qwen3-8B), a directory with config.json, or a built-in profile "
        "(llama-3.1-8b, qwen2.5-7b, ...)"
    )
    gpu: str | dict[str, Any] = Field(
        default="auto",
        description="auto (this machine's GPUs through NVML or amd-smi; docker and process launchers only), a "
        "catalog name (a10g, l4, l40s, h100-80gb, ...), cpu (vLLM's CPU build), or the GPU's figures "
        "{name, memory_gib, bandwidth_gbps?, bf16_tflops?}",
    )
    gpus: int | None = Field(
        default=None,
        ge=1,
        description="the GPUs of the deployment the study fills with replicas of each trial's shape (8: a TP-2 "
        "shape is 4 replicas, each measured under 1/4 of the load); default: 1 for the emulator, else the GPUs the "
        "machine has",
    )
    gpu_hour_usd: float | None = Field(
        default=None,
        gt=0,
        description="the price of one GPU-hour in USD, for $ per million tokens; default: the catalog's "
        "on-demand price for the card where it has one",
    )
    startup_timeout: Duration = Field(default=1200.0, description="how long a server may take to become ready")
    engine_wait: Duration = Field(
        default=300.0,
        description="how long a study waits for a container engine that stopped answering under a trial (Docker "
        "restarted); the trial runs again when it answers, the study stops past this",
    )
    profile: Path | None = Field(
        default=None,
        description="a device profile `tuner calibrate` wrote (JSON; relative to the job file): the twin's step "
        "times, fitted to a real server of this target, instead of the GPU's roofline",
    )
    # The launcher kinds, each registered here once: see the module's docstring.
    emulator: EmulatorOptions = Field(default_factory=EmulatorOptions)
    process: ProcessOptions = Field(default_factory=ProcessOptions)
    docker: DockerOptions = Field(default_factory=DockerOptions)
    # off by default: on a 2-core machine the plan halved throughput and made it far noisier (the API server,
    # engine core and load client starve on one core; benchmarks/README.md, real vLLM noise with the CPU plan)
    cpu_affinity: CpuAffinity = Field(
        default="off",
        description="gpu: cpu with the process launcher: off (bind nothing, the default), auto (vLLM's CPU worker "
        "gets cores of its own, the API server, engine core and load client the rest), or {worker: 1, others: 0}",
    )

    def section(self, kind: str) -> LauncherOptions:
        """The options section of `kind` (one of LAUNCHER_KINDS)."""
        options = getattr(self, kind)
        assert isinstance(options, LauncherOptions), kind
        return options

    @model_validator(mode="after")
    def _emulated_gpu_is_named(self) -> TargetSection:
        # The emulator imitates a card from its figures: there is no machine GPU to read, and `tuner emulate --gpu`
        # takes a name.
        if self.launcher == "emulator" and (not isinstance(self.gpu, str) or self.gpu.strip().lower() == "auto"):
            raise ValueError(
                "gpu: the emulator imitates a named GPU (rtx4090, l4, a100-80gb, h100-80gb, ...); auto and a GPU's "
                "figures are for the docker and process launchers"
            )
        return self


LAUNCHER_KINDS: dict[str, type[LauncherOptions]] = {
    name: field.annotation
    for name, field in TargetSection.model_fields.items()
    if isinstance(field.annotation, type) and issubclass(field.annotation, LauncherOptions)
}
