"""Fixtures of the morning commands: a demo study on disk, and the `tuner` command run in-process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from morning_demo import Run, RunCli, build_demo_study


@pytest.fixture(scope="session")
def demo_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_demo_study(tmp_path_factory.mktemp("morning") / "demo.db")


@pytest.fixture
def tuner_cli(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> RunCli:
    """`tuner ARGS...` through the real entry point (its one-line error handling included), output captured."""
    from tuner.cli import main

    monkeypatch.setenv("COLUMNS", "220")
    monkeypatch.delenv("TUNER_STORAGE", raising=False)
    monkeypatch.delenv("TUNER_STORAGE_URL", raising=False)

    def run(*args: str | Path) -> Run:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["tuner", *map(str, args)])
        code = 0
        try:
            main()
        except SystemExit as e:
            code = int(e.code or 0) if not isinstance(e.code, str) else 1
        captured = capsys.readouterr()
        return Run(code, captured.out, captured.err)

    return run
