"""In the morning: `tuner studies`, `status`, `trials`, `pareto`, `show`, `export`, `rescore`.

Each reads the study through Optuna's public API (and the project's tables for detail and per-request records),
renders with Rich, and never starts a server.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import datetime as dt
import io
import json
import os
import shlex
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import optuna
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tuner.cli import app
from tuner.config import Job, load_job, parse_job
from tuner.errors import ConfigError, StorageError, TunerError
from tuner.export import DEFAULT_IMAGE, FORMATS, render
from tuner.flags import VllmFlags
from tuner.record import OUTCOMES
from tuner.report import (
    BEST_CHOICES,
    RescoredTrial,
    StudyListing,
    StudyView,
    TrialView,
    choose,
    listing,
    opened_study,
    pareto_front,
    ratios,
    rescore,
    resolve_storage,
    status,
    study_names,
    study_view,
    terminal_scatter,
    write_html,
    write_png,
)
from tuner.report.deployment import deploy_options, provenance
from tuner.report.overview import StudyStatus
from tuner.report.storage import job_study_name, sole_study
from tuner.report.tables import (
    flag_lines,
    flags_table,
    flags_text,
    fmt,
    front_doc,
    front_flags,
    front_table,
    kv_table,
    ratio,
    steps_table,
    summary_table,
)
from tuner.scoring import figures
from tuner.ship.manifest import PlanInputs, planned_kubernetes
from tuner.store import safe_url

__all__ = ["export_cmd", "pareto_cmd", "rescore_cmd", "show_cmd", "status_cmd", "studies_cmd", "trials_cmd"]

StorageOpt = Annotated[
    str | None,
    typer.Option(
        "--storage",
        envvar=["TUNER_STORAGE_URL", "TUNER_STORAGE"],
        help="Study storage URL (sqlite:///night.db, postgresql+psycopg://...). Default: the --job file's, "
        "else $TUNER_STORAGE_URL, else sqlite:///tuner.db.",
        show_default=False,
    ),
]
JobOpt = Annotated[
    Path | None,
    typer.Option("--job", help="A job file: its storage (and study name, when STUDY is left out).", show_default=False),
]
StudyArg = Annotated[
    str | None,
    typer.Argument(help="Study name (default: the --job file's, else the storage's only study).", show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
WideOpt = Annotated[
    bool, typer.Option("--wide", help="Every column, the flags in the table (the default fits 80 columns).")
]

_OUTCOMES = (*OUTCOMES, "running", "waiting", "fail")  # the record's outcomes, and Optuna states without one
# A headline P95 sorts by its metric's name (`ttft`), another statistic by the figure's (`ttft_p90`).
_FIGURE_KEYS = {(f.metric if f.stat == "p95" else f.name): f.name for f in figures() if f.headline}
_SORT_KEYS = ("number", "throughput", "latency", *_FIGURE_KEYS, "success")


def console_for_output() -> Console:
    width = os.environ.get("COLUMNS")
    return Console(width=int(width) if width and width.isdigit() else None, highlight=False, soft_wrap=False)


def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@contextlib.contextmanager
def _opened(study: str | None, storage: str | None, job: Path | None) -> Iterator[tuple[str, optuna.Study]]:
    _quiet_optuna()
    url = resolve_storage(storage, job)
    if study is None:
        study = job_study_name(job) if job is not None else sole_study(url)
    with opened_study(url, study) as s:
        yield url, s


def open_view(study: str | None, storage: str | None, job: Path | None) -> tuple[str, StudyView]:
    """The study read once; an empty one is an error for every command that reads trials."""
    with _opened(study, storage, job) as (url, s):
        view = study_view(s)
    _need_trials(view, url)
    return url, view


def _need_trials(view: StudyView, url: str) -> None:
    if not view.trials:
        raise TunerError(f"study {view.name!r} in {safe_url(url)} has no trials yet")


def _print_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2, default=str))


# -- tuner studies -------------------------------------------------------------------------------------------------


@app.command("studies")
def studies_cmd(
    storage: StorageOpt = None, job: JobOpt = None, as_json: JsonOpt = False, wide: WideOpt = False
) -> None:
    """List the studies in a storage: trials, state, best feasible throughput.

    Example: [bold]tuner studies --storage sqlite:///night.db[/bold]
    """
    _quiet_optuna()
    url = resolve_storage(storage, job)
    names = study_names(url)
    if not names:
        raise StorageError(f"no study in {safe_url(url)}")
    rows = []
    for name in names:
        with opened_study(url, name) as s:
            rows.append(listing(study_view(s)))
    if as_json:
        _print_json([r.as_dict() for r in rows])
        return
    console_for_output().print(_studies_table(rows, url, wide=wide))


def _studies_table(rows: list[StudyListing], url: str, *, wide: bool) -> Table:
    """Narrow (the default) fits 80 columns: what picks a study out; --wide adds running, model and start."""
    cols: tuple[str, ...] = ("study", "state", "trials", "running", "feasible", "best tok/s", "GPU", "model", "started")
    if not wide:
        cols = ("study", "state", "trials", "feasible", "best tok/s", "GPU")
    numeric = ("trials", "running", "feasible", "best tok/s")
    table = Table(title=f"studies in {escape(safe_url(url))}")
    for col in cols:
        # Names wrap rather than end in "…": a cut study name cannot be typed back.
        table.add_column(col, justify="right" if col in numeric else "left", overflow="fold")
    for r in rows:
        best = f"{r.best_throughput:,.1f} (#{r.best_trial})" if r.best_throughput is not None else "—"
        cells = {
            "study": escape(r.name),
            "state": r.state,
            "trials": str(r.trials),
            "running": str(r.running),
            "feasible": str(r.feasible),
            "best tok/s": best,
            "GPU": escape(r.gpu or "—"),
            "model": escape(r.model or "—"),
            "started": r.started.strftime("%Y-%m-%d %H:%M") if r.started else "—",
        }
        table.add_row(*(cells[c] for c in cols))
    return table


# -- tuner status --------------------------------------------------------------------------------------------------


@app.command("status")
def status_cmd(
    study: StudyArg = None, storage: StorageOpt = None, job: JobOpt = None, as_json: JsonOpt = False
) -> None:
    """Progress of a study: budget, running trials, best so far, failures by reason, skips and the server time
    they saved.

    Example: [bold]tuner status night --storage sqlite:///night.db[/bold]
    """
    _, view = open_view(study, storage, job)
    st = status(view)
    if as_json:
        _print_json(st.as_dict())
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
    if st.budget:
        done = min(st.finished, st.budget)
        bar = "█" * round(30 * done / st.budget) + "░" * (30 - round(30 * done / st.budget))
        con.print(f"budget   {bar} {st.finished}/{st.budget} trials finished ({st.finished / st.budget:.0%})")
    else:
        con.print(f"trials   {st.finished} finished")
    con.print(f"measured {st.measured}, feasible {st.feasible}, server time {st.server_minutes:.1f} min")
    if st.best is not None:
        base = view.baseline
        r = ratios(st.best, base)
        vs = f"  ({ratio(r.throughput)} throughput, {ratio(r.latency_p95)} P95 vs baseline)" if base else ""
        con.print(
            f"best so far: trial {st.best.number}: {fmt(st.best.throughput)} tok/s, "
            f"P95 {fmt(st.best.objective_latency_s, '.3f', ' s')}{vs}  {escape('[' + flags_text(st.best.flags) + ']')}"
        )
    else:
        con.print("best so far: no feasible trial yet")
    if st.running:
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
    if st.failures:
        con.print("failures: " + ", ".join(f"{escape(k)} {v}" for k, v in st.failures.items()))
    else:
        con.print("failures: none")
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
    _print_twin(con, st)


def _print_twin(con: Any, st: StudyStatus) -> None:
    """The twin sampler's prediction against each real trial's measurement (its error as it shrinks)."""
    if not st.twin:
        return
    con.print("twin, predicted -> measured output tok/s (error):")
    for number, predicted, measured in st.twin:
        error = f"{abs(predicted - measured) / measured:.0%}" if measured else "not measured in full"
        shown = f"{measured:,.1f}" if measured is not None else "—"
        con.print(f"  trial {number}: {predicted:,.1f} -> {shown} ({error})")
    if st.twin_fallback:
        con.print(f"twin handed over to TPE {escape(st.twin_fallback)}")


# -- tuner trials --------------------------------------------------------------------------------------------------


def _sort_key(key: str) -> Any:
    inf = float("inf")
    keys = {
        "number": lambda t: t.number,
        "throughput": lambda t: -(t.throughput if t.measured and t.throughput is not None else -inf),
        "latency": lambda t: t.objective_latency_s if t.measured and t.objective_latency_s is not None else inf,
        **{key: _by_figure(name) for key, name in _FIGURE_KEYS.items()},
        "success": lambda t: -(t.success_rate if t.success_rate is not None else -inf),
    }
    if key not in keys:
        raise ConfigError(f"unknown --sort {key!r}; allowed: {', '.join(_SORT_KEYS)}")
    return keys[key]


def _by_figure(name: str) -> Callable[[TrialView], float]:
    def key(t: TrialView) -> float:
        value = t.latency(name)
        return value if value is not None else float("inf")

    return key


@app.command("trials")
def trials_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    sort: Annotated[
        str, typer.Option("--sort", help=f"Order, best first: {', '.join(_SORT_KEYS)}.", show_default=True)
    ] = "number",
    reverse: Annotated[bool, typer.Option("--reverse", help="Reverse the order.")] = False,
    feasible: Annotated[bool, typer.Option("--feasible", help="Only trials that met every SLO.")] = False,
    outcome: Annotated[
        list[str] | None,
        typer.Option(
            "--outcome",
            help="Only these outcomes (repeatable): measured, launch_failed, crashed, skipped_infeasible, interrupted.",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="At most N rows.", show_default=False)] = None,
    as_json: JsonOpt = False,
    as_csv: Annotated[bool, typer.Option("--csv", help="Print CSV instead of a table.")] = False,
    wide: WideOpt = False,
) -> None:
    """One row a trial: flags, throughput, P95 TTFT and e2e, success rate, verdict or reason, bottleneck.

    Example: [bold]tuner trials night --sort throughput --feasible --limit 10[/bold]
    """
    key = _sort_key(sort)
    unknown = sorted(set(outcome or ()) - set(_OUTCOMES))
    if unknown:
        raise ConfigError(f"unknown --outcome {', '.join(unknown)}; allowed: {', '.join(_OUTCOMES)}")
    _, view = open_view(study, storage, job)
    rows = sorted(view.trials, key=key, reverse=reverse)
    if feasible:
        rows = [t for t in rows if t.feasible]
    if outcome:
        rows = [t for t in rows if t.outcome in outcome or t.state.lower() in outcome]
    if limit is not None:
        rows = rows[: max(limit, 0)]
    if as_json:
        _print_json([t.as_dict() for t in rows])
        return
    if as_csv:
        buf = io.StringIO()
        fields = ["number", "state", "baseline", "outcome", "verdict", "feasible", "throughput"]
        fields += ["objective_latency_s", "latency_p95_s", "output_tok_s", "request_rate"]
        fields += [*(f.attr for f in figures()), "success_rate"]
        fields += ["goodput", "diagnosis", "reason", "server_seconds", "flags"]
        w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for t in rows:
            d = t.as_dict()
            d["flags"] = json.dumps(t.flags, sort_keys=True)
            w.writerow(d)
        typer.echo(buf.getvalue(), nl=False)
        return
    con = console_for_output()
    con.print(_trials_table(view, rows, wide=wide))
    if not wide:
        con.print(flag_lines([(_trial_key(t), flags_text(t.flags)) for t in rows]))
    if any(t.baseline for t in rows):
        con.print("ᵇ baseline: vLLM's defaults on this GPU and model")


def _trial_key(t: TrialView) -> str:
    return f"#{t.number}{'ᵇ' if t.baseline else ''}"


def _trials_table(view: StudyView, rows: list[TrialView], *, wide: bool) -> Table:
    """Narrow (the default) fits 80 columns, the flags printed after it a line each; --wide: flags and bottleneck
    in the table."""
    shown = [f for f in figures() if f.headline]
    labels = tuple(f.label for f in shown)
    cols: tuple[str, ...] = ("#", "flags", "tok/s", *labels, "success", "verdict", "bottleneck")
    if not wide:
        cols = ("#", "tok/s", *labels, "success", "verdict")
    numeric = ("#", "tok/s", *labels, "success")
    table = Table(title=f"{escape(view.name)}: {len(rows)} of {len(view.trials)} trials")
    for col in cols:
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col in numeric)
    for t in rows:
        style = "green" if t.feasible else ("yellow" if t.measured else "red")
        cells = {
            "#": f"{t.number}{'ᵇ' if t.baseline else ''}",
            "flags": escape(flags_text(t.flags)),
            "tok/s": fmt(t.throughput if t.measured else t.output_tok_s),
            **{f.label: fmt(t.latency(f.name), ".3f", " s") for f in shown},
            "success": fmt(t.success_rate, ".1%"),
            "verdict": f"[{style}]{escape(t.verdict)}[/{style}]",
            "bottleneck": escape(t.diagnosis or "—"),
        }
        table.add_row(*(cells[c] for c in cols))
    return table


# -- tuner pareto --------------------------------------------------------------------------------------------------


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
    with _opened(study, storage, job) as (url, s):
        view = study_view(s)
        _need_trials(view, url)
        front = pareto_front(view.trials)
        if html is not None:
            write_html(view, front, html)
    if png is not None:
        write_png(view, front, png)
    if view.stopped and not front and not as_json:
        # Not an empty front of 0 tok/s: the study measured nothing, and says why.
        raise TunerError(f"study {view.name!r} stopped: {view.stopped}")
    _show_front(view, front, as_json=as_json, plot=plot, width=width, height=height, wide=wide)
    if not front:
        choose(front, "throughput", study=view.name)  # raises the one-line NoFeasibleTrial


def _show_front(
    view: StudyView, front: list[TrialView], *, as_json: bool, plot: bool, width: int, height: int, wide: bool = False
) -> None:
    baseline = view.baseline
    if as_json:
        _print_json({"study": view.name, "latency_metric": view.latency_metric, **front_doc(front, baseline)})
        return
    con = console_for_output()
    measured = sum(t.measured for t in view.trials)
    title = (
        f"{escape(view.name)}: feasible front, {len(front)} of {measured} measured trials "
        f"(latency = {view.latency_metric})"
    )
    con.print(front_table(front, baseline, title, wide=wide))
    if not wide:
        con.print(front_flags(front, baseline))
    if plot:
        scatter = terminal_scatter(view, front, width=min(width, con.width), height=height, color=con.is_terminal)
        con.print(scatter, markup=False, highlight=False, soft_wrap=True)
    if front:
        winner = choose(front, "throughput")
        hint = f"export it: tuner export {shlex.quote(view.name)} --trial {winner.number} --format docker"
        con.print(hint, markup=False, highlight=False)


# -- tuner show ----------------------------------------------------------------------------------------------------


def _open_store(url: str) -> Any | None:
    """The project's tables, or None when this storage has none (a study written by Optuna alone)."""
    from tuner.store import open_store

    try:
        return open_store(url, migrate=False)
    except StorageError:
        return None


