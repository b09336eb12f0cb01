"""JSON Lines as the job's files are read: one object a line, blank lines skipped, a broken line named by number."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tuner.errors import ConfigError

__all__ = ["json_lines"]


def json_lines(path: Path, text: str, what: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed value) of each non-blank line; a line that is not JSON is one ConfigError naming `what`
    (`trace`, `dataset`), the file and the line."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{what} {path}: line {lineno} is not JSON ({e.msg})") from None
