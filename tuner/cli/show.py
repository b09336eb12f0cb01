"""`tuner show`: everything stored for one trial."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tuner.cli import app
from tuner.cli.common import (
    JobOpt,
    JsonOpt,
    StorageOpt,
    console_for_output,
    open_view,
    print_json,
    request_records,
    trial_detail,
)
from tuner.errors import ConfigError, TunerError
from tuner.intervals import Interval, run_intervals
from tuner.load.contention import Contention
from tuner.report import StudyView, TrialView
from tuner.report.tables import flags_table, fmt, steps_table, summary_table
from tuner.report.uncertainty import FigureCI, figure_text, trial_intervals

__all__ = ["facts_table", "show_cmd", "value_text"]


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
    each figure with its 95% interval (the run's over its requests; over the flag set's starts where the study
    started it more than once), failure classes, server metrics, diagnosis, log tail.

    Example: [bold]tuner show night 7[/bold]
    """
    name, number = _study_and_trial(study, trial)
    url, view = open_view(name, storage, job)
    t = view.trial(number)
    if t is None:
        numbers = [x.number for x in view.trials]
        span = f"trials are {min(numbers)}..{max(numbers)}" if numbers else "it has no trials"
        raise TunerError(f"no trial {number} in study {view.name!r}; {span}")
    detail, steps = trial_detail(url, view.name, number)
    if as_json:
        d = detail.__dict__ if detail is not None else {}
        doc = {"trial": t.as_dict(view.figures), "detail": dict(d) or None, "request_steps": steps}
        doc["intervals"] = [_interval_doc(ci) for ci in _intervals(view, t.number, url, detail)]
        print_json(doc)
        return
    con = console_for_output()
    _print_launch(con, view, t, detail)
    _print_measurement(con, view, t, url, detail)
    _print_server(con, t, detail, log_lines)


def _print_launch(con: Console, view: StudyView, t: TrialView, detail: Any) -> None:
    """The trial's verdict, its flags, what was predicted and what the server said as it started."""
    d = detail.__dict__ if detail is not None else {}
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
            con.print(facts_table(title, d[key]))
    if t.kv_tokens is not None or t.predicted_kv_tokens is not None:
        con.print(f"KV tokens: predicted {fmt(t.predicted_kv_tokens, ',')}, measured {fmt(t.kv_tokens, ',')}")


def _print_measurement(con: Console, view: StudyView, t: TrialView, url: str, detail: Any) -> None:
    """The load's figures with their intervals, the box and its cost, the capacity search's steps."""
    d = detail.__dict__ if detail is not None else {}
    summary = d.get("load_summary")
    if summary:
        con.print(summary_table(summary))
        if summary.get("failures"):
            con.print(_failures_table(summary))
    elif t.measured:
        con.print(
            f"load: {fmt(t.output_tok_s if view.is_cost else t.throughput)} tok/s, "
            f"latency ({view.latency_metric}) {fmt(t.objective_latency_s, '.3f', ' s')}, "
            + "".join(f"{f.label} {fmt(t.latency(f.name), '.3f', ' s')}, " for f in view.headline_figures)
            + f"success {fmt(t.success_rate, '.1%')}, "
            + f"goodput {fmt(t.goodput, '.2f', ' req/s')} ({fmt(t.good_share, '.1%')} good)"
        )
    _print_intervals(con, view, t.number, url, detail)
    if t.measured and t.replicas is not None:
        con.print(box_line(t))
    if t.costed:
        con.print(cost_line(t))
    if d.get("capacity_steps"):
        con.print(steps_table(d["capacity_steps"], d.get("scored_step"), view.named_figures))


def _print_server(con: Console, t: TrialView, detail: Any, log_lines: int) -> None:
    """What the server's metrics said, the diagnosis, the constraints, its time and its log's tail."""
    d = detail.__dict__ if detail is not None else {}
    if d.get("server_metrics"):
        con.print(facts_table("server metrics (/metrics during the run)", d["server_metrics"]))
    _print_machine_and_diagnosis(con, t, d)
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


def _print_machine_and_diagnosis(con: Console, t: TrialView, d: dict[str, Any]) -> None:
    """What the machine was doing during the load (its figures hold for that), then what limited the run."""
    contention = Contention.of(t.contention)
    if contention is not None:
        style = "yellow" if contention.lagged else "default"
        con.print(f"[bold]machine during the load:[/bold] [{style}]{escape(contention.describe())}[/{style}]")
    diagnosis = d.get("diagnosis") or t.diagnosis
    if diagnosis:
        con.print(f"[bold]diagnosis:[/bold] {escape(str(diagnosis))}")


# Keys whose value is a fraction of a whole (KV cache in use, the prefix cache's hits): shown as a percentage.
_SHARE_WORDS = ("usage", "utilization", "hit_rate", "share", "fraction")


# A key's unit, from how its name ends.
_UNITS = (("_s", " s"), ("_seconds", " s"), ("_gib", " GiB"))


