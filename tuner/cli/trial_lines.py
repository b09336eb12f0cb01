"""What a study prints as it runs: a trial's line, the Pareto front's table, the best so far, the plain log file.

Shared by `tuner tune`'s one-worker run (tuner/cli/tune.py) and its `--parallel` run (tuner/cli/tune_workers.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import logging
import math
import os
import re
import statistics
import sys
import traceback
from pathlib import Path
from typing import IO, Any

import optuna
from optuna.trial import FrozenTrial, TrialState
from rich.console import Console
from rich.table import Table

from tuner.cli.cost_lines import best_cost_text, trial_cost_part
from tuner.config import Job
from tuner.record import MEASURED, TrialRecord
from tuner.report.tables import flag_label
from tuner.scoring import OBJECTIVE_FALLBACK

__all__ = [
    "TextLog",
    "best_text",
    "closing_once",
    "console",
    "count_done",
    "fit_console_to_output",
    "front_line",
    "pareto_table",
    "search_trace_rate",
    "short_flags",
    "trial_line",
]

console = Console(highlight=False)

# A log file's width: wide enough that no table of the study's is folded to fit.
LOG_WIDTH = 1000


def fit_console_to_output() -> bool:
    """A terminal keeps its width and Rich's bar; stdout a file or a pipe (`nohup tuner tune ... > night.log`)
    never wraps a line, so that `grep` finds a trial's record whole. True when stdout is a terminal."""
    if console.is_terminal:
        return True
    console.soft_wrap = True
    columns = os.environ.get("COLUMNS", "")
    console.width = int(columns) if columns.isdigit() else LOG_WIDTH
    return False


def short_flags(flags: dict[str, Any]) -> str:
    return " ".join(
        f"{flag_label(k)}={v:g}" if isinstance(v, float) else f"{flag_label(k)}={v}" for k, v in flags.items()
    )


def search_trace_rate(job: Job) -> float | None:
    """A rate search on a trace: the slice's own mean rate, of which each trial's rate is a speed-up."""
    return job.arrival.trace_rate() if job.objective != "throughput" and job.arrival.trace is not None else None


def trial_line(t: FrozenTrial, trace_rate: float | None = None) -> str:
    """One line a person reads in the morning: flags -> throughput, P95, success, verdict or reason; with
    `trace_rate` (a rate search on a trace: its slice's own mean rate), the speed-up the rate found means."""
    r = TrialRecord.from_attrs(t.user_attrs)
    head = f"#{t.number:<3}{' (baseline)' if r.baseline else ''} {short_flags(r.flags)}"
    suffix = f"  [same flags as #{r.duplicate_of}, not relaunched]" if r.duplicate_of is not None else ""
    if t.user_attrs.get("repeat_of") is not None:  # a confirmation start (tuner.study.confirm): launched again
        suffix = f"  [#{t.user_attrs['repeat_of']} started again, to confirm it]"
    suffix += f"  [GPU {','.join(r.devices)}]" if r.devices else ""
    if r.outcome != MEASURED:
        return f"{head} -> {r.outcome}: {r.reason}{suffix}"
    metric = r.latency_metric or OBJECTIVE_FALLBACK
    latency = t.values[1] if t.values else None
    verdict = "feasible" if r.feasible else "misses " + ", ".join(_missed(r))
    if r.slo_stop:
        verdict += " (load stopped early: the miss was certain)"
    rate = r.request_rate
    parts = [
        f"{_scored_tok_s(t, r):.1f} tok/s"
        + (f" at {rate:.2f} req/s" if rate else "")
        + (f" (the trace x{rate / trace_rate:.3g})" if rate and trace_rate else ""),
        f"{metric} {latency:.2f}s" if latency is not None else "",
        f"success {r.success_rate:.1%}" if r.success_rate is not None else "",
        _turns(r),
        trial_cost_part(r),
        verdict,
    ]
    return f"{head} -> " + "  ".join(p for p in parts if p) + suffix


def _scored_tok_s(t: FrozenTrial, r: TrialRecord) -> float:
    """The tok/s the study compared the trial by, as the progress bar and the front show it: its first value (the
    box's, or a capacity search's rate x tokens); a cost trial's first value is a cost, so its run's own."""
    if t.values and t.values[0] > 0 and r.cost_gpu_hours_per_m_tokens is None:
        return float(t.values[0])
    return r.output_tok_s or 0.0


def _turns(r: TrialRecord) -> str:
    """A conversation workload's TTFT p95 of first and later turns, and how much of its prompts the cache served."""
    first, later = r.ttft_p95_first_turn_s, r.ttft_p95_later_turns_s
    if first is None and later is None:
        return ""
    text = "ttft_p95 by turn " + "/".join("-" if v is None else f"{v:.2f}s" for v in (first, later)) + " first/later"
    hits = r.prefix_cache_hit_rate
    return text + (f", prefix cache {hits:.0%}" if hits is not None else "")


def _missed(r: TrialRecord) -> list[str]:
    names, values = r.constraint_names or [], r.constraints or []
    return [n.removeprefix("slo:") for n, v in zip(names, values, strict=False) if v > 0] or ["SLOs"]


def pareto_table(study: optuna.Study) -> Table:
    """The end-of-run front in 80 columns, as `tuner pareto` shows it (a flag set started again by the confirmation
    at its pooled figure): the figures in the table, each point's flags a line under it; `tuner pareto --wide` has
    every column."""
    from tuner.report import pareto_front, study_view
    from tuner.report.front import separability_line
    from tuner.report.tables import front_flags, front_table

    view = study_view(study)
    front = pareto_front(view.trials)
    first = "cost per M output tokens" if view.is_cost else "output tok/s"
    title = f"Feasible Pareto front of {study.study_name} ({first} vs {view.latency_metric})"
    # One Table (the type callers print) holding the table and its flag lines.
    both = Table.grid()
    both.add_row(front_table(front, view.baseline, title, named=view.named_figures, objective=view.latency_metric))
    both.add_row(front_flags(front, view.baseline))
    if (line := separability_line(view, front)) is not None:
        both.add_row(line)
    return both


