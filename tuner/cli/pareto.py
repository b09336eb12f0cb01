"""`tuner pareto`: the feasible Pareto front, the baseline beside it, a scatter plot of every trial."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli import app
from tuner.cli.common import (
    console_for_output,
    need_trials,
    opened,
    print_json,
    show_front,
)
from tuner.cli.extras import need_plot_extras
from tuner.cli.options import HtmlOpt, JobOpt, JsonOpt, PngOpt, StorageOpt, StudyArg, WideOpt
from tuner.errors import TunerError
from tuner.report import choose, pareto_front, study_view, write_html, write_png
from tuner.report.cost_front import box_tok_s, cost_front, cost_front_table, cost_scatter, need_price
from tuner.report.cost_plots import write_cost_html, write_cost_png
from tuner.report.views import StudyView

__all__ = ["pareto_cmd"]


@app.command("pareto")
def pareto_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    html: HtmlOpt = None,
    png: PngOpt = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Draw the scatter plot in the terminal.")] = True,
    width: Annotated[int, typer.Option("--width", help="Terminal plot width (columns).")] = 80,
    height: Annotated[int, typer.Option("--height", help="Terminal plot height (rows).")] = 20,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
    cost: Annotated[
        bool,
        typer.Option(
            "--cost",
            help="The front of the box's output tok/s against $ per million output tokens instead, in the table, "
            "the plot and --html/--png (needs a study with a GPU-hour price, target.gpu_hour_usd).",
        ),
    ] = False,
) -> None:
    """The feasible Pareto front (throughput against latency P95; a cost study's cost per million output tokens
    at its load against latency P95), the baseline beside it with the winners' ratios, and a scatter plot of every
    trial (x: missed an SLO, o: feasible, *: the front, B: baseline). --cost: the front of the box's throughput
    against $ per million output tokens, for a study with a price.

    Example: [bold]tuner pareto night --html front.html --png front.png[/bold]; [bold]tuner pareto night --cost[/bold]
    """
    need_plot_extras(html, png)
    with opened(study, storage, job) as (url, s):
        view = study_view(s)
        need_trials(view, url)
        if cost:
            show_cost_front(view, html=html, png=png, as_json=as_json, plot=plot, width=width, height=height)
            return
        front = pareto_front(view.trials)
        if html is not None:
            write_html(view, front, html)
    if png is not None:
        write_png(view, front, png)
    if view.stopped and not front and not as_json:
        # Not an empty front of 0 tok/s: the study measured nothing, and says why.
        raise TunerError(f"study {view.name!r} stopped: {view.stopped}")
    show_front(view, front, as_json=as_json, plot=plot, width=width, height=height, wide=wide)
    if not front:
        choose(front, "throughput", study=view.name)  # raises the one-line NoFeasibleTrial


def show_cost_front(
    view: StudyView, *, html: Path | None, png: Path | None, as_json: bool, plot: bool, width: int, height: int
) -> None:
    """The front of box throughput against $ per million output tokens: table (or JSON), scatter plot, files."""
    need_price(view)
    front = cost_front(view.trials)
    if html is not None:
        write_cost_html(view, front, html)
    if png is not None:
        write_cost_png(view, front, png)
    if as_json:
        points = [t.as_dict() | {"box_output_tok_s": box_tok_s(t)} for t in front]
        print_json({"study": view.name, "front": points})
        return
    con = console_for_output()
    title = f"{view.name}: box tok/s vs $ per M output tokens, {len(front)} on the front"
    con.print(cost_front_table(front, title, view.objective_stat))
    con.print("box: replicas × GPUs each; $ at the box's measured throughput, idle GPUs paid for")
    if plot:
        text = cost_scatter(view, front, width=min(width, con.width), height=height)
        con.print(text, markup=False, highlight=False, soft_wrap=True)
    if not front:
        choose(front, "throughput", study=view.name)  # raises the one-line NoFeasibleTrial
