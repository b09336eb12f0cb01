"""What `tuner show` and `tuner trials` print reads as a person writes it: no raw `None`/`True`/`1.997e+04`, a share
as a percentage, one precision per column, a 1-GPU box without a per-GPU figure that repeats (and disagrees with)
the box's."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import create_trial
from rich.console import Console

from tuner.cli.show import box_line, facts_table, value_text
from tuner.report.tables import tok_s_column
from tuner.report.views import trial_view


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("reason", None, "—"),
        ("ok", True, "yes"),
        ("predicted", False, "no"),
        ("kv_tokens", 19970, "19,970"),
        ("kv_tokens_measured", 19970.0, "19,970"),
        ("generation_tokens", 19970.5, "19,970.5"),
        ("kv_usage_max", 0.9861, "98.6%"),
        ("prefix_cache_hit_rate", 0.5, "50.0%"),
        ("startup_s", 31.25, "31.25 s"),
        ("startup_seconds", 1.946, "1.946 s"),
        ("weights_gib", 14.99, "14.99 GiB"),
        ("preemptions", 12.0, "12"),
        ("ratio", 0.123456, "0.1235"),
        ("shape", {"a": 1}, '{"a": 1}'),
    ],
)
def test_a_stored_value_reads_as_written(key: str, value: Any, shown: str) -> None:
    assert value_text(key, value) == shown


def test_the_facts_table_holds_no_python_literal() -> None:
    con = Console(width=100, record=True)
    con.print(facts_table("server metrics", {"kv_usage_max": 0.9861, "ok": True, "reason": None, "n": 19970.0}))
    text = con.export_text()
    assert "98.6%" in text and "yes" in text and "—" in text and "19,970" in text
    assert not any(raw in text for raw in ("None", "True", "e+0", "0.9861"))


def view(number: int, attrs: dict[str, Any], value: float, ci: tuple[float, float, float] | None = None) -> Any:
    frozen = create_trial(
        params={"x": 0.5},
        distributions={"x": FloatDistribution(0, 1)},
        values=[value, 1.0],
        user_attrs={"outcome": "measured", "flags": {}, **attrs},
    )
    return replace(trial_view(frozen), number=number, throughput_ci=ci)


def test_a_one_gpu_box_says_its_throughput_once() -> None:
    attrs = {"output_tok_s": 343.8, "replicas": 1, "box_gpus": 1, "tok_s_per_gpu": 343.9, "usd_per_m_tokens": 1.5}
    line = box_line(view(0, attrs, 343.8))
    assert line.startswith("box: 1 replica on 1 GPU: 343.8 tok/s;") and "per GPU" not in line


def test_a_box_of_several_gpus_gives_the_per_gpu_figure_of_the_throughput_beside_it() -> None:
    # The record's per-GPU figure is its first start's; the throughput shown may be pooled over starts.
    attrs = {"output_tok_s": 900.0, "replicas": 2, "box_gpus": 4, "tok_s_per_gpu": 224.0}
    assert "1,000.0 tok/s (250.0 per GPU)" in box_line(view(0, attrs, 1000.0))


def test_the_tok_s_column_has_one_precision() -> None:
    with_ci = view(1, {"output_tok_s": 341.2}, 341.2, (341.2, 332.0, 350.4))
    narrow = view(2, {"output_tok_s": 193.44}, 193.44, (193.44, 192.3, 194.6))
    bare = view(3, {"output_tok_s": 120.0}, 120.04)
    cells = tok_s_column([with_ci, narrow, bare])
    assert cells == {1: "341.2 ± 9.2", 2: "193.4 ± 1.1", 3: "120.0"}
    # The interval of a single row keeps its own rounding, the rest of the column follows it.
    assert tok_s_column([with_ci, bare]) == {1: "341 ± 9", 3: "120"}


def test_the_flags_table_says_on_off_and_unset() -> None:
    from tuner.report.tables import flags_table
    from tuner.report.views import StudyView

    study = StudyView(name="s", attrs={"gpu": "l4", "model": "llama-3.1-8b"}, trials=[])
    con = Console(width=120, record=True)
    con.print(flags_table(study, {"max_num_seqs": 48, "enforce_eager": True}))
    text = con.export_text()
    assert "on" in text.split("--enforce-eager")[1].splitlines()[0]
    assert "on (default)" in text and "off (default)" in text
    assert not any(raw in text for raw in ("True", "False", "None"))
