"""`tuner --help` and every command's --help read as prose at 80 and 100 columns: a summary is whole, no line breaks
where the source's docstring did (mid-sentence, well short of the width), and no line runs past the width."""

from __future__ import annotations

import itertools
import re

import pytest
import typer
from typer.core import TyperGroup
from typer.testing import CliRunner

from tuner.cli import app

WIDTHS = (80, 100)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")  # a CI that forces colour gets Rich's escapes; the text is what is checked


def render(args: list[str], width: int) -> str:
    result = CliRunner().invoke(app, args, env={"COLUMNS": str(width)})
    assert result.exit_code == 0, result.output
    return _ANSI.sub("", result.output)


def command_paths() -> list[list[str]]:
    """Every command and group under `tuner`, as the arguments that reach it."""
    paths: list[list[str]] = []

    def walk(group: TyperGroup, prefix: list[str]) -> None:
        for name, command in group.commands.items():
            paths.append([*prefix, name])
            if isinstance(command, TyperGroup):
                walk(command, [*prefix, name])

    root = typer.main.get_command(app)
    assert isinstance(root, TyperGroup)
    walk(root, [])
    return paths


def command_rows(text: str) -> dict[str, list[str]]:
    """The Commands panel of a group's --help: each command's summary, as the lines it renders on."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("╭─ Commands"))
    rows: dict[str, list[str]] = {}
    name = ""
    for line in lines[start + 1 :]:
        if line.startswith("╰"):
            break
        inner = line[2:-2]  # inside "│ " and " │"
        if not inner.startswith(" "):
            name = inner.split()[0]
            rows[name] = [inner[len(name) :].strip()]
        else:
            rows[name].append(inner.strip())
    return rows


def premature_breaks(lines: list[str], room: int) -> list[str]:
    """Lines that end although the next word would have fitted after them: a hard break in the source, not a wrap."""
    return [
        f"{line!r} | {after!r}"
        for line, after in itertools.pairwise(lines)
        if line and after and len(line) + 1 + len(after.split()[0]) <= room
    ]


@pytest.mark.parametrize("width", WIDTHS)
def test_every_summary_in_the_command_list_is_whole(width: int) -> None:
    rows = command_rows(render(["--help"], width))
    assert {"studies", "status", "trials", "pareto", "show", "export", "rescore", "tune", "verify"} <= set(rows)
    # The widest summary line shows the room Rich had (it fills lines up to it); a break with room to spare is one
    # the docstring made.
    room = max(len(line) for lines in rows.values() for line in lines)
    for name, lines in rows.items():
        assert " ".join(lines).endswith("."), f"{name}'s summary is cut: {' '.join(lines)!r}"
        broken = premature_breaks(lines, room)
        assert not broken, f"{name}'s summary breaks mid-sentence: {broken}"


# `tuner emulate --help` is the emulator's own argparse help (vLLM's flags), not Typer's: the emulator lays it out.
TYPER_COMMANDS = [[], *(p for p in command_paths() if p != ["emulate"])]


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("path", TYPER_COMMANDS, ids=lambda path: " ".join(path) or "tuner")
def test_every_command_help_reads_as_prose_within_the_width(path: list[str], width: int) -> None:
    text = render([*path, "--help"], width)
    too_long = [line for line in text.splitlines() if len(line) > width]
    assert not too_long, f"{' '.join(['tuner', *path])} --help runs past {width} columns: {too_long}"
    # The prose between the usage line and the first panel, a paragraph at a time (Rich pads it a column each side).
    lines = text.splitlines()
    prose = lines[next(i for i, line in enumerate(lines) if "Usage:" in line) + 1 :]
    prose = prose[: next((i for i, line in enumerate(prose) if line.startswith("╭")), len(prose))]
    paragraphs = "\n".join(line.strip() for line in prose).split("\n\n")
    for paragraph in paragraphs:
        broken = premature_breaks(paragraph.strip().splitlines(), width - 2)
        assert not broken, f"{' '.join(['tuner', *path])} --help breaks mid-sentence at {width} columns: {broken}"


def test_the_emulators_own_help_reads_whole_in_80_columns() -> None:
    text = render(["emulate", "--help"], 80)
    too_long = [line for line in text.splitlines() if len(line) > 80]
    assert not too_long, f"tuner emulate --help runs past 80 columns: {too_long}"
    assert "--max-num-seqs" in text and "example:" in text


def test_the_dry_run_of_the_demo_job_reads_one_line_per_thing_in_80_columns() -> None:
    """Each searched flag's range in words and the baseline's verdict on a line of its own: no line of the dry run
    is wrapped by the terminal, so none runs past 80 characters before Rich sees it."""
    from pathlib import Path

    job = Path(__file__).resolve().parents[2] / "search_spaces" / "emulator-demo.yaml"
    text = render(["tune", "--dry-run", str(job)], 200)
    lines = text.splitlines()
    assert "Distribution(" not in text
    assert "  gpu_memory_utilization: 0.86 to 0.98, step 0.04" in lines
    assert any(line.startswith("  max_num_seqs: one of 16, 32") for line in lines)
    too_long = [line for line in lines if len(line) > 80 and not line.startswith("storage:")]
    assert not too_long, f"the dry run runs past 80 columns: {too_long}"


@pytest.mark.parametrize("path", TYPER_COMMANDS, ids=lambda path: " ".join(path) or "tuner")
def test_a_switch_shows_no_value(path: list[str]) -> None:
    """`--dry-run` takes no value: its row names no type, as `--storage <str>`'s does."""
    text = render([*path, "--help"], 120)
    assert "<bool>" not in text
    if path == ["tune"]:
        row = next(line for line in text.splitlines() if line.startswith("│ --dry-run"))
        assert re.search(r"--dry-run\s+check the job", row), row
        assert re.search(r"--storage\s+<str>", text)
