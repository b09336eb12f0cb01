"""A JSON value reduced to its shape: what a client may rely on, without what changes from run to run.

Kept verbatim: the values a client branches on (`object`, `finish_reason`, an error's `type`, `param`, `code` and
`message`, ...) and whatever the caller names as stable for its probe (usage counts of a token-id prompt). Replaced by
their type (`"<str>"`, `"<int>"`, `"<float>"`, `"<bool>"`): ids, timestamps, generated text. `None` stays `None`:
whether a field is null is part of the surface (`"usage": null` in every completion chunk).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

Shape = Any  # a JSON value: dict, list, str, int, float, bool or None

# Keys whose values are the same on every run of a probe and that clients read.
STABLE_KEYS = frozenset({"object", "finish_reason", "stop_reason", "role", "owned_by", "type", "param", "code"})


def shape_of(value: Any, keep: Iterable[str] = (), *, key: str = "", path: str = "") -> Shape:
    """The shape of `value`; keys in STABLE_KEYS or `keep` (bare names or dotted paths) keep their scalar value."""
    kept = frozenset(keep)
    return _shape(value, kept, key, path)


def _shape(value: Any, keep: frozenset[str], key: str, path: str) -> Shape:
    if isinstance(value, dict):
        return {k: _shape(v, keep, k, f"{path}.{k}" if path else k) for k, v in sorted(value.items())}
    if isinstance(value, list):
        shapes = [_shape(v, keep, key, f"{path}[]") for v in value]
        unique: dict[str, Shape] = {}
        for s in shapes:  # a list of alike elements is one element's shape; order of first appearance
            unique.setdefault(json.dumps(s, sort_keys=True), s)
        return list(unique.values())
    if value is None:
        return None
    if key in STABLE_KEYS or key in keep or path in keep:
        return value
    if isinstance(value, bool):
        return "<bool>"
    if isinstance(value, int):
        return "<int>"
    if isinstance(value, float):
        return "<float>"
    return "<str>"


def collapse(shapes: list[Shape]) -> list[Shape]:
    """A stream's chunk shapes with runs of one shape kept once: how many tokens a chunk carries is the engine's
    timing (a slow reader gets several tokens merged), the order of the kinds of chunk is the surface."""
    out: list[Shape] = []
    for s in shapes:
        if not out or out[-1] != s:
            out.append(s)
    return out


def differences(expected: Shape, actual: Shape, path: str = "$") -> list[str]:
    """Where `actual` departs from `expected`, one line a difference, each naming its JSON path."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out: list[str] = []
        for k in sorted(expected.keys() - actual.keys()):
            out.append(f"{path}.{k}: missing (expected {_short(expected[k])})")
        for k in sorted(actual.keys() - expected.keys()):
            out.append(f"{path}.{k}: unexpected (got {_short(actual[k])})")
        for k in sorted(expected.keys() & actual.keys()):
            out.extend(differences(expected[k], actual[k], f"{path}.{k}"))
        return out
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{path}: {len(actual)} element shape(s), expected {len(expected)}: {_short(actual)}"]
        return [
            d for i, (e, a) in enumerate(zip(expected, actual, strict=True)) for d in differences(e, a, f"{path}[{i}]")
        ]
    if expected != actual or type(expected) is not type(actual):
        return [f"{path}: got {_short(actual)}, expected {_short(expected)}"]
    return []


def _short(value: Shape) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 160 else text[:157] + "..."
