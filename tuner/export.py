"""A trial's flags as something to paste: `vllm serve` flags, a `--config` YAML, `docker run`, a compose service,
a Kubernetes Deployment + Service, JSON, or the `LLM(**kwargs)` of vLLM's Python API.

The GPUs are asked for as the study's vendor needs them: NVIDIA through its container runtime (`--gpus`, compose's
device reservation, `nvidia.com/gpu`), AMD through ROCm's device files (`/dev/kfd`, `/dev/dri`, the `video` group, as
vLLM's ROCm docs run its image) and the AMD device plugin's `amd.com/gpu`.

A box of several replicas (`target.gpus`, tuner.box) is written as the box runs: each replica its own disjoint GPUs
(`CUDA_VISIBLE_DEVICES`, compose's `device_ids`, `--gpus device=`) and its own host port; the Deployment at that many
replicas, each pod asking for one replica's GPUs. One replica is written as a single server, as it always was.

Every format that has comments carries the provenance (study, trial, image, GPU, model, workload hash, what was
measured, when), so a pasted line can be traced back to the measurement behind it. Secrets appear only by name:
`-e HF_TOKEN` passes the caller's variable through, compose interpolates `${HF_TOKEN}`, Kubernetes reads a Secret;
no secret value is ever read here.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

from tuner.errors import ConfigError
from tuner.flags import VllmFlags
from tuner.intervals import format_with_ci
from tuner.scoring import Figure, figures
from tuner.vllm_pin import PINNED_VLLM

__all__ = [
    "DEFAULT_IMAGE",
    "FORMATS",
    "K8S_GPU_RESOURCE",
    "VENDORS",
    "DeployOptions",
    "Provenance",
    "Renderer",
    "container_args",
    "export_format",
    "gpu_limits",
    "k8s_name",
    "kubernetes_with",
    "render",
    "replica_devices",
    "secret_ref",
    "serve_args",
    "yaml_documents",
]

DEFAULT_IMAGE = f"vllm/vllm-openai:v{PINNED_VLLM}"  # the vLLM tuner is tested against, not whatever :latest is today
_CONTAINER_HF_CACHE = "/root/.cache/huggingface"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_DNS_LABEL = re.compile(r"[^a-z0-9-]+")
VENDORS = ("nvidia", "amd")
# The extended resource each vendor's Kubernetes device plugin advertises.
K8S_GPU_RESOURCE = {"nvidia": "nvidia.com/gpu", "amd": "amd.com/gpu"}
# vLLM's ROCm docs' `docker run`: the compute (kfd) and render (dri) device files, their group, and the seccomp and
# ptrace allowances ROCm's runtime needs.
_AMD_DEVICE_FILES = ("/dev/kfd", "/dev/dri")
_AMD_GROUP = "video"
_AMD_CAPS = ("SYS_PTRACE",)
_AMD_SECURITY = ("seccomp=unconfined",)
# The variable that hides all but a server's own GPUs from it: vLLM's ROCm platform reads HIP's, as PyTorch does.
VISIBLE_DEVICES_ENV = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}


class _PlainDumper(yaml.SafeDumper):
    """No `&id001` anchors: a manifest a person reads should spell every value out."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _yaml(doc: Any) -> str:
    return yaml.dump(doc, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)


def yaml_documents(docs: Sequence[Any]) -> str:
    """Kubernetes objects as one YAML stream (`---` between them), every value spelled out."""
    return yaml.dump_all(docs, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)


def k8s_name(text: str, limit: int = 63, fallback: str = "vllm") -> str:
    """`text` made a valid Kubernetes object name (an RFC 1123 label) of at most `limit` characters."""
    return _DNS_LABEL.sub("-", text.lower()).strip("-")[:limit].strip("-") or fallback


