"""The runnable examples of the documentation pages, as tests/docs/test_docs_examples.py and scripts/docs-figures
read them.

The convention, said on docs/contributing/docs.md:
- a fenced block with a title, ```yaml title="job.yaml"```, is a file the page's reader writes: it is written into
  the page's working directory (a job file among them is checked with `tuner tune FILE --dry-run` unless a command
  of the page runs it);
- a ```console``` block's lines that start with `$ ` are commands, run in order in that directory after the files
  are written (a line ending in `\\` continues on the next); the other lines are the output the page shows. A
  command the page shows failing ends with `# exit N` (`# exit 0|1`: a verdict either way, such as `tuner verify`
  on an emulator sharing the machine's cores);
- any other block (```shell```, ```text```) is shown, not run: commands that need a GPU, Docker, Kubernetes or real
  vLLM, which the page says.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
_FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)(?P<attrs>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.S | re.M
)
_TITLE = re.compile(r'title="([^"]+)"')
_EXIT = re.compile(r"\s+# exit (\d+(?:\|\d+)*)\s*$")


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]  # `tuner` first, after any VAR=value words
    env: tuple[tuple[str, str], ...]
    exit_codes: tuple[int, ...]  # what the page says it exits with: 0 unless `# exit N` (or `# exit 0|1`)
    text: str

    @property
    def runs_a_study(self) -> bool:
        """Starts servers: `tuner tune` without --dry-run, `verify`, `plan --measure`, `bench` without --url."""
        args = self.argv[1:]
        if not args:
            return False
        if args[0] == "tune":
            return not {"--dry-run", "--check"} & set(args)
        return args[0] in {"verify", "bench", "calibrate"} or "--measure" in args


@dataclass
class PageExamples:
    page: Path
    files: dict[str, str] = field(default_factory=dict)
    commands: list[Command] = field(default_factory=list)

    @property
    def job_files(self) -> list[str]:
        return [
            name for name, text in self.files.items() if name.endswith(".yaml") and re.search(r"^study:", text, re.M)
        ]

    @property
    def slow(self) -> bool:
        return any(c.runs_a_study for c in self.commands)


def _commands(body: str) -> list[Command]:
    out: list[Command] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if not line.startswith("$ "):
            continue
        text = line[2:]
        while text.endswith("\\") and i < len(lines):
            text = text[:-1].rstrip() + " " + lines[i].strip()
            i += 1
        exit_codes = (0,)
        if m := _EXIT.search(text):
            exit_codes = tuple(int(code) for code in m.group(1).split("|"))
            text = text[: m.start()]
        words = shlex.split(text, comments=True)
        env = []
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            name, _, value = words.pop(0).partition("=")
            env.append((name, value))
        out.append(Command(tuple(words), tuple(env), exit_codes, text))
    return out


def page_examples(page: Path) -> PageExamples:
    examples = PageExamples(page)
    for m in _FENCE.finditer(page.read_text(encoding="utf-8")):
        body = "\n".join(line[len(m.group("indent")) :] for line in m.group("body").splitlines()) + "\n"
        if title := _TITLE.search(m.group("attrs")):
            examples.files[title.group(1)] = body
        elif m.group("lang") == "console":
            examples.commands.extend(_commands(body))
    return examples


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if "snippets" not in p.parts)


# The pages whose figures come from a run: scripts/docs-figures runs the page's commands in a fresh directory and
# writes what each printed into docs/snippets/ (one file for the page, or one a command when split), which the page
# includes; tests/docs/test_docs_examples.py holds each file to the page's current commands.
TRANSCRIPTS: dict[str, tuple[str, bool]] = {
    "guides/cost.md": ("cost", False),
    "guides/goodput.md": ("goodput", False),
    "guides/plan.md": ("plan", True),
    "guides/traces.md": ("traces", True),
}


def transcript_commands(page: PageExamples) -> list[Command]:
    """The commands a transcript shows: all but a study's own run, whose log is long (the views say what it found);
    a dry run is shown."""
    return [c for c in page.commands if not (c.argv[1:2] == ("tune",) and c.runs_a_study)]
