"""The reference pages the docs build generates (docs/hooks.py) agree with the code; the README stays short and
every link in it resolves; the troubleshooting page names every reason a trial records."""

from __future__ import annotations

import importlib.util
import re
from types import ModuleType
from typing import Any

import typer.main
from doc_blocks import DOCS, ROOT
from pydantic import BaseModel

from tuner.cli import app
from tuner.config.schema import Job
from tuner.export import FORMATS
from tuner.launch.failures import REASONS
from tuner.load.results import FAILURE_CLASSES
from tuner.scoring import FIGURES, METRICS


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _field_paths(model: type[BaseModel], prefix: str = "") -> tuple[list[str], set[str]]:
    """Every field of the job file by its dotted path, nested sections included; and the models a field holds one of
    several of (a union) or in a list or a map, which the page lists under their own heading."""
    paths: list[str] = []
    apart: set[str] = set()
    for name, info in model.model_fields.items():
        if info.exclude:
            continue
        alias = info.alias or name
        paths.append(prefix + alias)
        kinds = _models_in(info.annotation)
        if len(kinds) == 1:
            inner, inner_apart = _field_paths(kinds[0], f"{prefix}{alias}.")
            paths += inner
            apart |= inner_apart
        else:
            apart |= {kind.__name__ for kind in kinds}
    return paths, apart


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    origin = getattr(annotation, "__origin__", None)
    if origin in (list, dict):
        return []
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models_in(arg)]


def test_the_job_file_reference_lists_every_field_of_the_schema() -> None:
    page = _hooks().job_file_page()
    listed = set(re.findall(r"^\| `([^`]+)` \|", page, re.M))
    paths, apart = _field_paths(Job)
    missing = [path for path in paths if path not in listed]
    assert not missing, f"fields of the job file missing from reference/job-file.md: {missing}"
    assert apart, "the job file holds unions of models (the length distributions)"
    assert not [name for name in apart if f"\n### {name}\n" not in page]
    rows = {row[0]: row for row in _hooks().job_schema_rows()}
    assert rows["budget.n_trials"][2] == "`30`" and "trials of the whole study" in rows["budget.n_trials"][3]
    assert rows["study.name"][2] == "required"
    assert "e2e_p95 <= 10s" in rows["slos"][2]  # a default_factory's value, which JSON Schema leaves out


def test_the_command_reference_lists_every_command_and_option() -> None:
    page = _hooks().commands_page()
    group = typer.main.get_command(app)
    for name, command in group.commands.items():  # type: ignore[attr-defined]
        assert f"## tuner {name}\n" in page, f"tuner {name} missing from reference/commands.md"
        section = page.split(f"## tuner {name}\n", 1)[1].split("\n## tuner ", 1)[0]
        for param in command.params:
            for opt in param.opts:
                if param.param_type_name == "option":
                    assert f"`{opt}" in section or f", {opt}" in section, f"tuner {name} {opt} missing"
            if getattr(param, "is_flag", False):
                assert "| switch |" in section, f"tuner {name}: a switch shown as taking a value"


def test_the_metric_and_export_references_list_the_registries() -> None:
    hooks = _hooks()
    metrics = hooks.metrics_page()
    for name in METRICS:
        assert f"| `{name}` |" in metrics
    for figure in FIGURES:
        assert f"`{figure.name}_s`" in metrics
    exports = hooks.export_formats_page()
    for fmt in FORMATS:
        assert f"\n## {fmt}\n" in exports
    assert "--max-num-seqs 48" in exports  # each format rendered, not only named


def test_every_benchmark_section_is_a_page() -> None:
    pages = _hooks().benchmark_pages()
    readme = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    sections = re.findall(r"^## (.+)$", readme, re.M)
    assert len(pages) == len(sections) + 1  # and the index
    assert all(any(page.startswith(f"# {title}\n") for page in pages.values()) for title in sections)


def test_the_readme_is_short_and_every_link_resolves() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert len(targets) > 20
    broken = [t for t in targets if not t.startswith(("http://", "https://")) and not (ROOT / t).exists()]
    assert not broken, f"README links to files that do not exist: {broken}"
    for command in ("scripts/demo", "scripts/test"):
        assert f"\n    {command}\n" in readme  # CI runs the test command as the README gives it


def test_troubleshooting_names_every_launch_reason_and_failure_class() -> None:
    page = (DOCS / "troubleshooting.md").read_text(encoding="utf-8")
    missing = [name for name in (*REASONS, *FAILURE_CLASSES) if f"`{name}`" not in page]
    assert not missing, f"troubleshooting.md does not explain: {missing}"
