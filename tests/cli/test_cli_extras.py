"""An optional part of tuner that is not installed (PostgreSQL's driver, plotly, matplotlib, GP's torch) is one line
naming the extra to install, exit 2, never a traceback; `tune --dry-run` checks the storage's driver too. A missing
module is simulated as Python does it: `sys.modules[name] = None` makes its import fail."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import run_main
from tuner.cli.extras import EXTRAS, extra_for_module, installed, need_storage_driver
from tuner.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "search_spaces" / "emulator-demo.yaml"
POSTGRES = "postgresql+psycopg://tuner:secret@db.invalid:5432/tuner"


def missing(monkeypatch: pytest.MonkeyPatch, *modules: str) -> None:
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_pareto_html_and_png_without_their_libraries_name_the_extra(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing(monkeypatch, "plotly", "matplotlib")
    url = f"sqlite:///{tmp_path / 'none.db'}"
    code, _, err = run_main(
        ["pareto", "night", "--storage", url, "--html", str(tmp_path / "f.html")], capsys, monkeypatch
    )
    assert code == 2
    assert one_error_line(err) == "error: --html needs plotly, which is not installed: pip install 'tuner[html]'"
    code, _, err = run_main(
        ["rescore", "night", "--storage", url, "--slo", "e2e_p95<=3s", "--png", "f.png"], capsys, monkeypatch
    )
    assert code == 2
    assert one_error_line(err) == "error: --png needs matplotlib, which is not installed: pip install 'tuner[png]'"
    assert not list(tmp_path.iterdir())  # checked before the storage was opened


def test_a_postgres_storage_without_its_driver_is_refused_by_the_dry_run_and_every_reader(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing(monkeypatch, "psycopg")
    want = (
        "error: storage postgresql+psycopg://tuner:***@db.invalid:5432/tuner: its database driver psycopg is not "
        "installed: pip install 'tuner[postgres]'"
    )
    code, out, err = run_main(["tune", str(DEMO), "--dry-run", "--storage", POSTGRES], capsys, monkeypatch)
    assert code == 2 and one_error_line(err) == want
    assert "job file is valid" not in out
    for command in (["studies"], ["trials", "night"], ["db", "upgrade"]):
        code, _, err = run_main([*command, "--storage", POSTGRES], capsys, monkeypatch)
        assert code == 2 and one_error_line(err) == want, command


def test_a_driver_of_no_extra_is_named_for_pip(monkeypatch: pytest.MonkeyPatch) -> None:
    missing(monkeypatch, "psycopg", "pymysql")
    with pytest.raises(ConfigError, match=re.escape("driver psycopg is not installed: pip install 'tuner[postgres]'")):
        need_storage_driver("postgresql://tuner@db/tuner")  # SQLAlchemy's default PostgreSQL driver, psycopg 3
    with pytest.raises(ConfigError, match=r"driver pymysql is not installed: pip install pymysql$"):
        need_storage_driver("mysql+pymysql://tuner@db/tuner")


def test_sqlite_and_bad_urls_pass_the_driver_check_to_the_storages_own() -> None:
    need_storage_driver("sqlite:///night.db")
    need_storage_driver("not a url")  # the storage says what is allowed, in its own words
    need_storage_driver("nosuchdb://x")


def test_the_gp_sampler_without_torch_is_refused_by_the_dry_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    missing(monkeypatch, "torch")
    job = yaml.safe_load(DEMO.read_text())
    job["sampler"] = {"name": "gp", "seed": 1}
    path = tmp_path / "gp.yaml"
    path.write_text(yaml.safe_dump(job))
    code, _, err = run_main(["tune", str(path), "--dry-run"], capsys, monkeypatch)
    assert code == 2
    assert one_error_line(err) == (
        "error: sampler.name: gp needs torch, which is not installed: pip install 'tuner[gp]'"
    )


def test_every_extra_is_one_pyproject_declares_and_its_modules_are_known() -> None:
    import tomllib

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(declared)
    assert extra_for_module("plotly.graph_objects") is EXTRAS["html"]
    assert extra_for_module("yaml") is None
    assert installed("yaml") and not installed("no_such_module_anywhere")


def test_an_unchecked_import_of_an_extra_is_still_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The entry point's net, for a command that imports an extra without checking first."""
    import tuner.cli.studies

    def needs_plotly(*args: object, **kwargs: object) -> None:
        import plotly  # noqa: F401

    missing(monkeypatch, "plotly")
    monkeypatch.setattr(tuner.cli.studies, "storage_url", needs_plotly)
    code, _, err = run_main(["studies"], capsys, monkeypatch)
    assert code == 2
    assert one_error_line(err) == "error: plotly is not installed (HTML plots: --html): pip install 'tuner[html]'"
