"""CONTRIBUTING.md kept true: every module under tuner/ is on its map ("Where things are"), by its path or by name
in its package's entry, every file a "how to add or change X" section names exists, and each "to add X" recipe's
first steps name the files its registry's newest entry stands in (the last such addition touched them). Each rule is
itself tested on a small made-up CONTRIBUTING text where it fails."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import tuner

ROOT = Path(tuner.__file__).parent
REPO = ROOT.parent
CONTRIBUTING = REPO / "CONTRIBUTING.md"
MAP_HEADING = "## Where things are"
# An entry's first line: four spaces, then its path under tuner/ (a module or a package, which ends in /).
_ENTRY = re.compile(r"^ {4}(tuner/\S*)(.*)$")
# A file a section names: `tuner/...` or `tests/...` (a template such as `tuner/launch/<kind>.py` is not a file).
_NAMED_FILE = re.compile(r"`((?:tuner|tests)/[^`<>*\s]+\.py)`")
_HOW_TO = re.compile(r"^## ((?:Adding|Changing) .*)$")


@dataclass(frozen=True)
class MapEntry:
    path: str  # "tuner/config/" or "tuner/record.py"
    text: str  # what the map says of it, its lines joined


def map_entries(contributing: str) -> list[MapEntry]:
    """The map's entries in order: each path with its text, continuation lines joined."""
    lines = contributing.split(MAP_HEADING, 1)[1].splitlines()[1:]
    entries: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.strip() and not line.startswith("    "):
            break  # the map is the indented block under its heading
        match = _ENTRY.match(line)
        if match is not None:
            entries.append((match.group(1), [match.group(2)]))
        elif entries and line.strip():
            entries[-1][1].append(line)
    return [MapEntry(path, " ".join(" ".join(text).split())) for path, text in entries]


def _names(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w/.]){re.escape(name)}(?:\.py)?(?![\w])", text) is not None


def unmapped(contributing: str, modules: Iterable[str]) -> list[str]:
    """What to add for each module (a path under tuner/, "tuner/study/run.py") the map does not name. A module is
    named by its path anywhere on the map, or by its name in the entry of its package; a package's __init__.py
    with its package; a sub-package named in its package's entry (tuner/store/'s `migrations`) covers what it holds.
    """
    entries = map_entries(contributing)
    whole = " ".join(f"{e.path} {e.text}" for e in entries)
    by_path = {e.path: e for e in entries}
    missing = []
    for module in sorted(modules):
        if _names(whole, module):
            continue
        parts = module.split("/")
        if _named_within(parts, by_path, whole):
            continue
        package = "/".join(parts[:-1]) + "/"
        stem = parts[-1].removesuffix(".py")
        if package == "tuner/":
            missing.append(f"{module}: add its own line `    {module}  <what it holds>` to {MAP_HEADING!r}")
        elif package in by_path:
            missing.append(f"{module}: name `{stem}` (what it holds) in the `{package}` entry of {MAP_HEADING!r}")
        else:
            missing.append(
                f"{module}: add a `{package}` entry naming `{stem}` to {MAP_HEADING!r} (or its path on a line)"
            )
    return missing


def _named_within(parts: list[str], by_path: dict[str, MapEntry], whole: str) -> bool:
    """Named through a package: `__init__.py` by its package's path or name, a deeper module by the first
    directory below a package entry that names it."""
    if parts[-1] == "__init__.py":
        package = "/".join(parts[:-1]) + "/"
        parent = "/".join(parts[:-2]) + "/"
        return (
            package in by_path or package == "tuner/" or _names(by_path.get(parent, MapEntry("", "")).text, parts[-2])
        )
    stem = parts[-1].removesuffix(".py")
    for depth in range(len(parts) - 1, 0, -1):
        package = "/".join(parts[:depth]) + "/"
        entry = by_path.get(package)
        if entry is None:
            continue
        below = parts[depth] if depth < len(parts) - 1 else stem
        return _names(entry.text, below)
    return False


def how_to_sections(contributing: str) -> dict[str, str]:
    """Each "## Adding ..." / "## Changing ..." section's heading and text."""
    sections: dict[str, str] = {}
    current: str | None = None
    for line in contributing.splitlines():
        heading = _HOW_TO.match(line)
        if heading is not None:
            current = heading.group(1)
            sections[current] = ""
        elif line.startswith("## "):
            current = None
        elif current is not None:
            sections[current] += line + "\n"
    return sections


