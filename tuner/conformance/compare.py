"""Two recordings side by side: every difference one line, named `<part>.<where>: <what>`, so an allow-list can name
the ones that are meant (fnmatch patterns) and anything else fails with the line that says what moved."""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Mapping
from typing import Any

from tuner.conformance.shape import differences


def _stream(entry: dict[str, Any], many: bool) -> dict[str, Any]:
    if many and "chunks" in entry:
        # n > 1 interleaves the choices' chunks by timing: the kinds of chunk are the surface, not their order.
        unique = {json.dumps(c, sort_keys=True): c for c in entry["chunks"]}
        return {**entry, "chunks": [unique[k] for k in sorted(unique)]}
    return entry


def compare_http(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    out: list[str] = []
    exp_routes, act_routes = expected["routes"], actual["routes"]
    for path in sorted(exp_routes.keys() - act_routes.keys()):
        out.append(f"routes.{path}: not served")
    for path in sorted(act_routes.keys() - exp_routes.keys()):
        out.append(f"routes.{path}: served, vLLM has no such route")
    for path in sorted(exp_routes.keys() & act_routes.keys()):
        if exp_routes[path] != act_routes[path]:
            out.append(f"routes.{path}: methods {act_routes[path]}, expected {exp_routes[path]}")
    for name in sorted(expected["probes"].keys() | actual["probes"].keys()):
        if name not in actual["probes"] or name not in expected["probes"]:
            out.append(f"probes.{name}: only in the {'expected' if name in expected['probes'] else 'actual'} recording")
            continue
        sent = expected.get("requests", {}).get(name, {}).get("body")
        many = isinstance(sent, dict) and sent.get("n", 1) != 1
        e, a = _stream(expected["probes"][name], many), _stream(actual["probes"][name], many)
        out.extend(f"probes.{name}{d[1:]}" for d in differences(e, a))
    return out


def compare_metrics(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    exp, act = expected["families"], actual["families"]
    out = [f"metrics.{n}: missing ({exp[n]['type']})" for n in sorted(exp.keys() - act.keys())]
    out += [f"metrics.{n}: not in vLLM ({act[n]['type']})" for n in sorted(act.keys() - exp.keys())]
    for name in sorted(exp.keys() & act.keys()):
        out.extend(f"metrics.{name}{d[1:]}" for d in differences(exp[name], act[name]))
    return out


def compare_startup(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for part in ("lines", "failures"):
        for name in sorted(expected.get(part, {}).keys() | actual.get(part, {}).keys()):
            e, a = expected.get(part, {}).get(name), actual.get(part, {}).get(name)
            out.extend(f"startup.{part}.{name}{d[1:]}" for d in differences(e, a))
    return out


def unexplained(found: list[str], allowed: Mapping[str, str]) -> list[str]:
    """The differences no allow-list pattern covers."""
    return [d for d in found if not any(fnmatch.fnmatchcase(d, pattern) for pattern in allowed)]


def unused(found: list[str], allowed: Mapping[str, str]) -> list[str]:
    """Allow-list patterns that cover nothing any more: a difference fixed, or a fixture re-recorded."""
    return [p for p in allowed if not any(fnmatch.fnmatchcase(d, p) for d in found)]
