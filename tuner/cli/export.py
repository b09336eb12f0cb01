"""`tuner export`: the winning flags as `vllm serve` flags, YAML, docker, compose, Kubernetes, JSON or Python."""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Annotated

import typer

from tuner.cli import app
from tuner.cli.common import measured_trial, open_view, trial_detail, trial_flags, write_output
from tuner.cli.options import (
    BestOpt,
    ImageOpt,
    JobOpt,
    NameOpt,
    OutputOpt,
    PeakOpt,
    PortOpt,
    SecretEnvOpt,
    StorageOpt,
    StudyArg,
    TrialOpt,
)
from tuner.errors import ConfigError
from tuner.export import FORMATS, render
from tuner.report import StudyView, TrialView
from tuner.report.deployment import deploy_options, provenance
from tuner.ship.manifest import PlanInputs, planned_kubernetes
from tuner.store import safe_url

__all__ = ["ExportRequest", "export_cmd", "exported"]


FormatOpt = Annotated[str, typer.Option("--format", "-f", help=f"One of: {', '.join(FORMATS)}.")]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="Model to serve (default: the study's).", show_default=False)
]
PlanOpt = Annotated[
    float | None,
    typer.Option(
        "--plan",
        help="With --format kubernetes: plan for this many req/s (see tuner plan): the Deployment at the plan's "
        "replicas, an HPA on vLLM's queue, the PrometheusRule.",
        show_default=False,
    ),
]
ReplicasOpt = Annotated[
    int | None,
    typer.Option(
        "--replicas",
        help="Servers of the trial's shape, each on its own GPUs and port (default: the study's box, target.gpus "
        "// (tensor x pipeline parallel); 1 without one).",
        show_default=False,
    ),
]


@dataclass(frozen=True)
class ExportRequest:
    """What `tuner export` was asked for, checked before the study is read."""

    fmt: str
    trial: int | None
    best: str
    model: str | None
    image: str | None
    port: int
    name: str
    secret_env: tuple[str, ...] | None
    plan_rate: float | None
    peak: float | None
    replicas: int | None

    def check(self) -> None:
        if self.fmt not in FORMATS:
            raise ConfigError(f"unknown --format {self.fmt!r}; allowed: {', '.join(FORMATS)}")
        if (self.plan_rate is not None or self.peak is not None) and self.fmt != "kubernetes":
            raise ConfigError(f"--plan and --peak go with --format kubernetes, not {self.fmt!r}")
        if self.peak is not None and self.plan_rate is None:
            raise ConfigError("--peak needs --plan R, the requests per second to serve")
        if self.replicas is not None and self.replicas < 1:
            raise ConfigError(f"--replicas {self.replicas}: give 1 or more servers")
        if self.plan_rate is not None and (
            self.plan_rate <= 0 or (self.peak is not None and self.peak < self.plan_rate)
        ):
            raise ConfigError("--plan must be above 0 and --peak at least --plan")


@app.command("export")
def export_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    fmt: FormatOpt = "vllm-args",
    trial: TrialOpt = None,
    best: BestOpt = "throughput",
    model: ModelOpt = None,
    image: ImageOpt = None,
    port: PortOpt = 8000,
    name: NameOpt = "vllm",
    secret_env: SecretEnvOpt = None,
    output: OutputOpt = None,
    plan_rate: PlanOpt = None,
    peak: PeakOpt = None,
    replicas: ReplicasOpt = None,
) -> None:
    """The winning flags, ready to paste: `vllm serve` flags, a --config YAML, `docker run`, a compose service, a
    Kubernetes Deployment + Service, JSON or `LLM(**kwargs)`, with provenance comments. Secrets by name only.

    A box of several replicas (target.gpus) is written as it ran: `vllm serve` lines each with its own
    CUDA_VISIBLE_DEVICES and port, one compose service or `docker run` a replica on its own GPUs, the Deployment at
    the replicas with each pod's GPU request its world size.

    Example: [bold]tuner export night --best balanced --format kubernetes --plan 20 --peak 35 -o vllm.yaml[/bold]

    Example: [bold]tuner export box8 --format vllm-args --replicas 4[/bold]
    """
    secrets = tuple(secret_env) if secret_env is not None else None
    request = ExportRequest(fmt, trial, best, model, image, port, name, secrets, plan_rate, peak, replicas)
    request.check()
    url, view = open_view(study, storage, job)
    t, text = exported(url, view, request)
    write_output(text, output, f"trial {t.number}, {fmt}")


def exported(url: str, view: StudyView, request: ExportRequest) -> tuple[TrialView, str]:
    """The trial picked and its export's text (a planned Kubernetes export says its plan on stderr)."""
    t = measured_trial(view, request.trial, request.best)
    if request.trial is not None and not t.feasible:
        typer.echo(f"warning: trial {request.trial} {t.verdict}", err=True)
    options = deploy_options(
        view,
        t,
        model=request.model,
        image=request.image,
        port=request.port,
        name=request.name,
        secret_env=request.secret_env,
    )
    options = dataclasses.replace(options, replicas=request.replicas or t.replicas or 1)
    again = f"tuner verify {shlex.quote(view.name)} --trial {t.number} --storage {shlex.quote(safe_url(url))}"
    prov = dataclasses.replace(provenance(view, t), verify_command=again)
    if request.plan_rate is None:
        return t, render(request.fmt, trial_flags(t), options, prov)
    detail, _ = trial_detail(url, view.name, t.number)
    plan, text = planned_kubernetes(
        view,
        t,
        detail,
        PlanInputs(rate=request.plan_rate, peak=request.peak),
        flags=trial_flags(t),
        options=options,
        provenance=prov,
        name=request.name,
    )
    typer.echo(f"plan: {plan.replicas} replicas for {request.plan_rate:g} req/s, up to {plan.max_replicas}", err=True)
    return t, text
