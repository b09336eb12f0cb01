"""The package's shape: its packages in one order, bottom to top, each importing only those below it; no import
circle between packages or between modules. Every import counts: at the top of a module, inside a function, under
TYPE_CHECKING, relative, and a module named to `importlib.import_module`."""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import tuner

ROOT = Path(tuner.__file__).parent

# The packages (and top-level modules) of tuner, bottom to top: a module imports its own package and those listed
# before it, never one listed after. CONTRIBUTING.md ("Layers") says why each sits where it does. `tuner` is the
# package's own __init__ (its version and the errors it re-exports).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "clock", "vllm_pin"),
    ("catalog", "scoring", "intervals", "record", "vllm_args", "flags", "tuner"),
    ("load", "capacity", "step_profile", "export", "box", "cost"),
    ("emulator", "feasibility", "space", "store", "config"),
    ("launch", "twin", "calibration", "conformance"),
    ("study",),
    ("report", "verify"),
    ("ship",),
    ("cli", "__main__"),
)

# Imports that break a rule below, none today: each (importing module, imported module) with why it is here and
# what removes it, should one have to wait for other work. An entry whose import is gone fails
# `test_every_known_violation_is_still_there`, so the list only shrinks. (report/deployment -> launch.docker and
# ship -> report.views are not here: each goes down the layers, and neither package imports the other back.)
KNOWN_VIOLATIONS: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    path: Path
    line: int
    target: str  # the imported module, dotted

    def where(self, root: Path) -> str:
        return f"{self.path.relative_to(root.parent)}:{self.line}"


