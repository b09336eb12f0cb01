"""`tuner verify`: launch a study's winner again and confirm it over several runs of the study's own load."""

from __future__ import annotations

import json
import math
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
    StudyArg,
    console_for_output,
    measured_trial,
    open_view,
    stored_job,
    trial_flags,
)
from tuner.cli.options import BestOpt, TrialOpt
from tuner.config import Job
from tuner.errors import ConfigError, LaunchError, TunerError
from tuner.intervals import NOT_SEPARABLE, format_with_ci, platform_prior
from tuner.launch.factory import build_launcher
from tuner.load.contention import Contention, contention_warning, pooled
from tuner.report import StudyView, TrialView, choose, pareto_front
from tuner.study.confirm import noise_of
from tuner.study.measure import measure_load
from tuner.verify import Retest, Verification, VerifyRun, retest_against_baseline, study_claim, verify_flags

__all__ = ["verify_cmd"]


TopOpt = Annotated[
    int | None,
    typer.Option(
        "--top", min=1, max=20, help="Verify the K highest-throughput front points and rank them.", show_default=False
    ),
]
ToleranceOpt = Annotated[
    float,
    typer.Option(
        "--tolerance",
        min=0.0,
        max=1.0,
        help="Median tok/s may differ this fraction from the record (below it: a miss; above it and outside the "
        "runs' interval: the record was wrong).",
    ),
]

RunsOpt = Annotated[
    int,
    typer.Option(
        "--runs",
        min=1,
        max=50,
        help="Pairs of fresh starts against the baseline (with --alone: load runs on one server).",
    ),
]
AloneOpt = Annotated[
    bool,
    typer.Option(
        "--alone",
        help="Re-measure the trial alone on one server against its record, rather than against the baseline in pairs "
        "of fresh starts.",
    ),
]


@app.command("verify")
def verify_cmd(
    study: StudyArg = None,
    storage: StorageOpt = None,
    job: JobOpt = None,
    trial: TrialOpt = None,
    best: BestOpt = "throughput",
    top: TopOpt = None,
    runs: RunsOpt = 3,
    alone: AloneOpt = False,
    tolerance: ToleranceOpt = 0.10,
    as_json: JsonOpt = False,
) -> None:
    """Re-test a winner against the baseline on fresh servers, started alternately, and say whether the ranking
    reproduced.

    Each of --runs pairs starts the trial and the baseline one right after the other (the trial first, then the
    baseline first in the next pair, and so on) and runs the study's load once on each; the ranking is judged by
    the 95% interval of the pairs' ratios, never against a figure stored at another time: "reproduced" (the
    interval excludes zero on the side the study found), "not reproduced" (on the other side) or "not separable"
    (it includes zero); where the study itself could not separate them, "separated" when the re-test can. Exit 0
    when the study's conclusion held (reproduced, or not separable as the study said), 1 when not. The baseline
    itself, a study without a measured baseline, --top and --alone re-measure the trial alone instead, as follows.

    Alone: confirmed: every one of --runs runs meets every SLO (an SLO within the noise of its bound is decided by the
    runs' majority, never one run), the median output tok/s is not more than --tolerance below the record, and
    the record is reproduced: a record beyond --tolerance of the median and outside the runs' 95% interval, in
    either direction, was wrong, and the verdict says by how much (the interval adds the between-start noise the
    study learnt, when it confirmed its result). With --top K, the K best front points are verified and ranked
    by their medians: one lucky run cannot pick the winner. Exit 0 when (one) is confirmed, 1 when not. The
    server is started with the study's launcher, model and GPU; the job comes from --job, else from the study.

    Example: [bold]tuner verify night --trial 4 --runs 5[/bold]   ·   [bold]tuner verify night --top 3[/bold]
    """
    _, view = open_view(study, storage, job)
    if top is not None and trial is not None:
        raise ConfigError("give --trial N or --top K, not both")
    candidates = _candidates(view, trial, best, top)
    the_job = stored_job(view, job)
    con = console_for_output()
    # The baseline's first measured start (an interrupted first one was run again as the baseline)
    base = next((t for t in view.trials if t.baseline and t.measured and t.repeat_of is None), None)
    if top is None and not alone and base is not None and candidates[0].flags != base.flags:
        _retest(con, view, the_job, candidates[0], base, runs, as_json=as_json)
    results = _verify_each(con, view, the_job, candidates, runs, tolerance, as_json=as_json)
    winner = _winner(results)
    if as_json:
        doc = [_as_dict(view, t, v) if v is not None else {"trial": t.number, "verdict": why} for t, v, why in results]
        out: Any = doc[0] if top is None else {"winner": winner.number if winner else None, "candidates": doc}
        typer.echo(json.dumps(out, indent=2))
    elif top is not None:
        con.print(_ranking(view, results, winner))
    raise typer.Exit(0 if winner is not None else 1)


