"""Rich tables (and their JSON twins) of what the morning commands show: the front, one trial's stored detail."""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from tuner.catalog.gpus import GpuProfile, resolve_gpu
from tuner.errors import TunerError
from tuner.flags import VllmFlags
from tuner.intervals import format_with_ci
from tuner.record import StudyRecord
from tuner.report.front import BEST_CHOICES, choose, ratios
from tuner.report.views import StudyView, TrialView, first_label
from tuner.scoring import OBJECTIVE_FALLBACK, STATS, Figure, figures, in_table_order, latency_metrics

__all__ = [
    "FLAG_LABELS",
    "NARROW",
    "figures_that_fit",
    "flag_label",
    "flag_lines",
    "flags_table",
    "flags_text",
    "fmt",
    "front_doc",
    "front_flags",
    "front_table",
    "gpus_text",
    "kv_table",
    "ratio",
    "steps_table",
    "summary_table",
    "tok_s_column",
]

# One short label per vLLM flag, for every flag list a person reads (the morning tables, `tuner tune`'s lines).
FLAG_LABELS = {
    "max_num_seqs": "seqs",
    "max_model_len": "len",
    "gpu_memory_utilization": "util",
    "max_num_batched_tokens": "batch",
    "tensor_parallel_size": "tp",
    "kv_cache_dtype": "kv",
    "block_size": "block",
    "enable_chunked_prefill": "chunked",
    "enable_prefix_caching": "prefix",
    "enforce_eager": "eager",
}


def flag_label(flag: str) -> str:
    return FLAG_LABELS.get(flag, flag)


NARROW = 80
"""The columns the default (narrow) tables fit: an SSH terminal's."""


def figures_that_fit(
    named: Sequence[Figure],
    table_of: Callable[[list[Figure]], Table],
    *,
    wide: bool = False,
    keep_named: bool = True,
) -> list[Figure]:
    """The figure columns a table shows: the ones the study's SLOs and objective name (what its verdicts were made
    on), then each of the registry's headline figures while the table still fits `NARROW` columns uncut (`table_of`
    builds it with the figures given); wide: all of them. In table order (`in_table_order`). `keep_named=False`:
    the named ones too only while they fit, before the registry's (a table whose rows all met the SLOs)."""
    shown = list(named) if keep_named or wide else []
    for extra in (*named, *(f for f in figures() if f.headline)):
        if any(f.name == extra.name for f in shown):
            continue
        if wide or _fits(table_of(in_table_order([*shown, extra]))):
            shown.append(extra)
    return in_table_order(shown)


def _fits(table: Table) -> bool:
    """`table` printed in `NARROW` columns cuts nothing: its text may wrap between words, but no cell is cut (Rich
    marks a cut with …)."""
    out = io.StringIO()
    Console(width=NARROW, file=out, color_system=None).print(table)
    return "…" not in out.getvalue()


