"""In the morning: `tuner studies`, `status`, `trials`, `pareto`, `show`, `export`, `rescore`.

Each reads the study through Optuna's public API (and the project's tables for detail and per-request records),
renders with Rich, and never starts a server.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import optuna
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tuner import __version__
from tuner.cli import app
from tuner.errors import ConfigError, StorageError, TunerError
from tuner.export import DEFAULT_IMAGE, FORMATS, DeployOptions, Provenance, render
from tuner.flags import VllmFlags
from tuner.report import (
    BEST_CHOICES,
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
from tuner.report.storage import job_study_name, safe_url

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
StudyArg = Annotated[str | None, typer.Argument(help="Study name (default: the --job file's).", show_default=False)]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]

_SHORT = {
    "max_num_seqs": "seqs",
    "max_model_len": "len",
    "gpu_memory_utilization": "util",
    "max_num_batched_tokens": "batch",
    "tensor_parallel_size": "tp",
    "kv_cache_dtype": "kv",
    "block_size": "block",
    "enable_chunked_prefill": "chunked",
    "enable_prefix_caching": "prefix",
    "enforce_eager": "eager",
}
_OUTCOMES = ("measured", "launch_failed", "crashed", "skipped_infeasible", "interrupted", "running", "waiting", "fail")
_SORT_KEYS = ("number", "throughput", "latency", "ttft", "e2e", "success")


def _console() -> Console:
    width = os.environ.get("COLUMNS")
    return Console(width=int(width) if width and width.isdigit() else None, highlight=False, soft_wrap=False)


def _quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


@contextlib.contextmanager
def _opened(study: str | None, storage: str | None, job: Path | None) -> Iterator[tuple[str, optuna.Study]]:
    _quiet_optuna()
    if study is None:
        if job is None:
            raise ConfigError("name the study (STUDY) or give --job FILE; `tuner studies` lists them")
        study = job_study_name(job)
    url = resolve_storage(storage, job)
    with opened_study(url, study) as s:
        yield url, s


def _view(study: str | None, storage: str | None, job: Path | None) -> tuple[str, StudyView]:
    """The study read once; an empty one is an error for every command that reads trials."""
    with _opened(study, storage, job) as (url, s):
        view = study_view(s)
    _need_trials(view, url)
    return url, view


def _need_trials(view: StudyView, url: str) -> None:
    if not view.trials:
        raise TunerError(f"study {view.name!r} in {safe_url(url)} has no trials yet")


def _fmt(v: float | None, spec: str = ",.1f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"×{v:.2f}"


def flags_text(flags: dict[str, Any]) -> str:
    """Compact: `seqs=192 len=8192 util=0.93 batch=4096 prefix=off`."""
    parts = []
    for k, v in flags.items():
        if isinstance(v, bool):
            v = "on" if v else "off"
        parts.append(f"{_SHORT.get(k, k)}={v}")
    return " ".join(parts) or "(vLLM defaults)"


def _print_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2, default=str))


# -- tuner studies -------------------------------------------------------------------------------------------------


@app.command("studies")
def studies_cmd(storage: StorageOpt = None, job: JobOpt = None, as_json: JsonOpt = False) -> None:
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
    table = Table(title=f"studies in {escape(safe_url(url))}")
    for col in ("study", "state", "trials", "running", "feasible", "best tok/s", "GPU", "model", "started"):
        table.add_column(col, justify="right" if col in ("trials", "running", "feasible", "best tok/s") else "left")
    for r in rows:
        best = f"{r.best_throughput:,.1f} (#{r.best_trial})" if r.best_throughput is not None else "—"
        table.add_row(
            escape(r.name),
            r.state,
            str(r.trials),
            str(r.running),
            str(r.feasible),
            best,
            escape(r.gpu or "—"),
            escape(r.model or "—"),
            r.started.strftime("%Y-%m-%d %H:%M") if r.started else "—",
        )
    _console().print(table)


# -- tuner status --------------------------------------------------------------------------------------------------


@app.command("status")
def status_cmd(
    study: StudyArg = None, storage: StorageOpt = None, job: JobOpt = None, as_json: JsonOpt = False
) -> None:
    """Progress of a study: budget, running trials, best so far, failures by reason, skips and the server time
    they saved.

    Example: [bold]tuner status night --storage sqlite:///night.db[/bold]
    """
    _, view = _view(study, storage, job)
    st = status(view)
    if as_json:
        _print_json(st.as_dict())
        return
    con = _console()
    a = view.attrs
    con.print(
        f"[bold]{escape(view.name)}[/bold]  {st.state}  ·  GPU {escape(str(a.get('gpu', '?')))}  ·  "
        f"model {escape(str(a.get('model', '?')))}  ·  launcher {escape(str(a.get('launcher', '?')))}  ·  "
        f"objective {escape(str(a.get('objective', 'throughput')))}"
    )
    if view.slos:
        con.print("SLOs: " + escape(", ".join(view.slos)))
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
        vs = f"  ({_ratio(r.throughput)} throughput, {_ratio(r.latency_p95)} P95 vs baseline)" if base else ""
        con.print(
            f"best so far: trial {st.best.number}: {_fmt(st.best.throughput)} tok/s, "
            f"P95 {_fmt(st.best.latency_p95_s, '.3f', ' s')}{vs}  {escape('[' + flags_text(st.best.flags) + ']')}"
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


# -- tuner trials --------------------------------------------------------------------------------------------------


def _sort_key(key: str) -> Any:
    inf = float("inf")
    keys = {
        "number": lambda t: t.number,
        "throughput": lambda t: -(t.throughput if t.measured and t.throughput is not None else -inf),
        "latency": lambda t: t.latency_p95_s if t.measured and t.latency_p95_s is not None else inf,
        "ttft": lambda t: t.ttft_p95_s if t.ttft_p95_s is not None else inf,
        "e2e": lambda t: t.e2e_p95_s if t.e2e_p95_s is not None else inf,
        "success": lambda t: -(t.success_rate if t.success_rate is not None else -inf),
    }
    if key not in keys:
        raise ConfigError(f"unknown --sort {key!r}; allowed: {', '.join(_SORT_KEYS)}")
    return keys[key]


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
) -> None:
    """One row a trial: flags, throughput, P95 TTFT and e2e, success rate, verdict or reason, bottleneck.

    Example: [bold]tuner trials night --sort throughput --feasible --limit 10[/bold]
    """
    key = _sort_key(sort)
    unknown = sorted(set(outcome or ()) - set(_OUTCOMES))
    if unknown:
        raise ConfigError(f"unknown --outcome {', '.join(unknown)}; allowed: {', '.join(_OUTCOMES)}")
    _, view = _view(study, storage, job)
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
        fields = ["number", "state", "baseline", "outcome", "verdict", "feasible", "throughput", "latency_p95_s"]
        fields += ["output_tok_s", "request_rate", "ttft_p95_s", "e2e_p95_s", "tpot_p95_s", "success_rate"]
        fields += ["goodput", "diagnosis", "reason", "server_seconds", "flags"]
        w = csv.DictWriter(buf, fieldnames=fields, extrasaction="ignore", lineterminator="\n")
        w.writeheader()
        for t in rows:
            d = t.as_dict()
            d["flags"] = json.dumps(t.flags, sort_keys=True)
            w.writerow(d)
        typer.echo(buf.getvalue(), nl=False)
        return
    table = Table(title=f"{escape(view.name)}: {len(rows)} of {len(view.trials)} trials")
    for col in ("#", "flags", "tok/s", "TTFT P95", "e2e P95", "success", "verdict", "bottleneck"):
        table.add_column(col, justify="right" if col in ("#", "tok/s", "TTFT P95", "e2e P95", "success") else "left")
    for t in rows:
        num = f"{t.number}{'ᵇ' if t.baseline else ''}"
        style = "green" if t.feasible else ("yellow" if t.measured else "red")
        table.add_row(
            num,
            escape(flags_text(t.flags)),
            _fmt(t.throughput if t.measured else t.output_tok_s),
            _fmt(t.ttft_p95_s, ".3f", " s"),
            _fmt(t.e2e_p95_s, ".3f", " s"),
            _fmt(t.success_rate, ".1%"),
            f"[{style}]{escape(t.verdict)}[/{style}]",
            escape(t.diagnosis or "—"),
        )
    _console().print(table)
    if any(t.baseline for t in rows):
        _console().print("ᵇ baseline: vLLM's defaults on this GPU and model")


# -- tuner pareto --------------------------------------------------------------------------------------------------


def _front_table(view_name: str, front: list[TrialView], baseline: TrialView | None, title: str) -> Table:
    picks = {how: choose(front, how).number for how in BEST_CHOICES} if front else {}
    table = Table(title=title)
    for col in ("pick", "#", "tok/s", "latency P95", "TTFT P95", "e2e P95", "success", "× tok/s", "× P95", "flags"):
        table.add_column(col, justify="left" if col in ("pick", "flags") else "right")
    for t in front:
        r = ratios(t, baseline)
        table.add_row(
            ", ".join(h for h, n in picks.items() if n == t.number),
            str(t.number),
            _fmt(t.throughput),
            _fmt(t.latency_p95_s, ".3f", " s"),
            _fmt(t.ttft_p95_s, ".3f", " s"),
            _fmt(t.e2e_p95_s, ".3f", " s"),
            _fmt(t.success_rate, ".1%"),
            _ratio(r.throughput),
            _ratio(r.latency_p95),
            escape(flags_text(t.flags)),
        )
    if baseline is not None:
        table.add_section()
        table.add_row(
            "baseline",
            str(baseline.number),
            _fmt(baseline.throughput if baseline.measured else None),
            _fmt(baseline.latency_p95_s if baseline.measured else None, ".3f", " s"),
            _fmt(baseline.ttft_p95_s, ".3f", " s"),
            _fmt(baseline.e2e_p95_s, ".3f", " s"),
            _fmt(baseline.success_rate, ".1%"),
            "×1.00" if baseline.measured else "—",
            "×1.00" if baseline.measured else "—",
            escape(f"{baseline.verdict}; {flags_text(baseline.flags)}"),
        )
    return table


def _front_json(front: list[TrialView], baseline: TrialView | None) -> dict[str, Any]:
    picks: dict[str, Any] = {}
    for how in BEST_CHOICES if front else ():
        w = choose(front, how)
        r = ratios(w, baseline)
        picks[how] = {"trial": w.number, "throughput_ratio": r.throughput, "latency_p95_ratio": r.latency_p95}
    return {
        "front": [t.as_dict() for t in front],
        "baseline": baseline.as_dict() if baseline else None,
        "picks": picks,
    }


@app.command("pareto")
def pareto_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="Write an interactive Plotly chart here.", show_default=False)
    ] = None,
    png: Annotated[
        Path | None, typer.Option("--png", help="Write a static PNG here (needs tuner[png]).", show_default=False)
    ] = None,
    plot: Annotated[bool, typer.Option("--plot/--no-plot", help="Draw the scatter plot in the terminal.")] = True,
    width: Annotated[int, typer.Option("--width", help="Terminal plot width (columns).")] = 80,
    height: Annotated[int, typer.Option("--height", help="Terminal plot height (rows).")] = 20,
    as_json: JsonOpt = False,
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
    _show_front(view, front, as_json=as_json, plot=plot, width=width, height=height)
    if not front:
        choose(front, "throughput", study=view.name)  # raises the one-line NoFeasibleTrial


def _show_front(view: StudyView, front: list[TrialView], *, as_json: bool, plot: bool, width: int, height: int) -> None:
    baseline = view.baseline
    if as_json:
        _print_json({"study": view.name, "latency_metric": view.latency_metric, **_front_json(front, baseline)})
        return
    con = _console()
    measured = sum(t.measured for t in view.trials)
    title = (
        f"{escape(view.name)}: feasible front, {len(front)} of {measured} measured trials "
        f"(latency = {view.latency_metric})"
    )
    con.print(_front_table(view.name, front, baseline, title))
    if plot:
        con.print(terminal_scatter(view, front, width=width, height=height, color=con.is_terminal), markup=False)


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


def _kv_table(title: str, data: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, min_width=48)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in data.items():
        if isinstance(v, float):
            v = f"{v:,.4g}"
        table.add_row(escape(str(k)), escape(json.dumps(v) if isinstance(v, dict | list) else str(v)))
    return table


@app.command("show")
def show_cmd(
    study: Annotated[str, typer.Argument(help="Study name.")],
    trial: Annotated[int, typer.Argument(help="Trial number.")],
    storage: StorageOpt = None,
    job: JobOpt = None,
    as_json: JsonOpt = False,
    log_lines: Annotated[int, typer.Option("--log-lines", help="Lines of the server log tail to show.")] = 30,
) -> None:
    """Everything stored for one trial: flags, prediction, start-up facts, load summary with all percentiles,
    failure classes, server metrics, diagnosis, log tail.

    Example: [bold]tuner show night 7[/bold]
    """
    url, view = _view(study, storage, job)
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
    con = _console()
    style = "green" if t.feasible else ("yellow" if t.measured else "red")
    con.print(
        f"[bold]{escape(view.name)} · trial {t.number}[/bold]{' (baseline: vLLM defaults)' if t.baseline else ''}  "
        f"{t.state}  [{style}]{escape(t.verdict)}[/{style}]"
    )
    con.print(_flags_table(view, t.flags))
    if d.get("message"):
        con.print(f"[red]{escape(str(d['message']))}[/red]")
    for key, title in (
        ("prediction", "prediction (before launch)"),
        ("startup_facts", "start-up facts (from the log)"),
    ):
        if d.get(key):
            con.print(_kv_table(title, d[key]))
    if t.kv_tokens is not None or t.predicted_kv_tokens is not None:
        con.print(f"KV tokens: predicted {_fmt(t.predicted_kv_tokens, ',')}, measured {_fmt(t.kv_tokens, ',')}")
    summary = d.get("load_summary")
    if summary:
        con.print(_summary_table(summary))
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
            f"load: {_fmt(t.throughput)} tok/s, latency P95 {_fmt(t.latency_p95_s, '.3f', ' s')}, "
            f"TTFT P95 {_fmt(t.ttft_p95_s, '.3f', ' s')}, success {_fmt(t.success_rate, '.1%')}"
        )
    if d.get("capacity_steps"):
        con.print(_steps_table(d["capacity_steps"], d.get("scored_step")))
    if d.get("server_metrics"):
        con.print(_kv_table("server metrics (/metrics during the run)", d["server_metrics"]))
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


def _flags_table(view: StudyView, flags: dict[str, Any]) -> Table:
    resolved: dict[str, Any] = {}
    try:
        from tuner.catalog import get_gpu, load_model
        from tuner.flags import resolve

        r = resolve(VllmFlags.from_dict(flags), get_gpu(str(view.attrs["gpu"])), load_model(str(view.attrs["model"])))
        resolved = r.__dict__
    except (KeyError, TunerError, ValueError):
        pass
    table = Table(title="flags")
    table.add_column("flag")
    table.add_column("trial")
    table.add_column("as vLLM runs it")
    names = list(dict.fromkeys([*flags, *resolved]))
    for name in names:
        given = flags.get(name)
        table.add_row(
            "--" + name.replace("_", "-"),
            "—" if given is None else escape(str(given)),
            escape(str(resolved.get(name, given))) + ("" if name in flags else " (default)"),
        )
    return table


def _summary_table(summary: dict[str, Any]) -> Table:
    head = (
        f"load: {summary.get('requests_succeeded', 0)}/{summary.get('requests_sent', 0)} ok "
        f"({summary.get('success_rate', 0):.1%}) in {summary.get('duration_s', 0):.1f} s · "
        f"{summary.get('output_throughput', 0):,.1f} output tok/s · {summary.get('request_throughput', 0):.2f} req/s · "
        f"goodput {summary.get('goodput', 0):.2f} req/s · concurrency {summary.get('concurrency', 0):.1f}"
    )
    table = Table(title=head)
    stats = ("mean", "p50", "p90", "p95", "p99", "max")
    table.add_column("latency (s)")
    for st in stats:
        table.add_column(st, justify="right")
    for metric in ("ttft", "tpot", "itl", "e2e"):
        p = summary.get(metric) or {}
        table.add_row(metric, *(_fmt(p.get(st), ".4f") for st in stats))
    return table


def _steps_table(steps: list[Any], scored: int | None) -> Table:
    table = Table(title="capacity search (request rate steps)")
    for col in ("step", "rate req/s", "tok/s", "e2e P95", "success", "meets SLOs"):
        table.add_column(col, justify="right")
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            continue
        s = step.get("summary") or {}
        table.add_row(
            f"{i}{' ←' if i == scored else ''}",
            _fmt(step.get("rate"), ".2f"),
            _fmt(s.get("output_throughput")),
            _fmt((s.get("e2e") or {}).get("p95"), ".3f", " s"),
            _fmt(s.get("success_rate"), ".1%"),
            "yes" if step.get("meets_slos") else "no",
        )
    return table


# -- tuner export --------------------------------------------------------------------------------------------------


def _hub_model(attrs: dict[str, Any]) -> str:
    """The name vLLM should load: the job's `model_id` for its launcher, else a built-in profile's Hugging Face id,
    else the model name or path as the study recorded it."""
    from tuner.catalog import BUILTIN_MODELS

    target = _job_target(attrs)
    for section in (str(attrs.get("launcher") or ""), "docker", "process"):
        model_id = (target.get(section) or {}).get("model_id") if isinstance(target.get(section), dict) else None
        if isinstance(model_id, str) and model_id:
            return model_id
    name = str(attrs.get("model") or "")
    profile = BUILTIN_MODELS.get(name.strip().lower())
    return profile.name if profile is not None else name


def _job_target(attrs: dict[str, Any]) -> dict[str, Any]:
    job = attrs.get("job")
    target = job.get("target") if isinstance(job, dict) else None
    return target if isinstance(target, dict) else {}


def _image(attrs: dict[str, Any]) -> str:
    """The image measured (docker launcher), else the job's vLLM image (pinned by the job file), else the default."""
    docker = _job_target(attrs).get("docker")
    job_image = docker.get("image") if isinstance(docker, dict) else None
    return str(attrs.get("image") or job_image or DEFAULT_IMAGE)