def missing_files(contributing: str, exists: Callable[[str], bool]) -> list[str]:
    """Each file a how-to section names that is not there, as "section: path"."""
    return [
        f"{heading!r} names {path}, which does not exist: name the file that holds it now"
        for heading, text in how_to_sections(contributing).items()
        for path in dict.fromkeys(_NAMED_FILE.findall(text))
        if not exists(path)
    ]


def tuner_modules() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for p in ROOT.rglob("*.py"))


def test_every_module_is_on_the_map() -> None:
    missing = unmapped(CONTRIBUTING.read_text(), tuner_modules())
    assert not missing, "CONTRIBUTING.md's map misses modules:\n" + "\n".join(missing)


def test_every_file_a_how_to_names_exists() -> None:
    missing = missing_files(CONTRIBUTING.read_text(), lambda path: (REPO / path).is_file())
    assert not missing, "\n".join(missing)


def test_the_how_to_sections_are_found() -> None:
    sections = how_to_sections(CONTRIBUTING.read_text())
    assert {"Adding a sampler", "Adding an export format"} <= {h.split(" (")[0] for h in sections}, sorted(sections)
    assert all(_NAMED_FILE.search(text) for text in sections.values()), "a how-to section names no file"


FAKE = """# Contributing

## Where things are

    tuner/config/            the job file: schema (the models), loader (YAML in, Job out)
    tuner/record.py          the trial record
    tuner/store/             the tables: models, migrations (Alembic's
                             revisions)

## Adding a sampler (2 files)

1. `tuner/study/samplers.py`: a factory.
2. `tuner/config/schema.py`: its name; `tuner/launch/<kind>.py` is a template.

## Layers

`tuner/nowhere.py` is outside any how-to section.
"""


def test_the_map_rule_fails_on_a_module_it_does_not_name() -> None:
    named = [
        "tuner/__init__.py",
        "tuner/record.py",
        "tuner/config/__init__.py",
        "tuner/config/schema.py",
        "tuner/config/loader.py",
        "tuner/store/models.py",
        "tuner/store/migrations/env.py",
        "tuner/store/migrations/versions/0001_initial.py",
    ]
    assert unmapped(FAKE, named) == []
    assert unmapped(FAKE, [*named, "tuner/config/checks.py", "tuner/journal.py", "tuner/twin/residual.py"]) == [
        f"tuner/config/checks.py: name `checks` (what it holds) in the `tuner/config/` entry of {MAP_HEADING!r}",
        f"tuner/journal.py: add its own line `    tuner/journal.py  <what it holds>` to {MAP_HEADING!r}",
        f"tuner/twin/residual.py: add a `tuner/twin/` entry naming `residual` to {MAP_HEADING!r} (or its path on a "
        "line)",
    ]
    # a word inside another ("models" in "the models") still names; a prefix of a path does not
    assert unmapped(FAKE, ["tuner/config/sch.py"]) != []


def test_the_how_to_rule_fails_on_a_file_that_is_gone() -> None:
    present = {"tuner/study/samplers.py", "tuner/config/schema.py"}
    assert missing_files(FAKE, present.__contains__) == []
    assert missing_files(FAKE, {"tuner/study/samplers.py"}.__contains__) == [
        "'Adding a sampler (2 files)' names tuner/config/schema.py, which does not exist: name the file that holds "
        "it now"
    ]


# Where each "how to add" recipe's additions are registered, and how an entry reads there (entries are appended, so
# the last one is the newest addition). The files the recipe's first steps name must each hold that entry's name:
# a recipe that names a file the last addition did not touch (the registry moved, a step went stale) fails.
REGISTRIES = {
    "Adding a metric": ("tuner/scoring.py", r'\bMetric\(\s*"([\w-]+)"'),
    "Adding a launcher kind": ("tuner/launch/factory.py", r'\bLauncherKind\(\s*"([\w-]+)"'),
    "Adding a sampler": ("tuner/study/samplers.py", r'@sampler\("([\w-]+)"\)'),
    "Adding an export format": ("tuner/export.py", r'@export_format\("([\w-]+)"\)'),
}
# A step: a line that opens with the file it touches, numbered (`1. \`tuner/x.py\`:`) or not (`\`tuner/x.py\`:`).
_STEP_FILE = re.compile(r"^(?:\d+\. )?`((?:tuner|tests)/[^`*\s]+\.py)`")