def fmt(v: float | None, spec: str = ",.1f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def ratio(v: float | None) -> str:
    return "—" if v is None else f"×{v:.2f}"


def flags_text(flags: dict[str, Any]) -> str:
    """Compact: `seqs=192 len=8192 util=0.93 batch=4096 prefix=off`."""
    parts = []
    for k, v in flags.items():
        if isinstance(v, bool):
            v = "on" if v else "off"
        parts.append(f"{flag_label(k)}={v}")
    return " ".join(parts) or "(vLLM defaults)"


def flag_lines(rows: list[tuple[str, str]]) -> Table:
    """Each trial's flags on a line of their own, under a narrow table and keyed by the trial's number: in a cell
    beside the figures, an 80-column terminal cut them to `seqs=…`. Long lines wrap between flags, never inside one."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(justify="right", no_wrap=True)
    grid.add_column(overflow="fold")
    for key, text in rows:
        grid.add_row(escape(key), escape(text))
    return grid


def _picks(front: list[TrialView]) -> dict[str, int]:
    return {how: choose(front, how).number for how in BEST_CHOICES} if front else {}


def front_table(
    front: list[TrialView],
    baseline: TrialView | None,
    title: str,
    *,
    wide: bool = False,
    named: Sequence[Figure] = (),
    objective: str = OBJECTIVE_FALLBACK,
) -> Table:
    """The front with its ratios to the baseline. Narrow (the default) fits 80 columns: the figures a pick is made
    on (throughput and the `objective` latency, its column named by its statistic), the ones the study's SLOs name
    (`named`, `StudyView.named_figures`), then the registry's headline figures while they fit (`figures_that_fit`),
    the flags left to `front_flags`; wide: every headline figure and the flags in the table."""
    figure = Figure.named(objective)
    stat = figure.stat.upper() if figure is not None else "latency"
    others = [f for f in named if f.name != objective]

    def table_of(shown: list[Figure]) -> Table:
        return _front_table(front, baseline, title, [f for f in shown if wide or f.name != objective], stat, wide)

    # every point met the SLOs: their figures come first, but only while they fit (the pick's figures are not cut)
    return table_of(figures_that_fit(others, table_of, wide=wide, keep_named=False))


def _front_table(
    front: list[TrialView], baseline: TrialView | None, title: str, shown: list[Figure], stat: str, wide: bool
) -> Table:
    first = first_label(front)
    cols = ("pick", "#", first, f"latency {stat}" if wide else stat, *(f.label for f in shown), "success")
    table = Table(title=title)
    for col in (*cols, _ratio_label(first), f"× {stat}", *(("flags",) if wide else ())):
        left = col in ("pick", "flags")
        table.add_column(col, justify="left" if left else "right", no_wrap=not (wide or left))
    picks = _picks(front)
    for t in front:
        flags = [escape(flags_text(t.flags))] if wide else []
        table.add_row(*_front_row(t, baseline, picks, shown), *flags)
    if baseline is not None:
        table.add_section()
        flags = [escape(f"{baseline.verdict}; {flags_text(baseline.flags)}")] if wide else []
        table.add_row(*_baseline_row(baseline, shown), *flags)
    return table


def _front_row(t: TrialView, baseline: TrialView | None, picks: dict[str, int], shown: list[Figure]) -> list[str]:
    """A front trial's cells up to its ratios to the baseline (the wide table's flags go after)."""
    r = ratios(t, baseline)
    return [
        ", ".join(h for h, n in picks.items() if n == t.number),
        str(t.number),
        t.throughput_text,
        fmt(t.objective_latency_s, ".3f", " s"),
        *(fmt(t.latency(f.name), ".3f", " s") for f in shown),
        fmt(t.success_rate, ".1%"),
        _first_ratio(t, r.throughput),
        ratio(r.latency_p95),
    ]


def _baseline_row(baseline: TrialView, shown: list[Figure]) -> list[str]:
    """The baseline's cells in the same columns: its ratios to itself are 1 where it measured anything."""
    measured = baseline.measured
    itself = "×1.00" if measured else "—"
    return [
        "baseline",
        str(baseline.number),
        baseline.throughput_text if measured else "—",
        fmt(baseline.objective_latency_s if measured else None, ".3f", " s"),
        *(fmt(baseline.latency(f.name), ".3f", " s") for f in shown),
        fmt(baseline.success_rate, ".1%"),
        itself,
        itself,
    ]


def _ratio_label(first: str) -> str:
    return "× tok/s" if first == "tok/s" else "× cost"


def _first_ratio(t: TrialView, value: float | None) -> str:
    """The first value's ratio to the baseline; a cost's is the inverse of its tokens per $ (< 1: cheaper)."""
    if t.costed:
        return ratio(1.0 / value if value else None)
    return ratio(value)


def gpus_text(t: TrialView) -> str:
    """`3×2` (replicas x the shape's GPUs) for a cost study's trial, `—` for one with no capacity."""
    if not t.costed or t.replicas is None or t.box_gpus is None:
        return "—"
    return f"{t.replicas}×{t.box_gpus // max(1, t.replicas)}"


def front_flags(front: list[TrialView], baseline: TrialView | None) -> Table:
    """The narrow front table's flags, a line each (the baseline's verdict with its own)."""
    rows = [(f"#{t.number}", flags_text(t.flags)) for t in front]
    if baseline is not None:
        rows.append((f"#{baseline.number}", f"baseline, {baseline.verdict}: {flags_text(baseline.flags)}"))
    return flag_lines(rows)


def front_doc(front: list[TrialView], baseline: TrialView | None) -> dict[str, Any]:
    picks: dict[str, Any] = {}
    for how in BEST_CHOICES if front else ():
        w = choose(front, how)
        r = ratios(w, baseline)
        picks[how] = {"trial": w.number, "throughput_ratio": r.throughput, "latency_p95_ratio": r.latency_p95}
    return {
        "front": [t.as_dict() for t in front],
        "baseline": baseline.as_dict() if baseline else None,
        "picks": picks,
    }


def kv_table(title: str, data: dict[str, Any]) -> Table:
    table = Table(title=title, show_header=False, min_width=48)
    table.add_column("key", style="bold")
    table.add_column("value")
    for k, v in data.items():
        if isinstance(v, float):
            v = f"{v:,.4g}"
        table.add_row(escape(str(k)), escape(json.dumps(v) if isinstance(v, dict | list) else str(v)))
    return table