def value_text(key: str, value: Any) -> str:
    """A stored value as a person reads it: — for none, yes/no, thousands separated, a share as a percentage,
    seconds with their unit; never Python's `None`, `True` or `1.997e+04`."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    unit = next((u for end, u in _UNITS if key.endswith(end)), "")
    if isinstance(value, int):
        return f"{value:,}{unit}"
    if isinstance(value, float):
        if any(word in key for word in _SHARE_WORDS) and 0 <= value <= 1:
            return f"{value:.1%}"
        if value.is_integer() and abs(value) < 1e15:
            return f"{value:,.0f}{unit}"
        return (f"{value:,.1f}" if abs(value) >= 100 else f"{value:.4g}") + unit
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def facts_table(title: str, data: dict[str, Any]) -> Table:
    """A stored mapping (a prediction, start-up facts, server metrics) as key and readable value."""
    table = Table(title=title, show_header=False, min_width=48)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in data.items():
        table.add_row(escape(str(k)), escape(value_text(str(k), v)))
    return table


def _failures_table(summary: dict[str, Any]) -> Table:
    examples = summary.get("failure_examples") or {}
    table = Table(title="failures by class")
    table.add_column("class")
    table.add_column("count", justify="right")
    table.add_column("example")
    for cls, n in summary["failures"].items():
        table.add_row(escape(cls), str(n), escape(str(examples.get(cls, ""))[:120]))
    return table


def _intervals(view: StudyView, number: int, url: str, detail: Any) -> list[FigureCI]:
    """The trial's figures with their intervals; a trial whose record kept none (an older study) has them computed
    from its per-request records, where the storage holds them."""
    t = view.trial(number)
    if t is not None and t.measured and not t.run_intervals and detail is not None:
        duration = float((detail.load_summary or {}).get("duration_s") or 0.0)
        records = request_records(url, view.name, number)
        if records and duration > 0:
            cis = run_intervals(records, duration, seed=number, named=view.named_figures)
            kept = {k: (ci.value, ci.low, ci.high) for k, ci in cis.items()}
            trials = [replace(x, run_intervals=kept) if x.number == number else x for x in view.trials]
            view = replace(view, trials=trials)
    return trial_intervals(view, number)


def _interval_doc(ci: FigureCI) -> dict[str, Any]:
    def triple(i: Interval | None) -> list[float] | None:
        return None if i is None else [i.value, i.low, i.high]

    return {"figure": ci.name, "run": triple(ci.run), "over_starts": triple(ci.starts), "starts": ci.n_starts}


def _print_intervals(con: Console, view: StudyView, number: int, url: str, detail: Any) -> None:
    cis = _intervals(view, number, url, detail)
    if not any(ci.run is not None and ci.run.high > ci.run.low for ci in cis) and not any(ci.starts for ci in cis):
        return
    n = max(ci.n_starts for ci in cis)
    table = Table(title="figures, ± their 95% intervals")
    table.add_column("figure")
    table.add_column("this run (over its requests)", justify="right")
    if n > 1:
        table.add_column(f"its flags over {n} starts", justify="right")
    for ci in cis:
        cells = [ci.label, figure_text(ci.run, ci.unit)]
        table.add_row(*cells, *([figure_text(ci.starts, ci.unit)] if n > 1 else []))
    con.print(table)


def box_line(t: TrialView) -> str:
    """The trial on the whole box: its replicas, throughput, per GPU, and what a million tokens and requests cost."""
    rate = f", {t.box_request_rate:,.2f} req/s" if t.box_request_rate is not None else ""
    usd = (
        f"${t.usd_per_m_tokens:,.2f} per million output tokens"
        if t.usd_per_m_tokens is not None
        else "no price (target.gpu_hour_usd)"
    )
    hours = f", {t.gpu_hours_per_m_requests:,.1f} GPU-h per million requests" if t.gpu_hours_per_m_requests else ""
    shape = f"{t.replicas} replica{'s' if t.replicas != 1 else ''} on {t.box_gpus} GPU{'s' if t.box_gpus != 1 else ''}"
    # A cost study's first value is tokens per $: its box's throughput is its replicas' at their capacity.
    tok_s = t.box_output_tok_s if t.costed else t.throughput
    # Per GPU from the figure beside it (a pooled throughput is not the first start's), and only where it differs.
    gpus = t.box_gpus or 1
    per_gpu = f" ({fmt(tok_s / gpus if tok_s is not None else None)} per GPU)" if gpus > 1 else ""
    return f"box: {shape}: {fmt(tok_s)} tok/s{per_gpu}{rate}; {usd}{hours}"


def cost_line(t: TrialView) -> str:
    """A cost study's verdict: the box the job's load needs, each replica at its capacity, and what it costs."""
    each = (t.box_gpus or 1) // max(1, t.replicas or 1)
    capacity = f"{t.request_rate:,.2f} req/s" if t.request_rate is not None else "—"
    hourly = f"${t.cost_usd_per_hour:,.2f} an hour, " if t.cost_usd_per_hour is not None else ""
    return (
        f"cost: the job's {t.cost_load_rate or 0:,.2f} req/s need {t.replicas} x {each} GPUs (a replica's capacity "
        f"within the SLOs: {capacity}): {hourly}{t.cost_text} per million output tokens"
    )