def secret_ref(var: str, secret: str, key: str) -> dict[str, Any]:
    """A container's environment variable read from a Secret's key: the value never appears in the manifest."""
    return {"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def gpu_limits(resource: str | None, count: int) -> dict[str, Any]:
    """A container's `resources` asking for `count` of the GPUs' extended resource (Kubernetes requests one at its
    limit); none for a resource of None (vLLM's CPU build)."""
    return {"resources": {"limits": {resource: count}}} if resource else {}


Renderer = Callable[["VllmFlags", "DeployOptions", "Provenance | None"], str]
# The export formats by name, in the order `tuner export --format` lists them: filled by `@export_format`.
FORMATS: dict[str, Renderer] = {}


_AnyRenderer = TypeVar("_AnyRenderer", bound=Renderer)


def export_format(name: str) -> Callable[[_AnyRenderer], _AnyRenderer]:
    """Register a renderer `(flags, options, provenance) -> str` as the export format `name`."""

    def register(renderer: _AnyRenderer) -> _AnyRenderer:
        if name in FORMATS:
            raise ValueError(f"export format {name!r} is registered twice")
        FORMATS[name] = renderer
        return renderer

    return register


@dataclass(frozen=True)
class Provenance:
    """Where a set of flags came from, written beside them."""

    study: str
    trial: int
    baseline: bool = False
    image: str | None = None
    gpu: str | None = None
    model: str | None = None
    launcher: str | None = None
    workload_hash: str | None = None
    output_tok_s: float | None = None
    objective_latency_s: float | None = None  # the latency the study minimised: its `latency_metric`
    latency_metric: str | None = None
    latencies: Mapping[str, float] = field(default_factory=dict)  # the figures it recorded by name, in seconds
    # The figures quoted (the study's SLOs' and objective's, then the registry's headline ones: `StudyView
    # .headline_figures`); () quotes the registry's headline ones.
    shown_figures: tuple[Figure, ...] = ()
    success_rate: float | None = None
    slos: tuple[str, ...] = ()
    tuner_version: str | None = None
    vllm_version: str | None = None  # what the measured server's /version said
    notes: tuple[str, ...] = ()  # what a reader must know about these figures (e.g. a pinned image of another version)
    verify_command: str | None = None  # the `tuner verify` line that launches these flags again and confirms them
    # The figures' 95% intervals (value, low, high) by the record's names (`output_tok_s`, `ttft_p95_s`,
    # `success_rate`): over the flag set's `starts` where the study started it more than once, else its run's own
    intervals: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    starts: int = 1
    exported_at: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.UTC))

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "study": self.study,
            "trial": self.trial,
            "baseline": self.baseline,
            "image": self.image,
            "gpu": self.gpu,
            "model": self.model,
            "launcher": self.launcher,
            "workload_hash": self.workload_hash,
            "output_tok_s": self.output_tok_s,
            "objective_latency_s": self.objective_latency_s,
            "latency_metric": self.latency_metric,
            "latency_p95_s": self.objective_latency_s,  # its name in tuner 0.1, whatever its statistic
            **{f.attr: self.latencies.get(f.name) for f in (*figures(), *self.shown_figures)},
            "success_rate": self.success_rate,
            "slos": list(self.slos),
            "tuner_version": self.tuner_version,
            "vllm_version": self.vllm_version,
            "notes": list(self.notes),
            "verify_command": self.verify_command,
            "intervals": {k: list(v) for k, v in self.intervals.items()},
            "starts": self.starts,
            "exported_at": self.exported_at.isoformat(timespec="seconds"),
        }
        return d

    def _objective_label(self) -> str:
        """ "latency P95" for an e2e_p95 objective, "latency P99" for a ttft_p99; "latency" when not known."""
        figure = Figure.named(self.latency_metric or "")
        return f"latency {figure.stat.upper()}" if figure is not None else "latency"

    def _figure(self, name: str, unit: str, bare: str) -> str:
        """`1,371 ± 40 output tok/s` where the interval of that figure is kept (its figure: over the starts, where
        pooled), else the figure as it was shown."""
        ci = self.intervals.get(name)
        if ci is None:
            return bare if unit in ("s", "fraction") else f"{bare} {unit}"
        return format_with_ci(ci[0], ci[1], ci[2], unit)

    def comment_lines(self) -> list[str]:
        """Short lines, without the comment marker; each a single line whatever the stored strings hold."""
        which = "baseline (vLLM defaults)" if self.baseline else "tuned"
        lines = [f"tuner export: study {self.study!r}, trial {self.trial} ({which})"]
        where = [(k, v) for k, v in (("GPU", self.gpu), ("model", self.model), ("image", self.image)) if v]
        where += [("launcher", self.launcher)] if self.launcher else []
        where += [("vLLM", self.vllm_version)] if self.vllm_version else []
        if where:
            lines.append("measured on: " + ", ".join(f"{k} {v}" for k, v in where))
        measured = []
        if self.output_tok_s is not None:
            measured.append(self._figure("output_tok_s", "output tok/s", f"{self.output_tok_s:,.1f}"))
        if self.objective_latency_s is not None:
            objective = self.objective_latency_s
            shown = self._figure(f"{self.latency_metric}_s", "s", f"{objective:.3f} s")
            measured.append(f"{self._objective_label()} {shown}")
        for f in self.shown_figures or tuple(f for f in figures() if f.headline):
            value = self.latencies.get(f.name)
            if value is not None:
                measured.append(f"{f.label} {self._figure(f.attr, 's', f'{value:.3f} s')}")
        if self.success_rate is not None:
            rate = self.success_rate
            measured.append(f"success {self._figure('success_rate', 'fraction', f'{rate:.1%}')}")
        if measured:
            starts = f" (± 95% CI over {self.starts} starts)" if self.starts > 1 else ""
            starts = starts or (" (± 95% CI within the run)" if self.intervals else "")
            lines.append("measured" + starts + ": " + ", ".join(measured))
        if self.slos:
            lines.append("SLOs: " + ", ".join(self.slos))
        if self.workload_hash:
            lines.append(f"workload hash: {self.workload_hash}")
        lines += [f"note: {note}" for note in self.notes]
        if self.verify_command:
            lines.append(f"re-verify: {self.verify_command}")
        stamp = self.exported_at.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
        lines.append(f"exported {stamp}" + (f" by tuner {self.tuner_version}" if self.tuner_version else ""))
        return [_one_line(line) for line in lines]


