"""pydantic's errors said as a job file's author reads them: one line a mistake, at its path in the file
(`target.docker.imgae`), with the keys allowed there; the members and tags of a union (`int`, `range`) never
shown, and a typo said once, not once for each member it fails."""

from __future__ import annotations

import difflib
import types
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from tuner.config.schema import Job

__all__ = ["did_you_mean", "field_path", "format_validation_error"]


def field_path(loc: tuple[int | str, ...]) -> str:
    """`target.docker.env[0]`: a location in the job file as its author would write it."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "(top level)"


def _user_path(loc: tuple[int | str, ...], data: Any, missing: bool) -> tuple[int | str, ...]:
    """The part of pydantic's error location that is in the job file: the keys and indexes found in `data`.

    The rest are union members and tags (`int`, `range`, `tagged-union[...]`), which say nothing to a user and
    would split one mistake into several lines."""
    path: list[int | str] = []
    node = data
    for i, part in enumerate(loc):
        in_file = isinstance(node, dict) and part in node
        in_file = in_file or (isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node))
        if in_file:
            node = node[part]
        elif not (missing and i == len(loc) - 1):
            continue
        path.append(part)
    return tuple(path)


def _unwrap(tp: Any) -> Any:
    while get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    return tp


def _members(tp: Any) -> list[Any]:
    """A union's members, nested unions (a discriminated LengthDist inside `int | LengthDist`) flattened."""
    out: list[Any] = []
    for m in get_args(tp):
        if get_origin(_unwrap(m)) in (Union, types.UnionType):
            out += _members(_unwrap(m))
        elif m is not type(None):
            out.append(m)
    return out


def _member_matches(member: Any, part: int | str) -> bool:
    if get_origin(member) is Annotated and any(getattr(m, "tag", None) == part for m in get_args(member)[1:]):
        return True
    inner = _unwrap(member)
    if not (isinstance(inner, type) and issubclass(inner, BaseModel)):
        return False
    return inner.__name__ == part or any(f.default == part for f in inner.model_fields.values())


def _descend(tp: Any, part: int | str) -> Any:
    """The type found at `part` of pydantic's location inside `tp` (a model, dict, list or union)."""
    tp = _unwrap(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        field = tp.model_fields.get(str(part))
        return None if field is None else field.annotation
    origin, args = get_origin(tp), get_args(tp)
    if origin is dict:
        return args[1]
    if origin is list:
        return args[0]
    if origin in (Union, types.UnionType):
        members = _members(tp)
        matched = [m for m in members if _member_matches(m, part)]
        if matched:
            return matched[0]
        # Not a member's name: a field of the union's only model, or pydantic's name of an inner union.
        models = [m for m in members if isinstance(_unwrap(m), type) and issubclass(_unwrap(m), BaseModel)]
        return _descend(models[0], part) if len(models) == 1 and str(part) in _unwrap(models[0]).model_fields else tp
    return None


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str] | None:
    """The field names allowed where an unknown key was found, by walking the models along the path."""
    tp: Any = Job
    for part in loc[:-1]:
        tp = _descend(tp, part)
        if tp is None:
            return None
    tp = _unwrap(tp)
    if get_origin(tp) in (Union, types.UnionType):
        models = [_unwrap(m) for m in _members(tp) if isinstance(_unwrap(m), type)]
        tp = next((m for m in models if issubclass(m, BaseModel)), None)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return [k for k in tp.model_fields if k != "source"]
    return None


def did_you_mean(name: str, known: Any) -> str:
    """`; did you mean X?` when a known name is close to `name`, else nothing."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _message(err: Any) -> str:
    loc = tuple(err["loc"])
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc) or []
        listed = f"; allowed: {', '.join(allowed)}" if allowed else ""
        return "unknown field" + listed + did_you_mean(str(loc[-1]), allowed)
    if err["type"] == "missing":
        return "required field is missing"
    if err["type"] == "too_short" and loc and loc[-1] == "choices":
        return "choices must list at least one value"
    return str(err["msg"]).removeprefix("Value error, ")


def _is_type_error(err: Any) -> bool:
    return str(err["type"]).endswith(("_type", "_parsing")) or "union" in str(err["type"])


def _prune(groups: dict[tuple[int | str, ...], list[Any]]) -> None:
    """Drop what a union's other member explains better: `not an integer` beside the errors of the mapping given
    instead, and `high: missing` beside `hgih: unknown field` (the same typo, said once)."""
    for path in list(groups):
        deeper = any(p[: len(path)] == path and p != path for p in groups)
        if deeper and all(_is_type_error(x) for x in groups[path]):
            del groups[path]
    unknown = {p for p, errs in groups.items() if any(x["type"] == "extra_forbidden" for x in errs)}
    for path in list(groups):
        if path and all(x["type"] == "missing" for x in groups[path]):
            typos = [
                u for u in unknown if u[:-1] == path[:-1] and difflib.get_close_matches(str(u[-1]), [str(path[-1])])
            ]
            if typos:
                del groups[path]


def format_validation_error(e: ValidationError, where: str, data: Any = None) -> str:
    """One line per mistake: pydantic's errors grouped by the path in the file, unions' members merged."""
    groups: dict[tuple[int | str, ...], list[Any]] = {}
    for err in e.errors(include_url=False):
        loc = tuple(err["loc"])
        path = _user_path(loc, data, err["type"] == "missing") if data is not None else loc
        groups.setdefault(path, []).append(err)
    _prune(groups)
    lines = []
    for path, errs in groups.items():
        # Of a union's errors, one that is not "wrong type" says what is wrong with the value given (0 < 1).
        specific = [x for x in errs if not _is_type_error(x)]
        chosen = specific or errs
        msgs = list(dict.fromkeys(_message(x) for x in chosen))
        if len(msgs) > 1 and not specific:
            kinds = " or ".join(m.lower().removeprefix("input should be ") for m in msgs)
            msgs = [f"{chosen[0]['input']!r} is not allowed; expected {kinds}"]
        lines.append(f"{where}: {field_path(path)}: {'; '.join(msgs)}")
    return "\n".join(lines)
