"""The morning commands in an 80-column SSH terminal (issue #14): nothing a person reads is cut with "…", no line
runs past the edge, the flags are printed whole; --wide keeps every column; a storage's only study needs no name."""

from __future__ import annotations

from pathlib import Path

import optuna
import pytest
from morning_demo import SPECS, STUDY, RunCli, build_demo_study
from rich.console import Console

from tuner.report import pareto_front
from tuner.report.tables import flags_text, front_flags, front_table

WIDTH = 80


@pytest.fixture
def narrow(tuner_cli: RunCli, monkeypatch: pytest.MonkeyPatch) -> RunCli:
    """`tuner` as it prints to an 80-column terminal (the fixture's 220 hides every cut)."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    return tuner_cli


def assert_fits(text: str) -> None:
    too_long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not too_long, too_long
    assert "…" not in text, text


@pytest.mark.parametrize(
    "args",
    [
        ("studies",),
        ("status", STUDY),
        ("trials", STUDY),
        ("trials", STUDY, "--sort", "throughput", "--feasible"),
        ("pareto", STUDY),
        ("show", STUDY, "2"),
        ("show", STUDY, "3"),
        ("rescore", STUDY, "--slo", "e2e_p95<=5s"),
    ],
)
def test_every_morning_table_fits_80_columns_uncut(narrow: RunCli, demo_url: str, args: tuple[str, ...]) -> None:
    r = narrow(*args, "--storage", demo_url)
    assert r.code == 0, r.err
    # the server's log tail is printed as the log wrote it (soft-wrapped by the terminal, whole when copied)
    assert_fits(r.out.split("server log tail:")[0])


def test_trials_and_pareto_print_every_flag_value_whole(narrow: RunCli, demo_url: str) -> None:
    trials = narrow("trials", STUDY, "--storage", demo_url).out
    for spec in SPECS:
        assert flags_text(spec.flags) in trials, spec.number
    pareto = narrow("pareto", STUDY, "--storage", demo_url).out
    for number in (9, 6, 4, 7):  # the demo's front
        flags = next(s.flags for s in SPECS if s.number == number)
        assert f"#{number} {flags_text(flags)}" in pareto
    assert "3,400.0" in pareto and "×1.70" in pareto and "4.800 s" in pareto


def test_studies_at_80_columns_keeps_the_figures(narrow: RunCli, demo_url: str) -> None:
    out = narrow("studies", "--storage", demo_url).out
    assert STUDY in out and "3,400.0 (#9)" in out and "h100-80gb" in out


def test_wide_has_the_extra_columns(narrow: RunCli, demo_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    studies = narrow("studies", "--storage", demo_url).out
    trials = narrow("trials", STUDY, "--storage", demo_url).out
    pareto = narrow("pareto", STUDY, "--storage", demo_url, "--no-plot").out
    assert "model" not in studies and "bottleneck" not in trials and "latency P95" not in pareto
    assert "TTFT P95" in pareto  # a headline figure where it fits in 80 columns
    monkeypatch.setenv("COLUMNS", "220")  # --wide is every column, for a terminal wide enough to hold them
    studies = narrow("studies", "--storage", demo_url, "--wide").out
    assert "running" in studies and "model" in studies and "started" in studies and "llama-3.1-8b" in studies
    trials = narrow("trials", STUDY, "--storage", demo_url, "--wide").out
    assert "bottleneck" in trials and "flags" in trials and "bottleneck: KV cache" in trials
    pareto = narrow("pareto", STUDY, "--storage", demo_url, "--wide", "--no-plot").out
    assert "TTFT P95" in pareto and "seqs=256 len=8192 util=0.94 batch=8192" in pareto


def test_front_table_renders_in_80_columns(demo_url: str) -> None:
    """The table functions themselves, on a Console of 80 columns (what `tuner tune` and scripts print through)."""
    from tuner.report import opened_study, study_view

    with opened_study(demo_url, STUDY) as s:
        view = study_view(s)
    front = pareto_front(view.trials)
    con = Console(width=WIDTH, record=True, highlight=False)
    con.print(front_table(front, view.baseline, "front"))
    con.print(front_flags(front, view.baseline))
    assert_fits(con.export_text())
    wide = Console(width=200, record=True)
    wide.print(front_table(front, view.baseline, "front", wide=True))
    text = wide.export_text()
    assert "e2e P95" in text and "seqs=256 len=8192" in text


def test_png_help_names_the_extra(narrow: RunCli) -> None:
    out = narrow("pareto", "--help").out
    assert "tuner[png]" in out


def test_the_only_study_needs_no_name(narrow: RunCli, demo_url: str) -> None:
    for args in (("pareto", "--no-plot"), ("status",), ("trials",), ("show", "9"), ("export",)):
        r = narrow(*args, "--storage", demo_url)
        assert r.code == 0, (args, r.err)
    assert "#9 " in narrow("pareto", "--storage", demo_url, "--no-plot").out
    assert "demo · trial 9" in narrow("show", "9", "--storage", demo_url).out


def test_several_studies_are_listed_not_guessed(narrow: RunCli, tmp_path: Path) -> None:
    url = build_demo_study(tmp_path / "two.db")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name="other", storage=url, directions=["maximize", "minimize"])
    r = narrow("pareto", "--storage", url)
    assert r.code != 0 and "2 studies" in r.err and STUDY in r.err and "other" in r.err
    assert "Traceback" not in r.err and len(r.err.strip().splitlines()) == 1
    assert narrow("pareto", STUDY, "--storage", url, "--no-plot").code == 0


def test_show_with_a_name_and_no_trial_says_how(narrow: RunCli, demo_url: str) -> None:
    r = narrow("show", STUDY, "--storage", demo_url)
    assert r.code != 0 and "tuner show demo TRIAL" in r.err


def test_tune_end_of_run_front_fits_80_columns(demo_url: str) -> None:
    """`tuner tune`'s last table, printed where the study ran: figures whole, every front point's flags whole."""
    from tuner.cli.tune import pareto_table

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    con = Console(width=WIDTH, record=True, highlight=False)
    con.print(pareto_table(optuna.load_study(study_name=STUDY, storage=demo_url)))
    text = con.export_text()
    assert_fits(text)
    for number in (9, 6, 4, 7):
        flags = next(s.flags for s in SPECS if s.number == number)
        assert f"#{number} {flags_text(flags)}" in text
    # The same table as `tuner pareto`: the leader's figure and its ratio to the baseline, the baseline's verdict.
    assert "3,400" in text and "×1.70" in text and "#0 baseline, ok: seqs=1024" in text
