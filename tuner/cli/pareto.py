"""`tuner pareto`: the feasible Pareto front, the baseline beside it, a scatter plot of every trial."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from tuner.cli import app
from tuner.cli.common import JobOpt, JsonOpt, StorageOpt, StudyArg, WideOpt, need_trials, opened, show_front
from tuner.errors import TunerError
from tuner.report import choose, pareto_front, study_view, write_html, write_png

__all__ = ["pareto_cmd"]


@app.command("pareto")
def pareto_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write an interactive Plotly chart here.", show_default=False)
    ] = None,
    png: Annotated[
        Path | None,
        typer.Option("--png", help="Write a static PNG here (needs the extra tuner\\[png]).", show_default=False),
    ] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Draw the scatter plot in the terminal.")] = True,
    width: Annotated[int, typer.Option("--width", help="Terminal plot width (columns).")] = 80,
    height: Annotated[int, typer.Option("--height", help="Terminal plot height (rows).")] = 20,
    as_json: JsonOpt = False,
    wide: WideOpt = False,
) -> None:
    """The feasible Pareto front (throughput against latency P95), the baseline beside it with the winners'
    ratios, and a scatter plot of every trial (x: missed an SLO, o: feasible, *: the front, B: baseline).

    Example: [bold]tuner pareto night --html front.html --png front.png[/bold]
    """
    with opened(study, storage, job) as (url, s):
        view = study_view(s)
        need_trials(view, url)
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
