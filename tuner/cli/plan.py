"""`tuner plan`: the replicas, GPUs and cost a rate needs on the winner's flags, and the alert rules to ship them;
`--compare-gpus`: the same load sized on other catalog cards, as the twin predicts it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml

from tuner.catalog.gpus import GPUS
from tuner.cli import app
from tuner.cli.common import (
    console_for_output,
    measured_trial,
    open_view,
    stored_job,
    trial_detail,
    trial_flags,
)
from tuner.cli.options import BestOpt, JobOpt, NameOpt, PeakOpt, StorageOpt, StudyArg, TrialOpt
from tuner.config import Job
from tuner.config.loader import load_job
from tuner.errors import ConfigError, TunerError
from tuner.report import StudyView, TrialView
from tuner.report.deployment import deploy_options, provenance
from tuner.ship.alerts import alert_rules, prometheus_rule, rules_file
from tuner.ship.cards import compare_cards, parse_cards, parse_prices
from tuner.ship.cards_text import comparison_lines
from tuner.ship.dashboard import dashboard
from tuner.ship.manifest import PlanInputs, planned_kubernetes, queue_at_capacity
from tuner.ship.measure import MeasuredCapacity, measure_capacity

__all__ = ["plan_cmd"]


RateOpt = Annotated[float, typer.Option("--rate", help="Requests per second to serve.", show_default=False)]
HeadroomOpt = Annotated[float, typer.Option("--headroom", help="Fraction of measured capacity to plan on.")]
PriceOpt = Annotated[
    float | None,
    typer.Option(
        "--price-per-gpu-hour",
        help="Price of one GPU-hour: adds the cost lines (default: the job's target.gpu_hour_usd, else the "
        "catalog's price for the card).",
        show_default=False,
    ),
]
RulesOpt = Annotated[
    Path | None, typer.Option("--rules", help="Write Prometheus alert rules here.", show_default=False)
]
OperatorOpt = Annotated[bool, typer.Option("--operator", help="--rules as a PrometheusRule object.")]
ManifestOpt = Annotated[
    Path | None,
    typer.Option(
        "--manifest",
        help="Write the Kubernetes export with the plan: Deployment at the replicas, Service, HPA on the queue "
        "between replicas and peak replicas, PrometheusRule.",
        show_default=False,
    ),
]
DashboardOpt = Annotated[
    Path | None,
    typer.Option("--dashboard", help="Write a Grafana dashboard JSON here (SLO bounds drawn).", show_default=False),
]
MeasureOpt = Annotated[
    bool,
    typer.Option(
        "--measure",
        help="Measure the trial's highest SLO-meeting rate now (the study's launcher starts one server) instead "
        "of the stored rate: for a throughput study, whose stored rate is a floor.",
    ),
]
CompareGpusOpt = Annotated[
    str | None,
    typer.Option(
        "--compare-gpus",
        help="Catalog cards to rank for --rate under the study's workload and SLOs, by the twin's predictions "
        "(no server started): each card's best flag set of the space, its servers, GPUs and cost. "
        "E.g. h100-80gb,a100-80gb,l40s.",
        show_default=False,
    ),
]
GpuHourUsdOpt = Annotated[
    str | None,
    typer.Option(
        "--gpu-hour-usd",
        help="With --compare-gpus: USD per GPU-hour by card, e.g. h100-80gb=3.5,l40s=1.2 (ranks by cost when "
        "every card has one; else by GPUs needed).",
        show_default=False,
    ),
]


LowerBoundOpt = Annotated[
    bool,
    typer.Option(
        "--lower-bound",
        help="Size from the lower end of the 95% interval of the rate pooled over the flag set's starts, not from the "
        "pooled rate itself.",
    ),
]


@app.command("plan")
def plan_cmd(
    study: StudyArg = None,
    rate: RateOpt = 0.0,
    peak: PeakOpt = None,
    headroom: HeadroomOpt = 0.7,
    price: PriceOpt = None,
    trial: TrialOpt = None,
    best: BestOpt = "throughput",
    rules: RulesOpt = None,
    operator: OperatorOpt = False,
    manifest: ManifestOpt = None,
    grafana: DashboardOpt = None,
    name: NameOpt = "vllm",
    storage: StorageOpt = None,
    job: JobOpt = None,
    measure: MeasureOpt = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of the arithmetic.")] = False,
    compare_gpus: CompareGpusOpt = None,
    lower_bound: LowerBoundOpt = False,
    gpu_hour_usd: GpuHourUsdOpt = None,
) -> None:
    """Replicas, GPUs and cost for --rate req/s (and --peak), from the winner's measured SLO-meeting rate per
    server pooled over every start of its flag set (--lower-bound: that rate's lower 95% bound), with the
    arithmetic shown; --rules writes alert rules from the study's SLOs.

    Example: [bold]tuner plan night --rate 20 --peak 35 --price-per-gpu-hour 2.5 --rules vllm-rules.yaml[/bold]

    Example: [bold]tuner plan night --rate 20 --compare-gpus h100-80gb,a100-80gb,l40s --gpu-hour-usd
    h100-80gb=3.5,a100-80gb=2.2,l40s=1.2[/bold]
    """
    if rate <= 0:
        raise ConfigError("give --rate R, the requests per second to serve, e.g. --rate 20")
    if compare_gpus is not None:
        given = {"--peak": peak, "--trial": trial, "--rules": rules, "--manifest": manifest, "--dashboard": grafana}
        given |= {"--measure": measure or None}
        clash = [k for k, v in given.items() if v is not None]
        if clash:
            raise ConfigError(f"--compare-gpus predicts for --rate alone; run {', '.join(clash)} without it")
        _compare(
            compare_gpus, gpu_hour_usd, price, (study, storage, job), rate=rate, headroom=headroom, as_json=as_json
        )
        return
    if gpu_hour_usd is not None:
        raise ConfigError("--gpu-hour-usd goes with --compare-gpus; the study's own card takes --price-per-gpu-hour")
    url, view = open_view(study, storage, job)
    t = measured_trial(view, trial, best)
    detail, _ = trial_detail(url, view.name, t.number)
    measured = _measured(view, t, job) if measure else None
    if price is None:
        price = view.record.gpu_hour_usd
    inputs = PlanInputs(
        rate=rate, peak=peak, headroom=headroom, price_per_gpu_hour=price, measured=measured, lower_bound=lower_bound
    )
    plan = inputs.plan(view, t, detail)
    _write_files(view, t, detail, inputs, _Files(rules, operator, grafana, manifest), name=name)
    if as_json:
        typer.echo(json.dumps(plan.as_dict(), indent=2))
        return
    for line in plan.lines():
        typer.echo(line)


@dataclass(frozen=True)
class _Files:
    """What --rules (--operator), --dashboard and --manifest asked to be written."""

    rules: Path | None
    operator: bool
    grafana: Path | None
    manifest: Path | None


def _write_files(view: StudyView, t: TrialView, detail: Any, inputs: PlanInputs, files: _Files, *, name: str) -> None:
    queue = queue_at_capacity(detail, t.flags)
    listed = alert_rules(view.slos, queue_at_capacity=queue, name=name)
    if files.rules is not None:
        _write(files.rules, _yaml(prometheus_rule(listed, name=name)) if files.operator else rules_file(listed))
        typer.echo(f"wrote {files.rules} ({len(listed)} rules)", err=True)
    if files.grafana is not None:
        _write(files.grafana, json.dumps(dashboard(name, view.slos, queue_at_capacity=queue), indent=2) + "\n")
        typer.echo(f"wrote {files.grafana} (Grafana dashboard)", err=True)
    if files.manifest is not None:
        options = deploy_options(view, t, name=name)
        _, text = planned_kubernetes(
            view, t, detail, inputs, flags=trial_flags(t), options=options, provenance=provenance(view, t), name=name
        )
        _write(files.manifest, text)
        typer.echo(f"wrote {files.manifest} (Deployment, Service, HorizontalPodAutoscaler, PrometheusRule)", err=True)


def _compare(
    cards_text: str,
    prices_text: str | None,
    own_price: float | None,
    where: tuple[str | None, str | None, Path | None],
    *,
    rate: float,
    headroom: float,
    as_json: bool,
) -> None:
    cards, given = parse_cards(cards_text), parse_prices(prices_text)
    if not 0 < headroom <= 1:
        raise ConfigError(f"--headroom {headroom:g}: give a fraction in (0, 1], e.g. 0.7")
    study, storage, job_file = where
    the_job = load_job(job_file) if job_file is not None else stored_job(open_view(study, storage, None)[1], None)
    prices = _card_prices(the_job, cards, given, own_price)
    with console_for_output().status(f"predicting {len(cards)} cards with the twin ..."):
        plans = compare_cards(the_job, cards, rate=rate, headroom=headroom, prices=prices)
    if as_json:
        typer.echo(json.dumps([p.as_dict() for p in plans], indent=2))
        return
    command = f"`tuner tune {job_file}`" if job_file is not None else "`tuner tune JOB`"
    for line in comparison_lines(plans, rate=rate, headroom=headroom, slos=the_job.slos, command=command):
        typer.echo(line)


def _card_prices(
    job: Job, cards: list[str], given: dict[str, float], own_price: float | None
) -> dict[str, tuple[float, str]]:
    """Each card's USD per GPU-hour and where it comes from: --gpu-hour-usd, else (the study's own card) the
    plan's price or the job's, else the catalog's where it cites one. None is made up."""
    own = job.target.gpu if isinstance(job.target.gpu, str) else None
    out: dict[str, tuple[float, str]] = {}
    for card in cards:
        if card in given:
            out[card] = (given[card], "--gpu-hour-usd")
        elif card == own and own_price is not None:
            out[card] = (own_price, "--price-per-gpu-hour")
        elif card == own and job.target.gpu_hour_usd is not None:
            out[card] = (job.target.gpu_hour_usd, "the job's target.gpu_hour_usd")
        elif GPUS[card].usd_per_hour is not None:
            out[card] = (float(GPUS[card].usd_per_hour or 0.0), GPUS[card].price_source)
    return out


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