class TextLog:
    """The plain --log-file: one timestamped line per event and per finished trial, and the details a person is
    spared on the terminal (the tuner's own log records with their tracebacks; an error's chain of causes)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._f: IO[str] | None = path.open("a", encoding="utf-8") if path else None
        self._handlers: list[logging.Handler] = []
        if self._f is not None:
            self._capture(logging.getLogger("tuner"))

    def __call__(self, line: str) -> None:
        self._write(f"{dt.datetime.now(dt.UTC).isoformat(timespec='seconds')} {line}\n")

    def details(self, error: BaseException) -> None:
        """`error` with every exception behind it, each with its traceback: what the one line on the terminal left
        out."""
        self._write(_chain_text(error) + "\n")

    def _write(self, text: str) -> None:
        if self._f is None:
            return
        try:
            self._f.write(text)
            self._f.flush()
        except OSError as e:
            # A full disk: the study goes on, its lines on the terminal alone (said once).
            self.close()
            self._f = None
            why = e.strerror or e
            console.print(f"the log file {self.path} cannot be written ({why}); lines go to the terminal only")

    def _capture(self, logger: logging.Logger) -> None:
        """The tuner's log records into this file, details and all; its warnings still on the terminal (as Python
        prints them without a handler), one line each, their tracebacks in the file only."""
        into_file = _Into(lambda record: self(_with_details(record)))
        terminal = _Into(lambda record: sys.stderr.write(record.getMessage() + "\n"), logging.WARNING)
        self._handlers = [into_file, terminal]
        self._level = logger.level
        logger.setLevel(logging.DEBUG)
        for h in self._handlers:
            logger.addHandler(h)

    def close(self) -> None:
        logger = logging.getLogger("tuner")
        for h in self._handlers:
            logger.removeHandler(h)
        if self._handlers:
            logger.setLevel(self._level)
        self._handlers = []
        if self._f is not None:
            with contextlib.suppress(OSError):  # what was not flushed had no room: already said
                self._f.close()


class _Into(logging.Handler):
    def __init__(self, write: Any, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self._write_record = write

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._write_record(record)
        except Exception:
            self.handleError(record)


def _with_details(record: logging.LogRecord) -> str:
    text = f"{record.levelname.lower()} {record.name}: {record.getMessage()}"
    if record.exc_info and record.exc_info[1] is not None:
        text += "\n" + _chain_text(record.exc_info[1])
    return text


def _chain_text(error: BaseException) -> str:
    """The exceptions behind `error`, first cause first, each with its traceback; also a cause hidden with
    `from None`, which is often the one that explains it (the driver's error under ours)."""
    chain: list[BaseException] = []
    link: BaseException | None = error
    while link is not None and link not in chain and len(chain) < 10:
        chain.append(link)
        link = link.__cause__ or link.__context__
    parts = ["".join(traceback.format_exception(type(e), e, e.__traceback__, chain=False)) for e in reversed(chain)]
    return "".join(parts).rstrip()


def count_done(study: optuna.Study) -> int:
    """As the budget counts: a repeat of a flag set already tried is not a trial of the budget."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    return sum(t.user_attrs.get("duplicate_of") is None for t in done)


def best_text(study: optuna.Study) -> str:
    """The progress bar's best: a flag set (its first trial's number, never a confirmation start's) at its tok/s
    pooled over every feasible start of it, as the confirmation and the front pool it (a geometric mean)."""
    starts: dict[int, list[FrozenTrial]] = {}
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        record = TrialRecord.from_attrs(t.user_attrs)
        repeat_of = t.user_attrs.get("repeat_of")
        if not (record.feasible and t.values) or (record.duplicate_of is not None and repeat_of is None):
            continue
        starts.setdefault(int(repeat_of) if repeat_of is not None else t.number, []).append(t)
    if not starts:
        return "best feasible: none yet"
    first = min(starts, key=lambda n: (-_pooled(starts[n]), n))
    group = starts[first]
    record = TrialRecord.from_attrs(group[0].user_attrs)
    if record.cost_gpu_hours_per_m_tokens is not None:
        return best_cost_text(first, record)
    over = f" over {len(group)} starts" if len(group) > 1 else ""
    return f"best feasible: #{first} {_pooled(group):.1f} tok/s{over}"


def _pooled(group: list[FrozenTrial]) -> float:
    values = [t.values[0] for t in group if t.values and t.values[0] > 0]
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else 0.0


def front_line(study: optuna.Study) -> str:
    """The study log's last line: the front's trial numbers, for a script reading the log."""
    numbers = [t.number for t in study.best_trials]
    return f"the front's trials (Optuna's best_trials, starts again included): {json.dumps(numbers)}"


# The headline says the leader and the baseline are within the noise of each other, with its interval; the list of
# flag sets that cannot be told from the leader then named the baseline again, in other words.
_BASELINE_HEADLINE = " and the baseline are not separable"
_BASELINE_AGAIN = re.compile(r" and the baseline \(#\d+\) are not separable")


def closing_once(lines: list[str]) -> list[str]:
    """The study's closing lines with each thing said once: the baseline's `not separable` in the headline only."""
    if not any(_BASELINE_HEADLINE in line for line in lines):
        return lines
    return [line for line in lines if not _BASELINE_AGAIN.search(line)]
