"""Start-up log lines reduced to their shape: which process wrote them, at what level, from which source file, and
the sentence with its figures masked.

vLLM prefixes every line with its writer (`(EngineCore pid=41) INFO 12-04 02:31:03 [kv_cache_utils.py:2327] ...`,
vllm/logging_utils/formatter.py); pids, dates, source line numbers and figures change from run to run and release to
release, the rest is what the launchers parse (tuner/launch/startup_log.py) and what the emulator imitates.
"""

from __future__ import annotations

import re
from typing import Any

from tuner.launch.failures import find_cause
from tuner.launch.startup_log import STARTUP_LINES

_PREFIX = re.compile(
    r"^\((?P<writer>[\w-]+) pid=\d+\) (?P<level>[A-Z]+) \d\d-\d\d \d\d:\d\d:\d\d "
    r"\[(?P<source>[\w.]+?)(?::\d+)?\] (?P<text>.*)$"
)
_FIGURE = re.compile(r"\d[\d,]*(?:\.\d+)?")
_ANSI = re.compile(r"\x1b\[[\d;]*m")


def mask(text: str) -> str:
    """The sentence with every figure as <n>: the wording, not the values."""
    return _FIGURE.sub("<n>", _ANSI.sub("", text)).rstrip()


def line_shape(line: str) -> dict[str, str]:
    m = _PREFIX.match(_ANSI.sub("", line))
    if m is None:
        return {"writer": "", "level": "", "source": "", "text": mask(line)}
    return {"writer": m["writer"], "level": m["level"], "source": m["source"], "text": mask(m["text"])}


def startup_lines(log: str) -> dict[str, dict[str, str] | None]:
    """For each fact the launchers read, the shape of the line it is read from (None: the log has no such line)."""
    lines = log.splitlines()
    out: dict[str, dict[str, str] | None] = {}
    for fact, pattern in STARTUP_LINES.items():
        found = next((line for line in lines if pattern.search(line)), None)
        out[fact] = line_shape(found) if found is not None else None
    return out


def failure_shape(log: str, exit_code: int | None) -> dict[str, Any]:
    """A refused start: its exit code, the reason the launchers classify, and vLLM's sentence (verbatim and masked)."""
    cause = find_cause(log)
    return {
        "exit_code": exit_code,
        "reason": cause.reason if cause else None,
        "message": mask(cause.message) if cause else None,
        "verbatim": cause.message if cause else None,
    }