@dataclass(frozen=True)
class DeployOptions:
    """What the deployment around the flags looks like; everything but the model has a usual default."""

    model: str
    image: str = DEFAULT_IMAGE
    served_model_name: str | None = None
    port: int = 8000
    name: str = "vllm"
    hf_cache: str | None = None  # host directory of the Hugging Face cache; None = $HOME/.cache/huggingface
    secret_env: tuple[str, ...] = ("HF_TOKEN",)
    k8s_secret: str = "hf-token"
    gpu_vendor: str = "nvidia"  # how the deployment is given its GPUs (the study's GPU's vendor)
    replicas: int = 1  # servers of the flags' shape side by side on one box (tuner.box), each on its own GPUs

    def __post_init__(self) -> None:
        if not self.model.strip():
            raise ConfigError("export needs a model name (a Hugging Face id or a path), got an empty one")
        if self.gpu_vendor not in VENDORS:
            raise ConfigError(f"GPU vendor must be one of {', '.join(VENDORS)}, not {self.gpu_vendor!r}")
        if not 1 <= self.port <= 65535:
            raise ConfigError(f"port must be in 1..65535, got {self.port}")
        if self.replicas < 1 or self.port + self.replicas - 1 > 65535:
            raise ConfigError(f"replicas must be 1 or more with ports {self.port}.. up to 65535, got {self.replicas}")
        for name in self.secret_env:
            if not _ENV_NAME.match(name):
                raise ConfigError(f"secret variable name {name!r} is not a valid environment variable name")

    @property
    def dns_name(self) -> str:
        """`name` made a valid Kubernetes object name (RFC 1123 label)."""
        return k8s_name(self.name)


