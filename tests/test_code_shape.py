"""The code's shape in lines: a function over LONG_FUNCTION_LINES lines outside the CLI is rare (at most
MAX_LONG_FUNCTIONS) and says why it is one piece in a `# one piece:` comment beside its `def` (CONTRIBUTING.md).
A command function (tuner/cli) is never over LONG_FUNCTION_LINES, its signature included: its options are Annotated
aliases (tuner/cli/options.py for those several commands share) and its work a function it calls."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import tuner

ROOT = Path(tuner.__file__).parent
LONG_FUNCTION_LINES = 60
MAX_LONG_FUNCTIONS = 5
REASON = "# one piece:"


@dataclass(frozen=True)
class LongFunction:
    path: str
    name: str
    line: int
    lines: int
    reason: str | None  # the `# one piece:` comment on the line before or after the `def` line

    def __str__(self) -> str:
        return f"{self.path}:{self.line} {self.name} ({self.lines} lines)"


def long_functions(root: Path, limit: int = LONG_FUNCTION_LINES) -> list[LongFunction]:
    """Every function and method under `root` (its `cli` package aside) longer than `limit` lines, decorators not
    counted, longest first."""
    found: list[LongFunction] = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        if relative.parts[0] == "cli":
            continue
        text = path.read_text()
        source = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length <= limit:
                continue
            beside = [source[i].strip() for i in (node.lineno - 2, node.lineno) if 0 <= i < len(source)]
            reason = next((line for line in beside if line.startswith(REASON)), None)
            found.append(LongFunction(relative.as_posix(), node.name, node.lineno, length, reason))
    return sorted(found, key=lambda f: -f.lines)


def test_few_functions_outside_the_cli_are_long() -> None:
    long = long_functions(ROOT)
    assert len(long) <= MAX_LONG_FUNCTIONS, (
        f"{len(long)} functions over {LONG_FUNCTION_LINES} lines outside tuner/cli (at most {MAX_LONG_FUNCTIONS}): "
        "split one into well-named parts\n" + "\n".join(map(str, long))
    )


def test_every_long_function_says_why_it_is_one_piece() -> None:
    unexplained = [f for f in long_functions(ROOT) if f.reason is None or not f.reason.removeprefix(REASON).strip()]
    assert not unexplained, (
        f"a function over {LONG_FUNCTION_LINES} lines needs a `{REASON} why` comment on the line before or after "
        "its def:\n" + "\n".join(map(str, unexplained))
    )


def _write(root: Path, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _function(name: str, body_lines: int, comment: str = "", indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    reason = f"{indent}{comment}" if comment else ""
    return f"{reason}{indent}def {name}() -> None:\n{body}"


def test_the_count_sees_long_functions_and_methods_and_skips_the_cli(tmp_path: Path) -> None:
    _write(tmp_path, "a.py", _function("short", 59) + "\n\n" + _function("long", 60))
    _write(tmp_path, "pkg/b.py", "class C:\n" + _function("method", 70, indent="    "))
    _write(tmp_path, "cli/c.py", _function("command", 100))
    found = {(f.path, f.name, f.lines) for f in long_functions(tmp_path)}
    assert found == {("a.py", "long", 61), ("pkg/b.py", "method", 71)}


def test_the_reason_is_read_beside_the_def_line_only(tmp_path: Path) -> None:
    _write(
        tmp_path,
        "a.py",
        _function("before", 61, comment="# one piece: a table\n")
        + "\n"
        + "def after() -> None:\n    # one piece: a parser\n"
        + "".join(f"    y{i} = {i}\n" for i in range(61))
        + "\n# one piece: too far\n\n"
        + _function("apart", 61),
    )
    reasons = {f.name: f.reason for f in long_functions(tmp_path)}
    assert reasons == {"before": "# one piece: a table", "after": "# one piece: a parser", "apart": None}


def long_commands(root: Path, limit: int = LONG_FUNCTION_LINES) -> list[LongFunction]:
    """Every command function (decorated `@<app>.command(...)`) under `root`'s `cli` package longer than `limit`
    lines, its signature included: a command parses its options and calls a function that does the work."""
    found: list[LongFunction] = []
    for path in sorted((root / "cli").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or not any(
                _is_command(d) for d in node.decorator_list
            ):
                continue
            length = (node.end_lineno or node.lineno) - node.lineno + 1
            if length > limit:
                found.append(LongFunction(path.relative_to(root).as_posix(), node.name, node.lineno, length, None))
    return sorted(found, key=lambda f: -f.lines)


def _is_command(decorator: ast.expr) -> bool:
    call = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(call, ast.Attribute) and call.attr == "command"


def test_no_command_function_is_long() -> None:
    long = long_commands(ROOT)
    assert not long, (
        f"a command function over {LONG_FUNCTION_LINES} lines: declare its options as Annotated aliases "
        "(tuner/cli/options.py for shared ones) and move its work into a function it calls\n"
        + "\n".join(map(str, long))
    )


def test_the_command_count_sees_decorated_commands_only(tmp_path: Path) -> None:
    _write(
        tmp_path, "cli/a.py", "@app.command('a')\n" + _function("a_cmd", 60) + "\n@app.command\n" + _function("b", 70)
    )
    _write(tmp_path, "cli/b.py", _function("helper", 100) + "\n@db_app.command('up')\n" + _function("up", 59))
    found = {(f.path, f.name, f.lines) for f in long_commands(tmp_path)}
    assert found == {("cli/a.py", "a_cmd", 61), ("cli/a.py", "b", 71)}