def _modules(root: Path) -> dict[str, Path]:
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _from_targets(node: ast.ImportFrom, name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """`from X import a, b`: X's submodules a and b where they are modules, X itself where a name is not."""
    base = node.module or ""
    if node.level:  # relative: from the importing module's own package, up `level - 1` packages
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
    return subs if len(subs) == len(node.names) else [base, *subs]


def _named_to_import_module(tree: ast.Module) -> tuple[list[tuple[int, str]], bool]:
    """The constant modules given to `import_module(...)`, and whether a call names one by a variable (then every
    module name the file spells counts: a registry list of command modules)."""
    named, by_variable = [], False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module":
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                named.append((node.lineno, arg.value))
            else:
                by_variable = True
    return named, by_variable


def imports(root: Path, *, dynamic: bool = True) -> Iterator[Import]:
    """Every import of a module of `root`'s package by another (`dynamic`: those through import_module too)."""
    modules = _modules(root)
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found: list[tuple[int, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found += [(node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                found += [(node.lineno, t) for t in _from_targets(node, name, path, modules)]
        if dynamic:
            named, by_variable = _named_to_import_module(tree)
            found += named
            if by_variable:
                strings = (n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str))
                found += [(n.lineno, n.value) for n in strings if n.value in modules]
        for line, target in found:
            # `import a.b.c` loads a.b.c; a name not a module of ours (a library, or an attribute) is left out
            while target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                yield Import(name, path, line, target)


def layer_of(module: str) -> str:
    """The package or top-level module a module belongs to: `tuner.launch.docker` -> launch, `tuner` -> tuner."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(
    root: Path, layers: tuple[tuple[str, ...], ...], known: dict[tuple[str, str], str] | None = None
) -> list[str]:
    """One line for each import that runs up (or sideways out of) the order of `layers`, or from or to a package
    the order does not place."""
    rank = {name: i for i, name in enumerate(n for line in layers for n in line)}
    problems = []
    for imp in imports(root):
        source, target = layer_of(imp.source), layer_of(imp.target)
        if source == target or (imp.source, imp.target) in (known or {}):
            continue
        unplaced = [p for p in (source, target) if p not in rank]
        if unplaced:
            problems.append(f"{imp.where(root)}: {', '.join(unplaced)} has no place in LAYERS")
        elif rank[target] > rank[source]:
            problems.append(f"{imp.where(root)}: {source} imports {imp.target}, which sits above it")
    return problems


def _cycle_from(start: str, graph: dict[str, set[str]]) -> list[str] | None:
    """A path of imports from `start` back to itself, if there is one."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, [*path, nxt]))
    return None


def package_cycles(root: Path, known: dict[tuple[str, str], str] | None = None) -> list[str]:
    """Each circle of imports between packages, as `a -> b -> a` with the import that closes each step."""
    graph: dict[str, set[str]] = {}
    example: dict[tuple[str, str], str] = {}
    for imp in imports(root):
        edge = (layer_of(imp.source), layer_of(imp.target))
        if edge[0] != edge[1] and (imp.source, imp.target) not in (known or {}):
            graph.setdefault(edge[0], set()).add(edge[1])
            example.setdefault(edge, imp.where(root))
    cycles = {}
    for start in sorted(graph):
        cycle = _cycle_from(start, graph)
        if cycle is not None and frozenset(cycle) not in cycles:
            steps = [f"{a} -> {b} ({example[a, b]})" for a, b in itertools.pairwise(cycle)]
            cycles[frozenset(cycle)] = "; ".join(steps)
    return list(cycles.values())


def test_every_import_goes_down_the_layers() -> None:
    problems = layer_violations(ROOT, LAYERS, KNOWN_VIOLATIONS)
    assert not problems, "imports up the layers (CONTRIBUTING.md, Layers):\n" + "\n".join(problems)


def test_no_import_circle_between_packages() -> None:
    cycles = package_cycles(ROOT, KNOWN_VIOLATIONS)
    assert not cycles, "import circles between packages:\n" + "\n".join(cycles)


def test_every_known_violation_is_still_there() -> None:
    present = {(imp.source, imp.target) for imp in imports(ROOT)}
    stale = [f"{a} -> {b}" for a, b in KNOWN_VIOLATIONS if (a, b) not in present]
    assert not stale, "KNOWN_VIOLATIONS lists imports that are gone; remove them: " + ", ".join(stale)


def test_no_import_circle_between_modules() -> None:
    # The static imports only: cli/__init__ imports its command modules by name so each registers on `app`, which
    # each imports back; that is the registration, not a circle in the code's dependencies.
    graph: dict[str, set[str]] = {}
    for imp in imports(ROOT, dynamic=False):
        graph.setdefault(imp.source, set()).add(imp.target)
    circles = [c for m in sorted(graph) if (c := _cycle_from(m, graph)) is not None]
    assert not circles, "import circle: " + " -> ".join(circles[0])


def _command_modules(root: Path) -> set[str]:
    """The modules of tuner.cli that register a command (`@app.command`)."""
    found = set()
    for name, path in _modules(root).items():
        if name.startswith(f"{root.name}.cli."):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                    "app.command" in ast.unparse(d) for d in node.decorator_list
                ):
                    found.add(name)
    return found


def test_a_command_module_imports_no_other_command_module() -> None:
    # What two commands share belongs to neither: a command's module changes with its command alone.
    commands = _command_modules(ROOT)
    assert {"tuner.cli.tune", "tuner.cli.bench"} <= commands
    crossing = [
        f"{imp.where(ROOT)}: {imp.source} imports the command module {imp.target}"
        for imp in imports(ROOT, dynamic=False)
        if {imp.source, imp.target} <= commands and (imp.source, imp.target) not in KNOWN_VIOLATIONS
    ]
    assert not crossing, "\n".join(crossing)


def test_no_module_imports_another_modules_private_name() -> None:
    private = []
    for name, path in _modules(ROOT).items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tuner")):
                continue
            names = [a.name for a in node.names if a.name.startswith("_") and not a.name.startswith("__")]
            if names and (name, node.module) not in KNOWN_VIOLATIONS:
                private.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {node.module}.{', '.join(names)}")
    assert not private, "private names imported from another module:\n" + "\n".join(private)


# The checker's own tests, on a package tree made for them: `low` below `high`.
FAKE_LAYERS = (("low",), ("high",))


def _fake_tree(tmp_path: Path, low_calc: str) -> Path:
    root = tmp_path / "fake"
    files = {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/calc.py": low_calc,
        "high/__init__.py": "",
        "high/thing.py": "from fake.low.calc import VALUE\n\nTHING = VALUE + 1\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root


UPWARD = {
    "inside a function": "VALUE = 1\n\n\ndef f():\n    from fake.high.thing import THING\n\n    return THING\n",
    "a plain import in a function": "VALUE = 1\n\n\ndef f():\n    import fake.high.thing\n\n    return fake\n",
    "relative": "VALUE = 1\n\n\ndef f():\n    from ..high import thing\n\n    return thing\n",
    "under TYPE_CHECKING": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from fake.high import thing\n"
    "VALUE = 1\n",
    "by import_module": "import importlib\n\nVALUE = 1\n\n\ndef f():\n    return importlib.import_module("
    "'fake.high.thing')\n",
    "by import_module, named in a list": "import importlib\n\nVALUE = 1\nPLUGINS = ['fake.high.thing']\n\n\n"
    "def f():\n    return [importlib.import_module(p) for p in PLUGINS]\n",
}


@pytest.mark.parametrize("source", list(UPWARD.values()), ids=list(UPWARD))
def test_the_checker_fails_an_import_that_runs_up_the_layers(tmp_path: Path, source: str) -> None:
    root = _fake_tree(tmp_path, source)
    problems = layer_violations(root, FAKE_LAYERS)
    assert len(problems) == 1 and problems[0].startswith("fake/low/calc.py:"), problems
    assert "low imports fake.high" in problems[0]
    cycles = package_cycles(root)
    assert len(cycles) == 1 and cycles[0].startswith(
        "high -> low (fake/high/thing.py:1); low -> high (fake/low/calc.py:"
    )


def test_the_checker_passes_the_same_tree_going_down_and_excuses_a_known_violation(tmp_path: Path) -> None:
    root = _fake_tree(tmp_path, "VALUE = 1\n")
    assert layer_violations(root, FAKE_LAYERS) == [] and package_cycles(root) == []
    root = _fake_tree(tmp_path, UPWARD["inside a function"])
    known = {("fake.low.calc", "fake.high.thing"): "the fixture's own"}
    assert layer_violations(root, FAKE_LAYERS, known) == [] and package_cycles(root, known) == []


def test_the_checker_names_a_package_the_layers_do_not_place(tmp_path: Path) -> None:
    root = _fake_tree(tmp_path, "VALUE = 1\n")
    problems = layer_violations(root, (("low",),))
    assert problems == ["fake/high/thing.py:1: high has no place in LAYERS"]


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