def serve_args(flags: VllmFlags, options: DeployOptions) -> list[str]:
    """The arguments after `vllm serve`: the model positional, then the flags."""
    return [options.model, *_server_args(flags, options)]


def container_args(flags: VllmFlags, options: DeployOptions) -> list[str]:
    """The arguments appended to the vllm/vllm-openai entrypoint (`--model` works with old and new images)."""
    return ["--model", options.model, *_server_args(flags, options)]


def render(fmt: str, flags: VllmFlags, options: DeployOptions, provenance: Provenance | None = None) -> str:
    """The flags in format `fmt` (one of FORMATS), ready to paste, ending with a newline."""
    renderer = FORMATS.get(fmt)
    if renderer is None:
        raise ConfigError(f"unknown export format {fmt!r}; allowed: {', '.join(FORMATS)}")
    return renderer(flags, options, provenance)


def replica_devices(replicas: int, world_size: int) -> list[str]:
    """Each replica's GPUs as `CUDA_VISIBLE_DEVICES` lists them: disjoint runs of `world_size` indices, in order, so
    a tensor parallel group sits on neighbouring GPUs (on most boxes the ones an NVLink or PCIe switch joins)."""
    size = max(1, world_size)
    return [",".join(str(i * size + k) for k in range(size)) for i in range(replicas)]


def _replicas(flags: VllmFlags, options: DeployOptions) -> list[tuple[str, int]]:
    """(visible devices, host port) of each replica: its own GPUs, and ports counting up from `options.port`."""
    devices = replica_devices(options.replicas, flags.world_size)
    return [(d, options.port + i) for i, d in enumerate(devices)]


def _box_comment(flags: VllmFlags, options: DeployOptions) -> str:
    n, size = options.replicas, flags.world_size
    last = options.port + n - 1
    return (
        f"# box: {n} replicas x {size} GPU{'s' if size > 1 else ''} (tensor x pipeline parallel) = {n * size} GPUs, "
        f"ports {options.port}-{last}\n# a load balancer in front of them shares the load\n"
    )


def _server_args(flags: VllmFlags, options: DeployOptions, port: int | None = None) -> list[str]:
    """The server's options; `port` (a replica's) is always written, the deployment's only where not vLLM's 8000."""
    args: list[str] = []
    if options.served_model_name:
        args += ["--served-model-name", options.served_model_name]
    if port is not None or options.port != 8000:
        args += ["--port", str(options.port if port is None else port)]
    return args + flags.to_args()


def _comments(provenance: Provenance | None, marker: str = "#") -> str:
    if provenance is None:
        return ""
    return "".join(f"{marker} {line}\n" for line in provenance.comment_lines())


def _one_line(text: str) -> str:
    return " ".join(text.split())


