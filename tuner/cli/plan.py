"""`tuner plan`: the replicas, GPUs and cost a rate needs on the winner's flags, and the alert rules to ship them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from tuner.cli import app
from tuner.cli.common import (
    JobOpt,
    StorageOpt,
    StudyArg,
    console_for_output,
    measured_trial,
    open_view,
    stored_job,
    trial_detail,
    trial_flags,
)
from tuner.errors import ConfigError, TunerError
from tuner.report import BEST_CHOICES, StudyView, TrialView
from tuner.report.deployment import deploy_options, provenance
from tuner.ship.alerts import alert_rules, prometheus_rule, rules_file
from tuner.ship.dashboard import dashboard
from tuner.ship.manifest import PlanInputs, planned_kubernetes, queue_at_capacity
from tuner.ship.measure import MeasuredCapacity, measure_capacity

__all__ = ["plan_cmd"]


@app.command("plan")
def plan_cmd(
    study: StudyArg = None,
    rate: Annotated[float, typer.Option("--rate", help="Requests per second to serve.", show_default=False)] = 0.0,
    peak: Annotated[
        float | None, typer.Option("--peak", help="Peak requests per second: the autoscaler's max.", show_default=False)
    ] = None,
    headroom: Annotated[float, typer.Option("--headroom", help="Fraction of measured capacity to plan on.")] = 0.7,
    price: Annotated[
        float | None,
        typer.Option(
            "--price-per-gpu-hour",
            help="Price of one GPU-hour: adds the cost lines (default: the job's target.gpu_hour_usd, else the "
            "catalog's price for the card).",
            show_default=False,
        ),
    ] = None,
    trial: Annotated[int | None, typer.Option("--trial", help="Plan this trial.", show_default=False)] = None,
    best: Annotated[
        str, typer.Option("--best", help=f"Pick from the feasible front: {', '.join(BEST_CHOICES)}.")
    ] = "throughput",
    rules: Annotated[
        Path | None, typer.Option("--rules", help="Write Prometheus alert rules here.", show_default=False)
    ] = None,
    operator: Annotated[bool, typer.Option("--operator", help="--rules as a PrometheusRule object.")] = False,
    manifest: Annotated[
        Path | None,
        typer.Option(
            "--manifest",
            help="Write the Kubernetes export with the plan: Deployment at the replicas, Service, HPA on the queue "
            "between replicas and peak replicas, PrometheusRule.",
            show_default=False,
        ),
    ] = None,
    grafana: Annotated[
        Path | None,
        typer.Option("--dashboard", help="Write a Grafana dashboard JSON here (SLO bounds drawn).", show_default=False),
    ] = None,
    name: Annotated[str, typer.Option("--name", help="The Prometheus job / Kubernetes name.")] = "vllm",
    storage: StorageOpt = None,
    job: JobOpt = None,
    measure: Annotated[
        bool,
        typer.Option(
            "--measure",
            help="Measure the trial's highest SLO-meeting rate now (the study's launcher starts one server) instead "
            "of the stored rate: for a throughput study, whose stored rate is a floor.",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of the arithmetic.")] = False,
) -> None:
    """Replicas, GPUs and cost for --rate req/s (and --peak), from the winner's measured SLO-meeting rate per
    server, with the arithmetic shown; --rules writes alert rules from the study's SLOs.

    Example: [bold]tuner plan night --rate 20 --peak 35 --price-per-gpu-hour 2.5 --rules vllm-rules.yaml[/bold]
    """
    if rate <= 0:
        raise ConfigError("give --rate R, the requests per second to serve, e.g. --rate 20")
    url, view = open_view(study, storage, job)
    t = measured_trial(view, trial, best)
    detail, _ = trial_detail(url, view.name, t.number)
    measured = _measured(view, t, job) if measure else None
    if price is None:
        price = view.record.gpu_hour_usd
    inputs = PlanInputs(rate=rate, peak=peak, headroom=headroom, price_per_gpu_hour=price, measured=measured)
    plan = inputs.plan(view, t, detail)
    queue = queue_at_capacity(detail, t.flags)
    listed = alert_rules(view.slos, queue_at_capacity=queue, name=name)
    if rules is not None:
        _write(rules, _yaml(prometheus_rule(listed, name=name)) if operator else rules_file(listed))
        typer.echo(f"wrote {rules} ({len(listed)} rules)", err=True)
    if grafana is not None:
        _write(grafana, json.dumps(dashboard(name, view.slos, queue_at_capacity=queue), indent=2) + "\n")
        typer.echo(f"wrote {grafana} (Grafana dashboard)", err=True)
    if manifest is not None:
        options = deploy_options(view, t, name=name)
        _, text = planned_kubernetes(
            view, t, detail, inputs, flags=trial_flags(t), options=options, provenance=provenance(view, t), name=name
        )
        _write(manifest, text)
        typer.echo(f"wrote {manifest} (Deployment, Service, HorizontalPodAutoscaler, PrometheusRule)", err=True)
    if as_json:
        typer.echo(json.dumps(plan.as_dict(), indent=2))
        return
    for line in plan.lines():
        typer.echo(line)


def _measured(view: StudyView, t: TrialView, job_file: Path | None) -> MeasuredCapacity:
    the_job = stored_job(view, job_file)
    with console_for_output().status(f"measuring trial {t.number}'s capacity ({the_job.target.launcher}) ..."):
        return measure_capacity(the_job, trial_flags(t), study=view.name, trial=t.number)


def _write(path: Path, text: str) -> None:
    try:
        path.write_text(text)
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None


def _yaml(doc: dict[str, Any]) -> str:
    return str(yaml.safe_dump(doc, sort_keys=False, width=120))