def first_steps(section: str) -> list[str]:
    """The files the first paragraph of steps in a how-to section opens with: what every addition touches (a later
    paragraph's steps are the ones some additions need, "in addition")."""
    for paragraph in section.split("\n\n"):
        files = [m.group(1) for line in paragraph.splitlines() if (m := _STEP_FILE.match(line)) is not None]
        if files:
            return files
    return []


def stale_recipes(
    contributing: str, registries: dict[str, tuple[str, str]], read: Callable[[str], str | None]
) -> list[str]:
    """Each file a recipe's first steps name that does not hold the newest entry of its registry (a template such
    as `tuner/launch/<kind>.py` read with that entry's name), as a line saying which."""
    sections = {heading.split(" (")[0]: text for heading, text in how_to_sections(contributing).items()}
    out = []
    for heading, (registry, entry) in registries.items():
        if heading not in sections:
            out.append(f"{heading!r}: no such section in CONTRIBUTING.md")
            continue
        names = re.findall(entry, read(registry) or "")
        if not names:
            out.append(f"{heading!r}: {registry} registers nothing as {entry!r}")
            continue
        newest = names[-1]
        for path in first_steps(sections[heading]):
            path = re.sub(r"<\w+>", newest, path)
            text = read(path)
            if text is None or re.search(rf"\b{re.escape(newest)}\b", text) is None:
                out.append(f"{heading!r} names {path}, which the newest addition ({newest!r}) did not touch")
    return out


def _read(path: str) -> str | None:
    file = REPO / path
    return file.read_text() if file.is_file() else None


def test_each_recipe_names_the_files_its_last_addition_touched() -> None:
    assert stale_recipes(CONTRIBUTING.read_text(), REGISTRIES, _read) == []
    # every recipe is checked: its first steps name at least its registry
    steps = {h.split(" (")[0]: first_steps(t) for h, t in how_to_sections(CONTRIBUTING.read_text()).items()}
    assert all(registry in steps[h] for h, (registry, _) in REGISTRIES.items()), steps


RECIPES = """# Contributing

## Adding a sampler (2 files)

1. `tuner/study/samplers.py`: a factory.
2. `tuner/config/schema.py`: its name.

`tests/study/test_sampler_contract.py` runs it.

## Adding a launcher kind (2 files)

1. `tuner/launch/<kind>.py`: the launcher.
2. `tuner/launch/factory.py`: its entry.
"""
_FAKE_REGISTRIES = {
    "Adding a sampler": ("tuner/study/samplers.py", r'@sampler\("([\w-]+)"\)'),
    "Adding a launcher kind": ("tuner/launch/factory.py", r'\bLauncherKind\(\s*"([\w-]+)"'),
}


def test_the_recipe_rule_fails_on_a_step_the_last_addition_did_not_touch() -> None:
    files = {
        "tuner/study/samplers.py": '@sampler("tpe")\n...\n@sampler("twin")\n',
        "tuner/config/schema.py": 'SamplerName = Literal["tpe", "twin"]\n',
        "tuner/launch/factory.py": 'LauncherKind(\n    "emulator", ...),\nLauncherKind("docker", ...)\n',
        "tuner/launch/docker.py": "class DockerLauncher:  # docker run\n",
    }
    assert first_steps(how_to_sections(RECIPES)["Adding a sampler (2 files)"]) == [
        "tuner/study/samplers.py",
        "tuner/config/schema.py",
    ]
    assert stale_recipes(RECIPES, _FAKE_REGISTRIES, files.get) == []
    # the newest sampler's name is not where the recipe says it goes; the newest kind has no module of its own
    broken = files | {"tuner/config/schema.py": 'SamplerName = Literal["tpe"]\n'}
    del broken["tuner/launch/docker.py"]
    assert stale_recipes(RECIPES, _FAKE_REGISTRIES, broken.get) == [
        "'Adding a sampler' names tuner/config/schema.py, which the newest addition ('twin') did not touch",
        "'Adding a launcher kind' names tuner/launch/docker.py, which the newest addition ('docker') did not touch",
    ]
    # a registry that registers nothing under the pattern (it moved, or the pattern went stale) is said, not passed
    assert stale_recipes(RECIPES, _FAKE_REGISTRIES, lambda _: None) == [
        f"'Adding a sampler': tuner/study/samplers.py registers nothing as {_FAKE_REGISTRIES['Adding a sampler'][1]!r}",
        "'Adding a launcher kind': tuner/launch/factory.py registers nothing as "
        f"{_FAKE_REGISTRIES['Adding a launcher kind'][1]!r}",
    ]
