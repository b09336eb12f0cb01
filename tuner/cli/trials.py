"""`tuner trials`: one row a trial, sorted and filtered; a table, CSV or JSON."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from tuner.cli import app
from tuner.cli.common import console_for_output, open_view, print_json
from tuner.cli.options import JobOpt, JsonOpt, StorageOpt, StudyArg, WideOpt
from tuner.errors import ConfigError
from tuner.record import OUTCOMES
from tuner.report import StudyView, TrialView
from tuner.report.overview import counts
from tuner.report.tables import figures_that_fit, flag_lines, flags_text, fmt, gpus_text, tok_s_column
from tuner.report.views import first_label
from tuner.scoring import METRICS, Figure, figures

__all__ = ["trials_cmd"]


_OUTCOMES = (*OUTCOMES, "running", "waiting", "fail")  # the record's outcomes, and Optuna states without one
# A headline P95 sorts by its metric's name (`ttft`), another statistic by the figure's (`ttft_p90`).
_FIGURE_KEYS = {(f.metric if f.stat == "p95" else f.name): f.name for f in figures() if f.headline}
_SORT_KEYS = ("number", "throughput", "latency", *_FIGURE_KEYS, "success", "good")
# The share of requests that met every latency SLO on their own (DistServe's goodput), beside the success rate.
_GOOD = METRICS["good_share"].label


def _sort_key(key: str) -> Any:
    inf = float("inf")
    keys = {
        "number": lambda t: t.number,
        "throughput": lambda t: -(t.throughput if t.measured and t.throughput is not None else -inf),
        "latency": lambda t: t.objective_latency_s if t.measured and t.objective_latency_s is not None else inf,
        **{key: _by_figure(name) for key, name in _FIGURE_KEYS.items()},
        "success": lambda t: -(t.success_rate if t.success_rate is not None else -inf),
        "good": lambda t: -(t.good_share if t.good_share is not None else -inf),
    }
    if key not in keys and Figure.named(key) is not None:
        return _by_figure(key)  # any recorded figure by its name: `--sort ttft_p90`
    if key not in keys:
        raise ConfigError(f"unknown --sort {key!r}; allowed: {', '.join(_SORT_KEYS)} or a figure (ttft_p90)")
    return keys[key]


def _by_figure(name: str) -> Callable[[TrialView], float]:
    def key(t: TrialView) -> float:
        value = t.latency(name)
        return value if value is not None else float("inf")

    return key


SortOpt = Annotated[str, typer.Option("--sort", help=f"Order, best first: {', '.join(_SORT_KEYS)}.", show_default=True)]
OutcomeOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--outcome",
        help="Only these outcomes (repeatable): measured, launch_failed, crashed, skipped_infeasible, interrupted.",
        show_default=False,
    ),
]
CsvOpt = Annotated[bool, typer.Option("--csv", help="Print CSV instead of a table.")]


def csv_fields(study: Sequence[Figure] = ()) -> list[str]:
    """The CSV's columns (the registry's figures as it is now); scripts read tuner 0.1's by place, so later ones
    are appended, never inserted: the figures the study's SLOs and objective name (`study`, `StudyView.figures`)
    beyond the registry's come last."""
    fixed = figures()
    return [
        *("number", "state", "baseline", "outcome", "verdict", "feasible", "throughput"),
        *("objective_latency_s", "latency_p95_s", "output_tok_s", "request_rate"),
        *(f.attr for f in fixed),
        "success_rate",
        *("goodput", "good_share", "diagnosis", "reason", "server_seconds", "flags"),
        *("output_tok_s_ci", "starts", "repeat_of"),
        *("replicas", "box_gpus", "box_request_rate", "tok_s_per_gpu", "usd_per_m_tokens"),
        "gpu_hours_per_m_requests",
        *("cost_load_rate", "cost_usd_per_hour", "cost_usd_per_m_tokens", "cost_gpu_hours_per_m_tokens"),
        *(f.attr for f in study if all(f.name != r.name for r in fixed)),
    ]


