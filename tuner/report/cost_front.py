"""The box's throughput against what a million of its output tokens cost: the front of trials no other beats on both
(more tok/s for the box, fewer $ per million tokens), for a study that had a GPU-hour price (`target.gpu_hour_usd`).

The $ is at each trial's measured throughput (tuner.box): the whole box paid for, a GPU its shape leaves idle
included; a cost study's box is the one its job's load needs (tuner.cost).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from tuner.errors import ConfigError
from tuner.report.views import StudyView, TrialView

__all__ = ["box_tok_s", "cost_front", "cost_front_table", "cost_scatter", "need_price", "priced_trials"]


def box_tok_s(t: TrialView) -> float | None:
    """The box's output tok/s: the study's first value, but a cost study's, whose first value is tokens per $."""
    if t.costed:
        return t.box_output_tok_s
    return t.throughput


def priced_trials(trials: Sequence[TrialView]) -> list[TrialView]:
    """Feasible measured trials with a $ figure: the points the cost front is drawn from."""
    return [
        t
        for t in trials
        if t.feasible and t.measured and t.duplicate_of is None and t.usd_per_m_tokens is not None and box_tok_s(t)
    ]


def need_price(view: StudyView) -> None:
    """One line, exit 2, for a study whose trials carry no $ figure."""
    if not view.priced:
        raise ConfigError(
            f"study {view.name!r} has no GPU-hour price, so no $ per million tokens: give target.gpu_hour_usd "
            "in the job (e.g. gpu_hour_usd: 2.5) for its next trials"
        )


def cost_front(trials: Sequence[TrialView]) -> list[TrialView]:
    """Feasible priced trials no other beats on both box tok/s (more) and $ per million tokens (fewer); cheapest
    first."""
    pool = priced_trials(trials)

    def beats(a: TrialView, b: TrialView) -> bool:
        ta, tb, ua, ub = box_tok_s(a) or 0.0, box_tok_s(b) or 0.0, _usd(a), _usd(b)
        return ta >= tb and ua <= ub and (ta > tb or ua < ub)

    front = [t for t in pool if not any(beats(o, t) for o in pool)]
    return sorted(front, key=lambda t: (_usd(t), -(box_tok_s(t) or 0.0), t.number))


def _usd(t: TrialView) -> float:
    assert t.usd_per_m_tokens is not None
    return t.usd_per_m_tokens


def cost_front_table(front: Sequence[TrialView], title: str, stat: str = "P95") -> Table:
    """The front in 80 columns: the trial, its box (replicas x GPUs each), tok/s, per GPU, $ per million, the
    minimised latency (`stat`: its statistic, `StudyView.objective_stat`)."""
    table = Table(title=title)
    for col in ("#", "box", "box tok/s", "tok/s/GPU", "$/M tok", stat):
        table.add_column(col, justify="right", no_wrap=True)
    for t in front:
        each = (t.box_gpus or 1) // max(1, t.replicas or 1)
        table.add_row(
            f"{t.number}{'ᵇ' if t.baseline else ''}",
            f"{t.replicas or 1}×{each}",
            f"{box_tok_s(t) or 0.0:,.1f}",
            "—" if t.tok_s_per_gpu is None else f"{t.tok_s_per_gpu:,.1f}",
            f"${_usd(t):,.3f}",
            "—" if t.objective_latency_s is None else f"{t.objective_latency_s:.3f} s",
        )
    return table


def cost_scatter(view: StudyView, front: Sequence[TrialView], *, width: int = 80, height: int = 20) -> str:
    """Every feasible priced trial (`o`), the front joined (`*`): box tok/s across, $ per million tokens up."""
    import plotext as plt

    pool = priced_trials(view.trials)
    if not pool:
        return "(no feasible priced trial to plot)\n"
    on_front = {t.number for t in front}
    fig = plt.figure
    fig.clear()
    fig.theme("colorless")
    fig.plot_size(max(width, 40), max(height, 12))
    rest = [t for t in pool if t.number not in on_front]
    ordered = sorted(front, key=lambda t: box_tok_s(t) or 0.0)
    if len(ordered) > 1:
        fig.draw(fig.signal([box_tok_s(t) or 0.0 for t in ordered], [_usd(t) for t in ordered], marker="·").lines())
    for group, marker in ((rest, "o"), (ordered, "*")):
        if group:
            fig.draw(fig.signal([box_tok_s(t) or 0.0 for t in group], [_usd(t) for t in group], marker=marker))
    fig.title(f"{view.name}: box throughput vs $ per million output tokens")
    fig.label("box output tok/s", axis="x")
    fig.label("$ / M output tokens", axis="y")
    text = str(plt.uncolorize(str(fig.build())))
    fig.clear()
    return text.rstrip() + "\n" + "o feasible   * front" + ("   · front joined" if len(ordered) > 1 else "") + "\n"
