"""Production request logs read as timed requests: Mooncake JSONL, Azure LLM inference CSV, BurstGPT CSV, or a
plain JSONL of {t, input_len, output_len}.

A trace's times are seconds from its first request (whatever the file's own origin: Mooncake's milliseconds from
zero, Azure's wall-clock datetimes, BurstGPT's seconds). Every row that cannot be read is one ConfigError naming
the file and the line; an unsorted file is sorted and says so in `Trace.note`.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, get_args

from tuner.errors import ConfigError
from tuner.load.jsonl import json_lines

__all__ = ["TRACE_FORMATS", "Trace", "TraceFormat", "TraceRequest", "load_trace"]

TraceFormat = Literal["auto", "mooncake", "azure", "burstgpt", "jsonl"]
TRACE_FORMATS: tuple[str, ...] = tuple(f for f in get_args(TraceFormat) if f != "auto")


@dataclass(frozen=True)
class TraceRequest:
    t_s: float
    """Seconds from the trace's first request."""
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()
    """Mooncake's prompt blocks: requests sharing an id share that block of prompt text."""


@dataclass(frozen=True)
class Trace:
    path: Path
    format: str
    requests: tuple[TraceRequest, ...]
    note: str | None = None
    """Said once to the user: the file was not in time order and was sorted."""


@dataclass(frozen=True)
class _Row:
    line: int
    t: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


class _BadRow(Exception):
    """What is wrong with one row; the reader adds the file and the line."""


_cache: dict[tuple[str, str, float, int], Trace] = {}


def load_trace(path: Path, fmt: TraceFormat = "auto") -> Trace:
    """The trace in `path` (cached by file identity); ConfigError, one line naming the file and line, otherwise."""
    try:
        st = path.stat()
    except OSError as e:
        raise ConfigError(f"trace {path}: cannot read it ({e.strerror})") from None
    key = (str(path.resolve()), fmt, st.st_mtime, st.st_size)
    if key not in _cache:
        _cache[key] = _read(path, fmt)
    return _cache[key]


def _read(path: Path, fmt: TraceFormat) -> Trace:
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise ConfigError(f"trace {path}: the file is empty")
    name = _detect(path, first) if fmt == "auto" else fmt
    reader = _READERS[name]
    rows = list(reader(path, text))
    if not rows:
        raise ConfigError(f"trace {path}: no requests in it")
    note = None
    if any(b.t < a.t for a, b in itertools.pairwise(rows)):
        rows.sort(key=lambda r: (r.t, r.line))
        note = f"trace {path}: its rows were not in time order; sorted by time"
    origin = rows[0].t
    requests = tuple(TraceRequest(r.t - origin, r.input_len, r.output_len, r.hash_ids) for r in rows)
    return Trace(path=path, format=name, requests=requests, note=note)


def _detect(path: Path, first: str) -> str:
    """The format from the first line: a JSON object's keys, or a CSV header's column names."""
    head = first.strip()
    if head.startswith("{"):
        try:
            keys = set(json.loads(head))
        except (json.JSONDecodeError, TypeError):
            raise ConfigError(f"trace {path}: line 1 is not a JSON object") from None
        if "timestamp" in keys and "input_length" in keys:
            return "mooncake"
        if "t" in keys and "input_len" in keys:
            return "jsonl"
    else:
        columns = {c.strip() for c in next(csv.reader([head]))}
        if "TIMESTAMP" in columns and "ContextTokens" in columns:
            return "azure"
        if "Timestamp" in columns and "Request tokens" in columns:
            return "burstgpt"
    raise ConfigError(
        f"trace {path}: cannot tell its format from line 1; give arrival.format: one of {', '.join(TRACE_FORMATS)} "
        "(Mooncake JSONL {timestamp, input_length, output_length, hash_ids}, Azure CSV {TIMESTAMP, ContextTokens, "
        "GeneratedTokens}, BurstGPT CSV {Timestamp, Request tokens, Response tokens}, JSONL {t, input_len, output_len})"
    )