def _detail(url: str, study: str, number: int) -> tuple[Any | None, list[Any]]:
    store = _open_store(url)
    if store is None:
        return None, []
    try:
        try:
            detail = store.trial_detail(study, number)
        except StorageError:
            return None, []
        steps = store.request_steps(study, number) if detail is not None else []
        return detail, steps
    finally:
        store.close()


def _study_and_trial(first: str, second: int | None) -> tuple[str | None, int]:
    """`show STUDY TRIAL`, or `show TRIAL` with the study left out (a positional cannot be optional before another)."""
    if second is not None:
        return first, second
    try:
        return None, int(first)
    except ValueError:
        raise ConfigError(f"give the trial number: tuner show {first} TRIAL (or tuner show TRIAL)") from None


@app.command("show")
def show_cmd(
    study: Annotated[
        str, typer.Argument(help="Study name; left out (`tuner show 7`), the --job file's or the storage's only one.")
    ],
    trial: Annotated[int | None, typer.Argument(help="Trial number.", show_default=False)] = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    as_json: JsonOpt = False,
    log_lines: Annotated[int, typer.Option("--log-lines", help="Lines of the server log tail to show.")] = 30,
) -> None:
    """Everything stored for one trial: flags, prediction, start-up facts, load summary with all percentiles,
    failure classes, server metrics, diagnosis, log tail.

    Example: [bold]tuner show night 7[/bold]
    """
    name, trial = _study_and_trial(study, trial)
    url, view = open_view(name, storage, job)
    t = view.trial(trial)
    if t is None:
        numbers = [x.number for x in view.trials]
        span = f"trials are {min(numbers)}..{max(numbers)}" if numbers else "it has no trials"
        raise TunerError(f"no trial {trial} in study {view.name!r}; {span}")
    detail, steps = _detail(url, view.name, trial)
    d = detail.__dict__ if detail is not None else {}
    if as_json:
        doc = {"trial": t.as_dict(), "detail": {k: v for k, v in d.items()} or None, "request_steps": steps}
        _print_json(doc)
        return
    con = console_for_output()
    style = "green" if t.feasible else ("yellow" if t.measured else "red")
    con.print(
        f"[bold]{escape(view.name)} · trial {t.number}[/bold]{' (baseline: vLLM defaults)' if t.baseline else ''}  "
        f"{t.state}  [{style}]{escape(t.verdict)}[/{style}]"
    )
    facts = d.get("startup_facts") if isinstance(d.get("startup_facts"), dict) else {}
    version = t.vllm_version or (facts or {}).get("vllm_version")
    if version:
        con.print(f"vLLM version: {escape(str(version))}")
    con.print(flags_table(view, t.flags))
    for note in t.notes:
        con.print(f"note: {escape(note)}")
    if t.slo_stop:
        con.print(f"[yellow]load stopped early[/yellow]: {escape(t.slo_stop)}")
    if d.get("message"):
        con.print(f"[red]{escape(str(d['message']))}[/red]")
    for key, title in (
        ("prediction", "prediction (before launch)"),
        ("startup_facts", "start-up facts (from the log)"),
    ):
        if d.get(key):
            con.print(kv_table(title, d[key]))
    if t.kv_tokens is not None or t.predicted_kv_tokens is not None:
        con.print(f"KV tokens: predicted {fmt(t.predicted_kv_tokens, ',')}, measured {fmt(t.kv_tokens, ',')}")
    summary = d.get("load_summary")
    if summary:
        con.print(summary_table(summary))
        if summary.get("failures"):
            examples = summary.get("failure_examples") or {}
            table = Table(title="failures by class")
            table.add_column("class")
            table.add_column("count", justify="right")
            table.add_column("example")
            for cls, n in summary["failures"].items():
                table.add_row(escape(cls), str(n), escape(str(examples.get(cls, ""))[:120]))
            con.print(table)
    elif t.measured:
        con.print(
            f"load: {fmt(t.throughput)} tok/s, latency P95 {fmt(t.objective_latency_s, '.3f', ' s')}, "
            + "".join(f"{f.label} {fmt(t.latency(f.name), '.3f', ' s')}, " for f in figures() if f.headline)
            + f"success {fmt(t.success_rate, '.1%')}"
        )
    if d.get("capacity_steps"):
        con.print(steps_table(d["capacity_steps"], d.get("scored_step")))
    if d.get("server_metrics"):
        con.print(kv_table("server metrics (/metrics during the run)", d["server_metrics"]))
    diagnosis = d.get("diagnosis") or t.diagnosis
    if diagnosis:
        con.print(f"[bold]diagnosis:[/bold] {escape(str(diagnosis))}")
    if t.constraints:
        pairs = zip(t.constraint_names, t.constraints, strict=True)
        con.print("constraints (<= 0 met): " + ", ".join(f"{escape(n)} {c:+.3f}" for n, c in pairs))
    con.print(f"server time: {t.server_seconds:.1f} s" + (f", attempts {d['attempts']}" if d.get("attempts") else ""))
    if d.get("log_tail"):
        tail = "\n".join(str(d["log_tail"]).splitlines()[-max(log_lines, 1) :])
        con.print("[bold]server log tail:[/bold]")
        con.print(tail, markup=False, highlight=False, soft_wrap=True)
    if detail is None:
        con.print("(no detail stored for this trial beyond Optuna's record)")