def _verify_each(
    con: Console, view: StudyView, job: Job, candidates: list[TrialView], runs: int, tolerance: float, *, as_json: bool
) -> list[tuple[TrialView, Verification | None, str | None]]:
    """Each candidate re-measured alone against its record, its table and verdict printed as it comes."""
    results: list[tuple[TrialView, Verification | None, str | None]] = []
    for t in candidates:
        try:
            v = _verify_one(con, view, job, t, runs, tolerance, quiet=as_json)
        except LaunchError as e:
            why = f"not confirmed: trial {t.number}'s flags did not start again ({e.reason}): {e}"
            if len(candidates) == 1:
                raise TunerError(why) from None
            results.append((t, None, why))
            continue
        results.append((t, v, None))
        if not as_json:
            con.print(_table(view, t, v))
            style = "green" if v.confirmed else "red"
            con.print(f"[bold {style}]{escape(v.verdict())}[/bold {style}]")
            record, now = Contention.of(t.contention), pooled([r.contention for r in v.runs])
            if note := contention_warning(now, record, "the re-test", f"the record of #{t.number}"):
                con.print(f"[yellow]{escape(note)}[/yellow]")
    return results


def _retest(
    con: Console, view: StudyView, job: Job, t: TrialView, base: TrialView, pairs: int, *, as_json: bool
) -> None:
    """The trial against the baseline in pairs of fresh starts; exits 0 when the study's ranking reproduced."""
    status = con.status(f"re-testing trial {t.number} against the baseline #{base.number} ...")

    def progress(which: str, i: int, run: VerifyRun | None) -> None:
        label = f"trial {t.number}" if which == "trial" else f"the baseline #{base.number}"
        if run is None:
            status.update(f"pair {i + 1} of {pairs}: starting {label} ...")
        elif not as_json:
            con.print(f"pair {i + 1}/{pairs} {label}: {_run_text(run, view.latency_metric)}")

    noise = noise_of(view.attrs)
    if not noise.df:  # a study from before the prior: the platform's alone
        noise = platform_prior(job.gpu_profile().is_cpu).noise
    try:
        with status:
            r = retest_against_baseline(
                job, build_launcher(job), trial_flags(t), trial_flags(base), pairs=pairs,
                claimed_above=_claimed(view, t, base),
                latency_metric=view.latency_metric, study=view.name, measure=measure_load, on_run=progress, prior=noise,
            )  # fmt: skip
    except LaunchError as e:
        raise TunerError(f"{NOT_SEPARABLE}: a server did not start again ({e.reason}): {e}") from None
    if as_json:
        typer.echo(json.dumps(_retest_dict(view, t, base, r), indent=2))
    else:
        con.print(_pairs_table(view, t, base, r))
        style = "green" if r.held else "red"
        con.print(f"[bold {style}]{escape(r.verdict())}[/bold {style}]")
    raise typer.Exit(0 if r.held else 1)


def _claimed(view: StudyView, t: TrialView, base: TrialView) -> bool | None:
    """The study's conclusion of the trial against the baseline; a study kept from before confirmation recorded
    its pairs has only its point figures to go by."""
    confirm = view.record.confirm
    if confirm:
        return study_claim(confirm, t.number, base.number)
    return (t.throughput or 0.0) >= (base.throughput or 0.0)


