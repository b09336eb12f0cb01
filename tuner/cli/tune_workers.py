"""`tuner tune --parallel N`'s terminal: the study's progress and a line for every worker (its trial, its GPUs)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path

import optuna
import typer
from optuna.trial import FrozenTrial
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from tuner.cli.progress_lines import PlainProgress
from tuner.cli.trial_lines import (
    TextLog,
    best_text,
    closing_once,
    console,
    count_done,
    fit_console_to_output,
    front_line,
    pareto_table,
    search_trace_rate,
    trial_line,
)
from tuner.config import Job
from tuner.errors import TunerError
from tuner.store import safe_url
from tuner.study.measure import Measure
from tuner.study.parallel import WorkerEvent, run_parallel
from tuner.study.run import RunReport, TuningRun
from tuner.study.storage import sqlite_wal

__all__ = ["run_workers"]


def _progress() -> Progress | PlainProgress:
    """A row for the study (its budget, the best so far) and one a worker (its trial, its GPUs, the trial's time);
    in a file or a pipe, the study's progress as a plain line a finished trial."""
    if not fit_console_to_output():
        return PlainProgress(console)
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(bar_width=12),
        TextColumn("{task.fields[count]}"),
        TimeElapsedColumn(),
        TextColumn("{task.fields[best]}"),
        console=console,
        transient=False,
    )


class _WorkerRows:
    """The progress rows: the study's (its budget, the best so far) and one a worker (its trial, its GPUs)."""

    def __init__(
        self,
        progress: Progress | PlainProgress,
        say: Callable[[str], None],
        study: optuna.Study,
        n: int,
        workers: int,
        trace_rate: float | None = None,
    ) -> None:
        self.progress, self.say, self.study, self.n = progress, say, study, n
        self.trace_rate = trace_rate  # a rate search on a trace: each trial's rate is a speed-up of it
        done = count_done(study)
        self.overall = progress.add_task(
            "study", total=n, completed=done, count=f"{done}/{n} trials", best=best_text(study)
        )
        self.rows = [
            progress.add_task(f"worker {i + 1}: starting", total=None, count="", best="") for i in range(workers)
        ]
        self.ran = [0] * workers

    def __call__(self, e: WorkerEvent) -> None:
        who, row, progress = f"worker {e.worker + 1}", self.rows[e.worker], self.progress
        if e.kind == "event":
            self.say(f"{who}: {e.args[0]}")
        elif e.kind == "start":
            progress.reset(row, description=f"{who}: trial #{e.args[0]}, waiting for GPUs")  # elapsed: this trial's
        elif e.kind == "gpus":
            progress.update(row, description=f"{who}: trial #{e.args[0]} on GPU {','.join(e.args[1])}")
        elif e.kind == "end":
            t: FrozenTrial = e.args[0]
            self.ran[e.worker] += 1
            self.say(f"{trial_line(t, self.trace_rate)}  ({who})")
            progress.update(row, description=f"{who}: trial #{t.number} done", count=f"{self.ran[e.worker]} run")
            done = count_done(self.study)
            progress.update(self.overall, completed=done, count=f"{done}/{self.n} trials", best=best_text(self.study))
        elif e.kind == "done":
            progress.update(row, description=f"{who}: finished ({e.args[1]})")
            if isinstance(progress, PlainProgress):  # a log has no rows: the worker's end is a line of its own
                self.say(f"{who}: finished ({e.args[1]})")
        elif e.kind == "failed":
            progress.update(row, description=f"{who}: {e.args[0]}")
            if e.args[0] != "interrupted":
                self.say(f"{who}: {e.args[1]}")
        elif e.kind == "died":
            progress.update(row, description=f"{who}: died")
            self.say(
                f"{who} died (exit {e.args[0]}); its trial is failed by the heartbeat and run again by another worker"
            )


def run_workers(
    job: Job, url: str, log_file: Path | None, *, workers: int, gpus: Sequence[str], measure: Measure
) -> None:
    from tuner.launch.factory import build_launcher
    from tuner.report.rejudge import rejudge

    log = TextLog(log_file)
    progress = _progress()

    def say(line: str) -> None:
        progress.console.print(line, markup=False)  # a record's `[same flags as #2]` is text, not a style
        log(line)

    launcher = build_launcher(job)
    for line in launcher.cleanup_leftovers(job.study.name):
        say(f"cleaned up: {line}")
    if url.startswith("sqlite"):
        sqlite_wal(url)  # before any connection of this run holds the file
    # The study is made ready once, here: created with its baseline, interrupted trials requeued, said once.
    parent = TuningRun(job, launcher, storage_url=url, on_event=say, measure=measure, rejudge=rejudge)
    n = job.budget.n_trials

    started = time.monotonic()
    try:
        parent.prepare()
        with progress:
            done = count_done(parent.study)
            view = _WorkerRows(progress, say, parent.study, n, workers, search_trace_rate(job))
            say(
                f"study {job.study.name!r} in {safe_url(url)}: {done}/{n} trials done; {workers} workers on GPUs "
                f"{', '.join(gpus)}"
            )
            report = run_parallel(job, url, workers, gpus, on_event=view, measure=measure)
        took = time.monotonic() - started
        whole = RunReport(parent.study, report.trials_run, ",".join(sorted(set(report.stopped_by))) or "budget")
        say(
            f"finished ({whole.stopped_by}) after {took:.0f}s; {report.trials_run} trials run by {workers} workers; "
            f"{whole.distinct} distinct flag sets tried ({whole.measured} measured), {whole.repeats_said()} "
            "(not counted in the budget)"
        )
        console.print(pareto_table(parent.study))
        for line in closing_once(parent.closing()):  # how sure the result is, from every worker's starts
            say(line)
        log(front_line(parent.study))
    except KeyboardInterrupt:
        say(
            "interrupted: every worker's running trial is recorded as interrupted and will run again, every server "
            "is stopped; the same command continues"
        )
        raise typer.Exit(130) from None
    except TunerError as e:
        log(f"error: {e}")
        log.details(e)  # what lay behind it, for the log file only
        raise
    finally:
        parent.close()
        log.close()