def _secret_names(attrs: dict[str, Any]) -> tuple[str, ...]:
    """HF_TOKEN, plus every variable the job passed through to its server (names only: values never stored)."""
    target = _job_target(attrs)
    names = ["HF_TOKEN"]
    for section in ("docker", "process"):
        env = (target.get(section) or {}).get("env") if isinstance(target.get(section), dict) else None
        names += [str(n) for n in env or [] if isinstance(n, str)]
    return tuple(dict.fromkeys(names))


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
) -> None:
    """The winning flags, ready to paste: `vllm serve` flags, a --config YAML, `docker run`, a compose service, a
    Kubernetes Deployment + Service, JSON or `LLM(**kwargs)`, with provenance comments. Secrets by name only.

    Example: [bold]tuner export night --best balanced --format kubernetes -o vllm.yaml[/bold]
    """
    if fmt not in FORMATS:
        raise ConfigError(f"unknown --format {fmt!r}; allowed: {', '.join(FORMATS)}")
    _, view = _view(study, storage, job)
    if trial is not None:
        t = view.trial(trial)
        if t is None:
            raise TunerError(f"no trial {trial} in study {view.name!r}")
        if not t.measured:
            raise TunerError(f"trial {trial} of {view.name!r} has no measurement ({t.verdict}); pick a measured trial")
        if not t.feasible:
            typer.echo(f"warning: trial {trial} {t.verdict}", err=True)
    else:
        t = choose(pareto_front(view.trials), best, study=view.name)
    a = view.attrs
    model_name = model or _hub_model(a)
    if not model_name:
        raise ConfigError("the study records no model: give --model NAME")
    options = DeployOptions(
        model=model_name,
        image=image or _image(a),
        port=port,
        name=name,
        secret_env=tuple(secret_env) if secret_env is not None else _secret_names(a),
    )
    prov = Provenance(
        study=view.name,
        trial=t.number,
        baseline=t.baseline,
        image=_opt(a.get("image")),
        gpu=_opt(a.get("gpu")),
        model=_opt(a.get("model")),
        launcher=_opt(a.get("launcher")),
        workload_hash=_opt(a.get("workload_hash")),
        output_tok_s=t.throughput,
        latency_p95_s=t.latency_p95_s,
        ttft_p95_s=t.ttft_p95_s,
        e2e_p95_s=t.e2e_p95_s,
        success_rate=t.success_rate,
        slos=tuple(view.slos),
        tuner_version=__version__,
    )
    try:
        flags = VllmFlags.from_dict(t.flags)
    except ValueError as e:
        raise TunerError(f"trial {t.number}'s stored flags are not vLLM flags: {e}") from None
    text = render(fmt, flags, options, prov)
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as e:
        raise TunerError(f"cannot write {output}: {e.strerror or e}") from None
    typer.echo(f"wrote {output} (trial {t.number}, {fmt})", err=True)


def _opt(v: Any) -> str | None:
    return str(v) if v is not None else None


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
    url, view = _view(study, storage, job)
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
                "trials": [
                    {
                        "number": r.after.number,
                        "feasible_before": r.before.feasible,
                        "feasible_after": r.after.feasible,
                        "throughput": r.after.throughput,
                        "latency_p95_s": r.after.latency_p95_s,
                        "constraints": list(r.after.constraints),
                        "violated": list(r.after.violated),
                        "step": r.step,
                        "note": r.note,
                    }
                    for r in result.trials
                ],
                **_front_json(result.front, after.baseline),
            }
        )
        return
    con = _console()
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
            _fmt(a_.throughput),
            _fmt(a_.latency_p95_s, ".3f", " s"),
            _fmt(a_.success_rate, ".1%"),
            escape(", ".join(a_.violated) or r.note or ""),
        )
    con.print(table)
    con.print(f"feasible: {result.feasible_before} → {result.feasible_after} trials (nothing written to the study)")
    _show_front(after, result.front, as_json=False, plot=plot, width=80, height=20)
    if not result.front:
        choose(result.front, "throughput", study=view.name)