@app.command("trials")
def trials_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    sort: SortOpt = "number",
    reverse: Annotated[bool, typer.Option("--reverse", help="Reverse the order.")] = False,
    feasible: Annotated[bool, typer.Option("--feasible", help="Only trials that met every SLO.")] = False,
    outcome: OutcomeOpt = None,
    limit: Annotated[int | None, typer.Option("--limit", help="At most N rows.", show_default=False)] = None,
    as_json: JsonOpt = False,
    as_csv: CsvOpt = False,
    wide: WideOpt = False,
) -> None:
    """One row a trial: flags, throughput with its 95% interval, the latency figures the study's SLOs and
    objective name (a ttft_p90 SLO: TTFT P90), then TTFT and e2e P95 where they fit, success rate, the share of good
    requests (each met every latency SLO on its own: DistServe's goodput), verdict or reason, bottleneck. A flag set
    the confirmation started again is one row, its throughput pooled over its starts; --json and --csv list every
    start, a confirmation start with the trial it repeats (`repeat_of`).

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
    if not (as_json or as_csv):
        # A confirmation start is its flag set's: the row of its first trial holds it (tok/s pooled, its starts).
        rows = [t for t in rows if t.repeat_of is None]
    if limit is not None:
        rows = rows[: max(limit, 0)]
    if as_json:
        print_json([t.as_dict(view.figures) for t in rows])
    elif as_csv:
        typer.echo(trials_csv(rows, view.figures), nl=False)
    else:
        print_trials(view, rows, wide=wide)


def trials_csv(rows: list[TrialView], study: Sequence[Figure] = ()) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=csv_fields(study), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for t in rows:
        d = t.as_dict(study)
        d["flags"] = json.dumps(t.flags, sort_keys=True)
        d["output_tok_s_ci"] = json.dumps(list(t.throughput_ci)) if t.throughput_ci else None
        w.writerow(d)
    return buf.getvalue()


def print_trials(view: StudyView, rows: list[TrialView], *, wide: bool) -> None:
    """The table, the flags a line each (narrow), and the notes on its marks."""
    con = console_for_output()

    def table_of(shown: list[Figure]) -> Table:
        return _trials_table(view, rows, shown, wide=wide)

    con.print(table_of(figures_that_fit(view.named_figures, table_of, wide=wide)))
    if not wide:
        con.print(flag_lines([(_trial_key(t), flags_text(t.flags)) for t in rows]))
    con.print(f"counted: {counts(view).text()}")
    if any(t.baseline for t in rows):
        con.print("ᵇ baseline: vLLM's defaults on this GPU and model")
    if any(t.throughput_ci for t in rows):
        con.print("tok/s ± its 95% interval; ×N: pooled over the flag set's N starts")
    for t in rows:
        again = [x.number for x in view.starts_of(t.number) if x.repeat_of is not None]
        if again:
            numbers = ", ".join(f"#{n}" for n in again)
            con.print(f"#{t.number}: started again by {numbers} to confirm it ({t.starts} measured starts)")


def _trial_key(t: TrialView) -> str:
    return f"#{t.number}{'ᵇ' if t.baseline else ''}"


def _trials_table(view: StudyView, rows: list[TrialView], shown: list[Figure], *, wide: bool) -> Table:
    """Narrow (the default) fits 80 columns, the flags printed after it a line each; --wide: flags and bottleneck
    in the table. `shown`: the figure columns (`figures_that_fit`)."""
    labels = tuple(f.label for f in shown)
    # A cost study's first column is its cost per million output tokens at the job's load, then the GPUs it needs.
    first: tuple[str, ...] = (first_label(view.trials), "GPUs") if view.is_cost else ("tok/s",)
    cols: tuple[str, ...] = ("#", "flags", *first, *labels, "success", _GOOD, "verdict", "bottleneck")
    if not wide:
        cols = ("#", *first, *labels, "success", _GOOD, "verdict")
    numeric = ("#", *first, *labels, "success", _GOOD)
    confirming = len(view.confirmation_starts)
    folded = f" (+{confirming} confirmation start{'s' if confirming != 1 else ''})" if confirming else ""
    table = Table(title=f"{escape(view.name)}: {len(rows)} of {len(view.search_trials)} trials{folded}")
    for col in cols:
        table.add_column(col, justify="right" if col in numeric else "left", no_wrap=col in numeric)
    tok_s = tok_s_column(rows)
    for t in rows:
        style = "green" if t.feasible else ("yellow" if t.measured else "red")
        cells = {
            "#": f"{t.number}{'ᵇ' if t.baseline else ''}",
            "flags": escape(flags_text(t.flags)),
            "tok/s": tok_s[t.number],
            first[0]: t.throughput_text if t.costed or not view.is_cost else "—",
            "GPUs": gpus_text(t),
            **{f.label: fmt(t.latency(f.name), ".3f", " s") for f in shown},
            "success": fmt(t.success_rate, ".1%"),
            _GOOD: fmt(t.good_share, ".1%"),
            "verdict": f"[{style}]{escape(t.verdict)}[/{style}]" + (f" ×{t.starts}" if t.starts > 1 else ""),
            "bottleneck": escape(t.diagnosis or "—"),
        }
        table.add_row(*(cells[c] for c in cols))
    return table
