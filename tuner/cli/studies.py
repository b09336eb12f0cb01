"""`tuner studies`: the studies in a storage, a row each."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from tuner.cli import app
from tuner.cli.common import (
    JobOpt,
    JsonOpt,
    StorageOpt,
    WideOpt,
    console_for_output,
    print_json,
    quiet_optuna,
    storage_url,
)
from tuner.errors import StorageError
from tuner.report import StudyListing, listing, opened_study, study_names, study_view
from tuner.store import safe_url

__all__ = ["studies_cmd"]


@app.command("studies")
def studies_cmd(
    storage: StorageOpt = None, job: JobOpt = None, as_json: JsonOpt = False, wide: WideOpt = False
) -> None:
    """List the studies in a storage: trials, state, best feasible throughput.

    Example: [bold]tuner studies --storage sqlite:///night.db[/bold]
    """
    quiet_optuna()
    url = storage_url(storage, job)
    names = study_names(url)
    if not names:
        raise StorageError(f"no study in {safe_url(url)}")
    rows = []
    for name in names:
        with opened_study(url, name) as s:
            rows.append(listing(study_view(s)))
    if as_json:
        print_json([r.as_dict() for r in rows])
        return
    console_for_output().print(_studies_table(rows, url, wide=wide))


def _studies_table(rows: list[StudyListing], url: str, *, wide: bool) -> Table:
    """Narrow (the default) fits 80 columns: what picks a study out; --wide adds running, model and start."""
    cols: tuple[str, ...] = ("study", "state", "trials", "running", "feasible", "best tok/s", "GPU", "model", "started")
    if not wide:
        cols = ("study", "state", "trials", "feasible", "best tok/s", "GPU")
    numeric = ("trials", "running", "feasible", "best tok/s")
    table = Table(title=f"studies in {escape(safe_url(url))}")
    # A cost study's best is its cheapest ($ per million output tokens): the column then says both.
    label = {"best tok/s": "best tok/s or $" if any(r.best_cost is not None for r in rows) else "best tok/s"}
    for col in cols:
        # Names wrap rather than end in "…": a cut study name cannot be typed back.
        table.add_column(label.get(col, col), justify="right" if col in numeric else "left", overflow="fold")
    for r in rows:
        best = f"{r.best_throughput:,.1f} (#{r.best_trial})" if r.best_throughput is not None else "—"
        if r.best_cost is not None:  # a cost study: its cheapest, not its tokens per $
            best = f"{r.best_cost} (#{r.best_trial})"
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
