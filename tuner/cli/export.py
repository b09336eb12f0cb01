"""`tuner export`: the winning flags as `vllm serve` flags, YAML, docker, compose, Kubernetes, JSON or Python."""

from __future__ import annotations

import dataclasses
import shlex
from pathlib import Path
from typing import Annotated

import typer

from tuner.cli import app
from tuner.cli.common import JobOpt, StorageOpt, StudyArg, measured_trial, open_view, trial_detail, trial_flags
from tuner.errors import ConfigError, TunerError
from tuner.export import DEFAULT_IMAGE, FORMATS, render
from tuner.report import BEST_CHOICES
from tuner.report.deployment import deploy_options, provenance
from tuner.ship.manifest import PlanInputs, planned_kubernetes
from tuner.store import safe_url

__all__ = ["export_cmd"]


@app.command("export")
def export_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help=f"One of: {', '.join(FORMATS)}.")] = "vllm-args",
    trial: Annotated[int | None, typer.Option("--trial", help="Export this trial.", show_default=False)] = None,
    best: Annotated[
        str, typer.Option("--best", help=f"Pick from the feasible front: {', '.join(BEST_CHOICES)}.")
    ] = "throughput",
    model: Annotated[
        str | None, typer.Option("--model", help="Model to serve (default: the study's).", show_default=False)
    ] = None,
    image: Annotated[
        str | None,
        typer.Option("--image", help=f"Container image (default: the study's, else the job's, else {DEFAULT_IMAGE})."),
    ] = None,
    port: Annotated[int, typer.Option("--port", help="Server port.")] = 8000,
    name: Annotated[str, typer.Option("--name", help="Compose service / Kubernetes object name.")] = "vllm",
    secret_env: Annotated[
        list[str] | None,
        typer.Option(
            "--secret-env",
            help="Secret variables passed by name (default: HF_TOKEN and the job's env names).",
            show_default=False,
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.", show_default=False)
    ] = None,
    plan_rate: Annotated[
        float | None,
        typer.Option(
            "--plan",
            help="With --format kubernetes: plan for this many req/s (see tuner plan): the Deployment at the plan's "
            "replicas, an HPA on vLLM's queue, the PrometheusRule.",
            show_default=False,
        ),
    ] = None,
    peak: Annotated[
        float | None, typer.Option("--peak", help="With --plan: peak req/s, the HPA's maximum.", show_default=False)
    ] = None,
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas",
            help="Servers of the trial's shape, each on its own GPUs and port (default: the study's box, target.gpus "
            "// (tensor x pipeline parallel); 1 without one).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """The winning flags, ready to paste: `vllm serve` flags, a --config YAML, `docker run`, a compose service, a
    Kubernetes Deployment + Service, JSON or `LLM(**kwargs)`, with provenance comments. Secrets by name only.

    A box of several replicas (target.gpus) is written as it ran: `vllm serve` lines each with its own
    CUDA_VISIBLE_DEVICES and port, one compose service or `docker run` a replica on its own GPUs, the Deployment at
    the replicas with each pod's GPU request its world size.

    Example: [bold]tuner export night --best balanced --format kubernetes --plan 20 --peak 35 -o vllm.yaml[/bold]

    Example: [bold]tuner export box8 --format vllm-args --replicas 4[/bold]
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if (plan_rate is not None or peak is not None) and fmt != "kubernetes":
        raise ConfigError(f"--plan and --peak go with --format kubernetes, not {fmt!r}")
    if peak is not None and plan_rate is None:
        raise ConfigError("--peak needs --plan R, the requests per second to serve")
    if replicas is not None and replicas < 1:
        raise ConfigError(f"--replicas {replicas}: give 1 or more servers")
    if plan_rate is not None and (plan_rate <= 0 or (peak is not None and peak < plan_rate)):
        raise ConfigError("--plan must be above 0 and --peak at least --plan")
    url, view = open_view(study, storage, job)
    t = measured_trial(view, trial, best)
    if trial is not None and not t.feasible:
        typer.echo(f"warning: trial {trial} {t.verdict}", err=True)
    options = deploy_options(
        view,
        t,
        model=model,
        image=image,
        port=port,
        name=name,
        secret_env=tuple(secret_env) if secret_env is not None else None,
    )
    options = dataclasses.replace(options, replicas=replicas or t.replicas or 1)
    again = f"tuner verify {shlex.quote(view.name)} --trial {t.number} --storage {shlex.quote(safe_url(url))}"
    prov = dataclasses.replace(provenance(view, t), verify_command=again)
    if plan_rate is None:
        text = render(fmt, trial_flags(t), options, prov)
    else:
        detail, _ = trial_detail(url, view.name, t.number)
        plan, text = planned_kubernetes(
            view,
            t,
            detail,
            PlanInputs(rate=plan_rate, peak=peak),
            flags=trial_flags(t),
            options=options,
            provenance=prov,
            name=name,
        )
        typer.echo(f"plan: {plan.replicas} replicas for {plan_rate:g} req/s, up to {plan.max_replicas}", err=True)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as e:
        raise TunerError(f"cannot write {output}: {e.strerror or e}") from None
    typer.echo(f"wrote {output} (trial {t.number}, {fmt})", err=True)
