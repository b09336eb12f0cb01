"""The package's shape: no import circle between its modules (imports inside functions and TYPE_CHECKING count)."""

from __future__ import annotations

import ast
from pathlib import Path

import tuner

ROOT = Path(tuner.__file__).parent


def _graph() -> dict[str, set[str]]:
    modules = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _circle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from `start` back to itself, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def test_no_import_circle() -> None:
    graph = _graph()
    circles = [c for m in sorted(graph) if (c := _circle_from(m, graph)) is not None]
    assert not circles, "import circle: " + " -> ".join(circles[0])


def test_the_study_is_a_package() -> None:
    assert (ROOT / "study" / "__init__.py").is_file() and not (ROOT / "study.py").exists()


MAX_FUNCTION_LINES = 80


def _function_lengths() -> list[tuple[str, int]]:
    """(where, lines) for every function in the package, from its `def` line to the end of its body; under
    tuner/cli only the body counts, since typer's `Annotated` parameter lists make the signatures long."""
    lengths = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent)
        in_cli = rel.parts[:2] == ("tuner", "cli")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = node.body[0].lineno if in_cli else node.lineno
                end = node.end_lineno or node.lineno
                lengths.append((f"{rel}:{node.lineno} {node.name}", end - start + 1))
    return lengths


def test_no_function_is_longer_than_80_lines() -> None:
    long = [f"{where} ({n} lines)" for where, n in _function_lengths() if n > MAX_FUNCTION_LINES]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: " + "; ".join(long)