@export_format("vllm-args")
def _vllm_args(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
    if options.replicas == 1:
        return _comments(provenance) + shlex.join(["vllm", "serve", *serve_args(flags, options)]) + "\n"
    env = VISIBLE_DEVICES_ENV[options.gpu_vendor]
    lines = [
        f"{env}={devices} " + shlex.join(["vllm", "serve", options.model, *_server_args(flags, options, port)]) + " &"
        for devices, port in _replicas(flags, options)
    ]
    return _comments(provenance) + _box_comment(flags, options) + "\n".join(lines) + "\nwait\n"


@export_format("vllm-config")
def _vllm_config(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
    # vLLM's --config file: the long option names as keys; a false boolean becomes --no-<key>.
    config: dict[str, Any] = {"model": options.model}
    if options.served_model_name:
        config["served-model-name"] = options.served_model_name
    if options.port != 8000:
        config["port"] = options.port
    for key, value in _flag_items(flags):
        config[key] = value
    body = _yaml(config)
    if options.replicas == 1:
        return _comments(provenance) + "# usage: vllm serve --config vllm-config.yaml\n" + body
    # vLLM's own command line wins over its --config file: each replica's port is given there.
    env = VISIBLE_DEVICES_ENV[options.gpu_vendor]
    usage = "".join(
        f"#   {env}={devices} vllm serve --config vllm-config.yaml --port {port} &\n"
        for devices, port in _replicas(flags, options)
    )
    return _comments(provenance) + _box_comment(flags, options) + "# usage, one server a replica:\n" + usage + body


def _flag_items(flags: VllmFlags) -> list[tuple[str, Any]]:
    """(option name without dashes, typed value) for every flag `to_args()` would pass."""
    items: list[tuple[str, Any]] = []
    args = flags.to_args()
    i = 0
    while i < len(args):
        name = args[i].removeprefix("--")
        if i + 1 < len(args) and not args[i + 1].startswith("--"):
            items.append((name, _typed(flags, name, args[i + 1])))
            i += 2
        else:
            # A bare switch: `--no-x` is x=false, `--x` is x=true.
            if name.startswith("no-"):
                items.append((name.removeprefix("no-"), False))
            else:
                items.append((name, True))
            i += 1
    return items


def _typed(flags: VllmFlags, name: str, text: str) -> Any:
    field_name = name.replace("-", "_")
    dumped = flags.model_dump()
    if field_name in dumped and dumped[field_name] is not None:
        return dumped[field_name]
    if field_name in flags.extra:
        return flags.extra[field_name]
    return text


def _docker_gpu_lines(vendor: str, devices: str | None = None, name: str | None = None) -> list[str]:
    """The `docker run` head that gives the container its GPUs: all of them, or (a replica) `devices` only."""
    run = "docker run" if name is None else f"docker run -d --name {shlex.quote(name)}"
    if vendor == "amd":
        # The device files carry every AMD GPU; HIP's variable leaves the replica its own.
        env = [] if devices is None else [f"-e {VISIBLE_DEVICES_ENV['amd']}={devices}"]
        return [
            f"{run} --ipc=host",
            " ".join(f"--device {d}" for d in _AMD_DEVICE_FILES),
            f"--group-add {_AMD_GROUP} "
            + " ".join(f"--cap-add {c}" for c in _AMD_CAPS)
            + " "
            + " ".join(f"--security-opt {o}" for o in _AMD_SECURITY),
            *env,
        ]
    gpus = "all" if devices is None else shlex.quote(f'"device={devices}"')
    return [f"{run} --runtime nvidia --gpus {gpus} --ipc=host"]


def _docker_lines(flags: VllmFlags, options: DeployOptions, replica: tuple[int, str, int] | None = None) -> list[str]:
    """One `docker run`; `replica` (index, devices, host port) runs it detached, named, on that replica's GPUs."""
    cache = '"$HOME/.cache/huggingface"' if options.hf_cache is None else shlex.quote(options.hf_cache)
    head = _docker_gpu_lines(options.gpu_vendor)
    host_port = options.port
    if replica is not None:
        index, devices, host_port = replica
        head = _docker_gpu_lines(options.gpu_vendor, devices, f"{options.dns_name}-{index}")
    lines = [*head, f"-p {host_port}:{options.port}", f"-v {cache}:{_CONTAINER_HF_CACHE}"]
    lines += [f"-e {name}" for name in options.secret_env]
    lines.append(shlex.quote(options.image))
    lines.append(shlex.join(container_args(flags, options)))
    return lines


@export_format("docker")
def _docker(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
    # `-e NAME` without a value hands the caller's variable to the container: the token never appears here.
    if options.replicas == 1:
        return _comments(provenance) + " \\\n  ".join(_docker_lines(flags, options)) + "\n"
    runs = [
        " \\\n  ".join(_docker_lines(flags, options, (i, devices, port)))
        for i, (devices, port) in enumerate(_replicas(flags, options))
    ]
    return _comments(provenance) + _box_comment(flags, options) + "\n".join(runs) + "\n"


def _compose_gpus(flags: VllmFlags, vendor: str, devices: str | None = None) -> dict[str, Any]:
    """The service's keys that give it its GPUs: (a replica) `devices` only."""
    if vendor == "amd":
        # Every AMD GPU is behind the two device files; vLLM takes the first world-size of them (of `devices`).
        return {
            "devices": [f"{d}:{d}" for d in _AMD_DEVICE_FILES],
            "group_add": [_AMD_GROUP],
            "cap_add": list(_AMD_CAPS),
            "security_opt": list(_AMD_SECURITY),
        }
    n = flags.world_size
    device: dict[str, Any] = {"driver": "nvidia", "count": n if n > 1 else "all", "capabilities": ["gpu"]}
    if devices is not None:  # compose takes a count or the ids, not both
        device = {"driver": "nvidia", "device_ids": devices.split(","), "capabilities": ["gpu"]}
    return {"deploy": {"resources": {"reservations": {"devices": [device]}}}}


def _compose_service(
    flags: VllmFlags, options: DeployOptions, host_port: int, devices: str | None = None
) -> dict[str, Any]:
    cache = "${HOME}/.cache/huggingface" if options.hf_cache is None else options.hf_cache.replace("$", "$$")
    env = {name: "${" + name + "}" for name in options.secret_env}
    if devices is not None and options.gpu_vendor == "amd":
        env[VISIBLE_DEVICES_ENV["amd"]] = devices
    service: dict[str, Any] = {
        "image": options.image,
        # Compose interpolates `$` in every string: escape the flags' own.
        "command": [a.replace("$", "$$") for a in container_args(flags, options)],
        "ports": [f"{host_port}:{options.port}"],
        "ipc": "host",
        "volumes": [f"{cache}:{_CONTAINER_HF_CACHE}"],
        "environment": env,
        **_compose_gpus(flags, options.gpu_vendor, devices),
    }
    if not env:
        del service["environment"]
    return service


@export_format("compose")
def _compose(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
    usage = "usage: docker compose -f compose.yaml up -d   (with HF_TOKEN exported in your shell)"
    if options.replicas == 1:
        doc = {"services": {options.dns_name: _compose_service(flags, options, options.port)}}
        return _comments(provenance) + f"# {usage}\n" + _yaml(doc)
    services = {
        f"{options.dns_name}-{i}": _compose_service(flags, options, port, devices)
        for i, (devices, port) in enumerate(_replicas(flags, options))
    }
    return _comments(provenance) + _box_comment(flags, options) + f"# {usage}\n" + _yaml({"services": services})


def kubernetes_with(
    flags: VllmFlags,
    options: DeployOptions,
    provenance: Provenance | None,
    *,
    replicas: int,
    extra: Sequence[dict[str, Any]],
) -> str:
    """The kubernetes format for a capacity plan: the Deployment at `replicas`, then `extra` objects (the
    autoscaler, the alert rules) in the same stream."""
    return _kubernetes(flags, options, provenance, replicas=replicas, extra=extra)


def _k8s_container(flags: VllmFlags, options: DeployOptions) -> dict[str, Any]:
    """The vLLM container of the Deployment: its flags, the GPUs, the caches it mounts, the health probes."""
    container: dict[str, Any] = {
        "name": "vllm",
        "image": options.image,
        "args": container_args(flags, options),
        "ports": [{"name": "http", "containerPort": options.port}],
        "env": [secret_ref(env, options.k8s_secret, env) for env in options.secret_env],
        **gpu_limits(K8S_GPU_RESOURCE[options.gpu_vendor], flags.world_size),
        "volumeMounts": [
            {"name": "hf-cache", "mountPath": _CONTAINER_HF_CACHE},
            # vLLM's workers share tensors through /dev/shm: the pod's answer to `--ipc=host`.
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
        "startupProbe": {
            "httpGet": {"path": "/health", "port": "http"},
            "periodSeconds": 10,
            "failureThreshold": 90,
        },
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 5},
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 15},
    }
    if not container["env"]:
        del container["env"]
    return container


@export_format("kubernetes")
def _kubernetes(
    flags: VllmFlags,
    options: DeployOptions,
    provenance: Provenance | None,
    *,
    replicas: int | None = None,
    extra: Sequence[dict[str, Any]] = (),
) -> str:
    """The Deployment at `replicas` (default: the box's), each pod asking for one replica's GPUs (its world size:
    Kubernetes requests an extended resource at its limit), its Service, then `extra`."""
    name = options.dns_name
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/managed-by": "tuner"}
    annotations = {}
    if provenance is not None:
        annotations = {
            "tuner/study": provenance.study,
            "tuner/trial": str(provenance.trial),
            "tuner/workload-hash": provenance.workload_hash or "",
        }
    container = _k8s_container(flags, options)
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels, **({"annotations": annotations} if annotations else {})},
        "spec": {
            "replicas": options.replicas if replicas is None else replicas,
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [container],
                    "volumes": [
                        # Swap for a PersistentVolumeClaim to keep downloaded weights across restarts.
                        {"name": "hf-cache", "emptyDir": {}},
                        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
                    ],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "selector": {"app.kubernetes.io/name": name},
            "ports": [{"name": "http", "port": options.port, "targetPort": "http"}],
        },
    }
    secret_hint = ""
    if options.secret_env:
        keys = " ".join(f'--from-literal={env}="${env}"' for env in options.secret_env)
        secret_hint = f"# needs: kubectl create secret generic {options.k8s_secret} {keys}\n"
    return _comments(provenance) + secret_hint + yaml_documents([deployment, service, *extra])


@export_format("json")
def _json(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
    doc: dict[str, Any] = {
        "model": options.model,
        "image": options.image,
        "flags": flags.as_dict(),
        "vllm_serve_args": serve_args(flags, options),
        "container_args": container_args(flags, options),
        "secret_env": list(options.secret_env),
        "provenance": provenance.as_dict() if provenance is not None else None,
    }
    if options.replicas > 1:
        env = VISIBLE_DEVICES_ENV[options.gpu_vendor]
        doc["replicas"] = [
            {env: devices, "port": port, "vllm_serve_args": [options.model, *_server_args(flags, options, port)]}
            for devices, port in _replicas(flags, options)
        ]
    return json.dumps(doc, indent=2) + "\n"


@export_format("python")
def _python(flags: VllmFlags, options: DeployOptions, provenance: Provenance | None) -> str:
    # vLLM's LLM class has larger scheduler defaults than the server: every tuned value is written out, so the
    # engine gets what was measured (an unset one is left to vLLM, as in the trial).
    kwargs: dict[str, Any] = {"model": options.model, **flags.as_dict()}
    if options.served_model_name:
        kwargs["served_model_name"] = options.served_model_name
    body = "".join(f"    {k!r}: {v!r},\n" for k, v in kwargs.items())
    box = ""
    if options.replicas > 1:
        env = VISIBLE_DEVICES_ENV[options.gpu_vendor]
        shown = "; ".join(f"{env}={devices}" for devices, _ in _replicas(flags, options))
        box = f"# The box runs {options.replicas} replicas of this engine, one process each: {shown}\n"
    return (
        _comments(provenance)
        + box
        + "".join(f"# {env} is read from the environment; never write its value here.\n" for env in options.secret_env)
        + "from vllm import LLM\n\n"
        + "engine_kwargs = {\n"
        + body
        + "}\n"
        + "llm = LLM(**engine_kwargs)\n"
    )
