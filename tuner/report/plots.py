"""The front drawn three ways: in the terminal (plotext, works over SSH), as interactive HTML (Plotly, Optuna's own
`plot_pareto_front` over the measured trials), and as a PNG (matplotlib, the optional extra `png`:
Plotly's PNG export needs a Chrome it would download, which fails offline)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna

from tuner.errors import TunerError
from tuner.report.views import StudyView, TrialView

__all__ = ["COST_X_LABEL", "X_LABEL", "terminal_scatter", "write_html", "write_png"]

X_LABEL = "output tok/s"
# A cost study's first value (tuner.cost): the inverse of its cost, more is cheaper.
COST_X_LABEL = "M output tokens per $ (or GPU-h) at the job's load"


def _x_label(view: StudyView) -> str:
    return COST_X_LABEL if view.is_cost else X_LABEL


def _title(view: StudyView) -> str:
    return f"{view.name}: {'cost' if view.is_cost else 'throughput'} vs latency {view.objective_stat}"


def _y_label(view: StudyView) -> str:
    return f"{view.latency_metric} (s)"


def _points(trials: Sequence[TrialView]) -> tuple[list[float], list[float]]:
    return [t.throughput or 0.0 for t in trials], [t.objective_latency_s or 0.0 for t in trials]


def _groups(view: StudyView, front: Sequence[TrialView]) -> dict[str, list[TrialView]]:
    on_front = {t.number for t in front}
    measured = [t for t in view.trials if t.measured and t.duplicate_of is None]
    return {
        "infeasible": [t for t in measured if not t.feasible],
        "feasible": [t for t in measured if t.feasible and t.number not in on_front and not t.baseline],
        "front": list(front),
        "baseline": [t for t in measured if t.baseline],
    }


def terminal_scatter(
    view: StudyView, front: Sequence[TrialView], *, width: int = 80, height: int = 20, color: bool = False
) -> str:
    """Every measured trial: `x` infeasible, `o` feasible, `*` the front (joined), `B` the baseline."""
    import plotext as plt

    groups = _groups(view, front)
    if not any(groups.values()):
        return "(no measured trial to plot)\n"
    fig = plt.figure
    fig.clear()
    fig.theme("default" if color else "colorless")
    fig.plot_size(max(width, 40), max(height, 12))
    if len(front) > 1:
        # The joining line first, so the points are drawn over it.
        line = fig.signal(*_points(sorted(front, key=lambda t: t.throughput or 0.0)), marker="·").lines()
        fig.draw(line)
    markers = (("infeasible", "x"), ("feasible", "o"), ("front", "*"), ("baseline", "B"))
    for name, marker in markers:
        if groups[name]:
            fig.draw(fig.signal(*_points(groups[name]), marker=marker))
    fig.title(_title(view))
    fig.label(_x_label(view), axis="x")
    fig.label(_y_label(view), axis="y")
    text = str(fig.build())
    fig.clear()
    if not color:
        text = plt.uncolorize(text)
    # The key below the plot: a legend box inside would hide the points in the dominated corner.
    key = "   ".join(f"{m} {n}" for n, m in markers if groups[n]) + ("   · front joined" if len(front) > 1 else "")
    return text.rstrip() + "\n" + key + "\n"


def write_html(view: StudyView, front: Sequence[TrialView], path: Path) -> None:
    """Optuna's own `plot_pareto_front` (feasible trials coloured, infeasible grey), in one self-contained file
    (plotly.js inlined: it opens offline), with the front joined and the baseline marked."""
    fig = optuna.visualization.plot_pareto_front(_plot_study(view), target_names=[_x_label(view), _y_label(view)])
    fig.update_layout(title=f"Pareto-front plot: {view.name}")
    _add_overlays(fig, view, front)
    try:
        fig.write_html(str(path), include_plotlyjs=True, full_html=True)
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None


def _plot_study(view: StudyView) -> optuna.Study:
    """An in-memory copy holding only the measured trials, with our feasibility as Optuna constraints: the stored
    study also holds failed starts at (0 tok/s, the timeout), which would squash the plot into one corner, and a
    re-scored view has feasibility the stored constraints do not know."""
    from optuna.distributions import CategoricalDistribution

    study = optuna.create_study(directions=["maximize", "minimize"], study_name=view.name)
    for t in view.trials:
        if not t.measured or t.duplicate_of is not None:
            continue
        constraints = dict(zip(t.constraint_names, t.constraints, strict=True))
        if not t.feasible and all(c <= 0 for c in constraints.values()):
            constraints["feasible"] = 1.0
        params = {k: v for k, v in t.flags.items() if isinstance(v, bool | int | float | str)}
        study.add_trial(
            optuna.trial.create_trial(
                values=[t.throughput or 0.0, t.objective_latency_s or 0.0],
                params=params,
                distributions={k: CategoricalDistribution((v,)) for k, v in params.items()},
                user_attrs={"trial": t.number, "baseline": t.baseline, "verdict": t.verdict},
                constraints=constraints,
            )
        )
    return study


def _add_overlays(fig: Any, view: StudyView, front: Sequence[TrialView]) -> None:
    import plotly.graph_objects as go

    if front:
        ordered = sorted(front, key=lambda t: t.throughput or 0.0)
        x, y = _points(ordered)
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines+markers",
                name="feasible front",
                line={"color": "#d62728"},
                marker={"color": "#d62728", "size": 9},
                text=[_hover(t) for t in ordered],
                hoverinfo="text",
            )
        )
    base = view.baseline
    if base is not None and base.measured:
        fig.add_trace(
            go.Scatter(
                x=[base.throughput],
                y=[base.objective_latency_s],
                mode="markers",
                name="baseline (vLLM defaults)",
                marker={"symbol": "star", "size": 14, "color": "#2ca02c"},
                text=[_hover(base)],
                hoverinfo="text",
            )
        )


def _first_text(t: TrialView) -> str:
    return f"{t.cost_text} per M output tokens" if t.costed else f"{t.throughput or 0:,.1f} tok/s"


def _hover(t: TrialView) -> str:
    flags = "<br>".join(f"{k}={v}" for k, v in t.flags.items())
    return (
        f"trial {t.number}{' (baseline)' if t.baseline else ''}<br>{_first_text(t)}, "
        f"P95 {t.objective_latency_s or 0:.3f} s<br>{t.verdict}<br>{flags}"
    )


def write_png(view: StudyView, front: Sequence[TrialView], path: Path) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise TunerError("--png needs matplotlib: pip install 'tuner[png]'") from None
    groups = _groups(view, front)
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if groups["infeasible"]:
        ax.scatter(*_points(groups["infeasible"]), marker="x", color="#999999", label="infeasible")
    if groups["feasible"]:
        ax.scatter(*_points(groups["feasible"]), marker="o", color="#1f77b4", label="feasible")
    if front:
        ordered = sorted(front, key=lambda t: t.throughput or 0.0)
        ax.plot(*_points(ordered), marker="o", color="#d62728", label="feasible front")
        for t in ordered:
            ax.annotate(f"#{t.number}", (t.throughput or 0.0, t.objective_latency_s or 0.0), fontsize=8)
    if groups["baseline"]:
        ax.scatter(*_points(groups["baseline"]), marker="*", s=200, color="#2ca02c", label="baseline", zorder=3)
    ax.set_xlabel(_x_label(view))
    ax.set_ylabel(_y_label(view))
    ax.set_title(_title(view))
    ax.grid(True, alpha=0.3)
    if any(groups.values()):
        ax.legend()
    try:
        fig.savefig(str(path), format="png")
    except OSError as e:
        raise TunerError(f"cannot write {path}: {e.strerror or e}") from None
