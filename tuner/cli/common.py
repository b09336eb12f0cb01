"""What the commands share: the study options (--storage, --job, STUDY, --json, --wide: declared in options.py,
named here too), opening a study, the trial a command acts on, the front as the morning commands print it, and the
server root from --url."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import typer
from rich.console import Console
from rich.markup import escape

from tuner.cli.extras import need_storage_driver
from tuner.cli.options import JobOpt, JsonOpt, StorageOpt, StudyArg, WideOpt
from tuner.config import Job, load_job, parse_job
from tuner.errors import ConfigError, StorageError, TunerError
from tuner.flags import VllmFlags
from tuner.report import (
    StudyView,
    TrialView,
    choose,
    opened_study,
    pareto_front,
    resolve_storage,
    study_view,
    terminal_scatter,
)
from tuner.report.front import separability_line
from tuner.report.overview import counts
from tuner.report.storage import job_study_name, sole_study
from tuner.report.tables import front_doc, front_flags, front_table
from tuner.store import safe_url

__all__ = [
    "JobOpt",
    "JsonOpt",
    "StorageOpt",
    "StudyArg",
    "WideOpt",
    "console_for_output",
    "measured_trial",
    "need_trials",
    "open_store",
    "open_view",
    "opened",
    "print_json",
    "quiet_optuna",
    "request_records",
    "show_front",
    "storage_url",
    "stored_job",
    "target_url",
    "trial_detail",
    "trial_flags",
    "write_output",
]


def console_for_output() -> Console:
    width = os.environ.get("COLUMNS")
    return Console(width=int(width) if width and width.isdigit() else None, highlight=False, soft_wrap=False)


def quiet_optuna() -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def storage_url(storage: str | None, job: Path | None) -> str:
    """The storage a command reads (--storage, the --job file's, $TUNER_STORAGE_URL, ./tuner.db), its database
    driver checked: a missing one is the one line naming the extra, not Optuna's import error."""
    url = resolve_storage(storage, job)
    need_storage_driver(url)
    return url


@contextlib.contextmanager
def opened(study: str | None, storage: str | None, job: Path | None) -> Iterator[tuple[str, optuna.Study]]:
    """The study named (or the --job file's, or the storage's only one), open while the block runs."""
    quiet_optuna()
    url = storage_url(storage, job)
    if study is None:
        study = job_study_name(job) if job is not None else sole_study(url)
    with opened_study(url, study) as s:
        yield url, s


def open_view(study: str | None, storage: str | None, job: Path | None) -> tuple[str, StudyView]:
    """The study read once; an empty one is an error for every command that reads trials."""
    with opened(study, storage, job) as (url, s):
        view = study_view(s)
    need_trials(view, url)
    return url, view


def need_trials(view: StudyView, url: str) -> None:
    if not view.trials:
        raise TunerError(f"study {view.name!r} in {safe_url(url)} has no trials yet")


def print_json(doc: Any) -> None:
    typer.echo(json.dumps(doc, indent=2, default=str))


def open_store(url: str) -> Any | None:
    """The project's tables, or None when this storage has none (a study written by Optuna alone)."""
    from tuner.store import open_store as open_tables

    try:
        return open_tables(url, migrate=False)
    except StorageError:
        return None


def trial_detail(url: str, study: str, number: int) -> tuple[Any | None, list[Any]]:
    """A trial's stored detail and per-request steps; (None, []) where the storage holds none."""
    store = open_store(url)
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


def request_records(url: str, study: str, number: int) -> list[Any]:
    """A trial's per-request records of its scored load step; [] where the storage holds none."""
    store = open_store(url)
    if store is None:
        return []
    try:
        return list(store.request_records(study, number))
    except StorageError:
        return []
    finally:
        store.close()


def stored_job(view: StudyView, path: Path | None) -> Job:
    """The job a command that launches acts with: --job FILE, else the one stored with the study."""
    if path is not None:
        return load_job(path)
    stored = view.record.job
    if stored is None:
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


def show_front(
    view: StudyView, front: list[TrialView], *, as_json: bool, plot: bool, width: int, height: int, wide: bool = False
) -> None:
    """The feasible front as `pareto` and `rescore` print it: table, flags, scatter plot, the export hint."""
    baseline = view.baseline
    if as_json:
        print_json({"study": view.name, "latency_metric": view.latency_metric, **front_doc(front, baseline)})
        return
    con = console_for_output()
    measured = counts(view).measured  # flag sets measured: not a repeat's or a confirmation start's copy
    title = (
        f"{escape(view.name)}: feasible front, {len(front)} of {measured} measured trials "
        f"(latency = {view.latency_metric})"
    )
    con.print(front_table(front, baseline, title, wide=wide, named=view.named_figures, objective=view.latency_metric))
    if not wide:
        con.print(front_flags(front, baseline))
    if (line := separability_line(view, front)) is not None:
        con.print(line, markup=False, highlight=False)
    if plot:
        scatter = terminal_scatter(view, front, width=min(width, con.width), height=height, color=con.is_terminal)
        con.print(scatter, markup=False, highlight=False, soft_wrap=True)
    if front:
        winner = choose(front, "throughput")
        hint = f"export it: tuner export {shlex.quote(view.name)} --trial {winner.number} --format docker"
        con.print(hint, markup=False, highlight=False)


def write_output(text: str, output: Path | None, what: str) -> None:
    """A command's text to stdout, or to --output FILE with a line on stderr saying what was written."""
    if output is None:
        typer.echo(text, nl=False)
        return
    try:
        output.write_text(text)
    except OSError as e:
        raise TunerError(f"cannot write {output}: {e.strerror or e}") from None
    typer.echo(f"wrote {output} ({what})", err=True)


def target_url(url: str) -> str:
    """The server root: accepts http://host:8000 or the OpenAI base http://host:8000/v1."""
    u = url.strip().rstrip("/")
    if not re.match(r"^https?://[^/\s]+", u):
        raise ConfigError(f"--url {url!r}: give the server's address, e.g. http://localhost:8000")
    return u[: -len("/v1")] if u.endswith("/v1") else u