def _json_rows(
    path: Path, text: str, row: Callable[[dict[str, Any]], tuple[float, int, int, tuple[int, ...]]]
) -> Iterator[_Row]:
    for lineno, item in json_lines(path, text, "trace"):
        if not isinstance(item, dict):
            raise ConfigError(f"trace {path}: line {lineno} is not a JSON object")
        try:
            t, n_in, n_out, ids = row(item)
        except _BadRow as e:
            raise ConfigError(f"trace {path}: line {lineno}: {e}") from None
        yield _Row(lineno, t, n_in, n_out, ids)


def _csv_rows(path: Path, text: str, row: Callable[[dict[str, str]], tuple[float, int, int]]) -> Iterator[_Row]:
    reader = csv.DictReader(io.StringIO(text))
    for item in reader:
        # the header is line 1; a quoted field holding a newline is not in these formats
        lineno = reader.line_num
        try:
            t, n_in, n_out = row({k.strip(): v for k, v in item.items() if k is not None})
        except _BadRow as e:
            raise ConfigError(f"trace {path}: line {lineno}: {e}") from None
        yield _Row(lineno, t, n_in, n_out)


def _field(item: dict[str, Any], key: str) -> Any:
    value = item.get(key)
    if value is None or value == "":
        raise _BadRow(f"no '{key}'")
    return value


def _time(item: dict[str, Any], key: str, unit: float = 1.0) -> float:
    value = _field(item, key)
    try:
        t = float(value) * unit
    except (TypeError, ValueError):
        raise _BadRow(f"'{key}' is {value!r}, not a number") from None
    if not math.isfinite(t) or t < 0:
        raise _BadRow(f"'{key}' is {value!r}; a time is a number >= 0")
    return t


def _length(item: dict[str, Any], key: str) -> int:
    value = _field(item, key)
    try:
        n = float(value)
    except (TypeError, ValueError):
        raise _BadRow(f"'{key}' is {value!r}, not a number of tokens") from None
    if not math.isfinite(n) or n < 0 or n != int(n):
        raise _BadRow(f"'{key}' is {value!r}; a length is a whole number of tokens >= 0")
    # A request needs one token each way: a logged 0 (BurstGPT's failed responses) is sent as 1.
    return max(1, int(n))


def _mooncake(item: dict[str, Any]) -> tuple[float, int, int, tuple[int, ...]]:
    ids = item.get("hash_ids", [])
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise _BadRow("'hash_ids' is not a list of integers")
    return _time(item, "timestamp", 1e-3), _length(item, "input_length"), _length(item, "output_length"), tuple(ids)


def _plain(item: dict[str, Any]) -> tuple[float, int, int, tuple[int, ...]]:
    return _time(item, "t"), _length(item, "input_len"), _length(item, "output_len"), ()


def _azure(item: dict[str, str]) -> tuple[float, int, int]:
    value = _field(item, "TIMESTAMP")
    try:
        stamp = datetime.fromisoformat(value.strip())
    except ValueError:
        raise _BadRow(f"'TIMESTAMP' is {value!r}, not a date and time (2023-11-16 18:15:46.680)") from None
    # A naive time is read as UTC, not local time: a daylight-saving change must not shift the trace by an hour.
    t = (stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)).timestamp()
    return t, _length(item, "ContextTokens"), _length(item, "GeneratedTokens")


def _burstgpt(item: dict[str, str]) -> tuple[float, int, int]:
    return _time(item, "Timestamp"), _length(item, "Request tokens"), _length(item, "Response tokens")


_READERS: dict[str, Callable[[Path, str], Iterator[_Row]]] = {
    "mooncake": lambda p, text: _json_rows(p, text, _mooncake),
    "jsonl": lambda p, text: _json_rows(p, text, _plain),
    "azure": lambda p, text: _csv_rows(p, text, _azure),
    "burstgpt": lambda p, text: _csv_rows(p, text, _burstgpt),
}