def _pairs_table(view: StudyView, t: TrialView, base: TrialView, r: Retest) -> Table:
    title = f"{view.name} · trial {t.number} against the baseline #{base.number}, {len(r.pairs)} pairs of fresh starts"
    table = Table(title=title, title_justify="left")
    for col in ("pair", "order", f"#{t.number} tok/s", f"#{base.number} tok/s", "ratio"):
        table.add_column(col, justify="left" if col in ("pair", "order") else "right")
    for i, (a, b) in enumerate(r.pairs):
        order = f"#{t.number} then #{base.number}" if i % 2 == 0 else f"#{base.number} then #{t.number}"
        ratio = f"{a / b - 1:+.1%}" if b > 0 else "-"
        table.add_row(str(i + 1), order, f"{a:,.1f}", f"{b:,.1f}", ratio)
    d = r.difference
    shown = "-" if d is None else f"{d.value:+.1%} ({d.low:+.0%}..{d.high:+.0%})"
    table.add_row("95% CI", "", "", "", shown, style="bold")
    table.add_row("study", "", t.throughput_text, base.throughput_text, "", style="dim")
    return table


def _retest_dict(view: StudyView, t: TrialView, base: TrialView, r: Retest) -> dict[str, Any]:
    d = r.difference
    return {
        "study": view.name,
        "trial": t.number,
        "baseline": base.number,
        "ranking": r.ranking,
        "verdict": r.verdict(),
        "study_tok_s": {"trial": t.throughput, "baseline": base.throughput},
        "claimed_above": r.claimed_above,
        "held": r.held,
        "pairs": [
            {"trial_tok_s": a, "baseline_tok_s": b, "trial_first": i % 2 == 0} for i, (a, b) in enumerate(r.pairs)
        ],
        "difference": None if d is None else [d.value, d.low, d.high],
    }


def _candidates(view: StudyView, trial: int | None, best: str, top: int | None) -> list[TrialView]:
    if top is None:
        return [measured_trial(view, trial, best)]
    front = pareto_front(view.trials)
    if not front:
        choose(front, "throughput", study=view.name)  # raises the no-feasible-trial error
    return sorted(front, key=lambda t: (-(t.throughput or 0.0), t.number))[:top]


def _verify_one(
    con: Console, view: StudyView, job: Job, t: TrialView, runs: int, tolerance: float, *, quiet: bool
) -> Verification:
    flags = trial_flags(t)
    status = con.status(f"launching trial {t.number}'s flags ({job.target.launcher}) ...")

    def progress(i: int, run: VerifyRun | None) -> None:
        if run is None:
            status.update(f"trial {t.number}: load run {i + 1} of {runs} ...")
        elif not quiet:
            con.print(f"trial {t.number} run {i + 1}/{runs}: {_run_text(run, view.latency_metric)}")

    with status:
        return verify_flags(
            job,
            build_launcher(job),
            flags,
            runs=runs,
            # A flag set the study started more than once is recorded by its figure pooled over those starts
            recorded_tok_s=t.throughput_ci[0] if t.starts > 1 and t.throughput_ci else t.output_tok_s or t.throughput,
            latency_metric=view.latency_metric,
            tolerance=tolerance,
            study=view.name,
            on_run=progress,
            noise=noise_of(view.attrs),
        )


def _winner(results: list[tuple[TrialView, Verification | None, str | None]]) -> TrialView | None:
    confirmed = [(t, v) for t, v, _ in results if v is not None and v.confirmed]
    if not confirmed:
        return None
    return max(confirmed, key=lambda tv: (tv[1].median_tok_s, -tv[0].number))[0]


def _ranking(
    view: StudyView, results: list[tuple[TrialView, Verification | None, str | None]], winner: TrialView | None
) -> Table:
    title = f"{view.name}: front points verified" + (f"; winner #{winner.number}" if winner else "; none confirmed")
    table = Table(title=title, title_justify="left")
    for col in ("trial", "recorded tok/s", "median tok/s", "change", "spread", "verdict"):
        table.add_column(col, justify="left" if col in ("trial", "verdict") else "right")
    for t, v, why in results:
        mark = " ★" if winner is not None and t.number == winner.number else ""
        recorded = _recorded(t)
        if v is None:
            table.add_row(f"#{t.number}", recorded, "-", "-", "-", f"[red]{escape(why or '')}[/red]")
            continue
        change = f"{v.change:+.1%}" if v.change is not None else "-"
        style = "green" if v.confirmed else "red"
        verdict = "confirmed" if v.confirmed else v.verdict().removeprefix("not confirmed: ")
        table.add_row(
            f"#{t.number}{mark}", recorded, _median(v), change, f"{v.spread:.1%}",
            f"[{style}]{escape(verdict)}[/{style}]",
        )  # fmt: skip
    return table