def study_gpu(attrs: dict[str, Any]) -> GpuProfile:
    """The GPU a study ran on, as it resolved then (studies before `gpu_profile` was stored: by its name)."""
    record = StudyRecord.from_attrs(attrs)
    if record.gpu_profile is not None:
        with contextlib.suppress(TypeError):
            return GpuProfile(**record.gpu_profile)
    return resolve_gpu(attrs["gpu"])


def flags_table(view: StudyView, flags: dict[str, Any]) -> Table:
    resolved: dict[str, Any] = {}
    try:
        from tuner.catalog import load_model
        from tuner.flags import resolve

        r = resolve(VllmFlags.from_dict(flags), study_gpu(view.attrs), load_model(str(view.record.model)))
        resolved = r.__dict__
    except (KeyError, TunerError, ValueError):
        pass
    table = Table(title="flags")
    table.add_column("flag")
    table.add_column("trial")
    table.add_column("as vLLM runs it")
    names = list(dict.fromkeys([*flags, *resolved]))
    for name in names:
        given = flags.get(name)
        table.add_row(
            "--" + name.replace("_", "-"),
            _flag_text(given),
            _flag_text(resolved.get(name, given)) + ("" if name in flags else " (default)"),
        )
    return table


def _flag_text(value: Any) -> str:
    """A flag's value as the flag lines write a switch (`prefix=off`): on/off, — for unset, not True/None."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "on" if value else "off"
    return escape(str(value))


def _good_share(summary: dict[str, Any]) -> str:
    # A summary stored before the share was recorded has none: say nothing rather than 0%.
    share = summary.get("good_share")
    return f" ({share:.1%} good)" if isinstance(share, int | float) else ""


def summary_table(summary: dict[str, Any]) -> Table:
    head = (
        f"load: {summary.get('requests_succeeded', 0)}/{summary.get('requests_sent', 0)} ok "
        f"({summary.get('success_rate', 0):.1%}) in {summary.get('duration_s', 0):.1f} s · "
        f"{summary.get('output_throughput', 0):,.1f} output tok/s · {summary.get('request_throughput', 0):.2f} req/s · "
        f"goodput {summary.get('goodput', 0):.2f} req/s{_good_share(summary)} · "
        f"concurrency {summary.get('concurrency', 0):.1f}"
    )
    table = Table(title=head)
    stats = STATS
    table.add_column("latency (s)")
    for st in stats:
        table.add_column(st, justify="right")
    for metric in (m.name for m in latency_metrics()):
        p = summary.get(metric) or {}
        table.add_row(metric, *(fmt(p.get(st), ".4f") for st in stats))
    return table


def steps_table(steps: list[Any], scored: int | None, shown: Sequence[Figure] = ()) -> Table:
    """A capacity search's steps; `shown`: the latency figures to show of each (what its steps are judged on:
    `StudyView.named_figures`; (): the registry's headline ones), read from the step's stored summary."""
    shown = list(shown) or [f for f in figures() if f.headline]
    table = Table(title="capacity search (request rate steps)")
    for col in ("step", "rate req/s", "tok/s", *(f.label for f in shown), "success", "good", "meets SLOs"):
        table.add_column(col, justify="right")
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            continue
        s = step.get("summary") or {}
        table.add_row(
            f"{i}{' ←' if i == scored else ''}",
            fmt(step.get("rate"), ".2f"),
            fmt(s.get("output_throughput")),
            *(fmt((s.get(f.metric) or {}).get(f.stat), ".3f", " s") for f in shown),
            fmt(s.get("success_rate"), ".1%"),
            fmt(s.get("good_share"), ".1%"),  # what a goodput search judges a step by; — where not stored
            "yes" if step.get("meets_slos") else "no",
        )
    return table


def tok_s_column(rows: list[TrialView]) -> dict[int, str]:
    """Each row's tok/s at one precision for the whole column (`341.0 ± 9.0` beside `193.4`, not `341 ± 9`): the
    finest any row's interval asks for (its half width to one significant digit, two when it starts with a 1), else
    one decimal."""
    places = max((_ci_places(t.throughput_ci) for t in rows if t.measured and t.throughput_ci), default=1)
    cells = {}
    for t in rows:
        value = t.throughput if t.measured else t.output_tok_s
        if value is None:
            cells[t.number] = "—"
            continue
        text = f"{value:,.{places}f}"
        if t.measured and t.throughput_ci:
            half = (t.throughput_ci[2] - t.throughput_ci[1]) / 2
            text += f" ± {half:,.{places}f}" if half > 0 else ""
        cells[t.number] = text
    return cells


def _ci_places(ci: tuple[float, float, float]) -> int:
    """The decimals `format_with_ci` gives this interval, read from its text (one rule, kept there)."""
    figure = format_with_ci(*ci, "").split(" ± ")[0]
    return len(figure.partition(".")[2])
