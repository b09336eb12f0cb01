"""`tuner status`: a study's progress: budget, running trials, best so far, failures, skips, the twin."""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.markup import escape
from rich.table import Table

from tuner.cli import app
from tuner.cli.common import JobOpt, JsonOpt, StorageOpt, StudyArg, console_for_output, open_view, print_json
from tuner.report import StudyView, ratios, status
from tuner.report.overview import StudyStatus, machine_line
from tuner.report.tables import flags_text, fmt, ratio
from tuner.twin.reachability import Unreachable

__all__ = ["status_cmd"]


@app.command("status")
def status_cmd(
    study: StudyArg = None, storage: StorageOpt = None, job: JobOpt = None, as_json: JsonOpt = False
) -> None:
    """Progress of a study: budget, running trials, best so far, failures by reason, skips and the server time
    they saved; the confirmation's extra starts of flags already tried are counted apart from the budget's trials.

    Example: [bold]tuner status night --storage sqlite:///night.db[/bold]
    """
    _, view = open_view(study, storage, job)
    st = status(view)
    if as_json:
        print_json(st.as_dict())
        return
    con = console_for_output()
    a = view.attrs
    con.print(
        f"[bold]{escape(view.name)}[/bold]  {st.state}  ·  GPU {escape(str(a.get('gpu', '?')))}  ·  "
        f"model {escape(str(a.get('model', '?')))}  ·  launcher {escape(str(a.get('launcher', '?')))}  ·  "
        f"objective {escape(str(a.get('objective', 'throughput')))}"
    )
    if view.slos:
        con.print("SLOs: " + escape(", ".join(view.slos)))
    if st.stopped:
        con.print(f"[bold red]stopped:[/bold red] {escape(st.stopped)}")
    found = (a.get("unreachable") or {}).get("found") if isinstance(a.get("unreachable"), dict) else None
    if isinstance(found, dict) and not st.feasible:  # an SLO the twin predicted nothing meets (tuner.study.unreachable)
        con.print(f"[bold yellow]unreachable:[/bold yellow] {escape(Unreachable.from_attr(found).line())}")
    if st.budget:
        done = min(st.finished, st.budget)
        bar = "█" * round(30 * done / st.budget) + "░" * (30 - round(30 * done / st.budget))
        # A budget lowered below what was run: the trials it ran, never more than 100% of it.
        over = f"; {st.finished} were run under a larger budget" if st.finished > st.budget else ""
        con.print(f"budget   {bar} {done}/{st.budget} trials finished ({done / st.budget:.0%}){over}")
    else:
        con.print(f"trials   {st.finished} finished")
    con.print(f"measured {st.measured}, feasible {st.feasible}, server time {st.server_minutes:.1f} min")
    _print_apart(con, view, st)
    if st.confirmation_starts:
        con.print(
            f"confirmation: {st.confirmation_starts} extra start{'s' if st.confirmation_starts != 1 else ''} of "
            f"flags already tried ({st.confirmation_measured} measured, {st.confirmation_minutes:.1f} server-min)"
        )
    _print_best(con, view, st)
    _print_running(con, st)
    if st.failures:
        con.print("failures: " + ", ".join(f"{escape(k)} {v}" for k, v in st.failures.items()))
    else:
        con.print("failures: none")
    _print_skips(con, st)
    _print_twin(con, st)


def _print_best(con: Any, view: StudyView, st: StudyStatus) -> None:
    if st.best is not None:
        base = view.baseline
        r = ratios(st.best, base)
        first = ratio(r.throughput) + " throughput"
        if st.best.costed:  # a cost study: its cost against the baseline's, < 1 cheaper
            first = ratio(1 / r.throughput if r.throughput else None) + " cost"
        vs = f"  ({first}, {ratio(r.latency_p95)} {view.objective_stat} vs baseline)" if base else ""
        figure = f"{st.best.cost_text} per M output tokens" if st.best.costed else f"{fmt(st.best.throughput)} tok/s"
        con.print(
            f"best so far: trial {st.best.number}: {figure}, "
            f"{view.objective_stat} {fmt(st.best.objective_latency_s, '.3f', ' s')}{vs}  "
            f"{escape('[' + flags_text(st.best.flags) + ']')}"
        )
    else:
        con.print("best so far: no feasible trial yet")


def _print_running(con: Any, st: StudyStatus) -> None:
    if not st.running:
        return
    table = Table(title="running")
    for col in ("#", "started", "for", "flags"):
        table.add_column(col)
    now = dt.datetime.now()
    for t in st.running:
        # Optuna stores naive local datetimes
        age = f"{(now - t.started).total_seconds() / 60:.1f} min" if t.started else "—"
        started = t.started.strftime("%H:%M:%S") if t.started else "—"
        table.add_row(str(t.number), started, age, escape(flags_text(t.flags)))
    con.print(table)


def _print_skips(con: Any, st: StudyStatus) -> None:
    if st.skipped:
        saved = st.server_minutes_saved
        con.print(
            f"skipped as infeasible before launch: {st.skipped_total} ("
            + ", ".join(f"{escape(k)} {v}" for k, v in st.skipped.items())
            + ")"
            + (f", saving ≈ {saved:.1f} server-minutes" if saved else "")
        )
    else:
        con.print("skipped as infeasible before launch: 0")


def _print_apart(con: Any, view: StudyView, st: StudyStatus) -> None:
    """What the budget's count leaves out, and the machine the trials were measured on."""
    if machine := machine_line(view):
        con.print(escape(machine))
    if st.interrupted:
        con.print(f"interrupted: {st.interrupted}, not counted: each runs again when the same command is run")
    if st.repeats:
        con.print(f"repeats: {st.repeats} proposals of a flag set already tried, answered from it, not counted")


def _print_twin(con: Any, st: StudyStatus) -> None:
    """The twin sampler's prediction against each real trial's measurement (its error as it shrinks)."""
    if not st.twin:
        return
    con.print("twin, predicted -> measured output tok/s (error), and the SLO verdicts it got wrong:")
    for number, predicted, measured in st.twin:
        error = f"{abs(predicted - measured) / measured:.0%}" if measured else "not measured in full"
        shown = f"{measured:,.1f}" if measured is not None else "—"
        con.print(f"  trial {number}: {predicted:,.1f} -> {shown} ({error})")
        if number in st.twin_verdicts:
            con.print(f"    SLO verdict wrong: {escape(st.twin_verdicts[number])}")
    if st.twin_fallback:
        con.print(f"twin handed over to TPE {escape(st.twin_fallback)}")