# -- tuner export --------------------------------------------------------------------------------------------------


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
) -> None:
    """The winning flags, ready to paste: `vllm serve` flags, a --config YAML, `docker run`, a compose service, a
    Kubernetes Deployment + Service, JSON or `LLM(**kwargs)`, with provenance comments. Secrets by name only.

    Example: [bold]tuner export night --best balanced --format kubernetes --plan 20 --peak 35 -o vllm.yaml[/bold]
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if (plan_rate is not None or peak is not None) and fmt != "kubernetes":
        raise ConfigError(f"--plan and --peak go with --format kubernetes, not {fmt!r}")
    if peak is not None and plan_rate is None:
        raise ConfigError("--peak needs --plan R, the requests per second to serve")
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
    again = f"tuner verify {shlex.quote(view.name)} --trial {t.number} --storage {shlex.quote(safe_url(url))}"
    prov = dataclasses.replace(provenance(view, t), verify_command=again)
    if plan_rate is None:
        text = render(fmt, trial_flags(t), options, prov)
    else:
        detail, _ = _detail(url, view.name, t.number)
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


def stored_job(view: StudyView, path: Path | None) -> Job:
    """The job a command that launches acts with: --job FILE, else the one stored with the study."""
    if path is not None:
        return load_job(path)
    stored = view.attrs.get("job")
    if not isinstance(stored, dict):
        raise ConfigError(f"study {view.name!r} holds no job; give the job file with --job FILE")
    return parse_job(stored, where=f"the job stored with study {view.name!r} (or give --job FILE)", stored=True)


def measured_trial(view: StudyView, trial: int | None, best: str) -> TrialView:
    """The trial a command acts on: --trial N, which must have been measured, else the --best front point."""
    if trial is None:
        return choose(pareto_front(view.trials), best, study=view.name)
    t = view.trial(trial)
    if t is None:
        raise TunerError(f"no trial {trial} in study {view.name!r}")
    if not t.measured:
        raise TunerError(f"trial {trial} of {view.name!r} has no measurement ({t.verdict}); pick a measured trial")
    return t


def trial_flags(t: TrialView) -> VllmFlags:
    try:
        return VllmFlags.from_dict(t.flags)
    except ValueError as e:
        raise TunerError(f"trial {t.number}'s stored flags are not vLLM flags: {e}") from None


# -- tuner rescore -------------------------------------------------------------------------------------------------


@app.command("rescore")
def rescore_cmd(
    study: StudyArg = None,
    slo: Annotated[
        list[str] | None,
        typer.Option(
            "--slo", help="A new SLO (repeatable), e.g. 'e2e_p95<=3s', 'success_rate>=0.99'.", show_default=False
        ),
    ] = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write the new front as HTML.", show_default=False)
    ] = None,
    png: Annotated[Path | None, typer.Option("--png", help="Write the new front as PNG.", show_default=False)] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Draw the new front in the terminal.")] = True,
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
    url, view = open_view(study, storage, job)
    store = _open_store(url)
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
        result = rescore(view, store, slos)
    finally:
        store.close()
    after = StudyView(name=view.name, attrs=view.attrs, trials=result.view_after)
    if html is not None:
        write_html(after, result.front, html)
    if png is not None:
        write_png(after, result.front, png)
    if as_json:
        _print_json(
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
    con = console_for_output()
    table = Table(title=f"{escape(view.name)} re-scored under {escape(', '.join(result.slos))}")
    for col in ("#", "before", "after", "tok/s", "latency P95", "success", "misses"):
        table.add_column(col, justify="right" if col in ("#", "tok/s", "latency P95", "success") else "left")
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
            fmt(a_.success_rate, ".1%"),
            escape(", ".join(a_.violated) or r.note or ""),
        )
    con.print(table)
    con.print(f"feasible: {result.feasible_before} → {result.feasible_after} trials (nothing written to the study)")
    _show_front(after, result.front, as_json=False, plot=plot, width=80, height=20)
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
        "constraints": list(r.after.constraints),
        "violated": list(r.after.violated),
        "step": r.step,
        "note": r.note,
    }