def _recorded(t: TrialView) -> str:
    """The study's figure with its interval (pooled over its starts where it confirmed the flag set)."""
    if t.throughput_ci is None:
        return f"{t.output_tok_s or t.throughput or 0:,.1f}"
    return t.throughput_text + (f" ×{t.starts}" if t.starts > 1 else "")


def _median(v: Verification) -> str:
    interval = v.interval
    if interval is None or len(v.runs) < 2:
        return f"{v.median_tok_s:,.1f}"
    return format_with_ci(v.median_tok_s, interval.low, interval.high, "")


def _run_tok_s(run: VerifyRun) -> str:
    """A run's tok/s with its within-run interval (a bootstrap over its requests)."""
    ci = run.figures.get("output_tok_s")
    return f"{run.output_tok_s:,.1f}" if ci is None else format_with_ci(run.output_tok_s, ci.low, ci.high, "")


def _run_text(run: VerifyRun, metric: str) -> str:
    latency = f"{run.latency_p95_s:.2f}s" if math.isfinite(run.latency_p95_s) else "-"
    verdict = "meets the SLOs" if run.meets else "misses " + ", ".join(run.missed)
    return f"{_run_tok_s(run)} tok/s  {metric} {latency}  success {run.success_rate:.1%}  {verdict}"


def _table(view: StudyView, t: TrialView, v: Verification) -> Table:
    table = Table(title=f"{view.name} · trial {t.number} verified over {len(v.runs)} runs", title_justify="left")
    for col in ("run", "tok/s", f"{view.latency_metric} s", "success", "SLOs"):
        table.add_column(col, justify="left" if col in ("run", "SLOs") else "right")
    for i, r in enumerate(v.runs, start=1):
        lat = f"{r.latency_p95_s:.2f}" if math.isfinite(r.latency_p95_s) else "-"
        slos = "[green]met[/green]" if r.meets else "[red]" + escape(", ".join(r.missed)) + "[/red]"
        table.add_row(str(i), _run_tok_s(r), lat, f"{r.success_rate:.1%}", slos)
    table.add_row("median", f"{v.median_tok_s:,.1f}", f"{v.median_latency_s:.2f}", "", "", style="bold")
    interval = v.interval
    if interval is not None and len(v.runs) > 1:
        ci = format_with_ci(v.median_tok_s, interval.low, interval.high, "").strip()
        table.add_row("95% CI", ci, "", "", "", style="bold")
    if t.throughput is not None:
        lat = f"{t.objective_latency_s:.2f}" if t.objective_latency_s is not None else "-"
        ok = f"{t.success_rate:.1%}" if t.success_rate is not None else ""
        table.add_row("recorded", _recorded(t), lat, ok, "", style="dim")
    return table


def _as_dict(view: StudyView, t: TrialView, v: Verification) -> dict[str, Any]:
    return {
        "study": view.name,
        "trial": t.number,
        "flags": t.flags,
        "confirmed": v.confirmed,
        "verdict": v.verdict(),
        "recorded_tok_s": v.recorded_tok_s,
        # The record's interval: pooled over the flag set's starts where the study confirmed it, else its run's
        "recorded_tok_s_ci": list(t.throughput_ci) if t.throughput_ci is not None else None,
        "recorded_starts": t.starts,
        "median_tok_s": v.median_tok_s,
        "change": v.change,
        "reproduced": v.reproduced,
        "interval_tok_s": [v.interval.low, v.interval.high] if v.interval is not None else None,
        "spread": v.spread,
        "tolerance": v.tolerance,
        "latency_metric": v.latency_metric,
        "runs": [
            {
                "output_tok_s": r.output_tok_s,
                "latency_p95_s": r.latency_p95_s if math.isfinite(r.latency_p95_s) else None,
                "success_rate": r.success_rate,
                "missed": list(r.missed),
                "diagnosis": r.diagnosis,
            }
            for r in v.runs
        ],
    }
