"""`tuner rescore`: feasibility and the front again under new SLOs, from the stored per-request records."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cli import app
from tuner.cli.common import (
    console_for_output,
    open_store,
    open_view,
    print_json,
    show_front,
)
from tuner.cli.extras import need_plot_extras
from tuner.cli.options import HtmlOpt, JobOpt, JsonOpt, PngOpt, StorageOpt, StudyArg
from tuner.errors import ConfigError, StorageError
from tuner.report import RescoredTrial, RescoreResult, StudyView, choose, rescore, write_html, write_png
from tuner.report.tables import fmt, front_doc
from tuner.scoring import Slo, figures
from tuner.store import safe_url

__all__ = ["rescore_cmd"]


SloOpt = Annotated[
    list[str] | None,
    typer.Option("--slo", help="A new SLO (repeatable), e.g. 'e2e_p95<=3s', 'success_rate>=0.99'.", show_default=False),
]
PlotOpt = Annotated[bool, typer.Option("--plot/--no-plot", help="Draw the new front in the terminal.")]


@app.command("rescore")
def rescore_cmd(
    study: StudyArg = None,
    slo: SloOpt = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    html: HtmlOpt = None,
    png: PngOpt = None,
    plot: PlotOpt = True,
    as_json: JsonOpt = False,
) -> None:
    """Feasibility and the front again under new SLOs, from the stored per-request records: no server is started
    and nothing is written to the study.

    Example: [bold]tuner rescore night --slo 'e2e_p95<=3s' --slo 'success_rate>=0.99'[/bold]
    """
    from tuner.scoring import parse_slo

    if not slo:
        raise ConfigError("give at least one --slo, e.g. --slo 'e2e_p95<=3s'")
    slos = [parse_slo(s) for s in slo]
    need_plot_extras(html, png)
    url, view = open_view(study, storage, job)
    result = rescored(url, view, slos)
    # judged under the new SLOs: the front shows their figures
    after = StudyView(name=view.name, attrs={**view.attrs, "slos": result.slos}, trials=result.view_after)
    if html is not None:
        write_html(after, result.front, html)
    if png is not None:
        write_png(after, result.front, png)
    if as_json:
        print_json(
            {
                "study": view.name,
                "slos": result.slos,
                "latency_metric": result.latency_metric,
                "feasible_before": result.feasible_before,
                "feasible_after": result.feasible_after,
                "trials": [_rescored_doc(r) for r in result.trials],
                **front_doc(result.front, after.baseline),
            }
        )
        return
    print_rescored(view, result, after, plot=plot)


def rescored(url: str, view: StudyView, slos: list[Slo]) -> RescoreResult:
    """The study's trials judged again from their stored per-request records."""
    store = open_store(url)
    missing = StorageError(
        f"{safe_url(url)} holds no per-request records for {view.name!r}: the tuner's tables are missing "
        "(a study not run by `tuner tune`?)"
    )
    if store is None:
        raise missing
    try:
        from tuner.store import current_revision

        if current_revision(store.engine) is None:
            raise missing
        return rescore(view, store, slos)
    finally:
        store.close()


def print_rescored(view: StudyView, result: RescoreResult, after: StudyView, *, plot: bool) -> None:
    con = console_for_output()
    table = Table(title=f"{escape(view.name)} re-scored under {escape(', '.join(result.slos))}")
    # the minimised latency, then each figure the new SLOs name (`--slo ttft_p90<=2s`: TTFT P90)
    named = [f for f in after.named_figures if f.name != view.latency_metric]
    latency = f"latency {view.objective_stat}"
    numeric = ("#", "tok/s", latency, *(f.label for f in named), "success")
    for col in ("#", "before", "after", "tok/s", latency, *(f.label for f in named), "success", "misses"):
        table.add_column(col, justify="right" if col in numeric else "left")
    for r in result.trials:
        if r.note == "no measurement":
            continue
        a_ = r.after
        table.add_row(
            str(a_.number),
            "ok" if r.before.feasible else "—",
            ("[green]ok[/green]" if a_.feasible else "[red]no[/red]") + (" (changed)" if r.changed else ""),
            fmt(a_.throughput),
            fmt(a_.objective_latency_s, ".3f", " s"),
            *(fmt(a_.latency(f.name), ".3f", " s") for f in named),
            fmt(a_.success_rate, ".1%"),
            escape(", ".join(a_.violated) or r.note or ""),
        )
    con.print(table)
    con.print(f"feasible: {result.feasible_before} → {result.feasible_after} trials (nothing written to the study)")
    show_front(after, result.front, as_json=False, plot=plot, width=80, height=20)
    if not result.front:
        choose(result.front, "throughput", study=view.name)


def _rescored_doc(r: RescoredTrial) -> dict[str, Any]:
    return {
        "number": r.after.number,
        "feasible_before": r.before.feasible,
        "feasible_after": r.after.feasible,
        "throughput": r.after.throughput,
        "objective_latency_s": r.after.objective_latency_s,
        "latency_p95_s": r.after.objective_latency_s,  # its name in tuner 0.1
        **{f.attr: r.after.latency(f.name) for f in figures()},
        **{f"{name}_s": value for name, value in r.after.latencies.items()},
        "constraints": list(r.after.constraints),
        "violated": list(r.after.violated),
        "step": r.step,
        "note": r.note,
    }
