"""The cost front drawn as files: interactive HTML (Plotly) and a PNG (matplotlib, the optional extra `png`), box
output tok/s across and $ per million output tokens up, every feasible priced trial and the front joined."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tuner.errors import TunerError
from tuner.report.cost_front import box_tok_s, priced_trials
from tuner.report.views import StudyView, TrialView

__all__ = ["write_cost_html", "write_cost_png"]

_X = "box output tok/s"
_Y = "$ per million output tokens"


def _xy(trials: Sequence[TrialView]) -> tuple[list[float], list[float]]:
    return [box_tok_s(t) or 0.0 for t in trials], [t.usd_per_m_tokens or 0.0 for t in trials]


def _title(view: StudyView) -> str:
    return f"{view.name}: box throughput vs $ per million output tokens"


def write_cost_html(view: StudyView, front: Sequence[TrialView], path: Path) -> None:
    import plotly.graph_objects as go

    on_front = {t.number for t in front}
    rest = [t for t in priced_trials(view.trials) if t.number not in on_front]
    ordered = sorted(front, key=lambda t: box_tok_s(t) or 0.0)
    fig = go.Figure()
    for trials, name, mode in ((rest, "feasible", "markers"), (ordered, "front", "lines+markers")):
        x, y = _xy(trials)
        text = [f"trial {t.number}: {t.replicas}×{(t.box_gpus or 1) // max(1, t.replicas or 1)} GPUs" for t in trials]
        fig.add_trace(go.Scatter(x=x, y=y, mode=mode, name=name, text=text, hoverinfo="text+x+y"))
    fig.update_layout(title=_title(view), xaxis_title=_X, yaxis_title=_Y)
    try:
        fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None


def write_cost_png(view: StudyView, front: Sequence[TrialView], path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise TunerError("--png needs matplotlib: pip install 'tuner[png]'") from None
    on_front = {t.number for t in front}
    rest = [t for t in priced_trials(view.trials) if t.number not in on_front]
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if rest:
        ax.scatter(*_xy(rest), marker="o", color="#1f77b4", label="feasible")
    if front:
        ordered = sorted(front, key=lambda t: box_tok_s(t) or 0.0)
        ax.plot(*_xy(ordered), marker="o", color="#d62728", label="front")
        for t in ordered:
            ax.annotate(f"#{t.number}", (box_tok_s(t) or 0.0, t.usd_per_m_tokens or 0.0), fontsize=8)
        ax.legend()
    ax.set_xlabel(_X)
    ax.set_ylabel(_Y)
    ax.set_title(_title(view))
    ax.grid(True, alpha=0.3)
    try:
        fig.savefig(str(path), format="png")
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None
